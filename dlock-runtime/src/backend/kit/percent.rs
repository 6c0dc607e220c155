//! `%xx` escapes of URLs, decoded one way for every backend that reads a
//! URL (and for the inspector's `file://` paths).
//!
//! A user name or password in a URL is percent-encoded when it holds a
//! character the URL syntax reserves (`redis://app:p%40ss@host` has the
//! password `p@ss`). Decode it with [`decode`] before handing it to a
//! client that takes it apart from the URL, and scrub every form it could
//! take ([`decode_lossy`] and the text as written) from messages.

/// `text` with its `%xx` escapes decoded; `None` for a bad escape or a
/// result that is not UTF-8 (where a wrong guess would name the wrong
/// user, password or directory).
///
/// ```
/// use dlock_runtime::backend::kit::percent::decode;
///
/// assert_eq!(decode("p%40ss%20word").as_deref(), Some("p@ss word"));
/// assert_eq!(decode("50%"), None); // not an escape: refused, not guessed
/// ```
pub fn decode(text: &str) -> Option<String> {
    String::from_utf8(decode_bytes(text, true)?).ok()
}

/// `text` with its well-formed `%xx` escapes decoded and any other `%`
/// kept, non-UTF-8 bytes replaced: every form a secret could take in a
/// message, to scrub it from there.
///
/// ```
/// use dlock_runtime::backend::kit::percent::decode_lossy;
///
/// assert_eq!(decode_lossy("p%40ss"), "p@ss");
/// assert_eq!(decode_lossy("50%"), "50%");
/// ```
pub fn decode_lossy(text: &str) -> String {
    let bytes = decode_bytes(text, false).unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The bytes of `text` decoded; a bad escape is `None` if `strict`, else
/// kept as written.
fn decode_bytes(text: &str, strict: bool) -> Option<Vec<u8>> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            // Two hex digits, no sign (`from_str_radix` alone takes `+f`).
            let hex = text
                .get(i + 1..i + 3)
                .filter(|hex| hex.bytes().all(|b| b.is_ascii_hexdigit()))
                .and_then(|hex| u8::from_str_radix(hex, 16).ok());
            match hex {
                Some(byte) => {
                    out.push(byte);
                    i += 3;
                    continue;
                }
                None if strict => return None,
                None => {}
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::decode;

    #[test]
    fn decode_takes_escapes_and_refuses_bad_ones_and_non_utf8() {
        assert_eq!(
            decode("s3cret%20pass%27word").as_deref(),
            Some("s3cret pass'word")
        );
        assert_eq!(decode("/var/lib/dlock").as_deref(), Some("/var/lib/dlock"));
        assert_eq!(decode("a%2"), None);
        assert_eq!(decode("a%zz"), None);
        assert_eq!(decode("%ff"), None);
        assert_eq!(decode("%+f"), None);
        assert_eq!(decode("%C3%A9").as_deref(), Some("é"));
    }

    #[test]
    fn decode_lossy_keeps_what_it_cannot_decode() {
        use super::decode_lossy;
        assert_eq!(decode_lossy("p%40ss"), "p@ss");
        assert_eq!(decode_lossy("50%"), "50%");
        assert_eq!(decode_lossy("a%zzb"), "a%zzb");
        assert_eq!(decode_lossy("%ff"), "\u{fffd}");
    }
}

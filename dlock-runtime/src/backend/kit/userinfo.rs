//! Where a URL's user info ends: one rule for every URL dlock reads,
//! redacts or refuses.
//!
//! A password written without percent-encoding may hold `/`, `?`, `#`,
//! `@` or `:`. The URL standard ends the authority at the first `/`, `?`
//! or `#`, so such a password would be read as a host, a port or a path,
//! and shown as one (`redis://app:2024/Summer!@host` names the host `app`
//! and the port `2024`). dlock reads every URL the other way: any `@`
//! after `scheme://` means the text before it, up to the last `@`, is user
//! info, which may be credentials and is never shown in any part. A URL a
//! client library would read differently (see [`misread_by`]) is refused
//! before the library sees it.
//!
//! A backend that takes a URL refuses it, unshown, when its client would
//! read it otherwise, and redacts the user info whole wherever it shows
//! the URL:
//!
//! ```
//! use dlock_runtime::backend::kit::userinfo::{self, URL_STANDARD};
//!
//! // The password `2024/Summer!`, which the URL standard reads as a port and
//! // a path: refused, with a reason that does not show it.
//! let url = "redis://app:2024/Summer!@10.0.0.5";
//! assert!(userinfo::misread_by(url, URL_STANDARD));
//! let _reason = userinfo::MISREAD; // the reason to give, never the URL
//!
//! // What may be shown of a URL the client reads as written.
//! let url = "redis://app:p%40ss@10.0.0.5:6379/0";
//! assert!(!userinfo::misread_by(url, URL_STANDARD));
//! assert_eq!(userinfo::user_info(url), Some("app:p%40ss"));
//! let (_, shown) = userinfo::split_user_info("app:p%40ss@10.0.0.5:6379/0");
//! assert_eq!(shown, "10.0.0.5:6379/0");
//! ```

/// What ends the user info or the authority for a parser that follows the
/// URL standard (redis-rs): it splits the user info at the last `@` of the
/// authority, which ends at the first of these.
pub const URL_STANDARD: &[char] = &['/', '?', '#'];

/// What ends the user info or the authority for tokio-postgres: it splits
/// the user info at the first `@` of the whole string.
pub const FIRST_AT_SIGN: &[char] = &['/', '?', '#', '@'];

/// What follows `scheme://` (`after_scheme`), as the user info (everything
/// before its last `@`, if it has one) and the rest (host, port, path,
/// query).
pub fn split_user_info(after_scheme: &str) -> (Option<&str>, &str) {
    match after_scheme.rsplit_once('@') {
        Some((user_info, rest)) => (Some(user_info), rest),
        None => (None, after_scheme),
    }
}

/// `url`'s user info, by [`split_user_info`]; `None` when it has none or
/// is not a `scheme://` URL (a key=value string holding `://`, say).
/// Leading and trailing spaces and C0 control characters are not part of
/// the URL: the URL standard strips them before it finds the scheme
/// (redis-rs's parser does), so ` redis://app:pw@host` has the user info
/// `app:pw` too.
pub fn user_info(url: &str) -> Option<&str> {
    let (scheme, after_scheme) = url.trim_matches(is_c0_or_space).split_once("://")?;
    if !is_scheme(scheme) {
        return None;
    }
    split_user_info(after_scheme).0
}

/// True when a parser whose user info or authority ends at any of
/// `delimiters` would read `url` otherwise than [`split_user_info`]: its
/// user info holds one of them, so part of it (a password, maybe) would be
/// taken for a host, a port, a path or a query, and shown as one.
pub fn misread_by(url: &str, delimiters: &[char]) -> bool {
    user_info(url).is_some_and(|info| info.contains(delimiters))
}

/// A space or a C0 control character, which the URL standard strips from
/// both ends of a URL.
fn is_c0_or_space(c: char) -> bool {
    c <= ' '
}

/// True when a parser that follows the URL standard (redis-rs) would read
/// another text than `url` as written: the standard removes every tab and
/// line break, wherever it is, so `re\tdis://app:4817?pw@host` is a
/// `redis://` URL to it while dlock's rule sees no scheme, and the
/// password would be read as a host and a port. Such a URL is refused
/// and never shown.
pub fn rewritten_by_url_standard(url: &str) -> bool {
    url.contains(['\t', '\n', '\r'])
}

/// Why a URL [`rewritten_by_url_standard`] is refused; never the URL
/// itself.
pub const REWRITTEN: &str = "the URL holds a tab or a line break, which its client \
     would remove, reading another URL than the one written: write it without them (the URL \
     is not shown: it may hold a password)";

/// Why a URL [`misread_by`] its client is refused, and how to write it;
/// never the URL itself.
pub const MISREAD: &str = "the URL has an `@` after a `/`, `?` or `#`, so the text before \
     its last `@` may be a password that its client would read as a host, a port or a path: percent-encode `/`, `?`, `#` and `@` in the user \
     name and the password (%2F, %3F, %23, %40) and any `@` after the host as %40 (the URL is \
     not shown: it may hold a password)";

/// Whether `word` is a URL scheme (`ALPHA *( ALPHA / DIGIT / "+" / "-" /
/// "." )`).
pub fn is_scheme(word: &str) -> bool {
    word.starts_with(|c: char| c.is_ascii_alphabetic())
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_user_info_ends_at_the_last_at_sign_after_the_scheme() {
        assert_eq!(
            user_info("redis+sentinel://app:2024/Summer!@127.0.0.1:27999"),
            Some("app:2024/Summer!")
        );
        assert_eq!(user_info("redis://a:p@ss@host/0"), Some("a:p@ss"));
        assert_eq!(user_info("redis://host/0?x=a@b"), Some("host/0?x=a"));
        assert_eq!(user_info("redis://host:6379/0"), None);
        assert_eq!(user_info("host=h password=a://b@c"), None);
        assert_eq!(user_info("hunter2"), None);
        assert_eq!(user_info(" redis://app:pw@host"), Some("app:pw"));
        assert_eq!(user_info("\u{1}\tredis://4817?x@host\n"), Some("4817?x"));
    }

    #[test]
    fn a_delimiter_in_the_user_info_is_a_misreading() {
        for url in [
            "redis://app:2024/Summer!@host",
            "redis://:pa?ss@host",
            "redis://:pa#ss@host",
            "redis://host/0?password=a@b",
            " redis://app:4817?x@host",
            "\u{1}redis://app:4817#x@host",
        ] {
            assert!(misread_by(url, URL_STANDARD), "{url}");
        }
        for url in [
            "redis://app:p@ss@host/0",
            "redis://app:p:ss@host",
            "redis://host/0",
        ] {
            assert!(!misread_by(url, URL_STANDARD), "{url}");
        }
    }
}

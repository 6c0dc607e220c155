//! Keeping credentials out of everything the backend prints.

/// `url` with the password of its user-info replaced by `***`:
/// `redis://app:secret@host:6379/0` becomes `redis://app:***@host:6379/0`.
/// User info without a `:` is hidden whole, since some clients read a bare
/// `redis://secret@host` as a password. Works on text that is not a valid
/// URL too, so even a URL that fails to parse can be shown.
pub(crate) fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        // Not URL-shaped: it may be anything, including a bare password.
        return "<unparsable URL>".to_owned();
    };
    let rest_start = scheme_end + 3;
    let rest = &url[rest_start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let user = match authority[..at].split_once(':') {
        Some((user, _password)) => format!("{user}:***"),
        None => "***".to_owned(),
    };
    format!(
        "{}{user}@{}{}",
        &url[..rest_start],
        &authority[at + 1..],
        &rest[authority_end..]
    )
}

/// The secrets in `url` (the password, or bare user info) that must never
/// appear in output, each at least 1 byte long.
pub(crate) fn secrets_of(url: &str) -> Vec<String> {
    let Some(scheme_end) = url.find("://") else {
        return vec![url.to_owned()];
    };
    let rest = &url[scheme_end + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let Some(at) = authority.rfind('@') else {
        return Vec::new();
    };
    let secret = match authority[..at].split_once(':') {
        Some((_, password)) => password,
        None => &authority[..at],
    };
    let mut secrets = Vec::new();
    if !secret.is_empty() {
        secrets.push(secret.to_owned());
        // The percent-decoded form is what the client sends and could echo.
        let decoded = percent_decode(secret);
        if decoded != secret {
            secrets.push(decoded);
        }
    }
    secrets
}

/// `text` with every secret replaced by `***`.
pub(crate) fn scrub(text: &str, secrets: &[String]) -> String {
    secrets
        .iter()
        .filter(|secret| !secret.is_empty())
        .fold(text.to_owned(), |text, secret| {
            text.replace(secret.as_str(), "***")
        })
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            out.push((hi * 16 + lo) as u8);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_hidden_and_the_rest_kept() {
        assert_eq!(
            redact_url("redis://app:s3cret@10.0.0.1:6379/2"),
            "redis://app:***@10.0.0.1:6379/2"
        );
        assert_eq!(
            redact_url("rediss://:pw@host/0?protocol=resp3"),
            "rediss://:***@host/0?protocol=resp3"
        );
        assert_eq!(redact_url("redis://bare@host"), "redis://***@host");
        assert_eq!(redact_url("redis://host:6379"), "redis://host:6379");
        assert_eq!(redact_url("redis://a:p@ss@host"), "redis://a:***@host");
        assert_eq!(redact_url("hunter2"), "<unparsable URL>");
    }

    #[test]
    fn secrets_are_found_and_scrubbed() {
        let secrets = secrets_of("redis://app:p%40ss@host");
        assert_eq!(secrets, ["p%40ss", "p@ss"]);
        assert_eq!(scrub("auth p@ss failed", &secrets), "auth *** failed");
        assert!(secrets_of("redis://host").is_empty());
        assert!(secrets_of("redis://:@host").is_empty());
    }
}

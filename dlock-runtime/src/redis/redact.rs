//! Keeping credentials out of everything the backend prints.
//!
//! A Redis URL carries its password in the user info
//! (`redis://user:password@host`) or, for a unix socket, in the query
//! (`redis+unix:///path?pass=password&user=user`). Both are read with the
//! parser redis-rs itself uses, so what is hidden is what the client sends;
//! a URL redis-rs cannot read, or would read otherwise than dlock's rule
//! for user info ([`crate::backend::kit::userinfo`]), is never shown at all, since a
//! password in it may sit anywhere.

use std::cmp::Reverse;

use ::redis::IntoConnectionInfo as _;

use crate::backend::kit::percent::decode_lossy;
use crate::backend::kit::userinfo::{self, URL_STANDARD};

/// Query parameters that hold a password: `pass` is the one redis-rs reads
/// (unix sockets); `password` is hidden too, wherever it is written. Both
/// in any case (`PASS`, `Password`): see [`is_password_param`].
const PASSWORD_PARAMS: [&str; 2] = ["pass", "password"];
/// What stands for a hidden password.
const HIDDEN: &str = "***";
/// What stands for a URL that cannot be shown safely.
const UNREADABLE: &str = "<unreadable URL, not shown>";

/// `url` with its password replaced by `***`, wherever it is written:
/// `redis://app:secret@host:6379/0` becomes `redis://app:***@host:6379/0`,
/// `unix:///run/redis.sock?pass=secret` becomes `unix:///run/redis.sock?pass=***`.
/// User info without a password is hidden whole, since some clients read a
/// bare `redis://secret@host` as a password.
pub(crate) fn redact_url(url: &str) -> String {
    // Shown only if redis-rs reads it too: a password typed where neither
    // parser expects one (an unencoded `/` or `#` in it, say) must not end
    // up shown as a host or a path.
    if userinfo::misread_by(url, URL_STANDARD) || userinfo::rewritten_by_url_standard(url) {
        return UNREADABLE.to_owned();
    }
    let Some(mut parsed) = url
        .into_connection_info()
        .ok()
        .and_then(|_| ::redis::parse_redis_url(url))
    else {
        return UNREADABLE.to_owned();
    };
    let hidden = if parsed.password().is_some() {
        parsed.set_password(Some(HIDDEN))
    } else if !parsed.username().is_empty() {
        parsed.set_username(HIDDEN)
    } else {
        Ok(())
    };
    if hidden.is_err() {
        return UNREADABLE.to_owned();
    }
    // A password in the query may run past where the query parser ends
    // it: an unencoded `&` makes its tail a parameter of its own, an
    // unencoded `#` a fragment. So none of such a query is shown, nor the
    // fragment, whatever the parameters' names.
    if parsed
        .query_pairs()
        .any(|(name, _)| is_password_param(&name))
        || has_password_param(url)
    {
        parsed.set_query(None);
        parsed.set_fragment(None);
        let mut shown: String = parsed.into();
        shown.push('?');
        shown.push_str(HIDDEN);
        return shown;
    }
    parsed.into()
}

/// Every form of the secrets in `url` that could show up in a message:
/// the password (or bare user info) and any password query parameter, each
/// as written, as the URL parser encodes it and decoded (what the client
/// sends and a server could echo). Empty strings are left out.
pub(crate) fn secrets_of(url: &str) -> Vec<String> {
    let mut secrets = Vec::new();
    if let Ok(info) = url.into_connection_info() {
        secrets.extend(info.redis_settings().password().map(str::to_owned));
    }
    if let Some(parsed) = ::redis::parse_redis_url(url) {
        let user_info = match parsed.password() {
            Some(password) => password,
            None => parsed.username(),
        };
        secrets.push(user_info.to_owned());
        secrets.push(decode_lossy(user_info));
        for (name, value) in parsed.query_pairs() {
            if is_password_param(&name) {
                secrets.push(value.into_owned());
            }
        }
        secrets.extend(password_params(parsed.query().unwrap_or_default()));
    }
    // As typed, which the parser may have encoded differently, and found
    // even in text that is not a URL.
    secrets.extend(typed_user_info(url));
    if let Some((_, query)) = url.split_once('?') {
        let query = query.split_once('#').map_or(query, |(query, _)| query);
        secrets.extend(password_params(query));
    }
    secrets.retain(|secret| !secret.is_empty());
    secrets.sort_unstable();
    secrets.dedup();
    secrets
}

/// Whether a query parameter named `name` holds a password. Case does not
/// count: a user who writes `?PASSWORD=` means a password as much as one
/// who writes `?password=`, whatever a client makes of it.
fn is_password_param(name: &str) -> bool {
    PASSWORD_PARAMS
        .iter()
        .any(|param| param.eq_ignore_ascii_case(name))
}

/// Whether `url` has a password query parameter as written, in any case
/// and any spelling (percent-encoded names decoded): the text after the
/// first `?` is searched past any `#`, so a parameter the URL parser would
/// put in the fragment counts too.
fn has_password_param(url: &str) -> bool {
    url.split_once('?').is_some_and(|(_, query)| {
        query.split(['&', '#', ';']).any(|pair| {
            let name = pair.split_once('=').map_or(pair, |(name, _)| name);
            is_password_param(form_decode(name).trim())
        })
    })
}

/// The password query parameters' values in `query`, raw and decoded.
fn password_params(query: &str) -> Vec<String> {
    let mut values = Vec::new();
    for pair in query.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        if is_password_param(&form_decode(name)) {
            values.push(value.to_owned());
            values.push(form_decode(value));
        }
    }
    values
}

/// The password of the user info as typed (or the whole user info when it
/// has no `:`), found by text alone, by dlock's rule for user info.
fn typed_user_info(url: &str) -> Option<String> {
    let user_info = userinfo::user_info(url)?;
    let secret = user_info.split_once(':').map_or(user_info, |(_, p)| p);
    Some(secret.to_owned())
}

/// `text` with every secret replaced by `***`, the longest first, so a
/// secret that contains another is hidden whole.
pub(crate) fn scrub(text: &str, secrets: &[String]) -> String {
    let mut longest_first: Vec<&str> = secrets
        .iter()
        .map(String::as_str)
        .filter(|secret| !secret.is_empty())
        .collect();
    longest_first.sort_unstable_by_key(|secret| Reverse(secret.len()));
    longest_first
        .into_iter()
        .fold(text.to_owned(), |text, secret| text.replace(secret, HIDDEN))
}

/// `application/x-www-form-urlencoded` decoding, as query parameters are
/// read: `+` is a space.
fn form_decode(text: &str) -> String {
    decode_lossy(&text.replace('+', " "))
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
        assert_eq!(
            redact_url("redis+unix:///run/redis.sock?pass=s3cret&user=app&db=1"),
            "redis+unix:///run/redis.sock?***"
        );
        assert_eq!(
            redact_url("unix:///run/redis.sock?user=app&pass=p%26w"),
            "unix:///run/redis.sock?***"
        );
        assert_eq!(
            redact_url("redis://host/0?PASSWORD=s3cret&Pass=p2&db=1"),
            "redis://host/0?***"
        );
        assert_eq!(
            redact_url("redis://host/0?db=1&protocol=resp3#x"),
            "redis://host/0?db=1&protocol=resp3#x"
        );
    }

    #[test]
    fn a_url_redis_rs_cannot_read_is_not_shown() {
        for unreadable in [
            "hunter2",
            "redis://:pa/ss@host",
            "redis://:pa#ss@host",
            "redis://:123/x@host",
            "redis://app:2024/Summer!@host",
            "redis://app:6379/0?x@host",
            "http://user:pw@host",
            " redis://app:4817?x@host",
            "re\tdis://app:4817?x@host",
        ] {
            assert_eq!(redact_url(unreadable), UNREADABLE, "{unreadable}");
        }
    }

    #[test]
    fn nothing_of_a_query_holding_a_password_is_shown() {
        for (url, shown) in [
            (
                "unix:///tmp/x.sock?pass=Ux1#Ux2&user=app",
                "unix:///tmp/x.sock?***",
            ),
            (
                "redis://127.0.0.1:1/0?password=Qx1#Qx2",
                "redis://127.0.0.1:1/0?***",
            ),
            (
                "redis://127.0.0.1:1/0?password=Qy1&Qy2",
                "redis://127.0.0.1:1/0?***",
            ),
            (
                "redis://127.0.0.1:1/0?pass%77ord=Qo1#Qo2",
                "redis://127.0.0.1:1/0?***",
            ),
            (
                "redis://[::1]:1/0?db=1#&password=Qf1",
                "redis://[::1]:1/0?***",
            ),
            (
                "redis://:pw@[::1]:1/0?PASS+=Qs1",
                "redis://:***@[::1]:1/0?***",
            ),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    #[test]
    fn secrets_are_found_in_every_form_and_scrubbed() {
        let secrets = secrets_of("redis://app:p%40ss@host");
        assert!(secrets.contains(&"p%40ss".to_owned()), "{secrets:?}");
        assert!(secrets.contains(&"p@ss".to_owned()), "{secrets:?}");
        assert_eq!(scrub("auth p@ss failed", &secrets), "auth *** failed");

        let secrets = secrets_of("unix:///run/redis.sock?pass=a%2Bb+c&user=app");
        for form in ["a%2Bb+c", "a+b c"] {
            assert!(secrets.contains(&form.to_owned()), "{form}: {secrets:?}");
        }
        assert!(!secrets.contains(&"app".to_owned()), "{secrets:?}");

        assert!(secrets_of("redis://host").is_empty());
        assert!(secrets_of("redis://:@host").is_empty());
    }

    #[test]
    fn a_secret_containing_another_is_hidden_whole() {
        let secrets = ["pw".to_owned(), "pw%40x".to_owned()];
        assert_eq!(scrub("got pw%40x", &secrets), "got ***");
    }
}

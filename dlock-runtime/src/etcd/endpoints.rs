//! Reading endpoint URLs and keeping their credentials out of everything
//! the backend prints.
//!
//! An endpoint may carry etcd credentials in its user info
//! (`http://user:password@host:2379`). The user info is taken off before
//! the URL reaches the gRPC client (which would only refuse it), and the
//! user and password go to etcd's authentication instead. What the backend
//! shows (`Debug`, errors) is the URL without them; the password, in every
//! form it was written in, is also scrubbed from any text an error carries.

use crate::error::{LockError, Operation};

use super::KIND;

/// What stands for a hidden password.
const HIDDEN: &str = "***";

/// One endpoint, split into what is sent where.
#[derive(Clone, PartialEq, Eq)]
pub(super) struct Endpoint {
    /// `scheme://host:port[/...]` without user info: what the gRPC client
    /// connects to, and what errors and `Debug` show.
    pub(super) address: String,
    /// The user and password from the user info, percent-decoded.
    pub(super) credentials: Option<(String, String)>,
}

/// The endpoints, checked: at least one, all `http://` (this build has no
/// TLS), all with the same credentials if any.
pub(super) fn parse_all(endpoints: &[&str]) -> Result<Vec<Endpoint>, LockError> {
    if endpoints.is_empty() {
        return Err(invalid("no endpoint was given".into()));
    }
    let parsed = endpoints
        .iter()
        .map(|url| parse(url))
        .collect::<Result<Vec<_>, _>>()?;
    if parsed
        .iter()
        .any(|endpoint| endpoint.credentials != parsed[0].credentials)
    {
        return Err(invalid(
            "the endpoints name different credentials; one backend authenticates as one user"
                .into(),
        ));
    }
    Ok(parsed)
}

/// One endpoint URL. The error never shows the URL itself, only what it
/// would show with the credentials hidden, if that can be told.
pub(super) fn parse(url: &str) -> Result<Endpoint, LockError> {
    // What comes before `://` is shown only if it is a scheme: otherwise
    // it may be a user and the start of a password
    // (`root:pw://rest@host`), and nothing of the endpoint is shown.
    let Some((scheme, rest)) = url
        .split_once("://")
        .filter(|(scheme, _)| crate::backend::kit::userinfo::is_scheme(scheme))
    else {
        return Err(invalid(
            "an endpoint must be a URL like http://127.0.0.1:2379 (it is not shown: it may hold a password)"
                .into(),
        ));
    };
    let (user_info, host, path) = split_authority(rest);
    let address = format!("{scheme}://{host}{path}");
    match scheme {
        "http" => {}
        "https" => {
            return Err(invalid(format!(
                "{address}: TLS endpoints (https://) are not supported by the etcd backend yet"
            )));
        }
        _ => {
            return Err(invalid(format!(
                "{}: an endpoint's scheme must be http://",
                shown(scheme, host, user_info.is_some())
            )));
        }
    }
    if host.is_empty() {
        return Err(invalid(format!("{address}: the endpoint names no host")));
    }
    let credentials = match user_info {
        None => None,
        Some(user_info) => {
            let (user, password) = user_info.split_once(':').unwrap_or((user_info, ""));
            let (Some(user), Some(password)) = (
                crate::backend::kit::percent::decode(user),
                crate::backend::kit::percent::decode(password),
            ) else {
                return Err(invalid(format!(
                    "{address}: the user info is not valid percent-encoded UTF-8"
                )));
            };
            if user.is_empty() {
                return Err(invalid(format!(
                    "{}: the user info names no user",
                    shown(scheme, host, true)
                )));
            }
            Some((user, password))
        }
    };
    Ok(Endpoint {
        address,
        credentials,
    })
}

/// What follows `scheme://`, as user info, host and path. The user info
/// ends at the LAST `@`, wherever it is ([`crate::backend::kit::userinfo`]): a password
/// written without percent-encoding may hold `/`, `?` or `#`, and reading
/// the authority as ending at the first of those would leave the password
/// in the path, in the address shown. (No etcd endpoint has an `@` in its
/// path.)
fn split_authority(rest: &str) -> (Option<&str>, &str, &str) {
    let (user_info, after) = crate::backend::kit::userinfo::split_user_info(rest);
    let host_end = after.find(['/', '?', '#']).unwrap_or(after.len());
    let (host, path) = after.split_at(host_end);
    (user_info, host, path)
}

/// `scheme://***@host`, or `scheme://host`.
fn shown(scheme: &str, host: &str, had_user_info: bool) -> String {
    if had_user_info {
        format!("{scheme}://{HIDDEN}@{host}")
    } else {
        format!("{scheme}://{host}")
    }
}

fn invalid(reason: String) -> LockError {
    LockError::backend(KIND, Operation::Connect, "", reason)
}

/// Every form of the password that could show up in a message: as
/// decoded (what is sent) and as written in the URL. Empty ones are left
/// out.
pub(super) fn secrets_of(endpoints: &[&str], parsed: &[Endpoint]) -> Vec<String> {
    let mut secrets: Vec<String> = parsed
        .iter()
        .filter_map(|endpoint| endpoint.credentials.as_ref())
        .map(|(_, password)| password.clone())
        .collect();
    for url in endpoints {
        if let Some((_, rest)) = url.split_once("://")
            && let (Some(user_info), _, _) = split_authority(rest)
            && let Some((_, password)) = user_info.split_once(':')
        {
            secrets.push(password.to_owned());
        }
    }
    secrets.retain(|secret| !secret.is_empty());
    secrets.sort_by_key(|secret| std::cmp::Reverse(secret.len()));
    secrets.dedup();
    secrets
}

/// `text` with every secret replaced by `***` (longest first, so a secret
/// that contains another is hidden whole).
pub(super) fn scrub(text: &str, secrets: &[String]) -> String {
    let mut text = text.to_owned();
    for secret in secrets {
        if text.contains(secret.as_str()) {
            text = text.replace(secret.as_str(), HIDDEN);
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_taken_off_the_address() {
        let endpoint = parse("http://app:s%40cret@10.0.0.5:2379").expect("valid");
        assert_eq!(endpoint.address, "http://10.0.0.5:2379");
        assert_eq!(
            endpoint.credentials,
            Some(("app".to_owned(), "s@cret".to_owned()))
        );
        let plain = parse("http://127.0.0.1:2379").expect("valid");
        assert_eq!(plain.address, "http://127.0.0.1:2379");
        assert_eq!(plain.credentials, None);
    }

    #[test]
    fn errors_never_show_a_password() {
        for url in [
            "ftp://app:hunter2@host:2379",
            "http://:hunter2@host:2379",
            "hunter2",
            "http://app:hunter2%zz@host",
            "app:hunter2://x@host:2379",
            " http://app:hunter2@host:2379",
        ] {
            // `Endpoint` has no `Debug`: it holds the password.
            let Err(err) = parse(url) else {
                panic!("an endpoint was accepted that must be refused")
            };
            let err = err.to_string();
            assert!(!err.contains("hunter2"), "{url}: {err}");
        }
    }

    #[test]
    fn an_unencoded_password_with_a_slash_stays_in_the_user_info() {
        for (url, password) in [
            ("http://app:pa/ss@10.0.0.5:2379", "pa/ss"),
            ("http://app:pa?ss@10.0.0.5:2379", "pa?ss"),
            ("http://app:pa#ss@10.0.0.5:2379/", "pa#ss"),
        ] {
            let endpoint = parse(url).expect("valid");
            assert!(
                endpoint.address.starts_with("http://10.0.0.5:2379"),
                "{url}"
            );
            assert_eq!(
                endpoint.credentials,
                Some(("app".to_owned(), password.to_owned()))
            );
            let secrets = secrets_of(&[url], &[endpoint]);
            assert_eq!(secrets, vec![password.to_owned()]);
        }
    }

    #[test]
    fn scrub_hides_every_form_of_the_password() {
        let urls = ["http://app:p%40ss@host:2379"];
        let parsed = parse_all(&urls).expect("valid");
        let secrets = secrets_of(&urls, &parsed);
        let text = scrub("auth failed for p@ss (p%40ss)", &secrets);
        assert_eq!(text, "auth failed for *** (***)");
    }

    #[test]
    fn endpoints_must_agree_on_credentials() {
        assert!(parse_all(&["http://a:b@h1:2379", "http://h2:2379"]).is_err());
        assert!(parse_all(&[]).is_err());
        assert!(parse_all(&["http://a:b@h1:2379", "http://a:b@h2:2379"]).is_ok());
    }
}

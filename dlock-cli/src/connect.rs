//! From the `--backend` URL to a connected backend.
//!
//! The URL is never shown: it may carry a password. Errors name its scheme
//! at most, and the backends' own connection errors already hide their
//! credentials.

use std::path::PathBuf;
use std::sync::Arc;

use dlock::Backend;
use dlock::file::FileBackend;
#[cfg(feature = "pg")]
use dlock::pg::{PgBackend, PgOptions};
#[cfg(feature = "redis")]
use dlock::redis::RedisBackend;

use crate::Failure;

/// The forms `--backend` accepts, for error messages.
const FORMS: &str = "redis://…, rediss://…, redis+sentinel://h1,h2/name, postgresql://… (or key=value like \
                     `host=db user=app dbname=app`), or file:///dir";

/// Which store a `--backend` URL names.
#[derive(Debug, PartialEq, Eq)]
pub enum Store {
    /// Redis or a Redis Cluster: the URL as it is.
    Redis,
    /// PostgreSQL: a URL or a key=value connection string, as it is.
    Pg,
    /// A directory of lock files.
    File(PathBuf),
}

impl Store {
    /// Reads `url`'s form; the error does not show the URL.
    pub fn of(url: &str) -> Result<Self, Failure> {
        let url = url.trim();
        // A `://` after a word that cannot be a scheme is part of a
        // key=value string (a password, say).
        let scheme = url
            .split_once("://")
            .map(|(scheme, _)| scheme)
            .filter(|scheme| is_scheme(scheme));
        match scheme.map(str::to_ascii_lowercase).as_deref() {
            Some(
                "redis" | "rediss" | "redis+unix" | "unix" | "redis+sentinel" | "rediss+sentinel",
            ) => Ok(Store::Redis),
            Some("postgresql" | "postgres") => Ok(Store::Pg),
            Some("file") => file_path(&url["file://".len()..]).map(Store::File),
            Some(other) => Err(Failure::usage(format!(
                "--backend: dlock does not know the scheme `{other}`; use {FORMS}"
            ))),
            // No scheme: a key=value connection string is PostgreSQL's.
            None if url.contains('=') => Ok(Store::Pg),
            _ => Err(Failure::usage(format!(
                "--backend: not a backend URL dlock knows (it is not shown: it may hold a \
                 password); use {FORMS}"
            ))),
        }
    }
}

/// Connects to the store `url` names. Opening a file store needs its
/// directory to exist: an inspector must not create an empty one for a
/// mistyped path and then report that nothing is held there.
pub async fn connect(url: &str) -> Result<Arc<dyn Backend>, Failure> {
    Ok(match Store::of(url)? {
        #[cfg(feature = "redis")]
        Store::Redis => Arc::new(RedisBackend::connect(url.trim()).await?),
        // One lock session: the inspector takes no locks of its own.
        #[cfg(feature = "pg")]
        Store::Pg => {
            Arc::new(PgBackend::connect_with(url.trim(), PgOptions::new().sessions(1)).await?)
        }
        #[cfg(not(feature = "redis"))]
        Store::Redis => return Err(without("Redis", "redis")),
        #[cfg(not(feature = "pg"))]
        Store::Pg => return Err(without("PostgreSQL", "pg")),
        Store::File(dir) => {
            if !dir.is_dir() {
                return Err(Failure::error(format!(
                    "--backend: {} is not a directory",
                    dir.display()
                )));
            }
            Arc::new(FileBackend::open(&dir)?)
        }
    })
}

/// This build cannot open `store`.
#[cfg(any(not(feature = "redis"), not(feature = "pg")))]
fn without(store: &str, feature: &str) -> Failure {
    Failure::error(format!(
        "this dlock was built without {store} support (the `{feature}` feature of dlock-cli)"
    ))
}

/// True for a word that can be a URL scheme, so that it can be shown: it
/// cannot carry a password.
fn is_scheme(word: &str) -> bool {
    word.starts_with(|c: char| c.is_ascii_alphabetic())
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// The directory of `file://REST`: `/dir` or `localhost/dir`, with
/// `%xx` escapes decoded.
fn file_path(rest: &str) -> Result<PathBuf, Failure> {
    let path = rest.strip_prefix("localhost").unwrap_or(rest);
    if !path.starts_with('/') {
        return Err(Failure::usage(
            "--backend: a file URL names a local directory by its absolute path: \
             file:///var/lib/dlock",
        ));
    }
    let decoded = dlock::backend::kit::percent::decode(path).ok_or_else(|| {
        Failure::usage("--backend: the file URL has a bad %-escape or is not UTF-8 once decoded")
    })?;
    Ok(PathBuf::from(decoded))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_form_names_its_store() {
        for url in [
            "redis://127.0.0.1",
            "rediss://:pw@h:6380/1",
            "REDIS://h",
            "redis+sentinel://:pw@h1:26379,h2/mymaster",
        ] {
            assert_eq!(Store::of(url).ok(), Some(Store::Redis), "{url}");
        }
        for url in [
            "postgresql://u:pw@h/db",
            "postgres://h",
            "host=127.0.0.1 user=postgres dbname=test",
            "host=h password=a://b",
        ] {
            assert_eq!(Store::of(url).ok(), Some(Store::Pg), "{url}");
        }
        assert_eq!(
            Store::of("file:///var/lib/my%20locks").ok(),
            Some(Store::File(PathBuf::from("/var/lib/my locks")))
        );
        assert_eq!(
            Store::of("file://localhost/tmp").ok(),
            Some(Store::File(PathBuf::from("/tmp")))
        );
    }

    #[test]
    fn a_url_that_is_not_understood_is_not_shown() {
        for url in [
            "http://user:s3cret@host",
            "s3cret",
            "file://s3cret/x",
            "file:///%zz",
        ] {
            let err = Store::of(url).err().map(|f| f.to_string());
            let err = err.unwrap_or_else(|| panic!("{url} was accepted"));
            assert!(!err.contains("s3cret"), "{err}");
        }
        let err = Store::of("http://user:pw@host")
            .err()
            .map(|f| f.to_string());
        assert!(err.is_some_and(|e| e.contains("`http`")));
    }
}

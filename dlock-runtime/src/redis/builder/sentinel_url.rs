//! A Redis Sentinel URL, read without ever repeating it (it may hold a
//! password), and its tests.

use super::*;

/// The default port of a sentinel.
const SENTINEL_PORT: u16 = 26379;

/// A `redis+sentinel://[[user]:password@]host[:port][,host[:port]…]/service[/db]`
/// URL (`rediss+sentinel://` for TLS), read: the user info is the data
/// nodes' credentials (sentinels that want a password of their own take
/// the builder's [`RedisBackend::sentinel`]).
#[derive(Debug, PartialEq)]
pub(super) struct SentinelUrl {
    pub(super) sentinels: Vec<String>,
    pub(super) service: String,
    pub(super) auth: Option<(Option<String>, String)>,
    pub(super) db: i64,
}

impl SentinelUrl {
    /// `None` when `url` is not a sentinel URL; an error that never
    /// repeats the URL (it may hold a password) when it cannot be read.
    pub(super) fn read(url: &str) -> Option<Result<Self, String>> {
        let (scheme, rest) = url.split_once("://")?;
        let tls = if scheme.eq_ignore_ascii_case("redis+sentinel") {
            false
        } else if scheme.eq_ignore_ascii_case("rediss+sentinel") {
            true
        } else {
            return None;
        };
        let form = "a sentinel URL is redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]";
        // The user info first, by the rule every URL is read by: a
        // password may hold `/`, which must not end the hosts.
        let (user_info, after) = userinfo::split_user_info(rest);
        let (hosts, path) = match after.split_once('/') {
            Some(parts) => parts,
            None => return Some(Err(format!("{form}: the service name is missing"))),
        };
        let auth = user_info.map(|info| match info.split_once(':') {
            Some((user, password)) => (
                Some(decode_lossy(user)).filter(|user| !user.is_empty()),
                decode_lossy(password),
            ),
            None => (None, decode_lossy(info)),
        });
        let mut sentinels = Vec::new();
        for host in hosts.split(',') {
            // `[::1]` alone is a host without a port.
            let split = if host.ends_with(']') {
                None
            } else {
                host.rsplit_once(':')
            };
            let (name, port) = match split {
                Some((name, port)) => match port.parse::<u16>() {
                    Ok(port) => (name, port),
                    Err(_) => return Some(Err(format!("{form}: a port is not a number"))),
                },
                None => (host, SENTINEL_PORT),
            };
            if name.is_empty() {
                return Some(Err(format!("{form}: a host is empty")));
            }
            let scheme = if tls { "rediss" } else { "redis" };
            sentinels.push(format!("{scheme}://{name}:{port}"));
        }
        // A query or fragment (`?password=…`) is no part of the form: it
        // would become part of the service name, shown in errors.
        if path.contains(['?', '#']) {
            return Some(Err(format!(
                "{form}: a query (?...) or fragment (#...) is not read"
            )));
        }
        let (service, db) = match path.split_once('/') {
            Some((service, db)) => match db.parse::<i64>() {
                Ok(db) if db >= 0 => (service, db),
                Ok(_) => return Some(Err(format!("{form}: the database is negative"))),
                Err(_) => return Some(Err(format!("{form}: the database is not a number"))),
            },
            None => (path, 0),
        };
        if service.is_empty() {
            return Some(Err(format!("{form}: the service name is missing")));
        }
        Some(Ok(Self {
            sentinels,
            service: decode_lossy(service),
            auth,
            db,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sentinel_url_names_the_sentinels_the_service_and_the_data_nodes_credentials() {
        let read = SentinelUrl::read("redis+sentinel://app:p%40ss@h1:26380,h2/mymaster/2")
            .expect("a sentinel URL")
            .expect("readable");
        assert_eq!(
            read,
            SentinelUrl {
                sentinels: vec!["redis://h1:26380".into(), "redis://h2:26379".into()],
                service: "mymaster".into(),
                auth: Some((Some("app".into()), "p@ss".into())),
                db: 2,
            }
        );
        let tls = SentinelUrl::read("rediss+sentinel://:pw@h:1/m")
            .expect("a sentinel URL")
            .expect("readable");
        assert_eq!(tls.sentinels, vec!["rediss://h:1".to_owned()]);
        assert_eq!(tls.auth, Some((None, "pw".into())));
        assert!(SentinelUrl::read("redis://h:6379").is_none());
        let slash = SentinelUrl::read("redis+sentinel://app:2024/Summer!@h:1/m/1")
            .expect("a sentinel URL")
            .expect("readable");
        assert_eq!(slash.sentinels, vec!["redis://h:1".to_owned()]);
        assert_eq!(
            slash.auth,
            Some((Some("app".into()), "2024/Summer!".into()))
        );
        assert_eq!((slash.service.as_str(), slash.db), ("m", 1));
    }

    #[test]
    fn an_unreadable_sentinel_url_is_refused_without_repeating_it() {
        for url in [
            "redis+sentinel://:secret@h1:26379",
            "redis+sentinel://:secret@h1:x/m",
            "redis+sentinel://:secret@h1/",
            "redis+sentinel://:secret@h1/m/zero",
            "redis+sentinel://:secret@,h2/m",
            "redis+sentinel://:secret@h1/m?password=secret",
            "redis+sentinel://:secret@h1/m#secret",
            "redis+sentinel://:secret@h1/m/-1",
            "redis+sentinel://app:secret/x@h1:26379",
            "redis+sentinel://app:26379/secret@h1",
        ] {
            let reason = SentinelUrl::read(url)
                .expect("a sentinel URL")
                .expect_err("unreadable");
            assert!(!reason.contains("secret"), "{reason}");
        }
    }

    #[test]
    fn a_sentinel_builder_shows_no_credentials() {
        let builder = RedisBuilder::new("redis+sentinel://app:s3cret@h1,h2/mymaster");
        let shown = format!("{builder:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("mymaster"), "{shown}");
    }
}

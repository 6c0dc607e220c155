//! [`PgOptions`]: the settings of a [`PgBackend`](super::PgBackend) beyond
//! the connection string, and the checks on them and on the string.

use super::DEFAULT_SCHEMA;
use super::tls::TlsVerification;
use crate::error::LockError;
use std::time::Duration;

/// Settings of a [`PgBackend`](super::PgBackend) beyond the connection string.
///
/// ```
/// use std::time::Duration;
/// use dlock_runtime::pg::PgOptions;
///
/// let options = PgOptions::new()
///     .sessions(4)
///     .schema("locks")
///     .liveness_interval(Duration::from_secs(1));
/// # let _ = options;
/// ```
#[derive(Clone, Debug)]
pub struct PgOptions {
    pub(super) sessions: usize,
    pub(super) wait_sessions: usize,
    pub(super) fair_sessions: usize,
    pub(super) schema: String,
    pub(super) key_seed: i64,
    pub(super) connect_timeout: Duration,
    pub(super) liveness_interval: Duration,
    pub(super) server_idle_timeout: Option<Duration>,
    pub(super) tls: TlsVerification,
    pub(super) label: Option<String>,
    pub(super) record_holders: bool,
}

impl Default for PgOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl PgOptions {
    /// Two lock sessions, up to four wait sessions, up to 32 fair
    /// sessions, schema `dlock`, key
    /// seed 0, a 5 s connect timeout, a liveness check every 2 s, a 15 s
    /// server idle timeout, libpq's TLS behaviour, no label of its own,
    /// and every acquisition's holder recorded.
    pub fn new() -> Self {
        Self {
            sessions: 2,
            wait_sessions: 4,
            fair_sessions: 32,
            schema: DEFAULT_SCHEMA.to_owned(),
            key_seed: 0,
            connect_timeout: Duration::from_secs(5),
            liveness_interval: Duration::from_secs(2),
            server_idle_timeout: Some(Duration::from_secs(15)),
            tls: TlsVerification::default(),
            label: None,
            record_holders: true,
        }
    }

    /// How many connections hold locks (1 to 64). Leases spread over them;
    /// more sessions mean fewer leases lost together when one dies.
    pub fn sessions(mut self, sessions: usize) -> Self {
        self.sessions = sessions;
        self
    }

    /// At most how many connections wait on the server for keys held by
    /// other processes (one per waited key; 0 to 64). When all are busy,
    /// further waiters recheck once a second instead.
    pub fn wait_sessions(mut self, wait_sessions: usize) -> Self {
        self.wait_sessions = wait_sessions;
        self
    }

    /// At most how many connections fair acquisitions
    /// ([`LockOptions::fair`](crate::LockOptions::fair)) use at once (1 to
    /// 1024): each fair waiter that queues waits in PostgreSQL's own queue
    /// of the key on a connection of its own, and holds the key on it once
    /// a release hands it over, until it releases it. Connections are kept
    /// for the next fair waiter for 30 s after their last use. A fair
    /// waiter that would need one more is answered an error, which the
    /// acquisition rides out (retrying) while it may wait. See the
    /// [module docs](super#fair-mode).
    pub fn fair_sessions(mut self, fair_sessions: usize) -> Self {
        self.fair_sessions = fair_sessions;
        self
    }

    /// The schema of the token sequence: lowercase letters, digits and
    /// `_`, not starting with a digit, at most 63 bytes.
    ///
    /// The schema is not part of the lock: the advisory lock of a key
    /// depends on the key and the [key seed](Self::key_seed) only. Clients
    /// that lock the same keys with the same seed (backends and
    /// [`TransactionLock`](super::TransactionLock)s alike) must use the same
    /// schema, or the tokens of a key come from two sequences that need
    /// not agree, and can go back between them; give unrelated deployments
    /// in one database their own seed. A backend warns when it finds token
    /// sequences in other schemas of its database.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The seed of `hashtextextended(key, seed)`: every client that must
    /// see the same locks uses the same seed.
    pub fn key_seed(mut self, seed: i64) -> Self {
        self.key_seed = seed;
        self
    }

    /// How long opening a connection may take in all (TCP, TLS,
    /// authentication), unless the connection string sets
    /// `connect_timeout`.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How often each lock session is pinged; a ping without an answer
    /// within the same time ends the session (its leases are told). At
    /// least 100 ms.
    pub fn liveness_interval(mut self, interval: Duration) -> Self {
        self.liveness_interval = interval;
        self
    }

    /// PostgreSQL 14+ ends a lock session that has sent nothing for this
    /// long (`idle_session_timeout`), which frees the locks of a holder
    /// that froze or was cut off. Must be more than twice the liveness
    /// interval; `None` leaves the server's setting alone.
    pub fn server_idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.server_idle_timeout = timeout;
        self
    }

    /// How the server certificate is checked. A check
    /// ([`TlsVerification::PublicRoots`], [`TlsVerification::RootCertificate`])
    /// makes TLS required; the default, [`TlsVerification::EncryptOnly`],
    /// does not stop a man in the middle.
    pub fn tls(mut self, verification: TlsVerification) -> Self {
        self.tls = verification;
        self
    }

    /// The application label every acquisition through this backend
    /// records with its host and pid ([`HolderInfo`](crate::HolderInfo)),
    /// over the process's ([`Registry::set_label`](crate::Registry::set_label)).
    /// Checked by [`check_label`](crate::holder::check_label) when the
    /// backend connects: at most 64 bytes, not empty, no control characters.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// Whether acquisitions without an identity record their holder (on
    /// by default). Each then writes a row of the `UNLOGGED` table
    /// `<schema>.dlock_holders` in its lock statement, and its session
    /// deletes the rows of its released leases in batches: see the
    /// [module docs](super#who-holds-a-key) for what that costs. Off, such
    /// leases cost what they did before holder records, and
    /// [`Backend::holder`](crate::Backend::holder) reads their holder as
    /// unknown and [`Backend::held`](crate::Backend::held) does not list
    /// them. Acquisitions with an identity (elections) always record.
    pub fn record_holders(mut self, record: bool) -> Self {
        self.record_holders = record;
        self
    }

    pub(super) fn validate(&self) -> Result<String, LockError> {
        let bad = |option, reason: String| Err(LockError::InvalidOption { option, reason });
        if let Some(label) = &self.label {
            crate::holder::check_label(label)?;
        }
        if !(1..=64).contains(&self.sessions) {
            return bad(
                "sessions",
                format!("{} is not between 1 and 64", self.sessions),
            );
        }
        if self.wait_sessions > 64 {
            return bad(
                "wait_sessions",
                format!("{} is more than 64", self.wait_sessions),
            );
        }
        if !(1..=1024).contains(&self.fair_sessions) {
            return bad(
                "fair_sessions",
                format!("{} is not between 1 and 1024", self.fair_sessions),
            );
        }
        if self.liveness_interval < Duration::from_millis(100) {
            return bad(
                "liveness_interval",
                format!("{:?} is below 100ms", self.liveness_interval),
            );
        }
        if self.connect_timeout.is_zero() {
            return bad("connect_timeout", "must be greater than zero".into());
        }
        if let Some(idle) = self.server_idle_timeout
            && idle <= self.liveness_interval * 2
        {
            return bad(
                "server_idle_timeout",
                format!(
                    "{idle:?} is not more than twice the liveness interval {:?}: healthy sessions would be ended",
                    self.liveness_interval
                ),
            );
        }
        quote_schema(&self.schema)
    }
}

/// True when `conn` is a URL that tokio-postgres would read otherwise than
/// dlock reads every URL ([`crate::backend::kit::userinfo`]): its user info (everything
/// before the last `@` after `://`) holds a `/`, `?`, `#` or another `@`.
/// tokio-postgres splits the user info at the first `@` of the whole
/// string, wherever it is, so a password in the query holding an `@`
/// (`?user=app&password=a@b`) would make everything before that `@` the
/// user name and the rest the host — shown by every error and by `Debug`.
pub(super) fn misplaced_at_sign(conn: &str) -> bool {
    let is_url = ["postgres://", "postgresql://"]
        .iter()
        .any(|scheme| conn.starts_with(scheme));
    is_url
        && crate::backend::kit::userinfo::misread_by(
            conn,
            crate::backend::kit::userinfo::FIRST_AT_SIGN,
        )
}

/// Why tokio-postgres refused a connection string, in words safe to show,
/// or `None` when its words could hold part of the password.
///
/// The parser's messages never hold a value, only an option's name: a bad
/// value is named by the option's own fixed name (`sslmode`), always safe.
/// An unknown option is named as written, which can be the tail of a
/// password written with an unquoted space or an unencoded `&`
/// (`password=pa ss=x`), percent-encoded or not, under a `password` key
/// that may itself be encoded: no test of the string tells that apart
/// surely, so its name is never shown. Any other message is shown only if
/// it is one known to hold no text of the string.
pub(super) fn parse_error_reason(err: &tokio_postgres::Error) -> Option<String> {
    let cause = std::error::Error::source(err)?.to_string();
    if let Some(option) = cause
        .strip_prefix("invalid value for option `")
        .and_then(|rest| rest.strip_suffix('`'))
        .filter(|name| is_plain_option_name(name))
    {
        return Some(format!("invalid value for option `{option}`"));
    }
    if cause.starts_with("unknown option `") {
        return Some(
            "an unknown option (its name is not shown: part of a password with an unquoted \
             space or an unencoded `&` reads as one; check the option names, and quote or \
             percent-encode the password)"
                .to_owned(),
        );
    }
    if let Some(rest) = cause.strip_prefix("unexpected character at byte ") {
        // `…: expected `=` but got `x``: the character got may be the
        // password's, the position and what was expected are not.
        let byte = rest
            .split(':')
            .next()
            .filter(|n| n.parse::<usize>().is_ok())?;
        return Some(format!("unexpected character at byte {byte}"));
    }
    const FIXED: [&str; 3] = [
        "unexpected EOF",
        "unterminated parameter",
        "unterminated quoted connection parameter value",
    ];
    FIXED.contains(&cause.as_str()).then_some(cause)
}

fn is_plain_option_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Checks a schema name and returns it quoted for SQL text (an identifier
/// cannot be a bound parameter). Also used by the PostgreSQL fence.
pub(crate) fn quote_schema(schema: &str) -> Result<String, LockError> {
    let mut chars = schema.chars();
    let valid = schema.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if valid {
        Ok(format!("\"{schema}\""))
    } else {
        Err(LockError::InvalidOption {
            option: "schema",
            reason: format!(
                "{schema:?} is not a plain lowercase identifier ([a-z_][a-z0-9_]*, at most 63 bytes)"
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr as _;

    fn reason(conn: &str) -> Option<String> {
        let err = tokio_postgres::Config::from_str(conn).expect_err("a malformed string");
        parse_error_reason(&err)
    }

    #[test]
    fn parse_reasons_name_options_but_never_a_password_part() {
        let unknown = reason("host=h passwd=x").expect("a reason");
        assert!(
            unknown.starts_with("an unknown option") && !unknown.contains("passwd"),
            "{unknown}"
        );
        assert_eq!(
            reason("host=h password=pw sslmode=bogus").as_deref(),
            Some("invalid value for option `sslmode`")
        );
        // The tail of a password with an unquoted space or an unencoded `&`,
        // under a `password` key written plainly or percent-encoded.
        for conn in [
            "host=h password=pw Tail=1",
            "postgresql://h/db?password=pw&tail=1",
            "postgresql://h/db?password=pw&t%61il=1",
            "postgresql://h/db?p%61ssword=pw&tail=1",
            "postgresql://u:tail@h/db?tail=1",
        ] {
            let shown = reason(conn).unwrap_or_default();
            assert!(
                !shown.to_ascii_lowercase().contains("tail"),
                "{conn}: {shown}"
            );
        }
        // The character the parser got may be the password's.
        assert_eq!(
            reason("host=h password=ab cd ef").as_deref(),
            Some("unexpected character at byte 22")
        );
        assert_eq!(
            reason("host=h password='open").as_deref(),
            Some("unterminated quoted connection parameter value")
        );
    }
}

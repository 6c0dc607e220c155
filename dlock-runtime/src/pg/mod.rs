//! `PgBackend`: locks held as PostgreSQL session advisory locks, for
//! services that already run PostgreSQL and want no new infrastructure.
//!
//! # Sessions
//!
//! A session advisory lock belongs to the connection that took it: it is
//! dropped when that connection says so, or the moment the connection ends.
//! So the backend opens and owns the connections that hold locks (a small
//! set, [`PgOptions::sessions`]) and never borrows one from an application
//! pool — returning a pooled connection would otherwise keep the lock on a
//! connection someone else gets next, or drop it behind the holder's back.
//! Several leases share a session. Advisory locks are re-entrant per
//! session (a second `pg_try_advisory_lock` on the same session says yes),
//! so the backend keeps its own per-key exclusion: a second task of the same
//! process never asks the server for a key this process holds or is taking.
//!
//! # Key mapping
//!
//! A lock key (a string) maps to the 64-bit advisory key
//! `hashtextextended(key, seed)`, computed on the server, with the seed
//! of [`PgOptions::key_seed`] (0 by default). It is the hash PostgreSQL
//! uses for hash partitioning, so it is stable across releases, and any
//! client in any language locks the same key with
//! `SELECT pg_try_advisory_lock(hashtextextended('my-key', 0))`. Two
//! different keys with the same hash are one lock: a collision means false
//! contention (one waits for the other), never lost exclusion — including
//! within one process, where a colliding grant on a session that already
//! holds the hash is given back at once. The full key is kept in process for
//! errors and inspection ([`PgBackend::advisory_key`],
//! [`PgBackend::holder_pids`]). The single-`bigint` advisory key space is
//! shared with any other use of advisory locks in the database: choose a
//! seed to keep dlock's keys apart if that matters.
//!
//! # Fencing tokens
//!
//! One statement takes the lock and, only if it was taken, draws the token,
//! so the token comes in the same round trip: the next value of the
//! sequence `<schema>.dlock_token_seq` or the server clock in microseconds
//! (`clock_timestamp()`), whichever is higher — the Redis backend's rule,
//! with its two guarantees. The clock floor keeps tokens above every token
//! handed out before when the sequence goes back: a DBA drops and recreates
//! it or `setval`s it, a failover to an asynchronous replica or a
//! point-in-time restore brings back an older copy. And whenever the clock
//! wins, the statement `setval`s the sequence to the token, so the sequence
//! holds at least the last token and a server clock that steps back cannot
//! lower the next one. That takes UPDATE on the sequence: a role with USAGE
//! only still locks, but its tokens rest on the clock alone, and a clock
//! step back lowers them. A sequence is not transactional and needs no row
//! per key; the statement's own commit is asynchronous (a crash that loses
//! the last `setval` only leaves the sequence behind, which the clock floor
//! covers), so the write costs no WAL flush.
//!
//! Tokens of one key rise strictly unless the sequence went back *and* the
//! server clock stepped back at the same time (or, after a failover, the
//! new primary's clock is behind the old one's by more than the failover
//! took). Tokens of different keys may be equal: a token orders the holders
//! of one key. The reasoning, races between sessions over the sequence
//! included, is written next to the lock statement (`pg/sql.rs`).
//!
//! The backend creates what it needs with `CREATE ... IF NOT EXISTS` when
//! it is missing — at connect, when a lock session opens, and when a lock
//! statement finds the sequence dropped — and a DBA can pre-create it:
//!
//! ```sql
//! CREATE SCHEMA IF NOT EXISTS dlock;
//! CREATE SEQUENCE IF NOT EXISTS dlock.dlock_token_seq AS bigint;
//! GRANT USAGE ON SCHEMA dlock TO app_role;
//! GRANT USAGE, UPDATE ON SEQUENCE dlock.dlock_token_seq TO app_role;
//! ```
//!
//! A sequence that cannot give rising tokens — `CACHE` above 1 (each session
//! hands out numbers from a block of its own), `CYCLE`, an increment below
//! 1, a maximum without a century of room above the clock in microseconds
//! (`AS integer`), or a position more than a day ahead of the clock (its
//! tokens would rest on the sequence alone, and the clock floor could not
//! stand in for it were it ever lost) — is refused when a lock session
//! opens, with the `ALTER SEQUENCE` that fixes it. Sessions open at connect and again
//! whenever one ended, so an `ALTER` made while services run is caught
//! there; reading the settings on every acquisition would cost a catalog
//! lookup each time.
//!
//! # Time to live
//!
//! A session lock does not expire while its connection lives, so the
//! backend enforces each lease's ttl itself: it unlocks a lease that was not
//! extended in time. A holder process that dies closes its connections and
//! PostgreSQL frees its locks at once — no ttl wait. A holder that freezes
//! or is cut off is ended by the server after
//! [`PgOptions::server_idle_timeout`] (PostgreSQL 14+), because its
//! sessions stop sending their liveness checks.
//!
//! # Waiting
//!
//! A key held in this process wakes its waiters in process. A key held
//! elsewhere is waited for on the server, not polled: see the `wait` module
//! docs — a shared-lock probe that PostgreSQL grants the instant the holder
//! lets go, however it lets go.
//!
//! # Loss detection
//!
//! When a lock session's connection ends (server restart,
//! `pg_terminate_backend`, network cut, a liveness check that got no answer
//! within [`PgOptions::liveness_interval`]), every lease on it is told at
//! once with [`LostReason::SessionEnded`](crate::LostReason::SessionEnded),
//! and the session is replaced for later acquisitions. A session busy
//! answering is alive: the lock statement waits at most half the liveness
//! interval for a lock on the token sequence (an `ALTER SEQUENCE` or a
//! `DROP` left open in another transaction holds one) and then fails with
//! an error that says so, so a ping queued behind such statements still
//! sees answers, and the session's other leases live on.
//!
//! # Runtimes
//!
//! A session lock never expires by itself, so the backend's own work — its
//! connections, ttl enforcement, liveness checks, wait probes, and the rest
//! of an acquisition or release whose caller gave up — runs on the runtime
//! the backend was connected on, which must keep running, and not on a
//! caller's runtime, which may shut down right after. Callers on another
//! runtime (a `block_on` in a blocking library) have their acquisitions
//! and releases run there too. If that runtime shuts down, its connections
//! close with it — the server frees their locks and their leases are told
//! — and the next caller's runtime takes over.
//!
//! # PgBouncer
//!
//! Session locks need a real server session: point `PgBackend` at
//! PostgreSQL directly or through a PgBouncer pool in *session* mode.
//! Behind *transaction* pooling use [`TransactionLock`], which locks inside
//! the caller's own transaction.

mod expiry;
mod home;
mod sequence;
mod session;
pub(crate) mod sql;
mod tls;
mod wait;
mod xact;

/// The statements the backend sends, word for word, for tools that must
/// speak the same protocol (the benchmark's raw tokio-postgres floor issues
/// exactly these; `{schema}` stands for the quoted schema). Not a stable API.
#[doc(hidden)]
pub mod protocol {
    pub use super::sql::{TRY_LOCK, UNLOCK};
}

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{Mutex as AsyncMutex, oneshot, watch};
use tokio::time::Instant;
use tokio_postgres::Config;
use tokio_postgres::error::SqlState;

use self::expiry::{Expiries, Slot};
use self::home::{Home, NoRuntime};
use self::session::{Connector, Failure, LockSession, SessionEnding};
use self::wait::Waits;
use crate::backend::{
    AcquireRequest, Attempt, Backend, Grant, LossGroup, OwnerId, ReleaseNotice, ReleaseOutcome,
    ReleaseRequest, Renewal,
};
use crate::detach::{AbandonedWith, Ignore};
use crate::error::{LockError, Operation};
use crate::key::LockKey;
use crate::token::FencingToken;

pub use self::tls::TlsVerification;
pub use self::xact::{MAX_LOCK_TIMEOUT, TransactionLock};
/// The PostgreSQL client this backend is built on, for
/// [`TransactionLock::acquire`] and anything else that needs its types.
pub use tokio_postgres;

const KIND: &str = "pg";
const DEFAULT_SCHEMA: &str = "dlock";
/// How long `force_release` waits for a holding session to be gone.
const TERMINATE_WAIT_MS: i64 = 5_000;
/// How soon a waiter looks again for a key held elsewhere when every wait
/// session is busy, so no server-side probe watches the key for it.
const UNWATCHED_RECHECK: Duration = Duration::from_secs(1);

/// Settings of a [`PgBackend`] beyond the connection string.
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
    sessions: usize,
    wait_sessions: usize,
    schema: String,
    key_seed: i64,
    connect_timeout: Duration,
    liveness_interval: Duration,
    server_idle_timeout: Option<Duration>,
    tls: TlsVerification,
}

impl Default for PgOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl PgOptions {
    /// Two lock sessions, up to four wait sessions, schema `dlock`, key
    /// seed 0, a 5 s connect timeout, a liveness check every 2 s, a 15 s
    /// server idle timeout, and libpq's TLS behaviour.
    pub fn new() -> Self {
        Self {
            sessions: 2,
            wait_sessions: 4,
            schema: DEFAULT_SCHEMA.to_owned(),
            key_seed: 0,
            connect_timeout: Duration::from_secs(5),
            liveness_interval: Duration::from_secs(2),
            server_idle_timeout: Some(Duration::from_secs(15)),
            tls: TlsVerification::default(),
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

    /// The schema of the token sequence: lowercase letters, digits and
    /// `_`, not starting with a digit, at most 63 bytes.
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

    fn validate(&self) -> Result<String, LockError> {
        let bad = |option, reason: String| Err(LockError::InvalidOption { option, reason });
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

/// True when `conn` is a URL whose first `@` is not in its authority (what
/// lies between `://` and the first `/`, `?` or `#`) or whose authority has
/// more than one. tokio-postgres splits the user info at the first `@` of
/// the whole string, wherever it is, so a password in the query holding an
/// `@` (`?user=app&password=a@b`) would make everything before that `@` the
/// user name and the rest the host — shown by every error and by `Debug`.
fn misplaced_at_sign(conn: &str) -> bool {
    let Some(rest) = ["postgres://", "postgresql://"]
        .iter()
        .find_map(|scheme| conn.strip_prefix(scheme))
    else {
        return false;
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest.find('@') {
        None => false,
        Some(first) => first > authority_end || rest[first + 1..authority_end].contains('@'),
    }
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

/// Locks held as PostgreSQL session advisory locks on connections this
/// backend owns. See the [module docs](self) for how it maps keys, issues
/// tokens, waits and notices a lost session.
///
/// Cloning is cheap and shares the sessions. `Debug` shows where it
/// connects, never the password.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_runtime::LockError> {
/// use std::time::Duration;
/// use dlock_runtime::{pg::PgBackend, registry, LockOptions};
///
/// let conn = std::env::var("DLOCK_PG_URL")
///     .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=test".into());
/// registry().register("doc-pg", PgBackend::connect(&conn).await?);
/// let lease = LockOptions::new(Duration::from_secs(30))
///     .backend("doc-pg")
///     .acquire("nightly-report")
///     .await?;
/// println!("token {}", lease.token());
/// lease.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PgBackend {
    inner: Arc<Inner>,
}

struct Inner {
    /// Where connections are driven and background work runs.
    home: Arc<Home>,
    connector: Connector,
    options: PgOptions,
    quoted_schema: String,
    try_lock_sql: String,
    unlock_key_sql: String,
    terminate_sql: String,
    slots: Vec<SessionSlot>,
    next_slot: AtomicUsize,
    next_session_id: AtomicU64,
    /// One repair of the schema objects at a time (see `restore_objects`),
    /// with why the last one failed, and how many were tried.
    restoring: AsyncMutex<Option<String>>,
    restorations: AtomicU64,
    keys: Mutex<HashMap<LockKey, Entry>>,
    expiries: Arc<Expiries>,
    waits: Waits,
}

/// One lock session's place. Taking the live session is a plain mutex and
/// a clone, with no await: every acquisition does it. Only opening a
/// session (the first, or after one died) waits, one opener at a time.
#[derive(Default)]
struct SessionSlot {
    current: Mutex<Option<Arc<LockSession>>>,
    opening: AsyncMutex<()>,
}

impl SessionSlot {
    fn current(&self) -> MutexGuard<'_, Option<Arc<LockSession>>> {
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The slot's session, if it is open and alive.
    fn live(&self) -> Option<Arc<LockSession>> {
        self.current()
            .as_ref()
            .filter(|session| !session.is_ended())
            .map(Arc::clone)
    }
}

/// What this process knows of one key it holds or is taking.
struct Entry {
    owner: OwnerId,
    /// Dropped with the entry, which wakes this process's waiters; made
    /// only once a waiter of this process asks (most keys never have one).
    gone: Option<watch::Sender<()>>,
    state: State,
}

enum State {
    /// An attempt is on its way to the server.
    Acquiring,
    /// Held on `session`.
    Held(Holding),
    /// An unlock is on its way to the server.
    Releasing,
}

/// Made only once `session` granted a [`LockSession::claim`] of
/// `advisory_key`, which its drop gives back: so a session's claims are
/// exactly the advisory keys of the `Held` entries on it (and, while it
/// runs, the one of a failed lock statement's undo).
struct Holding {
    session: Arc<LockSession>,
    advisory_key: i64,
    /// The token drawn for it, for a retry by the same owner.
    token: FencingToken,
    /// When the backend unlocks the key unless it is extended (the
    /// deadline), and the hold's place in the backend's expiry queue, which
    /// it leaves when the hold ends.
    expiry: Slot,
    expiries: Arc<Expiries>,
}

impl Holding {
    fn deadline(&self) -> Instant {
        self.expiry.0
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        self.expiries.remove(self.expiry);
        self.session.unclaim(self.advisory_key);
    }
}

impl Entry {
    fn new(owner: OwnerId) -> Self {
        Self {
            owner,
            gone: None,
            state: State::Acquiring,
        }
    }

    fn holding(&self) -> Option<&Holding> {
        match &self.state {
            State::Held(holding) => Some(holding),
            State::Acquiring | State::Releasing => None,
        }
    }
}

impl PgBackend {
    /// Connects with default [`PgOptions`]. `conn` is a tokio-postgres
    /// connection string, key-value (`host=127.0.0.1 user=app dbname=app
    /// sslmode=require`) or URL (`postgresql://app:secret@db:5432/app`).
    ///
    /// Opens the first lock session (so a wrong password or an unreachable
    /// host is an error here, within the connect timeout), creates the
    /// schema objects if they are missing, and refuses a token sequence
    /// that cannot give rising tokens (see the [module docs](self#fencing-tokens)).
    pub async fn connect(conn: &str) -> Result<Self, LockError> {
        Self::connect_with(conn, PgOptions::new()).await
    }

    /// Connects with the given options; see [`PgBackend::connect`].
    pub async fn connect_with(conn: &str, options: PgOptions) -> Result<Self, LockError> {
        let quoted_schema = options.validate()?;
        let connect_error =
            |what: String| LockError::backend(KIND, Operation::Connect, "", Failure::msg(what));
        if misplaced_at_sign(conn) {
            return Err(connect_error(
                "the connection URL has an `@` that does not end its user info (one after the \
                 host, in the path or the query, or a second one before the host): write every \
                 `@` in the user name, the password and the query as %40, and `/`, `?` and `#` \
                 in the user name and the password as %2F, %3F and %23 (the URL is not shown: \
                 it may hold a password)"
                    .to_owned(),
            ));
        }
        // The parser's messages name the offending option, never its value,
        // so the password cannot leak through them.
        let mut config = Config::from_str(conn)
            .map_err(|e| connect_error(format!("invalid PostgreSQL connection string: {e}")))?;
        // An `@` left unencoded in a URL's user or password makes the
        // parser take the rest of it for the host name, which every error
        // and `Debug` would then show.
        if config.get_hosts().iter().any(
            |host| matches!(host, tokio_postgres::config::Host::Tcp(name) if name.contains('@')),
        ) {
            return Err(connect_error(
                "the connection URL has an unencoded `@` in its user name or password: \
                 write it as %40 (the host is not shown: it would hold part of the password)"
                    .to_owned(),
            ));
        }
        tls::require_when_verifying(&mut config, &options.tls).map_err(|reason| {
            LockError::InvalidOption {
                option: "tls",
                reason,
            }
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(options.connect_timeout);
        }
        if config.get_application_name().is_none() {
            config.application_name("dlock");
        }
        let connect_timeout = config
            .get_connect_timeout()
            .copied()
            .unwrap_or(options.connect_timeout);
        let tls = tls::connector(&options.tls).map_err(connect_error)?;
        let home = Arc::new(Home::here().ok_or_else(|| {
            connect_error("PgBackend::connect must be called on a Tokio runtime".to_owned())
        })?);
        let connector = Connector::new(config, tls, connect_timeout, Arc::clone(&home));
        let waits = Waits::new(
            connector.clone(),
            &quoted_schema,
            options.key_seed,
            options.wait_sessions,
        );
        let inner = Arc::new(Inner {
            try_lock_sql: sql::render(sql::TRY_LOCK, &quoted_schema),
            unlock_key_sql: "SELECT pg_catalog.pg_advisory_unlock(
                pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8))"
                .to_owned(),
            terminate_sql: sql::render(sql::TERMINATE_HOLDERS, &quoted_schema),
            slots: (0..options.sessions)
                .map(|_| SessionSlot::default())
                .collect(),
            next_slot: AtomicUsize::new(0),
            next_session_id: AtomicU64::new(0),
            restoring: AsyncMutex::new(None),
            restorations: AtomicU64::new(0),
            keys: Mutex::default(),
            expiries: Arc::new(Expiries::new(Arc::clone(&home))),
            waits,
            home,
            connector,
            options,
            quoted_schema,
        });
        inner.session().await?;
        Ok(Self { inner })
    }

    /// The advisory key `key` maps to (`hashtextextended(key, seed)`,
    /// asked of the server), to find the lock in `pg_locks`: a `bigint`
    /// advisory key shows there as `classid` (high 32 bits), `objid` (low
    /// 32 bits) and `objsubid = 1`.
    pub async fn advisory_key(&self, key: &LockKey) -> Result<i64, LockError> {
        let session = self.inner.session().await?;
        let row = session
            .query_one(
                sql::ADVISORY_KEY,
                &[&key.as_str(), &self.inner.options.key_seed],
            )
            .await
            .map_err(|e| {
                self.inner
                    .failed(Operation::Acquire, key, "cannot hash the key", e)
            })?;
        row.try_get(0).map_err(|e| {
            self.inner
                .failed(Operation::Acquire, key, "unexpected answer", e)
        })
    }

    /// The server process ids of the sessions (of any client, this backend
    /// included unless the question runs on the holding session itself)
    /// that hold `key`, for inspection: `pg_stat_activity` tells more.
    pub async fn holder_pids(&self, key: &LockKey) -> Result<Vec<i32>, LockError> {
        let session = self.inner.session().await?;
        let rows = session
            .query(sql::HOLDERS, &[&key.as_str(), &self.inner.options.key_seed])
            .await
            .map_err(|e| {
                self.inner
                    .failed(Operation::Acquire, key, "cannot list holders", e)
            })?;
        rows.iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()
            .map_err(|e| {
                self.inner
                    .failed(Operation::Acquire, key, "unexpected answer", e)
            })
    }

    /// The server process ids of this backend's open lock sessions.
    pub async fn session_pids(&self) -> Vec<i32> {
        let mut pids = Vec::new();
        for slot in &self.inner.slots {
            if let Some(session) = slot.live() {
                pids.push(session.pid);
            }
        }
        pids
    }
}

impl std::fmt::Debug for PgBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgBackend")
            .field("target", &self.inner.connector.target())
            .field("schema", &self.inner.quoted_schema)
            .field("sessions", &self.inner.options.sessions)
            .finish_non_exhaustive()
    }
}

impl Inner {
    fn keys(&self) -> MutexGuard<'_, HashMap<LockKey, Entry>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn failed(
        &self,
        operation: Operation,
        key: &LockKey,
        what: &str,
        err: tokio_postgres::Error,
    ) -> LockError {
        LockError::backend(KIND, operation, key.as_str(), Failure::new(what, err))
    }

    /// How long a lock statement waits for a lock on the token sequence (an
    /// `ALTER SEQUENCE` left open holds one) before it fails: half the
    /// liveness interval, so the liveness ping queued behind it still gets
    /// its answer in time and the session's other leases live on.
    fn lock_timeout(&self) -> Duration {
        self.options.liveness_interval / 2
    }

    /// A live lock session, opening one in its slot if needed. Slots are
    /// used in turn; a dead session is replaced here.
    async fn session(self: &Arc<Self>) -> Result<Arc<LockSession>, LockError> {
        let turn = self.next_slot.fetch_add(1, Ordering::Relaxed);
        let Some(slot) = self.slots.get(turn % self.slots.len().max(1)) else {
            return Err(LockError::backend(
                KIND,
                Operation::Connect,
                "",
                Failure::msg("no lock session slot"),
            ));
        };
        match slot.live() {
            Some(session) => Ok(session),
            // Boxed: opening a session is rare and its future is large;
            // every acquisition's future would otherwise carry its size.
            None => Box::pin(self.open_in(slot)).await,
        }
    }

    /// Opens a session in `slot`, unless another caller just did.
    async fn open_in(self: &Arc<Self>, slot: &SessionSlot) -> Result<Arc<LockSession>, LockError> {
        // One opener per slot; whoever waited for it uses what it opened.
        let _opening = slot.opening.lock().await;
        if let Some(session) = slot.live() {
            return Ok(session);
        }
        let session = self
            .open_session()
            .await
            .map_err(|e| LockError::backend(KIND, Operation::Connect, "", e))?;
        *slot.current() = Some(Arc::clone(&session));
        Ok(session)
    }

    async fn open_session(self: &Arc<Self>) -> Result<Arc<LockSession>, Failure> {
        let id = self.next_session_id.fetch_add(1, Ordering::Relaxed);
        let (ended_tx, ended) = watch::channel(None);
        let (kill, killed) = oneshot::channel();
        let weak = Arc::downgrade(self);
        let loss = LossGroup::new();
        let pid_known = Arc::new(AtomicI32::new(0));
        let ending = SessionEnding::new(Arc::clone(&loss), Arc::clone(&pid_known));
        let mut client = self
            .connector
            .open(self.lock_timeout(), killed, move |why| {
                ended_tx.send_replace(Some(why.clone()));
                ending.end(&why);
                if let Some(inner) = weak.upgrade() {
                    inner.session_ended(id, &why);
                }
            })
            .await?;
        // Every session, not only the first: a DBA may have dropped or
        // altered the token sequence since. One catalog query when all is well.
        self.ensure_objects(&mut client).await?;
        let setup = async {
            let idle_ms = self
                .options
                .server_idle_timeout
                .map(|idle| idle.as_millis().to_string());
            let pid: i32 = client
                .query_one(sql::LOCK_SESSION_SETUP, &[&idle_ms])
                .await?
                .try_get(0)?;
            let try_lock = client.prepare(&self.try_lock_sql).await?;
            let unlock = client.prepare(sql::UNLOCK).await?;
            Ok::<_, tokio_postgres::Error>((pid, try_lock, unlock))
        };
        let (pid, try_lock, unlock) = setup
            .await
            .map_err(|e| Failure::new("cannot prepare a lock session", e))?;
        pid_known.store(pid, Ordering::Release);
        let session = Arc::new(LockSession::new(
            id,
            pid,
            client,
            (try_lock, unlock),
            ended,
            kill,
            loss,
        ));
        self.home.spawn(session::check_liveness(
            Arc::downgrade(&session),
            self.options.liveness_interval,
        ));
        tracing::debug!(
            pid,
            target = self.connector.target(),
            "PostgreSQL lock session opened"
        );
        Ok(session)
    }

    /// Creates the schema and the token sequence when missing, checks the
    /// privileges on them, and refuses a sequence whose settings cannot give
    /// rising tokens.
    async fn ensure_objects(&self, client: &mut tokio_postgres::Client) -> Result<(), Failure> {
        let schema = self.options.schema.as_str();
        let inspect_sql = sql::INSPECT_OBJECTS;
        let inspect_failed = |e: tokio_postgres::Error| {
            let what = if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
                "cannot inspect the token sequence: another transaction holds a lock on it \
                 (an ALTER SEQUENCE or a DROP left open?)"
            } else {
                "cannot inspect the schema objects"
            };
            Failure::new(what, e)
        };
        let row = client
            .query_one(inspect_sql, &[&schema])
            .await
            .map_err(inspect_failed)?;
        let mut found = Inspection::from_row(&row).map_err(inspect_failed)?;
        if !found.schema_exists || !found.sequence_exists {
            let created = async {
                let tx = client.transaction().await?;
                // A lock session waits for locks only briefly (see
                // `sql::SESSION_DEFAULTS`); creating may wait for another
                // backend creating at the same moment, up to the connect
                // timeout.
                let setup_wait = self
                    .connector
                    .connect_timeout()
                    .as_millis()
                    .max(1)
                    .to_string();
                tx.query_one(sql::SET_LOCAL_LOCK_TIMEOUT, &[&setup_wait])
                    .await?;
                tx.query_one(sql::SETUP_LOCK, &[]).await?;
                // Look again under the lock: another backend may just have
                // created them, and CREATE checks privileges before IF NOT EXISTS.
                let again = Inspection::from_row(&tx.query_one(inspect_sql, &[&schema]).await?)?;
                if !again.schema_exists {
                    tx.batch_execute(&sql::render(sql::CREATE_SCHEMA, &self.quoted_schema))
                        .await?;
                }
                if !again.sequence_exists {
                    tx.batch_execute(&sql::render(sql::CREATE_SEQUENCE, &self.quoted_schema))
                        .await?;
                }
                tx.commit().await
            };
            if let Err(err) = created.await {
                let what = if err.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) {
                    format!(
                        "role {} may not create the objects dlock needs in schema {}; \
                         have a DBA run: {} (or choose a usable schema with PgOptions::schema)",
                        found.role,
                        self.quoted_schema,
                        sql::ddl_for_dba(&self.quoted_schema, &found.role)
                    )
                } else {
                    format!("cannot create the schema objects in {}", self.quoted_schema)
                };
                return Err(Failure::new(what, err));
            }
            let row = client
                .query_one(inspect_sql, &[&schema])
                .await
                .map_err(inspect_failed)?;
            found = Inspection::from_row(&row).map_err(inspect_failed)?;
        }
        if !found.schema_usable || !found.sequence_usable {
            return Err(Failure::msg(format!(
                "role {} lacks privileges on the objects dlock needs (USAGE on schema {s}, \
                 USAGE on sequence {s}.dlock_token_seq); have a DBA run: {}",
                found.role,
                sql::ddl_for_dba(&self.quoted_schema, &found.role),
                s = self.quoted_schema,
            )));
        }
        match &found.settings {
            Some(settings) => settings.check(&self.quoted_schema)?,
            // Dropped again between creating it and looking at it.
            None => {
                return Err(Failure::msg(format!(
                    "the token sequence {}.dlock_token_seq vanished while it was being checked",
                    self.quoted_schema
                )));
            }
        }
        if !found.sequence_updatable {
            tracing::warn!(
                role = found.role,
                schema = self.quoted_schema,
                "no UPDATE on the token sequence: fencing tokens rest on the server clock \
                 alone, so a clock step back lowers them; GRANT UPDATE on it to protect them"
            );
        }
        Ok(())
    }

    /// Recreates what a lock statement found missing — a DBA dropped the
    /// token sequence, or its schema, while the service runs — so locking
    /// goes on instead of failing until someone notices. Safe because every
    /// token is floored by the clock: a fresh sequence cannot hand out a
    /// token at or below an earlier one. A role that may not create it gets
    /// the error naming the DDL for a DBA.
    ///
    /// On a connection of its own: creating needs a transaction, and a lock
    /// session carries other leases' statements. Acquisitions that failed
    /// together try once, and share the outcome.
    async fn restore_objects(&self) -> Result<(), Failure> {
        let seen = self.restorations.load(Ordering::Acquire);
        let mut last_failure = self.restoring.lock().await;
        if self.restorations.load(Ordering::Acquire) != seen {
            // Tried while this caller waited: its outcome is this caller's.
            return match &*last_failure {
                None => Ok(()),
                Some(why) => Err(Failure::msg(why.clone())),
            };
        }
        let restored = async {
            // Dropping `close` closes the connection.
            let (close, closed) = oneshot::channel();
            let mut client = self
                .connector
                .open(self.connector.connect_timeout(), closed, |_| {})
                .await?;
            let ensured = self.ensure_objects(&mut client).await;
            drop(close);
            ensured
        }
        .await
        .map_err(|e| {
            e.context(format!(
                "the token sequence {}.dlock_token_seq is missing (dropped while the service runs?)",
                self.quoted_schema
            ))
        });
        *last_failure = restored.as_ref().err().map(ToString::to_string);
        self.restorations.fetch_add(1, Ordering::AcqRel);
        if restored.is_ok() {
            tracing::warn!(
                schema = self.quoted_schema,
                "a lock statement found the token sequence missing; it exists again \
                 (tokens stay above the clock)"
            );
        }
        restored
    }

    /// A lock session ended: its locks are gone on the server, so this
    /// process forgets them (which wakes its waiters); its leases learn it
    /// through the session's loss group.
    fn session_ended(&self, id: u64, why: &str) {
        let mut keys = self.keys();
        let before = keys.len();
        keys.retain(|_, entry| entry.holding().is_none_or(|h| h.session.id != id));
        let lost = before - keys.len();
        drop(keys);
        if lost > 0 {
            tracing::warn!(
                leases = lost,
                reason = why,
                "PostgreSQL lock session ended; its leases are lost"
            );
        } else {
            tracing::debug!(reason = why, "PostgreSQL lock session ended");
        }
    }

    /// Removes `key`'s entry if it still belongs to `owner`.
    fn forget(&self, key: &LockKey, owner: OwnerId) {
        let mut keys = self.keys();
        if keys.get(key).is_some_and(|entry| entry.owner == owner) {
            keys.remove(key);
        }
    }

    /// Held by another process, whose ttl this process cannot see: the
    /// waiter relies on the release notice (a server-side probe, or a
    /// recheck when none could watch the key).
    fn held_elsewhere(&self) -> Attempt {
        Attempt::Held { expires_in: None }
    }

    /// Sends the lock statement: the advisory key and the token (None:
    /// held). A session found dead is replaced once.
    async fn try_lock(
        self: &Arc<Self>,
        key: &LockKey,
        in_flight: &mut Option<Arc<LockSession>>,
    ) -> Result<(Arc<LockSession>, i64, Option<i64>), LockError> {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
            [&key.as_str(), &self.options.key_seed];
        let mut retried = false;
        let mut restored = false;
        loop {
            let session = self.session().await?;
            *in_flight = Some(Arc::clone(&session));
            let answer = session.query_one(&session.try_lock, &params).await;
            let err = match answer {
                Ok(row) => {
                    let parsed = row.try_get(0).and_then(|h| Ok((h, row.try_get(1)?)));
                    return match parsed {
                        Ok((advisory_key, token)) => Ok((session, advisory_key, token)),
                        Err(e) => Err(self.failed(Operation::Acquire, key, "unexpected answer", e)),
                    };
                }
                Err(err) => err,
            };
            if (err.is_closed() || session.is_ended()) && !retried {
                retried = true;
                continue;
            }
            // A session lock outlives the statement that took it, so a
            // failure after `pg_try_advisory_lock` leaves the lock held.
            if !err.is_closed() && !session.is_ended() {
                Box::pin(self.undo_failed_lock(&session, key, &err)).await;
            }
            *in_flight = None;
            if sql::sequence_missing(&err) && !restored {
                restored = true;
                Box::pin(self.restore_objects())
                    .await
                    .map_err(|e| LockError::backend(KIND, Operation::Acquire, key.as_str(), e))?;
                continue;
            }
            if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
                let what = format!(
                    "the token sequence {}.dlock_token_seq is locked by another transaction \
                     (an ALTER SEQUENCE or a DROP left open?) for longer than a lock session \
                     waits for it ({:?}): the lock was not taken; try again once that \
                     transaction has ended",
                    self.quoted_schema,
                    self.lock_timeout()
                );
                return Err(LockError::backend(
                    KIND,
                    Operation::Acquire,
                    key.as_str(),
                    Failure::new(what, err),
                ));
            }
            return Err(self.failed(Operation::Acquire, key, "lock statement failed", err));
        }
    }

    async fn acquire_on_server(
        self: &Arc<Self>,
        key: &LockKey,
        owner: OwnerId,
        ttl: Duration,
    ) -> Result<Attempt, LockError> {
        let mut unfinished = Unfinished::new(self, key, owner);
        let attempt = self.try_lock(key, &mut unfinished.in_flight).await;
        let (session, advisory_key, token) = match attempt {
            Ok(answer) => answer,
            Err(err) => {
                unfinished.finish();
                self.forget(key, owner);
                return Err(err);
            }
        };
        let Some(token) = token else {
            unfinished.finish();
            self.forget(key, owner);
            return Ok(self.held_elsewhere());
        };
        let token = match xact::to_token(token, key.as_str()) {
            Ok(token) => token,
            Err(err) => {
                self.forget(key, owner);
                Box::pin(self.give_back(&session, advisory_key)).await;
                unfinished.finish();
                return Err(err);
            }
        };
        let deadline = Instant::now() + ttl;
        let held = {
            let mut keys = self.keys();
            match keys.get_mut(key) {
                // The claim fails when a different key with the same
                // advisory key is held on the same session (this key's own
                // entry is still `Acquiring`, so it has no claim): the server
                // said yes only because advisory locks are re-entrant. That
                // is contention, not a grant. Claimed under the key map's
                // lock, so the check and the hold are one step.
                Some(entry)
                    if entry.owner == owner
                        && matches!(entry.state, State::Acquiring)
                        && session.claim(advisory_key) =>
                {
                    // Queued under the key map's lock, so the hold and its
                    // deadline are one step.
                    let expiry = self
                        .expiries
                        .add(Arc::downgrade(self), key, owner, deadline);
                    entry.state = State::Held(Holding {
                        session: Arc::clone(&session),
                        advisory_key,
                        token,
                        expiry,
                        expiries: Arc::clone(&self.expiries),
                    });
                    true
                }
                _ => false,
            }
        };
        if !held {
            self.forget(key, owner);
            Box::pin(self.give_back(&session, advisory_key)).await;
            unfinished.finish();
            return Ok(Attempt::Held { expires_in: None });
        }
        unfinished.finish();
        Ok(Attempt::Acquired(
            Grant::new(token).lost_with(session.loss_group()),
        ))
    }

    /// Undoes what a lock statement that failed with `err` may have left on
    /// `session`: the lock of the key's advisory key, if the statement took
    /// it before a later step failed. Only what this attempt took: a plain
    /// unlock of the advisory key drops one hold, which, if this attempt
    /// took none, is the hold of another lease of this session whose key
    /// has the same 64-bit hash.
    async fn undo_failed_lock(
        &self,
        session: &LockSession,
        key: &LockKey,
        err: &tokio_postgres::Error,
    ) {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
            [&key.as_str(), &self.options.key_seed];
        match sql::lock_left_by(err) {
            sql::LockLeft::No => {}
            // This attempt holds the lock (once more, if another lease of
            // the session holds the same advisory key): one unlock drops
            // exactly its hold.
            sql::LockLeft::Yes => {
                if session
                    .query_one(&self.unlock_key_sql, &params)
                    .await
                    .is_err()
                {
                    session.end(format!("could not undo a failed lock of `{key}`"));
                }
            }
            sql::LockLeft::Unknown => {
                let advisory_key = match session.query_one(sql::ADVISORY_KEY, &params).await {
                    Ok(row) => row.try_get::<_, i64>(0),
                    Err(err) => Err(err),
                };
                let Ok(advisory_key) = advisory_key else {
                    session.end(format!("could not undo a failed lock of `{key}`"));
                    return;
                };
                // A claim of its own while it unlocks: a lease of another
                // key with the same advisory key that the server grants on
                // this session meanwhile cannot claim it, and gives its
                // hold back. (One granted before the unlock but claiming
                // only after it is the one case left: a 64-bit collision
                // of two keys taken at that instant on one session.)
                if !session.claim(advisory_key) {
                    session.end(format!(
                        "a lock statement for `{key}` failed without saying whether it took the \
                         lock, and a lease of another key with the same advisory key holds it on \
                         this session: only ending the session surely drops what it took"
                    ));
                    return;
                }
                let unlocked = session.query_one(&session.unlock, &[&advisory_key]).await;
                session.unclaim(advisory_key);
                if unlocked.is_err() {
                    session.end(format!("could not undo a failed lock of `{key}`"));
                }
            }
        }
    }

    /// Drops one hold of `advisory_key` on `session` that no lease owns.
    async fn give_back(&self, session: &LockSession, advisory_key: i64) {
        if session
            .query_one(&session.unlock, &[&advisory_key])
            .await
            .is_err()
        {
            session.end("could not give back an unowned lock".to_owned());
        }
    }

    /// Unlocks `key` on its session. `owner: None` is the administrator's
    /// force; `expiring` only unlocks a lease whose deadline has passed.
    /// `Ok(true)` when a live lease of `owner` was released.
    async fn unlock(
        self: &Arc<Self>,
        key: &LockKey,
        owner: Option<OwnerId>,
        expiring: bool,
    ) -> Result<bool, LockError> {
        let (session, advisory_key, live, entry_owner) = {
            let mut keys = self.keys();
            let Some(entry) = keys.get_mut(key) else {
                return Ok(false);
            };
            if owner.is_some_and(|owner| owner != entry.owner) {
                return Ok(false);
            }
            let Some(holding) = entry.holding() else {
                return Ok(false);
            };
            let live = holding.deadline() > Instant::now();
            if expiring && live {
                return Ok(false);
            }
            let State::Held(holding) = std::mem::replace(&mut entry.state, State::Releasing) else {
                return Ok(false);
            };
            (
                Arc::clone(&holding.session),
                holding.advisory_key,
                live,
                entry.owner,
            )
        };
        // Finished even if the caller gives up half-way, so the key cannot
        // stay marked as releasing for ever: at home (see `home`).
        let inner = Arc::clone(self);
        let unlocked_key = key.clone();
        let unlocked_on = Arc::clone(&session);
        let unlocking = self.home.run_detachable(
            async move {
                let key = unlocked_key;
                let mut unfinished = Unfinished::new(&inner, &key, entry_owner);
                unfinished.in_flight = Some(Arc::clone(&session));
                let outcome = session.query_one(&session.unlock, &[&advisory_key]).await;
                unfinished.finish();
                inner.forget(&key, entry_owner);
                match outcome {
                    Ok(row) => Ok(row.try_get::<_, bool>(0).unwrap_or(false)),
                    // The session is gone, and every lock it held with it.
                    Err(err) if err.is_closed() || session.is_ended() => Ok(false),
                    Err(err) => {
                        // Ending the session is the one sure way to drop the lock.
                        session.end(format!("could not release `{key}`"));
                        Err(inner.failed(Operation::Release, &key, "unlock failed", err))
                    }
                }
            },
            Ignore,
        );
        match unlocking.await {
            Ok(released) => Ok(live && released?),
            Err(NoRuntime) => {
                // Not unlocked, and nowhere to do it: ending the session
                // frees the lock on the server.
                self.forget(key, entry_owner);
                unlocked_on.end(format!("no runtime left to release `{key}` on"));
                Err(no_runtime(Operation::Release, key))
            }
        }
    }
}

/// Cleans up after work on a key that is dropped before it finished, which
/// happens only when the runtime running it shuts down: forgets the key's
/// entry, so this process does not take it for held or being taken for
/// ever, and ends the session a statement of it was sent on, which may hold
/// a lock nobody will give back (that session's connection most likely
/// went with the same runtime; this makes sure).
struct Unfinished<'a> {
    inner: &'a Inner,
    key: &'a LockKey,
    owner: OwnerId,
    in_flight: Option<Arc<LockSession>>,
    finished: bool,
}

impl<'a> Unfinished<'a> {
    fn new(inner: &'a Inner, key: &'a LockKey, owner: OwnerId) -> Self {
        Self {
            inner,
            key,
            owner,
            in_flight: None,
            finished: false,
        }
    }

    /// The work got to its end: nothing to clean up.
    fn finish(&mut self) {
        self.finished = true;
    }
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        self.inner.forget(self.key, self.owner);
        if let Some(session) = self.in_flight.take() {
            session.end(format!(
                "work on `{}` was dropped half-way (its runtime shut down)",
                self.key
            ));
        }
    }
}

/// The error when no runtime is left to run the backend's work on.
fn no_runtime(operation: Operation, key: &LockKey) -> LockError {
    LockError::backend(
        KIND,
        operation,
        key.as_str(),
        Failure::msg(
            "the runtime the PostgreSQL backend runs on shut down, and no other runtime is \
             there to take over",
        ),
    )
}

/// Gives back a lock the server granted to a caller that stopped waiting.
struct GiveBack {
    inner: Arc<Inner>,
    key: LockKey,
    owner: OwnerId,
}

impl AbandonedWith<Result<Attempt, LockError>> for GiveBack {
    async fn handle(self, outcome: Result<Attempt, LockError>) {
        if let Ok(Attempt::Acquired(_)) = outcome {
            let _ = self.inner.unlock(&self.key, Some(self.owner), false).await;
        }
    }
}

struct Inspection {
    schema_exists: bool,
    sequence_exists: bool,
    schema_usable: bool,
    sequence_usable: bool,
    role: String,
    sequence_updatable: bool,
    settings: Option<sequence::Settings>,
}

impl Inspection {
    /// Reads a row of [`sql::INSPECT_OBJECTS`].
    fn from_row(row: &tokio_postgres::Row) -> Result<Self, tokio_postgres::Error> {
        let increment: Option<i64> = row.try_get(6)?;
        let settings = match increment {
            Some(increment) => Some(sequence::Settings {
                increment,
                cache: row.try_get(7)?,
                cycle: row.try_get(8)?,
                max: row.try_get(9)?,
                data_type: row.try_get(10)?,
                clock_us: row.try_get(11)?,
                last_value: row.try_get(12)?,
                start: row.try_get(13)?,
            }),
            None => None,
        };
        Ok(Self {
            schema_exists: row.try_get(0)?,
            sequence_exists: row.try_get(1)?,
            schema_usable: row.try_get(2)?,
            sequence_usable: row.try_get(3)?,
            role: row.try_get(4)?,
            sequence_updatable: row.try_get(5)?,
            settings,
        })
    }
}

/// The session `owner`'s live lease on `key` is held on, if there is one.
fn live_session(
    keys: &HashMap<LockKey, Entry>,
    key: &LockKey,
    owner: &OwnerId,
) -> Option<Arc<LockSession>> {
    keys.get(key)
        .filter(|entry| entry.owner == *owner)
        .and_then(Entry::holding)
        .filter(|h| h.deadline() > Instant::now())
        .map(|h| Arc::clone(&h.session))
}

#[async_trait]
impl Backend for PgBackend {
    fn kind(&self) -> &'static str {
        KIND
    }

    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        let (key, owner, ttl) = (request.key, request.owner, request.ttl);
        {
            // In-process exclusion first: never ask the server for a key
            // this process holds or is taking (re-entrancy would say yes).
            let mut keys = self.inner.keys();
            if let Some(entry) = keys.get_mut(key) {
                let now = Instant::now();
                // A retry by the owner that holds it (its first answer was
                // lost): it has the key, with its token, for a ttl from now.
                if entry.owner == *owner
                    && let State::Held(holding) = &mut entry.state
                    && holding.deadline() > now
                {
                    holding.expiry =
                        self.inner
                            .expiries
                            .moved(holding.expiry, key, *owner, now + ttl);
                    return Ok(Attempt::Acquired(
                        Grant::new(holding.token).lost_with(holding.session.loss_group()),
                    ));
                }
                return Ok(Attempt::Held {
                    expires_in: entry
                        .holding()
                        .map(|h| h.deadline().saturating_duration_since(now)),
                });
            }
            keys.insert(key.clone(), Entry::new(*owner));
        }
        // If the caller is cancelled after the server granted the lock, the
        // rest runs on in a task of its own, which gives the lock back
        // instead of leaking it.
        let give_back = GiveBack {
            inner: Arc::clone(&self.inner),
            key: key.clone(),
            owner: *owner,
        };
        let owner = *owner;
        let attempt = {
            let (inner, key) = (Arc::clone(&self.inner), key.clone());
            async move { inner.acquire_on_server(&key, owner, ttl).await }
        };
        match self.inner.home.run_detachable(attempt, give_back).await {
            Ok(outcome) => outcome,
            Err(NoRuntime) => {
                self.inner.forget(key, owner);
                Err(no_runtime(Operation::Acquire, key))
            }
        }
    }

    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        self.extend_many(std::slice::from_ref(renewal))
            .await
            .pop()
            .unwrap_or(Ok(false))
    }

    /// A lock lives exactly as long as its session, so one round trip on a
    /// session proves every lease on it: the batch costs one check per
    /// session, however many leases it renews.
    async fn extend_many(&self, leases: &[Renewal<'_>]) -> Vec<Result<bool, LockError>> {
        let held_on: Vec<Option<Arc<LockSession>>> = {
            let keys = self.inner.keys();
            leases
                .iter()
                .map(|lease| live_session(&keys, lease.key, lease.owner))
                .collect()
        };
        // Per session: the check's failure, if any, as text, and as the
        // error itself for the first lease it fails (the others get its text).
        let mut checked: Vec<(u64, Option<(String, Option<Failure>)>)> = Vec::new();
        for session in held_on.iter().flatten() {
            if checked.iter().any(|(id, _)| *id == session.id) {
                continue;
            }
            let failure = match session.check_connection().await {
                Ok(()) => None,
                Err(err) => {
                    let failure = Failure::new("lock session check failed", err);
                    Some((failure.to_string(), Some(failure)))
                }
            };
            checked.push((session.id, failure));
        }
        let mut keys = self.inner.keys();
        let now = Instant::now();
        leases
            .iter()
            .zip(held_on)
            .map(|(lease, session)| {
                let Some(session) = session else {
                    return Ok(false);
                };
                match checked.iter_mut().find(|(id, _)| *id == session.id) {
                    Some((_, None)) => {}
                    Some((_, Some((text, failure)))) => {
                        let failure = failure.take().unwrap_or_else(|| Failure::msg(text.clone()));
                        return Err(LockError::backend(
                            KIND,
                            Operation::Extend,
                            lease.key.as_str(),
                            failure,
                        ));
                    }
                    None => return Ok(false),
                }
                match live_session(&keys, lease.key, lease.owner) {
                    Some(now_on) if now_on.id == session.id => {
                        if let Some(State::Held(holding)) =
                            keys.get_mut(lease.key).map(|e| &mut e.state)
                        {
                            holding.expiry = self.inner.expiries.moved(
                                holding.expiry,
                                lease.key,
                                *lease.owner,
                                now + lease.ttl,
                            );
                        }
                        Ok(true)
                    }
                    _ => Ok(false),
                }
            })
            .collect()
    }

    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
        let (key, owner) = (lease.key, lease.owner);
        let released = self.inner.unlock(key, Some(*owner), false).await?;
        Ok(ReleaseOutcome::from_released(released))
    }

    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        if let Some(entry) = self.inner.keys().get_mut(key) {
            // Held (or being taken) here: its entry going away is the signal.
            let mut gone = entry
                .gone
                .get_or_insert_with(|| watch::channel(()).0)
                .subscribe();
            return Ok(ReleaseNotice::new(async move {
                let _ = gone.changed().await;
            }));
        }
        Ok(self.inner.waits.watch(key).unwrap_or_else(|| {
            ReleaseNotice::new(std::future::pending()).recheck_within(UNWATCHED_RECHECK)
        }))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        // Held here: unlock it on our own session, so our other leases live on.
        if self.inner.unlock(key, None, false).await? {
            return Ok(true);
        }
        // Held elsewhere: only the holding session can drop an advisory
        // lock, so end that session.
        let session = self.inner.session().await?;
        let rows = session
            .query(
                &self.inner.terminate_sql,
                &[&key.as_str(), &self.inner.options.key_seed, &TERMINATE_WAIT_MS],
            )
            .await
            .map_err(|e| {
                self.inner.failed(
                    Operation::Release,
                    key,
                    "cannot end the session holding it (needs pg_signal_backend or the holder's role)",
                    e,
                )
            })?;
        for row in &rows {
            let pid: Option<i32> = row.try_get(0).ok();
            let gone: bool = row.try_get(1).unwrap_or(false);
            tracing::warn!(key = %key, pid, gone, "force release: ended the PostgreSQL session holding the key");
        }
        Ok(!rows.is_empty())
    }
}

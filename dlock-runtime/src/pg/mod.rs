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
//! A lock key maps to the 64-bit advisory key `hashtextextended(key, seed)`
//! ([`PgOptions::key_seed`], 0 by default), PostgreSQL's own stable text
//! hash, so any client in any language takes the same lock with
//! `SELECT pg_try_advisory_lock(hashtextextended('my-key', 0))`. The
//! backend computes it in process too (each session checks that the server
//! agrees), to know which leases and attempts on a session share an
//! advisory key: a collision is false contention, never lost exclusion.
//! The full key stays in process for errors and inspection
//! ([`PgBackend::advisory_key`], [`PgBackend::holder_pids`]). What
//! collisions cost, and the seed that keeps untrusted keys apart:
//! docs/postgres.md, "Key mapping".
//!
//! # Fencing tokens
//!
//! One statement takes the lock and, only if it was taken, draws the token:
//! the next value of the sequence `<schema>.dlock_token_seq`, or, when the
//! server clock (`clock_timestamp()` in microseconds) has passed it, the
//! clock plus the sequence's token lead (10 ms on a sequence dlock
//! creates), which the statement then `setval`s — so the clock floors
//! tokens when the sequence goes back (dropped, set back, restored) and the
//! sequence carries them when the clock steps back. A sequence whose
//! settings cannot give rising tokens is refused, when a lock session opens
//! and by the draw itself, with the `ALTER SEQUENCE` that fixes it. While
//! the sequence leads the clock the backend sends a quick statement that
//! holds only the draw from `nextval` (see `quick`). Tokens of one key rise
//! strictly unless the sequence went back *and* the clock stepped back at
//! once; tokens of different keys may be equal. The proof, races between
//! sessions included, is next to the lock statement (`pg/sql/lock.rs`);
//! the objects a DBA can pre-create, the grants and what a token costs are
//! in docs/postgres.md.
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
//! # Who holds a key
//!
//! [`Backend::holder`](crate::Backend::holder) reads the session that holds
//! the key's advisory lock from `pg_locks`.
//!
//! A lock without an identity writes nothing when it is taken or let go.
//! Its lock statement also takes two *token marks*, shared advisory locks
//! in the `(int4, int4)` form that carry its fencing token, beside the
//! key's lock, and its release drops them with it; who its session is
//! (this process's host and pid and the label, [`PgOptions::label`] over
//! the process's, see [`HolderInfo`](crate::HolderInfo)) is written once
//! per session in `<schema>.dlock_sessions`, and which key its advisory key
//! stands for once per key and process in `<schema>.dlock_keys`, in a
//! statement pipelined ahead of the first lock (see the `names` module).
//! A reader takes the token from the marks of the session holding the lock
//! (only when exactly one mark of each half is there: a missing or extra
//! one reads as no token, never another lease's), the holder from that
//! session's name (only for a session with its pid *and* start, so a dead
//! session's name never names a later one), and how long the key has been
//! held from the token, which is the server's clock in microseconds at
//! the draw unless the token sequence ran ahead of it (it then reads short
//! by that lead). [`Backend::held`](crate::Backend::held) lists the held
//! keys a dlock named (`starts_with`, so `%` and `_` in a prefix are data).
//!
//! A lock with an identity (a leader) records who took it in the table
//! `<schema>.dlock_holders`, in the statement that takes the lock, and
//! deletes the row in the statement that drops it: the key, its token, the
//! session (pid and start time), the identity, the holder record and
//! `since`, the server's time of acquisition. A reader believes a record
//! only when it names the session holding the lock. A reader of another
//! role than the holder's sees the holder's name or record only if it is a
//! member of that role or of `pg_read_all_stats` (PostgreSQL hides when
//! other roles' sessions started); the marks it sees all the same. A key
//! held by a [`TransactionLock`], with [`PgOptions::record_holders`] off or
//! by any other client reads as held by someone unknown, and `held` lists
//! it only if a dlock named the key.
//!
//! The tables are created on the first acquisition, never at connect; a
//! DBA can pre-create them with the files dlock runs (docs/postgres.md,
//! "Objects").
//!
//! Beside a table of holder records made by an older dlock (which recorded
//! every lock in it), the tables of names are created on the first
//! acquisition that records. An older dlock goes on writing its rows,
//! which a reader believes as it believes a record; an older dlock reads
//! a newer one's plain lock as held by someone unknown (see
//! `tests/pg/upgrade.rs`).
//!
//! Where the tables of names cannot be made or used, a lock without an
//! identity records itself in `dlock_holders` instead, as an older dlock
//! did: an upsert per acquisition, its row left at its release and
//! deleted, with the session's other released rows, in one statement when
//! 64 have come or with the first release a second after the oldest. A
//! role that may not create or write that table either still locks:
//! locks without an identity are then taken without a record (their
//! holder reads as unknown and `held` does not list them), one warning
//! says why, and the tables are looked at again a minute later. Locks with
//! an identity (elections) need their record, and fail with the DDL or
//! GRANT a DBA must run. A lock without an identity whose recording
//! statement fails for its record (a privilege revoked, the table locked
//! by a DBA's `ALTER TABLE` for longer than a lock session waits) is taken
//! again at once without one. Whether the session already holds the key's
//! advisory key (a re-entrant grant of a colliding key, that must take
//! nothing) is decided in process, from the keys its leases hold.
//! [`PgOptions::record_holders`]`(false)` takes locks without an identity
//! with neither name nor record, at the price of the holder and the
//! listing.
//!
//! A renewal of a lock taken with an identity makes sure its record is
//! there and is its own, and writes it again if not, so a DBA who
//! truncates the table or deletes a row hides the holder for one renewal
//! interval at most after the DBA's transaction ends; a dropped table is
//! created again, as the first acquisition creates it. That costs one
//! statement per session per renewal batch, sent after the session check
//! that answers the renewal, and only on sessions that hold such a lock:
//! plain locks are renewed as before. No renewal waits for it, and a
//! record that cannot be written fails no renewal (the lock is held all
//! the same): it is logged as a warning. It waits at most 100 ms for a
//! lock on the table (a DBA's `ALTER TABLE`, `VACUUM FULL` or `TRUNCATE`
//! holds one while it runs), as the session's other statements queue
//! behind it: one that waited longer is tried again at the next renewal,
//! and after any other failure the session sends none for 10 s. A release
//! whose role may no longer delete its record (a DBA revoked DELETE) drops
//! the lock all the same and fails with the GRANT to run; the record left
//! names the session, which takes no new lock from then on (its other
//! leases live on), so it is never read.
//!
//! [`Backend::watch_holder`](crate::Backend::watch_holder) hears of
//! releases from the wait probe (below), and of acquisitions with an
//! identity from PostgreSQL itself: once the statement that takes such a
//! lock committed, the session sends `NOTIFY` on the channel
//! `dlock_holders_<schema>` (for a schema longer than 49 bytes, its first
//! 32 bytes and a hash of it), with the advisory key as payload. The
//! backend listens on one more connection of its own, opened like the
//! lock sessions by the first watch of a free key, checked every
//! [`PgOptions::liveness_interval`] and closed 30 s after the last watch:
//! an observer of a vacant election hears the next leader at once, and
//! reads again only once a second, for an acquisition that was not
//! announced. `LISTEN` and `NOTIFY` need no privilege. The announcement
//! is best effort and never part of the acquisition: its commit needs
//! PostgreSQL's one cluster-wide lock of notifying commits, which another
//! application's `NOTIFY` holds while its commit waits (for a synchronous
//! standby that is down, say); it waits at most 100 ms for it, and a
//! failure is a warning, not a failed acquisition. Should the listening
//! connection not open, watches of free keys read again every 50 ms (a
//! warning says so), and it is tried again 10 s later. An acquisition
//! without an identity is not announced, nor is one by a dlock that
//! predates announcements: a reader hears of it at its next read.
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
//! The backend's own work (connections, ttl enforcement, liveness checks,
//! wait probes, the rest of a call whose caller gave up) runs on the runtime
//! the backend was connected on, never on a caller's short-lived one; see
//! docs/postgres.md, "Runtimes".
//!
//! # Fair mode
//!
//! A fair acquisition ([`LockOptions::fair`](crate::LockOptions::fair))
//! waits in PostgreSQL's own queue of the key's advisory lock. The lock
//! manager queues the sessions that wait for a lock in arrival order and,
//! when the holder lets go, grants the lock to the first of them itself:
//! that grant is the handoff, and costs the holder nothing but its unlock.
//! So each fair waiter that must wait takes a *fair session*, a connection
//! of its own that carries nothing else while it waits, and sends one
//! statement on it: `pg_advisory_lock` on the key's advisory key (the one
//! plain locks take), then, once granted, the token drawn and the holder
//! recorded as a plain acquisition draws and records them. Its attempt is
//! answered once the server shows the session queued, so waiters are
//! served in the order their attempts were answered, across processes;
//! the waiters of one process are queued in the order their attempts came,
//! however long each takes to get a connection.
//! The granted lease lives on that session like any other lease (renewed,
//! released, lost with its session, listed, its identity announced).
//!
//! The queue binds every client of the key: a plain attempt (dlock's, an
//! older dlock's, any `pg_try_advisory_lock`) is refused while a waiter is
//! queued, and a release never leaves the key free for an instant while
//! one is. A fair caller's first try is that plain attempt (refused at
//! once if a fair waiter of its own process is on its way into the
//! queue), so an uncontended fair acquisition costs what a plain one
//! does. A waiter that
//! gives up leaves the queue before its release returns (a cancel request
//! to the server, on a connection of its own), as does one whose entry
//! its process stopped refreshing for
//! [`QUEUE_ENTRY_TTL`](crate::backend::QUEUE_ENTRY_TTL); a handoff that
//! reached it in the race is passed on. A waiter process that dies closes
//! its connection: the server finds it closed within
//! [`PgOptions::liveness_interval`] (`client_connection_check_interval`,
//! PostgreSQL 14+ on Linux, macOS and the BSDs) and drops it from the
//! queue; elsewhere the key reaches the dead session, which ends at once
//! and passes it on. Either way the store sees the death, so a handed-over
//! lease is kept for its whole ttl.
//!
//! The wait is bounded by its waiter only. It runs with `lock_timeout` 0
//! (dlock's own value again for the token draw), and fair sessions set
//! `statement_timeout` (and, PostgreSQL 17+, `transaction_timeout`) to 0
//! whatever a DBA set for the role or the database; they are never idle
//! in a transaction, so `idle_in_transaction_session_timeout` does not
//! apply. While a statement waits its session sends no liveness check:
//! TCP keepalives (every liveness interval, unless the connection string
//! sets them) find a server gone half-open. A wait cut off all the same (a
//! DBA's `pg_cancel_backend` or `pg_terminate_backend`, a server restart)
//! is sent again at once, on the same session or a new one: the waiter
//! keeps waiting, at the end of the queue. A statement that fails for
//! another reason is handled as a plain lock statement's failure is, or
//! answered as an error to the waiter's next attempt, which the
//! acquisition rides out while it may wait.
//!
//! What it costs:
//!
//! - One connection per fair waiter while it waits in a queue, and while
//!   it holds the key a handoff gave it (the lock belongs to that session).
//!   Connections are kept for the next fair waiter for 30 s after their
//!   last use, and at most [`PgOptions::fair_sessions`] (32) are open at
//!   once: a fair waiter that would need one more is answered an error,
//!   which the acquisition retries while it may wait.
//! - Per wait, one statement on the fair session and one or a few looks at
//!   that session's entry in `pg_stat_activity`, on a lock session, until
//!   it shows the wait queued.
//! - A waiting statement holds a snapshot, so `VACUUM` cannot remove rows
//!   deleted after the oldest wait began (`backend_xmin` in
//!   `pg_stat_activity`). It names none of dlock's tables, so it holds
//!   no lock on them: a waiter whose holder is recorded writes its record
//!   in a statement of its own once granted, and a DBA's `ALTER TABLE`,
//!   `TRUNCATE`, `VACUUM FULL` or `LOCK TABLE` never waits for a queue.
//!   With `log_lock_waits` on,
//!   the server logs every wait longer than `deadlock_timeout`, after
//!   which it also runs its deadlock check once for it.
//! - Nothing for plain locks: no statement is added to their acquisition,
//!   renewal or release, and a release reads one flag in process (once
//!   fair mode was used, it looks at an empty map).
//!
//! No schema object is added: fair waiters use the token sequence and the
//! table of holder records as they are, and processes of older dlock
//! versions lock beside them (their plain attempts cannot pass a queued
//! fair waiter either).
//!
//! # Shared locks and permits
//!
//! [`LockMode::Shared`](crate::LockMode::Shared) and
//! [`LockOptions::permits`](crate::LockOptions::permits) (rules M1 to M5
//! on [`Backend`](crate::Backend)), each attempt one statement on a lock
//! session (see `modes`). A reader takes the key's advisory lock shared and
//! a shared lock on the key's *phase key*
//! (`hashtextextended('dlock-phase:' || key, seed)`), which only readers
//! take, so the read phase is live while a session holds it; the phase
//! token and the writer-waiting mark are a row of `<schema>.dlock_phases`.
//! Whether a phase is live is a non-blocking try of the phase key, and the
//! reader that starts one writes its token while it holds that key
//! exclusively; the readers of one key in a process share one hold on the
//! server. A writer refused while readers hold
//! leaves its mark in that row (one more statement, sent only where the
//! functions exist, so a service that never reads shared creates nothing).
//! A permit is the exclusive advisory lock of
//! `hashtextextended('dlock-permit:' || slot || ':' || key, seed)`, the
//! slots tried in order by one statement that stops at the first taken.
//! The table and the three functions the statements call are created on
//! the first shared or permit attempt; a DBA can run the DDL
//! (`sql::MODES_SETUP`, `CREATE OR REPLACE` in a `DO` block) instead.
//! A reader or permit holder that dies frees its hold when its connection
//! ends, and an ended session marks every lease on it lost. Their waiters
//! look again every 100 ms: the server-side wait hears only of exclusive
//! holders. Shared and permit leases have no holder record (`holder`,
//! `held` and `force_release` know exclusive holders only), and a permit
//! key and the same key as a read-write lock exclude each other only
//! within one process.
//!
//! # PgBouncer
//!
//! Session locks need a real server session: point `PgBackend` at
//! PostgreSQL directly or through a PgBouncer pool in *session* mode.
//! Behind *transaction* pooling use [`TransactionLock`], which locks inside
//! the caller's own transaction.

mod announce;
mod backend;
mod claims;
mod connect;
mod connection;
mod deadlines;
mod entry;
mod fair;
mod fair_grant;
mod fair_queue;
mod fair_statement;
mod fair_wait;
pub mod fence;
mod hash;
mod holders;
mod holders_force;
mod holders_rewrite;
mod holders_table;
mod home;
mod listen;
mod locks;
mod mode_sql;
mod mode_statements;
mod modes;
mod names;
mod objects;
mod options;
mod quick;
mod read_hold;
mod recording;
mod sequence;
mod session;
mod sessions;
mod sql;
mod tls;
mod unlock;
mod wait;
mod xact;

/// The statements the backend sends, word for word, for tools that must
/// speak the same protocol (the benchmark's raw tokio-postgres floor issues
/// exactly these; `{schema}` stands for the quoted schema). A lease without
/// an identity takes its lock with [`TRY_LOCK_NAMED`](protocol::TRY_LOCK_NAMED)
/// and drops it with [`UNLOCK_NAMED`](protocol::UNLOCK_NAMED); a lease with
/// an identity takes it with [`TRY_LOCK_RECORDING`](protocol::TRY_LOCK_RECORDING)
/// and drops it with [`UNLOCK_RECORDED`](protocol::UNLOCK_RECORDED); with
/// holder records off, [`TRY_LOCK`](protocol::TRY_LOCK) and
/// [`UNLOCK`](protocol::UNLOCK). While the token sequence leads the clock,
/// [`TRY_LOCK_NAMED_QUICK`](protocol::TRY_LOCK_NAMED_QUICK) and
/// [`TRY_LOCK_QUICK`](protocol::TRY_LOCK_QUICK) stand in for the first and
/// the last lock statement (see `quick`). Not a stable API.
#[doc(hidden)]
pub mod protocol {
    pub use super::sql::{
        DELETE_RELEASED, TRY_LOCK, TRY_LOCK_NAMED, TRY_LOCK_NAMED_QUICK, TRY_LOCK_QUICK,
        TRY_LOCK_RECORDING, UNLOCK, UNLOCK_GATED, UNLOCK_NAMED, UNLOCK_RECORDED,
    };
}

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Mutex as AsyncMutex;
use tokio::time::Instant;

use self::connection::{Connector, Failure};
use self::deadlines::Deadlines;
use self::entry::{Entry, Holding, Identified, State};
use self::home::Home;
use self::listen::Listener;
use self::wait::Waits;
use crate::backend::OwnerId;
use crate::error::{LockError, Operation};
use crate::key::LockKey;

pub use self::options::PgOptions;
use self::options::quote_schema;
use self::sessions::SessionSlot;
pub use self::tls::TlsVerification;
pub use self::xact::{MAX_LOCK_TIMEOUT, TransactionLock};
/// The PostgreSQL client this backend is built on, for
/// [`TransactionLock::acquire`] and anything else that needs its types.
pub use tokio_postgres;

/// The prefixes of the texts whose advisory locks are the backend's own:
/// a read phase's key and its token's lock, a permit's slots (see
/// `sql::MODES_SETUP`). A key spelled like one of them would hash to that
/// very lock, whatever the seed (the seed hashes both alike), and so pose
/// as a member of another key's read phase, or hold its readers off.
const OWN_LOCK_PREFIXES: [&str; 3] = ["dlock-phase:", "dlock-phase-token:", "dlock-permit:"];

/// Refuses a key that names one of the backend's own advisory locks (see
/// [`OWN_LOCK_PREFIXES`]).
fn refuse_own_lock_name(key: &LockKey) -> Result<(), LockError> {
    match OWN_LOCK_PREFIXES
        .iter()
        .find(|p| key.as_str().starts_with(**p))
    {
        Some(prefix) => Err(LockError::invalid_key(
            key.as_str(),
            format!(
                "on PostgreSQL, a key starting with `{prefix}` names one of dlock's own advisory locks (read phases, permits); choose another key"
            ),
        )),
        None => Ok(()),
    }
}

const KIND: &str = "pg";
const DEFAULT_SCHEMA: &str = "dlock";
/// How long `force_release` waits for a holding session to be gone.
const TERMINATE_WAIT_MS: i64 = 5_000;
/// How soon a waiter looks again for a key held elsewhere when every wait
/// session is busy, so no server-side probe watches the key for it.
const UNWATCHED_RECHECK: Duration = Duration::from_secs(1);

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
    /// The connector of fair sessions: TCP keepalives on (see `fair`).
    fair_connector: Connector,
    options: PgOptions,
    quoted_schema: String,
    try_lock_sql: String,
    terminate_sql: String,
    /// [`sql::FORCE_RELEASE_NAMED`], schema filled in.
    force_release_named_sql: String,
    /// A fair waiter's statements ([`sql::FAIR_LOCK`], or
    /// [`sql::FAIR_LOCK_MARKED`] and then [`sql::FAIR_RECORD`]), schema
    /// filled in.
    fair_lock_sql: String,
    fair_lock_marked_sql: String,
    fair_record_sql: String,
    /// The statements of identity records ([`holders`]), schema filled in.
    try_lock_recording_sql: String,
    unlock_recorded_sql: String,
    delete_released_sql: String,
    rewrite_records_sql: String,
    holder_session_sql: String,
    holder_record_sql: String,
    held_sql: String,
    /// The statements of names ([`names`]), schema filled in.
    name_lease_sql: String,
    try_lock_named_sql: String,
    unlock_named_sql: String,
    /// Whether lock statements take the quick draw (see [`quick`]).
    quick: quick::QuickDraw,
    session_holders_sql: String,
    held_named_sql: String,
    /// What this backend named, and whether it may (see [`names`]).
    names: names::Names,
    /// Whether the table of holder records is known to exist and be
    /// usable, checked (created) on the first acquisition that records,
    /// one check at a time; and, for leases without an identity, whether
    /// it was found unusable, and when (see `holders_table`).
    holders_table: AsyncMutex<bool>,
    holders_state: holders_table::TableState,
    /// When renewals last tried to create the table of identity records
    /// again, if that try is in flight or failed.
    holders_recreated: Mutex<Option<Instant>>,
    slots: Vec<SessionSlot>,
    next_slot: AtomicUsize,
    next_session_id: AtomicU64,
    /// One repair of the schema objects at a time (see `restore_objects`),
    /// with why the last one failed, and how many were tried.
    restoring: AsyncMutex<Option<String>>,
    restorations: AtomicU64,
    keys: Mutex<HashMap<LockKey, Entry>>,
    /// Keys held shared or as permits here (see `modes`).
    modes: modes::Modes,
    deadlines: Arc<Deadlines>,
    waits: Waits,
    /// Fair waiters, their handoff notices and their sessions.
    fair: Arc<fair_queue::Fair>,
    /// Hears acquisitions announced, for watches of free keys.
    listener: Listener,
    /// Paces the warnings of announcements that failed (see `announce`)
    /// and of renewals' writes of identity records that waited too long
    /// for the table (see `holders_rewrite`): both can recur with every
    /// acquisition or renewal.
    announce_warnings: WarningPace,
    rewrite_lock_warnings: WarningPace,
    /// Whether `warn_other_schemas` has spoken.
    warned_other_schemas: AtomicBool,
}

/// Paces a warning that can recur: at most one every `every`, the others
/// logged at debug level.
struct WarningPace {
    every: Duration,
    last: Mutex<Option<Instant>>,
}

impl WarningPace {
    fn new(every: Duration) -> Self {
        Self {
            every,
            last: Mutex::new(None),
        }
    }

    /// Whether the warning is due now; if it is, the next one is due
    /// `every` later.
    fn due(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if last.is_some_and(|at| at.elapsed() < self.every) {
            return false;
        }
        *last = Some(Instant::now());
        true
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

    /// Removes `key`'s entry if it still belongs to `owner`.
    fn forget(&self, key: &LockKey, owner: OwnerId) {
        let mut keys = self.keys();
        if keys.get(key).is_some_and(|entry| entry.owner == owner) {
            keys.remove(key);
        }
    }
}

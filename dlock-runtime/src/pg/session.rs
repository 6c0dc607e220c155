//! The lock sessions that hold session advisory locks: their statements,
//! the in-process claims of the advisory keys their leases hold, the lock
//! statements in flight on them, and their liveness check.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, SystemTime};

use tokio::sync::{Mutex as AsyncMutex, OnceCell, oneshot, watch};
use tokio::time::{Instant, sleep, timeout};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{CancelToken, Client, Row, SimpleQueryMessage, Statement, ToStatement};

use super::announce::Announcements;
use super::claims::Claims;
use super::fair::FairTicket;
use crate::backend::LossGroup;
use crate::error::LostReason;

/// One connection that holds session advisory locks for any number of
/// leases. The backend opened it and nothing else ever runs on it, so a
/// lock taken here is only ever dropped by this backend (or by the session
/// ending).
pub(super) struct LockSession {
    pub(super) id: u64,
    pub(super) pid: i32,
    /// When the server started the session (`backend_start`): with the pid,
    /// what names it in an identity record, as a pid alone may be reused.
    /// `None` if the server did not say; the session then records nothing.
    pub(super) started: Option<SystemTime>,
    client: Client,
    /// How many answers the server gave on this session, errors included:
    /// what tells the liveness check that a session whose ping waits behind
    /// statements the server is still working on is alive.
    answers: AtomicU64,
    pub(super) try_lock: Statement,
    pub(super) unlock: Statement,
    /// The statements of leases that record an identity, prepared on the
    /// first such lease (they name a table that only exists from then on).
    recording: OnceCell<Recording>,
    /// The lock and unlock of named leases (see `names`), prepared on the
    /// first such lease.
    named_statements: OnceCell<(Statement, Statement)>,
    /// The statements of shared locks and permits (by
    /// [`ModeStatement`]), each prepared on its first use on this session:
    /// they name functions and a table that exist only once shared locks
    /// or permits are in use, and each names only what it needs, so a
    /// change to what one names reaches no other.
    modes: [OnceCell<Statement>; ModeStatement::COUNT],
    /// Held while identity records are written or deleted on this session
    /// (a renewal writing missing ones again, an unlock deleting one), so
    /// that a renewal's write is never sent after the lease's unlock.
    pub(super) record_writes: AsyncMutex<()>,
    /// Until when renewals write no identity records again on this
    /// session: set after such a write failed (see
    /// `Inner::rewrite_records`).
    rewrites_paused_until: Mutex<Option<Instant>>,
    /// Acquisitions on this session waiting to be announced (see the
    /// `announce` module).
    pub(super) announcements: Mutex<Announcements>,
    /// Set once the session must take no new locks (see
    /// [`retire`](Self::retire)).
    retired: AtomicBool,
    /// The keys whose holder records lock statements wrote on this
    /// session (see [`wrote_a_record`](Self::wrote_a_record)).
    recorded_keys: Mutex<HashSet<String>>,
    /// The holders this session named (see `names`), with when: one,
    /// unless its leases carry several labels.
    named_holders: Mutex<Vec<(Box<str>, Instant)>>,
    /// `Some(why)` once the connection has ended.
    ended: watch::Receiver<Option<String>>,
    kill: Mutex<Option<oneshot::Sender<String>>>,
    /// Holder records of plain leases released on this session, not yet
    /// deleted (see [`sql::DELETE_RELEASED`](super::sql::DELETE_RELEASED)).
    released: Mutex<Released>,
    /// What this process knows of the advisory keys on this session: the
    /// ones its leases hold, and the lock statements in flight.
    pub(super) claims: Arc<Claims>,
    /// Every lease on this session, lost together when it ends.
    loss: Arc<LossGroup>,
    /// Set while a fair waiter's statement waits in a key's queue on this
    /// session: the liveness check sends nothing then (a ping would queue
    /// behind the wait and get no answer in time).
    waiting: AtomicBool,
    /// Set on a fair session (see the `fair` module): the session counts
    /// against [`PgOptions::fair_sessions`](super::PgOptions::fair_sessions)
    /// until it is dropped.
    fair: OnceLock<FairTicket>,
}

/// Ends a session's [`LossGroup`] with the reason the connection gave, or,
/// if it is dropped unused (the driver task went away with its runtime),
/// with a reason of its own: either way no lease on a gone session is left
/// believing it holds its lock.
pub(super) struct SessionEnding {
    loss: Arc<LossGroup>,
    /// The session's server process id, known once the session is set up.
    pid: Arc<AtomicI32>,
}

impl SessionEnding {
    pub(super) fn new(loss: Arc<LossGroup>, pid: Arc<AtomicI32>) -> Self {
        Self { loss, pid }
    }

    /// Tells every lease on the session that it ended, and why.
    pub(super) fn end(&self, why: &str) {
        let pid = self.pid.load(Ordering::Acquire);
        self.loss.end(LostReason::SessionEnded(format!(
            "PostgreSQL lock session pid {pid}: {why}"
        )));
    }
}

impl Drop for SessionEnding {
    fn drop(&mut self) {
        self.end("the backend closed the session");
    }
}

/// A lock session's statements for leases that record an identity.
pub(super) struct Recording {
    pub(super) try_lock: Statement,
    pub(super) unlock: Statement,
    pub(super) delete_released: Statement,
}

/// A statement of shared locks and permits (see the `modes` module),
/// prepared once per lock session, so each attempt and each release is
/// one round trip, and the server plans none of them again.
#[derive(Clone, Copy)]
pub(super) enum ModeStatement {
    TryShared,
    UnlockShared,
    TryPermit,
    UnlockPermit,
    Marked,
}

impl ModeStatement {
    const COUNT: usize = 5;
}

/// The SQL of each [`ModeStatement`], the schema filled in.
pub(super) struct ModeSql {
    pub(super) try_shared: String,
    pub(super) unlock_shared: String,
    pub(super) try_permit: String,
    pub(super) unlock_permit: String,
    pub(super) marked: String,
}

impl ModeSql {
    fn of(&self, statement: ModeStatement) -> &str {
        match statement {
            ModeStatement::TryShared => &self.try_shared,
            ModeStatement::UnlockShared => &self.unlock_shared,
            ModeStatement::TryPermit => &self.try_permit,
            ModeStatement::UnlockPermit => &self.unlock_permit,
            ModeStatement::Marked => &self.marked,
        }
    }
}

/// How many released records a session keeps before it deletes them.
pub(super) const RELEASED_BATCH: usize = 64;

/// How long the oldest released record waits for its batch, at most
/// until the next release after that.
pub(super) const RELEASED_WAIT: Duration = Duration::from_secs(1);

/// The released records of a session waiting for their batch delete:
/// advisory keys and tokens, pairwise, and when the first came.
#[derive(Default)]
pub(super) struct Released {
    pub(super) lock_ids: Vec<i64>,
    pub(super) tokens: Vec<i64>,
    pub(super) since: Option<Instant>,
}

impl LockSession {
    pub(super) fn new(
        id: u64,
        (pid, started): (i32, Option<SystemTime>),
        client: Client,
        statements: (Statement, Statement),
        ended: watch::Receiver<Option<String>>,
        kill: oneshot::Sender<String>,
        loss: Arc<LossGroup>,
    ) -> Self {
        Self {
            id,
            pid,
            started,
            client,
            answers: AtomicU64::new(0),
            try_lock: statements.0,
            unlock: statements.1,
            recording: OnceCell::new(),
            named_statements: OnceCell::new(),
            modes: std::array::from_fn(|_| OnceCell::new()),
            record_writes: AsyncMutex::new(()),
            rewrites_paused_until: Mutex::new(None),
            announcements: Mutex::default(),
            retired: AtomicBool::new(false),
            recorded_keys: Mutex::default(),
            named_holders: Mutex::default(),
            ended,
            kill: Mutex::new(Some(kill)),
            released: Mutex::default(),
            claims: Claims::new(pid),
            loss,
            waiting: AtomicBool::new(false),
            fair: OnceLock::new(),
        }
    }

    /// Makes this a fair session, counted by `ticket` until it is dropped.
    pub(super) fn make_fair(&self, ticket: FairTicket) {
        let _ = self.fair.set(ticket);
    }

    /// True for a fair session (see the `fair` module).
    pub(super) fn is_fair(&self) -> bool {
        self.fair.get().is_some()
    }

    /// Marks whether a fair waiter's statement waits on this session (see
    /// [`check_liveness`]).
    pub(super) fn set_waiting(&self, waiting: bool) {
        self.waiting.store(waiting, Ordering::Release);
    }

    fn is_waiting(&self) -> bool {
        self.waiting.load(Ordering::Acquire)
    }

    /// What it takes to cancel the statement running on this session.
    pub(super) fn cancel_token(&self) -> CancelToken {
        self.client.cancel_token()
    }

    /// Keeps the record of a plain lease released on this session for its
    /// batch delete, and hands back the batch when one is due: when
    /// [`RELEASED_BATCH`] have come, or the first came [`RELEASED_WAIT`] ago.
    pub(super) fn released(&self, advisory_key: i64, token: i64) -> Option<Released> {
        let mut released = self.released.lock().unwrap_or_else(PoisonError::into_inner);
        released.lock_ids.push(advisory_key);
        released.tokens.push(token);
        let first = *released.since.get_or_insert_with(Instant::now);
        let due = released.lock_ids.len() >= RELEASED_BATCH || first.elapsed() >= RELEASED_WAIT;
        due.then(|| std::mem::take(&mut *released))
    }

    /// Puts back a batch of released records whose delete failed: they are
    /// still this session's to delete, with its next batch.
    pub(super) fn keep_released(&self, batch: Released) {
        let mut released = self.released.lock().unwrap_or_else(PoisonError::into_inner);
        let since = match (batch.since, released.since) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        released.lock_ids.extend(batch.lock_ids);
        released.tokens.extend(batch.tokens);
        released.since = since;
    }

    /// Sends a statement that returns one row on this session.
    pub(super) async fn query_one<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, tokio_postgres::Error>
    where
        T: ?Sized + ToStatement,
    {
        let answer = self.client.query_one(statement, params).await;
        self.count_answer(&answer);
        answer
    }

    /// Sends a statement on this session.
    pub(super) async fn query<T>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, tokio_postgres::Error>
    where
        T: ?Sized + ToStatement,
    {
        let answer = self.client.query(statement, params).await;
        self.count_answer(&answer);
        answer
    }

    /// Sends a statement with the given parameter types, unprepared: one
    /// round trip, for statements sent too rarely to keep prepared.
    pub(super) async fn query_typed(
        &self,
        statement: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        let answer = self.client.query_typed(statement, params).await;
        self.count_answer(&answer);
        answer
    }

    /// Sends statements as one simple query, without parameters: the
    /// server runs them in one transaction, with no other statement of
    /// the session between them.
    pub(super) async fn simple_query(
        &self,
        statements: &str,
    ) -> Result<Vec<SimpleQueryMessage>, tokio_postgres::Error> {
        let answer = self.client.simple_query(statements).await;
        self.count_answer(&answer);
        answer
    }

    /// Whether renewals may write identity records again on this session
    /// (none failed within the pause set by
    /// [`pause_rewrites`](Self::pause_rewrites)).
    pub(super) fn may_rewrite(&self) -> bool {
        self.rewrites_paused_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none_or(|until| until <= Instant::now())
    }

    /// No renewal writes identity records again on this session for `pause`.
    pub(super) fn pause_rewrites(&self, pause: Duration) {
        *self
            .rewrites_paused_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now() + pause);
    }

    /// The statements of leases that record an identity (the SQL of
    /// [`sql::TRY_LOCK_RECORDING`](super::sql::TRY_LOCK_RECORDING) and [`sql::UNLOCK_RECORDED`](super::sql::UNLOCK_RECORDED) with the
    /// schema filled in), prepared on first use.
    pub(super) async fn recording(
        &self,
        try_lock_sql: &str,
        unlock_sql: &str,
        delete_released_sql: &str,
    ) -> Result<&Recording, tokio_postgres::Error> {
        self.recording
            .get_or_try_init(|| async {
                let prepare = |sql| async move {
                    let prepared = self.client.prepare(sql).await;
                    self.count_answer(&prepared);
                    prepared
                };
                Ok(Recording {
                    try_lock: prepare(try_lock_sql).await?,
                    unlock: prepare(unlock_sql).await?,
                    delete_released: prepare(delete_released_sql).await?,
                })
            })
            .await
    }

    /// The lock and unlock statements of named leases (the SQL of
    /// [`sql::TRY_LOCK_NAMED`](super::sql::TRY_LOCK_NAMED) and
    /// [`sql::UNLOCK_NAMED`](super::sql::UNLOCK_NAMED)), prepared on first
    /// use.
    pub(super) async fn named_statements(
        &self,
        try_lock_sql: &str,
        unlock_sql: &str,
    ) -> Result<&(Statement, Statement), tokio_postgres::Error> {
        self.named_statements
            .get_or_try_init(|| async {
                let prepare = |sql| async move {
                    let prepared = self.client.prepare(sql).await;
                    self.count_answer(&prepared);
                    prepared
                };
                Ok((prepare(try_lock_sql).await?, prepare(unlock_sql).await?))
            })
            .await
    }

    /// `statement` (its SQL in `sql`), prepared on its first use on this
    /// session (after the backend made what it names).
    pub(super) async fn mode_statement(
        &self,
        statement: ModeStatement,
        sql: &ModeSql,
    ) -> Result<&Statement, tokio_postgres::Error> {
        self.modes[statement as usize]
            .get_or_try_init(|| async {
                let prepared = self.client.prepare(sql.of(statement)).await;
                self.count_answer(&prepared);
                prepared
            })
            .await
    }

    /// The recording statements, if they were prepared.
    pub(super) fn recording_prepared(&self) -> Option<&Recording> {
        self.recording.get()
    }

    /// One round trip that runs nothing.
    pub(super) async fn check_connection(&self) -> Result<(), tokio_postgres::Error> {
        let answer = self.client.check_connection().await;
        self.count_answer(&answer);
        answer
    }

    fn count_answer<T>(&self, answer: &Result<T, tokio_postgres::Error>) {
        let answered = match answer {
            Ok(_) => true,
            Err(err) => err.as_db_error().is_some(),
        };
        if answered {
            self.answers.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// True once the connection is gone (or going).
    pub(super) fn is_ended(&self) -> bool {
        self.ended.borrow().is_some() || self.client.is_closed()
    }

    /// Takes the session out of use for new locks, while its leases live
    /// on: its slot opens another for the next acquisition, and the
    /// connection closes once the slot has and the last lease on it ended. For a session that
    /// dropped a lock whose identity record it could not delete: the record
    /// names this session, so this session must never hold that key again
    /// (a reader would take the record for the new holder's).
    pub(super) fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    /// Notes that a lock statement wrote a holder record of `key` on this
    /// session. The session never takes a lease of that key without one
    /// (see `Inner::try_lock`): the record of an earlier lease may still be
    /// there, whatever the session did to delete it (a delete that failed,
    /// or that a DBA's trigger or rule skipped without an error), and it
    /// names this session and the key, so a reader would take it for the
    /// holder's of a lease of the key taken here without one.
    pub(super) fn wrote_a_record(&self, key: &str) {
        let mut keys = self
            .recorded_keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !keys.contains(key) {
            keys.insert(key.to_owned());
        }
    }

    /// Whether a lock statement wrote a record of `key` on this session
    /// (see [`wrote_a_record`](Self::wrote_a_record)).
    pub(super) fn may_have_a_record_of(&self, key: &str) -> bool {
        self.recorded_keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(key)
    }

    /// Whether this session named `holder` within `kept` (see `names`).
    pub(super) fn named(&self, holder: &str, kept: Duration) -> bool {
        self.named_holders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .any(|(named, at)| **named == *holder && at.elapsed() < kept)
    }

    /// Notes that this session named `holder` now.
    pub(super) fn name(&self, holder: &str) {
        let mut named = self
            .named_holders
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        named.retain(|(n, _)| **n != *holder);
        named.push((holder.into(), Instant::now()));
    }

    /// True once [`retire`](Self::retire)d.
    pub(super) fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// Closes the connection: the server drops every lock it held, and
    /// every lease on it is told its session ended.
    pub(super) fn end(&self, why: String) {
        let kill = self
            .kill
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(kill) = kill {
            let _ = kill.send(why);
        }
    }

    /// The group of the leases on this session: ended with
    /// [`LostReason::SessionEnded`] when the connection ends.
    pub(super) fn loss_group(&self) -> Arc<LossGroup> {
        Arc::clone(&self.loss)
    }
}

/// Pings a lock session every `interval` (a protocol Sync: the cheapest
/// round trip there is) and ends it when a ping fails, or when within
/// `interval` neither the ping nor anything else sent before it got an
/// answer: that catches half-open connections the kernel would only notice
/// much later. A ping queues behind the statements sent before it; each of
/// those waits at most the session's `lock_timeout` (below `interval`), so
/// while answers keep coming the session is alive however many wait.
/// Holds the session weakly, so a dropped backend still closes its
/// connections.
///
/// A fair session whose statement waits in a key's queue gets no ping:
/// the ping would only be answered after the wait, however long. TCP
/// keepalives watch it then (see `Connector::keeping_alive`), and a ping
/// sent just before the wait began is not held against it.
pub(super) async fn check_liveness(session: Weak<LockSession>, interval: Duration) {
    loop {
        sleep(interval).await;
        let Some(session) = session.upgrade() else {
            return;
        };
        if session.is_ended() {
            return;
        }
        if session.is_waiting() {
            continue;
        }
        let mut answers = session.answers.load(Ordering::Relaxed);
        let ping = session.client.check_connection();
        tokio::pin!(ping);
        loop {
            match timeout(interval, &mut ping).await {
                Ok(Ok(())) => break,
                Ok(Err(err)) => {
                    session.end(format!("liveness check failed: {err}"));
                    return;
                }
                Err(_) => {
                    let now = session.answers.load(Ordering::Relaxed);
                    if now == answers && !session.is_waiting() {
                        session.end(format!(
                            "no answer to a liveness check within {interval:?} \
                             (half-open connection?)"
                        ));
                        return;
                    }
                    answers = now;
                }
            }
        }
    }
}

//! The lock sessions that hold session advisory locks: their statements,
//! the in-process claims of the advisory keys their leases hold, the lock
//! statements in flight on them, and their liveness check.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, SystemTime};

use tokio::sync::{oneshot, watch};
use tokio::time::{sleep, timeout};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{CancelToken, Client, Row, SimpleQueryMessage, Statement, ToStatement};

use super::claims::Claims;
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
    /// [`sql::TRY_LOCK_QUICK`](super::sql::TRY_LOCK_QUICK) (see `quick`).
    pub(super) try_lock_quick: Statement,
    pub(super) unlock: Statement,
    /// Set once the session must take no new locks (see
    /// [`retire`](Self::retire)).
    retired: AtomicBool,
    /// `Some(why)` once the connection has ended.
    ended: watch::Receiver<Option<String>>,
    kill: Mutex<Option<oneshot::Sender<String>>>,
    /// What this process knows of the advisory keys on this session: the
    /// ones its leases hold, and the lock statements in flight.
    pub(super) claims: Arc<Claims>,
    /// Every lease on this session, lost together when it ends.
    loss: Arc<LossGroup>,
    /// Set while a statement waits in a key's queue on this session (a
    /// fair waiter's): the liveness check sends nothing then (a ping would
    /// queue behind the wait and get no answer in time).
    waiting: AtomicBool,
    /// What each feature keeps of this session (see
    /// [`feature`](Self::feature)).
    features: [OnceLock<Box<dyn Any + Send + Sync>>; FEATURES],
}

/// How many features keep state of their own per session, at most.
const FEATURES: usize = 8;

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

impl LockSession {
    pub(super) fn new(
        id: u64,
        (pid, started): (i32, Option<SystemTime>),
        client: Client,
        (try_lock, try_lock_quick, unlock): (Statement, Statement, Statement),
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
            try_lock,
            try_lock_quick,
            unlock,
            retired: AtomicBool::new(false),
            ended,
            kill: Mutex::new(Some(kill)),
            claims: Claims::new(pid),
            loss,
            waiting: AtomicBool::new(false),
            features: std::array::from_fn(|_| OnceLock::new()),
        }
    }

    /// What a feature keeps of this session, in a type `T` of its own:
    /// made on its first use, dropped with the session. So the session
    /// knows no feature, and each feature's state stays in its module.
    pub(super) fn feature<T: Any + Default + Send + Sync>(&self) -> &T {
        for slot in &self.features {
            let state = slot.get_or_init(|| Box::new(T::default()));
            if let Some(state) = (**state).downcast_ref::<T>() {
                return state;
            }
        }
        unreachable!("more than {FEATURES} features keep state per session")
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

    /// Prepares `sql` on this session.
    pub(super) async fn prepare(&self, sql: &str) -> Result<Statement, tokio_postgres::Error> {
        let prepared = self.client.prepare(sql).await;
        self.count_answer(&prepared);
        prepared
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

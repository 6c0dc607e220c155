//! Connections the backend opens and owns: the lock sessions that hold
//! session advisory locks, and the plumbing every connection shares
//! (connect with a timeout, a driver task that reports how it ended).
//!
//! Over 700 lines: a lock session's state (claims, in-flight marks, records
//! written) and its connection, one lock guarding them; the redesign of the
//! PostgreSQL backend splits it.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::task::{Poll, ready};
use std::time::{Duration, SystemTime};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Mutex as AsyncMutex, OnceCell, oneshot, watch};
use tokio::time::{Instant, sleep, timeout};
use tokio_postgres::config::Host;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{
    AsyncMessage, CancelToken, Client, Config, Connection, Notification, Row, SimpleQueryMessage,
    Statement, ToStatement,
};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::announce::Announcements;
use super::fair::FairTicket;
use super::home::{Home, NoRuntime};
use super::sql;
use crate::backend::LossGroup;
use crate::error::LostReason;

/// A failure talking to PostgreSQL, with what was being done. Its text never
/// holds the password: connection errors name `user@host:port/db` only.
#[derive(Debug)]
pub(super) struct Failure {
    what: String,
    source: Option<tokio_postgres::Error>,
}

impl Failure {
    pub(super) fn new(what: impl Into<String>, source: tokio_postgres::Error) -> Self {
        Self {
            what: what.into(),
            source: Some(source),
        }
    }

    pub(super) fn msg(what: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            source: None,
        }
    }

    /// The same failure, with what led to it said first.
    pub(super) fn context(self, before: impl std::fmt::Display) -> Self {
        Self {
            what: format!("{before}: {}", self.what),
            source: self.source,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(source) => match source.as_db_error() {
                // The server's own words read better than "db error: ERROR: …".
                Some(db) => write!(f, "{}: {}", self.what, db),
                None => {
                    // tokio-postgres keeps the telling part ("invalid peer
                    // certificate: UnknownIssuer") in its source chain.
                    write!(f, "{}: {source}", self.what)?;
                    let mut cause = std::error::Error::source(source);
                    while let Some(inner) = cause {
                        write!(f, ": {inner}")?;
                        cause = inner.source();
                    }
                    Ok(())
                }
            },
            None => f.write_str(&self.what),
        }
    }
}

impl std::error::Error for Failure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// What it takes to open one more connection.
#[derive(Clone)]
pub(super) struct Connector {
    config: Config,
    tls: MakeRustlsConnect,
    timeout: Duration,
    target: String,
    /// Where connections are opened and driven.
    home: Arc<Home>,
}

impl Connector {
    pub(super) fn new(
        config: Config,
        tls: MakeRustlsConnect,
        timeout: Duration,
        home: Arc<Home>,
    ) -> Self {
        let target = describe(&config);
        Self {
            config,
            tls,
            timeout,
            target,
            home,
        }
    }

    /// Where the backend's work runs.
    pub(super) fn home(&self) -> &Arc<Home> {
        &self.home
    }

    /// `user@host:port/dbname`, for messages: never the password.
    pub(super) fn target(&self) -> &str {
        &self.target
    }

    /// The connect timeout.
    pub(super) fn connect_timeout(&self) -> Duration {
        self.timeout
    }

    /// The same connector, whose connections have the kernel probe the
    /// server every `every` once they are quiet (TCP keepalives: idle
    /// `every`, then every `every`, given up after two probes without an
    /// answer), unless the connection string set keepalives of its own.
    /// For fair sessions, which send nothing while they wait in a key's
    /// queue, so no liveness check can run on them then: a server gone
    /// half-open ends the wait within about three times `every`, not the
    /// kernel's two hours.
    pub(super) fn keeping_alive(&self, every: Duration) -> Self {
        let mut connector = self.clone();
        let config = &mut connector.config;
        let untouched = config.get_keepalives()
            && config.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60)
            && config.get_keepalives_interval().is_none()
            && config.get_keepalives_retries().is_none();
        if untouched {
            let every = every.max(Duration::from_secs(1));
            config
                .keepalives_idle(every)
                .keepalives_interval(every)
                .keepalives_retries(2);
        }
        connector
    }

    /// Asks the server to cancel the statement running on the session of
    /// `token` (a connection of its own, which the server closes at once),
    /// within the connect timeout. The server says nothing of the outcome.
    pub(super) async fn cancel(&self, token: CancelToken) -> Result<(), Failure> {
        match timeout(self.timeout, token.cancel_query(self.tls.clone())).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) => Err(Failure::new(
                format!("cannot send a cancel request to {}", self.target),
                err,
            )),
            Err(_) => Err(Failure::msg(format!(
                "cannot send a cancel request to {}: no answer within the connect timeout of {:?}",
                self.target, self.timeout
            ))),
        }
    }

    /// Opens a connection and drives it in a task of its own. `on_end` gets
    /// why it ended; a message on `kill` (or dropping its sender) closes it.
    /// The whole connect, handshake and authentication included, is bounded
    /// by the connect timeout (tokio-postgres bounds only the TCP connect).
    /// The session's settings are dlock's (see `sql::SESSION_DEFAULTS`)
    /// before anything else is sent, with `lock_timeout` for its
    /// `lock_timeout`. Opened at home, whatever runtime asks: the
    /// connection's socket and its driver belong to the runtime that opens
    /// it.
    pub(super) async fn open(
        &self,
        lock_timeout: Duration,
        kill: oneshot::Receiver<String>,
        on_end: impl FnOnce(String) + Send + 'static,
    ) -> Result<Client, Failure> {
        self.open_with(lock_timeout, kill, on_end, None).await
    }

    /// [`open`](Self::open), for a connection that `LISTEN`s: its driver
    /// hands every notification the server sends to `on_notification`
    /// (called in the driver's task, so it must not block).
    pub(super) async fn open_listening(
        &self,
        lock_timeout: Duration,
        kill: oneshot::Receiver<String>,
        on_end: impl FnOnce(String) + Send + 'static,
        on_notification: OnNotification,
    ) -> Result<Client, Failure> {
        self.open_with(lock_timeout, kill, on_end, Some(on_notification))
            .await
    }

    async fn open_with(
        &self,
        lock_timeout: Duration,
        kill: oneshot::Receiver<String>,
        on_end: impl FnOnce(String) + Send + 'static,
        on_notification: Option<OnNotification>,
    ) -> Result<Client, Failure> {
        let connector = self.clone();
        self.home
            .run(async move {
                connector
                    .open_here(lock_timeout, kill, on_end, on_notification)
                    .await
            })
            .await
            .unwrap_or_else(|NoRuntime| {
                Err(Failure::msg(format!(
                    "cannot connect to {}: the runtime the backend runs on shut down, and no \
                     other runtime is there to take over",
                    self.target
                )))
            })
    }

    async fn open_here(
        &self,
        lock_timeout: Duration,
        kill: oneshot::Receiver<String>,
        on_end: impl FnOnce(String) + Send + 'static,
        on_notification: Option<OnNotification>,
    ) -> Result<Client, Failure> {
        let connecting = self.config.connect(self.tls.clone());
        let (client, connection) = match timeout(self.timeout, connecting).await {
            Ok(Ok(pair)) => pair,
            Ok(Err(err)) => {
                return Err(Failure::new(
                    format!("cannot connect to {}", self.target),
                    err,
                ));
            }
            Err(_) => {
                return Err(Failure::msg(format!(
                    "cannot connect to {}: no answer within the connect timeout of {:?}",
                    self.target, self.timeout
                )));
            }
        };
        match on_notification {
            None => tokio::spawn(drive(connection, kill, on_end)),
            Some(forward) => tokio::spawn(drive(forwarding(connection, forward), kill, on_end)),
        };
        // First of all, before any statement that names a function.
        let lock_timeout_ms = lock_timeout.as_millis().max(1).to_string();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&lock_timeout_ms];
        let defaults = client.query_one(sql::SESSION_DEFAULTS, &params);
        match timeout(self.timeout, defaults).await {
            Ok(Ok(_)) => Ok(client),
            Ok(Err(err)) => Err(Failure::new(
                format!("cannot set up a session on {}", self.target),
                err,
            )),
            Err(_) => Err(Failure::msg(format!(
                "cannot set up a session on {}: no answer within the connect timeout of {:?}",
                self.target, self.timeout
            ))),
        }
    }
}

/// Runs a connection until the server or the network ends it, or until it
/// is told to stop; dropping the connection closes the socket, and the
/// server then drops every lock the session held. `on_end` is told why —
/// also when the runtime drops this task unfinished as it shuts down.
async fn drive<C, E>(connection: C, kill: oneshot::Receiver<String>, on_end: E)
where
    C: Future<Output = Result<(), tokio_postgres::Error>>,
    E: FnOnce(String),
{
    let mut on_end = OnEnd(Some(on_end));
    let reason = tokio::select! {
        ended = connection => match ended {
            Ok(()) => "the server closed the connection".to_owned(),
            Err(err) => match err.as_db_error() {
                Some(db) => db.to_string(),
                None => err.to_string(),
            },
        },
        why = kill => why.unwrap_or_else(|_| "the backend closed the session".to_owned()),
    };
    on_end.call(reason);
}

/// Where a listening connection's driver hands the notifications it gets.
pub(super) type OnNotification = Box<dyn FnMut(Notification) + Send + 'static>;

/// Drives `connection` as its own `Future` does, and hands each
/// notification to `forward` (that `Future` drops them).
async fn forwarding<S, T>(
    mut connection: Connection<S, T>,
    mut forward: OnNotification,
) -> Result<(), tokio_postgres::Error>
where
    S: AsyncRead + AsyncWrite + Unpin,
    T: AsyncRead + AsyncWrite + Unpin,
{
    std::future::poll_fn(move |cx| {
        loop {
            match ready!(connection.poll_message(cx)) {
                Some(Ok(AsyncMessage::Notification(notification))) => forward(notification),
                Some(Ok(AsyncMessage::Notice(notice))) => tracing::info!(
                    severity = notice.severity(),
                    "PostgreSQL notice on a listening connection: {}",
                    notice.message()
                ),
                Some(Ok(_)) => {}
                Some(Err(err)) => return Poll::Ready(Err(err)),
                None => return Poll::Ready(Ok(())),
            }
        }
    })
    .await
}

/// Calls its function once: with the given reason, or when dropped.
struct OnEnd<E: FnOnce(String)>(Option<E>);

impl<E: FnOnce(String)> OnEnd<E> {
    fn call(&mut self, why: String) {
        if let Some(on_end) = self.0.take() {
            on_end(why);
        }
    }
}

impl<E: FnOnce(String)> Drop for OnEnd<E> {
    fn drop(&mut self) {
        self.call("the runtime driving the connection shut down".to_owned());
    }
}

fn describe(config: &Config) -> String {
    let user = config.get_user().unwrap_or("(default user)");
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(host)) => host.clone(),
        Some(Host::Unix(path)) => path.display().to_string(),
        None => match config.get_hostaddrs().first() {
            Some(addr) => addr.to_string(),
            None => "localhost".to_owned(),
        },
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let db = config.get_dbname().unwrap_or(user);
    format!("{user}@{host}:{port}/{db}")
}

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
    /// Cleared when the server's advisory keys are not the ones the `hash`
    /// module computes (see [`advisory_key_of`](Self::advisory_key_of)).
    hashes: AtomicBool,
    /// Whether the server's encoding is UTF-8: else only ASCII keys have
    /// the advisory keys the `hash` module computes.
    utf8: AtomicBool,
    /// The keys whose holder records lock statements wrote on this
    /// session (see [`wrote_a_record`](Self::wrote_a_record)).
    recorded_keys: Mutex<HashSet<String>>,
    /// `Some(why)` once the connection has ended.
    ended: watch::Receiver<Option<String>>,
    kill: Mutex<Option<oneshot::Sender<String>>>,
    /// The advisory keys some lease of this process holds on this session:
    /// the index behind the backend's collision check, so it costs one
    /// lookup instead of a scan of every key held.
    claimed: Mutex<HashSet<i64>>,
    /// Holder records of plain leases released on this session, not yet
    /// deleted (see [`sql::DELETE_RELEASED`]).
    released: Mutex<Released>,
    /// The lock statements in flight on this session (see
    /// [`already_holds`](Self::already_holds)).
    in_flight: Mutex<Flying>,
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

/// Lock statements in flight on a session: how many of each advisory
/// key, how many whose advisory key is not known before the answer
/// (permit statements, which try slot after slot, and any statement once
/// the backend stopped trusting its own hash), and how many undos are
/// between their claim and their unlock (see
/// [`LockSession::claim_for_undo`]).
#[derive(Default)]
struct Flying {
    keys: HashMap<i64, usize>,
    unknown: usize,
    undoing: usize,
}

/// A lock statement counted in flight on its session until dropped (see
/// [`LockSession::already_holds`]): dropped once its lease claimed its
/// advisory key, or gave it back.
pub(super) struct InFlight {
    session: Arc<LockSession>,
    advisory_key: Option<i64>,
}

impl InFlight {
    /// The advisory key of the statement, if it was known when sent.
    pub(super) fn advisory_key(&self) -> Option<i64> {
        self.advisory_key
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut flying = self
            .session
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match self.advisory_key {
            Some(h) => {
                if let Some(count) = flying.keys.get_mut(&h) {
                    *count -= 1;
                    if *count == 0 {
                        flying.keys.remove(&h);
                    }
                }
            }
            None => flying.unknown = flying.unknown.saturating_sub(1),
        }
    }
}

/// An undo's claim of an advisory key (see
/// [`LockSession::claim_for_undo`]), given up when dropped.
pub(super) struct UndoClaim {
    session: Arc<LockSession>,
    advisory_key: i64,
}

impl Drop for UndoClaim {
    fn drop(&mut self) {
        let mut claimed = self
            .session
            .claimed
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut flying = self
            .session
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        claimed.remove(&self.advisory_key);
        flying.undoing -= 1;
    }
}

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
            modes: std::array::from_fn(|_| OnceCell::new()),
            record_writes: AsyncMutex::new(()),
            rewrites_paused_until: Mutex::new(None),
            announcements: Mutex::default(),
            retired: AtomicBool::new(false),
            hashes: AtomicBool::new(true),
            utf8: AtomicBool::new(true),
            recorded_keys: Mutex::default(),
            ended,
            kill: Mutex::new(Some(kill)),
            claimed: Mutex::default(),
            released: Mutex::default(),
            in_flight: Mutex::default(),
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

    /// True when no lease of this process holds a lock on this session.
    pub(super) fn holds_nothing(&self) -> bool {
        self.claimed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    }

    /// What it takes to cancel the statement running on this session.
    pub(super) fn cancel_token(&self) -> CancelToken {
        self.client.cancel_token()
    }

    /// Records that a lease now holds `advisory_key` on this session; false
    /// (and nothing recorded) when another lease already does — the server
    /// granted it again only because advisory locks are re-entrant.
    pub(super) fn claim(&self, advisory_key: i64) -> bool {
        self.claimed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(advisory_key)
    }

    /// Claims `advisory_key` for the undo of a failed lock statement
    /// (`own`: its in-flight mark) that cannot tell whether it took it,
    /// until the returned claim is dropped (after the undo's unlock).
    /// `None`, and nothing claimed, when a lease holds it, or another lock
    /// statement that may take it waits for its answer on this session
    /// (one of the same advisory key, or one whose advisory key is not
    /// known): that statement may have a fresh hold of it, not yet
    /// claimed, which the undo's one unlock would drop instead of its own.
    /// While the claim stands, no statement that may take the advisory key
    /// is sent on this session (see [`already_holds`](Self::already_holds)
    /// and [`mark_unknown`](Self::mark_unknown)), so the unlock drops what
    /// the failed statement took, or nothing.
    pub(super) fn claim_for_undo(
        self: &Arc<Self>,
        advisory_key: i64,
        own: &InFlight,
    ) -> Option<UndoClaim> {
        let mut claimed = self.claimed.lock().unwrap_or_else(PoisonError::into_inner);
        let mut flying = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let same = flying.keys.get(&advisory_key).copied().unwrap_or(0);
        let same = same.saturating_sub(usize::from(own.advisory_key == Some(advisory_key)));
        let unknown = flying
            .unknown
            .saturating_sub(usize::from(own.advisory_key.is_none()));
        if same > 0 || unknown > 0 || !claimed.insert(advisory_key) {
            return None;
        }
        flying.undoing += 1;
        Some(UndoClaim {
            session: Arc::clone(self),
            advisory_key,
        })
    }

    /// For a lock statement of a key whose advisory key is `advisory_key`
    /// (`None`: not known before the answer), about to be sent: `None`
    /// when a lease of this process, or an undo, claims that advisory key
    /// on this session (the attempt is answered held in process; the
    /// server would grant it only because advisory locks are re-entrant).
    /// Else whether the session holds the advisory key already, decided in
    /// process: `Some(true)` also when another lock statement of it is in
    /// flight (its lease may be the holder by the time this one runs), and
    /// `None` (the statement reads `pg_locks`) when a statement of an
    /// unknown advisory key is in flight, or this one's is unknown. Until
    /// the returned mark is dropped, the statement counts as in flight.
    pub(super) fn already_holds(
        self: &Arc<Self>,
        advisory_key: Option<i64>,
    ) -> Option<(Option<bool>, InFlight)> {
        let claimed = self.claimed.lock().unwrap_or_else(PoisonError::into_inner);
        let mut flying = self
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let answer = match advisory_key {
            Some(h) if claimed.contains(&h) => return None,
            None if flying.undoing > 0 => return None,
            Some(h) if flying.unknown == 0 => Some(flying.keys.contains_key(&h)),
            _ => None,
        };
        match advisory_key {
            Some(h) => *flying.keys.entry(h).or_default() += 1,
            None => flying.unknown += 1,
        }
        Some((
            answer,
            InFlight {
                session: Arc::clone(self),
                advisory_key,
            },
        ))
    }

    /// The advisory key of `key` with `seed`, computed in process; `None`
    /// for a key outside ASCII on a server whose encoding is not UTF-8,
    /// and for any key once this session found that the server computes
    /// another (see [`check_advisory_key`](Self::check_advisory_key)).
    pub(super) fn advisory_key_of(&self, key: &str, seed: i64) -> Option<i64> {
        let known = self.hashes.load(Ordering::Acquire)
            && (key.is_ascii() || self.utf8.load(Ordering::Acquire));
        known.then(|| super::hash::advisory_key(key, seed))
    }

    /// Takes what a new session learned of the server: whether it hashes
    /// the probe as the `hash` module does, and whether its encoding is
    /// UTF-8.
    pub(super) fn hashes_agree(&self, (probe, utf8): (bool, bool)) {
        self.utf8.store(utf8, Ordering::Release);
        if !probe {
            self.distrust_hashes();
        }
    }

    /// Stops computing advisory keys in process on this session: the
    /// server's differ (see the `hash` module).
    pub(super) fn distrust_hashes(&self) {
        if self.hashes.swap(false, Ordering::AcqRel) {
            tracing::warn!(
                pid = self.pid,
                "the server's advisory keys differ from the ones dlock computes: this lock \
                 session asks the server instead"
            );
        }
    }

    /// Compares the advisory key `expected` of `key` (computed in process)
    /// with the one the server answered, and stops trusting the former on
    /// this session when they differ.
    pub(super) fn check_advisory_key(&self, key: &str, expected: Option<i64>, server: i64) {
        if expected.is_some_and(|h| h != server) {
            tracing::warn!(
                key,
                expected,
                server,
                "an advisory key differs from the server's"
            );
            self.distrust_hashes();
        }
    }

    /// Counts a statement that may take any advisory key (a permit
    /// statement) in flight until the returned mark is dropped; `None`,
    /// and the statement must not be sent, while an undo on this session
    /// is between its claim and its unlock.
    pub(super) fn mark_unknown(self: &Arc<Self>) -> Option<InFlight> {
        self.already_holds(None).map(|(_, mark)| mark)
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

    /// Undoes a [`claim`](Self::claim) when the hold ends.
    pub(super) fn unclaim(&self, advisory_key: i64) {
        self.claimed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&advisory_key);
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
    /// [`sql::TRY_LOCK_RECORDING`] and [`sql::UNLOCK_RECORDED`] with the
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
/// keepalives watch it then (see [`Connector::keeping_alive`]), and a ping
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

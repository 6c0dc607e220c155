//! Fair mode: PostgreSQL's own queue of a key's advisory lock.
//!
//! PostgreSQL's lock manager queues the sessions that wait for a lock in
//! arrival order, and when the holder lets go it grants the lock to the
//! first waiter itself, before any other session can ask: that grant is
//! the handoff, with no round trip of the holder's beyond its unlock. So a
//! fair waiter (rules F1 to F3 of the `Backend` trait) is a session that
//! waits in that queue: the owner's first [`Queue::Join`] takes a *fair
//! session* (a connection of its own, shared with nothing while it waits)
//! and sends [`sql::FAIR_LOCK`] on it (or [`sql::FAIR_LOCK_RECORDING`], by
//! the rules a plain acquisition records by): `pg_advisory_lock` on the
//! key's advisory key, and once granted the token drawn and the holder
//! recorded in the same statement. The attempt answers `Held` once the
//! server shows the session waiting in the key's queue
//! ([`sql::WAITS_IN_QUEUE`]), so an attempt answered later is queued later,
//! or `Acquired` if the lock was granted first (the key was free). The
//! waits of one key of this process go to the server in the order their
//! first attempts came (each after the one before it shows queued), so a
//! waiter that reuses a kept session cannot pass one that opens a new
//! connection. The
//! statement runs on in a task at home; its grant becomes the owner's
//! lease on that session, which is then a lock session like any other
//! (renewed, released, lost with its session, its record read and
//! rewritten), and resolves the owner's handoff notice.
//!
//! The rules around it, and why they hold here:
//!
//! - [`Queue::Respect`] is the plain attempt, unchanged: the lock manager
//!   refuses `pg_try_advisory_lock` whenever a waiter is queued for a mode
//!   it conflicts with, even in the instant the lock is free, and a release
//!   grants the lock to the first waiter before returning, so the key is
//!   never free while someone waits. The in-process checks only ever
//!   answer `Held` early: a key this process holds or is taking, or one a
//!   fair waiter of this process is queued for or on its way into the
//!   queue for (its first attempt registered it: its place comes before
//!   the `Respect` try, even while it opens a connection). Plain
//!   attempts cannot pass a queued fair waiter either (nor can an older
//!   dlock's, nor any other client's `pg_try_advisory_lock`).
//! - Later `Join`s of the owner refresh its entry's expiry, or answer
//!   `Acquired` once the wait took the key (rule 3). Each `Join` answered
//!   `Held` also leaves or refreshes the owner's writer-waiting mark where
//!   readers hold the key (rule M3, see the `modes` module): the server's
//!   queue keeps new shared holders of other sessions out, but readers of
//!   a process that holds the key shared join that process's hold and ask
//!   only whether a writer's mark stands, so without a fresh mark they
//!   would starve the fair writer. The grant clears the mark. An entry not refreshed
//!   within its `entry_ttl`, or left by a release of its owner (rule F3),
//!   ends its wait: the task asks the server to cancel the statement (a
//!   cancel request, on a connection of its own) and waits for the
//!   statement to end, so the session has left the queue when the
//!   release returns; a lock granted in the race is given back, and the
//!   session kept (or closed, should anything fail).
//! - A grant to an owner that no longer listens (no handoff notice
//!   registered or still open, and no first attempt waiting) is given
//!   back at once, and the key passes on to the next waiter, as the
//!   reference backend skips a waiter that does not listen.
//! - A waiter process that dies closes its connection: the server notices
//!   it within [`PgOptions::liveness_interval`](super::PgOptions::liveness_interval)
//!   (`client_connection_check_interval`, PostgreSQL 14+ on Linux, macOS and
//!   the BSDs) and drops the session from the queue; elsewhere, when the
//!   key reaches the dead session, which then ends at once and passes it on.
//!
//! The wait is bounded only by its waiter: `lock_timeout` is 0 for the
//! wait itself (and dlock's own again for the draw), `statement_timeout`
//! and `transaction_timeout` are 0 on fair sessions, and
//! `idle_in_transaction_session_timeout` never applies (a fair session is
//! never idle in a transaction). A wait cut off all the same (a DBA's
//! `pg_cancel_backend`, the session terminated, the server restarted) is
//! sent again at once, at the end of the queue, on the same session or a
//! new one: the place is lost, never the waiter. A statement that fails
//! for another reason is handled as a plain lock statement's failure is
//! (the sequence restored, the record left out), and otherwise answered as
//! an error to the owner's next attempt.
//!
//! Over 700 lines: the PostgreSQL backend is being redesigned (no record per
//! acquisition), which removes most of the recording paths here; it is split
//! then, not before.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, SystemTime};

use tokio::sync::{Notify, oneshot, watch};
use tokio::time::{Instant, sleep, sleep_until, timeout};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

use super::connection::Failure;
use super::locks::{micros_since_1970, no_runtime};
use super::session::LockSession;
use super::{Entry, Holding, Identified, Inner, KIND, State, sql, xact};
use crate::backend::{AcquireRequest, Attempt, Grant, Handoff, OwnerId};
use crate::error::{LockError, Operation};
use crate::key::LockKey;

/// How long a fair session is kept for the next fair waiter after its last
/// use.
const KEPT_IDLE: Duration = Duration::from_secs(30);
/// How long a granted wait waits for this process's entry of the key (an
/// unlock or an attempt of another owner, on its way) to go before it
/// gives the key back.
const ENTRY_CLEARS_WITHIN: Duration = Duration::from_secs(5);
/// The longest pause between two waits sent again after a cut-off.
const MAX_RESTART_PAUSE: Duration = Duration::from_secs(1);

/// One owner's place in one key's queue.
type Place = (LockKey, OwnerId);

/// The fair waiters of one backend, their handoff notices, and the fair
/// sessions kept for the next waiter.
pub(super) struct Fair {
    /// Set by the first fair attempt or handoff notice: until then a
    /// release (every plain one) costs one load of it here, no lock.
    used: AtomicBool,
    queues: Mutex<Queues>,
    /// Told whenever a waiter is queued on the server or leaves (see
    /// [`Wait::until_first_in_process`]).
    enqueued: Notify,
    /// Fair sessions open, being opened, or reserved to be: at most `max`.
    sessions: AtomicUsize,
    max: usize,
}

#[derive(Default)]
struct Queues {
    waiters: HashMap<Place, Waiter>,
    /// The owners' handoff notices ([`Inner::subscribe_handoff`]), each
    /// with the number of its registration.
    handoffs: HashMap<Place, (u64, oneshot::Sender<Grant>)>,
    /// Fair sessions that hold nothing, with the number of their stay.
    idle: Vec<(Arc<LockSession>, u64)>,
    next_id: u64,
}

impl Queues {
    fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }
}

/// A fair waiter's entry: its wait runs in a task of its own.
struct Waiter {
    /// Which wait of the owner this is (an owner may queue again later);
    /// the waits of one key of this process are sent to the server in the
    /// order of their ids.
    id: u64,
    /// Whether the server showed the wait queued (or it was taken for
    /// queued), which the first attempt was answered on.
    queued: bool,
    /// When the entry expires unless a `Join` refreshes it: `entry_ttl`
    /// after the owner's latest attempt was answered.
    expires_at: Instant,
    entry_ttl: Duration,
    /// The ttl of the owner's latest attempt: a granted lease's.
    ttl: Duration,
    /// Dropped with the entry, which stops the wait.
    _stop: oneshot::Sender<()>,
    /// True once the task has let go of the wait (and of a lock granted in
    /// the race).
    done: watch::Receiver<bool>,
    /// Why the wait ended without the key, for the owner's next attempt.
    failed: Option<LockError>,
}

/// A fair session's count against [`Fair::max`], given back when dropped.
pub(super) struct FairTicket(Weak<Fair>);

impl Drop for FairTicket {
    fn drop(&mut self) {
        if let Some(fair) = self.0.upgrade() {
            fair.sessions.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// What a new wait starts with: a kept session, or the right to open one.
enum Reserved {
    Session(Arc<LockSession>),
    Ticket(FairTicket),
}

/// The first answer of a wait, to the attempt that started it.
enum First {
    /// The server shows the session waiting in the key's queue.
    Queued,
    /// The lock was granted (the key was free), and is the owner's lease.
    Granted(Grant),
    Failed(LockError),
}

impl Fair {
    pub(super) fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            used: AtomicBool::new(false),
            queues: Mutex::default(),
            enqueued: Notify::new(),
            sessions: AtomicUsize::new(0),
            max,
        })
    }

    fn queues(&self) -> MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The queues, for a fair attempt or a handoff notice.
    fn queues_in_use(&self) -> MutexGuard<'_, Queues> {
        self.used.store(true, Ordering::Release);
        self.queues()
    }

    /// The right to open one more fair session, if there is room.
    fn ticket(self: &Arc<Self>) -> Option<FairTicket> {
        self.sessions
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < self.max).then_some(open + 1)
            })
            .ok()?;
        Some(FairTicket(Arc::downgrade(self)))
    }

    /// A kept session that is still fit, or else the right to open one.
    fn reserve(self: &Arc<Self>, queues: &mut Queues) -> Option<Reserved> {
        while let Some((session, _)) = queues.idle.pop() {
            if !session.is_ended() && !session.is_retired() && session.claims.holds_nothing() {
                return Some(Reserved::Session(session));
            }
        }
        self.ticket().map(Reserved::Ticket)
    }
}

/// Drops the handoff registration it names, unless a newer one took its
/// place: a notice dropped unresolved leaves nothing registered.
struct Registered {
    fair: Weak<Fair>,
    place: Place,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Some(fair) = self.fair.upgrade() {
            let mut queues = fair.queues();
            if queues
                .handoffs
                .get(&self.place)
                .is_some_and(|(id, _)| *id == self.id)
            {
                queues.handoffs.remove(&self.place);
            }
        }
    }
}

impl Inner {
    /// A fair waiter's attempt ([`Queue::Join`]): see the module docs.
    ///
    /// [`Queue::Join`]: crate::backend::Queue::Join
    pub(super) async fn join(
        self: &Arc<Self>,
        request: &AcquireRequest<'_>,
        entry_ttl: Duration,
    ) -> Result<Attempt, LockError> {
        let (key, owner, ttl) = (request.key, *request.owner, request.ttl);
        let place: Place = (key.clone(), owner);
        let now = Instant::now();
        let started = 'queues: {
            let mut queues = self.fair.queues_in_use();
            let expires_in = {
                let mut keys = self.keys();
                match keys.get_mut(key) {
                    // The wait took the key (its notice may have been
                    // lost): rule 3, a lease for a ttl from now.
                    Some(entry) if entry.owner == owner => match &mut entry.state {
                        State::Held(holding) if holding.deadline() > now => {
                            holding.deadline_slot =
                                self.deadlines
                                    .moved(holding.deadline_slot, key, owner, now + ttl);
                            let grant =
                                Grant::new(holding.token).lost_with(holding.session.loss_group());
                            drop(keys);
                            queues.waiters.remove(&place);
                            return Ok(Attempt::Acquired(grant));
                        }
                        _ => None,
                    },
                    Some(entry) => entry
                        .holding()
                        .map(|h| h.deadline().saturating_duration_since(now)),
                    None => None,
                }
            };
            if let Some(waiter) = queues.waiters.get_mut(&place) {
                if waiter.failed.is_none() {
                    waiter.expires_at = now + entry_ttl;
                    waiter.entry_ttl = entry_ttl;
                    waiter.ttl = ttl;
                    break 'queues (expires_in, None);
                }
                // The wait ended with an error: this attempt answers it,
                // and the next one queues again.
                if let Some(err) = queues.waiters.remove(&place).and_then(|w| w.failed) {
                    return Err(err);
                }
            }
            // Entries of waits that failed and whose owner never came back.
            queues
                .waiters
                .retain(|_, w| w.failed.is_none() || w.expires_at > now);
            let Some(reserved) = self.fair.reserve(&mut queues) else {
                return Err(self.fair_sessions_busy(key));
            };
            let id = queues.next_id();
            let (stop_sender, stop) = oneshot::channel();
            let (done, done_receiver) = watch::channel(false);
            let (first_sender, first) = oneshot::channel();
            queues.waiters.insert(
                place,
                Waiter {
                    id,
                    queued: false,
                    expires_at: now + entry_ttl,
                    entry_ttl,
                    ttl,
                    _stop: stop_sender,
                    done: done_receiver,
                    failed: None,
                },
            );
            (
                None,
                Some((reserved, id, stop, done, (first_sender, first))),
            )
        };
        let (reserved, id, stop, done, first) = match started {
            (_, Some(started)) => started,
            (expires_in, None) => {
                // The entry was refreshed: a writer that waits keeps its
                // mark fresh too (rule M3).
                self.mark_writer(key, owner).await;
                return Ok(Attempt::Held { expires_in });
            }
        };
        let (first_sender, first) = first;
        let wait = Wait {
            inner: Arc::clone(self),
            key: key.clone(),
            owner,
            id,
            identity: request.identity.map(Arc::<str>::from),
            holder: request.holder_record(self.options.label.as_deref()),
            stop,
            stopped: false,
            done,
            first: Some(first_sender),
        };
        // Dropped unstarted when no runtime is left: its guard removes
        // the entry.
        if !self.home.spawn(wait_in_queue(wait, reserved)) {
            return Err(no_runtime(Operation::Acquire, key));
        }
        match first.await {
            Ok(First::Queued) => {
                self.mark_writer(key, owner).await;
                Ok(Attempt::Held { expires_in: None })
            }
            Ok(First::Granted(grant)) => Ok(Attempt::Acquired(grant)),
            Ok(First::Failed(err)) => Err(err),
            Err(_) => Err(no_runtime(Operation::Acquire, key)),
        }
    }

    /// Whether a fair waiter of this process is in `key`'s queue, or on its
    /// way into it: a [`Queue::Respect`] attempt of this process is then
    /// refused in process, as the server refuses it once that waiter's
    /// statement is queued.
    ///
    /// [`Queue::Respect`]: crate::backend::Queue::Respect
    pub(super) fn fair_waiter_queued(&self, key: &LockKey) -> bool {
        if !self.fair.used.load(Ordering::Acquire) {
            return false;
        }
        let now = Instant::now();
        self.fair
            .queues()
            .waiters
            .iter()
            .any(|((queued, _), waiter)| {
                queued == key
                    && waiter.failed.is_none()
                    && (!waiter.queued || waiter.expires_at > now)
            })
    }

    /// The error of a fair waiter that would need one fair session more
    /// than [`PgOptions::fair_sessions`](super::PgOptions::fair_sessions).
    fn fair_sessions_busy(&self, key: &LockKey) -> LockError {
        LockError::backend(
            KIND,
            Operation::Acquire,
            key.as_str(),
            Failure::msg(format!(
                "every fair session is in use ({} at most, PgOptions::fair_sessions): the \
                 waiter cannot queue until a fair waiter of this backend is served or leaves",
                self.options.fair_sessions
            )),
        )
    }

    /// Registers `owner`'s handoff notice for `key` (see the module docs).
    pub(super) fn subscribe_handoff(&self, key: &LockKey, owner: &OwnerId) -> Handoff {
        let (sender, receiver) = oneshot::channel();
        let place: Place = (key.clone(), *owner);
        let id = {
            let mut queues = self.fair.queues_in_use();
            let id = queues.next_id();
            queues.handoffs.insert(place.clone(), (id, sender));
            id
        };
        let registered = Registered {
            fair: Arc::downgrade(&self.fair),
            place,
            id,
        };
        Handoff::new(async move {
            let _registered = registered;
            match receiver.await {
                Ok(grant) => grant,
                // Left the queue, or the wait ended another way: the
                // waiter's next attempt decides.
                Err(_) => std::future::pending().await,
            }
        })
    }

    /// Rule F3: `owner` leaves `key`'s queue, if it is in it, and its
    /// handoff notice goes. Returns once its wait has left the server's
    /// queue (see [`cancel_wait`](Self::cancel_wait)), or after twice the
    /// connect timeout and a second. Costs a plain release one atomic
    /// load, or, once fair mode was used, one look at an empty map.
    pub(super) async fn leave_queue(&self, key: &LockKey, owner: &OwnerId) {
        if !self.fair.used.load(Ordering::Acquire) {
            return;
        }
        let done = {
            let mut queues = self.fair.queues();
            if queues.waiters.is_empty() && queues.handoffs.is_empty() {
                return;
            }
            let place: Place = (key.clone(), *owner);
            queues.handoffs.remove(&place);
            queues
                .waiters
                .remove(&place)
                .map(|waiter| waiter.done.clone())
        };
        if let Some(mut done) = done {
            // A cancel request, then the statement's end: each within
            // the connect timeout.
            let within = self.connector.connect_timeout() * 2 + Duration::from_secs(1);
            let _ = timeout(within, done.wait_for(|done| *done)).await;
        }
    }

    /// Keeps `session`, a fair session that holds nothing now, for the next
    /// fair waiter, for [`KEPT_IDLE`]; any other session is left alone.
    pub(super) fn fair_session_free(self: &Arc<Self>, session: &Arc<LockSession>) {
        if !session.is_fair()
            || session.is_ended()
            || session.is_retired()
            || !session.claims.holds_nothing()
        {
            return;
        }
        let stay = {
            let mut queues = self.fair.queues();
            if queues
                .idle
                .iter()
                .any(|(kept, _)| Arc::ptr_eq(kept, session))
            {
                return;
            }
            let stay = queues.next_id();
            queues.idle.push((Arc::clone(session), stay));
            stay
        };
        let fair = Arc::downgrade(&self.fair);
        self.home.spawn(async move {
            sleep(KEPT_IDLE).await;
            let Some(fair) = fair.upgrade() else { return };
            let closed = {
                let mut queues = fair.queues();
                queues
                    .idle
                    .iter()
                    .position(|(_, kept)| *kept == stay)
                    .map(|at| queues.idle.swap_remove(at))
            };
            // Dropping the last handle closes the connection.
            drop(closed);
        });
    }

    /// Waits until the server shows the server process `pid` waiting in an
    /// advisory lock's queue, asking on a lock session; gives up after the
    /// connect timeout (the wait is then taken as queued).
    async fn until_queued(self: &Arc<Self>, pid: i32) {
        let give_up = Instant::now() + self.connector.connect_timeout();
        let mut pause = Duration::from_millis(1);
        while Instant::now() < give_up {
            if let Ok(session) = self.session().await
                && let Ok(rows) = session
                    .query_typed(sql::WAITS_IN_QUEUE, &[(&pid, Type::INT4)])
                    .await
                && rows.first().and_then(|row| row.try_get(0).ok()) == Some(true)
            {
                return;
            }
            sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// Drops every advisory lock `session` holds (a fair session holds
    /// none but what its failed statement may have taken); ends the session
    /// if that fails. False if the session is gone.
    async fn drop_fair_locks(&self, session: &LockSession) -> bool {
        match session.query_typed(sql::UNLOCK_ALL, &[]).await {
            Ok(_) => true,
            Err(_) => {
                session.end("could not drop the locks of a failed fair wait".to_owned());
                false
            }
        }
    }

    /// Ends a wait nobody wants any more (its statement `sent`, on
    /// `session`): asks the server to cancel the statement, and waits (at
    /// most the connect timeout) until it ended, so the session has left
    /// the key's queue. A lock granted in the race is given back, with the
    /// record it wrote, and the session kept; a session whose statement
    /// does not end, or whose clean-up fails, is closed, which drops
    /// everything it held.
    async fn cancel_wait<F>(
        self: &Arc<Self>,
        session: &Arc<LockSession>,
        wait: &Wait,
        sent: &mut std::pin::Pin<&mut F>,
        recording: Option<SystemTime>,
    ) where
        F: Future<Output = Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>>,
    {
        let key = &wait.key;
        if let Err(err) = self.fair_connector.cancel(session.cancel_token()).await {
            tracing::debug!(
                key = %key,
                error = %err,
                "could not cancel a fair wait; closing its session (the server drops the wait \
                 when it checks the connection, or when the key reaches it)"
            );
            session.set_waiting(false);
            session.end(format!("the fair wait for `{key}` was given up"));
            return;
        }
        let ended = timeout(self.connector.connect_timeout(), sent.as_mut()).await;
        session.set_waiting(false);
        match ended {
            // Granted before the cancel came.
            Ok(Ok(rows)) => match granted(&rows, recording) {
                Some(Ok((advisory_key, Some(token), since))) => {
                    let immediate = since.is_some() && wait.identity.is_some();
                    let record = since.map(|_| token);
                    self.give_back_fair(session, advisory_key, record, immediate)
                        .await;
                }
                _ => session.end(format!("the fair wait for `{key}` was given up")),
            },
            // Cancelled (a cancel that struck after the grant, in the
            // draw, leaves the lock held, and nothing else).
            Ok(Err(err)) if !err.is_closed() && !session.is_ended() => {
                if self.drop_fair_locks(session).await {
                    self.fair_session_free(session);
                }
            }
            _ => session.end(format!("the fair wait for `{key}` was given up")),
        }
    }

    /// Gives back a lock a fair wait took that no owner takes: dropped with
    /// its record as a lease's would be, and the session kept (or ended,
    /// should the unlock fail).
    async fn give_back_fair(
        self: &Arc<Self>,
        session: &Arc<LockSession>,
        advisory_key: i64,
        record: Option<i64>,
        immediate: bool,
    ) {
        match self
            .unlock_on(session, advisory_key, record, immediate)
            .await
        {
            Ok(unlocked) if unlocked.record_left.is_none() => self.fair_session_free(session),
            Ok(_) => {}
            Err(_) => session.end("could not give back a lock no fair waiter took".to_owned()),
        }
    }
}

/// One owner's wait in one key's queue, run by [`wait_in_queue`].
struct Wait {
    inner: Arc<Inner>,
    key: LockKey,
    owner: OwnerId,
    id: u64,
    identity: Option<Arc<str>>,
    /// The holder record ([`crate::HolderInfo::encode`]).
    holder: String,
    /// Resolves when the entry is removed (rule F3).
    stop: oneshot::Receiver<()>,
    /// Set once the wait is no longer wanted.
    stopped: bool,
    /// Set (and dropped) when the task ends.
    done: watch::Sender<bool>,
    /// The first attempt, until it is answered.
    first: Option<oneshot::Sender<First>>,
}

impl Wait {
    fn place(&self) -> Place {
        (self.key.clone(), self.owner)
    }

    /// Tells the first attempt that the wait is queued; the entry lives
    /// its `entry_ttl` from this answer. The waits of the key that came
    /// after it in this process may go to the server now.
    fn report_queued(&mut self) {
        if let Some(first) = self.first.take() {
            let _ = first.send(First::Queued);
            let place = self.place();
            {
                let mut queues = self.inner.fair.queues();
                if let Some(waiter) = queues.waiters.get_mut(&place).filter(|w| w.id == self.id) {
                    waiter.expires_at = Instant::now() + waiter.entry_ttl;
                    waiter.queued = true;
                }
            }
            self.inner.fair.enqueued.notify_waiters();
        }
    }

    /// Waits until every earlier wait of this key in this process is
    /// queued on the server, or gone: a process's waiters of one key are
    /// queued in the order their first attempts came, however long each
    /// takes to get a session. Only a first wait does: one sent again
    /// (after a cut-off) goes at once, its place being lost anyway. False
    /// if the wait is no longer wanted meanwhile.
    async fn until_first_in_process(&mut self) -> bool {
        if self.first.is_none() {
            return true;
        }
        let fair = Arc::clone(&self.inner.fair);
        loop {
            let told = fair.enqueued.notified();
            tokio::pin!(told);
            told.as_mut().enable();
            let behind = {
                let queues = fair.queues();
                queues.waiters.iter().any(|((key, _), waiter)| {
                    *key == self.key
                        && waiter.id < self.id
                        && !waiter.queued
                        && waiter.failed.is_none()
                })
            };
            if !behind {
                return true;
            }
            tokio::select! {
                () = told => {}
                // A safety net: an earlier wait's task that ends without
                // a word is seen within this.
                () = sleep(Duration::from_millis(50)) => {}
                () = self.unwanted() => return false,
            }
        }
    }

    /// Ends the wait with `err`: the first attempt's answer if it still
    /// waits for one, else the owner's next attempt's.
    fn fail(&mut self, err: LockError) {
        let err = match self.first.take() {
            Some(first) => match first.send(First::Failed(err)) {
                Ok(()) => return,
                Err(First::Failed(err)) => err,
                Err(_) => return,
            },
            None => err,
        };
        let place = self.place();
        let mut queues = self.inner.fair.queues();
        if let Some(waiter) = queues.waiters.get_mut(&place).filter(|w| w.id == self.id) {
            waiter.failed = Some(err);
        }
    }

    /// Resolves once nobody wants the wait any more: its entry was removed
    /// (its owner left the queue), or it expired unrefreshed (and is
    /// removed here). An entry does not expire while its first attempt
    /// waits for its answer: its life counts from that answer.
    async fn unwanted(&mut self) {
        if self.stopped {
            return;
        }
        let place = self.place();
        loop {
            let expires_at = {
                let mut queues = self.inner.fair.queues();
                match queues.waiters.get(&place) {
                    Some(waiter) if waiter.id == self.id => {
                        if self.first.is_some() {
                            None
                        } else if waiter.expires_at <= Instant::now() {
                            queues.waiters.remove(&place);
                            self.stopped = true;
                            return;
                        } else {
                            Some(waiter.expires_at)
                        }
                    }
                    _ => {
                        self.stopped = true;
                        return;
                    }
                }
            };
            let expiry = async {
                match expires_at {
                    Some(at) => sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut self.stop => {
                    self.stopped = true;
                    return;
                }
                () = expiry => {}
            }
        }
    }
}

impl Drop for Wait {
    /// However the task ends (its runtime shutting down included), the
    /// owner's entry goes with it, unless it keeps an error for the owner's
    /// next attempt; then whoever waits for the wait to end hears of it.
    fn drop(&mut self) {
        let place = self.place();
        let unfinished = {
            let mut queues = self.inner.fair.queues();
            let unfinished = queues
                .waiters
                .get(&place)
                .is_some_and(|w| w.id == self.id && w.failed.is_none());
            if unfinished {
                queues.waiters.remove(&place);
            }
            unfinished
        };
        // A first attempt still waiting for its answer: the owner left the
        // queue meanwhile, and the key is not its (`Held`); unless the task
        // was dropped unfinished, with its runtime, which that attempt
        // hears as such.
        if !unfinished && let Some(first) = self.first.take() {
            let _ = first.send(First::Queued);
        }
        self.inner.fair.enqueued.notify_waiters();
        self.done.send_replace(true);
    }
}

/// The task of one fair wait (see the module docs): a session of its own,
/// the wait statement, and what comes of it.
async fn wait_in_queue(mut wait: Wait, reserved: Reserved) {
    let inner = Arc::clone(&wait.inner);
    let (mut session, mut ticket) = match reserved {
        Reserved::Session(session) => (Some(session), None),
        Reserved::Ticket(ticket) => (None, Some(ticket)),
    };
    // Whether leases without an identity record: `None` asks again.
    let mut record: Option<bool> = None;
    let mut restored = false;
    let mut pause = Duration::ZERO;
    loop {
        if !pause.is_zero() {
            tokio::select! {
                () = sleep(pause) => {}
                () = wait.unwanted() => return,
            }
        }
        let on = match session.take().filter(|on| !on.is_ended()) {
            Some(on) => on,
            None => {
                let Some(ticket) = ticket.take().or_else(|| inner.fair.ticket()) else {
                    return wait.fail(inner.fair_sessions_busy(&wait.key));
                };
                let opened = tokio::select! {
                    opened = inner.open_fair_session(ticket) => opened,
                    () = wait.unwanted() => return,
                };
                match opened {
                    Ok(on) => on,
                    Err(err) => {
                        let err =
                            LockError::backend(KIND, Operation::Acquire, wait.key.as_str(), err);
                        return wait.fail(err);
                    }
                }
            }
        };
        // Recorded by the rules of a plain acquisition (`Inner::try_lock`).
        let recording = if wait.identity.is_some() {
            if let Err(err) = inner.ensure_holders_table(&wait.key, false).await {
                inner.fair_session_free(&on);
                return wait.fail(err);
            }
            true
        } else {
            match record {
                Some(record) => record,
                None => inner.may_record(&wait.key).await,
            }
        };
        let recording = on.started.filter(|_| recording);
        if recording.is_none() && on.may_have_a_record_of(wait.key.as_str()) {
            // A record it wrote of an earlier lease could be read for this
            // one (see `LockSession::wrote_a_record`): another session.
            on.end(
                "a fair session that wrote holder records takes no lease without one".to_owned(),
            );
            continue;
        }
        if !wait.until_first_in_process().await {
            // Nobody wants it any more: the session was not used.
            inner.fair_session_free(&on);
            return;
        }
        on.set_waiting(true);
        let answer = {
            let sent = send_wait(
                Arc::clone(&inner),
                Arc::clone(&on),
                wait.key.clone(),
                wait.identity.clone(),
                wait.holder.clone(),
                recording,
            );
            tokio::pin!(sent);
            let queued = inner.until_queued(on.pid);
            tokio::pin!(queued);
            let mut reporting = wait.first.is_some();
            let wanted = loop {
                tokio::select! {
                    biased;
                    answer = &mut sent => break Some(answer),
                    () = &mut queued, if reporting => {
                        reporting = false;
                        wait.report_queued();
                    }
                    () = wait.unwanted() => break None,
                }
            };
            match wanted {
                Some(answer) => answer,
                None => {
                    // Nobody wants the wait any more: it leaves the queue
                    // before the task ends (a release of its owner returns
                    // only then).
                    inner.cancel_wait(&on, &wait, &mut sent, recording).await;
                    return;
                }
            }
        };
        on.set_waiting(false);
        let err = match answer {
            Ok(rows) => {
                match granted(&rows, recording) {
                    // Granted, and the record written if it was to be.
                    Some(Ok((advisory_key, Some(token), since)))
                        if recording.is_none() || since.is_some() =>
                    {
                        if since.is_some() {
                            on.wrote_a_record(wait.key.as_str());
                        }
                        return deliver(wait, on, advisory_key, token, since).await;
                    }
                    // Granted, and a DBA's trigger or rule skipped the write:
                    // the record there, if any, is an earlier lease's. The
                    // lock goes back; a lease without an identity waits
                    // again without its record.
                    Some(Ok((_, Some(_), _))) => {
                        // A trigger may have written a row of its own
                        // making (see `Inner::try_lock`).
                        on.wrote_a_record(wait.key.as_str());
                        if !inner.drop_fair_locks(&on).await {
                            pause = restart_pause(pause);
                            continue;
                        }
                        let what = format!(
                            "the fair lock statement of `{}` wrote no record, which a trigger \
                             or a rule on {}.dlock_holders skips: the lock was not taken",
                            wait.key, inner.quoted_schema
                        );
                        if wait.identity.is_none() {
                            inner.records_unusable(&what);
                            record = Some(false);
                            session = Some(on);
                            continue;
                        }
                        inner.fair_session_free(&on);
                        return wait.fail(LockError::backend(
                            KIND,
                            Operation::Acquire,
                            wait.key.as_str(),
                            Failure::msg(what),
                        ));
                    }
                    // An answer it cannot read: the record may be there.
                    Some(Err(err)) => {
                        if recording.is_some() {
                            on.wrote_a_record(wait.key.as_str());
                        }
                        err
                    }
                    // Never: the statement waits until it is granted.
                    _ => {
                        if inner.drop_fair_locks(&on).await {
                            inner.fair_session_free(&on);
                        }
                        return wait.fail(LockError::backend(
                            KIND,
                            Operation::Acquire,
                            wait.key.as_str(),
                            Failure::msg("the fair wait statement answered no token"),
                        ));
                    }
                }
            }
            Err(err) => err,
        };
        // A session lock outlives the statement that took it: a failure
        // after the grant leaves the lock held, and a fair session holds
        // no other.
        let alive = !err.is_closed() && !on.is_ended() && inner.drop_fair_locks(&on).await;
        if !alive {
            // The session went (terminated, a restart, a half-open
            // connection found by its keepalives): queue again on another.
            tracing::debug!(key = %wait.key, error = %err, "a fair wait's session ended; queuing again");
            pause = restart_pause(pause);
            continue;
        }
        if err.code() == Some(&SqlState::QUERY_CANCELED) {
            // Not this backend's cancel (that one ends the session): a
            // DBA's, or a timeout set despite the session's settings.
            tracing::warn!(
                key = %wait.key,
                error = %err,
                "a fair wait was cancelled on the server; it queues again, at the end of the queue"
            );
            session = Some(on);
            pause = restart_pause(pause);
            continue;
        }
        if sql::sequence_missing(&err) && !restored {
            restored = true;
            if let Err(err) = Box::pin(inner.restore_objects()).await {
                inner.fair_session_free(&on);
                let err = LockError::backend(KIND, Operation::Acquire, wait.key.as_str(), err);
                return wait.fail(err);
            }
            if wait.identity.is_some() {
                // Or the table of holder records went.
                if let Err(err) = inner.ensure_holders_table(&wait.key, true).await {
                    inner.fair_session_free(&on);
                    return wait.fail(err);
                }
            } else if recording.is_some() {
                inner.holders_state.set_unchecked();
                record = None;
            }
            session = Some(on);
            continue;
        }
        // A lease without an identity never fails for its record (see
        // `Inner::try_lock`).
        if wait.identity.is_none()
            && recording.is_some()
            && err.as_db_error().is_some()
            && sql::refused_sequence(&err).is_none()
        {
            if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
                inner.records_locked(&wait.key, &err);
            } else {
                inner.records_unusable(&err);
            }
            record = Some(false);
            session = Some(on);
            continue;
        }
        inner.fair_session_free(&on);
        return wait.fail(inner.lock_error(&wait.key, err, recording.is_some()));
    }
}

/// The advisory key, the token, and the time of the record (if `recording`)
/// of a wait statement's answer.
type Granted = (i64, Option<i64>, Option<SystemTime>);

/// Reads a wait statement's answer (see [`sql::FAIR_LOCK`]); `None`
/// without a row.
fn granted(
    rows: &[tokio_postgres::Row],
    recording: Option<SystemTime>,
) -> Option<Result<Granted, tokio_postgres::Error>> {
    rows.first().map(|row| {
        let since = if recording.is_some() {
            sql::recorded_since(row, 2, None)?.0
        } else {
            None
        };
        Ok((row.try_get(0)?, row.try_get(1)?, since))
    })
}

/// The pause before a wait is sent again after a cut-off: 10 ms, doubling
/// up to [`MAX_RESTART_PAUSE`].
fn restart_pause(pause: Duration) -> Duration {
    if pause.is_zero() {
        Duration::from_millis(10)
    } else {
        (pause * 2).min(MAX_RESTART_PAUSE)
    }
}

/// Sends the wait statement for `key` on `session`: recording the holder
/// (`identity` and `holder`, the session's start given) or not. One round
/// trip, unprepared.
async fn send_wait(
    inner: Arc<Inner>,
    session: Arc<LockSession>,
    key: LockKey,
    identity: Option<Arc<str>>,
    holder: String,
    recording: Option<SystemTime>,
) -> Result<Vec<tokio_postgres::Row>, tokio_postgres::Error> {
    let key = key.as_str();
    let seed = &inner.options.key_seed;
    match recording {
        None => {
            session
                .query_typed(
                    &inner.fair_lock_sql,
                    &[(&key, Type::TEXT), (seed, Type::INT8)],
                )
                .await
        }
        Some(started) => {
            let identity = identity.as_deref();
            session
                .query_typed(
                    &inner.fair_lock_recording_sql,
                    &[
                        (&key, Type::TEXT),
                        (seed, Type::INT8),
                        (&identity, Type::TEXT),
                        (&started, Type::TIMESTAMPTZ),
                        (&holder, Type::TEXT),
                    ],
                )
                .await
        }
    }
}

/// What a granted wait does under the queues' and the keys' locks.
enum Step {
    /// Another owner's entry of the key is still there: wait for it to go.
    Wait(watch::Receiver<()>),
    /// Nobody takes the grant: give it back.
    GiveBack,
    /// The lease is the owner's: tell it.
    Held(Option<(u64, oneshot::Sender<Grant>)>),
}

/// The lock was granted to `wait` on `on`, with `token` (and a record
/// written at `since`, if it wrote one): the lease becomes the owner's, in
/// this process's entry of the key, and its first attempt or its handoff
/// notice hears of it; or, if neither listens, or the owner left the
/// queue meanwhile, the lock is given back and passes on.
async fn deliver(
    mut wait: Wait,
    on: Arc<LockSession>,
    advisory_key: i64,
    token: i64,
    since: Option<SystemTime>,
) {
    let inner = Arc::clone(&wait.inner);
    let recorded = since.is_some();
    let record = recorded.then_some(token);
    let immediate = recorded && wait.identity.is_some();
    let token = match xact::to_token(token, wait.key.as_str()) {
        Ok(token) => token,
        Err(err) => {
            inner
                .give_back_fair(&on, advisory_key, record, immediate)
                .await;
            return wait.fail(err);
        }
    };
    let place = wait.place();
    let clears_by = Instant::now() + ENTRY_CLEARS_WITHIN;
    let handoff = loop {
        let step = {
            let mut queues = inner.fair.queues();
            match queues.waiters.get(&place) {
                Some(waiter) if waiter.id == wait.id => {
                    let ttl = waiter.ttl;
                    let first_listens = wait.first.as_ref().is_some_and(|f| !f.is_closed());
                    let notice_listens = queues
                        .handoffs
                        .get(&place)
                        .is_some_and(|(_, notice)| !notice.is_closed());
                    if !first_listens && !notice_listens {
                        queues.waiters.remove(&place);
                        Step::GiveBack
                    } else {
                        let mut keys = inner.keys();
                        match keys.get_mut(&wait.key) {
                            // An unlock, or another owner's attempt, on its
                            // way: it ends in a round trip.
                            Some(entry) if Instant::now() < clears_by => Step::Wait(
                                entry
                                    .gone
                                    .get_or_insert_with(|| watch::channel(()).0)
                                    .subscribe(),
                            ),
                            None if on.claims.claim(advisory_key) => {
                                let deadline_slot = inner.deadlines.add(
                                    Arc::downgrade(&inner),
                                    &wait.key,
                                    wait.owner,
                                    Instant::now() + ttl,
                                );
                                let identity =
                                    wait.identity.clone().zip(since).map(|(identity, since)| {
                                        Box::new(Identified {
                                            identity,
                                            holder: wait.holder.clone().into_boxed_str(),
                                            since_us: micros_since_1970(since),
                                        })
                                    });
                                let mut entry = Entry::new(wait.owner);
                                entry.state = State::Held(Holding {
                                    session: Arc::clone(&on),
                                    advisory_key,
                                    token,
                                    recorded,
                                    identity,
                                    deadline_slot,
                                    deadlines: Arc::clone(&inner.deadlines),
                                });
                                keys.insert(wait.key.clone(), entry);
                                queues.waiters.remove(&place);
                                Step::Held(queues.handoffs.remove(&place))
                            }
                            _ => {
                                queues.waiters.remove(&place);
                                Step::GiveBack
                            }
                        }
                    }
                }
                // The owner left the queue as the lock came.
                _ => Step::GiveBack,
            }
        };
        match step {
            Step::Held(handoff) => break handoff,
            Step::GiveBack => {
                inner
                    .give_back_fair(&on, advisory_key, record, immediate)
                    .await;
                return;
            }
            Step::Wait(mut gone) => {
                let _ = timeout(Duration::from_millis(50), gone.changed()).await;
            }
        }
    };
    let grant = || Grant::new(token).lost_with(on.loss_group());
    let mut delivered = false;
    if let Some(first) = wait.first.take() {
        delivered = first.send(First::Granted(grant())).is_ok();
    }
    if !delivered && let Some((_, notice)) = handoff {
        delivered = notice.send(grant()).is_ok();
    }
    if !delivered {
        // It stopped listening this instant: a holder's release, which
        // passes the key on.
        let _ = inner.unlock(&wait.key, Some(wait.owner), false).await;
        return;
    }
    if immediate {
        // For watches of the free key, in other processes too.
        inner.announce_later(&on, &wait.key, advisory_key);
    }
    // Taking the key clears the owner's writer-waiting mark.
    inner.unmark_writer(&wait.key, wait.owner).await;
}

//! The queues of one backend's fair waiters (see the `fair` module docs),
//! the fair sessions kept for the next waiter, and a wait's side of its
//! entry ([`Wait`]).
//!
//! Its own file: the owner's attempts (`fair`), the wait's task
//! (`fair_wait`), its statement (`fair_statement`) and its grant
//! (`fair_grant`) all meet here, and it imports none of them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::{Notify, oneshot, watch};
use tokio::time::{Instant, sleep, sleep_until};

use super::connection::Failure;
use super::session::LockSession;
use super::{Inner, KIND};
use crate::backend::kit::after;
use crate::backend::{Grant, OwnerId};
use crate::error::{LockError, Operation};
use crate::key::LockKey;

/// How long a fair session is kept for the next fair waiter after its last
/// use.
const KEPT_IDLE: Duration = Duration::from_secs(30);

/// One owner's place in one key's queue.
pub(super) type Place = (LockKey, OwnerId);

/// The fair waiters of one backend, their handoff notices, and the fair
/// sessions kept for the next waiter.
pub(super) struct Fair {
    /// Set by the first fair attempt or handoff notice: until then a
    /// release (every plain one) costs one load of it here, no lock.
    pub(super) used: AtomicBool,
    queues: Mutex<Queues>,
    /// Told whenever a waiter is queued on the server or leaves (see
    /// [`Wait::until_first_in_process`]).
    pub(super) enqueued: Notify,
    /// Fair sessions open, being opened, or reserved to be: at most `max`.
    sessions: AtomicUsize,
    max: usize,
}

#[derive(Default)]
pub(super) struct Queues {
    pub(super) waiters: HashMap<Place, Waiter>,
    /// The owners' handoff notices ([`Inner::subscribe_handoff`]), each
    /// with the number of its registration.
    pub(super) handoffs: HashMap<Place, (u64, oneshot::Sender<Grant>)>,
    /// Fair sessions that hold nothing, with the number of their stay.
    pub(super) idle: Vec<(Arc<LockSession>, u64)>,
    next_id: u64,
}

impl Queues {
    pub(super) fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }
}

/// A fair waiter's entry: its wait runs in a task of its own.
pub(super) struct Waiter {
    /// Which wait of the owner this is (an owner may queue again later);
    /// the waits of one key of this process are sent to the server in the
    /// order of their ids.
    pub(super) id: u64,
    /// Whether the server showed the wait queued (or it was taken for
    /// queued), which the first attempt was answered on.
    pub(super) queued: bool,
    /// When the entry expires unless a `Join` refreshes it: `entry_ttl`
    /// after the owner's latest attempt was answered.
    pub(super) expires_at: Instant,
    pub(super) entry_ttl: Duration,
    /// The ttl of the owner's latest attempt: a granted lease's.
    pub(super) ttl: Duration,
    /// Dropped with the entry, which stops the wait.
    pub(super) _stop: oneshot::Sender<()>,
    /// True once the task has let go of the wait (and of a lock granted in
    /// the race).
    pub(super) done: watch::Receiver<bool>,
    /// Why the wait ended without the key, for the owner's next attempt.
    pub(super) failed: Option<LockError>,
}

/// A fair session's count against [`Fair::max`], given back when dropped.
pub(super) struct FairTicket(Weak<Fair>);

/// Set on a fair session: the session counts against
/// [`PgOptions::fair_sessions`](super::PgOptions::fair_sessions) until it
/// is dropped.
#[derive(Default)]
struct FairSession(OnceLock<FairTicket>);

impl LockSession {
    /// Makes this a fair session, counted by `ticket` until it is dropped.
    pub(super) fn make_fair(&self, ticket: FairTicket) {
        let _ = self.feature::<FairSession>().0.set(ticket);
    }

    /// True for a fair session (see the `fair` module).
    pub(super) fn is_fair(&self) -> bool {
        self.feature::<FairSession>().0.get().is_some()
    }
}

impl Drop for FairTicket {
    fn drop(&mut self) {
        if let Some(fair) = self.0.upgrade() {
            fair.sessions.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// What a new wait starts with: a kept session, or the right to open one.
pub(super) enum Reserved {
    Session(Arc<LockSession>),
    Ticket(FairTicket),
}

/// The first answer of a wait, to the attempt that started it.
pub(super) enum First {
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

    pub(super) fn queues(&self) -> MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The queues, for a fair attempt or a handoff notice.
    pub(super) fn queues_in_use(&self) -> MutexGuard<'_, Queues> {
        self.used.store(true, Ordering::Release);
        self.queues()
    }

    /// The right to open one more fair session, if there is room.
    pub(super) fn ticket(self: &Arc<Self>) -> Option<FairTicket> {
        self.sessions
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < self.max).then_some(open + 1)
            })
            .ok()?;
        Some(FairTicket(Arc::downgrade(self)))
    }

    /// A kept session that is still fit, or else the right to open one.
    pub(super) fn reserve(self: &Arc<Self>, queues: &mut Queues) -> Option<Reserved> {
        while let Some((session, _)) = queues.idle.pop() {
            if !session.is_ended() && !session.is_retired() && session.claims.holds_nothing() {
                return Some(Reserved::Session(session));
            }
        }
        self.ticket().map(Reserved::Ticket)
    }
}

/// One owner's wait in one key's queue, run by `fair_wait::wait_in_queue`.
pub(super) struct Wait {
    pub(super) inner: Arc<Inner>,
    pub(super) key: LockKey,
    pub(super) owner: OwnerId,
    pub(super) id: u64,
    pub(super) identity: Option<Arc<str>>,
    /// The holder record ([`crate::HolderInfo::encode`]).
    pub(super) holder: String,
    /// Resolves when the entry is removed (rule F3).
    pub(super) stop: oneshot::Receiver<()>,
    /// Set once the wait is no longer wanted.
    pub(super) stopped: bool,
    /// Set (and dropped) when the task ends.
    pub(super) done: watch::Sender<bool>,
    /// The first attempt, until it is answered.
    pub(super) first: Option<oneshot::Sender<First>>,
}

impl Wait {
    pub(super) fn place(&self) -> Place {
        (self.key.clone(), self.owner)
    }

    /// Tells the first attempt that the wait is queued; the entry lives
    /// its `entry_ttl` from this answer. The waits of the key that came
    /// after it in this process may go to the server now.
    pub(super) fn report_queued(&mut self) {
        if let Some(first) = self.first.take() {
            let _ = first.send(First::Queued);
            let place = self.place();
            {
                let mut queues = self.inner.fair.queues();
                if let Some(waiter) = queues.waiters.get_mut(&place).filter(|w| w.id == self.id) {
                    waiter.expires_at = after(Instant::now(), waiter.entry_ttl);
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
    pub(super) async fn until_first_in_process(&mut self) -> bool {
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
    pub(super) fn fail(&mut self, err: LockError) {
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
    pub(super) async fn unwanted(&mut self) {
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

impl Inner {
    /// The error of a fair waiter that would need one fair session more
    /// than [`PgOptions::fair_sessions`](super::PgOptions::fair_sessions).
    pub(super) fn fair_sessions_busy(&self, key: &LockKey) -> LockError {
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
}

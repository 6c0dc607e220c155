//! Fair mode: PostgreSQL's own queue of a key's advisory lock.
//!
//! PostgreSQL's lock manager queues the sessions that wait for a lock in
//! arrival order, and when the holder lets go it grants the lock to the
//! first waiter itself, before any other session can ask: that grant is
//! the handoff, with no round trip of the holder's beyond its unlock. So a
//! fair waiter (rules F1 to F3 of the `Backend` trait) is a session that
//! waits in that queue: the owner's first [`Queue::Join`] takes a *fair
//! session* (a connection of its own, shared with nothing while it waits)
//! and sends [`sql::FAIR_LOCK`] on it: `pg_advisory_lock` on the key's
//! advisory key, and once granted the token drawn in the same statement.
//! A waiter whose holder is recorded (by the rules a plain acquisition
//! records by) sends [`sql::FAIR_LOCK_MARKED`] instead, and once granted
//! [`sql::FAIR_RECORD`]: the statement that waits names none of dlock's
//! tables, so a DBA's lock of a table never waits for a queue. The attempt answers `Held` once the
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
//! This file keeps the owner's side: its attempts, its handoff notice and
//! its leaving. The queues and the fair sessions kept are `fair_queue`'s,
//! the wait's task `fair_wait`'s, its statement on the server
//! `fair_statement`'s, and what becomes of a grant `fair_grant`'s.
//!
//! [`Queue::Join`]: crate::backend::Queue::Join
//! [`Queue::Respect`]: crate::backend::Queue::Respect
//! [`sql::FAIR_LOCK`]: super::sql::FAIR_LOCK
//! [`sql::FAIR_LOCK_MARKED`]: super::sql::FAIR_LOCK_MARKED
//! [`sql::FAIR_RECORD`]: super::sql::FAIR_RECORD
//! [`sql::WAITS_IN_QUEUE`]: super::sql::WAITS_IN_QUEUE

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, timeout};

use super::connection::no_runtime;
use super::fair_queue::{Fair, First, Place, Wait, Waiter};
use super::fair_wait::wait_in_queue;
use super::{Inner, State};
use crate::backend::kit::after;
use crate::backend::{AcquireRequest, Attempt, Grant, Handoff, OwnerId};
use crate::error::{LockError, Operation};
use crate::key::LockKey;

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
                            holding.deadline_slot = self.deadlines.moved(
                                holding.deadline_slot,
                                key,
                                owner,
                                after(now, ttl),
                            );
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
                    waiter.expires_at = after(now, entry_ttl);
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
                    expires_at: after(now, entry_ttl),
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

    /// Whether `owner` holds `key` here, its lease still valid: a retry
    /// of its attempt is answered with it (rule 3).
    pub(super) fn holds(&self, key: &LockKey, owner: &OwnerId) -> bool {
        let now = Instant::now();
        self.keys().get(key).is_some_and(|entry| {
            entry.owner == *owner
                && matches!(&entry.state, State::Held(holding) if holding.deadline() > now)
        })
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
}

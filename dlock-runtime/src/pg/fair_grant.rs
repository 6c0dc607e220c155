//! A fair wait's grant: the lease handed to its owner (its first attempt
//! or its handoff notice), or, if nobody takes it, the lock given back so
//! the key passes on.
//!
//! Its own file: the step from the server's grant to the owner's lease,
//! apart from the wait's task in `fair_wait`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, timeout};

use super::fair_queue::{First, Wait};
use super::locks::micros_since_1970;
use super::session::LockSession;
use super::{Entry, Holding, Identified, Inner, State, xact};
use crate::backend::Grant;
use crate::backend::kit::after;
use crate::token::FencingToken;

/// How long a granted wait waits for this process's entry of the key (an
/// unlock or an attempt of another owner, on its way) to go before it
/// gives the key back.
const ENTRY_CLEARS_WITHIN: Duration = Duration::from_secs(5);

impl Inner {
    /// Gives back a lock a fair wait took that no owner takes: dropped with
    /// its record as a lease's would be, and the session kept (or ended,
    /// should the unlock fail).
    pub(super) async fn give_back_fair(
        self: &Arc<Self>,
        session: &Arc<LockSession>,
        advisory_key: i64,
        record: Option<i64>,
        immediate: bool,
    ) {
        match self
            .unlock_on(session, advisory_key, (record, None), immediate)
            .await
        {
            Ok(unlocked) if unlocked.record_left.is_none() => self.fair_session_free(session),
            Ok(_) => {}
            Err(_) => session.end("could not give back a lock no fair waiter took".to_owned()),
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
pub(super) async fn deliver(
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
                                let entry =
                                    held_entry(&wait, &on, ttl, (advisory_key, token, since));
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

/// The owner's entry of the key, holding the lease granted to `wait` on
/// `on` (with `token`, and a record written at `since`, if it wrote one),
/// its deadline `ttl` from now queued.
fn held_entry(
    wait: &Wait,
    on: &Arc<LockSession>,
    ttl: Duration,
    (advisory_key, token, since): (i64, FencingToken, Option<SystemTime>),
) -> Entry {
    let inner = &wait.inner;
    let deadline_slot = inner.deadlines.add(
        Arc::downgrade(inner),
        &wait.key,
        wait.owner,
        after(Instant::now(), ttl),
    );
    let identity = wait.identity.clone().zip(since).map(|(identity, since)| {
        Box::new(Identified {
            identity,
            holder: wait.holder.clone().into_boxed_str(),
            since_us: micros_since_1970(since),
        })
    });
    let mut entry = Entry::new(wait.owner);
    entry.state = State::Held(Holding {
        session: Arc::clone(on),
        advisory_key,
        token,
        recorded: since.is_some(),
        marks: None,
        _mark_slot: None,
        identity,
        deadline_slot,
        deadlines: Arc::clone(&inner.deadlines),
    });
    entry
}

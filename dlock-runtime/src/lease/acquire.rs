//! Taking a key: the attempt loop (waiting by notice, riding out backend
//! failures), finishing abandoned attempts in the background, and the
//! warning for a counter far ahead of the clock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::time::{Instant, timeout};
use tracing::{Instrument as _, Span};

use super::metrics::{self, Meters, Outcome};
use super::{Hold, Lease, Terms, start};
use crate::backend::kit::detach::{AbandonedWith, Detachable};
use crate::backend::{
    Access, AcquireRequest, Attempt, Backend, Grant, Handoff, Holding, Look, OwnerId,
    QUEUE_ENTRY_TTL, Queue, ReleaseNotice, ReleaseOutcome, ReleaseRequest,
};
use crate::error::{LockError, Operation};
use crate::fallback::{self, Work};
use crate::holder;
use crate::key::LockKey;
use crate::token::FencingToken;

mod fair;
mod plain;

use fair::take_fair;
use plain::take;

/// The longest a waiter sleeps without trying again, whatever the backend
/// says: a safety net should a release notice ever be lost.
const MAX_NAP: Duration = Duration::from_secs(10);
/// The longest a caller whose every answer came from the backend in
/// process ([`Attempt::Behind`]) naps before it asks the store itself: the
/// store's word reaches every waiter soon, whatever the backend's view of
/// the queue ahead (a key freed with no announcement, say), at one round
/// trip for a caller that waits longer than this.
const FIRST_ASK_WITHIN: Duration = Duration::from_millis(200);
/// Added to a holder's remaining lifetime before retrying, so the retry lands
/// after the expiry rather than just before it.
const EXPIRY_SLACK: Duration = Duration::from_millis(2);
/// The first and the longest pause before a waiter retries after a backend
/// failure.
const MIN_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Acquires one key, waiting until `deadline` if it is held.
///
/// Counts the acquisition under its outcome (one that its caller cancels
/// under none) and opens the hold's span, which the lease then carries;
/// see [`metrics`].
pub(crate) async fn acquire(
    backend: Arc<dyn Backend>,
    key: LockKey,
    terms: Terms,
    deadline: Instant,
) -> Result<Lease, LockError> {
    let started = Instant::now();
    let meters = Meters::of(backend.kind());
    let acquiring = Acquiring {
        span: Some(metrics::hold_span(&key, backend.kind())),
        started,
    };
    let Ok(runtime) = Handle::try_current() else {
        let err = LockError::NoRuntime {
            key: key.to_string(),
        };
        acquiring.failed(meters, &err);
        return Err(err);
    };
    let span = acquiring
        .in_scope(|| tracing::debug_span!("dlock.acquire", key = %key, backend = backend.kind()));
    async move {
        let taken = match refuse_unsupported(&backend, &terms).and_then(|()| OwnerId::random()) {
            Ok(owner) if terms.fair => take_fair(&backend, &key, &owner, &terms, deadline, started)
                .await
                .map(|(grant, sent)| (owner, grant, sent)),
            Ok(owner) => take(&backend, &key, &owner, &terms, deadline, started)
                .await
                .map(|(grant, sent)| (owner, grant, sent)),
            Err(err) => Err(err),
        };
        let (owner, grant, sent) = match taken {
            Ok(taken) => taken,
            Err(LockError::Held { key: name, .. }) => {
                let err = LockError::Held {
                    key: name,
                    holder: describe_holder(&backend, &key).await,
                };
                acquiring.failed(meters, &err);
                return Err(err);
            }
            Err(err) => {
                acquiring.failed(meters, &err);
                return Err(err);
            }
        };
        let hold = acquiring.acquired(meters, grant.token, sent);
        tracing::debug!(
            token = %grant.token,
            waited_ms = metrics::millis(hold.since - started),
            "lock acquired"
        );
        warn_if_ahead_of_clock(backend.kind(), &key, grant.token);
        Ok(start(runtime, backend, key, owner, grant, &terms, hold))
    }
    .instrument(span)
    .await
}

/// Refuses an access the backend does not keep (rules M1 to M5), before
/// anything is sent: locking in another way would not be what was asked.
fn refuse_unsupported(backend: &Arc<dyn Backend>, terms: &Terms) -> Result<(), LockError> {
    if terms.access == Access::Exclusive || backend.supports_access(terms.access) {
        return Ok(());
    }
    Err(LockError::InvalidOption {
        option: terms.access.option(),
        reason: format!(
            "the {} backend cannot hold a key as {}: it has no {}",
            backend.kind(),
            terms.access,
            match terms.access {
                Access::Permits { .. } => "permits",
                _ => "shared locks",
            }
        ),
    })
}

/// Whether an exclusive attempt answered `Held` may have left a
/// writer-waiting mark (rule M3), which the owner's release removes: only
/// a caller that waits leaves one.
fn may_mark(backend: &Arc<dyn Backend>, terms: &Terms) -> bool {
    terms.access == Access::Exclusive
        && !terms.wait.is_zero()
        && backend.supports_access(Access::Shared)
}

/// The longest a refused caller waits to learn who holds the key, on top
/// of the refusal: a store that is slow to answer costs the message its
/// holder, never the caller its prompt "held".
const DESCRIBE_HOLDER_WITHIN: Duration = Duration::from_millis(500);

/// Who holds `key`, for the [`LockError::Held`] a caller that would not
/// wait gets: one read of the store after the refusal. `None` when the key
/// was freed meanwhile, or the read failed or took longer than
/// [`DESCRIBE_HOLDER_WITHIN`].
async fn describe_holder(backend: &Arc<dyn Backend>, key: &LockKey) -> Option<Box<Holding>> {
    match timeout(DESCRIBE_HOLDER_WITHIN, backend.holder(key)).await {
        Ok(Ok(holding)) => holding.map(Box::new),
        Ok(Err(err)) => {
            tracing::debug!(key = %key, error = %err, "could not read who holds a refused key");
            None
        }
        Err(_) => None,
    }
}

/// An acquisition under way, with the span of the hold it may become. One
/// its caller gives up on (the future dropped) is marked `cancelled` on
/// the span and counted under no outcome.
struct Acquiring {
    /// Taken out when the acquisition ends.
    span: Option<Span>,
    started: Instant,
}

impl Acquiring {
    fn in_scope<T>(&self, f: impl FnOnce() -> T) -> T {
        match &self.span {
            Some(span) => span.in_scope(f),
            None => f(),
        }
    }

    /// Ends the acquisition: its wait, and its span with `wait_ms`.
    fn end(mut self) -> (Span, Duration, Instant) {
        let now = Instant::now();
        let wait = now - self.started;
        let span = self.span.take().unwrap_or_else(Span::none);
        span.record("wait_ms", metrics::millis(wait));
        (span, wait, now)
    }

    /// The key was had with `token`, by a request sent at `sent`: the
    /// hold begins.
    fn acquired(self, meters: &'static Meters, token: FencingToken, sent: Instant) -> Hold {
        let (span, wait, since) = self.end();
        meters.acquired(wait);
        span.record("token", tracing::field::display(token));
        Hold {
            sent,
            since,
            meters,
            span,
        }
    }

    /// The acquisition failed with `err`; its span closes here.
    fn failed(self, meters: &Meters, err: &LockError) {
        let outcome = Outcome::of_error(err);
        let (span, wait, _) = self.end();
        meters.failed(outcome, wait);
        span.record("outcome", outcome.label());
    }
}

impl Drop for Acquiring {
    fn drop(&mut self) {
        if let Some(span) = self.span.take() {
            span.record("wait_ms", metrics::millis(self.started.elapsed()));
            span.record("outcome", "cancelled");
        }
    }
}

/// How far ahead of the wall clock (in µs) a token may be before its
/// counter counts as one the clock floor cannot protect.
const AHEAD_OF_CLOCK: Duration = Duration::from_secs(24 * 60 * 60);
/// How often, at most, that is said again for one key of one kind of
/// backend, and how many keys are remembered for that.
const AHEAD_OF_CLOCK_REPEAT: Duration = Duration::from_secs(60 * 60);
const AHEAD_OF_CLOCK_KEYS: usize = 1024;

/// Warns (at most hourly per key and kind of backend) when a token is far ahead of
/// the clock in microseconds. Every backend floors its tokens at its clock
/// so that a counter lost in a restart, failover or restore still hands out
/// higher tokens; a counter seeded or pushed far ahead of the clock is past
/// that protection, and should it ever be lost, tokens would go back.
fn warn_if_ahead_of_clock(kind: &'static str, key: &LockKey, token: FencingToken) {
    /// Tokens up to this bound need no look at the clock.
    static BOUND: AtomicU64 = AtomicU64::new(0);
    static WARNED: LazyLock<Mutex<std::collections::HashMap<(&'static str, LockKey), Instant>>> =
        LazyLock::new(Mutex::default);
    let token = token.get();
    if token <= BOUND.load(Ordering::Relaxed) {
        return;
    }
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_micros() as u64);
    let bound = now_us.saturating_add(AHEAD_OF_CLOCK.as_micros() as u64);
    BOUND.fetch_max(bound, Ordering::Relaxed);
    if token <= bound {
        return;
    }
    {
        let mut warned = WARNED.lock().unwrap_or_else(PoisonError::into_inner);
        if warned
            .get(&(kind, key.clone()))
            .is_some_and(|at| at.elapsed() < AHEAD_OF_CLOCK_REPEAT)
        {
            return;
        }
        if warned.len() >= AHEAD_OF_CLOCK_KEYS {
            warned.clear();
        }
        warned.insert((kind, key.clone()), Instant::now());
    }
    tracing::warn!(
        backend = kind,
        key = %key,
        token,
        clock_us = now_us,
        "fencing token is far ahead of the clock: its counter was seeded or pushed ahead, \
         so the clock floor no longer protects it; should the counter be lost (a restart \
         without persistence, a failover, a restore), new tokens would fall back to the \
         clock and stop rising. Keep the counter durable"
    );
}

/// What a caller gets when the key stayed held: `Held` for one that would
/// not wait, `Timeout` after `waited` for one that did.
fn contended(key: &LockKey, terms: &Terms, waited: Duration) -> LockError {
    if terms.wait.is_zero() {
        LockError::Held {
            key: key.to_string(),
            holder: None,
        }
    } else {
        LockError::Timeout {
            key: key.to_string(),
            waited,
        }
    }
}

/// The least a waiting caller gives one call to its store, even with less
/// of its wait left: a healthy store that answers a little late still
/// answers, where a cut at the very deadline would fail a short wait.
const LEAST_PER_CALL: Duration = Duration::from_millis(500);

/// `call` to the store (`operation` on `key`), cut off for a caller that
/// waits when its deadline has passed (and at least [`LEAST_PER_CALL`]
/// from now, or from the deadline for a call sent after it: the calls of
/// one acquisition, one after another, share that grace, so the caller
/// returns within it of its deadline): a store that stops answering does
/// not keep the caller past its wait for the length of the backend's own
/// timeouts. What was cut off
/// is cancel safe: an abandoned attempt is finished in the background and
/// its grant given back ([`attempt`]); a subscription leaves nothing. A
/// caller that does not wait has no deadline to keep, and gets the
/// backend's own answer.
async fn by_deadline<T>(
    kind: &'static str,
    operation: Operation,
    key: &LockKey,
    terms: &Terms,
    deadline: Instant,
    call: impl Future<Output = Result<T, LockError>>,
) -> Result<T, LockError> {
    if terms.wait.is_zero() {
        return call.await;
    }
    let cut = deadline.max(Instant::now().min(deadline) + LEAST_PER_CALL);
    match tokio::time::timeout_at(cut, call).await {
        Ok(answer) => answer,
        Err(_) => Err(LockError::backend(
            kind,
            operation,
            key.as_str(),
            format!(
                "no answer before the caller's wait of {:?} ran out",
                terms.wait
            ),
        )),
    }
}

/// Whether a waiting caller rides out `err` (a backend failure) and tries
/// again until its deadline.
fn may_retry(terms: &Terms, err: &LockError) -> bool {
    !terms.wait.is_zero() && matches!(err, LockError::Backend { .. })
}

/// A waiter's way out: dropped armed, it releases the owner's key in the
/// background, which removes a fair waiter's entry (rule F3) and gives
/// back a handoff that reached it as it gave up, or removes an exclusive
/// waiter's writer-waiting mark (rule M3).
struct LeaveQueue {
    give_back: Option<(Arc<dyn Backend>, LockKey, OwnerId)>,
    /// The waiter's handoff notice. Dropped armed, it is kept until the
    /// release that leaves the queue has finished: a store that watches
    /// its waiters through it (the file backend's alive file) must not see
    /// the owner gone while a handoff to it is being given back, or the
    /// next waiter would take the handed key for a dead holder's and wait
    /// for a recheck instead of the release's wake-up.
    notice: Option<Handoff>,
}

impl LeaveQueue {
    fn disarm(&mut self) {
        self.give_back = None;
    }
}

impl Drop for LeaveQueue {
    fn drop(&mut self) {
        if let Some((backend, key, owner)) = self.give_back.take() {
            let notice = self
                .notice
                .take()
                .map(|notice| Arc::new(Mutex::new(notice)));
            spawn_give_back_keeping(&backend, &key, owner, Access::Exclusive, notice);
        }
    }
}

/// One `try_acquire`, carried on in the background if the caller stops
/// waiting half-way; whatever it was granted then is given back.
fn attempt(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    owner: OwnerId,
    terms: &Terms,
    queue: Queue,
    look: Look,
) -> impl Future<Output = Result<Attempt, LockError>> + Send + 'static {
    let work = {
        let (backend, key) = (Arc::clone(backend), key.clone());
        let (ttl, identity, access) = (terms.ttl, terms.identity.clone(), terms.access);
        let waits = !terms.wait.is_zero();
        async move {
            let label = holder::process_label();
            let request = AcquireRequest::new(&key, &owner, ttl)
                .with_identity(identity.as_deref())
                .with_label(label.as_deref())
                .with_queue(queue)
                .with_access(access)
                .with_waits(waits)
                .with_look(look);
            backend.try_acquire(&request).await
        }
    };
    let give_back = GiveBack {
        backend: Arc::clone(backend),
        key: key.clone(),
        owner,
        access: terms.access,
        queued: matches!(queue, Queue::Join { .. }) || may_mark(backend, terms),
    };
    Detachable::new(work, give_back)
}

/// Gives back what an abandoned attempt was granted, or may have been: a
/// failed attempt's request may have reached the store before its reply
/// was lost. The release is owner-checked, so it never touches a lock
/// someone else holds, and giving back twice is harmless.
#[derive(Clone)]
struct GiveBack {
    backend: Arc<dyn Backend>,
    key: LockKey,
    owner: OwnerId,
    /// How the attempt would hold the key: a permit's slot is not known
    /// yet, so the release names none (rule M4).
    access: Access,
    /// The attempt was a fair waiter's [`Queue::Join`], or an exclusive one
    /// on a backend with shared locks: answered `Held`, it may have left an
    /// entry in the queue (rule F3) or a writer-waiting mark (rule M3),
    /// which the release removes.
    queued: bool,
}

impl GiveBack {
    fn release(self) -> Work {
        Box::pin(async move {
            match self
                .backend
                .release(&ReleaseRequest::new(&self.key, &self.owner).holding(self.access, None))
                .await
            {
                Ok(ReleaseOutcome::Released) => tracing::debug!(
                    key = %self.key,
                    "gave back a lock granted after its caller gave up"
                ),
                Ok(_) => {}
                Err(err) => {
                    let key = self.key.clone();
                    if fallback::try_again(self.release()) {
                        tracing::debug!(
                            key = %key,
                            error = %err,
                            "giving back an abandoned acquisition failed; \
                             trying again on dlock's fallback runtime"
                        );
                    } else {
                        tracing::warn!(
                            key = %key,
                            error = %err,
                            "giving back an abandoned acquisition failed; \
                             the ttl will free the key"
                        );
                    }
                }
            }
        })
    }
}

impl AbandonedWith<Result<Attempt, LockError>> for GiveBack {
    async fn handle(self, outcome: Result<Attempt, LockError>) {
        if self.queued || !matches!(outcome, Ok(Attempt::Held { .. } | Attempt::Behind { .. })) {
            self.release().await;
        }
    }

    /// The attempt may have been granted before its runtime dropped it.
    fn unfinished(&self) -> impl Future<Output = ()> + Send + 'static {
        self.clone().release()
    }
}

/// Gives `owner`'s possible hold of `key` back in the background (and,
/// for a fair waiter, its place in the queue: rule F3).
fn spawn_give_back(backend: &Arc<dyn Backend>, key: &LockKey, owner: OwnerId, access: Access) {
    spawn_give_back_keeping(backend, key, owner, access, None);
}

/// [`spawn_give_back`], keeping `notice` alive until the release is done.
fn spawn_give_back_keeping(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    owner: OwnerId,
    access: Access,
    notice: Option<Arc<Mutex<Handoff>>>,
) {
    let give_back = GiveBack {
        backend: Arc::clone(backend),
        key: key.clone(),
        owner,
        access,
        queued: false,
    };
    let (here, fallback) = (give_back.clone().release(), give_back.release());
    let keep = notice.clone();
    fallback::spawn(
        async move {
            here.await;
            drop(keep);
        },
        async move {
            fallback.await;
            drop(notice);
        },
    );
}

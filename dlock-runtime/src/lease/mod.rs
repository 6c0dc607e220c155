//! The lease lifecycle, written once for every backend: acquisition with
//! waiting, background renewal, the lost signal, release, and release on drop.
//!
//! Words with one meaning each, here and in the backends:
//!
//! - **release**: a holder ends its lease (explicitly, on drop, or at once
//!   when a multi-key acquisition fails half-way).
//! - **give back**: return a grant no caller will use: an attempt whose
//!   caller gave up mid-flight, or a lock a backend took but cannot hand to
//!   any lease.
//! - **expire** / **expiry**: a lease's known validity ran out, so the core
//!   marks it lost. A store that enforces a ttl itself (PostgreSQL session
//!   locks do not expire on their own) *enforces the deadline*.
//!
//! What the lifecycle records (metrics, and a span per hold) is told in
//! [`metrics`].

use std::future::{Future, poll_fn};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::Poll;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::Span;

mod acquire;
pub mod metrics;
mod release;
mod renewal;
mod set;

pub(crate) use acquire::acquire;
use release::{Release, finish_detached};
pub use set::LeaseSet;
pub(crate) use set::acquire_many;

use crate::backend::kit::detach::{AbandonedWith, Detachable};
use crate::backend::{
    Access, Backend, Grant, LossGroup, LossSink, OwnerId, ReleaseOutcome, ReleaseRequest, Renewal,
};
use crate::error::{LockError, LostReason};
use crate::fallback::{self, Work};
use crate::key::LockKey;
use crate::token::FencingToken;
use metrics::Meters;

/// The terms a lease is taken and kept on: what
/// [`LockOptions`](crate::LockOptions) says about one acquisition, without
/// the backend's name, which the caller has already resolved.
#[derive(Clone, Debug)]
pub(crate) struct Terms {
    /// The lease's lifetime unless renewed.
    pub(crate) ttl: Duration,
    /// How long to wait for a held key; zero fails at once.
    pub(crate) wait: Duration,
    /// Whether a live holder renews in the background.
    pub(crate) renew: bool,
    /// How long the key stays held after acquisition even if released.
    pub(crate) min_hold: Duration,
    /// Who the acquirer says it is, recorded beside the lock (an
    /// election's campaigner); `None` for plain locks.
    pub(crate) identity: Option<Arc<str>>,
    /// Whether waiters queue in arrival order and a release hands the key
    /// to the first ([`crate::LockOptions::fair`]).
    pub(crate) fair: bool,
    /// How the key is held ([`crate::LockOptions::mode`],
    /// [`crate::LockOptions::permits`]).
    pub(crate) access: Access,
}

#[derive(Debug)]
enum State {
    /// Held, with the hold's span (see [`metrics`]): whoever ends the hold
    /// takes it out, records how the hold ended and closes it.
    Held(Span),
    Lost(LostReason),
    Released,
}

impl State {
    /// The hold's span if the lease was still held, or a disabled one.
    fn into_span(self) -> Span {
        match self {
            State::Held(span) => span,
            State::Lost(_) | State::Released => Span::none(),
        }
    }
}

/// How a hold began: when, and what it is measured and traced with.
struct Hold {
    /// When the request that was granted was sent: the lease's lifetime
    /// counts from it (never later than the store's).
    sent: Instant,
    /// When the acquisition returned: the hold's start, for its metric.
    since: Instant,
    meters: &'static Meters,
    span: Span,
}

/// `at` as nanoseconds since `from` (zero before it).
fn since(from: Instant, at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(from).as_nanos()).unwrap_or(u64::MAX)
}

/// What a lease and its renewal task share.
struct Shared {
    key: LockKey,
    token: FencingToken,
    owner: OwnerId,
    backend: Arc<dyn Backend>,
    /// How the lease holds the key, and its permit slot (rule M4).
    access: Access,
    slot: Option<u32>,
    /// The identity the lease was taken with, recorded beside the lock.
    identity: Option<Arc<str>>,
    /// The metrics of the backend's kind.
    meters: &'static Meters,
    /// When the acquisition returned: the hold's start, for its metric.
    held_since: Instant,
    /// The lease's place in its renewal scheduler, once registered: what
    /// [`LostSignal::recheck`] renews at once.
    renewal: std::sync::OnceLock<(Weak<renewal::Renewer>, u64)>,
    /// When the granted request was sent: what `valid_until` counts from.
    /// Per lease: a paused clock (tokio's `test-util`) starts afresh behind
    /// an earlier runtime's advanced one, so from a process-wide epoch a
    /// new lease's every deadline would read as passed.
    counted_from: Instant,
    /// Until when the lease is known valid (ns since `counted_from`):
    /// counted from when the acquisition, or the last renewal the store
    /// confirmed, was sent, so never later than the store's own expiry.
    /// Checks compare the time with it themselves, so a holder is told even
    /// when the renewal task cannot run (a body that blocks its thread, a
    /// runtime that went away).
    valid_until: AtomicU64,
    state: Mutex<State>,
    /// Set once the lease is no longer held (after `state` changed): the
    /// checks on the hot path read this instead of taking the lock.
    ended: AtomicBool,
    /// How many tasks wait in [`Shared::lost`]: a lease that ends with
    /// nobody waiting (the usual release) skips the wake-up.
    waiting: AtomicUsize,
    /// Wakes the tasks waiting in [`Shared::lost`].
    wake: Notify,
}

impl LossSink for Shared {
    fn lost(&self, reason: LostReason) {
        self.mark_lost(reason);
    }
}

impl Shared {
    /// A held lease. It counts as held (the `dlock_leases_held` gauge)
    /// from its acquisition until [`Shared::mark_released`] or
    /// [`Shared::mark_lost`] ends it: every lease ends exactly once.
    fn new(
        key: LockKey,
        token: FencingToken,
        (owner, access, slot): (OwnerId, Access, Option<u32>),
        backend: Arc<dyn Backend>,
        identity: Option<Arc<str>>,
        valid_until: Instant,
        hold: Hold,
    ) -> Self {
        Self {
            key,
            token,
            owner,
            backend,
            access,
            slot,
            identity,
            meters: hold.meters,
            held_since: hold.since,
            renewal: std::sync::OnceLock::new(),
            counted_from: hold.sent,
            valid_until: AtomicU64::new(since(hold.sent, valid_until)),
            state: Mutex::new(State::Held(hold.span)),
            ended: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
            wake: Notify::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The release of this lease, on its own side (rule M4).
    fn release_request(&self) -> ReleaseRequest<'_> {
        ReleaseRequest::new(&self.key, &self.owner).holding(self.access, self.slot)
    }

    /// A renewal of this lease for `ttl`, on its own side (rule M4).
    fn renewal(&self, ttl: Duration) -> Renewal<'_> {
        Renewal::new(&self.key, &self.owner, ttl).holding(self.access, self.slot)
    }

    fn lost_error(&self, reason: LostReason) -> LockError {
        LockError::LeaseLost {
            key: self.key.to_string(),
            token: self.token,
            reason,
        }
    }

    /// True once the lease is lost or released.
    fn is_ended(&self) -> bool {
        self.ended.load(Ordering::SeqCst)
    }

    /// Records a renewal the store confirmed.
    pub(super) fn renewed_until(&self, valid_until: Instant) {
        self.valid_until
            .fetch_max(since(self.counted_from, valid_until), Ordering::SeqCst);
    }

    /// True while the lease's known validity has not run out.
    fn within_validity(&self, now: Instant) -> bool {
        since(self.counted_from, now) < self.valid_until.load(Ordering::SeqCst)
    }

    /// True once the lease is lost or released, or its validity ran out
    /// (which marks it lost here and now, whether or not the renewal task
    /// has run).
    fn is_over(&self) -> bool {
        if self.is_ended() {
            return true;
        }
        if self.within_validity(Instant::now()) {
            return false;
        }
        self.mark_lost(LostReason::Expired);
        true
    }

    /// `Ok(())` while the lease is held, the error that ended it otherwise.
    fn check(&self) -> Result<(), LockError> {
        if !self.is_over() {
            return Ok(());
        }
        match self.error_for(&self.state()) {
            None => Ok(()),
            Some(err) => Err(err),
        }
    }

    fn error_for(&self, state: &State) -> Option<LockError> {
        match state {
            State::Held(_) => None,
            State::Lost(reason) => Some(self.lost_error(reason.clone())),
            State::Released => Some(self.lost_error(LostReason::Released)),
        }
    }

    /// Sets `ended` (the state has changed) and wakes whoever waits.
    fn end(&self) {
        self.ended.store(true, Ordering::SeqCst);
        // A waiter counts itself before it looks at `ended` (both SeqCst):
        // either it sees `ended`, or this sees it waiting and wakes it.
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.wake.notify_waiters();
        }
    }

    /// Marks the lease released `at` and returns the state it had. A
    /// lease still held ends its hold here; its span, still open, comes
    /// back in the state for the caller to record the outcome on and close
    /// once the release is done.
    fn mark_released(&self, at: Instant) -> State {
        let prior = std::mem::replace(&mut *self.state(), State::Released);
        self.end();
        if matches!(prior, State::Held(_)) {
            self.meters
                .lease_ended(at.saturating_duration_since(self.held_since), None);
        }
        prior
    }

    /// Marks the lease lost unless it already ended; true if this call did.
    fn mark_lost(&self, reason: LostReason) -> bool {
        let span = {
            let mut state = self.state();
            if !matches!(*state, State::Held(_)) {
                return false;
            }
            std::mem::replace(&mut *state, State::Lost(reason.clone())).into_span()
        };
        self.end();
        self.meters
            .lease_ended(self.held_since.elapsed(), Some(&reason));
        span.record("outcome", "lost");
        span.record("reason", metrics::reason_label(&reason));
        span.in_scope(|| {
            tracing::warn!(
                key = %self.key,
                backend = self.backend.kind(),
                token = %self.token,
                %reason,
                "lease lost"
            );
        });
        true
    }

    /// Records on the hold's span how a release its holder awaited ended,
    /// and counts a release that found the key gone as a loss.
    fn record_release(&self, span: &Span, result: &Result<(), LockError>) {
        match result {
            Ok(()) => {
                span.record("outcome", "released");
            }
            Err(LockError::LeaseLost { reason, .. }) => {
                self.meters.lost(reason);
                span.record("outcome", "lost");
                span.record("reason", metrics::reason_label(reason));
            }
            Err(_) => {
                span.record("outcome", "error");
            }
        }
    }

    /// Resolves, with the error that says why, once the lease has ended.
    async fn lost(&self) -> LockError {
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let _waiting = Waiting(&self.waiting);
        loop {
            // Made (and enabled) before `ended` is read: a wake-up between
            // the two is not missed.
            let notified = self.wake.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self.is_ended()
                && let Some(err) = self.error_for(&self.state())
            {
                return err;
            }
            notified.await;
        }
    }
}

/// A held lock. Renewed in the background while it lives (unless renewal is
/// off); lost when renewal fails or the ttl runs out, and its holder can see
/// that ([`Lease::lost`], [`Lease::check`]); released by
/// [`Lease::release`] or, if dropped unreleased, in the background.
///
/// # Release on drop, and runtimes that shut down
///
/// A lease dropped unreleased is released by a task on the runtime it is
/// dropped on. Should no runtime run there, or should that runtime shut
/// down before the release is done (a runtime dropped while its tasks hold
/// leases, `#[tokio::main]` returning), the release is started over on
/// dlock's fallback thread, which runs a runtime of its own and is started
/// on first use; a release that fails on a runtime that goes away is tried
/// once more there. Acquisitions a runtime cuts off half-way are given back
/// the same way. That frees the key at once on every backend: memory and
/// file need no runtime, PostgreSQL unlocks through the runtime it was
/// connected on (and if that one shut down, its sessions closed and the
/// server freed their locks), and Redis opens a new connection from the
/// fallback thread. The key waits for its ttl only when the process exits
/// before the fallback thread is done (it never holds the process up, nor
/// a runtime's shutdown), or when the store cannot be reached from there
/// within 10 s, which is logged as a warning.
///
/// # Metrics and the span
///
/// A lease counts in the `dlock_leases_held` gauge from its acquisition
/// until it is released or lost, and its hold is one `dlock.hold` span,
/// closed when the release is done or the loss is noticed: see
/// [`metrics`] for the names, labels and fields.
#[must_use = "a lease is released as soon as it is dropped"]
pub struct Lease {
    shared: Arc<Shared>,
    renewal: renewal::Registration,
    /// The backend's loss group this lease is attached to, if it gave one,
    /// and the lease's place in it.
    loss_group: Option<(Arc<LossGroup>, u64)>,
    acquired_at: Instant,
    min_hold: Duration,
    finished: bool,
}

impl Lease {
    /// The locked key.
    pub fn key(&self) -> &LockKey {
        &self.shared.key
    }

    /// The fencing token: send it with every write to the protected resource.
    pub fn token(&self) -> FencingToken {
        self.shared.token
    }

    /// How the lease holds its key: exclusive, shared or a permit.
    pub fn access(&self) -> Access {
        self.shared.access
    }

    /// The permit slot this lease holds, in `0..permits`, for a lease taken
    /// with [`LockOptions::permits`](crate::LockOptions::permits); `None`
    /// otherwise. Tokens rise per slot: a resource fences each slot on its
    /// own ("`>=` the highest accepted for this slot").
    pub fn slot(&self) -> Option<u32> {
        self.shared.slot
    }

    /// The kind of backend holding the lock.
    pub fn backend_kind(&self) -> &'static str {
        self.shared.backend.kind()
    }

    /// True once the lease is lost: stop acting on the protected resource.
    /// Compares the time with the lease's known validity itself, so it
    /// tells the truth even when the renewal task could not run.
    pub fn is_lost(&self) -> bool {
        self.shared.is_over()
    }

    /// `Ok(())` while the lease is held, the [`LockError::LeaseLost`] that
    /// ended it otherwise. Cheap: call it between steps of long work.
    pub fn check(&self) -> Result<(), LockError> {
        self.shared.check()
    }

    /// Resolves, with the [`LockError::LeaseLost`] that says why, when the
    /// lease is lost. Pending for as long as it is held.
    pub async fn lost(&self) -> LockError {
        self.shared.lost().await
    }

    /// A cheap handle on the lost signal that can be moved into other tasks.
    pub fn lost_signal(&self) -> LostSignal {
        LostSignal {
            shared: Arc::clone(&self.shared),
        }
    }

    /// Runs `work` while the lease is held: if the lease is lost first,
    /// `work` is dropped (cancelled) and the lost error returned.
    pub async fn run<F: Future>(&self, work: F) -> Result<F::Output, LockError> {
        self.check()?;
        // The lost signal is only made and listened to once `work` has to
        // wait: work that finishes in its first poll costs no subscription.
        let mut lost = std::pin::pin!(false.then(|| self.lost()));
        let mut work = std::pin::pin!(work);
        poll_fn(|cx| {
            if let Some(lost) = lost.as_mut().as_pin_mut()
                && let Poll::Ready(err) = lost.poll(cx)
            {
                return Poll::Ready(Err(err));
            }
            if let Poll::Ready(out) = work.as_mut().poll(cx) {
                return Poll::Ready(Ok(out));
            }
            if lost.is_none() {
                lost.set(Some(self.lost()));
                if let Some(lost) = lost.as_mut().as_pin_mut()
                    && let Poll::Ready(err) = lost.poll(cx)
                {
                    return Poll::Ready(Err(err));
                }
            }
            Poll::Pending
        })
        .await
    }

    /// Releases the lock (keeping it until the minimum hold, if one was
    /// set). Fails with [`LockError::LeaseLost`] if the lease had been lost
    /// before: its holder must assume someone else acted meanwhile.
    ///
    /// A caller that gives up half-way (a timeout around this call) does
    /// not leave the key held: the release goes on in the background.
    pub async fn release(mut self) -> Result<(), LockError> {
        self.finished = true;
        self.stop_watching();
        // One clock read: the hold's end, the minimum hold's remainder, and
        // when the release was sent (read just before it is).
        let sent = Instant::now();
        let (span, lost) = match self.shared.mark_released(sent) {
            State::Held(span) => (span, None),
            State::Lost(reason) => (Span::none(), Some(reason)),
            State::Released => (Span::none(), None),
        };
        let outcome = finish_detached(&self.shared, self.keep_for(sent), sent, &span).await;
        if let Some(reason) = lost {
            return Err(self.shared.lost_error(reason));
        }
        let result = self.judge(outcome, sent);
        self.shared.record_release(&span, &result);
        result
    }

    /// What the backend's answer to a release, sent at `sent`, means to
    /// its holder.
    fn judge(
        &self,
        outcome: Result<ReleaseOutcome, LockError>,
        sent: Instant,
    ) -> Result<(), LockError> {
        match outcome {
            Ok(ReleaseOutcome::Released) => Ok(()),
            // The first request's reply was lost and the retry found the key
            // gone: that request released it, or the lease ran out after it
            // was sent. Either way, if it was sent before `valid_until`
            // (counted from when the last renewal was sent, so never later
            // than the store's own expiry), the holder let go while the key
            // was still its own, and nobody else can have held it before:
            // a release, not a loss. (Only an outside hand breaking the lock
            // before the release is told apart by nothing here.) Judged by
            // when it was sent, not answered: a retry after a response
            // timeout easily lands past a short ttl.
            Ok(ReleaseOutcome::Unconfirmed) if self.shared.within_validity(sent) => Ok(()),
            Ok(ReleaseOutcome::NotOwner | ReleaseOutcome::Unconfirmed) => {
                Err(self.shared.lost_error(LostReason::NotOwner))
            }
            Err(err) => Err(err),
        }
    }

    /// Releases at once, ignoring the minimum hold: the lease did no work
    /// (a multi-key acquisition failed half-way).
    async fn release_unused(mut self) {
        self.finished = true;
        self.stop_watching();
        let now = Instant::now();
        let span = self.shared.mark_released(now).into_span();
        span.record("outcome", "released");
        if let Err(err) = finish_detached(&self.shared, Duration::ZERO, now, &span).await {
            tracing::warn!(key = %self.shared.key, error = %err, "releasing an unused lease failed; its ttl will free it");
        }
    }

    /// Ends renewal and the loss watch: the lease is ending.
    fn stop_watching(&mut self) {
        self.renewal.cancel();
        if let Some((group, id)) = self.loss_group.take() {
            group.detach(id);
        }
    }

    /// How much longer, from `now`, the minimum hold keeps the key.
    fn keep_for(&self, now: Instant) -> Duration {
        self.min_hold
            .saturating_sub(now.saturating_duration_since(self.acquired_at))
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        self.stop_watching();
        let now = Instant::now();
        let span = self.shared.mark_released(now).into_span();
        span.record("outcome", "released");
        let release = Release {
            shared: Arc::clone(&self.shared),
            hold_until: now + self.keep_for(now),
            span,
        };
        // Early return, `?`, panic or cancellation: release in the
        // background, on the fallback runtime should this one be gone or
        // shut down first.
        fallback::spawn(release.again().run(), release.run());
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.shared.key)
            .field("token", &self.shared.token)
            .field("backend", &self.shared.backend.kind())
            .field("lost", &self.is_lost())
            .finish()
    }
}

/// A handle on a lease's lost signal, detached from the lease so it can be
/// moved into spawned tasks. It reports the lease ended once it is lost *or*
/// released: either way nothing may be done under it any more.
#[derive(Clone)]
pub struct LostSignal {
    shared: Arc<Shared>,
}

impl LostSignal {
    /// True once the lease is lost or released.
    pub fn is_lost(&self) -> bool {
        self.shared.is_over()
    }

    /// `Ok(())` while the lease is held.
    pub fn check(&self) -> Result<(), LockError> {
        self.shared.check()
    }

    /// Resolves when the lease is lost or released.
    pub async fn lost(&self) -> LockError {
        self.shared.lost().await
    }

    /// The token of the lease this signal watches.
    pub fn token(&self) -> FencingToken {
        self.shared.token
    }

    /// Renews the lease now rather than at its time, so that a lease the
    /// store lost is told as soon as the store answers, not a renewal
    /// interval later (an election's guard, which watches the store, asks
    /// for it). A lease with renewal off, or with a renewal in flight, is
    /// left as it is.
    pub(crate) fn recheck(&self) {
        if let Some((renewer, id)) = self.shared.renewal.get()
            && let Some(renewer) = renewer.upgrade()
        {
            renewer.renew_now(*id);
        }
    }
}

impl std::fmt::Debug for LostSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LostSignal")
            .field("key", &self.shared.key)
            .field("lost", &self.is_lost())
            .finish()
    }
}

fn start(
    runtime: Handle,
    backend: Arc<dyn Backend>,
    key: LockKey,
    owner: OwnerId,
    grant: Grant,
    terms: &Terms,
    hold: Hold,
) -> Lease {
    let sent = hold.sent;
    // A handed-over lease the store keeps for less than the ttl until its
    // first renewal is valid that long, and renewed a third of the way in.
    let valid = grant
        .valid_for
        .map_or(terms.ttl, |valid_for| valid_for.min(terms.ttl));
    let valid_until = sent + valid;
    let shared = Arc::new(Shared::new(
        key,
        grant.token,
        (owner, terms.access, grant.slot),
        backend,
        terms.identity.clone(),
        valid_until,
        hold,
    ));
    // Renewal, and the lost signal when the ttl runs out, come from the
    // backend's renewal scheduler; a backend that can tell of a loss by
    // itself (a PostgreSQL session ending) does so through its loss group.
    // Neither costs a task or a timer per lease.
    let renewal = renewal::register(
        &runtime,
        Arc::clone(&shared),
        valid_until,
        valid,
        terms.ttl,
        terms.renew,
    );
    let loss_group = grant.loss.and_then(|group| {
        let sink = Arc::downgrade(&shared) as Weak<dyn LossSink>;
        match group.attach(sink) {
            Ok(id) => Some((group, id)),
            Err(reason) => {
                shared.mark_lost(reason);
                None
            }
        }
    });
    Lease {
        shared,
        renewal,
        loss_group,
        acquired_at: sent,
        min_hold: terms.min_hold,
        finished: false,
    }
}

//! What the lease lifecycle records: the metrics (read back through a
//! recorder that captures values) and the `dlock.hold` span (read back
//! through a layer that captures spans).
//!
//! The metrics recorder is global to the process, and the renewal
//! scheduler and background releases record from threads other than the
//! test's, so a thread-local recorder would miss them. One
//! `DebuggingRecorder` is installed for the whole binary instead, and every
//! test locks on a backend of a `kind` of its own (the memory backend under
//! another name): the `backend` label keeps each test's series apart while
//! the tests run in parallel. Spans are captured per test, by a subscriber
//! set as the default of the test's thread (each test runs on a
//! current-thread runtime); a span records through the subscriber it was
//! made with, on whichever thread its hold ends.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use dlock::backend::{
    AcquireRequest, Attempt, Holding, LossGroup, ReleaseNotice, ReleaseOutcome, ReleaseRequest,
    Renewal,
};
use dlock::error::Operation;
use dlock::lease::metrics::{ACQUISITIONS, HOLD, LEASES_HELD, LEASES_LOST, RENEWAL_FAILURES, WAIT};
use dlock::memory::MemoryBackend;
use dlock::{Backend, LockError, LockKey, LockOptions, LostReason};
use dlock_runtime::conformance::{CountingBackend, fresh_key};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

const TTL: Duration = Duration::from_secs(30);
/// A ttl whose renewals (every second) and expiry a test can wait for,
/// and which a loaded machine's stall does not outlast: a lease broken by
/// hand is told so by its next renewal (`NotOwner`), not by its expiry.
const SHORT_TTL: Duration = Duration::from_secs(3);

// ---------------------------------------------------------------------------
// The captured metrics.

/// A series: the metric's name and its labels, sorted.
type Series = (String, Vec<(String, String)>);

/// Everything recorded so far. The recorder's snapshots consume what they
/// read (counters and gauges are reset to zero, histograms emptied), so
/// every snapshot is added here, under one lock: a test that reads does
/// not take another test's values away. Only increments and decrements
/// are recorded, so adding up gauge snapshots gives the gauge.
#[derive(Default)]
struct Captured {
    counters: HashMap<Series, u64>,
    gauges: HashMap<Series, f64>,
    histograms: HashMap<Series, Vec<f64>>,
}

fn capture() -> &'static Mutex<(Snapshotter, Captured)> {
    static RECORDER: OnceLock<Mutex<(Snapshotter, Captured)>> = OnceLock::new();
    RECORDER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("no other recorder in this binary");
        Mutex::new((snapshotter, Captured::default()))
    })
}

/// The values recorded for backends of `kind` so far.
struct Recorded {
    kind: &'static str,
    counters: HashMap<Series, u64>,
    gauges: HashMap<Series, f64>,
    histograms: HashMap<Series, Vec<f64>>,
}

fn recorded(kind: &'static str) -> Recorded {
    let mut guard = capture().lock().unwrap_or_else(PoisonError::into_inner);
    let (snapshotter, captured) = &mut *guard;
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let mut labels: Vec<(String, String)> = key
            .labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect();
        labels.sort();
        let series = (key.name().to_owned(), labels);
        match value {
            DebugValue::Counter(n) => *captured.counters.entry(series).or_default() += n,
            DebugValue::Gauge(v) => *captured.gauges.entry(series).or_default() += v.into_inner(),
            DebugValue::Histogram(vs) => captured
                .histograms
                .entry(series)
                .or_default()
                .extend(vs.into_iter().map(|v| v.into_inner())),
        }
    }
    Recorded {
        kind,
        counters: of_kind(&captured.counters, kind),
        gauges: of_kind(&captured.gauges, kind),
        histograms: of_kind(&captured.histograms, kind),
    }
}

/// The series of `values` labelled with backend `kind`.
fn of_kind<V: Clone>(values: &HashMap<Series, V>, kind: &str) -> HashMap<Series, V> {
    values
        .iter()
        .filter(|(series, _)| {
            series
                .1
                .iter()
                .any(|(k, v)| k == "backend" && v.as_str() == kind)
        })
        .map(|(series, value)| (series.clone(), value.clone()))
        .collect()
}

impl Recorded {
    /// The series `name` with `backend = kind` and `labels`.
    fn series(&self, name: &str, labels: &[(&str, &str)]) -> Series {
        let mut all: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .chain([("backend".to_owned(), self.kind.to_owned())])
            .collect();
        all.sort();
        (name.to_owned(), all)
    }

    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.counters
            .get(&self.series(name, labels))
            .copied()
            .unwrap_or(0)
    }

    /// Every counter series of `name`, by its label other than `backend`.
    fn counters_of(&self, name: &str) -> HashMap<String, u64> {
        self.counters
            .iter()
            .filter(|((n, _), v)| n == name && **v > 0)
            .map(|((_, labels), v)| {
                let other = labels
                    .iter()
                    .find(|(k, _)| k != "backend")
                    .map(|(k, v)| format!("{k}={v}"))
                    .unwrap_or_default();
                (other, *v)
            })
            .collect()
    }

    fn gauge(&self, name: &str) -> f64 {
        self.gauges
            .get(&self.series(name, &[]))
            .copied()
            .unwrap_or(0.0)
    }

    fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        self.histograms
            .get(&self.series(name, labels))
            .cloned()
            .unwrap_or_default()
    }

    fn held_now(&self) -> f64 {
        self.gauge(LEASES_HELD)
    }
}

// ---------------------------------------------------------------------------
// A backend of a kind of its own.

/// The memory backend under another kind. It can also fail every renewal
/// (a server that went away), answer acquisitions late (a slow one), or
/// attach its grants to a loss group the test ends (a session that died).
struct Labelled {
    kind: &'static str,
    inner: MemoryBackend,
    fail_renewals: AtomicBool,
    /// Renewals asked for.
    renewals: AtomicUsize,
    acquire_delay: Duration,
    session: Option<Arc<LossGroup>>,
}

impl Labelled {
    fn new(kind: &'static str) -> Self {
        Self {
            kind,
            inner: MemoryBackend::new(),
            fail_renewals: AtomicBool::new(false),
            renewals: AtomicUsize::new(0),
            acquire_delay: Duration::ZERO,
            session: None,
        }
    }

    fn shared(self) -> Arc<dyn Backend> {
        Arc::new(self)
    }

    fn refused(&self, key: &LockKey) -> LockError {
        LockError::backend(
            self.kind,
            Operation::Extend,
            key.as_str(),
            "connection refused",
        )
    }
}

#[async_trait]
impl Backend for Labelled {
    fn kind(&self) -> &'static str {
        self.kind
    }
    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        if !self.acquire_delay.is_zero() {
            tokio::time::sleep(self.acquire_delay).await;
        }
        match (self.inner.try_acquire(request).await?, &self.session) {
            (Attempt::Acquired(grant), Some(session)) => {
                Ok(Attempt::Acquired(grant.lost_with(Arc::clone(session))))
            }
            (answer, _) => Ok(answer),
        }
    }
    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        self.renewals.fetch_add(1, Ordering::SeqCst);
        if self.fail_renewals.load(Ordering::SeqCst) {
            return Err(self.refused(renewal.key));
        }
        self.inner.extend(renewal).await
    }
    async fn extend_many(&self, renewals: &[Renewal<'_>]) -> Vec<Result<bool, LockError>> {
        self.renewals.fetch_add(renewals.len(), Ordering::SeqCst);
        if self.fail_renewals.load(Ordering::SeqCst) {
            return renewals.iter().map(|r| Err(self.refused(r.key))).collect();
        }
        self.inner.extend_many(renewals).await
    }
    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
        self.inner.release(lease).await
    }
    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        self.inner.subscribe(key).await
    }
    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        self.inner.force_release(key).await
    }
    async fn holder(&self, key: &LockKey) -> Result<Option<Holding>, LockError> {
        self.inner.holder(key).await
    }
    async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        self.inner.watch_holder(key).await
    }
}

/// Waits (up to 5 s) for `lease` to be told it is lost, and returns why.
async fn lost_reason(lease: &dlock::Lease) -> LostReason {
    match tokio::time::timeout(Duration::from_secs(10), lease.lost()).await {
        Ok(LockError::LeaseLost { reason, .. }) => reason,
        Ok(other) => panic!("expected LeaseLost, got {other}"),
        Err(_) => panic!("the lease was not lost within 10 s"),
    }
}

// ---------------------------------------------------------------------------
// Acquisitions and waits.

#[tokio::test]
async fn acquisitions_are_counted_by_outcome() {
    let kind = "test-outcomes";
    capture();
    // Its first attempt fails as a refused connection would.
    let backend: Arc<dyn Backend> = CountingBackend::failing_first(Labelled::new(kind).shared(), 1);
    let key = fresh_key("outcomes");
    let options = LockOptions::new(TTL);

    let failed = options.acquire_on(Arc::clone(&backend), key.clone()).await;
    assert!(
        matches!(failed, Err(LockError::Backend { .. })),
        "{failed:?}"
    );
    let lease = options
        .acquire_on(Arc::clone(&backend), key.clone())
        .await
        .expect("free key");
    let held = options.acquire_on(Arc::clone(&backend), key.clone()).await;
    assert!(matches!(held, Err(LockError::Held { .. })), "{held:?}");
    // A wait long enough that a loaded machine's slow call that may not
    // wait does not take as long.
    let waited = options
        .wait(Duration::from_secs(1))
        .acquire_on(Arc::clone(&backend), key.clone())
        .await;
    assert!(
        matches!(waited, Err(LockError::Timeout { .. })),
        "{waited:?}"
    );
    lease.release().await.expect("released");

    let m = recorded(kind);
    let by_outcome = m.counters_of(ACQUISITIONS);
    let expected: HashMap<String, u64> = ["acquired", "held", "timeout", "error"]
        .into_iter()
        .map(|o| (format!("outcome={o}"), 1))
        .collect();
    assert_eq!(by_outcome, expected);
    for outcome in ["acquired", "held", "timeout", "error"] {
        assert_eq!(
            m.histogram(WAIT, &[("outcome", outcome)]).len(),
            1,
            "one wait for the {outcome} acquisition"
        );
    }
    let timed_out = m.histogram(WAIT, &[("outcome", "timeout")])[0];
    assert!(timed_out >= 1.0, "the timeout waited {timed_out} s");
    let at_once = m.histogram(WAIT, &[("outcome", "held")])[0];
    assert!(
        at_once < timed_out,
        "a call that may not wait waited {at_once} s"
    );
}

#[tokio::test]
async fn wait_and_hold_are_recorded_once_per_lease() {
    let kind = "test-once-per-lease";
    capture();
    let memory = Labelled::new(kind).shared();
    let options = LockOptions::new(TTL);
    let short = LockOptions::new(SHORT_TTL);
    let take = |key: LockKey| options.acquire_on(Arc::clone(&memory), key);

    // Released after a hold of 50 ms.
    let held_50ms = take(fresh_key("once")).await.expect("free");
    tokio::time::sleep(Duration::from_millis(50)).await;
    held_50ms.release().await.expect("released");
    // Dropped.
    drop(take(fresh_key("once")).await.expect("free"));
    // Lost (broken by hand, told at its next renewal), then released.
    let key = fresh_key("once");
    let lost = short
        .acquire_on(Arc::clone(&memory), key.clone())
        .await
        .expect("free");
    assert!(memory.force_release(&key).await.expect("memory answers"));
    assert_eq!(lost_reason(&lost).await, LostReason::NotOwner);
    assert!(
        lost.release().await.is_err(),
        "a lost lease's release fails"
    );
    // Two keys at once.
    let set = options
        .acquire_many_on(Arc::clone(&memory), [fresh_key("once"), fresh_key("once")])
        .await
        .expect("free keys");
    set.release().await.expect("released");

    let m = recorded(kind);
    assert_eq!(m.counter(ACQUISITIONS, &[("outcome", "acquired")]), 5);
    assert_eq!(m.histogram(WAIT, &[("outcome", "acquired")]).len(), 5);
    let holds = m.histogram(HOLD, &[]);
    assert_eq!(holds.len(), 5, "one hold per lease: {holds:?}");
    assert!(
        holds.iter().any(|&h| h >= 0.05),
        "the 50 ms hold is among {holds:?}"
    );
    assert_eq!(m.counter(LEASES_LOST, &[("reason", "not_owner")]), 1);
}

#[tokio::test]
async fn cancelled_acquisitions_are_not_counted() {
    let kind = "test-cancelled";
    capture();
    let memory = Labelled::new(kind).shared();
    let key = fresh_key("cancelled");
    let holder = LockOptions::new(TTL)
        .acquire_on(Arc::clone(&memory), key.clone())
        .await
        .expect("free");
    // A waiter whose caller gives up while the key is held.
    let patient = LockOptions::new(TTL).wait(Duration::from_secs(10));
    let waiting = patient.acquire_on(Arc::clone(&memory), key.clone());
    assert!(
        tokio::time::timeout(Duration::from_millis(50), waiting)
            .await
            .is_err(),
        "the key is held"
    );
    holder.release().await.expect("released");

    // An attempt answered after its caller gave up: the grant is given back
    // in the background, and is no acquisition.
    let slow = Labelled {
        acquire_delay: Duration::from_secs(1),
        ..Labelled::new(kind)
    }
    .shared();
    let options = LockOptions::new(TTL);
    let late = options.acquire_on(Arc::clone(&slow), key.clone());
    assert!(
        tokio::time::timeout(Duration::from_millis(20), late)
            .await
            .is_err(),
        "the answer comes after 1 s"
    );
    // Given back: the key is free again once the late answer came.
    let mut free = false;
    for _ in 0..250 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if slow.holder(&key).await.expect("memory answers").is_none() {
            free = true;
            break;
        }
    }
    assert!(free, "the late grant was given back");

    let m = recorded(kind);
    assert_eq!(
        m.counters_of(ACQUISITIONS),
        HashMap::from([("outcome=acquired".to_owned(), 1)]),
        "only the holder's acquisition counts"
    );
    assert_eq!(m.histogram(WAIT, &[("outcome", "acquired")]).len(), 1);
    assert_eq!(m.histogram(HOLD, &[]).len(), 1);
    assert_eq!(m.held_now(), 0.0);
}

// ---------------------------------------------------------------------------
// The leases-held gauge, on every way a lease ends.

#[tokio::test]
async fn leases_held_returns_to_baseline_after_release() {
    let kind = "test-held-release";
    capture();
    let memory = Labelled::new(kind).shared();
    let lease = LockOptions::new(TTL)
        .acquire_on(Arc::clone(&memory), fresh_key("gauge"))
        .await
        .expect("free");
    assert_eq!(recorded(kind).held_now(), 1.0);
    lease.release().await.expect("released");
    assert_eq!(recorded(kind).held_now(), 0.0);
}

#[tokio::test]
async fn leases_held_returns_to_baseline_after_drop() {
    let kind = "test-held-drop";
    capture();
    let memory = Labelled::new(kind).shared();
    let key = fresh_key("gauge");
    let lease = LockOptions::new(TTL)
        .acquire_on(Arc::clone(&memory), key.clone())
        .await
        .expect("free");
    assert_eq!(recorded(kind).held_now(), 1.0);
    drop(lease);
    assert_eq!(recorded(kind).held_now(), 0.0, "ended when dropped");
    // The background release that follows counts nothing more.
    for _ in 0..100 {
        if memory.holder(&key).await.expect("memory answers").is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let m = recorded(kind);
    assert_eq!(m.held_now(), 0.0);
    assert_eq!(m.histogram(HOLD, &[]).len(), 1);
    assert!(m.counters_of(LEASES_LOST).is_empty());
}

#[tokio::test]
async fn leases_held_returns_to_baseline_after_loss() {
    let kind = "test-held-loss";
    capture();
    let memory = Labelled::new(kind).shared();
    let key = fresh_key("gauge");
    let lease = LockOptions::new(SHORT_TTL)
        .acquire_on(Arc::clone(&memory), key.clone())
        .await
        .expect("free");
    assert_eq!(recorded(kind).held_now(), 1.0);
    assert!(memory.force_release(&key).await.expect("memory answers"));
    assert_eq!(lost_reason(&lease).await, LostReason::NotOwner);
    assert_eq!(recorded(kind).held_now(), 0.0, "ended when lost");
    // Released after the loss: neither a second end nor a second loss.
    assert!(lease.release().await.is_err());
    let m = recorded(kind);
    assert_eq!(m.held_now(), 0.0);
    assert_eq!(m.histogram(HOLD, &[]).len(), 1);
    assert_eq!(
        m.counters_of(LEASES_LOST),
        HashMap::from([("reason=not_owner".to_owned(), 1)])
    );
}

#[tokio::test]
async fn leases_held_returns_to_baseline_after_a_lease_set() {
    let kind = "test-held-set";
    capture();
    let memory = Labelled::new(kind).shared();
    let options = LockOptions::new(TTL);
    let keys = [fresh_key("set"), fresh_key("set"), fresh_key("set")];

    let set = options
        .acquire_many_on(Arc::clone(&memory), keys.clone())
        .await
        .expect("free keys");
    assert_eq!(recorded(kind).held_now(), 3.0);
    set.release().await.expect("released");
    assert_eq!(recorded(kind).held_now(), 0.0);

    // A set that fails half-way: the keys before the held one are taken,
    // then released unused.
    let mut sorted = keys.clone();
    sorted.sort();
    let blocker = options
        .acquire_on(Arc::clone(&memory), sorted[1].clone())
        .await
        .expect("free");
    let half = options
        .acquire_many_on(Arc::clone(&memory), keys.clone())
        .await;
    assert!(matches!(half, Err(LockError::Held { .. })), "{half:?}");
    assert_eq!(recorded(kind).held_now(), 1.0, "only the blocker holds");
    blocker.release().await.expect("released");

    let m = recorded(kind);
    assert_eq!(m.held_now(), 0.0);
    // 3 (the set) + 1 (the blocker) + 1 (the half set's first key).
    assert_eq!(m.counter(ACQUISITIONS, &[("outcome", "acquired")]), 5);
    assert_eq!(m.counter(ACQUISITIONS, &[("outcome", "held")]), 1);
    assert_eq!(m.histogram(HOLD, &[]).len(), 5);
    assert!(m.counters_of(LEASES_LOST).is_empty());
}

// ---------------------------------------------------------------------------
// Losses and renewals.

#[tokio::test]
async fn lost_leases_are_counted_by_reason() {
    let kind = "test-lost-reasons";
    capture();
    let short = LockOptions::new(SHORT_TTL);

    // expired: no renewal, and the ttl runs out.
    let memory = Labelled::new(kind).shared();
    let expired = short
        .clone()
        .renew(false)
        .acquire_on(Arc::clone(&memory), fresh_key("lost"))
        .await
        .expect("free");
    assert_eq!(lost_reason(&expired).await, LostReason::Expired);

    // not_owner: broken by hand, refused at the next renewal.
    let key = fresh_key("lost");
    let broken = short
        .acquire_on(Arc::clone(&memory), key.clone())
        .await
        .expect("free");
    assert!(memory.force_release(&key).await.expect("memory answers"));
    assert_eq!(lost_reason(&broken).await, LostReason::NotOwner);

    // unreachable: every renewal fails until the ttl runs out.
    let failing = Labelled::new(kind);
    failing.fail_renewals.store(true, Ordering::SeqCst);
    let unreachable = short
        .acquire_on(failing.shared(), fresh_key("lost"))
        .await
        .expect("free");
    assert!(matches!(
        lost_reason(&unreachable).await,
        LostReason::Unreachable(_)
    ));

    // session_ended: the backend's session ends.
    let session = LossGroup::new();
    let on_session = Labelled {
        session: Some(Arc::clone(&session)),
        ..Labelled::new(kind)
    }
    .shared();
    let ended = LockOptions::new(TTL)
        .acquire_on(on_session, fresh_key("lost"))
        .await
        .expect("free");
    session.end(LostReason::SessionEnded("connection closed".into()));
    assert!(matches!(
        lost_reason(&ended).await,
        LostReason::SessionEnded(_)
    ));

    // runtime_gone: the runtime that renews it shuts down.
    let memory_for_thread = Arc::clone(&memory);
    let gone = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let lease = runtime
            .block_on(LockOptions::new(TTL).acquire_on(memory_for_thread, fresh_key("lost")))
            .expect("free");
        drop(runtime);
        let reason = match lease.check() {
            Err(LockError::LeaseLost { reason, .. }) => Some(reason),
            _ => None,
        };
        drop(lease);
        reason
    })
    .join()
    .expect("thread runs");
    assert_eq!(gone, Some(LostReason::RuntimeGone));

    // Each lost once, and released afterwards without counting again.
    for lease in [expired, broken, unreachable, ended] {
        assert!(lease.release().await.is_err());
    }
    let m = recorded(kind);
    let expected: HashMap<String, u64> = [
        "expired",
        "not_owner",
        "unreachable",
        "session_ended",
        "runtime_gone",
    ]
    .into_iter()
    .map(|reason| (format!("reason={reason}"), 1))
    .collect();
    assert_eq!(m.counters_of(LEASES_LOST), expected);
    assert_eq!(m.held_now(), 0.0);
    assert_eq!(m.histogram(HOLD, &[]).len(), 5);
}

#[tokio::test]
async fn a_release_that_finds_the_key_gone_counts_as_lost() {
    let kind = "test-lost-at-release";
    capture();
    let memory = Labelled::new(kind).shared();
    let key = fresh_key("release");
    let lease = LockOptions::new(TTL)
        .acquire_on(Arc::clone(&memory), key.clone())
        .await
        .expect("free");
    // Broken by hand; renewal (every 10 s) has not noticed yet.
    assert!(memory.force_release(&key).await.expect("memory answers"));
    let released = lease.release().await;
    assert!(
        matches!(
            released,
            Err(LockError::LeaseLost {
                reason: LostReason::NotOwner,
                ..
            })
        ),
        "{released:?}"
    );
    let m = recorded(kind);
    assert_eq!(
        m.counters_of(LEASES_LOST),
        HashMap::from([("reason=not_owner".to_owned(), 1)])
    );
    assert_eq!(m.held_now(), 0.0);
    assert_eq!(m.histogram(HOLD, &[]).len(), 1);
}

#[tokio::test]
async fn renewal_failures_are_counted() {
    let kind = "test-renewal-failures";
    let healthy_kind = "test-renewal-healthy";
    capture();
    let ttl = SHORT_TTL;

    let failing = Labelled::new(kind);
    failing.fail_renewals.store(true, Ordering::SeqCst);
    let failing: Arc<Labelled> = Arc::new(failing);
    let healthy: Arc<Labelled> = Arc::new(Labelled::new(healthy_kind));
    // Renewed at a third of the ttl, then retried until it runs out.
    let lease = LockOptions::new(ttl)
        .acquire_on(
            Arc::clone(&failing) as Arc<dyn Backend>,
            fresh_key("renewal"),
        )
        .await
        .expect("free");
    let renewed = LockOptions::new(ttl)
        .acquire_on(
            Arc::clone(&healthy) as Arc<dyn Backend>,
            fresh_key("renewal"),
        )
        .await
        .expect("free");
    assert!(matches!(
        lost_reason(&lease).await,
        LostReason::Unreachable(_)
    ));
    support::within(10, "two renewals of the healthy lease", async {
        while healthy.renewals.load(Ordering::SeqCst) < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    drop(renewed);

    let failures = recorded(kind).counter(RENEWAL_FAILURES, &[]);
    let asked = failing.renewals.load(Ordering::SeqCst) as u64;
    // A renewal answered after the expiry took the lease out of the
    // scheduler is no longer filed, so it may go uncounted; none counts twice.
    assert!(
        (2..=asked).contains(&failures),
        "{failures} failures counted of {asked} failed renewals"
    );
    assert_eq!(
        recorded(healthy_kind).counter(RENEWAL_FAILURES, &[]),
        0,
        "renewals that went through are no failures"
    );
}

// ---------------------------------------------------------------------------
// The span.

/// What the capturing layer saw of one span.
#[derive(Clone, Debug, Default)]
struct SeenSpan {
    id: u64,
    name: String,
    parent: Option<u64>,
    fields: HashMap<String, String>,
    closed: bool,
}

/// What it saw of one event.
#[derive(Clone, Debug)]
struct SeenEvent {
    message: String,
    span: Option<u64>,
}

/// A layer that keeps every span (fields included) and event.
#[derive(Clone, Default)]
struct Seen {
    spans: Arc<Mutex<Vec<SeenSpan>>>,
    events: Arc<Mutex<Vec<SeenEvent>>>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl Seen {
    fn spans(&self) -> std::sync::MutexGuard<'_, Vec<SeenSpan>> {
        self.spans.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The spans named `dlock.hold`, in the order they were opened.
    fn holds(&self) -> Vec<SeenSpan> {
        self.spans()
            .iter()
            .filter(|s| s.name == "dlock.hold")
            .cloned()
            .collect()
    }

    /// Ids are reused once a span closes: the open span with this id.
    fn with_open<T>(&self, id: u64, f: impl FnOnce(&mut SeenSpan) -> T) -> Option<T> {
        self.spans()
            .iter_mut()
            .rev()
            .find(|s| s.id == id && !s.closed)
            .map(f)
    }
}

impl<S> tracing_subscriber::Layer<S> for Seen
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut seen = SeenSpan {
            id: id.into_u64(),
            name: attrs.metadata().name().to_owned(),
            parent: ctx
                .span(id)
                .and_then(|span| span.parent())
                .map(|parent| parent.id().into_u64()),
            ..SeenSpan::default()
        };
        attrs.record(&mut Fields(&mut seen.fields));
        self.spans().push(seen);
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.with_open(id.into_u64(), |span| {
            values.record(&mut Fields(&mut span.fields))
        });
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: tracing_subscriber::layer::Context<'_, S>) {
        let mut fields = HashMap::new();
        event.record(&mut Fields(&mut fields));
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(SeenEvent {
                message: fields.remove("message").unwrap_or_default(),
                span: ctx.event_span(event).map(|span| span.id().into_u64()),
            });
    }

    fn on_close(&self, id: tracing::span::Id, _ctx: tracing_subscriber::layer::Context<'_, S>) {
        self.with_open(id.into_u64(), |span| span.closed = true);
    }
}

fn seen() -> (Seen, tracing::subscriber::DefaultGuard) {
    use tracing_subscriber::layer::SubscriberExt as _;
    support::every_call_site_on();
    let seen = Seen::default();
    let subscriber = tracing_subscriber::registry()
        .with(seen.clone())
        .with(tracing_subscriber::filter::LevelFilter::DEBUG);
    let guard = tracing::subscriber::set_default(subscriber);
    (seen, guard)
}

#[tokio::test]
async fn the_hold_span_covers_a_hold_from_acquisition_to_release() {
    let kind = "test-span-released";
    let (seen, _guard) = seen();
    let memory = Labelled::new(kind).shared();
    let key = fresh_key("span");
    let lease = LockOptions::new(TTL)
        .acquire_on(Arc::clone(&memory), key.clone())
        .await
        .expect("free");

    let holds = seen.holds();
    assert_eq!(holds.len(), 1, "{holds:?}");
    let hold = &holds[0];
    assert!(!hold.closed, "open while the lease is held");
    assert_eq!(hold.fields["key"], key.as_str());
    assert_eq!(hold.fields["backend"], kind);
    assert_eq!(hold.fields["token"], lease.token().to_string());
    assert!(hold.fields.contains_key("wait_ms"), "{hold:?}");
    assert!(!hold.fields.contains_key("outcome"), "no outcome yet");
    let acquire = seen
        .spans()
        .iter()
        .find(|s| s.name == "dlock.acquire")
        .cloned()
        .expect("the acquisition's span");
    assert_eq!(
        acquire.parent,
        Some(hold.id),
        "dlock.acquire is inside the hold"
    );

    lease.release().await.expect("released");
    let hold = &seen.holds()[0];
    assert!(hold.closed, "closed once the release is done");
    assert_eq!(hold.fields["outcome"], "released");
    assert!(!hold.fields.contains_key("reason"));
}

#[tokio::test]
async fn the_hold_span_records_a_loss_and_closes_with_it() {
    let kind = "test-span-lost";
    let (seen, _guard) = seen();
    let memory = Labelled::new(kind).shared();
    let key = fresh_key("span");
    let lease = LockOptions::new(SHORT_TTL)
        .acquire_on(Arc::clone(&memory), key.clone())
        .await
        .expect("free");
    assert!(memory.force_release(&key).await.expect("memory answers"));
    assert_eq!(lost_reason(&lease).await, LostReason::NotOwner);

    let hold = seen.holds()[0].clone();
    assert!(
        hold.closed,
        "closed when the loss is noticed, before any release"
    );
    assert_eq!(hold.fields["outcome"], "lost");
    assert_eq!(hold.fields["reason"], "not_owner");
    let warning = seen
        .events
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .find(|e| e.message == "lease lost")
        .cloned()
        .expect("the loss is logged");
    assert_eq!(
        warning.span,
        Some(hold.id),
        "the warning is inside the hold"
    );
    assert!(lease.release().await.is_err());
    assert_eq!(seen.holds()[0].fields["outcome"], "lost", "not overwritten");
}

#[tokio::test]
async fn the_hold_span_of_a_failed_acquisition_records_its_outcome() {
    let kind = "test-span-failed";
    let (seen, _guard) = seen();
    let memory = Labelled::new(kind).shared();
    let key = fresh_key("span");
    let lease = LockOptions::new(TTL)
        .acquire_on(Arc::clone(&memory), key.clone())
        .await
        .expect("free");
    let held = LockOptions::new(TTL)
        .acquire_on(Arc::clone(&memory), key.clone())
        .await;
    assert!(matches!(held, Err(LockError::Held { .. })));
    let patient = LockOptions::new(TTL).wait(Duration::from_secs(10));
    let waiting = patient.acquire_on(Arc::clone(&memory), key.clone());
    assert!(
        tokio::time::timeout(Duration::from_millis(30), waiting)
            .await
            .is_err()
    );

    let holds = seen.holds();
    assert_eq!(holds.len(), 3, "{holds:?}");
    let (failed, cancelled) = (&holds[1], &holds[2]);
    assert!(failed.closed);
    assert_eq!(failed.fields["outcome"], "held");
    assert!(!failed.fields.contains_key("token"), "nothing was held");
    assert!(failed.fields.contains_key("wait_ms"));
    assert!(cancelled.closed);
    assert_eq!(cancelled.fields["outcome"], "cancelled");
    lease.release().await.expect("released");
}

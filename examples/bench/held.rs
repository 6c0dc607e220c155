//! Scenario 4: many leases held at once with renewal running: what the
//! renewal costs in round trips, CPU and memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use dlock::backend::{
    AcquireRequest, Attempt, ReleaseNotice, ReleaseOutcome, ReleaseRequest, Renewal,
};
use dlock::{Backend, Lease, LockError, LockKey, LockOptions};
use tokio::time::Instant;

use crate::Res;

/// The ttl of the held leases: renewal every third of it.
pub const TTL: Duration = Duration::from_secs(30);

/// Forwards to a backend and counts the round trips renewal makes.
pub struct Counting {
    inner: Arc<dyn Backend>,
    /// Renewal requests sent to the backend: `extend` and `extend_many`
    /// calls, one round trip each (a batch is one pipeline on Redis, one
    /// check per lock session on PostgreSQL).
    pub renewal_calls: AtomicU64,
    /// Leases those requests renewed.
    pub leases_renewed: AtomicU64,
}

impl Counting {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        Self {
            inner,
            renewal_calls: AtomicU64::new(0),
            leases_renewed: AtomicU64::new(0),
        }
    }
}

#[async_trait]
impl Backend for Counting {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        self.inner.try_acquire(request).await
    }
    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        self.renewal_calls.fetch_add(1, Ordering::Relaxed);
        self.leases_renewed.fetch_add(1, Ordering::Relaxed);
        self.inner.extend(renewal).await
    }
    async fn extend_many(&self, leases: &[Renewal<'_>]) -> Vec<Result<bool, LockError>> {
        self.renewal_calls.fetch_add(1, Ordering::Relaxed);
        self.leases_renewed
            .fetch_add(leases.len() as u64, Ordering::Relaxed);
        self.inner.extend_many(leases).await
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
    async fn holder(&self, key: &LockKey) -> Result<Option<dlock::backend::Holding>, LockError> {
        self.inner.holder(key).await
    }
    async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        self.inner.watch_holder(key).await
    }
}

/// What holding the leases cost.
#[derive(Debug, Default)]
pub struct Held {
    /// Leases held.
    pub leases: usize,
    /// Renewal round trips per second in the window.
    pub round_trips_per_s: f64,
    /// Lease renewals per second in the window.
    pub renewals_per_s: f64,
    /// Process CPU time in the window over its wall time (1.0 = one core).
    pub cpu_share: f64,
    /// Resident memory added by the leases, per lease (peak RSS growth:
    /// allocator arenas and transient buffers included).
    pub bytes_per_lease: f64,
    /// Live heap bytes held at the end of the window, per lease (the
    /// allocator's count; the `Vec` holding the leases included).
    pub heap_per_lease: f64,
    /// Leases found lost at the end (should be 0).
    pub lost: usize,
    /// How long taking them all took.
    pub acquire_time: Duration,
}

/// Process CPU time (user + system) so far.
pub fn cpu_time() -> Duration {
    // SAFETY: getrusage writes into the struct we pass and nothing else.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return Duration::ZERO;
    }
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, (t.tv_usec as u32) * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Resident set size in bytes, from /proc/self/statm.
pub fn rss() -> u64 {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u64>().ok())
        })
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * page.max(0) as u64
}

/// Takes `count` leases on `backend` (64 acquirers at a time), holds them
/// for `window` while renewal runs, then releases them all.
pub async fn hold(
    backend: Arc<dyn Backend>,
    prefix: &str,
    count: usize,
    window: Duration,
) -> Res<Held> {
    let counting = Arc::new(Counting::new(backend));
    let dynamic: Arc<dyn Backend> = counting.clone();
    let before = rss();
    crate::heap::start();
    let started = Instant::now();
    let acquirers = 64.min(count.max(1));
    let mut handles = Vec::new();
    for a in 0..acquirers {
        let backend = dynamic.clone();
        let prefix = prefix.to_owned();
        handles.push(tokio::spawn(async move {
            let options = LockOptions::new(TTL);
            let mut leases = Vec::new();
            for i in (a..count).step_by(acquirers) {
                leases.push(
                    options
                        .acquire_on(backend.clone(), format!("{prefix}:{i}"))
                        .await?,
                );
            }
            Ok::<_, LockError>(leases)
        }));
    }
    let mut leases: Vec<Lease> = Vec::with_capacity(count);
    for handle in handles {
        leases.extend(handle.await??);
    }
    let acquire_time = started.elapsed();
    // Let the acquisition's stragglers settle before the window opens.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (calls0, renewed0) = (
        counting.renewal_calls.load(Ordering::Relaxed),
        counting.leases_renewed.load(Ordering::Relaxed),
    );
    let (cpu0, wall0) = (cpu_time(), Instant::now());
    let mut peak = rss();
    let window_end = wall0 + window;
    while Instant::now() < window_end {
        tokio::time::sleep(Duration::from_millis(500).min(window_end - Instant::now())).await;
        peak = peak.max(rss());
    }
    let (cpu1, wall) = (cpu_time(), wall0.elapsed());
    let heap = crate::heap::live();
    crate::heap::stop();
    let (calls1, renewed1) = (
        counting.renewal_calls.load(Ordering::Relaxed),
        counting.leases_renewed.load(Ordering::Relaxed),
    );
    let lost = leases.iter().filter(|l| l.is_lost()).count();
    let held = Held {
        leases: leases.len(),
        round_trips_per_s: (calls1 - calls0) as f64 / wall.as_secs_f64(),
        renewals_per_s: (renewed1 - renewed0) as f64 / wall.as_secs_f64(),
        cpu_share: (cpu1 - cpu0).as_secs_f64() / wall.as_secs_f64(),
        bytes_per_lease: peak.saturating_sub(before) as f64 / leases.len().max(1) as f64,
        heap_per_lease: heap as f64 / leases.len().max(1) as f64,
        lost,
        acquire_time,
    };
    // Release in parallel, 64 at a time.
    let mut chunks: Vec<Vec<Lease>> = (0..64).map(|_| Vec::new()).collect();
    for (i, lease) in leases.into_iter().enumerate() {
        chunks[i % 64].push(lease);
    }
    let handles: Vec<_> = chunks
        .into_iter()
        .map(|chunk| {
            tokio::spawn(async move {
                for lease in chunk {
                    let _ = lease.release().await;
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await?;
    }
    Ok(held)
}

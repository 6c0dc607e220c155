//! The suite's helpers: how the runners hand a property its backends,
//! and the guards, keys and wrapped backends the properties use. Public,
//! so a backend's own tests can use them too.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::timeout;

use crate::LockKey;
use crate::backend::{AcquireRequest, Attempt, Backend, OwnerId, ReleaseOutcome, ReleaseRequest};

/// A property as the runners call it: an async fn of one backend, or of
/// two instances of the backend on one store (`Two`). The runners connect
/// as many as it takes with `make`; a property says which by its signature.
#[doc(hidden)]
pub trait Property<Takes>: Send + 'static {
    /// How many backends the property takes.
    const BACKENDS: usize;
    /// The property's run on `backends`, exactly [`Self::BACKENDS`] of them.
    fn run(self, backends: Vec<Arc<dyn Backend>>) -> BoxedRun;
}

/// One run of a property, ready to be spawned.
#[doc(hidden)]
pub type BoxedRun = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// Marks a property of one backend.
#[doc(hidden)]
pub enum One {}

/// Marks a property of two instances of the backend on one store.
#[doc(hidden)]
pub enum Two {}

impl<P, Fut> Property<One> for P
where
    P: FnOnce(Arc<dyn Backend>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    const BACKENDS: usize = 1;
    fn run(self, backends: Vec<Arc<dyn Backend>>) -> BoxedRun {
        let [backend] = <[_; 1]>::try_from(backends).unwrap_or_else(|_| unreachable!());
        Box::pin(self(backend))
    }
}

impl<P, Fut> Property<Two> for P
where
    P: FnOnce(Arc<dyn Backend>, Arc<dyn Backend>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    const BACKENDS: usize = 2;
    fn run(self, backends: Vec<Arc<dyn Backend>>) -> BoxedRun {
        let [backend, another] = <[_; 2]>::try_from(backends).unwrap_or_else(|_| unreachable!());
        Box::pin(self(backend, another))
    }
}

/// Connects the backends `property` takes, one call of `make` each, and
/// hands back its run, for [`conformance_suite!`](crate::conformance_suite)
/// and [`check_all`](super::check_all).
#[doc(hidden)]
pub async fn start<P, Takes, F, Fut>(property: P, make: &F) -> BoxedRun
where
    P: Property<Takes>,
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<dyn Backend>>,
{
    let mut backends = Vec::with_capacity(P::BACKENDS);
    for _ in 0..P::BACKENDS {
        backends.push(make().await);
    }
    property.run(backends)
}

/// Fails with `what` if `fut` has not finished within `secs` (a hang guard,
/// not a timing assertion).
pub async fn within<F: Future>(secs: u64, what: &str, fut: F) -> F::Output {
    match timeout(Duration::from_secs(secs), fut).await {
        Ok(out) => out,
        Err(_) => panic!("{what} did not finish within {secs}s"),
    }
}

/// Polls `fut` up to `polls` times, yielding to the runtime between polls
/// (so the tasks it waits on move on), and drops it there if it has not
/// finished: a caller that gives up at a chosen await point, not at a
/// timer's whim. A finished future's output is dropped as well.
pub async fn poll_then_drop<F: Future>(fut: F, polls: usize) {
    let mut fut = std::pin::pin!(fut);
    for _ in 0..polls {
        let polled = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
        if polled.is_ready() {
            return;
        }
        tokio::task::yield_now().await;
    }
}

/// A backend that counts acquisition attempts and passes everything to
/// `inner`: a test tells a waiter woken by a release from one that polls.
/// It can also fail its first attempts, as a restarting server would, or
/// leave its next attempt unanswered for ever, as a stalled one would.
pub struct CountingBackend {
    inner: Arc<dyn crate::Backend>,
    attempts: std::sync::atomic::AtomicUsize,
    answered: std::sync::atomic::AtomicUsize,
    failures: std::sync::atomic::AtomicUsize,
    hang_next: std::sync::atomic::AtomicBool,
    joined: std::sync::Mutex<std::collections::HashSet<crate::backend::OwnerId>>,
    first_tries: std::sync::atomic::AtomicUsize,
    /// A clock the caller advances, and its reading when a fair waiter's
    /// attempt first queued it.
    clock: Option<std::sync::Arc<std::sync::atomic::AtomicUsize>>,
    queued_at: std::sync::Mutex<Option<usize>>,
}

impl CountingBackend {
    /// Wraps `inner`, passing every call through.
    pub fn new(inner: Arc<dyn crate::Backend>) -> Arc<Self> {
        Self::failing_first(inner, 0)
    }

    /// Its first `failures` acquisition attempts fail with a backend error
    /// ("connection refused") without reaching `inner`.
    pub fn failing_first(inner: Arc<dyn crate::Backend>, failures: usize) -> Arc<Self> {
        std::sync::Arc::new(Self {
            inner,
            attempts: std::sync::atomic::AtomicUsize::new(0),
            answered: std::sync::atomic::AtomicUsize::new(0),
            failures: std::sync::atomic::AtomicUsize::new(failures),
            hang_next: std::sync::atomic::AtomicBool::new(false),
            joined: std::sync::Mutex::default(),
            first_tries: std::sync::atomic::AtomicUsize::new(0),
            clock: None,
            queued_at: std::sync::Mutex::default(),
        })
    }

    /// Wraps `inner`, and reads `clock` when an attempt first queues a fair
    /// waiter (see [`Self::queued_at`]).
    pub fn with_clock(
        inner: Arc<dyn crate::Backend>,
        clock: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) -> Arc<Self> {
        let mut counting = Self::failing_first(inner, 0);
        Arc::get_mut(&mut counting).expect("just made").clock = Some(clock);
        counting
    }

    /// The clock's reading (see [`Self::with_clock`]) when a
    /// [`Queue::Join`](crate::backend::Queue::Join) attempt was first
    /// answered `Held` or `Behind`: when its waiter was in the queue.
    pub fn queued_at(&self) -> Option<usize> {
        *self
            .queued_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The next acquisition attempt never gets an answer.
    pub fn hang_next_attempt(&self) {
        self.hang_next
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many acquisition attempts went through so far.
    pub fn attempts(&self) -> usize {
        self.attempts.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many acquisition attempts have had their answer (or error) so
    /// far: as many as [`Self::attempts`] when none is in flight.
    pub fn answered(&self) -> usize {
        self.answered.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many fair callers' first tries ([`Queue::Respect`] attempts)
    /// went through so far.
    ///
    /// [`Queue::Respect`]: crate::backend::Queue::Respect
    pub fn first_tries(&self) -> usize {
        self.first_tries.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many owners had a fair waiter's
    /// [`Queue::Join`](crate::backend::Queue::Join) attempt answered `Held`
    /// so far: each has had an entry in the queue once this counts it.
    pub fn joined(&self) -> usize {
        self.joined
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }
}

#[async_trait]
impl crate::Backend for CountingBackend {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn try_acquire(
        &self,
        request: &crate::backend::AcquireRequest<'_>,
    ) -> Result<crate::backend::Attempt, crate::LockError> {
        use std::sync::atomic::Ordering;
        self.attempts.fetch_add(1, Ordering::SeqCst);
        if request.queue == crate::backend::Queue::Respect {
            self.first_tries.fetch_add(1, Ordering::SeqCst);
        }
        if self.hang_next.swap(false, Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            self.answered.fetch_add(1, Ordering::SeqCst);
            return Err(crate::LockError::backend(
                self.inner.kind(),
                crate::error::Operation::Acquire,
                request.key.as_str(),
                "connection refused",
            ));
        }
        let answer = self.inner.try_acquire(request).await;
        if matches!(request.queue, crate::backend::Queue::Join { .. })
            && matches!(answer, Ok(crate::backend::Attempt::Held { .. }))
        {
            self.joined
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(*request.owner);
        }
        if let Some(clock) = &self.clock
            && matches!(request.queue, crate::backend::Queue::Join { .. })
            && matches!(
                answer,
                Ok(crate::backend::Attempt::Held { .. } | crate::backend::Attempt::Behind { .. })
            )
        {
            self.queued_at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get_or_insert_with(|| clock.load(Ordering::SeqCst));
        }
        self.answered.fetch_add(1, Ordering::SeqCst);
        answer
    }
    fn expiry_slack(&self) -> std::time::Duration {
        self.inner.expiry_slack()
    }

    fn supports_fair(&self) -> bool {
        self.inner.supports_fair()
    }
    fn supports_access(&self, access: crate::backend::Access) -> bool {
        self.inner.supports_access(access)
    }
    fn queued_here(&self, key: &crate::LockKey) -> bool {
        self.inner.queued_here(key)
    }
    async fn subscribe_handoff(
        &self,
        key: &crate::LockKey,
        owner: &crate::backend::OwnerId,
    ) -> Result<crate::backend::Handoff, crate::LockError> {
        self.inner.subscribe_handoff(key, owner).await
    }
    async fn extend(
        &self,
        renewal: &crate::backend::Renewal<'_>,
    ) -> Result<bool, crate::LockError> {
        self.inner.extend(renewal).await
    }
    async fn extend_many(
        &self,
        renewals: &[crate::backend::Renewal<'_>],
    ) -> Vec<Result<bool, crate::LockError>> {
        self.inner.extend_many(renewals).await
    }
    async fn release(
        &self,
        lease: &crate::backend::ReleaseRequest<'_>,
    ) -> Result<crate::backend::ReleaseOutcome, crate::LockError> {
        self.inner.release(lease).await
    }
    async fn subscribe(
        &self,
        key: &crate::LockKey,
    ) -> Result<crate::backend::ReleaseNotice, crate::LockError> {
        self.inner.subscribe(key).await
    }
    async fn force_release(&self, key: &crate::LockKey) -> Result<bool, crate::LockError> {
        self.inner.force_release(key).await
    }
    async fn force_release_holding(
        &self,
        key: &crate::LockKey,
        expected: &crate::backend::Holding,
    ) -> Result<crate::backend::ForceRelease, crate::LockError> {
        self.inner.force_release_holding(key, expected).await
    }
    async fn holder(
        &self,
        key: &crate::LockKey,
    ) -> Result<Option<crate::backend::Holding>, crate::LockError> {
        self.inner.holder(key).await
    }
    async fn watch_holder(
        &self,
        key: &crate::LockKey,
    ) -> Result<crate::backend::ReleaseNotice, crate::LockError> {
        self.inner.watch_holder(key).await
    }
}

/// A task that takes `key` on `backend` with a ttl of `ttl_secs`, waiting
/// up to `wait_secs` for it.
pub fn spawn_waiter(
    backend: Arc<dyn crate::Backend>,
    key: &crate::LockKey,
    ttl_secs: u64,
    wait_secs: u64,
) -> tokio::task::JoinHandle<Result<crate::Lease, crate::LockError>> {
    let key = key.clone();
    tokio::spawn(async move {
        crate::LockOptions::new(Duration::from_secs(ttl_secs))
            .wait(Duration::from_secs(wait_secs))
            .acquire_on(backend, key)
            .await
    })
}

/// One `try_acquire` of `key` by `owner`, straight on the backend; the
/// backend must answer.
pub async fn attempt_as(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    owner: &OwnerId,
    ttl: Duration,
) -> Attempt {
    backend
        .try_acquire(&AcquireRequest::new(key, owner, ttl))
        .await
        .expect("backend answers")
}

/// One `release` of `key` by `owner`, straight on the backend; the backend
/// must answer.
pub async fn release_as(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    owner: &OwnerId,
) -> ReleaseOutcome {
    backend
        .release(&ReleaseRequest::new(key, owner))
        .await
        .expect("backend answers")
}

/// A fresh key no other test (or earlier run) uses.
pub fn fresh_key(label: &str) -> LockKey {
    let id = OwnerId::random().expect("random bytes");
    LockKey::new(format!("dlock-test:{label}:{id}")).expect("valid key")
}

//! The conformance suite on `MemoryBackend`, plus what only it can show.

use crate::support;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use dlock::memory::MemoryBackend;
use dlock::{Backend, LockError, LockOptions, registry};

/// Every instance the suite connects shares one store, as processes share
/// a server: clones of one `MemoryBackend`.
async fn backend() -> Arc<dyn Backend> {
    static STORE: OnceLock<MemoryBackend> = OnceLock::new();
    Arc::new(STORE.get_or_init(MemoryBackend::new).clone())
}

dlock_runtime::conformance_suite!(backend);

#[tokio::test]
async fn unknown_backend_name_is_an_error_listing_the_registered_ones() {
    registry().register("memory-listed", MemoryBackend::new());
    let err = LockOptions::new(Duration::from_secs(1))
        .backend("no-such-backend")
        .acquire("k")
        .await
        .expect_err("no backend of that name");
    match err {
        LockError::UnknownBackend { name, registered } => {
            assert_eq!(name, "no-such-backend");
            assert!(registered.contains("memory-listed"), "{registered}");
        }
        other => panic!("expected UnknownBackend, got {other}"),
    }
}

#[tokio::test]
async fn released_keys_are_forgotten() {
    let memory = MemoryBackend::new();
    let backend: Arc<dyn Backend> = Arc::new(memory.clone());
    for i in 0..100 {
        let lease = LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend.clone(), format!("forget:{i}"))
            .await
            .expect("free");
        lease.release().await.expect("release");
    }
    assert_eq!(memory.tracked_keys(), 0, "released keys must not pile up");
}

#[test]
fn acquiring_outside_a_runtime_is_an_error_not_a_panic() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let acquired = block_on_without_runtime(
        LockOptions::new(Duration::from_secs(1)).acquire_on(backend, "no-runtime"),
    );
    assert!(matches!(acquired, Err(LockError::NoRuntime { .. })));
}

/// Polls a future to completion on this thread, with no Tokio runtime.
fn block_on_without_runtime<F: std::future::Future>(fut: F) -> F::Output {
    use std::task::{Context, Poll, Waker};
    let mut fut = std::pin::pin!(fut);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::yield_now();
    }
}

/// A memory backend whose first `failures` acquire attempts fail, as a
/// restarting server's would.
fn flaky(failures: usize) -> Arc<dyn Backend> {
    support::CountingBackend::failing_first(Arc::new(MemoryBackend::new()), failures)
}

#[tokio::test]
async fn a_waiting_caller_rides_out_brief_backend_failures() {
    let lease = LockOptions::new(Duration::from_secs(10))
        .wait(Duration::from_secs(10))
        .acquire_on(flaky(3), "flaky")
        .await
        .expect("three failures fit in the wait");
    lease.release().await.expect("release");
}

#[tokio::test]
async fn a_caller_that_may_not_wait_sees_the_backend_failure_at_once() {
    let err = LockOptions::new(Duration::from_secs(10))
        .acquire_on(flaky(1), "flaky")
        .await
        .expect_err("no wait, no retry");
    assert!(matches!(err, LockError::Backend { .. }), "{err}");
}

#[tokio::test]
async fn a_wait_that_ends_in_failures_reports_the_failure_not_a_timeout() {
    let err = LockOptions::new(Duration::from_secs(10))
        .wait(Duration::from_millis(300))
        .acquire_on(flaky(usize::MAX), "flaky")
        .await
        .expect_err("the backend never recovers");
    assert!(matches!(err, LockError::Backend { .. }), "{err}");
}

#[tokio::test(flavor = "current_thread")]
async fn check_tells_a_holder_whose_ttl_ran_out_while_its_thread_was_blocked() {
    // On a single-threaded runtime a body that blocks its thread keeps the
    // renewal task from running at all: the check must not depend on it.
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let lease = LockOptions::new(Duration::from_millis(100))
        .acquire_on(backend.clone(), "blocked-holder")
        .await
        .expect("free");
    std::thread::sleep(Duration::from_millis(250));
    let other = {
        let backend = backend.clone();
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(async {
                    LockOptions::new(Duration::from_secs(10))
                        .acquire_on(backend, "blocked-holder")
                        .await
                })
        })
        .join()
        .expect("thread")
    };
    assert!(other.is_ok(), "the ttl ran out, so another holder gets in");
    assert!(
        matches!(
            lease.check(),
            Err(LockError::LeaseLost {
                reason: dlock::LostReason::Expired,
                ..
            })
        ),
        "the blocked holder must be told its lease ran out: {:?}",
        lease.check()
    );
    assert!(lease.is_lost());
    assert!(lease.lost_signal().is_lost());
}

#[test]
fn a_lease_whose_runtime_shut_down_is_told_at_once() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let short_lived = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let lease = short_lived
        .block_on(
            LockOptions::new(Duration::from_secs(60)).acquire_on(backend.clone(), "runtime-gone"),
        )
        .expect("free");
    // The runtime whose task renewed the lease goes away: nobody renews it.
    drop(short_lived);
    let other = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    other.block_on(async {
        // Long before the 60 s ttl: only the runtime's end can explain it.
        let lost = support::within(10, "the lost signal", lease.lost()).await;
        assert!(
            matches!(
                lost,
                LockError::LeaseLost {
                    reason: dlock::LostReason::RuntimeGone,
                    ..
                }
            ),
            "{lost}"
        );
        assert!(lease.check().is_err());
    });
}

/// The memory backend, recording when a release by owner has finished and
/// when a fair waiter's handoff notice is dropped.
struct Watched {
    inner: MemoryBackend,
    events: Arc<std::sync::Mutex<Vec<&'static str>>>,
}

/// Records that the handoff notice it lives in was dropped.
struct NoticeDropped(Arc<std::sync::Mutex<Vec<&'static str>>>);

impl Drop for NoticeDropped {
    fn drop(&mut self) {
        self.0.lock().expect("events").push("notice dropped");
    }
}

#[async_trait::async_trait]
impl Backend for Watched {
    fn kind(&self) -> &'static str {
        "watched"
    }
    async fn try_acquire(
        &self,
        request: &dlock::backend::AcquireRequest<'_>,
    ) -> Result<dlock::backend::Attempt, LockError> {
        self.inner.try_acquire(request).await
    }
    fn supports_fair(&self) -> bool {
        true
    }
    async fn subscribe_handoff(
        &self,
        key: &dlock::LockKey,
        owner: &dlock::backend::OwnerId,
    ) -> Result<dlock::backend::Handoff, LockError> {
        let inner = self.inner.subscribe_handoff(key, owner).await?;
        let dropped = NoticeDropped(Arc::clone(&self.events));
        Ok(dlock::backend::Handoff::new(async move {
            let _dropped = dropped;
            inner.await
        }))
    }
    async fn extend(&self, renewal: &dlock::backend::Renewal<'_>) -> Result<bool, LockError> {
        self.inner.extend(renewal).await
    }
    async fn release(
        &self,
        lease: &dlock::backend::ReleaseRequest<'_>,
    ) -> Result<dlock::backend::ReleaseOutcome, LockError> {
        let outcome = self.inner.release(lease).await;
        self.events.lock().expect("events").push("released");
        outcome
    }
    async fn subscribe(
        &self,
        key: &dlock::LockKey,
    ) -> Result<dlock::backend::ReleaseNotice, LockError> {
        self.inner.subscribe(key).await
    }
    async fn force_release(&self, key: &dlock::LockKey) -> Result<bool, LockError> {
        self.inner.force_release(key).await
    }
    async fn holder(
        &self,
        key: &dlock::LockKey,
    ) -> Result<Option<dlock::backend::Holding>, LockError> {
        self.inner.holder(key).await
    }
    async fn watch_holder(
        &self,
        key: &dlock::LockKey,
    ) -> Result<dlock::backend::ReleaseNotice, LockError> {
        self.inner.watch_holder(key).await
    }
}

/// A fair waiter whose caller gives up keeps its handoff notice until the
/// release that leaves the queue has finished: a store that watches its
/// waiters through the notice (the file backend's alive file) must not
/// see the owner gone while a handoff to it may still be given back, or
/// the next waiter takes the handed key for a dead holder's and waits for
/// a recheck instead of the release's wake-up.
#[tokio::test]
async fn a_fair_waiter_that_gives_up_keeps_its_handoff_notice_until_it_has_left_the_queue() {
    let inner = MemoryBackend::new();
    let events = Arc::new(std::sync::Mutex::new(Vec::new()));
    let backend: Arc<dyn Backend> = Arc::new(Watched {
        inner: inner.clone(),
        events: Arc::clone(&events),
    });
    let key = dlock::LockKey::new("fair-notice-kept").expect("key");
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let waiter = tokio::spawn({
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            LockOptions::new(Duration::from_secs(30))
                .wait(Duration::from_secs(30))
                .fair(true)
                .acquire_on(backend, &key)
                .await
        }
    });
    support::within(10, "the waiter queues", async {
        while inner.queued_waiters(&key) == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    waiter.abort();
    assert!(waiter.await.is_err(), "the waiter was cancelled");
    let events = support::within(10, "the waiter leaves the queue", async {
        loop {
            let seen = events.lock().expect("events").clone();
            if seen.len() >= 2 {
                return seen;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    assert_eq!(
        events,
        ["released", "notice dropped"],
        "the notice outlives the release that leaves the queue"
    );
    assert_eq!(inner.queued_waiters(&key), 0, "the waiter left the queue");
    holder.release().await.expect("release");
}

/// The fence's ">= highest" rule on a read-write lock: two overlapping
/// readers both pass (equal tokens), a writer after them passes, and then
/// a stale reader of the phase before and a stale writer are refused.
#[tokio::test]
async fn a_fenced_cell_refuses_a_stale_writer_and_never_a_current_reader() {
    use dlock::LockMode;
    use dlock::fence::FencedCell;
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let cell = FencedCell::new("config", 0u32);
    let read = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let write = LockOptions::new(Duration::from_secs(30));

    let old_writer = write
        .acquire_on(backend.clone(), "config")
        .await
        .expect("free");
    cell.write(old_writer.token(), |v| *v = 1)
        .expect("the writer");
    let old_token = old_writer.token();
    old_writer.release().await.expect("release");

    let first = read
        .acquire_on(backend.clone(), "config")
        .await
        .expect("free");
    let second = read
        .acquire_on(backend.clone(), "config")
        .await
        .expect("overlap");
    cell.write(first.token(), |_| ())
        .expect("a current reader passes");
    cell.write(second.token(), |_| ())
        .expect("a second current reader passes");
    cell.write(first.token(), |_| ())
        .expect("a current reader passes again after the other");
    assert!(
        matches!(
            cell.write(old_token, |v| *v = 2),
            Err(LockError::StaleToken { .. })
        ),
        "the writer before the readers is stale"
    );
    let phase = first.token();
    first.release().await.expect("release");
    second.release().await.expect("release");

    let writer = write
        .acquire_on(backend.clone(), "config")
        .await
        .expect("free");
    cell.write(writer.token(), |v| *v = 3)
        .expect("the current writer");
    assert!(
        matches!(cell.write(phase, |_| ()), Err(LockError::StaleToken { .. })),
        "a reader of the phase before the writer is stale"
    );
    assert!(
        matches!(
            cell.write(old_token, |v| *v = 4),
            Err(LockError::StaleToken { .. })
        ),
        "the first writer is still stale"
    );
    assert_eq!(cell.read().0, 3);
    writer.release().await.expect("release");
}

/// Combinations of mode, permits, fair and several keys that make no sense
/// are refused before anything reaches the backend.
#[tokio::test]
async fn nonsense_mode_and_permit_options_are_refused_before_anything_is_sent() {
    use dlock::LockMode;
    use dlock_runtime::conformance::CountingBackend;
    let counting = CountingBackend::new(Arc::new(MemoryBackend::new()));
    let backend: Arc<dyn Backend> = counting.clone();
    let base = LockOptions::new(Duration::from_secs(30)).wait(Duration::from_secs(1));
    let cases = [
        (base.clone().permits(0), "permits"),
        (base.clone().permits(2).mode(LockMode::Shared), "permits"),
        (base.clone().mode(LockMode::Shared).fair(true), "fair"),
        (base.clone().permits(2).fair(true), "fair"),
    ];
    for (options, option) in cases {
        let refused = options.acquire_on(backend.clone(), "nonsense").await;
        assert!(
            matches!(&refused, Err(LockError::InvalidOption { option: named, .. }) if *named == option),
            "{option} is refused, got {refused:?}"
        );
    }
    for (options, option) in [
        (base.clone().mode(LockMode::Shared), "mode"),
        (base.clone().permits(2), "permits"),
    ] {
        let refused = options.acquire_many_on(backend.clone(), ["a", "b"]).await;
        assert!(
            matches!(&refused, Err(LockError::InvalidOption { option: named, .. }) if *named == option),
            "{option} with several keys is refused, got {refused:?}"
        );
    }
    assert_eq!(counting.attempts(), 0, "nothing was sent");
}

/// Keys read-locked, written after a waiting writer, or taken as permits
/// are forgotten once released, as plain ones are.
#[tokio::test]
async fn released_shared_and_permit_keys_are_forgotten() {
    use dlock::LockMode;
    let memory = MemoryBackend::new();
    let backend: Arc<dyn Backend> = Arc::new(memory.clone());
    let read = LockOptions::new(Duration::from_secs(10)).mode(LockMode::Shared);
    let permits = LockOptions::new(Duration::from_secs(10)).permits(3);
    for i in 0..20 {
        let a = read
            .acquire_on(backend.clone(), format!("forget-rw:{i}"))
            .await
            .expect("free");
        let b = read
            .acquire_on(backend.clone(), format!("forget-rw:{i}"))
            .await
            .expect("overlap");
        // A writer that waited and gave up left a mark, which its give
        // back removes.
        let refused = LockOptions::new(Duration::from_secs(10))
            .wait(Duration::from_millis(20))
            .acquire_on(backend.clone(), format!("forget-rw:{i}"))
            .await;
        assert!(matches!(refused, Err(LockError::Timeout { .. })));
        a.release().await.expect("release");
        b.release().await.expect("release");
        let p = permits
            .acquire_on(backend.clone(), format!("forget-permit:{i}"))
            .await
            .expect("free");
        p.release().await.expect("release");
    }
    // The refused writers' give backs run in the background: up to 10 s
    // on a busy machine.
    for _ in 0..1000 {
        if memory.tracked_keys() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(memory.tracked_keys(), 0, "released keys must not pile up");
}

/// A backend that answers every first look and every look right after
/// subscribing `Behind` (the second one late, after the caller's short
/// wait ran out), and asks its memory store otherwise: the caller, whose
/// every answer came in process, asks the store once more at its deadline
/// and takes the free key, never told "held" on the backend's word alone.
#[tokio::test]
async fn a_caller_answered_only_in_process_asks_the_store_before_it_times_out() {
    use async_trait::async_trait;
    use dlock::LockKey;
    use dlock::backend::{
        AcquireRequest, Attempt, Holding, Look, ReleaseNotice, ReleaseOutcome, ReleaseRequest,
        Renewal,
    };
    use std::sync::Mutex;

    struct LateBehind {
        inner: MemoryBackend,
        looks: Mutex<Vec<Look>>,
    }
    #[async_trait]
    impl Backend for LateBehind {
        fn kind(&self) -> &'static str {
            "late-behind"
        }
        async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
            self.looks
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(request.look);
            let behind = Attempt::Behind {
                expires_in: Duration::from_secs(1),
            };
            match request.look {
                Look::First => Ok(behind),
                Look::Subscribed { .. } => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Ok(behind)
                }
                _ => self.inner.try_acquire(request).await,
            }
        }
        async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
            self.inner.extend(renewal).await
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
    let backend = Arc::new(LateBehind {
        inner: MemoryBackend::new(),
        looks: Mutex::new(Vec::new()),
    });
    let key = dlock_runtime::conformance::fresh_key("late-behind");
    let lease = LockOptions::new(Duration::from_secs(30))
        .wait(Duration::from_millis(20))
        .acquire_on(backend.clone() as Arc<dyn Backend>, &key)
        .await;
    let looks = backend
        .looks
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let lease = lease.unwrap_or_else(|err| {
        panic!("told {err} on the backend's word alone; looks sent: {looks:?}")
    });
    assert_eq!(looks.last(), Some(&Look::Again), "{looks:?}");
    lease.release().await.expect("release");
}

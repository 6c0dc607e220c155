//! The conformance suite on `MemoryBackend`, plus what only it can show.

mod support;

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

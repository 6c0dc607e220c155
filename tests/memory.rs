//! The conformance suite on `MemoryBackend`, plus what only it can show.

mod conformance;
mod support;

use std::sync::Arc;
use std::time::Duration;

use dlock::memory::MemoryBackend;
use dlock::{Backend, LockError, LockOptions, registry};

async fn backend() -> Arc<dyn Backend> {
    Arc::new(MemoryBackend::new())
}

conformance::suite!(backend);

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

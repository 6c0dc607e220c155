//! What `#[distributed_lock]` does at run time, on the in-memory backend:
//! every test registers its own backend under its own name, so tests can
//! run in parallel in one process.
//!
//! Durations below are timeouts that bound a test that would otherwise hang,
//! or ttls that make renewal notice a loss quickly; no test asserts how long
//! something took.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dlock::{
    FencingToken, FencingTokens, LockError, LockKey, LockOptions, LostSignal, distributed_lock,
    memory::MemoryBackend, registry,
};
use tokio::sync::oneshot;
use tokio::time::timeout;

/// Bounds every wait that should end; long enough never to fire on a slow
/// machine.
const PATIENCE: Duration = Duration::from_secs(20);

fn register(name: &str) {
    registry().register(name, MemoryBackend::new());
}

/// A body that says it is running, then runs until told to leave.
async fn stay(entered: oneshot::Sender<()>, leave: oneshot::Receiver<()>) {
    let _ = entered.send(());
    let _ = leave.await;
}

/// Whether `key` can be had on `backend` right now (and gives it back).
async fn is_free(backend: &'static str, key: &str) -> bool {
    match LockOptions::new(Duration::from_secs(30))
        .backend(backend)
        .acquire(key)
        .await
    {
        Ok(lease) => {
            lease.release().await.expect("release");
            true
        }
        Err(LockError::Held { .. }) => false,
        Err(other) => panic!("unexpected error: {other}"),
    }
}

static HELD_RUNS: AtomicUsize = AtomicUsize::new(0);

#[distributed_lock(key = "report:{day}", ttl = "30s", backend = "macro-held")]
async fn held_report(
    day: u32,
    entered: oneshot::Sender<()>,
    leave: oneshot::Receiver<()>,
) -> Result<u32, LockError> {
    HELD_RUNS.fetch_add(1, Ordering::SeqCst);
    stay(entered, leave).await;
    Ok(day)
}

#[tokio::test]
async fn held_key_fails_the_second_call_with_held_without_running_its_body() {
    register("macro-held");
    let (entered, first_in) = oneshot::channel();
    let (first_leave, leave) = oneshot::channel();
    let first = tokio::spawn(held_report(7, entered, leave));
    first_in.await.expect("the first call runs");

    let (entered, _second_in) = oneshot::channel();
    let (_second_leave, leave) = oneshot::channel();
    let second = held_report(7, entered, leave).await;
    assert!(
        matches!(&second, Err(LockError::Held { key, .. }) if key == "report:7"),
        "{second:?}"
    );
    assert_eq!(HELD_RUNS.load(Ordering::SeqCst), 1, "the second body ran");

    first_leave.send(()).expect("the first call waits");
    let first = timeout(PATIENCE, first).await.expect("finishes");
    assert_eq!(first.expect("no panic").expect("held the key"), 7);
}

#[distributed_lock(key = "sequence", ttl = "30s", backend = "macro-tokens")]
async fn token_of_this_call(token: FencingToken) -> Result<FencingToken, LockError> {
    Ok(token)
}

#[tokio::test]
async fn tokens_passed_to_the_body_increase_strictly_across_calls() {
    register("macro-tokens");
    let mut tokens = Vec::new();
    for _ in 0..5 {
        tokens.push(token_of_this_call().await.expect("free key"));
    }
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "{tokens:?}"
    );
}

static WAIT_EVENTS: Mutex<Vec<&str>> = Mutex::new(Vec::new());

fn wait_event(event: &'static str) {
    WAIT_EVENTS.lock().expect("not poisoned").push(event);
}

#[distributed_lock(key = "nightly", ttl = "30s", wait = "30s", backend = "macro-wait")]
async fn waiting_job(
    name: &'static str,
    entered: oneshot::Sender<()>,
    leave: oneshot::Receiver<()>,
) -> Result<&'static str, LockError> {
    wait_event(name);
    stay(entered, leave).await;
    Ok(name)
}

#[tokio::test]
async fn wait_waits_for_the_holder_and_then_runs() {
    register("macro-wait");
    let (entered, first_in) = oneshot::channel();
    let (first_leave, leave) = oneshot::channel();
    let first = tokio::spawn(waiting_job("first", entered, leave));
    first_in.await.expect("the first call runs");

    let (entered, second_in) = oneshot::channel();
    let (second_leave, leave) = oneshot::channel();
    let second = tokio::spawn(waiting_job("second", entered, leave));
    // Whenever it got there, the second call cannot be done: it is waiting
    // (without `wait` it would have failed with `Held` at once).
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!second.is_finished(), "the second call gave up");

    first_leave.send(()).expect("the first call waits");
    timeout(PATIENCE, first)
        .await
        .expect("finishes")
        .expect("no panic")
        .expect("held the key");
    timeout(PATIENCE, second_in)
        .await
        .expect("the second call got the key once the first released it")
        .expect("the second call runs");
    second_leave.send(()).expect("the second call waits");
    let second = timeout(PATIENCE, second).await.expect("finishes");
    assert_eq!(second.expect("no panic").expect("got the key"), "second");
    assert_eq!(
        *WAIT_EVENTS.lock().expect("not poisoned"),
        ["first", "second"]
    );
}

#[distributed_lock(key = "fragile", ttl = "30s", backend = "macro-panic")]
async fn panicking_job() -> Result<(), LockError> {
    panic!("the body failed");
}

#[tokio::test]
async fn panicking_body_still_releases_the_key() {
    register("macro-panic");
    let joined = tokio::spawn(panicking_job()).await;
    assert!(joined.expect_err("the body panics").is_panic());
    // The ttl is 30s: only a release lets this waiting acquisition through.
    let lease = LockOptions::new(Duration::from_secs(30))
        .backend("macro-panic")
        .wait(PATIENCE)
        .acquire("fragile")
        .await
        .expect("the panicking call released the key");
    lease.release().await.expect("release");
}

static ABORTED_BODY_FINISHED: AtomicUsize = AtomicUsize::new(0);

// The ttls of the two bodies broken by hand below outlast a loaded
// machine's stall before the break (an expired key cannot be broken), and
// the loss is noticed by the next renewal.
#[distributed_lock(key = "abortable", ttl = "2s", backend = "macro-abort")]
async fn abortable_job(entered: oneshot::Sender<()>) -> Result<(), LockError> {
    let _ = entered.send(());
    tokio::time::sleep(PATIENCE * 2).await;
    ABORTED_BODY_FINISHED.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

async fn force_release(backend: &str, key: &str) {
    let backend = registry().get(backend).expect("registered");
    let key = LockKey::new(key).expect("valid key");
    assert!(backend.force_release(&key).await.expect("force release"));
}

#[tokio::test]
async fn on_lost_abort_cancels_the_body_and_returns_lease_lost() {
    register("macro-abort");
    let (entered, running) = oneshot::channel();
    let call = tokio::spawn(abortable_job(entered));
    running.await.expect("the body runs");
    force_release("macro-abort", "abortable").await;

    let result = timeout(PATIENCE, call)
        .await
        .expect("renewal notices the loss and the body is cancelled")
        .expect("no panic");
    assert!(
        matches!(&result, Err(LockError::LeaseLost { key, .. }) if key == "abortable"),
        "{result:?}"
    );
    assert_eq!(ABORTED_BODY_FINISHED.load(Ordering::SeqCst), 0);
}

#[distributed_lock(
    key = "finishing",
    ttl = "2s",
    backend = "macro-finish",
    on_lost = "finish"
)]
async fn finishing_job(
    entered: oneshot::Sender<()>,
    lost: LostSignal,
) -> Result<&'static str, LockError> {
    let _ = entered.send(());
    // Keeps working past the loss, as `on_lost = "finish"` allows.
    let _why = lost.lost().await;
    Ok("finished")
}

#[tokio::test]
async fn on_lost_finish_returns_the_body_result() {
    register("macro-finish");
    let (entered, running) = oneshot::channel();
    let call = tokio::spawn(finishing_job(entered));
    running.await.expect("the body runs");
    force_release("macro-finish", "finishing").await;

    let result = timeout(PATIENCE, call)
        .await
        .expect("the body sees the loss and finishes")
        .expect("no panic");
    assert_eq!(result.expect("the body's result"), "finished");
}

#[distributed_lock(
    key = "once-a-minute",
    ttl = "1m",
    min_hold = "50s",
    backend = "macro-min-hold"
)]
async fn quick_job() -> Result<(), LockError> {
    Ok(())
}

#[tokio::test]
async fn min_hold_keeps_the_key_held_after_return() {
    register("macro-min-hold");
    quick_job().await.expect("free key");
    assert!(!is_free("macro-min-hold", "once-a-minute").await);
    let again = quick_job().await;
    assert!(matches!(again, Err(LockError::Held { .. })), "{again:?}");
}

#[distributed_lock(key = "pair:{a}:{b}", ttl = "30s", backend = "macro-escape")]
async fn pair_job(
    a: &'static str,
    b: &'static str,
    entered: oneshot::Sender<()>,
    leave: oneshot::Receiver<()>,
) -> Result<(), LockError> {
    stay(entered, leave).await;
    Ok(())
}

#[tokio::test]
async fn key_template_escapes_values_so_different_values_never_share_a_key() {
    register("macro-escape");
    let (entered, first_in) = oneshot::channel();
    let (first_leave, leave) = oneshot::channel();
    let first = tokio::spawn(pair_job("1:2", "3", entered, leave));
    first_in.await.expect("the first call runs");

    let (entered, second_in) = oneshot::channel();
    let (second_leave, leave) = oneshot::channel();
    let second = tokio::spawn(pair_job("1", "2:3", entered, leave));
    // Both hold their lock at the same time: the keys differ.
    second_in
        .await
        .expect("(\"1\", \"2:3\") is not locked by (\"1:2\", \"3\")");

    first_leave.send(()).expect("waits");
    second_leave.send(()).expect("waits");
    for call in [first, second] {
        let done = timeout(PATIENCE, call).await.expect("finishes");
        done.expect("no panic").expect("held its key");
    }
    assert!(is_free("macro-escape", "pair:1%3A2:3").await);
    assert!(is_free("macro-escape", "pair:1:2%3A3").await);
}

#[distributed_lock(keys = ["account:{from}", "account:{to}"], ttl = "30s", backend = "macro-keys")]
async fn transfer(
    from: u32,
    to: u32,
    tokens: FencingTokens,
    entered: oneshot::Sender<FencingTokens>,
    leave: oneshot::Receiver<()>,
) -> Result<(), LockError> {
    let _ = entered.send(tokens);
    let _ = leave.await;
    Ok(())
}

#[tokio::test]
async fn keys_lock_every_key_and_pass_one_token_per_key() {
    register("macro-keys");
    let (entered, inside) = oneshot::channel();
    let (done, leave) = oneshot::channel();
    let call = tokio::spawn(transfer(1, 2, entered, leave));
    let tokens = inside.await.expect("the body runs");
    assert_eq!(tokens.len(), 2);

    assert!(!is_free("macro-keys", "account:1").await);
    assert!(!is_free("macro-keys", "account:2").await);
    done.send(()).expect("waits");
    timeout(PATIENCE, call)
        .await
        .expect("finishes")
        .expect("no panic")
        .expect("held both keys");
    assert!(is_free("macro-keys", "account:1").await);
    assert!(is_free("macro-keys", "account:2").await);
}

// The body outlasts three ttls, each renewed with two thirds of it to
// spare: a loaded machine's stall of a few hundred ms loses no lease.
#[distributed_lock(key = "slow", ttl = "1s", backend = "macro-renew")]
async fn slow_job() -> Result<&'static str, LockError> {
    tokio::time::sleep(Duration::from_millis(3500)).await;
    Ok("done")
}

#[tokio::test]
async fn renewal_keeps_a_body_running_longer_than_the_ttl() {
    register("macro-renew");
    let result = timeout(PATIENCE, slow_job()).await.expect("finishes");
    assert_eq!(result.expect("renewed, never lost"), "done");
}

#[distributed_lock(
    key = "unrenewed",
    ttl = "300ms",
    renew = false,
    backend = "macro-no-renew"
)]
async fn unrenewed_job() -> Result<(), LockError> {
    tokio::time::sleep(PATIENCE * 2).await;
    Ok(())
}

#[tokio::test]
async fn without_renewal_the_lease_is_lost_when_the_ttl_runs_out() {
    register("macro-no-renew");
    let result = timeout(PATIENCE, unrenewed_job())
        .await
        .expect("cancelled once the ttl ran out");
    assert!(
        matches!(result, Err(LockError::LeaseLost { .. })),
        "{result:?}"
    );
}

#[distributed_lock(key = "orphan", ttl = "30s", backend = "macro-never-registered")]
async fn orphan_job() -> Result<(), LockError> {
    Ok(())
}

#[tokio::test]
async fn an_unregistered_backend_is_an_error_not_a_silent_skip() {
    let result = orphan_job().await;
    assert!(
        matches!(&result, Err(LockError::UnknownBackend { name, .. }) if name == "macro-never-registered"),
        "{result:?}"
    );
}

#[distributed_lock(key = "swap", ttl = "30s", backend = "macro-swap")]
async fn swap_job() -> Result<(), LockError> {
    Ok(())
}

#[tokio::test]
async fn an_annotated_fn_follows_the_registry_when_its_backend_is_replaced_or_removed() {
    // `swap` is held on backend A for the whole test.
    let a: std::sync::Arc<dyn dlock::Backend> = std::sync::Arc::new(MemoryBackend::new());
    let held = LockOptions::new(Duration::from_secs(30))
        .acquire_on(std::sync::Arc::clone(&a), "swap")
        .await
        .expect("free on a fresh backend");
    registry().register_shared("macro-swap", std::sync::Arc::clone(&a));
    let on_a = swap_job().await;
    assert!(matches!(on_a, Err(LockError::Held { .. })), "{on_a:?}");

    // Replaced by B, where the key is free: the very next call uses B.
    registry().register("macro-swap", MemoryBackend::new());
    swap_job().await.expect("runs on the replacement backend");

    // A again: held again.
    let b = registry()
        .register_shared("macro-swap", std::sync::Arc::clone(&a))
        .expect("B was registered");
    let on_a = swap_job().await;
    assert!(matches!(on_a, Err(LockError::Held { .. })), "{on_a:?}");
    held.release().await.expect("release");

    // Removed: the next call fails instead of using what it used before.
    registry().unregister("macro-swap").expect("was registered");
    let result = swap_job().await;
    assert!(
        matches!(&result, Err(LockError::UnknownBackend { name, .. }) if name == "macro-swap"),
        "{result:?}"
    );

    // The call site does not keep a backend it used alive once it is gone
    // from the registry.
    let weak_b = std::sync::Arc::downgrade(&b);
    drop(b);
    assert!(
        weak_b.upgrade().is_none(),
        "a replaced backend is still referenced"
    );
}

/// A lease's token on `backend`, taken and given back at once: the key's
/// token sequence as it stands.
async fn token_now(backend: &'static str, key: &str) -> FencingToken {
    let lease = LockOptions::new(Duration::from_secs(30))
        .backend(backend)
        .acquire(key)
        .await
        .expect("free key");
    let token = lease.token();
    lease.release().await.expect("release");
    token
}

// `#[async_trait]` on the impl expands the method before
// `#[distributed_lock]` sees it.
#[async_trait::async_trait]
trait Export: Send + Sync {
    async fn export(
        &self,
        tenant: u32,
        entered: oneshot::Sender<()>,
        leave: oneshot::Receiver<()>,
    ) -> Result<FencingToken, LockError>;
}

struct RegionExport {
    region: &'static str,
}

static ASYNC_TRAIT_RUNS: AtomicUsize = AtomicUsize::new(0);

#[async_trait::async_trait]
impl Export for RegionExport {
    #[distributed_lock(
        key = "export:{self.region}:{tenant}",
        ttl = "30s",
        backend = "macro-async-trait"
    )]
    async fn export(
        &self,
        tenant: u32,
        entered: oneshot::Sender<()>,
        leave: oneshot::Receiver<()>,
        token: FencingToken,
    ) -> Result<FencingToken, LockError> {
        ASYNC_TRAIT_RUNS.fetch_add(1, Ordering::SeqCst);
        stay(entered, leave).await;
        Ok(token)
    }
}

#[tokio::test]
async fn an_async_trait_method_called_through_dyn_holds_the_key_and_gets_its_token() {
    register("macro-async-trait");
    let key = "export:eu:7";
    let before = token_now("macro-async-trait", key).await;
    let exporter: std::sync::Arc<dyn Export> = std::sync::Arc::new(RegionExport { region: "eu" });

    let (entered, first_in) = oneshot::channel();
    let (first_leave, leave) = oneshot::channel();
    let first = tokio::spawn({
        let exporter = std::sync::Arc::clone(&exporter);
        async move { exporter.export(7, entered, leave).await }
    });
    first_in.await.expect("the first call runs");
    assert!(
        !is_free("macro-async-trait", key).await,
        "the key is not held"
    );

    let (entered, _second_in) = oneshot::channel();
    let (_second_leave, leave) = oneshot::channel();
    let second = exporter.export(7, entered, leave).await;
    assert!(
        matches!(&second, Err(LockError::Held { key: held, .. }) if held == key),
        "{second:?}"
    );
    assert_eq!(
        ASYNC_TRAIT_RUNS.load(Ordering::SeqCst),
        1,
        "the second body ran"
    );

    first_leave.send(()).expect("the first call waits");
    let first = timeout(PATIENCE, first).await.expect("finishes");
    let token = first.expect("no panic").expect("held the key");
    // The body got the token of the lease it ran under: issued for this key
    // after the one before the call, and before the one after it.
    let after = token_now("macro-async-trait", key).await;
    assert!(
        before < token && token < after,
        "{before} < {token} < {after}"
    );
}

// `#[async_trait]` on the trait expands the default method before
// `#[distributed_lock]` sees it; implementors inherit the locked body.
#[async_trait::async_trait]
trait Audit: Sync {
    #[distributed_lock(
        key = "audit:{tenant}",
        ttl = "30s",
        backend = "macro-async-trait-default"
    )]
    async fn audit(&self, tenant: u32, token: FencingToken) -> Result<FencingToken, LockError> {
        Ok(token)
    }
}

struct Auditor;

#[async_trait::async_trait]
impl Audit for Auditor {}

#[tokio::test]
async fn a_locked_default_method_of_an_async_trait_holds_the_key_and_gets_its_token() {
    register("macro-async-trait-default");
    let auditor: &dyn Audit = &Auditor;
    let held = LockOptions::new(Duration::from_secs(30))
        .backend("macro-async-trait-default")
        .acquire("audit:3")
        .await
        .expect("free key");
    let refused = auditor.audit(3).await;
    assert!(
        matches!(&refused, Err(LockError::Held { key, .. }) if key == "audit:3"),
        "{refused:?}"
    );
    let held_token = held.token();
    held.release().await.expect("release");

    let token = auditor.audit(3).await.expect("free key");
    let after = token_now("macro-async-trait-default", "audit:3").await;
    assert!(
        held_token < token && token < after,
        "{held_token} < {token} < {after}"
    );
}

static FAIR_ORDER: Mutex<Vec<u32>> = Mutex::new(Vec::new());

#[distributed_lock(
    key = "payout",
    ttl = "30s",
    wait = "20s",
    fair = true,
    backend = "macro-fair"
)]
async fn fair_payout(turn: u32) -> Result<(), LockError> {
    FAIR_ORDER.lock().expect("order").push(turn);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_true_queues_callers_and_serves_them_in_arrival_order() {
    let backend = MemoryBackend::new();
    registry().register("macro-fair", backend.clone());
    let key = LockKey::new("payout").expect("key");
    let held = LockOptions::new(Duration::from_secs(30))
        .backend("macro-fair")
        .acquire(&key)
        .await
        .expect("free key");
    let mut calls = Vec::new();
    for turn in 0..4 {
        calls.push(tokio::spawn(fair_payout(turn)));
        timeout(PATIENCE, async {
            while backend.queued_waiters(&key) <= turn as usize {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await
        .expect("the call queues behind the holder");
    }
    held.release().await.expect("release");
    for call in calls {
        timeout(PATIENCE, call)
            .await
            .expect("served")
            .expect("task")
            .expect("the fair call runs");
    }
    assert_eq!(*FAIR_ORDER.lock().expect("order"), vec![0, 1, 2, 3]);
}

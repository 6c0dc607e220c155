//! The conformance suite every backend runs unchanged.
//!
//! A backend's test file provides `async fn backend() -> Arc<dyn Backend>`
//! (a real server or real storage, never a fake) and instantiates the suite:
//!
//! ```ignore
//! mod conformance;
//! mod support; // shared test helpers the suite uses
//! conformance::suite!(backend);
//! ```
//!
//! Every test uses fresh random keys, so the suite can run in parallel and
//! repeatedly against one server.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use dlock::backend::OwnerId;
use dlock::{Backend, LockError, LockKey, LockOptions, LostReason};
use tokio::sync::Barrier;
use tokio::time::{Instant, sleep, timeout};

use crate::support::within;

/// Instantiates one `#[tokio::test]` per property for the backend made by
/// `$make` (an async fn returning `Arc<dyn Backend>`).
macro_rules! suite {
    ($make:path) => {
        $crate::conformance::suite!(@tests $make;
            twenty_concurrent_acquirers_exactly_one_wins,
            tokens_strictly_increase,
            tokens_strictly_increase_across_keys_and_backend_instances,
            release_by_non_owner_fails_and_changes_nothing,
            extend_by_non_owner_fails_and_changes_nothing,
            expiry_frees_the_key,
            renewal_keeps_a_lease_alive_past_several_ttls,
            lost_signal_fires_when_the_lease_is_taken_away,
            lost_signal_fires_when_the_ttl_runs_out_without_renewal,
            waiter_wakes_on_release_not_by_polling,
            waiter_times_out_with_timeout_error,
            min_hold_keeps_the_key_after_early_release,
            opposite_order_multi_key_acquirers_never_deadlock,
            multi_key_failure_gives_back_taken_keys,
            dropping_an_unreleased_lease_frees_the_key,
            cancelled_waiter_leaves_the_key_free,
            acquisitions_abandoned_mid_attempt_leave_their_keys_free,
            a_release_abandoned_half_way_still_frees_the_key,
            a_woken_notice_dropped_unanswered_passes_the_wake_up_on,
            a_woken_waiter_cancelled_before_its_attempt_does_not_swallow_the_release,
            odd_keys_are_data_and_lock_exclusively,
            bad_keys_and_durations_are_errors,
        );
    };
    (@tests $make:path; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                $crate::conformance::$name($make().await).await;
            }
        )*
    };
}
pub(crate) use suite;

/// A fresh key no other test (or earlier run) uses.
pub fn fresh_key(label: &str) -> LockKey {
    let id = OwnerId::random().expect("random bytes");
    LockKey::new(format!("dlock-test:{label}:{id}")).expect("valid key")
}

fn options(ttl_ms: u64) -> LockOptions {
    LockOptions::new(Duration::from_millis(ttl_ms))
}

pub async fn twenty_concurrent_acquirers_exactly_one_wins(backend: Arc<dyn Backend>) {
    let key = fresh_key("race");
    let barrier = Arc::new(Barrier::new(20));
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (backend, key, barrier) = (backend.clone(), key.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let result = options(10_000).acquire_on(backend, key).await;
            // Hold any winning lease until every contender has tried.
            barrier.wait().await;
            result
        }));
    }
    let mut winners = Vec::new();
    for task in tasks {
        match task.await.expect("task") {
            Ok(lease) => winners.push(lease),
            Err(LockError::Held { .. }) => {}
            Err(other) => panic!("unexpected error: {other}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one of 20 acquirers must win");
    for lease in winners {
        lease.release().await.expect("release");
    }
}

pub async fn tokens_strictly_increase(backend: Arc<dyn Backend>) {
    let key = fresh_key("tokens");
    let mut last = None;
    for _ in 0..20 {
        let lease = options(10_000)
            .acquire_on(backend.clone(), &key)
            .await
            .expect("free key");
        if let Some(previous) = last {
            assert!(
                lease.token() > previous,
                "{} after {previous}",
                lease.token()
            );
        }
        last = Some(lease.token());
        lease.release().await.expect("release");
    }
}

pub async fn tokens_strictly_increase_across_keys_and_backend_instances(backend: Arc<dyn Backend>) {
    // Tokens of one key keep rising even when other keys are locked in
    // between and when a lease expires instead of being released.
    let key = fresh_key("tokens-mixed");
    let other = fresh_key("tokens-other");
    let first = options(10_000)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let first_token = first.token();
    first.release().await.expect("release");
    let unrelated = options(10_000)
        .acquire_on(backend.clone(), &other)
        .await
        .expect("free");
    unrelated.release().await.expect("release");
    let expiring = options(100)
        .renew(false)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    assert!(expiring.token() > first_token);
    let expired_token = expiring.token();
    within(10, "expiry", expiring.lost()).await;
    let next = options(10_000)
        .wait(Duration::from_secs(5))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free after expiry");
    assert!(next.token() > expired_token);
    next.release().await.expect("release");
    drop(expiring);
}

pub async fn release_by_non_owner_fails_and_changes_nothing(backend: Arc<dyn Backend>) {
    let key = fresh_key("non-owner-release");
    let lease = options(10_000)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let stranger = OwnerId::random().expect("random");
    let released = backend
        .release(&key, &stranger)
        .await
        .expect("backend answers");
    assert_eq!(
        released,
        dlock::backend::ReleaseOutcome::NotOwner,
        "a non-owner's release must be refused"
    );
    let contender = options(10_000).acquire_on(backend.clone(), &key).await;
    assert!(
        matches!(contender, Err(LockError::Held { .. })),
        "the key must still be held after a refused release"
    );
    assert!(lease.check().is_ok());
    lease
        .release()
        .await
        .expect("the owner's release still works");
}

pub async fn extend_by_non_owner_fails_and_changes_nothing(backend: Arc<dyn Backend>) {
    let key = fresh_key("non-owner-extend");
    let lease = options(10_000)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let stranger = OwnerId::random().expect("random");
    let extended = backend
        .extend(&key, &stranger, Duration::from_secs(60))
        .await
        .expect("backend answers");
    assert!(!extended, "a non-owner's extend must be refused");
    lease
        .release()
        .await
        .expect("the owner's release still works");
    let again = options(10_000).acquire_on(backend.clone(), &key).await;
    assert!(again.is_ok(), "the key is free after the owner released it");
}

pub async fn expiry_frees_the_key(backend: Arc<dyn Backend>) {
    let key = fresh_key("expiry");
    let holder = options(300)
        .renew(false)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let next = options(10_000)
        .wait(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the key must be free once the holder's ttl ran out");
    assert!(next.token() > holder.token());
    assert!(
        holder.is_lost(),
        "the expired holder must know it lost the lease"
    );
    assert!(matches!(
        holder.release().await,
        Err(LockError::LeaseLost { .. })
    ));
    assert!(
        next.check().is_ok(),
        "the expired holder's release must not touch the new lease"
    );
    next.release().await.expect("release");
}

pub async fn renewal_keeps_a_lease_alive_past_several_ttls(backend: Arc<dyn Backend>) {
    let key = fresh_key("renewal");
    let lease = options(300)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    sleep(Duration::from_millis(1500)).await;
    assert!(lease.check().is_ok(), "a renewed lease must survive 5 ttls");
    let contender = options(300).acquire_on(backend.clone(), &key).await;
    assert!(matches!(contender, Err(LockError::Held { .. })));
    lease.release().await.expect("release");
}

pub async fn lost_signal_fires_when_the_lease_is_taken_away(backend: Arc<dyn Backend>) {
    let key = fresh_key("taken-away");
    let lease = options(300)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    assert!(backend.force_release(&key).await.expect("force release"));
    let usurper = options(10_000)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("freed");
    let lost = within(10, "the lost signal", lease.lost()).await;
    assert!(
        matches!(
            lost,
            LockError::LeaseLost {
                // A store that can only break a lock by ending the holder's
                // session (PostgreSQL) reports that instead.
                reason: LostReason::NotOwner | LostReason::SessionEnded(_),
                ..
            }
        ),
        "unexpected: {lost}"
    );
    assert!(matches!(
        lease.release().await,
        Err(LockError::LeaseLost { .. })
    ));
    assert!(usurper.check().is_ok());
    let third = options(10_000).acquire_on(backend.clone(), &key).await;
    assert!(
        matches!(third, Err(LockError::Held { .. })),
        "the lost holder's release must not free the usurper's lock"
    );
    usurper.release().await.expect("release");
}

pub async fn lost_signal_fires_when_the_ttl_runs_out_without_renewal(backend: Arc<dyn Backend>) {
    let key = fresh_key("ttl-runs-out");
    let lease = options(200)
        .renew(false)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let signal = lease.lost_signal();
    let lost = within(10, "the lost signal", signal.lost()).await;
    assert!(
        matches!(
            lost,
            LockError::LeaseLost {
                reason: LostReason::Expired,
                ..
            }
        ),
        "unexpected: {lost}"
    );
    assert!(lease.check().is_err());
}

pub async fn waiter_wakes_on_release_not_by_polling(backend: Arc<dyn Backend>) {
    let key = fresh_key("wake");
    let holder = options(30_000)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let counting = crate::support::CountingBackend::new(backend.clone());
    let waiter = {
        let (counting, key) = (counting.clone(), key.clone());
        tokio::spawn(async move {
            options(30_000)
                .wait(Duration::from_secs(20))
                .acquire_on(counting, key)
                .await
        })
    };
    // Long enough that a polling waiter (fallback every second) would try
    // several more times than one woken by the release.
    sleep(Duration::from_millis(2500)).await;
    let released_at = Instant::now();
    holder.release().await.expect("release");
    let lease = within(15, "the waiter", waiter)
        .await
        .expect("task")
        .expect("woken waiter acquires");
    eprintln!("handoff took {:?}", released_at.elapsed());
    let attempts = counting.attempts();
    // First try, the retry after subscribing, the retry after the wake-up.
    assert!(
        attempts <= 3,
        "the waiter tried {attempts} times: it polled instead of waking on the release"
    );
    lease.release().await.expect("release");
}

pub async fn waiter_times_out_with_timeout_error(backend: Arc<dyn Backend>) {
    let key = fresh_key("timeout");
    let holder = options(30_000)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let waited = options(30_000)
        .wait(Duration::from_millis(300))
        .acquire_on(backend.clone(), &key)
        .await;
    match waited {
        Err(LockError::Timeout { key: k, .. }) => assert_eq!(k, key.to_string()),
        other => panic!("expected a timeout, got {other:?}"),
    }
    holder.release().await.expect("release");
}

pub async fn min_hold_keeps_the_key_after_early_release(backend: Arc<dyn Backend>) {
    let key = fresh_key("min-hold");
    let lease = options(10_000)
        .min_hold(Duration::from_millis(800))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let token = lease.token();
    lease
        .release()
        .await
        .expect("release within the minimum hold");
    let early = options(10_000).acquire_on(backend.clone(), &key).await;
    assert!(
        matches!(early, Err(LockError::Held { .. })),
        "the key must stay held until the minimum hold is over"
    );
    let later = options(10_000)
        .wait(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free once the minimum hold is over");
    assert!(later.token() > token);
    later.release().await.expect("release");
}

pub async fn opposite_order_multi_key_acquirers_never_deadlock(backend: Arc<dyn Backend>) {
    let a = fresh_key("pair-a");
    let b = fresh_key("pair-b");
    let run = |first: LockKey, second: LockKey| {
        let backend = backend.clone();
        tokio::spawn(async move {
            for _ in 0..20 {
                let set = options(10_000)
                    .wait(Duration::from_secs(20))
                    .acquire_many_on(backend.clone(), [&first, &second])
                    .await
                    .expect("both keys");
                let tokens = set.tokens();
                assert_eq!(tokens.len(), 2);
                assert_eq!(set.token_of(&first), tokens.get(0));
                assert_eq!(set.token_of(&second), tokens.get(1));
                tokio::task::yield_now().await;
                set.release().await.expect("release");
            }
        })
    };
    let ab = run(a.clone(), b.clone());
    let ba = run(b.clone(), a.clone());
    within(60, "opposite-order lockers (deadlock?)", async {
        ab.await.expect("a,b task");
        ba.await.expect("b,a task");
    })
    .await;
}

pub async fn multi_key_failure_gives_back_taken_keys(backend: Arc<dyn Backend>) {
    // Sorted order takes `…a…` before `…b…`; `b` is held, so `a` must be
    // given back when the set fails.
    let id = OwnerId::random().expect("random");
    let a = LockKey::new(format!("dlock-test:give-back:{id}:a")).expect("key");
    let b = LockKey::new(format!("dlock-test:give-back:{id}:b")).expect("key");
    let holder = options(10_000)
        .acquire_on(backend.clone(), &b)
        .await
        .expect("free");
    let set = options(10_000)
        .acquire_many_on(backend.clone(), [&b, &a])
        .await;
    match set {
        Err(LockError::Held { key }) => assert_eq!(key, b.to_string()),
        other => panic!("expected b held, got {other:?}"),
    }
    let a_again = options(10_000).acquire_on(backend.clone(), &a).await;
    assert!(a_again.is_ok(), "a must have been given back");
    holder.release().await.expect("release");
}

pub async fn dropping_an_unreleased_lease_frees_the_key(backend: Arc<dyn Backend>) {
    let key = fresh_key("drop");
    {
        let _lease = options(60_000)
            .acquire_on(backend.clone(), &key)
            .await
            .expect("free");
        // Dropped here without release, as on an early return or `?`.
    }
    let after_drop = options(60_000)
        .wait(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a dropped lease must free the key long before its 60s ttl");
    drop(after_drop);
    // A panicking holder frees it too.
    let (backend2, key2) = (backend.clone(), key.clone());
    let panicked = tokio::spawn(async move {
        let _lease = options(60_000)
            .wait(Duration::from_secs(10))
            .acquire_on(backend2, key2)
            .await
            .expect("free");
        panic!("the holder panics while holding the lease");
    })
    .await;
    assert!(panicked.is_err());
    let after_panic = options(60_000)
        .wait(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a panicking holder's lease must be freed");
    after_panic.release().await.expect("release");
}

pub async fn cancelled_waiter_leaves_the_key_free(backend: Arc<dyn Backend>) {
    let key = fresh_key("cancelled");
    let holder = options(60_000)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let waiting_options = options(60_000).wait(Duration::from_secs(30));
    let waiting = waiting_options.acquire_on(backend.clone(), &key);
    // Cancel the waiter mid-wait.
    assert!(timeout(Duration::from_millis(200), waiting).await.is_err());
    holder.release().await.expect("release");
    let next = options(60_000).acquire_on(backend.clone(), &key).await;
    assert!(next.is_ok(), "a cancelled waiter must not keep the key");
}

pub async fn odd_keys_are_data_and_lock_exclusively(backend: Arc<dyn Backend>) {
    let id = OwnerId::random().expect("random");
    let odd = [
        "quote\"s and 'single' quotes",
        "new\nline\r\nand\ttab",
        "lua: redis.call('DEL', KEYS[1]) -- ]] [[",
        "glob * ? [a-z] \\ escape",
        "sql'; DROP TABLE locks; --",
        "ünïcödé 🔒 键",
        "../../../etc/passwd",
        "%00%2e%2E",
    ];
    for text in odd {
        let key = LockKey::new(format!("{text}:{id}")).expect("odd keys are valid keys");
        let lease = options(10_000)
            .acquire_on(backend.clone(), &key)
            .await
            .unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let second = options(10_000).acquire_on(backend.clone(), &key).await;
        assert!(
            matches!(second, Err(LockError::Held { .. })),
            "{text:?} must lock exclusively"
        );
        lease.release().await.expect("release");
    }
    // Keys that differ only in odd characters are different locks.
    let a = options(10_000)
        .acquire_on(backend.clone(), format!("a:b*{id}"))
        .await
        .expect("free");
    let b = options(10_000)
        .acquire_on(backend.clone(), format!("a:b?{id}"))
        .await
        .expect("a different key");
    a.release().await.expect("release");
    b.release().await.expect("release");
}

pub async fn bad_keys_and_durations_are_errors(backend: Arc<dyn Backend>) {
    let invalid_key =
        |r: Result<dlock::Lease, LockError>| matches!(r, Err(LockError::InvalidKey { .. }));
    assert!(invalid_key(
        options(1000).acquire_on(backend.clone(), "").await
    ));
    let huge = "k".repeat(1024 * 1024);
    assert!(invalid_key(
        options(1000).acquire_on(backend.clone(), huge).await
    ));
    assert!(invalid_key(
        options(1000).acquire_on(backend.clone(), "nul\0byte").await
    ));
    let bad_option = |r: Result<dlock::Lease, LockError>, name: &str| matches!(r, Err(LockError::InvalidOption { option, .. }) if option == name);
    let key = fresh_key("bad-options");
    assert!(bad_option(
        options(0).acquire_on(backend.clone(), &key).await,
        "ttl"
    ));
    assert!(bad_option(
        LockOptions::new(Duration::from_secs(40 * 24 * 3600))
            .acquire_on(backend.clone(), &key)
            .await,
        "ttl"
    ));
    assert!(bad_option(
        options(1000)
            .min_hold(Duration::from_secs(2))
            .acquire_on(backend.clone(), &key)
            .await,
        "min_hold"
    ));
    assert!(bad_option(
        options(1000)
            .wait(Duration::from_secs(40 * 24 * 3600))
            .acquire_on(backend.clone(), &key)
            .await,
        "wait"
    ));
    // None of the refused calls took the key.
    let lease = options(1000)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    lease.release().await.expect("release");
}

pub async fn acquisitions_abandoned_mid_attempt_leave_their_keys_free(backend: Arc<dyn Backend>) {
    let keys: Vec<LockKey> = (0..20).map(|_| fresh_key("abandoned")).collect();
    for key in &keys {
        // A caller that gives up at once, as a zero timeout, a `select!` or
        // an aborted request does: the attempt may well reach the store.
        let abandoned = timeout(
            Duration::ZERO,
            options(60_000).acquire_on(backend.clone(), key),
        )
        .await;
        // A backend that answers in the first poll hands out a lease,
        // which is dropped here like any unreleased lease.
        drop(abandoned);
    }
    for key in &keys {
        let next = options(60_000)
            .wait(Duration::from_secs(10))
            .acquire_on(backend.clone(), key)
            .await
            .expect("an abandoned acquisition must not keep its key for the 60s ttl");
        next.release().await.expect("release");
    }
}

pub async fn a_release_abandoned_half_way_still_frees_the_key(backend: Arc<dyn Backend>) {
    let key = fresh_key("abandoned-release");
    let lease = options(60_000)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let _ = timeout(Duration::ZERO, lease.release()).await;
    let next = options(60_000)
        .wait(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a release given up half-way must still free the key before its 60s ttl");
    next.release().await.expect("release");
}

pub async fn a_woken_notice_dropped_unanswered_passes_the_wake_up_on(backend: Arc<dyn Backend>) {
    let key = fresh_key("pass-on");
    let holder = options(60_000)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let first = backend.subscribe(&key).await.expect("subscribe");
    let mut second = backend.subscribe(&key).await.expect("subscribe");
    holder.release().await.expect("release");
    let mut first = first;
    within(10, "the first notice", &mut first).await;
    // Its waiter gives up before trying the key: the release must reach
    // the other waiter all the same.
    drop(first);
    within(
        10,
        "the second notice after the first woken waiter gave up",
        &mut second,
    )
    .await;
    second.answered();
}

pub async fn a_woken_waiter_cancelled_before_its_attempt_does_not_swallow_the_release(
    backend: Arc<dyn Backend>,
) {
    let key = fresh_key("swallowed");
    let holder = options(60_000)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    // The first waiter: woken first, then stuck in its attempt and cancelled.
    let stuck = crate::support::CountingBackend::new(backend.clone());
    let first = crate::support::spawn_waiter(stuck.clone(), &key, 60, 30);
    within(10, "the first waiter to start waiting", async {
        while stuck.attempts() < 2 {
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // The second waiter waits 8s: less than a nap without a wake-up (the
    // holder's ttl is 60s), so only the release can give it the key.
    let patient = crate::support::CountingBackend::new(backend.clone());
    let second = crate::support::spawn_waiter(patient.clone(), &key, 60, 8);
    within(10, "the second waiter to start waiting", async {
        while patient.attempts() < 2 {
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    stuck.hang_next_attempt();
    holder.release().await.expect("release");
    within(10, "the first waiter to be woken", async {
        while stuck.attempts() < 3 {
            sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    first.abort();
    let lease = within(15, "the second waiter", second)
        .await
        .expect("task")
        .expect("the release must reach the second waiter when the first gives up");
    lease.release().await.expect("release");
}

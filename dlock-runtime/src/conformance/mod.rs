//! The conformance suite: the properties every [`Backend`] must keep, as
//! one test each, run against a real store. Every in-tree backend runs it
//! unchanged; a backend in another crate runs it the same way (enable this
//! crate's `conformance` feature in its dev-dependencies):
//!
//! ```ignore
//! // tests/conformance.rs of the crate that implements the backend
//! async fn backend() -> Arc<dyn dlock::Backend> {
//!     std::sync::Arc::new(MyBackend::connect("…").await.expect("the test server"))
//! }
//! dlock::conformance_suite!(backend);
//! ```
//!
//! `backend` is called once per backend a property takes. Most take one; a
//! property about several processes (tokens that rise across them, a key
//! held through one and refused through another) takes two instances (its
//! signature says so: `(backend, another)`), so each call must connect a new instance to the *same* store, as another
//! process would: the same server, the same directory, or, for a store in
//! the process's memory, a clone of one shared instance.
//!
//! [`conformance_suite!`](crate::conformance_suite) makes one `#[test]` per
//! property, each on a multi-threaded runtime of its own, named after it (so
//! `cargo test tokens_strictly_increase` runs one). [`check_all`] runs them
//! all in one go, for a doctest or a quick check. Every property uses fresh
//! random keys ([`fresh_key`]), so the suite runs in parallel and repeatedly
//! against one server.
//!
//! The properties are written as plain async functions that panic on a
//! broken promise: read one to see exactly what a backend is held to. The
//! rules behind them are on the [`Backend`] trait itself.
//!
//! Not a stable API: properties are added as the contract grows. The
//! properties stay in this one file, one function each, so the whole
//! contract reads from top to bottom; it runs past a thousand lines because
//! each property spells out its own setup rather than hiding it in shared
//! steps. The helpers they share (hang guards, fresh keys, a counting
//! backend) and the runners' plumbing live in a submodule, re-exported
//! here.

#![allow(clippy::missing_panics_doc)]

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Barrier;
use tokio::time::{Instant, sleep, timeout};

use crate::backend::{AcquireRequest, Attempt, Backend, OwnerId};
use crate::{LockError, LockKey, LockOptions, LostReason};

/// What a store's clock may round a lease's expiry by (to its
/// millisecond): a key can be free this much before a ttl after the
/// request was sent.
const ROUNDING: Duration = Duration::from_millis(5);

mod helpers;

pub use helpers::{
    BoxedRun, CountingBackend, One, Property, Two, attempt_as, fresh_key, poll_then_drop,
    release_as, spawn_waiter, start, within,
};

/// Makes one `#[test]` per conformance property for the backend that the
/// async fn `$make` (returning `Arc<dyn Backend>`) connects, called once
/// per instance a property takes, each on the same store. See the
/// [module docs](crate::conformance).
#[macro_export]
macro_rules! conformance_suite {
    ($make:path) => {
        $crate::conformance_suite!(@list tests [$make]);
    };
    // The one list of properties, handed to the rule named by `$what`.
    (@list $what:ident [$($arg:tt)*]) => {
        $crate::conformance_suite!(@$what [$($arg)*]
            twenty_concurrent_acquirers_exactly_one_wins,
            tokens_strictly_increase,
            tokens_strictly_increase_across_keys_and_backend_instances,
            release_by_non_owner_fails_and_changes_nothing,
            extend_by_non_owner_fails_and_changes_nothing,
            extend_of_an_ended_lease_is_refused_and_takes_nothing,
            extend_many_answers_each_lease_on_its_own,
            extend_many_renews_each_lease_for_its_own_ttl_in_a_long_batch,
            tokens_keep_rising_after_a_force_release,
            a_force_release_naming_a_holder_that_changed_breaks_nothing,
            a_force_release_racing_its_holder_breaks_only_the_lease_it_names,
            a_force_release_naming_a_permit_breaks_only_that_permit,
            expiry_frees_the_key,
            renewal_keeps_a_lease_alive_past_several_ttls,
            lost_signal_fires_when_the_lease_is_taken_away,
            lost_signal_fires_when_the_ttl_runs_out_without_renewal,
            waiter_wakes_on_release_not_by_polling,
            waiter_times_out_with_timeout_error,
            min_hold_keeps_the_key_after_early_release,
            opposite_order_multi_key_acquirers_never_deadlock,
            multi_key_failure_releases_taken_keys,
            dropping_an_unreleased_lease_frees_the_key,
            cancelled_waiter_leaves_the_key_free,
            odd_keys_are_data_and_lock_exclusively,
            bad_keys_and_durations_are_errors,
            acquisitions_abandoned_mid_attempt_leave_their_keys_free,
            a_release_abandoned_half_way_still_frees_the_key,
            a_woken_notice_dropped_unanswered_passes_the_wake_up_on,
            a_release_racing_new_waiters_always_wakes_them,
            a_woken_waiter_cancelled_before_its_attempt_does_not_swallow_the_release,
            a_retry_by_the_owner_that_holds_the_key_counts_as_acquired,
            a_retry_by_the_owner_restarts_the_lease_with_its_ttl,
            an_extend_to_a_shorter_ttl_frees_the_key_at_the_new_deadline,
            a_try_acquire_dropped_half_way_leaves_nothing_stuck,
            holder_reads_the_live_holders_token_and_identity,
            holder_never_pairs_a_holder_with_an_earlier_leases_identity,
            holder_is_none_once_the_lease_expires,
            a_holder_watch_wakes_on_an_identity_acquisition_and_on_release,
            every_acquisition_records_its_holders_host_pid_and_label,
            a_refused_caller_is_told_who_holds_the_key,
            held_lists_exactly_the_held_keys_under_a_prefix,
            fair_waiters_are_served_in_arrival_order_with_rising_tokens,
            fair_a_cancelled_waiter_in_the_middle_does_not_hold_up_the_queue,
            fair_an_expired_entry_is_skipped_by_the_release,
            fair_a_handoff_to_a_waiter_that_never_listens_comes_back_within_its_entry_ttl,
            fair_a_handoff_that_arrived_after_its_waiter_gave_up_is_passed_on,
            fair_no_waiter_starves_among_sixteen_looping_tasks,
            fair_a_handed_over_lease_renews_and_hands_on_when_dropped,
            fair_a_handed_over_lease_without_renewal_is_kept_for_its_whole_ttl,
            fair_a_handed_over_lease_with_a_short_ttl_is_not_spent_on_arrival,
            permits_at_most_n_hold_at_once_in_distinct_slots,
            readers_overlap_and_a_writer_overlaps_no_one,
            a_waiting_writer_is_not_starved_by_a_stream_of_readers,
            a_waiting_fair_writer_is_not_starved_by_another_processs_readers,
            tokens_fence_stale_writers_and_never_current_readers,
            permit_tokens_rise_per_slot,
            a_crashed_permit_holder_frees_its_slot_after_the_ttl,
            a_cancelled_writer_leaves_no_mark_and_a_cancelled_permit_no_slot,
            a_writer_that_does_not_wait_leaves_no_mark,
        );
    };
    (@tests [$make:path] $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::conformance::block_on(async {
                    $crate::conformance::start($crate::conformance::$name, &$make)
                        .await
                        .await;
                });
            }
        )*
    };
    (@spawn [$make:ident, $tasks:ident] $($name:ident),* $(,)?) => {
        $(
            $tasks.push((
                stringify!($name),
                tokio::spawn($crate::conformance::start($crate::conformance::$name, &$make).await),
            ));
        )*
    };
}

/// Runs `future` to completion on a fresh multi-threaded runtime (four
/// workers, timers and I/O on), as each property of the suite runs.
pub fn block_on<F: Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a runtime for the conformance suite")
        .block_on(future)
}

/// Runs every property of the suite at once, each as a task of the
/// current (multi-threaded) runtime on backends of its own made by `make`
/// (one, or two instances on one store, as the module docs say),
/// and panics naming every property that broke. For a doctest or a quick
/// check; a crate's own tests should use
/// [`conformance_suite!`](crate::conformance_suite), which makes each
/// property a test of its own.
pub async fn check_all<F, Fut>(make: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<dyn Backend>>,
{
    let mut tasks: Vec<(&'static str, tokio::task::JoinHandle<()>)> = Vec::new();
    crate::conformance_suite!(@list spawn [make, tasks]);
    let mut broken = Vec::new();
    for (name, task) in tasks {
        if task.await.is_err() {
            broken.push(name);
        }
    }
    assert!(
        broken.is_empty(),
        "the backend breaks these conformance properties: {}",
        broken.join(", ")
    );
}

fn options(ttl_ms: u64) -> LockOptions {
    LockOptions::new(Duration::from_millis(ttl_ms))
}

/// Takes `key` through the core for `ttl_ms`, waiting up to `wait` for it,
/// or panics saying `why`.
async fn take(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    ttl_ms: u64,
    wait: Duration,
    why: &str,
) -> crate::Lease {
    options(ttl_ms)
        .wait(wait)
        .acquire_on(backend.clone(), key)
        .await
        .expect(why)
}

/// Takes `key` as [`take`] does and lets it go again: the key is free
/// (within `wait`), or this panics saying `why`.
async fn free_within(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    ttl_ms: u64,
    wait: Duration,
    why: &str,
) {
    take(backend, key, ttl_ms, wait, why)
        .await
        .release()
        .await
        .expect("release");
}

/// Twenty acquirers race for one key: exactly one wins, the others are told `Held`.
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

/// Each acquisition of a key gets a token strictly greater than every token before it.
pub async fn tokens_strictly_increase(backend: Arc<dyn Backend>) {
    let key = fresh_key("tokens");
    let mut last = None;
    for _ in 0..20 {
        let lease = take(&backend, &key, 10_000, Duration::ZERO, "free key").await;
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

/// Tokens keep rising for a key taken in turn through two instances of the backend on one store (as two processes share a server), with other keys locked in between and a lease that expires instead of being released; a key held through one instance is held for the other.
pub async fn tokens_strictly_increase_across_keys_and_backend_instances(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let key = fresh_key("tokens-mixed");
    let other = fresh_key("tokens-other");
    let instances = [&backend, &another, &backend, &another];
    let mut last = None;
    for (round, pair) in instances.windows(2).enumerate() {
        let (through, rival) = (pair[0], pair[1]);
        let lease = options(10_000)
            .wait(Duration::from_secs(5))
            .acquire_on(through.clone(), &key)
            .await
            .expect("free");
        if let Some(previous) = last {
            assert!(
                lease.token() > previous,
                "round {round}: token {} after {previous} through the other instance",
                lease.token()
            );
        }
        last = Some(lease.token());
        let refused = options(10_000).acquire_on(rival.clone(), &key).await;
        assert!(
            matches!(refused, Err(LockError::Held { .. })),
            "a key held through one instance must be held for the other, not {refused:?}"
        );
        lease.release().await.expect("release");
        let unrelated = options(10_000)
            .acquire_on(rival.clone(), &other)
            .await
            .expect("free");
        unrelated.release().await.expect("release");
    }
    let last = last.expect("three rounds");
    let expiring = options(100)
        .renew(false)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    assert!(expiring.token() > last);
    let expired_token = expiring.token();
    within(10, "expiry", expiring.lost()).await;
    let next = options(10_000)
        .wait(Duration::from_secs(5))
        .acquire_on(another.clone(), &key)
        .await
        .expect("free after expiry");
    assert!(
        next.token() > expired_token,
        "token {} through the other instance after the expired {expired_token}",
        next.token()
    );
    next.release().await.expect("release");
    drop(expiring);
}

/// A release by an owner that does not hold the key is refused (`NotOwner`) and leaves the holder's lease alone.
pub async fn release_by_non_owner_fails_and_changes_nothing(backend: Arc<dyn Backend>) {
    let key = fresh_key("non-owner-release");
    let lease = take(&backend, &key, 10_000, Duration::ZERO, "free").await;
    let stranger = OwnerId::random().expect("random");
    let released = backend
        .release(&crate::backend::ReleaseRequest::new(&key, &stranger))
        .await
        .expect("backend answers");
    assert_eq!(
        released,
        crate::backend::ReleaseOutcome::NotOwner,
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

/// An extension by an owner that does not hold the key is refused and leaves the holder's lease alone.
pub async fn extend_by_non_owner_fails_and_changes_nothing(backend: Arc<dyn Backend>) {
    let key = fresh_key("non-owner-extend");
    let lease = take(&backend, &key, 10_000, Duration::ZERO, "free").await;
    let stranger = OwnerId::random().expect("random");
    let extended = backend
        .extend(&crate::backend::Renewal::new(
            &key,
            &stranger,
            Duration::from_secs(60),
        ))
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

/// An `extend` of a lease that ended (released, broken by an
/// administrator, or run out, with or without another holder since) is
/// refused with `Ok(false)` and takes nothing: the key stays free.
pub async fn extend_of_an_ended_lease_is_refused_and_takes_nothing(backend: Arc<dyn Backend>) {
    use crate::backend::{Attempt, ReleaseOutcome, Renewal};
    let take = |key: &LockKey, owner: &OwnerId, ttl: Duration| {
        let (backend, key, owner) = (backend.clone(), key.clone(), *owner);
        async move {
            let attempt = attempt_as(&backend, &key, &owner, ttl).await;
            assert!(
                matches!(attempt, Attempt::Acquired(_)),
                "{key} must be free"
            );
        }
    };
    let ended = |how: &'static str| (fresh_key(how), OwnerId::random().expect("random"));
    let released = ended("extend-released");
    take(&released.0, &released.1, Duration::from_secs(10)).await;
    assert_eq!(
        release_as(&backend, &released.0, &released.1).await,
        ReleaseOutcome::Released
    );
    let broken = ended("extend-broken");
    take(&broken.0, &broken.1, Duration::from_secs(10)).await;
    assert!(
        backend
            .force_release(&broken.0)
            .await
            .expect("force release")
    );
    let expired = ended("extend-expired");
    take(&expired.0, &expired.1, Duration::from_millis(200)).await;
    let taken_over = ended("extend-taken-over");
    take(&taken_over.0, &taken_over.1, Duration::from_millis(200)).await;
    // Someone else holds the run-out lease's key, then lets it go.
    let next = options(10_000)
        .wait(Duration::from_secs(5))
        .acquire_on(backend.clone(), &taken_over.0)
        .await
        .expect("free once the ttl ran out");
    next.release().await.expect("release");
    sleep(Duration::from_millis(400) + backend.expiry_slack()).await;
    for (key, owner) in [&released, &broken, &expired, &taken_over] {
        let extended = backend
            .extend(&Renewal::new(key, owner, Duration::from_secs(60)))
            .await
            .expect("backend answers");
        assert!(
            !extended,
            "an extend of an ended lease on {key} must be refused"
        );
        let after = options(10_000)
            .wait(Duration::from_secs(5))
            .acquire_on(backend.clone(), key)
            .await
            .unwrap_or_else(|e| panic!("a refused extend must leave {key} free: {e}"));
        after.release().await.expect("release");
    }
}

/// `extend_many` answers each lease on its own: in one batch, held leases
/// are renewed and answered `true`, while a lease that ended and a lease
/// asked for by an owner that does not hold its key are answered `false`
/// and change nothing, wherever they stand in the batch.
pub async fn extend_many_answers_each_lease_on_its_own(backend: Arc<dyn Backend>) {
    use crate::backend::{Attempt, ReleaseOutcome, Renewal};
    const INITIAL_MS: u64 = 2_000;
    let keys: Vec<LockKey> = (0..4).map(|_| fresh_key("batch")).collect();
    let owners: Vec<OwnerId> = (0..4).map(|_| OwnerId::random().expect("random")).collect();
    // 0 and 3 held for 2 s (the batch renews them), 1 released, 2 held by
    // its owner but renewed in the batch by a stranger. The 2 s are
    // counted from before the first request; a stall of that long before
    // the batch lands would end them unrenewed.
    let taken = Instant::now();
    for (i, (key, owner)) in keys.iter().zip(&owners).enumerate() {
        let ttl = Duration::from_millis(if i == 2 { 10_000 } else { INITIAL_MS });
        let attempt = attempt_as(&backend, key, owner, ttl).await;
        assert!(
            matches!(attempt, Attempt::Acquired(_)),
            "{key} must be free"
        );
    }
    assert_eq!(
        release_as(&backend, &keys[1], &owners[1]).await,
        ReleaseOutcome::Released
    );
    let stranger = OwnerId::random().expect("random");
    let ttl = Duration::from_secs(10);
    let batch = [
        Renewal::new(&keys[0], &owners[0], ttl),
        Renewal::new(&keys[1], &owners[1], ttl),
        Renewal::new(&keys[2], &stranger, ttl),
        Renewal::new(&keys[3], &owners[3], ttl),
    ];
    let answers: Vec<bool> = backend
        .extend_many(&batch)
        .await
        .into_iter()
        .map(|answer| answer.expect("backend answers"))
        .collect();
    assert_eq!(
        answers,
        [true, false, false, true],
        "one answer per lease: held, ended, not the owner's, held"
    );
    // Led by a lease that ended.
    let answers: Vec<bool> = backend
        .extend_many(&[batch[1], batch[3]])
        .await
        .into_iter()
        .map(|answer| answer.expect("backend answers"))
        .collect();
    assert_eq!(answers, [false, true], "one answer per lease: ended, held");
    // Past the 2 s the leases were taken for: the batch renewed 0 and 3.
    tokio::time::sleep_until(taken + Duration::from_millis(INITIAL_MS + 500)).await;
    for i in [0, 2, 3] {
        let contender = options(10_000).acquire_on(backend.clone(), &keys[i]).await;
        assert!(
            matches!(contender, Err(LockError::Held { .. })),
            "lease {i} of the batch must still be held"
        );
    }
    let free = take(
        &backend,
        &keys[1],
        10_000,
        Duration::ZERO,
        "a lease that ended must stay ended after the batch",
    )
    .await;
    free.release().await.expect("release");
    for i in [0, 2, 3] {
        assert_eq!(
            release_as(&backend, &keys[i], &owners[i]).await,
            ReleaseOutcome::Released
        );
    }
}

/// A batch renews each lease for its own ttl, however long the batch (the
/// core's renewal sends up to a thousand leases of mixed ttls at once):
/// here eight leases, renewed alternately for 10 s and 300 ms.
pub async fn extend_many_renews_each_lease_for_its_own_ttl_in_a_long_batch(
    backend: Arc<dyn Backend>,
) {
    use crate::backend::{Attempt, ReleaseOutcome, Renewal};
    let keys: Vec<LockKey> = (0..8).map(|_| fresh_key("long-batch")).collect();
    let owners: Vec<OwnerId> = (0..8).map(|_| OwnerId::random().expect("random")).collect();
    // Counted from before the first request: a stall of up to the initial
    // 2 s before the batch lands still leaves every lease to renew.
    const INITIAL_MS: u64 = 2_000;
    let taken = Instant::now();
    for (key, owner) in keys.iter().zip(&owners) {
        let attempt = attempt_as(&backend, key, owner, Duration::from_millis(INITIAL_MS)).await;
        assert!(
            matches!(attempt, Attempt::Acquired(_)),
            "{key} must be free"
        );
    }
    let ttl = |i: usize| Duration::from_millis(if i.is_multiple_of(2) { 10_000 } else { 300 });
    let batch: Vec<Renewal<'_>> = (0..8)
        .map(|i| Renewal::new(&keys[i], &owners[i], ttl(i)))
        .collect();
    let answers: Vec<bool> = backend
        .extend_many(&batch)
        .await
        .into_iter()
        .map(|answer| answer.expect("backend answers"))
        .collect();
    assert_eq!(answers, [true; 8], "every lease of the batch is held");
    // Past the 2 s the leases were taken for and the 300 ms of the odd
    // ones, and past the time the store may keep an unrenewed lease longer
    // (its `expiry_slack`: etcd's whole-second leases, freed at the
    // leader's next sweep): the even ones were renewed for 10 s, the odd
    // ones ended.
    tokio::time::sleep_until(
        taken + Duration::from_millis(INITIAL_MS + 500) + backend.expiry_slack(),
    )
    .await;
    for (i, key) in keys.iter().enumerate() {
        let contender = options(10_000).acquire_on(backend.clone(), key).await;
        match (i.is_multiple_of(2), contender) {
            (true, Err(LockError::Held { .. })) => {}
            (true, other) => panic!("lease {i}, renewed for 10 s, must still be held: {other:?}"),
            (false, Ok(lease)) => lease.release().await.expect("release"),
            (false, Err(err)) => panic!("lease {i}, renewed for 300 ms, must have ended: {err}"),
        }
    }
    for i in (0..8).step_by(2) {
        assert_eq!(
            release_as(&backend, &keys[i], &owners[i]).await,
            ReleaseOutcome::Released
        );
    }
}

/// Breaking a lock by force frees the key and nothing else: the next
/// holder's token is still above every token issued before.
pub async fn tokens_keep_rising_after_a_force_release(backend: Arc<dyn Backend>) {
    let key = fresh_key("forced-tokens");
    let broken = take(&backend, &key, 10_000, Duration::ZERO, "free").await;
    assert!(
        backend.force_release(&key).await.expect("backend answers"),
        "a held key must be broken"
    );
    let next = take(
        &backend,
        &key,
        10_000,
        Duration::from_secs(5),
        "free once broken",
    )
    .await;
    assert!(
        next.token() > broken.token(),
        "token {} after a force release, not above {}",
        next.token(),
        broken.token()
    );
    next.release().await.expect("release");
    drop(broken);
}

/// A force release that names the holder it breaks
/// (`force_release_holding`, as an operator confirms a holder shown to
/// them) breaks only that lease. Through another instance (an
/// administrator's process): the holder is read, lets go and takes the key
/// again; naming the first lease then answers `HolderChanged` and breaks
/// nothing, the second lease keeps the key. Naming the second breaks it
/// (its holder is told), and naming it again answers `NotHeld`.
pub async fn a_force_release_naming_a_holder_that_changed_breaks_nothing(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    use crate::backend::ForceRelease;
    let key = fresh_key("forced-named");
    let first = take(&backend, &key, 10_000, Duration::ZERO, "free").await;
    let shown = another
        .holder(&key)
        .await
        .expect("backend answers")
        .expect("the key is held");
    assert_eq!(
        shown.token,
        Some(first.token()),
        "the holder read must name the lease's token"
    );
    first.release().await.expect("release");
    // Renewed every second: its holder is told soon once it is broken.
    let second = take(&backend, &key, 3_000, Duration::ZERO, "free again").await;
    let answer = another
        .force_release_holding(&key, &shown)
        .await
        .expect("backend answers");
    assert_eq!(
        answer,
        ForceRelease::HolderChanged,
        "a force release naming a lease that ended must find the holder changed"
    );
    let now = another
        .holder(&key)
        .await
        .expect("backend answers")
        .expect("the second lease must still hold the key");
    assert_eq!(now.token, Some(second.token()));
    assert!(
        second.check().is_ok(),
        "a force release naming another lease must not break this one"
    );
    let contender = options(10_000).acquire_on(another.clone(), &key).await;
    assert!(
        matches!(contender, Err(LockError::Held { .. })),
        "the second lease must still keep the key: {contender:?}"
    );

    let answer = another
        .force_release_holding(&key, &now)
        .await
        .expect("backend answers");
    assert_eq!(answer, ForceRelease::Released, "the named holder is broken");
    within(10, "the broken holder's lost signal", second.lost()).await;
    assert!(
        another
            .holder(&key)
            .await
            .expect("backend answers")
            .is_none(),
        "the key must be free once its named holder is broken"
    );
    let answer = another
        .force_release_holding(&key, &now)
        .await
        .expect("backend answers");
    assert_eq!(answer, ForceRelease::NotHeld, "nothing is left to break");
    drop(second);
}

/// A force release that names a lease breaks that lease or nothing, even
/// racing its holder: one instance takes the key and lets it go again in
/// a tight loop while another reads the holder and force-releases the
/// lease it read, over and over, as an operator answering `y` would. A
/// force release answered `Released` must have broken the lease it named
/// (whose own release then fails); one answered otherwise must have
/// broken nothing (the named lease's own release succeeds). A check and a
/// break in two steps fail this: the holder lets go between them and
/// takes the key again, and the break hits the next lease.
pub async fn a_force_release_racing_its_holder_breaks_only_the_lease_it_names(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    use crate::backend::{ForceRelease, ReleaseOutcome, ReleaseRequest};
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    const RACE: Duration = Duration::from_secs(3);
    let key = fresh_key("forced-race");
    let stop = Arc::new(AtomicBool::new(false));
    let holder = tokio::spawn({
        let (backend, key, stop) = (backend.clone(), key.clone(), Arc::clone(&stop));
        async move {
            // Each lease's token, and what its own release answered.
            let mut released: HashMap<u64, Result<ReleaseOutcome, String>> = HashMap::new();
            // Half the time let go at once and take the key again (the
            // race of a check and a break), half the time held for up to
            // as long as a force release takes (breaks that land).
            let holds = [1, 2, 5, 20, 50].map(Duration::from_millis).into_iter();
            let mut holds = holds.cycle();
            let began = Instant::now();
            while !stop.load(Ordering::SeqCst) {
                let tight = (began.elapsed().as_millis() / 500).is_multiple_of(2);
                let owner = OwnerId::random().expect("an owner id");
                let request = AcquireRequest::new(&key, &owner, Duration::from_secs(10));
                match backend.try_acquire(&request).await {
                    Ok(Attempt::Acquired(grant)) => {
                        if tight {
                            tokio::task::yield_now().await;
                        } else {
                            sleep(holds.next().unwrap_or_default()).await;
                        }
                        let outcome = backend
                            .release(&ReleaseRequest::new(&key, &owner))
                            .await
                            .map_err(|err| err.to_string());
                        released.insert(grant.token.get(), outcome);
                    }
                    // Broken a moment ago (a session that comes back, say).
                    Ok(_) | Err(_) => sleep(Duration::from_millis(5)).await,
                }
            }
            released
        }
    });
    let mut answers = Vec::new();
    let began = Instant::now();
    while began.elapsed() < RACE {
        // A store in this process answers without a pause: a pause here
        // lets the holder's task run, and keeps this loop from taking a
        // whole core from the properties that run beside it.
        sleep(Duration::from_millis(1)).await;
        let shown = match another.holder(&key).await {
            Ok(Some(shown)) => shown,
            Ok(None) => continue,
            Err(err) => panic!("the holder read failed: {err}"),
        };
        let Some(token) = shown.token else { continue };
        let answer = another
            .force_release_holding(&key, &shown)
            .await
            .expect("backend answers");
        answers.push((token.get(), answer));
    }
    stop.store(true, Ordering::SeqCst);
    let released = within(30, "the holder's loop", holder)
        .await
        .expect("the holder's loop");
    let broken = answers
        .iter()
        .filter(|(_, answer)| *answer == ForceRelease::Released)
        .count();
    eprintln!(
        "{} force releases raced {} leases; {broken} answered released",
        answers.len(),
        released.len()
    );
    for (token, answer) in &answers {
        // A lease broken before its acquisition's answer reached its
        // holder: the holder never knew it, and has nothing to tell.
        let Some(own) = released.get(token) else {
            continue;
        };
        match answer {
            ForceRelease::Released => assert!(
                !matches!(own, Ok(ReleaseOutcome::Released)),
                "a force release naming lease {token} answered released, yet that lease's own \
                 release succeeded after it: the break hit another lease"
            ),
            other => assert!(
                matches!(own, Ok(ReleaseOutcome::Released)),
                "a force release naming lease {token} answered {other:?}, yet that lease's own \
                 release answered {own:?}: it broke something"
            ),
        }
    }
}

/// A force release that names one permit of a key held as permits breaks
/// that permit alone, or is refused with an error and breaks nothing:
/// never the key's other permits. With permits A and B held, naming B by
/// its token leaves A's release answering `Released`. With B released by
/// its holder, naming B (a lease shown a moment before) breaks nothing,
/// and A keeps its permit.
pub async fn a_force_release_naming_a_permit_breaks_only_that_permit(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    use crate::backend::{Access, ForceRelease, Holding, ReleaseOutcome, ReleaseRequest};
    let access = Access::Permits { permits: 2 };
    if !keeps_access(&backend, access).await {
        return;
    }
    let take_permit = |key: LockKey| {
        let backend = backend.clone();
        async move {
            let owner = OwnerId::random().expect("an owner id");
            let request =
                AcquireRequest::new(&key, &owner, Duration::from_secs(30)).with_access(access);
            match backend
                .try_acquire(&request)
                .await
                .expect("backend answers")
            {
                Attempt::Acquired(grant) => (owner, grant.token, grant.slot),
                other => panic!("a free permit must be granted: {other:?}"),
            }
        }
    };
    let release = |key: LockKey, owner: OwnerId, slot: Option<u32>| {
        let backend = backend.clone();
        async move {
            backend
                .release(&ReleaseRequest::new(&key, &owner).holding(access, slot))
                .await
                .expect("backend answers")
        }
    };

    // Both held: naming the one shown breaks that one at most.
    let key = fresh_key("forced-permit");
    let a = take_permit(key.clone()).await;
    let b = take_permit(key.clone()).await;
    let named = b.1;
    let (named_lease, other_lease) = (b, a);
    let answer = another
        .force_release_holding(&key, &Holding::new(Some(named), None))
        .await;
    let other_out = release(key.clone(), other_lease.0, other_lease.2).await;
    assert_eq!(
        other_out,
        ReleaseOutcome::Released,
        "naming permit {named} (answered {answer:?}) must not break permit {}",
        other_lease.1
    );
    let named_out = release(key.clone(), named_lease.0, named_lease.2).await;
    match answer {
        Ok(ForceRelease::Released) => assert_ne!(
            named_out,
            ReleaseOutcome::Released,
            "the permit named was answered broken, yet its holder still held it"
        ),
        // Refused, or not found: nothing may be broken.
        other => assert_eq!(
            named_out,
            ReleaseOutcome::Released,
            "a force release answering {other:?} must break nothing"
        ),
    }

    // The permit named was released by its holder meanwhile: nothing breaks.
    let key = fresh_key("forced-permit-gone");
    let a = take_permit(key.clone()).await;
    let b = take_permit(key.clone()).await;
    let named = b.1;
    let (gone, kept) = (b, a);
    assert_eq!(
        release(key.clone(), gone.0, gone.2).await,
        ReleaseOutcome::Released
    );
    let answer = another
        .force_release_holding(&key, &Holding::new(Some(named), None))
        .await;
    assert!(
        !matches!(answer, Ok(ForceRelease::Released)),
        "naming permit {named}, which its holder released, must break nothing: {answer:?}"
    );
    assert_eq!(
        release(key.clone(), kept.0, kept.2).await,
        ReleaseOutcome::Released,
        "naming a released permit ({answer:?}) must not break permit {}",
        kept.1
    );
}

/// A lease that is not renewed expires: the key is free after its ttl, and
/// not before it, with a higher token for the next holder.
pub async fn expiry_frees_the_key(backend: Arc<dyn Backend>) {
    // A store that kept the lease for less (half, say) frees the key a
    // second early: a waiter retrying within that second tells.
    const TTL: Duration = Duration::from_millis(2_000);
    let key = fresh_key("expiry");
    // Before the request leaves: the lease cannot start earlier, so the
    // key must stay held until at least a ttl after this, however late the
    // waiter below gets it on a loaded machine.
    let asked = Instant::now();
    let holder = options(TTL.as_millis() as u64)
        .renew(false)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let next = take(
        &backend,
        &key,
        10_000,
        Duration::from_secs(10),
        "the key must be free once the holder's ttl ran out",
    )
    .await;
    let freed_after = asked.elapsed();
    assert!(
        freed_after + ROUNDING >= TTL,
        "the key was taken again {freed_after:?} after a lease of {TTL:?} was asked for: \
         a store must keep a lease for its whole ttl"
    );
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

/// `extend` sets the lease's remaining lifetime, shorter as well as longer:
/// a release within a minimum hold cuts the lease to what is left of the
/// hold, and the key must be free when that runs out, not at the old
/// deadline.
pub async fn an_extend_to_a_shorter_ttl_frees_the_key_at_the_new_deadline(
    backend: Arc<dyn Backend>,
) {
    use crate::backend::{Attempt, Renewal};
    let key = fresh_key("shortened");
    let owner = OwnerId::random().expect("random");
    let taken = attempt_as(&backend, &key, &owner, Duration::from_secs(20)).await;
    assert!(
        matches!(taken, Attempt::Acquired(_)),
        "a fresh key must be free"
    );
    let shortened = backend
        .extend(&Renewal::new(&key, &owner, Duration::from_millis(300)))
        .await
        .expect("backend answers");
    assert!(shortened, "the holder's extend must be accepted");
    // Far sooner than the old 20 s deadline, with room for a slow machine.
    free_within(
        &backend,
        &key,
        10_000,
        Duration::from_secs(8),
        "the key must be free once the shortened lease ran out",
    )
    .await;
}

/// A renewed lease outlives several ttls and stays exclusive.
pub async fn renewal_keeps_a_lease_alive_past_several_ttls(backend: Arc<dyn Backend>) {
    let key = fresh_key("renewal");
    // A ttl of 1 s is renewed every third of it: a renewal delayed by a
    // stall of up to ~600 ms still lands in time.
    let asked = Instant::now();
    let lease = take(&backend, &key, 1_000, Duration::ZERO, "free").await;
    // Counted from the request, so a slow acquisition cannot eat into the
    // span the lease must outlive by renewal.
    tokio::time::sleep_until(asked + Duration::from_millis(3_500)).await;
    assert!(
        lease.check().is_ok(),
        "a renewed lease must survive 3.5 ttls"
    );
    let contender = options(1_000).acquire_on(backend.clone(), &key).await;
    assert!(matches!(contender, Err(LockError::Held { .. })));
    lease.release().await.expect("release");
}

/// The lost signal fires when an administrator breaks the lock (`force_release`).
pub async fn lost_signal_fires_when_the_lease_is_taken_away(backend: Arc<dyn Backend>) {
    let key = fresh_key("taken-away");
    let lease = take(&backend, &key, 300, Duration::ZERO, "free").await;
    assert!(backend.force_release(&key).await.expect("force release"));
    let usurper = take(&backend, &key, 10_000, Duration::ZERO, "freed").await;
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

/// The lost signal fires when the ttl runs out without renewal.
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

/// A waiter is woken by the release (the backend's notice), not by polling.
pub async fn waiter_wakes_on_release_not_by_polling(backend: Arc<dyn Backend>) {
    let key = fresh_key("wake");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let counting = CountingBackend::new(backend.clone());
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

/// A waiter whose wait runs out gets `Timeout`.
pub async fn waiter_times_out_with_timeout_error(backend: Arc<dyn Backend>) {
    let key = fresh_key("timeout");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
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

/// A minimum hold keeps the key held after an early release, then frees it.
pub async fn min_hold_keeps_the_key_after_early_release(backend: Arc<dyn Backend>) {
    // The early attempt must come within the minimum hold, counted from
    // before the acquisition: a stall that pushes it past proves nothing,
    // and the round is run again on a fresh key with a hold twice as long.
    let mut min_hold = Duration::from_millis(800);
    let (key, token) = loop {
        let key = fresh_key("min-hold");
        let asked = Instant::now();
        let lease = options(10_000)
            .min_hold(min_hold)
            .acquire_on(backend.clone(), &key)
            .await
            .expect("free");
        let token = lease.token();
        lease
            .release()
            .await
            .expect("release within the minimum hold");
        let early = options(10_000).acquire_on(backend.clone(), &key).await;
        match early {
            Err(LockError::Held { .. }) => break (key, token),
            Ok(lease)
                if asked.elapsed() + ROUNDING >= min_hold && min_hold < Duration::from_secs(6) =>
            {
                lease.release().await.expect("release");
                min_hold *= 2;
            }
            other => panic!(
                "the key must stay held until the minimum hold ({min_hold:?}) is over: {other:?}"
            ),
        }
    };
    let later = take(
        &backend,
        &key,
        10_000,
        Duration::from_secs(10),
        "free once the minimum hold is over",
    )
    .await;
    assert!(later.token() > token);
    later.release().await.expect("release");
}

/// Two callers locking the same keys in opposite orders never deadlock.
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

/// A multi-key acquisition that cannot take every key releases the ones it took.
pub async fn multi_key_failure_releases_taken_keys(backend: Arc<dyn Backend>) {
    // Sorted order takes `…a…` before `…b…`; `b` is held, so `a` must be
    // released when the set fails.
    let id = OwnerId::random().expect("random");
    let a = LockKey::new(format!("dlock-test:release-taken:{id}:a")).expect("key");
    let b = LockKey::new(format!("dlock-test:release-taken:{id}:b")).expect("key");
    let holder = take(&backend, &b, 10_000, Duration::ZERO, "free").await;
    let set = options(10_000)
        .acquire_many_on(backend.clone(), [&b, &a])
        .await;
    match set {
        Err(LockError::Held { key, .. }) => assert_eq!(key, b.to_string()),
        other => panic!("expected b held, got {other:?}"),
    }
    let a_again = options(10_000).acquire_on(backend.clone(), &a).await;
    assert!(a_again.is_ok(), "a must have been released");
    holder.release().await.expect("release");
}

/// A lease dropped unreleased (an early return, a panic) frees the key long before its ttl.
pub async fn dropping_an_unreleased_lease_frees_the_key(backend: Arc<dyn Backend>) {
    let key = fresh_key("drop");
    {
        let _lease = take(&backend, &key, 60_000, Duration::ZERO, "free").await;
        // Dropped here without release, as on an early return or `?`.
    }
    let after_drop = take(
        &backend,
        &key,
        60_000,
        Duration::from_secs(10),
        "a dropped lease must free the key long before its 60s ttl",
    )
    .await;
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
    free_within(
        &backend,
        &key,
        60_000,
        Duration::from_secs(10),
        "a panicking holder's lease must be freed",
    )
    .await;
}

/// A waiter cancelled mid-wait leaves nothing held.
pub async fn cancelled_waiter_leaves_the_key_free(backend: Arc<dyn Backend>) {
    let key = fresh_key("cancelled");
    let holder = take(&backend, &key, 60_000, Duration::ZERO, "free").await;
    let waiting_options = options(60_000).wait(Duration::from_secs(30));
    let waiting = waiting_options.acquire_on(backend.clone(), &key);
    // Cancel the waiter mid-wait.
    assert!(timeout(Duration::from_millis(200), waiting).await.is_err());
    holder.release().await.expect("release");
    // A cancelled waiter's clean-up (its writer-waiting mark, its queue
    // entry) may still be on its way; a waiter that kept the key would
    // hold it for its 60 s ttl, far past this wait.
    let next = options(60_000)
        .wait(Duration::from_secs(5))
        .acquire_on(backend.clone(), &key)
        .await;
    assert!(next.is_ok(), "a cancelled waiter must not keep the key");
}

/// Keys with quotes, braces, separators and non-ASCII text are data: each locks exclusively, and different keys never collide.
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

/// Bad keys and durations are clear errors, never a panic or a silent lock.
pub async fn bad_keys_and_durations_are_errors(backend: Arc<dyn Backend>) {
    let invalid_key =
        |r: Result<crate::Lease, LockError>| matches!(r, Err(LockError::InvalidKey { .. }));
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
    let bad_option = |r: Result<crate::Lease, LockError>, name: &str| matches!(r, Err(LockError::InvalidOption { option, .. }) if option == name);
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
    free_within(&backend, &key, 1000, Duration::ZERO, "free").await;
}

/// Acquisitions whose callers give up mid-attempt leave their keys free long before the ttl.
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
        let next = take(
            &backend,
            key,
            60_000,
            Duration::from_secs(10),
            "an abandoned acquisition must not keep its key for the 60s ttl",
        )
        .await;
        next.release().await.expect("release");
    }
}

/// A release whose caller gives up half-way still frees the key.
pub async fn a_release_abandoned_half_way_still_frees_the_key(backend: Arc<dyn Backend>) {
    let key = fresh_key("abandoned-release");
    let lease = take(&backend, &key, 60_000, Duration::ZERO, "free").await;
    let _ = timeout(Duration::ZERO, lease.release()).await;
    free_within(
        &backend,
        &key,
        60_000,
        Duration::from_secs(10),
        "a release given up half-way must still free the key before its 60s ttl",
    )
    .await;
}

/// A release notice that woke one waiter and is dropped before that waiter's next attempt is answered passes the wake-up on to another waiter.
pub async fn a_woken_notice_dropped_unanswered_passes_the_wake_up_on(backend: Arc<dyn Backend>) {
    use crate::backend::Attempt;
    let key = fresh_key("pass-on");
    let holder = take(&backend, &key, 60_000, Duration::ZERO, "free").await;
    let first = backend.subscribe(&key).await.expect("subscribe");
    let mut second = backend.subscribe(&key).await.expect("subscribe");
    // As a waiter does: subscribed, it tries the key and finds it held.
    let other = OwnerId::random().expect("random");
    let found = attempt_as(&backend, &key, &other, Duration::from_secs(60)).await;
    assert!(
        matches!(found, Attempt::Held { .. }),
        "a held key was given to another owner: {found:?}"
    );
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

/// A release that races the arrival of new waiters never leaves one asleep: in rounds where the holder lets go at moments spread over the waiters' subscribe and first attempts, two waiters of one instance and one of another each get the key in turn, long before the 60 s ttl a missed release would make them wait out.
pub async fn a_release_racing_new_waiters_always_wakes_them(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    /// Waits up to 5 s (less than any nap without a wake-up: the holders'
    /// ttl is 60 s, the core's longest nap 10 s), holds briefly, releases.
    fn turn(
        backend: &Arc<dyn Backend>,
        key: &LockKey,
    ) -> tokio::task::JoinHandle<Result<(), LockError>> {
        let (backend, key) = (backend.clone(), key.clone());
        tokio::spawn(async move {
            let lease = options(60_000)
                .wait(Duration::from_secs(5))
                .acquire_on(backend, key)
                .await?;
            sleep(Duration::from_millis(1)).await;
            lease.release().await
        })
    }
    for round in 0..40u64 {
        let key = fresh_key("release-race");
        let holder = take(&backend, &key, 60_000, Duration::ZERO, "free").await;
        let waiters = [
            turn(&backend, &key),
            turn(&backend, &key),
            turn(&another, &key),
        ];
        // From at once to well after the waiters started waiting.
        sleep(Duration::from_micros(round * round * 5)).await;
        holder.release().await.expect("release");
        for (i, waiter) in waiters.into_iter().enumerate() {
            within(20, "a waiter racing a release", waiter)
                .await
                .expect("task")
                .unwrap_or_else(|err| {
                    panic!("round {round}: waiter {i} missed a release it raced: {err}")
                });
        }
    }
}

/// A waiter woken by a release and cancelled before its attempt does not swallow the release: another waiter gets the key.
pub async fn a_woken_waiter_cancelled_before_its_attempt_does_not_swallow_the_release(
    backend: Arc<dyn Backend>,
) {
    let key = fresh_key("swallowed");
    let holder = take(&backend, &key, 60_000, Duration::ZERO, "free").await;
    // The first waiter: woken first, then stuck in its attempt and cancelled.
    let stuck = CountingBackend::new(backend.clone());
    let first = spawn_waiter(stuck.clone(), &key, 60, 30);
    within(10, "the first waiter to start waiting", async {
        while stuck.attempts() < 2 {
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // The second waiter waits 8s: less than a nap without a wake-up (the
    // holder's ttl is 60s), so only the release can give it the key.
    let patient = CountingBackend::new(backend.clone());
    let second = spawn_waiter(patient.clone(), &key, 60, 8);
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

/// A `try_acquire` retried by the owner that holds the key (its first
/// answer was lost) is a success, with the token already drawn or a higher
/// one; anyone else is still refused.
pub async fn a_retry_by_the_owner_that_holds_the_key_counts_as_acquired(backend: Arc<dyn Backend>) {
    use crate::backend::{Attempt, ReleaseOutcome};
    let key = fresh_key("same-owner");
    let owner = OwnerId::random().expect("random");
    let ttl = Duration::from_secs(10);
    let Attempt::Acquired(first) = attempt_as(&backend, &key, &owner, ttl).await else {
        panic!("a fresh key must be free");
    };
    match attempt_as(&backend, &key, &owner, ttl).await {
        Attempt::Acquired(again) => assert!(
            again.token >= first.token,
            "the retry must get the token already drawn or a higher one, not {} after {}",
            again.token,
            first.token
        ),
        other => panic!("a retry by the holding owner must be a success, not {other:?}"),
    }
    let stranger = OwnerId::random().expect("random");
    assert!(
        matches!(
            attempt_as(&backend, &key, &stranger, ttl).await,
            Attempt::Held { .. }
        ),
        "another owner must still be refused"
    );
    assert_eq!(
        release_as(&backend, &key, &owner).await,
        ReleaseOutcome::Released
    );
}

/// A `try_acquire` retried by the owner that holds the key counts the
/// lease's lifetime anew with the retry's ttl: the key stays held past the
/// first attempt's expiry.
pub async fn a_retry_by_the_owner_restarts_the_lease_with_its_ttl(backend: Arc<dyn Backend>) {
    use crate::backend::{Attempt, ReleaseOutcome};
    let key = fresh_key("same-owner-ttl");
    let owner = OwnerId::random().expect("random");
    let started = Instant::now();
    let first = attempt_as(&backend, &key, &owner, Duration::from_secs(1)).await;
    assert!(
        matches!(first, Attempt::Acquired(_)),
        "a fresh key must be free"
    );
    sleep(Duration::from_millis(600)).await;
    let retry = attempt_as(&backend, &key, &owner, Duration::from_secs(2)).await;
    assert!(
        matches!(retry, Attempt::Acquired(_)),
        "the retry must be a success"
    );
    // Past the first attempt's 1s, well within the retry's 2s.
    sleep((started + Duration::from_millis(1_300)).saturating_duration_since(Instant::now())).await;
    let stranger = OwnerId::random().expect("random");
    let other = attempt_as(&backend, &key, &stranger, Duration::from_secs(10)).await;
    assert!(
        matches!(other, Attempt::Held { .. }),
        "the retry's 2s lease must still hold the key after the first attempt's 1s"
    );
    assert_eq!(
        release_as(&backend, &key, &owner).await,
        ReleaseOutcome::Released
    );
}

/// A `try_acquire` whose caller drops it half-way (called directly, not
/// through the core) leaves nothing stuck, wherever it was dropped: each key
/// is free again by its ttl at the latest.
pub async fn a_try_acquire_dropped_half_way_leaves_nothing_stuck(backend: Arc<dyn Backend>) {
    use crate::backend::AcquireRequest;
    let ttl = Duration::from_secs(1);
    let mut keys = Vec::new();
    // Dropped after its 1st, 2nd, … poll: at each of its await points in
    // turn, the same in every run.
    for polls in 1..=8 {
        let (key, owner) = (
            fresh_key("dropped-attempt"),
            OwnerId::random().expect("random"),
        );
        poll_then_drop(
            backend.try_acquire(&AcquireRequest::new(&key, &owner, ttl)),
            polls,
        )
        .await;
        keys.push(key);
    }
    // Dropped after short waits: a backend that talks to a server is
    // dropped with its request on the way, at the server, or its answer on
    // the way back.
    // Up to a slow server's round trips, one after another.
    for micros in [
        0, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 35_000, 60_000, 100_000,
    ] {
        let (key, owner) = (
            fresh_key("dropped-attempt"),
            OwnerId::random().expect("random"),
        );
        let request = AcquireRequest::new(&key, &owner, ttl);
        let _ = timeout(Duration::from_micros(micros), backend.try_acquire(&request)).await;
        keys.push(key);
    }
    for key in &keys {
        let lease = options(1_000)
            .wait(Duration::from_secs(5))
            .acquire_on(backend.clone(), key)
            .await
            .unwrap_or_else(|e| {
                panic!("a dropped attempt must not keep {key} past its 1s ttl: {e}")
            });
        lease.release().await.expect("release");
    }
}

/// Takes `key` for `owner` with `identity` recorded, straight on the
/// backend, or panics: the key must be free.
async fn take_as(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    owner: &OwnerId,
    identity: &str,
    ttl: Duration,
) -> crate::FencingToken {
    let request = AcquireRequest::new(key, owner, ttl).with_identity(Some(identity));
    match backend
        .try_acquire(&request)
        .await
        .expect("backend answers")
    {
        Attempt::Acquired(grant) => grant.token,
        Attempt::Held { .. } | Attempt::Behind { .. } => {
            panic!("`{key}` must be free for {identity}")
        }
    }
}

/// Waits for a holder watch: until it resolves, or, for a notice that may
/// miss a change, until it says to look again. Panics if a notice that
/// promised to resolve (no recheck) stays silent for 5 s after `what`.
async fn watched(notice: crate::ReleaseNotice, what: &str) {
    match notice.recheck() {
        Some(every) => {
            let _ = timeout(every, notice).await;
        }
        None => {
            if timeout(Duration::from_secs(5), notice).await.is_err() {
                panic!("a holder watch without a recheck slept through {what}");
            }
        }
    }
}

/// `holder` reads the token and identity an acquisition recorded, through either instance on the store; a lock taken without an identity reads as held with none; a free key reads `None`.
pub async fn holder_reads_the_live_holders_token_and_identity(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let key = fresh_key("holder");
    assert_eq!(
        backend.holder(&key).await.expect("holder"),
        None,
        "a fresh key is free"
    );
    let owner = OwnerId::random().expect("random");
    let token = take_as(
        &backend,
        &key,
        &owner,
        "web-3 (pid 4121)",
        Duration::from_secs(30),
    )
    .await;
    for through in [&backend, &another] {
        let holding = through
            .holder(&key)
            .await
            .expect("holder")
            .expect("the key is held");
        assert_eq!(holding.token, Some(token), "the holder's token");
        assert_eq!(holding.identity.as_deref(), Some("web-3 (pid 4121)"));
        // Up to the store's expiry slack more: the time left is when
        // the key is free at the latest.
        if let Some(left) = holding.expires_in {
            assert!(
                left <= Duration::from_secs(30) + through.expiry_slack(),
                "{left:?} left of a 30 s lease"
            );
        }
    }
    assert_eq!(
        release_as(&backend, &key, &owner).await,
        crate::ReleaseOutcome::Released
    );
    assert_eq!(
        another.holder(&key).await.expect("holder"),
        None,
        "released"
    );
    let plain = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let holding = another
        .holder(&key)
        .await
        .expect("holder")
        .expect("a plain lock is held too");
    assert_eq!(holding.identity, None, "a plain lock records no identity");
    assert!(
        holding.token.is_none() || holding.token == Some(plain.token()),
        "a plain lock's token, if told, is its own: {:?} for {}",
        holding.token,
        plain.token()
    );
    plain.release().await.expect("release");
    assert_eq!(
        backend.holder(&key).await.expect("holder"),
        None,
        "released"
    );
}

/// While leases with different identities follow each other on a key through two instances, every holder read pairs a token with the identity granted with it, never an earlier lease's.
pub async fn holder_never_pairs_a_holder_with_an_earlier_leases_identity(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let key = fresh_key("holder-pairs");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (reader_backend, key, stop) = (another.clone(), key.clone(), stop.clone());
        tokio::spawn(async move {
            let mut seen = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if let Some(holding) = reader_backend.holder(&key).await.expect("holder") {
                    seen.push(holding);
                }
                tokio::task::yield_now().await;
            }
            seen
        })
    };
    let mut granted = std::collections::HashMap::new();
    for round in 0..30 {
        let through = if round % 2 == 0 { &backend } else { &another };
        let owner = OwnerId::random().expect("random");
        let identity = format!("replica-{round}");
        let token = take_as(through, &key, &owner, &identity, Duration::from_secs(30)).await;
        granted.insert(token, identity);
        sleep(Duration::from_millis(2)).await;
        assert_eq!(
            release_as(through, &key, &owner).await,
            crate::ReleaseOutcome::Released
        );
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = within(20, "the holder reader", reader)
        .await
        .expect("reader");
    for holding in &seen {
        match (&holding.token, &holding.identity) {
            (Some(token), Some(identity)) => assert_eq!(
                granted.get(token),
                Some(identity),
                "token {token} was read with identity {identity:?}"
            ),
            (None, None) => {}
            (token, identity) => panic!(
                "every lease here recorded an identity: read {identity:?} with token {token:?}"
            ),
        }
    }
}

/// A lease with an identity that runs out unrenewed reads as free.
pub async fn holder_is_none_once_the_lease_expires(backend: Arc<dyn Backend>) {
    // The read of the holder must come within the ttl, counted from before
    // the acquisition: one a stall pushed past it that reads nothing proves
    // nothing, and the round is run again on a fresh key with a ttl twice
    // as long.
    let mut ttl = Duration::from_millis(300);
    let key = loop {
        let key = fresh_key("holder-expiry");
        let owner = OwnerId::random().expect("random");
        let asked = Instant::now();
        take_as(&backend, &key, &owner, "short-lived", ttl).await;
        let held = backend.holder(&key).await.expect("holder").is_some();
        if held {
            break key;
        }
        assert!(
            asked.elapsed() + ROUNDING >= ttl && ttl < Duration::from_secs(2),
            "held: nobody read within the {ttl:?} ttl"
        );
        ttl *= 2;
    };
    // Read until free: a store frees the key by its own clock, within its
    // expiry slack of the ttl (etcd by a sweep of its leader's, which a
    // loaded machine delays), so one read at a fixed instant could come
    // before it did.
    let deadline = Instant::now() + ttl + backend.expiry_slack() + Duration::from_secs(3);
    sleep(ttl + Duration::from_millis(400) + backend.expiry_slack()).await;
    let mut read = backend.holder(&key).await.expect("holder");
    while read.is_some() && Instant::now() < deadline {
        sleep(Duration::from_millis(50)).await;
        read = backend.holder(&key).await.expect("holder");
    }
    assert_eq!(read, None, "the lease ran out");
}

/// A holder watch registered on a free key wakes (or says to look again) when another instance takes the key with an identity, and one registered while it is held wakes when it is released: a reader that waits on it then reads the change.
pub async fn a_holder_watch_wakes_on_an_identity_acquisition_and_on_release(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let key = fresh_key("holder-watch");
    let owner = OwnerId::random().expect("random");
    for round in 0..3 {
        let notice = another.watch_holder(&key).await.expect("watch");
        assert_eq!(another.holder(&key).await.expect("holder"), None, "free");
        let taker = {
            let (backend, key) = (backend.clone(), key.clone());
            tokio::spawn(async move {
                sleep(Duration::from_millis(20)).await;
                take_as(&backend, &key, &owner, "leader", Duration::from_secs(30)).await
            })
        };
        watched(notice, "an acquisition with an identity").await;
        let token = within(10, "the acquisition", taker).await.expect("taker");
        let mut read = another.holder(&key).await.expect("holder");
        // A notice with a recheck may come back before the acquisition.
        let deadline = Instant::now() + Duration::from_secs(5);
        while read.as_ref().and_then(|h| h.token) != Some(token) && Instant::now() < deadline {
            sleep(Duration::from_millis(10)).await;
            read = another.holder(&key).await.expect("holder");
        }
        let read = read.expect("held after the acquisition");
        assert_eq!(
            (read.token, read.identity.as_deref()),
            (Some(token), Some("leader"))
        );

        let notice = another.watch_holder(&key).await.expect("watch");
        assert!(
            another.holder(&key).await.expect("holder").is_some(),
            "round {round}: held"
        );
        let releaser = {
            let (backend, key) = (backend.clone(), key.clone());
            tokio::spawn(async move {
                sleep(Duration::from_millis(20)).await;
                release_as(&backend, &key, &owner).await
            })
        };
        watched(notice, "a release").await;
        let released = within(10, "the release", releaser).await.expect("releaser");
        assert_eq!(released, crate::ReleaseOutcome::Released);
        assert_eq!(
            another.holder(&key).await.expect("holder"),
            None,
            "released"
        );
    }
}

/// Every acquisition, with an identity or without, records this process's
/// host and pid and the request's label beside the lock, read back through
/// another instance with how long the key has been held. (A backend under
/// test carries no label of its own.)
pub async fn every_acquisition_records_its_holders_host_pid_and_label(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let me = crate::HolderInfo::this_process(Some("conformance"));
    for identity in [None, Some("web-3")] {
        let key = fresh_key("recorded");
        let owner = OwnerId::random().expect("random");
        let request = AcquireRequest::new(&key, &owner, Duration::from_secs(30))
            .with_identity(identity)
            .with_label(Some("conformance"));
        let Attempt::Acquired(grant) = backend.try_acquire(&request).await.expect("acquire") else {
            panic!("`{key}` must be free");
        };
        let holding = another
            .holder(&key)
            .await
            .expect("holder")
            .expect("the key is held");
        assert!(
            holding.token.is_none() || holding.token == Some(grant.token),
            "the holder's own token: {:?} for {}",
            holding.token,
            grant.token
        );
        let holder = holding
            .holder
            .unwrap_or_else(|| panic!("no holder recorded for `{key}` ({identity:?})"));
        assert_eq!(
            (holder.host.as_str(), holder.pid, holder.label.as_deref()),
            (me.host.as_str(), me.pid, Some("conformance")),
            "the recorded holder"
        );
        if let Some(held_for) = holder.held_for {
            assert!(
                held_for < Duration::from_secs(30),
                "held for {held_for:?} right after a 30 s lease was taken"
            );
        }
        assert_eq!(
            release_as(&backend, &key, &owner).await,
            crate::ReleaseOutcome::Released
        );
        assert_eq!(another.holder(&key).await.expect("holder"), None);
    }
}

/// A caller that would not wait and finds the key held gets a
/// [`LockError::Held`] naming the holder (its host, pid and token) in its
/// field and in its message.
pub async fn a_refused_caller_is_told_who_holds_the_key(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let key = fresh_key("refused");
    let options = LockOptions::new(Duration::from_secs(30));
    let lease = options
        .acquire_on(Arc::clone(&backend), key.clone())
        .await
        .expect("a fresh key is free");
    // The holder is read after the refusal, within a bound of its own: a
    // read a stall pushed past it costs one refusal its holder. Of a few
    // refusals, one must name it.
    let mut tries = 0;
    let (holding, message) = loop {
        tries += 1;
        let refused = options.acquire_on(Arc::clone(&another), key.clone()).await;
        let Err(err @ LockError::Held { .. }) = refused else {
            panic!("the second caller must be refused as held: {refused:?}");
        };
        let message = err.to_string();
        let LockError::Held { holder, .. } = err else {
            unreachable!()
        };
        match holder {
            Some(holding) => break (holding, message),
            None if tries < 5 => {}
            None => panic!("{tries} refusals named no holder: {message}"),
        }
    };
    assert!(
        holding.token.is_none() || holding.token == Some(lease.token()),
        "the refusal names the holder's token: {:?} for {}",
        holding.token,
        lease.token()
    );
    let info = holding
        .holder
        .unwrap_or_else(|| panic!("the refusal names no host or pid: {message}"));
    assert_eq!(info.pid, std::process::id(), "{message}");
    assert!(
        message.contains(&format!("{} (pid {}", info.host, info.pid)),
        "the message names host and pid: {message}"
    );
    lease.release().await.expect("release");
}

/// `held` lists exactly the live locks whose keys start with a prefix,
/// sorted, with their tokens, through another instance: not a key beside
/// the prefix, not a released one, and keys with the characters stores
/// treat as patterns (`*?[]%_`) are data.
pub async fn held_lists_exactly_the_held_keys_under_a_prefix(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let base = fresh_key("list");
    let prefix = format!("{base}:*?[a]%_:");
    let names = [
        format!("{prefix}b"),
        format!("{prefix}a"),
        format!("{prefix}odd*?[x]%_\\"),
    ];
    let beside = format!("{base}:*?[a]%_x");
    let glob_lookalike = format!("{base}:xx[a]%_:a");
    let like_lookalike = format!("{base}:*?[a]ab:a");
    let options = LockOptions::new(Duration::from_secs(30));
    let mut leases = Vec::new();
    for name in names
        .iter()
        .chain([&beside, &glob_lookalike, &like_lookalike])
    {
        let key = LockKey::new(name.clone()).expect("valid key");
        leases.push(
            options
                .acquire_on(Arc::clone(&backend), key)
                .await
                .expect("a fresh key is free"),
        );
    }
    let listed = another.held(&prefix).await.expect("held");
    let mut expected: Vec<(String, crate::FencingToken)> = names
        .iter()
        .zip(&leases)
        .map(|(name, lease)| (name.clone(), lease.token()))
        .collect();
    expected.sort();
    assert_eq!(
        listed
            .iter()
            .map(|(key, _)| key.clone())
            .collect::<Vec<_>>(),
        expected
            .iter()
            .map(|(key, _)| key.clone())
            .collect::<Vec<_>>(),
        "the keys under {prefix:?}, sorted"
    );
    for ((key, holding), (_, token)) in listed.iter().zip(&expected) {
        assert!(
            holding.token.is_none() || holding.token == Some(*token),
            "`{key}` lists its own holder's token: {:?} for {token}",
            holding.token
        );
    }
    let mut leases = leases.into_iter();
    let first = leases.next().expect("a lease");
    first.release().await.expect("release");
    let after: Vec<String> = another
        .held(&prefix)
        .await
        .expect("held")
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    assert!(
        !after.contains(&names[0]) && after.len() == names.len() - 1,
        "a released key is not listed: {after:?}"
    );
    assert_eq!(
        another.held(&format!("{base}:none:")).await.expect("held"),
        Vec::new(),
        "nothing is held under a prefix of no key"
    );
    for lease in leases {
        lease.release().await.expect("release");
    }
}

// Fair mode (`LockOptions::fair`, rules F1 to F3 on the `Backend` trait).
// A backend without it must refuse a fair acquisition rather than lock
// unfairly: on such a backend each fair property checks that refusal.

/// Fair options: `ttl_ms`, waiting up to `wait`.
fn fair(ttl_ms: u64, wait: Duration) -> LockOptions {
    options(ttl_ms).wait(wait).fair(true)
}

/// True if `backend` keeps fair queues; if it does not, checks that it
/// refuses a fair acquisition with `InvalidOption` (and false).
async fn keeps_fair_queues(backend: &Arc<dyn Backend>) -> bool {
    if backend.supports_fair() {
        return true;
    }
    let refused = fair(1_000, Duration::from_millis(100))
        .acquire_on(backend.clone(), fresh_key("fair-refused"))
        .await;
    assert!(
        matches!(
            refused,
            Err(LockError::InvalidOption { option: "fair", .. })
        ),
        "a backend without fair mode refuses a fair acquisition, got {refused:?}"
    );
    false
}

/// A fair waiter task on `backend` that records `(index, token)` in `order`
/// once it holds the key, holds it for `hold`, and releases it.
/// A fair waiter served: its index, its token, and when its acquisition
/// returned.
type Served = (usize, crate::FencingToken, Instant);

fn spawn_fair_waiter(
    backend: Arc<dyn Backend>,
    key: &LockKey,
    index: usize,
    hold: Duration,
    order: &Arc<std::sync::Mutex<Vec<Served>>>,
) -> tokio::task::JoinHandle<()> {
    let (key, order) = (key.clone(), Arc::clone(order));
    tokio::spawn(async move {
        let lease = fair(30_000, Duration::from_secs(30))
            .acquire_on(backend, key)
            .await
            .expect("a fair waiter is served");
        order
            .lock()
            .expect("order")
            .push((index, lease.token(), Instant::now()));
        sleep(hold).await;
        lease.release().await.expect("release");
    })
}

/// Waits until an acquisition attempt through `counting` after its first
/// `seen` was answered, with none in flight, and returns how many went
/// through. A fair waiter's next attempt (its poll) comes a nap after that
/// answer: a third of [`QUEUE_ENTRY_TTL`](crate::backend::QUEUE_ENTRY_TTL)
/// while the key's holder has longer left.
async fn after_an_answered_attempt(counting: &CountingBackend, seen: usize) -> usize {
    within(10, "an attempt of the waiter", async {
        loop {
            // Answers first: equal to the attempts read after them, none
            // was in flight, and none was sent in between.
            let answered = counting.answered();
            let sent = counting.attempts();
            if sent > seen && answered == sent {
                return sent;
            }
            sleep(Duration::from_millis(1)).await;
        }
    })
    .await
}

/// Waits until `counting` has seen `owners` distinct fair waiters queue.
async fn until_queued(counting: &[&CountingBackend], owners: usize, what: &str) {
    within(10, what, async {
        while counting.iter().map(|c| c.joined()).sum::<usize>() < owners {
            sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
}

/// Fair waiters that queued at distinct times, through two instances of
/// the store, are served in arrival order, each by a handoff with a token
/// above the one before; a fair caller that would not wait is refused at
/// once and takes no place in the queue.
pub async fn fair_waiters_are_served_in_arrival_order_with_rising_tokens(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-order");
    let holder = fair(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a free key is taken by a fair caller at once");
    let (one, two) = (
        CountingBackend::new(backend.clone()),
        CountingBackend::new(another.clone()),
    );
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for index in 0..5 {
        let via: Arc<dyn Backend> = if index % 2 == 0 {
            one.clone()
        } else {
            two.clone()
        };
        waiters.push(spawn_fair_waiter(
            via,
            &key,
            index,
            Duration::from_millis(5),
            &order,
        ));
        until_queued(&[&one, &two], index + 1, "the waiter joins the queue").await;
        if index == 2 {
            let impatient = fair(30_000, Duration::ZERO)
                .acquire_on(backend.clone(), &key)
                .await;
            assert!(
                matches!(impatient, Err(LockError::Held { .. })),
                "a fair caller that would not wait is refused at once: {impatient:?}"
            );
        }
    }
    let first = holder.token();
    holder.release().await.expect("release");
    for waiter in waiters {
        within(20, "the queued waiters", waiter)
            .await
            .expect("waiter task");
    }
    let order = order.lock().expect("order").clone();
    let served: Vec<usize> = order.iter().map(|(index, _, _)| *index).collect();
    assert_eq!(served, vec![0, 1, 2, 3, 4], "served in arrival order");
    let mut previous = first;
    for (index, token, _) in order {
        assert!(
            token > previous,
            "waiter {index}'s token {token} is above the previous holder's {previous}"
        );
        previous = token;
    }
}

/// A fair waiter cancelled in the middle of the queue does not hold it up:
/// the one behind it is served right after the one ahead, well within the
/// life of a queue entry, and the cancelled one never holds the key.
pub async fn fair_a_cancelled_waiter_in_the_middle_does_not_hold_up_the_queue(
    backend: Arc<dyn Backend>,
) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-cancel");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let counting = CountingBackend::new(backend.clone());
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let ahead = spawn_fair_waiter(counting.clone(), &key, 0, Duration::ZERO, &order);
    until_queued(&[&counting], 1, "the first waiter joins").await;
    // The cancelled waiter's entry is written after this, and lives a
    // queue entry's life from its latest write: held up by it, the waiter
    // behind could not be served before this and that life.
    let cancelled_spawned = Instant::now();
    let cancelled = spawn_fair_waiter(counting.clone(), &key, 1, Duration::ZERO, &order);
    until_queued(&[&counting], 2, "the second waiter joins").await;
    let behind = spawn_fair_waiter(counting.clone(), &key, 2, Duration::ZERO, &order);
    until_queued(&[&counting], 3, "the third waiter joins").await;
    cancelled.abort();
    assert!(
        cancelled.await.expect_err("cancelled").is_cancelled(),
        "the middle waiter was cancelled while queued"
    );
    holder.release().await.expect("release");
    within(20, "the first waiter", ahead).await.expect("task");
    within(20, "the waiter behind the cancelled one", behind)
        .await
        .expect("task");
    let order = order.lock().expect("order").clone();
    let served: Vec<usize> = order.iter().map(|o| o.0).collect();
    assert_eq!(
        served,
        vec![0, 2],
        "the cancelled waiter never held the key"
    );
    // Until the waiter behind was granted, not until its task was joined.
    let waited = order[1].2.duration_since(cancelled_spawned);
    assert!(
        waited < crate::backend::QUEUE_ENTRY_TTL,
        "the waiter behind a cancelled one was served {waited:?} after the cancelled \
         one asked, past its entry's earliest expiry: the cancelled waiter's entry held \
         the queue up"
    );
}

/// An entry whose waiter vanished without a word (a killed process: it
/// never listens for its handoff and never refreshes its entry) is skipped
/// once it expired: the release hands the key straight to the live waiter
/// behind it.
pub async fn fair_an_expired_entry_is_skipped_by_the_release(backend: Arc<dyn Backend>) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-expired");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let vanished = OwnerId::random().expect("owner");
    let entry_ttl = Duration::from_millis(300);
    let queued = backend
        .try_acquire(
            &AcquireRequest::new(&key, &vanished, Duration::from_secs(30))
                .with_queue(crate::backend::Queue::Join { entry_ttl }),
        )
        .await
        .expect("backend answers");
    assert!(
        matches!(queued, Attempt::Held { .. }),
        "a waiter joins the queue of a held key: {queued:?}"
    );
    let counting = CountingBackend::new(backend.clone());
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let live = spawn_fair_waiter(counting.clone(), &key, 0, Duration::ZERO, &order);
    until_queued(&[&counting], 1, "the live waiter joins").await;
    let joined = counting.attempts();
    sleep(entry_ttl + Duration::from_millis(200)).await;
    // Released just after one of the live waiter's attempts was answered:
    // its next comes a poll period later, so a waiter served with no
    // attempt after this was handed the key, not let in by a poll.
    let polled = after_an_answered_attempt(&counting, joined).await;
    holder.release().await.expect("release");
    within(20, "the live waiter", live).await.expect("task");
    let polls = counting.attempts() - polled;
    assert_eq!(
        polls, 0,
        "the live waiter needed {polls} attempt(s) after the release: it was not handed \
         the key past the expired entry"
    );
    assert_eq!(
        release_as(&backend, &key, &vanished).await,
        crate::backend::ReleaseOutcome::NotOwner,
        "the vanished waiter never held the key"
    );
}

/// A handoff to a waiter that never listens (it died after refreshing its
/// entry) is taken back by the time its entry would have expired: the
/// live waiter behind it gets the key soon after.
pub async fn fair_a_handoff_to_a_waiter_that_never_listens_comes_back_within_its_entry_ttl(
    backend: Arc<dyn Backend>,
) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-deaf");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let deaf = OwnerId::random().expect("owner");
    let entry_ttl = Duration::from_millis(800);
    let queued = backend
        .try_acquire(
            &AcquireRequest::new(&key, &deaf, Duration::from_secs(30))
                .with_queue(crate::backend::Queue::Join { entry_ttl }),
        )
        .await
        .expect("backend answers");
    assert!(matches!(queued, Attempt::Held { .. }), "{queued:?}");
    let counting = CountingBackend::new(backend.clone());
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let live = spawn_fair_waiter(counting.clone(), &key, 0, Duration::ZERO, &order);
    until_queued(&[&counting], 1, "the live waiter joins").await;
    let released_at = Instant::now();
    holder.release().await.expect("release");
    within(20, "the live waiter", live).await.expect("task");
    // Until the live waiter was granted, not until its task was joined.
    let waited = order.lock().expect("order")[0]
        .2
        .duration_since(released_at);
    // The entry's life, then the live waiter's next look (a third of a
    // queue entry's life at most), with as much again to spare.
    let bound = (entry_ttl + crate::backend::QUEUE_ENTRY_TTL / 3) * 2;
    assert!(
        waited < bound,
        "the live waiter waited {waited:?} (bound {bound:?}): a handoff to a waiter \
         that never listened kept the key"
    );
}

/// A handoff that reached a waiter as it gave up is passed on by the
/// release the giving-up waiter sends (rule F3): the next waiter holds the
/// key, with a token above both earlier holders'.
pub async fn fair_a_handoff_that_arrived_after_its_waiter_gave_up_is_passed_on(
    backend: Arc<dyn Backend>,
) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-late");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let late = OwnerId::random().expect("owner");
    let notice = backend
        .subscribe_handoff(&key, &late)
        .await
        .expect("handoff notice");
    let queued = backend
        .try_acquire(
            &AcquireRequest::new(&key, &late, Duration::from_secs(30)).with_queue(
                crate::backend::Queue::Join {
                    entry_ttl: crate::backend::QUEUE_ENTRY_TTL,
                },
            ),
        )
        .await
        .expect("backend answers");
    assert!(matches!(queued, Attempt::Held { .. }), "{queued:?}");
    let counting = CountingBackend::new(backend.clone());
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let next = spawn_fair_waiter(counting.clone(), &key, 0, Duration::ZERO, &order);
    until_queued(&[&counting], 1, "the next waiter joins").await;
    // Its attempt that queued it was just answered: its next (its poll)
    // comes a poll period later, so a next waiter served with no attempt
    // after this was handed the key, not let in by a poll.
    let polled = after_an_answered_attempt(&counting, 0).await;
    let first = holder.token();
    holder.release().await.expect("release");
    let handed = within(10, "the handoff to the first waiter", notice).await;
    assert!(
        handed.token > first,
        "a handed-over key's token {} is above its previous holder's {first}",
        handed.token
    );
    // The waiter gave up as the handoff arrived: its way out is a release.
    assert_eq!(
        release_as(&backend, &key, &late).await,
        crate::backend::ReleaseOutcome::Released,
        "the waiter that gave up held the handed-over key, and released it"
    );
    within(20, "the next waiter", next).await.expect("task");
    let polls = counting.attempts() - polled;
    let (_, token, _) = order.lock().expect("order")[0];
    assert!(token > handed.token, "{token} is above {}", handed.token);
    assert_eq!(
        polls, 0,
        "the next waiter needed {polls} attempt(s) after the release: the given-up \
         handoff was not passed on"
    );
}

/// No fair waiter starves: 16 tasks loop on one key, and between asking
/// for the key and getting it, none waits more than about 16 turns of the
/// others (counted, not timed).
pub async fn fair_no_waiter_starves_among_sixteen_looping_tasks(backend: Arc<dyn Backend>) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    const TASKS: usize = 16;
    const ROUNDS: usize = 3;
    let key = fresh_key("fair-starve");
    let turns = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(TASKS));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (backend, key, turns, start) = (
                backend.clone(),
                key.clone(),
                Arc::clone(&turns),
                Arc::clone(&start),
            );
            tokio::spawn(async move {
                use std::sync::atomic::Ordering;
                start.wait().await;
                let mut longest = 0;
                for _ in 0..ROUNDS {
                    // Turns are counted from when the waiter is in the
                    // queue (its attempt that joined was answered), not
                    // from before the round trips that get it there.
                    let counting = CountingBackend::with_clock(backend.clone(), Arc::clone(&turns));
                    let asked = turns.load(Ordering::SeqCst);
                    let lease = fair(30_000, Duration::from_secs(60))
                        .acquire_on(counting.clone(), &key)
                        .await
                        .expect("every fair waiter is served");
                    let asked_at = counting.queued_at().unwrap_or(asked);
                    let turn = turns.fetch_add(1, Ordering::SeqCst);
                    longest = longest.max(turn - asked_at);
                    sleep(Duration::from_millis(3)).await;
                    lease.release().await.expect("release");
                }
                longest
            })
        })
        .collect();
    let mut longest = Vec::new();
    for task in tasks {
        longest.push(within(60, "the looping tasks", task).await.expect("task"));
    }
    let worst = longest.iter().copied().max().unwrap_or(0);
    assert!(
        worst <= TASKS + 2,
        "a task waited through {worst} turns of others (of {TASKS} tasks): {longest:?}"
    );
}

/// A handed-over lease is a lease like any other: it outlives several
/// ttls by renewal, and dropping it hands the key on to the next waiter.
pub async fn fair_a_handed_over_lease_renews_and_hands_on_when_dropped(backend: Arc<dyn Backend>) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-renew");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let counting = CountingBackend::new(backend.clone());
    let first = {
        let (counting, key) = (counting.clone(), key.clone());
        tokio::spawn(async move {
            fair(1_000, Duration::from_secs(20))
                .acquire_on(counting, key)
                .await
        })
    };
    until_queued(&[&counting], 1, "the waiter joins").await;
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let second = spawn_fair_waiter(counting.clone(), &key, 1, Duration::ZERO, &order);
    until_queued(&[&counting], 2, "the second waiter joins").await;
    holder.release().await.expect("release");
    let lease = within(20, "the handoff", first)
        .await
        .expect("task")
        .expect("the first waiter is handed the key");
    // A ttl of 1 s renewed every third of it survives a stall of ~600 ms.
    sleep(Duration::from_millis(3_500)).await;
    lease
        .check()
        .expect("a handed-over lease is renewed past three ttls");
    let token = lease.token();
    drop(lease);
    within(20, "the second waiter", second).await.expect("task");
    let (_, next, _) = order.lock().expect("order")[0];
    assert!(next > token, "{next} is above {token}");
}

/// A handed-over lease taken without background renewal is kept by the
/// store for its whole ttl, not only for the short life a store may give a
/// handoff until its first renewal ([`crate::backend::Grant::valid_for`]).
pub async fn fair_a_handed_over_lease_without_renewal_is_kept_for_its_whole_ttl(
    backend: Arc<dyn Backend>,
) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-no-renew");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let counting = CountingBackend::new(backend.clone());
    let ttl = crate::backend::QUEUE_ENTRY_TTL * 4;
    let waiter = {
        let (counting, key) = (counting.clone(), key.clone());
        tokio::spawn(async move {
            LockOptions::new(ttl)
                .renew(false)
                .wait(Duration::from_secs(20))
                .fair(true)
                .acquire_on(counting, key)
                .await
        })
    };
    until_queued(&[&counting], 1, "the waiter joins").await;
    holder.release().await.expect("release");
    let lease = within(20, "the handoff", waiter)
        .await
        .expect("task")
        .expect("the waiter is handed the key");
    let holding = backend
        .holder(&key)
        .await
        .expect("holder")
        .expect("the handed-over key is held");
    if let Some(left) = holding.expires_in {
        assert!(
            left > crate::backend::QUEUE_ENTRY_TTL * 2,
            "the store keeps a handed-over lease without renewal for its ttl {ttl:?}, \
             but it expires in {left:?}"
        );
    }
    lease.release().await.expect("release");
}

/// A handed-over lease whose ttl is shorter than the time since its
/// waiter's last attempt (the core counts a handoff's lease from that
/// attempt's send, up to a third of the queue entry's life back) is not
/// returned spent: its holder gets a live lease, not one lost at once
/// though nobody else could take the key.
pub async fn fair_a_handed_over_lease_with_a_short_ttl_is_not_spent_on_arrival(
    backend: Arc<dyn Backend>,
) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-short-ttl");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let counting = CountingBackend::new(backend.clone());
    let ttl = Duration::from_millis(600);
    let waiter = {
        let (counting, key) = (counting.clone(), key.clone());
        tokio::spawn(async move {
            LockOptions::new(ttl)
                .wait(Duration::from_secs(20))
                .fair(true)
                .acquire_on(counting, key)
                .await
        })
    };
    until_queued(&[&counting], 1, "the waiter joins").await;
    // Longer than the ttl, shorter than the waiter's next refresh (a third
    // of the entry's life after it joined).
    sleep(Duration::from_millis(800)).await;
    holder.release().await.expect("release");
    let lease = within(20, "the handoff", waiter)
        .await
        .expect("task")
        .expect("the waiter is handed the key");
    assert!(
        !lease.is_lost(),
        "a handed-over lease with a {ttl:?} ttl was lost when its caller got it"
    );
    assert!(
        timeout(ttl / 3, lease.lost()).await.is_err(),
        "a handed-over lease with a {ttl:?} ttl was lost within a third of it: {:?}",
        lease.check()
    );
    lease.release().await.expect("release");
}

// Shared locks and permits (`LockOptions::mode`, `LockOptions::permits`,
// rules M1 to M5 on the `Backend` trait). A backend without them must
// refuse the acquisition rather than lock wrongly: on such a backend each
// property checks that refusal.

/// Shared options: `ttl_ms`, waiting up to `wait`.
fn shared(ttl_ms: u64, wait: Duration) -> LockOptions {
    options(ttl_ms).wait(wait).mode(crate::LockMode::Shared)
}

/// Options for one of `permits` permits: `ttl_ms`, waiting up to `wait`.
fn permits(permits: u32, ttl_ms: u64, wait: Duration) -> LockOptions {
    options(ttl_ms).wait(wait).permits(permits)
}

/// True if `backend` keeps `access`; if it does not, checks that it
/// refuses an acquisition with it with `InvalidOption` naming the option
/// and the backend's kind (and false).
async fn keeps_access(backend: &Arc<dyn Backend>, access: crate::backend::Access) -> bool {
    if backend.supports_access(access) {
        return true;
    }
    let options = match access {
        crate::backend::Access::Permits { permits: n } => permits(n, 1_000, Duration::ZERO),
        _ => shared(1_000, Duration::ZERO),
    };
    let refused = options
        .acquire_on(backend.clone(), fresh_key("access-refused"))
        .await;
    match refused {
        Err(LockError::InvalidOption { option, reason }) => {
            assert_eq!(option, access.option(), "the refusal names the option");
            assert!(
                reason.contains(backend.kind()),
                "the refusal names the backend's kind: {reason}"
            );
        }
        other => panic!("a backend without {access} refuses it, got {other:?}"),
    }
    false
}

/// N permits: at most N hold at once, each in its own slot of `0..N`; the
/// N+1th is refused until a slot is freed, and then takes that slot. Among
/// twelve concurrent acquirers of a fresh key, exactly N win.
pub async fn permits_at_most_n_hold_at_once_in_distinct_slots(backend: Arc<dyn Backend>) {
    const N: u32 = 3;
    if !keeps_access(&backend, crate::backend::Access::Permits { permits: N }).await {
        return;
    }
    let key = fresh_key("permits");
    let mut leases = Vec::new();
    for _ in 0..N {
        leases.push(
            permits(N, 30_000, Duration::ZERO)
                .acquire_on(backend.clone(), &key)
                .await
                .expect("a free permit"),
        );
    }
    let mut slots: Vec<u32> = leases
        .iter()
        .map(|lease| lease.slot().expect("a permit has a slot"))
        .collect();
    slots.sort_unstable();
    assert_eq!(slots, vec![0, 1, 2], "the slots are distinct, in 0..{N}");
    let over = permits(N, 30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await;
    assert!(
        matches!(over, Err(LockError::Held { .. })),
        "the permit beyond {N} is refused, got {over:?}"
    );
    let freed = leases.remove(1);
    let freed_slot = freed.slot();
    freed.release().await.expect("release");
    let next = permits(N, 30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the freed slot");
    assert_eq!(next.slot(), freed_slot, "the freed slot is taken again");
    next.release().await.expect("release");
    for lease in leases {
        lease.release().await.expect("release");
    }

    let key = fresh_key("permits-race");
    let barrier = Arc::new(Barrier::new(12));
    let racers: Vec<_> = (0..12)
        .map(|_| {
            let (backend, key, barrier) = (backend.clone(), key.clone(), Arc::clone(&barrier));
            tokio::spawn(async move {
                barrier.wait().await;
                permits(N, 30_000, Duration::ZERO)
                    .acquire_on(backend, key)
                    .await
            })
        })
        .collect();
    let mut won = Vec::new();
    for racer in racers {
        match within(20, "a permit racer", racer).await.expect("task") {
            Ok(lease) => won.push(lease),
            Err(LockError::Held { .. }) => {}
            Err(err) => panic!("a racer failed: {err}"),
        }
    }
    assert_eq!(won.len(), N as usize, "exactly {N} of twelve racers hold");
    let mut slots: Vec<_> = won.iter().map(crate::Lease::slot).collect();
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(slots.len(), N as usize, "the winners hold distinct slots");
    for lease in won {
        lease.release().await.expect("release");
    }
}

/// Readers overlap, and a writer overlaps no one: two readers hold at once;
/// a writer is refused while either does; a reader is refused while the
/// writer holds.
pub async fn readers_overlap_and_a_writer_overlaps_no_one(backend: Arc<dyn Backend>) {
    if !keeps_access(&backend, crate::backend::Access::Shared).await {
        return;
    }
    let key = fresh_key("rw");
    let first = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a free key");
    let second = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("readers overlap");
    for _ in 0..2 {
        let writer = options(30_000).acquire_on(backend.clone(), &key).await;
        assert!(
            matches!(writer, Err(LockError::Held { .. })),
            "a writer is refused while readers hold, got {writer:?}"
        );
    }
    first.release().await.expect("release");
    let writer = options(30_000).acquire_on(backend.clone(), &key).await;
    assert!(
        matches!(writer, Err(LockError::Held { .. })),
        "a writer is refused while one reader still holds, got {writer:?}"
    );
    second.release().await.expect("release");
    // The refused writers did not wait, so they left no writer-waiting
    // mark (rule M3): a reader still joins, and a writer that waits gets
    // the key once the readers have left.
    shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a writer that does not wait holds no reader back")
        .release()
        .await
        .expect("release");
    let writer = options(30_000)
        .wait(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the readers have gone");
    let reader = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await;
    assert!(
        matches!(reader, Err(LockError::Held { .. })),
        "a reader is refused while the writer holds, got {reader:?}"
    );
    let other_writer = options(30_000).acquire_on(backend.clone(), &key).await;
    assert!(
        matches!(other_writer, Err(LockError::Held { .. })),
        "a second writer is refused, got {other_writer:?}"
    );
    writer.release().await.expect("release");
    let reader = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free again");
    reader.release().await.expect("release");
}

/// A waiting writer is not starved by a stream of readers that overlap
/// (each new reader comes before the one before it leaves, so the key is
/// never free of readers): within a few turns new readers are refused, the
/// readers drain and the writer gets the key, with a token above theirs.
pub async fn a_waiting_writer_is_not_starved_by_a_stream_of_readers(backend: Arc<dyn Backend>) {
    const TURNS: usize = 50;
    if !keeps_access(&backend, crate::backend::Access::Shared).await {
        return;
    }
    let key = fresh_key("rw-starve");
    let mut current = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a free key");
    let reader_token = current.token();
    let writer = {
        let (backend, key) = (backend.clone(), key.clone());
        tokio::spawn(async move {
            options(30_000)
                .wait(Duration::from_secs(30))
                .acquire_on(backend, key)
                .await
        })
    };
    let mut turns = 0;
    loop {
        assert!(
            turns < TURNS,
            "the writer starved: {TURNS} overlapping readers in a row took the key"
        );
        turns += 1;
        // Give the writer's attempts a chance to reach the store.
        sleep(Duration::from_millis(20)).await;
        match shared(30_000, Duration::ZERO)
            .acquire_on(backend.clone(), &key)
            .await
        {
            Ok(next) => {
                assert_eq!(
                    next.token(),
                    reader_token,
                    "overlapping readers share a token"
                );
                let before = std::mem::replace(&mut current, next);
                before.release().await.expect("release");
            }
            Err(LockError::Held { .. }) => break,
            Err(err) => panic!("a reader failed: {err}"),
        }
    }
    current.release().await.expect("release");
    let writer = within(20, "the waiting writer", writer)
        .await
        .expect("task")
        .expect("the writer gets the key once the readers drained");
    assert!(
        writer.token() > reader_token,
        "the writer's token {} is above the readers' {reader_token}",
        writer.token()
    );
    writer.release().await.expect("release");
    let reader = shared(30_000, Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("readers go again after the writer");
    reader.release().await.expect("release");
}

/// Rule M3 for a fair writer, and across processes: a fair writer on one
/// instance is not starved by readers on another that keep joining the
/// key while readers of their own process hold it. A new reader comes
/// every 100 ms and each holds the key longer than a writer's mark lives
/// unless its waiter keeps it ([`QUEUE_ENTRY_TTL`] and a second), so the
/// key is never free of readers unless new ones are refused for as long
/// as the writer waits: then those that hold finish and the writer gets
/// the key, with a token above theirs.
///
/// [`QUEUE_ENTRY_TTL`]: crate::backend::QUEUE_ENTRY_TTL
pub async fn a_waiting_fair_writer_is_not_starved_by_another_processs_readers(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    if !keeps_access(&backend, crate::backend::Access::Shared).await
        || !keeps_fair_queues(&backend).await
    {
        return;
    }
    let hold = crate::backend::QUEUE_ENTRY_TTL + Duration::from_secs(1);
    let key = fresh_key("fair-rw-starve");
    let first = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a free key");
    let reader_token = first.token();
    let mut holding = std::collections::VecDeque::from([(first, Instant::now())]);
    let writer = {
        let key = key.clone();
        tokio::spawn(async move { fair(30_000, hold * 3).acquire_on(another, key).await })
    };
    while !writer.is_finished() {
        sleep(Duration::from_millis(100)).await;
        while holding
            .front()
            .is_some_and(|(_, since)| since.elapsed() >= hold)
        {
            if let Some((reader, _)) = holding.pop_front() {
                reader.release().await.expect("release");
            }
        }
        match shared(30_000, Duration::ZERO)
            .acquire_on(backend.clone(), &key)
            .await
        {
            Ok(reader) => holding.push_back((reader, Instant::now())),
            Err(LockError::Held { .. }) => {}
            Err(err) => panic!("a reader failed: {err}"),
        }
    }
    let writer = writer.await.expect("task").unwrap_or_else(|err| {
        panic!(
            "the fair writer starved: readers of another process kept joining for as long as \
             it waited ({err})"
        )
    });
    assert!(
        holding.is_empty(),
        "{} readers hold the key together with the fair writer",
        holding.len()
    );
    assert!(
        writer.token() > reader_token,
        "the writer's token {} is above the readers' {reader_token}",
        writer.token()
    );
    writer.release().await.expect("release");
}

/// Tokens of a read-write lock: an exclusive token is above every token
/// issued before for the key, readers' included; readers that overlap get
/// equal tokens, above the last writer's. So "accept `>=` the highest
/// accepted" refuses a stale writer and never a current reader.
pub async fn tokens_fence_stale_writers_and_never_current_readers(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    if !keeps_access(&backend, crate::backend::Access::Shared).await {
        return;
    }
    let key = fresh_key("rw-tokens");
    let w1 = options(30_000)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a free key");
    let w1_token = w1.token();
    w1.release().await.expect("release");
    let r1 = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let r2 = shared(30_000, Duration::ZERO)
        .acquire_on(another.clone(), &key)
        .await
        .expect("readers overlap, across instances");
    assert!(
        r1.token() > w1_token,
        "a reader's token is above the writer's before"
    );
    assert_eq!(
        r1.token(),
        r2.token(),
        "overlapping readers get equal tokens"
    );
    r1.release().await.expect("release");
    let r3 = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the phase is live");
    assert_eq!(
        r3.token(),
        r2.token(),
        "a reader joining a live phase gets its token"
    );
    let r3_token = r3.token();
    r2.release().await.expect("release");
    r3.release().await.expect("release");
    let w2 = options(30_000)
        .acquire_on(another.clone(), &key)
        .await
        .expect("free");
    assert!(
        w2.token() > r3_token,
        "a writer's token {} is above every reader's before, {r3_token}",
        w2.token(),
    );
    let w2_token = w2.token();
    w2.release().await.expect("release");
    let r4 = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    assert!(
        r4.token() > w2_token,
        "a new phase's token is above the writer's"
    );
    r4.release().await.expect("release");
}

/// A permit's token rises per slot: the next holder of a slot gets a
/// greater token than the one before in that slot.
pub async fn permit_tokens_rise_per_slot(backend: Arc<dyn Backend>, another: Arc<dyn Backend>) {
    if !keeps_access(&backend, crate::backend::Access::Permits { permits: 2 }).await {
        return;
    }
    let key = fresh_key("permit-tokens");
    let mut last: [Option<crate::FencingToken>; 2] = [None, None];
    for round in 0..4 {
        let via = if round % 2 == 0 { &backend } else { &another };
        let a = permits(2, 30_000, Duration::ZERO)
            .acquire_on(via.clone(), &key)
            .await
            .expect("a free permit");
        let b = permits(2, 30_000, Duration::ZERO)
            .acquire_on(via.clone(), &key)
            .await
            .expect("the second permit");
        for lease in [&a, &b] {
            let slot = lease.slot().expect("a slot") as usize;
            assert!(slot < 2, "slot {slot} is in 0..2");
            if let Some(before) = last[slot] {
                assert!(
                    lease.token() > before,
                    "slot {slot}'s token {} is above its last holder's {before}",
                    lease.token()
                );
            }
            last[slot] = Some(lease.token());
        }
        a.release().await.expect("release");
        b.release().await.expect("release");
    }
}

/// A permit holder that crashed (its lease never released, never renewed:
/// only the store's ttl can free it) frees its slot once the ttl is over.
pub async fn a_crashed_permit_holder_frees_its_slot_after_the_ttl(backend: Arc<dyn Backend>) {
    let access = crate::backend::Access::Permits { permits: 1 };
    if !keeps_access(&backend, access).await {
        return;
    }
    // The refused attempt must come within the ttl, counted from before
    // the crashed holder's request: one a stall pushed past it that is
    // let in proves nothing, and the round is run again on a fresh key
    // with a ttl twice as long.
    let mut ttl = Duration::from_millis(400);
    let key = loop {
        let key = fresh_key("permit-crash");
        let crashed = OwnerId::random().expect("random bytes");
        let asked = Instant::now();
        let taken = backend
            .try_acquire(&AcquireRequest::new(&key, &crashed, ttl).with_access(access))
            .await
            .expect("backend answers");
        let Attempt::Acquired(grant) = taken else {
            panic!("a fresh key's permit is free, got {taken:?}");
        };
        assert_eq!(grant.slot, Some(0), "the only slot is 0");
        let refused = permits(1, 30_000, Duration::ZERO)
            .acquire_on(backend.clone(), &key)
            .await;
        match refused {
            Err(LockError::Held { .. }) => break key,
            Ok(lease) if asked.elapsed() + ROUNDING >= ttl && ttl < Duration::from_secs(3) => {
                lease.release().await.expect("release");
                ttl *= 2;
            }
            other => panic!("the crashed holder's slot is held until its ttl, got {other:?}"),
        }
    };
    let next = permits(1, 30_000, Duration::from_secs(15))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the ttl frees the slot");
    assert_eq!(next.slot(), Some(0));
    next.release().await.expect("release");
}

/// Cancellation: a writer that waits behind readers and is dropped
/// mid-wait leaves no writer-waiting mark (a new reader gets the key well
/// before a mark's expiry would have freed it), and a permit acquisition
/// dropped at any await point leaves no slot held.
pub async fn a_cancelled_writer_leaves_no_mark_and_a_cancelled_permit_no_slot(
    backend: Arc<dyn Backend>,
) {
    if keeps_access(&backend, crate::backend::Access::Shared).await {
        let key = fresh_key("rw-cancel");
        let reader = shared(30_000, Duration::ZERO)
            .acquire_on(backend.clone(), &key)
            .await
            .expect("a free key");
        let counting = CountingBackend::new(backend.clone());
        let via: Arc<dyn Backend> = counting.clone();
        // Before the writer's first attempt: a mark it leaves was written
        // after this, and expires no earlier than a queue entry's life
        // later (less the milliseconds a server's clock rounds away).
        let mark_expiry =
            Instant::now() + crate::backend::QUEUE_ENTRY_TTL - Duration::from_millis(5);
        {
            let writer = options(30_000).wait(Duration::from_secs(30));
            let waiting = writer.acquire_on(via, &key);
            let mut waiting = std::pin::pin!(waiting);
            // Until its attempt was answered `Held` (the mark is left).
            within(10, "the writer's first attempt", async {
                while counting.attempts() == 0 {
                    let _ = timeout(Duration::from_millis(10), waiting.as_mut()).await;
                }
                let _ = timeout(Duration::from_millis(50), waiting.as_mut()).await;
            })
            .await;
        }
        // Until the mark's earliest expiry: only a removed mark lets it in.
        let joined = shared(
            30_000,
            mark_expiry.saturating_duration_since(Instant::now()),
        )
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the cancelled writer's mark is gone");
        joined.release().await.expect("release");
        reader.release().await.expect("release");
    }
    let access = crate::backend::Access::Permits { permits: 1 };
    if !keeps_access(&backend, access).await {
        return;
    }
    // What the core sends for an attempt abandoned before its answer: a
    // release naming no slot, which frees the owner's slot (rule M4).
    let key = fresh_key("permit-give-back");
    let abandoned = OwnerId::random().expect("random bytes");
    let taken = backend
        .try_acquire(
            &AcquireRequest::new(&key, &abandoned, Duration::from_secs(30)).with_access(access),
        )
        .await
        .expect("backend answers");
    assert!(
        matches!(taken, Attempt::Acquired(_)),
        "a fresh key's permit is free, got {taken:?}"
    );
    let given_back = backend
        .release(&crate::backend::ReleaseRequest::new(&key, &abandoned).holding(access, None))
        .await
        .expect("backend answers");
    assert_eq!(
        given_back,
        crate::backend::ReleaseOutcome::Released,
        "a release naming no slot gives the owner's slot back"
    );
    permits(1, 30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the given-back slot is free")
        .release()
        .await
        .expect("release");
    for polls in 0..6 {
        let key = fresh_key("permit-cancel");
        poll_then_drop(
            permits(1, 30_000, Duration::ZERO).acquire_on(backend.clone(), &key),
            polls,
        )
        .await;
        let next = permits(1, 30_000, Duration::from_secs(10))
            .acquire_on(backend.clone(), &key)
            .await
            .unwrap_or_else(|err| {
                panic!("a permit acquisition dropped after {polls} polls left its slot: {err}")
            });
        next.release().await.expect("release");
    }
}

/// Rule M3: only a writer that waits leaves a writer-waiting mark. A
/// try-lock writer refused by readers sends no release afterwards (it does
/// not wait, so the core has no mark to remove), so a mark it left would
/// hold every new reader back for the mark's whole expiry: a reader that
/// does not wait must be granted at once right after the refusal.
pub async fn a_writer_that_does_not_wait_leaves_no_mark(backend: Arc<dyn Backend>) {
    if !keeps_access(&backend, crate::backend::Access::Shared).await {
        return;
    }
    let key = fresh_key("rw-try-writer");
    let reader = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a free key");
    for round in 0..3 {
        match options(30_000).acquire_on(backend.clone(), &key).await {
            Err(LockError::Held { .. }) => {}
            other => panic!("a writer beside a reader is refused, got {other:?}"),
        }
        let joined = shared(30_000, Duration::ZERO)
            .acquire_on(backend.clone(), &key)
            .await
            .unwrap_or_else(|err| {
                panic!("round {round}: a refused try-lock writer left a mark: {err}")
            });
        assert_eq!(
            joined.token(),
            reader.token(),
            "a reader joining the live phase shares its token"
        );
        joined.release().await.expect("release");
    }
    reader.release().await.expect("release");
}

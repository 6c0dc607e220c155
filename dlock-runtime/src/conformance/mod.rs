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
//! Not a stable API: properties are added as the contract grows. They are
//! grouped by the rules they check, one file a group, each property one
//! function that spells out its own setup: exclusion and ownership
//! (`exclusive`), force releases (`force`), expiry and renewal (`expiry`),
//! waiting and cancellation (`waiting`), holder identity (`holders`), fair
//! mode (`fair`), shared locks and permits (`modes`); all re-exported here.
//! The helpers they share (hang guards, fresh keys, a counting backend) and
//! the runners' plumbing live in `helpers`; the option builders and
//! capability checks of several groups below.

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

mod exclusive;
mod expiry;
mod fair;
mod force;
mod helpers;
mod holders;
mod modes;
mod waiting;

pub use exclusive::*;
pub use expiry::*;
pub use fair::*;
pub use force::*;
pub use holders::*;
pub use modes::*;
pub use waiting::*;

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
            a_duration_past_any_clock_is_answered_without_a_panic,
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
            fair_an_owner_granted_by_a_plain_attempt_leaves_the_queue,
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

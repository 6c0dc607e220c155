//! Model-based tests of every backend's protocol against its real store.
//!
//! A seeded generator draws a few thousand operations on three keys (one
//! for exclusive and shared holders, one for permits, one for fair
//! waiters) from three backend instances, as separate processes would
//! hold them: the `Backend` trait's primitives, driven directly, and the
//! faults an operator inflicts on the store (keys deleted, the token
//! counter set back or overwritten, foreign values under dlock's keys,
//! the store wiped or restarted, sessions terminated, tables locked). The
//! runner checks every answer against a reference model of the rules of
//! `dlock::Backend` (`model/reference.rs`); leases last 300 s, so nothing
//! expires by itself and the model is exact. A violation is shrunk to the
//! shortest sequence that still shows it and printed as a regression test
//! to paste below.
//!
//! Every run prints `model: <backend>: <N> operations, <F> faults, <V>
//! violations` and its seed; `DLOCK_SEED=<seed>` replays one,
//! `DLOCK_MODEL_OPS=<n>` sends `n` operations instead of 2,000. See
//! docs/testing.md.

#[cfg(feature = "etcd")]
#[path = "etcd_support/mod.rs"]
mod etcd_support;
#[path = "pg_support/mod.rs"]
mod pg_support;
#[path = "redis_support/mod.rs"]
mod redis_support;
#[allow(dead_code)] // the fault runs' shuffle
#[path = "fault/rng.rs"]
mod rng;
#[path = "support/mod.rs"]
mod support;

#[path = "model/driver.rs"]
mod driver;
#[cfg(feature = "etcd")]
#[path = "model/etcd.rs"]
mod etcd;
#[path = "model/local.rs"]
mod local;
#[path = "model/ops.rs"]
mod ops;
#[path = "model/pg.rs"]
mod pg;
#[path = "model/pg_restart.rs"]
mod pg_restart;
#[path = "model/redis.rs"]
mod redis;
#[path = "model/reference.rs"]
mod reference;
#[path = "model/run.rs"]
mod run;

#[allow(unused_imports)] // the regression tests name them
use ops::{Mode, Op, Part};
use run::Store;
use support::seeds;

/// The stores the model runs on.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    Memory,
    File,
    Redis,
    RedisLists,
    RedisCluster,
    Pg,
    PgRestart,
    #[cfg(feature = "etcd")]
    Etcd,
}

/// Opens a store of `kind`.
async fn open(kind: Kind) -> Box<dyn Store> {
    match kind {
        Kind::Memory => Box::new(local::Memory::open()),
        Kind::File => Box::new(local::Files::open()),
        Kind::Redis => Box::new(redis::Redis::standalone().await),
        Kind::RedisLists => Box::new(redis::Redis::standalone_with_lists().await),
        Kind::RedisCluster => Box::new(redis::Redis::cluster().await),
        Kind::Pg => Box::new(pg::Pg::open().await),
        Kind::PgRestart => Box::new(pg_restart::PgRestart::open().await),
        #[cfg(feature = "etcd")]
        Kind::Etcd => Box::new(etcd::Etcd::open().await),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
}

/// Runs `test`'s seeds on a store of `kind`.
fn check(kind: Kind, test: &str) {
    let runtime = runtime();
    runtime.block_on(async {
        let store = open(kind).await;
        for seed in seeds::seeds(test) {
            seeds::announce(test, seed);
            driver::check(&*store, test, seed).await;
        }
    });
}

/// Replays a shrunk sequence: no violation.
#[allow(dead_code)]
fn replay(kind: Kind, ops: &[Op]) {
    let runtime = runtime();
    runtime.block_on(async {
        let store = open(kind).await;
        if let (_, Some((at, violation))) = driver::replay_ops(&*store, ops).await {
            panic!("operation {at} ({:?}): {violation}", ops[at]);
        }
    });
}

#[test]
fn memory_answers_match_the_model() {
    check(Kind::Memory, "memory_answers_match_the_model");
}

#[test]
fn file_answers_match_the_model_with_its_files_removed() {
    check(
        Kind::File,
        "file_answers_match_the_model_with_its_files_removed",
    );
}

#[test]
fn redis_answers_match_the_model_under_operator_faults() {
    check(
        Kind::Redis,
        "redis_answers_match_the_model_under_operator_faults",
    );
}

#[test]
fn redis_with_list_queues_answers_match_the_model_under_operator_faults() {
    check(
        Kind::RedisLists,
        "redis_with_list_queues_answers_match_the_model_under_operator_faults",
    );
}

#[test]
fn redis_cluster_answers_match_the_model_under_operator_faults() {
    check(
        Kind::RedisCluster,
        "redis_cluster_answers_match_the_model_under_operator_faults",
    );
}

#[test]
fn pg_answers_match_the_model_under_operator_faults() {
    check(Kind::Pg, "pg_answers_match_the_model_under_operator_faults");
}

#[test]
fn pg_answers_match_the_model_across_server_restarts() {
    check(
        Kind::PgRestart,
        "pg_answers_match_the_model_across_server_restarts",
    );
}

#[cfg(feature = "etcd")]
#[test]
fn etcd_answers_match_the_model_with_its_keys_deleted() {
    check(
        Kind::Etcd,
        "etcd_answers_match_the_model_with_its_keys_deleted",
    );
}

/// A permit drawn by the shared and permit functions after the token
/// sequence was set back to 1 gets a token above the key's last one: the
/// functions' written-out draw is the lock statements' own, which takes a
/// sequence that far behind the clock for a lost one.
#[test]
fn pg_a_permit_drawn_after_the_sequence_was_set_back_gets_a_higher_token() {
    replay(
        Kind::Pg,
        &[
            Op::Acquire {
                p: 0,
                k: 2,
                o: 5,
                mode: Mode::Exclusive,
            },
            Op::Acquire {
                p: 2,
                k: 1,
                o: 1,
                mode: Mode::Permit,
            },
            Op::WriterWaits {
                p: 1,
                o: 7,
                reader: 8,
            },
            Op::TableLocked {
                table: 0,
                p: 2,
                k: 1,
                o: 9,
            },
            Op::Acquire {
                p: 0,
                k: 0,
                o: 10,
                mode: Mode::Exclusive,
            },
            Op::Release { k: 1, o: 3 },
            Op::Release { k: 2, o: 5 },
            Op::Release { k: 1, o: 9 },
            Op::Acquire {
                p: 1,
                k: 1,
                o: 11,
                mode: Mode::Permit,
            },
            Op::Release { k: 2, o: 5 },
            Op::Acquire {
                p: 0,
                k: 0,
                o: 12,
                mode: Mode::Shared,
            },
            Op::Rewind { k: 1, value: 1 },
            Op::Release { k: 2, o: 5 },
            Op::Held { p: 1 },
            Op::Release { k: 0, o: 8 },
            Op::Release { k: 1, o: 1 },
            Op::TableLocked {
                table: 1,
                p: 1,
                k: 1,
                o: 13,
            },
        ],
    );
}

/// A permit holder whose lease was broken by force, retried with its owner
/// id through the same process, is answered: its alive file, still locked
/// by that process, is let go of first instead of waited for forever with
/// the key's step locked for every process.
#[test]
fn file_a_permit_retried_after_its_lease_was_broken_is_answered() {
    replay(
        Kind::File,
        &[
            Op::Acquire {
                p: 0,
                k: 1,
                o: 0,
                mode: Mode::Permit,
            },
            Op::ForceRelease { p: 1, k: 1 },
            Op::Acquire {
                p: 0,
                k: 1,
                o: 0,
                mode: Mode::Permit,
            },
        ],
    );
}

/// A renewal that finds no lease changes nothing: a queued fair waiter
/// whose owner is renewed (answered false) keeps its place, and the
/// holder's release hands it the key (rule F2).
#[test]
fn file_a_failed_renewal_of_a_queued_waiter_keeps_its_place() {
    replay(
        Kind::File,
        &[
            Op::Acquire {
                p: 0,
                k: 2,
                o: 0,
                mode: Mode::Join,
            },
            Op::Acquire {
                p: 0,
                k: 2,
                o: 1,
                mode: Mode::Join,
            },
            Op::Extend { k: 2, o: 1 },
            Op::Release { k: 2, o: 0 },
        ],
    );
}

/// A permit's lock deleted by an operator leaves the key free, its slots'
/// record left over: a force release naming a holder finds nobody
/// (`NotHeld`), as `holder` does, and is not refused as one of permits.
#[test]
fn redis_a_force_release_beside_left_over_permit_slots_finds_the_key_free() {
    replay(
        Kind::Redis,
        &[
            Op::Acquire {
                p: 2,
                k: 1,
                o: 0,
                mode: Mode::Permit,
            },
            Op::Delete {
                k: 1,
                part: Part::Lock,
            },
            Op::ForceStale { p: 1, k: 1 },
        ],
    );
}

/// A retry of a fair caller's first try (`Respect`) by the owner that took
/// the key is a success (rule 3), even while a waiter of the same process
/// queues behind it.
#[test]
fn pg_a_fair_first_try_retried_by_its_holder_is_a_success() {
    replay(
        Kind::Pg,
        &[
            Op::Acquire {
                p: 0,
                k: 2,
                o: 0,
                mode: Mode::Join,
            },
            Op::Acquire {
                p: 0,
                k: 2,
                o: 1,
                mode: Mode::Join,
            },
            Op::Acquire {
                p: 0,
                k: 2,
                o: 0,
                mode: Mode::Respect,
            },
        ],
    );
}

/// An operator sets the key's counter back below a reader's token: the
/// reader is still read with its phase's token, and a force release naming
/// an older one breaks nothing.
#[test]
fn redis_a_counter_set_back_leaves_a_readers_token_and_a_stale_name_breaks_nothing() {
    counter_set_back_under(Mode::Shared);
}

/// The same for an exclusive holder, whose token is in its lock's value.
#[test]
fn redis_a_counter_set_back_leaves_a_holders_token_and_a_stale_name_breaks_nothing() {
    counter_set_back_under(Mode::Exclusive);
}

fn counter_set_back_under(mode: Mode) {
    replay(
        Kind::Redis,
        &[
            Op::Acquire {
                p: 1,
                k: 0,
                o: 94,
                mode,
            },
            Op::Rewind { k: 0, value: 0 },
            Op::Holder { p: 0, k: 0 },
            Op::ForceStale { p: 1, k: 0 },
            Op::ForceNamed { p: 2, k: 0 },
        ],
    );
}

/// An operator deletes the fair queue while two waiters queue: each of
/// them joins again at its next look (not only the first to look), so a
/// waiter that joins after they looked again is served after both.
#[test]
fn redis_every_fair_waiter_joins_again_after_its_queue_was_deleted() {
    let join = |o| Op::Acquire {
        p: 0,
        k: 2,
        o,
        mode: Mode::Join,
    };
    replay(
        Kind::Redis,
        &[
            join(0),
            join(1),
            join(2),
            Op::Delete {
                k: 2,
                part: Part::Queue,
            },
            join(3),
            Op::Release { k: 2, o: 0 },
            Op::Release { k: 2, o: 2 },
            Op::Release { k: 2, o: 1 },
            Op::Release { k: 2, o: 3 },
        ],
    );
}

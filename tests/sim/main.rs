//! A deterministic simulator of dlock's lock core.
//!
//! The lease lifecycle (acquisition with waiting, fair handoffs, shared
//! locks and permits, renewal, the lost signal, release and release on
//! drop, elections) runs on one current-thread runtime with a paused
//! clock, against the memory backend behind a fault layer (`store`): calls
//! held back, lost before or after the store applied them, refused; the
//! store losing its data, counter included; processes frozen past their
//! ttls and thawed; callers that give up half-way; a process's tasks
//! aborted. One seeded random source draws it all, so a seed is a
//! schedule, replayed bit for bit. `checks` says what every schedule must
//! keep.
//!
//! - `DLOCK_SIM_SEED=<seed>` replays one schedule and prints its trace.
//! - `DLOCK_SEED=<seed>` runs the bulk run from another base seed (the
//!   project's convention, `tests/support/seeds.rs`); CI's base seed is in
//!   `tests/seeds.txt`. `DLOCK_SIM_SCHEDULES=<n>` runs `n` schedules
//!   instead of 10,000.

#[path = "../support/mod.rs"]
mod support;

mod actors;
mod checks;
mod rng;
mod schedule;
mod store;
mod trace;
mod world;

use std::io::Write as _;
use std::time::Instant;

use support::seeds;
use trace::Record;

/// The schedules of one CI run.
const SCHEDULES: u64 = 10_000;

/// Says `text` on the test's stderr even when the harness captures
/// output, so the suite's log shows the summary of a green run too.
fn say(text: &str) {
    let _ = writeln!(std::io::stderr(), "{text}");
}

/// How to replay a schedule, and its trace.
fn replay_text(seed: u64) -> String {
    let outcome = schedule::run(seed, Record::Text);
    format!(
        "{}\nsim: seed {seed}: {} violations, trace digest {:016x} ({} lines)\n\
         replay it with: DLOCK_SIM_SEED={seed} cargo test --features axum,etcd --test sim every_schedule -- --nocapture",
        outcome.trace.unwrap_or_default(),
        outcome.violations.len(),
        outcome.digest,
        outcome.lines,
    )
}

#[test]
fn every_schedule_keeps_exclusion_rising_tokens_loss_notice_deadlines_and_cleanup() {
    if let Some(seed) = seeds::env_seed("DLOCK_SIM_SEED") {
        let outcome = schedule::run(seed, Record::Text);
        say(&replay_text(seed));
        assert!(
            outcome.violations.is_empty(),
            "seed {seed}: {:#?}",
            outcome.violations
        );
        return;
    }
    let base = seeds::seed("sim_schedules");
    let count = match std::env::var("DLOCK_SIM_SCHEDULES") {
        Ok(n) => n
            .trim()
            .parse()
            .expect("DLOCK_SIM_SCHEDULES must be a whole number"),
        Err(_) => SCHEDULES,
    };
    say(&format!(
        "sim: base seed {base} (DLOCK_SEED={base} repeats this run); schedule i has seed mix(base + i)"
    ));
    let started = Instant::now();
    let (mut steps, mut calls, mut off_thread, mut violations) = (0, 0, 0, 0);
    let mut first_failing = None;
    let mut counts = std::collections::BTreeMap::new();
    for i in 0..count {
        let seed = rng::mix(base.wrapping_add(i));
        let outcome = schedule::run(seed, Record::Nothing);
        steps += outcome.steps;
        calls += outcome.store_calls;
        off_thread += outcome.off_thread;
        violations += outcome.violations.len();
        for (what, n) in &outcome.counts {
            *counts.entry(*what).or_insert(0) += n;
        }
        if let Some(first) = outcome.violations.first() {
            say(&format!("sim: schedule {i}, seed {seed}: {first}"));
        }
        if !outcome.violations.is_empty() && first_failing.is_none() {
            first_failing = Some((seed, outcome.violations));
        }
    }
    say(&format!(
        "sim: {count} schedules in {:.1} s, {calls} store calls, {off_thread} refused off the simulated thread",
        started.elapsed().as_secs_f64()
    ));
    let counted: Vec<String> = counts
        .iter()
        .map(|(what, n)| format!("{n} {what}"))
        .collect();
    say(&format!("sim: {}", counted.join(", ")));
    say(&format!(
        "sim: {count} schedules, {steps} steps, {violations} violations"
    ));
    if let Some((seed, found)) = first_failing {
        say(&replay_text(seed));
        panic!(
            "sim: the schedule of seed {seed} broke a promise (its trace is above): {found:#?}\nreplay: DLOCK_SIM_SEED={seed}"
        );
    }
}

#[test]
fn schedules_that_once_broke_a_promise_now_keep_it() {
    for seed in seeds::seeds("sim_pinned") {
        let outcome = schedule::run(seed, Record::Nothing);
        if !outcome.violations.is_empty() {
            say(&replay_text(seed));
            panic!(
                "sim: pinned seed {seed} breaks a promise again: {:#?}",
                outcome.violations
            );
        }
    }
}

/// How many more schedules, after the named one, the digest test runs
/// twice and compares (digests only).
const TWICE_MORE: u64 = 200;

#[test]
fn one_seed_run_twice_gives_the_same_trace_digest() {
    let seed = seeds::env_seed("DLOCK_SIM_SEED").unwrap_or_else(|| seeds::seed("sim_digest"));
    seeds::announce("one_seed_run_twice_gives_the_same_trace_digest", seed);
    let first = schedule::run(seed, Record::Text);
    let second = schedule::run(seed, Record::Text);
    say(&format!(
        "sim: seed {seed} run twice: digests {:016x} and {:016x} ({} and {} lines)",
        first.digest, second.digest, first.lines, second.lines
    ));
    if first.trace != second.trace {
        let (a, b) = (
            first.trace.unwrap_or_default(),
            second.trace.unwrap_or_default(),
        );
        let at = a
            .lines()
            .zip(b.lines())
            .position(|(x, y)| x != y)
            .unwrap_or(0);
        let show = |text: &str| {
            text.lines()
                .skip(at.saturating_sub(3))
                .take(8)
                .collect::<Vec<_>>()
                .join("\n")
        };
        panic!(
            "the traces part at line {at}:\n--- first\n{}\n--- second\n{}",
            show(&a),
            show(&b)
        );
    }
    assert_eq!(first.digest, second.digest);
    let parted: Vec<u64> = (1..=TWICE_MORE)
        .map(|i| rng::mix(seed.wrapping_add(i)))
        .filter(|&seed| {
            schedule::run(seed, Record::Digest).digest != schedule::run(seed, Record::Digest).digest
        })
        .collect();
    say(&format!(
        "sim: {TWICE_MORE} more schedules run twice, {} with differing digests",
        parted.len()
    ));
    assert!(
        parted.is_empty(),
        "these seeds gave two different traces: {parted:?}"
    );
}

/// A runtime with a paused clock starts its clock at the real time,
/// behind the instants an earlier paused runtime advanced to. The core
/// once counted every lease's deadline from one process-wide instant,
/// taken on first use: taken late on an advanced clock, it lay in a later
/// runtime's future, and every lease taken there read as lost on arrival.
/// The simulator ran into it, each schedule on a runtime of its own.
#[test]
fn a_lease_on_a_paused_clock_behind_an_earlier_runtimes_clock_is_not_lost_on_arrival() {
    use std::sync::Arc;
    use std::time::Duration;

    use dlock::memory::MemoryBackend;
    use dlock::{Backend, LockOptions};

    let paused = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a current-thread runtime")
    };
    let take = |after: Duration| async move {
        tokio::time::sleep(after).await;
        let store: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
        let lease = LockOptions::new(Duration::from_secs(10))
            .acquire_on(store, "k")
            .await
            .expect("a free key");
        let lost = lease.is_lost();
        let _ = lease.release().await;
        lost
    };
    // A day ahead on the first clock, then from the real time again.
    assert!(!paused().block_on(take(Duration::from_secs(86_400))));
    assert!(
        !paused().block_on(take(Duration::ZERO)),
        "a lease taken on a fresh paused clock read as lost on arrival"
    );
}

/// The exclusion check excuses a believer whose grant the store lost with
/// its data. A lease whose token the store never granted at all (a core
/// that took a `Held` answer, or a stale grant, for its own) has no grant
/// of any epoch, and must be compared, not excused: `stale` is an `all`
/// over that lease's grants, true of none.
#[test]
fn exclusion_flags_a_believer_whose_token_the_store_never_granted() {
    use std::sync::Arc;
    use std::time::Duration;

    use dlock::backend::OwnerId;
    use dlock::memory::MemoryBackend;
    use dlock::{Backend, LockOptions};

    use crate::world::{Side, World};

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    runtime.block_on(async {
        let world = World::new(1, Record::Nothing);
        let take = || async {
            let store: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
            LockOptions::new(Duration::from_secs(10))
                .acquire_on(store, "k0")
                .await
                .expect("a free key")
        };
        // p0 holds k0 by a grant the simulated store recorded.
        let granted = take().await;
        let ttl = Duration::from_secs(10);
        let signal = granted.lost_signal();
        world.granted(
            0,
            "k0",
            &OwnerId::random().expect("owner bits"),
            signal.token(),
            Side::Exclusive,
            ttl,
        );
        world.hold(0, "k0", Side::Exclusive, signal, true, 0);
        // p1 believes it holds k0 too, by a token no grant recorded.
        let rogue = take().await;
        world.hold(1, "k0", Side::Exclusive, rogue.lost_signal(), true, 0);
        let violations = world.state().violations.clone();
        assert!(
            violations.iter().any(|v| v.contains("exclusion")),
            "two believers of k0, one never granted it, and no violation: {violations:?}"
        );
    });
}

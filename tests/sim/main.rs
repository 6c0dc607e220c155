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

use std::collections::BTreeMap;
use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

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
    let bulk = run_bulk(base, count);
    for (i, seed, first) in &bulk.failing {
        say(&format!("sim: schedule {i}, seed {seed}: {first}"));
    }
    let Bulk {
        steps,
        calls,
        off_thread,
        violations,
        ref counts,
        ..
    } = bulk;
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
    if let Some((_, seed, _)) = bulk.failing.first() {
        let found = schedule::run(*seed, Record::Nothing).violations;
        say(&replay_text(*seed));
        panic!(
            "sim: the schedule of seed {seed} broke a promise (its trace is above): {found:#?}\nreplay: DLOCK_SIM_SEED={seed}"
        );
    }
}

/// How long the bulk run waits for any schedule to end before it calls
/// the schedules still running hung: each takes milliseconds of processor
/// time, so a minute with none ended is a schedule that never ends (a
/// livelock on the paused clock), not a slow machine.
const HUNG_AFTER: Duration = Duration::from_secs(60);

/// The sums of a bulk run, and its failing schedules by index.
#[derive(Default)]
struct Bulk {
    steps: usize,
    calls: u64,
    off_thread: u64,
    violations: usize,
    counts: BTreeMap<&'static str, u64>,
    /// (index, seed, first violation) of each failing schedule, in order.
    failing: Vec<(u64, u64, String)>,
}

impl Bulk {
    fn add(&mut self, i: u64, seed: u64, outcome: schedule::Outcome) {
        self.steps += outcome.steps;
        self.calls += outcome.store_calls;
        self.off_thread += outcome.off_thread;
        self.violations += outcome.violations.len();
        for (what, n) in outcome.counts {
            *self.counts.entry(what).or_insert(0) += n;
        }
        if let Some(first) = outcome.violations.into_iter().next() {
            self.failing.push((i, seed, first));
        }
    }

    fn absorb(&mut self, other: Bulk) {
        self.steps += other.steps;
        self.calls += other.calls;
        self.off_thread += other.off_thread;
        self.violations += other.violations;
        for (what, n) in other.counts {
            *self.counts.entry(what).or_insert(0) += n;
        }
        self.failing.extend(other.failing);
    }
}

/// The (index, seed) of the schedule each thread runs now, for the report
/// of a hang.
type Running = Mutex<Vec<Option<(u64, u64)>>>;

/// Runs schedules `0..count` of `base`, two at once for each of the
/// machine's processors (at most four). Each schedule is a runtime and a
/// world of its own, so what it does depends on its seed alone, not on
/// which thread ran it or beside what; the sums and the failing schedules come out in index
/// order. A schedule that never ends fails the run with its seed.
fn run_bulk(base: u64, count: u64) -> Bulk {
    // Twice the processors (at most four): inside the suite the other
    // binaries and cargo keep the processors busy, and the scheduler
    // shares them out by thread, so two threads a processor keep the
    // simulator's share; alone, the extra threads only wait their turn.
    let threads = std::thread::available_parallelism().map_or(2, |n| (2 * n.get()).min(4));
    let next = Arc::new(AtomicU64::new(0));
    let running: Arc<Running> = Arc::new(Mutex::new(vec![None; threads]));
    let (done, ended) = mpsc::channel();
    for t in 0..threads {
        let (next, running, done) = (Arc::clone(&next), Arc::clone(&running), done.clone());
        std::thread::spawn(move || {
            let mut bulk = Bulk::default();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                let seed = rng::mix(base.wrapping_add(i));
                running.lock().expect("running")[t] = Some((i, seed));
                bulk.add(i, seed, schedule::run(seed, Record::Nothing));
                running.lock().expect("running")[t] = None;
                let _ = done.send(None);
            }
            let _ = done.send(Some(bulk));
        });
    }
    drop(done);
    let mut total = Bulk::default();
    let mut finished = 0;
    while finished < threads {
        match ended.recv_timeout(HUNG_AFTER) {
            Ok(None) => {}
            Ok(Some(bulk)) => {
                finished += 1;
                total.absorb(bulk);
            }
            Err(_) => {
                let hung: Vec<String> = running
                    .lock()
                    .expect("running")
                    .iter()
                    .flatten()
                    .map(|(i, seed)| format!("schedule {i}, seed {seed}"))
                    .collect();
                panic!(
                    "sim: no schedule ended in {HUNG_AFTER:?}; still running: {hung:?} \
                     (replay one with DLOCK_SIM_SEED=<seed>)"
                );
            }
        }
    }
    total.failing.sort_by_key(|(i, _, _)| *i);
    total
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

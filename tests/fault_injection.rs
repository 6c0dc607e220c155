//! The fault-injection suite: five worker processes take one lock through
//! `#[distributed_lock]` and increment a fenced register under it, while a
//! seeded driver pauses holders past the ttl (SIGSTOP/SIGCONT), kills and
//! restarts them (SIGKILL), breaks the lock on the server's side, cuts
//! workers off behind loopback proxies, has workers give up on acquisitions
//! mid-flight and sets the lock store's token source back. The checker then
//! proves that no stale write was accepted, accepted tokens rose strictly
//! (along the accepted writes, and within every worker process) and no
//! increment was lost — and counts the moments two workers both believed
//! they held the lock, to show that fencing, not the lock, kept the data
//! safe.
//!
//! | run | locks | register | server-side fault | partition | rewind |
//! | --- | --- | --- | --- | --- | --- |
//! | file | `FileBackend`, own directory | PostgreSQL row (`PgFence`) | `force_release` of the held key | the holder's link to the register | none (a durable counter file) |
//! | redis | `RedisBackend`, own redis-server | PostgreSQL row (`PgFence`) | server restart, data lost | the holder's link to redis | `SET dlock:{<key>}:fence 1` |
//! | pg | `PgBackend`, shared PostgreSQL, schema `dlock_fault_<id>` of the run's own (dropped at the end) | Redis hash (`RedisFence`) | `pg_terminate_backend` of the holder's session | the holder's link to PostgreSQL | seeded: `setval(<schema>.dlock_token_seq, 1)` and every lock session of the workers terminated, or the sequence dropped and recreated |
//! | etcd (feature `etcd`; lock and election runs, no fair mode) | `EtcdBackend`, a three-member cluster of the run's own, each worker through its proxy to one member | PostgreSQL row (`PgFence`) | SIGKILL of the cluster's leader, started again after the fault's length | the holder's link to its member | none (the token is the cluster's revision) |
//!
//! Every run also drives the abandon fault: a worker makes its next 4 to 8
//! acquisitions through `LockOptions::acquire` (the macro's key, ttl and
//! wait) and gives up on each after a seeded 0–1 ms; one that completes
//! first is released at once. It hits when at least one attempt was given
//! up mid-flight. Every fault kind of a run's list must hit at least once.
//!
//! Memory locks cannot span processes, so the multi-process run of
//! "memory/file" uses the file backend (`tests/fence.rs` plays the article's
//! timeline on memory locks and a `FencedCell`).
//!
//! The election scenario runs on the same stores, register and driver: the
//! workers campaign in one election with `Election::lead` (the lock's key
//! names it), each with an identity of its own, and the leader increments
//! the register step after step under its term's token, checking its term
//! before every read and write (`fault::election`). The driver pauses
//! leaders past the ttl, kills and restarts them, breaks their lock on the
//! server's side and partitions them, as in the lock runs. Besides the
//! lock runs' checks, the checker proves that every leader paused past its
//! ttl and deposed meanwhile learned of its loss after resuming (a `LOST`
//! line, from `Term::check` or the lost signal) before any write of its own
//! got through, that every write it still attempted (the one it had on its
//! way is sent anyway) was refused by the fence, and that no two terms'
//! accepted writes interleave.
//!
//! The fair scenario runs the lock scenario's workers, faults and checks
//! with the lock taken in fair mode: `#[distributed_lock(fair = true, wait
//! = "8s")]` around the same body, and fair abandon rounds (a fair waiter
//! given up on mid-flight leaves the queue). Waiters queue in arrival order
//! and a release hands the key to the first. Every acquisition that waited
//! its whole 8 s and timed out prints its wait's window, and the checker
//! adds, for each one that overlaps no fault on the store's side and no
//! pause or partition of the waiter itself: the key was held for most of
//! the wait. The free time (no lease covering the key, a lease whose
//! holder was killed, stopped, cut off or lost counted to its last word
//! plus the time the store keeps a silent holder's key) stays within what
//! the queue's rules allow: a refresh (1 s, `QUEUE_ENTRY_TTL / 3`) for the
//! wait and for each lease that ran out in it, and for each other waiter
//! that vanished near it, an entry's life (3 s), a handoff to it (at most
//! the ttl; PostgreSQL: until the server ends the idle session), and a
//! refresh; half a second more for the rest. With no fault near, 1.5 s of
//! an 8 s wait (`fault::check::FairVerdict`). The report gives how many
//! acquisitions timed out and the largest free time seen, and the same
//! figures for the waits that got the key (judged alike, not asserted).
//! The checker's unit tests show the check failing on a history where a
//! waiter timed out with the key free.
//!
//! | run | locks | waits | checked besides the lock runs' checks |
//! | --- | --- | --- | --- |
//! | fair file, redis, pg | as the lock run on that store, `fair = true` | 8 s, in arrival order | every timed-out wait not excused by a fault had the key held but for the free time the queue's rules allow |
//!
//! The permits and read-write scenarios run the lock scenario's workers,
//! faults and checks on a key that admits more than one holder
//! (`fault::modes`). Permits: each lease takes one of `PERMITS` (2)
//! permits (`LockOptions::permits`, the macro's `permits = 2`: the body
//! needs the lease's slot, which the macro does not bind) and increments
//! its slot's own fenced register, `<run>:pool:<slot>`, since a permit's
//! token rises per slot. The checker runs the lock checks slot by slot
//! and, over all slots, counts for every moment the holders (worker,
//! token, slot) whose fenced writes were accepted within their lease —
//! from the accepted read's answer to the sending of the accepted write,
//! the part of the window the history proves — and asserts at most
//! `PERMITS`, and at least two at some moment (the permits were shared).
//! Read-write: each lease is a writer (`#[distributed_lock]`, an
//! increment) or a reader (`mode = "shared"`: two fenced touches of the
//! register, reads that record the reader's token under the same `>=`
//! rule) at random. The lock checks cover the writers with the readers'
//! tokens in them (a writer's write accepted below a token the register
//! had answered, a writer's or a read phase's, is a stale write accepted),
//! and no current reader may be refused: a reader's refusal must come from
//! a writer's higher token, or follow something that can end its lease
//! (its lost signal, a pause or partition of it or a fault on the store's
//! side since its `BEGIN`, or half a ttl gone since then, a starved
//! process's lease running out); any other refusal is a violation
//! (`fault::modes::ReadWriteVerdict`). The checker's unit tests show each
//! check failing: three holders accepted at once with two permits, a stale
//! write accepted on one slot, a stale writer accepted after a reader, a
//! current reader refused.
//!
//! | run | locks | register | checked besides the lock runs' checks |
//! | --- | --- | --- | --- |
//! | permits file, redis, pg | as the lock run on that store, `permits(2)`, the lock run's faults | one fenced resource per slot, `<run>:pool:<slot>`, on the lock run's register | per slot: no stale write, tokens rising, no lost increment; at most 2 holders with accepted writes at any moment, every slot in `0..2` |
//! | read-write file, redis, pg | as the lock run on that store, writers `mode = "exclusive"` and readers `mode = "shared"`, the lock run's faults | the lock run's | no stale writer's write accepted past a reader's or writer's higher token; no current reader refused |
//!
//! A store that keeps shared locks and permits is one line of the run list
//! (`+ Lock::File => <permits run>, <read-write run>;` in `fault_runs!`).
//!
//! Each short lock run lasts 60 s, each election, fair, permits and
//! read-write run 30 s. The
//! runs of the binary overlap (`fault::overlap`): the first run test to
//! start launches every run test's run that the command line selects (its
//! filters, `--exact` and `--skip` read as libtest reads them), each in a
//! thread of its own, eight at a time (their PostgreSQL connections stay
//! under the server's default 100), and every run test waits for its own
//! run's report, so the whole binary takes about the sum of its runs over
//! eight rather than over libtest's threads; `DLOCK_FAULT_OVERLAP=<n>`
//! sets how many runs go at once. A test's run prints its schedule and
//! report when that test gets it (at once with `--nocapture`).
//!
//! Each run test runs the seeds `tests/seeds.txt` lists for it (see
//! `support::seeds`: `DLOCK_SEED=<seed>` replays one, `DLOCK_FRESH_SEEDS=<n>`
//! adds fresh ones); the seed is printed with the schedule, and
//! `DLOCK_FAULT_SEED=<seed>` replays the same fault schedule too. A kind of
//! fault that did not hit is injected again, up to `fault::run::RETRIES`
//! times. `DLOCK_FAULT_SECS` sets the length of every run. The long runs
//! (`DLOCK_FAULT_SCENARIO`: `lock`, the default, `election`, `fair`,
//! `permits` or `rw`):
//!
//! ```sh
//! DLOCK_FAULT_BACKEND=redis DLOCK_FAULT_SECS=600 DLOCK_FAULT_SEED=42 \
//!   cargo test --test fault_injection -- --ignored --exact long_run --nocapture
//! DLOCK_FAULT_SCENARIO=election DLOCK_FAULT_BACKEND=pg DLOCK_FAULT_SECS=600 \
//!   cargo test --test fault_injection -- --ignored --exact long_run --nocapture
//! DLOCK_FAULT_SCENARIO=fair DLOCK_FAULT_BACKEND=file DLOCK_FAULT_SECS=600 \
//!   cargo test --test fault_injection -- --ignored --exact long_run --nocapture
//! DLOCK_FAULT_SCENARIO=permits DLOCK_FAULT_BACKEND=pg DLOCK_FAULT_SECS=600 \
//!   cargo test --test fault_injection -- --ignored --exact long_run --nocapture
//! DLOCK_FAULT_SCENARIO=rw DLOCK_FAULT_BACKEND=file DLOCK_FAULT_SECS=600 \
//!   cargo test --test fault_injection -- --ignored --exact long_run --nocapture
//! ```

#[cfg(feature = "etcd")]
mod etcd_support;
mod fault;
mod redis_support;
mod support;

use fault::overlap;
use fault::run::{Fault, Lock, Register, Report, Settings, run};
use fault::worker::PERMITS;

/// How long a short lock run lasts unless `DLOCK_FAULT_SECS` says otherwise.
const SHORT_RUN_SECS: u64 = 60;
/// How long a short election run lasts unless `DLOCK_FAULT_SECS` says
/// otherwise.
const SHORT_ELECTION_RUN_SECS: u64 = 30;
/// How long a short fair run lasts unless `DLOCK_FAULT_SECS` says
/// otherwise.
const SHORT_FAIR_RUN_SECS: u64 = 30;
/// How long a short permits or read-write run lasts unless
/// `DLOCK_FAULT_SECS` says otherwise.
const SHORT_MODE_RUN_SECS: u64 = 30;

/// The child side: a worker process (see `fault::worker`). Ignored in
/// normal runs; the harness starts the test binary as
/// `fault_worker_entry --exact --ignored` with the worker's configuration.
#[test]
#[ignore = "runs only as a worker process of the fault runs"]
fn fault_worker_entry() {
    let Ok(spec) = std::env::var(fault::worker::WORKER_ENV) else {
        return;
    };
    let config = fault::worker::Config::decode(&spec).expect("worker configuration");
    fault::worker::main(config);
}

/// Every kind of fault of the run's list hit at least once.
fn assert_every_fault_hit(report: &Report) {
    for &kind in &report.settings.faults {
        assert!(
            report.hits(kind) >= 1,
            "no {kind} fault hit (seed {}): {:?}",
            report.settings.seed,
            report.injected
        );
    }
}

/// The acceptance of a fenced run: every kind of fault of the run's list
/// hit at least once, and the checker found nothing.
fn assert_fenced_run_is_safe(report: &Report) {
    assert_every_fault_hit(report);
    // Pauses past the ttl made two workers believe they held the lock at
    // once: the lock alone did not keep the register right, the fence did.
    assert!(
        report.verdict.double_belief > 0,
        "a pause past the ttl should have let another worker in: {report}"
    );
    assert!(
        report.verdict.writes_accepted > 0,
        "no write was accepted at all: {report}"
    );
    assert!(
        report.verdict.is_safe(),
        "seed {}: {:?}",
        report.settings.seed,
        report.verdict.violations
    );
    assert_eq!(report.verdict.stale_writes_accepted, 0);
}

/// The acceptance of a fair run: a fenced run's, and no waiter that timed
/// out did so while the key lay free longer than the queue's rules allow.
fn assert_fair_run_is_safe(report: &Report) {
    // A store without fair mode refuses every fair acquisition: say so
    // first, rather than as a fault that never hit.
    assert!(
        report.verdict.leases > 0,
        "no worker ever held the lock in fair mode: {report}"
    );
    assert_fenced_run_is_safe(report);
    let fair = report
        .verdict
        .fair
        .as_ref()
        .expect("a fair run has a fair verdict");
    assert_eq!(
        fair.starved, 0,
        "a waiter timed out while the key lay free: {report}"
    );
}

/// The acceptance of a permits run: a fenced run's, slot by slot (no
/// stale write accepted on any slot, tokens rising per slot, no increment
/// lost; a pause past the ttl let another worker into the paused holder's
/// slot), no lease of a slot outside `0..PERMITS`, and at no moment more
/// holders with accepted fenced writes than permits — while at some moment
/// more than one had (the permits were shared, not taken one at a time).
fn assert_permits_run_is_safe(report: &Report) {
    assert!(
        report.verdict.leases > 0,
        "no worker ever held a permit: {report}"
    );
    assert_fenced_run_is_safe(report);
    let permits = report
        .verdict
        .permits
        .as_ref()
        .expect("a permits run has a permits verdict");
    assert_eq!(
        (permits.over_the_bound, permits.out_of_range),
        (0, 0),
        "more holders than permits, or a slot out of range: {report}"
    );
    assert!(permits.max_concurrent <= PERMITS as usize, "{report}");
    assert!(
        permits.max_concurrent >= 2,
        "no two permit holders ever had writes accepted at once: {report}"
    );
}

/// The acceptance of a read-write run: a fenced run's over writers and
/// readers (no write of a stale writer accepted — below a token the
/// register had answered, a writer's or a read phase's —, no increment
/// lost; a pause past the ttl let another worker in beside a holder it
/// excludes), both sides took the key, and no current reader was refused
/// (`fault::modes::ReadWriteVerdict` says which refusals are the fence's
/// work).
fn assert_read_write_run_is_safe(report: &Report) {
    assert_fenced_run_is_safe(report);
    let rw = report
        .verdict
        .read_write
        .as_ref()
        .expect("a read-write run has a read-write verdict");
    assert!(
        rw.reader_leases > 0 && rw.writer_leases > 0 && rw.reads_accepted > 0,
        "readers and writers must both have held the key: {report}"
    );
    assert_eq!(
        rw.current_readers_refused, 0,
        "a current reader was refused: {report}"
    );
}

/// The acceptance of an election run: every kind of fault hit, a pause
/// past the ttl deposed a leader at least once, every deposed leader was
/// told after resuming, and the checker found nothing (no write of a
/// deposed leader accepted, no stale write, no lost increment, no two
/// terms writing at once).
fn assert_election_run_is_safe(report: &Report) {
    assert_every_fault_hit(report);
    let election = report
        .verdict
        .election
        .as_ref()
        .expect("an election run has an election verdict");
    assert!(
        election.deposed_by_pause >= 1,
        "no pause past the ttl let another campaigner win the term of the leader it stopped: {report}"
    );
    assert_eq!(
        election.noticed_lost + election.killed_before_noticing,
        election.deposed_by_pause,
        "every deposed leader learns of its loss after resuming: {report}"
    );
    // Paused between its read and its write, a leader resumes with a write
    // on its way, and sends it: the fence must refuse it.
    assert!(
        election.deposed_writes_refused >= 1,
        "no deposed leader's write was refused: {report}"
    );
    assert!(
        report.verdict.writes_accepted > 0,
        "no write was accepted at all: {report}"
    );
    assert!(
        report.verdict.is_safe(),
        "seed {}: {:?}",
        report.settings.seed,
        report.verdict.violations
    );
    assert_eq!(
        (
            election.deposed_writes_accepted,
            report.verdict.stale_writes_accepted,
            election.terms_overlapping
        ),
        (0, 0, 0)
    );
}

/// The election checks can fail: with leaders that ignore their term and
/// the fence off, a leader paused past its ttl resumes without noticing
/// its loss, and the write it had on its way lands on top of its
/// successor's; the checker reports both.
fn assert_election_checker_caught_a_deposed_leaders_write(report: &Report) {
    let election = report
        .verdict
        .election
        .as_ref()
        .expect("an election run has an election verdict");
    assert!(
        election.deposed_by_pause >= 1,
        "no pause deposed a leader: {report}"
    );
    assert!(
        election.unnoticed >= 1,
        "a leader that ignores its term never records its loss, and the checker must see it: {report}"
    );
    assert!(
        election.deposed_writes_accepted >= 1
            && report.verdict.stale_writes_accepted > 0
            && !report.verdict.is_safe(),
        "without fencing a deposed leader's write must get through, and the checker must see it: {report}"
    );
}

/// The checker can fail: with the fence switched off (plain reads and
/// writes of the register) and holders paused past the ttl mid-update, a
/// stale write is accepted and an increment lost, and the checker says so.
fn assert_checker_caught_a_stale_write(report: &Report) {
    assert!(report.hits(Fault::Pause) >= 1, "no pause hit a holder");
    assert!(
        !report.verdict.is_safe() && report.verdict.stale_writes_accepted > 0,
        "without fencing a paused holder's stale write must get through, and the checker must see it: {report}"
    );
}

/// The binary's run tests: each `name: settings => acceptance;` is a
/// `#[test] fn name` asserting `acceptance` on the report of a run of
/// `settings`, and an entry of the table `RUNS` from which `fault::overlap`
/// launches the selected runs together (the test's name, spelled once,
/// names both). Each `+ store => permits_name, read_write_name;` after
/// them is the permits run and the read-write run on that store (its lock
/// runs' faults, `SHORT_MODE_RUN_SECS`), under those two names.
macro_rules! fault_runs {
    (
        $($(#[$attr:meta])* $(@$feature:literal)? $name:ident: $settings:expr => $accept:ident;)*
        $(+ $store:expr => $permits:ident, $read_write:ident;)*
    ) => {
        /// Every run test of the binary, for `fault::overlap`.
        const RUNS: &[overlap::Entry] = &[$(
            #[cfg(all($(feature = $feature)?))]
            overlap::Entry {
                name: stringify!($name),
                settings: || $settings,
            },
        )* $(
            overlap::Entry {
                name: stringify!($permits),
                settings: || Settings::from_env($store, SHORT_MODE_RUN_SECS).permits(),
            },
            overlap::Entry {
                name: stringify!($read_write),
                settings: || Settings::from_env($store, SHORT_MODE_RUN_SECS).read_write(),
            },
        )*];
        $(
            $(#[$attr])*
            #[cfg(all($(feature = $feature)?))]
            #[test]
            fn $name() {
                for report in overlap::report(stringify!($name), RUNS) {
                    $accept(&report);
                }
            }
        )*
        $(
            #[test]
            fn $permits() {
                for report in overlap::report(stringify!($permits), RUNS) {
                    assert_permits_run_is_safe(&report);
                }
            }

            #[test]
            fn $read_write() {
                for report in overlap::report(stringify!($read_write), RUNS) {
                    assert_read_write_run_is_safe(&report);
                }
            }
        )*
    };
}

fault_runs! {
    file_locks_under_pauses_kills_breaks_partitions_and_abandons_accept_no_stale_write:
        Settings::from_env(Lock::File, SHORT_RUN_SECS) => assert_fenced_run_is_safe;

    redis_locks_under_pauses_kills_restarts_partitions_abandons_rewinds_accept_no_stale_write:
        Settings::from_env(Lock::Redis, SHORT_RUN_SECS) => assert_fenced_run_is_safe;

    pg_locks_under_pauses_kills_terminations_partitions_abandons_rewinds_accept_no_stale_write:
        Settings::from_env(Lock::Pg, SHORT_RUN_SECS) => assert_fenced_run_is_safe;

    fair_file_locks_under_pauses_kills_breaks_partitions_and_abandons_accept_no_stale_write_and_time_out_no_waiter_on_a_free_key:
        Settings::from_env(Lock::File, SHORT_FAIR_RUN_SECS).fair() => assert_fair_run_is_safe;

    fair_redis_locks_under_pauses_kills_restarts_partitions_abandons_rewinds_accept_no_stale_write_and_time_out_no_waiter_on_a_free_key:
        Settings::from_env(Lock::Redis, SHORT_FAIR_RUN_SECS).fair() => assert_fair_run_is_safe;

    fair_pg_locks_under_pauses_kills_terminations_partitions_abandons_rewinds_accept_no_stale_write_and_time_out_no_waiter_on_a_free_key:
        Settings::from_env(Lock::Pg, SHORT_FAIR_RUN_SECS).fair() => assert_fair_run_is_safe;

    /// etcd (feature `etcd`): a three-member cluster of the run's own;
    /// the server-side fault kills its leader, and no rewind (the token is
    /// the cluster's revision).
    @"etcd" etcd_locks_under_pauses_kills_leader_kills_partitions_and_abandons_accept_no_stale_write:
        Settings::from_env(Lock::Etcd, SHORT_RUN_SECS) => assert_fenced_run_is_safe;

    @"etcd" etcd_election_under_pauses_kills_leader_kills_partitions_tells_and_fences_off_deposed_leaders:
        Settings::from_env(Lock::Etcd, SHORT_ELECTION_RUN_SECS).election()
            => assert_election_run_is_safe;

    file_election_under_pauses_kills_breaks_partitions_tells_and_fences_off_deposed_leaders:
        Settings::from_env(Lock::File, SHORT_ELECTION_RUN_SECS).election()
            => assert_election_run_is_safe;

    redis_election_under_pauses_kills_restarts_partitions_tells_and_fences_off_deposed_leaders:
        Settings::from_env(Lock::Redis, SHORT_ELECTION_RUN_SECS).election()
            => assert_election_run_is_safe;

    pg_election_under_pauses_kills_terminations_partitions_tells_and_fences_off_deposed_leaders:
        Settings::from_env(Lock::Pg, SHORT_ELECTION_RUN_SECS).election()
            => assert_election_run_is_safe;

    /// The election checks can fail (see the acceptance).
    with_fencing_off_and_terms_ignored_the_election_checker_catches_a_deposed_leaders_write: {
        let mut settings = Settings::from_env(Lock::File, 20).election();
        settings.register = Register::Redis;
        settings.fenced = false;
        settings.heeds_term = false;
        settings.faults = vec![Fault::Pause];
        settings
    } => assert_election_checker_caught_a_deposed_leaders_write;

    /// The checker can fail (see the acceptance).
    with_fencing_off_the_checker_catches_an_accepted_stale_write: {
        let mut settings = Settings::from_env(Lock::File, 20);
        settings.register = Register::Redis;
        settings.fenced = false;
        settings.faults = vec![Fault::Pause];
        settings
    } => assert_checker_caught_a_stale_write;

    // Permits (`permits = 2`, a fenced register per slot) and read-write
    // (`mode = "exclusive"` writers, `mode = "shared"` readers) runs, one
    // line per store that keeps both.
    + Lock::File => file_permits_under_pauses_kills_breaks_partitions_and_abandons_accept_no_stale_write_and_no_more_holders_than_permits, file_read_write_locks_under_pauses_kills_breaks_partitions_and_abandons_accept_no_stale_writer_and_refuse_no_current_reader;
    + Lock::Redis => redis_permits_under_pauses_kills_restarts_partitions_abandons_rewinds_accept_no_stale_write_and_no_more_holders_than_permits, redis_read_write_locks_under_pauses_kills_restarts_partitions_abandons_rewinds_accept_no_stale_writer_and_refuse_no_current_reader;
    + Lock::Pg => pg_permits_under_pauses_kills_terminations_partitions_abandons_rewinds_accept_no_stale_write_and_no_more_holders_than_permits, pg_read_write_locks_under_pauses_kills_terminations_partitions_abandons_rewinds_accept_no_stale_writer_and_refuse_no_current_reader;
}

/// The long run: `DLOCK_FAULT_SCENARIO` (lock, election, fair, permits,
/// rw; default lock), `DLOCK_FAULT_BACKEND` (file, redis, pg; default redis),
/// `DLOCK_FAULT_SECS` (default 600), `DLOCK_FAULT_SEED` (default random,
/// printed).
#[test]
#[ignore = "the long run; see the module docs for the command"]
fn long_run() {
    let lock = match std::env::var("DLOCK_FAULT_BACKEND").as_deref() {
        Ok("file") => Lock::File,
        Ok("pg") => Lock::Pg,
        #[cfg(feature = "etcd")]
        Ok("etcd") => Lock::Etcd,
        Ok("redis") | Err(_) => Lock::Redis,
        Ok(other) => panic!("DLOCK_FAULT_BACKEND must be file, redis or pg, not {other:?}"),
    };
    let settings = Settings::from_env(lock, 600);
    match std::env::var("DLOCK_FAULT_SCENARIO").as_deref() {
        Ok("lock") | Err(_) => assert_fenced_run_is_safe(&run(settings)),
        Ok("election") => assert_election_run_is_safe(&run(settings.election())),
        Ok("fair") => assert_fair_run_is_safe(&run(settings.fair())),
        Ok("permits") => assert_permits_run_is_safe(&run(settings.permits())),
        Ok("rw") => assert_read_write_run_is_safe(&run(settings.read_write())),
        Ok(other) => panic!(
            "DLOCK_FAULT_SCENARIO must be lock, election, fair, permits or rw, not {other:?}"
        ),
    }
}

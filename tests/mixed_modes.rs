//! Shared locks and permits mixed with writers on the backends that span
//! processes, file and PostgreSQL, each test run on both: many processes
//! (this test binary re-run as children) and many tasks of one process
//! mixing readers, writers and permit holders with random cancellations
//! and SIGKILLs keep every invariant; readers flow again once a waiting
//! writer gives up; a writer that only tries never holds readers off; a
//! writer is not starved by readers of four processes. What one backend
//! shows alone is in its binary (`tests/file/modes.rs`,
//! `tests/pg/modes.rs`).

mod support;

use std::sync::Arc;
use std::time::Duration;

use dlock::backend::QUEUE_ENTRY_TTL;
use dlock::pg::PgBackend;
use dlock::{Backend, LockError, LockMode, LockOptions};
use dlock_runtime::conformance::fresh_key;

fn conn() -> String {
    std::env::var("DLOCK_PG_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".to_owned())
}
// ---------------------------------------------------------------------------
// Many processes mixing readers, writers and permit holders on one key each,
// with random cancellations and SIGKILLs; the invariants are checked from a
// log of grants and releases (a grant is logged after it is granted and a
// release before it is sent, so each logged interval lies within the hold).

const CHILD_ROLE: &str = "DLOCK_REVIEW_MODES_CHILD";

#[test]
#[ignore = "only run as a child process by the tests of this file"]
fn child_process_entry() {
    let Some((runtime, parts)) = support::child_role(CHILD_ROLE) else {
        return;
    };
    runtime.block_on(mix_child(parts));
}

async fn child_backend(kind: &str, dir: &str) -> Arc<dyn Backend> {
    match kind {
        "pg" => {
            // A server shared with other tests: one lock session, and a
            // retry while it has no connection to spare.
            let mut tries = 0;
            loop {
                match PgBackend::connect_with(&conn(), dlock::pg::PgOptions::new().sessions(1))
                    .await
                {
                    Ok(pg) => break Arc::new(pg),
                    Err(err) if tries < 50 => {
                        tries += 1;
                        let _ = err;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(err) => panic!("connect: {err}"),
                }
            }
        }
        _ => Arc::new(dlock::file::FileBackend::open(dir).expect("open the lock directory")),
    }
}

struct Rng(u64);
impl Rng {
    /// A generator for `seed` (xorshift: any seed but 0, which stays 0).
    fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    /// The seed of the `n`th of the things seeded from `seed` (a child
    /// process, a task): apart for each `n`.
    fn derive(seed: u64, n: u64) -> u64 {
        seed ^ (n + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos()
}

fn log_line(log: &std::path::Path, line: &str) {
    use std::io::Write as _;
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(log)
        .expect("log");
    file.write_all(format!("{line}\n").as_bytes())
        .expect("log write");
}

async fn mix_child(parts: Vec<String>) {
    if parts[0] == "read-stream" {
        return read_stream_child(&parts[1..]).await;
    }
    let [role, kind, dir, rw_key, permit_key, log, seconds, seed] = &parts[..] else {
        panic!("mix role: KIND DIR RWKEY PKEY LOG SECONDS SEED, got {parts:?}");
    };
    assert_eq!(role, "mix");
    let backend = child_backend(kind, dir).await;
    let until = std::time::Instant::now() + Duration::from_secs(seconds.parse().expect("seconds"));
    mix_loop(
        backend,
        rw_key.clone(),
        permit_key.clone(),
        std::path::PathBuf::from(log),
        until,
        std::process::id(),
        seed.parse().expect("seed"),
    )
    .await;
}

/// Random readers, writers and permit holders until `until`, each attempt
/// cancelled at a random point, each grant and release logged as `pid`'s;
/// every choice drawn from `seed`.
async fn mix_loop(
    backend: Arc<dyn Backend>,
    rw_key: String,
    permit_key: String,
    log: std::path::PathBuf,
    until: std::time::Instant,
    pid: u32,
    seed: u64,
) {
    let mut rng = Rng::new(seed);
    while std::time::Instant::now() < until {
        let pick = rng.next(10);
        let (what, key, options) = match pick {
            0..=4 => (
                "read",
                &rw_key,
                LockOptions::new(Duration::from_secs(5)).mode(LockMode::Shared),
            ),
            5..=6 => ("write", &rw_key, LockOptions::new(Duration::from_secs(5))),
            _ => (
                "permit",
                &permit_key,
                LockOptions::new(Duration::from_secs(5)).permits(2),
            ),
        };
        let wait = Duration::from_millis(rng.next(4) * 100);
        let options = options.wait(wait);
        let cancel_after = Duration::from_millis(rng.next(400) + 1);
        let acquired = tokio::time::timeout(
            cancel_after,
            options.acquire_on(backend.clone(), key.as_str()),
        )
        .await;
        let Ok(Ok(lease)) = acquired else {
            continue;
        };
        let slot = lease.slot().map_or(-1, i64::from);
        log_line(
            &log,
            &format!("G {what} {} {slot} {pid} {}", lease.token().get(), now_ns()),
        );
        tokio::time::sleep(Duration::from_millis(rng.next(30))).await;
        let lost = lease.is_lost();
        log_line(
            &log,
            &format!(
                "R {what} {} {slot} {pid} {} {lost}",
                lease.token().get(),
                now_ns()
            ),
        );
        if rng.next(2) == 0 {
            let _ = lease.release().await;
        } else {
            drop(lease);
        }
    }
}

#[derive(Debug, Clone)]
struct Interval {
    what: String,
    token: u64,
    slot: i64,
    #[allow(dead_code)] // in the Debug of a violation
    pid: u32,
    start: u128,
    end: u128,
}

fn check_log(text: &str) -> (Vec<Interval>, Vec<String>) {
    use std::collections::HashMap;
    let mut open: HashMap<u32, Interval> = HashMap::new();
    let mut done = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        match f[0] {
            "G" => {
                let pid: u32 = f[4].parse().unwrap();
                open.insert(
                    pid,
                    Interval {
                        what: f[1].to_owned(),
                        token: f[2].parse().unwrap(),
                        slot: f[3].parse().unwrap(),
                        pid,
                        start: f[5].parse().unwrap(),
                        end: u128::MAX,
                    },
                );
            }
            "R" => {
                let pid: u32 = f[4].parse().unwrap();
                if let Some(mut i) = open.remove(&pid) {
                    i.end = f[5].parse().unwrap();
                    done.push(i);
                }
            }
            "K" => {
                let pid: u32 = f[1].parse().unwrap();
                if let Some(mut i) = open.remove(&pid) {
                    i.end = f[2].parse().unwrap();
                    done.push(i);
                }
            }
            _ => {}
        }
    }
    done.extend(open.into_values());
    let mut bad = Vec::new();
    let overlap = |a: &Interval, b: &Interval| a.start < b.end && b.start < a.end;
    let rw: Vec<&Interval> = done.iter().filter(|i| i.what != "permit").collect();
    for a in &rw {
        for b in &rw {
            if std::ptr::eq(*a, *b) {
                continue;
            }
            if overlap(a, b) {
                if a.what == "write" || b.what == "write" {
                    bad.push(format!("overlap with a writer: {a:?} {b:?}"));
                } else if a.token != b.token {
                    bad.push(format!("overlapping readers with two tokens: {a:?} {b:?}"));
                }
            } else if b.start < a.start && a.what == "write" && a.token <= b.token {
                bad.push(format!(
                    "a writer's token not above an earlier one: {b:?} then {a:?}"
                ));
            } else if b.start < a.start && b.what == "write" && a.token <= b.token {
                bad.push(format!(
                    "a reader's token not above an earlier writer's: {b:?} then {a:?}"
                ));
            }
        }
    }
    let permits: Vec<&Interval> = done.iter().filter(|i| i.what == "permit").collect();
    for a in &permits {
        let at_once = permits
            .iter()
            .filter(|b| b.start <= a.start && a.start < b.end)
            .count();
        if at_once > 2 {
            bad.push(format!("{at_once} permit holders at once at {a:?}"));
        }
        for b in &permits {
            if std::ptr::eq(*a, *b) || a.slot != b.slot {
                continue;
            }
            if overlap(a, b) {
                bad.push(format!("one slot held twice: {a:?} {b:?}"));
            } else if b.start < a.start && a.token <= b.token {
                bad.push(format!("a slot's token did not rise: {b:?} then {a:?}"));
            }
        }
    }
    bad.dedup();
    (done, bad)
}

fn run_mix(test: &str, kind: &str, children: usize, seconds: u64, kills: bool) {
    for seed in support::seeds::seeds(test) {
        support::seeds::announce(test, seed);
        run_mix_seeded(seed, kind, children, seconds, kills);
    }
}

fn run_mix_seeded(seed: u64, kind: &str, children: usize, seconds: u64, kills: bool) {
    let dir = tempfile_dir(kind);
    let rw_key = fresh_key("review-mix-rw");
    let permit_key = fresh_key("review-mix-permit");
    let log = dir.join("mix.log");
    let args = |n: u64| {
        vec![
            kind.to_owned(),
            dir.display().to_string(),
            rw_key.as_str().to_owned(),
            permit_key.as_str().to_owned(),
            log.display().to_string(),
            seconds.to_string(),
            Rng::derive(seed, n).to_string(),
        ]
    };
    // Every process started gets a seed of its own, the restarted too.
    let mut started_children = 0;
    let mut spawn = || {
        let a = args(started_children);
        started_children += 1;
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        support::spawn_child(module_path!(), CHILD_ROLE, "mix", &a)
    };
    let mut procs: Vec<std::process::Child> = (0..children).map(|_| spawn()).collect();
    let started = std::time::Instant::now();
    let mut rng = Rng::new(seed);
    if kills {
        while started.elapsed() < Duration::from_secs(seconds.saturating_sub(2)) {
            std::thread::sleep(Duration::from_millis(500 + rng.next(1000)));
            let victim = rng.next(procs.len() as u64) as usize;
            let pid = procs[victim].id();
            // The kill's instant is read before the signal: after it the
            // victim runs no more code, so none of its beliefs outlasts
            // it. Read after `wait`, a lease granted to another process
            // between the death and the log line looked like an overlap.
            let killed_ns = now_ns();
            let _ = procs[victim].kill();
            let _ = procs[victim].wait();
            log_line(&log, &format!("K {pid} {killed_ns}"));
            procs[victim] = spawn();
        }
    }
    for mut p in procs {
        let deadline = std::time::Instant::now() + Duration::from_secs(seconds + 30);
        loop {
            if let Some(status) = p.try_wait().expect("wait") {
                assert!(status.success(), "a child failed: {status}");
                break;
            }
            assert!(std::time::Instant::now() < deadline, "a child hangs");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let (done, bad) = check_log(&text);
    let count = |w: &str| done.iter().filter(|i| i.what == w).count();
    eprintln!(
        "{kind}: {} reads, {} writes, {} permits; {} violations",
        count("read"),
        count("write"),
        count("permit"),
        bad.len()
    );
    assert!(count("write") > 0 && count("read") > 0 && count("permit") > 0);
    assert!(bad.is_empty(), "{:#?}", &bad[..bad.len().min(10)]);
}

fn tempfile_dir(kind: &str) -> support::ScratchDir {
    support::ScratchDir::new(&format!("dlock-review-mix-{kind}"))
}

#[test]
fn file_many_processes_mixing_modes_with_cancels_and_sigkills_keep_every_invariant() {
    run_mix(
        "file_many_processes_mixing_modes_with_cancels_and_sigkills_keep_every_invariant",
        "file",
        5,
        14,
        true,
    );
}

#[test]
fn pg_many_processes_mixing_modes_with_cancels_and_sigkills_keep_every_invariant() {
    run_mix(
        "pg_many_processes_mixing_modes_with_cancels_and_sigkills_keep_every_invariant",
        "pg",
        5,
        14,
        true,
    );
}

async fn either_backend(kind: &str, dir: &std::path::Path) -> Arc<dyn Backend> {
    child_backend(kind, &dir.display().to_string()).await
}

/// A writer that gives up while it waits behind a reader (its wait runs
/// out, or its caller drops it at a random point) takes its mark with it:
/// a new reader gets in at once, not when the mark expires.
async fn readers_flow_again_once_a_waiting_writer_gives_up(kind: &str) {
    let dir = tempfile_dir(kind);
    for round in 0..6u64 {
        let key = fresh_key("review-giveup");
        let shared = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
        let reader = shared
            .acquire_on(either_backend(kind, &dir).await, &key)
            .await
            .expect("reader");
        let writer_backend = either_backend(kind, &dir).await;
        let writer = LockOptions::new(Duration::from_secs(30)).wait(Duration::from_secs(10));
        // Before the writer's first attempt: any mark it leaves was written
        // after this, and expires no earlier than a QUEUE_ENTRY_TTL later.
        let writer_sent = tokio::time::Instant::now();
        if round % 2 == 0 {
            let waited = LockOptions::new(Duration::from_secs(30))
                .wait(Duration::from_millis(300 + 100 * round))
                .acquire_on(writer_backend.clone(), &key)
                .await;
            assert!(
                matches!(
                    waited,
                    Err(LockError::Timeout { .. } | LockError::Held { .. })
                ),
                "{waited:?}"
            );
        } else {
            let cancelled = tokio::time::timeout(
                Duration::from_millis(200 + 150 * round),
                writer.acquire_on(writer_backend.clone(), &key),
            )
            .await;
            assert!(cancelled.is_err(), "the writer was still waiting");
        }
        // Connected before the clock starts: only the acquisition counts.
        let late_backend = either_backend(kind, &dir).await;
        let started = tokio::time::Instant::now();
        let late = LockOptions::new(Duration::from_secs(30))
            .mode(LockMode::Shared)
            .wait(Duration::from_secs(10))
            .acquire_on(late_backend, &key)
            .await
            .expect("a new reader once the writer gave up");
        let granted = tokio::time::Instant::now();
        let took = granted.duration_since(started);
        // A mark left behind holds readers off until it expires, a
        // QUEUE_ENTRY_TTL (3 s) after the writer placed it (less the
        // milliseconds a server's clock rounds away): a reader in before
        // then found no mark.
        let mark_expiry = writer_sent + QUEUE_ENTRY_TTL - Duration::from_millis(5);
        assert!(
            granted < mark_expiry,
            "{kind} round {round}: the new reader waited {took:?} after the writer gave up, \
             {:?} after the writer's first attempt: past a left mark's expiry",
            granted.duration_since(writer_sent)
        );
        late.release().await.expect("release");
        reader.release().await.expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_readers_flow_again_once_a_waiting_writer_gives_up() {
    readers_flow_again_once_a_waiting_writer_gives_up("file").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_readers_flow_again_once_a_waiting_writer_gives_up() {
    readers_flow_again_once_a_waiting_writer_gives_up("pg").await;
}

/// A try-lock writer (no wait) refused by a reader leaves no mark: a
/// reader right after it is not held off.
async fn a_try_lock_writer_never_holds_readers_off(kind: &str) {
    let dir = tempfile_dir(kind);
    let key = fresh_key("review-trylock");
    let shared = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let reader = shared
        .acquire_on(either_backend(kind, &dir).await, &key)
        .await
        .expect("reader");
    let other = either_backend(kind, &dir).await;
    for _ in 0..5 {
        let tried = LockOptions::new(Duration::from_secs(30))
            .acquire_on(other.clone(), &key)
            .await;
        assert!(matches!(tried, Err(LockError::Held { .. })), "{tried:?}");
        let next = shared
            .acquire_on(either_backend(kind, &dir).await, &key)
            .await
            .expect("a reader beside the refused try-lock writer");
        assert_eq!(next.token(), reader.token());
        next.release().await.expect("release");
    }
    reader.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_a_try_lock_writer_never_holds_readers_off() {
    a_try_lock_writer_never_holds_readers_off("file").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_try_lock_writer_never_holds_readers_off() {
    a_try_lock_writer_never_holds_readers_off("pg").await;
}

/// Readers back to back for `seconds`, each holding a little while, so that
/// with several such processes the key is never free of readers.
async fn read_stream_child(args: &[String]) {
    let [kind, dir, key, seconds] = args else {
        panic!("read-stream: KIND DIR KEY SECONDS");
    };
    let backend = child_backend(kind, dir).await;
    let until = std::time::Instant::now() + Duration::from_secs(seconds.parse().expect("seconds"));
    let mut reads = 0;
    while std::time::Instant::now() < until {
        let lease = LockOptions::new(Duration::from_secs(10))
            .mode(LockMode::Shared)
            .wait(Duration::from_secs(20))
            .acquire_on(backend.clone(), key.as_str())
            .await
            .expect("a reader");
        tokio::time::sleep(Duration::from_millis(80)).await;
        lease.release().await.expect("release");
        reads += 1;
    }
    // The parent's proof that this process streamed readers at all.
    println!("reads {reads}");
}

/// Four processes stream readers onto one key; a writer that waits gets
/// it well within its wait.
async fn a_writer_is_not_starved_by_readers_of_four_processes(kind: &str) {
    let dir = tempfile_dir(kind);
    let key = fresh_key("review-starve");
    let d = dir.display().to_string();
    let mut children: Vec<_> = (0..4)
        .map(|_| {
            support::spawn_child(
                module_path!(),
                CHILD_ROLE,
                "read-stream",
                &[kind, &d, key.as_str(), "12"],
            )
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = tokio::time::Instant::now();
    let writer = LockOptions::new(Duration::from_secs(10))
        .wait(Duration::from_secs(8))
        .acquire_on(either_backend(kind, &dir).await, &key)
        .await;
    let took = started.elapsed();
    let ok = writer.is_ok();
    if let Ok(lease) = writer {
        lease.release().await.expect("release");
    }
    for child in &mut children {
        assert!(
            child.wait().expect("exit").success(),
            "a reader process failed"
        );
        let mut out = String::new();
        std::io::Read::read_to_string(&mut child.stdout.take().expect("piped"), &mut out)
            .expect("the reader's output");
        let reads: u32 = out
            .lines()
            .find_map(|line| line.strip_prefix("reads "))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{kind}: a reader process never streamed: {out:?}"));
        assert!(reads > 0, "{kind}: a reader process took no reader lease");
    }
    assert!(ok, "{kind}: the writer starved for {took:?}");
    eprintln!("{kind}: the writer got in after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_a_writer_is_not_starved_by_readers_of_four_processes() {
    a_writer_is_not_starved_by_readers_of_four_processes("file").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_writer_is_not_starved_by_readers_of_four_processes() {
    a_writer_is_not_starved_by_readers_of_four_processes("pg").await;
}

/// The same mix within one process: tasks sharing one backend (one lock
/// session, re-entrant advisory locks) and tasks of a second backend.
async fn tasks_of_one_process_mix(test: &str, kind: &str) {
    for seed in support::seeds::seeds(test) {
        support::seeds::announce(test, seed);
        tasks_of_one_process_mix_seeded(seed, kind).await;
    }
}

async fn tasks_of_one_process_mix_seeded(seed: u64, kind: &str) {
    let dir = tempfile_dir(kind);
    let log = dir.join("mix.log");
    let (rw_key, permit_key) = (
        fresh_key("review-tasks-rw").as_str().to_owned(),
        fresh_key("review-tasks-permit").as_str().to_owned(),
    );
    let one_session = either_backend(kind, &dir).await;
    let other: Arc<dyn Backend> = if kind == "pg" {
        Arc::new(
            PgBackend::connect_with(&conn(), dlock::pg::PgOptions::new().sessions(2))
                .await
                .expect("connect"),
        )
    } else {
        either_backend(kind, &dir).await
    };
    let until = std::time::Instant::now() + Duration::from_secs(12);
    let tasks: Vec<_> = (0..8u32)
        .map(|id| {
            let backend = if id < 5 {
                one_session.clone()
            } else {
                other.clone()
            };
            tokio::spawn(mix_loop(
                backend,
                rw_key.clone(),
                permit_key.clone(),
                log.clone(),
                until,
                id + 1,
                Rng::derive(seed, u64::from(id)),
            ))
        })
        .collect();
    for task in tasks {
        support::within(60, "a mixing task", task)
            .await
            .expect("task");
    }
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let (done, bad) = check_log(&text);
    let count = |w: &str| done.iter().filter(|i| i.what == w).count();
    eprintln!(
        "{kind} tasks: {} reads, {} writes, {} permits; {} violations",
        count("read"),
        count("write"),
        count("permit"),
        bad.len()
    );
    assert!(bad.is_empty(), "{:#?}", &bad[..bad.len().min(10)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_tasks_of_one_process_mixing_modes_with_cancels_keep_every_invariant() {
    tasks_of_one_process_mix(
        "pg_tasks_of_one_process_mixing_modes_with_cancels_keep_every_invariant",
        "pg",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_tasks_of_one_process_mixing_modes_with_cancels_keep_every_invariant() {
    tasks_of_one_process_mix(
        "file_tasks_of_one_process_mixing_modes_with_cancels_keep_every_invariant",
        "file",
    )
    .await;
}

/// The log checker itself finds what it looks for.
#[test]
fn the_log_checker_finds_overlaps_low_tokens_and_too_many_permits() {
    let bad_log = "G write 10 -1 1 100\nG read 9 -1 2 150\nR write 10 -1 1 200\nR read 9 -1 2 250\n\
                   G read 20 -1 3 300\nG read 21 -1 4 310\nR read 20 -1 3 400\nR read 21 -1 4 410\n\
                   G permit 5 0 5 100\nG permit 6 1 6 110\nG permit 7 0 7 120\nK 5 130\nK 6 130\nK 7 130\n";
    let (_, bad) = check_log(bad_log);
    let text = bad.join("\n");
    assert!(text.contains("overlap with a writer"), "{text}");
    assert!(
        text.contains("overlapping readers with two tokens"),
        "{text}"
    );
    assert!(text.contains("permit holders at once"), "{text}");
    assert!(text.contains("one slot held twice"), "{text}");
    let (_, low) = check_log(
        "G read 30 -1 1 100\nR read 30 -1 1 200\nG write 29 -1 2 300\nR write 29 -1 2 400\nG read 28 -1 3 500\nR read 28 -1 3 600\n",
    );
    let text = low.join("\n");
    assert!(text.contains("a writer's token not above"), "{text}");
    assert!(
        text.contains("a reader's token not above an earlier writer's"),
        "{text}"
    );
    let (_, good) = check_log(
        "G write 10 -1 1 100\nR write 10 -1 1 200\nG read 11 -1 2 300\nR read 11 -1 2 400\n",
    );
    assert!(good.is_empty(), "{good:?}");
}

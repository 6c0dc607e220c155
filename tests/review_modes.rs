//! Hostile review of shared locks and permits: what operators and other
//! callers do to a running system.

mod pg_support;
mod support;

use std::sync::Arc;
use std::time::Duration;

use dlock::backend::QUEUE_ENTRY_TTL;
use dlock::pg::PgBackend;
use dlock::pg::tokio_postgres::{self, NoTls};
use dlock::{Backend, LockError, LockMode, LockOptions};
use dlock_runtime::conformance::fresh_key;

fn conn() -> String {
    std::env::var("DLOCK_PG_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".to_owned())
}

async fn backend() -> Arc<dyn Backend> {
    Arc::new(
        PgBackend::connect(&conn())
            .await
            .expect("PostgreSQL at 127.0.0.1:5432 or DLOCK_PG_URL"),
    )
}

async fn raw_client() -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&conn(), NoTls)
        .await
        .expect("plain connection");
    tokio::spawn(connection);
    client
}

/// A DBA who empties `dlock_phases` (TRUNCATE, or a DELETE of its rows)
/// while readers hold must not make a new reader draw a token above the
/// current readers': a `>=` fence would then refuse the current readers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_phase_row_never_gives_a_new_reader_a_token_above_a_current_readers() {
    let key = fresh_key("review-phase-row");
    let shared = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let first = shared
        .acquire_on(backend().await, &key)
        .await
        .expect("first reader");
    let first_token = first.token();
    let t1 = i64::try_from(first_token.get()).expect("token fits");
    let deleted = raw_client()
        .await
        .execute(
            "DELETE FROM dlock.dlock_phases WHERE phase_token = $1",
            &[&t1],
        )
        .await
        .expect("delete the phase row");
    assert_eq!(deleted, 1, "the phase row was there");
    // A reader of another backend (its own sessions): the server decides.
    match shared.acquire_on(backend().await, &key).await {
        Ok(second) => {
            assert_eq!(
                second.token(),
                first.token(),
                "a reader overlapping a current one gets its token, never a higher one"
            );
            second.release().await.expect("release");
        }
        Err(LockError::Held { .. }) => {}
        Err(other) => panic!("unexpected {other:?}"),
    }
    first.release().await.expect("release");
    // Once the phase is over, readers come in again, with a fresh token.
    let third = shared
        .acquire_on(backend().await, &key)
        .await
        .expect("a reader once the phase ended");
    assert!(third.token() > first_token);
    third.release().await.expect("release");
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
    if parts[0] == "stale-read" {
        return stale_reader_child(&parts[1..]).await;
    }
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

/// A reader that holds for `ttl`, prints its token, then tells whether it
/// heard of its loss.
async fn stale_reader_child(args: &[String]) {
    let [kind, dir, key] = args else {
        panic!("stale-read: KIND DIR KEY");
    };
    let lease = LockOptions::new(Duration::from_secs(1))
        .mode(LockMode::Shared)
        .acquire_on(child_backend(kind, dir).await, key.as_str())
        .await
        .expect("reader");
    println!("held {}", lease.token().get());
    let lost = tokio::time::timeout(Duration::from_secs(20), lease.lost()).await;
    println!("{}", if lost.is_ok() { "lost" } else { "kept" });
}

/// A reader stopped (SIGSTOP) past its ttl while a writer takes the key:
/// the writer's token is above the reader's, so the reader's fenced write
/// is refused, and the reader, resumed, hears that its lease is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_a_reader_stopped_past_its_ttl_is_fenced_out_and_told() {
    use std::io::BufRead as _;
    let dir = tempfile_dir("file");
    let key = fresh_key("review-stopped-reader");
    let mut child = support::spawn_child(
        module_path!(),
        CHILD_ROLE,
        "stale-read",
        &["file", &dir.display().to_string(), key.as_str()],
    );
    let mut lines = std::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut next_report = || {
        loop {
            let line = lines.next().expect("a line").expect("read");
            if line.starts_with("held ") || line == "lost" || line == "kept" {
                break line;
            }
        }
    };
    let held = next_report();
    let token: u64 = held
        .strip_prefix("held ")
        .expect("held")
        .parse()
        .expect("token");
    let pid = child.id().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-STOP", &pid])
            .status()
            .unwrap()
            .success()
    );
    let writer = LockOptions::new(Duration::from_secs(30))
        .wait(Duration::from_secs(10))
        .acquire_on(either_backend("file", &dir).await, &key)
        .await
        .expect("the writer gets the key once the stopped reader's ttl ran out");
    assert!(
        writer.token().get() > token,
        "the writer's token is above the stale reader's"
    );
    assert!(
        std::process::Command::new("kill")
            .args(["-CONT", &pid])
            .status()
            .unwrap()
            .success()
    );
    let told = next_report();
    assert_eq!(told, "lost", "the resumed reader hears of its loss");
    assert!(child.wait().expect("exit").success());
    assert!(!writer.is_lost(), "the writer still holds");
    writer.release().await.expect("release");
}

/// A DBA's transaction that holds `dlock_phases` locked (LOCK TABLE, a
/// TRUNCATE left open) past the lock session's lock_timeout refuses a
/// reader's attempt, which took nothing: the session and every other lease
/// on it live on. In a schema of its own: the table lock would hold up
/// every other test's readers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_phases_table_fails_a_reader_without_losing_the_sessions_other_leases() {
    let schema = pg_support::ScratchSchema::new("locked_phases");
    let pg: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), schema.options().sessions(1))
            .await
            .expect("connect"),
    );
    // The objects exist before the DBA locks the table.
    let warm = LockOptions::new(Duration::from_secs(30))
        .mode(LockMode::Shared)
        .acquire_on(pg.clone(), fresh_key("review-locked-warm"))
        .await
        .expect("reader");
    warm.release().await.expect("release");
    let writer = LockOptions::new(Duration::from_secs(30))
        .acquire_on(pg.clone(), fresh_key("review-locked-other"))
        .await
        .expect("an exclusive lease on the one session");
    let mut dba = raw_client().await;
    let tx = dba.transaction().await.expect("begin");
    tx.batch_execute(&format!(
        "LOCK TABLE \"{}\".dlock_phases IN ACCESS EXCLUSIVE MODE",
        schema.name
    ))
    .await
    .expect("lock the table");
    let reader_key = fresh_key("review-locked-reader");
    let refused = LockOptions::new(Duration::from_secs(30))
        .mode(LockMode::Shared)
        .acquire_on(pg.clone(), &reader_key)
        .await;
    assert!(refused.is_err(), "{refused:?}");
    tx.rollback().await.expect("rollback");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !writer.is_lost(),
        "the exclusive lease on the session lives on after a reader's attempt was refused by a locked table"
    );
    writer.release().await.expect("release");
    // The refused attempt left nothing held: a writer elsewhere takes the key.
    let elsewhere_on: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), schema.options())
            .await
            .expect("connect"),
    );
    let elsewhere = LockOptions::new(Duration::from_secs(30))
        .acquire_on(elsewhere_on, &reader_key)
        .await
        .expect("the refused reader's key is free");
    elsewhere.release().await.expect("release");
}

/// Readers back to back for `seconds`, each holding a little while, so that
/// with several such processes the key is never free of readers.
async fn read_stream_child(args: &[String]) {
    let [kind, dir, key, seconds] = args else {
        panic!("read-stream: KIND DIR KEY SECONDS");
    };
    let backend = child_backend(kind, dir).await;
    let until = std::time::Instant::now() + Duration::from_secs(seconds.parse().expect("seconds"));
    println!("held 0");
    while std::time::Instant::now() < until {
        let lease = LockOptions::new(Duration::from_secs(10))
            .mode(LockMode::Shared)
            .wait(Duration::from_secs(20))
            .acquire_on(backend.clone(), key.as_str())
            .await
            .expect("a reader");
        tokio::time::sleep(Duration::from_millis(80)).await;
        lease.release().await.expect("release");
    }
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

/// The token sequence set back (`setval`) while readers hold: a reader
/// joining the phase still gets the phase token, and the writer after
/// them, and the readers after it, still get tokens above every earlier
/// one (the draw is floored at the server's clock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_set_back_while_readers_hold_never_lowers_a_later_token() {
    let key = fresh_key("review-setval");
    let shared = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let set_back = || async {
        raw_client()
            .await
            .batch_execute(
                "SELECT pg_catalog.setval('dlock.dlock_token_seq', \
                 GREATEST(1, (SELECT last_value FROM dlock.dlock_token_seq) - 3600000000))",
            )
            .await
            .expect("set the sequence back an hour");
    };
    let first = shared
        .acquire_on(backend().await, &key)
        .await
        .expect("reader");
    set_back().await;
    let second = shared
        .acquire_on(backend().await, &key)
        .await
        .expect("reader");
    assert_eq!(second.token(), first.token(), "the phase token");
    let read_token = first.token();
    first.release().await.expect("release");
    second.release().await.expect("release");
    let writer = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend().await, &key)
        .await
        .expect("writer");
    assert!(writer.token() > read_token);
    let write_token = writer.token();
    writer.release().await.expect("release");
    set_back().await;
    let third = shared
        .acquire_on(backend().await, &key)
        .await
        .expect("reader");
    assert!(
        third.token() > write_token,
        "a reader's token is above the writer's before it"
    );
    third.release().await.expect("release");
}

/// A DBA drops the functions (or the table) while a reader holds: the
/// backend makes them again, and readers and writers keep their rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_functions_mid_run_are_made_again_and_keep_the_phase_token() {
    let key = fresh_key("review-dropped");
    let shared = LockOptions::new(Duration::from_secs(30))
        .mode(LockMode::Shared)
        .wait(Duration::from_secs(5));
    // A schema of its own: the drop must not reach other tests' attempts
    // (one whose function is dropped under it fails, and its session ends).
    let in_schema = || async {
        Arc::new(
            PgBackend::connect_with(
                &conn(),
                dlock::pg::PgOptions::new().schema("dlock_review_drop"),
            )
            .await
            .expect("connect"),
        ) as Arc<dyn Backend>
    };
    let backend_a = in_schema().await;
    let first = shared
        .acquire_on(backend_a.clone(), &key)
        .await
        .expect("reader");
    raw_client()
        .await
        .batch_execute(
            "DROP FUNCTION dlock_review_drop.dlock_try_shared(text, int8); \
             DROP FUNCTION dlock_review_drop.dlock_mark(text, int8, text, int8); \
             DROP FUNCTION dlock_review_drop.dlock_try_permit(text, int8, int4, int4[])",
        )
        .await
        .expect("drop the functions");
    let second = shared.acquire_on(backend_a.clone(), &key).await;
    let second = match second {
        Ok(lease) => lease,
        Err(err) => {
            eprintln!("first attempt after the drop: {err}");
            shared
                .acquire_on(backend_a.clone(), &key)
                .await
                .expect("a reader once the functions are made again")
        }
    };
    assert_eq!(second.token(), first.token(), "the phase token");
    let read_token = first.token();
    first.release().await.expect("release");
    second.release().await.expect("release");
    let writer = LockOptions::new(Duration::from_secs(30))
        .acquire_on(in_schema().await, &key)
        .await
        .expect("writer");
    assert!(writer.token() > read_token);
    writer.release().await.expect("release");
    drop(backend_a);
    let _ = raw_client()
        .await
        .batch_execute("DROP SCHEMA IF EXISTS dlock_review_drop CASCADE")
        .await;
}

/// A temp-dir cleaner removes every alive file (the group's and the
/// readers') while readers hold: a writer waiting behind them still gets
/// the key soon after the last reader releases, and not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_a_cleaner_removing_alive_files_mid_phase_neither_frees_nor_strands_the_key() {
    let dir = tempfile_dir("file");
    let key = fresh_key("review-cleaner");
    let shared = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let first = shared
        .acquire_on(either_backend("file", &dir).await, &key)
        .await
        .expect("reader");
    let second = shared
        .acquire_on(either_backend("file", &dir).await, &key)
        .await
        .expect("reader");
    let mut removed = 0;
    for entry in std::fs::read_dir(&dir).expect("dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "alive") {
            std::fs::remove_file(&path).expect("remove");
            removed += 1;
        }
    }
    assert!(
        removed >= 3,
        "the group's and both readers' files, got {removed}"
    );
    let writer_backend = either_backend("file", &dir).await;
    let writer = tokio::spawn({
        let key = key.clone();
        async move {
            LockOptions::new(Duration::from_secs(30))
                .wait(Duration::from_secs(20))
                .acquire_on(writer_backend, &key)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!writer.is_finished(), "the writer waits while readers hold");
    let late = shared
        .acquire_on(either_backend("file", &dir).await, &key)
        .await;
    assert!(
        matches!(late, Err(LockError::Held { .. })),
        "a new reader waits behind the writer: {late:?}"
    );
    let read_token = first.token();
    first.release().await.expect("release");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !writer.is_finished(),
        "the writer waits while one reader holds"
    );
    second.release().await.expect("release");
    let started = tokio::time::Instant::now();
    let lease = support::within(20, "the writer", writer)
        .await
        .expect("task")
        .expect("the writer gets the key");
    eprintln!(
        "the writer got in {:?} after the last release",
        started.elapsed()
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert!(lease.token() > read_token);
    lease.release().await.expect("release");
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

/// Shared locks and permits send prepared statements: once a lock session
/// prepared them, an attempt, a release and an in-process reader's check
/// for a writer's mark are one round trip each, and the server parses and
/// plans none of them again. (Sent as text, each would be a prepare and an
/// execution: twice the round trips, and a plan per call.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_and_permit_cycles_parse_no_statement_once_their_session_prepared_them() {
    let config: tokio_postgres::Config = conn().parse().expect("a PostgreSQL connection string");
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let proxy = support::proxy::Proxy::bind_pg(format!("127.0.0.1:{port}")).await;
    let through = format!(
        "host=127.0.0.1 port={} user={} dbname={} sslmode=disable",
        proxy.port,
        config.get_user().unwrap_or("postgres"),
        config.get_dbname().unwrap_or("test"),
    );
    let pg: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&through, dlock::pg::PgOptions::new().sessions(1))
            .await
            .expect("PostgreSQL through the proxy"),
    );
    let ttl = Duration::from_secs(30);
    let (read_key, permit_key) = (fresh_key("prepared-read"), fresh_key("prepared-permit"));
    let cycles = |n: usize| {
        let pg = pg.clone();
        let (read_key, permit_key) = (read_key.clone(), permit_key.clone());
        async move {
            for _ in 0..n {
                let shared = LockOptions::new(ttl).mode(LockMode::Shared);
                let first = shared
                    .acquire_on(pg.clone(), &read_key)
                    .await
                    .expect("reader");
                // Joins the first reader's hold in process: asks the server
                // only whether a writer's mark stands.
                let second = shared
                    .acquire_on(pg.clone(), &read_key)
                    .await
                    .expect("joiner");
                assert_eq!(
                    first.token(),
                    second.token(),
                    "readers of one phase share its token"
                );
                second.release().await.expect("joiner's release");
                first.release().await.expect("reader's release");
                let permit = LockOptions::new(ttl)
                    .permits(2)
                    .acquire_on(pg.clone(), &permit_key)
                    .await
                    .expect("permit");
                permit.release().await.expect("permit's release");
            }
        }
    };
    // The first round makes the functions and prepares the statements.
    cycles(1).await;
    let (parsed, bound) = (proxy.pg_sent(b'P'), proxy.pg_sent(b'B'));
    cycles(10).await;
    assert_eq!(
        proxy.pg_sent(b'P'),
        parsed,
        "a shared or permit cycle prepared a statement again"
    );
    // Each round: the reader's attempt and release, the joiner's check,
    // the permit's attempt and release.
    assert!(
        proxy.pg_sent(b'B') >= bound + 10 * 5,
        "the cycles' statements did not go through the proxy: {} executions",
        proxy.pg_sent(b'B') - bound
    );
}

// Shared locks' and permits' prepared statements under a DBA's changes
// (each statement prepared on its own first use, a failed prepare ending
// no session).

fn scratch_schema(label: &str) -> String {
    let id = dlock_runtime::conformance::fresh_key("s").to_string();
    let tail: String = id
        .chars()
        .rev()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(12)
        .collect();
    format!("dlock_rv_{label}_{}", tail.to_ascii_lowercase())
}

async fn in_schema(schema: &str) -> Arc<dyn Backend> {
    Arc::new(
        PgBackend::connect_with(
            &conn(),
            dlock::pg::PgOptions::new().schema(schema).sessions(1),
        )
        .await
        .expect("connect"),
    )
}

async fn drop_schema(schema: &str) {
    let _ = raw_client()
        .await
        .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .await;
}

/// Permits never read `dlock_phases` (`dlock_try_permit` touches no
/// table), so a DBA's change to that table must not reach a permit
/// attempt, let alone the other leases on its session. (When a session
/// prepared every mode statement at once, a permit's first attempt
/// prepared MARKED, which names `dlock_phases.mark_until`, failed with
/// 42703 and ended the session.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dba_change_to_the_phase_table_costs_permits_nothing() {
    let schema = scratch_schema("perm");
    let ttl = Duration::from_secs(30);
    // One backend makes the table and functions.
    let maker = in_schema(&schema).await;
    LockOptions::new(ttl)
        .permits(2)
        .acquire_on(maker.clone(), &fresh_key("rv-maker"))
        .await
        .expect("a permit")
        .release()
        .await
        .expect("release");
    // A DBA changes the table of read phases (used only by shared locks).
    raw_client()
        .await
        .batch_execute(&format!(
            "ALTER TABLE {schema}.dlock_phases RENAME COLUMN mark_until TO mark_expires"
        ))
        .await
        .expect("alter the phase table");
    // Another service: an exclusive lease, then its first permit.
    let service = in_schema(&schema).await;
    let writer = LockOptions::new(ttl)
        .acquire_on(service.clone(), &fresh_key("rv-excl"))
        .await
        .expect("an exclusive lock");
    let permit = LockOptions::new(ttl)
        .permits(2)
        .acquire_on(service.clone(), &fresh_key("rv-permit"))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let writer_lost = writer.is_lost();
    drop_schema(&schema).await;
    let permit = permit.map(|lease| lease.token());
    eprintln!("permit: {permit:?}\nexclusive lease lost: {writer_lost}");
    assert!(
        permit.is_ok(),
        "a permit attempt failed over a table permits never use: {permit:?}"
    );
    assert!(
        !writer_lost,
        "an exclusive lease was lost because a permit attempt on its session failed"
    );
}

/// A service that uses only shared locks never calls `dlock_try_permit`,
/// so a DBA dropping that function must not cost its readers anything.
/// (HOLDS as seen by the caller: a join's mark check on a session that has
/// not prepared fails — the prepare of all five statements trips on the
/// missing function — but the acquire loop retries it until it lands on a
/// prepared session. Nothing runs the setup again meanwhile.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_permit_function_costs_readers_nothing_and_heals() {
    let schema = scratch_schema("join");
    let ttl = Duration::from_secs(30);
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(
            &conn(),
            dlock::pg::PgOptions::new().schema(&schema).sessions(3),
        )
        .await
        .expect("connect"),
    );
    let key = fresh_key("rv-join");
    let shared = LockOptions::new(ttl).mode(LockMode::Shared);
    let first = shared
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the first reader");
    raw_client()
        .await
        .batch_execute(&format!(
            "DROP FUNCTION {schema}.dlock_try_permit(text, int8, int4, int4[])"
        ))
        .await
        .expect("drop the permit function");
    let mut failed = Vec::new();
    for round in 0..30 {
        // Other work of the service (an exclusive lock on another key)
        // moves the round-robin choice of lock session along.
        if round % 3 != 0 {
            LockOptions::new(ttl)
                .acquire_on(backend.clone(), &fresh_key("rv-other"))
                .await
                .expect("an exclusive lock")
                .release()
                .await
                .expect("release");
        }
        match shared.acquire_on(backend.clone(), &key).await {
            Ok(joiner) => {
                assert_eq!(
                    joiner.token(),
                    first.token(),
                    "a joiner shares the phase token"
                );
                joiner.release().await.expect("release");
            }
            Err(err) => failed.push(format!("join {round}: {err}")),
        }
    }
    let first_lost = first.is_lost();
    let _ = first.release().await;
    drop(backend);
    drop_schema(&schema).await;
    eprintln!(
        "{} of 30 joins failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
    assert!(!first_lost, "the first reader's lease was lost");
    assert!(
        failed.is_empty(),
        "joins of a live read phase failed over a function readers never call: {failed:#?}"
    );
}

/// Many tasks use a fresh backend's lock session for the first time at
/// once (each prepares, or waits for the one that does), some of them
/// given up at random points: no error, never more holders than permits,
/// and once everyone is gone every slot can be had again from another
/// backend (nothing is left held on the server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_use_with_cancellations_leaves_nothing_held() {
    let schema = scratch_schema("first");
    let ttl = Duration::from_secs(30);
    let permits = 3u32;
    for round in 0..6u64 {
        let backend = in_schema(&schema).await;
        let key = fresh_key("rv-first");
        let holders = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..24u64 {
            let (backend, key, holders, most) =
                (backend.clone(), key.clone(), holders.clone(), most.clone());
            let mode = i % 2 == 0;
            tasks.push(tokio::spawn(async move {
                let options = if mode {
                    LockOptions::new(ttl).permits(permits)
                } else {
                    LockOptions::new(ttl).mode(LockMode::Shared)
                };
                // Shared and permit attempts of one key would refuse each
                // other: readers take a key of their own.
                let key = if mode {
                    key
                } else {
                    dlock::LockKey::new(format!("{key}:r")).expect("key")
                };
                let give_up = Duration::from_micros((round * 7919 + i * 104_729) % 3000);
                let attempt = options.acquire_on(backend, &key);
                match tokio::time::timeout(give_up, attempt).await {
                    Err(_) => Ok(()),
                    Ok(Err(dlock::LockError::Held { .. })) => Ok(()),
                    Ok(Err(err)) => Err(format!("{err}")),
                    Ok(Ok(lease)) => {
                        if mode {
                            let now = holders.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                            most.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            holders.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        if i % 3 == 0 {
                            drop(lease);
                        } else {
                            lease.release().await.map_err(|e| format!("{e}"))?;
                        }
                        Ok(())
                    }
                }
            }));
        }
        for task in tasks {
            task.await.expect("task").expect("no attempt fails");
        }
        assert!(most.load(std::sync::atomic::Ordering::SeqCst) <= permits as usize);
        drop(backend);
        // Another backend: every slot, and the key exclusively on the
        // readers' key, within a few seconds (drops release best effort).
        let other = in_schema(&schema).await;
        let mut slots = Vec::new();
        for _ in 0..permits {
            slots.push(
                LockOptions::new(ttl)
                    .permits(permits)
                    .wait(Duration::from_secs(5))
                    .acquire_on(other.clone(), &key)
                    .await
                    .expect("every slot free once all are gone"),
            );
        }
        let readers_key = dlock::LockKey::new(format!("{key}:r")).expect("key");
        LockOptions::new(ttl)
            .wait(Duration::from_secs(5))
            .acquire_on(other.clone(), &readers_key)
            .await
            .expect("the readers' key free once all are gone")
            .release()
            .await
            .expect("release");
        for slot in slots {
            slot.release().await.expect("release");
        }
    }
    drop_schema(&schema).await;
}

/// A DBA drops `dlock_phases` while a reader holds, and permit holders
/// hold: the permit holders and the reader keep their leases, new permits
/// come at once, new readers of other keys come after at most one error,
/// and once the phase is over its key is read again with a token above the
/// old phase's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_phase_table_mid_run_heals_and_loses_no_lease() {
    let schema = scratch_schema("tbl");
    let ttl = Duration::from_secs(30);
    let backend = in_schema(&schema).await;
    let shared = LockOptions::new(ttl).mode(LockMode::Shared);
    let key = fresh_key("rv-tbl");
    let reader = shared
        .acquire_on(backend.clone(), &key)
        .await
        .expect("reader");
    let permit_key = fresh_key("rv-tbl-permit");
    let permit = LockOptions::new(ttl)
        .permits(2)
        .acquire_on(backend.clone(), &permit_key)
        .await
        .expect("permit");
    raw_client()
        .await
        .batch_execute(&format!("DROP TABLE {schema}.dlock_phases"))
        .await
        .expect("drop the table");
    let second_permit = LockOptions::new(ttl)
        .permits(2)
        .acquire_on(backend.clone(), &permit_key)
        .await;
    let other = fresh_key("rv-tbl-other");
    let mut errors = Vec::new();
    let mut other_reader = None;
    for _ in 0..3 {
        match shared.acquire_on(backend.clone(), &other).await {
            Ok(lease) => {
                other_reader = Some(lease);
                break;
            }
            Err(err) => errors.push(format!("{err}")),
        }
    }
    let joiner = shared.acquire_on(backend.clone(), &key).await;
    let (reader_lost, permit_lost) = (reader.is_lost(), permit.is_lost());
    eprintln!(
        "second permit: {:?}\nother reader after {} errors: {errors:?}\njoiner: {:?}\nlost: reader {reader_lost} permit {permit_lost}",
        second_permit.as_ref().map(|l| l.token()),
        errors.len(),
        joiner.as_ref().map(|l| l.token()),
    );
    let old = reader.token();
    if let Ok(j) = joiner {
        assert_eq!(j.token(), old);
        j.release().await.expect("release");
    }
    reader.release().await.expect("release");
    let later = shared.acquire_on(backend.clone(), &key).await;
    drop_schema(&schema).await;
    assert!(!reader_lost && !permit_lost, "a lease was lost");
    assert!(second_permit.is_ok(), "a permit while the table was gone");
    assert!(other_reader.is_some() && errors.len() <= 1, "{errors:?}");
    assert!(later.expect("a reader after the phase").token() > old);
}

/// Permits never touch `dlock_phases`, so a DBA's transaction that holds
/// a lock on it (TRUNCATE, ALTER TABLE, VACUUM FULL, LOCK TABLE, left
/// open) must not hold up a permit attempt. (When a session prepared every
/// mode statement at once, a permit's first attempt prepared MARKED, whose
/// parse waited for that lock until the session's `lock_timeout`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dba_lock_on_the_phase_table_does_not_hold_up_permits() {
    let schema = scratch_schema("lockt");
    let ttl = Duration::from_secs(30);
    let maker = in_schema(&schema).await;
    LockOptions::new(ttl)
        .permits(2)
        .acquire_on(maker.clone(), &fresh_key("rv-lockt-maker"))
        .await
        .expect("a permit")
        .release()
        .await
        .expect("release");
    let dba = raw_client().await;
    dba.batch_execute(&format!(
        "BEGIN; LOCK TABLE {schema}.dlock_phases IN ACCESS EXCLUSIVE MODE"
    ))
    .await
    .expect("the DBA's open transaction");
    // A statement held up by the DBA's lock waits for the session's
    // lock_timeout, half the liveness interval: 10 s here, so a permit
    // held up is told from a first attempt that is merely slow.
    let service: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(
            &conn(),
            dlock::pg::PgOptions::new()
                .schema(&schema)
                .sessions(1)
                .liveness_interval(Duration::from_secs(20))
                .server_idle_timeout(Some(Duration::from_secs(45))),
        )
        .await
        .expect("connect"),
    );
    let started = std::time::Instant::now();
    let permit = LockOptions::new(ttl)
        .permits(2)
        .acquire_on(service.clone(), &fresh_key("rv-lockt"))
        .await;
    let took = started.elapsed();
    let _ = dba.batch_execute("COMMIT").await;
    drop_schema(&schema).await;
    let permit = permit.map(|lease| lease.token());
    eprintln!("permit after {took:?}: {permit:?}");
    assert!(permit.is_ok(), "{permit:?}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

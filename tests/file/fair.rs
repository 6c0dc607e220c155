//! Fair mode on `FileBackend` across real OS processes on one host: a
//! queued waiter killed with SIGKILL is skipped at once, and waiters in
//! several processes are served in the order they queued.
//!
//! The tests watch the key's queue file (`NAME.queue`: a header line, then
//! one line per waiter, see the backend's `state` module) to know when a
//! child has queued.

use crate::support;
use crate::{fresh_dir, path, until_queued};

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::Path;
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dlock::file::FileBackend;
use dlock::{Backend, LockOptions};
use support::within;

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The environment variable that turns this test binary into a child
/// process playing one role (see `child_process_entry`).
const CHILD_ROLE: &str = "DLOCK_FILE_FAIR_TEST_CHILD";

/// The child side. Ignored in normal runs; the tests below start it as
/// `<test binary> <module>::child_process_entry --exact --ignored` with a role.
#[test]
#[ignore = "runs only as a child process of the cross-process tests"]
fn child_process_entry() {
    let Some((runtime, parts)) = support::child_role(CHILD_ROLE) else {
        return;
    };
    runtime.block_on(async move {
        let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&parts[1]).expect("dir"));
        let key = parts[2].as_str();
        match parts[0].as_str() {
            // `fair-wait DIR KEY HOLD_MS`: wait in line for the key, print
            // `held <token>`, hold it HOLD_MS, release it.
            "fair-wait" => {
                let hold: u64 = parts[3].parse().expect("hold ms");
                let lease = LockOptions::new(Duration::from_secs(30))
                    .wait(Duration::from_secs(30))
                    .fair(true)
                    .acquire_on(backend, key)
                    .await
                    .expect("a fair waiter is served");
                println!("held {}", lease.token());
                tokio::time::sleep(Duration::from_millis(hold)).await;
                lease.release().await.expect("release");
            }
            // `ping DIR KEY fair|plain`: for each `go` line on stdin, wait
            // for the key (in line, or plainly), print `held <token>
            // <wall-clock µs when granted>`, release it.
            "ping" => {
                let fair = parts[3] == "fair";
                let mut lines = BufReader::new(std::io::stdin()).lines();
                while let Some(Ok(_go)) = lines.next() {
                    let lease = LockOptions::new(Duration::from_secs(30))
                        .wait(Duration::from_secs(10))
                        .fair(fair)
                        .acquire_on(backend.clone(), key)
                        .await
                        .expect("the waiter is served");
                    println!("held {} {}", lease.token(), now_us());
                    lease.release().await.expect("release");
                }
            }
            other => panic!("unknown child role {other}"),
        }
    });
}

fn spawn_child(role: &str, args: &[&str]) -> Child {
    support::spawn_child(module_path!(), CHILD_ROLE, role, args)
}

/// The expiries (microseconds since the epoch) of the entries in the queue
/// of `key`, in order.
fn entry_expiries(dir: &Path, key: &str) -> Vec<u64> {
    std::fs::read_to_string(dir.join(format!("{key}.queue")))
        .expect("the queue file")
        .lines()
        .skip(1)
        .map(|entry| {
            entry
                .split(' ')
                .nth(2)
                .and_then(|expiry| expiry.parse().ok())
                .unwrap_or_else(|| panic!("a queue entry with an expiry: {entry}"))
        })
        .collect()
}

/// The files of `dir` whose names end with `suffix`.
fn files_ending(dir: &Path, suffix: &str) -> usize {
    std::fs::read_dir(dir)
        .expect("dir")
        .filter_map(Result::ok)
        .filter(|entry| entry.file_name().to_string_lossy().ends_with(suffix))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_waiter_killed_with_sigkill_is_skipped_at_once_and_never_handed_the_key() {
    let dir = fresh_dir();
    let key = "killed-waiter";
    let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), key)
        .await
        .expect("a fresh key is free");
    // First in line: a waiter in another process, killed while it waits.
    let mut killed = spawn_child("fair-wait", &[path(&dir), key, "0"]);
    until_queued(&dir, key, 1).await;
    // Second in line: a live waiter in this process.
    let live = tokio::spawn({
        let backend = backend.clone();
        async move {
            let lease = LockOptions::new(Duration::from_secs(30))
                .wait(Duration::from_secs(20))
                .fair(true)
                .acquire_on(backend, key)
                .await;
            (lease, now_us())
        }
    });
    until_queued(&dir, key, 2).await;
    killed.kill().expect("SIGKILL the first waiter");
    killed.wait().expect("reap");
    // A release that waited for the killed waiter's entry (first in line)
    // to expire would keep the live waiter until then: the expiry the
    // queue file gives it, a queue entry's life after its last refresh.
    let killed_entry_expires_at_us = entry_expiries(&dir, key)[0];
    let first = holder.token();
    holder.release().await.expect("release");
    let (lease, served_at_us) = within(10, "the live waiter", live).await.expect("task");
    let lease = lease.expect("the live waiter is served");
    assert_eq!(
        lease.token().get(),
        first.get() + 1,
        "the release handed the key straight to the live waiter: no token was drawn \
         for the killed one"
    );
    assert!(
        served_at_us < killed_entry_expires_at_us,
        "the live waiter was served {} us past the killed waiter's entry's expiry: \
         that entry held the queue up",
        served_at_us - killed_entry_expires_at_us
    );
    assert_eq!(
        files_ending(&dir, ".alive"),
        1,
        "only the live holder's alive file is left: the killed waiter's went with \
         its entry"
    );
    lease.release().await.expect("release");
    assert_eq!(
        files_ending(&dir, ".queue"),
        0,
        "an empty queue leaves no file"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_in_three_processes_are_served_in_the_order_they_queued() {
    let dir = fresh_dir();
    let key = "three-in-line";
    let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), key)
        .await
        .expect("a fresh key is free");
    let mut children = Vec::new();
    for waiters in 1..=3 {
        children.push(spawn_child("fair-wait", &[path(&dir), key, "20"]));
        until_queued(&dir, key, waiters).await;
    }
    let mut previous = holder.token().get();
    holder.release().await.expect("release");
    for (index, child) in children.iter_mut().enumerate() {
        let lines = support::child_lines(child, "held ");
        assert!(child.wait().expect("exit").success(), "waiter {index}");
        let token: u64 = lines[0].parse().expect("token");
        assert!(
            token > previous,
            "waiter {index} (token {token}) was served after the one that queued after it \
             (token {previous})"
        );
        previous = token;
    }
}

/// Not a test of a property: the time from a release to the return of the
/// waiter's acquisition in another process, for fair and plain waiters.
/// Run with `cargo test --test file -- --ignored --nocapture
/// fair::handoff_latency`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, run by hand"]
async fn handoff_latency_across_processes() {
    const ROUNDS: usize = 200;
    for mode in ["fair", "plain"] {
        let dir = fresh_dir();
        let key = "ping";
        let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
        let mut child = spawn_child("ping", &[path(&dir), key, mode]);
        let mut to_child = child.stdin.take().expect("stdin");
        let mut from_child = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut latencies = Vec::with_capacity(ROUNDS);
        let mut release_calls = Vec::with_capacity(ROUNDS);
        let mut after_return = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            let holder = LockOptions::new(Duration::from_secs(30))
                .wait(Duration::from_secs(10))
                .acquire_on(backend.clone(), key)
                .await
                .expect("the key comes back");
            writeln!(to_child, "go").expect("to child");
            if mode == "fair" {
                until_queued(&dir, key, 1).await;
            } else {
                // A plain waiter leaves no trace: give it time to wait.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let token = holder.token().get();
            let released_at = now_us();
            let started = Instant::now();
            holder.release().await.expect("release");
            let returned_at = now_us();
            release_calls.push(started.elapsed().as_micros() as u64);
            // The child's test harness prints lines of its own.
            let line = from_child
                .by_ref()
                .map_while(Result::ok)
                .find_map(|line| line.strip_prefix("held ").map(str::to_owned))
                .expect("the child reports its grant");
            let mut fields = line
                .split(' ')
                .map(|field| field.parse::<u64>().expect("number"));
            let (handed, granted_at) = (fields.next().expect("token"), fields.next().expect("µs"));
            assert!(handed > token, "{handed} after {token}");
            if mode == "fair" {
                assert_eq!(handed, token + 1, "a handoff, not a later acquisition");
            }
            latencies.push(granted_at.saturating_sub(released_at));
            after_return.push(granted_at.saturating_sub(returned_at));
        }
        drop(to_child);
        assert!(child.wait().expect("exit").success());
        let show = |what: &str, values: &mut Vec<u64>| {
            values.sort_unstable();
            let at = |q: f64| values[((values.len() - 1) as f64 * q) as usize];
            println!(
                "{mode}: {what}: p50 {} µs, p90 {} µs, p99 {} µs, max {} µs ({} rounds)",
                at(0.5),
                at(0.9),
                at(0.99),
                at(1.0),
                values.len()
            );
        };
        show("release call to the waiter's grant", &mut latencies);
        show("the release call itself", &mut release_calls);
        show(
            "its return to the waiter's grant (0 if before)",
            &mut after_return,
        );
    }
}

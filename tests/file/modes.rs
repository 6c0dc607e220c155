//! Shared locks on `FileBackend` when a holder stops or files go missing:
//! a reader stopped past its ttl in another process is fenced out by the
//! writer after it and told when it resumes, and a cleaner removing the
//! `.alive` files of live readers neither frees nor strands the key. The
//! behaviour of modes mixed under load, common to the file and PostgreSQL
//! backends, is in `tests/mixed_modes.rs`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use dlock::file::FileBackend;
use dlock::{Backend, LockError, LockMode, LockOptions};
use dlock_runtime::conformance::fresh_key;

use crate::support;

const CHILD_ROLE: &str = "DLOCK_FILE_MODES_TEST_CHILD";

/// The child side of the cross-process tests, which run this test binary
/// as `<test binary> <module>::child_process_entry --exact --ignored` with
/// a role.
#[test]
#[ignore = "only run as a child process by the tests of this file"]
fn child_process_entry() {
    let Some((runtime, parts)) = support::child_role(CHILD_ROLE) else {
        return;
    };
    let [role, args @ ..] = &parts[..] else {
        panic!("a role, then its arguments: {parts:?}");
    };
    assert_eq!(role, "stale-read");
    runtime.block_on(stale_reader_child(args));
}

/// A backend on the lock directory `dir`.
fn backend(dir: &Path) -> Arc<dyn Backend> {
    Arc::new(FileBackend::open(dir).expect("open the lock directory"))
}

/// A reader that holds for `ttl`, prints its token, then tells whether it
/// heard of its loss.
async fn stale_reader_child(args: &[String]) {
    let [dir, key] = args else {
        panic!("stale-read: DIR KEY");
    };
    let lease = LockOptions::new(Duration::from_secs(1))
        .mode(LockMode::Shared)
        .acquire_on(backend(Path::new(dir)), key.as_str())
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
    let dir = support::ScratchDir::new("dlock-file-modes");
    let key = fresh_key("review-stopped-reader");
    let mut child = support::spawn_child(
        module_path!(),
        CHILD_ROLE,
        "stale-read",
        &[&dir.display().to_string(), key.as_str()],
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
        .acquire_on(backend(&dir), &key)
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

/// A temp-dir cleaner removes every alive file (the group's and the
/// readers') while readers hold: a writer waiting behind them still gets
/// the key soon after the last reader releases, and not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_a_cleaner_removing_alive_files_mid_phase_neither_frees_nor_strands_the_key() {
    let dir = support::ScratchDir::new("dlock-file-modes");
    let key = fresh_key("review-cleaner");
    let shared = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let first = shared
        .acquire_on(backend(&dir), &key)
        .await
        .expect("reader");
    let second = shared
        .acquire_on(backend(&dir), &key)
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
    let writer_backend = backend(&dir);
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
    let late = shared.acquire_on(backend(&dir), &key).await;
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

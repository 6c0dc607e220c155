//! The conformance suite on `FileBackend`, plus what it promises across
//! real OS processes on one host.

use crate::support;
use crate::{fresh_dir, path, until_queued};

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::Child;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use support::within;

use dlock::backend::{AcquireRequest, Attempt, OwnerId, ReleaseRequest};
use dlock::file::FileBackend;
use dlock::{Backend, LockKey, LockMode, LockOptions};

/// Every instance the suite opens shares one directory, as the processes
/// of a host do.
async fn backend() -> Arc<dyn Backend> {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    Arc::new(FileBackend::open(DIR.get_or_init(fresh_dir)).expect("lock directory"))
}

dlock_runtime::conformance_suite!(backend);

/// The environment variable that turns this test binary into a child
/// process playing one role (see `child_process_entry`).
const CHILD_ROLE: &str = "DLOCK_FILE_TEST_CHILD";

fn spawn_child(role: &str, args: &[&str]) -> Child {
    support::spawn_child(module_path!(), CHILD_ROLE, role, args)
}

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
            // Increment a plain, unlocked counter file under the lock: any
            // overlap between holders loses an increment.
            "counter" => support::counter_rounds(backend.clone(), key, &parts[3..]).await,
            // Take the lock with a long ttl and hang on to it.
            "hold" => {
                let lease = LockOptions::new(Duration::from_secs(120))
                    .acquire_on(backend.clone(), key)
                    .await
                    .expect("acquire");
                println!("held {}", lease.token());
                tokio::time::sleep(Duration::from_secs(600)).await;
                drop(lease);
            }
            // Take a permit of the key's `parts[3]` (a long ttl) and hang
            // on to it.
            "hold-permit" => {
                let permits = parts[3].parse().expect("a number of permits");
                let lease = LockOptions::new(Duration::from_secs(120))
                    .permits(permits)
                    .acquire_on(backend.clone(), key)
                    .await
                    .expect("acquire a permit");
                println!("held {}", lease.token());
                tokio::time::sleep(Duration::from_secs(600)).await;
                drop(lease);
            }
            // Take the read side (a long ttl) and hang on to it.
            "hold-shared" => {
                let lease = LockOptions::new(Duration::from_secs(120))
                    .mode(LockMode::Shared)
                    .acquire_on(backend.clone(), key)
                    .await
                    .expect("acquire the read side");
                println!("held {}", lease.token());
                tokio::time::sleep(Duration::from_secs(600)).await;
                drop(lease);
            }
            // Take the lock directly with an identity (the last argument)
            // and a long ttl, and hang on to it.
            "hold-as" => {
                let key = LockKey::new(key).expect("key");
                let owner = OwnerId::random().expect("random");
                let request = AcquireRequest::new(&key, &owner, Duration::from_secs(120))
                    .with_identity(Some(&parts[3]));
                match backend.try_acquire(&request).await.expect("acquire") {
                    Attempt::Acquired(grant) => println!("held {}", grant.token),
                    held => panic!("the key must be free: {held:?}"),
                }
                tokio::time::sleep(Duration::from_secs(600)).await;
            }
            // Take and release once.
            "once" => {
                let lease = LockOptions::new(Duration::from_secs(10))
                    .acquire_on(backend.clone(), key)
                    .await
                    .expect("acquire");
                println!("held {}", lease.token());
                lease.release().await.expect("release");
            }
            // Give up on 20 acquisitions at once; print how many of their
            // keys are still held and the open descriptors before and after.
            "abandon" => {
                let open_fds = || std::fs::read_dir("/proc/self/fd").expect("/proc").count();
                let warm = LockOptions::new(Duration::from_secs(10))
                    .acquire_on(backend.clone(), format!("{key}:warm"))
                    .await
                    .expect("acquire");
                warm.release().await.expect("release");
                let before = open_fds();
                let keys: Vec<String> = (0..20).map(|i| format!("{key}:{i}")).collect();
                for key in &keys {
                    let abandoned = tokio::time::timeout(
                        Duration::ZERO,
                        LockOptions::new(Duration::from_secs(120)).acquire_on(backend.clone(), key),
                    )
                    .await;
                    drop(abandoned);
                }
                // The give-backs run in the background: wait for them, up
                // to far less than the 120 s ttl.
                let other: Arc<dyn Backend> = Arc::new(FileBackend::open(&parts[1]).expect("dir"));
                let mut held = keys.len();
                for _ in 0..200 {
                    held = 0;
                    for key in &keys {
                        match LockOptions::new(Duration::from_secs(10))
                            .acquire_on(other.clone(), key)
                            .await
                        {
                            Ok(lease) => lease.release().await.expect("release"),
                            Err(_) => held += 1,
                        }
                    }
                    if held == 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                println!("held {held}");
                println!("fds {before} {}", open_fds());
            }
            other => panic!("unknown child role {other}"),
        }
    });
}

#[test]
fn three_processes_never_hold_one_key_at_once_and_tokens_rise() {
    let dir = fresh_dir();
    let counter = dir.join("counter.txt");
    std::fs::create_dir_all(&dir).expect("dir");
    let dir_s = dir.to_str().expect("utf-8 path");
    let counter_s = counter.to_str().expect("utf-8 path");
    const ROUNDS: usize = 40;
    let mut children: Vec<Child> = (0..3)
        .map(|_| {
            spawn_child(
                "counter",
                &[dir_s, "shared-job", counter_s, &ROUNDS.to_string()],
            )
        })
        .collect();
    let mut lines = Vec::new();
    for child in &mut children {
        lines.extend(support::child_lines(child, "held "));
        assert!(child.wait().expect("child exits").success());
    }
    support::check_counter_holds(lines, &counter, 3 * ROUNDS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_a_holder_frees_the_key_at_once_and_wakes_waiters() {
    let dir = fresh_dir();
    let mut child = spawn_child("hold", &[dir.to_str().expect("utf-8"), "killed-holder"]);
    let child_token = held_token(&mut child);

    let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    // The child's ttl is 120s; the waiter gives up after 20s, so only the
    // holder's death can let it in.
    let waiter = tokio::spawn({
        let backend = backend.clone();
        async move {
            LockOptions::new(Duration::from_secs(10))
                .wait(Duration::from_secs(20))
                .acquire_on(backend, "killed-holder")
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    child.kill().expect("SIGKILL the holder");
    child.wait().expect("reap");
    let lease = waiter
        .await
        .expect("task")
        .expect("the dead holder's lock must be free long before its ttl");
    assert!(lease.token().get() > child_token);
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_a_permit_holder_frees_its_slot_at_once() {
    let dir = fresh_dir();
    let mut child = spawn_child("hold-permit", &[path(&dir), "killed-permit", "2"]);
    let child_token = held_token(&mut child);
    let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let two = |wait| {
        LockOptions::new(Duration::from_secs(10))
            .permits(2)
            .wait(wait)
    };
    let mine = two(Duration::ZERO)
        .acquire_on(backend.clone(), "killed-permit")
        .await
        .expect("the second slot is free");
    assert_eq!(mine.slot(), Some(1), "the child holds slot 0");
    assert!(
        two(Duration::ZERO)
            .acquire_on(backend.clone(), "killed-permit")
            .await
            .is_err(),
        "both slots are held"
    );
    // The child's ttl is 120 s; the waiter gives up after 20 s, so only the
    // child's death can free its slot.
    let waiter = tokio::spawn({
        let backend = backend.clone();
        async move {
            two(Duration::from_secs(20))
                .acquire_on(backend, "killed-permit")
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    child.kill().expect("SIGKILL the permit holder");
    child.wait().expect("reap");
    let freed = waiter
        .await
        .expect("task")
        .expect("the killed holder's slot must be free long before its ttl");
    assert_eq!(freed.slot(), Some(0), "the killed holder's slot");
    assert!(freed.token().get() > child_token);
    assert!(freed.token() > mine.token(), "a token drawn anew per grant");
    assert!(!mine.is_lost(), "the other slot's holder is untouched");
    freed.release().await.expect("release");
    mine.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_in_two_processes_share_the_phase_and_a_killed_one_leaves_the_other_holding() {
    let dir = fresh_dir();
    let key = LockKey::new("killed-reader").expect("key");
    let mut first = spawn_child("hold-shared", &[path(&dir), key.as_str()]);
    let phase = held_token(&mut first);
    let mut second = spawn_child("hold-shared", &[path(&dir), key.as_str()]);
    assert_eq!(held_token(&mut second), phase, "one read phase, one token");
    let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    // Both children's ttl is 120 s; the writer gives up after 20 s, so only
    // their deaths can let it in.
    let writer = tokio::spawn({
        let backend = backend.clone();
        async move {
            LockOptions::new(Duration::from_secs(10))
                .wait(Duration::from_secs(20))
                .acquire_on(backend, "killed-reader")
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.kill().expect("SIGKILL one reader");
    first.wait().expect("reap");
    let holding = backend.holder(&key).await.expect("holder").expect("held");
    assert_eq!(
        holding.token.map(|t| t.get()),
        Some(phase),
        "the other reader still holds"
    );
    let other = OwnerId::random().expect("random");
    let attempt = backend
        .try_acquire(&AcquireRequest::new(&key, &other, Duration::from_secs(10)))
        .await
        .expect("attempt");
    assert!(matches!(attempt, Attempt::Held { .. }), "{attempt:?}");
    backend
        .release(&ReleaseRequest::new(&key, &other))
        .await
        .expect("the attempt's mark goes");
    assert!(!writer.is_finished(), "a reader still holds");
    second.kill().expect("SIGKILL the last reader");
    second.wait().expect("reap");
    let lease = writer
        .await
        .expect("task")
        .expect("the last reader's death lets the writer in long before its ttl");
    assert!(
        lease.token().get() > phase,
        "a writer's token is above the readers'"
    );
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_writers_behind_readers_are_served_in_the_order_they_queued() {
    let dir = fresh_dir();
    let backend = || -> Arc<dyn Backend> { Arc::new(FileBackend::open(&dir).expect("dir")) };
    let reader = LockOptions::new(Duration::from_secs(30))
        .mode(LockMode::Shared)
        .acquire_on(backend(), "fair-behind-readers")
        .await
        .expect("a free key");
    // A writer keeps the key until the test has made its plain attempt:
    // else both could be served and gone before it.
    let (go, _) = tokio::sync::watch::channel(false);
    let fair_writer = |backend: Arc<dyn Backend>| {
        let mut go = go.subscribe();
        tokio::spawn(async move {
            let lease = LockOptions::new(Duration::from_secs(10))
                .fair(true)
                .wait(Duration::from_secs(20))
                .acquire_on(backend, "fair-behind-readers")
                .await?;
            let _ = go.wait_for(|go| *go).await;
            let token = lease.token();
            lease.release().await?;
            Ok::<_, dlock::LockError>(token)
        })
    };
    // Each writer is in line (its entry in the key's queue file) before
    // the next one starts, so the order they queued is known.
    let first = fair_writer(backend());
    until_queued(&dir, "fair-behind-readers", 1).await;
    let second = fair_writer(backend());
    until_queued(&dir, "fair-behind-readers", 2).await;
    let read_token = reader.token();
    reader.release().await.expect("release");
    // The last reader's release hands the key to the first in line, so a
    // plain attempt right after it finds the key held.
    let key = LockKey::new("fair-behind-readers").expect("key");
    let barger = OwnerId::random().expect("random");
    let barged = backend()
        .try_acquire(&AcquireRequest::new(&key, &barger, Duration::from_secs(10)))
        .await
        .expect("attempt");
    assert!(matches!(barged, Attempt::Held { .. }), "{barged:?}");
    go.send_replace(true);
    let first = first.await.expect("task").expect("the first writer");
    let second = second.await.expect("task").expect("the second writer");
    assert!(read_token < first, "a writer's token is above the readers'");
    assert!(first < second, "served in the order they queued");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_phase_is_listed_with_its_token_and_a_forced_release_lets_a_writer_in_above_it() {
    let dir = fresh_dir();
    let one: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let two: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let read = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let first = read
        .acquire_on(one.clone(), "phase:listed")
        .await
        .expect("free");
    let second = read
        .acquire_on(two.clone(), "phase:listed")
        .await
        .expect("shared");
    assert_eq!(first.token(), second.token());
    let held = two.held("phase:").await.expect("listing");
    let listed: Vec<_> = held
        .iter()
        .map(|(key, h)| (key.as_str(), h.token))
        .collect();
    assert_eq!(listed, [("phase:listed", Some(first.token()))]);
    let key = LockKey::new("phase:listed").expect("key");
    assert!(two.force_release(&key).await.expect("force"), "it was held");
    assert_eq!(one.holder(&key).await.expect("holder"), None);
    let writer = LockOptions::new(Duration::from_secs(10))
        .acquire_on(one.clone(), "phase:listed")
        .await
        .expect("free once forced");
    assert!(writer.token() > first.token());
    writer.release().await.expect("release");
    drop((first, second));
}

/// The token a holding child reports; its further output is drained so it
/// never writes into a closed pipe.
fn held_token(child: &mut Child) -> u64 {
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let token = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|line| line.strip_prefix("held ").and_then(|t| t.parse().ok()))
        .expect("the child reports its token");
    std::thread::spawn(move || lines.for_each(drop));
    token
}

#[tokio::test]
async fn holder_reads_the_recorded_token_and_identity_through_the_files_and_none_after_release() {
    let dir = fresh_dir();
    let holder: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    // A second backend on the directory stands for another process.
    let reader: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let key = LockKey::new("leader:\nelection").expect("key");
    let identity = "web 3\n100% (pid 4121)";
    let owner = OwnerId::random().expect("random");
    let request =
        AcquireRequest::new(&key, &owner, Duration::from_secs(30)).with_identity(Some(identity));
    let Attempt::Acquired(grant) = holder.try_acquire(&request).await.expect("acquire") else {
        panic!("a fresh key is free");
    };
    let holding = reader
        .holder(&key)
        .await
        .expect("holder")
        .expect("the key is held");
    assert_eq!(holding.token, Some(grant.token));
    assert_eq!(holding.identity.as_deref(), Some(identity));
    let left = holding
        .expires_in
        .expect("the file backend knows the expiry");
    assert!(left <= Duration::from_secs(30), "{left:?}");
    holder
        .release(&ReleaseRequest::new(&key, &owner))
        .await
        .expect("release");
    assert_eq!(reader.holder(&key).await.expect("holder"), None);
    assert_eq!(holder.holder(&key).await.expect("holder"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holder_is_none_once_the_holding_process_is_killed() {
    let dir = fresh_dir();
    let mut child = spawn_child("hold-as", &[path(&dir), "killed-leader", "leader 1"]);
    let child_token = held_token(&mut child);
    let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let key = LockKey::new("killed-leader").expect("key");
    let holding = backend.holder(&key).await.expect("holder").expect("held");
    assert_eq!(
        (holding.token.map(|t| t.get()), holding.identity.as_deref()),
        (Some(child_token), Some("leader 1"))
    );
    child.kill().expect("SIGKILL the holder");
    child.wait().expect("reap");
    // Its 120 s lease has not run out: only its death frees the key.
    assert_eq!(backend.holder(&key).await.expect("holder"), None);
    let lease = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), "killed-leader")
        .await
        .expect("holder and try_acquire agree that the key is free");
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_watch_registered_while_held_resolves_on_release() {
    let dir = fresh_dir();
    let holder: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let observer: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let key = LockKey::new("watched-leader").expect("key");
    let free = observer.watch_holder(&key).await.expect("watch");
    assert_eq!(
        free.recheck(),
        Some(Duration::from_millis(50)),
        "nothing announces an acquisition: a free key is polled"
    );
    let owner = OwnerId::random().expect("random");
    let request =
        AcquireRequest::new(&key, &owner, Duration::from_secs(60)).with_identity(Some("me"));
    assert!(matches!(
        holder.try_acquire(&request).await.expect("acquire"),
        Attempt::Acquired(_)
    ));
    let mut notice = observer.watch_holder(&key).await.expect("watch");
    assert_eq!(notice.recheck(), None, "a held key is not polled");
    assert!(
        tokio::time::timeout(Duration::from_millis(200), &mut notice)
            .await
            .is_err(),
        "the notice waits while the key stays held"
    );
    holder
        .release(&ReleaseRequest::new(&key, &owner))
        .await
        .expect("release");
    // Only the release can wake it within the 60 s lease.
    within(10, "the release notice", notice).await;
    assert_eq!(observer.holder(&key).await.expect("holder"), None);
}

#[tokio::test]
async fn tokens_keep_rising_across_process_restarts() {
    let dir = fresh_dir();
    let dir_s = dir.to_str().expect("utf-8");
    let mut tokens = Vec::new();
    for _ in 0..2 {
        let mut child = spawn_child("once", &[dir_s, "restarts"]);
        let lines = support::child_lines(&mut child, "held ");
        assert!(child.wait().expect("exit").success());
        tokens.push(lines[0].parse::<u64>().expect("token"));
    }
    // And a fresh backend instance in this process continues the sequence.
    let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let lease = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend, "restarts")
        .await
        .expect("free");
    tokens.push(lease.token().get());
    lease.release().await.expect("release");
    assert!(
        tokens.windows(2).all(|w| w[1] > w[0]),
        "tokens must rise across processes: {tokens:?}"
    );
}

#[tokio::test]
async fn a_corrupt_state_file_is_an_error_not_a_reset_counter() {
    let dir = fresh_dir();
    let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let lease = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), "corrupt")
        .await
        .expect("free");
    lease.release().await.expect("release");
    std::fs::write(dir.join("corrupt.state"), "not a state file").expect("overwrite");
    let err = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend, "corrupt")
        .await
        .expect_err("a corrupt counter must not be silently reset");
    assert!(err.to_string().contains("corrupt"), "{err}");
}

#[tokio::test]
async fn an_unusable_directory_is_a_clear_error() {
    let file = fresh_dir();
    std::fs::create_dir_all(file.parent().expect("parent")).expect("parent");
    std::fs::write(&file, "a file, not a directory").expect("file");
    let err = FileBackend::open(file.join("locks")).expect_err("cannot create under a file");
    assert!(err.to_string().contains("cannot create"), "{err}");
}

#[tokio::test]
async fn finished_leases_leave_no_alive_files_behind() {
    let dir = fresh_dir();
    let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let alive_files = || {
        std::fs::read_dir(&dir)
            .expect("dir")
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().ends_with(".alive"))
            .count()
    };
    let released = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), "tidy")
        .await
        .expect("free");
    assert_eq!(alive_files(), 1, "a held lease has its alive file");
    released.release().await.expect("release");
    assert_eq!(alive_files(), 0);
    let kept = LockOptions::new(Duration::from_secs(10))
        .min_hold(Duration::from_secs(2))
        .acquire_on(backend.clone(), "tidy")
        .await
        .expect("free");
    kept.release()
        .await
        .expect("release within the minimum hold");
    assert_eq!(alive_files(), 1, "the minimum hold keeps the key held");
    let next = LockOptions::new(Duration::from_secs(10))
        .wait(Duration::from_secs(10))
        .acquire_on(backend.clone(), "tidy")
        .await
        .expect("free after the minimum hold");
    next.release().await.expect("release");
    // The minimum hold's own release (timed, in the background) may still
    // be finishing: wait for the count to settle, not a fixed time.
    within(10, "alive files must not pile up", async {
        while alive_files() != 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// The alive files in `dir`.
fn alive_files(dir: &std::path::Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .expect("dir")
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.to_string_lossy().ends_with(".alive"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_alive_file_does_not_free_a_valid_lease() {
    // A temp-dir cleaner removes the holder's alive file. That is no proof
    // its process died: the key stays held until it is released.
    let dir = fresh_dir();
    let holder: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    // A second backend on the directory stands for another process.
    let other: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let lease = LockOptions::new(Duration::from_secs(60))
        .renew(false)
        .acquire_on(holder.clone(), "cleaned")
        .await
        .expect("free");
    for path in alive_files(&dir) {
        std::fs::remove_file(path).expect("remove the alive file");
    }
    let second = LockOptions::new(Duration::from_secs(60))
        .acquire_on(other.clone(), "cleaned")
        .await;
    assert!(
        matches!(second, Err(dlock::LockError::Held { .. })),
        "a second holder while the first is valid: {:?}",
        second.map(|l| l.token())
    );
    assert!(lease.check().is_ok());
    // A waiter still gets the key on release, though there is no alive
    // file to watch: only the release (not the 60 s ttl) can let it in
    // before its 20 s wait ends.
    let waiter = tokio::spawn(async move {
        LockOptions::new(Duration::from_secs(10))
            .wait(Duration::from_secs(20))
            .acquire_on(other, "cleaned")
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    lease.release().await.expect("release");
    let next = waiter
        .await
        .expect("task")
        .expect("the released key goes to the waiter");
    next.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_puts_its_removed_alive_file_back_at_renewal() {
    // So that its death frees the key at once again, and waiters can
    // watch it.
    let dir = fresh_dir();
    let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let lease = LockOptions::new(Duration::from_secs(3))
        .acquire_on(backend.clone(), "restored")
        .await
        .expect("free");
    let removed = alive_files(&dir);
    assert_eq!(removed.len(), 1);
    std::fs::remove_file(&removed[0]).expect("remove the alive file");
    within(10, "the alive file to come back", async {
        while alive_files(&dir) != removed {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let file = std::fs::File::open(&removed[0]).expect("open");
    assert!(
        matches!(file.try_lock(), Err(std::fs::TryLockError::WouldBlock)),
        "the holder's process must hold the new alive file locked"
    );
    assert!(lease.check().is_ok());
    lease.release().await.expect("release");
    assert!(alive_files(&dir).is_empty());
}

#[test]
fn twenty_abandoned_acquisitions_hold_no_key_and_leak_no_descriptor() {
    // In a process of its own, so no other test's files blur the count.
    let dir = fresh_dir();
    let child = support::child_command(
        module_path!(),
        CHILD_ROLE,
        "abandon",
        &[path(&dir), "abandoned"],
    )
    .stdout(std::process::Stdio::piped())
    .output()
    .expect("run the child");
    assert!(
        child.status.success(),
        "the child failed: {:?}",
        child.status
    );
    let out = String::from_utf8_lossy(&child.stdout);
    let field = |prefix: &str| -> Vec<usize> {
        out.lines()
            .find_map(|line| line.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` line in the child's output:\n{out}"))
            .split(' ')
            .map(|n| n.parse().expect("a number"))
            .collect()
    };
    assert_eq!(
        field("held "),
        [0],
        "abandoned acquisitions must not keep their keys"
    );
    let fds = field("fds ");
    assert_eq!(
        fds[1], fds[0],
        "abandoned acquisitions must not keep descriptors open"
    );
}

//! What a runtime that shuts down leaves behind: a lease a task of it still
//! held, and acquisitions it cut off half-way (a blocking library that
//! makes a runtime per call, a worker pool, `#[tokio::main]` returning while
//! tasks run). Another owner must get the key long before its ttl (60 s
//! here; the bound is 5 s), and the file backend must not keep the cut-off
//! acquisitions' files open.
//!
//! Memory and file run everywhere; Redis (127.0.0.1:6379 or
//! `DLOCK_REDIS_URL`) and PostgreSQL (127.0.0.1:5432 or `DLOCK_PG_URL`)
//! with their features.

mod support;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use dlock::backend::OwnerId;
use dlock::file::FileBackend;
use dlock::memory::MemoryBackend;
use dlock::{Backend, Lease, LockError, LockKey, LockOptions};
use tokio::runtime::Runtime;

/// Far longer than any test waits: a key freed within [`BOUND`] was not
/// freed by its ttl.
const TTL: Duration = Duration::from_secs(60);
const BOUND: Duration = Duration::from_secs(5);
/// Acquisitions cut off by their runtime's shutdown, at staggered moments.
const CUT_OFF: usize = 20;

fn fresh_key(label: &str) -> LockKey {
    LockKey::new(format!(
        "dlock-test:shutdown:{label}:{}",
        OwnerId::random().expect("random bytes")
    ))
    .expect("valid key")
}

/// A directory of the test's own, removed however the test ends.
fn fresh_dir(label: &str) -> support::ScratchDir {
    support::ScratchDir::new(&format!("dlock-shutdown-{label}"))
}

/// A runtime like a blocking library makes for one call.
fn short_lived_runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

async fn take(backend: Arc<dyn Backend>, key: &LockKey) -> Lease {
    LockOptions::new(TTL)
        .acquire_on(backend, key)
        .await
        .unwrap_or_else(|err| panic!("{key} should be free: {err}"))
}

/// On a runtime of the test's own, another owner takes each key within
/// [`BOUND`]; returns the keys it could not take.
fn still_held(connect: impl Future<Output = Arc<dyn Backend>>, keys: &[LockKey]) -> Vec<String> {
    Runtime::new().expect("runtime").block_on(async {
        let backend = connect.await;
        let mut held = Vec::new();
        for key in keys {
            match LockOptions::new(TTL)
                .wait(BOUND)
                .acquire_on(Arc::clone(&backend), key)
                .await
            {
                Ok(lease) => lease.release().await.expect("release"),
                Err(err @ LockError::Timeout { .. }) => held.push(format!("{key}: {err}")),
                Err(err) => panic!("taking {key}: {err}"),
            }
        }
        held
    })
}

/// A task of a short-lived runtime holds a lease when the runtime shuts
/// down; `connect` makes the backend, on that runtime.
fn hold_when_runtime_shuts_down(
    connect: impl Future<Output = Arc<dyn Backend>> + Send + 'static,
) -> LockKey {
    let key = fresh_key("held");
    let runtime = short_lived_runtime();
    let held = key.clone();
    runtime.block_on(async move {
        let lease = take(connect.await, &held).await;
        tokio::spawn(async move {
            let _lease = lease;
            std::future::pending::<()>().await;
        });
        tokio::task::yield_now().await;
    });
    drop(runtime);
    key
}

/// A lease taken on a short-lived runtime outlives it, and is dropped where
/// no runtime runs at all.
fn drop_with_no_runtime(connect: impl Future<Output = Arc<dyn Backend>>) -> LockKey {
    let key = fresh_key("no-runtime");
    let runtime = short_lived_runtime();
    let lease = runtime.block_on(async {
        let backend = connect.await;
        take(backend, &key).await
    });
    drop(runtime);
    drop(lease);
    key
}

/// Acquisitions, each on a runtime of its own that shuts down a little
/// later each time: some are cut off before they reach the store, some
/// mid-flight, some after they were granted.
fn cut_off_by_runtime_shutdown(
    connect: impl Fn() -> std::pin::Pin<Box<dyn Future<Output = Arc<dyn Backend>> + Send>>,
) -> Vec<LockKey> {
    let keys: Vec<LockKey> = (0..CUT_OFF).map(|_| fresh_key("cut")).collect();
    for (i, key) in keys.iter().enumerate() {
        let runtime = short_lived_runtime();
        let backend = runtime.block_on(connect());
        let key = key.clone();
        runtime.spawn(async move {
            let _ = LockOptions::new(TTL).acquire_on(backend, &key).await;
            std::future::pending::<()>().await;
        });
        std::thread::sleep(Duration::from_micros(150 * i as u64));
        runtime.shutdown_background();
    }
    keys
}

fn assert_free(held: Vec<String>) {
    assert!(
        held.is_empty(),
        "{} key(s) still held {BOUND:?} after their runtime shut down (ttl {TTL:?}):\n{}",
        held.len(),
        held.join("\n")
    );
}

fn memory_backend(
    backend: &MemoryBackend,
) -> impl Future<Output = Arc<dyn Backend>> + Send + 'static {
    let backend = backend.clone();
    async move { Arc::new(backend) as Arc<dyn Backend> }
}

#[test]
fn memory_a_lease_held_when_its_runtime_shuts_down_frees_the_key_at_once() {
    let backend = MemoryBackend::new();
    let key = hold_when_runtime_shuts_down(memory_backend(&backend));
    assert_free(still_held(memory_backend(&backend), &[key]));
}

#[test]
fn memory_a_lease_dropped_with_no_runtime_left_frees_the_key_at_once() {
    let backend = MemoryBackend::new();
    let key = drop_with_no_runtime(memory_backend(&backend));
    assert_free(still_held(memory_backend(&backend), &[key]));
}

/// Another file backend on `dir`: the view of another process.
fn file_backend(dir: &Path) -> impl Future<Output = Arc<dyn Backend>> + Send + 'static {
    let dir = dir.to_path_buf();
    async move { Arc::new(FileBackend::open(&dir).expect("lock dir")) as Arc<dyn Backend> }
}

/// A file backend to hand to a scenario, as [`the_file_backend`] makes it.
type ConnectFile = std::pin::Pin<Box<dyn Future<Output = Arc<dyn Backend>> + Send>>;

/// `backend` itself, which lives on as a process's backend does (in the
/// registry, say): the alive files of its leases stay open in it.
fn the_file_backend(backend: &FileBackend) -> ConnectFile {
    let backend = backend.clone();
    Box::pin(async move { Arc::new(backend) as Arc<dyn Backend> })
}

/// The descriptors this process has open on files in `dir`.
fn open_in(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir("/proc/self/fd")
        .map(|fds| {
            fds.filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
                .filter(|target| target.starts_with(dir))
                .collect()
        })
        .unwrap_or_default()
}

/// Runs `scenario` on a file backend in a fresh directory `label`, then
/// checks its key is free at once (through a backend of its own).
fn file_key_freed_at_once(label: &str, scenario: fn(ConnectFile) -> LockKey) {
    let dir = fresh_dir(label);
    let backend = FileBackend::open(&dir).expect("lock dir");
    let key = scenario(the_file_backend(&backend));
    let held = still_held(file_backend(&dir), &[key]);
    assert_free(held);
}

#[test]
fn file_a_lease_held_when_its_runtime_shuts_down_frees_the_key_at_once() {
    file_key_freed_at_once("held", hold_when_runtime_shuts_down);
}

#[test]
fn file_a_lease_dropped_with_no_runtime_left_frees_the_key_at_once() {
    file_key_freed_at_once("no-runtime", drop_with_no_runtime);
}

#[test]
fn file_acquisitions_cut_off_by_their_runtime_shutting_down_leave_no_key_held_and_no_file_open() {
    let dir = fresh_dir("cut");
    // One backend, as a process has: the cut-off acquisitions' files would
    // stay open in it.
    let backend = FileBackend::open(&dir).expect("lock dir");
    let keys = cut_off_by_runtime_shutdown(|| the_file_backend(&backend));
    let held = still_held(file_backend(&dir), &keys);
    let open = open_in(&dir);
    assert_free(held);
    assert!(
        open.is_empty(),
        "files still open after every acquisition was cut off: {open:?}"
    );
}

#[cfg(unix)]
#[test]
fn a_lease_a_forked_child_drops_with_no_runtime_is_released_by_the_childs_own_fallback() {
    // fork() copies only the calling thread: a lock another test's thread
    // of this process held at that instant (a backend's, the allocator's)
    // stays locked in the child forever, and the child hangs instead of
    // releasing. So the fork happens in a process of its own, this test
    // binary run again for this one test alone.
    const ALONE: &str = "DLOCK_FORK_TEST_ALONE";
    if std::env::var_os(ALONE).is_none() {
        let name =
            "a_lease_a_forked_child_drops_with_no_runtime_is_released_by_the_childs_own_fallback";
        let output = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args([name, "--exact", "--test-threads=1", "--nocapture"])
            .env(ALONE, "1")
            .output()
            .expect("the test binary runs again");
        assert!(
            output.status.success(),
            "the fork test, alone in its process, failed:\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            String::from_utf8_lossy(&output.stdout).contains("1 passed"),
            "the fork test did not run alone: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        return;
    }
    // The parent's fallback thread runs; a forked child inherits its queue
    // but not the thread, and must start its own. It is started by a
    // memory lease, whose release needs no blocking thread: such a thread
    // parks and unparks through a table the whole process shares, and a
    // child forked while it does so finds that table locked for ever.
    let warm = MemoryBackend::new();
    let warm_key = drop_with_no_runtime(memory_backend(&warm));
    assert_free(still_held(memory_backend(&warm), &[warm_key]));
    until_other_threads_sleep();

    let dir = fresh_dir("fork");
    let key = fresh_key("forked");
    // The child tells through a pipe that it dropped the lease: a byte, or
    // the end of the pipe should it die first.
    let mut pipe = [0; 2];
    // SAFETY: pipe() fills the two descriptors of a fresh pipe.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0, "pipe failed");
    let [from_child, to_parent] = pipe;
    // SAFETY: the child only takes and drops a lease on runtimes of its
    // own, says so, and then sleeps, alive (so its process keeps the alive
    // file open unless the lease was released), until the parent kills it.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        unsafe { libc::close(from_child) };
        let backend = FileBackend::open(&dir).expect("lock dir");
        let runtime = short_lived_runtime();
        let lease = runtime.block_on(take(Arc::new(backend), &key));
        drop(runtime);
        drop(lease);
        // SAFETY: writes one byte from a live buffer to the pipe.
        unsafe { libc::write(to_parent, b"d".as_ptr().cast(), 1) };
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
    // SAFETY: closes this process's copy of the write end.
    unsafe { libc::close(to_parent) };
    let answered = child_answers(from_child, CHILD_BOUND);
    unsafe { libc::close(from_child) };
    // Taken and dropped by the child, which is still alive.
    let held = still_held(file_backend(&dir), &[key]);
    let mut status = 0;
    // SAFETY: looks at, then ends, the child forked above.
    let alive = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == 0;
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, &mut status, 0);
    }
    assert!(
        answered,
        "the forked child did not drop its lease within {CHILD_BOUND:?}: it hangs"
    );
    assert!(
        alive,
        "the child must still be alive when the key is checked (status {status})"
    );
    assert_free(held);
}

/// How long the forked child may take to take and drop its lease.
#[cfg(unix)]
const CHILD_BOUND: Duration = Duration::from_secs(60);

/// Whether `from_child` gives a byte or its end within `bound`.
#[cfg(unix)]
fn child_answers(from_child: i32, bound: Duration) -> bool {
    let deadline = std::time::Instant::now() + bound;
    let mut poll = libc::pollfd {
        fd: from_child,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: polls one live pollfd.
        match unsafe { libc::poll(&mut poll, 1, ms) } {
            0 => return false,
            n if n > 0 => break,
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            _ => panic!("poll failed: {}", std::io::Error::last_os_error()),
        }
    }
    let mut byte = 0u8;
    // SAFETY: reads one byte into a live buffer: the child's, or 0 at its end.
    while unsafe { libc::read(from_child, (&raw mut byte).cast(), 1) } < 0
        && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
    {}
    true
}

/// Waits until every other thread of this process sleeps, so that none is
/// half-way through a lock when the process forks.
#[cfg(unix)]
fn until_other_threads_sleep() {
    // SAFETY: gettid() has no preconditions.
    let me = unsafe { libc::gettid() }.to_string();
    let deadline = std::time::Instant::now() + BOUND;
    loop {
        let running: Vec<String> = std::fs::read_dir("/proc/self/task")
            .expect("/proc/self/task")
            .filter_map(|task| task.ok()?.file_name().into_string().ok())
            .filter(|tid| *tid != me)
            .filter(|tid| {
                // The state follows the last ')' of the stat line: S sleeps.
                std::fs::read_to_string(format!("/proc/self/task/{tid}/stat"))
                    .ok()
                    .and_then(|stat| {
                        stat.rsplit_once(')')
                            .map(|(_, rest)| rest.trim_start().starts_with('S'))
                    })
                    == Some(false)
            })
            .collect();
        if running.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "threads {running:?} still run {BOUND:?} after the warm-up; forking now could copy a held lock"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use dlock::redis::RedisBackend;

    fn redis_url() -> String {
        std::env::var("DLOCK_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
    }

    /// A backend connected on the runtime this is awaited on: its
    /// connection lives and dies with that runtime.
    fn redis_backend() -> std::pin::Pin<Box<dyn Future<Output = Arc<dyn Backend>> + Send>> {
        Box::pin(async {
            Arc::new(
                RedisBackend::connect(&redis_url())
                    .await
                    .expect("redis is running"),
            ) as Arc<dyn Backend>
        })
    }

    #[test]
    fn redis_a_lease_held_when_its_runtime_shuts_down_frees_the_key_at_once() {
        let key = hold_when_runtime_shuts_down(redis_backend());
        assert_free(still_held(redis_backend(), &[key]));
    }

    #[test]
    fn redis_a_lease_dropped_with_no_runtime_left_frees_the_key_at_once() {
        let key = drop_with_no_runtime(redis_backend());
        assert_free(still_held(redis_backend(), &[key]));
    }

    #[test]
    fn redis_acquisitions_cut_off_by_their_runtime_shutting_down_leave_no_key_held() {
        let keys = cut_off_by_runtime_shutdown(redis_backend);
        assert_free(still_held(redis_backend(), &keys));
    }
}

#[cfg(feature = "pg")]
mod pg {
    use super::*;
    use dlock::pg::PgBackend;

    fn pg_conn() -> String {
        std::env::var("DLOCK_PG_URL")
            .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".to_owned())
    }

    /// The backend's home: a runtime that keeps running for the whole
    /// test, as an application's main runtime does, while callers come and
    /// go on runtimes of their own.
    fn home() -> (Runtime, Arc<dyn Backend>) {
        let home = Runtime::new().expect("runtime");
        let backend = home.block_on(async {
            Arc::new(
                PgBackend::connect(&pg_conn())
                    .await
                    .expect("postgres is running"),
            ) as Arc<dyn Backend>
        });
        (home, backend)
    }

    fn the(
        backend: &Arc<dyn Backend>,
    ) -> std::pin::Pin<Box<dyn Future<Output = Arc<dyn Backend>> + Send>> {
        let backend = Arc::clone(backend);
        Box::pin(async move { backend })
    }

    #[test]
    fn pg_a_lease_held_when_its_callers_runtime_shuts_down_frees_the_key_at_once() {
        let (_home, backend) = home();
        let key = hold_when_runtime_shuts_down(the(&backend));
        assert_free(still_held(the(&backend), &[key]));
    }

    #[test]
    fn pg_a_lease_dropped_with_no_runtime_left_frees_the_key_at_once() {
        let (_home, backend) = home();
        let key = drop_with_no_runtime(the(&backend));
        assert_free(still_held(the(&backend), &[key]));
    }

    #[test]
    fn pg_acquisitions_cut_off_by_their_callers_runtime_shutting_down_leave_no_key_held() {
        let (_home, backend) = home();
        let keys = cut_off_by_runtime_shutdown(|| the(&backend));
        assert_free(still_held(the(&backend), &keys));
    }
}

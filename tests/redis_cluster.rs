//! The conformance suite on `RedisBackend` against a real 3-master Redis
//! Cluster that this test binary starts for itself: three cluster-enabled
//! `redis-server`s on free loopback ports, joined with
//! `redis-cli --cluster create`, shared by every test of the binary and
//! killed when it exits.

mod conformance;
mod redis_support;
mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::{Mutex, OnceLock, mpsc};
use std::time::Duration;

use dlock::redis::RedisBackend;
use dlock::{Backend, LockOptions};
use redis_support::RedisServer;

/// The running cluster: its node URLs.
struct Cluster {
    urls: Vec<String>,
}

/// What the exit hook cleans up: server pids and their directories.
static STARTED: Mutex<Vec<(u32, PathBuf)>> = Mutex::new(Vec::new());

extern "C" fn kill_cluster_at_exit() {
    let started = STARTED.lock().map(|s| s.clone()).unwrap_or_default();
    for (pid, dir) in started {
        // SAFETY: kill(2) on a child's pid; at worst the process is gone.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Starts the cluster once for the whole binary. The servers are started by
/// a thread that lives as long as the process, so the kernel kills them
/// (parent-death signal) if the process dies; a normal exit kills them in
/// an exit hook.
fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            let servers = redis_support::start_cluster();
            if let Ok(mut started) = STARTED.lock() {
                started.extend(
                    servers
                        .iter()
                        .filter_map(|s| Some((s.pid()?, s.dir().to_path_buf()))),
                );
            }
            // SAFETY: registering a plain extern "C" fn with atexit(3).
            unsafe {
                libc::atexit(kill_cluster_at_exit);
            }
            let _ = sender.send(servers.iter().map(RedisServer::url).collect::<Vec<_>>());
            // Keep the servers (and this thread, their parent) alive.
            loop {
                std::thread::park();
            }
        });
        let urls = receiver
            .recv_timeout(Duration::from_secs(120))
            .expect("the test cluster starts");
        Cluster { urls }
    })
}

async fn backend() -> Arc<dyn Backend> {
    let urls = tokio::task::spawn_blocking(|| cluster().urls.clone())
        .await
        .expect("cluster start");
    let redis = RedisBackend::connect(&urls[0])
        .await
        .expect("connect to the cluster");
    assert!(redis.is_cluster(), "the cluster must be detected");
    Arc::new(redis)
}

conformance::suite!(backend);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_on_every_master_lock_and_wake_waiters_through_one_seed() {
    let backend = backend().await;
    // Enough keys that all three masters hold some of them.
    for i in 0..30 {
        let key = conformance::fresh_key(&format!("spread-{i}"));
        let lease = LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend.clone(), &key)
            .await
            .expect("free");
        let waiter = support::spawn_waiter(backend.clone(), &key, 10, 20);
        tokio::task::yield_now().await;
        let token = lease.token();
        lease.release().await.expect("release");
        let next = waiter.await.expect("task").expect("the waiter gets it");
        assert!(next.token() > token);
        next.release().await.expect("release");
    }
}

//! The conformance suite on `RedisBackend` against a real 3-master Redis
//! Cluster that this test binary starts for itself: three cluster-enabled
//! `redis-server`s on free loopback ports, joined with
//! `redis-cli --cluster create`, shared by every test of the binary and
//! killed when it exits.

mod redis_support;
mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::{Mutex, OnceLock, mpsc};
use std::time::Duration;

use dlock::redis::RedisBackend;
use dlock::{Backend, LockOptions};
use redis_support::RedisServer;

/// The running cluster: its nodes' URLs and `host:port` addresses.
struct Cluster {
    urls: Vec<String>,
    addresses: Vec<String>,
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
            let _ = sender.send(Cluster {
                urls: servers.iter().map(RedisServer::url).collect(),
                addresses: servers.iter().map(RedisServer::address).collect(),
            });
            // Keep the servers (and this thread, their parent) alive.
            loop {
                std::thread::park();
            }
        });
        receiver
            .recv_timeout(Duration::from_secs(120))
            .expect("the test cluster starts")
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

dlock_runtime::conformance_suite!(backend);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_on_every_master_lock_and_wake_waiters_through_one_seed() {
    let backend = backend().await;
    // Enough keys that all three masters hold some of them.
    for i in 0..30 {
        let key = dlock_runtime::conformance::fresh_key(&format!("spread-{i}"));
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

/// `redis-cli` options that reach the node at `address` (`host:port`).
fn node_target(address: &str) -> [&str; 4] {
    let (host, port) = address.rsplit_once(':').expect("host:port");
    ["-h", host, "-p", port]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_least_privilege_acl_user_can_lock_wait_renew_and_release_on_the_cluster() {
    let cluster = tokio::task::spawn_blocking(cluster)
        .await
        .expect("cluster start");
    // ACL users are per node: the user exists on every one.
    for address in &cluster.addresses {
        redis_support::create_least_privilege_user(
            &node_target(address),
            "cluster-locker",
            "cluster-locker-pass-7",
        );
        redis_support::reset_acl_log(&node_target(address));
    }
    let refused = || {
        cluster
            .addresses
            .iter()
            .flat_map(|address| redis_support::refused_commands(&node_target(address)))
            .filter(|command| !redis_support::HARMLESS_REFUSALS.contains(&command.as_str()))
            .collect::<Vec<_>>()
    };
    let urls: Vec<String> = cluster
        .addresses
        .iter()
        .map(|address| format!("redis://cluster-locker:cluster-locker-pass-7@{address}"))
        .collect();
    // Seeds as a user gives them; the cluster is detected, not named.
    let redis = urls[1..]
        .iter()
        .fold(RedisBackend::builder(&urls[0]), |builder, url| {
            builder.node(url)
        })
        .connect()
        .await
        .unwrap_or_else(|err| panic!("{err}; refused: {:?}", refused()));
    assert!(redis.is_cluster(), "the cluster must be detected");
    // Enough keys that every master holds some.
    if let Err(err) = redis_support::every_operation(&redis, 12).await {
        panic!("{err}; refused: {:?}", refused());
    }
    // And through the front door: a waiter woken by a release.
    let backend: Arc<dyn Backend> = Arc::new(redis);
    let key = dlock_runtime::conformance::fresh_key("acl-wait");
    let holder = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let waiter = support::spawn_waiter(backend.clone(), &key, 10, 10);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let token = holder.token();
    holder.release().await.expect("release");
    let next = support::within(15, "the waiter", waiter)
        .await
        .expect("task")
        .expect("acquired");
    assert!(next.token() > token);
    next.release().await.expect("release");
    // Nothing the client sent was refused: the rights are not just enough
    // to get by, they are what redis-rs and dlock use.
    assert_eq!(refused(), Vec::<String>::new(), "commands the ACL refused");
}

//! The conformance suite on `RedisBackend` against a real 3-master Redis
//! Cluster that this test binary starts for itself: three cluster-enabled
//! `redis-server`s on free loopback ports, joined with
//! `redis-cli --cluster create`, shared by every test of the binary and
//! killed when it exits.

use crate::redis_support;
use crate::support;

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

/// A cluster of its own for a test that breaks it, started on a thread of
/// its own (the servers die with the thread that started them) and killed
/// when dropped.
struct OwnCluster {
    addresses: Vec<String>,
    /// Each node's process id, in the order of `addresses`.
    pids: Vec<u32>,
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl OwnCluster {
    fn start() -> Self {
        Self::start_of(0, 5000)
    }

    /// A cluster of three masters with `replicas` replicas each
    /// (`redis_support::start_cluster_of`).
    fn start_of(replicas: usize, node_timeout_ms: u32) -> Self {
        let (started, nodes) = mpsc::channel::<Vec<(String, u32)>>();
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let servers = redis_support::start_cluster_of(replicas, node_timeout_ms);
            let _ = started.send(
                servers
                    .iter()
                    .map(|s| (s.address(), s.pid().expect("running")))
                    .collect(),
            );
            let _ = stopped.recv();
            drop(servers);
        });
        let nodes = nodes
            .recv_timeout(Duration::from_secs(120))
            .expect("the cluster starts");
        Self {
            addresses: nodes.iter().map(|(a, _)| a.clone()).collect(),
            pids: nodes.iter().map(|(_, p)| *p).collect(),
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// The process id of the node at `address` (`host:port`).
    fn pid_of(&self, address: &str) -> u32 {
        let at = self
            .addresses
            .iter()
            .position(|a| a == address)
            .unwrap_or_else(|| panic!("no node at {address}"));
        self.pids[at]
    }
}

impl Drop for OwnCluster {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Puts a proxy in front of every node of `cluster` and has each node
/// announce its proxy's port, so that clients (which connect to the
/// addresses `CLUSTER SLOTS` gives) go through the proxies; the nodes still
/// talk to each other directly.
async fn behind_proxies(cluster: &OwnCluster) -> Vec<support::proxy::Proxy> {
    let mut proxies = Vec::new();
    for address in &cluster.addresses {
        let proxy = support::proxy::Proxy::bind(address.clone()).await;
        let out = redis_support::cli(
            &node_target(address),
            &[
                "CONFIG",
                "SET",
                "cluster-announce-port",
                &proxy.port.to_string(),
            ],
        );
        assert_eq!(out, "OK", "announce the proxy's port");
        proxies.push(proxy);
    }
    let ports: Vec<String> = proxies.iter().map(|p| p.port.to_string()).collect();
    let addresses = cluster.addresses.clone();
    support::within(30, "every node to announce its proxy", async {
        loop {
            let settled = addresses.iter().all(|address| {
                let slots = redis_support::cli(&node_target(address), &["CLUSTER", "SLOTS"]);
                ports
                    .iter()
                    .all(|port| slots.lines().any(|line| line == port))
            });
            if settled {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    proxies
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_connection_gone_silent_is_replaced_and_leases_keep_renewing() {
    let cluster = tokio::task::spawn_blocking(OwnCluster::start)
        .await
        .expect("cluster start");
    let proxies = behind_proxies(&cluster).await;
    let urls: Vec<String> = proxies
        .iter()
        .map(|p| format!("redis://127.0.0.1:{}", p.port))
        .collect();
    let redis = urls[1..]
        .iter()
        .fold(RedisBackend::builder(&urls[0]), |builder, url| {
            builder.node(url)
        })
        .connect_timeout(Duration::from_secs(1))
        // Short enough that silence is noticed soon, long enough that a
        // loaded machine's slow reply is not taken for silence; a lease
        // that must outlive the silence has a ttl of three of it or more.
        .response_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect("connect through the proxies");
    assert!(redis.is_cluster(), "the cluster must be detected");
    let backend: Arc<dyn Backend> = Arc::new(redis);
    // Keys on every master, so that every node connection is in use.
    let keys: Vec<_> = (0..12)
        .map(|i| dlock_runtime::conformance::fresh_key(&format!("silent-cluster-{i}")))
        .collect();
    for key in &keys {
        LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend.clone(), key)
            .await
            .expect("free")
            .release()
            .await
            .expect("release");
    }
    let held = LockOptions::new(Duration::from_secs(12))
        .acquire_on(
            backend.clone(),
            dlock_runtime::conformance::fresh_key("silent-cluster-held"),
        )
        .await
        .expect("free");
    let opened: usize = proxies.iter().map(|p| p.connections()).sum();

    for proxy in &proxies {
        proxy.silence();
    }
    let callers: Vec<_> = keys
        .iter()
        .map(|key| support::spawn_waiter(backend.clone(), key, 30, 10))
        .collect();
    support::within(
        20,
        "locking again after the cluster's connections went silent",
        async {
            for caller in callers {
                caller
                    .await
                    .expect("task")
                    .expect("new connections must replace the silent ones")
                    .release()
                    .await
                    .expect("release");
            }
        },
    )
    .await;
    let new_connections = proxies.iter().map(|p| p.connections()).sum::<usize>() - opened;
    assert!(
        new_connections <= 2 * proxies.len(),
        "twelve callers on one silent cluster connection must share its replacement, not open \
         connections of their own: {new_connections} new connections"
    );

    let lease = LockOptions::new(Duration::from_secs(3))
        .acquire_on(
            backend.clone(),
            dlock_runtime::conformance::fresh_key("silent-cluster-after"),
        )
        .await
        .expect("free");
    tokio::time::sleep(Duration::from_secs(4)).await;
    for (which, lease) in [("taken after the silence", lease), ("held across it", held)] {
        assert!(
            lease.check().is_ok(),
            "the lease {which} was lost: {:?}",
            lease.check()
        );
        lease.release().await.expect("release");
    }
}

/// Sends `signal` to the process `pid`.
fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) on a child's pid; at worst the process is gone.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}

/// The addresses (`host:port`) of the master that serves `slot` and of its
/// replica, read from `CLUSTER NODES` on `node`.
fn master_and_replica_of(node: &str, slot: u16) -> (String, String) {
    let port = node.rsplit(':').next().expect("port");
    let nodes = redis_support::cli(&["-p", port], &["CLUSTER", "NODES"]);
    let address = |field: &str| field.split('@').next().expect("address").to_owned();
    let serves = |ranges: &[&str]| {
        ranges.iter().any(|range| {
            let mut ends = range.split('-').map(|n| n.parse::<u16>().ok());
            match (ends.next().flatten(), ends.next()) {
                (Some(first), Some(Some(last))) => (first..=last).contains(&slot),
                (Some(only), None) => only == slot,
                _ => false,
            }
        })
    };
    let lines: Vec<Vec<&str>> = nodes
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    let master = lines
        .iter()
        .find(|f| f.len() > 8 && f[2].contains("master") && serves(&f[8..]))
        .unwrap_or_else(|| panic!("no master serves slot {slot}:\n{nodes}"));
    let replica = lines
        .iter()
        .find(|f| f.len() > 3 && f[2].contains("slave") && f[3] == master[0])
        .unwrap_or_else(|| panic!("the master of slot {slot} has no replica:\n{nodes}"));
    (address(master[1]), address(replica[1]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_cluster_failover_to_a_replica_that_missed_the_last_tokens_tokens_rise_and_the_holder_is_told()
 {
    let cluster = tokio::task::spawn_blocking(|| OwnCluster::start_of(1, 1000))
        .await
        .expect("cluster start");
    let urls: Vec<String> = cluster
        .addresses
        .iter()
        .map(|a| format!("redis://{a}"))
        .collect();
    let redis = urls[1..]
        .iter()
        .fold(RedisBackend::builder(&urls[0]), |builder, url| {
            builder.node(url)
        })
        .connect_timeout(Duration::from_secs(1))
        // A loaded node's healthy reply is not taken for a dead one.
        .response_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect("connect to the cluster");
    let backend: Arc<dyn Backend> = Arc::new(redis);
    let key = dlock_runtime::conformance::fresh_key("cluster-failover");
    let lock = redis_support::lock_name(&key);
    let fence = lock.replace(":lock", ":fence");
    let first_port = cluster.addresses[0].rsplit(':').next().expect("port");
    let slot: u16 = redis_support::cli(&["-p", first_port], &["CLUSTER", "KEYSLOT", &lock])
        .parse()
        .expect("a slot number");
    let (master, replica) = master_and_replica_of(&cluster.addresses[0], slot);
    let on = |address: &str, args: &[&str]| {
        redis_support::cli(&["-p", address.rsplit(':').next().expect("port")], args)
    };

    let mut highest = 0;
    let cycle = async |highest: &mut u64| {
        let lease = LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend.clone(), &key)
            .await
            .expect("free");
        *highest = (*highest).max(lease.token().get());
        lease.release().await.expect("release");
    };
    for _ in 0..3 {
        cycle(&mut highest).await;
    }
    assert_eq!(
        on(&master, &["WAIT", "1", "5000"]),
        "1",
        "the replica caught up"
    );
    // The replica stops receiving; the master goes on handing out tokens
    // (and one lease) it will never see, then dies.
    // (Stopped, it cannot reconnect once the master cuts its link, and
    // nothing sent after the cut waits in its socket.)
    signal(cluster.pid_of(&replica), libc::SIGSTOP);
    on(&master, &["CLIENT", "KILL", "TYPE", "replica"]);
    for _ in 0..3 {
        cycle(&mut highest).await;
    }
    let held = LockOptions::new(Duration::from_secs(3))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    highest = highest.max(held.token().get());
    signal(cluster.pid_of(&master), libc::SIGKILL);
    signal(cluster.pid_of(&replica), libc::SIGCONT);
    assert_eq!(on(&replica, &["CLUSTER", "FAILOVER", "TAKEOVER"]), "OK");
    support::within(20, "the replica's promotion", async {
        while !on(&replica, &["ROLE"]).starts_with("master") {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let counter: u64 = on(&replica, &["GET", &fence]).parse().unwrap_or(0);
    assert!(
        counter < highest,
        "the promoted replica must have missed the last tokens for this to test anything \
         (its counter {counter}, the highest token {highest})"
    );

    let lost = support::within(30, "the lost signal", held.lost()).await;
    assert!(matches!(lost, dlock::LockError::LeaseLost { .. }), "{lost}");
    let after = support::within(30, "a lease on the new master", async {
        loop {
            match LockOptions::new(Duration::from_secs(10))
                .acquire_on(backend.clone(), &key)
                .await
            {
                Ok(lease) => return lease,
                Err(err) => {
                    eprintln!("not yet: {err}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    })
    .await;
    assert!(
        after.token().get() > highest,
        "after the failover got {}, not above {highest}",
        after.token()
    );
    after.release().await.expect("release");
}

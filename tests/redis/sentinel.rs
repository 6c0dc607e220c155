//! The Redis backend behind Redis Sentinel, against a real deployment each
//! test starts for itself on free loopback ports: one primary, one replica
//! (`--replicaof`) and three sentinels (`redis-server <conf> --sentinel`,
//! quorum 2, `down-after-milliseconds` 1000), all killed and their
//! directories removed on drop. The conformance suite shares one such
//! deployment for the whole binary (its sentinels wait 5000 ms before
//! taking the primary as down: nothing there wants a failover); every test
//! that breaks one has its own, and a test that forces its failover waits
//! 5000 ms too, so that no second failover follows the forced one.

use crate::redis_support;
use crate::support;

use std::collections::HashMap;
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

use dlock::redis::RedisBackend;
use dlock::{Backend, LockError, LockOptions};
use redis_support::RedisServer;
use support::within;
use tokio::time::sleep;

/// The name the sentinels monitor the primary under.
const SERVICE: &str = "dlock-primary";

/// A `redis-server --sentinel` child process with a generated config in a
/// directory of its own; killed (SIGKILL) and the directory removed on
/// drop. It dies with the thread that started it (parent-death signal).
struct Sentinel {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

impl Sentinel {
    /// Starts a sentinel on a free port; if another process took the port
    /// first (the sentinel exits), again on a fresh one.
    fn start(primary_port: u16, down_after_ms: u32) -> Self {
        for _ in 0..5 {
            let port = redis_support::free_port(false);
            let dir = redis_support::fresh_dir("sentinel");
            let conf = dir.join("sentinel.conf");
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile sentinel.log\n\
                     sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n\
                     sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n\
                     sentinel failover-timeout {SERVICE} 3000\n\
                     sentinel parallel-syncs {SERVICE} 1\n",
                    dir = dir.display()
                ),
            )
            .expect("write sentinel.conf");
            let mut sentinel = Self {
                child: None,
                port,
                dir,
            };
            if sentinel.launch() {
                return sentinel;
            }
        }
        panic!("no sentinel came up on any of five free ports");
    }

    /// Runs `redis-server --sentinel` on the directory's config and waits
    /// until this very process answers on the port: false if it exited
    /// (its port taken).
    fn launch(&mut self) -> bool {
        let mut command = Command::new("redis-server");
        command
            .arg(self.dir.join("sentinel.conf"))
            .arg("--sentinel")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: prctl is async-signal-safe; the sentinel dies with the
        // thread that started it, so a test process that dies without
        // running destructors leaves none behind.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command.spawn().expect("redis-server must be installed");
        // Another process on the port may answer a PING: only this
        // process's own id in `INFO server` says it is up.
        let own = format!("process_id:{}", child.id());
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(_)) = child.try_wait()
            {
                self.child = None;
                return false;
            }
            if self
                .cli(&["INFO", "server"])
                .lines()
                .any(|l| l.trim() == own)
            {
                return true;
            }
            assert!(
                Instant::now() < deadline,
                "the sentinel on port {} did not come up",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn cli(&self, args: &[&str]) -> String {
        redis_support::cli(&["-p", &self.port.to_string()], args)
    }

    /// `SENTINEL master <name>` as a map.
    fn master_fields(&self) -> HashMap<String, String> {
        let text = self.cli(&["SENTINEL", "MASTER", SERVICE]);
        let lines: Vec<&str> = text.lines().collect();
        lines
            .chunks(2)
            .filter_map(|pair| match pair {
                [name, value] => Some(((*name).to_owned(), (*value).to_owned())),
                _ => None,
            })
            .collect()
    }

    /// Starts the sentinel again from the config file it rewrote.
    fn relaunch(&mut self) {
        self.kill();
        assert!(self.launch(), "the sentinel did not come back");
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One primary, one replica, three sentinels.
struct Deployment {
    primary: RedisServer,
    replica: RedisServer,
    sentinels: Vec<Sentinel>,
}

impl Deployment {
    /// Starts the servers and waits until the replica is in sync and every
    /// sentinel knows the replica and the two other sentinels (a failover
    /// needs both). The sentinels take a primary silent for a second as
    /// down.
    fn start() -> Self {
        Self::start_with(1000)
    }

    /// For a test that forces its failover (`SENTINEL FAILOVER`): the
    /// sentinels wait 5 s before they take the primary as down, so on a
    /// loaded machine a PING answered late never starts a second,
    /// automatic failover behind the one the test forced, which would move
    /// the primary back while the test looks for it on the new one.
    fn start_for_a_forced_failover() -> Self {
        Self::start_with(5000)
    }

    /// As [`start`](Self::start), with the sentinels' `down-after-milliseconds`.
    fn start_with(down_after_ms: u32) -> Self {
        // A replica's sync starts at once, not after Redis's default 5 s
        // wait for more replicas to share it (either may end up primary).
        let no_delay = ["--repl-diskless-sync-delay", "0"];
        let primary = RedisServer::start(&no_delay);
        let replica_of = format!("127.0.0.1 {}", primary.port);
        let replica = RedisServer::start(&[no_delay[0], no_delay[1], "--replicaof", &replica_of]);
        let sentinels: Vec<Sentinel> = (0..3)
            .map(|_| Sentinel::start(primary.port, down_after_ms))
            .collect();
        let deployment = Self {
            primary,
            replica,
            sentinels,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let synced = deployment
                .replica
                .cli(&["INFO", "replication"])
                .contains("master_link_status:up");
            let known = deployment.sentinels.iter().all(|sentinel| {
                let fields = sentinel.master_fields();
                fields.get("num-slaves").map(String::as_str) == Some("1")
                    && fields.get("num-other-sentinels").map(String::as_str) == Some("2")
            });
            if synced && known {
                return deployment;
            }
            assert!(
                Instant::now() < deadline,
                "the sentinel deployment did not settle"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(Sentinel::url).collect()
    }

    /// The primary's port as the sentinels see it now.
    fn primary_port_named(&self) -> Option<u16> {
        let text = self.sentinels[0].cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE]);
        text.lines().nth(1)?.trim().parse().ok()
    }

    async fn backend(&self) -> RedisBackend {
        connect(&self.sentinel_urls()).await
    }
}

async fn connect(urls: &[String]) -> RedisBackend {
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    RedisBackend::sentinel(&urls, SERVICE)
        .connect_timeout(Duration::from_secs(2))
        .response_timeout(Duration::from_secs(1))
        .connect()
        .await
        .expect("connect through the test's sentinels")
}

fn role(server: &RedisServer) -> String {
    server
        .cli(&["ROLE"])
        .lines()
        .next()
        .unwrap_or("")
        .to_owned()
}

fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) on a child's pid; at worst the process is gone.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}

// ---------------------------------------------------------------------------
// The shared deployment: the conformance suite and the tests that do not
// break anything.

/// What the exit hook cleans up: the shared deployment's pids and
/// directories.
static STARTED: Mutex<Vec<(u32, PathBuf)>> = Mutex::new(Vec::new());

extern "C" fn kill_shared_at_exit() {
    let started = STARTED.lock().map(|s| s.clone()).unwrap_or_default();
    for (pid, dir) in started {
        signal(pid, libc::SIGKILL);
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The sentinels' URLs of the deployment shared by the whole binary,
/// started once by a thread that lives as long as the process (the
/// servers die with it) and killed at exit.
fn shared() -> &'static Vec<String> {
    static SHARED: OnceLock<Vec<String>> = OnceLock::new();
    SHARED.get_or_init(|| {
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            // Nothing here wants a failover: a primary starved for a
            // second on a loaded machine must not be taken as down.
            let deployment = Deployment::start_with(5000);
            if let Ok(mut started) = STARTED.lock() {
                for server in [&deployment.primary, &deployment.replica] {
                    if let Some(pid) = server.pid() {
                        started.push((pid, server.dir().to_path_buf()));
                    }
                }
                for sentinel in &deployment.sentinels {
                    if let Some(child) = &sentinel.child {
                        started.push((child.id(), sentinel.dir.clone()));
                    }
                }
            }
            // SAFETY: registering a plain extern "C" fn with atexit(3).
            unsafe {
                libc::atexit(kill_shared_at_exit);
            }
            let _ = sender.send(deployment.sentinel_urls());
            loop {
                std::thread::park();
            }
        });
        receiver
            .recv_timeout(Duration::from_secs(120))
            .expect("the shared sentinel deployment starts")
    })
}

async fn backend() -> Arc<dyn Backend> {
    let urls = tokio::task::spawn_blocking(shared)
        .await
        .expect("start the shared deployment");
    Arc::new(connect(urls).await)
}

dlock_runtime::conformance_suite!(backend);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_acks_grant_when_the_replica_acknowledges_and_give_the_key_back_when_too_few_do() {
    let urls: Vec<&str> = backend_urls().await;
    let acked = RedisBackend::sentinel(&urls, SERVICE)
        .replica_acks(1, Duration::from_secs(2))
        .connect()
        .await
        .expect("connect");
    let key = dlock_runtime::conformance::fresh_key("sentinel-acks");
    let lease = LockOptions::new(Duration::from_secs(10))
        .acquire_on(Arc::new(acked.clone()), &key)
        .await
        .expect("one replica acknowledges");
    lease.release().await.expect("release");

    // Two replicas asked for, one there: never a silent success.
    let greedy = RedisBackend::sentinel(&urls, SERVICE)
        .replica_acks(2, Duration::from_millis(200))
        .connect()
        .await
        .expect("connect");
    let err = LockOptions::new(Duration::from_secs(10))
        .acquire_on(Arc::new(greedy), &key)
        .await
        .expect_err("only one replica exists");
    assert!(matches!(err, LockError::Backend { .. }), "{err}");
    let text = format!("{err} {:?}", std::error::Error::source(&err));
    assert!(text.contains("only 1 of the 2 replicas"), "{text}");
    // The grant was given back: the key is free at once.
    let again = LockOptions::new(Duration::from_secs(10))
        .acquire_on(Arc::new(acked), &key)
        .await
        .expect("the refused grant was given back");
    again.release().await.expect("release");
}

/// Readers and permits wait for the replicas' acknowledgement too, and a
/// grant too few acknowledged is given back on its own side: the permit's
/// slot, the reader's share, free at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_acks_give_back_a_short_acknowledged_permit_or_read_on_its_own_side() {
    let urls: Vec<&str> = backend_urls().await;
    let acked: Arc<dyn Backend> = Arc::new(
        RedisBackend::sentinel(&urls, SERVICE)
            .replica_acks(1, Duration::from_secs(2))
            .connect()
            .await
            .expect("connect"),
    );
    let greedy: Arc<dyn Backend> = Arc::new(
        RedisBackend::sentinel(&urls, SERVICE)
            .replica_acks(2, Duration::from_millis(200))
            .connect()
            .await
            .expect("connect"),
    );
    let one = LockOptions::new(Duration::from_secs(10)).permits(1);
    let key = dlock_runtime::conformance::fresh_key("sentinel-acks-permit");
    let err = one
        .acquire_on(greedy.clone(), &key)
        .await
        .expect_err("only one replica exists");
    assert!(matches!(err, LockError::Backend { .. }), "{err}");
    let permit = one
        .acquire_on(acked.clone(), &key)
        .await
        .expect("the refused permit's slot was given back");
    assert_eq!(permit.slot(), Some(0));
    permit.release().await.expect("release");

    let key = dlock_runtime::conformance::fresh_key("sentinel-acks-read");
    let read = LockOptions::new(Duration::from_secs(10)).mode(dlock::LockMode::Shared);
    let err = read
        .acquire_on(greedy, &key)
        .await
        .expect_err("only one replica exists");
    assert!(matches!(err, LockError::Backend { .. }), "{err}");
    let writer = LockOptions::new(Duration::from_secs(10))
        .acquire_on(acked, &key)
        .await
        .expect("the refused reader's share was given back");
    writer.release().await.expect("release");
}

async fn backend_urls() -> Vec<&'static str> {
    let urls = tokio::task::spawn_blocking(shared)
        .await
        .expect("start the shared deployment");
    urls.iter().map(String::as_str).collect()
}

// ---------------------------------------------------------------------------
// Faults, each on a deployment of its own.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_primary_dies_tokens_rise_above_the_ones_the_replica_missed_and_the_holder_is_told()
 {
    let deployment = Deployment::start();
    let backend: Arc<dyn Backend> = Arc::new(deployment.backend().await);
    let key = dlock_runtime::conformance::fresh_key("sentinel-kill");
    let fence = redis_support::lock_name(&key).replace(":lock", ":fence");

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
        deployment.primary.cli(&["WAIT", "1", "5000"]),
        "1",
        "the replica caught up"
    );
    // The replica stops receiving: the primary goes on handing out tokens
    // (and one lease) it never sees, then dies.
    let replica_pid = deployment.replica.pid().expect("replica runs");
    signal(replica_pid, libc::SIGSTOP);
    deployment
        .primary
        .cli(&["CLIENT", "KILL", "TYPE", "replica"]);
    for _ in 0..3 {
        cycle(&mut highest).await;
    }
    let held = LockOptions::new(Duration::from_secs(3))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    highest = highest.max(held.token().get());
    let primary_pid = deployment.primary.pid().expect("primary runs");
    signal(primary_pid, libc::SIGKILL);
    signal(replica_pid, libc::SIGCONT);

    support::within(60, "the sentinels' promotion of the replica", async {
        while role(&deployment.replica) != "master"
            || deployment.primary_port_named() != Some(deployment.replica.port)
        {
            sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let counter: u64 = deployment
        .replica
        .cli(&["GET", &fence])
        .parse()
        .unwrap_or(0);
    assert!(
        counter < highest,
        "the promoted replica must have missed the last tokens for this to test anything \
         (its counter {counter}, the highest token {highest})"
    );

    let lost = within(30, "the lost signal", held.lost()).await;
    assert!(matches!(lost, LockError::LeaseLost { .. }), "{lost}");
    assert!(held.check().is_err(), "check() agrees with lost()");
    let after = within(30, "a lease on the new primary", async {
        loop {
            match LockOptions::new(Duration::from_secs(10))
                .acquire_on(backend.clone(), &key)
                .await
            {
                Ok(lease) => return lease,
                Err(err) => {
                    eprintln!("not yet: {err}");
                    sleep(Duration::from_millis(200)).await;
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
    // It was taken on the promoted replica, not on some stale node.
    assert_eq!(
        deployment
            .replica
            .cli(&["EXISTS", &redis_support::lock_name(&key)]),
        "1"
    );
    after.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_is_woken_by_a_release_on_the_new_primary_after_a_forced_failover() {
    let deployment = Deployment::start_for_a_forced_failover();
    let holder_side: Arc<dyn Backend> = Arc::new(deployment.backend().await);
    let waiter_backend = deployment.backend().await;
    let waiter_side: Arc<dyn Backend> = Arc::new(waiter_backend.clone());
    let key = dlock_runtime::conformance::fresh_key("sentinel-waiter");
    let channel = redis_support::lock_name(&key).replace(":lock", ":released");

    // A long ttl: a waiter that only woke at the holder's expiry would take
    // a minute, one woken by the release a moment.
    let ttl = Duration::from_secs(60);
    let held = LockOptions::new(ttl)
        .acquire_on(holder_side.clone(), &key)
        .await
        .expect("free");
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            LockOptions::new(Duration::from_secs(10))
                .wait(Duration::from_secs(120))
                .acquire_on(waiter_side, &key)
                .await
        }
    });
    within(20, "the waiter's subscription", async {
        while waiter_backend.subscribed_channels() == 0
            || deployment.primary.cli(&["PUBSUB", "NUMSUB", &channel]) != format!("{channel}\n1")
        {
            sleep(Duration::from_millis(50)).await;
        }
    })
    .await;

    assert_eq!(
        deployment.sentinels[0].cli(&["SENTINEL", "FAILOVER", SERVICE]),
        "OK"
    );
    within(60, "the forced failover", async {
        while role(&deployment.replica) != "master"
            || role(&deployment.primary) != "slave"
            || deployment.primary_port_named() != Some(deployment.replica.port)
        {
            sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    // The waiter follows: it subscribes again, on the new primary.
    within(30, "the waiter's subscription on the new primary", async {
        while deployment.replica.cli(&["PUBSUB", "NUMSUB", &channel]) != format!("{channel}\n1") {
            sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(
        deployment.primary.cli(&["PUBSUB", "NUMSUB", &channel]),
        format!("{channel}\n0"),
        "the demoted primary must not keep serving the waiter's subscription"
    );
    assert!(!waiter.is_finished(), "the key is still held");

    release_wakes_the_waiter(held, waiter, ttl).await;
}

/// The holder's release, sent to the new primary, wakes the waiter (well
/// before the holder's ttl would have), which gets the key with a higher
/// token.
async fn release_wakes_the_waiter(
    held: dlock::Lease,
    waiter: tokio::task::JoinHandle<Result<dlock::Lease, LockError>>,
    ttl: Duration,
) {
    let token = held.token();
    let released_at = Instant::now();
    within(30, "the release on the new primary", held.release())
        .await
        .expect("the holder's release reaches the new primary");
    let lease = within(30, "the woken waiter", waiter)
        .await
        .expect("the waiter task")
        .expect("the waiter gets the key");
    let waited = released_at.elapsed();
    assert!(
        waited < ttl / 2,
        "the waiter took {waited:?} after the release: woken by the holder's expiry, not the release"
    );
    assert!(lease.token() > token);
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locking_goes_on_through_a_forced_failover_without_a_new_backend() {
    let deployment = Deployment::start_for_a_forced_failover();
    let backend: Arc<dyn Backend> = Arc::new(deployment.backend().await);
    let key = dlock_runtime::conformance::fresh_key("sentinel-forced");
    let lock = redis_support::lock_name(&key);

    // The application: lock cycles, one after another, all along.
    let tokens = Arc::new(Mutex::new(Vec::<u64>::new()));
    let running = tokio::spawn({
        let (backend, key, tokens) = (backend.clone(), key.clone(), Arc::clone(&tokens));
        async move {
            loop {
                match LockOptions::new(Duration::from_secs(5))
                    .wait(Duration::from_secs(5))
                    .acquire_on(backend.clone(), &key)
                    .await
                {
                    Ok(lease) => {
                        tokens.lock().expect("tokens").push(lease.token().get());
                        sleep(Duration::from_millis(20)).await;
                        let _ = lease.release().await;
                    }
                    Err(err) => {
                        eprintln!("during the failover: {err}");
                        sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
    });
    let count = || tokens.lock().expect("tokens").len();
    within(20, "cycles before the failover", async {
        while count() < 10 {
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await;

    assert_eq!(
        deployment.sentinels[1].cli(&["SENTINEL", "FAILOVER", SERVICE]),
        "OK"
    );
    within(60, "the forced failover", async {
        while role(&deployment.replica) != "master"
            || role(&deployment.primary) != "slave"
            || deployment.primary_port_named() != Some(deployment.replica.port)
        {
            sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let before = count();
    within(30, "cycles after the failover", async {
        while count() < before + 20 {
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // The cycles run on the new primary: a lease taken now is there.
    let lease = LockOptions::new(Duration::from_secs(10))
        .wait(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a lease after the failover");
    assert_eq!(deployment.replica.cli(&["EXISTS", &lock]), "1");
    running.abort();
    lease.release().await.expect("release");

    let tokens = tokens.lock().expect("tokens").clone();
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "tokens must rise through the failover: {tokens:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_sentinel_down_connecting_fails_within_its_timeout_naming_that_no_sentinel_answered()
 {
    // One port refuses; one accepts and never answers.
    let refused = support::RefusedPort::new();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let silent_port = silent.local_addr().expect("addr").port();
    let urls = [
        format!("redis://:sentinel-secret@127.0.0.1:{}", refused.port),
        format!("redis://:sentinel-secret@127.0.0.1:{silent_port}"),
    ];
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let connect_timeout = Duration::from_secs(2);
    let response_timeout = Duration::from_millis(500);
    let started = Instant::now();
    let err = within(
        20,
        "connecting with every sentinel down",
        RedisBackend::sentinel(&urls, SERVICE)
            .data_node_auth(None, "data-secret")
            .connect_timeout(connect_timeout)
            .response_timeout(response_timeout)
            .connect(),
    )
    .await
    .expect_err("no sentinel answers");
    let took = started.elapsed();
    let text = format!("{err} {:?} {err:?}", std::error::Error::source(&err));
    assert!(matches!(err, LockError::Backend { .. }), "{text}");
    assert!(text.contains("no sentinel answered"), "{text}");
    assert!(!text.contains("sentinel-secret"), "{text}");
    assert!(!text.contains("data-secret"), "{text}");
    // Bounded by the timeouts (the look-up by the connect timeout), with
    // slack for a loaded machine; a hang would be caught by `within`.
    assert!(
        took < connect_timeout + response_timeout + Duration::from_secs(3),
        "took {took:?}"
    );
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_in_sentinel_urls_and_for_data_nodes_never_show_in_debug() {
    let builder = RedisBackend::sentinel(&["redis://user:sentinel-secret@127.0.0.1:1"], SERVICE)
        .data_node_auth(Some("app"), "data-secret");
    let shown = format!("{builder:?}");
    assert!(!shown.contains("sentinel-secret"), "{shown}");
    assert!(!shown.contains("data-secret"), "{shown}");
    assert!(shown.contains(SERVICE), "{shown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_sentinel_url_connects_through_the_sentinels_it_lists() {
    let urls = backend_urls().await;
    let hosts: Vec<&str> = urls
        .iter()
        .map(|url| url.trim_start_matches("redis://"))
        .collect();
    let url = format!("redis+sentinel://{}/{SERVICE}", hosts.join(","));
    let backend: Arc<dyn Backend> = Arc::new(
        RedisBackend::connect(&url)
            .await
            .expect("connect with a sentinel URL"),
    );
    let key = dlock_runtime::conformance::fresh_key("sentinel-url");
    let lease = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    assert!(lease.token().get() > 0);
    lease.release().await.expect("release");

    // A service the sentinels do not monitor: a clear error, in time.
    let unknown = format!("redis+sentinel://{}/no-such-primary", hosts.join(","));
    let err = RedisBackend::builder(&unknown)
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await
        .expect_err("no such primary");
    let text = format!("{err} {:?}", std::error::Error::source(&err));
    assert!(text.contains("monitors no primary named"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_turned_replica_behind_our_back_answers_readonly_and_the_commands_follow_the_new_one()
 {
    let deployment = Deployment::start();
    let backend: Arc<dyn Backend> = Arc::new(deployment.backend().await);
    let key = dlock_runtime::conformance::fresh_key("sentinel-readonly");
    let lock = redis_support::lock_name(&key);
    let before = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let first = before.token();
    before.release().await.expect("release");

    swap_behind_the_sentinels(&deployment).await;
    assert!(
        deployment
            .primary
            .cli(&["SET", "probe", "1"])
            .contains("READONLY"),
        "the old primary must refuse writes for this to test anything"
    );

    let after = within(30, "an acquisition after the swap", async {
        LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend.clone(), &key)
            .await
    })
    .await
    .expect("the READONLY answer makes the backend follow the new primary");
    assert!(after.token() > first);
    assert_eq!(deployment.replica.cli(&["EXISTS", &lock]), "1");
    after.release().await.expect("release on the new primary");
}

/// Swaps the roles without the sentinels, so nobody closes the clients'
/// connections to the old primary (which stay open, and refuse writes),
/// then tells the sentinels of the new primary.
async fn swap_behind_the_sentinels(deployment: &Deployment) {
    for sentinel in &deployment.sentinels {
        assert_eq!(sentinel.cli(&["SENTINEL", "REMOVE", SERVICE]), "OK");
    }
    assert_eq!(deployment.replica.cli(&["REPLICAOF", "NO", "ONE"]), "OK");
    let replica_of = deployment.replica.port.to_string();
    assert_eq!(
        deployment
            .primary
            .cli(&["REPLICAOF", "127.0.0.1", &replica_of]),
        "OK"
    );
    within(20, "the old primary's demotion", async {
        while role(&deployment.primary) != "slave" {
            sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    for sentinel in &deployment.sentinels {
        assert_eq!(
            sentinel.cli(&[
                "SENTINEL",
                "MONITOR",
                SERVICE,
                "127.0.0.1",
                &replica_of,
                "2"
            ]),
            "OK"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_subscribed_on_a_primary_demoted_behind_our_back_moves_to_the_new_one_and_is_woken_there()
 {
    let deployment = Deployment::start();
    let holder_side: Arc<dyn Backend> = Arc::new(deployment.backend().await);
    let waiter_backend = deployment.backend().await;
    let waiter_side: Arc<dyn Backend> = Arc::new(waiter_backend.clone());
    let key = dlock_runtime::conformance::fresh_key("sentinel-demoted-waiter");
    let channel = redis_support::lock_name(&key).replace(":lock", ":released");
    let subscribers = |server: &RedisServer| {
        server
            .cli(&["PUBSUB", "NUMSUB", &channel])
            .lines()
            .nth(1)
            .unwrap_or("")
            .to_owned()
    };

    let ttl = Duration::from_secs(60);
    let held = LockOptions::new(ttl)
        .acquire_on(holder_side.clone(), &key)
        .await
        .expect("free");
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            LockOptions::new(Duration::from_secs(10))
                .wait(Duration::from_secs(120))
                .acquire_on(waiter_side, &key)
                .await
        }
    });
    within(20, "the waiter's subscription", async {
        while subscribers(&deployment.primary) != "1" {
            sleep(Duration::from_millis(50)).await;
        }
    })
    .await;

    swap_behind_the_sentinels(&deployment).await;
    // Nobody closed the waiter's connection: the backend notices that the
    // sentinels name another primary and subscribes there instead.
    within(30, "the waiter's move to the new primary", async {
        while subscribers(&deployment.replica) != "1" || subscribers(&deployment.primary) != "0" {
            sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(!waiter.is_finished(), "the key is still held");

    release_wakes_the_waiter(held, waiter, ttl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_that_leaves_the_old_primary_running_is_followed_without_any_refusal() {
    let deployment = Deployment::start();
    let backend: Arc<dyn Backend> = Arc::new(deployment.backend().await);
    let key = dlock_runtime::conformance::fresh_key("sentinel-split");
    let lock = redis_support::lock_name(&key);
    let before = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let first = before.token();
    before.release().await.expect("release");
    // The replica has every write before it is promoted: this failover
    // loses nothing (losing writes is the other tests' fault). Without it,
    // a release not yet replicated on a loaded machine left the key held
    // on the promoted replica, and the acquisitions below timed out.
    assert_eq!(deployment.primary.cli(&["WAIT", "1", "10000"]), "1");

    // The replica is promoted while the old primary stays a primary that
    // takes writes and keeps the backend's connection: nothing ever
    // refuses, so only asking the sentinels can move the backend.
    for sentinel in &deployment.sentinels {
        assert_eq!(sentinel.cli(&["SENTINEL", "REMOVE", SERVICE]), "OK");
    }
    assert_eq!(deployment.replica.cli(&["REPLICAOF", "NO", "ONE"]), "OK");
    let promoted = deployment.replica.port.to_string();
    for sentinel in &deployment.sentinels {
        assert_eq!(
            sentinel.cli(&["SENTINEL", "MONITOR", SERVICE, "127.0.0.1", &promoted, "2"]),
            "OK"
        );
    }
    assert_eq!(role(&deployment.primary), "master");

    let lease = within(30, "a lease taken on the promoted replica", async {
        loop {
            let lease = LockOptions::new(Duration::from_secs(10))
                .wait(Duration::from_secs(5))
                .acquire_on(backend.clone(), &key)
                .await
                .expect("the key is free on either node");
            if deployment.replica.cli(&["EXISTS", &lock]) == "1" {
                return lease;
            }
            // Granted by the old primary: once the backend has moved to the
            // promoted replica, its release finds no such lease there and
            // says it was lost, which it was. Any other error is not.
            match lease.release().await {
                Ok(()) => {}
                Err(LockError::LeaseLost {
                    reason: dlock::LostReason::NotOwner,
                    ..
                }) => {}
                Err(other) => panic!("release: {other:?}"),
            }
            sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    assert!(lease.token() > first);
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_acks_that_could_never_be_met_in_time_are_refused_before_connecting() {
    let sentinels = ["redis://127.0.0.1:1"];
    for (replicas, within) in [
        (0, Duration::from_millis(100)),
        (1, Duration::ZERO),
        (1, Duration::from_secs(1)),
    ] {
        let err = RedisBackend::sentinel(&sentinels, SERVICE)
            .response_timeout(Duration::from_secs(1))
            .replica_acks(replicas, within)
            .connect()
            .await
            .expect_err("refused");
        assert!(
            matches!(
                err,
                LockError::InvalidOption {
                    option: "replica_acks",
                    ..
                }
            ),
            "{err}"
        );
    }
}

// ---------------------------------------------------------------------------
// Review: faults the tests above did not try.

/// Kills every sentinel, then breaks the command connection to a primary
/// that is still up and well: the backend cannot ask anyone whether the
/// primary moved, but the node it knows is the primary still, so locking
/// must go on there instead of failing every call that meets the broken
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_sentinel_down_a_broken_connection_is_retried_on_the_known_primary() {
    let mut deployment = Deployment::start();
    let backend: Arc<dyn Backend> = Arc::new(deployment.backend().await);
    let key = dlock_runtime::conformance::fresh_key("sentinel-all-down-blip");
    let held = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    for sentinel in &mut deployment.sentinels {
        sentinel.kill();
    }
    for round in 0..3 {
        // Every normal client of the primary (ours among them) is cut.
        deployment
            .primary
            .cli(&["CLIENT", "KILL", "TYPE", "normal"]);
        let other = dlock_runtime::conformance::fresh_key("sentinel-all-down-other");
        let result = within(
            30,
            "an acquisition with the sentinels down",
            LockOptions::new(Duration::from_secs(10)).acquire_on(backend.clone(), &other),
        )
        .await;
        let lease = result.unwrap_or_else(|err| {
            panic!("round {round}: the primary is up, yet the acquisition failed: {err}")
        });
        lease.release().await.expect("release");
    }
    assert!(
        held.check().is_ok(),
        "the lease on a primary that never went away was lost"
    );
    held.release().await.expect("release");
}

/// A sentinel that was down through a failover and restarts from its
/// config file still names the old primary; the old primary, restarted
/// empty, says it is a master until the other sentinels turn it into a
/// replica. A backend asking that sentinel first must not lock there a key
/// the new primary shows held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_that_slept_through_a_failover_never_leads_to_the_stale_old_primary() {
    let mut deployment = Deployment::start();
    deployment.sentinels[0].kill();
    let primary_pid = deployment.primary.pid().expect("primary runs");
    signal(primary_pid, libc::SIGKILL);
    let awake: Vec<String> = deployment.sentinels[1..]
        .iter()
        .map(Sentinel::url)
        .collect();
    within(60, "the promotion by the two live sentinels", async {
        loop {
            let named =
                deployment.sentinels[1].cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE]);
            let port = named
                .lines()
                .nth(1)
                .and_then(|port| port.trim().parse().ok());
            if role(&deployment.replica) == "master" && port == Some(deployment.replica.port) {
                return;
            }
            sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let current: Arc<dyn Backend> = Arc::new(connect(&awake).await);
    let key = dlock_runtime::conformance::fresh_key("sentinel-stale");
    let held = LockOptions::new(Duration::from_secs(60))
        .acquire_on(current.clone(), &key)
        .await
        .expect("free on the new primary");
    assert_eq!(
        deployment
            .replica
            .cli(&["EXISTS", &redis_support::lock_name(&key)]),
        "1"
    );

    // The old primary comes back, empty, a master for now; the sentinel
    // that missed the failover comes back from its config file.
    deployment.primary.restart();
    deployment.sentinels[0].relaunch();
    let named = deployment.sentinels[0].cli(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE]);
    eprintln!(
        "the restarted sentinel names {named:?}; old primary {} role {}, new {}",
        deployment.primary.port,
        role(&deployment.primary),
        deployment.replica.port
    );
    let fresh: Arc<dyn Backend> = Arc::new(connect(&deployment.sentinel_urls()).await);
    let stolen = LockOptions::new(Duration::from_secs(10))
        .acquire_on(fresh.clone(), &key)
        .await;
    assert!(
        stolen.is_err(),
        "a key the new primary shows held was granted (token {:?}); the old primary holds it: {}",
        stolen.as_ref().map(|lease| lease.token().get()).ok(),
        deployment
            .primary
            .cli(&["EXISTS", &redis_support::lock_name(&key)])
    );
    held.release().await.expect("release");
}

/// `replica_acks` with the only replica paused, then killed, and many
/// acquisitions at once on one backend: every one is an error naming the
/// shortfall (never a silent success), none hangs, and every key is free
/// again at once — none stays held for its ttl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_acks_with_the_replica_stopped_or_killed_fail_every_concurrent_acquisition_and_free_its_key()
 {
    let mut deployment = Deployment::start();
    let urls = deployment.sentinel_urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let backend: Arc<dyn Backend> = Arc::new(
        RedisBackend::sentinel(&urls, SERVICE)
            .connect_timeout(Duration::from_secs(2))
            .response_timeout(Duration::from_secs(1))
            .replica_acks(1, Duration::from_millis(300))
            .connect()
            .await
            .expect("connect"),
    );
    let replica_pid = deployment.replica.pid().expect("replica runs");
    for phase in ["stopped", "killed"] {
        match phase {
            "stopped" => signal(replica_pid, libc::SIGSTOP),
            _ => {
                signal(replica_pid, libc::SIGCONT);
                deployment.replica.kill();
            }
        }
        let keys: Vec<_> = (0..8)
            .map(|_| dlock_runtime::conformance::fresh_key("sentinel-acks-down"))
            .collect();
        let calls = keys.iter().map(|key| {
            let backend = backend.clone();
            let key = key.clone();
            async move {
                LockOptions::new(Duration::from_secs(60))
                    .acquire_on(backend, &key)
                    .await
            }
        });
        let results = within(
            30,
            "acquisitions with the replica down",
            futures_util::future::join_all(calls),
        )
        .await;
        for (key, result) in keys.iter().zip(results) {
            let err = match result {
                Ok(lease) => panic!(
                    "{phase}: granted (token {}) with no replica to acknowledge",
                    lease.token()
                ),
                Err(err) => err,
            };
            assert!(matches!(err, LockError::Backend { .. }), "{phase}: {err}");
            let held = deployment
                .primary
                .cli(&["EXISTS", &redis_support::lock_name(key)]);
            assert_eq!(
                held, "0",
                "{phase}: a refused acquisition left its key held ({err})"
            );
        }
    }
}

/// Every form of credentials — in sentinel URLs (`:pw@`, `user:pw@`,
/// percent-encoded), in a `redis+sentinel://` URL, and given with
/// `data_node_auth` — stays out of errors, `Debug` and the log lines, for
/// connections that work and ones that fail.
#[tokio::test(flavor = "current_thread")]
async fn credentials_in_every_sentinel_form_stay_out_of_errors_debug_and_logs() {
    let deployment = Deployment::start();
    let (logs, _guard) = support::Logs::capture();
    assert_eq!(
        deployment.primary.cli(&[
            "ACL",
            "SETUSER",
            "app",
            "on",
            ">data@Secret1",
            "~*",
            "&*",
            "+@all"
        ]),
        "OK"
    );
    let secrets = [
        "data@Secret1",
        "data%40Secret1",
        "sent@Secret2",
        "sent%40Secret2",
        "wrong@Secret3",
        "wrong%40Secret3",
    ];
    let ports: Vec<u16> = deployment.sentinels.iter().map(|s| s.port).collect();
    let mut seen = String::new();
    let note = |seen: &mut String, text: String| {
        seen.push_str(&text);
        seen.push('\n');
    };
    // Works: the data nodes' credentials in a redis+sentinel:// URL.
    let hosts: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let url = format!(
        "redis+sentinel://app:data%40Secret1@{}/{SERVICE}",
        hosts.join(",")
    );
    let builder = RedisBackend::builder(&url);
    note(&mut seen, format!("{builder:?}"));
    let backend = builder.connect().await.expect("the right credentials");
    note(&mut seen, format!("{backend:?}"));
    let key = dlock_runtime::conformance::fresh_key("sentinel-secrets");
    let lease = LockOptions::new(Duration::from_secs(10))
        .acquire_on(Arc::new(backend.clone()), &key)
        .await
        .expect("free");
    lease.release().await.expect("release");
    // Fails: a wrong data password, in the URL and through data_node_auth.
    let wrong = format!(
        "redis+sentinel://app:wrong%40Secret3@{}/{SERVICE}",
        hosts.join(",")
    );
    let err = RedisBackend::builder(&wrong)
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await
        .expect_err("a wrong password");
    note(
        &mut seen,
        format!("{err} {err:?} {:?}", std::error::Error::source(&err)),
    );
    let sentinel_urls: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, p)| match i {
            0 => format!("redis://:sent%40Secret2@127.0.0.1:{p}"),
            1 => format!("redis://someone:sent%40Secret2@127.0.0.1:{p}"),
            _ => format!("redis://:sent@Secret2@127.0.0.1:{p}"),
        })
        .collect();
    let refs: Vec<&str> = sentinel_urls.iter().map(String::as_str).collect();
    let builder = RedisBackend::sentinel(&refs, SERVICE)
        .data_node_auth(Some("app"), "wrong@Secret3")
        .connect_timeout(Duration::from_secs(1));
    note(&mut seen, format!("{builder:?}"));
    let err = builder.connect().await.expect_err("sentinels refuse AUTH");
    note(
        &mut seen,
        format!("{err} {err:?} {:?}", std::error::Error::source(&err)),
    );
    let plain: Vec<String> = ports
        .iter()
        .map(|p| format!("redis://127.0.0.1:{p}"))
        .collect();
    let refs: Vec<&str> = plain.iter().map(String::as_str).collect();
    let err = RedisBackend::sentinel(&refs, SERVICE)
        .data_node_auth(Some("app"), "wrong@Secret3")
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await
        .expect_err("the primary refuses the password");
    note(
        &mut seen,
        format!("{err} {err:?} {:?}", std::error::Error::source(&err)),
    );
    // A backend whose primary later refuses it: calls fail, logs flow.
    let backend = RedisBackend::sentinel(&refs, SERVICE)
        .data_node_auth(Some("app"), "data@Secret1")
        .connect_timeout(Duration::from_secs(1))
        .response_timeout(Duration::from_millis(500))
        .connect()
        .await
        .expect("connect");
    deployment
        .primary
        .cli(&["ACL", "SETUSER", "app", "resetpass", ">other"]);
    deployment.primary.cli(&["CLIENT", "KILL", "USER", "app"]);
    let failed = LockOptions::new(Duration::from_secs(10))
        .acquire_on(Arc::new(backend.clone()), &key)
        .await;
    if let Err(err) = failed {
        note(&mut seen, format!("{err} {err:?}"));
    }
    note(&mut seen, format!("{backend:?}"));
    note(&mut seen, logs.text());
    for secret in secrets {
        assert!(!seen.contains(secret), "{secret} shows in:\n{seen}");
    }
}

/// Odd `redis+sentinel://` URLs are refused or fail in time with a clear
/// error, never a panic, never repeating a password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_sentinel_urls_give_clear_errors_without_a_panic_or_the_password() {
    for url in [
        "redis+sentinel://",
        "redis+sentinel:///m",
        "redis+sentinel://:Secret9@/m",
        "redis+sentinel://127.0.0.1:1,,127.0.0.1:2/m",
        "redis+sentinel://[::1]/m",
        "redis+sentinel://[::1]:1/m",
        "redis+sentinel://::1/m",
        "redis+sentinel://127.0.0.1:1/m/x",
        "redis+sentinel://127.0.0.1:1/m/1/2",
        "redis+sentinel://127.0.0.1:99999/m",
        "redis+sentinel://u:Secret9@127.0.0.1:1/m/-1",
        "REDIS+SENTINEL://:Secret9@127.0.0.1:1/m",
        "redis+sentinel://127.0.0.1:1/%zz",
        "redis+sentinel://@@@/m",
        "redis+sentinel://:Secret9@127.0.0.1:1/m?password=Secret9",
        "redis+sentinel://:Secret9@127.0.0.1:1/m#Secret9",
        "redis+sentinel://:Sec/ret9@127.0.0.1:1/m",
        "rediss+sentinel://:Secret9@127.0.0.1:1/m",
        "redis+sentinel://h\u{e9}/m",
    ] {
        let result = within(
            20,
            "an odd sentinel URL",
            RedisBackend::builder(url)
                .connect_timeout(Duration::from_millis(300))
                .connect(),
        )
        .await;
        let err = match result {
            Ok(backend) => panic!("{url}: connected: {backend:?}"),
            Err(err) => err,
        };
        let text = format!("{err} {err:?} {:?}", std::error::Error::source(&err));
        eprintln!("{url} -> {text}");
        assert!(!text.contains("Secret9"), "{url}: {text}");
        assert!(!text.contains("ret9"), "{url}: {text}");
    }
}

/// The primary killed (SIGKILL) while four keys are held with renewals
/// running and two waiters wait on each: after the failover every holder
/// either still holds its key on the new primary or is told it lost it,
/// every waiter gets its key once the holder lets go, and every waiter's
/// token is above its holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_killed_under_holders_waiters_and_renewals_tells_every_holder_and_wakes_every_waiter()
 {
    if std::env::var_os("REVIEW_LOGS").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(std::io::stderr)
            .try_init();
    }
    let deployment = Deployment::start();
    let backend: Arc<dyn Backend> = Arc::new(deployment.backend().await);
    let keys: Vec<_> = (0..4)
        .map(|_| dlock_runtime::conformance::fresh_key("sentinel-kill-busy"))
        .collect();
    let mut holders = Vec::new();
    for key in &keys {
        holders.push(
            LockOptions::new(Duration::from_secs(4))
                .acquire_on(backend.clone(), key)
                .await
                .expect("free"),
        );
    }
    // Each waiter lets go as soon as it has the key, for the next one.
    let mut waiters = Vec::new();
    for key in &keys {
        for _ in 0..2 {
            let backend = backend.clone();
            let key = key.clone();
            waiters.push((
                key.clone(),
                tokio::spawn(async move {
                    let lease = LockOptions::new(Duration::from_secs(30))
                        .wait(Duration::from_secs(90))
                        .acquire_on(backend, &key)
                        .await?;
                    let token = lease.token().get();
                    lease.release().await?;
                    Ok::<u64, LockError>(token)
                }),
            ));
        }
    }
    sleep(Duration::from_millis(300)).await;
    assert_eq!(deployment.primary.cli(&["WAIT", "1", "5000"]), "1");
    let primary_pid = deployment.primary.pid().expect("primary runs");
    signal(primary_pid, libc::SIGKILL);
    within(60, "the promotion", async {
        while role(&deployment.replica) != "master"
            || deployment.primary_port_named() != Some(deployment.replica.port)
        {
            sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    // Give the renewals a few rounds on the new primary.
    sleep(Duration::from_secs(3)).await;
    let mut tokens = HashMap::new();
    for (key, holder) in keys.iter().zip(holders) {
        tokens.insert(key.to_string(), holder.token().get());
        let shown = deployment
            .replica
            .cli(&["EXISTS", &redis_support::lock_name(key)]);
        if holder.check().is_ok() {
            assert_eq!(
                shown, "1",
                "{key}: the holder believes it holds a key the new primary does not show"
            );
            holder.release().await.expect("release on the new primary");
        } else {
            eprintln!("{key}: the holder was told it lost the key");
        }
    }
    for (key, waiter) in waiters {
        let token = within(60, "a waiter's grant after the failover", waiter)
            .await
            .expect("join")
            .unwrap_or_else(|err| panic!("{key}: the waiter never got the key: {err}"));
        let holder = tokens[&key.to_string()];
        assert!(
            token > holder,
            "{key}: the waiter's token {token} is not above the holder's {holder}"
        );
    }
}

/// Callers that give up (a timeout at 0..2000 ms) on acquisitions of one
/// key while the primary is killed and a replica promoted: afterwards the
/// key is free within its ttl, nothing in the process blocks it, and a
/// caller takes it promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_giving_up_during_a_failover_leave_nothing_held_past_its_ttl() {
    let deployment = Deployment::start();
    let backend: Arc<dyn Backend> = Arc::new(deployment.backend().await);
    let key = dlock_runtime::conformance::fresh_key("sentinel-give-up");
    let primary_pid = deployment.primary.pid().expect("primary runs");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for task in 0..6_u64 {
        let backend = backend.clone();
        let key = key.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut round = 0_u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                round += 1;
                let cut = Duration::from_millis((task * 331 + round * 197) % 2000);
                let options = LockOptions::new(Duration::from_secs(2)).wait(Duration::from_secs(5));
                let attempt = options.acquire_on(backend.clone(), &key);
                if let Ok(Ok(lease)) = tokio::time::timeout(cut, attempt).await {
                    let _ = tokio::time::timeout(cut, lease.release()).await;
                }
            }
        }));
    }
    sleep(Duration::from_millis(500)).await;
    signal(primary_pid, libc::SIGKILL);
    within(60, "the promotion", async {
        while role(&deployment.replica) != "master"
            || deployment.primary_port_named() != Some(deployment.replica.port)
        {
            sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for task in tasks {
        within(30, "a giving-up caller's end", task)
            .await
            .expect("join");
    }
    // Every lease taken had a 2 s ttl: within it plus slack, the key is
    // free to anyone, on this backend and on a new one.
    let lease = within(
        30,
        "the key after the callers gave up",
        LockOptions::new(Duration::from_secs(10))
            .wait(Duration::from_secs(6))
            .acquire_on(backend.clone(), &key),
    )
    .await
    .expect("the key is free within its ttl");
    lease.release().await.expect("release");
    let fresh: Arc<dyn Backend> = Arc::new(deployment.backend().await);
    let lease = within(
        30,
        "the key from a new backend",
        LockOptions::new(Duration::from_secs(10))
            .wait(Duration::from_secs(6))
            .acquire_on(fresh, &key),
    )
    .await
    .expect("free");
    lease.release().await.expect("release");
}

/// A sentinel paused (SIGSTOP) accepts connections and never answers: a
/// look-up does not wait the response timeout for it when the others
/// answer. Then the primary paused: a caller with a 1 s wait returns by
/// its deadline (with slack), not after the backend's own timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sentinel_or_primary_never_holds_a_caller_past_its_bounds() {
    let deployment = Deployment::start();
    let paused = deployment.sentinels[0]
        .child
        .as_ref()
        .map(Child::id)
        .expect("sentinel runs");
    signal(paused, libc::SIGSTOP);
    let urls = deployment.sentinel_urls();
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    let started = Instant::now();
    let backend: Arc<dyn Backend> = Arc::new(
        within(
            60,
            "connecting with a paused sentinel",
            RedisBackend::sentinel(&refs, SERVICE)
                .connect_timeout(Duration::from_secs(20))
                .response_timeout(Duration::from_secs(10))
                .connect(),
        )
        .await
        .expect("two sentinels answer"),
    );
    let took = started.elapsed();
    signal(paused, libc::SIGCONT);
    assert!(
        took < Duration::from_secs(8),
        "connecting waited {took:?} for the paused sentinel (response timeout 10s)"
    );

    let key = dlock_runtime::conformance::fresh_key("sentinel-paused-primary");
    let primary_pid = deployment.primary.pid().expect("primary runs");
    signal(primary_pid, libc::SIGSTOP);
    let started = Instant::now();
    let result = within(
        60,
        "an acquisition on a paused primary",
        LockOptions::new(Duration::from_secs(10))
            .wait(Duration::from_secs(1))
            .acquire_on(backend.clone(), &key),
    )
    .await;
    let took = started.elapsed();
    signal(primary_pid, libc::SIGCONT);
    assert!(result.is_err(), "granted by a paused primary");
    assert!(
        took < Duration::from_secs(6),
        "a caller with a 1 s wait returned after {took:?}"
    );
}

/// `replica_acks` behind a paused primary: acquisitions of one backend
/// take turns for the `WAIT`, and each turn may last the whole call
/// limit, so without a bound on the turn the sixth of six callers would
/// wait for all five before it. Every caller returns, with an error,
/// within twice the call limit (and slack).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_acks_behind_a_paused_primary_never_queue_a_caller_past_its_own_limit() {
    let deployment = Deployment::start();
    let urls = deployment.sentinel_urls();
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    let backend: Arc<dyn Backend> = Arc::new(
        RedisBackend::sentinel(&refs, SERVICE)
            .connect_timeout(Duration::from_secs(1))
            .response_timeout(Duration::from_millis(500))
            .replica_acks(1, Duration::from_millis(200))
            .connect()
            .await
            .expect("connect"),
    );
    let primary_pid = deployment.primary.pid().expect("primary runs");
    signal(primary_pid, libc::SIGSTOP);
    let calls = (0..6).map(|_| {
        let backend = backend.clone();
        async move {
            let key = dlock_runtime::conformance::fresh_key("sentinel-acks-paused");
            let started = Instant::now();
            let result = LockOptions::new(Duration::from_secs(10))
                .acquire_on(backend, &key)
                .await;
            (started.elapsed(), result.is_ok())
        }
    });
    let outcomes = within(
        120,
        "acquisitions behind a paused primary",
        futures_util::future::join_all(calls),
    )
    .await;
    signal(primary_pid, libc::SIGCONT);
    // The call limit behind sentinels: 2 x connect + response = 2.5 s.
    for (took, granted) in outcomes {
        assert!(!granted, "granted by a paused primary");
        assert!(
            took < Duration::from_secs(9),
            "a caller waited {took:?} (call limit 2.5 s)"
        );
    }
}

/// `replica_acks` with the replica paused and acquisitions taking turns
/// for their `WAIT`s: a held lease's renewals do not take a turn behind
/// them, so the lease (ttl 3 s) outlives four seconds of such traffic
/// (sixteen callers' turns of 300 ms each, 4.8 s, would outlast the two
/// thirds of a ttl a renewal has).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_acks_never_hold_a_renewal_behind_the_acquisitions_waiting_for_replicas() {
    let deployment = Deployment::start();
    let urls = deployment.sentinel_urls();
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    let backend: Arc<dyn Backend> = Arc::new(
        RedisBackend::sentinel(&refs, SERVICE)
            .connect_timeout(Duration::from_secs(2))
            .response_timeout(Duration::from_secs(1))
            .replica_acks(1, Duration::from_millis(300))
            .connect()
            .await
            .expect("connect"),
    );
    let key = dlock_runtime::conformance::fresh_key("sentinel-acks-renewal");
    // The lease taken while the replica runs: a replica slowed by a loaded
    // machine may miss one 300 ms window, which is no part of the property.
    let since = Instant::now();
    let held = loop {
        match LockOptions::new(Duration::from_secs(3))
            .acquire_on(backend.clone(), &key)
            .await
        {
            Ok(lease) => break lease,
            Err(err) if since.elapsed() < Duration::from_secs(30) => {
                eprintln!("the replica did not acknowledge in time, again: {err}");
                sleep(Duration::from_millis(200)).await;
            }
            Err(err) => panic!("the replica acknowledged no acquisition in 30 s: {err}"),
        }
    };
    let replica_pid = deployment.replica.pid().expect("replica runs");
    signal(replica_pid, libc::SIGSTOP);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut busy = Vec::new();
    for _ in 0..16 {
        let backend = backend.clone();
        let stop = stop.clone();
        busy.push(tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let other = dlock_runtime::conformance::fresh_key("sentinel-acks-busy");
                let _ = LockOptions::new(Duration::from_secs(5))
                    .wait(Duration::from_secs(2))
                    .acquire_on(backend.clone(), &other)
                    .await;
            }
        }));
    }
    sleep(Duration::from_secs(4)).await;
    let kept = held.check();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for task in busy {
        within(30, "a busy caller's end", task).await.expect("join");
    }
    signal(replica_pid, libc::SIGCONT);
    kept.expect("the lease was lost while acquisitions waited for replicas");
    held.release().await.expect("release");
}

/// Every sentinel down while a lease is held: its renewals go on on the
/// primary known, nothing hangs; the sentinels back (from their config
/// files), a forced failover is followed by the same backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_sentinel_down_renewals_go_on_and_once_they_are_back_a_failover_is_followed() {
    let mut deployment = Deployment::start_for_a_forced_failover();
    let backend: Arc<dyn Backend> = Arc::new(deployment.backend().await);
    let key = dlock_runtime::conformance::fresh_key("sentinel-down-and-back");
    let held = LockOptions::new(Duration::from_secs(2))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    for sentinel in &mut deployment.sentinels {
        sentinel.kill();
    }
    // Past the 5 s primary check, several ttls long.
    sleep(Duration::from_secs(7)).await;
    held.check().expect("renewals went on on the known primary");
    held.release().await.expect("release");
    for sentinel in &mut deployment.sentinels {
        sentinel.relaunch();
    }
    within(60, "the sentinels knowing each other again", async {
        while !deployment.sentinels.iter().all(|sentinel| {
            let fields = sentinel.master_fields();
            fields.get("num-slaves").map(String::as_str) == Some("1")
                && fields.get("num-other-sentinels").map(String::as_str) == Some("2")
        }) {
            sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    within(60, "a forced failover", async {
        while deployment.sentinels[0].cli(&["SENTINEL", "FAILOVER", SERVICE]) != "OK" {
            sleep(Duration::from_millis(500)).await;
        }
        // Until the old primary is demoted it still takes writes (the
        // window docs/redis.md admits): wait for the demotion.
        while role(&deployment.replica) != "master"
            || role(&deployment.primary) != "slave"
            || deployment.primary_port_named() != Some(deployment.replica.port)
        {
            sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let lease = within(
        60,
        "a lease on the new primary",
        LockOptions::new(Duration::from_secs(10))
            .wait(Duration::from_secs(30))
            .acquire_on(backend.clone(), &key),
    )
    .await
    .expect("the backend follows the failover");
    assert_eq!(
        deployment
            .replica
            .cli(&["EXISTS", &redis_support::lock_name(&key)]),
        "1",
        "taken on the new primary"
    );
    lease.release().await.expect("release");
}

/// With only a minority of the sentinels answering (here one of three:
/// the other two addresses refuse), the primary it names is not trusted:
/// the answering one may be the sentinel that missed a failover, naming
/// the old primary. Connecting fails, saying how many answered; with a
/// majority back it connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_named_by_a_minority_of_the_sentinels_is_not_trusted() {
    let urls = shared();
    // Refusing for the whole test: a port found free and let go could be
    // taken by another test's server and answer.
    let dead = [support::RefusedPort::new(), support::RefusedPort::new()];
    let minority: Vec<String> = std::iter::once(urls[0].clone())
        .chain(
            dead.iter()
                .map(|dead| format!("redis://127.0.0.1:{}", dead.port)),
        )
        .collect();
    let minority: Vec<&str> = minority.iter().map(String::as_str).collect();
    let err = RedisBackend::sentinel(&minority, SERVICE)
        .connect_timeout(Duration::from_secs(1))
        .response_timeout(Duration::from_secs(1))
        .connect()
        .await
        .expect_err("one sentinel of three is a minority");
    let text = err.to_string();
    assert!(
        text.contains("only 1 of the 3 sentinels answered"),
        "{text}"
    );
    let majority: Vec<&str> = [urls[0].as_str(), urls[1].as_str(), minority[1]].to_vec();
    let backend = RedisBackend::sentinel(&majority, SERVICE)
        .connect_timeout(Duration::from_secs(2))
        .response_timeout(Duration::from_secs(1))
        .connect()
        .await
        .expect("two sentinels of three are a majority");
    drop(backend);
}

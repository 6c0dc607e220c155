//! Redis servers a test starts for itself: on a free loopback port, with no
//! persistence, in a temporary directory, and always killed again (on drop,
//! and by the kernel if the test process dies first).

#![allow(dead_code)]

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use dlock::backend::OwnerId;
use dlock::redis::RedisBackend;

/// The shared Redis most tests talk to: `DLOCK_REDIS_URL`, or
/// `redis://127.0.0.1:6379`.
pub fn shared_url() -> String {
    std::env::var("DLOCK_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A backend on the shared Redis.
pub async fn shared_backend() -> std::sync::Arc<dyn dlock::Backend> {
    std::sync::Arc::new(
        RedisBackend::connect(&shared_url())
            .await
            .expect("the Redis at DLOCK_REDIS_URL (or 127.0.0.1:6379) must be running"),
    )
}

/// A raw connection to the shared Redis, to read and write what the
/// backend keeps as an operator or another tool would.
pub async fn shared_conn() -> redis::aio::MultiplexedConnection {
    redis::Client::open(shared_url())
        .expect("the url at DLOCK_REDIS_URL")
        .get_multiplexed_async_connection()
        .await
        .expect("the Redis at DLOCK_REDIS_URL (or 127.0.0.1:6379) must be running")
}

/// `redis-cli` against the shared Redis.
pub fn shared_cli(args: &[&str]) -> String {
    cli(&["-u", &shared_url()], args)
}

/// The Redis name of `key`'s lock (keys the tests make need no escaping).
pub fn lock_name(key: &dlock::LockKey) -> String {
    format!("dlock:{{{key}}}:lock")
}

/// A `redis-server` child process. Killed (SIGKILL) and its directory
/// removed when dropped.
pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    args: Vec<String>,
}

/// A loopback port nothing listens on now (and, with `bus`, whose cluster
/// bus port, +10000, is free too).
pub fn free_port(bus: bool) -> u16 {
    for _ in 0..100 {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let port = listener.local_addr().expect("local addr").port();
        if !bus {
            return port;
        }
        if port <= 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port found");
}

/// Ports that speak TLS only (a plain `PING` gets no answer there).
static TLS_PORTS: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());

/// A directory of its own under the test target directory.
pub fn fresh_dir(label: &str) -> PathBuf {
    let id = OwnerId::random().expect("random");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("dlock-{label}-{id}"));
    std::fs::create_dir_all(&dir).expect("server directory");
    dir
}

impl RedisServer {
    /// Starts a server on a free port with `args` added to the defaults
    /// (`{port}` in an argument stands for the chosen port, `{dir}` for the
    /// server's directory).
    pub fn start(args: &[&str]) -> Self {
        let bus = args.contains(&"--cluster-enabled");
        // A port found free may be taken before the server binds it (or,
        // in a cluster, its bus port): the server then exits, and starts
        // again on a fresh port.
        for _ in 0..5 {
            let port = free_port(bus);
            if args.contains(&"--tls-port")
                && let Ok(mut ports) = TLS_PORTS.lock()
            {
                ports.push(port);
            }
            let dir = fresh_dir("redis");
            let mut server = Self {
                child: None,
                port,
                args: args
                    .iter()
                    .map(|a| {
                        a.replace("{port}", &port.to_string())
                            .replace("{dir}", &dir.to_string_lossy())
                    })
                    .collect(),
                dir,
            };
            match server.try_launch() {
                Ok(()) => return server,
                Err(log) if log.contains("Address already in use") => continue,
                Err(log) => panic!("redis-server exited:\n{log}"),
            }
        }
        panic!("redis-server found its port taken on five free ports in a row");
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `host:port` for `redis-cli --cluster`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn launch(&mut self) {
        if let Err(log) = self.try_launch() {
            panic!("redis-server exited:\n{log}");
        }
    }

    /// Starts the server and waits until it is ready; its log if it exited.
    fn try_launch(&mut self) -> Result<(), String> {
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .args(["--logfile", "server.log"])
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: prctl is async-signal-safe; it asks the kernel to kill the
        // server when the thread that started it ends, so a test process
        // that dies without running destructors leaves no server behind.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .expect("redis-server must be installed (scripts/test installs it)");
        self.child = Some(child);
        self.wait_ready()
    }

    /// Waits until this server (not another process on its port: its own
    /// log line, which starts with its pid, says it is ready) answers on
    /// its port; its log if it exited.
    fn wait_ready(&mut self) -> Result<(), String> {
        let log_path = self.dir.join("server.log");
        let ready = format!("{}:", self.pid().expect("just started"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(format!("(exit {status})\n{log}"));
            }
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            if log.lines().any(|line| {
                line.starts_with(&ready) && line.contains("Ready to accept connections")
            }) && ping(self.port)
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {} did not come up", self.port);
    }

    /// Kills the server at once (SIGKILL): everything in memory is lost.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, with no data.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    /// The server's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The server's working directory.
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Runs `redis-cli` against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        cli(&["-p", &self.port.to_string()], args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `redis-cli` with connection options `target` and command `args`;
/// returns its trimmed output.
pub fn cli(target: &[&str], args: &[&str]) -> String {
    let Output { stdout, stderr, .. } = Command::new("redis-cli")
        .args(target)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli must be installed");
    let mut text = String::from_utf8_lossy(&stdout).trim().to_owned();
    if text.is_empty() {
        text = String::from_utf8_lossy(&stderr).trim().to_owned();
    }
    text
}

/// True if the server answers a RESP `PING` on the port (any reply, even an
/// authentication error, means it is up), or, for a TLS port, accepts.
fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    if TLS_PORTS.lock().is_ok_and(|ports| ports.contains(&port)) {
        return true;
    }
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).is_ok() && !line.is_empty()
}

/// Starts a Redis Cluster of three masters (no replicas) on free loopback
/// ports and waits until every node reports it ok.
///
/// The servers die with the thread that started them (parent-death
/// signal): call this on a thread that outlives their use.
pub fn start_cluster() -> Vec<RedisServer> {
    start_cluster_of(0, 5000)
}

/// Starts a Redis Cluster of three masters with `replicas` replicas each
/// and a node timeout of `node_timeout_ms`, as [`start_cluster`] does.
pub fn start_cluster_of(replicas: usize, node_timeout_ms: u32) -> Vec<RedisServer> {
    let timeout = node_timeout_ms.to_string();
    let servers: Vec<RedisServer> = (0..3 * (1 + replicas))
        .map(|_| {
            RedisServer::start(&[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                &timeout,
                // A replica's first sync starts at once, not after Redis's
                // default 5 s wait for more replicas to share it.
                "--repl-diskless-sync-delay",
                "0",
            ])
        })
        .collect();
    let mut create = vec!["--cluster", "create"];
    let addresses: Vec<String> = servers.iter().map(RedisServer::address).collect();
    create.extend(addresses.iter().map(String::as_str));
    let replicas_arg = replicas.to_string();
    create.extend(["--cluster-replicas", &replicas_arg, "--cluster-yes"]);
    let output = cli(&[], &create);
    assert!(
        output.contains("All 16384 slots covered"),
        "redis-cli --cluster create failed:\n{output}"
    );
    let known = format!("cluster_known_nodes:{}", servers.len());
    let deadline = Instant::now() + Duration::from_secs(60);
    for server in &servers {
        loop {
            let info = server.cli(&["CLUSTER", "INFO"]);
            // Every node must also see each replica as one: `--cluster
            // create` returns before the last `CLUSTER REPLICATE` has
            // spread, and a test that looks for a master's replica then
            // finds only masters.
            let nodes = server.cli(&["CLUSTER", "NODES"]);
            let seen_replicas = nodes
                .lines()
                .filter(|line| {
                    line.split_whitespace()
                        .nth(2)
                        .is_some_and(|f| f.contains("slave"))
                })
                .count();
            // A replica must also have finished its first sync: until then
            // a master's `WAIT` counts it out, and a failover to it would
            // lose every key.
            let replication = server.cli(&["INFO", "replication"]);
            let synced = !replication.contains("role:slave")
                || replication.contains("master_link_status:up");
            if info.contains("cluster_state:ok")
                && info.contains(&known)
                && seen_replicas == 3 * replicas
                && synced
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster never became ok with its replicas synced:\n{info}\n{nodes}\n{replication}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    servers
}

/// The least-privilege ACL rules for a dlock user, exactly as the module
/// docs of `dlock::redis` and docs/redis.md give them (a test checks both
/// texts), used by the ACL tests on a single server and on a cluster.
pub const LEAST_PRIVILEGE_ACL: &str = "~dlock:* &dlock:* +evalsha +script|load +set +setrange +get +getrange +incr +pexpire +pttl +del +publish +time +hgetall +hset +hdel +subscribe +unsubscribe +cluster|slots +ping";

/// Creates (or resets) ACL user `user` with `password` and exactly the
/// rules of [`LEAST_PRIVILEGE_ACL`] on the server `target` (redis-cli
/// connection options) names.
pub fn create_least_privilege_user(target: &[&str], user: &str, password: &str) {
    create_user(
        target,
        user,
        password,
        LEAST_PRIVILEGE_ACL.split_whitespace(),
    );
}

/// Creates (or resets) ACL user `user` with `password` and exactly `rules`
/// on the server `target` names.
pub fn create_user<'a>(
    target: &[&str],
    user: &str,
    password: &str,
    rules: impl IntoIterator<Item = &'a str>,
) {
    let password = format!(">{password}");
    let mut args = vec!["ACL", "SETUSER", user, "reset", "on", &password];
    let rules: Vec<&str> = rules.into_iter().collect();
    args.extend(&rules);
    let out = cli(target, &args);
    assert_eq!(out, "OK", "ACL SETUSER {args:?}");
}

/// The commands the server `target` names has refused since its ACL log
/// was last reset (the `object` of each `ACL LOG` entry).
pub fn refused_commands(target: &[&str]) -> Vec<String> {
    let log = cli(target, &["ACL", "LOG"]);
    let mut lines = log.lines().map(str::trim);
    let mut refused = Vec::new();
    while let Some(line) = lines.next() {
        if line == "object"
            && let Some(object) = lines.next()
        {
            refused.push(object.to_owned());
        }
    }
    refused
}

/// Empties the ACL log of the server `target` names.
pub fn reset_acl_log(target: &[&str]) {
    assert_eq!(cli(target, &["ACL", "LOG", "RESET"]), "OK");
}

/// Commands a client may send and be refused without harm: redis-rs names
/// its connections with `CLIENT SETINFO` (Redis 7.2+) and ignores the
/// answer, as the command's documentation advises.
pub const HARMLESS_REFUSALS: [&str; 1] = ["client|setinfo"];

/// Does everything the backend does on a server, under the rights of the
/// user `redis` connected as, on `keys` keys (enough to reach every master
/// of a cluster): take a key, renew it, wait for it through pub/sub (a
/// waiter that falls back to polling counts as refused), release it, take
/// it again and force-release it. The first failure, if any.
pub async fn every_operation(redis: &RedisBackend, keys: usize) -> Result<(), String> {
    use dlock::backend::{Attempt, Backend as _};
    let ttl = Duration::from_secs(10);
    for i in 0..keys {
        let id = OwnerId::random().map_err(|e| e.to_string())?;
        let key =
            dlock::LockKey::new(format!("dlock-test:acl-{i}:{id}")).map_err(|e| e.to_string())?;
        let owner = OwnerId::random().map_err(|e| e.to_string())?;
        let failed = |what: &str, err: dlock::LockError| format!("{what} `{key}`: {err}");
        match redis
            .try_acquire(&dlock::backend::AcquireRequest::new(&key, &owner, ttl))
            .await
        {
            Ok(Attempt::Acquired(_)) => {}
            Ok(_) => return Err(format!("`{key}` was not free")),
            Err(err) => return Err(failed("acquire", err)),
        }
        if !redis
            .extend(&dlock::backend::Renewal::new(&key, &owner, ttl))
            .await
            .map_err(|e| failed("renew", e))?
        {
            return Err(format!("renewing `{key}` said it was not held"));
        }
        let notice = redis
            .subscribe(&key)
            .await
            .map_err(|e| failed("wait for", e))?;
        if redis.subscribed_channels() == 0 {
            return Err(format!(
                "waiting for `{key}` fell back to polling: SUBSCRIBE refused"
            ));
        }
        // As a waiter does: subscribed, it finds the key held (and marks
        // the holder's value, so the release is published).
        let waiter = OwnerId::random().map_err(|e| e.to_string())?;
        match redis
            .try_acquire(&dlock::backend::AcquireRequest::new(&key, &waiter, ttl))
            .await
        {
            Ok(Attempt::Held { .. }) => {}
            Ok(_) => return Err(format!("`{key}` was taken while held")),
            Err(err) => return Err(failed("wait for", err)),
        }
        if redis
            .release(&dlock::backend::ReleaseRequest::new(&key, &owner))
            .await
            .map_err(|e| failed("release", e))?
            != dlock::backend::ReleaseOutcome::Released
        {
            return Err(format!("releasing `{key}` said it was not held"));
        }
        if tokio::time::timeout(Duration::from_secs(10), notice)
            .await
            .is_err()
        {
            return Err(format!("the release of `{key}` was never heard"));
        }
        let other = OwnerId::random().map_err(|e| e.to_string())?;
        redis
            .try_acquire(&dlock::backend::AcquireRequest::new(&key, &other, ttl))
            .await
            .map_err(|e| failed("acquire", e))?;
        if !redis
            .force_release(&key)
            .await
            .map_err(|e| failed("force-release", e))?
        {
            return Err(format!("force-releasing `{key}` found nothing to release"));
        }
        shared_and_permit_operations(redis, &key, ttl)
            .await
            .map_err(|err| format!("`{key}`: {err}"))?;
    }
    Ok(())
}

/// Every command a read-write lock and a permit send: two readers join,
/// renew, a writer finds them (leaving its mark), the readers release
/// (the last one announces it), the writer gives up (removing its mark);
/// a permit is taken, renewed and released by an owner that lost its
/// slot's number. `key` is free.
async fn shared_and_permit_operations(
    redis: &RedisBackend,
    key: &dlock::LockKey,
    ttl: Duration,
) -> Result<(), String> {
    use dlock::backend::{
        Access, AcquireRequest, Attempt, Backend as _, ReleaseOutcome, ReleaseRequest, Renewal,
    };
    let e = |what: &'static str| move |err: dlock::LockError| format!("{what}: {err}");
    let readers = [
        OwnerId::random().map_err(|e| e.to_string())?,
        OwnerId::random().map_err(|e| e.to_string())?,
    ];
    for reader in &readers {
        let request = AcquireRequest::new(key, reader, ttl).with_access(Access::Shared);
        match redis.try_acquire(&request).await.map_err(e("read"))? {
            Attempt::Acquired(_) => {}
            other => return Err(format!("a reader was refused: {other:?}")),
        }
        let renewal = Renewal::new(key, reader, ttl).holding(Access::Shared, None);
        if !redis.extend(&renewal).await.map_err(e("renew a reader"))? {
            return Err("renewing a reader said it was not held".into());
        }
    }
    let notice = redis.subscribe(key).await.map_err(e("wait for"))?;
    let writer = OwnerId::random().map_err(|e| e.to_string())?;
    match redis
        .try_acquire(&AcquireRequest::new(key, &writer, ttl).with_waits(true))
        .await
        .map_err(e("write"))?
    {
        Attempt::Held { .. } => {}
        other => return Err(format!("a writer was let in beside readers: {other:?}")),
    }
    for reader in &readers {
        let release = ReleaseRequest::new(key, reader).holding(Access::Shared, None);
        if redis
            .release(&release)
            .await
            .map_err(e("release a reader"))?
            != ReleaseOutcome::Released
        {
            return Err("releasing a reader said it was not held".into());
        }
    }
    if tokio::time::timeout(Duration::from_secs(10), notice)
        .await
        .is_err()
    {
        return Err("the last reader's release was never heard".into());
    }
    redis
        .release(&ReleaseRequest::new(key, &writer))
        .await
        .map_err(e("give up writing"))?;
    let permit = Access::Permits { permits: 2 };
    let owner = OwnerId::random().map_err(|e| e.to_string())?;
    let request = AcquireRequest::new(key, &owner, ttl).with_access(permit);
    let slot = match redis.try_acquire(&request).await.map_err(e("permit"))? {
        Attempt::Acquired(grant) => grant.slot,
        other => return Err(format!("a free permit was refused: {other:?}")),
    };
    let renewal = Renewal::new(key, &owner, ttl).holding(permit, slot);
    if !redis.extend(&renewal).await.map_err(e("renew a permit"))? {
        return Err("renewing a permit said it was not held".into());
    }
    let release = ReleaseRequest::new(key, &owner).holding(permit, None);
    if redis
        .release(&release)
        .await
        .map_err(e("release a permit"))?
        != ReleaseOutcome::Released
    {
        return Err("releasing a permit said it was not held".into());
    }
    Ok(())
}

//! Hostile review of the etcd backend: authentication, credentials in
//! every URL form, a paused member, an operator's lease revocation, and
//! callers that give up mid-call. Each etcd member here is started by the
//! test on free loopback ports and killed with it.

mod etcd_support;
mod support;

use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock::etcd::EtcdBackend;
use dlock::{Backend, LockError, LockKey, LockOptions};
use etcd_support::{etcdctl, free_port, random_word};
use support::RefusedPort;

fn fresh_key(label: &str) -> LockKey {
    LockKey::new(format!("etcd-review/{label}/{}", random_word())).expect("a key")
}

/// One etcd member on free loopback ports, with extra flags; killed and
/// its directory removed on drop.
struct Solo {
    port: u16,
    peer: u16,
    dir: PathBuf,
    extra: Vec<String>,
    child: Option<Child>,
    /// The length of `etcd.log` when the running process was started:
    /// what it wrote begins there.
    log_from: usize,
}

impl Solo {
    fn start(extra: &[&str]) -> Self {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "dlock-etcd-{}-review-{}",
            std::process::id(),
            random_word()
        ));
        std::fs::create_dir_all(&dir).expect("dir");
        let mut solo = Self {
            port: free_port(),
            peer: free_port(),
            dir,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
            child: None,
            log_from: 0,
        };
        // A free port can be taken by another test before etcd binds it:
        // etcd then exits, and starts again on fresh ports.
        for _ in 0..3 {
            solo.spawn();
            if solo.wait_up() {
                return solo;
            }
            solo.kill();
            let _ = std::fs::remove_dir_all(solo.dir.join("data"));
            solo.port = free_port();
            solo.peer = free_port();
        }
        panic!("etcd kept finding its ports taken:\n{}", solo.log());
    }

    /// A member on free ports, not started: flags to set, then
    /// [`Solo::launch`].
    fn start_later() -> Self {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "dlock-etcd-{}-review-{}",
            std::process::id(),
            random_word()
        ));
        std::fs::create_dir_all(&dir).expect("dir");
        Self {
            port: free_port(),
            peer: free_port(),
            dir,
            extra: Vec::new(),
            child: None,
            log_from: 0,
        }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn launch(&mut self) {
        self.spawn();
        assert!(self.wait_up(), "etcd exited:\n{}", self.log());
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }

    /// Starts the process, without waiting for it to answer.
    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .expect("log");
        self.log_from = self.log().len();
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let mut command = Command::new("etcd");
        command
            .args(["--name", "solo"])
            .arg("--data-dir")
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &self.endpoint()])
            .args(["--advertise-client-urls", &self.endpoint()])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("solo={peer}")])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        // SAFETY: prctl is async-signal-safe.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        self.child = Some(command.spawn().expect("etcd"));
    }

    /// Waits until the member answers; `false` if its process exited
    /// (its port was taken). An answer counts only while this process
    /// runs and has said it serves clients on the port: then the port is
    /// its own, not another test's etcd's.
    fn wait_up(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.exited() {
                return false;
            }
            if self.answers() {
                return true;
            }
            assert!(
                Instant::now() < deadline,
                "etcd did not start:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether its process has exited.
    fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .expect("spawned")
            .try_wait()
            .expect("try_wait")
            .is_some()
    }

    /// Whether it answers on its client port, having said in its log that
    /// it serves clients there (call while it runs).
    fn answers(&self) -> bool {
        let serving = format!(
            "serving insecure client requests on 127.0.0.1:{},",
            self.port
        );
        // `endpoint status` needs no credentials once auth is on.
        self.log()
            .get(self.log_from..)
            .is_some_and(|log| log.contains(&serving))
            && etcdctl(&self.endpoint(), &["endpoint", "status"]).is_some()
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = self.child.as_ref().expect("runs").id();
        // SAFETY: kill(2) on our own child.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, signal) }, 0);
    }

    /// Turns authentication on, user `root` with `password`.
    fn enable_auth(&self, password: &str) {
        let e = self.endpoint();
        let ok = |args: &[&str]| {
            assert!(etcdctl(&e, args).is_some(), "etcdctl {args:?}");
        };
        ok(&["user", "add", "root", "--new-user-password", password]);
        ok(&["user", "grant-role", "root", "root"]);
        ok(&["auth", "enable"]);
    }
}

impl Drop for Solo {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The password of the auth tests: `/`, `@`, `%` and `:` in it.
const PASSWORD: &str = "s3/cr@t:p%w";
const ENCODED: &str = "s3%2Fcr%40t%3Ap%25w";

/// etcd's simple auth tokens live `--auth-token-ttl` seconds unused (300
/// by default) and never outlive a restart of the member: a backend idle
/// that long, or whose member restarted, must authenticate again instead
/// of failing every call from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_authenticates_again_when_its_auth_token_expires() {
    let mut solo = Solo::start(&["--auth-token-ttl", "1"]);
    solo.enable_auth(PASSWORD);
    let url = format!("http://root:{ENCODED}@127.0.0.1:{}", solo.port);
    let backend: Arc<dyn Backend> = Arc::new(
        EtcdBackend::builder(&[url.as_str()])
            .response_timeout(Duration::from_secs(2))
            .connect()
            .await
            .expect("the right password connects"),
    );
    let key = fresh_key("auth");
    let first = LockOptions::new(Duration::from_secs(5))
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("acquire with auth");
    let first_token = first.token();
    first.release().await.expect("release");
    // The token expires unused.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let second = LockOptions::new(Duration::from_secs(5))
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("acquire after the auth token expired");
    assert!(second.token() > first_token);
    let second_token = second.token();
    second.release().await.expect("release");
    // A restart of the member forgets every token.
    solo.kill();
    solo.launch();
    let third = LockOptions::new(Duration::from_secs(5))
        .wait(Duration::from_secs(10))
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("acquire after the member restarted");
    assert!(
        third.token() > second_token,
        "tokens keep rising across a restart"
    );
    third.release().await.expect("release");
}

/// A wrong password is a clear error that shows no password, in any form,
/// on one endpoint or several.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_a_clear_error_that_shows_no_password() {
    let solo = Solo::start(&[]);
    solo.enable_auth(PASSWORD);
    let wrong = "wr%2Fong%40pw";
    let one = format!("http://root:{wrong}@127.0.0.1:{}", solo.port);
    let refused = RefusedPort::new();
    let dead = format!("http://root:{wrong}@127.0.0.1:{}", refused.port);
    for urls in [vec![one.clone()], vec![dead, one]] {
        let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
        let err = EtcdBackend::connect(&urls)
            .await
            .expect_err("a wrong password is refused");
        let text = format!("{err} {err:?}");
        for secret in ["wr/ong@pw", wrong, "ong"] {
            assert!(!text.contains(secret), "{text}");
        }
        assert!(
            text.contains("authentication failed") || text.contains("invalid user"),
            "not a clear error: {text}"
        );
    }
    // The right one, percent-encoded, on two endpoints.
    let right = format!("http://root:{ENCODED}@127.0.0.1:{}", solo.port);
    let backend = EtcdBackend::connect(&[right.as_str(), right.as_str()])
        .await
        .expect("the right password connects");
    let shown = format!("{backend:?}");
    assert!(
        !shown.contains(ENCODED) && !shown.contains(PASSWORD),
        "{shown}"
    );
}

/// With credentials and a list of members of which one is down,
/// connecting must not depend on which member the client's balancer picks
/// to authenticate with, or to learn the cluster's minimum lease ttl
/// from (without credentials too): every connection succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_with_credentials_while_a_listed_member_is_down_succeeds() {
    let solo = Solo::start(&[]);
    solo.enable_auth(PASSWORD);
    let live = format!("http://root:{ENCODED}@127.0.0.1:{}", solo.port);
    let (refused, plain_refused) = (RefusedPort::new(), RefusedPort::new());
    let down = format!("http://root:{ENCODED}@127.0.0.1:{}", refused.port);
    let plain = Solo::start(&[]);
    let plain_live = plain.endpoint();
    let plain_down = format!("http://127.0.0.1:{}", plain_refused.port);
    for round in 0..16 {
        let (live, down) = if round < 12 {
            (live.as_str(), down.as_str())
        } else {
            (plain_live.as_str(), plain_down.as_str())
        };
        let urls = if round % 2 == 0 {
            [down, live]
        } else {
            [live, down]
        };
        let backend = EtcdBackend::connect(&urls)
            .await
            .unwrap_or_else(|err| panic!("round {round}: {err}"));
        let key = fresh_key("auth-one-down");
        let lease = LockOptions::new(Duration::from_secs(5))
            .acquire_on(Arc::new(backend), key)
            .await
            .unwrap_or_else(|err| panic!("round {round}: {err}"));
        lease.release().await.expect("release");
    }
}

/// A password written without percent-encoding, with a `/`, `?` or `#` in
/// it (an operator's easy mistake), must not end up in the address that
/// errors and `Debug` output show.
#[tokio::test]
async fn an_unencoded_password_with_a_slash_is_never_shown() {
    let refused = RefusedPort::new();
    let port = refused.port;
    for password in ["hunt/er2", "hunt?er2", "hunt#er2"] {
        let url = format!("http://dlock:{password}@127.0.0.1:{port}");
        let builder =
            EtcdBackend::builder(&[url.as_str()]).connect_timeout(Duration::from_millis(300));
        let shown = format!("{builder:?}");
        assert!(!shown.contains("er2"), "{shown}");
        let err = builder.connect().await.expect_err("nothing listens there");
        let text = format!("{err} {err:?}");
        assert!(!text.contains("er2"), "{text}");
    }
}

/// The only member a client knows is paused: a caller that waits 1 s
/// gets its answer by about then, and a holder is told it lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_only_member_bounds_every_call_by_the_callers_wait() {
    let solo = Solo::start(&[]);
    let backend: Arc<dyn Backend> = Arc::new(
        EtcdBackend::builder(&[solo.endpoint().as_str()])
            .response_timeout(Duration::from_secs(1))
            .connect()
            .await
            .expect("connect"),
    );
    let key = fresh_key("paused");
    let held = LockOptions::new(Duration::from_secs(2))
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("free");
    solo.signal(libc::SIGSTOP);
    let started = Instant::now();
    let answer = LockOptions::new(Duration::from_secs(2))
        .wait(Duration::from_secs(1))
        .acquire_on(backend.clone(), fresh_key("paused-other"))
        .await;
    let took = started.elapsed();
    assert!(
        answer.is_err(),
        "nothing can be acquired from a paused member"
    );
    eprintln!("paused member: a 1 s wait answered after {took:?}");
    assert!(took < Duration::from_secs(4), "a 1 s wait took {took:?}");
    let lost = support::until_lost(&held, "the holder to be told").await;
    assert!(matches!(lost, LockError::LeaseLost { .. }), "{lost:?}");
    let started = Instant::now();
    let _ = tokio::time::timeout(Duration::from_secs(30), held.release()).await;
    let took = started.elapsed();
    solo.signal(libc::SIGCONT);
    eprintln!("paused member: a release answered after {took:?}");
    assert!(took < Duration::from_secs(12), "a release took {took:?}");
}

/// An operator revokes the holder's lease with etcdctl: the holder is
/// told, and the next holder's token is higher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_revoked_by_an_operator_is_lost_for_its_holder() {
    let solo = Solo::start(&[]);
    let backend: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(&[solo.endpoint().as_str()])
            .await
            .expect("connect"),
    );
    let key = fresh_key("revoked");
    let held = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("free");
    let json = etcdctl(
        &solo.endpoint(),
        &["get", &format!("dlock/lock/{}", key.as_str()), "-w", "json"],
    )
    .expect("get");
    let lease = etcd_support::json_number(&json, "lease").expect("a lease");
    assert!(
        etcdctl(
            &solo.endpoint(),
            &["lease", "revoke", &format!("{lease:x}")]
        )
        .is_some(),
        "revoke"
    );
    let lost = support::until_lost(&held, "the holder to hear its lease was revoked").await;
    assert!(matches!(lost, LockError::LeaseLost { .. }), "{lost:?}");
    let next = LockOptions::new(Duration::from_secs(5))
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("free again");
    assert!(next.token() > held.token());
    next.release().await.expect("release");
}

/// Callers that give up at random points of acquire and release, many
/// times: afterwards the key is free within the ttl plus the backend's
/// expiry slack, and no watch is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_that_give_up_mid_call_leave_nothing_held_or_watched() {
    let solo = Solo::start(&[]);
    let etcd = Arc::new(
        EtcdBackend::connect(&[solo.endpoint().as_str()])
            .await
            .expect("connect"),
    );
    let backend: Arc<dyn Backend> = etcd.clone();
    let key = fresh_key("give-up");
    let ttl = Duration::from_secs(1);
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut last_token = None;
    for _ in 0..120 {
        let cut = Duration::from_micros(next() % 8_000);
        let waiter = {
            let backend = backend.clone();
            let key = key.clone();
            tokio::spawn(async move {
                LockOptions::new(ttl)
                    .wait(Duration::from_millis(200))
                    .acquire_on(backend, key)
                    .await
            })
        };
        let acquired = tokio::time::timeout(
            cut,
            LockOptions::new(ttl)
                .wait(Duration::from_millis(200))
                .acquire_on(backend.clone(), key.clone()),
        )
        .await;
        if let Ok(Ok(lease)) = acquired {
            if let Some(last) = last_token {
                assert!(lease.token() > last);
            }
            last_token = Some(lease.token());
            let _ =
                tokio::time::timeout(Duration::from_micros(next() % 4_000), lease.release()).await;
        }
        if let Ok(lease) = waiter.await.expect("waiter") {
            let _ =
                tokio::time::timeout(Duration::from_micros(next() % 4_000), lease.release()).await;
        }
    }
    let deadline = Instant::now() + ttl + etcd.expiry_slack() + Duration::from_secs(3);
    loop {
        if backend.holder(&key).await.expect("holder").is_none() && etcd.watched_keys() == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still held or watched: {:?}, {} watches",
            backend.holder(&key).await,
            etcd.watched_keys()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let lease = LockOptions::new(ttl)
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("free at the end");
    lease.release().await.expect("release");
}

/// Takes `key` and holds it `hold`, `rounds` times, for waiters.
async fn take_in_turn(
    backend: Arc<dyn Backend>,
    key: LockKey,
    wait: Duration,
) -> Result<u64, LockError> {
    let lease = LockOptions::new(Duration::from_secs(5))
        .wait(wait)
        .acquire_on(backend, key)
        .await?;
    let token = lease.token().get();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let _ = lease.release().await;
    Ok(token)
}

/// Waiters wait on a key (their watches open on the members) when the
/// leader is killed: after the release each of them gets the key in
/// turn, long before its wait would end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_through_a_leader_kill_all_get_the_key_after_the_release() {
    let mut cluster = etcd_support::Cluster::start(3);
    let leader = cluster.leader().await;
    let all: Arc<dyn Backend> = Arc::new(cluster.backend().await);
    let only_leader: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(&[cluster.members[leader].endpoint().as_str()])
            .await
            .expect("connect"),
    );
    let follower = (leader + 1) % 3;
    let only_follower: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(&[cluster.members[follower].endpoint().as_str()])
            .await
            .expect("connect"),
    );
    let key = fresh_key("leader-kill-waiters");
    // A ttl well past the election: on a loaded machine the election and
    // the client's move to a live member can take longer than a short
    // ttl, and a holder that could not renew in time is rightly told it
    // lost the lease. This test is about the waiters, so the holder must
    // still hold when it releases. At 120 s, the lease cannot run out
    // within the 30 s the waiters get after the release (it was renewed
    // at most 40 s before it): only the release can wake them.
    let held = LockOptions::new(Duration::from_secs(120))
        .acquire_on(all.clone(), key.clone())
        .await
        .expect("free");
    let wait = Duration::from_secs(60);
    let waiters: Vec<_> = [
        all.clone(),
        all.clone(),
        only_follower.clone(),
        only_follower,
    ]
    .into_iter()
    .map(|backend| tokio::spawn(take_in_turn(backend, key.clone(), wait)))
    .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(only_leader);
    cluster.members[leader].kill();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let first = held.token().get();
    support::within(20, "the release after the election", held.release())
        .await
        .expect("release after the election");
    let started = Instant::now();
    let tokens = support::within(30, "every waiter to get the key in turn", async {
        let mut tokens = Vec::new();
        for waiter in waiters {
            tokens.push(
                waiter
                    .await
                    .expect("waiter")
                    .expect("each waiter gets the key"),
            );
        }
        tokens
    })
    .await;
    assert!(
        tokens.iter().all(|t| *t > first),
        "{tokens:?} after {first}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// Compaction and defragmentation while waiters watch: they still get
/// the key after the release, and none wakes falsely forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_through_compaction_and_defrag_get_the_key_after_the_release() {
    let solo = Solo::start(&[]);
    let backend: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(&[solo.endpoint().as_str()])
            .await
            .expect("connect"),
    );
    let other: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(&[solo.endpoint().as_str()])
            .await
            .expect("connect"),
    );
    let key = fresh_key("compaction");
    let held = LockOptions::new(Duration::from_secs(5))
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("free");
    let wait = Duration::from_secs(60);
    let waiters: Vec<_> = [backend.clone(), backend.clone(), other.clone(), other]
        .into_iter()
        .map(|backend| tokio::spawn(take_in_turn(backend, key.clone(), wait)))
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for i in 0..20 {
        etcdctl(&solo.endpoint(), &["put", "review/noise", &i.to_string()]).expect("put");
    }
    let status = etcdctl(&solo.endpoint(), &["endpoint", "status", "-w", "json"]).expect("status");
    let revision = etcd_support::json_number(&status, "revision").expect("revision");
    etcdctl(&solo.endpoint(), &["compact", &revision.to_string()]).expect("compact");
    etcdctl(&solo.endpoint(), &["defrag"]).expect("defrag");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(held.check().is_ok(), "compaction does not end a lease");
    let first = held.token().get();
    held.release().await.expect("release");
    let tokens = support::within(30, "every waiter to get the key in turn", async {
        let mut tokens = Vec::new();
        for waiter in waiters {
            tokens.push(
                waiter
                    .await
                    .expect("waiter")
                    .expect("each waiter gets the key"),
            );
        }
        tokens
    })
    .await;
    assert!(
        tokens.iter().all(|t| *t > first),
        "{tokens:?} after {first}"
    );
}

/// Keys with `/`, a key that is a prefix of others, a key of the
/// longest length: each is its own lock, and `held` lists by prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_that_prefix_each_other_are_separate_locks() {
    let solo = Solo::start(&[]);
    let backend: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(&[solo.endpoint().as_str()])
            .await
            .expect("connect"),
    );
    let base = format!("review-prefix/{}/", random_word());
    let name = |s: &str| LockKey::new(format!("{base}{s}")).expect("key");
    let a = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), name("a"))
        .await
        .expect("a");
    for other in ["a/b", "ab", "a/", "b"] {
        let lease = LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend.clone(), name(other))
            .await
            .unwrap_or_else(|err| panic!("{other} is free beside a: {err}"));
        let listed: Vec<String> = backend
            .held(&format!("{base}a"))
            .await
            .expect("held")
            .into_iter()
            .map(|(key, _)| key)
            .collect();
        let expect_listed = other.starts_with('a');
        assert_eq!(
            listed.contains(&format!("{base}{other}")),
            expect_listed,
            "{other}: {listed:?}"
        );
        assert!(listed.contains(&format!("{base}a")));
        lease.release().await.expect("release");
        assert!(backend.holder(&name("a")).await.expect("holder").is_some());
    }
    let only_slash: Vec<String> = backend
        .held(&format!("{base}a/"))
        .await
        .expect("held")
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    assert!(only_slash.is_empty(), "{only_slash:?}");
    a.release().await.expect("release");
    let long = LockKey::new("é/".repeat(dlock::key::MAX_KEY_LEN / 3)).expect("a long key");
    let lease = LockOptions::new(Duration::from_secs(5))
        .acquire_on(backend.clone(), long.clone())
        .await
        .expect("a long key is a key");
    let again = LockOptions::new(Duration::from_secs(5))
        .acquire_on(backend.clone(), long.clone())
        .await;
    assert!(matches!(again, Err(LockError::Held { .. })), "{again:?}");
    lease.release().await.expect("release");
}

/// Short ttls below etcd's whole-second minimum: the holder is told at
/// its own ttl when it cannot renew, and the key is never another's
/// while the holder's lease is valid by its clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_ttls_tell_the_holder_at_its_own_ttl_and_keep_exclusion() {
    let solo = Solo::start(&[]);
    let proxy = support::proxy::Proxy::bind(format!("127.0.0.1:{}", solo.port)).await;
    let holder_side: Arc<dyn Backend> = Arc::new(
        EtcdBackend::builder(&[format!("http://127.0.0.1:{}", proxy.port).as_str()])
            .response_timeout(Duration::from_millis(500))
            .connect()
            .await
            .expect("connect"),
    );
    let other: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(&[solo.endpoint().as_str()])
            .await
            .expect("connect"),
    );
    for ttl in [Duration::from_millis(100), Duration::from_secs(2)] {
        let key = fresh_key("short-ttl");
        let held = LockOptions::new(ttl)
            .acquire_on(holder_side.clone(), key.clone())
            .await
            .expect("free");
        // Renewals go on for a while. At 100 ms a renewal has about 60 ms
        // to come back, which a loaded machine can miss; the lease is then
        // lost early, which is no break of exclusion, so only the
        // whole-second ttl must still hold here. At 2 s (renewed every
        // 667 ms) a pause of over a second still leaves a renewal in time,
        // as 1 s (renewed every 333 ms, 500 ms response timeout) did not.
        tokio::time::sleep(ttl * 2).await;
        if ttl >= Duration::from_secs(1) {
            assert!(held.check().is_ok(), "{ttl:?}: renewed");
        }
        proxy.freeze();
        let frozen_at = Instant::now();
        let mut told_at = None;
        let mut other_at = None;
        let deadline = Instant::now() + Duration::from_secs(15);
        while (told_at.is_none() || other_at.is_none()) && Instant::now() < deadline {
            if told_at.is_none() && held.check().is_err() {
                told_at = Some(Instant::now());
            }
            if other_at.is_none()
                && let Ok(next) = LockOptions::new(Duration::from_secs(5))
                    .acquire_on(other.clone(), key.clone())
                    .await
            {
                other_at = Some(Instant::now());
                assert!(next.token() > held.token());
                // The holder's validity counts from before each of its
                // requests was sent (lease/renewal.rs: `sent + ttl`), so
                // it ends no later than etcd's lease, before the other's
                // grant. It may end between the poll at the top of this
                // pass and the grant: look again now that the grant has
                // returned. Still valid now is a real overlap.
                if told_at.is_none() && held.check().is_err() {
                    told_at = Some(Instant::now());
                }
                assert!(
                    told_at.is_some(),
                    "{ttl:?}: another holder got the key before the holder was told"
                );
                next.release().await.expect("release");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let told = told_at.expect("told") - frozen_at;
        eprintln!(
            "ttl {ttl:?}: told {told:?} after the freeze, another got the key {:?} after",
            other_at.map(|at| at - frozen_at)
        );
        // Told by the holder's own clock; the margin is for this loop's
        // acquisitions and wake-ups on a loaded machine, not the lease.
        assert!(
            told <= ttl + Duration::from_millis(1500),
            "{ttl:?}: told after {told:?}"
        );
        assert!(other_at.is_some(), "{ttl:?}: the key came free");
        proxy.thaw();
        drop(held);
    }
}

/// Peer proxies that can cut one member off from the others for real:
/// every member advertises a proxy port as its peer URL, and each proxy
/// tags the connections it carries by the member that opened them (the
/// `X-PeerURLs` header etcd's peer requests carry). Cutting member `x`
/// closes, and refuses from then on, every connection to `x` and every
/// connection `x` opened: no raft message, lease forward or snapshot
/// passes either way, while `x` keeps serving its clients.
struct PeerNet {
    /// The advertised (proxy) peer port of each member.
    ports: Vec<u16>,
    cut: Arc<std::sync::Mutex<Option<usize>>>,
    conns: Arc<std::sync::Mutex<Vec<(usize, usize, tokio::task::AbortHandle)>>>,
    accepts: Vec<tokio::task::AbortHandle>,
}

impl PeerNet {
    async fn bind(listen: &[u16]) -> Self {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut listeners = Vec::new();
        for _ in listen {
            listeners.push(
                tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind"),
            );
        }
        let ports: Vec<u16> = listeners
            .iter()
            .map(|l| l.local_addr().expect("addr").port())
            .collect();
        let cut: Arc<std::sync::Mutex<Option<usize>>> = Arc::default();
        let conns: Arc<std::sync::Mutex<Vec<(usize, usize, tokio::task::AbortHandle)>>> =
            Arc::default();
        let mut accepts = Vec::new();
        for (to, listener) in listeners.into_iter().enumerate() {
            let upstream = listen[to];
            let (cut, conns, ports) = (cut.clone(), conns.clone(), ports.clone());
            accepts.push(
                tokio::spawn(async move {
                    while let Ok((mut client, _)) = listener.accept().await {
                        let (cut, conns, ports) = (cut.clone(), conns.clone(), ports.clone());
                        let task = tokio::spawn(async move {
                            // The request's headers name the sender.
                            let mut head = Vec::new();
                            let mut buf = [0u8; 4096];
                            let from = loop {
                                let n = match client.read(&mut buf).await {
                                    Ok(0) | Err(_) => return,
                                    Ok(n) => n,
                                };
                                head.extend_from_slice(&buf[..n]);
                                let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
                                if let Some(at) = text.find("x-peerurls:") {
                                    let line = text[at..].lines().next().unwrap_or("");
                                    if line.contains('\r') || text[at..].contains("\r\n") {
                                        break ports
                                            .iter()
                                            .position(|p| line.contains(&format!(":{p}")));
                                    }
                                }
                                if text.contains("\r\n\r\n") || head.len() > 65_536 {
                                    break None;
                                }
                            };
                            let from = from.unwrap_or(usize::MAX);
                            let blocked =
                                |c: Option<usize>| c.is_some_and(|c| c == to || c == from);
                            if blocked(*cut.lock().expect("cut")) {
                                return;
                            }
                            let Ok(mut server) =
                                tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                            else {
                                return;
                            };
                            if server.write_all(&head).await.is_err() {
                                return;
                            }
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        });
                        let mut conns = conns.lock().expect("conns");
                        conns.retain(|(_, _, t)| !t.is_finished());
                        // A cut closes every connection; the ones etcd opens
                        // again are checked against the cut when they open.
                        conns.push((to, usize::MAX, task.abort_handle()));
                    }
                })
                .abort_handle(),
            );
        }
        Self {
            ports,
            cut,
            conns,
            accepts,
        }
    }

    /// Cuts member `x` off: every connection closed, new ones to or
    /// from `x` refused.
    fn cut(&self, x: usize) {
        *self.cut.lock().expect("cut") = Some(x);
        // Close everything; connections not touching `x` are opened again
        // by etcd at once and let through.
        for (_, _, task) in self.conns.lock().expect("conns").drain(..) {
            task.abort();
        }
    }

    fn heal(&self) {
        *self.cut.lock().expect("cut") = None;
    }
}

impl Drop for PeerNet {
    fn drop(&mut self) {
        for task in &self.accepts {
            task.abort();
        }
        for (_, _, task) in self.conns.lock().expect("conns").drain(..) {
            task.abort();
        }
    }
}

/// A cluster of three members whose peer traffic passes through a
/// [`PeerNet`].
struct PartCluster {
    members: Vec<Solo>,
    net: PeerNet,
}

impl PartCluster {
    /// A free port can be taken by another test before a member binds it:
    /// that member exits, and the cluster starts again on fresh ports.
    async fn start() -> Self {
        for _ in 0..2 {
            if let Some(cluster) = Self::launch().await {
                return cluster;
            }
        }
        Self::launch()
            .await
            .expect("etcd members kept finding their ports taken")
    }

    /// `None` if a member exited (its port was taken).
    async fn launch() -> Option<Self> {
        let listen: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let net = PeerNet::bind(&listen).await;
        let initial: Vec<String> = (0..3)
            .map(|i| format!("p{i}=http://127.0.0.1:{}", net.ports[i]))
            .collect();
        let initial = initial.join(",");
        let token = random_word();
        let mut members = Vec::new();
        for (i, listen) in listen.iter().enumerate() {
            let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
                "dlock-etcd-{}-review-{}",
                std::process::id(),
                random_word()
            ));
            std::fs::create_dir_all(&dir).expect("dir");
            let extra = vec![
                "--name".to_owned(),
                format!("p{i}"),
                "--listen-peer-urls".to_owned(),
                format!("http://127.0.0.1:{listen}"),
                "--initial-advertise-peer-urls".to_owned(),
                format!("http://127.0.0.1:{}", net.ports[i]),
                "--initial-cluster".to_owned(),
                initial.clone(),
                "--initial-cluster-token".to_owned(),
                token.clone(),
            ];
            members.push(Solo {
                port: free_port(),
                peer: *listen,
                dir,
                extra,
                child: None,
                log_from: 0,
            });
        }
        // Started together, then waited for (on this thread: a member
        // dies with the thread that started it).
        for member in &mut members {
            member.spawn();
        }
        // Every member is watched at once: one that exited may keep the
        // others from ever answering.
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut up = [false; 3];
        while up.contains(&false) {
            for (i, member) in members.iter_mut().enumerate() {
                if member.exited() {
                    eprintln!("etcd exited, starting again:\n{}", member.log());
                    return None;
                }
                up[i] = up[i] || member.answers();
            }
            assert!(Instant::now() < deadline, "etcd members did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(Self { members, net })
    }

    fn endpoints_but(&self, x: usize) -> Vec<String> {
        (0..3)
            .filter(|i| *i != x)
            .map(|i| self.members[i].endpoint())
            .collect()
    }

    fn leader(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            assert!(Instant::now() < deadline, "no leader");
            for (i, m) in self.members.iter().enumerate() {
                if let Some(status) = etcdctl(&m.endpoint(), &["endpoint", "status", "-w", "json"])
                {
                    let id = etcd_support::json_number(&status, "member_id");
                    let leader = etcd_support::json_number(&status, "leader");
                    if id.is_some() && id == leader {
                        return i;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A holder connected only to a member that a real partition cuts off
/// from the other two (a follower, then the leader itself): it is told
/// its lease is lost, and the majority gives the key to another, with a
/// higher token, only once the holder knows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_on_the_minority_side_of_a_partition_is_told_before_the_majority_grants() {
    for cut_leader in [false, true] {
        let cluster = PartCluster::start().await;
        let leader = cluster.leader();
        let x = if cut_leader { leader } else { (leader + 1) % 3 };
        let holder_side: Arc<dyn Backend> = Arc::new(
            EtcdBackend::builder(&[cluster.members[x].endpoint().as_str()])
                .response_timeout(Duration::from_secs(1))
                .connect()
                .await
                .expect("connect"),
        );
        let majority = cluster.endpoints_but(x);
        let majority: Vec<&str> = majority.iter().map(String::as_str).collect();
        let other: Arc<dyn Backend> = Arc::new(
            EtcdBackend::builder(&majority)
                .response_timeout(Duration::from_secs(1))
                .connect()
                .await
                .expect("connect"),
        );
        let key = fresh_key("partition");
        let ttl = Duration::from_secs(3);
        let held = LockOptions::new(ttl)
            .acquire_on(holder_side.clone(), key.clone())
            .await
            .expect("free");
        tokio::time::sleep(Duration::from_secs(1)).await;
        cluster.net.cut(x);
        let cut_at = Instant::now();
        let deadline = cut_at + Duration::from_secs(30);
        let next = loop {
            assert!(
                Instant::now() < deadline,
                "cut leader {cut_leader}: the key never came free"
            );
            match LockOptions::new(Duration::from_secs(5))
                .acquire_on(other.clone(), key.clone())
                .await
            {
                Ok(next) => break next,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let granted_after = cut_at.elapsed();
        // The cut is real: the member, still serving its clients, cannot
        // answer a linearizable read (it needs a quorum).
        let cut_off = cluster.members[x].endpoint();
        assert!(
            etcdctl(&cut_off, &["endpoint", "status"]).is_some(),
            "the cut member still serves clients"
        );
        assert!(
            etcdctl(&cut_off, &["get", "review/probe"]).is_none(),
            "cut leader {cut_leader}: the cut member still reaches a quorum"
        );
        assert!(
            held.check().is_err(),
            "cut leader {cut_leader}: the majority granted {key} {granted_after:?} after the cut \
             while the minority holder still believes it holds it"
        );
        assert!(next.token() > held.token());
        let told = support::until_lost(&held, "the minority holder to be told").await;
        assert!(matches!(told, LockError::LeaseLost { .. }), "{told:?}");
        eprintln!("cut leader {cut_leader}: granted to another {granted_after:?} after the cut");
        // Released on the majority side while the cut holds: once healed,
        // the member that was cut off can force an election, and a release
        // sent then waits out the 1 s response timeout.
        next.release().await.expect("release");
        cluster.net.heal();
        drop(held);
    }
}

/// The lease is named by owner and ttl: a renewal to another ttl, and a
/// retry of the acquisition with another ttl, move the key onto another
/// lease. Through every change the key keeps its token and stays the
/// owner's alone, for the new ttl, and its release frees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_the_ttl_keeps_the_token_and_exclusion() {
    use dlock::backend::{
        AcquireRequest, Attempt, OwnerId, ReleaseOutcome, ReleaseRequest, Renewal,
    };
    let solo = Solo::start(&[]);
    let backend = EtcdBackend::connect(&[solo.endpoint().as_str()])
        .await
        .expect("connect");
    let key = fresh_key("ttl-change");
    let (owner, other) = (
        OwnerId::random().expect("id"),
        OwnerId::random().expect("id"),
    );
    let secs = Duration::from_secs;
    let Attempt::Acquired(grant) = backend
        .try_acquire(&AcquireRequest::new(&key, &owner, secs(2)))
        .await
        .expect("acquire")
    else {
        panic!("free")
    };
    let token = grant.token;
    let others_try = || async {
        backend
            .try_acquire(&AcquireRequest::new(&key, &other, secs(2)))
            .await
            .expect("try")
    };
    let token_now = || async {
        backend
            .holder(&key)
            .await
            .expect("holder")
            .expect("held")
            .token
    };
    // A renewal to a longer ttl, then past the first lease's end.
    assert!(
        backend
            .extend(&Renewal::new(&key, &owner, secs(6)))
            .await
            .expect("extend")
    );
    let extended = Instant::now();
    tokio::time::sleep(secs(3)).await;
    assert!(matches!(others_try().await, Attempt::Held { .. }));
    assert_eq!(token_now().await, Some(token));
    // A retry of the acquisition with yet another ttl: the same token.
    // Its 10 s lease outlasts the check below by far; the 6 s one would
    // have ended by then.
    let Attempt::Acquired(again) = backend
        .try_acquire(&AcquireRequest::new(&key, &owner, secs(10)))
        .await
        .expect("retry")
    else {
        panic!("a retry by the holder is a success")
    };
    assert_eq!(again.token, token);
    tokio::time::sleep_until((extended + secs(7)).into()).await;
    assert!(matches!(others_try().await, Attempt::Held { .. }));
    // Back to the first ttl, renewed as such.
    assert!(
        backend
            .extend(&Renewal::new(&key, &owner, secs(2)))
            .await
            .expect("extend")
    );
    assert!(
        backend
            .extend(&Renewal::new(&key, &owner, secs(2)))
            .await
            .expect("extend")
    );
    assert_eq!(token_now().await, Some(token));
    assert!(matches!(others_try().await, Attempt::Held { .. }));
    assert_eq!(
        backend
            .release(&ReleaseRequest::new(&key, &owner))
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    let Attempt::Acquired(next) = others_try().await else {
        panic!("free after the release")
    };
    assert!(next.token > token);
}

/// Every log line the backend and its client crates write, at every
/// level, while connecting with a wrong password and with the right one,
/// with a listed member down, and locking: none shows the password.
///
/// The lines are heard in a process of its own (this test, run again),
/// whose global subscriber is set before any line is written. A
/// subscriber of this thread only, beside the binary's other tests, heard
/// 3 lines in one run under load: a callsite first met on another thread
/// while it was being set keeps the interest it had without it, and stays
/// silent.
#[test]
fn no_log_line_shows_a_password() {
    const CHILD: &str = "DLOCK_TEST_LOG_EVERYTHING";
    if std::env::var_os(CHILD).is_some() {
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(std::io::stderr)
            .init();
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(log_everything());
        return;
    }
    let exe = std::env::current_exe().expect("this test binary");
    let out = std::process::Command::new(exe)
        .args(["--exact", "no_log_line_shows_a_password", "--nocapture"])
        .env(CHILD, "1")
        .output()
        .expect("run the test binary again");
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!(
        "log: {} lines, {} from h2, {} from tonic",
        text.lines().count(),
        text.matches(" h2::").count(),
        text.matches(" tonic::").count()
    );
    assert!(out.status.success(), "the logging run failed: {text}");
    assert!(text.len() > 1000, "the subscriber heard little: {text}");
    for secret in [PASSWORD, ENCODED, "wr/ong@pw", "wr%2Fong%40pw"] {
        assert!(!text.contains(secret), "a log line shows {secret}");
    }
}

/// What [`no_log_line_shows_a_password`] logs.
async fn log_everything() {
    let mut solo = Solo::start(&["--auth-token-ttl", "1"]);
    solo.enable_auth(PASSWORD);
    let refused = RefusedPort::new();
    let down = refused.port;
    let wrong = format!("http://root:wr%2Fong%40pw@127.0.0.1:{}", solo.port);
    let _ = EtcdBackend::connect(&[wrong.as_str()]).await;
    let right = format!("http://root:{ENCODED}@127.0.0.1:{}", solo.port);
    let right_down = format!("http://root:{ENCODED}@127.0.0.1:{down}");
    let backend: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(&[right_down.as_str(), right.as_str()])
            .await
            .expect("connect"),
    );
    let key = fresh_key("logs");
    let lease = LockOptions::new(Duration::from_secs(2))
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("free");
    let waiter = support::spawn_waiter(backend.clone(), &key, 2, 10);
    tokio::time::sleep(Duration::from_secs(2)).await;
    solo.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    solo.launch();
    let _ = lease.release().await;
    let _ = waiter.await;
}

/// A member replaced (removed, and a new one with an empty data
/// directory added in its place): a lock held through it stays held and
/// exclusive, and tokens keep rising, through the old client and one of
/// the new member alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacing_a_member_keeps_locks_and_tokens_rising() {
    let mut cluster = etcd_support::Cluster::start(3);
    let endpoints = cluster.endpoints();
    let all: Arc<dyn Backend> = Arc::new(cluster.backend().await);
    let key = fresh_key("replace");
    let first = LockOptions::new(Duration::from_secs(5))
        .acquire_on(all.clone(), key.clone())
        .await
        .expect("free");
    let first_token = first.token();
    // Its ttl leaves room for an election on a loaded machine (the member
    // removed may be the leader); the check below comes after two ttls,
    // so the lock held only by being renewed through the replacement.
    let held_ttl = Duration::from_secs(10);
    let held_since = Instant::now();
    let held = LockOptions::new(held_ttl)
        .acquire_on(all.clone(), fresh_key("replace-held"))
        .await
        .expect("free");
    first.release().await.expect("release");
    // Remove the last member, then add a new one in its place.
    let list = etcdctl(&endpoints[0], &["member", "list"]).expect("member list");
    let gone = &cluster.members[2];
    let id = list
        .lines()
        .find(|line| line.contains(&format!(":{},", gone.peer_port)))
        .and_then(|line| line.split(',').next())
        .expect("the member's id")
        .trim()
        .to_owned();
    // etcd refuses a removal until its leader has been in touch with a
    // quorum for 5 s.
    let deadline = Instant::now() + Duration::from_secs(20);
    while etcdctl(&endpoints[0], &["member", "remove", &id]).is_none() {
        assert!(Instant::now() < deadline, "member remove {id} of {list}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    cluster.members[2].kill();
    let mut fresh = Solo::start_later();
    let peer = format!("http://127.0.0.1:{}", fresh.peer);
    let add = format!("--peer-urls={peer}");
    while etcdctl(&endpoints[0], &["member", "add", "fresh", &add]).is_none() {
        assert!(Instant::now() < deadline, "member add");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let initial = format!(
        "m0=http://127.0.0.1:{},m1=http://127.0.0.1:{},fresh={peer}",
        cluster.members[0].peer_port, cluster.members[1].peer_port
    );
    fresh.extra = vec![
        "--name".into(),
        "fresh".into(),
        "--initial-cluster".into(),
        initial,
        "--initial-cluster-state".into(),
        "existing".into(),
    ];
    fresh.launch();
    let alone: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(&[fresh.endpoint().as_str()])
            .await
            .expect("connect"),
    );
    let mut last = first_token;
    for backend in [all.clone(), alone.clone(), all.clone()] {
        let lease = LockOptions::new(Duration::from_secs(5))
            .wait(Duration::from_secs(10))
            .acquire_on(backend, key.clone())
            .await
            .expect("free");
        assert!(lease.token() > last, "{} after {last}", lease.token());
        last = lease.token();
        lease.release().await.expect("release");
    }
    tokio::time::sleep_until((held_since + 2 * held_ttl).into()).await;
    assert!(
        held.check().is_ok(),
        "a lock held through the replacement stays held"
    );
    let again = LockOptions::new(Duration::from_secs(3))
        .acquire_on(alone, held.key().clone())
        .await;
    assert!(matches!(again, Err(LockError::Held { .. })), "{again:?}");
    held.release().await.expect("release");
}

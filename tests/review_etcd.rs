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
        };
        solo.launch();
        solo
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn launch(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .expect("log");
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
        let deadline = Instant::now() + Duration::from_secs(30);
        // `endpoint status` needs no credentials once auth is on.
        while etcdctl(&self.endpoint(), &["endpoint", "status"]).is_none() {
            assert!(Instant::now() < deadline, "etcd did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
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
    let dead = format!("http://root:{wrong}@127.0.0.1:{}", free_port());
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

/// A password written without percent-encoding, with a `/`, `?` or `#` in
/// it (an operator's easy mistake), must not end up in the address that
/// errors and `Debug` output show.
#[tokio::test]
async fn an_unencoded_password_with_a_slash_is_never_shown() {
    let port = free_port();
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
    assert!(took < Duration::from_secs(4), "a 1 s wait took {took:?}");
    let lost = support::until_lost(&held, "the holder to be told").await;
    assert!(matches!(lost, LockError::LeaseLost { .. }), "{lost:?}");
    let started = Instant::now();
    let _ = tokio::time::timeout(Duration::from_secs(30), held.release()).await;
    let took = started.elapsed();
    solo.signal(libc::SIGCONT);
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

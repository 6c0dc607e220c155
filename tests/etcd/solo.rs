//! One etcd member a test starts for itself on free loopback ports, with
//! extra flags, and what the tests on such members share.

use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock::{Backend, LockError, LockKey, LockOptions};

use crate::etcd_support::{etcdctl, free_port, random_word};

/// One etcd member on free loopback ports, with extra flags; killed and
/// its directory removed on drop.
pub struct Solo {
    pub port: u16,
    pub peer: u16,
    pub dir: PathBuf,
    pub extra: Vec<String>,
    pub child: Option<Child>,
    /// The length of `etcd.log` when the running process was started:
    /// what it wrote begins there.
    pub log_from: usize,
}

impl Solo {
    pub fn start(extra: &[&str]) -> Self {
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
    pub fn start_later() -> Self {
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

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn launch(&mut self) {
        self.spawn();
        assert!(self.wait_up(), "etcd exited:\n{}", self.log());
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }

    /// Starts the process, without waiting for it to answer.
    pub fn spawn(&mut self) {
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
    pub fn wait_up(&mut self) -> bool {
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
    pub fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .expect("spawned")
            .try_wait()
            .expect("try_wait")
            .is_some()
    }

    /// Whether it answers on its client port, having said in its log that
    /// it serves clients there (call while it runs).
    pub fn answers(&self) -> bool {
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

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn signal(&self, signal: libc::c_int) {
        let pid = self.child.as_ref().expect("runs").id();
        // SAFETY: kill(2) on our own child.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, signal) }, 0);
    }

    /// Turns authentication on, user `root` with `password`.
    pub fn enable_auth(&self, password: &str) {
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

/// Takes `key` and holds it `hold`, `rounds` times, for waiters.
pub async fn take_in_turn(
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

//! etcd clusters a test starts for itself: members on free loopback ports,
//! each in a directory of its own, always killed again (on drop, and by
//! the kernel if the test process dies first) and their directories
//! removed.
//!
//! The members run with a 50 ms heartbeat and a 500 ms election timeout,
//! so a leader is replaced within about a second and the cluster's
//! minimum lease ttl is 1 s (1.5 × the election timeout, rounded up).

#![allow(dead_code)]

use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use dlock::backend::OwnerId;
use dlock::etcd::EtcdBackend;

/// Member directories are `<target tmp>/dlock-etcd-<pid>-<token>-m<i>`:
/// named by the test process that made them, so a later run can remove
/// those of a process that is gone (etcd preallocates 64 MB of log per
/// member).
const DIR_PREFIX: &str = "dlock-etcd-";

/// Removes the member directories of test processes that no longer run
/// (killed before their clean-up ran).
fn sweep_dirs_of_dead_processes() {
    let Ok(entries) = std::fs::read_dir(env!("CARGO_TARGET_TMPDIR")) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(DIR_PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        // SAFETY: kill(2) with signal 0 only asks whether the pid exists.
        let alive = unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if !alive {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A loopback port nothing listens on now.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().expect("local addr").port()
}

/// A fresh random text, for key prefixes and cluster tokens.
pub fn random_word() -> String {
    OwnerId::random().expect("random").to_string()
}

/// One `etcd` member process.
pub struct Member {
    pub name: String,
    pub client_port: u16,
    pub peer_port: u16,
    dir: PathBuf,
    child: Option<Child>,
    /// The cluster it was started in: `--initial-cluster` and its token.
    initial: (String, String),
}

impl Member {
    /// Starts the member's process (again, after [`Member::kill`]: its
    /// data directory makes it rejoin as the member it was).
    pub fn launch(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .expect("log file");
        let mut command = Command::new("etcd");
        command
            .args(["--name", &self.name])
            .arg("--data-dir")
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &self.endpoint()])
            .args(["--advertise-client-urls", &self.endpoint()])
            .args(["--listen-peer-urls", &self.peer_url()])
            .args(["--initial-advertise-peer-urls", &self.peer_url()])
            .args(["--initial-cluster", &self.initial.0])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &self.initial.1])
            .args(["--heartbeat-interval", "50"])
            .args(["--election-timeout", "500"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log);
        // SAFETY: prctl is async-signal-safe; it asks the kernel to kill
        // the member when the thread that started it ends, so a test
        // process that dies without running destructors leaves no member
        // behind.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .expect("etcd must be installed (scripts/test installs etcd-server)");
        self.child = Some(child);
    }

    /// `http://127.0.0.1:PORT`, its client URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    /// Its process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills it at once (SIGKILL).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes it (SIGSTOP): its peers and clients hear nothing from it,
    /// and it hears nothing, until [`Member::resume`]; its sockets stay
    /// open, as across a network partition.
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Lets a frozen member run again (SIGCONT).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = self.pid().expect("the member runs");
        // SAFETY: kill(2) on our own child's pid.
        let sent = unsafe { libc::kill(pid as libc::pid_t, signal) };
        assert_eq!(sent, 0, "signal {signal} to etcd member {}", self.name);
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A cluster of members started together.
pub struct Cluster {
    pub members: Vec<Member>,
}

impl Cluster {
    /// Starts `size` members and waits until every one of them answers a
    /// read (which needs a leader).
    ///
    /// A port [`free_port`] handed out can be taken by another test before
    /// its member binds it: a cluster whose member found its port in use
    /// is started again on fresh ports (up to three times).
    pub fn start(size: usize) -> Self {
        for _ in 0..2 {
            let cluster = Self::launch(size);
            if cluster.wait_all_healthy() {
                return cluster;
            }
        }
        let cluster = Self::launch(size);
        assert!(
            cluster.wait_all_healthy(),
            "etcd members kept finding their ports taken"
        );
        cluster
    }

    /// Waits until every member answers a read; `false` if one found its
    /// port in use (it exits at once). Panics after 30 s.
    fn wait_all_healthy(&self) -> bool {
        for member in &self.members {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if etcdctl(&member.endpoint(), &["endpoint", "health"]).is_some() {
                    break;
                }
                if member.log().contains("address already in use") {
                    return false;
                }
                assert!(
                    Instant::now() < deadline,
                    "etcd member {} did not become healthy:\n{}",
                    member.name,
                    member.log()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        true
    }

    /// Starts `size` members on fresh ports, without waiting for them.
    fn launch(size: usize) -> Self {
        sweep_dirs_of_dead_processes();
        let token = random_word();
        let pid = std::process::id();
        let mut members: Vec<Member> = (0..size)
            .map(|i| {
                let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
                    .join(format!("{DIR_PREFIX}{pid}-{token}-m{i}"));
                std::fs::create_dir_all(&dir).expect("member directory");
                Member {
                    name: format!("m{i}"),
                    client_port: free_port(),
                    peer_port: free_port(),
                    dir,
                    child: None,
                    initial: (String::new(), String::new()),
                }
            })
            .collect();
        let initial: Vec<String> = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect();
        let initial = initial.join(",");
        for member in &mut members {
            member.initial = (initial.clone(), token.clone());
            member.launch();
        }
        Self { members }
    }

    /// Waits until member `i` answers a read.
    pub fn wait_healthy(&self, i: usize) {
        let member = &self.members[i];
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if etcdctl(&member.endpoint(), &["endpoint", "health"]).is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "etcd member {} did not become healthy:\n{}",
            member.name,
            member.log()
        );
    }

    /// Every running member's client URL.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .filter(|m| m.child.is_some())
            .map(Member::endpoint)
            .collect()
    }

    /// A backend on every running member.
    pub async fn backend(&self) -> EtcdBackend {
        let endpoints = self.endpoints();
        let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
        EtcdBackend::connect(&endpoints)
            .await
            .expect("the test cluster answers")
    }

    /// The index of the current leader, as the running members tell it
    /// (waits up to 20 s for one to be elected and known).
    pub async fn leader(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let statuses: Vec<(usize, u64, u64)> = self
                .members
                .iter()
                .enumerate()
                .filter(|(_, m)| m.child.is_some())
                .filter_map(|(i, m)| {
                    let status = etcdctl(&m.endpoint(), &["endpoint", "status", "-w", "json"])?;
                    Some((
                        i,
                        json_number(&status, "member_id")?,
                        json_number(&status, "leader")?,
                    ))
                })
                .collect();
            let leader = statuses.iter().find_map(|(_, _, leader)| {
                statuses
                    .iter()
                    .find(|(_, id, _)| id == leader)
                    .map(|(i, _, _)| *i)
            });
            if let Some(leader) = leader {
                return leader;
            }
            assert!(Instant::now() < deadline, "no etcd leader within 20 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// `etcdctl` against `endpoint`: its output, or `None` if it failed.
pub fn etcdctl(endpoint: &str, args: &[&str]) -> Option<String> {
    let output = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .args(["--endpoints", endpoint, "--command-timeout", "1s"])
        .args(args)
        .output()
        .expect("etcdctl must be installed (scripts/test installs etcd-client)");
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The first number after `"field":` in etcdctl's JSON.
pub fn json_number(json: &str, field: &str) -> Option<u64> {
    let at = json.find(&format!("\"{field}\":"))? + field.len() + 3;
    let digits: String = json[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// The create revision of the lock key of `key`, read with etcdctl.
pub fn create_revision(endpoint: &str, key: &str) -> Option<u64> {
    let json = etcdctl(
        endpoint,
        &["get", &format!("dlock/lock/{key}"), "-w", "json"],
    )?;
    json_number(&json, "create_revision")
}

/// The cluster the conformance suite and the other tests of a binary
/// share: three members, started once, on a thread that lives as long as
/// the test process (the members die with it, by `PR_SET_PDEATHSIG`).
pub fn shared_cluster() -> &'static Vec<String> {
    static ENDPOINTS: OnceLock<Vec<String>> = OnceLock::new();
    ENDPOINTS.get_or_init(|| {
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let cluster = Cluster::start(3);
            let members: Vec<(u32, PathBuf)> = cluster
                .members
                .iter()
                .filter_map(|m| Some((m.pid()?, m.dir.clone())))
                .collect();
            let _ = SHARED_MEMBERS.set(members);
            // SAFETY: registers a plain function to run at exit; the test
            // harness ends with `exit`, which runs it.
            unsafe {
                libc::atexit(remove_shared_cluster);
            }
            let _ = sender.send(cluster.endpoints());
            // Keeps the members (and this thread, which started them) alive.
            loop {
                std::thread::park();
            }
        });
        receiver.recv().expect("the shared etcd cluster started")
    })
}

/// The shared cluster's members: pid and directory, for the clean-up at
/// exit (statics are never dropped).
static SHARED_MEMBERS: OnceLock<Vec<(u32, PathBuf)>> = OnceLock::new();

/// At exit: kills the shared cluster's members and removes their
/// directories.
extern "C" fn remove_shared_cluster() {
    for (pid, dir) in SHARED_MEMBERS.get().into_iter().flatten() {
        // SAFETY: kill(2) on a member this process started.
        unsafe {
            libc::kill(*pid as libc::pid_t, libc::SIGKILL);
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A backend on the shared cluster.
pub async fn shared_backend() -> Arc<dyn dlock::Backend> {
    let endpoints = shared_cluster();
    let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
    Arc::new(
        EtcdBackend::connect(&endpoints)
            .await
            .expect("the shared etcd cluster answers"),
    )
}

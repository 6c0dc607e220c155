//! Helpers the integration test binaries share.

#![allow(dead_code)]

pub mod proxy;
pub mod seeds;

use std::process::Command;
use std::time::Duration;

/// The hang guard, the attempt-counting backend and the waiting task the
/// shipped conformance suite uses, for this crate's other tests too.
#[allow(unused_imports)] // each test binary uses some of them
pub use dlock_runtime::conformance::{CountingBackend, spawn_waiter, within};

/// A directory of one test's own under the target's scratch directory,
/// removed when dropped, however the test ended.
pub struct ScratchDir(std::path::PathBuf);

impl ScratchDir {
    /// A new, empty directory whose name starts with `label`.
    pub fn new(label: &str) -> Self {
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "{label}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |since| since.as_nanos())
        ));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        Self(dir)
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = std::path::Path;

    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for ScratchDir {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A loopback port that refuses every connection for as long as this
/// lives: bound and never listened on, so no server of another test can
/// take it meanwhile, as it can a port found free and let go (a "down
/// member" that another test's server answered on gave an h2 protocol
/// error instead of a refused connection; a "closed" Redis or PostgreSQL
/// port can likewise be taken by another test binary's server).
pub struct RefusedPort {
    _socket: tokio::net::TcpSocket,
    pub port: u16,
}

impl RefusedPort {
    pub fn new() -> Self {
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        socket
            .bind("127.0.0.1:0".parse().expect("an address"))
            .expect("bind a loopback port");
        let port = socket.local_addr().expect("local addr").port();
        Self {
            _socket: socket,
            port,
        }
    }
}

/// The port of a [`RefusedPort`] kept for the rest of this test binary's
/// run: for a helper that hands out bare port numbers (each call a port
/// of its own).
pub fn refused_port() -> u16 {
    static KEPT: std::sync::Mutex<Vec<RefusedPort>> = std::sync::Mutex::new(Vec::new());
    let refused = RefusedPort::new();
    let port = refused.port;
    KEPT.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(refused);
    port
}

/// Re-runs this test binary as a child process playing `role` (see
/// [`child_command`]), with its stdin and stdout piped to the caller.
pub fn spawn_child(module: &str, env_var: &str, role: &str, args: &[&str]) -> std::process::Child {
    use std::process::Stdio;
    child_command(module, env_var, role, args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child")
}

/// In a child started by [`spawn_child`]: its role and arguments, read from
/// `env_var`, and a runtime to play it on. `None` in a normal test run.
pub fn child_role(env_var: &str) -> Option<(tokio::runtime::Runtime, Vec<String>)> {
    let spec = std::env::var(env_var).ok()?;
    let parts = spec.split('\u{1f}').map(str::to_owned).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    Some((runtime, parts))
}

/// A command that re-runs this test binary as a child process playing
/// `role`: it runs only the `#[ignore]`d `child_process_entry` test of
/// `module` (the caller's `module_path!()`: a binary of several modules
/// has one entry in each that spawns children), which reads the role and
/// its arguments from `env_var`. The caller sets stdio.
pub fn child_command(module: &str, env_var: &str, role: &str, args: &[&str]) -> Command {
    let exe = std::env::current_exe().expect("test binary path");
    let mut command = Command::new(exe);
    command
        .args([
            test_name(module, "child_process_entry").as_str(),
            "--exact",
            "--ignored",
            "--nocapture",
            "--quiet",
        ])
        .env(env_var, format!("{role}\u{1f}{}", args.join("\u{1f}")));
    command
}

/// The name the test harness gives the test `function` of `module` (a
/// `module_path!()`): its path below the crate root, which is the test
/// binary itself, so `redis::lock` and `lock_works` give
/// `lock::lock_works`, and a binary's root module gives the bare name.
pub fn test_name(module: &str, function: &str) -> String {
    match module.split_once("::") {
        Some((_binary, path)) => format!("{path}::{function}"),
        None => function.to_owned(),
    }
}

/// The child side of the cross-process counter tests: `rounds` times, take
/// `key` (waiting), read the plain, unlocked counter file, pause, write it
/// back plus one, print `held <token> <value read>`, release. Any overlap
/// between two holders loses an increment.
/// `args` are the counter file's path and the number of rounds.
pub async fn counter_rounds<A: AsRef<str>>(
    backend: std::sync::Arc<dyn dlock::Backend>,
    key: &str,
    args: &[A],
) {
    let [counter, rounds] = args else {
        panic!("counter role: expected COUNTER_PATH ROUNDS");
    };
    let counter = std::path::Path::new(counter.as_ref());
    let rounds: usize = rounds.as_ref().parse().expect("rounds");
    for _ in 0..rounds {
        let lease = dlock::LockOptions::new(Duration::from_secs(10))
            .wait(Duration::from_secs(60))
            .acquire_on(backend.clone(), key)
            .await
            .expect("acquire");
        let value: u64 = std::fs::read_to_string(counter)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(1)).await;
        std::fs::write(counter, (value + 1).to_string()).expect("write counter");
        println!("held {} {}", lease.token(), value);
        lease.release().await.expect("release");
    }
}

/// The parent side: from the children's `held <token> <value>` lines
/// (prefix stripped), checks that all `expected` holds happened, that no
/// increment was lost, and that in the order the holders ran (the value
/// each one read) the tokens strictly increase.
pub fn check_counter_holds(
    lines: impl IntoIterator<Item = String>,
    counter: &std::path::Path,
    expected: usize,
) {
    let mut holds: Vec<(u64, u64)> = lines
        .into_iter()
        .map(|line| {
            let mut fields = line.split(' ').map(|f| f.parse::<u64>().expect("number"));
            (fields.next().expect("token"), fields.next().expect("value"))
        })
        .collect();
    let final_value: u64 = std::fs::read_to_string(counter)
        .expect("counter")
        .trim()
        .parse()
        .expect("number");
    assert_eq!(holds.len(), expected);
    assert_eq!(
        final_value, expected as u64,
        "an increment was lost: two processes held the lock at once"
    );
    holds.sort_by_key(|&(_, value)| value);
    for pair in holds.windows(2) {
        assert!(
            pair[1].0 > pair[0].0,
            "token {} ran after token {}",
            pair[1].0,
            pair[0].0
        );
    }
}

/// The lines of `child`'s stdout that start with `prefix`, prefix removed
/// (read until the child closes its stdout).
pub fn child_lines(child: &mut std::process::Child, prefix: &str) -> Vec<String> {
    use std::io::BufRead as _;
    let stdout = child.stdout.take().expect("piped stdout");
    std::io::BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| line.strip_prefix(prefix).map(str::to_owned))
        .collect()
}

/// Writes a test CA (`ca.crt`, `ca.key`) and a server certificate it
/// signed for 127.0.0.1 and localhost (`server.crt`, `server.key`) into
/// `dir`, with the `openssl` command (which `scripts/test` installs).
pub fn make_test_certificates(dir: &std::path::Path) {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl must be installed");
        assert!(
            out.status.success(),
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    #[rustfmt::skip]
    openssl(&["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=dlock-test-ca", "-keyout", "ca.key", "-out", "ca.crt"]);
    #[rustfmt::skip]
    openssl(&["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
        "-keyout", "server.key", "-out", "server.csr"]);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    .expect("write ext.cnf");
    #[rustfmt::skip]
    openssl(&["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "ext.cnf", "-out", "server.crt"]);
}

/// What tracing events of this thread say while the guard lives: for tests
/// that check a warning is given.
/// Installs, once per test binary, a global subscriber that takes every
/// event and writes nothing. tracing caches whether a call site is enabled
/// the first time it is hit, and while at most one subscriber is
/// registered it asks only the subscriber of the thread that hit it: a
/// site first hit by a test on a thread without one was then off for
/// every thread, and a test capturing this thread's events never saw it
/// when tests ran in parallel. With the global one, every site stays on;
/// a scoped subscriber still sees only its own thread.
pub fn every_call_site_on() {
    static GLOBAL: std::sync::Once = std::sync::Once::new();
    GLOBAL.call_once(|| {
        use tracing_subscriber::layer::SubscriberExt as _;
        let everything =
            tracing_subscriber::registry().with(tracing_subscriber::filter::LevelFilter::TRACE);
        let _ = tracing::subscriber::set_global_default(everything);
    });
}

#[derive(Clone, Default)]
pub struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Logs {
    /// Captures this thread's events (a `current_thread` runtime keeps
    /// every task on it) until the guard is dropped.
    pub fn capture() -> (Self, impl Drop) {
        every_call_site_on();
        let logs = Self::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        (
            logs,
            tracing_subscriber::util::SubscriberInitExt::set_default(subscriber),
        )
    }

    /// Everything captured so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(
            &self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
        .into_owned()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits (up to 10 s, saying `what` if not) until `lease` knows it is
/// lost, and returns what it says.
pub async fn until_lost(lease: &dlock::Lease, what: &str) -> dlock::LockError {
    within(10, what, async {
        loop {
            if let Err(err) = lease.check() {
                break err;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

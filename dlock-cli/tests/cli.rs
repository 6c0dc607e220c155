//! The `dlock` binary against the real stores (Redis, PostgreSQL, a
//! directory), looking at locks that ANOTHER process holds: each test
//! starts a holder process (this test binary again, running only
//! `holder_process`), tells it which keys to take and let go on its stdin,
//! and reads on its stdout what it took and when it was told of a lost
//! lease. Keys are under a random prefix a test.
//!
//! Servers: `DLOCK_REDIS_URL` (default `redis://127.0.0.1:6379`) and
//! `DLOCK_PG_URL` (default `host=127.0.0.1 port=5432 user=postgres
//! dbname=test`). Deadlines only guard against hangs.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// How long anything may take before the test calls it a hang.
const DEADLINE: Duration = Duration::from_secs(30);
/// The label the holder process gives its locks.
const LABEL: &str = "cli-test";
/// Set (to a store, `KIND URL`) in the holder process's environment.
const HOLDER_ENV: &str = "DLOCK_CLI_TEST_HOLDER";

/// A store the tests run on: the `--backend` URL, and how the holder
/// process connects to it.
struct Store {
    kind: &'static str,
    url: String,
    /// A file store's directory, removed at the end.
    dir: Option<PathBuf>,
}

impl Store {
    #[cfg(feature = "redis")]
    fn redis() -> Self {
        Self {
            kind: "redis",
            url: std::env::var("DLOCK_REDIS_URL")
                .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned()),
            dir: None,
        }
    }

    #[cfg(feature = "pg")]
    fn pg() -> Self {
        Self {
            kind: "pg",
            url: std::env::var("DLOCK_PG_URL").unwrap_or_else(|_| {
                "host=127.0.0.1 port=5432 user=postgres dbname=test".to_owned()
            }),
            dir: None,
        }
    }

    fn file() -> Self {
        let dir = std::env::temp_dir().join(format!("dlock-cli-{}", unique()));
        std::fs::create_dir_all(&dir).expect("create the lock directory");
        Self {
            kind: "file",
            url: format!("file://{}", dir.display()),
            dir: Some(dir),
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A fresh name part: this process, the time, a counter.
fn unique() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{}-{nanos:x}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// A random key prefix for one test.
fn prefix() -> String {
    format!("cli-test:{}:", unique())
}

/// Runs `dlock --backend URL ARGS…` with no terminal on stdin, and waits for
/// it (killed, and the test failed, after [`DEADLINE`]).
fn dlock(store: &Store, args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dlock"))
        .arg("--backend")
        .arg(&store.url)
        .args(args)
        .env_remove("DLOCK_BACKEND")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run dlock");
    let started = Instant::now();
    loop {
        if child.try_wait().expect("wait for dlock").is_some() {
            return child.wait_with_output().expect("read dlock's output");
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let output = child.wait_with_output().expect("read dlock's output");
            panic!("dlock {args:?} did not end: {}", describe(&output));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn describe(output: &Output) -> String {
    format!(
        "status {:?}, stdout {:?}, stderr {:?}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn json(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("not one JSON document ({e}): {}", describe(output)))
}

/// Reads the lines a child writes on `stream`, on a thread of its own.
fn lines_of(stream: impl Read + Send + 'static) -> Receiver<String> {
    let (sender, lines) = channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    lines
}

/// The next line of `lines` that starts with `start`, within [`DEADLINE`];
/// the lines before it are dropped.
fn next_line(lines: &Receiver<String>, start: &str, what: &str) -> String {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) if line.starts_with(start) => return line,
            Ok(_) => {}
            Err(RecvTimeoutError::Timeout) => panic!("no {what} within {DEADLINE:?}"),
            Err(RecvTimeoutError::Disconnected) => panic!("the output ended before {what}"),
        }
    }
}

/// The holder process: takes and lets go of keys when told.
struct Holder {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    pid: u32,
    tokens: HashMap<String, u64>,
}

impl Holder {
    fn start(store: &Store) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("this test binary"))
            .args(["holder_process", "--exact", "--ignored", "--nocapture"])
            .env(HOLDER_ENV, format!("{} {}", store.kind, store.url))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the holder process");
        let stdin = child.stdin.take().expect("its stdin");
        let lines = lines_of(child.stdout.take().expect("its stdout"));
        let ready = next_line(&lines, "ready ", "holder ready");
        let pid = ready["ready ".len()..].parse().expect("the holder's pid");
        assert_eq!(pid, child.id());
        Self {
            child,
            stdin,
            lines,
            pid,
            tokens: HashMap::new(),
        }
    }

    fn tell(&mut self, order: &str) {
        writeln!(self.stdin, "{order}").expect("tell the holder");
    }

    /// Takes `key` with a 10 s ttl (renewed); its token.
    fn take(&mut self, key: &str) -> u64 {
        self.tell(&format!("take {key}"));
        let line = next_line(&self.lines, &format!("taken {key} "), "the key taken");
        let token = line.rsplit(' ').next().and_then(|t| t.parse().ok());
        let token = token.expect("a token");
        self.tokens.insert(key.to_owned(), token);
        token
    }

    /// Takes one of two permits of `key` (10 s ttl, renewed); its token.
    /// The lease is known as `KEY#TOKEN` to `release` and `expect_lost`.
    fn permit(&mut self, key: &str) -> u64 {
        self.tell(&format!("permit {key}"));
        let line = next_line(&self.lines, &format!("taken {key} "), "the permit taken");
        line.rsplit(' ')
            .next()
            .and_then(|t| t.parse().ok())
            .expect("a token")
    }

    fn release(&mut self, key: &str) {
        self.tell(&format!("release {key}"));
        next_line(&self.lines, &format!("released {key}"), "the release");
    }

    /// Waits for the holder to report its lease on `key` lost.
    fn expect_lost(&self, key: &str) -> String {
        next_line(&self.lines, &format!("lost {key} "), "the lost signal")
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Not a test: the holder process of the tests above, this binary run again
/// with `HOLDER_ENV` set (without it, it returns at once). Orders on stdin:
/// `take KEY`, `release KEY`; it answers `taken KEY TOKEN`, `released KEY`,
/// and `lost KEY: WHY` when a lease is lost.
#[test]
#[ignore = "the lock holder the other tests start as a child process"]
fn holder_process() {
    let Ok(store) = std::env::var(HOLDER_ENV) else {
        return;
    };
    let (kind, url) = store.split_once(' ').expect("KIND URL");
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    runtime.block_on(hold(kind.to_owned(), url.to_owned()));
}

async fn hold(kind: String, url: String) {
    use dlock::{LockOptions, registry};
    use tokio::io::AsyncBufReadExt;

    match kind.as_str() {
        #[cfg(feature = "redis")]
        "redis" => registry().register(
            "default",
            dlock::redis::RedisBackend::connect(&url)
                .await
                .expect("connect to Redis"),
        ),
        #[cfg(feature = "pg")]
        "pg" => registry().register(
            "default",
            dlock::pg::PgBackend::connect(&url)
                .await
                .expect("connect to PostgreSQL"),
        ),
        "file" => registry().register(
            "default",
            dlock::file::FileBackend::open(url.trim_start_matches("file://"))
                .expect("open the lock directory"),
        ),
        other => panic!("unknown store {other}"),
    };
    registry().set_label(Some(LABEL)).expect("a valid label");
    println!("ready {}", std::process::id());
    let mut held = HashMap::new();
    let mut orders = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(order)) = orders.next_line().await {
        match order.split_once(' ') {
            Some(("take", key)) => {
                let lease = LockOptions::new(Duration::from_secs(10))
                    .acquire(key)
                    .await
                    .expect("take the key");
                println!("taken {key} {}", lease.token().get());
                let signal = lease.lost_signal();
                let key_shown = key.to_owned();
                let told = tokio::spawn(async move {
                    let why = signal.lost().await;
                    println!("lost {key_shown} : {why}");
                });
                held.insert(key.to_owned(), (lease, told));
            }
            Some(("permit", key)) => {
                // One of two permits, kept under `KEY#TOKEN`.
                let lease = LockOptions::new(Duration::from_secs(10))
                    .permits(2)
                    .acquire(key)
                    .await
                    .expect("take a permit");
                let token = lease.token().get();
                println!("taken {key} {token}");
                let signal = lease.lost_signal();
                let key_shown = format!("{key}#{token}");
                let told = tokio::spawn(async move {
                    let why = signal.lost().await;
                    println!("lost {key_shown} : {why}");
                });
                held.insert(format!("{key}#{token}"), (lease, told));
            }
            Some(("release", key)) => {
                let (lease, told) = held.remove(key).expect("a key it holds");
                told.abort();
                lease.release().await.expect("release the key");
                println!("released {key}");
            }
            _ => panic!("unknown order {order:?}"),
        }
    }
}

/// The tests, once a store.
macro_rules! on_every_store {
    ($($test:ident),* $(,)?) => {
        #[cfg(feature = "redis")]
        mod redis {
            $( #[test] fn $test() { super::$test(&super::Store::redis()) } )*
        }
        #[cfg(feature = "pg")]
        mod pg {
            $( #[test] fn $test() { super::$test(&super::Store::pg()) } )*
        }
        mod file {
            $( #[test] fn $test() { super::$test(&super::Store::file()) } )*
        }
    };
}

on_every_store!(
    list_shows_the_keys_another_process_holds_with_its_pid,
    show_names_the_holder_and_a_free_key_exits_with_3,
    release_refuses_without_force_or_a_terminal_and_keeps_the_lock,
    release_force_yes_frees_the_key_and_its_holder_sees_its_lease_lost,
    release_naming_a_holder_that_changed_releases_nothing_and_exits_1,
    release_of_a_permit_key_breaks_no_other_permit_and_says_so,
    release_naming_another_token_than_the_one_shown_still_asks_first,
    watch_prints_an_acquisition_and_a_release,
);

fn list_shows_the_keys_another_process_holds_with_its_pid(store: &Store) {
    let p = prefix();
    let listed = format!("{p}in:");
    let (a, b) = (format!("{listed}a"), format!("{listed}b"));
    let (outside, gone) = (format!("{p}out"), format!("{listed}gone"));
    let mut holder = Holder::start(store);
    holder.take(&a);
    holder.take(&b);
    holder.take(&outside);
    holder.take(&gone);
    holder.release(&gone);

    let output = dlock(store, &["list", &listed]);
    assert_eq!(output.status.code(), Some(0), "{}", describe(&output));
    let text = stdout(&output);
    let rows: Vec<&str> = text.lines().collect();
    assert_eq!(rows.len(), 3, "a header and two rows: {text}");
    assert!(
        rows[0].starts_with("KEY") && rows[0].contains("PID"),
        "{text}"
    );
    for (row, key) in rows[1..].iter().zip([&a, &b]) {
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cells[0], key, "{text}");
        assert!(cells.contains(&holder.pid.to_string().as_str()), "{text}");
        assert!(cells.contains(&LABEL), "{text}");
    }

    let output = dlock(store, &["list", &listed, "--json"]);
    assert_eq!(output.status.code(), Some(0), "{}", describe(&output));
    let doc = json(&output);
    assert_eq!(doc["prefix"], listed.as_str());
    let locks = doc["locks"].as_array().expect("a list of locks");
    let keys: Vec<&str> = locks.iter().filter_map(|l| l["key"].as_str()).collect();
    assert_eq!(keys, [a.as_str(), b.as_str()]);
    for lock in locks {
        assert_eq!(lock["pid"], holder.pid, "{lock}");
        assert_eq!(lock["label"], LABEL, "{lock}");
        assert!(
            lock["host"].as_str().is_some_and(|h| !h.is_empty()),
            "{lock}"
        );
        let key = lock["key"].as_str().unwrap_or_default();
        if let Some(token) = lock["token"].as_u64() {
            assert_eq!(Some(&token), holder.tokens.get(key), "{lock}");
        }
    }

    // An empty prefix lists every held key: these among them.
    let doc = json(&dlock(store, &["list", "--json"]));
    let all = doc["locks"].as_array().expect("a list of locks");
    for key in [&a, &b, &outside] {
        assert!(all.iter().any(|l| l["key"] == key.as_str()), "{key}");
    }
    assert!(!all.iter().any(|l| l["key"] == gone.as_str()));
}

fn show_names_the_holder_and_a_free_key_exits_with_3(store: &Store) {
    let p = prefix();
    let (held, free) = (format!("{p}held"), format!("{p}free"));
    let mut holder = Holder::start(store);
    holder.take(&held);

    let output = dlock(store, &["show", &held]);
    assert_eq!(output.status.code(), Some(0), "{}", describe(&output));
    let text = stdout(&output);
    assert!(
        text.contains(&format!("(pid {}, label \"{LABEL}\")", holder.pid)),
        "{text}"
    );
    assert!(text.contains(&held), "{text}");

    let doc = json(&dlock(store, &["show", &held, "--json"]));
    assert_eq!(doc["held"], true);
    assert_eq!(doc["key"], held.as_str());
    assert_eq!(doc["pid"], holder.pid);
    // A PostgreSQL lock's ttl is kept by its holder's process, out of sight.
    match doc["ttl_left_ms"].as_u64() {
        Some(ms) => assert!(ms <= 10_000, "{doc}"),
        None => assert_eq!(store.kind, "pg", "{doc}"),
    }

    let output = dlock(store, &["show", &free]);
    assert_eq!(output.status.code(), Some(3), "{}", describe(&output));
    assert!(stdout(&output).contains("is free"), "{}", describe(&output));
    let output = dlock(store, &["show", &free, "--json"]);
    assert_eq!(output.status.code(), Some(3), "{}", describe(&output));
    assert_eq!(
        json(&output),
        serde_json::json!({"key": free, "held": false})
    );
}

fn release_refuses_without_force_or_a_terminal_and_keeps_the_lock(store: &Store) {
    let key = format!("{}k", prefix());
    let mut holder = Holder::start(store);
    holder.take(&key);

    let output = dlock(store, &["release", &key]);
    assert_eq!(output.status.code(), Some(2), "{}", describe(&output));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("--force"),
        "{}",
        describe(&output)
    );
    // stdin is not a terminal and there is no --yes: no one to ask.
    let output = dlock(store, &["release", &key, "--force"]);
    assert_eq!(output.status.code(), Some(1), "{}", describe(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("not a terminal") && stderr.contains("--yes"),
        "{stderr}"
    );

    let output = dlock(store, &["show", &key, "--json"]);
    assert_eq!(output.status.code(), Some(0), "{}", describe(&output));
    assert_eq!(json(&output)["pid"], holder.pid);
}

fn release_force_yes_frees_the_key_and_its_holder_sees_its_lease_lost(store: &Store) {
    let key = format!("{}k", prefix());
    let mut holder = Holder::start(store);
    let token = holder.take(&key);

    let output = dlock(store, &["release", &key, "--force", "--yes", "--json"]);
    assert_eq!(output.status.code(), Some(0), "{}", describe(&output));
    let doc = json(&output);
    assert_eq!(doc["released"], true);
    assert_eq!(doc["pid"], holder.pid);
    let lost = holder.expect_lost(&key);
    assert!(lost.contains(&format!("fencing token {token}")), "{lost}");

    let output = dlock(store, &["show", &key]);
    assert_eq!(output.status.code(), Some(3), "{}", describe(&output));
    // Nothing left to release.
    let output = dlock(store, &["release", &key, "--force", "--yes"]);
    assert_eq!(output.status.code(), Some(3), "{}", describe(&output));
    assert!(
        stdout(&output).contains("is not held"),
        "{}",
        describe(&output)
    );
}

/// The lease `release` names is the one it breaks: a holder that let go
/// and took the key again since (a new lease, a new token) is not broken
/// by a release naming the first, which says so and exits with 1.
fn release_naming_a_holder_that_changed_releases_nothing_and_exits_1(store: &Store) {
    let key = format!("{}k", prefix());
    let mut holder = Holder::start(store);
    let first = holder.take(&key);
    holder.release(&key);
    let second = holder.take(&key);
    assert_ne!(first, second);

    let named = first.to_string();
    let output = dlock(
        store,
        &["release", &key, "--force", "--yes", "--token", &named],
    );
    assert_eq!(output.status.code(), Some(1), "{}", describe(&output));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!(
            "the holder of `{key}` changed: nothing was released"
        )),
        "{}",
        describe(&output)
    );
    let output = dlock(
        store,
        &[
            "release", &key, "--force", "--yes", "--token", &named, "--json",
        ],
    );
    assert_eq!(output.status.code(), Some(1), "{}", describe(&output));
    assert_eq!(json(&output)["exit_status"], 1);

    // The second lease still holds the key.
    let output = dlock(store, &["show", &key, "--json"]);
    assert_eq!(output.status.code(), Some(0), "{}", describe(&output));
    let doc = json(&output);
    assert_eq!(doc["pid"], holder.pid, "{doc}");
    if let Some(token) = doc["token"].as_u64() {
        assert_eq!(token, second, "{doc}");
    }

    // Named, it is broken.
    let named = second.to_string();
    let output = dlock(
        store,
        &["release", &key, "--force", "--yes", "--token", &named],
    );
    assert_eq!(output.status.code(), Some(0), "{}", describe(&output));
    let lost = holder.expect_lost(&key);
    assert!(lost.contains(&format!("fencing token {second}")), "{lost}");
}

/// On a key held as two permits, `release --force` naming one of them
/// never breaks the other: the backend breaks that permit alone, and the
/// message says the key is still held, or refuses and breaks nothing.
fn release_of_a_permit_key_breaks_no_other_permit_and_says_so(store: &Store) {
    let key = format!("{}p", prefix());
    let mut holder = Holder::start(store);
    let first = holder.permit(&key);
    let second = holder.permit(&key);
    assert_ne!(first, second);

    let named = second.to_string();
    let output = dlock(
        store,
        &["release", &key, "--force", "--yes", "--token", &named],
    );
    let text = describe(&output);
    match output.status.code() {
        Some(0) => {
            assert!(
                stdout(&output).contains("is still held"),
                "the key's other permit holds it: {text}"
            );
            let lost = holder.expect_lost(&format!("{key}#{second}"));
            assert!(lost.contains(&format!("fencing token {second}")), "{lost}");
        }
        // Refused (a backend that cannot tell its permits apart, or none
        // shown with a token): it says nothing was released.
        Some(1) => assert!(text.contains("nothing was released"), "{text}"),
        // PostgreSQL's holder read does not see another process's permits
        // yet: `release` finds the key free and breaks nothing.
        Some(3) if store.kind == "pg" => {}
        other => panic!("unexpected exit status {other:?}: {text}"),
    }
    // The other permit was not broken: its holder lets go of it itself.
    holder.release(&format!("{key}#{first}"));
}

/// `release --force --token` naming a lease other than the one the
/// holder read shows (another permit of the key) still asks first: with no
/// terminal and no `--yes` it breaks nothing, whichever permit it names.
fn release_naming_another_token_than_the_one_shown_still_asks_first(store: &Store) {
    let key = format!("{}q", prefix());
    let mut holder = Holder::start(store);
    let first = holder.permit(&key);
    let second = holder.permit(&key);
    for named in [first, second] {
        let named = named.to_string();
        let output = dlock(store, &["release", &key, "--force", "--token", &named]);
        let text = describe(&output);
        match output.status.code() {
            Some(1) => assert!(
                text.contains("not a terminal") && text.contains("--yes"),
                "naming token {named} without a terminal must be refused for lack of an \
                 answer: {text}"
            ),
            // PostgreSQL's holder read does not see another process's
            // permits: the key reads free, and nothing is asked or broken.
            Some(3) if store.kind == "pg" => {}
            other => panic!("unexpected exit status {other:?} naming token {named}: {text}"),
        }
    }
    // Neither permit was broken: their holder lets go of both itself.
    holder.release(&format!("{key}#{first}"));
    holder.release(&format!("{key}#{second}"));
}

fn watch_prints_an_acquisition_and_a_release(store: &Store) {
    let key = format!("{}w", prefix());
    let mut holder = Holder::start(store);
    let mut watch = Killed(
        Command::new(env!("CARGO_BIN_EXE_dlock"))
            .args(["--backend", &store.url, "watch", &key, "--json"])
            .env_remove("DLOCK_BACKEND")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("run dlock watch"),
    );
    let lines = lines_of(watch.0.stdout.take().expect("its stdout"));
    let event = |line: &str| -> Value {
        serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?} is not JSON: {e}"))
    };

    let first = event(&next_line(&lines, "{", "the first watch line"));
    assert_eq!(first["event"], "free", "{first}");
    assert_eq!(first["key"], key.as_str(), "{first}");

    let token = holder.take(&key);
    let acquired = event(&next_line(&lines, "{", "the acquisition"));
    assert_eq!(acquired["event"], "acquired", "{acquired}");
    assert_eq!(acquired["pid"], holder.pid, "{acquired}");
    if let Some(seen) = acquired["token"].as_u64() {
        assert_eq!(seen, token, "{acquired}");
    }

    holder.release(&key);
    let released = event(&next_line(&lines, "{", "the release"));
    assert_eq!(released["event"], "released", "{released}");
    assert_eq!(released["pid"], holder.pid, "{released}");
}

/// A child process killed when the test ends, whether it passed or not.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
#[cfg(all(feature = "redis", feature = "pg"))]
fn an_unreachable_store_is_a_clear_error_that_shows_no_password() {
    for url in [
        "redis://app:s3cret-pw@127.0.0.1:1",
        "postgresql://app:s3cret-pw@127.0.0.1:1/test",
    ] {
        let store = Store {
            kind: "none",
            url: url.to_owned(),
            dir: None,
        };
        for args in [&["list"][..], &["show", "k"], &["watch", "k"]] {
            let output = dlock(&store, args);
            assert_eq!(output.status.code(), Some(1), "{}", describe(&output));
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(
                stderr.starts_with("dlock: ") && stderr.contains("connect"),
                "{stderr}"
            );
            assert!(
                !stderr.contains("s3cret-pw") && !stderr.contains("panicked"),
                "{stderr}"
            );
            assert!(output.stdout.is_empty(), "{}", describe(&output));
        }
    }
}

/// A password written without percent-encoding, holding a character a URL
/// parser may end the user info, the host or the port at, in every URL form
/// the command takes: nothing listens, and no part of the password (the
/// text between those characters) is printed.
#[test]
#[cfg(all(feature = "redis", feature = "pg"))]
fn no_part_of_an_unencoded_password_is_printed_in_any_url_form() {
    let passwords: [(&str, &[&str]); 6] = [
        ("4817/Summer-Kx!", &["4817", "Summer-Kx"]),
        ("Sl1/Sl2", &["Sl1", "Sl2"]),
        ("Qm3?Qm4=Qm5", &["Qm3", "Qm4", "Qm5"]),
        ("Hs6#Hs7", &["Hs6", "Hs7"]),
        ("At8@At9", &["At8", "At9"]),
        ("Cn0:Cn1", &["Cn0", "Cn1"]),
    ];
    let forms = [
        "redis://app:{pw}@127.0.0.1:1",
        "redis://app:{pw}@127.0.0.1:1/1",
        "rediss://app:{pw}@127.0.0.1:1",
        "redis+sentinel://app:{pw}@127.0.0.1:1",
        "redis+sentinel://app:{pw}@127.0.0.1:1/1",
        "redis+sentinel://app:{pw}@127.0.0.1:1/mymaster",
        "rediss+sentinel://:{pw}@127.0.0.1:1/mymaster/1",
        "postgresql://app:{pw}@127.0.0.1:1/test",
    ];
    // All at once: a reachable-looking URL is retried for the command's
    // whole connect timeout.
    let runs: Vec<_> = forms
        .iter()
        .flat_map(|form| passwords.iter().map(move |run| (*form, *run)))
        .map(|(form, (password, parts))| {
            let store = Store {
                kind: "none",
                url: form.replace("{pw}", password),
                dir: None,
            };
            let run = std::thread::spawn(move || dlock(&store, &["show", "k"]));
            (form, password, parts, run)
        })
        .collect();
    for (form, password, parts, run) in runs {
        let output = run.join().expect("the dlock run");
        assert_eq!(output.status.code(), Some(1), "{}", describe(&output));
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        for part in parts {
            assert!(
                !printed.contains(part),
                "{form} with {password:?}: `{part}` was printed: {printed}"
            );
        }
        assert!(!printed.contains("panicked"), "{printed}");
    }
}

/// A password in a Redis URL's query, written with an unencoded `#` or
/// `&` or a percent-encoded parameter name, or a password a URL parser
/// would read as a port for the spaces before the scheme: nothing listens,
/// and no part of the password is printed.
#[test]
#[cfg(feature = "redis")]
fn no_part_of_a_redis_query_password_is_printed() {
    let cases: [(&str, &[&str]); 6] = [
        (
            "unix:///nonexistent/r.sock?pass=Ux1#Ux2&user=app",
            &["Ux1", "Ux2"],
        ),
        ("redis://127.0.0.1:1/0?password=Qx1#Qx2", &["Qx1", "Qx2"]),
        ("redis://127.0.0.1:1/0?password=Qy1&Qy2", &["Qy1", "Qy2"]),
        ("redis://127.0.0.1:1/0?pass%77ord=Qo1#Qo2", &["Qo1", "Qo2"]),
        ("redis://[::1]:1/0?password=Qi1#Qi2", &["Qi1", "Qi2"]),
        ("\u{1}redis://app:4817?Lc2@127.0.0.1:1", &["4817", "Lc2"]),
    ];
    // All at once: a reachable-looking URL is retried for the command's
    // whole connect timeout.
    let runs: Vec<_> = cases
        .into_iter()
        .map(|(url, parts)| {
            let store = Store {
                kind: "none",
                url: url.to_owned(),
                dir: None,
            };
            let run = std::thread::spawn(move || dlock(&store, &["show", "k"]));
            (url, parts, run)
        })
        .collect();
    for (url, parts, run) in runs {
        let output = run.join().expect("the dlock run");
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert_ne!(output.status.code(), Some(0), "{url:?}: {printed}");
        for part in parts {
            assert!(
                !printed.contains(part),
                "{url:?}: `{part}` was printed: {printed}"
            );
        }
        assert!(!printed.contains("panicked"), "{printed}");
    }
}

#[test]
fn a_backend_url_dlock_does_not_know_is_a_usage_error_that_does_not_echo_it() {
    for url in [
        "http://app:s3cret-pw@host",
        "s3cret-pw",
        "file://s3cret-pw/dir",
    ] {
        let store = Store {
            kind: "none",
            url: url.to_owned(),
            dir: None,
        };
        let output = dlock(&store, &["list"]);
        assert_eq!(output.status.code(), Some(2), "{}", describe(&output));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("--backend") && !stderr.contains("s3cret-pw"),
            "{stderr}"
        );
    }
}

#[test]
fn a_file_store_that_does_not_exist_is_not_created() {
    let dir = std::env::temp_dir().join(format!("dlock-cli-missing-{}", unique()));
    let store = Store {
        kind: "file",
        url: format!("file://{}", dir.display()),
        dir: None,
    };
    let output = dlock(&store, &["list"]);
    assert_eq!(output.status.code(), Some(1), "{}", describe(&output));
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("is not a directory"),
        "{}",
        describe(&output)
    );
    assert!(!dir.exists());
}

#[test]
fn json_failures_print_an_error_document_on_stdout_too() {
    let store = Store {
        kind: "none",
        url: "redis://app:s3cret-pw@127.0.0.1:1".to_owned(),
        dir: None,
    };
    let output = dlock(&store, &["show", "k", "--json"]);
    assert_eq!(output.status.code(), Some(1), "{}", describe(&output));
    let doc = json(&output);
    assert_eq!(doc["exit_status"], 1, "{doc}");
    let error = doc["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("connect") && !error.contains("s3cret-pw"),
        "{doc}"
    );
}

#[test]
fn a_key_no_lock_can_have_is_a_usage_error() {
    let dir = std::env::temp_dir().join(format!("dlock-cli-badkey-{}", unique()));
    std::fs::create_dir_all(&dir).expect("a lock directory");
    let store = Store {
        kind: "file",
        url: format!("file://{}", dir.display()),
        dir: None,
    };
    for args in [
        &["show", ""][..],
        &["watch", ""],
        &["release", "", "--force"],
    ] {
        let output = dlock(&store, args);
        assert_eq!(output.status.code(), Some(2), "{}", describe(&output));
    }
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn watch_refuses_an_interval_that_would_busy_loop() {
    let store = Store {
        kind: "none",
        url: "file:///nonexistent-dlock-dir".to_owned(),
        dir: None,
    };
    for every in ["0s", "1ms", "99ms"] {
        let output = dlock(&store, &["watch", "k", "--every", every]);
        assert_eq!(output.status.code(), Some(2), "{}", describe(&output));
        assert!(
            String::from_utf8_lossy(&output.stderr).contains("too short"),
            "{}",
            describe(&output)
        );
    }
}

//! The conformance suite on `RedisBackend` against the Redis at
//! `DLOCK_REDIS_URL` (default `redis://127.0.0.1:6379`), plus what the
//! Redis backend promises across OS processes, against interference from
//! outside, and for bad input.

use crate::redis_support;

use crate::support;
use redis_support::{
    lock_name, shared_backend as backend, shared_cli as cli, shared_url as redis_url,
};

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Child;
use std::sync::{Arc, mpsc};
use std::time::Duration;
use support::within;

use dlock::backend::OwnerId;
use dlock::redis::RedisBackend;
use dlock::{Backend, LockError, LockKey, LockOptions, LostReason};

dlock_runtime::conformance_suite!(backend);

// ---------------------------------------------------------------------------
// Across OS processes: this test binary re-run as children.

/// The environment variable that turns this test binary into a child
/// process playing one role (see `child_process_entry`).
const CHILD_ROLE: &str = "DLOCK_REDIS_TEST_CHILD";

fn spawn_child(role: &str, args: &[&str]) -> Child {
    support::spawn_child(module_path!(), CHILD_ROLE, role, args)
}

/// Sends every line the children print that starts with `prefix` (prefix
/// cut) to one channel.
fn collect_lines(children: &mut [Child], prefix: &'static str) -> mpsc::Receiver<String> {
    let (sender, receiver) = mpsc::channel();
    for child in children {
        let stdout = child.stdout.take().expect("piped stdout");
        let sender = sender.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix(prefix) {
                    let _ = sender.send(rest.to_owned());
                }
            }
        });
    }
    receiver
}

/// The child side. Ignored in normal runs; the tests below start it as
/// `<test binary> <module>::child_process_entry --exact --ignored` with a role.
#[test]
#[ignore = "runs only as a child process of the cross-process tests"]
fn child_process_entry() {
    let Some((runtime, parts)) = support::child_role(CHILD_ROLE) else {
        return;
    };
    runtime.block_on(async move {
        let backend = backend().await;
        let key = parts[1].clone();
        match parts[0].as_str() {
            // `tasks` tasks try the key once, together; whoever wins holds
            // it until the parent has heard from every contender.
            "race" => {
                let tasks: usize = parts[2].parse().expect("tasks");
                let barrier = Arc::new(tokio::sync::Barrier::new(tasks));
                let attempts: Vec<_> = (0..tasks)
                    .map(|_| {
                        let (backend, key, barrier) =
                            (backend.clone(), key.clone(), barrier.clone());
                        tokio::spawn(async move {
                            barrier.wait().await;
                            LockOptions::new(Duration::from_secs(30))
                                .acquire_on(backend, key)
                                .await
                        })
                    })
                    .collect();
                let mut held = Vec::new();
                for attempt in attempts {
                    match attempt.await.expect("task") {
                        Ok(lease) => {
                            println!("result won {}", lease.token());
                            held.push(lease);
                        }
                        Err(LockError::Held { .. }) => println!("result held"),
                        Err(other) => println!("result error {other}"),
                    }
                }
                // Hold until the parent says every contender has tried.
                let mut line = String::new();
                let _ = std::io::stdin().read_line(&mut line);
                for lease in held {
                    lease.release().await.expect("release");
                }
            }
            // Increment a plain, unlocked counter file under the lock: any
            // overlap between holders loses an increment.
            "counter" => support::counter_rounds(backend.clone(), key.as_str(), &parts[2..]).await,
            other => panic!("unknown child role {other}"),
        }
    });
}

#[test]
fn twenty_acquirers_across_three_processes_exactly_one_wins() {
    let key = dlock_runtime::conformance::fresh_key("race-processes").to_string();
    let mut children: Vec<Child> = [7, 7, 6]
        .iter()
        .map(|tasks: &usize| spawn_child("race", &[&key, &tasks.to_string()]))
        .collect();
    let results = collect_lines(&mut children, "result ");
    let mut outcomes = Vec::new();
    for _ in 0..20 {
        let outcome = results
            .recv_timeout(Duration::from_secs(60))
            .expect("every contender reports (hang guard)");
        outcomes.push(outcome);
    }
    for child in &mut children {
        // Let the winner release, and every child exit.
        let mut stdin = child.stdin.take().expect("piped stdin");
        let _ = stdin.write_all(b"done\n");
    }
    for child in &mut children {
        assert!(child.wait().expect("child exits").success());
    }
    let winners = outcomes.iter().filter(|o| o.starts_with("won")).count();
    let losers = outcomes.iter().filter(|o| *o == "held").count();
    assert_eq!(
        (winners, losers),
        (1, 19),
        "exactly one of 20 acquirers in 3 processes must win: {outcomes:?}"
    );
}

#[test]
fn three_processes_never_hold_one_key_at_once_and_tokens_rise() {
    let key = dlock_runtime::conformance::fresh_key("counter-processes").to_string();
    let id = OwnerId::random().expect("random");
    let counter = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("dlock-redis-{id}.txt"));
    let counter_s = counter.to_str().expect("utf-8 path");
    const ROUNDS: usize = 30;
    let mut children: Vec<Child> = (0..3)
        .map(|_| spawn_child("counter", &[&key, counter_s, &ROUNDS.to_string()]))
        .collect();
    let lines = collect_lines(&mut children, "held ");
    for child in &mut children {
        drop(child.stdin.take());
        assert!(child.wait().expect("child exits").success());
    }
    support::check_counter_holds(lines.try_iter(), &counter, 3 * ROUNDS);
    let _ = std::fs::remove_file(&counter);
}

// ---------------------------------------------------------------------------
// Interference from outside, and bad input.

/// The Redis name of `key`'s lock (see the keyspace in the module docs).

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_key_is_deleted_externally_sees_its_lease_lost() {
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("deleted");
    let lease = LockOptions::new(Duration::from_secs(3))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    assert_eq!(cli(&["DEL", &lock_name(&key)]), "1");
    let lost = within(10, "the lost signal", lease.lost()).await;
    assert!(
        matches!(
            lost,
            LockError::LeaseLost {
                reason: LostReason::NotOwner,
                ..
            }
        ),
        "unexpected: {lost}"
    );
    assert!(matches!(
        lease.release().await,
        Err(LockError::LeaseLost { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_key_is_overwritten_externally_sees_its_lease_lost_and_leaves_it_alone() {
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("overwritten");
    let lease = LockOptions::new(Duration::from_secs(3))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let name = lock_name(&key);
    assert_eq!(cli(&["SET", &name, "someone-else", "PX", "60000"]), "OK");
    let lost = within(10, "the lost signal", lease.lost()).await;
    assert!(
        matches!(
            lost,
            LockError::LeaseLost {
                reason: LostReason::NotOwner,
                ..
            }
        ),
        "unexpected: {lost}"
    );
    assert!(lease.release().await.is_err());
    assert_eq!(
        cli(&["GET", &name]),
        "someone-else",
        "the release must not touch it"
    );
    // A value of another type is "not the owner" too, not a script error.
    let other = dlock_runtime::conformance::fresh_key("overwritten-hash");
    let lease = LockOptions::new(Duration::from_secs(3))
        .acquire_on(backend.clone(), &other)
        .await
        .expect("free");
    let name = lock_name(&other);
    cli(&["DEL", &name]);
    assert_eq!(cli(&["HSET", &name, "field", "value"]), "1");
    let lost = within(10, "the lost signal", lease.lost()).await;
    assert!(
        matches!(
            lost,
            LockError::LeaseLost {
                reason: LostReason::NotOwner,
                ..
            }
        ),
        "unexpected: {lost}"
    );
    cli(&["DEL", &name]);
}

/// Every command the server runs from now on, one line each, as
/// `redis-cli MONITOR` prints them; the child ends when dropped by `kill`.
fn monitor() -> (Child, mpsc::Receiver<String>) {
    let mut child = std::process::Command::new("redis-cli")
        .args(["-u", &redis_url(), "MONITOR"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("redis-cli must be installed");
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    // `OK` once the monitor is on: nothing after it is missed.
    let first = lines.next().and_then(Result::ok);
    assert_eq!(first.as_deref(), Some("OK"), "MONITOR did not start");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_with_a_fraction_of_a_millisecond_reaches_redis_rounded_up_never_down() {
    // The holder counts its lease from its own ttl; a store that got the
    // ttl rounded down would free the key before the holder's lease ends.
    let (mut watch, lines) = monitor();
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("sub-ms-ttl");
    let lease = LockOptions::new(Duration::from_micros(2_000_500))
        .acquire_on(backend, &key)
        .await
        .expect("free");
    let name = format!("\"{}\"", lock_name(&key));
    // (number of keys, ttl argument) of the acquire script, then of the
    // first renewal's extend script: both take the ttl in ms as ARGV[2].
    let mut sent = Vec::new();
    while sent.len() < 2 {
        let line = lines
            .recv_timeout(Duration::from_secs(10))
            .expect("the acquisition and a renewal reach the server");
        if !line.contains(&name) || !line.contains("\"EVAL") {
            continue;
        }
        let args: Vec<&str> = line.split('"').skip(1).step_by(2).collect();
        let keys: usize = args[2].parse().expect("the number of keys");
        sent.push((args[2].to_owned(), args[3 + keys + 1].to_owned()));
    }
    lease.release().await.expect("release");
    let _ = watch.kill();
    let _ = watch.wait();
    assert_eq!(
        sent,
        [
            ("2".to_owned(), "2001".to_owned()),
            ("1".to_owned(), "2001".to_owned())
        ],
        "a ttl of 2000.5 ms must reach the server as 2001 ms (acquire, then extend)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_oversized_and_odd_keys_are_errors_or_data_never_code() {
    let backend = backend().await;
    let invalid =
        |r: &Result<dlock::Lease, LockError>| matches!(r, Err(LockError::InvalidKey { .. }));
    let options = LockOptions::new(Duration::from_secs(10));
    assert!(invalid(&options.acquire_on(backend.clone(), "").await));
    let huge = "k".repeat(1024 * 1024);
    assert!(invalid(&options.acquire_on(backend.clone(), huge).await));
    let id = OwnerId::random().expect("random");
    let odd = [
        "\" ' ` quotes",
        "new\nline\r\n",
        "redis.call('FLUSHALL') --",
        "KEYS[1] ARGV[1] ]]",
        "* ? [^a] \\",
        "ünïcödé 🔒",
    ];
    for text in odd {
        let key = format!("{text}:{id}");
        let lease = options
            .acquire_on(backend.clone(), key.as_str())
            .await
            .unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let name = format!("dlock:{{{key}}}:lock");
        assert_eq!(
            cli(&["EXISTS", &name]),
            "1",
            "{text:?} is stored under its own name"
        );
        lease.release().await.expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_url_is_an_error_within_the_connect_timeout_never_a_hang() {
    // Nothing listens on this port: the error says so, whether the connect
    // timeout leaves room for tries again or not.
    let closed = support::RefusedPort::new();
    let url = format!("redis://127.0.0.1:{}", closed.port);
    for connect_timeout in [Duration::from_millis(500), Duration::from_secs(1)] {
        let connecting = RedisBackend::builder(&url)
            .connect_timeout(connect_timeout)
            .connect();
        let err = within(15, "connecting to a closed port", connecting)
            .await
            .expect_err("nothing listens there");
        assert!(matches!(err, LockError::Backend { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("refused") && !text.contains("timed out"),
            "the error must say the connection was refused: {text}"
        );
    }

    // Something accepts connections there but never answers.
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!(
        "redis://127.0.0.1:{}",
        silent.local_addr().expect("addr").port()
    );
    let connecting = RedisBackend::builder(&url)
        .connect_timeout(Duration::from_secs(1))
        .connect();
    let err = within(15, "connecting to a silent server", connecting)
        .await
        .expect_err("a server that never answers");
    assert!(err.to_string().contains("timed out"), "{err}");
    drop(silent);
}

#[tokio::test]
async fn an_invalid_url_is_an_error_that_hides_its_password() {
    for url in [
        "redis://user:hunter2-secret@[::1",
        "http://user:hunter2-secret@127.0.0.1:6379",
        "hunter2-secret",
    ] {
        let err = RedisBackend::connect(url)
            .await
            .expect_err("not a Redis URL");
        let text = format!("{err} / {err:?}");
        assert!(
            !text.contains("hunter2-secret"),
            "the password leaked: {text}"
        );
    }
    let builder = RedisBackend::builder("redis://app:hunter2-secret@127.0.0.1:1");
    assert!(!format!("{builder:?}").contains("hunter2-secret"));
}

// ---------------------------------------------------------------------------
// Tokens past 2^53, and replies lost on the way back.

/// The Redis name of `key`'s fencing counter.
fn fence_name(key: &LockKey) -> String {
    format!("dlock:{{{key}}}:fence")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_stay_exact_and_strictly_rising_above_two_to_the_53() {
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("past-2-53");
    // Seeded past the largest integer a Lua number (a double) holds exactly,
    // as a migration from another lock store might.
    let seed: u64 = (1 << 53) + 1;
    assert_eq!(cli(&["SET", &fence_name(&key), &seed.to_string()]), "OK");
    let mut tokens = Vec::new();
    for _ in 0..6 {
        let lease = LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend.clone(), &key)
            .await
            .expect("free");
        tokens.push(lease.token().get());
        lease.release().await.expect("release");
    }
    let expected: Vec<u64> = (1..=6).map(|i| seed + i).collect();
    assert_eq!(
        tokens, expected,
        "every acquisition must get the next counter value, exactly"
    );
    assert_eq!(cli(&["GET", &fence_name(&key)]), (seed + 6).to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fencing_counter_that_cannot_rise_is_refused_and_leaves_the_key_free() {
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("counter-at-max");
    for stuck in [i64::MAX.to_string(), "not-a-number".to_owned()] {
        assert_eq!(cli(&["SET", &fence_name(&key), &stuck]), "OK");
        let refused = LockOptions::new(Duration::from_secs(60))
            .acquire_on(backend.clone(), &key)
            .await
            .expect_err("a counter that cannot rise must refuse the acquisition");
        let text = refused.to_string();
        assert!(
            matches!(refused, LockError::Backend { .. }),
            "unexpected: {text}"
        );
        // The script's own words, not a code redis-rs made of its first word.
        let said = format!(
            "failed to acquire `{key}`: the fencing counter {} cannot rise: ",
            fence_name(&key)
        );
        assert!(text.contains(&said), "{text:?} must say {said:?}");
        assert!(!text.contains("\"dlock:\""), "{text}");
        assert_eq!(
            cli(&["EXISTS", &lock_name(&key)]),
            "0",
            "the refused acquisition must not leave the key held"
        );
        assert_eq!(cli(&["GET", &fence_name(&key)]), stuck, "never wrapped");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_of_sixteen_characters_that_is_no_counter_is_refused_not_taken_as_below_the_clock()
{
    // The fast path compares a last token with the 16-digit clock as text:
    // a 16-character value that is not a plain decimal counter must not
    // pass for one below the clock (it would hide a corrupted counter and
    // could hand out a token below one issued before).
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("junk-16");
    for junk in [
        "0000000000000000",
        "-not-a-counter!!",
        "               7",
        "+000000000000123",
        "0000000000000042",
    ] {
        assert_eq!(junk.len(), 16);
        assert_eq!(cli(&["SET", &fence_name(&key), junk]), "OK");
        let refused = LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend.clone(), &key)
            .await
            .expect_err("a fence that is no counter must refuse the acquisition");
        assert!(
            refused.to_string().contains("cannot rise"),
            "{junk:?}: {refused}"
        );
        // (redis-cli's output comes trimmed.)
        assert_eq!(
            cli(&["GET", &fence_name(&key)]),
            junk.trim(),
            "left as it was"
        );
        assert_eq!(cli(&["STRLEN", &fence_name(&key)]), "16", "left as it was");
        assert_eq!(cli(&["EXISTS", &lock_name(&key)]), "0", "{junk:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attempt_never_writes_to_a_value_that_is_no_dlock_owner_id() {
    // The waiter mark is written only over the holder value dlock itself
    // stores (32 hex digits and `-`), never over a foreign string of the
    // same length.
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("foreign-33");
    let foreign = "session=user-42;expires=soonish!-";
    assert_eq!(foreign.len(), 33);
    assert_eq!(
        cli(&["SET", &lock_name(&key), foreign, "PX", "30000"]),
        "OK"
    );
    let refused = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect_err("held by the foreign value");
    assert!(matches!(refused, LockError::Held { .. }), "{refused}");
    assert_eq!(cli(&["GET", &lock_name(&key)]), foreign);
    cli(&["DEL", &lock_name(&key)]);
}

/// A backend connected to the local Redis through a proxy the test
/// controls.
async fn through_proxy() -> (support::proxy::Proxy, Arc<dyn Backend>) {
    let proxy = support::proxy::Proxy::bind("127.0.0.1:6379".to_owned()).await;
    let backend: Arc<dyn Backend> = Arc::new(
        RedisBackend::connect(&format!("redis://127.0.0.1:{}", proxy.port))
            .await
            .expect("connect through the proxy"),
    );
    (proxy, backend)
}

/// Waits until `key`'s lock is (or is no longer) on the server.
async fn until_lock_exists(key: &LockKey, exists: bool, what: &str) {
    let want = if exists { "1" } else { "0" };
    within(10, what, async {
        while cli(&["EXISTS", &lock_name(key)]) != want {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// Takes a key for `ttl` and releases it with the reply lost: the release
/// reaches the server, its reply does not come back, and `before_retry`
/// later the connection breaks, so the backend sends it again. Returns
/// what the release answered.
async fn released_with_its_reply_lost(
    label: &str,
    ttl: Duration,
    before_retry: Duration,
) -> Result<(), LockError> {
    let (proxy, backend) = through_proxy().await;
    let key = dlock_runtime::conformance::fresh_key(label);
    let lease = LockOptions::new(ttl)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    proxy.mute_replies();
    let releasing = tokio::spawn(lease.release());
    until_lock_exists(&key, false, "the release to reach the server").await;
    tokio::time::sleep(before_retry).await;
    proxy.cut();
    within(15, "the release", releasing).await.expect("task")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_reply_is_lost_is_not_reported_as_a_lost_lease() {
    let released =
        released_with_its_reply_lost("lost-reply", Duration::from_secs(30), Duration::ZERO).await;
    assert!(
        released.is_ok(),
        "the release succeeded on the server; its retry must not report a lost lease: {released:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_reply_is_lost_until_the_ttl_ran_out_is_not_reported_as_a_lost_lease() {
    // A short ttl: the retry after the lost reply lands after the lease's
    // validity. The release was sent while the key was still the holder's,
    // so the holder let go in time; reporting a loss would tell it that
    // someone else may have acted meanwhile, which nobody can have.
    let ttl = Duration::from_millis(800);
    // Well past the lease's validity before the retry is sent.
    let released = released_with_its_reply_lost("lost-reply-short-ttl", ttl, ttl * 2).await;
    assert!(
        released.is_ok(),
        "the release was sent and done while the lease was valid; a retry answered \
         after the ttl must not report a lost lease: {released:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_acquisition_after_the_counter_was_set_back_still_gets_a_higher_token() {
    // The acquisition reaches the server, its reply is lost, and before the
    // retry the fence counter goes back (a promotion that lost writes). The
    // retry, by the owner that now holds the key, must draw a token above
    // every earlier one, not read the set-back counter.
    let (proxy, backend) = through_proxy().await;
    let key = dlock_runtime::conformance::fresh_key("retry-after-set-back");
    let previous = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let previous_token = previous.token();
    previous.release().await.expect("release");
    proxy.mute_replies();
    let acquiring = tokio::spawn({
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            LockOptions::new(Duration::from_secs(30))
                .wait(Duration::from_secs(20))
                .acquire_on(backend, &key)
                .await
        }
    });
    until_lock_exists(&key, true, "the acquisition to reach the server").await;
    assert_eq!(
        cli(&["SET", &fence_name(&key), &previous_token.get().to_string()]),
        "OK"
    );
    proxy.cut();
    let lease = within(25, "the retried acquisition", acquiring)
        .await
        .expect("task")
        .expect("acquired by the retry");
    assert!(
        lease.token() > previous_token,
        "the retry got token {} after the previous holder's {previous_token}",
        lease.token()
    );
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "current_thread")]
async fn a_fencing_counter_far_ahead_of_the_clock_is_warned_about() {
    // A counter seeded past the clock (a migration) is beyond the clock
    // floor's protection: should it be lost, tokens would go back. That must
    // be loudly visible.
    let (logs, _guard) = support::Logs::capture();

    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("ahead-of-clock");
    assert_eq!(
        cli(&["SET", &fence_name(&key), &(1u64 << 60).to_string()]),
        "OK"
    );
    let lease = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    assert_eq!(lease.token().get(), (1 << 60) + 1);
    lease.release().await.expect("release");
    let text = logs.text();
    assert!(
        text.contains("WARN")
            && text.contains("far ahead of the clock")
            && text.contains(key.as_str()),
        "no warning about the counter ahead of the clock:\n{text}"
    );
}

// ---------------------------------------------------------------------------
// The holder record in each lock's value.

/// The absolute expiry of `name` in ms (`PEXPIRETIME`), as redis-cli
/// prints it: -2 for no such key, -1 for no expiry.
fn expires_at(name: &str) -> i64 {
    cli(&["PEXPIRETIME", name])
        .parse()
        .unwrap_or_else(|err| panic!("PEXPIRETIME {name}: {err}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_record_is_taken_renewed_and_released_in_the_lock_value_alone() {
    use dlock::backend::{AcquireRequest, Attempt, ReleaseOutcome, ReleaseRequest, Renewal};
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("record-in-lock");
    let (lock, info) = (lock_name(&key), format!("dlock:{{{key}}}:info"));
    let owner = OwnerId::random().expect("random");
    let request = AcquireRequest::new(&key, &owner, Duration::from_secs(60));
    let Ok(Attempt::Acquired(grant)) = backend.try_acquire(&request).await else {
        panic!("the key was free");
    };
    // `<owner id>- <token> <server µs> <record>` (read with redis-rs:
    // redis-cli's output loses the empty label's tab).
    let mut conn = redis::Client::open(redis_url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let value: String = redis::cmd("GET")
        .arg(&lock)
        .query_async(&mut conn)
        .await
        .expect("GET");
    let mut fields = value.splitn(4, ' ');
    assert_eq!(fields.next(), Some(&format!("{owner}-")[..]), "{value:?}");
    assert_eq!(
        fields.next(),
        Some(&grant.token.get().to_string()[..]),
        "{value:?}"
    );
    assert!(
        fields
            .next()
            .is_some_and(|micros| micros.parse::<u64>().is_ok()),
        "{value:?}"
    );
    let record = fields.next().expect("a record");
    let me = dlock::HolderInfo::this_process(None);
    assert_eq!(dlock::HolderInfo::decode(record), Some(me), "{value:?}");
    assert_eq!(cli(&["EXISTS", &info]), "0", "no key of its own");
    let taken = expires_at(&lock);
    assert!(taken > 0, "the lock has an expiry: {taken}");

    let renewal = Renewal::new(&key, &owner, Duration::from_secs(120));
    assert!(backend.extend(&renewal).await.expect("renew"));
    let renewed = expires_at(&lock);
    assert!(renewed > taken, "renewed: {renewed} after {taken}");
    // The batch renewal (one pipeline) too.
    let renewal = Renewal::new(&key, &owner, Duration::from_secs(180));
    let batch = backend.extend_many(&[renewal]).await;
    assert!(matches!(batch.as_slice(), [Ok(true)]), "{batch:?}");
    assert!(expires_at(&lock) > renewed);
    let kept: String = redis::cmd("GET")
        .arg(&lock)
        .query_async(&mut conn)
        .await
        .expect("GET");
    assert_eq!(kept, value, "renewals keep the record");

    assert_eq!(
        backend
            .release(&ReleaseRequest::new(&key, &owner))
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    assert_eq!(cli(&["EXISTS", &lock, &info]), "0", "nothing left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_set_on_the_builder_wins_over_the_requests() {
    use dlock::backend::{AcquireRequest, Attempt, ReleaseRequest};
    let labelled: Arc<dyn Backend> = Arc::new(
        RedisBackend::builder(&redis_url())
            .label("billing")
            .connect()
            .await
            .expect("connect"),
    );
    let unlabelled = backend().await;
    for (backend, expected) in [(&labelled, "billing"), (&unlabelled, "web")] {
        let key = dlock_runtime::conformance::fresh_key("builder-label");
        let owner = OwnerId::random().expect("random");
        let request =
            AcquireRequest::new(&key, &owner, Duration::from_secs(30)).with_label(Some("web"));
        assert!(matches!(
            backend.try_acquire(&request).await,
            Ok(Attempt::Acquired(_))
        ));
        let holder = unlabelled
            .holder(&key)
            .await
            .expect("holder")
            .and_then(|holding| holding.holder)
            .expect("recorded");
        assert_eq!(holder.label.as_deref(), Some(expected));
        backend
            .release(&ReleaseRequest::new(&key, &owner))
            .await
            .expect("release");
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_label_the_check_refuses_is_an_error_when_the_backend_is_built() {
    for bad in ["", "a\tb", &"x".repeat(dlock::holder::MAX_LABEL_LEN + 1)] {
        let built = RedisBackend::builder(&redis_url())
            .label(bad)
            .connect()
            .await;
        assert!(
            matches!(
                built,
                Err(LockError::InvalidOption {
                    option: "label",
                    ..
                })
            ),
            "{bad:?}: {built:?}"
        );
    }
}

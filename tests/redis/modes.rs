//! What only the Redis backend shows of shared locks and permits: holders
//! in separate OS processes (this test binary re-run as children) against
//! the Redis at `DLOCK_REDIS_URL` (default `redis://127.0.0.1:6379`), and a
//! server of the test's own that restarts and loses its data.

use crate::redis_support;
use crate::support;

use std::io::{BufRead as _, BufReader, Write as _};
use std::process::{Child, ChildStdout};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dlock::backend::OwnerId;
use dlock::redis::RedisBackend;
use dlock::{Backend, LockError, LockKey, LockMode, LockOptions};
use redis_support::{RedisServer, shared_backend as backend, shared_cli as cli};
use std::sync::Arc;

/// The environment variable that turns this test binary into a child
/// process playing one role (see `child_process_entry`).
const CHILD_ROLE: &str = "DLOCK_REDIS_MODES_TEST_CHILD";

/// The permit holder's ttl in the crash test, in ms.
const CRASH_TTL_MS: u64 = 3_000;

fn fresh_key(label: &str) -> LockKey {
    dlock_runtime::conformance::fresh_key(label)
}

/// The lines a child prints, one channel each, read on a thread of its own.
fn lines_of(stdout: ChildStdout) -> mpsc::Receiver<String> {
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                break;
            }
        }
    });
    receiver
}

/// A child playing `role` on `key`, and the lines it prints.
fn spawn(role: &str, key: &LockKey) -> (Child, mpsc::Receiver<String>) {
    let mut child = support::spawn_child(module_path!(), CHILD_ROLE, role, &[key.as_str()]);
    let lines = lines_of(child.stdout.take().expect("piped stdout"));
    (child, lines)
}

/// The next line a child prints that starts with `prefix`, prefix cut
/// (hang guard: 60 s).
fn next_line(lines: &mpsc::Receiver<String>, prefix: &str) -> String {
    loop {
        let line = lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|err| panic!("a child never printed `{prefix}`: {err}"));
        if let Some(rest) = line.strip_prefix(prefix) {
            return rest.to_owned();
        }
    }
}

/// Tells a child waiting on its stdin to go on.
fn go_on(child: &mut Child) {
    let stdin = child.stdin.as_mut().expect("piped stdin");
    stdin.write_all(b"go\n").expect("write to the child");
    stdin.flush().expect("flush");
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
        let until_told = || {
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
        };
        match parts[0].as_str() {
            // Take the only permit, renewed, and hold it until killed.
            "permit" => {
                let lease = LockOptions::new(Duration::from_millis(CRASH_TTL_MS))
                    .permits(1)
                    .acquire_on(backend, key)
                    .await
                    .expect("a free permit");
                println!("held {:?} {}", lease.slot(), lease.token());
                std::future::pending::<()>().await;
            }
            // Read until told, then release.
            "read" => {
                let lease = LockOptions::new(Duration::from_secs(30))
                    .mode(LockMode::Shared)
                    .wait(Duration::from_secs(20))
                    .acquire_on(backend, key)
                    .await
                    .expect("readers overlap");
                println!("read {}", lease.token().get());
                until_told();
                lease.release().await.expect("release");
                println!("released");
            }
            // Write, waiting, then release at once.
            "write" => {
                println!("trying");
                let lease = LockOptions::new(Duration::from_secs(30))
                    .wait(Duration::from_secs(40))
                    .acquire_on(backend, key)
                    .await
                    .expect("the writer gets the key once the readers left");
                println!("wrote {}", lease.token().get());
                lease.release().await.expect("release");
            }
            other => panic!("unknown child role {other}"),
        }
    });
}

/// A permit holder SIGKILLed (no release, no more renewals) keeps its slot
/// until its ttl runs out on the server, and not past it: right after the
/// kill the slot is refused, and it comes free no sooner than the expiry
/// the server had recorded for it at the kill, and within the wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_permit_holder_frees_its_slot_after_the_ttl_and_not_before() {
    let backend = backend().await;
    let key = fresh_key("permit-sigkill");
    let (mut holder, lines) = spawn("permit", &key);
    let held = next_line(&lines, "held ");
    assert!(held.starts_with("Some(0) "), "the only slot is 0: {held}");
    // Let it renew at least once: its process, not its first grant, holds.
    tokio::time::sleep(Duration::from_millis(CRASH_TTL_MS / 2)).await;
    holder.kill().expect("SIGKILL the permit holder");
    holder.wait().expect("reap the child");
    let killed = Instant::now();

    let one = LockOptions::new(Duration::from_secs(30)).permits(1);
    let refused = one.acquire_on(backend.clone(), &key).await;
    assert!(
        matches!(refused, Err(LockError::Held { .. })),
        "the killed holder's slot is held until its ttl, got {refused:?}"
    );
    let slots = format!("dlock:{{{key}}}:slots");
    assert_eq!(cli(&["HLEN", &slots]), "1", "the slot is still recorded");
    // What was left of the slot's ttl after the kill, by the server's clock
    // (the holder's last renewal may have come late, so its schedule says
    // nothing): the slot's value is `<expiry in server ms> <owner id>`.
    let recorded = cli(&["HGET", &slots, "0"]);
    let expiry_ms: u64 = recorded
        .split(' ')
        .next()
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("slot 0 recorded as {recorded:?}"));
    let time = cli(&["TIME"]);
    let mut time = time.lines().map(|n| n.trim().parse::<u64>().expect("TIME"));
    let now_ms = time.next().expect("seconds") * 1000 + time.next().expect("micros") / 1000;
    let left = Duration::from_millis(expiry_ms.saturating_sub(now_ms));
    assert!(
        left <= Duration::from_millis(CRASH_TTL_MS),
        "slot 0 expires {left:?} from now, past a ttl"
    );

    let next = one
        .wait(Duration::from_secs(20))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the ttl frees the slot");
    let freed_after = killed.elapsed();
    assert_eq!(next.slot(), Some(0));
    // `left` was read after the kill: the slot was due no sooner than
    // `left` after it (a millisecond of rounding either way).
    assert!(
        freed_after + Duration::from_millis(2) >= left,
        "the slot came free {freed_after:?} after the kill, before its ttl ran out on \
         the server ({left:?} after the kill at least)"
    );
    next.release().await.expect("release");
}

/// Readers in two processes hold at once and share the read phase's token;
/// a writer in a third waits (leaving its mark, which holds new readers
/// back) and gets the key only once both readers released, with a higher
/// token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_in_two_processes_share_the_phase_while_a_writer_in_a_third_waits() {
    let backend = backend().await;
    let key = fresh_key("rw-processes");
    let (mut first, first_lines) = spawn("read", &key);
    let first_token: u64 = next_line(&first_lines, "read ").parse().expect("a token");
    let (mut second, second_lines) = spawn("read", &key);
    let second_token: u64 = next_line(&second_lines, "read ").parse().expect("a token");
    assert_eq!(
        first_token, second_token,
        "overlapping readers in two processes share the phase token"
    );

    let (mut writer, writer_lines) = spawn("write", &key);
    next_line(&writer_lines, "trying");
    // The writer's attempt found the readers: its mark stands.
    let mark = format!("dlock:{{{key}}}:writer");
    let deadline = Instant::now() + Duration::from_secs(30);
    while cli(&["EXISTS", &mark]) != "1" {
        assert!(Instant::now() < deadline, "the waiting writer left no mark");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let late_reader = LockOptions::new(Duration::from_secs(30))
        .mode(LockMode::Shared)
        .acquire_on(backend.clone(), &key)
        .await;
    assert!(
        matches!(late_reader, Err(LockError::Held { .. })),
        "a new reader waits behind the marked writer, got {late_reader:?}"
    );

    go_on(&mut first);
    next_line(&first_lines, "released");
    assert!(
        writer_lines
            .try_iter()
            .all(|line| !line.starts_with("wrote")),
        "the writer got the key while a reader still held it"
    );
    go_on(&mut second);
    next_line(&second_lines, "released");
    let written: u64 = next_line(&writer_lines, "wrote ").parse().expect("a token");
    assert!(
        written > second_token,
        "the writer's token {written} is above the readers' {second_token}"
    );
    for child in [&mut first, &mut second, &mut writer] {
        assert!(child.wait().expect("child exits").success());
    }
    assert_eq!(
        cli(&["EXISTS", &mark]),
        "0",
        "the writer's grant took its mark"
    );
}

/// A server restart that loses the data (no persistence) loses the
/// fencing counter and any read phase: readers after it still get tokens
/// above the last writer's before it (the server clock floor), and so do
/// permits and writers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_that_loses_the_data_leaves_shared_tokens_above_the_last_writers() {
    let mut server = RedisServer::start(&[]);
    let backend: Arc<dyn Backend> = Arc::new(
        RedisBackend::builder(&server.url())
            .connect_timeout(Duration::from_secs(2))
            .response_timeout(Duration::from_secs(1))
            .connect()
            .await
            .expect("connect to the test's own server"),
    );
    let key = LockKey::new(format!(
        "dlock-test:rw-restart:{}",
        OwnerId::random().expect("random")
    ))
    .expect("key");
    let write = LockOptions::new(Duration::from_secs(10));
    let read = LockOptions::new(Duration::from_secs(10)).mode(LockMode::Shared);
    let mut last_writer = 0;
    for _ in 0..3 {
        let writer = write.acquire_on(backend.clone(), &key).await.expect("free");
        last_writer = writer.token().get();
        writer.release().await.expect("release");
        let reader = read.acquire_on(backend.clone(), &key).await.expect("free");
        assert!(reader.token().get() > last_writer);
        reader.release().await.expect("release");
    }
    // A reader holds across the restart: its phase is lost with the data.
    let across = read.acquire_on(backend.clone(), &key).await.expect("free");
    let fence = format!("dlock:{{{key}}}:fence");
    assert_eq!(server.cli(&["EXISTS", &fence]), "1");

    server.restart();
    assert_eq!(
        server.cli(&["EXISTS", &fence]),
        "0",
        "the restart must have lost the fencing counter"
    );
    let reader = support::within(20, "reading after the restart", async {
        loop {
            match read.acquire_on(backend.clone(), &key).await {
                Ok(lease) => return lease,
                Err(LockError::Backend { .. }) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(other) => panic!("reading after the restart: {other}"),
            }
        }
    })
    .await;
    assert!(reader.token().get() > last_writer);
    assert!(
        reader.token() > across.token(),
        "a reader after the restart ({}) is above every token before it (last writer \
         {last_writer}, last phase {})",
        reader.token(),
        across.token()
    );
    let second = read
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the phase");
    assert_eq!(second.token(), reader.token(), "the new phase is shared");
    let phase = reader.token();
    reader.release().await.expect("release");
    second.release().await.expect("release");
    let permit = LockOptions::new(Duration::from_secs(10))
        .permits(2)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    assert!(
        permit.token() > phase,
        "a permit after the phase is above it"
    );
    permit.release().await.expect("release");
    drop(across);
}

/// The wake-ups, seen on the release channel itself (a waiter's own
/// re-checks would hide a missing one): with a writer waiting on two
/// readers, the first reader's release announces nothing and the last
/// one's does; with the permits all taken and a waiter refused, a
/// permit's release does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_readers_release_and_a_permits_release_wake_waiters() {
    use dlock::backend::{Access, AcquireRequest, Attempt, ReleaseOutcome, ReleaseRequest};
    let backend = backend().await;
    let ttl = Duration::from_secs(30);
    let key = fresh_key("rw-wake");
    let readers = [
        OwnerId::random().expect("random"),
        OwnerId::random().expect("random"),
    ];
    for reader in &readers {
        let request = AcquireRequest::new(&key, reader, ttl).with_access(Access::Shared);
        let taken = backend
            .try_acquire(&request)
            .await
            .expect("backend answers");
        assert!(matches!(taken, Attempt::Acquired(_)), "{taken:?}");
    }
    let mut notice = backend.subscribe(&key).await.expect("subscribe");
    let writer = OwnerId::random().expect("random");
    let refused = backend
        .try_acquire(&AcquireRequest::new(&key, &writer, ttl).with_waits(true))
        .await
        .expect("backend answers");
    assert!(matches!(refused, Attempt::Held { .. }), "{refused:?}");
    let mark = format!("dlock:{{{key}}}:writer");
    assert_eq!(
        cli(&["EXISTS", &mark]),
        "1",
        "a writer that waits leaves its mark"
    );
    let release = |owner| ReleaseRequest::new(&key, owner).holding(Access::Shared, None);
    let first = backend
        .release(&release(&readers[0]))
        .await
        .expect("release");
    assert_eq!(first, ReleaseOutcome::Released);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut notice)
            .await
            .is_err(),
        "a reader's release while another reader holds announces nothing"
    );
    let last = backend
        .release(&release(&readers[1]))
        .await
        .expect("release");
    assert_eq!(last, ReleaseOutcome::Released);
    support::within(10, "the last reader's announcement", notice).await;
    backend
        .release(&ReleaseRequest::new(&key, &writer))
        .await
        .expect("the writer gives up");
    assert_eq!(cli(&["EXISTS", &mark]), "0", "giving up takes the mark");

    let key = fresh_key("permit-wake");
    let permit = Access::Permits { permits: 1 };
    let holder = OwnerId::random().expect("random");
    let taken = backend
        .try_acquire(&AcquireRequest::new(&key, &holder, ttl).with_access(permit))
        .await
        .expect("backend answers");
    assert!(matches!(taken, Attempt::Acquired(_)), "{taken:?}");
    let notice = backend.subscribe(&key).await.expect("subscribe");
    let waiter = OwnerId::random().expect("random");
    let refused = backend
        .try_acquire(&AcquireRequest::new(&key, &waiter, ttl).with_access(permit))
        .await
        .expect("backend answers");
    assert!(matches!(refused, Attempt::Held { .. }), "{refused:?}");
    let released = backend
        .release(&ReleaseRequest::new(&key, &holder).holding(permit, None))
        .await
        .expect("release");
    assert_eq!(released, ReleaseOutcome::Released);
    support::within(10, "the permit's announcement", notice).await;
}

/// One pipeline renews exclusive, shared and permit leases together, each
/// on its own side (rule M4): all renewed, and a renewal on the wrong side
/// or of a slot not held is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_batch_renews_exclusive_shared_and_permit_leases_each_on_its_side() {
    use dlock::backend::{Access, AcquireRequest, Attempt, Renewal};
    let backend = backend().await;
    let ttl = Duration::from_secs(5);
    let owner = OwnerId::random().expect("random");
    let permit = Access::Permits { permits: 2 };
    let keys = [
        fresh_key("batch-x"),
        fresh_key("batch-r"),
        fresh_key("batch-p"),
    ];
    let mut slot = None;
    for (key, access) in keys.iter().zip([Access::Exclusive, Access::Shared, permit]) {
        let request = AcquireRequest::new(key, &owner, ttl).with_access(access);
        match backend
            .try_acquire(&request)
            .await
            .expect("backend answers")
        {
            Attempt::Acquired(grant) => slot = slot.or(grant.slot),
            other => panic!("{access} on a fresh key: {other:?}"),
        }
    }
    let longer = Duration::from_secs(60);
    let renewals = [
        Renewal::new(&keys[0], &owner, longer),
        Renewal::new(&keys[1], &owner, longer).holding(Access::Shared, None),
        Renewal::new(&keys[2], &owner, longer).holding(permit, slot),
        // Wrong sides, and a slot the owner does not hold.
        Renewal::new(&keys[1], &owner, longer),
        Renewal::new(&keys[0], &owner, longer).holding(Access::Shared, None),
        Renewal::new(&keys[2], &owner, longer).holding(permit, Some(1)),
    ];
    let renewed: Vec<bool> = backend
        .extend_many(&renewals)
        .await
        .into_iter()
        .map(|answer| answer.expect("backend answers"))
        .collect();
    assert_eq!(renewed, [true, true, true, false, false, false]);
    for key in &keys {
        let left: i64 = cli(&["PTTL", &format!("dlock:{{{key}}}:lock")])
            .parse()
            .expect("a PTTL");
        assert!(left > 5_000, "`{key}` was renewed to 60 s, has {left} ms");
        backend.force_release(key).await.expect("force release");
    }
}

/// A fair writer queued behind readers gets the key once they left (the
/// last reader's release hands nothing over: the writer's own periodic
/// attempt takes it), and the holder read and the listing show a read-held
/// key as held, with the phase's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_writer_behind_readers_gets_the_key_and_a_read_held_key_is_listed() {
    let backend = backend().await;
    let key = fresh_key("rw-fair");
    let reader = LockOptions::new(Duration::from_secs(30))
        .mode(LockMode::Shared)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let phase = reader.token();
    let holding = backend
        .holder(&key)
        .await
        .expect("backend answers")
        .expect("read-held");
    assert_eq!(
        holding.token,
        Some(phase),
        "the holder read names the phase"
    );
    let listed = backend.held(key.as_str()).await.expect("backend answers");
    assert_eq!(listed.len(), 1, "the read-held key is listed: {listed:?}");

    let writer = {
        let (backend, key) = (backend.clone(), key.clone());
        tokio::spawn(async move {
            LockOptions::new(Duration::from_secs(30))
                .fair(true)
                .wait(Duration::from_secs(20))
                .acquire_on(backend, key)
                .await
        })
    };
    let mark = format!("dlock:{{{key}}}:writer");
    let deadline = Instant::now() + Duration::from_secs(20);
    while cli(&["EXISTS", &mark]) != "1" {
        assert!(Instant::now() < deadline, "the fair writer left no mark");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    reader.release().await.expect("release");
    let writer = support::within(25, "the fair writer", writer)
        .await
        .expect("task")
        .expect("the fair writer gets the key once the reader left");
    assert!(writer.token() > phase);
    writer.release().await.expect("release");
}

/// A shared attempt by a fresh owner on `key`, with `ttl`.
async fn try_read(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    ttl: Duration,
) -> dlock::backend::Attempt {
    use dlock::backend::{Access, AcquireRequest};
    let owner = OwnerId::random().expect("random");
    let request = AcquireRequest::new(key, &owner, ttl).with_access(Access::Shared);
    backend
        .try_acquire(&request)
        .await
        .expect("backend answers")
}

/// The key's fence counter: the last token issued for it.
fn last_issued(key: &LockKey) -> u64 {
    cli(&["GET", &format!("dlock:{{{key}}}:fence")])
        .parse()
        .expect("a fence counter")
}

/// The phase key deleted (an operator's `DEL`, an eviction) while one
/// reader holds (its record is in that key) or two do (the key holds the
/// token): the sentinel still stands for them, so a new reader is refused
/// rather than given a new, higher token (which a `>=` fence would then
/// hold against the current readers), the current token stays the highest
/// issued, each reader is told it lost at its next renewal and at its
/// release, and no writer gets the key before the sentinel, which lives as
/// long as the readers' validity, runs out; then it does, with a higher
/// token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_phase_key_refuses_new_readers_and_writers_and_its_readers_learn_they_lost() {
    use dlock::backend::{
        Access, AcquireRequest, Attempt, ReleaseOutcome, ReleaseRequest, Renewal,
    };
    let backend = backend().await;
    for readers in [1, 2] {
        let key = fresh_key(&format!("rw-lost-phase-{readers}"));
        let ttl = Duration::from_millis(2_000);
        let sent = Instant::now();
        let mut owners = Vec::new();
        let mut current = None;
        for _ in 0..readers {
            let owner = OwnerId::random().expect("random");
            let request = AcquireRequest::new(&key, &owner, ttl).with_access(Access::Shared);
            match backend
                .try_acquire(&request)
                .await
                .expect("backend answers")
            {
                Attempt::Acquired(grant) => current = Some(grant.token),
                other => panic!("readers share a fresh key: {other:?}"),
            }
            owners.push(owner);
        }
        let current = current.expect("a reader");
        let valid_until = sent + ttl;
        assert_eq!(cli(&["DEL", &format!("dlock:{{{key}}}:phase")]), "1");

        match try_read(&backend, &key, Duration::from_secs(30)).await {
            Attempt::Held { expires_in } => assert!(
                expires_in.is_some_and(|left| left > Duration::ZERO),
                "refused until the sentinel's expiry, got {expires_in:?}"
            ),
            Attempt::Acquired(grant) => panic!(
                "a new reader was granted {} beside the current readers' {current}",
                grant.token
            ),
            other => panic!("an unexpected answer: {other:?}"),
        }
        assert_eq!(
            last_issued(&key),
            current.get(),
            "the current readers' token is still the highest issued"
        );
        for owner in &owners {
            let renewal = Renewal::new(&key, owner, ttl).holding(Access::Shared, None);
            assert!(
                !backend.extend(&renewal).await.expect("backend answers"),
                "a reader of a lost phase is told it lost ({readers} readers)"
            );
            let release = ReleaseRequest::new(&key, owner).holding(Access::Shared, None);
            assert_ne!(
                backend.release(&release).await.expect("backend answers"),
                ReleaseOutcome::Released,
                "a reader of a lost phase is not told it held to the end"
            );
        }
        let other = OwnerId::random().expect("random");
        assert!(
            matches!(
                backend
                    .try_acquire(&AcquireRequest::new(&key, &other, ttl))
                    .await
                    .expect("backend answers"),
                Attempt::Held { .. }
            ),
            "a writer beside readers that believe they hold"
        );
        let writer = LockOptions::new(Duration::from_secs(30))
            .wait(Duration::from_secs(20))
            .acquire_on(backend.clone(), &key)
            .await
            .expect("the sentinel expires with its readers");
        assert!(
            Instant::now() >= valid_until,
            "a writer got the key before the readers' validity ran out"
        );
        assert!(
            writer.token() > current,
            "{} after {current}",
            writer.token()
        );
        writer.release().await.expect("release");
    }
}

/// The readers' hash deleted while two readers hold: a new reader never
/// gets a token above the current readers' (it is refused while the
/// sentinel stands), a current reader learns it lost at its next renewal
/// (never re-added), and no writer gets the key while the readers could
/// still believe they hold by their validity (the sentinel lives its ttl).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_readers_hash_refuses_new_readers_and_writers_until_the_phase_expires() {
    use dlock::backend::{Access, AcquireRequest, Attempt, Renewal};
    let backend = backend().await;
    let key = fresh_key("rw-lost-readers");
    let ttl = Duration::from_millis(2_000);
    let owner = OwnerId::random().expect("random");
    let request = AcquireRequest::new(&key, &owner, ttl).with_access(Access::Shared);
    let sent = Instant::now();
    let current = match backend
        .try_acquire(&request)
        .await
        .expect("backend answers")
    {
        Attempt::Acquired(grant) => grant.token,
        other => panic!("a fresh key is free: {other:?}"),
    };
    // A second reader: the phase's readers move into the hash.
    let second = OwnerId::random().expect("random");
    let joined = backend
        .try_acquire(&AcquireRequest::new(&key, &second, ttl).with_access(Access::Shared))
        .await
        .expect("backend answers");
    assert!(
        matches!(&joined, Attempt::Acquired(grant) if grant.token == current),
        "{joined:?}"
    );
    // What the reader believes, by its own clock: it holds until then.
    let valid_until = sent + ttl;
    assert_eq!(cli(&["DEL", &format!("dlock:{{{key}}}:readers")]), "1");

    match try_read(&backend, &key, Duration::from_secs(30)).await {
        Attempt::Held { .. } => {}
        Attempt::Acquired(grant) => assert!(
            grant.token <= current,
            "a new reader was granted {} above the current reader's {current}",
            grant.token
        ),
        other => panic!("an unexpected answer: {other:?}"),
    }
    assert_eq!(
        last_issued(&key),
        current.get(),
        "the current reader's token is still the highest issued"
    );
    let other = OwnerId::random().expect("random");
    let writer = AcquireRequest::new(&key, &other, ttl);
    assert!(
        matches!(
            backend.try_acquire(&writer).await.expect("backend answers"),
            Attempt::Held { .. }
        ),
        "a writer beside a reader that believes it holds"
    );

    let renewal = Renewal::new(&key, &owner, ttl).holding(Access::Shared, None);
    assert!(
        !backend.extend(&renewal).await.expect("backend answers"),
        "the reader whose entry is gone is told it lost"
    );
    assert_eq!(
        cli(&["EXISTS", &format!("dlock:{{{key}}}:readers")]),
        "0",
        "and is not written back"
    );
    let writer = LockOptions::new(Duration::from_secs(30))
        .wait(Duration::from_secs(20))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the sentinel expires with its reader");
    assert!(
        Instant::now() >= valid_until,
        "a writer got the key before the reader's validity ran out"
    );
    assert!(
        writer.token() > current,
        "{} after {current}",
        writer.token()
    );
    writer.release().await.expect("release");
}

/// A reader whose ttl ran out while an operator kept its phase alive
/// (`PEXPIRE` on the sentinel, `PERSIST` on the phase key) is answered
/// "not held" at its release, never "held to the end": a phase key that
/// lost its expiry reads as a lost phase. (An operator who stretches the
/// phase key's ttl stretches the lease, as one who stretches an exclusive
/// holder's lock key does.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_past_its_ttl_in_a_phase_an_operator_stretched_is_not_told_it_held_to_the_end() {
    use dlock::backend::{Access, AcquireRequest, Attempt, ReleaseOutcome, ReleaseRequest};
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("stretched-phase");
    let owner = OwnerId::random().expect("owner");
    // The operator's commands must land while the reader is still valid:
    // a connection made beforehand, and a ttl no slow step outlasts.
    let mut operator = redis::Client::open(redis_support::shared_url())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let ttl = Duration::from_secs(2);
    let asked = Instant::now();
    let taken = backend
        .try_acquire(&AcquireRequest::new(&key, &owner, ttl).with_access(Access::Shared))
        .await
        .expect("backend answers");
    assert!(matches!(taken, Attempt::Acquired(_)), "{taken:?}");
    let lock = redis_support::lock_name(&key);
    let readers = format!("dlock:{{{key}}}:readers");
    let stretched: i64 = redis::cmd("PEXPIRE")
        .arg(&lock)
        .arg(60_000)
        .query_async(&mut operator)
        .await
        .expect("PEXPIRE");
    assert_eq!(stretched, 1);
    let persisted: i64 = redis::cmd("PERSIST")
        .arg(format!("dlock:{{{key}}}:phase"))
        .query_async(&mut operator)
        .await
        .expect("PERSIST");
    assert_eq!(persisted, 1);
    tokio::time::sleep_until((asked + ttl + Duration::from_millis(300)).into()).await;
    let released = backend
        .release(&ReleaseRequest::new(&key, &owner).holding(Access::Shared, None))
        .await
        .expect("release");
    cli(&["DEL", &lock, &readers, &format!("dlock:{{{key}}}:phase")]);
    assert_ne!(
        released,
        ReleaseOutcome::Released,
        "a reader 300 ms past its ttl was told it held to the end"
    );
}

/// Waits until `backend` answers a permit attempt of `key` in process
/// ([`Attempt::Behind`]): a waiter of this process is queued on the key,
/// and the server told a refused attempt when the permits run out.
/// Panics after 10 s.
async fn until_queued_in_process(backend: &Arc<dyn Backend>, key: &LockKey, permits: u32) {
    use dlock::backend::{Access, AcquireRequest, Attempt, Look};
    let probe = OwnerId::random().expect("random");
    let request = AcquireRequest::new(key, &probe, Duration::from_secs(30))
        .with_access(Access::Permits { permits })
        .with_waits(true)
        .with_look(Look::First);
    let started = Instant::now();
    loop {
        match backend
            .try_acquire(&request)
            .await
            .expect("backend answers")
        {
            Attempt::Behind { .. } => return,
            Attempt::Acquired(_) => panic!("the probe took a permit of `{key}`"),
            _ => {}
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no waiter of this process queued on `{key}`"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Takes `count` permits of `key` (of `permits`) directly, for `ttl`: never
/// renewed, as a crashed holder's.
async fn take_permits(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    permits: u32,
    count: u32,
    ttl: Duration,
) -> Vec<OwnerId> {
    use dlock::backend::{Access, AcquireRequest, Attempt};
    let mut owners = Vec::new();
    for _ in 0..count {
        let owner = OwnerId::random().expect("random");
        let request =
            AcquireRequest::new(key, &owner, ttl).with_access(Access::Permits { permits });
        let taken = backend
            .try_acquire(&request)
            .await
            .expect("backend answers");
        assert!(matches!(taken, Attempt::Acquired(_)), "{taken:?}");
        owners.push(owner);
    }
    owners
}

/// Behind a waiter of its own process, a caller's first attempt and the
/// look right after it subscribed are answered in process; a retry always
/// asks the server, and so does a caller that would not wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_behind_its_processs_waiters_is_answered_in_process_and_a_retry_asks_the_server() {
    use dlock::backend::{Access, AcquireRequest, Attempt, Look};
    let backend = backend().await;
    let key = fresh_key("permit-behind");
    let holder = take_permits(&backend, &key, 1, 1, Duration::from_secs(30)).await;
    let waiter = tokio::spawn({
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            LockOptions::new(Duration::from_secs(30))
                .permits(1)
                .wait(Duration::from_secs(20))
                .acquire_on(backend, &key)
                .await
        }
    });
    until_queued_in_process(&backend, &key, 1).await;
    let other = OwnerId::random().expect("random");
    let request = AcquireRequest::new(&key, &other, Duration::from_secs(30))
        .with_access(Access::Permits { permits: 1 })
        .with_waits(true);
    for look in [
        Look::Again,
        Look::Subscribed {
            queued_behind: false,
        },
    ] {
        let answer = backend
            .try_acquire(&request.with_look(look))
            .await
            .expect("backend answers");
        assert!(
            matches!(
                answer,
                Attempt::Held {
                    expires_in: Some(_)
                }
            ),
            "{look:?} asks the server: {answer:?}"
        );
    }
    let answer = backend
        .try_acquire(&request.with_look(Look::First).with_waits(false))
        .await
        .expect("backend answers");
    assert!(
        matches!(
            answer,
            Attempt::Held {
                expires_in: Some(_)
            }
        ),
        "a caller that would not wait asks the server: {answer:?}"
    );
    backend
        .release(
            &dlock::backend::ReleaseRequest::new(&key, &holder[0])
                .holding(Access::Permits { permits: 1 }, None),
        )
        .await
        .expect("release");
    let lease = support::within(10, "the waiter's permit", waiter)
        .await
        .expect("the waiter's task")
        .expect("the waiter gets the permit");
    lease.release().await.expect("release");
}

/// A caller answered in process behind a waiter of its own process, with
/// a wait far shorter than that waiter's nap, is not told "held" on the
/// backend's word: at its deadline it asks the server, and takes the
/// permit an operator freed without any announcement.
///
/// The waiter counts as queued once its first attempt was refused, while
/// the attempt it sends right after it subscribed may still be on its way
/// (a loaded machine): landing after the operator's delete, it takes the
/// freed permit itself, first in line as it is, and the short caller is
/// rightly refused. Such a round shows nothing of the short caller and is
/// played again on a new key; a short caller refused while its own
/// process's waiter did not take the permit fails the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_wait_behind_its_processs_waiters_asks_the_server_before_it_times_out() {
    const ROUNDS: usize = 5;
    let backend = backend().await;
    for round in 1..=ROUNDS {
        let key = fresh_key("permit-behind-short");
        take_permits(&backend, &key, 2, 2, Duration::from_secs(30)).await;
        let waiter = tokio::spawn({
            let (backend, key) = (backend.clone(), key.clone());
            async move {
                LockOptions::new(Duration::from_secs(30))
                    .permits(2)
                    .wait(Duration::from_secs(30))
                    .acquire_on(backend, &key)
                    .await
            }
        });
        until_queued_in_process(&backend, &key, 2).await;
        // Slot 0 goes without a release (slot 1 stays live, so the permits
        // are not lost): nothing is published.
        let slots = format!("dlock:{{{key}}}:slots");
        assert_eq!(cli(&["HDEL", &slots, "0"]), "1");
        let short = LockOptions::new(Duration::from_secs(30))
            .permits(2)
            .wait(Duration::from_millis(300))
            .acquire_on(backend.clone(), &key)
            .await;
        let short = match short {
            Ok(short) => short,
            Err(refused @ LockError::Timeout { .. }) => {
                // The waiter's nap is 10 s: had it taken the permit before
                // the short caller's last look, it returns at once.
                let first = tokio::time::timeout(Duration::from_secs(5), waiter).await;
                match first {
                    Ok(Ok(Ok(lease))) if lease.slot() == Some(0) => {
                        eprintln!(
                            "round {round}: the waiter's own attempt took the freed permit \
                             first; played again"
                        );
                        lease.release().await.expect("release");
                        continue;
                    }
                    other => panic!(
                        "the caller's last look at its deadline did not take the free slot: \
                         {refused:?}; the waiter: {other:?}"
                    ),
                }
            }
            Err(err) => panic!("the short caller failed: {err}"),
        };
        assert_eq!(short.slot(), Some(0));
        short.release().await.expect("release");
        let lease = support::within(20, "the long waiter's permit", waiter)
            .await
            .expect("the waiter's task")
            .expect("the long waiter gets the permit after the short one");
        lease.release().await.expect("release");
        return;
    }
    panic!("in each of {ROUNDS} rounds the waiter took the freed permit before the short caller");
}

/// Permits of a crashed holder come free by their ttl, which announces
/// nothing: a caller answered in process behind a waiter of its own
/// process naps no longer than that expiry, and both take a permit soon
/// after it (well before the 10 s a waiter otherwise sleeps without news,
/// and their wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_a_crashed_holder_left_reach_a_caller_that_queued_in_process() {
    let backend = backend().await;
    let key = fresh_key("permit-behind-crash");
    take_permits(&backend, &key, 2, 2, Duration::from_millis(1500)).await;
    let wait = |backend: Arc<dyn Backend>, key: LockKey| async move {
        LockOptions::new(Duration::from_secs(30))
            .permits(2)
            .wait(Duration::from_secs(20))
            .acquire_on(backend, &key)
            .await
    };
    let first = tokio::spawn(wait(backend.clone(), key.clone()));
    until_queued_in_process(&backend, &key, 2).await;
    let second = tokio::spawn(wait(backend.clone(), key.clone()));
    // Each holds on (a release would wake the other) until both have one:
    // within 8 s of a 1.5 s ttl, short of both the 10 s nap without news
    // and the 20 s wait (whose end asks the server).
    let mut leases = Vec::new();
    for (name, waiter) in [("first", first), ("second", second)] {
        let lease = support::within(8, "a freed permit", waiter)
            .await
            .expect("the waiter's task")
            .unwrap_or_else(|err| panic!("the {name} waiter gets a freed permit: {err}"));
        leases.push(lease);
    }
    for lease in leases {
        lease.release().await.expect("release");
    }
}

/// The sentinel deleted while two readers hold (their hash stays): a new
/// reader starts a new phase with a higher token, and the old readers,
/// whose hash is left over, are told they lost at their next renewal and
/// at their release, before and after a second reader of the new phase
/// joins (which clears the left-over hash); the new phase's readers renew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_left_in_a_hash_from_a_lost_phase_never_renew_into_a_new_one() {
    use dlock::backend::{
        Access, AcquireRequest, Attempt, ReleaseOutcome, ReleaseRequest, Renewal,
    };
    let backend = backend().await;
    let key = fresh_key("rw-stale-hash");
    let ttl = Duration::from_secs(30);
    let read = |owner: OwnerId| {
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            match backend
                .try_acquire(&AcquireRequest::new(&key, &owner, ttl).with_access(Access::Shared))
                .await
                .expect("backend answers")
            {
                Attempt::Acquired(grant) => grant.token,
                other => panic!("a reader is refused: {other:?}"),
            }
        }
    };
    let old = [
        OwnerId::random().expect("random"),
        OwnerId::random().expect("random"),
    ];
    let old_token = read(old[0]).await;
    read(old[1]).await;
    assert_eq!(cli(&["DEL", &redis_support::lock_name(&key)]), "1");
    let new = [
        OwnerId::random().expect("random"),
        OwnerId::random().expect("random"),
    ];
    let new_token = read(new[0]).await;
    assert!(new_token > old_token, "{new_token} after {old_token}");
    let renews = |owner: OwnerId| {
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            backend
                .extend(&Renewal::new(&key, &owner, ttl).holding(Access::Shared, None))
                .await
                .expect("backend answers")
        }
    };
    assert!(
        !renews(old[0]).await,
        "an old reader renewed into the new phase"
    );
    read(new[1]).await;
    for owner in old {
        assert!(
            !renews(owner).await,
            "an old reader renewed into the new phase"
        );
        let release = ReleaseRequest::new(&key, &owner).holding(Access::Shared, None);
        assert_ne!(
            backend.release(&release).await.expect("backend answers"),
            ReleaseOutcome::Released
        );
    }
    for owner in new {
        assert!(renews(owner).await, "a reader of the new phase renews");
        let release = ReleaseRequest::new(&key, &owner).holding(Access::Shared, None);
        assert_eq!(
            backend.release(&release).await.expect("backend answers"),
            ReleaseOutcome::Released
        );
    }
    assert_eq!(
        cli(&["EXISTS", &redis_support::lock_name(&key)]),
        "0",
        "the new phase ended with its last reader"
    );
}

/// A permit freed with no announcement and no expiry (an operator's
/// `HDEL`; a failover that lost the write is alike) while the other
/// permit stays held and a waiter of this process is queued: a caller
/// arriving right after, even answered in process behind that waiter,
/// asks the server within a moment and takes the permit, rather than napping with the queue until
/// a nap without news runs out (10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_freed_without_an_announcement_goes_to_a_caller_arriving_behind_a_queued_waiter() {
    let backend = backend().await;
    let key = fresh_key("permit-behind-hdel");
    take_permits(&backend, &key, 2, 2, Duration::from_secs(30)).await;
    let wait = |backend: Arc<dyn Backend>, key: LockKey, wait: u64| async move {
        LockOptions::new(Duration::from_secs(30))
            .permits(2)
            .wait(Duration::from_secs(wait))
            .acquire_on(backend, &key)
            .await
    };
    let mut queued = tokio::spawn(wait(backend.clone(), key.clone(), 60));
    until_queued_in_process(&backend, &key, 2).await;
    assert_eq!(cli(&["HDEL", &format!("dlock:{{{key}}}:slots"), "0"]), "1");
    let mut arrival = tokio::spawn(wait(backend.clone(), key.clone(), 20));
    let taken = support::within(3, "the freed permit", async {
        tokio::select! {
            got = &mut arrival => got,
            got = &mut queued => got,
        }
    })
    .await;
    queued.abort();
    arrival.abort();
    let lease = taken
        .expect("the caller's task")
        .expect("a caller gets the freed permit");
    lease.release().await.expect("release");
}

/// `FLUSHALL` on a server of the test's own frees both permits of a key
/// with no announcement (the pub/sub connection lives on): two callers
/// arriving behind a waiter of this process each take one within a
/// moment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_a_flushall_freed_go_to_callers_arriving_behind_a_queued_waiter() {
    let server = RedisServer::start(&[]);
    let backend: Arc<dyn Backend> = Arc::new(
        RedisBackend::connect(&server.url())
            .await
            .expect("the test's server"),
    );
    let key = fresh_key("permit-behind-flush");
    take_permits(&backend, &key, 2, 2, Duration::from_secs(30)).await;
    let wait = |backend: Arc<dyn Backend>, key: LockKey, wait: u64| async move {
        LockOptions::new(Duration::from_secs(30))
            .permits(2)
            .wait(Duration::from_secs(wait))
            .acquire_on(backend, &key)
            .await
    };
    let queued = tokio::spawn(wait(backend.clone(), key.clone(), 60));
    until_queued_in_process(&backend, &key, 2).await;
    assert_eq!(server.cli(&["FLUSHALL"]), "OK");
    let arrivals = [
        tokio::spawn(wait(backend.clone(), key.clone(), 20)),
        tokio::spawn(wait(backend.clone(), key.clone(), 20)),
    ];
    let mut leases = Vec::new();
    for arrival in arrivals {
        leases.push(
            support::within(4, "a permit FLUSHALL freed", arrival)
                .await
                .expect("the caller's task")
                .expect("each arriving caller gets a freed permit"),
        );
    }
    queued.abort();
    for lease in leases {
        lease.release().await.expect("release");
    }
}

/// An operator shortens the phase key of a one-reader phase (the reader's
/// record) to 300 ms; a second reader joins and leaves: the first reader,
/// moved into the hash, keeps the sentinel's (its lease's) expiry, so no
/// writer gets the key, and no reader a higher token, while its 30 s
/// lease still checks valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shortened_phase_key_lets_no_writer_or_higher_token_in_beside_its_reader_after_a_join() {
    let backend = backend().await;
    let key = fresh_key("rw-shortened-phase");
    let read = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let first = read.acquire_on(backend.clone(), &key).await.expect("free");
    assert_eq!(
        cli(&["PEXPIRE", &format!("dlock:{{{key}}}:phase"), "300"]),
        "1"
    );
    let second = read.acquire_on(backend.clone(), &key).await.expect("joins");
    assert_eq!(second.token(), first.token());
    second.release().await.expect("release");
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(first.check().is_ok(), "the first reader's lease is valid");
    let writer = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await;
    assert!(
        matches!(writer, Err(LockError::Held { .. })),
        "a writer beside a reader whose lease checks valid: {:?}",
        writer.as_ref().map(|lease| lease.token())
    );
    if let dlock::backend::Attempt::Acquired(grant) =
        try_read(&backend, &key, Duration::from_secs(30)).await
    {
        assert_eq!(
            grant.token,
            first.token(),
            "a reader got a token other than the live reader's"
        );
    }
    backend.force_release(&key).await.expect("force release");
    drop(first);
}

/// A lone reader with a ttl past 10^14 ms (through the backend's own
/// interface: `LockOptions` caps a ttl at 30 days) is written into the
/// readers' hash as the integer it is when a second reader joins, never in
/// exponent form (which would read back as an expiry long past): it is not
/// pruned as dead, no writer gets in, and it renews.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_reader_with_a_huge_ttl_stays_live_when_a_second_reader_joins() {
    use dlock::backend::{
        Access, AcquireRequest, Attempt, ReleaseOutcome, ReleaseRequest, Renewal,
    };
    let backend = backend().await;
    let key = fresh_key("rw-huge-ttl");
    let huge = Duration::from_millis(1 << 50);
    let first = OwnerId::random().expect("random");
    let taken = backend
        .try_acquire(&AcquireRequest::new(&key, &first, huge).with_access(Access::Shared))
        .await
        .expect("backend answers");
    assert!(matches!(taken, Attempt::Acquired(_)), "{taken:?}");
    let second = OwnerId::random().expect("random");
    let joined = backend
        .try_acquire(
            &AcquireRequest::new(&key, &second, Duration::from_secs(5)).with_access(Access::Shared),
        )
        .await
        .expect("backend answers");
    assert!(matches!(joined, Attempt::Acquired(_)), "{joined:?}");
    assert_eq!(
        backend
            .release(&ReleaseRequest::new(&key, &second).holding(Access::Shared, None))
            .await
            .expect("backend answers"),
        ReleaseOutcome::Released
    );
    let writer = OwnerId::random().expect("random");
    let refused = backend
        .try_acquire(&AcquireRequest::new(&key, &writer, Duration::from_secs(5)))
        .await
        .expect("backend answers");
    let renews = backend
        .extend(&Renewal::new(&key, &first, huge).holding(Access::Shared, None))
        .await
        .expect("backend answers");
    backend.force_release(&key).await.expect("force release");
    assert!(
        matches!(refused, Attempt::Held { .. }),
        "a writer beside the huge-ttl reader: {refused:?}"
    );
    assert!(renews, "the huge-ttl reader was dropped as dead");
}

/// Ttls at and past 10^17 ms (a lone reader's own, through the backend's
/// interface; or its phase key's, stretched by an operator) are written to
/// the server as the integers they are, never as `1e+17`, which Redis
/// refuses: a second reader joins, and the phase keeps its expiries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_reader_joins_a_lone_reader_whose_ttl_is_past_ten_to_the_seventeenth_ms() {
    use dlock::backend::{Access, AcquireRequest, Attempt};
    let backend = backend().await;
    let phase = |key: &LockKey| format!("dlock:{{{key}}}:phase");
    let readers = |key: &LockKey| format!("dlock:{{{key}}}:readers");
    let join = |key: LockKey| {
        let backend = backend.clone();
        async move {
            let second = OwnerId::random().expect("random");
            backend
                .try_acquire(
                    &AcquireRequest::new(&key, &second, Duration::from_secs(5))
                        .with_access(Access::Shared),
                )
                .await
        }
    };

    let key = fresh_key("rw-ttl-1e17");
    let first = OwnerId::random().expect("random");
    let huge = Duration::from_millis(100_000_000_000_000_000);
    let taken = backend
        .try_acquire(&AcquireRequest::new(&key, &first, huge).with_access(Access::Shared))
        .await
        .expect("backend answers");
    assert!(matches!(taken, Attempt::Acquired(_)), "{taken:?}");
    let joined = join(key.clone()).await;
    let kept = cli(&["PTTL", &readers(&key)]);
    backend.force_release(&key).await.expect("force release");
    assert!(matches!(joined, Ok(Attempt::Acquired(_))), "{joined:?}");
    assert_ne!(kept, "-1", "the readers' hash was left without an expiry");

    let key = fresh_key("rw-stretched-2e17");
    let read = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let lease = read.acquire_on(backend.clone(), &key).await.expect("free");
    assert_eq!(cli(&["PEXPIRE", &phase(&key), "200000000000000000"]), "1");
    let joined = join(key.clone()).await;
    backend.force_release(&key).await.expect("force release");
    assert!(matches!(joined, Ok(Attempt::Acquired(_))), "{joined:?}");
    drop(lease);
}

/// An operator shortens a one-reader phase's key and makes its sentinel
/// persistent: a second reader is refused (a sentinel without an expiry
/// tells no reader's, so the phase reads as lost) rather than re-timing
/// the sentinel by the shortened key, and no writer gets in beside the
/// first reader while its lease checks valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persisted_sentinel_and_a_shortened_phase_key_let_no_writer_in_beside_the_reader() {
    use dlock::backend::Attempt;
    let backend = backend().await;
    let key = fresh_key("rw-persisted-sentinel");
    let read = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let first = read.acquire_on(backend.clone(), &key).await.expect("free");
    assert_eq!(
        cli(&["PEXPIRE", &format!("dlock:{{{key}}}:phase"), "300"]),
        "1"
    );
    assert_eq!(cli(&["PERSIST", &redis_support::lock_name(&key)]), "1");
    let joined = try_read(&backend, &key, Duration::from_secs(30)).await;
    assert!(
        matches!(joined, Attempt::Held { .. }),
        "a reader joined a phase whose sentinel has no expiry: {joined:?}"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(first.check().is_ok(), "the first reader's lease is valid");
    let writer = LockOptions::new(Duration::from_secs(5))
        .acquire_on(backend.clone(), &key)
        .await;
    backend.force_release(&key).await.expect("force release");
    assert!(
        matches!(writer, Err(LockError::Held { .. })),
        "a writer beside a reader whose lease checks valid"
    );
    drop(first);
}

/// A permit count as large as the option allows (`u32::MAX`) costs the
/// server what the key's holders cost, not what its slots would: on a
/// server of the test's own, an attempt on a free key, one beside a live
/// permit, and one that meets a dead slot entry beside live permits (which
/// the script prunes, a write, before it picks a slot) are each answered
/// at once, the slots' hash holds one entry a live holder, and another
/// client's `PING`s meanwhile are answered `PONG`, never `BUSY`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_count_of_u32_max_costs_the_server_its_holders_not_its_slots() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let server = RedisServer::start(&[]);
    let backend: Arc<dyn Backend> = Arc::new(
        RedisBackend::connect(&server.url())
            .await
            .expect("the test's server"),
    );
    let key = fresh_key("permits-u32-max");
    let slots = format!("dlock:{{{key}}}:slots");
    // Another client pings the server all along, on its own connection.
    let done = Arc::new(AtomicBool::new(false));
    let pinger = std::thread::spawn({
        let (done, port) = (done.clone(), server.address());
        move || {
            // At least one, however late the thread starts.
            let mut replies = Vec::new();
            loop {
                replies.push(redis_support::cli(
                    &["-u", &format!("redis://{port}")],
                    &["PING"],
                ));
                if done.load(Ordering::Relaxed) {
                    return replies;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    });
    let take = |what: &'static str| {
        let (backend, key) = (backend.clone(), key.clone());
        support::within(10, what, async move {
            LockOptions::new(Duration::from_secs(30))
                .permits(u32::MAX)
                .acquire_on(backend, &key)
                .await
        })
    };
    let first = take("a permit of a free key")
        .await
        .expect("a free key grants a permit");
    assert_eq!(first.slot(), Some(0));
    let second = take("a permit beside a live one")
        .await
        .expect("a second permit is granted");
    assert_eq!(second.slot(), Some(1));
    assert_eq!(server.cli(&["HLEN", &slots]), "2");
    // A dead entry (its expiry long past) in a slot no holder has.
    assert_eq!(
        server.cli(&["HSET", &slots, "5", "1 0123456789abcdef0123456789abcdef"]),
        "1"
    );
    let third = take("a permit beside a dead slot entry")
        .await
        .expect("a third permit is granted");
    assert_eq!(third.slot(), Some(2));
    assert_eq!(
        server.cli(&["HLEN", &slots]),
        "3",
        "one entry a live holder: the dead one pruned, no other written"
    );
    done.store(true, Ordering::Relaxed);
    let replies = pinger.join().expect("the pinging thread");
    assert!(
        replies.iter().all(|reply| reply == "PONG"),
        "another client was not answered: {replies:?}"
    );
    for lease in [first, second, third] {
        lease.release().await.expect("release");
    }
    assert_eq!(server.cli(&["EXISTS", &slots]), "0");
}

/// The slots' hash deleted (an operator's `DEL`, an eviction) while both
/// permits of `permits(2)` are held and the sentinel stands: the two
/// holders may still believe they hold, so no attempt is granted a permit
/// (and no token above theirs is drawn) until the sentinel, which lives as
/// long as their longest lease, runs out; each holder is told it lost at
/// its next renewal, and is not written back; then the key grants
/// permits again, with a higher token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slots_hash_refuses_new_permits_until_its_holders_leases_expire() {
    // A run so slow that the holders' validity ends before the checks
    // proves nothing either way: it runs again with a longer ttl.
    for ttl in [3, 10, 30].map(Duration::from_secs) {
        if lost_slots_hash_refuses_new_permits(ttl).await {
            return;
        }
        eprintln!("the holders' {ttl:?} validity ran out before the checks: again, longer");
    }
    panic!("every run was slower than its holders' ttl, the last 30s: nothing was checked");
}

/// One run of the test above with leases of `ttl`: false if the holders'
/// validity ran out before the checks that need it (nothing was shown).
async fn lost_slots_hash_refuses_new_permits(ttl: Duration) -> bool {
    use dlock::backend::{Access, AcquireRequest, Attempt, Renewal};
    let backend = backend().await;
    let key = fresh_key("permits-lost-slots");
    let access = Access::Permits { permits: 2 };
    let attempt = |owner: OwnerId| {
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            backend
                .try_acquire(&AcquireRequest::new(&key, &owner, ttl).with_access(access))
                .await
                .expect("backend answers")
        }
    };
    let sent = Instant::now();
    let mut holders = Vec::new();
    for _ in 0..2 {
        let owner = OwnerId::random().expect("random");
        match attempt(owner).await {
            Attempt::Acquired(grant) => holders.push((owner, grant.slot, grant.token)),
            other => panic!("a free permit is refused: {other:?}"),
        }
    }
    // What the holders believe, by their own clock: they hold until then.
    let valid_until = sent + ttl;
    let highest = holders.iter().map(|(_, _, token)| *token).max();
    let third = attempt(OwnerId::random().expect("random")).await;
    assert!(matches!(third, Attempt::Held { .. }), "{third:?}");

    // The checks below hold while the holders' validity lasts; a run so
    // slow that it ends first proves nothing either way.
    let inconclusive = || Instant::now() >= valid_until;
    let deleted = cli(&["DEL", &format!("dlock:{{{key}}}:slots")]);
    if deleted != "1" && inconclusive() {
        return false;
    }
    assert_eq!(deleted, "1");
    for _ in 0..2 {
        let answer = attempt(OwnerId::random().expect("random")).await;
        if matches!(answer, Attempt::Acquired(_)) && inconclusive() {
            return false;
        }
        assert!(
            matches!(answer, Attempt::Held { .. }),
            "a permit was granted beside two holders that believe they hold: {answer:?}"
        );
    }
    assert_eq!(
        Some(last_issued(&key)),
        highest.map(|token| token.get()),
        "the holders' tokens are still the highest issued"
    );
    for (owner, slot, _) in &holders {
        let renewal = Renewal::new(&key, owner, ttl).holding(access, *slot);
        assert!(
            !backend.extend(&renewal).await.expect("backend answers"),
            "a holder whose slot is gone is told it lost"
        );
    }
    assert_eq!(
        cli(&["EXISTS", &format!("dlock:{{{key}}}:slots")]),
        "0",
        "and is not written back"
    );
    let lease = LockOptions::new(Duration::from_secs(30))
        .permits(2)
        .wait(ttl + Duration::from_secs(20))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the sentinel expires with its holders' leases");
    assert!(
        Instant::now() >= valid_until,
        "a permit was granted before the holders' validity ran out"
    );
    assert!(
        Some(lease.token()) > highest,
        "{} after {highest:?}",
        lease.token()
    );
    lease.release().await.expect("release");
    true
}

/// An expiry past 2^63 ms in a slot entry (an operator's `HSET`) stretches
/// the permits' sentinel and hash to the longest expiry Redis accepts,
/// never by a negative (overflowed) `PEXPIRE`, which would delete them and
/// let more holders in than there are permits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_entry_with_an_expiry_past_two_to_the_sixty_third_lets_no_extra_permit_holder_in() {
    use dlock::backend::{Access, AcquireRequest, Attempt};
    let backend = backend().await;
    let key = fresh_key("permits-huge-expiry");
    let slots = format!("dlock:{{{key}}}:slots");
    let lock = format!("dlock:{{{key}}}:lock");
    let attempt = || {
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            let owner = OwnerId::random().expect("random");
            backend
                .try_acquire(
                    &AcquireRequest::new(&key, &owner, Duration::from_secs(30))
                        .with_access(Access::Permits { permits: 2 }),
                )
                .await
                .expect("backend answers")
        }
    };
    let first = attempt().await;
    assert!(matches!(first, Attempt::Acquired(_)), "{first:?}");
    cli(&[
        "HSET",
        &slots,
        "7",
        "99999999999999999999 0123456789abcdef0123456789abcdef",
    ]);
    let mut granted = 1;
    for _ in 0..4 {
        if matches!(attempt().await, Attempt::Acquired(_)) {
            granted += 1;
        }
    }
    let (lock_pttl, slots_pttl) = (cli(&["PTTL", &lock]), cli(&["PTTL", &slots]));
    cli(&["DEL", &lock, &slots]);
    assert_eq!(granted, 2, "holders of a 2-permit key");
    assert!(
        lock_pttl.parse::<i64>().is_ok_and(|ms| ms > 0)
            && slots_pttl.parse::<i64>().is_ok_and(|ms| ms > 0),
        "the sentinel's and the hash's PTTL: {lock_pttl}, {slots_pttl}"
    );
}

/// An expiry past 2^63 ms in a reader's entry (an operator's `HSET`) keeps
/// the read phase standing when another reader joins: no writer gets the
/// key while the readers hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_entry_with_an_expiry_past_two_to_the_sixty_third_lets_no_writer_in() {
    let backend = backend().await;
    let key = fresh_key("rw-huge-expiry");
    let readers = format!("dlock:{{{key}}}:readers");
    let lock = format!("dlock:{{{key}}}:lock");
    let phase = format!("dlock:{{{key}}}:phase");
    let read = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let a = read.acquire_on(backend.clone(), &key).await.expect("free");
    let b = read.acquire_on(backend.clone(), &key).await.expect("joins");
    cli(&[
        "HSET",
        &readers,
        "0123456789abcdef0123456789abcdef",
        "99999999999999999999",
    ]);
    let c = read.acquire_on(backend.clone(), &key).await.expect("joins");
    let writer = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), &key)
        .await;
    let writer_in = writer.is_ok();
    if let Ok(writer) = writer {
        let _ = writer.release().await;
    }
    for lease in [a, b, c] {
        let _ = lease.release().await;
    }
    cli(&["DEL", &lock, &readers, &phase]);
    assert!(!writer_in, "a writer got the key while readers hold");
}

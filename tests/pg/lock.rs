//! The conformance suite on `PgBackend` against a real PostgreSQL
//! (127.0.0.1:5432, or `DLOCK_PG_URL`), plus what only advisory locks on
//! owned sessions can show: across OS processes, a holder killed with
//! SIGKILL, a terminated lock session, a half-open connection, an
//! application pool beside the lock sessions, transaction-scoped locks.

use crate::pg_support;
use crate::support;

use std::io::{BufRead as _, BufReader};
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use support::within;

use dlock::backend::OwnerId;
use dlock::pg::tokio_postgres::{self, NoTls};
use dlock::pg::{PgBackend, PgOptions, TransactionLock};
use dlock::{Backend, FencingToken, LockError, LockKey, LockOptions, LostReason};
use dlock_runtime::conformance::fresh_key;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

fn conn() -> String {
    std::env::var("DLOCK_PG_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".to_owned())
}

async fn backend() -> Arc<dyn Backend> {
    Arc::new(pg().await)
}

async fn pg() -> PgBackend {
    PgBackend::connect(&conn())
        .await
        .expect("PostgreSQL at 127.0.0.1:5432 or DLOCK_PG_URL")
}

dlock_runtime::conformance_suite!(backend);

/// A plain client, as an application or an administrator would use.
async fn raw_client() -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&conn(), NoTls)
        .await
        .expect("plain connection");
    tokio::spawn(connection);
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_acquirers_in_one_process_over_four_shared_sessions_exactly_one_wins() {
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), PgOptions::new().sessions(4))
            .await
            .expect("connect"),
    );
    for _ in 0..5 {
        let key = fresh_key("race-4-sessions");
        let barrier = Arc::new(tokio::sync::Barrier::new(20));
        let tasks: Vec<_> = (0..20)
            .map(|_| {
                let (backend, key, barrier) = (backend.clone(), key.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let result = LockOptions::new(Duration::from_secs(10))
                        .acquire_on(backend, key)
                        .await;
                    barrier.wait().await;
                    result
                })
            })
            .collect();
        let mut winners = Vec::new();
        for task in tasks {
            match task.await.expect("task") {
                Ok(lease) => winners.push(lease),
                Err(LockError::Held { .. }) => {}
                Err(other) => panic!("unexpected error: {other}"),
            }
        }
        assert_eq!(winners.len(), 1, "exactly one of 20 must win");
        for lease in winners {
            lease.release().await.expect("release");
        }
    }
}

/// A renewal of a lease whose lock session ended (terminated by a DBA, a
/// force release of another key on it, a restart) answers "not held":
/// the session's locks are gone with its connection, for this process at
/// least, so "could not tell" would only make the caller ask again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_on_a_terminated_lock_session_answers_not_held_not_an_error() {
    use dlock::backend::{AcquireRequest, Attempt, Renewal};
    let holder = pg().await;
    let key = fresh_key("terminated-renewal");
    let owner = OwnerId::random().expect("owner");
    let ttl = Duration::from_secs(30);
    let taken = holder
        .try_acquire(&AcquireRequest::new(&key, &owner, ttl))
        .await
        .expect("answer");
    assert!(matches!(taken, Attempt::Acquired(_)), "{taken:?}");
    let pids = holder.holder_pids(&key).await.expect("holders");
    raw_client()
        .await
        .query_one("SELECT pg_terminate_backend($1)", &[&pids[0]])
        .await
        .expect("terminate");
    let answer = within(10, "a renewal that no longer renews", async {
        loop {
            match holder.extend(&Renewal::new(&key, &owner, ttl)).await {
                Ok(true) => tokio::time::sleep(Duration::from_millis(5)).await,
                other => return other,
            }
        }
    })
    .await;
    assert!(matches!(answer, Ok(false)), "{answer:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_the_lock_session_marks_the_lease_lost_at_once_and_the_next_holder_gets_a_higher_token()
 {
    let holder = pg().await;
    let other = pg().await;
    let key = fresh_key("terminated");
    let lease = LockOptions::new(Duration::from_secs(30))
        .acquire_on(Arc::new(holder.clone()), &key)
        .await
        .expect("free");
    let pids = other.holder_pids(&key).await.expect("holders");
    assert_eq!(pids.len(), 1, "one session holds the key: {pids:?}");
    assert!(holder.session_pids().await.contains(&pids[0]));

    let admin = raw_client().await;
    let terminated_at = Instant::now();
    admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pids[0]])
        .await
        .expect("terminate");
    let lost = within(5, "the lost signal", lease.lost()).await;
    let took = terminated_at.elapsed();
    eprintln!("lost signal {took:?} after pg_terminate_backend");
    assert!(
        matches!(
            lost,
            LockError::LeaseLost {
                reason: LostReason::SessionEnded(_),
                ..
            }
        ),
        "{lost}"
    );
    // The client sees the connection end a moment before the exiting server
    // process has dropped its locks (the safe order), hence a short wait.
    let next = LockOptions::new(Duration::from_secs(10))
        .wait(Duration::from_secs(5))
        .acquire_on(Arc::new(other), &key)
        .await
        .expect("the terminated session's lock is free");
    assert!(next.token() > lease.token());
    next.release().await.expect("release");
    // The holder's backend replaced its session and locks again.
    let again = LockOptions::new(Duration::from_secs(10))
        .wait(Duration::from_secs(5))
        .acquire_on(Arc::new(holder), &key)
        .await
        .expect("a new session takes over");
    again.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_is_unlocked_on_the_server_and_wakes_another_process() {
    // Two backends stand for two processes: the second only learns of the
    // first's expiry through the server.
    let first: Arc<dyn Backend> = backend().await;
    let second: Arc<dyn Backend> = backend().await;
    let key = fresh_key("expiry-elsewhere");
    let expiring = LockOptions::new(Duration::from_millis(300))
        .renew(false)
        .acquire_on(first, &key)
        .await
        .expect("free");
    let next = LockOptions::new(Duration::from_secs(10))
        .wait(Duration::from_secs(8))
        .acquire_on(second, &key)
        .await
        .expect("free once the first lease's ttl ran out");
    assert!(next.token() > expiring.token());
    assert!(expiring.is_lost());
    next.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returning_application_pool_connections_never_releases_the_lock() {
    use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
    let backend = pg().await;
    let key = fresh_key("beside-a-pool");
    let lease = LockOptions::new(Duration::from_secs(30))
        .acquire_on(Arc::new(backend.clone()), &key)
        .await
        .expect("free");
    // `Clean` recycling runs `pg_advisory_unlock_all()` on every returned
    // connection: exactly what would drop a lock taken on a pooled one.
    let config: tokio_postgres::Config = conn().parse().expect("config");
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Clean,
        },
    );
    let pool = Pool::builder(manager).max_size(4).build().expect("pool");
    let advisory_key = backend.advisory_key(&key).await.expect("advisory key");
    for round in 0..20 {
        let client = pool.get().await.expect("pooled connection");
        let one: i32 = client
            .query_one("SELECT $1::int", &[&round])
            .await
            .expect("ordinary query")
            .get(0);
        assert_eq!(one, round);
        // Not even an explicit unlock on an application connection touches it.
        let unlocked: bool = client
            .query_one("SELECT pg_advisory_unlock($1)", &[&advisory_key])
            .await
            .expect("unlock attempt")
            .get(0);
        assert!(
            !unlocked,
            "an application connection does not hold the lock"
        );
        drop(client); // back to the pool, recycled with pg_advisory_unlock_all()
    }
    assert!(lease.check().is_ok(), "the lease is still held");
    let contender = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend_arc().await, &key)
        .await;
    assert!(matches!(contender, Err(LockError::Held { .. })));
    let holders = backend.holder_pids(&key).await.expect("holders");
    let sessions = backend.session_pids().await;
    assert!(
        holders.iter().all(|pid| sessions.contains(pid)),
        "only the backend's own session holds the lock: {holders:?} vs {sessions:?}"
    );
    lease.release().await.expect("release");
}

async fn backend_arc() -> Arc<dyn Backend> {
    backend().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_lock_session_is_caught_by_the_liveness_check() {
    // A loopback proxy that can stop forwarding while keeping both sockets
    // open: to the client it looks like a network cut nobody reported.
    let frozen = Arc::new(AtomicBool::new(false));
    let proxy = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let proxy_port = proxy.local_addr().expect("addr").port();
    let upstream = pg_addr();
    tokio::spawn({
        let frozen = frozen.clone();
        async move {
            while let Ok((client, _)) = proxy.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pipe(cr, sw, frozen.clone()));
                tokio::spawn(pipe(sr, cw, frozen.clone()));
            }
        }
    });
    let via_proxy = format!("{} host=127.0.0.1 port={proxy_port}", conn_without_host());
    let backend = PgBackend::connect_with(
        &via_proxy,
        PgOptions::new()
            .sessions(1)
            .liveness_interval(Duration::from_millis(300))
            .server_idle_timeout(Some(Duration::from_secs(2))),
    )
    .await
    .expect("connect through the proxy");
    let key = fresh_key("half-open");
    let lease = LockOptions::new(Duration::from_secs(60))
        .acquire_on(Arc::new(backend), &key)
        .await
        .expect("free");
    let frozen_at = Instant::now();
    frozen.store(true, Ordering::SeqCst);
    let lost = within(10, "the lost signal", lease.lost()).await;
    eprintln!("half-open session noticed after {:?}", frozen_at.elapsed());
    assert!(
        matches!(
            lost,
            LockError::LeaseLost {
                reason: LostReason::SessionEnded(ref why),
                ..
            } if why.contains("liveness")
        ),
        "{lost}"
    );
    // The server ends the silent session too (idle_session_timeout), so the
    // key is free for others well before the 60s ttl.
    let next = LockOptions::new(Duration::from_secs(10))
        .wait(Duration::from_secs(20))
        .acquire_on(backend_arc().await, &key)
        .await
        .expect("the server ends the cut-off session and frees the key");
    next.release().await.expect("release");
}

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.load(Ordering::SeqCst) {
            // Swallow everything from now on, keeping the sockets open.
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// `host:port` of the server under test.
fn pg_addr() -> String {
    let config: tokio_postgres::Config = conn().parse().expect("config");
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!("{host}:{port}")
}

/// The connection string's user and database, as key-value pairs.
fn conn_without_host() -> String {
    let config: tokio_postgres::Config = conn().parse().expect("config");
    let mut parts = Vec::new();
    if let Some(user) = config.get_user() {
        parts.push(format!("user={user}"));
    }
    if let Some(db) = config.get_dbname() {
        parts.push(format!("dbname={db}"));
    }
    if let Some(password) = config.get_password() {
        parts.push(format!(
            "password={}",
            String::from_utf8_lossy(password)
                .replace('\\', "\\\\")
                .replace('\'', "\\'")
        ));
    }
    parts.join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_scoped_locks_exclude_session_locks_until_commit_and_share_their_tokens() {
    let backend = pg().await;
    let shared: Arc<dyn Backend> = Arc::new(backend.clone());
    let key = fresh_key("xact");
    let session_lease = LockOptions::new(Duration::from_secs(10))
        .acquire_on(shared.clone(), &key)
        .await
        .expect("free");
    let first_token = session_lease.token();

    let mut client = raw_client().await;
    {
        let mut tx = client.transaction().await.expect("begin");
        let held = TransactionLock::new().acquire(&mut tx, &key).await;
        assert!(matches!(held, Err(LockError::Held { .. })), "{held:?}");
        let waited = TransactionLock::new()
            .wait(Duration::from_millis(200))
            .acquire(&mut tx, &key)
            .await;
        assert!(
            matches!(waited, Err(LockError::Timeout { .. })),
            "{waited:?}"
        );
        // The failed waits left the transaction usable and lock_timeout as it was.
        let row = tx
            .query_one("SELECT current_setting('lock_timeout')", &[])
            .await
            .expect("transaction still usable");
        assert_eq!(row.get::<_, String>(0), "0");
        tx.rollback().await.expect("rollback");
    }
    session_lease.release().await.expect("release");

    let mut tx = client.transaction().await.expect("begin");
    let xact_token = TransactionLock::new()
        .wait(Duration::from_secs(5))
        .acquire(&mut tx, &key)
        .await
        .expect("free now");
    assert!(xact_token > first_token);
    let during = LockOptions::new(Duration::from_secs(10))
        .acquire_on(shared.clone(), &key)
        .await;
    assert!(
        matches!(during, Err(LockError::Held { .. })),
        "a transaction lock excludes session locks"
    );
    // A session waiter is woken by the commit (server-side wait, no polling).
    let waiter = support::spawn_waiter(shared.clone(), &key, 10, 10);
    tokio::time::sleep(Duration::from_millis(200)).await;
    tx.commit().await.expect("commit releases the lock");
    let after = within(10, "the waiter", waiter)
        .await
        .expect("task")
        .expect("free after commit");
    assert!(after.token() > xact_token);
    after.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_map_to_the_documented_server_hash_and_long_keys_lock() {
    let backend = pg().await;
    let client = raw_client().await;
    let id = OwnerId::random().expect("random");
    let long = LockKey::new(format!("{id}:{}", "ü".repeat(490))).expect("1024 bytes at most");
    assert!(long.as_str().len() > 1000);
    for key in [fresh_key("mapping"), long] {
        let ours = backend.advisory_key(&key).await.expect("advisory key");
        let theirs: i64 = client
            .query_one("SELECT hashtextextended($1, 0)", &[&key.as_str()])
            .await
            .expect("hash")
            .get(0);
        assert_eq!(ours, theirs, "any client computes the same advisory key");
        let lease = LockOptions::new(Duration::from_secs(10))
            .acquire_on(Arc::new(backend.clone()), &key)
            .await
            .expect("free");
        // A client in any language sees the lock as taken.
        let taken_elsewhere: bool = client
            .query_one("SELECT pg_try_advisory_lock($1)", &[&theirs])
            .await
            .expect("try")
            .get(0);
        assert!(!taken_elsewhere);
        lease.release().await.expect("release");
    }
}

/// The environment variable that turns this test binary into a child
/// process playing one role (see `child_process_entry`).
const CHILD_ROLE: &str = "DLOCK_PG_TEST_CHILD";

fn spawn_child(role: &str, args: &[&str]) -> Child {
    support::spawn_child(module_path!(), CHILD_ROLE, role, args)
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
        let backend: Arc<dyn Backend> = backend().await;
        let key = LockKey::new(parts[1].as_str()).expect("key");
        match parts[0].as_str() {
            // Increment a plain, unlocked counter file under the lock: any
            // overlap between holders loses an increment.
            "counter" => support::counter_rounds(backend.clone(), key.as_str(), &parts[2..]).await,
            // Take the lock with a long ttl and hang on to it.
            "hold" => {
                let lease = LockOptions::new(Duration::from_secs(120))
                    .acquire_on(backend.clone(), &key)
                    .await
                    .expect("acquire");
                println!("held {}", lease.token());
                tokio::time::sleep(Duration::from_secs(600)).await;
                drop(lease);
            }
            // Take the key shared with a long ttl; release it when told
            // (a line, or the end of stdin).
            "read" => {
                let lease = LockOptions::new(Duration::from_secs(120))
                    .mode(dlock::LockMode::Shared)
                    .acquire_on(backend.clone(), &key)
                    .await
                    .expect("acquire shared");
                println!("held {}", lease.token());
                let _ = tokio::task::spawn_blocking(|| {
                    let mut line = String::new();
                    let _ = std::io::stdin().read_line(&mut line);
                })
                .await;
                lease.release().await.expect("release");
                println!("released");
            }
            // Take one of `parts[2]` permits with a long ttl and hang on to it.
            "permit" => {
                let permits: u32 = parts[2].parse().expect("permits");
                let lease = LockOptions::new(Duration::from_secs(120))
                    .permits(permits)
                    .acquire_on(backend.clone(), &key)
                    .await
                    .expect("acquire a permit");
                let slot = lease.slot().expect("a permit has a slot");
                println!("held {} {slot}", lease.token());
                tokio::time::sleep(Duration::from_secs(600)).await;
                drop(lease);
            }
            other => panic!("unknown child role {other}"),
        }
    });
}

#[test]
fn three_processes_never_hold_one_key_at_once_and_tokens_rise() {
    let dir = support::ScratchDir::new("dlock-pg");
    let counter = dir.join("counter.txt");
    let counter_s = counter.to_str().expect("utf-8 path");
    let key = fresh_key("three-processes");
    const ROUNDS: usize = 30;
    let mut children: Vec<Child> = (0..3)
        .map(|_| spawn_child("counter", &[key.as_str(), counter_s, &ROUNDS.to_string()]))
        .collect();
    let mut lines = Vec::new();
    for child in &mut children {
        lines.extend(support::child_lines(child, "held "));
        assert!(child.wait().expect("child exits").success());
    }
    support::check_counter_holds(lines, &counter, 3 * ROUNDS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_a_holder_process_frees_the_key_without_waiting_for_its_ttl() {
    let key = fresh_key("killed-holder");
    let mut child = spawn_child("hold", &[key.as_str()]);
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let child_token: u64 = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|line| line.strip_prefix("held ").and_then(|t| t.parse().ok()))
        .expect("the child reports its token");
    std::thread::spawn(move || lines.for_each(drop));

    // The child's ttl is 120s and the waiter gives up after 20s: only the
    // holder's death can let it in.
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            LockOptions::new(Duration::from_secs(10))
                .wait(Duration::from_secs(20))
                .acquire_on(backend().await, key)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed_at = Instant::now();
    child.kill().expect("SIGKILL the holder");
    child.wait().expect("reap");
    let lease = waiter
        .await
        .expect("task")
        .expect("the dead holder's lock must be free long before its ttl");
    eprintln!(
        "waiter acquired {:?} after SIGKILL of the holder",
        killed_at.elapsed()
    );
    assert!(lease.token().get() > child_token);
    lease.release().await.expect("release");
}

/// The first line of `child` that starts with `prefix`, without it; the
/// rest of its output is drained in a thread of its own.
fn child_reports(child: &mut Child, prefix: &str) -> String {
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let report = lines
        .by_ref()
        .map_while(Result::ok)
        .find_map(|line| line.strip_prefix(prefix).map(str::to_owned))
        .expect("the child reports");
    std::thread::spawn(move || lines.for_each(drop));
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_in_two_processes_share_the_phase_token_while_a_writer_in_a_third_waits_for_both() {
    let key = fresh_key("rw-processes");
    let mut first = spawn_child("read", &[key.as_str()]);
    let first_token: u64 = child_reports(&mut first, "held ").parse().expect("token");
    // Started once the first holds: the two read phases overlap.
    let mut second = spawn_child("read", &[key.as_str()]);
    let second_token: u64 = child_reports(&mut second, "held ").parse().expect("token");
    assert_eq!(
        first_token, second_token,
        "overlapping readers of two processes share the phase token"
    );
    let writer = tokio::spawn({
        let key = key.clone();
        async move {
            LockOptions::new(Duration::from_secs(30))
                .wait(Duration::from_secs(30))
                .acquire_on(backend().await, key)
                .await
        }
    });
    let release = |child: &mut Child| {
        let stdin = child.stdin.as_mut().expect("stdin");
        std::io::Write::write_all(stdin, b"release\n").expect("tell the child");
        assert!(child.wait().expect("child exits").success());
    };
    // The writer waits once its mark is in the server's row (its own
    // connect and first attempt may take a while on a slow machine).
    let admin = raw_client().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let marked: bool = admin
            .query_one(
                "SELECT EXISTS (SELECT FROM dlock.dlock_phases AS t
                 WHERE t.lock_id = hashtextextended($1::text, 0)
                   AND t.mark_until > clock_timestamp())",
                &[&key.as_str()],
            )
            .await
            .expect("the key's mark")
            .get(0);
        if marked || writer.is_finished() {
            break;
        }
        assert!(Instant::now() < deadline, "the writer marked the key");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !writer.is_finished(),
        "the writer waits while both readers hold"
    );
    // Its mark, in the server's row, holds off a new reader of any process
    // (here a backend of its own: its own sessions, nothing shared in process).
    let late = LockOptions::new(Duration::from_secs(30))
        .mode(dlock::LockMode::Shared)
        .acquire_on(backend().await, &key)
        .await;
    assert!(
        matches!(late, Err(LockError::Held { .. })),
        "a new reader waits behind the waiting writer, got {late:?}"
    );
    release(&mut first);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !writer.is_finished(),
        "the writer waits while one reader still holds"
    );
    release(&mut second);
    let lease = within(20, "the writer", writer)
        .await
        .expect("task")
        .expect("the writer gets the key once both readers left");
    assert!(
        lease.token().get() > first_token,
        "the writer's token {} is above the readers' {first_token}",
        lease.token()
    );
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_a_permit_holder_process_frees_its_slot_without_waiting_for_its_ttl() {
    let key = fresh_key("killed-permit");
    let mut child = spawn_child("permit", &[key.as_str(), "1"]);
    let report = child_reports(&mut child, "held ");
    let (token, slot) = report.split_once(' ').expect("token and slot");
    let (child_token, child_slot): (u64, u32) =
        (token.parse().expect("token"), slot.parse().expect("slot"));
    assert_eq!(child_slot, 0, "the only slot");
    let backend = backend().await;
    let refused = LockOptions::new(Duration::from_secs(10))
        .permits(1)
        .acquire_on(backend.clone(), &key)
        .await;
    assert!(
        matches!(refused, Err(LockError::Held { .. })),
        "the child holds the only slot, got {refused:?}"
    );
    let killed_at = Instant::now();
    child.kill().expect("SIGKILL the permit holder");
    child.wait().expect("reap");
    // The child's ttl is 120 s: only its death can free the slot this soon.
    let lease = LockOptions::new(Duration::from_secs(10))
        .permits(1)
        .wait(Duration::from_secs(20))
        .acquire_on(backend, &key)
        .await
        .expect("the dead holder's slot is free long before its ttl");
    eprintln!(
        "permit taken {:?} after SIGKILL of its holder",
        killed_at.elapsed()
    );
    assert_eq!(lease.slot(), Some(0));
    assert!(lease.token().get() > child_token);
    lease.release().await.expect("release");
}

/// Advisory locks held by `pids`, as (mode, count).
async fn advisory_locks_of(admin: &tokio_postgres::Client, pids: &[i32]) -> Vec<(String, i64)> {
    admin
        .query(
            "SELECT mode, count(*) FROM pg_locks
             WHERE locktype = 'advisory' AND granted AND pid = ANY($1)
             GROUP BY mode ORDER BY mode",
            &[&pids],
        )
        .await
        .expect("pg_locks")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_attempt_takes_exactly_one_slot_lock_and_a_refused_one_none() {
    const N: u32 = 3;
    let pg = PgBackend::connect_with(&conn(), PgOptions::new().sessions(1))
        .await
        .expect("connect");
    let backend: Arc<dyn Backend> = Arc::new(pg.clone());
    let admin = raw_client().await;
    let key = fresh_key("permit-locks");
    let mut leases = Vec::new();
    for held in 1..=N {
        leases.push(
            LockOptions::new(Duration::from_secs(30))
                .permits(N)
                .acquire_on(backend.clone(), &key)
                .await
                .expect("a free slot"),
        );
        let pids = pg.session_pids().await;
        assert_eq!(
            advisory_locks_of(&admin, &pids).await,
            vec![("ExclusiveLock".to_owned(), i64::from(held))],
            "one slot lock per permit held, none left by the tries that failed"
        );
    }
    for _ in 0..3 {
        let refused = LockOptions::new(Duration::from_secs(30))
            .permits(N)
            .acquire_on(backend.clone(), &key)
            .await;
        assert!(
            matches!(refused, Err(LockError::Held { .. })),
            "{refused:?}"
        );
    }
    let pids = pg.session_pids().await;
    assert_eq!(
        advisory_locks_of(&admin, &pids).await,
        vec![("ExclusiveLock".to_owned(), i64::from(N))],
        "a refused attempt takes nothing"
    );
    for lease in leases {
        lease.release().await.expect("release");
    }
    assert_eq!(advisory_locks_of(&admin, &pids).await, vec![]);
    // Two readers of this process through its one session: each release
    // drops only its own hold.
    let shared = LockOptions::new(Duration::from_secs(30)).mode(dlock::LockMode::Shared);
    let read = || shared.acquire_on(backend.clone(), &key);
    let (first, second) = (read().await.expect("free"), read().await.expect("shared"));
    first.release().await.expect("release");
    let elsewhere: Arc<dyn Backend> = Arc::new(PgBackend::connect(&conn()).await.expect("connect"));
    let writer = LockOptions::new(Duration::from_secs(30))
        .acquire_on(elsewhere, &key)
        .await;
    assert!(
        matches!(writer, Err(LockError::Held { .. })),
        "the second reader still holds after the first let go, got {writer:?}"
    );
    second.release().await.expect("release");
    assert_eq!(advisory_locks_of(&admin, &pids).await, vec![]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_a_readers_lock_session_marks_its_lease_lost_and_frees_the_key() {
    let holder = PgBackend::connect_with(&conn(), PgOptions::new().sessions(1))
        .await
        .expect("connect");
    let key = fresh_key("terminated-reader");
    let lease = LockOptions::new(Duration::from_secs(30))
        .mode(dlock::LockMode::Shared)
        .acquire_on(Arc::new(holder.clone()), &key)
        .await
        .expect("free");
    let permit = LockOptions::new(Duration::from_secs(30))
        .permits(2)
        .acquire_on(Arc::new(holder.clone()), fresh_key("terminated-permit"))
        .await
        .expect("free");
    let pids = holder.session_pids().await;
    assert_eq!(pids.len(), 1);
    let admin = raw_client().await;
    admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pids[0]])
        .await
        .expect("terminate");
    for lost in [
        within(5, "the reader's lost signal", lease.lost()).await,
        within(5, "the permit's lost signal", permit.lost()).await,
    ] {
        assert!(
            matches!(
                lost,
                LockError::LeaseLost {
                    reason: LostReason::SessionEnded(_),
                    ..
                }
            ),
            "{lost}"
        );
    }
    // The lost lease still in hand: its own backend forgets the hold (or
    // the server lets the writer through on a new session) all the same.
    let writer = LockOptions::new(Duration::from_secs(10))
        .wait(Duration::from_secs(5))
        .acquire_on(Arc::new(holder.clone()), &key)
        .await
        .expect("the terminated reader's lock is free, in its own process too");
    assert!(writer.token() > lease.token());
    writer.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_leases_cost_no_task_per_lease_and_session_loss_still_reaches_each() {
    let pg = pg().await;
    let backend: Arc<dyn Backend> = Arc::new(pg.clone());
    let options = LockOptions::new(Duration::from_secs(30));
    // One lease first, so the backend's own tasks (connection drivers,
    // liveness checks, expiry queue, renewal scheduler) are running.
    let first = options
        .acquire_on(Arc::clone(&backend), fresh_key("tasks-first"))
        .await
        .expect("first lease");
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    let mut leases = Vec::new();
    for i in 0..200 {
        let key = fresh_key(&format!("tasks-{i}"));
        leases.push(
            options
                .acquire_on(Arc::clone(&backend), key)
                .await
                .expect("free key"),
        );
    }
    let during = metrics.num_alive_tasks();
    assert!(
        during < before + 20,
        "200 held leases run {} more tasks",
        during.saturating_sub(before)
    );

    // Every one of them still learns at once that its session ended.
    let pids = pg.session_pids().await;
    let admin = raw_client().await;
    for pid in pids {
        admin
            .execute("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .expect("terminate");
    }
    for lease in leases.iter().chain([&first]) {
        let lost = within(20, "told of the session's end", lease.lost()).await;
        assert!(
            matches!(
                &lost,
                LockError::LeaseLost {
                    reason: LostReason::SessionEnded(_),
                    ..
                }
            ),
            "{lost}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquisitions_and_releases_cancelled_at_any_point_leak_no_lock() {
    let backend: Arc<dyn Backend> = Arc::new(pg().await);
    let other: Arc<dyn Backend> = Arc::new(pg().await);
    let options = LockOptions::new(Duration::from_secs(30));
    let mut keys = Vec::new();
    // Give up after 0, 50, 100, ... µs: some attempts are dropped before
    // the statement is sent, some while the server answers, some after.
    for i in 0..120u64 {
        let key = fresh_key(&format!("cancel-{i}"));
        let patience = Duration::from_micros((i % 12) * 50);
        let attempt = options.acquire_on(Arc::clone(&backend), &key);
        if let Ok(Ok(lease)) = tokio::time::timeout(patience, attempt).await {
            // Taken in time: cancel its release instead.
            let _ = tokio::time::timeout(patience, lease.release()).await;
        }
        keys.push(key);
    }
    // Every key is free again, for this process and for another one.
    let patient = LockOptions::new(Duration::from_secs(30)).wait(Duration::from_secs(10));
    for key in &keys {
        for side in [&backend, &other] {
            let lease = within(20, "a cancelled key is free again", async {
                patient.acquire_on(Arc::clone(side), key).await
            })
            .await
            .unwrap_or_else(|e| panic!("{key}: {e}"));
            lease.release().await.expect("release");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_lock_wait_above_the_lock_timeout_limit_is_refused_before_anything_is_sent() {
    let mut client = raw_client().await;
    let key = fresh_key("xact-long-wait");
    let mut tx = client.transaction().await.expect("begin");
    let refused = TransactionLock::new()
        .wait(Duration::from_secs(25 * 24 * 60 * 60))
        .acquire(&mut tx, &key)
        .await;
    assert!(
        matches!(
            refused,
            Err(LockError::InvalidOption { option: "wait", .. })
        ),
        "{refused:?}"
    );
    // Nothing was sent: the transaction is as usable as before.
    tx.query_one("SELECT 1", &[])
        .await
        .expect("transaction still usable");
    // The limit itself is a wait PostgreSQL accepts.
    TransactionLock::new()
        .wait(dlock::pg::MAX_LOCK_TIMEOUT)
        .acquire(&mut tx, &key)
        .await
        .expect("a free key, under the longest lock_timeout");
    tx.rollback().await.expect("rollback");
}

/// Runs `work` on a runtime of its own, on a thread of its own, and shuts
/// that runtime down when `work` returns: a `block_on` at start-up, a
/// blocking library's runtime, a test harness's.
fn on_a_short_lived_runtime<T: Send + 'static>(
    work: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let out = runtime.block_on(work);
        drop(runtime);
        out
    })
    .join()
    .expect("the short-lived runtime's thread")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_on_short_lived_runtimes_that_give_up_leave_no_key_held() {
    // A backend made on the main runtime (as one registered at start-up
    // is), used from runtimes that shut down right after: each call gives up
    // at some point, and its runtime is gone before anything it left behind
    // could run there. PostgreSQL session locks never expire by themselves,
    // so whatever the backend must still do (give back a lock granted too
    // late, finish an unlock, enforce the ttl) has to run somewhere that
    // lives on.
    let backend = pg().await;
    let other: Arc<dyn Backend> = Arc::new(pg().await);
    let ttl = Duration::from_secs(2);
    let mut keys = Vec::new();
    for i in 0..40u64 {
        let key = fresh_key(&format!("short-runtime-{i}"));
        keys.push(key.clone());
        let backend: Arc<dyn Backend> = Arc::new(backend.clone());
        on_a_short_lived_runtime(async move {
            let options = LockOptions::new(ttl);
            let patience = Duration::from_micros(50 * i);
            match i % 4 {
                // Gives up on the acquisition.
                0 | 1 => {
                    let _ = tokio::time::timeout(patience, options.acquire_on(backend, key)).await;
                }
                // Gives up on the release.
                2 => {
                    if let Ok(lease) = options.acquire_on(backend, key).await {
                        let _ = tokio::time::timeout(patience, lease.release()).await;
                    }
                }
                // Drops the lease with the runtime, unreleased.
                _ => {
                    if let Ok(lease) = options.acquire_on(backend, key).await {
                        std::mem::forget(lease);
                    }
                }
            }
        });
    }
    // Past the ttl, every key is free: for another process, and for the
    // backend itself.
    tokio::time::sleep(ttl + Duration::from_millis(500)).await;
    let mut held = Vec::new();
    let backend: Arc<dyn Backend> = Arc::new(backend);
    for key in &keys {
        for (side, who) in [(&other, "another process"), (&backend, "the same backend")] {
            let attempt = LockOptions::new(Duration::from_secs(10))
                .wait(Duration::from_secs(5))
                .acquire_on(Arc::clone(side), key)
                .await;
            match attempt {
                Ok(lease) => lease.release().await.expect("release"),
                Err(err) => held.push(format!("{key} for {who}: {err}")),
            }
        }
    }
    assert!(held.is_empty(), "keys still held: {held:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_whose_runtime_shut_down_frees_what_it_held_and_works_from_another() {
    // Connected, and a lease taken, on a runtime that then shuts down (a
    // `block_on` at start-up); used afterwards from this one.
    let key = fresh_key("runtime-gone");
    let (backend, lease) = on_a_short_lived_runtime({
        let key = key.clone();
        async move {
            let backend = pg().await;
            let lease = LockOptions::new(Duration::from_secs(60))
                .acquire_on(Arc::new(backend.clone()), &key)
                .await
                .expect("free");
            (backend, lease)
        }
    });
    // The lease cannot be kept without that runtime: it is told, and the
    // lock is gone on the server, so nothing holds the key for good.
    let lost = support::until_lost(&lease, "the lease to be told").await;
    assert!(matches!(lost, LockError::LeaseLost { .. }), "{lost:?}");
    let observer = raw_client().await;
    assert!(
        pg_support::freed_on_the_server(&observer, &key).await,
        "the key is still held on the server"
    );
    drop(lease);

    // The backend goes on from this runtime: the key again, a lease that
    // really holds, and a ttl enforced here.
    let shared: Arc<dyn Backend> = Arc::new(backend.clone());
    let other: Arc<dyn Backend> = Arc::new(pg().await);
    let again = within(10, "the key again", async {
        LockOptions::new(Duration::from_secs(60))
            .acquire_on(Arc::clone(&shared), &key)
            .await
    })
    .await
    .expect("the key is free for the backend that held it");
    let meanwhile = LockOptions::new(Duration::from_secs(10))
        .acquire_on(Arc::clone(&other), &key)
        .await;
    assert!(
        matches!(meanwhile, Err(LockError::Held { .. })),
        "{meanwhile:?}"
    );
    again.release().await.expect("release");
    let short = fresh_key("runtime-gone-ttl");
    let abandoned = LockOptions::new(Duration::from_secs(1))
        .renew(false)
        .acquire_on(Arc::clone(&shared), &short)
        .await
        .expect("free");
    std::mem::forget(abandoned);
    let after_ttl = within(10, "the abandoned lease's ttl", async {
        LockOptions::new(Duration::from_secs(10))
            .wait(Duration::from_secs(5))
            .acquire_on(Arc::clone(&other), &short)
            .await
    })
    .await
    .expect("the ttl freed the key");
    after_ttl.release().await.expect("release");
}

/// A force release naming a lease, racing its holder's release, with a
/// busy lock table (another session holds 2,000 advisory locks, so
/// reading the table takes a while): it ends the holder's session only
/// while that session holds the named lease, never just after it let go,
/// whatever the read of the lock table costs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_force_release_racing_its_holder_beside_a_busy_lock_table_breaks_only_the_lease_it_names()
{
    let busy = raw_client().await;
    let class: i32 = rand_class();
    busy.execute(
        "SELECT pg_advisory_lock($1::int4, g) FROM generate_series(1, 2000) AS g",
        &[&class],
    )
    .await
    .expect("2,000 advisory locks for the lock table");
    dlock_runtime::conformance::a_force_release_racing_its_holder_breaks_only_the_lease_it_names(
        backend().await,
        backend().await,
    )
    .await;
    drop(busy);
}

/// An `int4` class for the busy session's locks, other than any other
/// test's run at the same time.
fn rand_class() -> i32 {
    let owner = OwnerId::random().expect("an owner id").to_hex();
    i32::from_str_radix(std::str::from_utf8(&owner[..7]).expect("hex"), 16)
        .expect("seven hex digits")
}

/// Whether a session holds `key`'s release gate exclusively (a force
/// release naming one of its leases is under way): the advisory lock on
/// the complement of the halves of the key's advisory key (seed 0).
async fn release_gate_held(admin: &tokio_postgres::Client, key: &LockKey) -> bool {
    admin
        .query_one(
            "SELECT EXISTS (
               SELECT FROM pg_locks AS l,
                    (SELECT hashtextextended($1::text, 0) AS h) AS k
               WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
                 AND l.mode = 'ExclusiveLock'
                 AND l.classid::int8 = ((~(k.h >> 32))::int4::int8 & 4294967295)
                 AND l.objid::int8 = ((~((k.h << 32) >> 32))::int4::int8 & 4294967295))",
            &[&key.as_str()],
        )
        .await
        .expect("read the lock table")
        .get(0)
}

/// A key's lease let go and the key taken again on `holder`'s session,
/// beside a lease of another key on that session: what the force releases
/// below meet. Returns the bystander lease, the token of the lease that
/// ended (the one an operator was shown) and the key's new lease.
async fn released_and_taken_again(
    holder: &Arc<dyn Backend>,
    key: &LockKey,
) -> (dlock::Lease, FencingToken, dlock::Lease) {
    let options = LockOptions::new(Duration::from_secs(30));
    let take = |key: LockKey| options.acquire_on(holder.clone(), key);
    let bystander = take(fresh_key(&format!("{key}-bystander")))
        .await
        .expect("free");
    let first = take(key.clone()).await.expect("free");
    let shown = first.token();
    first.release().await.expect("release");
    let second = take(key.clone()).await.expect("free again");
    (bystander, shown, second)
}

/// A force release by `operator` of `key` naming the lease with `token`.
async fn force_naming(
    operator: &Arc<dyn Backend>,
    key: &LockKey,
    token: FencingToken,
) -> Result<dlock::backend::ForceRelease, LockError> {
    operator
        .force_release_holding(key, &dlock::backend::Holding::new(Some(token), None))
        .await
}

/// A force release naming a lease that ended, whose link to the server
/// stalls mid-call (a network cut, a suspended laptop, a CLI stopped with
/// ^Z), holds up nothing of the holder's: the holder lets go of the lease
/// that holds the key now, the release goes through, and the other lease
/// on its session lives on. (The force release sends all its work in one
/// message, which the server finishes without waiting for the client: the
/// key's release gate, which the holder's releases wait for, is never
/// held across a round trip.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_force_release_whose_link_stalls_never_holds_up_the_holders_release() {
    let admin = raw_client().await;
    let holder: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), PgOptions::new().sessions(1))
            .await
            .expect("connect"),
    );
    let key = fresh_key("forced-stalled");
    let (bystander, shown, second) = released_and_taken_again(&holder, &key).await;

    let proxy = support::proxy::Proxy::bind(pg_addr()).await;
    let operator: Arc<dyn Backend> = Arc::new(
        PgBackend::connect(&format!(
            "host=127.0.0.1 port={} {}",
            proxy.port,
            conn_without_host()
        ))
        .await
        .expect("connect through the proxy"),
    );
    let force = tokio::spawn({
        let (operator, key) = (operator.clone(), key.clone());
        async move { force_naming(&operator, &key, shown).await }
    });
    // The link stalls once the gate is taken, or after 2 s if it never
    // shows (a force release that holds it for no round trip).
    let looked = Instant::now();
    while !release_gate_held(&admin, &key).await && looked.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    proxy.freeze();
    // Past the holder session's lock_timeout (half its 2 s liveness
    // interval) if the gate stayed held.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let released = within(30, "the holder's release", second.release()).await;
    assert!(
        released.is_ok(),
        "the holder's release of a lease the force release did not name failed: {released:?}"
    );
    assert!(
        bystander.check().is_ok(),
        "the other lease on the holder's session was lost"
    );
    proxy.thaw();
    let answer = within(60, "the force release's answer", force)
        .await
        .expect("the force release's task");
    assert!(
        !matches!(answer, Ok(dlock::backend::ForceRelease::Released)),
        "a force release naming a lease that ended answered released: {answer:?}"
    );
    bystander.release().await.expect("release");
}

/// A backend on a schema of its own (dropped with it), for a test that
/// locks the table of holder records as a DBA would.
async fn on_own_schema(
    options: PgOptions,
) -> (Arc<dyn Backend>, String, pg_support::ScratchSchema) {
    let scratch = pg_support::ScratchSchema::new("t");
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), options.schema(&scratch.name))
            .await
            .expect("connect"),
    );
    (backend, scratch.name.clone(), scratch)
}

/// Another process's session holds a key's release gate (any client can
/// take that pair of numbers): the holder's release of the key waits past
/// its lock timeout, then lets go without the gate. The release succeeds
/// and the other lease on the session lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_gate_another_session_holds_still_releases_and_keeps_the_session() {
    let admin = raw_client().await;
    let holder: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), PgOptions::new().sessions(1))
            .await
            .expect("connect"),
    );
    let key = fresh_key("gate-taken");
    let bystander = LockOptions::new(Duration::from_secs(30))
        .acquire_on(holder.clone(), fresh_key("gate-taken-bystander"))
        .await
        .expect("free");
    let lease = LockOptions::new(Duration::from_secs(30))
        .acquire_on(holder.clone(), key.clone())
        .await
        .expect("free");
    admin
        .query_one(
            "SELECT pg_advisory_lock((~(h >> 32))::int4, (~((h << 32) >> 32))::int4)
             FROM (SELECT hashtextextended($1::text, 0) AS h) AS k",
            &[&key.as_str()],
        )
        .await
        .expect("take the gate");
    let released = within(30, "the release", lease.release()).await;
    assert!(released.is_ok(), "{released:?}");
    assert!(bystander.check().is_ok(), "the holder's session was ended");
    let next = LockOptions::new(Duration::from_secs(30))
        .acquire_on(holder.clone(), key.clone())
        .await;
    assert!(next.is_ok(), "the key must be free: {next:?}");
    drop(admin);
}

/// A force release naming a lease that ended, while a DBA holds the table
/// of holder records locked (a `VACUUM FULL`, an `ALTER TABLE`): it waits
/// for the table before it takes the key's release gate, so the holder's
/// release of its current lease meanwhile goes through, and no lease of
/// its session is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_force_release_waiting_for_a_locked_records_table_holds_up_no_release() {
    let mut admin = raw_client().await;
    let (holder, schema, _drop) = on_own_schema(
        PgOptions::new()
            .sessions(1)
            .liveness_interval(Duration::from_secs(1)),
    )
    .await;
    let operator: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), PgOptions::new().sessions(1).schema(&schema))
            .await
            .expect("connect"),
    );
    let key = fresh_key("forced-table-locked");
    let (bystander, shown, second) = released_and_taken_again(&holder, &key).await;
    let dba = admin.transaction().await.expect("a transaction");
    dba.batch_execute(&format!(
        "LOCK TABLE {schema}.dlock_holders IN ACCESS EXCLUSIVE MODE"
    ))
    .await
    .expect("lock the table");
    let force = tokio::spawn({
        let (operator, key) = (operator.clone(), key.clone());
        async move { force_naming(&operator, &key, shown).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let released = within(30, "the holder's release", second.release()).await;
    let answer = within(30, "the force release", force)
        .await
        .expect("the force release's task");
    dba.rollback().await.expect("rollback");
    assert!(
        released.is_ok(),
        "the holder's release waited behind the force release: {released:?}"
    );
    assert!(bystander.check().is_ok(), "the holder's session was ended");
    assert!(
        !matches!(answer, Ok(dlock::backend::ForceRelease::Released)),
        "{answer:?}"
    );
}

/// A batch delete of released records that fails (the table locked by a
/// DBA's `CREATE INDEX` past the session's lock timeout) keeps them: the
/// key taken again on that session without a record is not read with the
/// old lease's record, and a force release naming the old lease ends
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_batch_delete_keeps_the_released_records_so_no_lease_is_read_with_one() {
    let mut admin = raw_client().await;
    let (holder, schema, _drop) = on_own_schema(
        PgOptions::new()
            .sessions(1)
            .liveness_interval(Duration::from_secs(1)),
    )
    .await;
    let operator: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), PgOptions::new().sessions(1).schema(&schema))
            .await
            .expect("connect"),
    );
    let key = fresh_key("batch-kept");
    let bystander = LockOptions::new(Duration::from_secs(60))
        .acquire_on(holder.clone(), fresh_key("batch-kept-bystander"))
        .await
        .expect("free");
    let first = LockOptions::new(Duration::from_secs(60))
        .acquire_on(holder.clone(), key.clone())
        .await
        .expect("free");
    let old = first.token();
    let other = LockOptions::new(Duration::from_secs(60))
        .acquire_on(holder.clone(), fresh_key("batch-kept-other"))
        .await
        .expect("free");
    first.release().await.expect("release");
    let dba = admin.transaction().await.expect("a transaction");
    dba.batch_execute(&format!("LOCK TABLE {schema}.dlock_holders IN SHARE MODE"))
        .await
        .expect("lock the table");
    // The batch falls due: this release's batch delete waits past the
    // lock timeout and fails.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    other.release().await.expect("release");
    let second = LockOptions::new(Duration::from_secs(60))
        .acquire_on(holder.clone(), key.clone())
        .await
        .expect("free again");
    let shown = operator.holder(&key).await.expect("backend answers");
    let answer = force_naming(&operator, &key, old).await;
    dba.rollback().await.expect("rollback");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        shown.as_ref().and_then(|h| h.token) != Some(old),
        "the key's new lease was read with the released lease's record: {shown:?}"
    );
    assert!(
        !matches!(answer, Ok(dlock::backend::ForceRelease::Released)),
        "a force release naming a released lease answered {answer:?}"
    );
    assert!(second.check().is_ok(), "the key's new lease was broken");
    assert!(bystander.check().is_ok(), "the holder's session was ended");
}

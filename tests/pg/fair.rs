//! Fair mode on `PgBackend`, against the shared PostgreSQL (127.0.0.1:5432,
//! or `DLOCK_PG_URL`), where only PostgreSQL's own lock queue can show it:
//! a fair waiter killed while queued leaves the server's queue by itself
//! and the release goes to the live waiter behind it; a plain waiter cannot
//! pass a queued fair one; a wait cut off on the server queues again; the
//! wait outlasts the timeouts a DBA sets; it ends on the server when its
//! entry expires or its owner leaves; fair sessions are kept for the next
//! waiter and bounded; a handed-over key's holder is recorded. The
//! conformance suite's fair properties run in `lock`.

use crate::pg_support;
use crate::support;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dlock::backend::{AcquireRequest, Attempt, OwnerId, Queue, ReleaseOutcome, ReleaseRequest};
use dlock::pg::tokio_postgres::Client;
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, LockError, LockKey, LockOptions};
use pg_support::{random_id, shared_client, shared_conn};
use support::{CountingBackend, within};
use tokio::time::{Instant, sleep};

/// The environment variable that turns this test binary into a child
/// process playing one role (see `child_process_entry`).
const CHILD_ROLE: &str = "DLOCK_PG_FAIR_TEST_CHILD";

fn fresh_key(label: &str) -> LockKey {
    LockKey::new(format!("dlock-test:fair-{label}:{}", random_id())).expect("valid key")
}

async fn connect_to(conn: &str, options: PgOptions) -> Arc<dyn Backend> {
    Arc::new(
        PgBackend::connect_with(conn, options)
            .await
            .expect("PostgreSQL at 127.0.0.1:5432 or DLOCK_PG_URL"),
    )
}

async fn connect_to_owned(conn: String, options: PgOptions) -> Arc<dyn Backend> {
    connect_to(&conn, options).await
}

async fn backend() -> Arc<dyn Backend> {
    connect_to(&shared_conn(), PgOptions::new()).await
}

fn fair(wait: Duration) -> LockOptions {
    LockOptions::new(Duration::from_secs(30))
        .wait(wait)
        .fair(true)
}

/// The server processes queued (not granted) for `key`'s advisory lock
/// (default key seed), each with when its statement started, oldest
/// first; only those of `application_name` `app` if given.
async fn queued(client: &Client, key: &LockKey, app: Option<&str>) -> Vec<(i32, SystemTime)> {
    client
        .query(
            "SELECT l.pid, a.query_start
             FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid,
                  (SELECT hashtextextended($1::text, 0) AS h) AS k
             WHERE l.locktype = 'advisory' AND NOT l.granted AND l.objsubid = 1
               AND l.mode = 'ExclusiveLock'
               AND l.classid::int8 = ((k.h >> 32) & 4294967295)
               AND l.objid::int8 = (k.h & 4294967295)
               AND ($2::text IS NULL OR a.application_name = $2::text)
             ORDER BY a.query_start",
            &[&key.as_str(), &app],
        )
        .await
        .expect("read the lock table")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Polls `queued` until `done` says yes, for at most `secs` seconds.
async fn until_queued(
    client: &Client,
    key: &LockKey,
    app: Option<&str>,
    secs: u64,
    what: &str,
    done: impl Fn(&[(i32, SystemTime)]) -> bool,
) -> Vec<(i32, SystemTime)> {
    let give_up = Instant::now() + Duration::from_secs(secs);
    loop {
        let now = queued(client, key, app).await;
        if done(&now) {
            return now;
        }
        assert!(
            Instant::now() < give_up,
            "{what}: not within {secs}s (queued now: {now:?})"
        );
        sleep(Duration::from_millis(20)).await;
    }
}

/// A fair waiter task on `backend`: the lease it is handed.
fn spawn_fair(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
) -> tokio::task::JoinHandle<Result<dlock::Lease, LockError>> {
    let (backend, key) = (Arc::clone(backend), key.clone());
    tokio::spawn(async move { fair(Duration::from_secs(30)).acquire_on(backend, key).await })
}

/// The child side. Ignored in normal runs; the tests start it as
/// `<test binary> <module>::child_process_entry --exact --ignored` with a role.
#[test]
#[ignore = "runs only as a child process of the cross-process tests"]
fn child_process_entry() {
    let Some((runtime, parts)) = support::child_role(CHILD_ROLE) else {
        return;
    };
    runtime.block_on(async move {
        match parts[0].as_str() {
            // Queue for the key as a fair waiter, connected as
            // `application_name` parts[2], and say so if it is ever served.
            "join" => {
                let conn = format!("{} application_name={}", shared_conn(), parts[2]);
                let backend = connect_to(&conn, PgOptions::new()).await;
                let lease = fair(Duration::from_secs(120))
                    .acquire_on(backend, parts[1].as_str())
                    .await
                    .expect("served");
                println!("held {}", lease.token());
                sleep(Duration::from_secs(600)).await;
            }
            other => panic!("unknown child role {other}"),
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_waiter_killed_while_queued_leaves_the_servers_queue_and_the_release_goes_to_the_live_waiter()
 {
    let key = fresh_key("killed");
    let client = shared_client().await;
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend().await, &key)
        .await
        .expect("free key");
    let app = format!("dlock-fair-child-{}", random_id());
    let mut child = support::spawn_child(module_path!(), CHILD_ROLE, "join", &[key.as_str(), &app]);
    until_queued(&client, &key, Some(&app), 10, "the child queues", |q| {
        q.len() == 1
    })
    .await;
    let live = spawn_fair(&backend().await, &key);
    until_queued(
        &client,
        &key,
        None,
        10,
        "the live waiter queues behind",
        |q| q.len() == 2,
    )
    .await;
    child.kill().expect("SIGKILL the queued child");
    child.wait().expect("reap");
    let killed_at = Instant::now();
    // Nobody asks: the server finds the connection closed and drops the
    // dead waiter from the queue (client_connection_check_interval).
    until_queued(&client, &key, None, 10, "the dead waiter leaves", |q| {
        q.len() == 1
    })
    .await;
    assert!(
        queued(&client, &key, Some(&app)).await.is_empty(),
        "the one left queued is the live waiter"
    );
    eprintln!(
        "the server dropped the killed waiter {:?} after SIGKILL",
        killed_at.elapsed()
    );
    let first = holder.token();
    holder.release().await.expect("release");
    let lease = within(10, "the live waiter is served", live)
        .await
        .expect("task")
        .expect("the release goes to the live waiter");
    assert!(lease.token() > first, "{} > {first}", lease.token());
    let left: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            &[&app],
        )
        .await
        .expect("sessions")
        .get(0);
    assert_eq!(left, 0, "no session of the killed child is left");
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_waiter_cannot_pass_a_queued_fair_waiter_at_the_release() {
    let key = fresh_key("no-barging");
    let (one, two, three) = (backend().await, backend().await, backend().await);
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(one, &key)
        .await
        .expect("free key");
    // Queued once its attempt is answered `Held`, as the core counts it.
    let counting = CountingBackend::new(two.clone());
    let fair_waiter = spawn_fair(&(counting.clone() as Arc<dyn Backend>), &key);
    within(10, "the fair waiter queues", async {
        while counting.joined() == 0 {
            sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    let plain_waiter = {
        let (three, key) = (three.clone(), key.clone());
        tokio::spawn(async move {
            LockOptions::new(Duration::from_secs(30))
                .wait(Duration::from_secs(30))
                .acquire_on(three, key)
                .await
        })
    };
    // The plain waiter looks, finds the key held, and waits for the release.
    sleep(Duration::from_millis(300)).await;
    let first = holder.token();
    holder.release().await.expect("release");
    let handed = within(10, "the fair waiter is served", fair_waiter)
        .await
        .expect("task")
        .expect("the release goes to the fair waiter");
    // The fair waiter holds the key now: the plain one cannot have it.
    sleep(Duration::from_millis(300)).await;
    assert!(
        !plain_waiter.is_finished(),
        "the plain waiter took the key past the fair waiter queued before it"
    );
    assert!(handed.token() > first);
    let handed_token = handed.token();
    handed.release().await.expect("release");
    let plain = within(10, "the plain waiter, after the fair one", plain_waiter)
        .await
        .expect("task")
        .expect("served next");
    assert!(plain.token() > handed_token);
    plain.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_wait_cancelled_or_terminated_on_the_server_queues_again_and_is_served() {
    let key = fresh_key("cut-off");
    let client = shared_client().await;
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend().await, &key)
        .await
        .expect("free key");
    let waiter = spawn_fair(&backend().await, &key);
    let before = until_queued(&client, &key, None, 10, "the waiter queues", |q| {
        q.len() == 1
    })
    .await[0];
    // A DBA cancels the waiting statement: the wait is sent again.
    client
        .query_one("SELECT pg_cancel_backend($1)", &[&before.0])
        .await
        .expect("cancel");
    let again = until_queued(
        &client,
        &key,
        None,
        10,
        "the cancelled wait queues again",
        |q| q.len() == 1 && q[0].1 > before.1,
    )
    .await[0];
    // A DBA ends the waiting session: the wait goes on in another.
    client
        .query_one("SELECT pg_terminate_backend($1)", &[&again.0])
        .await
        .expect("terminate");
    until_queued(
        &client,
        &key,
        None,
        10,
        "the terminated wait queues again",
        |q| q.len() == 1 && q[0].0 != again.0,
    )
    .await;
    let first = holder.token();
    holder.release().await.expect("release");
    let lease = within(10, "the waiter is served", waiter)
        .await
        .expect("task")
        .expect("a wait cut off on the server is never left dead");
    assert!(lease.token() > first);
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_wait_outlasts_a_roles_statement_timeout_and_the_sessions_lock_timeout() {
    let key = fresh_key("timeouts");
    let client = shared_client().await;
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend().await, &key)
        .await
        .expect("free key");
    // A statement_timeout from the connection (as a DBA's ALTER ROLE
    // sets one) of 800 ms, a lock session lock_timeout of 500 ms, and
    // liveness checks every second: all below the wait. Two waiters, one
    // whose wait statement records its holder and one whose does not.
    let strict = |options: PgOptions| {
        connect_to_owned(
            format!("{} options='-c statement_timeout=800'", shared_conn()),
            options.liveness_interval(Duration::from_secs(1)),
        )
    };
    let recording = spawn_fair(&strict(PgOptions::new()).await, &key);
    until_queued(&client, &key, None, 10, "the first waiter queues", |q| {
        q.len() == 1
    })
    .await;
    let plain = spawn_fair(&strict(PgOptions::new().record_holders(false)).await, &key);
    let before = until_queued(&client, &key, None, 10, "the second waiter queues", |q| {
        q.len() == 2
    })
    .await;
    sleep(Duration::from_millis(1_500)).await;
    assert_eq!(
        queued(&client, &key, None).await,
        before,
        "the same statements of the same sessions still wait: no timeout cut them off, \
         and no liveness check ended their sessions"
    );
    let first = holder.token();
    holder.release().await.expect("release");
    let lease = within(10, "the first waiter is served", recording)
        .await
        .expect("task")
        .expect("served");
    assert!(lease.token() > first);
    let second = lease.token();
    lease.release().await.expect("release");
    let lease = within(10, "the second waiter is served", plain)
        .await
        .expect("task")
        .expect("served");
    assert!(lease.token() > second);
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_wait_ends_on_the_server_when_its_entry_expires_or_its_owner_leaves() {
    let key = fresh_key("leaves");
    let client = shared_client().await;
    let (one, two) = (backend().await, backend().await);
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(one, &key)
        .await
        .expect("free key");
    let join = |owner: &OwnerId, entry_ttl: Duration| {
        let (two, key, owner) = (two.clone(), key.clone(), *owner);
        async move {
            two.try_acquire(
                &AcquireRequest::new(&key, &owner, Duration::from_secs(30))
                    .with_queue(Queue::Join { entry_ttl }),
            )
            .await
            .expect("the backend answers")
        }
    };
    // Never refreshed: the entry expires, and the wait leaves the queue.
    let vanished = OwnerId::random().expect("owner");
    let answer = join(&vanished, Duration::from_millis(300)).await;
    assert!(matches!(answer, Attempt::Held { .. }), "{answer:?}");
    assert_eq!(
        queued(&client, &key, None).await.len(),
        1,
        "queued on the server"
    );
    until_queued(&client, &key, None, 5, "the expired wait leaves", |q| {
        q.is_empty()
    })
    .await;
    // Its owner leaves (rule F3): gone from the queue when the release
    // returns.
    let leaving = OwnerId::random().expect("owner");
    let answer = join(&leaving, Duration::from_secs(30)).await;
    assert!(matches!(answer, Attempt::Held { .. }), "{answer:?}");
    assert_eq!(
        queued(&client, &key, None).await.len(),
        1,
        "queued on the server"
    );
    let left = two
        .release(&ReleaseRequest::new(&key, &leaving))
        .await
        .expect("release");
    assert_eq!(left, ReleaseOutcome::NotOwner);
    assert!(
        queued(&client, &key, None).await.is_empty(),
        "the wait is gone from the server's queue when its owner's release returns"
    );
    holder.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_sessions_are_kept_for_the_next_waiter_and_bounded_by_the_option() {
    let (key, other_key) = (fresh_key("kept"), fresh_key("kept-other"));
    let client = shared_client().await;
    let plain = backend().await;
    let one_session = connect_to(&shared_conn(), PgOptions::new().fair_sessions(1)).await;
    let hold = |key: &LockKey| {
        let (plain, key) = (plain.clone(), key.clone());
        async move {
            LockOptions::new(Duration::from_secs(30))
                .acquire_on(plain, key)
                .await
        }
    };
    let (holder, other_holder) = (
        hold(&key).await.expect("free"),
        hold(&other_key).await.expect("free"),
    );
    let first = spawn_fair(&one_session, &key);
    let (pid, _) = until_queued(&client, &key, None, 10, "the first waiter queues", |q| {
        q.len() == 1
    })
    .await[0];
    // Its one fair session waits: a second fair waiter cannot queue, and
    // is told why.
    let refused = fair(Duration::from_millis(300))
        .acquire_on(one_session.clone(), &other_key)
        .await;
    let why = match refused {
        Err(err @ LockError::Backend { .. }) => err.to_string(),
        other => panic!("a fair waiter past the bound is refused: {other:?}"),
    };
    assert!(why.contains("every fair session is in use"), "{why}");
    holder.release().await.expect("release");
    within(10, "the first waiter", first)
        .await
        .expect("task")
        .expect("served")
        .release()
        .await
        .expect("release");
    // The next fair waiter waits on the same connection.
    let second = spawn_fair(&one_session, &other_key);
    until_queued(
        &client,
        &other_key,
        None,
        10,
        "the next waiter queues on the kept session",
        |q| q.len() == 1 && q[0].0 == pid,
    )
    .await;
    other_holder.release().await.expect("release");
    within(10, "the second waiter", second)
        .await
        .expect("task")
        .expect("served")
        .release()
        .await
        .expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_over_key_reads_with_the_identity_and_token_its_wait_recorded() {
    let key = fresh_key("recorded");
    let (one, two) = (backend().await, backend().await);
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(one.clone(), &key)
        .await
        .expect("free key");
    let owner = OwnerId::random().expect("owner");
    let notice = two
        .subscribe_handoff(&key, &owner)
        .await
        .expect("handoff notice");
    let answer = two
        .try_acquire(
            &AcquireRequest::new(&key, &owner, Duration::from_secs(30))
                .with_identity(Some("fair-candidate"))
                .with_queue(Queue::Join {
                    entry_ttl: Duration::from_secs(30),
                }),
        )
        .await
        .expect("the backend answers");
    assert!(matches!(answer, Attempt::Held { .. }), "{answer:?}");
    let first = holder.token();
    holder.release().await.expect("release");
    let grant = within(10, "the handoff", notice).await;
    assert!(grant.token > first);
    // Read by another instance, as another process would.
    let holding = one
        .holder(&key)
        .await
        .expect("holder")
        .expect("the handed-over key is held");
    assert_eq!(holding.identity.as_deref(), Some("fair-candidate"));
    assert_eq!(holding.token, Some(grant.token));
    assert!(holding.holder.is_some(), "the holder record: {holding:?}");
    assert_eq!(
        two.release(&ReleaseRequest::new(&key, &owner))
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    assert_eq!(one.holder(&key).await.expect("holder"), None);
}

/// A fair waiter queued for a key holds no lock on dlock's tables: a DBA's
/// `LOCK TABLE` of the table of holder records (a migration's, say) is
/// granted while the waiter waits, and the waiter, handed the key once the
/// DBA is done, reads with the identity its grant recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dba_locks_the_holders_table_while_a_recorded_fair_waiter_is_queued() {
    let key = fresh_key("table-lock");
    let (one, two) = (backend().await, backend().await);
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(one.clone(), &key)
        .await
        .expect("free key");
    let owner = OwnerId::random().expect("owner");
    let notice = two
        .subscribe_handoff(&key, &owner)
        .await
        .expect("handoff notice");
    let request = AcquireRequest::new(&key, &owner, Duration::from_secs(30))
        .with_identity(Some("queued-candidate"))
        .with_queue(Queue::Join {
            entry_ttl: Duration::from_secs(30),
        });
    let answer = two
        .try_acquire(&request)
        .await
        .expect("the backend answers");
    assert!(matches!(answer, Attempt::Held { .. }), "{answer:?}");
    let dba = shared_client().await;
    until_queued(&dba, &key, None, 10, "the fair waiter queues", |q| {
        q.len() == 1
    })
    .await;
    dba.batch_execute(
        "BEGIN; SET LOCAL lock_timeout = '2s';
         LOCK TABLE dlock.dlock_holders IN ACCESS EXCLUSIVE MODE",
    )
    .await
    .expect("a queued fair waiter must not hold the table of holder records");
    holder.release().await.expect("release");
    dba.batch_execute("COMMIT").await.expect("commit");
    let grant = within(10, "the handoff", notice).await;
    let holding = one
        .holder(&key)
        .await
        .expect("holder")
        .expect("the handed-over key is held");
    assert_eq!(holding.identity.as_deref(), Some("queued-candidate"));
    assert_eq!(holding.token, Some(grant.token));
    assert_eq!(
        two.release(&ReleaseRequest::new(&key, &owner))
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
}

/// Rule M3 holds for a fair writer too: a fair writer of one process is
/// not starved by readers of another process that keep joining their
/// process's shared hold. Four reader tasks of one backend each hold the
/// key 4 s (longer than a writer's mark lives unless refreshed) and take
/// it again as soon as they let go, staggered by 250 ms, so the key is
/// never free of readers unless new ones are refused; a fair writer on a
/// second backend comes once they all hold. Its mark keeps new readers out
/// for as long as it waits, the readers drain, and it gets the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_writer_is_not_starved_by_readers_that_keep_joining_their_processs_hold() {
    const READERS: u32 = 4;
    const HOLD: Duration = Duration::from_secs(4);
    const STAGGER: Duration = Duration::from_millis(250);
    let readers_side = backend().await;
    let writer_side = backend().await;
    let key = fresh_key("fair-writer-readers");
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut readers = Vec::new();
    for i in 0..READERS {
        let (backend, key, done) = (readers_side.clone(), key.clone(), done.clone());
        readers.push(tokio::spawn(async move {
            sleep(STAGGER * i).await;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let reader = LockOptions::new(Duration::from_secs(30))
                    .mode(dlock::LockMode::Shared)
                    .wait(Duration::from_secs(30))
                    .acquire_on(backend.clone(), key.clone())
                    .await
                    .expect("a reader gets the key once the writer is done");
                let until = Instant::now() + HOLD;
                while Instant::now() < until && !done.load(std::sync::atomic::Ordering::SeqCst) {
                    sleep(Duration::from_millis(50)).await;
                }
                reader.release().await.expect("release");
            }
        }));
    }
    sleep(STAGGER * READERS).await;
    let writer = within(
        20,
        "the fair writer's acquisition to end",
        fair(Duration::from_secs(8)).acquire_on(writer_side.clone(), key.clone()),
    )
    .await;
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let writer = writer.expect("the fair writer gets the key once the readers drained");
    writer.release().await.expect("release");
    for reader in readers {
        within(40, "a reader task to end", reader)
            .await
            .expect("reader task");
    }
}

/// A fair waiter granted on a kept fair session whose record of an earlier
/// lease of the key is still there (waiting for its batch delete), whose
/// new record a DBA's trigger skips (`RETURN NULL`), keeps as it was
/// (`RETURN OLD`) or moves to another `lock_id`: the key is never read with
/// the earlier lease's record,
/// a force release naming that lease ends nothing, and the waiter gets
/// the key without a record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_grant_whose_record_a_trigger_skips_is_never_read_with_an_earlier_record() {
    for (event, body) in [
        ("UPDATE", "RETURN NULL;"),
        ("UPDATE", "RETURN OLD;"),
        ("INSERT", "NEW.lock_id := NEW.lock_id # 1; RETURN NEW;"),
    ] {
        fair_grant_under_a_trigger(event, body).await;
    }
}

async fn fair_grant_under_a_trigger(event: &str, body: &str) {
    let schema = pg_support::ScratchSchema::new("fair");
    let key = fresh_key("skipped");
    let admin = shared_client().await;
    let waiter = connect_to(&shared_conn(), schema.options().fair_sessions(1)).await;
    let reader = connect_to(&shared_conn(), schema.options()).await;
    // Held by a client that records nothing, so the fair session's own
    // record of the key is the only one.
    let hold = "SELECT pg_advisory_lock(hashtextextended($1::text, 0))";
    let unhold = "SELECT pg_advisory_unlock(hashtextextended($1::text, 0))";
    let served = |what: &'static str| {
        let (admin, waiter, key) = (&admin, &waiter, key.clone());
        async move {
            admin.execute(hold, &[&key.as_str()]).await.expect("hold");
            let lease = spawn_fair(waiter, &key);
            until_queued(admin, &key, None, 10, what, |q| !q.is_empty()).await;
            admin
                .execute(unhold, &[&key.as_str()])
                .await
                .expect("let go");
            within(10, what, lease)
                .await
                .expect("task")
                .expect("served")
        }
    };
    let earlier = served("the first waiter queues").await;
    let released = earlier.token();
    earlier.release().await.expect("release");

    admin
        .batch_execute(&format!(
            "CREATE FUNCTION {s}.audit() RETURNS trigger LANGUAGE plpgsql AS \
             $$BEGIN {body} END$$; \
             CREATE TRIGGER audit BEFORE {event} ON {s}.dlock_holders \
             FOR EACH ROW EXECUTE FUNCTION {s}.audit()",
            s = schema.name
        ))
        .await
        .expect("the DBA adds a trigger");
    let lease = served("the second waiter queues").await;
    let shown = reader.holder(&key).await.expect("read");
    assert!(
        shown.as_ref().and_then(|h| h.token) != Some(released),
        "{body}: the key is read with the released lease's record: {shown:?}"
    );
    let forced = reader
        .force_release_holding(&key, &dlock::backend::Holding::new(Some(released), None))
        .await;
    assert!(
        !matches!(forced, Ok(dlock::backend::ForceRelease::Released)),
        "{body}: a force release naming the released lease answered {forced:?}"
    );
    assert!(lease.check().is_ok(), "{body}: {:?}", lease.check());
    lease.release().await.expect("release");
}

//! Shared locks on PostgreSQL when a read phase's start fails under a
//! joiner, or runs under a DBA's settings: a reader's token stays above
//! every writer's before it, and overlapping readers share one. Each test
//! has a schema of its own, so a DBA's table lock or a terminated session
//! there touches no other test.

mod pg_support;
mod support;

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::tokio_postgres::Client;
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, Lease, LockError, LockKey, LockMode, LockOptions};
use dlock_runtime::conformance::fresh_key;
use pg_support::{ScratchSchema, shared_client, shared_conn};
use tokio::task::JoinHandle;

async fn backend_at(url: &str, schema: &ScratchSchema) -> Arc<dyn Backend> {
    backend_with(url, schema.options()).await
}

async fn backend_with(url: &str, options: PgOptions) -> Arc<dyn Backend> {
    Arc::new(
        PgBackend::connect_with(url, options)
            .await
            .expect("PostgreSQL"),
    )
}

/// How long a blocked start's sessions wait for a lock before they fail.
#[derive(Clone, Copy, PartialEq)]
enum LockWait {
    /// The default `lock_timeout`, half the default liveness interval (1 s).
    Default,
    /// 10 s (half a 20 s liveness interval): the starter and the joiner
    /// wait until the test acts, however slow the machine.
    Long,
}

impl LockWait {
    fn options(self, schema: &ScratchSchema) -> PgOptions {
        match self {
            Self::Default => schema.options(),
            Self::Long => schema
                .options()
                .liveness_interval(Duration::from_secs(20))
                .server_idle_timeout(None),
        }
    }
}

/// How long the test waits for a session to come to a lock wait.
const COME_TO_WAIT: Duration = Duration::from_secs(10);

/// The pid of the one session waiting for a relation lock on
/// `dlock_phases` of `schema` (`task`'s), once there is one; `None` if
/// `task` ended first.
async fn waiting_on_the_table(
    schema: &ScratchSchema,
    task: &JoinHandle<Result<Lease, LockError>>,
) -> Option<i32> {
    let admin = shared_client().await;
    let deadline = tokio::time::Instant::now() + COME_TO_WAIT;
    loop {
        let rows = admin
            .query(
                "SELECT l.pid FROM pg_locks AS l
                 WHERE l.locktype = 'relation' AND NOT l.granted
                   AND l.relation = $1::text::regclass",
                &[&phases(schema)],
            )
            .await
            .expect("the table's waiters");
        if let [row] = rows.as_slice() {
            return Some(row.get(0));
        }
        if task.is_finished() {
            return None;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "a session came to wait for the table: {} waiters",
            rows.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until a session waits for an advisory lock `pid` holds (the
/// joiner, behind the starter on the phase key).
async fn joiner_waiting_behind(pid: i32) {
    let admin = shared_client().await;
    let deadline = tokio::time::Instant::now() + COME_TO_WAIT;
    loop {
        let waiting: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_locks AS l
                 WHERE l.locktype = 'advisory' AND NOT l.granted
                   AND $1 = ANY(pg_blocking_pids(l.pid))",
                &[&pid],
            )
            .await
            .expect("the starter's waiters")
            .get(0);
        if waiting > 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the joiner came to wait behind the starter"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn shared() -> LockOptions {
    LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared)
}

/// `dlock_phases` of `schema`, for SQL.
fn phases(schema: &ScratchSchema) -> String {
    format!("\"{}\".dlock_phases", schema.name)
}

/// Phase 1 (a reader), then a writer, so the key's row keeps the old
/// phase's token, below the writer's. Returns (old phase token, writer token).
async fn old_phase_then_writer(on: &Arc<dyn Backend>, key: &LockKey) -> (u64, u64) {
    let r = shared().acquire_on(on.clone(), key).await.expect("reader");
    let t1 = r.token().get();
    r.release().await.expect("release");
    let w = LockOptions::new(Duration::from_secs(30))
        .acquire_on(on.clone(), key)
        .await
        .expect("writer");
    let tw = w.token().get();
    w.release().await.expect("release");
    assert!(tw > t1);
    (t1, tw)
}

/// A read phase starting while a DBA holds `dlock_phases` locked against
/// writes (reads go through): a starter, whose upsert waits for the table,
/// and, once it waits, a joiner of another process (connecting to
/// `joiner_url`), which waits on the phase key behind it. Before it, in a
/// schema of its own, an old phase and a writer (see
/// [`old_phase_then_writer`]). With [`LockWait::Long`] both are seen
/// waiting before this returns; with the default the starter may fail
/// (its lock_timeout) before the joiner comes.
struct BlockedStart {
    schema: ScratchSchema,
    /// In the transaction that holds the table lock: `ROLLBACK` ends it.
    dba: Client,
    starter: JoinHandle<Result<Lease, LockError>>,
    joiner: JoinHandle<Result<Lease, LockError>>,
    /// The old phase's token and the writer's.
    tokens: (u64, u64),
}

async fn blocked_start(label: &str, joiner_url: &str, wait: LockWait) -> BlockedStart {
    let schema = ScratchSchema::new(label);
    let key = fresh_key(label);
    let a = backend_at(&shared_conn(), &schema).await;
    let tokens = old_phase_then_writer(&a, &key).await;
    let dba = shared_client().await;
    dba.batch_execute(&format!(
        "BEGIN; LOCK TABLE {} IN EXCLUSIVE MODE",
        phases(&schema)
    ))
    .await
    .expect("lock the table");
    let starter_on = backend_with(&shared_conn(), wait.options(&schema)).await;
    let joiner_on = backend_with(joiner_url, wait.options(&schema)).await;
    let k = key.clone();
    let starter = tokio::spawn(async move { shared().acquire_on(starter_on, &k).await });
    let starter_pid = waiting_on_the_table(&schema, &starter).await;
    let k = key.clone();
    let joiner = tokio::spawn(async move { shared().acquire_on(joiner_on, &k).await });
    if wait == LockWait::Long {
        let pid = starter_pid.expect("the starter waits for the table until its lock_timeout");
        joiner_waiting_behind(pid).await;
    }
    BlockedStart {
        schema,
        dba,
        starter,
        joiner,
        tokens,
    }
}

/// The joiner's answer, once the DBA let go: refused or failed, or granted
/// a token above the writer's (and `equal_to`'s, if a starter holds beside
/// it).
async fn assert_joiner_above(
    joiner: JoinHandle<Result<Lease, LockError>>,
    dba: &Client,
    (t1, tw): (u64, u64),
    equal_to: Option<&Lease>,
) {
    let joined = joiner.await.expect("join");
    // Ends the DBA's transaction if it is still open (a warning if not).
    dba.batch_execute("ROLLBACK").await.expect("rollback");
    match joined {
        Ok(lease) => {
            let t = lease.token().get();
            lease.release().await.ok();
            assert!(
                t > tw,
                "reader granted token {t}: the old phase's is {t1}, a writer got {tw} since"
            );
            if let Some(other) = equal_to {
                assert_eq!(t, other.token().get(), "overlapping readers, two tokens");
            }
        }
        Err(LockError::Held { .. }) | Err(LockError::Backend { .. }) => {}
        Err(other) => panic!("unexpected {other:?}"),
    }
}

/// A starter whose statement fails after its try of the phase key was
/// granted (its upsert waits past lock_timeout for a DBA's lock on
/// dlock_phases) gives the phase key back; a joiner of another process
/// waiting behind it must then start the phase itself, not read the row
/// the starter never wrote (the old phase's token, below a writer's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_behind_a_failed_starter_never_gets_the_old_phases_token() {
    let run = blocked_start("r2_failed", &shared_conn(), LockWait::Default).await;
    let started = run.starter.await.expect("join");
    assert!(
        started.is_err(),
        "the starter's upsert waited past lock_timeout: {started:?}"
    );
    assert_joiner_above(run.joiner, &run.dba, run.tokens, None).await;
}

/// The same, the starter's server process ended by a DBA
/// (`pg_terminate_backend`) while its upsert waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_behind_a_terminated_starter_never_gets_the_old_phases_token() {
    let run = blocked_start("r2_killed", &shared_conn(), LockWait::Long).await;
    // The starter: the session waiting for a relation lock on dlock_phases.
    let killed = shared_client()
        .await
        .query(
            "SELECT pg_terminate_backend(l.pid) FROM pg_locks AS l
             WHERE l.locktype = 'relation' AND NOT l.granted
               AND l.relation = $1::text::regclass",
            &[&phases(&run.schema)],
        )
        .await
        .expect("terminate the starter");
    assert_eq!(killed.len(), 1, "one starter waited for the table");
    let started = run.starter.await.expect("join");
    assert!(started.is_err(), "{started:?}");
    // The joiner starts the phase itself: once its upsert waits for the
    // table, the DBA lets go and it writes a token of its own (it would
    // not wait if it read the old phase's).
    waiting_on_the_table(&run.schema, &run.joiner).await;
    run.dba.batch_execute("ROLLBACK").await.expect("rollback");
    assert_joiner_above(run.joiner, &run.dba, run.tokens, None).await;
}

/// A role or database whose `default_transaction_isolation` is
/// `serializable` (a DBA's setting): the joiner reads the phase token with
/// a snapshot taken after it waited for the starter's commit, so both
/// hold with the starter's token, above the writer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_under_repeatable_read_gets_the_starters_token() {
    let serializable = format!(
        "{} options='-c default_transaction_isolation=serializable'",
        shared_conn()
    );
    let run = blocked_start("r2_rr", &serializable, LockWait::Long).await;
    // The DBA lets go: the starter writes its token and commits.
    run.dba.batch_execute("ROLLBACK").await.expect("rollback");
    let started = run
        .starter
        .await
        .expect("join")
        .expect("the starter gets the key");
    assert_joiner_above(run.joiner, &run.dba, run.tokens, Some(&started)).await;
    started.release().await.ok();
}

/// The pid of a session holding `key`'s advisory lock shared (seed 0).
async fn shared_holder_pid(key: &LockKey) -> Option<i32> {
    shared_client()
        .await
        .query_opt(
            "SELECT l.pid FROM pg_locks AS l
             WHERE l.locktype = 'advisory' AND l.mode = 'ShareLock' AND l.granted AND l.objsubid = 1
               AND l.classid::int8 = ((hashtextextended($1, 0) >> 32) & 4294967295)
               AND l.objid::int8 = (hashtextextended($1, 0) & 4294967295)
             LIMIT 1",
            &[&key.as_str()],
        )
        .await
        .expect("pg_locks")
        .map(|row| row.get(0))
}

/// The lock session of this process's read hold is ended by a DBA: a
/// reader of this process that joins right after must not be granted a
/// lease that is not lost while a writer elsewhere holds the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_joining_a_hold_whose_session_was_ended_is_not_granted_beside_a_writer() {
    let schema = ScratchSchema::new("r2_join_dead");
    let mut doubles = 0;
    let rounds = 4;
    for _ in 0..rounds {
        let key = fresh_key("review2-join-dead");
        let a = backend_at(&shared_conn(), &schema).await;
        let b = backend_at(&shared_conn(), &schema).await;
        let first = shared()
            .acquire_on(a.clone(), &key)
            .await
            .expect("first reader");
        let pid = shared_holder_pid(&key).await.expect("the hold's session");
        shared_client()
            .await
            .execute("SELECT pg_terminate_backend($1, 2000)", &[&pid])
            .await
            .expect("terminate");
        let joined = shared().acquire_on(a.clone(), &key).await;
        let writer = LockOptions::new(Duration::from_secs(30))
            .wait(Duration::from_secs(3))
            .acquire_on(b.clone(), &key)
            .await;
        if let (Ok(joined), Ok(_writer)) = (&joined, &writer)
            && !joined.is_lost()
        {
            doubles += 1;
        }
        drop(first);
        drop(joined);
        drop(writer);
    }
    assert_eq!(
        doubles, 0,
        "{doubles} of {rounds} rounds: a reader joined a dead hold and believed it held beside a writer"
    );
}

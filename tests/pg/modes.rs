//! Shared locks and permits on `PgBackend` against what operators and
//! other callers do to a running system: phase rows, the phase table and
//! the permit function dropped, changed or locked by a DBA, a token
//! sequence set back, concurrent first use, statements prepared once per
//! session; and a read phase whose start fails under a joiner, or runs
//! under a DBA's settings: a reader's token stays above every writer's
//! before it, and overlapping readers share one. Tests that lock, drop or
//! terminate anything have a schema of their own, so a DBA's table lock
//! or a terminated session there touches no other test. The behaviour of
//! modes mixed under load, common to the file and PostgreSQL backends, is
//! in `tests/mixed_modes.rs`.

use crate::pg_support;
use crate::support;

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::tokio_postgres::{self, Client, NoTls};
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

/// A starter whose transaction ended without its phase while its session
/// kept the locks its start took (a server process terminated gives back
/// its transaction's locks before its session's, and a slow exit keeps
/// them past the joiner's few tries): the key's row is still the old
/// phase's, whose members are all gone. A joiner that comes then must not
/// take the old phase's token, below a writer's since; once the starter's
/// locks went, a reader starts a phase of its own. Played by a session
/// that starts a phase in a transaction it rolls back: its session locks
/// stay, its row goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_beside_a_start_rolled_back_never_gets_the_old_phases_token() {
    let schema = ScratchSchema::new("r3_rolled_back");
    let key = fresh_key("r3-rolled-back");
    let a = backend_at(&shared_conn(), &schema).await;
    let (t1, tw) = old_phase_then_writer(&a, &key).await;
    let starter = shared_client().await;
    starter.batch_execute("BEGIN").await.expect("begin");
    let started: Option<i64> = starter
        .query_one(
            &format!(
                "SELECT s.granted_token FROM \"{}\".dlock_join_readers($1, 0) AS s",
                schema.name
            ),
            &[&key.as_str()],
        )
        .await
        .expect("start a phase")
        .get(0);
    assert!(
        started.is_some_and(|t| u64::try_from(t).is_ok_and(|t| t > tw)),
        "the starter started a phase: {started:?}"
    );
    starter.batch_execute("ROLLBACK").await.expect("rollback");
    let joiner_on = backend_at(&shared_conn(), &schema).await;
    match shared().acquire_on(joiner_on.clone(), &key).await {
        Ok(lease) => {
            let t = lease.token().get();
            lease.release().await.ok();
            assert!(
                t > tw,
                "reader granted token {t}: the old phase's is {t1}, a writer got {tw} since"
            );
        }
        Err(LockError::Held { .. }) => {}
        Err(other) => panic!("unexpected {other:?}"),
    }
    starter
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .expect("the starter's locks go");
    let reader = shared()
        .acquire_on(joiner_on, &key)
        .await
        .expect("a reader once the starter's locks went");
    assert!(reader.token().get() > tw);
    // A live phase's members hold its token lock: a reader of another
    // process joins it, with its token.
    let joiner = shared()
        .acquire_on(backend_at(&shared_conn(), &schema).await, &key)
        .await
        .expect("a reader joins the live phase");
    assert_eq!(
        joiner.token(),
        reader.token(),
        "overlapping readers, two tokens"
    );
    joiner.release().await.expect("release");
    reader.release().await.expect("release");
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

// ---------------------------------------------------------------------------
// What operators and other callers do to the phase table, the permit
// function and the token sequence while readers and permit holders run.

fn conn() -> String {
    std::env::var("DLOCK_PG_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".to_owned())
}

async fn backend() -> Arc<dyn Backend> {
    Arc::new(
        PgBackend::connect(&conn())
            .await
            .expect("PostgreSQL at 127.0.0.1:5432 or DLOCK_PG_URL"),
    )
}

async fn raw_client() -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&conn(), NoTls)
        .await
        .expect("plain connection");
    tokio::spawn(connection);
    client
}

/// A DBA who empties `dlock_phases` (TRUNCATE, or a DELETE of its rows)
/// while readers hold must not make a new reader draw a token above the
/// current readers': a `>=` fence would then refuse the current readers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_phase_row_never_gives_a_new_reader_a_token_above_a_current_readers() {
    let key = fresh_key("review-phase-row");
    let shared = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let first = shared
        .acquire_on(backend().await, &key)
        .await
        .expect("first reader");
    let first_token = first.token();
    let t1 = i64::try_from(first_token.get()).expect("token fits");
    let deleted = raw_client()
        .await
        .execute(
            "DELETE FROM dlock.dlock_phases WHERE phase_token = $1",
            &[&t1],
        )
        .await
        .expect("delete the phase row");
    assert_eq!(deleted, 1, "the phase row was there");
    // A reader of another backend (its own sessions): the server decides.
    match shared.acquire_on(backend().await, &key).await {
        Ok(second) => {
            assert_eq!(
                second.token(),
                first.token(),
                "a reader overlapping a current one gets its token, never a higher one"
            );
            second.release().await.expect("release");
        }
        Err(LockError::Held { .. }) => {}
        Err(other) => panic!("unexpected {other:?}"),
    }
    first.release().await.expect("release");
    // Once the phase is over, readers come in again, with a fresh token.
    let third = shared
        .acquire_on(backend().await, &key)
        .await
        .expect("a reader once the phase ended");
    assert!(third.token() > first_token);
    third.release().await.expect("release");
}

/// A DBA's transaction that holds `dlock_phases` locked (LOCK TABLE, a
/// TRUNCATE left open) past the lock session's lock_timeout refuses a
/// reader's attempt, which took nothing: the session and every other lease
/// on it live on. In a schema of its own: the table lock would hold up
/// every other test's readers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_phases_table_fails_a_reader_without_losing_the_sessions_other_leases() {
    let schema = pg_support::ScratchSchema::new("locked_phases");
    let pg: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), schema.options().sessions(1))
            .await
            .expect("connect"),
    );
    // The objects exist before the DBA locks the table.
    let warm = LockOptions::new(Duration::from_secs(30))
        .mode(LockMode::Shared)
        .acquire_on(pg.clone(), fresh_key("review-locked-warm"))
        .await
        .expect("reader");
    warm.release().await.expect("release");
    let writer = LockOptions::new(Duration::from_secs(30))
        .acquire_on(pg.clone(), fresh_key("review-locked-other"))
        .await
        .expect("an exclusive lease on the one session");
    let mut dba = raw_client().await;
    let tx = dba.transaction().await.expect("begin");
    tx.batch_execute(&format!(
        "LOCK TABLE \"{}\".dlock_phases IN ACCESS EXCLUSIVE MODE",
        schema.name
    ))
    .await
    .expect("lock the table");
    let reader_key = fresh_key("review-locked-reader");
    let refused = LockOptions::new(Duration::from_secs(30))
        .mode(LockMode::Shared)
        .acquire_on(pg.clone(), &reader_key)
        .await;
    assert!(refused.is_err(), "{refused:?}");
    tx.rollback().await.expect("rollback");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !writer.is_lost(),
        "the exclusive lease on the session lives on after a reader's attempt was refused by a locked table"
    );
    writer.release().await.expect("release");
    // The refused attempt left nothing held: a writer elsewhere takes the key.
    let elsewhere_on: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), schema.options())
            .await
            .expect("connect"),
    );
    let elsewhere = LockOptions::new(Duration::from_secs(30))
        .acquire_on(elsewhere_on, &reader_key)
        .await
        .expect("the refused reader's key is free");
    elsewhere.release().await.expect("release");
}

/// The token sequence set back (`setval`) while readers hold: a reader
/// joining the phase still gets the phase token, and the writer after
/// them, and the readers after it, still get tokens above every earlier
/// one (the draw is floored at the server's clock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_set_back_while_readers_hold_never_lowers_a_later_token() {
    let key = fresh_key("review-setval");
    let shared = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let set_back = || async {
        raw_client()
            .await
            .batch_execute(
                "SELECT pg_catalog.setval('dlock.dlock_token_seq', \
                 GREATEST(1, (SELECT last_value FROM dlock.dlock_token_seq) - 3600000000))",
            )
            .await
            .expect("set the sequence back an hour");
    };
    let first = shared
        .acquire_on(backend().await, &key)
        .await
        .expect("reader");
    set_back().await;
    let second = shared
        .acquire_on(backend().await, &key)
        .await
        .expect("reader");
    assert_eq!(second.token(), first.token(), "the phase token");
    let read_token = first.token();
    first.release().await.expect("release");
    second.release().await.expect("release");
    let writer = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend().await, &key)
        .await
        .expect("writer");
    assert!(writer.token() > read_token);
    let write_token = writer.token();
    writer.release().await.expect("release");
    set_back().await;
    let third = shared
        .acquire_on(backend().await, &key)
        .await
        .expect("reader");
    assert!(
        third.token() > write_token,
        "a reader's token is above the writer's before it"
    );
    third.release().await.expect("release");
}

/// A DBA drops the functions (or the table) while a reader holds: the
/// backend makes them again, and readers and writers keep their rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_functions_mid_run_are_made_again_and_keep_the_phase_token() {
    let key = fresh_key("review-dropped");
    let shared = LockOptions::new(Duration::from_secs(30))
        .mode(LockMode::Shared)
        .wait(Duration::from_secs(5));
    // A schema of its own: the drop must not reach other tests' attempts
    // (one whose function is dropped under it fails, and its session ends).
    let in_schema = || async {
        Arc::new(
            PgBackend::connect_with(
                &conn(),
                dlock::pg::PgOptions::new().schema("dlock_review_drop"),
            )
            .await
            .expect("connect"),
        ) as Arc<dyn Backend>
    };
    let backend_a = in_schema().await;
    let first = shared
        .acquire_on(backend_a.clone(), &key)
        .await
        .expect("reader");
    raw_client()
        .await
        .batch_execute(
            "DROP FUNCTION dlock_review_drop.dlock_join_readers(text, int8); \
             DROP FUNCTION dlock_review_drop.dlock_mark(text, int8, text, int8); \
             DROP FUNCTION dlock_review_drop.dlock_take_permit_slot(text, int8, int4, int4[])",
        )
        .await
        .expect("drop the functions");
    let second = shared.acquire_on(backend_a.clone(), &key).await;
    let second = match second {
        Ok(lease) => lease,
        Err(err) => {
            eprintln!("first attempt after the drop: {err}");
            shared
                .acquire_on(backend_a.clone(), &key)
                .await
                .expect("a reader once the functions are made again")
        }
    };
    assert_eq!(second.token(), first.token(), "the phase token");
    let read_token = first.token();
    first.release().await.expect("release");
    second.release().await.expect("release");
    let writer = LockOptions::new(Duration::from_secs(30))
        .acquire_on(in_schema().await, &key)
        .await
        .expect("writer");
    assert!(writer.token() > read_token);
    writer.release().await.expect("release");
    drop(backend_a);
    let _ = raw_client()
        .await
        .batch_execute("DROP SCHEMA IF EXISTS dlock_review_drop CASCADE")
        .await;
}

/// Shared locks and permits send prepared statements: once a lock session
/// prepared them, an attempt, a release and an in-process reader's check
/// for a writer's mark are one round trip each, and the server parses and
/// plans none of them again. (Sent as text, each would be a prepare and an
/// execution: twice the round trips, and a plan per call.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_and_permit_cycles_parse_no_statement_once_their_session_prepared_them() {
    let config: tokio_postgres::Config = conn().parse().expect("a PostgreSQL connection string");
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let proxy = support::proxy::Proxy::bind_pg(format!("127.0.0.1:{port}")).await;
    let through = format!(
        "host=127.0.0.1 port={} user={} dbname={} sslmode=disable",
        proxy.port,
        config.get_user().unwrap_or("postgres"),
        config.get_dbname().unwrap_or("test"),
    );
    let pg: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&through, dlock::pg::PgOptions::new().sessions(1))
            .await
            .expect("PostgreSQL through the proxy"),
    );
    let ttl = Duration::from_secs(30);
    let (read_key, permit_key) = (fresh_key("prepared-read"), fresh_key("prepared-permit"));
    let cycles = |n: usize| {
        let pg = pg.clone();
        let (read_key, permit_key) = (read_key.clone(), permit_key.clone());
        async move {
            for _ in 0..n {
                let shared = LockOptions::new(ttl).mode(LockMode::Shared);
                let first = shared
                    .acquire_on(pg.clone(), &read_key)
                    .await
                    .expect("reader");
                // Joins the first reader's hold in process: asks the server
                // only whether a writer's mark stands.
                let second = shared
                    .acquire_on(pg.clone(), &read_key)
                    .await
                    .expect("joiner");
                assert_eq!(
                    first.token(),
                    second.token(),
                    "readers of one phase share its token"
                );
                second.release().await.expect("joiner's release");
                first.release().await.expect("reader's release");
                let permit = LockOptions::new(ttl)
                    .permits(2)
                    .acquire_on(pg.clone(), &permit_key)
                    .await
                    .expect("permit");
                permit.release().await.expect("permit's release");
            }
        }
    };
    // The first round makes the functions and prepares the statements.
    cycles(1).await;
    let (parsed, bound) = (proxy.pg_sent(b'P'), proxy.pg_sent(b'B'));
    cycles(10).await;
    assert_eq!(
        proxy.pg_sent(b'P'),
        parsed,
        "a shared or permit cycle prepared a statement again"
    );
    // Each round: the reader's attempt and release, the joiner's check,
    // the permit's attempt and release.
    assert!(
        proxy.pg_sent(b'B') >= bound + 10 * 5,
        "the cycles' statements did not go through the proxy: {} executions",
        proxy.pg_sent(b'B') - bound
    );
}

// Shared locks' and permits' prepared statements under a DBA's changes
// (each statement prepared on its own first use, a failed prepare ending
// no session).

fn scratch_schema(label: &str) -> String {
    let id = dlock_runtime::conformance::fresh_key("s").to_string();
    let tail: String = id
        .chars()
        .rev()
        .filter(|c| c.is_ascii_alphanumeric())
        .take(12)
        .collect();
    format!("dlock_rv_{label}_{}", tail.to_ascii_lowercase())
}

async fn in_schema(schema: &str) -> Arc<dyn Backend> {
    Arc::new(
        PgBackend::connect_with(
            &conn(),
            dlock::pg::PgOptions::new().schema(schema).sessions(1),
        )
        .await
        .expect("connect"),
    )
}

async fn drop_schema(schema: &str) {
    let _ = raw_client()
        .await
        .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
        .await;
}

/// Permits never read `dlock_phases` (`dlock_take_permit_slot` touches no
/// table), so a DBA's change to that table must not reach a permit
/// attempt, let alone the other leases on its session. (When a session
/// prepared every mode statement at once, a permit's first attempt
/// prepared MARKED, which names `dlock_phases.mark_until`, failed with
/// 42703 and ended the session.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dba_change_to_the_phase_table_costs_permits_nothing() {
    let schema = scratch_schema("perm");
    let ttl = Duration::from_secs(30);
    // One backend makes the table and functions.
    let maker = in_schema(&schema).await;
    LockOptions::new(ttl)
        .permits(2)
        .acquire_on(maker.clone(), &fresh_key("rv-maker"))
        .await
        .expect("a permit")
        .release()
        .await
        .expect("release");
    // A DBA changes the table of read phases (used only by shared locks).
    raw_client()
        .await
        .batch_execute(&format!(
            "ALTER TABLE {schema}.dlock_phases RENAME COLUMN mark_until TO mark_expires"
        ))
        .await
        .expect("alter the phase table");
    // Another service: an exclusive lease, then its first permit.
    let service = in_schema(&schema).await;
    let writer = LockOptions::new(ttl)
        .acquire_on(service.clone(), &fresh_key("rv-excl"))
        .await
        .expect("an exclusive lock");
    let permit = LockOptions::new(ttl)
        .permits(2)
        .acquire_on(service.clone(), &fresh_key("rv-permit"))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let writer_lost = writer.is_lost();
    drop_schema(&schema).await;
    let permit = permit.map(|lease| lease.token());
    eprintln!("permit: {permit:?}\nexclusive lease lost: {writer_lost}");
    assert!(
        permit.is_ok(),
        "a permit attempt failed over a table permits never use: {permit:?}"
    );
    assert!(
        !writer_lost,
        "an exclusive lease was lost because a permit attempt on its session failed"
    );
}

/// A service that uses only shared locks never calls `dlock_take_permit_slot`,
/// so a DBA dropping that function must not cost its readers anything.
/// (HOLDS as seen by the caller: a join's mark check on a session that has
/// not prepared fails — the prepare of all five statements trips on the
/// missing function — but the acquire loop retries it until it lands on a
/// prepared session. Nothing runs the setup again meanwhile.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_permit_function_costs_readers_nothing_and_heals() {
    let schema = scratch_schema("join");
    let ttl = Duration::from_secs(30);
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(
            &conn(),
            dlock::pg::PgOptions::new().schema(&schema).sessions(3),
        )
        .await
        .expect("connect"),
    );
    let key = fresh_key("rv-join");
    let shared = LockOptions::new(ttl).mode(LockMode::Shared);
    let first = shared
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the first reader");
    raw_client()
        .await
        .batch_execute(&format!(
            "DROP FUNCTION {schema}.dlock_take_permit_slot(text, int8, int4, int4[])"
        ))
        .await
        .expect("drop the permit function");
    let mut failed = Vec::new();
    for round in 0..30 {
        // Other work of the service (an exclusive lock on another key)
        // moves the round-robin choice of lock session along.
        if round % 3 != 0 {
            LockOptions::new(ttl)
                .acquire_on(backend.clone(), &fresh_key("rv-other"))
                .await
                .expect("an exclusive lock")
                .release()
                .await
                .expect("release");
        }
        match shared.acquire_on(backend.clone(), &key).await {
            Ok(joiner) => {
                assert_eq!(
                    joiner.token(),
                    first.token(),
                    "a joiner shares the phase token"
                );
                joiner.release().await.expect("release");
            }
            Err(err) => failed.push(format!("join {round}: {err}")),
        }
    }
    let first_lost = first.is_lost();
    let _ = first.release().await;
    drop(backend);
    drop_schema(&schema).await;
    eprintln!(
        "{} of 30 joins failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
    assert!(!first_lost, "the first reader's lease was lost");
    assert!(
        failed.is_empty(),
        "joins of a live read phase failed over a function readers never call: {failed:#?}"
    );
}

/// Many tasks use a fresh backend's lock session for the first time at
/// once (each prepares, or waits for the one that does), some of them
/// given up at random points: no error, never more holders than permits,
/// and once everyone is gone every slot can be had again from another
/// backend (nothing is left held on the server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_use_with_cancellations_leaves_nothing_held() {
    let schema = scratch_schema("first");
    let ttl = Duration::from_secs(30);
    let permits = 3u32;
    for round in 0..6u64 {
        let backend = in_schema(&schema).await;
        let key = fresh_key("rv-first");
        let holders = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..24u64 {
            let (backend, key, holders, most) =
                (backend.clone(), key.clone(), holders.clone(), most.clone());
            let mode = i % 2 == 0;
            tasks.push(tokio::spawn(async move {
                let options = if mode {
                    LockOptions::new(ttl).permits(permits)
                } else {
                    LockOptions::new(ttl).mode(LockMode::Shared)
                };
                // Shared and permit attempts of one key would refuse each
                // other: readers take a key of their own.
                let key = if mode {
                    key
                } else {
                    dlock::LockKey::new(format!("{key}:r")).expect("key")
                };
                let give_up = Duration::from_micros((round * 7919 + i * 104_729) % 3000);
                let attempt = options.acquire_on(backend, &key);
                match tokio::time::timeout(give_up, attempt).await {
                    Err(_) => Ok(()),
                    Ok(Err(dlock::LockError::Held { .. })) => Ok(()),
                    Ok(Err(err)) => Err(format!("{err}")),
                    Ok(Ok(lease)) => {
                        if mode {
                            let now = holders.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                            most.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            holders.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        if i % 3 == 0 {
                            drop(lease);
                        } else {
                            lease.release().await.map_err(|e| format!("{e}"))?;
                        }
                        Ok(())
                    }
                }
            }));
        }
        for task in tasks {
            task.await.expect("task").expect("no attempt fails");
        }
        assert!(most.load(std::sync::atomic::Ordering::SeqCst) <= permits as usize);
        drop(backend);
        // Another backend: every slot, and the key exclusively on the
        // readers' key, within a few seconds (drops release best effort).
        let other = in_schema(&schema).await;
        let mut slots = Vec::new();
        for _ in 0..permits {
            slots.push(
                LockOptions::new(ttl)
                    .permits(permits)
                    .wait(Duration::from_secs(5))
                    .acquire_on(other.clone(), &key)
                    .await
                    .expect("every slot free once all are gone"),
            );
        }
        let readers_key = dlock::LockKey::new(format!("{key}:r")).expect("key");
        LockOptions::new(ttl)
            .wait(Duration::from_secs(5))
            .acquire_on(other.clone(), &readers_key)
            .await
            .expect("the readers' key free once all are gone")
            .release()
            .await
            .expect("release");
        for slot in slots {
            slot.release().await.expect("release");
        }
    }
    drop_schema(&schema).await;
}

/// A DBA drops `dlock_phases` while a reader holds, and permit holders
/// hold: the permit holders and the reader keep their leases, new permits
/// come at once, new readers of other keys come after at most one error,
/// and once the phase is over its key is read again with a token above the
/// old phase's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_phase_table_mid_run_heals_and_loses_no_lease() {
    let schema = scratch_schema("tbl");
    let ttl = Duration::from_secs(30);
    let backend = in_schema(&schema).await;
    let shared = LockOptions::new(ttl).mode(LockMode::Shared);
    let key = fresh_key("rv-tbl");
    let reader = shared
        .acquire_on(backend.clone(), &key)
        .await
        .expect("reader");
    let permit_key = fresh_key("rv-tbl-permit");
    let permit = LockOptions::new(ttl)
        .permits(2)
        .acquire_on(backend.clone(), &permit_key)
        .await
        .expect("permit");
    raw_client()
        .await
        .batch_execute(&format!("DROP TABLE {schema}.dlock_phases"))
        .await
        .expect("drop the table");
    let second_permit = LockOptions::new(ttl)
        .permits(2)
        .acquire_on(backend.clone(), &permit_key)
        .await;
    let other = fresh_key("rv-tbl-other");
    let mut errors = Vec::new();
    let mut other_reader = None;
    for _ in 0..3 {
        match shared.acquire_on(backend.clone(), &other).await {
            Ok(lease) => {
                other_reader = Some(lease);
                break;
            }
            Err(err) => errors.push(format!("{err}")),
        }
    }
    let joiner = shared.acquire_on(backend.clone(), &key).await;
    let (reader_lost, permit_lost) = (reader.is_lost(), permit.is_lost());
    eprintln!(
        "second permit: {:?}\nother reader after {} errors: {errors:?}\njoiner: {:?}\nlost: reader {reader_lost} permit {permit_lost}",
        second_permit.as_ref().map(|l| l.token()),
        errors.len(),
        joiner.as_ref().map(|l| l.token()),
    );
    let old = reader.token();
    if let Ok(j) = joiner {
        assert_eq!(j.token(), old);
        j.release().await.expect("release");
    }
    reader.release().await.expect("release");
    let later = shared.acquire_on(backend.clone(), &key).await;
    drop_schema(&schema).await;
    assert!(!reader_lost && !permit_lost, "a lease was lost");
    assert!(second_permit.is_ok(), "a permit while the table was gone");
    assert!(other_reader.is_some() && errors.len() <= 1, "{errors:?}");
    assert!(later.expect("a reader after the phase").token() > old);
}

/// Permits never touch `dlock_phases`, so a DBA's transaction that holds
/// a lock on it (TRUNCATE, ALTER TABLE, VACUUM FULL, LOCK TABLE, left
/// open) must not hold up a permit attempt. (When a session prepared every
/// mode statement at once, a permit's first attempt prepared MARKED, whose
/// parse waited for that lock until the session's `lock_timeout`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dba_lock_on_the_phase_table_does_not_hold_up_permits() {
    let schema = scratch_schema("lockt");
    let ttl = Duration::from_secs(30);
    let maker = in_schema(&schema).await;
    LockOptions::new(ttl)
        .permits(2)
        .acquire_on(maker.clone(), &fresh_key("rv-lockt-maker"))
        .await
        .expect("a permit")
        .release()
        .await
        .expect("release");
    let dba = raw_client().await;
    dba.batch_execute(&format!(
        "BEGIN; LOCK TABLE {schema}.dlock_phases IN ACCESS EXCLUSIVE MODE"
    ))
    .await
    .expect("the DBA's open transaction");
    // A statement held up by the DBA's lock waits for the session's
    // lock_timeout, half the liveness interval: 10 s here, so a permit
    // held up is told from a first attempt that is merely slow.
    let service: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(
            &conn(),
            dlock::pg::PgOptions::new()
                .schema(&schema)
                .sessions(1)
                .liveness_interval(Duration::from_secs(20))
                .server_idle_timeout(Some(Duration::from_secs(45))),
        )
        .await
        .expect("connect"),
    );
    let started = std::time::Instant::now();
    let permit = LockOptions::new(ttl)
        .permits(2)
        .acquire_on(service.clone(), &fresh_key("rv-lockt"))
        .await;
    let took = started.elapsed();
    let _ = dba.batch_execute("COMMIT").await;
    drop_schema(&schema).await;
    let permit = permit.map(|lease| lease.token());
    eprintln!("permit after {took:?}: {permit:?}");
    assert!(permit.is_ok(), "{permit:?}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

/// A key spelled like one of the backend's own advisory locks (a read
/// phase's key, its token's lock, a permit's slot) would hash to that very
/// lock, whatever the seed: such a reader could pose as a member of
/// another key's read phase, so that a reader of that key joins a phase
/// long over (a token below a writer's since), or hold its readers off.
/// Every way of taking such a key is refused as an invalid key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_named_like_the_backends_own_locks_is_refused() {
    let schema = ScratchSchema::new("own_lock_names");
    let backend = backend_at(&shared_conn(), &schema).await;
    let key = fresh_key("own-lock-names");
    for name in [
        format!("dlock-phase:{key}"),
        format!("dlock-phase-token:1796466818527036:{key}"),
        format!("dlock-permit:0:{key}"),
    ] {
        for options in [
            shared(),
            LockOptions::new(Duration::from_secs(10)),
            LockOptions::new(Duration::from_secs(10)).permits(2),
        ] {
            let taken = options.acquire_on(backend.clone(), name.as_str()).await;
            assert!(
                matches!(&taken, Err(LockError::InvalidKey { reason, .. }) if reason.contains("dlock's own")),
                "{name}: {taken:?}"
            );
        }
        let mut client = shared_client().await;
        let mut tx = client.transaction().await.expect("begin");
        let xact = dlock::pg::TransactionLock::new().schema(schema.name.clone());
        let taken = xact.acquire(&mut tx, name.as_str()).await;
        assert!(
            matches!(&taken, Err(LockError::InvalidKey { .. })),
            "{name} in a transaction: {taken:?}"
        );
    }
    // The key itself, and a name that only contains such a text, lock.
    for name in [key.to_string(), format!("x-dlock-phase:{key}")] {
        let lease = shared()
            .acquire_on(backend.clone(), name.as_str())
            .await
            .expect("a key of the user's own");
        lease.release().await.expect("release");
    }
}

/// The error of a first shared attempt whose table and functions cannot
/// be made names the missing privilege only when a privilege is what was
/// refused: a role without CREATE on the schema is told so, while a setup
/// that waited too long for a DBA's transaction is not sent to ask for a
/// grant it already has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_modes_setup_names_create_only_when_the_privilege_was_refused() {
    let admin = shared_client().await;
    let read = LockOptions::new(Duration::from_secs(10)).mode(LockMode::Shared);

    let mut denied = ScratchSchema::new("modes_denied");
    let url = denied.role_without_create(&admin).await;
    let backend = backend_at(&url, &denied).await;
    let refused = read
        .acquire_on(backend.clone(), &fresh_key("modes-denied"))
        .await
        .expect_err("no CREATE on the schema");
    assert!(
        refused.to_string().contains("needs CREATE on the schema"),
        "{refused}"
    );

    let schema = ScratchSchema::new("modes_setup_locked");
    let backend = backend_with(
        &shared_conn(),
        schema
            .options()
            .liveness_interval(Duration::from_millis(300)),
    )
    .await;
    // A DBA's CREATE TABLE of the same name left open: the setup's own
    // waits for it past the session's lock_timeout (half the liveness
    // interval, short: the setup holds the setup lock of every schema
    // while it waits).
    let mut holder = pg_support::client_of(&shared_conn()).await;
    let dba = holder.transaction().await.expect("begin");
    dba.batch_execute(&format!(
        "CREATE TABLE {}.dlock_phases (x int)",
        schema.name
    ))
    .await
    .expect("create the table, uncommitted");
    let waited = read
        .acquire_on(backend.clone(), &fresh_key("modes-setup-locked"))
        .await
        .expect_err("the schema is locked");
    dba.rollback().await.expect("rollback");
    let text = waited.to_string();
    assert!(
        text.contains("cannot create the table and functions") && !text.contains("CREATE on"),
        "{text}"
    );
    drop(schema);
    drop(denied);
}

/// A shared attempt whose call finds dlock's functions dropped is the
/// call's own failure, not a DBA's trigger's at commit, on a connection
/// whose role logs parameters on error and for a key holding a newline:
/// the session lives on, and so does the reader held on it. Read as a
/// trigger's, the error ended the session and lost the reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_call_failing_on_dropped_functions_keeps_the_session_whatever_is_logged() {
    let scratch = ScratchSchema::new("modes_logged");
    let conn = format!(
        "{} options='-c log_parameter_max_length_on_error=-1'",
        shared_conn()
    );
    let backend = backend_with(&conn, scratch.options().sessions(1)).await;
    let shared = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    let reader = shared
        .acquire_on(backend.clone(), &fresh_key("logged-reader"))
        .await
        .expect("a reader");
    shared_client()
        .await
        .batch_execute(&format!(
            "DROP FUNCTION {s}.dlock_join_readers(text, int8); \
             DROP FUNCTION {s}.dlock_mark(text, int8, text, int8); \
             DROP FUNCTION {s}.dlock_take_permit_slot(text, int8, int4, int4[])",
            s = scratch.name
        ))
        .await
        .expect("drop the functions");
    let key = LockKey::new(format!("{}\nline two", fresh_key("logged-other"))).expect("a key");
    // Made again and granted, or refused: either way the call's own.
    let _ = shared.acquire_on(backend.clone(), &key).await;
    assert!(
        !reader.is_lost(),
        "the reader on the session was lost: {:?}",
        reader.check()
    );
    reader.release().await.expect("release");
}

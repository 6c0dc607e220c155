//! Shared locks on PostgreSQL when a read phase's start fails under a
//! joiner, or runs under a DBA's settings: a reader's token stays above
//! every writer's before it, and overlapping readers share one. Each test
//! has a schema of its own, so a DBA's table lock or a terminated session
//! there touches no other test.

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::tokio_postgres::{self, NoTls};
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, LockError, LockMode, LockOptions};
use dlock_runtime::conformance::fresh_key;

fn conn() -> String {
    std::env::var("DLOCK_PG_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".to_owned())
}

/// A schema of the test's own, dropped when the test ends.
struct Schema(String);

impl Schema {
    fn new(what: &str) -> Self {
        let key = fresh_key(what);
        let tag: String = key
            .as_str()
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .collect::<String>()
            .to_ascii_lowercase();
        Self(format!("dlock_t_{}", &tag[tag.len().saturating_sub(16)..]))
    }

    /// `dlock_phases` of this schema, for SQL.
    fn phases(&self) -> String {
        format!("\"{}\".dlock_phases", self.0)
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        let sql = format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.0);
        let _ = std::process::Command::new("psql")
            .args([
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-d",
                "test",
                "-qc",
                &sql,
            ])
            .output();
    }
}

async fn backend_at(url: &str, schema: &Schema) -> Arc<dyn Backend> {
    Arc::new(
        PgBackend::connect_with(url, PgOptions::new().schema(&schema.0))
            .await
            .expect("PostgreSQL"),
    )
}

async fn backend(schema: &Schema) -> Arc<dyn Backend> {
    backend_at(&conn(), schema).await
}

async fn raw_client() -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&conn(), NoTls)
        .await
        .expect("plain connection");
    tokio::spawn(connection);
    client
}

fn shared() -> LockOptions {
    LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared)
}

/// Phase 1 (a reader), then a writer, so the key's row keeps the old
/// phase's token, below the writer's. Returns (old phase token, writer token).
async fn old_phase_then_writer(on: &Arc<dyn Backend>, key: &dlock::LockKey) -> (u64, u64) {
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

/// A starter whose statement fails after its transaction-level try of the
/// phase key was granted (here: its upsert waits past lock_timeout for a
/// DBA's lock on dlock_phases) rolls back; a joiner of another process that
/// was waiting on the phase key behind it is then granted the phase key and
/// reads the row the starter never wrote: the *old* phase's token, below the
/// writer's token issued since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_behind_a_failed_starter_never_gets_the_old_phases_token() {
    let schema = Schema::new("review2-failed-starter");
    let key = fresh_key("review2-failed-starter");
    let a = backend(&schema).await;
    let (t1, tw) = old_phase_then_writer(&a, &key).await;
    let mut dba = raw_client().await;
    let tx = dba.transaction().await.expect("begin");
    // Blocks INSERT/UPDATE, not SELECT: the mark check and the joiner's read go through.
    tx.batch_execute(&format!("LOCK TABLE {} IN EXCLUSIVE MODE", schema.phases()))
        .await
        .expect("lock the table");
    let starter_on = backend(&schema).await;
    let joiner_on = backend(&schema).await;
    let k = key.clone();
    let starter = tokio::spawn(async move { shared().acquire_on(starter_on, &k).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let k = key.clone();
    let joiner = tokio::spawn(async move { shared().acquire_on(joiner_on, &k).await });
    let started = starter.await.expect("join");
    assert!(
        started.is_err(),
        "the starter's upsert waited past lock_timeout: {started:?}"
    );
    let joined = joiner.await.expect("join");
    tx.rollback().await.expect("rollback");
    match joined {
        Ok(lease) => {
            let t = lease.token().get();
            lease.release().await.ok();
            assert!(
                t > tw,
                "reader granted token {t}: the old phase's is {t1}, a writer got {tw} since"
            );
        }
        Err(LockError::Held { .. }) | Err(LockError::Backend { .. }) => {}
        Err(other) => panic!("unexpected {other:?}"),
    }
}

/// The same, the starter's server process ended by a DBA
/// (`pg_terminate_backend`) while its upsert waits: its transaction rolls
/// back, and the joiner waiting behind it reads the old phase's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_behind_a_terminated_starter_never_gets_the_old_phases_token() {
    let schema = Schema::new("review2-killed-starter");
    let key = fresh_key("review2-killed-starter");
    let a = backend(&schema).await;
    let (t1, tw) = old_phase_then_writer(&a, &key).await;
    let mut dba = raw_client().await;
    let tx = dba.transaction().await.expect("begin");
    tx.batch_execute(&format!("LOCK TABLE {} IN EXCLUSIVE MODE", schema.phases()))
        .await
        .expect("lock the table");
    let starter_on = backend(&schema).await;
    let joiner_on = backend(&schema).await;
    let k = key.clone();
    let starter = tokio::spawn(async move { shared().acquire_on(starter_on, &k).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let k = key.clone();
    let joiner = tokio::spawn(async move { shared().acquire_on(joiner_on, &k).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    // The starter: the session waiting for a relation lock on dlock_phases.
    let killed = raw_client()
        .await
        .query(
            "SELECT pg_terminate_backend(l.pid) FROM pg_locks AS l
             WHERE l.locktype = 'relation' AND NOT l.granted
               AND l.relation = $1::text::regclass",
            &[&schema.phases()],
        )
        .await
        .expect("terminate the starter");
    assert_eq!(killed.len(), 1, "one starter waited for the table");
    let started = starter.await.expect("join");
    assert!(started.is_err(), "{started:?}");
    let joined = joiner.await.expect("join");
    tx.rollback().await.expect("rollback");
    match joined {
        Ok(lease) => {
            let t = lease.token().get();
            lease.release().await.ok();
            assert!(
                t > tw,
                "reader granted token {t}: the old phase's is {t1}, a writer got {tw} since"
            );
        }
        Err(LockError::Held { .. }) | Err(LockError::Backend { .. }) => {}
        Err(other) => panic!("unexpected {other:?}"),
    }
}

/// A role or database whose `default_transaction_isolation` is
/// `repeatable read` or `serializable` (a DBA's setting, as statement_timeout on the role is):
/// a joiner's snapshot is its statement's start, taken before it waited
/// for the starter's commit, so it reads the old phase's token while the
/// starter's readers hold the new one: two overlapping readers with two
/// tokens, one below the writer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_under_repeatable_read_gets_the_starters_token() {
    let schema = Schema::new("review2-rr-joiner");
    let key = fresh_key("review2-rr-joiner");
    let a = backend(&schema).await;
    let (t1, tw) = old_phase_then_writer(&a, &key).await;
    let mut dba = raw_client().await;
    let tx = dba.transaction().await.expect("begin");
    tx.batch_execute(&format!("LOCK TABLE {} IN EXCLUSIVE MODE", schema.phases()))
        .await
        .expect("lock the table");
    let starter_on = backend(&schema).await;
    let joiner_on = backend_at(
        &format!(
            "{} options='-c default_transaction_isolation=serializable'",
            conn()
        ),
        &schema,
    )
    .await;
    let k = key.clone();
    let starter = tokio::spawn(async move { shared().acquire_on(starter_on, &k).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let k = key.clone();
    let joiner = tokio::spawn(async move { shared().acquire_on(joiner_on, &k).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    // The DBA lets go: the starter writes its token and commits.
    tx.rollback().await.expect("rollback");
    let started = starter
        .await
        .expect("join")
        .expect("the starter gets the key");
    let joined = joiner.await.expect("join");
    match joined {
        Ok(lease) => {
            let (t, ts) = (lease.token().get(), started.token().get());
            lease.release().await.ok();
            started.release().await.ok();
            assert!(
                t == ts && t > tw,
                "overlapping readers got {ts} and {t}: the old phase's is {t1}, a writer got {tw} since"
            );
        }
        Err(LockError::Held { .. }) | Err(LockError::Backend { .. }) => {
            started.release().await.ok();
        }
        Err(other) => panic!("unexpected {other:?}"),
    }
}

/// The pid of a session holding `key`'s advisory lock shared (seed 0).
async fn shared_holder_pid(key: &dlock::LockKey) -> Option<i32> {
    raw_client()
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
    let schema = Schema::new("review2-join-dead");
    let mut doubles = 0;
    let rounds = 4;
    for _ in 0..rounds {
        let key = fresh_key("review2-join-dead");
        let a = backend(&schema).await;
        let b = backend(&schema).await;
        let first = shared()
            .acquire_on(a.clone(), &key)
            .await
            .expect("first reader");
        let pid = shared_holder_pid(&key).await.expect("the hold's session");
        raw_client()
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

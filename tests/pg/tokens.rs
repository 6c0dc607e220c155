//! Fencing tokens of `PgBackend` and `TransactionLock` when the token
//! sequence is tampered with while services run — dropped and recreated,
//! set back, dropped for good, raced over — and pre-created sequences whose
//! settings cannot give rising tokens. Each test works in a schema of its
//! own on the shared server (127.0.0.1:5432, or `DLOCK_PG_URL`), dropped
//! again at the end, so the tests run in parallel and repeatedly.

use crate::pg_support;
use crate::support;

use pg_support::{free_on_the_server, freed_on_the_server};
use std::sync::Arc;
use std::time::Duration;
use support::within;

use dlock::backend::OwnerId;
use dlock::pg::fence::PgFence;
use dlock::pg::tokio_postgres::{self, NoTls};
use dlock::pg::{PgBackend, PgOptions, TransactionLock};
use dlock::{Backend, FencingToken, LockError, LockKey, LockOptions};

fn conn() -> String {
    std::env::var("DLOCK_PG_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".to_owned())
}

/// A plain client, as a DBA or an application would use.
async fn client() -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&conn(), NoTls)
        .await
        .expect("PostgreSQL at 127.0.0.1:5432 or DLOCK_PG_URL");
    tokio::spawn(connection);
    client
}

fn random_id() -> String {
    OwnerId::random().expect("random bytes").to_string()[..12].to_owned()
}

fn fresh_key(label: &str) -> LockKey {
    LockKey::new(format!("dlock-test:{label}:{}", random_id())).expect("valid key")
}

/// A schema of the test's own (and, if asked for, a login role), dropped
/// with everything in it when the test ends, even if it panicked.
struct Scratch {
    schema: String,
    role: Option<String>,
}

impl Scratch {
    fn new() -> Self {
        Self {
            schema: format!("dlock_tok_{}", random_id()),
            role: None,
        }
    }

    /// The token sequence, as SQL names it.
    fn seq(&self) -> String {
        format!("{}.dlock_token_seq", self.schema)
    }

    fn options(&self) -> PgOptions {
        PgOptions::new().schema(&self.schema)
    }

    fn xact(&self) -> TransactionLock {
        TransactionLock::new().schema(&self.schema)
    }

    /// A role that may only use the schema and the sequence (USAGE on
    /// both: no CREATE, no UPDATE), and a connection string for it.
    async fn usage_only_role(&mut self, admin: &tokio_postgres::Client) -> String {
        let role = format!("dlock_tok_role_{}", random_id());
        admin
            .batch_execute(&format!(
                "CREATE ROLE {role} LOGIN; \
                 CREATE SCHEMA {s}; CREATE SEQUENCE {s}.dlock_token_seq AS bigint; \
                 GRANT USAGE ON SCHEMA {s} TO {role}; \
                 GRANT USAGE ON SEQUENCE {s}.dlock_token_seq TO {role};",
                s = self.schema
            ))
            .await
            .expect("role and objects");
        self.role = Some(role.clone());
        let config: tokio_postgres::Config = conn().parse().expect("config");
        format!(
            "host=127.0.0.1 port={} user={role} dbname={}",
            config.get_ports().first().copied().unwrap_or(5432),
            config.get_dbname().unwrap_or("test"),
        )
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let mut sql = format!("DROP SCHEMA IF EXISTS {} CASCADE;", self.schema);
        if let Some(role) = &self.role {
            sql.push_str(&format!(" DROP ROLE IF EXISTS {role};"));
        }
        // A runtime of its own on a thread of its own: this may run while
        // the test's runtime is unwinding.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async move {
                let (client, connection) = tokio_postgres::connect(&conn(), NoTls).await.ok()?;
                tokio::spawn(connection);
                client.batch_execute(&sql).await.ok()
            })
        })
        .join();
    }
}

/// Takes `key` and gives it back at once: the token the holder had.
async fn hold_once(backend: &Arc<dyn Backend>, key: &LockKey) -> FencingToken {
    let lease = LockOptions::new(Duration::from_secs(30))
        .wait(Duration::from_secs(5))
        .acquire_on(Arc::clone(backend), key)
        .await
        .expect("the key is free");
    let token = lease.token();
    lease.release().await.expect("release");
    token
}

/// Takes `key` in a transaction of its own (waiting or not), commits, and
/// returns the token.
async fn hold_in_transaction(
    client: &mut tokio_postgres::Client,
    lock: &TransactionLock,
    key: &LockKey,
    wait: bool,
) -> Result<FencingToken, LockError> {
    let lock = if wait {
        lock.clone().wait(Duration::from_secs(5))
    } else {
        lock.clone()
    };
    let mut tx = client.transaction().await.expect("begin");
    let token = lock.acquire(&mut tx, key).await;
    tx.commit().await.expect("commit");
    token
}

/// A write to `resource` fenced with `token`, committed if the fence
/// accepts it, rolled back if not.
async fn fenced_write(
    client: &mut tokio_postgres::Client,
    fence: &PgFence,
    resource: &str,
    token: FencingToken,
) -> Result<(), LockError> {
    let tx = client.transaction().await.expect("begin");
    let accepted = fence.accept(&tx, resource, token).await;
    if accepted.is_ok() {
        tx.commit().await.expect("commit");
    } else {
        tx.rollback().await.expect("rollback");
    }
    accepted
}

/// Ends the backend's lock sessions, as `pg_terminate_backend` from a DBA
/// or a failover would, and waits until they are gone.
async fn terminate_lock_sessions(admin: &tokio_postgres::Client, backend: &PgBackend) -> Vec<i32> {
    let pids = backend.session_pids().await;
    assert!(!pids.is_empty(), "the backend has lock sessions");
    admin
        .query(
            "SELECT pg_terminate_backend(pid, 5000) FROM unnest($1::int[]) AS pid",
            &[&pids],
        )
        .await
        .expect("terminate");
    pids
}

/// The error of the first acquisition of `key` whose error says `refusal`,
/// once the backend's lock sessions have reopened on a sequence it must
/// refuse (`what`); an acquisition that succeeds instead fails the test.
async fn refused_once_a_session_reopens(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    refusal: &str,
    what: &str,
) -> dlock::LockError {
    within(20, "an acquisition on a reopened session", async {
        loop {
            match LockOptions::new(Duration::from_secs(30))
                .acquire_on(Arc::clone(backend), key)
                .await
            {
                Err(err) if err.to_string().contains(refusal) => break err,
                Err(err) => eprintln!("not yet: {err}"),
                Ok(lease) => {
                    let token = lease.token();
                    lease.release().await.expect("release");
                    panic!("a session opened on {what} (token {token})");
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
}

/// The next holder of `key` once the backend has replaced its ended
/// sessions (the first attempts may still meet a session ending).
async fn hold_once_reconnected(backend: &Arc<dyn Backend>, key: &LockKey) -> FencingToken {
    within(20, "an acquisition after the sessions ended", async {
        loop {
            match LockOptions::new(Duration::from_secs(30))
                .wait(Duration::from_secs(5))
                .acquire_on(Arc::clone(backend), key)
                .await
            {
                Ok(lease) => {
                    let token = lease.token();
                    lease.release().await.expect("release");
                    return token;
                }
                Err(err) => {
                    eprintln!("not yet: {err}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_dropped_and_recreated_while_connected_still_gives_the_next_holder_a_higher_token()
 {
    let scratch = Scratch::new();
    let mut admin = client().await;
    let pg = PgBackend::connect_with(&conn(), scratch.options().sessions(2))
        .await
        .expect("connect");
    let backend: Arc<dyn Backend> = Arc::new(pg);
    let key = fresh_key("recreated");
    let fence = PgFence::new().schema(&scratch.schema);
    fence.create_table(&admin).await.expect("fence table");
    let resource = key.to_string();

    // Holders on both lock sessions, so both have the lock statement
    // prepared against the old sequence.
    let mut highest = FencingToken::new(0);
    for _ in 0..4 {
        highest = highest.max(hold_once(&backend, &key).await);
    }
    // The last holder before the DBA's change writes under its token; it
    // will come back later, paused past its lease.
    let stale = hold_once(&backend, &key).await;
    assert!(stale > highest);
    fenced_write(&mut admin, &fence, &resource, stale)
        .await
        .expect("the holder's write");

    admin
        .batch_execute(&format!(
            "DROP SEQUENCE {seq}; CREATE SEQUENCE {seq} AS bigint;",
            seq = scratch.seq()
        ))
        .await
        .expect("drop and recreate");

    let mut previous = stale;
    for round in 0..4 {
        let token = hold_once(&backend, &key).await;
        assert!(
            token > previous,
            "holder {round} after the sequence was recreated got {token}, not above {previous}"
        );
        previous = token;
    }
    // The current holder's write is accepted, the stale holder's refused.
    fenced_write(&mut admin, &fence, &resource, previous)
        .await
        .expect("the current holder's write");
    let refused = fenced_write(&mut admin, &fence, &resource, stale).await;
    assert!(
        matches!(refused, Err(LockError::StaleToken { .. })),
        "{refused:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_set_back_while_the_lock_sessions_reconnect_still_gives_rising_tokens() {
    let scratch = Scratch::new();
    let admin = client().await;
    let pg = PgBackend::connect_with(&conn(), scratch.options().sessions(2))
        .await
        .expect("connect");
    let backend: Arc<dyn Backend> = Arc::new(pg.clone());
    let key = fresh_key("set-back");
    let mut highest = FencingToken::new(0);
    for _ in 0..4 {
        highest = highest.max(hold_once(&backend, &key).await);
    }

    // A failover to a replica that missed the latest WAL, or a restore:
    // the sequence is back where it started, and the sessions reconnect.
    admin
        .query_one(&format!("SELECT setval('{}', 1)", scratch.seq()), &[])
        .await
        .expect("setval");
    let ended = terminate_lock_sessions(&admin, &pg).await;

    let mut previous = highest;
    for round in 0..4 {
        let token = hold_once_reconnected(&backend, &key).await;
        assert!(
            token > previous,
            "holder {round} after the sequence went back got {token}, not above {previous}"
        );
        previous = token;
    }
    let now = pg.session_pids().await;
    assert!(
        now.iter().all(|pid| !ended.contains(pid)),
        "the lock sessions were replaced: {ended:?} -> {now:?}"
    );
}

/// What a fault to the sequence does to transaction locks: tokens taken in
/// an application's transactions (with and without waiting) before the
/// fault, then after it, must keep rising.
async fn transaction_lock_tokens_rise_across(label: &str, fault: &str, reconnect: bool) {
    let scratch = Scratch::new();
    let admin = client().await;
    let _creates_the_sequence = PgBackend::connect_with(&conn(), scratch.options())
        .await
        .expect("connect");
    let mut app = client().await;
    let lock = scratch.xact();
    let key = fresh_key(label);
    let mut highest = FencingToken::new(0);
    for wait in [false, true, false, true] {
        let token = hold_in_transaction(&mut app, &lock, &key, wait)
            .await
            .expect("free");
        highest = highest.max(token);
    }

    admin
        .batch_execute(&fault.replace("{seq}", &scratch.seq()))
        .await
        .expect("the fault");
    if reconnect {
        // A failover ends every connection, the application's too.
        app = client().await;
    }

    let mut previous = highest;
    for wait in [false, true, false, true] {
        let token = hold_in_transaction(&mut app, &lock, &key, wait)
            .await
            .expect("free");
        assert!(
            token > previous,
            "a transaction lock (wait: {wait}) after `{fault}` got {token}, not above {previous}"
        );
        previous = token;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_locks_after_the_sequence_is_dropped_and_recreated_still_get_higher_tokens() {
    let recreate = "DROP SEQUENCE {seq}; CREATE SEQUENCE {seq} AS bigint;";
    transaction_lock_tokens_rise_across("xact-recreated", recreate, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_locks_after_the_sequence_is_set_back_still_get_higher_tokens() {
    transaction_lock_tokens_rise_across("xact-set-back", "SELECT setval('{seq}', 1)", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_dropped_for_good_is_recreated_by_the_backend_and_tokens_keep_rising() {
    let scratch = Scratch::new();
    let admin = client().await;
    let pg = PgBackend::connect_with(&conn(), scratch.options().sessions(2))
        .await
        .expect("connect");
    let backend: Arc<dyn Backend> = Arc::new(pg.clone());
    let key = fresh_key("dropped");
    let mut highest = FencingToken::new(0);
    for _ in 0..4 {
        highest = highest.max(hold_once(&backend, &key).await);
    }

    admin
        .batch_execute(&format!("DROP SEQUENCE {}", scratch.seq()))
        .await
        .expect("drop");

    // Several acquirers meet the missing sequence at once.
    let tasks: Vec<_> = (0..6)
        .map(|i| {
            let backend = Arc::clone(&backend);
            tokio::spawn(async move {
                let other = fresh_key(&format!("dropped-{i}"));
                within(20, "an acquisition meeting a dropped sequence", async {
                    hold_once(&backend, &other).await
                })
                .await
            })
        })
        .collect();
    for task in tasks {
        assert!(task.await.expect("task") > highest);
    }
    let mut previous = highest;
    for round in 0..4 {
        let token = hold_once(&backend, &key).await;
        assert!(
            token > previous,
            "holder {round} after the sequence was dropped got {token}, not above {previous}"
        );
        previous = token;
    }
    let exists: bool = admin
        .query_one(
            "SELECT to_regclass($1::text) IS NOT NULL",
            &[&scratch.seq()],
        )
        .await
        .expect("look")
        .get(0);
    assert!(exists, "the backend recreated the sequence");

    // Dropped again, and the lock sessions end before any lock statement
    // meets the gap: the sessions that replace them recreate it.
    admin
        .batch_execute(&format!("DROP SEQUENCE {}", scratch.seq()))
        .await
        .expect("drop");
    terminate_lock_sessions(&admin, &pg).await;
    for round in 0..4 {
        let token = hold_once_reconnected(&backend, &key).await;
        assert!(
            token > previous,
            "holder {round} after the sequence was dropped and the sessions ended got {token}, \
             not above {previous}"
        );
        previous = token;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_dropped_for_good_that_the_role_may_not_recreate_is_an_error_naming_it_and_the_fix()
 {
    let mut scratch = Scratch::new();
    let admin = client().await;
    let role_conn = scratch.usage_only_role(&admin).await;
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&role_conn, scratch.options())
            .await
            .expect("a USAGE-only role connects"),
    );
    let key = fresh_key("dropped-no-create");
    // USAGE alone draws tokens: without UPDATE the sequence is not moved
    // up, and the clock floors them.
    let first = hold_once(&backend, &key).await;
    assert!(hold_once(&backend, &key).await > first);

    admin
        .batch_execute(&format!("DROP SEQUENCE {}", scratch.seq()))
        .await
        .expect("drop");
    let err = within(
        20,
        "an acquisition meeting a dropped sequence",
        LockOptions::new(Duration::from_secs(30)).acquire_on(Arc::clone(&backend), &key),
    )
    .await
    .expect_err("the sequence is gone and the role may not create it");
    let text = err.to_string();
    eprintln!("{text}");
    assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
    assert!(
        text.contains(&format!(
            "the token sequence \"{}\".dlock_token_seq is missing",
            scratch.schema
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "CREATE SEQUENCE IF NOT EXISTS \"{}\".dlock_token_seq",
            scratch.schema
        )),
        "{text}"
    );
    assert!(
        std::error::Error::source(&err).is_some(),
        "the cause is kept"
    );

    // Once a DBA has run what the error named, locking works again.
    admin
        .batch_execute(&format!(
            "CREATE SEQUENCE {seq} AS bigint; GRANT USAGE ON SEQUENCE {seq} TO {role};",
            seq = scratch.seq(),
            role = scratch.role.as_deref().unwrap_or_default()
        ))
        .await
        .expect("recreate");
    assert!(hold_once(&backend, &key).await > first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_lock_on_a_dropped_sequence_is_an_error_naming_it_and_the_fix() {
    let scratch = Scratch::new();
    let admin = client().await;
    let _creates_the_sequence = PgBackend::connect_with(&conn(), scratch.options())
        .await
        .expect("connect");
    admin
        .batch_execute(&format!("DROP SEQUENCE {}", scratch.seq()))
        .await
        .expect("drop");
    let mut app = client().await;
    for wait in [false, true] {
        let lock = if wait {
            scratch.xact().wait(Duration::from_secs(5))
        } else {
            scratch.xact()
        };
        let mut tx = app.transaction().await.expect("begin");
        let err = lock
            .acquire(&mut tx, fresh_key("xact-dropped"))
            .await
            .expect_err("no sequence");
        tx.rollback().await.expect("rollback");
        let text = err.to_string();
        eprintln!("{text}");
        assert!(
            text.contains(&format!(
                "the token sequence \"{}\".dlock_token_seq is missing",
                scratch.schema
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "CREATE SEQUENCE IF NOT EXISTS \"{}\".dlock_token_seq",
                scratch.schema
            )),
            "{text}"
        );
    }
}

/// Pre-creates the sequence with `options`, checks that connecting refuses
/// it with a message naming each of `problems` and an `ALTER SEQUENCE`, runs
/// that statement, and checks that the fixed sequence is accepted and
/// hands out tokens.
async fn refused_with_a_fix_that_works(options: &str, problems: &[&str]) {
    let scratch = Scratch::new();
    let admin = client().await;
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA {}; CREATE SEQUENCE {} {options};",
            scratch.schema,
            scratch.seq()
        ))
        .await
        .expect("pre-create");
    let err = PgBackend::connect_with(&conn(), scratch.options())
        .await
        .expect_err("a sequence that cannot give rising tokens is refused");
    let text = err.to_string();
    eprintln!("{text}");
    assert!(
        matches!(
            err,
            LockError::Backend {
                operation: dlock::error::Operation::Connect,
                ..
            }
        ),
        "{err:?}"
    );
    for problem in problems {
        assert!(text.contains(problem), "{problem:?} is not named: {text}");
    }
    let fix = text
        .find("ALTER SEQUENCE")
        .map(|at| &text[at..])
        .unwrap_or_else(|| panic!("no ALTER SEQUENCE in: {text}"));
    admin.batch_execute(fix).await.expect("the fix runs");
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), scratch.options())
            .await
            .expect("the fixed sequence is accepted"),
    );
    let key = fresh_key("fixed");
    let first = hold_once(&backend, &key).await;
    assert!(hold_once(&backend, &key).await > first);
}

#[tokio::test]
async fn a_pre_created_sequence_with_cache_20_is_refused_with_the_alter_that_fixes_it() {
    refused_with_a_fix_that_works("AS bigint CACHE 20", &["CACHE 20"]).await;
}

#[tokio::test]
async fn a_pre_created_cycling_sequence_is_refused_with_the_alter_that_fixes_it() {
    refused_with_a_fix_that_works("AS bigint CYCLE", &["CYCLE"]).await;
}

#[tokio::test]
async fn a_pre_created_falling_sequence_is_refused_with_the_alter_that_fixes_it() {
    refused_with_a_fix_that_works("AS bigint INCREMENT BY -1", &["INCREMENT BY -1"]).await;
}

#[tokio::test]
async fn a_pre_created_integer_sequence_is_refused_with_the_alter_that_fixes_it() {
    refused_with_a_fix_that_works("AS integer", &["MAXVALUE 2147483647 (AS integer)"]).await;
}

#[tokio::test]
async fn a_pre_created_sequence_without_a_century_of_room_above_the_clock_is_refused() {
    // Above today's clock in microseconds (about 1.8e15), below it plus a
    // century (about 3.2e15 more).
    refused_with_a_fix_that_works(
        "AS bigint MAXVALUE 4000000000000000",
        &["MAXVALUE 4000000000000000", "less than a century"],
    )
    .await;
}

#[tokio::test]
async fn a_pre_created_sequence_with_every_fault_is_refused_with_one_alter_for_all() {
    refused_with_a_fix_that_works(
        "AS smallint INCREMENT BY -5 CACHE 3 CYCLE",
        &["INCREMENT BY -5", "AS smallint", "CYCLE", "CACHE 3"],
    )
    .await;
}

#[tokio::test]
async fn a_pre_created_sequence_far_ahead_of_the_clock_is_refused_with_the_restart_that_fixes_it() {
    // Its tokens would come from the sequence alone; recreated or restored
    // later, tokens would fall back to the clock, below every one it gave.
    refused_with_a_fix_that_works(
        "AS bigint START WITH 4000000000000000000",
        &[
            "stands at 4000000000000000000",
            "ahead of the server clock",
            "clock floor could not",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_set_far_ahead_of_the_clock_while_running_is_refused_when_a_lock_session_reopens()
 {
    let scratch = Scratch::new();
    let admin = client().await;
    let pg = PgBackend::connect_with(&conn(), scratch.options().sessions(1))
        .await
        .expect("connect");
    let backend: Arc<dyn Backend> = Arc::new(pg.clone());
    let key = fresh_key("far-ahead");
    hold_once(&backend, &key).await;

    admin
        .query_one(
            &format!("SELECT setval('{}', 4000000000000000000)", scratch.seq()),
            &[],
        )
        .await
        .expect("setval");
    terminate_lock_sessions(&admin, &pg).await;
    let err = refused_once_a_session_reopens(
        &backend,
        &key,
        "ahead of the server clock",
        "a sequence far ahead of the clock",
    )
    .await;
    eprintln!("{err}");
    assert!(err.to_string().contains("START WITH 1 RESTART;"), "{err}");
}

/// Not a regression test (today's code accepts it too): guards against
/// refusing a sequence a DBA set up well, with other settings than dlock's.
#[tokio::test]
async fn a_good_pre_created_sequence_is_accepted() {
    let scratch = Scratch::new();
    let admin = client().await;
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA {}; \
             CREATE SEQUENCE {} AS bigint INCREMENT BY 3 START WITH 1000 CACHE 1 NO CYCLE;",
            scratch.schema,
            scratch.seq()
        ))
        .await
        .expect("pre-create");
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), scratch.options())
            .await
            .expect("accepted"),
    );
    let key = fresh_key("good");
    let first = hold_once(&backend, &key).await;
    assert!(hold_once(&backend, &key).await > first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_altered_to_cache_20_while_running_is_refused_when_a_lock_session_reopens() {
    let scratch = Scratch::new();
    let admin = client().await;
    let pg = PgBackend::connect_with(&conn(), scratch.options().sessions(1))
        .await
        .expect("connect");
    let backend: Arc<dyn Backend> = Arc::new(pg.clone());
    let key = fresh_key("altered");
    let first = hold_once(&backend, &key).await;

    admin
        .batch_execute(&format!("ALTER SEQUENCE {} CACHE 20", scratch.seq()))
        .await
        .expect("alter");
    terminate_lock_sessions(&admin, &pg).await;
    let err =
        refused_once_a_session_reopens(&backend, &key, "cannot give rising", "a CACHE 20 sequence")
            .await;
    let text = err.to_string();
    eprintln!("{text}");
    assert!(text.contains("CACHE 20"), "{text}");
    assert!(text.contains("CACHE 1;"), "{text}");

    admin
        .batch_execute(&format!("ALTER SEQUENCE {} CACHE 1", scratch.seq()))
        .await
        .expect("fix");
    assert!(hold_once(&backend, &key).await > first);
}

/// Moves the sequence an hour ahead of the server clock: the state a clock
/// stepped back by an hour leaves, in which tokens come from the sequence.
async fn clock_steps_back_an_hour(admin: &tokio_postgres::Client, seq: &str) {
    admin
        .batch_execute(&format!(
            "SELECT setval('{seq}', (extract(epoch from clock_timestamp()) * 1000000)::bigint \
             + 3600000000)"
        ))
        .await
        .expect("setval");
}

/// The error of acquiring `key` on `backend`, which must be refused.
async fn refused(backend: &Arc<dyn Backend>, key: &LockKey) -> String {
    match LockOptions::new(Duration::from_secs(30))
        .acquire_on(Arc::clone(backend), key)
        .await
    {
        Ok(lease) => panic!("acquired with token {}", lease.token()),
        Err(err) => err.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_altered_to_cache_20_under_open_sessions_is_refused_at_the_next_acquisition() {
    // Two services hold one key in turn; the server clock is behind the
    // sequence (so tokens come from it) when a DBA sets CACHE 20. Their
    // lock sessions stay open, so no session-open check sees it: the draw
    // itself must refuse, or the services' cached blocks interleave.
    let scratch = Scratch::new();
    let admin = client().await;
    let url = conn();
    let connect = || PgBackend::connect_with(&url, scratch.options().sessions(1));
    let a: Arc<dyn Backend> = Arc::new(connect().await.expect("connect"));
    let b: Arc<dyn Backend> = Arc::new(connect().await.expect("connect"));
    let key = fresh_key("cache-20-open");
    let before = hold_once(&a, &key).await.max(hold_once(&b, &key).await);
    clock_steps_back_an_hour(&admin, &scratch.seq()).await;
    admin
        .batch_execute(&format!("ALTER SEQUENCE {} CACHE 20", scratch.seq()))
        .await
        .expect("alter");

    for backend in [&a, &b, &a, &b] {
        let text = refused(backend, &key).await;
        assert!(
            text.contains("CACHE above 1")
                && text.contains("NO CYCLE CACHE 1;")
                && text.contains(&format!("\"{}\".dlock_token_seq", scratch.schema)),
            "{text}"
        );
        assert!(
            freed_on_the_server(&admin, &key).await,
            "a refused draw left {key} held"
        );
    }

    admin
        .batch_execute(&format!("ALTER SEQUENCE {} CACHE 1", scratch.seq()))
        .await
        .expect("fix");
    let mut previous = before;
    for backend in [&a, &b, &a, &b] {
        let token = hold_once(backend, &key).await;
        assert!(token > previous, "{token} after {previous}");
        previous = token;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_set_far_ahead_under_open_sessions_is_refused_at_the_next_acquisition() {
    // Tokens from a sequence two days ahead rest on it alone: dropped later
    // (and recreated at the clock) it would send tokens back. Refused at the
    // draw, even though the sessions opened before it moved.
    let scratch = Scratch::new();
    let admin = client().await;
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), scratch.options().sessions(1))
            .await
            .expect("connect"),
    );
    let key = fresh_key("far-ahead-open");
    hold_once(&backend, &key).await;
    admin
        .batch_execute(&format!(
            "SELECT setval('{}', (extract(epoch from clock_timestamp()) * 1000000)::bigint \
             + 2 * 86400000000)",
            scratch.seq()
        ))
        .await
        .expect("setval");
    let text = refused(&backend, &key).await;
    assert!(
        text.contains("more than a day ahead") && text.contains("START WITH 1 RESTART;"),
        "{text}"
    );
    assert!(
        freed_on_the_server(&admin, &key).await,
        "a refused draw left {key} held"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_locks_refuse_a_cache_20_sequence_and_leave_the_key_free() {
    // A deployment that only uses transaction locks (behind a pooler) has
    // no lock session whose opening would check the sequence.
    let scratch = Scratch::new();
    let admin = client().await;
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA {s}; CREATE SEQUENCE {s}.dlock_token_seq AS bigint CACHE 20;",
            s = scratch.schema
        ))
        .await
        .expect("pre-create");
    clock_steps_back_an_hour(&admin, &scratch.seq()).await;
    let mut app = client().await;
    let key = fresh_key("xact-cache-20");
    for wait in [false, true] {
        let lock = if wait {
            scratch.xact().wait(Duration::from_secs(5))
        } else {
            scratch.xact()
        };
        let mut tx = app.transaction().await.expect("begin");
        let refused = lock.acquire(&mut tx, &key).await;
        let text = match refused {
            Ok(token) => panic!("a transaction lock (wait: {wait}) got token {token}"),
            Err(err) => err.to_string(),
        };
        assert!(
            text.contains("CACHE above 1") && text.contains("NO CYCLE CACHE 1;"),
            "{text}"
        );
        tx.rollback().await.expect("rollback");
        assert!(freed_on_the_server(&admin, &key).await, "{key} left held");
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_backend_warns_when_another_schema_holds_a_token_sequence_it_may_share_locks_with() {
    // The schema is not part of the lock: a client of another schema with
    // the same key seed shares the locks but not the tokens.
    let (one, other) = (Scratch::new(), Scratch::new());
    let _first = PgBackend::connect_with(&conn(), one.options())
        .await
        .expect("connect");
    let (logs, _guard) = support::Logs::capture();
    let _second = PgBackend::connect_with(&conn(), other.options())
        .await
        .expect("connect");
    // The check runs as the backend's sessions come up, which may be after
    // `connect_with` returned: give them a bounded while.
    let warned = |text: &str| {
        text.contains("WARN")
            && text.contains("other schemas of this database hold dlock token sequences")
            && text.contains(&one.schema)
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !warned(&logs.text()) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = logs.text();
    assert!(
        warned(&text),
        "no warning about the token sequence in {}:\n{text}",
        one.schema
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_of_each_key_rise_while_sessions_race_to_move_the_sequence_up() {
    // Someone keeps setting the sequence back while session and
    // transaction locks on many keys draw tokens: lock statements on
    // different sessions move the sequence up at the same moments, each
    // with its own clock reading, and unconditional `setval`s can move it
    // down. Tokens of each key must still rise.
    let scratch = Scratch::new();
    let admin = client().await;
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), scratch.options().sessions(4))
            .await
            .expect("connect"),
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let setting_back = {
        let (stop, seq) = (Arc::clone(&stop), scratch.seq());
        tokio::spawn(async move {
            let mut times = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                admin
                    .query_one(&format!("SELECT setval('{seq}', 1)"), &[])
                    .await
                    .expect("setval");
                times += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            times
        })
    };
    let mut tasks = Vec::new();
    for i in 0..8 {
        let key = fresh_key(&format!("race-{i}"));
        let backend = Arc::clone(&backend);
        let lock = scratch.xact();
        tasks.push(tokio::spawn(async move {
            let mut app = client().await;
            let mut previous = FencingToken::new(0);
            for round in 0..60 {
                // Session and transaction locks take turns on the key.
                let token = if (i + round) % 3 == 0 {
                    hold_in_transaction(&mut app, &lock, &key, round % 2 == 0)
                        .await
                        .expect("free")
                } else {
                    hold_once(&backend, &key).await
                };
                assert!(
                    token > previous,
                    "key {i}, round {round}: {token} after {previous}"
                );
                previous = token;
            }
        }));
    }
    within(120, "the racing acquirers", async {
        for task in tasks {
            task.await.expect("tokens of the key rose");
        }
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let times = setting_back.await.expect("setter");
    assert!(times > 0, "the sequence was set back while they ran");
}

/// The sequence's last value, as a DBA reads it.
async fn last_value(admin: &tokio_postgres::Client, seq: &str) -> i64 {
    admin
        .query_one(&format!("SELECT last_value FROM {seq}"), &[])
        .await
        .expect("read the sequence")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sequence_holds_at_least_every_token_handed_out_so_a_clock_step_back_cannot_lower_tokens()
 {
    // A server clock that steps back (NTP stepping, a VM restored from a
    // snapshot) must not lower a key's next token: the sequence has to hold
    // at least the key's last token the moment it is handed out, so that
    // the next `nextval` beats it whatever the clock says. Checked directly,
    // while each holder still holds the key, by contenders on separate
    // sessions (three backends, as three processes) and in transactions,
    // and again after the sequence was set back.
    let scratch = Scratch::new();
    let admin = Arc::new(client().await);
    let key = fresh_key("seq-holds-token");
    let mut backends = Vec::new();
    for _ in 0..3 {
        let backend: Arc<dyn Backend> = Arc::new(
            PgBackend::connect_with(&conn(), scratch.options().sessions(2))
                .await
                .expect("connect"),
        );
        backends.push(backend);
    }
    let mut tasks = Vec::new();
    for i in 0..8usize {
        let (key, admin, seq) = (key.clone(), Arc::clone(&admin), scratch.seq());
        let backend = Arc::clone(&backends[i % backends.len()]);
        let lock = scratch.xact().wait(Duration::from_secs(10));
        tasks.push(tokio::spawn(async move {
            let mut app = client().await;
            let mut tokens = Vec::new();
            for round in 0..25 {
                // Each token is checked against the sequence before the
                // key is let go, so no later holder has drawn yet.
                let (token, behind) = if (i + round) % 4 == 0 {
                    let mut tx = app.transaction().await.expect("begin");
                    let token = lock.acquire(&mut tx, &key).await.expect("free in time");
                    let last = last_value(&admin, &seq).await;
                    tx.commit().await.expect("commit");
                    (token, last)
                } else {
                    let lease = LockOptions::new(Duration::from_secs(30))
                        .wait(Duration::from_secs(10))
                        .acquire_on(Arc::clone(&backend), &key)
                        .await
                        .expect("free in time");
                    let last = last_value(&admin, &seq).await;
                    let token = lease.token();
                    lease.release().await.expect("release");
                    (token, last)
                };
                assert!(
                    behind >= token.get() as i64,
                    "contender {i}, round {round}: the sequence holds {behind} right after \
                     token {token} was handed out, {} µs below it",
                    token.get() as i64 - behind
                );
                tokens.push(token);
            }
            tokens
        }));
    }
    let mut all = Vec::new();
    within(120, "the contenders", async {
        for task in tasks {
            all.extend(task.await.expect("the sequence held every token"));
        }
    })
    .await;
    all.sort();
    all.dedup();
    assert_eq!(
        all.len(),
        8 * 25,
        "every holder of the key got a token of its own"
    );

    // Set back (a restore, a DBA): the clock floors the next token, and the
    // draw moves the sequence up to it again.
    admin
        .query_one(&format!("SELECT setval('{}', 1)", scratch.seq()), &[])
        .await
        .expect("setval");
    let highest = all.last().copied().expect("tokens");
    let mut previous = highest;
    for round in 0..5 {
        let backend = &backends[round % backends.len()];
        let lease = LockOptions::new(Duration::from_secs(30))
            .acquire_on(Arc::clone(backend), &key)
            .await
            .expect("free");
        let last = last_value(&admin, &scratch.seq()).await;
        let token = lease.token();
        lease.release().await.expect("release");
        assert!(token > previous, "{token} after {previous} (set back)");
        assert!(
            last >= token.get() as i64,
            "{last} below token {token} after the set-back"
        );
        previous = token;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alter_sequence_left_open_fails_acquisitions_fast_and_loses_no_other_lease() {
    // A DBA runs the very `ALTER SEQUENCE` dlock's refusals suggest, in a
    // transaction left open. `nextval` waits for its lock. Lock statements
    // must give up fast with an error that says why, instead of holding up
    // the lock session until its liveness check ends it — with every other
    // lease on it — however many of them queue on the session.
    let scratch = Scratch::new();
    let mut admin = client().await;
    let pg = PgBackend::connect_with(&conn(), scratch.options().sessions(1))
        .await
        .expect("connect");
    let backend: Arc<dyn Backend> = Arc::new(pg.clone());
    let held = LockOptions::new(Duration::from_secs(60))
        .acquire_on(Arc::clone(&backend), fresh_key("held-during-alter"))
        .await
        .expect("free");

    let tx = admin.transaction().await.expect("begin");
    tx.batch_execute(&format!("ALTER SEQUENCE {} CACHE 1", scratch.seq()))
        .await
        .expect("alter");
    let others: Vec<LockKey> = (0..6)
        .map(|i| fresh_key(&format!("during-alter-{i}")))
        .collect();
    let attempts: Vec<_> = others
        .iter()
        .map(|key| {
            let (backend, key) = (Arc::clone(&backend), key.clone());
            tokio::spawn(async move {
                LockOptions::new(Duration::from_secs(60))
                    .acquire_on(backend, key)
                    .await
                    .map(|lease| lease.token())
            })
        })
        .collect();
    let mut answers = Vec::new();
    within(15, "the acquisitions while the ALTER is open", async {
        for attempt in attempts {
            answers.push(attempt.await.expect("attempt"));
        }
    })
    .await;
    // Still open: every answer came while the ALTER held the sequence, and
    // the held lease lived through more than two liveness intervals.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let still_held = held.check();
    tx.commit().await.expect("commit the ALTER");

    for answer in &answers {
        let err = answer.as_ref().expect_err("the sequence was locked");
        let text = err.to_string();
        assert!(
            text.contains("locked by another transaction") && text.contains("try again"),
            "{text}"
        );
    }
    eprintln!("{}", answers[0].as_ref().expect_err("refused"));
    assert!(
        still_held.is_ok(),
        "an unrelated lease was lost: {still_held:?}"
    );

    // Nothing was left held: the keys are free, here and for another process.
    let other_process: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), scratch.options())
            .await
            .expect("connect"),
    );
    for key in &others {
        let token = hold_once(&other_process, key).await;
        assert!(hold_once(&backend, key).await > token);
    }
    held.release().await.expect("the held lease is still ours");
}

/// Two different keys with the same advisory key, checked on the server.
async fn colliding_keys(admin: &tokio_postgres::Client) -> (LockKey, LockKey) {
    let (a, b) = pg_support::colliding_keys(&format!(":{}", random_id()));
    let same: bool = admin
        .query_one(
            "SELECT hashtextextended($1::text, 0) = hashtextextended($2::text, 0)",
            &[&a, &b],
        )
        .await
        .expect("hash both")
        .get(0);
    assert!(same && a != b, "{a:?} and {b:?} do not collide");
    (
        LockKey::new(a).expect("valid key"),
        LockKey::new(b).expect("valid key"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_statement_failing_before_it_locks_leaves_another_key_with_the_same_hash_held() {
    // The sequence is dropped, so the next lock statement fails when it is
    // planned, before it locks anything. What it "undoes" must not be the
    // lock of another key with the same 64-bit hash held on the same
    // session: an unlock by key would drop that lease's lock on the server
    // while the lease still believes it holds it.
    let scratch = Scratch::new();
    let admin = client().await;
    let (held_key, colliding) = colliding_keys(&admin).await;
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), scratch.options().sessions(1))
            .await
            .expect("connect"),
    );
    let held = LockOptions::new(Duration::from_secs(60))
        .acquire_on(Arc::clone(&backend), &held_key)
        .await
        .expect("free");
    admin
        .batch_execute(&format!("DROP SEQUENCE {}", scratch.seq()))
        .await
        .expect("drop the sequence");
    let attempt = LockOptions::new(Duration::from_secs(60))
        .acquire_on(Arc::clone(&backend), &colliding)
        .await;
    assert!(
        matches!(attempt, Err(LockError::Held { .. })),
        "one advisory key, so one lock: {attempt:?}"
    );
    assert!(
        !free_on_the_server(&admin, &held_key).await,
        "the held lease's lock was dropped on the server"
    );
    assert!(held.check().is_ok(), "{:?}", held.check());
    held.release().await.expect("release");
    assert!(freed_on_the_server(&admin, &held_key).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_statement_failing_after_it_locked_drops_only_its_own_hold() {
    // An `ALTER SEQUENCE` left open makes the token draw fail after the lock
    // was taken. Told by the error (a lock timeout in the draw): one unlock
    // drops exactly this attempt's hold. Not told (a statement timeout can
    // strike anywhere): the undo's one unlock drops what it took, or
    // nothing. Either way a lease of the session holding a key with the
    // same hash lives on: an attempt of that hash is answered held in
    // process, and reaches no server to fail there.
    let scratch = Scratch::new();
    let mut admin = client().await;
    let observer = client().await;
    let (held_key, colliding) = colliding_keys(&admin).await;
    let (timed_held, timed_colliding) = colliding_keys(&admin).await;
    let lone = fresh_key("statement-timeout");
    let after_lock = fresh_key("after-lock");
    // Without holder records: the lock statement draws once it holds the
    // lock, so a lock timeout in the draw says where it failed. (One that
    // records takes the lock last, and its lock timeout may be its
    // commit's, after that: with a lease of a colliding key on the session
    // it cannot tell whether it took the lock, and ends the session.)
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn(), scratch.options().sessions(1).record_holders(false))
            .await
            .expect("connect"),
    );
    // Statements on these sessions time out (800 ms) before they would
    // give up waiting for the sequence (1 s), and not before a statement
    // that waits for nothing is done on a busy server.
    let base = conn();
    let timing_out = if base.starts_with("postgres") {
        let sep = if base.contains('?') { '&' } else { '?' };
        format!("{base}{sep}options=-c%20statement_timeout%3D800")
    } else {
        format!("{base} options='-c statement_timeout=800'")
    };
    let impatient: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&timing_out, scratch.options().sessions(1))
            .await
            .expect("connect"),
    );
    let held = LockOptions::new(Duration::from_secs(60))
        .acquire_on(Arc::clone(&backend), &held_key)
        .await
        .expect("free");
    let timed = LockOptions::new(Duration::from_secs(60))
        .acquire_on(Arc::clone(&impatient), &timed_held)
        .await
        .expect("free");

    let tx = admin.transaction().await.expect("begin");
    tx.batch_execute(&format!("ALTER SEQUENCE {} CACHE 1", scratch.seq()))
        .await
        .expect("alter");
    let attempt = LockOptions::new(Duration::from_secs(60))
        .acquire_on(Arc::clone(&backend), &colliding)
        .await;
    assert!(
        matches!(attempt, Err(LockError::Held { .. })),
        "one advisory key, so one lock: {attempt:?}"
    );
    let attempt = LockOptions::new(Duration::from_secs(60))
        .acquire_on(Arc::clone(&backend), &after_lock)
        .await;
    let text = attempt.expect_err("the sequence is locked").to_string();
    assert!(text.contains("locked by another transaction"), "{text}");
    assert!(
        freed_on_the_server(&observer, &after_lock).await,
        "a lock statement that failed after it locked left its lock held"
    );
    assert!(
        !free_on_the_server(&observer, &held_key).await,
        "the held lease's lock was dropped on the server"
    );
    assert!(held.check().is_ok(), "{:?}", held.check());

    let attempt = LockOptions::new(Duration::from_secs(60))
        .acquire_on(Arc::clone(&impatient), &lone)
        .await;
    let text = attempt.expect_err("the statement timed out").to_string();
    assert!(text.contains("statement timeout"), "{text}");
    assert!(
        freed_on_the_server(&observer, &lone).await,
        "a timed-out lock statement left its lock held"
    );
    assert!(timed.check().is_ok(), "{:?}", timed.check());

    let attempt = LockOptions::new(Duration::from_secs(60))
        .acquire_on(Arc::clone(&impatient), &timed_colliding)
        .await;
    assert!(
        matches!(attempt, Err(LockError::Held { .. })),
        "one advisory key, so one lock: {attempt:?}"
    );
    assert!(
        !free_on_the_server(&observer, &timed_held).await,
        "the timed lease's lock was dropped on the server"
    );
    assert!(timed.check().is_ok(), "{:?}", timed.check());
    tx.commit().await.expect("commit the ALTER");
    timed.release().await.expect("release");
    assert!(freed_on_the_server(&observer, &timed_held).await);

    held.release().await.expect("release");
    assert!(freed_on_the_server(&observer, &held_key).await);
    assert!(freed_on_the_server(&observer, &colliding).await);
}

//! What a DBA does to the token sequence under running services, and what
//! callers are told.
//!
//! A `DROP SEQUENCE` that commits while a lock statement waits for the
//! sequence's lock: the statement was planned with the sequence, so it
//! fails only as it opens it, after it may have taken its key: the server
//! answers `could not open relation with OID …` (an internal error), not
//! "does not exist". The backend undoes the statement, creates what is
//! missing and takes the key, as it does for a sequence dropped between
//! two statements; a transaction lock says what happened. The DBA's
//! transaction commits only once the statement is seen waiting in
//! `pg_locks`, so the race is played the same way every run.
//!
//! A `MAXVALUE` lowered to the last token, and the role's privileges on
//! the sequence revoked: the error names the cause and its fix, and the
//! key is left free, or, for a transaction lock that cannot give it back,
//! the error says so.

use super::token_lead::{connect, fresh_key, hold_once, seq};
use crate::pg_support::{
    ScratchSchema, free_on_the_server, freed_on_the_server, shared_client, shared_conn,
};
use crate::support::within;

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::tokio_postgres::Client;
use dlock::pg::{PgBackend, PgOptions, TransactionLock};
use dlock::{Backend, Lease, LockKey, LockMode, LockOptions};

/// What the DBA runs, in one transaction left open until a lock statement
/// waits for the sequence.
const DROP: &str = "DROP SEQUENCE {seq}";
const DROP_AND_CREATE: &str = "DROP SEQUENCE {seq}; CREATE SEQUENCE {seq} AS bigint";

/// Opens `ddl` (with `{seq}` filled in) in a transaction on a client of
/// its own, and returns that client with the transaction still open, and
/// the sequence's OID from before.
async fn open_drop(ddl: &str, schema: &str) -> (Client, u32) {
    let dba = shared_client().await;
    let oid: u32 = dba
        .query_one("SELECT $1::text::regclass::oid", &[&seq(schema)])
        .await
        .expect("the sequence's oid")
        .get(0);
    dba.batch_execute(&format!("BEGIN; {}", ddl.replace("{seq}", &seq(schema))))
        .await
        .expect("the DBA's drop");
    (dba, oid)
}

/// Waits until a session waits for a lock on the relation `oid`.
async fn someone_waits_for(oid: u32) {
    let watcher = shared_client().await;
    within(
        20,
        "a lock statement waiting for the dropped sequence",
        async {
            loop {
                let waiting: bool = watcher
                    .query_one(
                        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_locks \
                     WHERE relation = $1::oid AND NOT granted)",
                        &[&oid],
                    )
                    .await
                    .expect("pg_locks")
                    .get(0);
                if waiting {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        },
    )
    .await;
}

/// Takes `key` with `options` on `backend` while `ddl` commits under its
/// statement: the lease, which it must get.
async fn taken_through(
    backend: &Arc<dyn Backend>,
    schema: &str,
    ddl: &str,
    options: LockOptions,
    key: &LockKey,
) -> Lease {
    let (dba, oid) = open_drop(ddl, schema).await;
    let acquisition = tokio::spawn({
        let (backend, key) = (Arc::clone(backend), key.clone());
        async move { options.acquire_on(backend, key).await }
    });
    someone_waits_for(oid).await;
    dba.batch_execute("COMMIT").await.expect("commit the drop");
    within(20, "the acquisition after the drop", acquisition)
        .await
        .expect("task")
        .unwrap_or_else(|err| panic!("{ddl}, committed under a lock statement: {err}"))
}

/// A lease taken on `backend` while `ddl` commits under its lock statement
/// is granted, with a token above the last one before the drop, and gives
/// its key back.
async fn acquired_through_the_drop(backend: Arc<dyn Backend>, schema: &str, ddl: &str, fair: bool) {
    let key = fresh_key("drop-race");
    let before = hold_once(&backend, &key).await;
    let options = LockOptions::new(Duration::from_secs(30)).fair(fair);
    let lease = taken_through(&backend, schema, ddl, options, &key).await;
    assert!(
        lease.token() > before,
        "{ddl}: token {:?} after {before:?}",
        lease.token()
    );
    lease.release().await.expect("release");
    let watcher = shared_client().await;
    assert!(
        free_on_the_server(&watcher, &key).await,
        "{ddl}: the key stayed held"
    );
    let after = hold_once(&backend, &key).await;
    assert!(after > before, "{ddl}: token {after:?} after {before:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_dropped_under_a_waiting_lock_statement_is_created_again_and_the_key_taken() {
    for ddl in [DROP, DROP_AND_CREATE] {
        let scratch = ScratchSchema::new("droprace");
        let backend = connect(&shared_conn(), &scratch.name).await;
        acquired_through_the_drop(backend, &scratch.name, ddl, false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_dropped_under_a_waiting_plain_lock_statement_is_created_again_and_the_key_taken()
 {
    for ddl in [DROP, DROP_AND_CREATE] {
        let scratch = ScratchSchema::new("droprace");
        let backend: Arc<dyn Backend> = Arc::new(
            PgBackend::connect_with(
                &shared_conn(),
                PgOptions::new()
                    .schema(&scratch.name)
                    .sessions(1)
                    .record_holders(false)
                    .liveness_interval(Duration::from_secs(60))
                    .server_idle_timeout(Some(Duration::from_secs(180))),
            )
            .await
            .expect("connect"),
        );
        acquired_through_the_drop(backend, &scratch.name, ddl, false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_dropped_under_a_waiting_fair_lock_statement_is_created_again_and_the_key_taken()
{
    for ddl in [DROP, DROP_AND_CREATE] {
        let scratch = ScratchSchema::new("droprace");
        let backend = connect(&shared_conn(), &scratch.name).await;
        acquired_through_the_drop(backend, &scratch.name, ddl, true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_dropped_under_a_waiting_transaction_lock_is_an_error_that_says_so() {
    let scratch = ScratchSchema::new("droprace");
    let _creates_the_sequence = connect(&shared_conn(), &scratch.name).await;
    let mut app = shared_client().await;
    let (dba, oid) = open_drop(DROP_AND_CREATE, &scratch.name).await;
    let key = fresh_key("drop-race-xact");
    let lock = TransactionLock::new().schema(&scratch.name);
    let mut tx = app.transaction().await.expect("begin");
    let (answer, ()) = tokio::join!(lock.acquire(&mut tx, key.clone()), async {
        someone_waits_for(oid).await;
        dba.batch_execute("COMMIT").await.expect("commit the drop");
    });
    let text = answer.expect_err("the sequence went").to_string();
    tx.rollback().await.expect("rollback");
    assert!(
        text.contains("was dropped while the lock statement ran") && text.contains("try again"),
        "{text}"
    );
    // Rolled back, the key is free, and the next transaction gets a token.
    assert!(free_on_the_server(&dba, &key).await);
    let mut tx = app.transaction().await.expect("begin");
    lock.acquire(&mut tx, key).await.expect("after the drop");
    tx.rollback().await.expect("rollback");
}

/// Takes `key` once on each backend and in a transaction, each expected to
/// fail with an error that contains every one of `says`; the key is free
/// after each.
async fn refused_everywhere(
    backends: &[Arc<dyn Backend>],
    conn: &str,
    schema: &str,
    says: &[&str],
) {
    let watcher = shared_client().await;
    for backend in backends {
        // A newline in the key: an error's context that lists it would
        // span lines.
        let key = LockKey::new(format!("{}\nline two", fresh_key("dba-refused"))).expect("a key");
        let err = LockOptions::new(Duration::from_secs(30))
            .acquire_on(Arc::clone(backend), key.clone())
            .await
            .expect_err("refused")
            .to_string();
        eprintln!("{err}");
        for said in says {
            assert!(err.contains(said), "{said:?} missing from: {err}");
        }
        assert!(freed_on_the_server(&watcher, &key).await, "{key} left held");
    }
    let mut app = crate::pg_support::client_of(conn).await;
    let key = fresh_key("dba-refused-xact");
    let mut tx = app.transaction().await.expect("begin");
    let err = TransactionLock::new()
        .schema(schema)
        .acquire(&mut tx, key.clone())
        .await
        .expect_err("refused")
        .to_string();
    tx.rollback().await.expect("rollback");
    for said in says {
        assert!(err.contains(said), "{said:?} missing from: {err}");
    }
    assert!(free_on_the_server(&watcher, &key).await, "{key} left held");
}

/// A backend on `schema` through `conn` that names its holders, and one
/// that does not (the named and the plain lock statements).
async fn named_and_plain(conn: &str, schema: &str) -> Vec<Arc<dyn Backend>> {
    let plain = PgBackend::connect_with(
        conn,
        PgOptions::new()
            .schema(schema)
            .sessions(1)
            .record_holders(false),
    )
    .await
    .expect("connect");
    vec![connect(conn, schema).await, Arc::new(plain)]
}

/// The shared server's connection string, and the same with
/// `log_parameter_max_length_on_error` set (a DBA's logging setting,
/// PostgreSQL 13+): then every error of a statement sent with parameters
/// has a context that lists them, which must not read as a DBA trigger's.
fn plain_and_logging_parameters() -> [String; 2] {
    let conn = shared_conn();
    let logging = format!("{conn} options='-c log_parameter_max_length_on_error=-1'");
    [conn, logging]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_maxvalue_lowered_to_the_last_token_is_an_error_naming_the_fix_and_leaves_the_key_free() {
    for conn in plain_and_logging_parameters() {
        let scratch = ScratchSchema::new("dbamax");
        let admin = shared_client().await;
        let backends = named_and_plain(&conn, &scratch.name).await;
        for backend in &backends {
            hold_once(backend, &fresh_key("before-max")).await;
        }
        admin
            .batch_execute(&format!(
                "DO $$ BEGIN EXECUTE format('ALTER SEQUENCE %s MAXVALUE %s', '{s}', \
                 (SELECT last_value FROM {s})); END $$",
                s = seq(&scratch.name)
            ))
            .await
            .expect("lower MAXVALUE");
        let fix = format!(
            "ALTER SEQUENCE \"{}\".dlock_token_seq NO MAXVALUE",
            scratch.name
        );
        refused_everywhere(
            &backends,
            &conn,
            &scratch.name,
            &["reached its MAXVALUE", &fix],
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_whose_sequence_privileges_were_revoked_is_told_what_it_needs_and_leaves_the_key_free()
 {
    let mut scratch = ScratchSchema::new("dbarevoke");
    let admin = shared_client().await;
    let conn = scratch.role_without_create(&admin).await;
    let backends = named_and_plain(&conn, &scratch.name).await;
    for backend in &backends {
        hold_once(backend, &fresh_key("before-revoke")).await;
    }
    let role = scratch.role.clone().expect("a role");
    admin
        .batch_execute(&format!(
            "REVOKE ALL ON SEQUENCE {} FROM {role}",
            seq(&scratch.name)
        ))
        .await
        .expect("revoke");
    let needs = format!(
        "USAGE and UPDATE on the sequence \"{}\".dlock_token_seq",
        scratch.name
    );
    refused_everywhere(
        &backends,
        &conn,
        &scratch.name,
        &["may not draw tokens", &needs],
    )
    .await;
}

/// A transaction lock draws its token in a savepoint after taking the key,
/// both inside a savepoint of the lock. With the sequence's `MAXVALUE`
/// between the sequence and the clock, that draw's `setval` fails: the
/// savepoint of the lock is rolled back with the key, waiting or not, and
/// the error says so, parameters logged on error or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_lock_whose_draw_meets_maxvalue_gives_the_key_back() {
    let scratch = ScratchSchema::new("dbaxmax");
    let _creates_the_sequence = connect(&shared_conn(), &scratch.name).await;
    let admin = shared_client().await;
    admin
        .batch_execute(&format!(
            "DO $$ DECLARE now_us bigint := \
                 (EXTRACT(epoch FROM clock_timestamp()) * 1000000)::bigint; \
             BEGIN \
                 PERFORM setval('{s}', now_us - 10000000); \
                 EXECUTE format('ALTER SEQUENCE {s} MAXVALUE %s', now_us - 5000000); \
             END $$",
            s = seq(&scratch.name)
        ))
        .await
        .expect("the sequence behind its MAXVALUE, behind the clock");
    let [plain, logging] = plain_and_logging_parameters();
    let mut apps = [
        crate::pg_support::client_of(&plain).await,
        crate::pg_support::client_of(&logging).await,
    ];
    for (which, wait) in [
        (0, Duration::ZERO),
        (0, Duration::from_secs(5)),
        (1, Duration::ZERO),
    ] {
        let app = &mut apps[which];
        let key = fresh_key("dba-xact-max");
        let mut tx = app.transaction().await.expect("begin");
        let err = TransactionLock::new()
            .schema(&scratch.name)
            .wait(wait)
            .acquire(&mut tx, key.clone())
            .await
            .expect_err("the draw meets MAXVALUE")
            .to_string();
        eprintln!("{err}");
        let held = !free_on_the_server(&admin, &key).await;
        tx.rollback().await.expect("rollback");
        assert!(err.contains("reached its MAXVALUE"), "{err}");
        assert!(
            !held,
            "the savepoint of the lock was rolled back with the key (wait {wait:?})"
        );
        assert!(err.contains("the lock was not taken"), "{err}");
        assert!(
            free_on_the_server(&admin, &key).await,
            "free after the rollback"
        );
    }
}

/// Shared locks and permits draw in database functions whose handlers give
/// back what they took when a statement inside fails: a drop under their
/// draw is made again and the attempt sent once more, and the lock session,
/// with the other leases on it, lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_or_permit_attempt_raced_by_a_drop_is_granted_and_loses_no_other_lease() {
    let ttl = Duration::from_secs(30);
    for (mode, options) in [
        ("shared", LockOptions::new(ttl).mode(LockMode::Shared)),
        ("permits", LockOptions::new(ttl).permits(3)),
    ] {
        let scratch = ScratchSchema::new("dbamodes");
        let backend = connect(&shared_conn(), &scratch.name).await;
        let key = fresh_key("dba-modes");
        let warm = options
            .acquire_on(Arc::clone(&backend), key.clone())
            .await
            .expect("the functions made");
        warm.release().await.expect("release");
        let before = hold_once(&backend, &key).await;
        let other = LockOptions::new(Duration::from_secs(30))
            .acquire_on(Arc::clone(&backend), fresh_key("dba-modes-other"))
            .await
            .expect("another lease on the one lock session");
        let lease = taken_through(&backend, &scratch.name, DROP, options, &key).await;
        assert!(
            lease.token() > before,
            "{mode}: {:?} after {before:?}",
            lease.token()
        );
        lease.release().await.expect("release");
        assert!(
            other.check().is_ok(),
            "{mode}: another lease of the session was lost"
        );
        other
            .release()
            .await
            .expect("the other lease is still held");
    }
}

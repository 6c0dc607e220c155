//! A DBA's deferred constraint trigger on the table of read phases fails
//! at the commit of a shared attempt, after `dlock_join_readers` returned
//! holding the key shared on the lock session. Whatever the trigger's
//! error says (a relation missing, dropped under it, anything), it did not
//! come from inside the function, whose handlers give back what they
//! took: the session must end, so no lock is left on the server that no
//! lease holds. Each test works in a schema of its own on the shared
//! server (127.0.0.1:5432, or `DLOCK_PG_URL`).

use super::token_lead::{connect, fresh_key};
use crate::pg_support::{ScratchSchema, freed_on_the_server, shared_client, shared_conn};
use crate::support::within;

use std::sync::Arc;
use std::time::Duration;

use dlock::backend::{Access, AcquireRequest, OwnerId};
use dlock::pg::tokio_postgres::Client;
use dlock::{Backend, LockMode, LockOptions};

/// A backend on a scratch schema whose shared-lock functions and table are
/// made, with `trigger` (SQL, `{s}` the schema) installed as the table's
/// deferred constraint trigger `fails`.
async fn with_trigger(scratch: &ScratchSchema, trigger: &str) -> (Arc<dyn Backend>, Client) {
    let backend = connect(&shared_conn(), &scratch.name).await;
    LockOptions::new(Duration::from_secs(30))
        .mode(LockMode::Shared)
        .acquire_on(Arc::clone(&backend), fresh_key("made"))
        .await
        .expect("the functions made")
        .release()
        .await
        .expect("release");
    let admin = shared_client().await;
    let s = &scratch.name;
    admin
        .batch_execute(&format!(
            "{} CREATE CONSTRAINT TRIGGER fails AFTER INSERT OR UPDATE ON {s}.dlock_phases \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {s}.fails();",
            trigger.replace("{s}", s)
        ))
        .await
        .expect("the DBA's deferred trigger");
    (backend, admin)
}

/// A shared attempt on `backend` fails at its commit, and leaves the key
/// free once the trigger is gone.
async fn fails_and_leaves_the_key_free(backend: &Arc<dyn Backend>, admin: &Client, schema: &str) {
    let key = fresh_key("commit-fault");
    let owner = OwnerId::random().expect("owner");
    let request =
        AcquireRequest::new(&key, &owner, Duration::from_secs(30)).with_access(Access::Shared);
    let answer = within(20, "a shared attempt", backend.try_acquire(&request)).await;
    assert!(answer.is_err(), "{answer:?}");
    admin
        .batch_execute(&format!("DROP TRIGGER fails ON {schema}.dlock_phases"))
        .await
        .expect("drop the trigger");
    assert!(
        freed_on_the_server(admin, &key).await,
        "the failed shared attempt left the key locked on a live lock session: {answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_time_could_not_open_relation_ends_the_session_and_leaves_no_hold() {
    let scratch = ScratchSchema::new("modetrig");
    let (backend, admin) = with_trigger(
        &scratch,
        "CREATE FUNCTION {s}.fails() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           RAISE EXCEPTION USING ERRCODE = 'XX000', \
             MESSAGE = 'could not open relation with OID 424242'; END $$;",
    )
    .await;
    fails_and_leaves_the_key_free(&backend, &admin, &scratch.name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_time_missing_relation_ends_the_session_and_leaves_no_hold() {
    let scratch = ScratchSchema::new("modetrig");
    let (backend, admin) = with_trigger(
        &scratch,
        "CREATE TABLE {s}.audit (at timestamptz); \
         CREATE FUNCTION {s}.fails() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           INSERT INTO {s}.audit VALUES (now()); RETURN NULL; END $$; \
         DROP TABLE {s}.audit;",
    )
    .await;
    fails_and_leaves_the_key_free(&backend, &admin, &scratch.name).await;
}

/// The trigger fails once: a caller that waits rides the failure out and
/// is granted the key on another session, and once its lease is released
/// the key is free on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_lease_granted_after_a_commit_time_failure_leaves_the_key_free_once_released() {
    let scratch = ScratchSchema::new("modetrig");
    let (backend, admin) = with_trigger(
        &scratch,
        "CREATE SEQUENCE {s}.once; \
         CREATE FUNCTION {s}.fails() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF nextval('{s}.once') = 1 THEN RAISE EXCEPTION USING ERRCODE = 'XX000', \
             MESSAGE = 'could not open relation with OID 424242'; END IF; \
           RETURN NULL; END $$;",
    )
    .await;
    let key = fresh_key("commit-fault-once");
    let lease = within(
        20,
        "a shared lease",
        LockOptions::new(Duration::from_secs(30))
            .mode(LockMode::Shared)
            .wait(Duration::from_secs(10))
            .acquire_on(Arc::clone(&backend), key.clone()),
    )
    .await
    .expect("granted after the failure");
    lease.release().await.expect("release");
    assert!(
        freed_on_the_server(&admin, &key).await,
        "the released shared lease left the key locked on the server"
    );
}

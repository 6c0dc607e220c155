//! Hostile review of shared locks and permits: what operators and other
//! callers do to a running system.

mod support;

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::PgBackend;
use dlock::pg::tokio_postgres::{self, NoTls};
use dlock::{Backend, LockError, LockMode, LockOptions};
use dlock_runtime::conformance::fresh_key;

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

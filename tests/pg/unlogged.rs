//! An unlogged token sequence (PostgreSQL 15+), the DBA's choice for a
//! token draw that writes no WAL (see docs/postgres.md, "What a token
//! costs"): a crash resets it, and the clock floor alone carries tokens
//! above every token handed out before the crash.

use crate::pg_support;
use crate::support;

use std::sync::Arc;
use std::time::Duration;

use dlock::backend::OwnerId;
use dlock::pg::tokio_postgres::{self, NoTls};
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, LockKey, LockOptions};
use pg_support::{OwnServer, PASSWORD};
use support::within;
use tokio::time::Instant;

fn fresh_key(label: &str) -> LockKey {
    let id = OwnerId::random().expect("random bytes");
    LockKey::new(format!("dlock-test:{label}:{id}")).expect("valid key")
}

async fn admin(server: &OwnServer) -> tokio_postgres::Client {
    let (client, connection) =
        tokio_postgres::connect(&server.conn(PASSWORD, "sslmode=disable"), NoTls)
            .await
            .expect("connect as admin");
    tokio::spawn(connection);
    client
}

/// A token, once the backend has found its way back to a restarted server.
async fn token_once_back(backend: &Arc<dyn Backend>, key: &LockKey) -> dlock::FencingToken {
    let started = Instant::now();
    loop {
        match LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend.clone(), key)
            .await
        {
            Ok(lease) => {
                let token = lease.token();
                lease.release().await.expect("release");
                return token;
            }
            Err(err) if started.elapsed() < Duration::from_secs(20) => {
                eprintln!("not yet: {err}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => panic!("the backend never recovered: {err}"),
        }
    }
}

/// A DBA made the token sequence unlogged; tokens rise while the server
/// runs, and after a crash (an immediate stop), which resets the sequence,
/// the next token is still above every token handed out before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlogged_token_sequence_reset_by_a_crash_still_gives_higher_tokens() {
    let server = OwnServer::start();
    admin(&server)
        .await
        .batch_execute(
            "CREATE SCHEMA dlock; CREATE UNLOGGED SEQUENCE dlock.dlock_token_seq AS bigint",
        )
        .await
        .expect("a DBA creates the sequence unlogged");
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&server.conn(PASSWORD, ""), PgOptions::new().sessions(1))
            .await
            .expect("connect"),
    );
    let key = fresh_key("unlogged");
    let mut highest = None;
    for _ in 0..20 {
        let token = token_once_back(&backend, &key).await;
        assert!(Some(token) > highest, "{token} after {highest:?}");
        highest = Some(token);
    }
    let stopped = server.pg_ctl_stop("immediate");
    assert!(stopped.status.success(), "{stopped:?}");
    server.pg_ctl_start();
    let reset: Option<i64> = admin(&server)
        .await
        .query_one(
            "SELECT pg_sequence_last_value('dlock.dlock_token_seq'::regclass)",
            &[],
        )
        .await
        .expect("read the sequence")
        .get(0);
    assert_eq!(reset, None, "the crash reset the unlogged sequence");
    let after = within(
        30,
        "a token after the crash",
        token_once_back(&backend, &key),
    )
    .await;
    assert!(
        Some(after) > highest,
        "{after} after a crash, not above {highest:?}"
    );
}

//! One full lock statement at a time per backend while a window of the
//! quick statement is known (`quick::QuickDraw`): every full statement
//! holds the draw lock exclusively, so a busy backend whose acquisitions
//! all sent it at once would have them wait on the server for each other.
//! Past half the window one acquisition sends it and the others go quick;
//! after the window each sends its own, waiting for no other's answer.
//! A client of the test holds the draw lock, so each statement sent shows
//! in `pg_locks` as a waiter, exclusive (full) or shared (quick). Each test works in a schema
//! of its own on the shared server (127.0.0.1:5432, or `DLOCK_PG_URL`).

use super::token_lead::{draw_lock, fresh_key, hold_draw_lock, seq, server_clock};
use crate::pg_support::{ScratchSchema, shared_client, shared_conn};
use crate::support::within;

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::tokio_postgres::Client;
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, LockOptions};

const SESSIONS: usize = 4;

/// The waiters for the draw lock: (exclusive, shared).
async fn waiters(admin: &Client, lock: (i32, i32)) -> (i64, i64) {
    let row = admin
        .query_one(
            "SELECT count(*) FILTER (WHERE mode = 'ExclusiveLock'),
                    count(*) FILTER (WHERE mode = 'ShareLock')
             FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND NOT granted
               AND classid::int8 = ($1::int4::int8 & 4294967295)
               AND objid::int8 = ($2::int4::int8 & 4294967295)",
            &[&lock.0, &lock.1],
        )
        .await
        .expect("pg_locks");
    (row.get(0), row.get(1))
}

/// A backend of `SESSIONS` lock sessions whose first full statement found
/// the sequence `lead` ahead of the clock, `since` ago (slept), with the
/// test's client holding the draw lock from then on.
async fn after_a_window(
    lead: Duration,
    since: Duration,
) -> (ScratchSchema, Client, Client, Arc<dyn Backend>, (i32, i32)) {
    let scratch = ScratchSchema::new("turn");
    let admin = shared_client().await;
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(
            &shared_conn(),
            PgOptions::new().schema(&scratch.name).sessions(SESSIONS),
        )
        .await
        .expect("connect"),
    );
    let clock = server_clock(&admin).await;
    admin
        .execute(
            &format!("SELECT setval('{}', $1)", seq(&scratch.name)),
            &[&(clock + lead.as_micros() as i64)],
        )
        .await
        .expect("set the sequence ahead");
    LockOptions::new(Duration::from_secs(30))
        .acquire_on(Arc::clone(&backend), &fresh_key("window"))
        .await
        .expect("the full statement")
        .release()
        .await
        .expect("release");
    tokio::time::sleep(since).await;
    let lock = draw_lock(&admin, &scratch).await;
    let holder = hold_draw_lock(lock).await;
    (scratch, admin, holder, backend, lock)
}

/// Eight acquisitions of keys of their own, spread over the sessions.
fn acquire_eight(backend: &Arc<dyn Backend>) -> Vec<tokio::task::JoinHandle<()>> {
    (0..8)
        .map(|_| {
            let backend = Arc::clone(backend);
            tokio::spawn(async move {
                LockOptions::new(Duration::from_secs(30))
                    .acquire_on(backend, &fresh_key("turn"))
                    .await
                    .expect("acquire")
                    .release()
                    .await
                    .expect("release");
            })
        })
        .collect()
}

async fn let_go(holder: &Client, lock: (i32, i32), tasks: Vec<tokio::task::JoinHandle<()>>) {
    holder
        .execute("SELECT pg_advisory_unlock($1, $2)", &[&lock.0, &lock.1])
        .await
        .expect("let the draw lock go");
    for task in tasks {
        within(30, "an acquisition after the draw lock", task)
            .await
            .expect("task");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_half_the_window_one_acquisition_sends_the_full_statement_and_the_others_go_quick() {
    // A window of 6 s, half over after 3.2 s: 2.8 s for the eight to be sent.
    let (_scratch, admin, holder, backend, lock) =
        after_a_window(Duration::from_secs(6), Duration::from_millis(3200)).await;
    let tasks = acquire_eight(&backend);
    // Each session sends one statement, which waits for the draw lock.
    let seen = within(
        20,
        "a statement of each session waiting for the draw lock",
        async {
            loop {
                let (exclusive, shared) = waiters(&admin, lock).await;
                if exclusive + shared >= SESSIONS as i64 {
                    return (exclusive, shared);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        },
    )
    .await;
    let_go(&holder, lock, tasks).await;
    assert_eq!(
        seen,
        (1, SESSIONS as i64 - 1),
        "(full, quick) statements waiting for the draw lock"
    );
}

/// After the window no acquisition waits for another's full statement,
/// whose answer may be slow (here: the draw lock held; a server farther
/// away than the lead): each sends its own, and fails or goes on by
/// itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_window_each_acquisition_sends_the_full_statement_itself() {
    let (_scratch, admin, holder, backend, lock) =
        after_a_window(Duration::from_millis(500), Duration::from_millis(700)).await;
    let tasks = acquire_eight(&backend);
    within(
        20,
        "a full statement of each session waiting for the draw lock",
        async {
            while waiters(&admin, lock).await != (SESSIONS as i64, 0) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        },
    )
    .await;
    let_go(&holder, lock, tasks).await;
}

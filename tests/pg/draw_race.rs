//! A writer of the token sequence caught between its `nextval` and its
//! `setval`: a sequence has no atomic "raise to at least", so a value
//! another session draws in between is undone by the write and handed out
//! again by the next draw, to the same key perhaps. Every draw takes the
//! draw lock before its `nextval` (see `draw_token!`), so none lands
//! there. A client of the test stands for the writer (a server process
//! descheduled between the two calls): it holds the draw lock, takes
//! `nextval`, and writes that value back once the acquisition is seen
//! waiting, or done. Each acquisition kind then takes its key twice; the
//! second token must be above the first. Each test works in a schema of
//! its own on the shared server (127.0.0.1:5432, or `DLOCK_PG_URL`).

use super::token_lead::{
    draw_lock, draw_lock_sessions, fresh_key, hold_draw_lock, seq, server_clock,
};
use crate::pg_support::{ScratchSchema, free_on_the_server, shared_client, shared_conn};
use crate::support::within;

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::tokio_postgres::Client;
use dlock::pg::{PgBackend, PgOptions, TransactionLock};
use dlock::{Backend, LockKey, LockMode, LockOptions};

/// How a scenario takes its key.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// A plain lease, holder named (the default), with the quick statement.
    NamedQuick,
    /// A plain lease with `record_holders(false)`, with the quick statement.
    PlainQuick,
    /// A plain lease on a backend that has drawn nothing yet: the full
    /// statement, whose draw finds the sequence ahead and does not write.
    Full,
    /// A shared lease: the phase's starter draws in `dlock_join_readers`.
    Shared,
    /// A permit: `dlock_take_permit_slot` draws for the slot taken.
    Permit,
    /// A fair lease: the draw after the wait in the key's queue.
    Fair,
    /// A transaction lock, without and with a wait.
    Xact { wait: bool },
}

const KINDS: [Kind; 8] = [
    Kind::NamedQuick,
    Kind::PlainQuick,
    Kind::Full,
    Kind::Shared,
    Kind::Permit,
    Kind::Fair,
    Kind::Xact { wait: false },
    Kind::Xact { wait: true },
];

async fn backend(schema: &str, record_holders: bool) -> Arc<dyn Backend> {
    Arc::new(
        PgBackend::connect_with(
            &shared_conn(),
            PgOptions::new()
                .schema(schema)
                .sessions(1)
                .record_holders(record_holders),
        )
        .await
        .expect("connect"),
    )
}

/// Takes `key` the way `kind` does and gives it back: the token.
async fn take(
    kind: Kind,
    backend: &Arc<dyn Backend>,
    caller: &mut Client,
    schema: &str,
    key: &LockKey,
) -> i64 {
    let options = LockOptions::new(Duration::from_secs(30));
    let options = match kind {
        Kind::Shared => options.mode(LockMode::Shared),
        Kind::Permit => options.permits(2),
        Kind::Fair => options.fair(true).wait(Duration::from_secs(30)),
        Kind::Xact { wait } => {
            let mut tx = caller.transaction().await.expect("begin");
            let xact = TransactionLock::new().schema(schema);
            let xact = if wait {
                xact.wait(Duration::from_secs(30))
            } else {
                xact
            };
            let token = xact
                .acquire(&mut tx, key.clone())
                .await
                .expect("transaction lock");
            tx.commit().await.expect("commit");
            return token.get() as i64;
        }
        Kind::NamedQuick | Kind::PlainQuick | Kind::Full => options,
    };
    let lease = options
        .acquire_on(Arc::clone(backend), key)
        .await
        .expect("acquire");
    let token = lease.token().get() as i64;
    lease.release().await.expect("release");
    token
}

/// Plays the race for `kind` in a fresh schema: the key's second token
/// after the writer's write, against its first.
async fn tokens_beside_a_paused_writer(kind: Kind) -> (i64, i64) {
    let scratch = ScratchSchema::new("race");
    let admin = shared_client().await;
    let writer = shared_client().await;
    let backend = backend(&scratch.name, !matches!(kind, Kind::PlainQuick)).await;
    let lock = draw_lock(&admin, &scratch).await;
    // The sequence a minute ahead of the clock, as after many draws: every
    // draw takes `nextval` and writes nothing, and a full statement says
    // the sequence leads for a minute, so the quick one follows.
    let clock = server_clock(&admin).await;
    admin
        .execute(
            &format!("SELECT setval('{}', $1)", seq(&scratch.name)),
            &[&(clock + 60_000_000)],
        )
        .await
        .expect("set the sequence ahead");
    let key = fresh_key("race");
    let mut caller = shared_client().await;
    if !matches!(kind, Kind::Full) {
        take(
            kind,
            &backend,
            &mut caller,
            &scratch.name,
            &fresh_key("warm"),
        )
        .await;
    }

    writer
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock({}, {})",
            lock.0, lock.1
        ))
        .await
        .expect("the writer takes the draw lock");
    let drawn: i64 = writer
        .query_one(&format!("SELECT nextval('{}')", seq(&scratch.name)), &[])
        .await
        .expect("the writer's nextval")
        .get(0);
    let first = tokio::spawn({
        let (backend, key, schema) = (Arc::clone(&backend), key.clone(), scratch.name.clone());
        async move {
            let mut caller = shared_client().await;
            take(kind, &backend, &mut caller, &schema, &key).await
        }
    });
    within(
        20,
        "the acquisition waiting for the draw lock, or done",
        async {
            while !first.is_finished() && draw_lock_sessions(&admin, lock, false).await.is_empty() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        },
    )
    .await;
    writer
        .batch_execute(&format!(
            "SELECT setval('{}', {drawn}); COMMIT",
            seq(&scratch.name)
        ))
        .await
        .expect("the writer's write");
    let first = within(20, "the first acquisition", first)
        .await
        .expect("task");
    let second = take(kind, &backend, &mut caller, &scratch.name, &key).await;
    eprintln!("{kind:?}: the writer drew {drawn}; tokens {first}, then {second}");
    (first, second)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_draw_lands_between_a_writers_nextval_and_its_setval() {
    let mut again = Vec::new();
    for kind in KINDS {
        let (first, second) = tokens_beside_a_paused_writer(kind).await;
        if second <= first {
            again.push(format!("{kind:?}: {first}, then {second}"));
        }
    }
    assert!(
        again.is_empty(),
        "tokens drawn beside a writer were handed out again: {again:#?}"
    );
}

/// A transaction lock takes its key and draws in a savepoint of its own:
/// a draw that fails (here: `nextval` in a read-only transaction, the
/// sequence dropped) rolls the key back with it, waiting or not, the error
/// says the lock was not taken, and the caller's transaction goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_lock_whose_draw_fails_gives_the_key_back_and_says_so() {
    let scratch = ScratchSchema::new("race");
    let admin = shared_client().await;
    let _creates_the_objects = backend(&scratch.name, true).await;
    let mut caller = shared_client().await;
    for (setup, wait) in [
        ("SET TRANSACTION READ ONLY", Duration::ZERO),
        ("SET TRANSACTION READ ONLY", Duration::from_secs(5)),
        ("", Duration::ZERO),
    ] {
        if setup.is_empty() {
            admin
                .batch_execute(&format!("DROP SEQUENCE {}", seq(&scratch.name)))
                .await
                .expect("drop the sequence");
        }
        let key = fresh_key("failed-draw");
        let tx = caller.transaction().await.expect("begin");
        if !setup.is_empty() {
            tx.batch_execute(setup).await.expect("read only");
        }
        let mut tx = tx;
        let err = TransactionLock::new()
            .schema(&scratch.name)
            .wait(wait)
            .acquire(&mut tx, key.clone())
            .await
            .expect_err("the draw fails")
            .to_string();
        let usable = tx.query_one("SELECT 1", &[]).await.is_ok();
        let free = free_on_the_server(&admin, &key).await;
        tx.rollback().await.expect("rollback");
        assert!(
            usable && free && err.contains("the lock was not taken"),
            "{setup:?}, wait {wait:?}: transaction usable {usable}, key free {free}: {err}"
        );
    }
}

/// A caller that stops waiting for a transaction lock while its draw
/// waits for the draw lock (held here by another client past the draw's
/// 1 s): its transaction must stay usable, commit what it did, and hold
/// no key. The savepoint of the lock is rolled back when the future is
/// dropped, after the draw's message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_lock_given_up_during_its_draw_leaves_the_transaction_whole() {
    let scratch = ScratchSchema::new("race");
    let admin = shared_client().await;
    let _creates_the_objects = backend(&scratch.name, true).await;
    admin
        .batch_execute(&format!("CREATE TABLE {}.work (v int)", scratch.name))
        .await
        .expect("table");
    let lock = draw_lock(&admin, &scratch).await;
    let _dba = hold_draw_lock(lock).await;
    for wait in [Duration::ZERO, Duration::from_secs(5)] {
        let key = fresh_key("given-up");
        let mut caller = shared_client().await;
        let mut tx = caller.transaction().await.expect("begin");
        tx.execute(
            &format!("INSERT INTO {}.work VALUES (1)", scratch.name),
            &[],
        )
        .await
        .expect("the caller's work");
        let xact = TransactionLock::new().schema(&scratch.name).wait(wait);
        tokio::select! {
            answer = xact.acquire(&mut tx, key.clone()) => {
                panic!("answered while the draw lock is held: {answer:?}")
            }
            () = async {
                while draw_lock_sessions(&admin, lock, false).await.is_empty() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            } => {}
        }
        // The abandoned draw fails once its 1 s for the draw lock is over.
        within(20, "the abandoned draw's end", async {
            while !draw_lock_sessions(&admin, lock, false).await.is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        // Behind the savepoint's rollback on the caller's connection.
        let usable = tx.query_one("SELECT 1", &[]).await.is_ok();
        let free = free_on_the_server(&admin, &key).await;
        let committed = tx.commit().await.is_ok();
        let rows: i64 = admin
            .query_one(&format!("SELECT count(*) FROM {}.work", scratch.name), &[])
            .await
            .expect("count")
            .get(0);
        admin
            .batch_execute(&format!("TRUNCATE {}.work", scratch.name))
            .await
            .expect("truncate");
        assert!(
            usable && free && committed && rows == 1,
            "wait {wait:?}: usable {usable}, key free {free}, committed {committed}, \
             rows committed {rows} of 1"
        );
    }
}

/// Every attempt of a transaction lock opens a savepoint: one refused
/// (the key held elsewhere) or failed must close it again, or each would
/// leave a level in the caller's transaction (past 64 the server's cache
/// of subtransactions overflows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_transaction_lock_leaves_no_savepoint_open() {
    let scratch = ScratchSchema::new("race");
    let _creates_the_objects = backend(&scratch.name, true).await;
    let key = fresh_key("refused");
    let other = shared_client().await;
    other
        .query_one(
            "SELECT pg_advisory_lock(hashtextextended($1::text, 0))",
            &[&key.as_str()],
        )
        .await
        .expect("hold the key elsewhere");
    let mut caller = shared_client().await;
    let mut tx = caller.transaction().await.expect("begin");
    for wait in [Duration::ZERO, Duration::from_millis(50)] {
        for _ in 0..3 {
            let refused = TransactionLock::new()
                .schema(&scratch.name)
                .wait(wait)
                .acquire(&mut tx, key.clone())
                .await;
            assert!(refused.is_err(), "the key is held elsewhere: {refused:?}");
        }
    }
    let open = tx
        .batch_execute("RELEASE SAVEPOINT dlock_lock")
        .await
        .is_ok();
    tx.rollback().await.expect("rollback");
    assert!(!open, "a refused attempt left its savepoint open");
}

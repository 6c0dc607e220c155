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

use super::token_lead::{draw_lock, draw_lock_sessions, fresh_key, seq, server_clock};
use crate::pg_support::{ScratchSchema, shared_client, shared_conn};
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

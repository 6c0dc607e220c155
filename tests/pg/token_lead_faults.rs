//! The token lead under faults and operators: a sequence recreated by
//! dlock after a DBA set a longer lead, a role without UPDATE beside a
//! late writer, a fast crash, an older replica's functions left behind,
//! a sequence recreated beside older replicas, the draw lock held by
//! another client; tokens of a key keep rising and no acquisition hangs.
//! Two known limits stay ignored, with their reason. Each test works in
//! a schema of its own on the shared server (127.0.0.1:5432, or
//! `DLOCK_PG_URL`), or a server of its own.

use super::token_lead::{
    connect, draw_lock, draw_lock_sessions, fresh_key, hold_once, lead_comment, seq, set_back,
    set_lead,
};
use crate::pg_support::{OwnServer, PASSWORD, ScratchSchema, shared_client, shared_conn};
use crate::support::within;

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::PgBackend;
use dlock::pg::tokio_postgres::Client;
use dlock::{Backend, FencingToken, LockKey, LockOptions};

/// A lead of one second, which dlock reads as its largest, 10 ms.
const ONE_SECOND: &str = "dlock-token-lead-us=1000000";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_given_a_longer_lead_and_recreated_by_dlock_still_gives_higher_tokens() {
    let scratch = ScratchSchema::new("leadrev");
    let admin = shared_client().await;
    let backend = connect(&shared_conn(), &scratch.name).await;
    set_lead(&admin, &scratch.name, Some(ONE_SECOND)).await;
    set_back(&admin, &scratch.name).await;
    let key = fresh_key("dropped");
    let before = hold_once(&backend, &key).await;
    admin
        .batch_execute(&format!("DROP SEQUENCE {}", seq(&scratch.name)))
        .await
        .expect("drop");
    // dlock creates the sequence again, with its own lead of 10 ms.
    let after = hold_once(&backend, &key).await;
    assert!(
        after > before,
        "the recreated sequence's lead is shorter than the one its tokens were drawn with: \
         {after:?} after {before:?}"
    );
}

/// A role with USAGE alone on the sequence hands out the clock plus the
/// lead and writes nothing. A writing draw of another key whose clock
/// reading came just before it (its backend descheduled between that
/// reading and its `setval`, which this test plays step by step under the
/// draw lock, as `draw_token!` does it) would leave the sequence below
/// that token, within the lead of the clock, and the next holder of the
/// key, with UPDATE, would take `nextval` and undercut it. Every draw
/// takes the draw lock, so the draw without UPDATE waits for the writer:
/// the tokens of the key rise whether it drew before the write or after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_update_draws_the_bare_clock_which_a_late_writer_cannot_undercut() {
    let mut scratch = ScratchSchema::new("leadrev");
    let admin = shared_client().await;
    let usage_only = scratch.role_with_usage_only(&admin).await;
    set_lead(&admin, &scratch.name, Some(ONE_SECOND)).await;
    let reader = connect(&usage_only, &scratch.name).await;
    let writer = connect(&shared_conn(), &scratch.name).await;
    set_back(&admin, &scratch.name).await;

    // Another key's writing draw: draw lock, nextval, clock ...
    let mut descheduled = shared_client().await;
    let tx = descheduled.transaction().await.expect("begin");
    let clock: i64 = tx
        .query_one(
            &format!(
                "SELECT c FROM (SELECT pg_advisory_xact_lock(1685217655,
                                   ((('{s}'::regclass::oid)::int8) & 2147483647)::int4) AS held
                                OFFSET 0) AS d,
                 LATERAL (SELECT nextval('{s}') AS n,
                                 (EXTRACT(epoch FROM clock_timestamp()) * 1000000)::int8 AS c
                          OFFSET 0) AS u",
                s = seq(&scratch.name)
            ),
            &[],
        )
        .await
        .expect("the writer's clock reading")
        .get(0);
    // ... descheduled here, while the key's holder without UPDATE draws
    // (and waits for the draw lock) ...
    let key = fresh_key("usage-only");
    let drawing = tokio::spawn({
        let (reader, key) = (Arc::clone(&reader), key.clone());
        async move { hold_once(&reader, &key).await }
    });
    let lock = draw_lock(&admin, &scratch).await;
    within(
        20,
        "the draw without UPDATE waiting for the draw lock, or done",
        async {
            while !drawing.is_finished() && draw_lock_sessions(&admin, lock, false).await.is_empty()
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        },
    )
    .await;
    // ... and then its setval lands.
    tx.execute(
        &format!("SELECT setval('{}', $1)", seq(&scratch.name)),
        &[&(clock + 1_000_000)],
    )
    .await
    .expect("setval");
    tx.commit().await.expect("commit");
    let without_update = within(20, "the draw without UPDATE", drawing)
        .await
        .expect("task");
    let with_update = hold_once(&writer, &key).await;
    assert!(
        with_update > without_update,
        "the next holder undercut a token the sequence never held: \
         {with_update:?} after {without_update:?} (the writer read {clock})"
    );
}

async fn connect_default(schema: &str) -> PgBackend {
    PgBackend::connect_with(&shared_conn(), dlock::pg::PgOptions::new().schema(schema))
        .await
        .expect("connect")
}

/// Holds the draw lock of the scratch schema's sequence on `holder`'s
/// session, as any client may take any advisory lock.
async fn hold_the_draw_lock(holder: &Client, schema: &str) {
    holder
        .execute(
            &format!(
                "SELECT pg_advisory_lock(1685217655, ((('{}'::regclass::oid)::int8) & 2147483647)::int4)",
                seq(schema)
            ),
            &[],
        )
        .await
        .expect("hold the draw lock");
}

/// A transaction lock that does not wait (`TransactionLock::new()`, a
/// try) under the caller's `lock_timeout` of 0 — PostgreSQL's default —
/// must answer: before the lead it waited for nothing but a DDL lock on
/// the sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_try_lock_answers_while_another_client_holds_the_draw_lock() {
    let scratch = ScratchSchema::new("leadrev");
    let admin = shared_client().await;
    let _backend = connect_default(&scratch.name).await;
    let holder = shared_client().await;
    hold_the_draw_lock(&holder, &scratch.name).await;
    set_back(&admin, &scratch.name).await;
    let mut caller = shared_client().await;
    let mut tx = caller.transaction().await.expect("begin");
    let answer = tokio::time::timeout(
        Duration::from_secs(20),
        dlock::pg::TransactionLock::new()
            .schema(&scratch.name)
            .acquire(&mut tx, fresh_key("try")),
    )
    .await;
    holder
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .expect("unlock");
    assert!(
        answer.is_ok(),
        "a transaction try-lock still waits for another client's lock after 20 s"
    );
}

/// A lock session's acquisition that waited for the draw lock past its
/// `lock_timeout` fails: its error should say what it waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquisition_that_waited_for_the_draw_lock_says_so() {
    let scratch = ScratchSchema::new("leadrev");
    let admin = shared_client().await;
    let backend: Arc<dyn Backend> = Arc::new(connect_default(&scratch.name).await);
    let holder = shared_client().await;
    hold_the_draw_lock(&holder, &scratch.name).await;
    set_back(&admin, &scratch.name).await;
    let answer = tokio::time::timeout(
        Duration::from_secs(20),
        LockOptions::new(Duration::from_secs(30))
            .acquire_on(Arc::clone(&backend), &fresh_key("said")),
    )
    .await;
    holder
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .expect("unlock");
    let err = match answer {
        Ok(Err(err)) => err.to_string(),
        Ok(Ok(_)) => panic!("acquired while another client held the draw lock"),
        Err(_) => panic!("still waiting after 20 s"),
    };
    eprintln!("the acquisition's error: {err}");
    assert!(
        err.contains("draw lock") || err.contains("1685217655"),
        "the error names another lock than the one waited for: {err}"
    );
}

/// An acquisition with an identity draws (taking the draw lock when it
/// writes) before it writes its record, and waits for a record's row
/// another transaction left locked while it holds the draw lock: a lease
/// of any other key, with no record at all, must still be taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known limit: a recording statement waiting for a record row holds the draw lock (docs/postgres.md)"]
async fn a_record_row_left_locked_does_not_hold_up_other_keys() {
    use dlock::backend::{AcquireRequest, Attempt, OwnerId, ReleaseRequest};
    let scratch = ScratchSchema::new("leadrev");
    let admin = shared_client().await;
    // A process whose lock sessions wait longer for a lock (liveness 60 s)
    // beside one with the default (1 s).
    let recording = PgBackend::connect_with(
        &shared_conn(),
        dlock::pg::PgOptions::new()
            .schema(&scratch.name)
            .liveness_interval(Duration::from_secs(60))
            .server_idle_timeout(Some(Duration::from_secs(180))),
    )
    .await
    .expect("connect");
    let plain: Arc<dyn Backend> = Arc::new(connect_default(&scratch.name).await);
    let key = fresh_key("recorded");
    let owner = OwnerId::random().expect("owner");
    let request =
        AcquireRequest::new(&key, &owner, Duration::from_secs(30)).with_identity(Some("a"));
    match recording.try_acquire(&request).await.expect("first") {
        Attempt::Acquired(_) => {}
        held => panic!("free key: {held:?}"),
    }
    let lock_id: i64 = admin
        .query_one(
            &format!(
                "SELECT lock_id FROM {}.dlock_holders WHERE key = $1",
                scratch.name
            ),
            &[&key.as_str()],
        )
        .await
        .expect("the record")
        .get(0);
    recording
        .release(&ReleaseRequest::new(&key, &owner))
        .await
        .expect("release");
    // Another transaction writes the key's record row and stays open.
    let mut open = shared_client().await;
    let tx = open.transaction().await.expect("begin");
    tx.execute(
        &format!(
            "INSERT INTO {}.dlock_holders (lock_id, key, token, pid, session_start)
             VALUES ($1, 'left open', 0, 0, now())
             ON CONFLICT (lock_id) DO UPDATE SET key = 'left open'",
            scratch.name
        ),
        &[&lock_id],
    )
    .await
    .expect("the row");
    set_back(&admin, &scratch.name).await;
    let waiting = tokio::spawn(async move {
        let owner = OwnerId::random().expect("owner");
        let request =
            AcquireRequest::new(&key, &owner, Duration::from_secs(30)).with_identity(Some("b"));
        recording.try_acquire(&request).await.map(|_| ())
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let other = LockOptions::new(Duration::from_secs(30))
        .acquire_on(Arc::clone(&plain), &fresh_key("unrelated"))
        .await;
    tx.rollback().await.expect("rollback");
    let recorded = waiting.await.expect("task");
    eprintln!("the recording acquisition: {recorded:?}");
    let other = other.map(|lease| lease.token());
    assert!(
        other.is_ok(),
        "a lease of an unrelated key failed behind another key's record row: {other:?}"
    );
}

/// docs/postgres.md: an older dlock writes without the draw lock, so dlock
/// "never adds [the lead]" to an existing sequence. A sequence an older
/// dlock made and a DBA dropped while services run is created again by
/// whichever replica draws first: a new one gives it the lead, while older
/// replicas may still draw from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_recreated_beside_older_replicas_gets_no_lead() {
    let scratch = ScratchSchema::new("leadrev");
    let admin = shared_client().await;
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA {s}; CREATE SEQUENCE {s}.dlock_token_seq AS bigint",
            s = scratch.name
        ))
        .await
        .expect("the older dlock's objects");
    let backend = connect(&shared_conn(), &scratch.name).await;
    let key = fresh_key("older");
    hold_once(&backend, &key).await;
    admin
        .batch_execute(&format!("DROP SEQUENCE {}", seq(&scratch.name)))
        .await
        .expect("drop");
    hold_once(&backend, &key).await;
    let lead = lead_comment(&admin, &scratch.name).await;
    assert_eq!(
        lead, None,
        "a new replica switched the lead on where older replicas may still draw"
    );
}

/// A lock session's draw commits asynchronously, which TRY_LOCK's doc
/// calls safe because "a server takes far longer than the 10 ms lead to
/// come back". The comment allows a lead of up to a second, and a server
/// of this test's own comes back from a crash in a fraction of that: the
/// `nextval`s of the draws after another transaction's synchronous commit
/// are lost with the crash, the sequence comes back at the last `setval`,
/// still ahead of the clock, and the next draw hands out a token already
/// handed out. Four crashes, each right after forty draws.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_after_a_fast_crash_under_a_lead_set_to_one_second_are_above_the_last() {
    use dlock::pg::tokio_postgres::{NoTls, connect as pg_connect};
    let server = OwnServer::start();
    let conn = server.conn(PASSWORD, "");
    let mut went_back = Vec::new();
    for round in 0..4 {
        let backend: Arc<dyn Backend> = Arc::new(PgBackend::connect(&conn).await.expect("connect"));
        let (admin, connection) = pg_connect(&conn, NoTls).await.expect("admin");
        let connection = tokio::spawn(connection);
        admin
            .batch_execute(&format!(
                "COMMENT ON SEQUENCE dlock.dlock_token_seq IS '{ONE_SECOND}'"
            ))
            .await
            .expect("comment");
        set_back(&admin, "dlock").await;
        // A draw that writes: the sequence is now a second ahead of the clock.
        hold_once(&backend, &fresh_key("writes")).await;
        // Another application's synchronous commit flushes the WAL so far.
        admin
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS other_app (x int4); INSERT INTO other_app VALUES (1)",
            )
            .await
            .expect("another application's commit");
        let key = fresh_key("crash");
        let mut last = hold_once(&backend, &key).await;
        for _ in 0..40 {
            last = hold_once(&backend, &key).await;
        }
        drop(admin);
        connection.abort();
        let stopped = server.pg_ctl_stop("immediate");
        assert!(stopped.status.success(), "pg_ctl stop: {stopped:?}");
        drop(backend);
        server.pg_ctl_start();
        let backend: Arc<dyn Backend> =
            Arc::new(PgBackend::connect(&conn).await.expect("connect again"));
        let after = hold_once(&backend, &key).await;
        eprintln!("round {round}: {last:?} before the crash, {after:?} after");
        if after <= last {
            went_back.push((round, last, after));
        }
    }
    assert!(
        went_back.is_empty(),
        "tokens after a crash not above the last before it (round, last, first after): {went_back:?}"
    );
}

/// docs/postgres.md: a DBA switches the lead "for all at once" with the
/// comment. A draw reads the lead before it queues for the draw lock, so
/// a draw queued when the lead is switched off writes the clock plus the
/// old lead, while draws that read no lead write the bare clock without
/// the draw lock: one of those, descheduled between its clock reading and
/// its `setval` (played step by step here, as `draw_token!` does it with
/// no lead), lands after the queued draw's and leaves the sequence below
/// its token; the key's next holder then hands out the clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known limit: switching the lead off is not atomic for draws in flight (docs/postgres.md)"]
async fn switching_the_lead_off_while_a_draw_queues_lowers_no_token() {
    let scratch = ScratchSchema::new("leadrev");
    let admin = shared_client().await;
    let backend = connect(&shared_conn(), &scratch.name).await;
    set_lead(&admin, &scratch.name, Some(ONE_SECOND)).await;
    let queue = shared_client().await;
    hold_the_draw_lock(&queue, &scratch.name).await;
    set_back(&admin, &scratch.name).await;
    let key = fresh_key("switch");
    let queued = tokio::spawn({
        let backend = Arc::clone(&backend);
        let key = key.clone();
        async move { hold_once(&backend, &key).await }
    });
    // The draw reads the lead, then queues for the draw lock.
    within(30, "the draw queueing for the draw lock", async {
        loop {
            let waiting: i64 = admin
                .query_one(
                    &format!(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2
                       AND classid::int8 = 1685217655 AND NOT granted
                       AND objid::int8 = ('{}'::regclass::oid::int8 & 2147483647)",
                        seq(&scratch.name)
                    ),
                    &[],
                )
                .await
                .expect("pg_locks")
                .get(0);
            if waiting > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    admin
        .batch_execute(&format!(
            "COMMENT ON SEQUENCE {} IS NULL",
            seq(&scratch.name)
        ))
        .await
        .expect("lead off");
    // A draw with no lead: nextval, clock ...
    let clock: i64 = admin
        .query_one(
            &format!(
                "SELECT (EXTRACT(epoch FROM clock_timestamp()) * 1000000)::int8
                 FROM (SELECT nextval('{}') OFFSET 0) AS n",
                seq(&scratch.name)
            ),
            &[],
        )
        .await
        .expect("the unleading draw's clock reading")
        .get(0);
    queue
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .expect("let the queue go");
    let with_old_lead = queued.await.expect("task");
    // ... and its setval lands last.
    admin
        .execute(
            &format!("SELECT setval('{}', $1)", seq(&scratch.name)),
            &[&clock],
        )
        .await
        .expect("setval");
    let next = hold_once(&backend, &key).await;
    assert!(
        next > with_old_lead,
        "the next holder undercut a token drawn with the old lead: {next:?} after {with_old_lead:?} \
         (the unleading draw read {clock})"
    );
}

/// The functions of shared locks and permits as a dlock from before the
/// lead made them (`pg_get_functiondef` of each; `{schema}` stands for the
/// schema): each process makes them once, with `CREATE OR REPLACE`, at
/// its first shared or permit attempt.
const MODES_FUNCTIONS_BEFORE_LEAD: &str = include_str!("recorded/modes_functions_before_lead.sql");

async fn hold_shared_once(backend: &Arc<dyn Backend>, key: &LockKey) -> FencingToken {
    let lease = LockOptions::new(Duration::from_secs(30))
        .mode(dlock::LockMode::Shared)
        .acquire_on(Arc::clone(backend), key)
        .await
        .expect("the key is free");
    let token = lease.token();
    lease.release().await.expect("release");
    token
}

/// docs/postgres.md switches the lead on "until no older process draws
/// from it". An older replica that took its first shared lock after this
/// process took its own has replaced the functions with its draw, which
/// knows neither lead nor draw lock, and this process, which makes them
/// only once, calls those for good: once the older replicas are gone and
/// the lead is on, a shared lock after a sequence set back (what the
/// clock floor covers) hands out the bare clock, below the last token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_locks_after_an_older_replica_came_and_went_draw_with_the_lead() {
    let scratch = ScratchSchema::new("leadrev");
    let admin = shared_client().await;
    let backend = connect(&shared_conn(), &scratch.name).await;
    let key = fresh_key("older-functions");
    hold_shared_once(&backend, &key).await;
    admin
        .batch_execute(&MODES_FUNCTIONS_BEFORE_LEAD.replace("{schema}", &scratch.name))
        .await
        .expect("the older replica's functions");
    // Only this version from here on, with the lead switched on.
    set_lead(&admin, &scratch.name, Some(ONE_SECOND)).await;
    set_back(&admin, &scratch.name).await;
    let exclusive = hold_once(&backend, &key).await;
    set_back(&admin, &scratch.name).await;
    let shared = hold_shared_once(&backend, &key).await;
    assert!(
        shared > exclusive,
        "a shared lock drawn by the older functions went below the last token: \
         {shared:?} after {exclusive:?}"
    );
}

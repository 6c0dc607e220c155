//! The token lead: a sequence dlock creates is set 10 ms ahead of the
//! server clock whenever a draw must write it, so the draws within those
//! 10 ms take `nextval` and write nothing; a draw that must write takes the
//! draw lock first, and a transaction lock gives it back before its
//! caller's transaction ends. Each test works in a schema of its own on
//! the shared server (127.0.0.1:5432, or `DLOCK_PG_URL`).

use crate::pg_support::{ScratchSchema, random_id, shared_client, shared_conn};
use crate::support::within;

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::tokio_postgres::Client;
use dlock::pg::{PgBackend, TransactionLock};
use dlock::{Backend, FencingToken, LockKey, LockOptions};

/// The draw lock's first number (see `draw_lock!`): "draw" in ASCII.
const DRAW_LOCK_CLASS: i64 = 0x6472_6177;

pub(super) fn fresh_key(label: &str) -> LockKey {
    LockKey::new(format!("dlock-test:lead:{label}:{}", random_id())).expect("valid key")
}

/// The server clock, in microseconds since 1970: what a draw reads.
pub(super) async fn server_clock(client: &Client) -> i64 {
    client
        .query_one(
            "SELECT (EXTRACT(epoch FROM clock_timestamp()) * 1000000)::int8",
            &[],
        )
        .await
        .expect("clock")
        .get(0)
}

/// The schema's token sequence, as SQL names it.
pub(super) fn seq(schema: &str) -> String {
    format!("{schema}.dlock_token_seq")
}

/// Sets the sequence back to 1, so the next draw finds it behind the clock
/// and must write (and takes it for a lost one: more than a day behind).
pub(super) async fn set_back(admin: &Client, schema: &str) {
    admin
        .execute(&format!("SELECT setval('{}', 1)", seq(schema)), &[])
        .await
        .expect("setval");
}

/// Sets the sequence a second behind the clock: the next draw must write,
/// but the sequence is not taken for a lost one.
pub(super) async fn set_just_behind(admin: &Client, schema: &str) {
    admin
        .execute(
            &format!(
                "SELECT setval('{}', (EXTRACT(epoch FROM clock_timestamp()) * 1000000)::int8 - 1000000)",
                seq(schema)
            ),
            &[],
        )
        .await
        .expect("setval");
}

/// The sequence's comment, where its lead is kept.
pub(super) async fn lead_comment(admin: &Client, schema: &str) -> Option<String> {
    admin
        .query_one(
            &format!(
                "SELECT obj_description('{}'::regclass, 'pg_class')",
                seq(schema)
            ),
            &[],
        )
        .await
        .expect("comment")
        .get(0)
}

/// Sets the sequence's comment, the lead (`None`: no comment).
pub(super) async fn set_lead(admin: &Client, schema: &str, lead: Option<&str>) {
    let comment = lead.map_or("NULL".to_owned(), |lead| format!("'{lead}'"));
    admin
        .batch_execute(&format!("COMMENT ON SEQUENCE {} IS {comment}", seq(schema)))
        .await
        .expect("comment");
}

/// A backend of one lock session on `schema` through `conn`, whose
/// statements wait for locks as long as a test may need (30 s).
pub(super) async fn connect(conn: &str, schema: &str) -> Arc<dyn Backend> {
    Arc::new(
        PgBackend::connect_with(
            conn,
            dlock::pg::PgOptions::new()
                .schema(schema)
                .sessions(1)
                .liveness_interval(Duration::from_secs(60))
                .server_idle_timeout(Some(Duration::from_secs(180))),
        )
        .await
        .expect("connect"),
    )
}

/// Takes `key` and gives it back at once, retrying for up to 5 s while the
/// acquisition fails (a sequence being recreated): the token.
pub(super) async fn hold_once(backend: &Arc<dyn Backend>, key: &LockKey) -> FencingToken {
    let mut tries = 0;
    loop {
        match LockOptions::new(Duration::from_secs(30))
            .acquire_on(Arc::clone(backend), key)
            .await
        {
            Ok(lease) => {
                let token = lease.token();
                lease.release().await.expect("release");
                return token;
            }
            Err(err) if tries < 50 => {
                eprintln!("acquisition failed, retrying: {err}");
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => panic!("acquisition kept failing: {err}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_dlock_creates_leads_the_clock_and_draws_within_the_lead_write_nothing() {
    let scratch = ScratchSchema::new("lead");
    let admin = shared_client().await;
    let backend = connect(&shared_conn(), &scratch.name).await;
    assert_eq!(
        lead_comment(&admin, &scratch.name).await.as_deref(),
        Some("dlock-token-lead-us=10000")
    );

    // A sequence behind the clock by less than a day (not a lost one): the
    // draw hands out the clock plus the lead.
    set_just_behind(&admin, &scratch.name).await;
    let before = server_clock(&admin).await;
    let mut first = hold_once(&backend, &fresh_key("first")).await.get() as i64;
    let after = server_clock(&admin).await;
    assert!(
        (before + 10_000..=after + 10_000).contains(&first),
        "a draw that writes hands out the clock plus the lead: {first} against a clock of \
         {before}..={after}"
    );
    // Two acquisitions in a row within 10 ms take nextval: one pair in 50
    // tries is enough, however slow the machine is at times.
    let mut from_the_sequence = false;
    for _ in 0..50 {
        let next = hold_once(&backend, &fresh_key("next")).await.get() as i64;
        assert!(next > first, "tokens rise: {next} after {first}");
        if next == first + 1 {
            from_the_sequence = true;
            break;
        }
        first = next;
    }
    assert!(
        from_the_sequence,
        "a draw within the lead takes nextval and writes nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_without_a_lead_hands_out_the_clock() {
    let scratch = ScratchSchema::new("lead");
    let mut admin = shared_client().await;
    let backend = connect(&shared_conn(), &scratch.name).await;
    set_lead(&admin, &scratch.name, None).await;
    for _ in 0..3 {
        set_just_behind(&admin, &scratch.name).await;
        let before = server_clock(&admin).await;
        let token = hold_once(&backend, &fresh_key("plain")).await.get() as i64;
        let after = server_clock(&admin).await;
        assert!(
            (before..=after).contains(&token),
            "without a lead the token is the clock at the draw: {token} not in {before}..={after}"
        );
    }
    set_just_behind(&admin, &scratch.name).await;
    let before = server_clock(&admin).await;
    let tx = admin.transaction().await.expect("begin");
    let mut tx = tx;
    let token = TransactionLock::new()
        .schema(&scratch.name)
        .acquire(&mut tx, fresh_key("plain-xact"))
        .await
        .expect("transaction lock")
        .get() as i64;
    tx.commit().await.expect("commit");
    let after = server_clock(&admin).await;
    assert!(
        (before..=after).contains(&token),
        "{token} not in {before}..={after}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lead_is_at_most_10_ms_and_a_comment_of_another_form_is_no_lead() {
    let scratch = ScratchSchema::new("lead");
    let admin = shared_client().await;
    let backend = connect(&shared_conn(), &scratch.name).await;
    for (comment, lead) in [
        ("dlock-token-lead-us=1000000", 10_000),
        ("dlock-token-lead-us=2500", 2_500),
        ("dlock-token-lead-us=-5", 0),
        ("dlock-token-lead-us=99999999", 0),
        ("lead 10 ms", 0),
        (" dlock-token-lead-us=10000", 0),
    ] {
        set_lead(&admin, &scratch.name, Some(comment)).await;
        set_just_behind(&admin, &scratch.name).await;
        let before = server_clock(&admin).await;
        let token = hold_once(&backend, &fresh_key("form")).await.get() as i64;
        let after = server_clock(&admin).await;
        assert!(
            (before + lead..=after + lead).contains(&token),
            "comment {comment:?}: {token} is not the clock plus {lead} ({before}..={after})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_set_back_within_the_lead_still_hands_out_higher_tokens() {
    let scratch = ScratchSchema::new("lead");
    let admin = shared_client().await;
    let backend = connect(&shared_conn(), &scratch.name).await;
    set_lead(&admin, &scratch.name, Some("dlock-token-lead-us=10000")).await;
    let key = fresh_key("set-back");
    let mut last = hold_once(&backend, &key).await;
    for _ in 0..3 {
        // Drawn from the sequence, up to the lead above the clock.
        let from_sequence = hold_once(&backend, &key).await;
        assert!(from_sequence > last);
        set_back(&admin, &scratch.name).await;
        let after_set_back = hold_once(&backend, &key).await;
        assert!(
            after_set_back > from_sequence,
            "the floor moves with the lead: {after_set_back:?} after {from_sequence:?}"
        );
        last = after_set_back;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_recreated_without_its_lead_still_gives_tokens_above_the_last_ones() {
    let scratch = ScratchSchema::new("lead");
    let admin = shared_client().await;
    let backend = connect(&shared_conn(), &scratch.name).await;
    set_lead(&admin, &scratch.name, Some("dlock-token-lead-us=10000")).await;
    let key = fresh_key("recreated");
    for _ in 0..3 {
        // Up to a second above the clock.
        let last = hold_once(&backend, &key).await;
        admin
            .batch_execute(&format!(
                "BEGIN; DROP SEQUENCE {s}; CREATE SEQUENCE {s} AS bigint; COMMIT",
                s = seq(&scratch.name)
            ))
            .await
            .expect("recreate without the comment");
        let next = hold_once(&backend, &key).await;
        assert!(
            next > last,
            "a sequence recreated without its lead floors at the clock plus the largest lead: \
             {next:?} after {last:?}"
        );
        set_lead(&admin, &scratch.name, Some("dlock-token-lead-us=10000")).await;
    }
}

/// The draw lock's numbers for the scratch schema's sequence.
pub(super) async fn draw_lock(admin: &Client, scratch: &ScratchSchema) -> (i32, i32) {
    let row = admin
        .query_one(
            &format!(
                "SELECT $1::int8::int4, ((('{}'::regclass::oid)::int8) & 2147483647)::int4",
                seq(&scratch.name)
            ),
            &[&DRAW_LOCK_CLASS],
        )
        .await
        .expect("draw lock numbers");
    (row.get(0), row.get(1))
}

/// A client of its own holding the draw lock `lock` for its session, as
/// a draw that writes holds it (or anyone may take any advisory lock).
pub(super) async fn hold_draw_lock(lock: (i32, i32)) -> Client {
    let holder = shared_client().await;
    holder
        .execute("SELECT pg_advisory_lock($1, $2)", &[&lock.0, &lock.1])
        .await
        .expect("hold the draw lock");
    holder
}

/// Sessions holding (`granted`) or waiting for the draw lock.
pub(super) async fn draw_lock_sessions(
    admin: &Client,
    lock: (i32, i32),
    granted: bool,
) -> Vec<i32> {
    admin
        .query(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2
               AND classid::int8 = ($1::int4::int8 & 4294967295)
               AND objid::int8 = ($2::int4::int8 & 4294967295) AND granted = $3",
            &[&lock.0, &lock.1, &granted],
        )
        .await
        .expect("pg_locks")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draw_that_must_write_waits_for_the_draw_lock() {
    let scratch = ScratchSchema::new("lead");
    let admin = shared_client().await;
    let backend = connect(&shared_conn(), &scratch.name).await;
    let lock = draw_lock(&admin, &scratch).await;
    let holder = hold_draw_lock(lock).await;
    set_back(&admin, &scratch.name).await;
    let before = server_clock(&admin).await;
    let acquiring = tokio::spawn({
        let backend = Arc::clone(&backend);
        async move { hold_once(&backend, &fresh_key("waits")).await }
    });
    within(30, "the draw waiting for the draw lock", async {
        while draw_lock_sessions(&admin, lock, false).await.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        !acquiring.is_finished(),
        "the draw went on without the draw lock"
    );
    holder
        .execute("SELECT pg_advisory_unlock($1, $2)", &[&lock.0, &lock.1])
        .await
        .expect("let the draw lock go");
    let token = within(30, "the draw after the draw lock", acquiring)
        .await
        .expect("task")
        .get() as i64;
    assert!(
        token >= before + 10_000,
        "{token} against a clock of {before}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_lock_whose_draw_writes_holds_no_draw_lock_while_its_transaction_runs() {
    let scratch = ScratchSchema::new("lead");
    let admin = shared_client().await;
    let mut caller = shared_client().await;
    let backend = connect(&shared_conn(), &scratch.name).await;
    let lock = draw_lock(&admin, &scratch).await;
    for wait in [false, true] {
        set_back(&admin, &scratch.name).await;
        let before = server_clock(&admin).await;
        let mut tx = caller.transaction().await.expect("begin");
        let xact = TransactionLock::new().schema(&scratch.name);
        let xact = if wait {
            xact.wait(Duration::from_secs(5))
        } else {
            xact
        };
        let token = xact
            .acquire(&mut tx, fresh_key("xact"))
            .await
            .expect("transaction lock")
            .get() as i64;
        assert!(
            token >= before + 10_000,
            "{token} against a clock of {before}"
        );
        assert_eq!(
            draw_lock_sessions(&admin, lock, true).await,
            Vec::<i32>::new(),
            "the draw lock was given back before the transaction ended (wait: {wait})"
        );
        // Another draw that must write goes through meanwhile.
        set_back(&admin, &scratch.name).await;
        let other = within(20, "a lease's draw beside an open transaction", async {
            hold_once(&backend, &fresh_key("beside")).await
        })
        .await;
        assert!(other.get() as i64 > token);
        tx.commit().await.expect("commit");
    }
}

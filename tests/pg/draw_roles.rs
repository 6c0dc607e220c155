//! The token draw's write under the draw lock, against roles with only
//! some of the sequence's privileges and draws that overlap: what a
//! transaction lock of such a role hands out. Each test works in a schema
//! of its own on the shared server (127.0.0.1:5432, or `DLOCK_PG_URL`).

use crate::pg_support::{ScratchSchema, client_of, shared_client};
use crate::support::within;
use crate::token_lead::{draw_lock, draw_lock_sessions, fresh_key, hold_draw_lock, seq, set_lead};

use std::time::Duration;

use dlock::pg::TransactionLock;
use dlock::pg::tokio_postgres::Client;

/// Creates the schema, its token sequence with the 10 ms lead dlock gives
/// its own, and a login role with USAGE on the schema and `grants` on the
/// sequence; returns a connection string for the role.
async fn schema_and_role(admin: &Client, scratch: &mut ScratchSchema, grants: &str) -> String {
    let conn = scratch.role_with_sequence_grants(admin, grants).await;
    set_lead(admin, &scratch.name, Some("dlock-token-lead-us=10000")).await;
    conn
}

/// A role with UPDATE on the sequence and neither USAGE nor SELECT may
/// `nextval` and `setval` it, so a transaction lock of that role draws by
/// the whole rule, the write under the draw lock included. When another
/// draw wrote the sequence ahead of the clock while this one waited for
/// the draw lock, the draw takes `nextval` again and hands that out: a
/// token, not a "permission denied" that `currval` (SELECT or USAGE only)
/// would raise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_lock_of_a_role_with_update_alone_draws_after_another_draw_wrote_ahead() {
    let admin = shared_client().await;
    let mut scratch = ScratchSchema::new("upd_only");
    let caller_conn = schema_and_role(&admin, &mut scratch, "UPDATE").await;
    let lock = draw_lock(&admin, &scratch).await;

    // Held by hand, as a draw that writes holds it: the transaction lock's
    // draw (its sequence far behind the clock) comes to wait for it.
    let holder = hold_draw_lock(lock).await;

    let schema = scratch.name.clone();
    let drawn = tokio::spawn(async move {
        let mut caller = client_of(&caller_conn).await;
        let mut tx = caller.transaction().await.expect("begin");
        let token = TransactionLock::new()
            .schema(&schema)
            .acquire(&mut tx, fresh_key("upd-only"))
            .await;
        tx.rollback().await.expect("rollback");
        token
    });
    within(30, "the draw waiting for the draw lock", async {
        while draw_lock_sessions(&admin, lock, false).await.is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // The other draw's write: the sequence a second ahead of the clock.
    let ahead: i64 = admin
        .query_one(
            &format!(
                "SELECT setval('{}', (EXTRACT(epoch FROM clock_timestamp()) * 1000000)::int8 + 1000000)",
                seq(&scratch.name)
            ),
            &[],
        )
        .await
        .expect("setval")
        .get(0);
    holder
        .execute("SELECT pg_advisory_unlock($1, $2)", &[&lock.0, &lock.1])
        .await
        .expect("let the draw lock go");

    let token = drawn.await.expect("task").map(|t| t.get() as i64);
    assert!(
        matches!(token, Ok(t) if t > ahead),
        "a draw under the draw lock after another draw wrote ahead ({ahead}): {token:?}"
    );
}

/// The same without anyone's help: transaction locks of a role with
/// UPDATE alone on a sequence dlock leads by 10 ms, drawing at once on
/// keys of their own. Once per lead the sequence falls behind the clock
/// and the draws that find it so queue for the draw lock; all but the
/// first then find it written ahead. Every one of them gets a token.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transaction_locks_of_a_role_with_update_alone_drawing_at_once_all_get_tokens() {
    let admin = shared_client().await;
    let mut scratch = ScratchSchema::new("upd_race");
    let caller_conn = schema_and_role(&admin, &mut scratch, "UPDATE").await;
    let stop = std::time::Instant::now() + Duration::from_secs(2);
    let mut callers = Vec::new();
    for i in 0..4 {
        let caller_conn = caller_conn.clone();
        let schema = scratch.name.clone();
        callers.push(tokio::spawn(async move {
            let mut caller = client_of(&caller_conn).await;
            let key = fresh_key(&format!("upd-race{i}"));
            let (mut drawn, mut failed) = (0_u32, Vec::new());
            while std::time::Instant::now() < stop {
                let mut tx = caller.transaction().await.expect("begin");
                match TransactionLock::new()
                    .schema(&schema)
                    .acquire(&mut tx, &key)
                    .await
                {
                    Ok(_) => drawn += 1,
                    Err(err) => failed.push(format!("{err:?}")),
                }
                tx.rollback().await.expect("rollback");
            }
            (drawn, failed)
        }));
    }
    let (mut drawn, mut failed) = (0, Vec::new());
    for caller in callers {
        let (d, f) = caller.await.expect("caller");
        drawn += d;
        failed.extend(f);
    }
    assert!(
        failed.is_empty(),
        "{} of {} draws failed, the first: {}",
        failed.len(),
        drawn as usize + failed.len(),
        failed[0]
    );
}

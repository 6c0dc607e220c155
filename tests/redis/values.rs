//! What the Redis lock value (`<owner id><mark> <token> <server µs>
//! <record>`) promises, tried against values and key states that operators,
//! other tools and replicas of the previous protocol leave behind: a holder
//! is shown and broken only by the token it was granted, a value dlock did
//! not write is never written to, and one odd value hides no other holder.
//!
//! Against the Redis at `DLOCK_REDIS_URL` (default `redis://127.0.0.1:6379`).

use std::sync::Arc;
use std::time::Duration;

use dlock::backend::ForceRelease;
use dlock::{Backend, LockKey, LockOptions};

use crate::upgrade_record::Recorded;
use redis::AsyncCommands as _;
use redis::aio::MultiplexedConnection;

async fn backend() -> Arc<dyn Backend> {
    crate::redis_support::shared_backend().await
}

fn name(key: &LockKey, part: &str) -> String {
    format!("dlock:{{{key}}}:{part}")
}

/// An operator sets the fence counter back (a restore of the key, a
/// `SET dlock:{k}:fence` by hand) below the token the holder was granted.
async fn set_counter_back(conn: &mut MultiplexedConnection, key: &LockKey, to: u64) {
    let () = conn
        .set(name(key, "fence"), to.to_string())
        .await
        .expect("SET fence");
}

/// A holder of the previous protocol's shape (33 characters, its record in
/// the info key) keeps no token in its value: it must not be shown with a
/// token it was never granted after the counter was set back, nor broken
/// by `force_release_holding` naming that token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_previous_holder_is_never_shown_or_broken_by_a_token_it_was_not_granted() {
    let backend = backend().await;
    let mut conn = crate::redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("review-previous-counter-back");
    let mut previous = Recorded::new('d').await;
    let granted = previous.acquire(&key).await.expect("free");
    set_counter_back(&mut conn, &key, granted - 1_000).await;

    let shown = backend.holder(&key).await.expect("holder").expect("held");
    // A holder shown without a token is refused before any script runs.
    let broke = backend.force_release_holding(&key, &shown).await;
    let still_held: bool = conn.exists(name(&key, "lock")).await.expect("EXISTS");
    let _ = previous.release(&key).await;
    assert!(
        shown.token.is_none_or(|t| t.get() == granted),
        "the holder granted {granted} is shown with {:?}",
        shown.token
    );
    assert!(
        still_held && !matches!(broke, Ok(ForceRelease::Released)),
        "the holder granted {granted} was broken by {:?}: {broke:?}",
        shown.token
    );
}

/// The same on a new replica's own lease: a previous replica's release
/// hands it the key in the previous shape (its queue line is read only
/// for the owner id), and the counter set back afterwards names it with a
/// token it was never granted, which then breaks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_lease_handed_over_by_a_previous_replica_is_broken_only_by_its_own_token() {
    let backend = backend().await;
    let mut conn = crate::redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("review-handed-counter-back");
    let mut previous = Recorded::new('e').await;
    previous.acquire(&key).await.expect("free");
    let waiter = tokio::spawn({
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            LockOptions::new(Duration::from_secs(60))
                .fair(true)
                .wait(Duration::from_secs(10))
                .acquire_on(backend, &key)
                .await
        }
    });
    // Queued: its line is in the queue.
    for _ in 0..100 {
        let queue: Option<String> = conn.get(name(&key, "queue")).await.expect("GET queue");
        if queue.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(previous.release(&key).await, 1, "the previous release");
    let lease = waiter.await.expect("task").expect("handed the key");
    let granted = lease.token().get();
    set_counter_back(&mut conn, &key, granted - 1_000).await;

    let shown = backend.holder(&key).await.expect("holder").expect("held");
    // A holder shown without a token is refused before any script runs.
    let broke = backend.force_release_holding(&key, &shown).await;
    let lost = lease.is_lost();
    let _ = lease.release().await;
    assert!(
        shown.token.is_none_or(|t| t.get() == granted),
        "the lease granted {granted} is shown with {:?}",
        shown.token
    );
    assert!(
        !matches!(broke, Ok(ForceRelease::Released)) && !lost,
        "the lease granted {granted} was broken by {:?}: {broke:?}",
        shown.token
    );
}

/// A waiter marks only a value dlock wrote: another tool's value that
/// merely starts with 32 hex digits, `-` and a space (no token, no time,
/// no record) is left byte for byte as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_value_shaped_like_a_holder_is_never_written_to() {
    let backend = backend().await;
    let mut conn = crate::redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("review-foreign-shaped");
    let foreign = "0123456789abcdef0123456789abcdef- session of another tool";
    let () = conn
        .pset_ex(name(&key, "lock"), foreign, 60_000)
        .await
        .expect("SET");
    let attempt = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await;
    let after: String = conn.get(name(&key, "lock")).await.expect("GET");
    let _: i64 = conn.del(name(&key, "lock")).await.expect("DEL");
    assert!(attempt.is_err(), "a foreign value's key was taken");
    assert_eq!(
        after, foreign,
        "a waiter wrote to a value dlock never wrote"
    );
}

/// `held(prefix)` lists every holder under the prefix; a value whose
/// record is not UTF-8 (written by another tool, or by hand) is at most
/// one holder it cannot name, and never an error that hides the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_whose_record_is_not_text_hides_no_other_holder() {
    let backend = backend().await;
    let mut conn = crate::redis_support::shared_conn().await;
    let odd = dlock_runtime::conformance::fresh_key("review-not-text");
    let prefix = format!("{odd}/");
    let live = LockKey::new(format!("{prefix}live")).expect("key");
    let odd = LockKey::new(format!("{prefix}odd")).expect("key");
    let lease = LockOptions::new(Duration::from_secs(60))
        .acquire_on(backend.clone(), &live)
        .await
        .expect("free");
    let mut value = b"0123456789abcdef0123456789abcdef- 5 1700000000000000 1\tho".to_vec();
    value.extend_from_slice(&[0xff, 0xfe]);
    value.extend_from_slice(b"st\t42\t");
    let () = conn
        .pset_ex(name(&odd, "lock"), value, 60_000)
        .await
        .expect("SET");

    let odd_read = backend.holder(&odd).await;
    let listed = backend.held(&prefix).await;
    let _: i64 = conn.del(name(&odd, "lock")).await.expect("DEL");
    lease.release().await.expect("release");
    let listed = listed.expect("the listing of every holder under the prefix");
    assert!(
        listed.iter().any(|(key, _)| key == live.as_str()),
        "the live lease is missing from {listed:?}"
    );
    assert!(odd_read.is_ok(), "the odd value's holder: {odd_read:?}");
}

/// `force_release_holding` compares the token `holder` reads, read the
/// same way: a value whose token is written with leading zeros (an
/// operator's edit) is shown with that token and broken by it, and one
/// whose token `holder` cannot read (its time is not a number) is shown
/// without one and broken by none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_release_holding_reads_the_token_holder_shows() {
    let backend = backend().await;
    let mut conn = crate::redis_support::shared_conn().await;
    let owner = "0123456789abcdef0123456789abcdef";
    let padded = dlock_runtime::conformance::fresh_key("review-token-padded");
    let untimed = dlock_runtime::conformance::fresh_key("review-token-untimed");
    let values = [
        (
            &padded,
            format!("{owner}- 0005 1700000000000000 1\thost\t42\t"),
        ),
        (&untimed, format!("{owner}- 5 not-a-time 1\thost\t42\t")),
    ];
    for (key, value) in &values {
        let () = conn
            .pset_ex(name(key, "lock"), value, 60_000)
            .await
            .expect("SET");
    }

    let shown = backend
        .holder(&padded)
        .await
        .expect("holder")
        .expect("held");
    let padded_broken = backend
        .force_release_holding(&padded, &shown)
        .await
        .expect("force release");
    let unshown = backend
        .holder(&untimed)
        .await
        .expect("holder")
        .expect("held");
    let named = dlock::Holding::new(Some(dlock::FencingToken::new(5)), None);
    let untimed_broken = backend
        .force_release_holding(&untimed, &named)
        .await
        .expect("force release");
    let _: i64 = conn
        .del(&[name(&padded, "lock"), name(&untimed, "lock")])
        .await
        .expect("DEL");
    assert_eq!(shown.token.map(|t| t.get()), Some(5));
    assert_eq!(
        padded_broken,
        ForceRelease::Released,
        "the holder shown with token 5 was not broken by it"
    );
    assert_eq!(unshown.token, None);
    assert_ne!(
        untimed_broken,
        ForceRelease::Released,
        "a holder shown without a token was broken by token 5"
    );
}

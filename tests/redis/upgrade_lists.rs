//! A rolling upgrade to list queues: replicas that begin fair queues as
//! lists (`RedisBuilder::list_queues`) beside replicas of the dlock before
//! lists, which read a list as no queue. The earlier replica is played by
//! its own scripts, word for word (`recorded/string_queue/`): its waiter
//! replaces the list with a string queue, the list's waiters queue again
//! behind it, and every waiter of both is served, one holder at a time,
//! with rising tokens.

use crate::list_queue::{hex, join, list_backend, take};
use crate::redis_support;

use redis_support::{lock_name, shared_cli as cli, shared_url};

use dlock::backend::{OwnerId, ReleaseRequest};
use dlock::{HolderInfo, LockKey};
use redis::Script;

/// The fair acquire and release scripts of the dlock before list queues.
const FAIR_ACQUIRE: &str = include_str!("recorded/string_queue/fair_acquire.lua");
const RELEASE: &str = include_str!("recorded/string_queue/release.lua");

/// The value a holder or waiter of the earlier replica sends: its owner
/// id and the unwaited mark.
fn value(owner: &str) -> String {
    format!("{owner}-")
}

/// The earlier replica's fair attempt as a queued waiter: held (an
/// integer) or the token.
async fn join_earlier(conn: &mut redis::aio::MultiplexedConnection, key: &LockKey, owner: &str) {
    let reply: redis::Value = Script::new(FAIR_ACQUIRE)
        .key(lock_name(key))
        .key(format!("dlock:{{{key}}}:fence"))
        .key(format!("dlock:{{{key}}}:queue"))
        .key(format!("dlock:{{{key}}}:waiter:{owner}"))
        .arg(value(owner))
        .arg(60_000)
        .arg(HolderInfo::this_process(Some("earlier")).encode())
        .arg(30_000)
        .arg("w")
        .invoke_async(conn)
        .await
        .expect("the earlier fair acquire script");
    // Held: the holder's ttl; on a list, with the type error its
    // `GETRANGE` met, which the earlier replica takes for an ACL refusal
    // (it warns once, and looks for its line while the rejoin mark
    // stands).
    match reply {
        redis::Value::Int(_) => {}
        redis::Value::Array(parts) if matches!(parts.first(), Some(redis::Value::Int(_))) => {}
        other => panic!("held: {other:?}"),
    }
}

async fn release_earlier(conn: &mut redis::aio::MultiplexedConnection, key: &LockKey, owner: &str) {
    let released: i64 = Script::new(RELEASE)
        .key(lock_name(key))
        .arg(value(owner))
        .invoke_async(conn)
        .await
        .expect("the earlier release script");
    assert_eq!(released, 1, "the earlier replica held the key");
}

/// The holder's owner id and token, from the lock's value.
fn holder(key: &LockKey) -> (String, u64) {
    let value = cli(&["GET", &lock_name(key)]);
    let owner = value.chars().take(32).collect();
    let token = value
        .split(' ')
        .nth(1)
        .and_then(|token| token.parse().ok())
        .unwrap_or_else(|| panic!("a token in {value:?}"));
    (owner, token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_waiter_replaces_a_list_and_every_waiter_of_both_is_served_in_turn() {
    let backend = list_backend(&shared_url()).await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-upgrade-lists");
    let [holder_id, a, b] = std::array::from_fn(|_| OwnerId::random().expect("id"));
    take(&backend, &key, &holder_id).await;
    join(&backend, &key, &a).await;
    join(&backend, &key, &b).await;
    let queue = format!("dlock:{{{key}}}:queue");
    assert_eq!(cli(&["TYPE", &queue]), "list");
    // The earlier replica's waiter reads the list as no queue and begins
    // a string of its own over it.
    let earlier = "e".repeat(32);
    join_earlier(&mut conn, &key, &earlier).await;
    assert_eq!(cli(&["TYPE", &queue]), "string");
    // The list's waiters find their lines gone at their next refresh and
    // queue again, behind it, in their order.
    join(&backend, &key, &a).await;
    join(&backend, &key, &b).await;
    let order: Vec<String> = cli(&["GET", &queue])
        .lines()
        .map(|line| line.chars().take(32).collect())
        .collect();
    assert_eq!(order, [earlier.clone(), hex(&a), hex(&b)]);
    // Each release hands the key on, one holder at a time, tokens rising.
    let (_, mut last) = holder(&key);
    backend
        .release(&ReleaseRequest::new(&key, &holder_id))
        .await
        .expect("release");
    let mut served = Vec::new();
    for turn in 0..3 {
        let (owner, token) = holder(&key);
        assert!(token > last, "turn {turn}: token {token} after {last}");
        last = token;
        served.push(owner.clone());
        if owner == earlier {
            release_earlier(&mut conn, &key, &earlier).await;
        } else {
            let id = if owner == hex(&a) { &a } else { &b };
            backend
                .release(&ReleaseRequest::new(&key, id))
                .await
                .expect("release");
        }
    }
    assert_eq!(served, [earlier, hex(&a), hex(&b)]);
    assert_eq!(cli(&["EXISTS", &lock_name(&key)]), "0", "free at the end");
    assert_eq!(cli(&["EXISTS", &queue]), "0", "no queue left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_waiter_whose_queue_was_lost_to_a_list_queues_again_and_is_served() {
    let backend = list_backend(&shared_url()).await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-upgrade-lists-lost");
    let [holder_id, a] = std::array::from_fn(|_| OwnerId::random().expect("id"));
    take(&backend, &key, &holder_id).await;
    // The earlier replica's waiter queues first, in a string.
    let earlier = "f".repeat(32);
    join_earlier(&mut conn, &key, &earlier).await;
    let queue = format!("dlock:{{{key}}}:queue");
    assert_eq!(cli(&["TYPE", &queue]), "string");
    // The queue is lost (an operator's DEL), its rejoin mark with it, and
    // a new waiter begins a list.
    cli(&["DEL", &queue, &format!("dlock:{{{key}}}:rejoin")]);
    join(&backend, &key, &a).await;
    assert_eq!(cli(&["TYPE", &queue]), "list");
    // The earlier waiter's refresh cannot read the list, and must not take
    // that for its place kept: it queues again (as a string over the
    // list), and the list's waiter queues again behind it.
    join_earlier(&mut conn, &key, &earlier).await;
    join(&backend, &key, &a).await;
    let order: Vec<String> = cli(&["GET", &queue])
        .lines()
        .map(|line| line.chars().take(32).collect())
        .collect();
    assert_eq!(order, [earlier.clone(), hex(&a)], "both queued");
    backend
        .release(&ReleaseRequest::new(&key, &holder_id))
        .await
        .expect("release");
    assert_eq!(holder(&key).0, earlier, "the earlier waiter is served");
    release_earlier(&mut conn, &key, &earlier).await;
    assert_eq!(holder(&key).0, hex(&a), "then the new one");
    backend
        .release(&ReleaseRequest::new(&key, &a))
        .await
        .expect("release");
}

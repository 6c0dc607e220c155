//! Fair mode on Redis after its queue was deleted: every waiter that was
//! queued joins again, and is served before callers that join after it
//! looked again, whoever recreated the queue first. And a fair writer's
//! writer-waiting mark (rule M3) goes when the writer has the key, however
//! it got it.

use crate::redis_support;
use crate::support;

use std::sync::Arc;
use std::time::Duration;

use crate::fair::queued;
use dlock::backend::{
    Access, AcquireRequest, Attempt, OwnerId, QUEUE_ENTRY_TTL, Queue, ReleaseRequest,
};
use dlock::{Backend, LockError, LockKey, LockOptions};
use redis::aio::MultiplexedConnection;
use redis_support::{lock_name, shared_backend as backend};
use support::within;

async fn del(conn: &mut MultiplexedConnection, name: &str) {
    let _: i64 = redis::cmd("DEL")
        .arg(name)
        .query_async(conn)
        .await
        .expect("DEL");
}

/// The owner id that holds `key` now, from the lock's value.
async fn holder_of(conn: &mut MultiplexedConnection, key: &LockKey) -> String {
    let value: Option<String> = redis::cmd("GET")
        .arg(lock_name(key))
        .query_async(conn)
        .await
        .expect("GET lock");
    value.unwrap_or_default().chars().take(32).collect()
}

/// One fair waiter's attempt (its first join or a refresh), answered held.
async fn join(backend: &Arc<dyn Backend>, key: &LockKey, owner: OwnerId) {
    let answer = backend
        .try_acquire(
            &AcquireRequest::new(key, &owner, Duration::from_secs(20))
                .with_queue(Queue::Join {
                    entry_ttl: QUEUE_ENTRY_TTL,
                })
                .with_waits(true),
        )
        .await
        .expect("join");
    assert!(matches!(answer, Attempt::Held { .. }), "{answer:?}");
}

async fn release(backend: &Arc<dyn Backend>, key: &LockKey, owner: OwnerId) {
    backend
        .release(&ReleaseRequest::new(key, &owner))
        .await
        .expect("release");
}

fn ids<const N: usize>() -> [OwnerId; N] {
    std::array::from_fn(|_| OwnerId::random().expect("id"))
}

/// A newcomer joins right after the queue was deleted, before the waiters
/// of the old queue look again: it recreates the queue, and may go ahead
/// of them (docs/fair.md). Each old waiter must still join again at its
/// next look, and be served before a caller that joins after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_waiter_of_a_deleted_queue_joins_again_when_a_newcomer_recreated_it_first() {
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-fair-rejoin-newcomer");
    let [holder, a, b, newcomer, later] = ids();
    let taken = backend
        .try_acquire(&AcquireRequest::new(&key, &holder, Duration::from_secs(20)))
        .await
        .expect("acquire");
    assert!(matches!(taken, Attempt::Acquired(_)), "{taken:?}");
    join(&backend, &key, a).await;
    join(&backend, &key, b).await;
    del(&mut conn, &format!("dlock:{{{key}}}:queue")).await;
    join(&backend, &key, newcomer).await;
    // The old waiters' refreshes, then a caller that joins after them.
    join(&backend, &key, a).await;
    join(&backend, &key, b).await;
    join(&backend, &key, later).await;
    let order = queued(&mut conn, &key).await;
    release(&backend, &key, holder).await;
    assert_eq!(holder_of(&mut conn, &key).await, newcomer.to_string());
    release(&backend, &key, newcomer).await;
    let next = holder_of(&mut conn, &key).await;
    for owner in [a, b, newcomer, later] {
        release(&backend, &key, owner).await;
    }
    assert!(
        next == a.to_string() || next == b.to_string(),
        "after the newcomer, an old waiter ({a} or {b}) is served before {later}, who joined \
         after they looked again; served {next}, the queue was {order:?}"
    );
}

/// The rejoin mark is deleted right after the first old waiter set it:
/// the other old waiters must still join again at their next look.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_waiter_of_a_deleted_queue_joins_again_when_its_rejoin_mark_was_deleted() {
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-fair-rejoin-mark");
    let [holder, a, b, c] = ids();
    let taken = backend
        .try_acquire(&AcquireRequest::new(&key, &holder, Duration::from_secs(20)))
        .await
        .expect("acquire");
    assert!(matches!(taken, Attempt::Acquired(_)), "{taken:?}");
    for owner in [a, b, c] {
        join(&backend, &key, owner).await;
    }
    del(&mut conn, &format!("dlock:{{{key}}}:queue")).await;
    join(&backend, &key, c).await;
    del(&mut conn, &format!("dlock:{{{key}}}:rejoin")).await;
    join(&backend, &key, a).await;
    join(&backend, &key, b).await;
    let order = queued(&mut conn, &key).await;
    for owner in [holder, a, b, c] {
        release(&backend, &key, owner).await;
    }
    let mut sorted = order.clone();
    sorted.sort();
    let mut expected = vec![a.to_string(), b.to_string(), c.to_string()];
    expected.sort();
    assert_eq!(sorted, expected, "every old waiter is queued: {order:?}");
}

/// A waiter queued when the queue was deleted, with callers arriving
/// faster than the holders are served: it joins again within a second,
/// so it is served within its wait rather than passed by every caller
/// that came after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_of_a_deleted_queue_is_served_within_its_wait_while_callers_keep_coming() {
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-fair-rejoin-stream");
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let old = {
        let (backend, key) = (backend.clone(), key.clone());
        tokio::spawn(async move {
            let lease = LockOptions::new(Duration::from_secs(30))
                // Long, for a loaded machine: passed by every later
                // caller, it would wait out any wait (the stream runs
                // until it is served).
                .wait(Duration::from_secs(30))
                .fair(true)
                .acquire_on(backend, &key)
                .await?;
            lease.release().await
        })
    };
    within(20, "the old waiter queues", async {
        while queued(&mut conn, &key).await.is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    del(&mut conn, &format!("dlock:{{{key}}}:queue")).await;
    // Callers keep coming, four a second, each holding the key 400 ms.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stream = {
        let (backend, key, stop) = (backend.clone(), key.clone(), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut callers = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let (backend, key) = (backend.clone(), key.clone());
                callers.push(tokio::spawn(async move {
                    let lease = LockOptions::new(Duration::from_secs(30))
                        .wait(Duration::from_secs(60))
                        .fair(true)
                        .acquire_on(backend, &key)
                        .await?;
                    tokio::time::sleep(Duration::from_millis(400)).await;
                    lease.release().await
                }));
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            callers
        })
    };
    // The old waiter has looked again (every second) before the release.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    holder.release().await.expect("release");
    let served = within(45, "the old waiter", old).await.expect("task");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let callers = within(10, "the stream stops", stream).await.expect("task");
    for caller in callers {
        within(60, "a caller", caller)
            .await
            .expect("task")
            .expect("served");
    }
    assert!(
        !matches!(served, Err(LockError::Timeout { .. })),
        "the old waiter was served within its wait, not passed by every later caller: \
         {served:?}"
    );
    served.expect("served");
}

/// Rule M3 with fair writers: a fair writer that found readers left a
/// writer-waiting mark, and was then handed the key (by the attempt of the
/// fair writer behind it, once the readers left) rather than taking it by
/// its own attempt. Once both writers released, nobody holds or waits: a
/// reader that does not wait must get the key, not be refused by the
/// first writer's mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_is_not_refused_by_the_mark_of_a_fair_writer_that_was_handed_the_key() {
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-fair-writer-mark");
    let [reader, first, second, later] = ids();
    let ttl = Duration::from_secs(20);
    let taken = backend
        .try_acquire(&AcquireRequest::new(&key, &reader, ttl).with_access(Access::Shared))
        .await
        .expect("read");
    assert!(matches!(taken, Attempt::Acquired(_)), "{taken:?}");
    // Both fair writers queue behind the reader; the first leaves its mark.
    join(&backend, &key, first).await;
    join(&backend, &key, second).await;
    backend
        .release(&ReleaseRequest::new(&key, &reader).holding(Access::Shared, None))
        .await
        .expect("release the read");
    // The second writer looks first: it hands the free key to the first.
    join(&backend, &key, second).await;
    assert_eq!(holder_of(&mut conn, &key).await, first.to_string());
    release(&backend, &key, first).await;
    assert_eq!(holder_of(&mut conn, &key).await, second.to_string());
    release(&backend, &key, second).await;
    let mark: Option<String> = redis::cmd("GET")
        .arg(format!("dlock:{{{key}}}:writer"))
        .query_async(&mut conn)
        .await
        .expect("GET writer");
    let answer = backend
        .try_acquire(&AcquireRequest::new(&key, &later, ttl).with_access(Access::Shared))
        .await
        .expect("read");
    if matches!(answer, Attempt::Acquired(_)) {
        backend
            .release(&ReleaseRequest::new(&key, &later).holding(Access::Shared, None))
            .await
            .expect("release the read");
    }
    assert!(
        matches!(answer, Attempt::Acquired(_)),
        "a reader of a free key nobody waits for gets it: {answer:?}, writer mark {mark:?} \
         (the first writer was {first})"
    );
}

/// The queue's text, as stored.
async fn queue_text(conn: &mut MultiplexedConnection, key: &LockKey) -> String {
    let text: Option<String> = redis::cmd("GET")
        .arg(format!("dlock:{{{key}}}:queue"))
        .query_async(conn)
        .await
        .expect("GET queue");
    text.unwrap_or_default()
}

/// The first waiter leaves, then the next is handed the key: each rewrite
/// of the queue's front keeps the queue's stamp, so the waiters behind
/// keep their places at their next refresh without reading, or
/// rewriting, the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refreshes_after_the_front_of_the_queue_changed_keep_their_places_untouched() {
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-fair-front-changed");
    let [holder, a, b, c, d] = ids();
    let taken = backend
        .try_acquire(&AcquireRequest::new(&key, &holder, Duration::from_secs(20)))
        .await
        .expect("acquire");
    assert!(matches!(taken, Attempt::Acquired(_)), "{taken:?}");
    for owner in [a, b, c, d] {
        join(&backend, &key, owner).await;
    }
    // `a`, first, gives up; the holder hands the key to `b`.
    release(&backend, &key, a).await;
    release(&backend, &key, holder).await;
    assert_eq!(holder_of(&mut conn, &key).await, b.to_string());
    let before = queue_text(&mut conn, &key).await;
    for owner in [c, d] {
        join(&backend, &key, owner).await;
    }
    let after = queue_text(&mut conn, &key).await;
    assert_eq!(
        queued(&mut conn, &key).await,
        vec![c.to_string(), d.to_string()]
    );
    for owner in [b, c, d] {
        release(&backend, &key, owner).await;
    }
    assert_eq!(after, before, "a refresh rewrote the queue");
}

/// Everything of the key is lost at once while fair waiters wait (a
/// restart without persistence, as far as this key goes): the holder's
/// lock, the queue with its stamp, every entry and the counter. Each
/// waiter is still served within its wait, each with a token above the
/// holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_waiters_are_all_served_after_every_key_of_their_lock_was_lost() {
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-fair-all-lost");
    let fair = LockOptions::new(Duration::from_secs(30))
        .wait(Duration::from_secs(20))
        .fair(true);
    let holder = fair.acquire_on(backend.clone(), &key).await.expect("free");
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let (backend, key, fair) = (backend.clone(), key.clone(), fair.clone());
            tokio::spawn(async move {
                let lease = fair.acquire_on(backend, &key).await?;
                let token = lease.token();
                lease.release().await?;
                Ok::<_, LockError>(token)
            })
        })
        .collect();
    let owners = within(20, "the waiters queue", async {
        loop {
            let owners = queued(&mut conn, &key).await;
            if owners.len() == 3 {
                return owners;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let mut names = vec![
        lock_name(&key),
        format!("dlock:{{{key}}}:queue"),
        format!("dlock:{{{key}}}:fence"),
        format!("dlock:{{{key}}}:rejoin"),
    ];
    names.extend(
        owners
            .iter()
            .map(|owner| format!("dlock:{{{key}}}:waiter:{owner}")),
    );
    let _: i64 = redis::cmd("DEL")
        .arg(&names)
        .query_async(&mut conn)
        .await
        .expect("DEL");
    let lost = holder.token();
    for waiter in waiters {
        let token = within(20, "every waiter is served", waiter)
            .await
            .expect("task")
            .expect("served");
        assert!(token > lost, "{token} after the lost holder's {lost}");
    }
    assert!(
        holder.release().await.is_err(),
        "the holder's lease was lost"
    );
}

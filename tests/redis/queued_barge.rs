//! A plain (`Queue::Barge`) attempt by an owner this backend queued goes
//! through the fair acquire script, whose grant takes the owner out of the
//! queue (rule F1): under the least-privilege ACL, and with an identity.

use crate::list_queue;
use crate::redis_support;
use crate::support::within;
use dlock_runtime::conformance::{attempt_as, release_as};

use std::sync::Arc;
use std::time::Duration;

use dlock::backend::{AcquireRequest, Attempt, OwnerId, Queue, ReleaseOutcome};
use dlock::redis::RedisBackend;
use dlock::{Backend, LockKey};
use redis_support::{RedisServer, shared_backend};

/// `key` is held by a plain lease that runs out in 300 ms, and `first`
/// then `second` queue behind it (registered for their handoffs); the
/// notice of `second` is returned.
async fn held_with_two_waiters(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    first: &OwnerId,
    second: &OwnerId,
) -> dlock::backend::Handoff {
    let holder = OwnerId::random().expect("owner");
    let held = attempt_as(backend, key, &holder, Duration::from_millis(300)).await;
    assert!(
        matches!(held, Attempt::Acquired(_)),
        "a free key is taken: {held:?}"
    );
    let mut notices = Vec::new();
    for owner in [first, second] {
        notices.push(backend.subscribe_handoff(key, owner).await.expect("notice"));
        let queued = backend
            .try_acquire(
                &AcquireRequest::new(key, owner, Duration::from_secs(30)).with_queue(Queue::Join {
                    entry_ttl: Duration::from_secs(30),
                }),
            )
            .await
            .expect("join");
        assert!(
            matches!(queued, Attempt::Held { .. }),
            "the waiter queues: {queued:?}"
        );
    }
    notices.pop().expect("second's notice")
}

/// `request`'s owner takes its key once the holder's lease ran out (every
/// attempt answered, none an error).
async fn barge(backend: &Arc<dyn Backend>, request: &AcquireRequest<'_>) {
    within(
        10,
        "the queued owner's plain attempt after the ttl",
        async {
            loop {
                match backend.try_acquire(request).await {
                    Ok(Attempt::Acquired(_)) => return,
                    Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                    Err(err) => panic!("a queued owner's plain attempt failed: {err}"),
                }
            }
        },
    )
    .await;
}

/// `first` releases `key`, and `second` is handed it; `first` was not
/// handed it again.
async fn hand_on(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    (first, second): (&OwnerId, &OwnerId),
    second_notice: dlock::backend::Handoff,
) {
    assert_eq!(
        release_as(backend, key, first).await,
        ReleaseOutcome::Released
    );
    within(10, "the handoff to the waiter behind", second_notice).await;
    assert_eq!(
        release_as(backend, key, first).await,
        ReleaseOutcome::NotOwner,
        "the owner granted by a plain attempt was not handed the key again"
    );
    assert_eq!(
        release_as(backend, key, second).await,
        ReleaseOutcome::Released,
        "the waiter behind it holds the key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_owners_plain_attempt_needs_no_command_beyond_the_least_privilege_acl() {
    let server = RedisServer::start(&[]);
    let port = server.port.to_string();
    let target = ["-p", port.as_str()];
    // The docs' rules, and for list queues the list commands they add.
    redis_support::create_least_privilege_user(&target, "barge", "barge-pass-1");
    list_queue::create_lister(&target, "lister", "lister-pass-1");
    redis_support::reset_acl_log(&target);
    for (lists, user) in [
        (false, "barge:barge-pass-1"),
        (true, "lister:lister-pass-1"),
    ] {
        let url = format!("redis://{user}@127.0.0.1:{}", server.port);
        let backend: Arc<dyn Backend> = Arc::new(
            RedisBackend::builder(&url)
                .list_queues(lists)
                .connect()
                .await
                .expect("connect"),
        );
        let key = dlock_runtime::conformance::fresh_key("redis-barge-acl");
        let (first, second) = (
            OwnerId::random().expect("id"),
            OwnerId::random().expect("id"),
        );
        let notice = held_with_two_waiters(&backend, &key, &first, &second).await;
        barge(
            &backend,
            &AcquireRequest::new(&key, &first, Duration::from_secs(30)),
        )
        .await;
        hand_on(&backend, &key, (&first, &second), notice).await;
    }
    assert_eq!(
        list_queue::refused(&target),
        Vec::<String>::new(),
        "commands the ACL refused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_owners_plain_attempt_with_an_identity_records_it_and_leaves_the_queue() {
    let backend = shared_backend().await;
    let key = dlock_runtime::conformance::fresh_key("redis-barge-identity");
    let (first, second) = (
        OwnerId::random().expect("id"),
        OwnerId::random().expect("id"),
    );
    let notice = held_with_two_waiters(&backend, &key, &first, &second).await;
    let request =
        AcquireRequest::new(&key, &first, Duration::from_secs(30)).with_identity(Some("leader-1"));
    barge(&backend, &request).await;
    let holding = backend.holder(&key).await.expect("holder").expect("held");
    assert_eq!(
        holding.identity.as_deref(),
        Some("leader-1"),
        "the identity is recorded"
    );
    hand_on(&backend, &key, (&first, &second), notice).await;
}

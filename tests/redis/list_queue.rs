//! Fair mode with queues begun as lists (`RedisBuilder::list_queues`):
//! the conformance suite's fair properties on such a backend, the list as
//! the server keeps it, one fleet with the option on and off serving one
//! queue of either kind, a deleted list, and an ACL without the list
//! commands.

use crate::redis_support;
use crate::support;

use std::sync::Arc;
use std::time::Duration;

use dlock::backend::{AcquireRequest, Attempt, OwnerId, Queue, ReleaseRequest};
use dlock::redis::RedisBackend;
use dlock::{Backend, LockKey, LockOptions};
use redis_support::{RedisServer, lock_name, shared_url};
use support::within;

async fn backend() -> Arc<dyn Backend> {
    list_backend(&shared_url()).await
}

/// A backend on `url` that begins fair queues as lists.
pub(crate) async fn list_backend(url: &str) -> Arc<dyn Backend> {
    Arc::new(
        RedisBackend::builder(url)
            .list_queues(true)
            .connect()
            .await
            .expect("the Redis at DLOCK_REDIS_URL (or 127.0.0.1:6379) must be running"),
    )
}

dlock_runtime::conformance_suite!(@tests [backend]
    fair_waiters_are_served_in_arrival_order_with_rising_tokens,
    fair_a_cancelled_waiter_in_the_middle_does_not_hold_up_the_queue,
    fair_an_expired_entry_is_skipped_by_the_release,
    fair_an_owner_granted_by_a_plain_attempt_leaves_the_queue,
    fair_a_handoff_to_a_waiter_that_never_listens_comes_back_within_its_entry_ttl,
    fair_a_handoff_that_arrived_after_its_waiter_gave_up_is_passed_on,
    fair_no_waiter_starves_among_sixteen_looping_tasks,
    fair_a_handed_over_lease_renews_and_hands_on_when_dropped,
    fair_a_handed_over_lease_without_renewal_is_kept_for_its_whole_ttl,
    fair_a_handed_over_lease_with_a_short_ttl_is_not_spent_on_arrival,
    a_waiting_fair_writer_is_not_starved_by_another_processs_readers,
);

fn queue_name(key: &LockKey) -> String {
    format!("dlock:{{{key}}}:queue")
}

pub(crate) fn hex(owner: &OwnerId) -> String {
    String::from_utf8(owner.to_hex().to_vec()).expect("hex")
}

fn ids<const N: usize>() -> [OwnerId; N] {
    std::array::from_fn(|_| OwnerId::random().expect("id"))
}

/// `TYPE` of `key`'s queue on the server `cli` talks to.
fn queue_type(cli: &dyn Fn(&[&str]) -> String, key: &LockKey) -> String {
    cli(&["TYPE", &queue_name(key)])
}

/// The owners queued for `key`, in order, whichever kind the queue is.
fn queued(cli: &dyn Fn(&[&str]) -> String, key: &LockKey) -> Vec<String> {
    let name = queue_name(key);
    let text = match queue_type(cli, key).as_str() {
        "list" => cli(&["LRANGE", &name, "0", "-1"]),
        "string" => cli(&["GET", &name]),
        _ => String::new(),
    };
    text.lines()
        .map(|line| line.split(' ').next().unwrap_or_default().to_owned())
        .filter(|owner| owner.len() == 32)
        .collect()
}

fn shared(args: &[&str]) -> String {
    redis_support::shared_cli(args)
}

/// One fair waiter's attempt (its first join or a refresh), answered held.
pub(crate) async fn join(backend: &Arc<dyn Backend>, key: &LockKey, owner: &OwnerId) {
    let answer = backend
        .try_acquire(
            &AcquireRequest::new(key, owner, Duration::from_secs(20))
                .with_queue(Queue::Join {
                    entry_ttl: Duration::from_secs(30),
                })
                .with_waits(true),
        )
        .await
        .expect("join");
    assert!(matches!(answer, Attempt::Held { .. }), "{answer:?}");
}

async fn release(backend: &Arc<dyn Backend>, key: &LockKey, owner: &OwnerId) {
    backend
        .release(&ReleaseRequest::new(key, owner))
        .await
        .expect("release");
}

/// The owner id that holds `key` now, from the lock's value.
fn holder_of(cli: &dyn Fn(&[&str]) -> String, key: &LockKey) -> String {
    cli(&["GET", &lock_name(key)]).chars().take(32).collect()
}

/// Creates ACL user `user` on the server `target` names with the
/// least-privilege rules and the list commands the docs add for list
/// queues.
pub(crate) fn create_lister(target: &[&str], user: &str, password: &str) {
    let rules = format!(
        "{} +lpush +rpush +lpop +rpop +lindex +lpos +lrem",
        redis_support::LEAST_PRIVILEGE_ACL
    );
    redis_support::create_user(target, user, password, rules.split_whitespace());
}

/// The commands the server `target` names refused since its ACL log was
/// reset, but for those refused harmlessly.
pub(crate) fn refused(target: &[&str]) -> Vec<String> {
    redis_support::refused_commands(target)
        .into_iter()
        .filter(|command| !redis_support::HARMLESS_REFUSALS.contains(&command.as_str()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_queue_keeps_arrival_order_hands_on_in_it_and_goes_with_its_last_waiter() {
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("redis-list-order");
    let [holder, a, b, c] = ids();
    backend
        .try_acquire(&AcquireRequest::new(&key, &holder, Duration::from_secs(20)))
        .await
        .expect("acquire");
    for owner in [&a, &b, &c] {
        join(&backend, &key, owner).await;
    }
    assert_eq!(queue_type(&shared, &key), "list");
    assert_eq!(queued(&shared, &key), [hex(&a), hex(&b), hex(&c)]);
    // A refresh keeps its place and rewrites nothing.
    let before = shared(&["LRANGE", &queue_name(&key), "0", "-1"]);
    join(&backend, &key, &b).await;
    assert_eq!(shared(&["LRANGE", &queue_name(&key), "0", "-1"]), before);
    release(&backend, &key, &holder).await;
    assert_eq!(holder_of(&shared, &key), hex(&a), "handed to the first");
    assert_eq!(queued(&shared, &key), [hex(&b), hex(&c)]);
    // A waiter that gives up leaves; the next release skips nobody.
    release(&backend, &key, &b).await;
    release(&backend, &key, &a).await;
    assert_eq!(
        holder_of(&shared, &key),
        hex(&c),
        "handed past the one that left"
    );
    assert_eq!(
        queue_type(&shared, &key),
        "none",
        "the list goes with its last waiter"
    );
    release(&backend, &key, &c).await;
    assert_eq!(shared(&["EXISTS", &lock_name(&key)]), "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backends_with_list_queues_on_and_off_serve_one_queue_of_either_kind_in_arrival_order() {
    let listing = backend().await;
    let plain = redis_support::shared_backend().await;
    for (first, then, kind) in [(&listing, &plain, "list"), (&plain, &listing, "string")] {
        let key = dlock_runtime::conformance::fresh_key("redis-list-mixed");
        let [holder, a, b, c, d] = ids();
        first
            .try_acquire(&AcquireRequest::new(&key, &holder, Duration::from_secs(20)))
            .await
            .expect("acquire");
        join(first, &key, &a).await;
        join(then, &key, &b).await;
        join(first, &key, &c).await;
        join(then, &key, &d).await;
        assert_eq!(
            queue_type(&shared, &key),
            kind,
            "begun by the first to queue"
        );
        let order = [hex(&a), hex(&b), hex(&c), hex(&d)];
        assert_eq!(queued(&shared, &key), order);
        // Each release, by either backend, hands to the next in line.
        let mut owner = holder;
        for (turn, next) in [a, b, c, d].into_iter().enumerate() {
            let releaser = if turn % 2 == 0 { then } else { first };
            release(releaser, &key, &owner).await;
            assert_eq!(
                holder_of(&shared, &key),
                hex(&next),
                "turn {turn} of a {kind}"
            );
            owner = next;
        }
        release(first, &key, &owner).await;
        assert_eq!(queue_type(&shared, &key), "none");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_waiter_of_a_deleted_list_joins_again_and_is_served() {
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("redis-list-lost");
    let [holder, a, b, newcomer] = ids();
    backend
        .try_acquire(&AcquireRequest::new(&key, &holder, Duration::from_secs(20)))
        .await
        .expect("acquire");
    join(&backend, &key, &a).await;
    join(&backend, &key, &b).await;
    assert_eq!(shared(&["DEL", &queue_name(&key)]), "1");
    // A newcomer begins a list anew: another stamp, so the waiters of
    // the deleted one find their lines gone when they look again.
    join(&backend, &key, &newcomer).await;
    join(&backend, &key, &b).await;
    join(&backend, &key, &a).await;
    assert_eq!(
        queued(&shared, &key),
        [hex(&newcomer), hex(&b), hex(&a)],
        "every waiter of the deleted list queued again"
    );
    let mut owner = holder;
    for next in [newcomer, b, a] {
        release(&backend, &key, &owner).await;
        assert_eq!(holder_of(&shared, &key), hex(&next));
        owner = next;
    }
    release(&backend, &key, &owner).await;
}

/// Fair waiters through the core on `backend`: a holder, two waiters
/// queued behind it, one leaving through a release, every one served.
async fn serve_two_fair_waiters(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    queued: impl Fn() -> usize,
) {
    let holder = LockOptions::new(Duration::from_secs(30))
        .fair(true)
        .acquire_on(backend.clone(), key)
        .await
        .expect("holder");
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let (backend, key) = (backend.clone(), key.clone());
            tokio::spawn(async move {
                let lease = LockOptions::new(Duration::from_secs(30))
                    .wait(Duration::from_secs(15))
                    .fair(true)
                    .acquire_on(backend, &key)
                    .await?;
                lease.release().await
            })
        })
        .collect();
    within(10, "the waiters queue", async {
        while queued() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let gone = OwnerId::random().expect("id");
    join(backend, key, &gone).await;
    release(backend, key, &gone).await;
    holder.release().await.expect("release");
    for waiter in waiters {
        within(20, "the fair waiters", waiter)
            .await
            .expect("task")
            .expect("served");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_queues_need_only_the_list_commands_the_docs_name() {
    let server = RedisServer::start(&[]);
    let port = server.port.to_string();
    let target = ["-p", port.as_str()];
    create_lister(&target, "lister", "lister-pass-1");
    redis_support::reset_acl_log(&target);
    let backend = list_backend(&format!("redis://lister:lister-pass-1@127.0.0.1:{port}")).await;
    let key = dlock_runtime::conformance::fresh_key("redis-list-acl");
    let cli = |args: &[&str]| server.cli(args);
    serve_two_fair_waiters(&backend, &key, || {
        assert_ne!(queue_type(&cli, &key), "string");
        queued(&cli, &key).len()
    })
    .await;
    assert_eq!(
        refused(&target),
        Vec::<String>::new(),
        "commands the ACL refused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_queues_under_an_acl_without_the_list_commands_are_begun_as_strings() {
    let server = RedisServer::start(&[]);
    let port = server.port.to_string();
    let target = ["-p", port.as_str()];
    redis_support::create_least_privilege_user(&target, "plain", "plain-pass-1");
    redis_support::reset_acl_log(&target);
    let backend = list_backend(&format!("redis://plain:plain-pass-1@127.0.0.1:{port}")).await;
    let key = dlock_runtime::conformance::fresh_key("redis-list-no-acl");
    let cli = |args: &[&str]| server.cli(args);
    serve_two_fair_waiters(&backend, &key, || {
        assert_ne!(queue_type(&cli, &key), "list");
        queued(&cli, &key).len()
    })
    .await;
    let refused = refused(&target);
    assert!(!refused.is_empty(), "the list was tried");
    assert!(
        refused.iter().all(|command| command == "rpop"),
        "only the list's first command is refused, once per queue begun: {refused:?}"
    );
}

/// A take of `key` for `owner` that must succeed.
pub(crate) async fn take(backend: &Arc<dyn Backend>, key: &LockKey, owner: &OwnerId) {
    let got = backend
        .try_acquire(&AcquireRequest::new(key, owner, Duration::from_secs(20)))
        .await
        .expect("acquire");
    assert!(matches!(got, Attempt::Acquired(..)), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_key_of_another_type_is_no_queue_to_a_release_and_replaced_by_a_join() {
    for listing in [false, true] {
        let backend = if listing {
            backend().await
        } else {
            redis_support::shared_backend().await
        };
        let key = dlock_runtime::conformance::fresh_key("redis-list-hash-queue");
        let [holder, waiter] = ids();
        shared(&["HSET", &queue_name(&key), "junk", "1"]);
        take(&backend, &key, &holder).await;
        // Neither the join nor the release may fail on it, or leave the
        // key held: the join begins a queue of its own in its place.
        join(&backend, &key, &waiter).await;
        assert_ne!(queue_type(&shared, &key), "hash", "listing {listing}");
        release(&backend, &key, &holder).await;
        assert_eq!(
            holder_of(&shared, &key),
            hex(&waiter),
            "listing {listing}: handed to the waiter"
        );
        release(&backend, &key, &waiter).await;
        shared(&["HSET", &queue_name(&key), "junk", "1"]);
        take(&backend, &key, &holder).await;
        shared(&["SETRANGE", &lock_name(&key), "32", "+"]);
        release(&backend, &key, &holder).await;
        assert_eq!(
            shared(&["EXISTS", &lock_name(&key)]),
            "0",
            "listing {listing}: freed"
        );
        shared(&["DEL", &queue_name(&key)]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_acl_lacks_the_list_commands_still_frees_a_key_a_list_waits_for() {
    let server = RedisServer::start(&[]);
    let port = server.port.to_string();
    let target = ["-p", port.as_str()];
    create_lister(&target, "lister", "lister-pass-2");
    redis_support::create_least_privilege_user(&target, "plain", "plain-pass-2");
    let lister = list_backend(&format!("redis://lister:lister-pass-2@127.0.0.1:{port}")).await;
    let plain: Arc<dyn Backend> = Arc::new(
        RedisBackend::connect(&format!("redis://plain:plain-pass-2@127.0.0.1:{port}"))
            .await
            .expect("connect"),
    );
    let cli = |args: &[&str]| server.cli(args);
    let key = dlock_runtime::conformance::fresh_key("redis-list-acl-mixed");
    let [holder, waiter] = ids();
    take(&plain, &key, &holder).await;
    join(&lister, &key, &waiter).await;
    assert_eq!(queue_type(&cli, &key), "list");
    // The release cannot read the list: it frees the key (and announces
    // it) instead of failing with the key still held.
    release(&plain, &key, &holder).await;
    assert_eq!(cli(&["EXISTS", &lock_name(&key)]), "0", "freed");
    // The list's waiter takes it at its next look.
    let answer = lister
        .try_acquire(
            &AcquireRequest::new(&key, &waiter, Duration::from_secs(20))
                .with_queue(Queue::Join {
                    entry_ttl: Duration::from_secs(30),
                })
                .with_waits(true),
        )
        .await
        .expect("the waiter's next look");
    assert!(matches!(answer, Attempt::Acquired(..)), "{answer:?}");
    release(&lister, &key, &waiter).await;
}

// One thread: the log capture sees this thread's events.
#[tokio::test]
async fn a_waiter_that_cannot_read_a_list_says_the_list_commands_are_missing_not_getrange() {
    let (logs, _guard) = support::Logs::capture();
    let server = RedisServer::start(&[]);
    let port = server.port.to_string();
    let target = ["-p", port.as_str()];
    create_lister(&target, "lister", "lister-pass-3");
    redis_support::create_least_privilege_user(&target, "plain", "plain-pass-3");
    let lister = list_backend(&format!("redis://lister:lister-pass-3@127.0.0.1:{port}")).await;
    let plain: Arc<dyn Backend> = Arc::new(
        RedisBackend::connect(&format!("redis://plain:plain-pass-3@127.0.0.1:{port}"))
            .await
            .expect("connect"),
    );
    let key = dlock_runtime::conformance::fresh_key("redis-list-warn");
    let [holder, listed, unlisted] = ids();
    take(&lister, &key, &holder).await;
    join(&lister, &key, &listed).await;
    join(&plain, &key, &unlisted).await;
    let text = logs.text();
    assert!(
        text.contains("could not be kept as a list"),
        "the warning names the list: {text}"
    );
    assert!(
        !text.contains("+getrange"),
        "the user may GETRANGE; it lacks the list commands: {text}"
    );
}

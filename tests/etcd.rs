//! The conformance suite on `EtcdBackend` against a real three-member etcd
//! cluster this binary starts once (on free loopback ports), plus what the
//! etcd backend promises beyond it: the token is the lock key's create
//! revision, waiters share one watch per key and wake one at a time, an
//! unreachable cluster is an error in bounded time, and credentials never
//! show.

mod etcd_support;
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock::etcd::EtcdBackend;
use dlock::{Backend, LockError, LockKey, LockOptions};
use etcd_support::{create_revision, random_word, shared_backend, shared_cluster};
use support::{RefusedPort, within};

dlock_runtime::conformance_suite!(shared_backend);

fn fresh_key(label: &str) -> LockKey {
    LockKey::new(format!("etcd-test/{label}/{}", random_word())).expect("a key")
}

async fn shared() -> EtcdBackend {
    let endpoints = shared_cluster();
    let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
    EtcdBackend::connect(&endpoints)
        .await
        .expect("the shared cluster answers")
}

#[tokio::test]
async fn the_token_is_the_lock_keys_create_revision() {
    let backend = Arc::new(shared().await);
    let key = fresh_key("revision");
    let options = LockOptions::new(Duration::from_secs(10));
    let first = options
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("free");
    let revision = create_revision(&shared_cluster()[0], key.as_str());
    assert_eq!(revision, Some(first.token().get()));
    let first_token = first.token();
    first.release().await.expect("release");
    // Other writes to the cluster move the revision on; the next token is
    // the new create revision, above the first.
    let other = options
        .acquire_on(backend.clone(), fresh_key("revision-other"))
        .await
        .expect("free");
    let second = options
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("free again");
    assert!(second.token() > other.token() && other.token() > first_token);
    assert_eq!(
        create_revision(&shared_cluster()[1], key.as_str()),
        Some(second.token().get())
    );
    second.release().await.expect("release");
    other.release().await.expect("release");
}

#[tokio::test]
async fn waiters_of_a_process_share_one_watch_and_each_release_wakes_one() {
    const WAITERS: usize = 6;
    let backend = Arc::new(shared().await);
    let key = fresh_key("herd");
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("free");
    // Every waiter counts its attempts: a release must cost one attempt
    // (the woken waiter's), not one per waiter.
    let counting = support::CountingBackend::new(backend.clone());
    let done = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..WAITERS {
        let (counting, key, done) = (counting.clone(), key.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let lease = LockOptions::new(Duration::from_secs(30))
                .wait(Duration::from_secs(60))
                .acquire_on(counting, key)
                .await
                .expect("each waiter gets the key in turn");
            tokio::time::sleep(Duration::from_millis(50)).await;
            done.fetch_add(1, Ordering::SeqCst);
            lease.release().await.expect("release");
        }));
    }
    // A waiter tries once, subscribes (which returns once etcd has
    // confirmed the key's watch), then tries again and naps until woken
    // (lease/acquire.rs `take`): two attempts each before the release.
    // Wait for all of them to be answered, however slow a loaded etcd is
    // to confirm the watch, rather than a fixed pause: only then is every
    // waiter subscribed, and `before` counts no attempt of this phase.
    within(20, "every waiter to subscribe and look again", async {
        while counting.attempts() < 2 * WAITERS || counting.answered() != counting.attempts() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(backend.watched_keys(), 1, "one watch for the key's waiters");
    let before = counting.attempts();
    holder.release().await.expect("release");
    for task in tasks {
        within(60, "every waiter to get the key", task)
            .await
            .expect("waiter");
    }
    assert_eq!(done.load(Ordering::SeqCst), WAITERS);
    // Six releases (the holder's and five waiters'), each waking one
    // waiter: about one attempt per release, far from one per waiter per
    // release (6 × 6 / 2 on average). Generous room for the rechecks a
    // loaded machine may add.
    let after = counting.attempts() - before;
    assert!(
        after <= 2 * WAITERS + 2,
        "{after} attempts for {WAITERS} releases: waiters were woken in a herd"
    );
    within(10, "the watch to go with its last waiter", async {
        while backend.watched_keys() != 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

#[tokio::test]
async fn an_unreachable_cluster_is_an_error_within_the_connect_timeout() {
    let refused = RefusedPort::new();
    let closed = format!("http://127.0.0.1:{}", refused.port);
    let started = Instant::now();
    let refused = EtcdBackend::builder(&[closed.as_str()])
        .connect_timeout(Duration::from_millis(800))
        .connect()
        .await;
    assert!(
        matches!(refused, Err(LockError::Backend { .. })),
        "{refused:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "connecting to a closed port took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn credentials_never_appear_in_errors_or_debug_output() {
    let refused = RefusedPort::new();
    let port = refused.port;
    let url = format!("http://dlock:hunter2@127.0.0.1:{port}");
    let builder = EtcdBackend::builder(&[url.as_str()]).connect_timeout(Duration::from_millis(500));
    let shown = format!("{builder:?}");
    assert!(
        !shown.contains("hunter2") && shown.contains(&port.to_string()),
        "{shown}"
    );
    let err = builder.connect().await.expect_err("nothing listens there");
    let text = format!("{err} {err:?}");
    assert!(!text.contains("hunter2"), "{text}");
    // A cluster without authentication refuses the credentials; the
    // refusal does not show them either.
    let endpoint = &shared_cluster()[0];
    let with_user = endpoint.replace("http://", "http://dlock:hunter2@");
    match EtcdBackend::connect(&[with_user.as_str()]).await {
        Ok(backend) => {
            let shown = format!("{backend:?}");
            assert!(!shown.contains("hunter2"), "{shown}");
        }
        Err(err) => {
            let text = format!("{err} {err:?}");
            assert!(!text.contains("hunter2"), "{text}");
        }
    }
}

#[tokio::test]
async fn a_lock_key_deleted_by_an_operator_is_lost_for_its_holder() {
    let backend = Arc::new(shared().await);
    let key = fresh_key("operator");
    let lease = LockOptions::new(Duration::from_secs(2))
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("free");
    let deleted = etcd_support::etcdctl(
        &shared_cluster()[0],
        &["del", &format!("dlock/lock/{}", key.as_str())],
    );
    assert_eq!(deleted.as_deref().map(str::trim), Some("1"));
    let err = support::until_lost(&lease, "the holder to hear its key was deleted").await;
    assert!(matches!(err, LockError::LeaseLost { .. }), "{err:?}");
    let next = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("the key is free again");
    assert!(next.token() > lease.token());
    assert!(backend.holder(&key).await.expect("holder").is_some());
    next.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_owner_that_takes_a_key_again_right_after_its_release_keeps_it() {
    use dlock::backend::{
        AcquireRequest, Attempt, OwnerId, ReleaseOutcome, ReleaseRequest, Renewal,
    };
    // The lease id comes from the owner id and the ttl: a multi-key
    // acquisition that backs off releases a key and takes it again with
    // the same owner, on the same lease id. The release's revoke of the
    // old lease must be over by then, or it deletes the new hold. Many
    // owners at once, many rounds each, so a late revoke would land.
    let backend = Arc::new(shared().await);
    let ttl = Duration::from_secs(10);
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let backend = backend.clone();
            tokio::spawn(async move {
                let key = fresh_key("same-owner-again");
                let owner = OwnerId::random().expect("random");
                for round in 0..30 {
                    let taken = backend
                        .try_acquire(&AcquireRequest::new(&key, &owner, ttl))
                        .await
                        .expect("acquire");
                    assert!(matches!(taken, Attempt::Acquired(_)), "round {round}");
                    let extended = backend
                        .extend(&Renewal::new(&key, &owner, ttl))
                        .await
                        .expect("extend");
                    assert!(
                        extended,
                        "round {round}: the hold taken again must be the owner's"
                    );
                    let released = backend
                        .release(&ReleaseRequest::new(&key, &owner))
                        .await
                        .expect("release");
                    assert_eq!(released, ReleaseOutcome::Released, "round {round}");
                }
            })
        })
        .collect();
    for task in tasks {
        within(60, "the owners' rounds", task)
            .await
            .expect("owner task");
    }
}

#[tokio::test]
async fn a_renewal_writes_a_deleted_identity_record_again() {
    use dlock::backend::{AcquireRequest, Attempt, OwnerId, Renewal};
    let backend = shared().await;
    let key = fresh_key("identity-again");
    let owner = OwnerId::random().expect("random");
    let ttl = Duration::from_secs(10);
    let request = AcquireRequest::new(&key, &owner, ttl).with_identity(Some("web-7"));
    let Attempt::Acquired(grant) = backend.try_acquire(&request).await.expect("acquire") else {
        panic!("{key} must be free");
    };
    let deleted = etcd_support::etcdctl(
        &shared_cluster()[0],
        &["del", &format!("dlock/identity/{}", key.as_str())],
    );
    assert_eq!(deleted.as_deref().map(str::trim), Some("1"));
    let hidden = backend.holder(&key).await.expect("holder").expect("held");
    assert_eq!(hidden.identity, None, "the record is gone");
    let renewed = backend
        .extend(&Renewal::new(&key, &owner, ttl).recording("web-7", grant.token))
        .await
        .expect("extend");
    assert!(renewed);
    let holding = backend.holder(&key).await.expect("holder").expect("held");
    assert_eq!(holding.identity.as_deref(), Some("web-7"));
    assert_eq!(holding.token, Some(grant.token));
    let released = backend
        .release(&dlock::backend::ReleaseRequest::new(&key, &owner))
        .await
        .expect("release");
    assert_eq!(released, dlock::backend::ReleaseOutcome::Released);
    assert_eq!(backend.holder(&key).await.expect("holder"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_reply_was_lost_and_whose_retry_finds_the_key_free_is_unconfirmed() {
    use dlock::backend::{AcquireRequest, Attempt, OwnerId, ReleaseOutcome, ReleaseRequest};
    let member = shared_cluster()[0].trim_start_matches("http://").to_owned();
    let proxy = support::proxy::Proxy::bind(member).await;
    let through = format!("http://127.0.0.1:{}", proxy.port);
    let backend = EtcdBackend::builder(&[through.as_str()])
        .response_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect("the shared cluster, through the proxy");
    let key = fresh_key("release-reply-lost");
    let owner = OwnerId::random().expect("random");
    let taken = backend
        .try_acquire(&AcquireRequest::new(&key, &owner, Duration::from_secs(30)))
        .await
        .expect("acquire");
    assert!(matches!(taken, Attempt::Acquired(_)));
    // The release reaches etcd and frees the key; its answer is dropped,
    // then the connection breaks, so the backend asks again.
    proxy.mute_replies();
    let watched = key.clone();
    let release = tokio::spawn(async move {
        backend
            .release(&ReleaseRequest::new(&key, &owner))
            .await
            .map(|outcome| (outcome, key))
    });
    // Only once etcd has applied the release is the reply's loss the case
    // under test: the key is seen free from another connection.
    let other = shared().await;
    within(10, "the release to reach etcd", async {
        while other.holder(&watched).await.expect("holder").is_some() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    proxy.cut();
    let (outcome, key) = within(10, "the release to answer", release)
        .await
        .expect("release task")
        .expect("the retry answers");
    assert_eq!(outcome, ReleaseOutcome::Unconfirmed);
    assert_eq!(other.holder(&key).await.expect("holder"), None);
}

/// etcd tells a lease's time left in whole seconds, cut down: a lease with
/// 1.9 s left reads 1 s. The time left a holder is shown (the `dlock`
/// command's "expires in", an HTTP `Retry-After`) must never be less than
/// the lease can still have: at least the ttl less the time since the
/// acquisition started, read as late as possible.
#[tokio::test]
async fn the_time_left_on_a_held_key_is_never_less_than_its_lease_has() {
    let backend = Arc::new(shared().await);
    let key = fresh_key("time-left");
    let ttl = Duration::from_secs(2);
    let started = Instant::now();
    let lease = LockOptions::new(ttl)
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("free");
    let holding = backend.holder(&key).await.expect("holder").expect("held");
    let at_least = ttl.saturating_sub(started.elapsed());
    let expires_in = holding.expires_in.expect("etcd tells a lease's time left");
    assert!(
        expires_in >= at_least,
        "shown {expires_in:?} left, while the lease has at least {at_least:?}"
    );
    // A refused acquisition carries the same reading, for `Retry-After`.
    // The holder is read after the refusal within a bound of its own: a
    // read a stall pushed past it costs one refusal its holder. Of a few
    // refusals, one must name it.
    let mut tries = 0;
    let (holder, at_least) = loop {
        tries += 1;
        let refused = LockOptions::new(ttl)
            .acquire_on(backend.clone(), key.clone())
            .await
            .expect_err("held");
        let at_least = ttl.saturating_sub(started.elapsed());
        match refused {
            LockError::Held {
                holder: Some(holder),
                ..
            } => break (holder, at_least),
            LockError::Held { holder: None, .. } if tries < 5 => {}
            refused => panic!("{tries} refusals, the last without a holder: {refused:?}"),
        }
    };
    let expires_in = holder.expires_in.expect("etcd tells a lease's time left");
    assert!(
        expires_in >= at_least,
        "a refusal shows {expires_in:?} left, while the lease has at least {at_least:?}"
    );
    lease.release().await.expect("release");
}

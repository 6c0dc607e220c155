//! The conformance suite on `EtcdBackend` against a real three-member etcd
//! cluster this binary starts once (on free loopback ports), plus what the
//! etcd backend promises beyond it: the token is the lock key's create
//! revision, waiters share one watch per key and wake one at a time, an
//! unreachable cluster is an error in bounded time, and credentials never
//! show.

use crate::etcd_support;
use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock::etcd::EtcdBackend;
use dlock::{Backend, LockError, LockKey, LockOptions};
use etcd_support::{create_revision, random_word, shared_backend, shared_cluster};
use support::{RefusedPort, within};

use super::fresh_key;
use super::solo::Solo;

dlock_runtime::conformance_suite!(shared_backend);

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

// ---------------------------------------------------------------------------
// On a member of the test's own: callers that give up mid-call, keys that
// prefix each other, short ttls, and a ttl changed between holds.

/// Callers that give up at random points of acquire and release, many
/// times: afterwards no watch is left behind and a caller gets the key
/// within the ttl plus the backend's expiry slack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_that_give_up_mid_call_leave_nothing_held_or_watched() {
    let solo = Solo::start(&[]);
    let etcd = Arc::new(
        EtcdBackend::connect(&[solo.endpoint().as_str()])
            .await
            .expect("connect"),
    );
    let backend: Arc<dyn Backend> = etcd.clone();
    let key = fresh_key("give-up");
    let ttl = Duration::from_secs(1);
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut last_token = None;
    for _ in 0..120 {
        let cut = Duration::from_micros(next() % 8_000);
        let waiter = {
            let backend = backend.clone();
            let key = key.clone();
            tokio::spawn(async move {
                LockOptions::new(ttl)
                    .wait(Duration::from_millis(200))
                    .acquire_on(backend, key)
                    .await
            })
        };
        let acquired = tokio::time::timeout(
            cut,
            LockOptions::new(ttl)
                .wait(Duration::from_millis(200))
                .acquire_on(backend.clone(), key.clone()),
        )
        .await;
        if let Ok(Ok(lease)) = acquired {
            if let Some(last) = last_token {
                assert!(lease.token() > last);
            }
            last_token = Some(lease.token());
            let _ =
                tokio::time::timeout(Duration::from_micros(next() % 4_000), lease.release()).await;
        }
        if let Ok(lease) = waiter.await.expect("waiter") {
            let _ =
                tokio::time::timeout(Duration::from_micros(next() % 4_000), lease.release()).await;
        }
    }
    let bound = ttl + etcd.expiry_slack() + Duration::from_secs(3);
    let deadline = Instant::now() + bound;
    loop {
        if backend.holder(&key).await.expect("holder").is_none() && etcd.watched_keys() == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still held or watched: {:?}, {} watches",
            backend.holder(&key).await,
            etcd.watched_keys()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // An abandoned attempt goes on detached until its answer, then gives
    // back what it was granted: one still on its way may take the key just
    // after the check above. The caller waits for that give-back (or for
    // the ttl), never longer than the bound.
    let lease = LockOptions::new(ttl)
        .wait(bound)
        .acquire_on(backend.clone(), key.clone())
        .await
        .expect("free within the ttl and the expiry slack at the end");
    lease.release().await.expect("release");
}

/// Keys with `/`, a key that is a prefix of others, a key of the
/// longest length: each is its own lock, and `held` lists by prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_that_prefix_each_other_are_separate_locks() {
    let solo = Solo::start(&[]);
    let backend: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(&[solo.endpoint().as_str()])
            .await
            .expect("connect"),
    );
    let base = format!("review-prefix/{}/", random_word());
    let name = |s: &str| LockKey::new(format!("{base}{s}")).expect("key");
    let a = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), name("a"))
        .await
        .expect("a");
    for other in ["a/b", "ab", "a/", "b"] {
        let lease = LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend.clone(), name(other))
            .await
            .unwrap_or_else(|err| panic!("{other} is free beside a: {err}"));
        let listed: Vec<String> = backend
            .held(&format!("{base}a"))
            .await
            .expect("held")
            .into_iter()
            .map(|(key, _)| key)
            .collect();
        let expect_listed = other.starts_with('a');
        assert_eq!(
            listed.contains(&format!("{base}{other}")),
            expect_listed,
            "{other}: {listed:?}"
        );
        assert!(listed.contains(&format!("{base}a")));
        lease.release().await.expect("release");
        assert!(backend.holder(&name("a")).await.expect("holder").is_some());
    }
    let only_slash: Vec<String> = backend
        .held(&format!("{base}a/"))
        .await
        .expect("held")
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    assert!(only_slash.is_empty(), "{only_slash:?}");
    a.release().await.expect("release");
    let long = LockKey::new("é/".repeat(dlock::key::MAX_KEY_LEN / 3)).expect("a long key");
    let lease = LockOptions::new(Duration::from_secs(5))
        .acquire_on(backend.clone(), long.clone())
        .await
        .expect("a long key is a key");
    let again = LockOptions::new(Duration::from_secs(5))
        .acquire_on(backend.clone(), long.clone())
        .await;
    assert!(matches!(again, Err(LockError::Held { .. })), "{again:?}");
    lease.release().await.expect("release");
}

/// Short ttls below etcd's whole-second minimum: the holder is told at
/// its own ttl when it cannot renew, and the key is never another's
/// while the holder's lease is valid by its clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_ttls_tell_the_holder_at_its_own_ttl_and_keep_exclusion() {
    let solo = Solo::start(&[]);
    let proxy = support::proxy::Proxy::bind(format!("127.0.0.1:{}", solo.port)).await;
    let holder_side: Arc<dyn Backend> = Arc::new(
        EtcdBackend::builder(&[format!("http://127.0.0.1:{}", proxy.port).as_str()])
            .response_timeout(Duration::from_millis(500))
            .connect()
            .await
            .expect("connect"),
    );
    let other: Arc<dyn Backend> = Arc::new(
        EtcdBackend::connect(&[solo.endpoint().as_str()])
            .await
            .expect("connect"),
    );
    for ttl in [Duration::from_millis(100), Duration::from_secs(2)] {
        let key = fresh_key("short-ttl");
        let held = LockOptions::new(ttl)
            .acquire_on(holder_side.clone(), key.clone())
            .await
            .expect("free");
        // Renewals go on for a while. At 100 ms a renewal has about 60 ms
        // to come back, which a loaded machine can miss; the lease is then
        // lost early, which is no break of exclusion, so only the
        // whole-second ttl must still hold here. At 2 s (renewed every
        // 667 ms) a pause of over a second still leaves a renewal in time,
        // as 1 s (renewed every 333 ms, 500 ms response timeout) did not.
        tokio::time::sleep(ttl * 2).await;
        if ttl >= Duration::from_secs(1) {
            assert!(held.check().is_ok(), "{ttl:?}: renewed");
        }
        proxy.freeze();
        let frozen_at = Instant::now();
        let mut told_at = None;
        let mut other_at = None;
        let deadline = Instant::now() + Duration::from_secs(15);
        while (told_at.is_none() || other_at.is_none()) && Instant::now() < deadline {
            if told_at.is_none() && held.check().is_err() {
                told_at = Some(Instant::now());
            }
            if other_at.is_none()
                && let Ok(next) = LockOptions::new(Duration::from_secs(5))
                    .acquire_on(other.clone(), key.clone())
                    .await
            {
                other_at = Some(Instant::now());
                assert!(next.token() > held.token());
                // The holder's validity counts from before each of its
                // requests was sent (lease/renewal.rs: `sent + ttl`), so
                // it ends no later than etcd's lease, before the other's
                // grant. It may end between the poll at the top of this
                // pass and the grant: look again now that the grant has
                // returned. Still valid now is a real overlap.
                if told_at.is_none() && held.check().is_err() {
                    told_at = Some(Instant::now());
                }
                assert!(
                    told_at.is_some(),
                    "{ttl:?}: another holder got the key before the holder was told"
                );
                next.release().await.expect("release");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let told = told_at.expect("told") - frozen_at;
        eprintln!(
            "ttl {ttl:?}: told {told:?} after the freeze, another got the key {:?} after",
            other_at.map(|at| at - frozen_at)
        );
        // Told by the holder's own clock; the margin is for this loop's
        // acquisitions and wake-ups on a loaded machine, not the lease.
        assert!(
            told <= ttl + Duration::from_millis(1500),
            "{ttl:?}: told after {told:?}"
        );
        assert!(other_at.is_some(), "{ttl:?}: the key came free");
        proxy.thaw();
        drop(held);
    }
}

/// The lease is named by owner and ttl: a renewal to another ttl, and a
/// retry of the acquisition with another ttl, move the key onto another
/// lease. Through every change the key keeps its token and stays the
/// owner's alone, for the new ttl, and its release frees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_the_ttl_keeps_the_token_and_exclusion() {
    use dlock::backend::{
        AcquireRequest, Attempt, OwnerId, ReleaseOutcome, ReleaseRequest, Renewal,
    };
    let solo = Solo::start(&[]);
    let backend = EtcdBackend::connect(&[solo.endpoint().as_str()])
        .await
        .expect("connect");
    let key = fresh_key("ttl-change");
    let (owner, other) = (
        OwnerId::random().expect("id"),
        OwnerId::random().expect("id"),
    );
    let secs = Duration::from_secs;
    let Attempt::Acquired(grant) = backend
        .try_acquire(&AcquireRequest::new(&key, &owner, secs(2)))
        .await
        .expect("acquire")
    else {
        panic!("free")
    };
    let token = grant.token;
    let others_try = || async {
        backend
            .try_acquire(&AcquireRequest::new(&key, &other, secs(2)))
            .await
            .expect("try")
    };
    let token_now = || async {
        backend
            .holder(&key)
            .await
            .expect("holder")
            .expect("held")
            .token
    };
    // A renewal to a longer ttl, then past the first lease's end.
    assert!(
        backend
            .extend(&Renewal::new(&key, &owner, secs(6)))
            .await
            .expect("extend")
    );
    let extended = Instant::now();
    tokio::time::sleep(secs(3)).await;
    assert!(matches!(others_try().await, Attempt::Held { .. }));
    assert_eq!(token_now().await, Some(token));
    // A retry of the acquisition with yet another ttl: the same token.
    // Its 10 s lease outlasts the check below by far; the 6 s one would
    // have ended by then.
    let Attempt::Acquired(again) = backend
        .try_acquire(&AcquireRequest::new(&key, &owner, secs(10)))
        .await
        .expect("retry")
    else {
        panic!("a retry by the holder is a success")
    };
    assert_eq!(again.token, token);
    tokio::time::sleep_until((extended + secs(7)).into()).await;
    assert!(matches!(others_try().await, Attempt::Held { .. }));
    // Back to the first ttl, renewed as such.
    assert!(
        backend
            .extend(&Renewal::new(&key, &owner, secs(2)))
            .await
            .expect("extend")
    );
    assert!(
        backend
            .extend(&Renewal::new(&key, &owner, secs(2)))
            .await
            .expect("extend")
    );
    assert_eq!(token_now().await, Some(token));
    assert!(matches!(others_try().await, Attempt::Held { .. }));
    assert_eq!(
        backend
            .release(&ReleaseRequest::new(&key, &owner))
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    let Attempt::Acquired(next) = others_try().await else {
        panic!("free after the release")
    };
    assert!(next.token > token);
}

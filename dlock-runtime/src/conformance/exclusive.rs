//! Exclusion and ownership: one winner among racing acquirers, tokens that
//! rise per key and across instances, and releases and renewals by
//! anyone but the owner refused.

use super::*;

/// Twenty acquirers race for one key: exactly one wins, the others are told `Held`.
pub async fn twenty_concurrent_acquirers_exactly_one_wins(backend: Arc<dyn Backend>) {
    let key = fresh_key("race");
    let barrier = Arc::new(Barrier::new(20));
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (backend, key, barrier) = (backend.clone(), key.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let result = options(10_000).acquire_on(backend, key).await;
            // Hold any winning lease until every contender has tried.
            barrier.wait().await;
            result
        }));
    }
    let mut winners = Vec::new();
    for task in tasks {
        match task.await.expect("task") {
            Ok(lease) => winners.push(lease),
            Err(LockError::Held { .. }) => {}
            Err(other) => panic!("unexpected error: {other}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one of 20 acquirers must win");
    for lease in winners {
        lease.release().await.expect("release");
    }
}

/// Each acquisition of a key gets a token strictly greater than every token before it.
pub async fn tokens_strictly_increase(backend: Arc<dyn Backend>) {
    let key = fresh_key("tokens");
    let mut last = None;
    for _ in 0..20 {
        let lease = take(&backend, &key, 10_000, Duration::ZERO, "free key").await;
        if let Some(previous) = last {
            assert!(
                lease.token() > previous,
                "{} after {previous}",
                lease.token()
            );
        }
        last = Some(lease.token());
        lease.release().await.expect("release");
    }
}

/// Tokens keep rising for a key taken in turn through two instances of the backend on one store (as two processes share a server), with other keys locked in between and a lease that expires instead of being released; a key held through one instance is held for the other.
pub async fn tokens_strictly_increase_across_keys_and_backend_instances(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let key = fresh_key("tokens-mixed");
    let other = fresh_key("tokens-other");
    let instances = [&backend, &another, &backend, &another];
    let mut last = None;
    for (round, pair) in instances.windows(2).enumerate() {
        let (through, rival) = (pair[0], pair[1]);
        let lease = options(10_000)
            .wait(Duration::from_secs(5))
            .acquire_on(through.clone(), &key)
            .await
            .expect("free");
        if let Some(previous) = last {
            assert!(
                lease.token() > previous,
                "round {round}: token {} after {previous} through the other instance",
                lease.token()
            );
        }
        last = Some(lease.token());
        let refused = options(10_000).acquire_on(rival.clone(), &key).await;
        assert!(
            matches!(refused, Err(LockError::Held { .. })),
            "a key held through one instance must be held for the other, not {refused:?}"
        );
        lease.release().await.expect("release");
        let unrelated = options(10_000)
            .acquire_on(rival.clone(), &other)
            .await
            .expect("free");
        unrelated.release().await.expect("release");
    }
    let last = last.expect("three rounds");
    let expiring = options(100)
        .renew(false)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    assert!(expiring.token() > last);
    let expired_token = expiring.token();
    within(10, "expiry", expiring.lost()).await;
    let next = options(10_000)
        .wait(Duration::from_secs(5))
        .acquire_on(another.clone(), &key)
        .await
        .expect("free after expiry");
    assert!(
        next.token() > expired_token,
        "token {} through the other instance after the expired {expired_token}",
        next.token()
    );
    next.release().await.expect("release");
    drop(expiring);
}

/// A release by an owner that does not hold the key is refused (`NotOwner`) and leaves the holder's lease alone.
pub async fn release_by_non_owner_fails_and_changes_nothing(backend: Arc<dyn Backend>) {
    let key = fresh_key("non-owner-release");
    let lease = take(&backend, &key, 10_000, Duration::ZERO, "free").await;
    let stranger = OwnerId::random().expect("random");
    let released = backend
        .release(&crate::backend::ReleaseRequest::new(&key, &stranger))
        .await
        .expect("backend answers");
    assert_eq!(
        released,
        crate::backend::ReleaseOutcome::NotOwner,
        "a non-owner's release must be refused"
    );
    let contender = options(10_000).acquire_on(backend.clone(), &key).await;
    assert!(
        matches!(contender, Err(LockError::Held { .. })),
        "the key must still be held after a refused release"
    );
    assert!(lease.check().is_ok());
    lease
        .release()
        .await
        .expect("the owner's release still works");
}

/// An extension by an owner that does not hold the key is refused and leaves the holder's lease alone.
pub async fn extend_by_non_owner_fails_and_changes_nothing(backend: Arc<dyn Backend>) {
    let key = fresh_key("non-owner-extend");
    let lease = take(&backend, &key, 10_000, Duration::ZERO, "free").await;
    let stranger = OwnerId::random().expect("random");
    let extended = backend
        .extend(&crate::backend::Renewal::new(
            &key,
            &stranger,
            Duration::from_secs(60),
        ))
        .await
        .expect("backend answers");
    assert!(!extended, "a non-owner's extend must be refused");
    lease
        .release()
        .await
        .expect("the owner's release still works");
    let again = options(10_000).acquire_on(backend.clone(), &key).await;
    assert!(again.is_ok(), "the key is free after the owner released it");
}

/// An `extend` of a lease that ended (released, broken by an
/// administrator, or run out, with or without another holder since) is
/// refused with `Ok(false)` and takes nothing: the key stays free.
pub async fn extend_of_an_ended_lease_is_refused_and_takes_nothing(backend: Arc<dyn Backend>) {
    use crate::backend::{Attempt, ReleaseOutcome, Renewal};
    let take = |key: &LockKey, owner: &OwnerId, ttl: Duration| {
        let (backend, key, owner) = (backend.clone(), key.clone(), *owner);
        async move {
            let attempt = attempt_as(&backend, &key, &owner, ttl).await;
            assert!(
                matches!(attempt, Attempt::Acquired(_)),
                "{key} must be free"
            );
        }
    };
    let ended = |how: &'static str| (fresh_key(how), OwnerId::random().expect("random"));
    let released = ended("extend-released");
    take(&released.0, &released.1, Duration::from_secs(10)).await;
    assert_eq!(
        release_as(&backend, &released.0, &released.1).await,
        ReleaseOutcome::Released
    );
    let broken = ended("extend-broken");
    take(&broken.0, &broken.1, Duration::from_secs(10)).await;
    assert!(
        backend
            .force_release(&broken.0)
            .await
            .expect("force release")
    );
    let expired = ended("extend-expired");
    take(&expired.0, &expired.1, Duration::from_millis(200)).await;
    let taken_over = ended("extend-taken-over");
    take(&taken_over.0, &taken_over.1, Duration::from_millis(200)).await;
    // Someone else holds the run-out lease's key, then lets it go.
    let next = options(10_000)
        .wait(Duration::from_secs(5))
        .acquire_on(backend.clone(), &taken_over.0)
        .await
        .expect("free once the ttl ran out");
    next.release().await.expect("release");
    sleep(Duration::from_millis(400) + backend.expiry_slack()).await;
    for (key, owner) in [&released, &broken, &expired, &taken_over] {
        let extended = backend
            .extend(&Renewal::new(key, owner, Duration::from_secs(60)))
            .await
            .expect("backend answers");
        assert!(
            !extended,
            "an extend of an ended lease on {key} must be refused"
        );
        let after = options(10_000)
            .wait(Duration::from_secs(5))
            .acquire_on(backend.clone(), key)
            .await
            .unwrap_or_else(|e| panic!("a refused extend must leave {key} free: {e}"));
        after.release().await.expect("release");
    }
}

/// `extend_many` answers each lease on its own: in one batch, held leases
/// are renewed and answered `true`, while a lease that ended and a lease
/// asked for by an owner that does not hold its key are answered `false`
/// and change nothing, wherever they stand in the batch.
pub async fn extend_many_answers_each_lease_on_its_own(backend: Arc<dyn Backend>) {
    use crate::backend::{Attempt, ReleaseOutcome, Renewal};
    const INITIAL_MS: u64 = 4_000;
    let keys: Vec<LockKey> = (0..4).map(|_| fresh_key("batch")).collect();
    let owners: Vec<OwnerId> = (0..4).map(|_| OwnerId::random().expect("random")).collect();
    // 0 and 3 held for 4 s (the batch renews them), 1 released, 2 held by
    // its owner but renewed in the batch by a stranger. The 4 s are
    // counted from before the first request; only a stall of that long
    // before the batch lands would end them unrenewed.
    let taken = Instant::now();
    for (i, (key, owner)) in keys.iter().zip(&owners).enumerate() {
        let ttl = Duration::from_millis(if i == 2 { 10_000 } else { INITIAL_MS });
        let attempt = attempt_as(&backend, key, owner, ttl).await;
        assert!(
            matches!(attempt, Attempt::Acquired(_)),
            "{key} must be free"
        );
    }
    assert_eq!(
        release_as(&backend, &keys[1], &owners[1]).await,
        ReleaseOutcome::Released
    );
    let stranger = OwnerId::random().expect("random");
    let ttl = Duration::from_secs(10);
    let batch = [
        Renewal::new(&keys[0], &owners[0], ttl),
        Renewal::new(&keys[1], &owners[1], ttl),
        Renewal::new(&keys[2], &stranger, ttl),
        Renewal::new(&keys[3], &owners[3], ttl),
    ];
    let answers: Vec<bool> = backend
        .extend_many(&batch)
        .await
        .into_iter()
        .map(|answer| answer.expect("backend answers"))
        .collect();
    assert_eq!(
        answers,
        [true, false, false, true],
        "one answer per lease: held, ended, not the owner's, held"
    );
    // Led by a lease that ended.
    let answers: Vec<bool> = backend
        .extend_many(&[batch[1], batch[3]])
        .await
        .into_iter()
        .map(|answer| answer.expect("backend answers"))
        .collect();
    assert_eq!(answers, [false, true], "one answer per lease: ended, held");
    // Past the 4 s the leases were taken for: the batch renewed 0 and 3.
    tokio::time::sleep_until(taken + Duration::from_millis(INITIAL_MS + 500)).await;
    for i in [0, 2, 3] {
        let contender = options(10_000).acquire_on(backend.clone(), &keys[i]).await;
        assert!(
            matches!(contender, Err(LockError::Held { .. })),
            "lease {i} of the batch must still be held"
        );
    }
    let free = take(
        &backend,
        &keys[1],
        10_000,
        Duration::ZERO,
        "a lease that ended must stay ended after the batch",
    )
    .await;
    free.release().await.expect("release");
    for i in [0, 2, 3] {
        assert_eq!(
            release_as(&backend, &keys[i], &owners[i]).await,
            ReleaseOutcome::Released
        );
    }
}

/// A batch renews each lease for its own ttl, however long the batch (the
/// core's renewal sends up to a thousand leases of mixed ttls at once):
/// here eight leases, renewed alternately for 10 s and 300 ms.
pub async fn extend_many_renews_each_lease_for_its_own_ttl_in_a_long_batch(
    backend: Arc<dyn Backend>,
) {
    use crate::backend::{Attempt, ReleaseOutcome, Renewal};
    let keys: Vec<LockKey> = (0..8).map(|_| fresh_key("long-batch")).collect();
    let owners: Vec<OwnerId> = (0..8).map(|_| OwnerId::random().expect("random")).collect();
    // Counted from before the first request: a stall of up to the initial
    // 4 s before the batch lands still leaves every lease to renew.
    const INITIAL_MS: u64 = 4_000;
    let taken = Instant::now();
    for (key, owner) in keys.iter().zip(&owners) {
        let attempt = attempt_as(&backend, key, owner, Duration::from_millis(INITIAL_MS)).await;
        assert!(
            matches!(attempt, Attempt::Acquired(_)),
            "{key} must be free"
        );
    }
    let ttl = |i: usize| Duration::from_millis(if i.is_multiple_of(2) { 10_000 } else { 300 });
    let batch: Vec<Renewal<'_>> = (0..8)
        .map(|i| Renewal::new(&keys[i], &owners[i], ttl(i)))
        .collect();
    let answers: Vec<bool> = backend
        .extend_many(&batch)
        .await
        .into_iter()
        .map(|answer| answer.expect("backend answers"))
        .collect();
    assert_eq!(answers, [true; 8], "every lease of the batch is held");
    let batched = Instant::now();
    // Past the 4 s the leases were taken for and the 300 ms of the odd
    // ones (counted from the batch's answer, however late it came), and
    // past the time the store may keep an unrenewed lease longer (its
    // `expiry_slack`: etcd's whole-second leases, freed at the leader's
    // next sweep): the even ones were renewed for 10 s, the odd ones ended.
    tokio::time::sleep_until(
        (taken + Duration::from_millis(INITIAL_MS + 500)).max(batched + Duration::from_millis(800))
            + backend.expiry_slack(),
    )
    .await;
    for (i, key) in keys.iter().enumerate() {
        let contender = options(10_000).acquire_on(backend.clone(), key).await;
        match (i.is_multiple_of(2), contender) {
            (true, Err(LockError::Held { .. })) => {}
            (true, other) => panic!("lease {i}, renewed for 10 s, must still be held: {other:?}"),
            (false, Ok(lease)) => lease.release().await.expect("release"),
            (false, Err(err)) => panic!("lease {i}, renewed for 300 ms, must have ended: {err}"),
        }
    }
    for i in (0..8).step_by(2) {
        assert_eq!(
            release_as(&backend, &keys[i], &owners[i]).await,
            ReleaseOutcome::Released
        );
    }
}

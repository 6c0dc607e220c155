//! Waiting and cancellation: waiters woken by the release, deadlines kept,
//! minimum holds, several keys at once, and callers that give up at any
//! point leaving nothing held.

use super::*;

/// A waiter is woken by the release (the backend's notice), not by polling.
pub async fn waiter_wakes_on_release_not_by_polling(backend: Arc<dyn Backend>) {
    let key = fresh_key("wake");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let counting = CountingBackend::new(backend.clone());
    let waiter = {
        let (counting, key) = (counting.clone(), key.clone());
        tokio::spawn(async move {
            options(30_000)
                .wait(Duration::from_secs(20))
                .acquire_on(counting, key)
                .await
        })
    };
    // Long enough that a polling waiter (fallback every second) would try
    // several more times than one woken by the release.
    sleep(Duration::from_millis(2500)).await;
    let before = counting.attempts();
    let released_at = Instant::now();
    holder.release().await.expect("release");
    let lease = within(15, "the waiter", waiter)
        .await
        .expect("task")
        .expect("woken waiter acquires");
    let took = released_at.elapsed();
    eprintln!("handoff took {took:?}");
    let attempts = counting.attempts();
    // The first try and the retry after subscribing, then nothing while
    // the key stayed held.
    assert!(
        before <= 2,
        "the waiter tried {before} times while the key was held: it polled"
    );
    // And the retry after the wake-up; one more only if the release took
    // so long to reach it (a stalled machine) that a poll came first.
    assert!(
        attempts <= 3 || took >= Duration::from_millis(900),
        "the waiter tried {attempts} times: it polled instead of waking on the release"
    );
    // Woken by the release, not by its safety net: a waiter that hears of
    // no release looks again only after its longest nap (10 s, 7.5 s
    // after this release), far beyond any stall the release may meet.
    assert!(
        took < Duration::from_secs(5),
        "the waiter took the key {took:?} after the release: the release did not wake it"
    );
    lease.release().await.expect("release");
}

/// A waiter whose wait runs out gets `Timeout`.
pub async fn waiter_times_out_with_timeout_error(backend: Arc<dyn Backend>) {
    let key = fresh_key("timeout");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let waited = options(30_000)
        .wait(Duration::from_millis(300))
        .acquire_on(backend.clone(), &key)
        .await;
    match waited {
        Err(LockError::Timeout { key: k, .. }) => assert_eq!(k, key.to_string()),
        other => panic!("expected a timeout, got {other:?}"),
    }
    holder.release().await.expect("release");
}

/// A minimum hold keeps the key held after an early release, then frees it.
pub async fn min_hold_keeps_the_key_after_early_release(backend: Arc<dyn Backend>) {
    // The early attempt must come within the minimum hold, counted from
    // before the acquisition: a stall that pushes it past proves nothing,
    // and the round is run again on a fresh key with a hold twice as long.
    let mut min_hold = Duration::from_millis(800);
    let (key, token) = loop {
        let key = fresh_key("min-hold");
        let asked = Instant::now();
        let lease = options(10_000)
            .min_hold(min_hold)
            .acquire_on(backend.clone(), &key)
            .await
            .expect("free");
        let token = lease.token();
        lease
            .release()
            .await
            .expect("release within the minimum hold");
        let early = options(10_000).acquire_on(backend.clone(), &key).await;
        match early {
            Err(LockError::Held { .. }) => break (key, token),
            Ok(lease)
                if asked.elapsed() + ROUNDING >= min_hold && min_hold < Duration::from_secs(6) =>
            {
                lease.release().await.expect("release");
                min_hold *= 2;
            }
            other => panic!(
                "the key must stay held until the minimum hold ({min_hold:?}) is over: {other:?}"
            ),
        }
    };
    let later = take(
        &backend,
        &key,
        10_000,
        Duration::from_secs(10),
        "free once the minimum hold is over",
    )
    .await;
    assert!(later.token() > token);
    later.release().await.expect("release");
}

/// Two callers locking the same keys in opposite orders never deadlock.
pub async fn opposite_order_multi_key_acquirers_never_deadlock(backend: Arc<dyn Backend>) {
    let a = fresh_key("pair-a");
    let b = fresh_key("pair-b");
    let run = |first: LockKey, second: LockKey| {
        let backend = backend.clone();
        tokio::spawn(async move {
            for _ in 0..20 {
                let set = options(10_000)
                    .wait(Duration::from_secs(20))
                    .acquire_many_on(backend.clone(), [&first, &second])
                    .await
                    .expect("both keys");
                let tokens = set.tokens();
                assert_eq!(tokens.len(), 2);
                assert_eq!(set.token_of(&first), tokens.get(0));
                assert_eq!(set.token_of(&second), tokens.get(1));
                tokio::task::yield_now().await;
                set.release().await.expect("release");
            }
        })
    };
    let ab = run(a.clone(), b.clone());
    let ba = run(b.clone(), a.clone());
    within(60, "opposite-order lockers (deadlock?)", async {
        ab.await.expect("a,b task");
        ba.await.expect("b,a task");
    })
    .await;
}

/// A multi-key acquisition that cannot take every key releases the ones it took.
pub async fn multi_key_failure_releases_taken_keys(backend: Arc<dyn Backend>) {
    // Sorted order takes `…a…` before `…b…`; `b` is held, so `a` must be
    // released when the set fails.
    let id = OwnerId::random().expect("random");
    let a = LockKey::new(format!("dlock-test:release-taken:{id}:a")).expect("key");
    let b = LockKey::new(format!("dlock-test:release-taken:{id}:b")).expect("key");
    let holder = take(&backend, &b, 10_000, Duration::ZERO, "free").await;
    let set = options(10_000)
        .acquire_many_on(backend.clone(), [&b, &a])
        .await;
    match set {
        Err(LockError::Held { key, .. }) => assert_eq!(key, b.to_string()),
        other => panic!("expected b held, got {other:?}"),
    }
    let a_again = options(10_000).acquire_on(backend.clone(), &a).await;
    assert!(a_again.is_ok(), "a must have been released");
    holder.release().await.expect("release");
}

/// A lease dropped unreleased (an early return, a panic) frees the key long before its ttl.
pub async fn dropping_an_unreleased_lease_frees_the_key(backend: Arc<dyn Backend>) {
    let key = fresh_key("drop");
    {
        let _lease = take(&backend, &key, 60_000, Duration::ZERO, "free").await;
        // Dropped here without release, as on an early return or `?`.
    }
    let after_drop = take(
        &backend,
        &key,
        60_000,
        Duration::from_secs(10),
        "a dropped lease must free the key long before its 60s ttl",
    )
    .await;
    drop(after_drop);
    // A panicking holder frees it too.
    let (backend2, key2) = (backend.clone(), key.clone());
    let panicked = tokio::spawn(async move {
        let _lease = options(60_000)
            .wait(Duration::from_secs(10))
            .acquire_on(backend2, key2)
            .await
            .expect("free");
        panic!("the holder panics while holding the lease");
    })
    .await;
    assert!(panicked.is_err());
    free_within(
        &backend,
        &key,
        60_000,
        Duration::from_secs(10),
        "a panicking holder's lease must be freed",
    )
    .await;
}

/// A waiter cancelled mid-wait leaves nothing held.
pub async fn cancelled_waiter_leaves_the_key_free(backend: Arc<dyn Backend>) {
    let key = fresh_key("cancelled");
    let holder = take(&backend, &key, 60_000, Duration::ZERO, "free").await;
    let waiting_options = options(60_000).wait(Duration::from_secs(30));
    let waiting = waiting_options.acquire_on(backend.clone(), &key);
    // Cancel the waiter mid-wait.
    assert!(timeout(Duration::from_millis(200), waiting).await.is_err());
    holder.release().await.expect("release");
    // A cancelled waiter's clean-up (its writer-waiting mark, its queue
    // entry) may still be on its way; a waiter that kept the key would
    // hold it for its 60 s ttl, far past this wait.
    let next = options(60_000)
        .wait(Duration::from_secs(5))
        .acquire_on(backend.clone(), &key)
        .await;
    assert!(next.is_ok(), "a cancelled waiter must not keep the key");
}

/// Keys with quotes, braces, percent signs, separators and non-ASCII text
/// are data: each locks exclusively, and no two collide: each is free
/// while all the others are held, also keys that are prefixes of each
/// other, or that differ by a hash tag's braces or a percent-encoding.
pub async fn odd_keys_are_data_and_lock_exclusively(backend: Arc<dyn Backend>) {
    let id = OwnerId::random().expect("random");
    let odd = [
        "quote\"s and 'single' quotes",
        "new\nline\r\nand\ttab",
        "lua: redis.call('DEL', KEYS[1]) -- ]] [[",
        "glob * ? [a-z] \\ escape",
        "sql'; DROP TABLE locks; --",
        "ünïcödé 🔒 键",
        "../../../etc/passwd",
        "%00%2e%2E",
        "}",
        "}{",
        "{}",
        "a}b",
        "a%7Db",
        "a%b",
        "{tag}",
        "%7B%7D",
    ];
    // Keys that are prefixes of each other.
    let nested = ["a", "a/", "a/b", "ab"];
    let texts = odd
        .iter()
        .map(|text| format!("{text}:{id}"))
        .chain(nested.iter().map(|text| format!("{id}:{text}")));
    let mut leases = Vec::new();
    for text in texts {
        let key = LockKey::new(text.clone()).expect("odd keys are valid keys");
        let lease = options(10_000)
            .acquire_on(backend.clone(), &key)
            .await
            .unwrap_or_else(|e| panic!("{text:?} is free while the others are held: {e}"));
        let second = options(10_000).acquire_on(backend.clone(), &key).await;
        assert!(
            matches!(second, Err(LockError::Held { .. })),
            "{text:?} must lock exclusively"
        );
        leases.push(lease);
    }
    for lease in leases {
        lease.release().await.expect("release");
    }
    // Keys that differ only in odd characters are different locks.
    let a = options(10_000)
        .acquire_on(backend.clone(), format!("a:b*{id}"))
        .await
        .expect("free");
    let b = options(10_000)
        .acquire_on(backend.clone(), format!("a:b?{id}"))
        .await
        .expect("a different key");
    a.release().await.expect("release");
    b.release().await.expect("release");
}

/// Bad keys and durations are clear errors, never a panic or a silent lock.
pub async fn bad_keys_and_durations_are_errors(backend: Arc<dyn Backend>) {
    let invalid_key =
        |r: Result<crate::Lease, LockError>| matches!(r, Err(LockError::InvalidKey { .. }));
    assert!(invalid_key(
        options(1000).acquire_on(backend.clone(), "").await
    ));
    let huge = "k".repeat(1024 * 1024);
    assert!(invalid_key(
        options(1000).acquire_on(backend.clone(), huge).await
    ));
    assert!(invalid_key(
        options(1000).acquire_on(backend.clone(), "nul\0byte").await
    ));
    let bad_option = |r: Result<crate::Lease, LockError>, name: &str| matches!(r, Err(LockError::InvalidOption { option, .. }) if option == name);
    let key = fresh_key("bad-options");
    assert!(bad_option(
        options(0).acquire_on(backend.clone(), &key).await,
        "ttl"
    ));
    assert!(bad_option(
        LockOptions::new(Duration::from_secs(40 * 24 * 3600))
            .acquire_on(backend.clone(), &key)
            .await,
        "ttl"
    ));
    assert!(bad_option(
        options(1000)
            .min_hold(Duration::from_secs(2))
            .acquire_on(backend.clone(), &key)
            .await,
        "min_hold"
    ));
    assert!(bad_option(
        options(1000)
            .wait(Duration::from_secs(40 * 24 * 3600))
            .acquire_on(backend.clone(), &key)
            .await,
        "wait"
    ));
    // None of the refused calls took the key.
    free_within(&backend, &key, 1000, Duration::ZERO, "free").await;
}

/// Acquisitions whose callers give up mid-attempt leave their keys free long before the ttl.
pub async fn acquisitions_abandoned_mid_attempt_leave_their_keys_free(backend: Arc<dyn Backend>) {
    let keys: Vec<LockKey> = (0..20).map(|_| fresh_key("abandoned")).collect();
    for key in &keys {
        // A caller that gives up at once, as a zero timeout, a `select!` or
        // an aborted request does: the attempt may well reach the store.
        let abandoned = timeout(
            Duration::ZERO,
            options(60_000).acquire_on(backend.clone(), key),
        )
        .await;
        // A backend that answers in the first poll hands out a lease,
        // which is dropped here like any unreleased lease.
        drop(abandoned);
    }
    for key in &keys {
        let next = take(
            &backend,
            key,
            60_000,
            Duration::from_secs(10),
            "an abandoned acquisition must not keep its key for the 60s ttl",
        )
        .await;
        next.release().await.expect("release");
    }
}

/// A release whose caller gives up half-way still frees the key.
pub async fn a_release_abandoned_half_way_still_frees_the_key(backend: Arc<dyn Backend>) {
    let key = fresh_key("abandoned-release");
    let lease = take(&backend, &key, 60_000, Duration::ZERO, "free").await;
    let _ = timeout(Duration::ZERO, lease.release()).await;
    free_within(
        &backend,
        &key,
        60_000,
        Duration::from_secs(10),
        "a release given up half-way must still free the key before its 60s ttl",
    )
    .await;
}

/// A release notice that woke one waiter and is dropped before that waiter's next attempt is answered passes the wake-up on to another waiter.
pub async fn a_woken_notice_dropped_unanswered_passes_the_wake_up_on(backend: Arc<dyn Backend>) {
    use crate::backend::Attempt;
    let key = fresh_key("pass-on");
    let holder = take(&backend, &key, 60_000, Duration::ZERO, "free").await;
    let first = backend.subscribe(&key).await.expect("subscribe");
    let mut second = backend.subscribe(&key).await.expect("subscribe");
    // As a waiter does: subscribed, it tries the key and finds it held.
    let other = OwnerId::random().expect("random");
    let found = attempt_as(&backend, &key, &other, Duration::from_secs(60)).await;
    assert!(
        matches!(found, Attempt::Held { .. }),
        "a held key was given to another owner: {found:?}"
    );
    holder.release().await.expect("release");
    let mut first = first;
    within(10, "the first notice", &mut first).await;
    // Its waiter gives up before trying the key: the release must reach
    // the other waiter all the same.
    drop(first);
    within(
        10,
        "the second notice after the first woken waiter gave up",
        &mut second,
    )
    .await;
    second.answered();
}

/// A release that races the arrival of new waiters never leaves one asleep: in rounds where the holder lets go at moments spread over the waiters' subscribe and first attempts, two waiters of one instance and one of another each get the key in turn, long before the 60 s ttl a missed release would make them wait out.
pub async fn a_release_racing_new_waiters_always_wakes_them(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    /// Waits up to 5 s (less than any nap without a wake-up: the holders'
    /// ttl is 60 s, the core's longest nap 10 s), holds briefly, releases.
    fn turn(
        backend: &Arc<dyn Backend>,
        key: &LockKey,
    ) -> tokio::task::JoinHandle<Result<(), LockError>> {
        let (backend, key) = (backend.clone(), key.clone());
        tokio::spawn(async move {
            let lease = options(60_000)
                .wait(Duration::from_secs(5))
                .acquire_on(backend, key)
                .await?;
            sleep(Duration::from_millis(1)).await;
            lease.release().await
        })
    }
    for round in 0..40u64 {
        let key = fresh_key("release-race");
        let holder = take(&backend, &key, 60_000, Duration::ZERO, "free").await;
        let waiters = [
            turn(&backend, &key),
            turn(&backend, &key),
            turn(&another, &key),
        ];
        // From at once to well after the waiters started waiting.
        sleep(Duration::from_micros(round * round * 5)).await;
        holder.release().await.expect("release");
        for (i, waiter) in waiters.into_iter().enumerate() {
            within(20, "a waiter racing a release", waiter)
                .await
                .expect("task")
                .unwrap_or_else(|err| {
                    panic!("round {round}: waiter {i} missed a release it raced: {err}")
                });
        }
    }
}

/// A waiter woken by a release and cancelled before its attempt does not swallow the release: another waiter gets the key.
pub async fn a_woken_waiter_cancelled_before_its_attempt_does_not_swallow_the_release(
    backend: Arc<dyn Backend>,
) {
    let key = fresh_key("swallowed");
    let holder = take(&backend, &key, 60_000, Duration::ZERO, "free").await;
    // The first waiter: woken first, then stuck in its attempt and cancelled.
    let stuck = CountingBackend::new(backend.clone());
    let first = spawn_waiter(stuck.clone(), &key, 60, 30);
    // Its look after subscribing answered `Held`: only a release wakes it
    // now. (Counted at its start, that look could still be on its way to
    // the store, and be granted the key the release frees.)
    within(10, "the first waiter to start waiting", async {
        while stuck.answered() < 2 {
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // The second waiter waits 8s: less than a nap without a wake-up (the
    // holder's ttl is 60s), so only the release can give it the key.
    let patient = CountingBackend::new(backend.clone());
    let second = spawn_waiter(patient.clone(), &key, 60, 8);
    within(10, "the second waiter to start waiting", async {
        while patient.answered() < 2 {
            sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    stuck.hang_next_attempt();
    holder.release().await.expect("release");
    within(10, "the first waiter to be woken", async {
        while stuck.attempts() < 3 {
            sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    first.abort();
    let lease = within(15, "the second waiter", second)
        .await
        .expect("task")
        .expect("the release must reach the second waiter when the first gives up");
    lease.release().await.expect("release");
}

/// A `try_acquire` retried by the owner that holds the key (its first
/// answer was lost) is a success, with the token already drawn or a higher
/// one; anyone else is still refused.
pub async fn a_retry_by_the_owner_that_holds_the_key_counts_as_acquired(backend: Arc<dyn Backend>) {
    use crate::backend::{Attempt, ReleaseOutcome};
    let key = fresh_key("same-owner");
    let owner = OwnerId::random().expect("random");
    let ttl = Duration::from_secs(10);
    let Attempt::Acquired(first) = attempt_as(&backend, &key, &owner, ttl).await else {
        panic!("a fresh key must be free");
    };
    match attempt_as(&backend, &key, &owner, ttl).await {
        Attempt::Acquired(again) => assert!(
            again.token >= first.token,
            "the retry must get the token already drawn or a higher one, not {} after {}",
            again.token,
            first.token
        ),
        other => panic!("a retry by the holding owner must be a success, not {other:?}"),
    }
    let stranger = OwnerId::random().expect("random");
    assert!(
        matches!(
            attempt_as(&backend, &key, &stranger, ttl).await,
            Attempt::Held { .. }
        ),
        "another owner must still be refused"
    );
    assert_eq!(
        release_as(&backend, &key, &owner).await,
        ReleaseOutcome::Released
    );
}

/// A `try_acquire` retried by the owner that holds the key counts the
/// lease's lifetime anew with the retry's ttl: the key stays held past the
/// first attempt's expiry.
pub async fn a_retry_by_the_owner_restarts_the_lease_with_its_ttl(backend: Arc<dyn Backend>) {
    use crate::backend::{Attempt, ReleaseOutcome};
    let key = fresh_key("same-owner-ttl");
    let owner = OwnerId::random().expect("random");
    let started = Instant::now();
    let first = attempt_as(&backend, &key, &owner, Duration::from_secs(1)).await;
    assert!(
        matches!(first, Attempt::Acquired(_)),
        "a fresh key must be free"
    );
    sleep(Duration::from_millis(600)).await;
    let retry = attempt_as(&backend, &key, &owner, Duration::from_secs(10)).await;
    assert!(
        matches!(retry, Attempt::Acquired(_)),
        "the retry must be a success"
    );
    // Past the first attempt's 1s, well within the retry's 10s.
    sleep((started + Duration::from_millis(1_300)).saturating_duration_since(Instant::now())).await;
    let stranger = OwnerId::random().expect("random");
    let other = attempt_as(&backend, &key, &stranger, Duration::from_secs(10)).await;
    assert!(
        matches!(other, Attempt::Held { .. }),
        "the retry's 10s lease must still hold the key after the first attempt's 1s"
    );
    assert_eq!(
        release_as(&backend, &key, &owner).await,
        ReleaseOutcome::Released
    );
}

/// A `try_acquire` whose caller drops it half-way (called directly, not
/// through the core) leaves nothing stuck, wherever it was dropped: each key
/// is free again by its ttl at the latest.
pub async fn a_try_acquire_dropped_half_way_leaves_nothing_stuck(backend: Arc<dyn Backend>) {
    use crate::backend::AcquireRequest;
    let ttl = Duration::from_secs(1);
    let mut keys = Vec::new();
    // Dropped after its 1st, 2nd, … poll: at each of its await points in
    // turn, the same in every run.
    for polls in 1..=8 {
        let (key, owner) = (
            fresh_key("dropped-attempt"),
            OwnerId::random().expect("random"),
        );
        poll_then_drop(
            backend.try_acquire(&AcquireRequest::new(&key, &owner, ttl)),
            polls,
        )
        .await;
        keys.push(key);
    }
    // Dropped after short waits: a backend that talks to a server is
    // dropped with its request on the way, at the server, or its answer on
    // the way back.
    // Up to a slow server's round trips, one after another.
    for micros in [
        0, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 35_000, 60_000, 100_000,
    ] {
        let (key, owner) = (
            fresh_key("dropped-attempt"),
            OwnerId::random().expect("random"),
        );
        let request = AcquireRequest::new(&key, &owner, ttl);
        let _ = timeout(Duration::from_micros(micros), backend.try_acquire(&request)).await;
        keys.push(key);
    }
    for key in &keys {
        let lease = options(1_000)
            .wait(Duration::from_secs(5))
            .acquire_on(backend.clone(), key)
            .await
            .unwrap_or_else(|e| {
                panic!("a dropped attempt must not keep {key} past its 1s ttl: {e}")
            });
        lease.release().await.expect("release");
    }
}

/// Durations past what the core sends (it refuses a ttl of 40 days and
/// more) reach a backend only from a caller of [`Backend`] itself: the
/// backend answers them, an error or a grant, and never panics, whether
/// the key is free or held, for a ttl, a fair entry's life, a renewal or
/// a renewal's time left.
pub async fn a_duration_past_any_clock_is_answered_without_a_panic(backend: Arc<dyn Backend>) {
    use crate::backend::{Queue, ReleaseRequest, Renewal};
    let key = fresh_key("endless");
    let (holder, waiter) = (
        OwnerId::random().expect("random"),
        OwnerId::random().expect("random"),
    );
    let endless = Duration::MAX;
    let taken = backend
        .try_acquire(&AcquireRequest::new(&key, &holder, endless))
        .await;
    let _ = backend
        .try_acquire(&AcquireRequest::new(&key, &holder, endless))
        .await;
    let _ = backend.extend(&Renewal::new(&key, &holder, endless)).await;
    let hold = Renewal::new(&key, &holder, Duration::from_secs(30)).expiring_in(endless);
    let _ = backend.extend(&hold).await;
    let _ = backend.extend_many(&[hold]).await;
    if !matches!(taken, Ok(Attempt::Acquired(_))) {
        // Refused: take it for a while, so the queue below meets a holder.
        attempt_as(&backend, &key, &holder, Duration::from_secs(30)).await;
    }
    let _ = backend
        .try_acquire(
            &AcquireRequest::new(&key, &waiter, endless)
                .with_queue(Queue::Join { entry_ttl: endless }),
        )
        .await;
    let _ = backend.release(&ReleaseRequest::new(&key, &waiter)).await;
    let _ = backend.release(&ReleaseRequest::new(&key, &holder)).await;
    free_within(&backend, &key, 1000, Duration::from_secs(10), "released").await;
}

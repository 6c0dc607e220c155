//! Holder identity: who holds a key, read by other instances, watched, told
//! to a refused caller, and listed by `held`.

use super::*;

/// Takes `key` for `owner` with `identity` recorded, straight on the
/// backend, or panics: the key must be free.
async fn take_as(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    owner: &OwnerId,
    identity: &str,
    ttl: Duration,
) -> crate::FencingToken {
    let request = AcquireRequest::new(key, owner, ttl).with_identity(Some(identity));
    match backend
        .try_acquire(&request)
        .await
        .expect("backend answers")
    {
        Attempt::Acquired(grant) => grant.token,
        Attempt::Held { .. } | Attempt::Behind { .. } => {
            panic!("`{key}` must be free for {identity}")
        }
    }
}

/// Waits for a holder watch: until it resolves, or, for a notice that may
/// miss a change, until it says to look again. Panics if a notice that
/// promised to resolve (no recheck) stays silent for 5 s after `what`.
async fn watched(notice: crate::ReleaseNotice, what: &str) {
    match notice.recheck() {
        Some(every) => {
            let _ = timeout(every, notice).await;
        }
        None => {
            if timeout(Duration::from_secs(5), notice).await.is_err() {
                panic!("a holder watch without a recheck slept through {what}");
            }
        }
    }
}

/// `holder` reads the token and identity an acquisition recorded, through either instance on the store; a lock taken without an identity reads as held with none; a free key reads `None`.
pub async fn holder_reads_the_live_holders_token_and_identity(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let key = fresh_key("holder");
    assert_eq!(
        backend.holder(&key).await.expect("holder"),
        None,
        "a fresh key is free"
    );
    let owner = OwnerId::random().expect("random");
    let token = take_as(
        &backend,
        &key,
        &owner,
        "web-3 (pid 4121)",
        Duration::from_secs(30),
    )
    .await;
    for through in [&backend, &another] {
        let holding = through
            .holder(&key)
            .await
            .expect("holder")
            .expect("the key is held");
        assert_eq!(holding.token, Some(token), "the holder's token");
        assert_eq!(holding.identity.as_deref(), Some("web-3 (pid 4121)"));
        // Up to the store's expiry slack more: the time left is when
        // the key is free at the latest.
        if let Some(left) = holding.expires_in {
            assert!(
                left <= Duration::from_secs(30) + through.expiry_slack(),
                "{left:?} left of a 30 s lease"
            );
        }
    }
    assert_eq!(
        release_as(&backend, &key, &owner).await,
        crate::ReleaseOutcome::Released
    );
    assert_eq!(
        another.holder(&key).await.expect("holder"),
        None,
        "released"
    );
    let plain = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let holding = another
        .holder(&key)
        .await
        .expect("holder")
        .expect("a plain lock is held too");
    assert_eq!(holding.identity, None, "a plain lock records no identity");
    assert!(
        holding.token.is_none() || holding.token == Some(plain.token()),
        "a plain lock's token, if told, is its own: {:?} for {}",
        holding.token,
        plain.token()
    );
    plain.release().await.expect("release");
    assert_eq!(
        backend.holder(&key).await.expect("holder"),
        None,
        "released"
    );
}

/// While leases with different identities follow each other on a key through two instances, every holder read pairs a token with the identity granted with it, never an earlier lease's.
pub async fn holder_never_pairs_a_holder_with_an_earlier_leases_identity(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let key = fresh_key("holder-pairs");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (reader_backend, key, stop) = (another.clone(), key.clone(), stop.clone());
        tokio::spawn(async move {
            let mut seen = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if let Some(holding) = reader_backend.holder(&key).await.expect("holder") {
                    seen.push(holding);
                }
                tokio::task::yield_now().await;
            }
            seen
        })
    };
    let mut granted = std::collections::HashMap::new();
    for round in 0..30 {
        let through = if round % 2 == 0 { &backend } else { &another };
        let owner = OwnerId::random().expect("random");
        let identity = format!("replica-{round}");
        let token = take_as(through, &key, &owner, &identity, Duration::from_secs(30)).await;
        granted.insert(token, identity);
        sleep(Duration::from_millis(2)).await;
        assert_eq!(
            release_as(through, &key, &owner).await,
            crate::ReleaseOutcome::Released
        );
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = within(20, "the holder reader", reader)
        .await
        .expect("reader");
    for holding in &seen {
        match (&holding.token, &holding.identity) {
            (Some(token), Some(identity)) => assert_eq!(
                granted.get(token),
                Some(identity),
                "token {token} was read with identity {identity:?}"
            ),
            (None, None) => {}
            (token, identity) => panic!(
                "every lease here recorded an identity: read {identity:?} with token {token:?}"
            ),
        }
    }
}

/// A lease with an identity that runs out unrenewed reads as free.
pub async fn holder_is_none_once_the_lease_expires(backend: Arc<dyn Backend>) {
    // The read of the holder must come within the ttl, counted from before
    // the acquisition: one a stall pushed past it that reads nothing proves
    // nothing, and the round is run again on a fresh key with a ttl twice
    // as long.
    let mut ttl = Duration::from_millis(300);
    let key = loop {
        let key = fresh_key("holder-expiry");
        let owner = OwnerId::random().expect("random");
        let asked = Instant::now();
        take_as(&backend, &key, &owner, "short-lived", ttl).await;
        let held = backend.holder(&key).await.expect("holder").is_some();
        if held {
            break key;
        }
        assert!(
            asked.elapsed() + ROUNDING >= ttl && ttl < Duration::from_secs(2),
            "held: nobody read within the {ttl:?} ttl"
        );
        ttl *= 2;
    };
    // Read until free: a store frees the key by its own clock, within its
    // expiry slack of the ttl (etcd by a sweep of its leader's, which a
    // loaded machine delays), so one read at a fixed instant could come
    // before it did.
    let deadline = Instant::now() + ttl + backend.expiry_slack() + Duration::from_secs(3);
    sleep(ttl + Duration::from_millis(400) + backend.expiry_slack()).await;
    let mut read = backend.holder(&key).await.expect("holder");
    while read.is_some() && Instant::now() < deadline {
        sleep(Duration::from_millis(50)).await;
        read = backend.holder(&key).await.expect("holder");
    }
    assert_eq!(read, None, "the lease ran out");
}

/// A holder watch registered on a free key wakes (or says to look again) when another instance takes the key with an identity, and one registered while it is held wakes when it is released: a reader that waits on it then reads the change.
pub async fn a_holder_watch_wakes_on_an_identity_acquisition_and_on_release(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let key = fresh_key("holder-watch");
    let owner = OwnerId::random().expect("random");
    for round in 0..3 {
        let notice = another.watch_holder(&key).await.expect("watch");
        assert_eq!(another.holder(&key).await.expect("holder"), None, "free");
        let taker = {
            let (backend, key) = (backend.clone(), key.clone());
            tokio::spawn(async move {
                sleep(Duration::from_millis(20)).await;
                take_as(&backend, &key, &owner, "leader", Duration::from_secs(30)).await
            })
        };
        watched(notice, "an acquisition with an identity").await;
        let token = within(10, "the acquisition", taker).await.expect("taker");
        let mut read = another.holder(&key).await.expect("holder");
        // A notice with a recheck may come back before the acquisition.
        let deadline = Instant::now() + Duration::from_secs(5);
        while read.as_ref().and_then(|h| h.token) != Some(token) && Instant::now() < deadline {
            sleep(Duration::from_millis(10)).await;
            read = another.holder(&key).await.expect("holder");
        }
        let read = read.expect("held after the acquisition");
        assert_eq!(
            (read.token, read.identity.as_deref()),
            (Some(token), Some("leader"))
        );

        let notice = another.watch_holder(&key).await.expect("watch");
        assert!(
            another.holder(&key).await.expect("holder").is_some(),
            "round {round}: held"
        );
        let releaser = {
            let (backend, key) = (backend.clone(), key.clone());
            tokio::spawn(async move {
                sleep(Duration::from_millis(20)).await;
                release_as(&backend, &key, &owner).await
            })
        };
        watched(notice, "a release").await;
        let released = within(10, "the release", releaser).await.expect("releaser");
        assert_eq!(released, crate::ReleaseOutcome::Released);
        assert_eq!(
            another.holder(&key).await.expect("holder"),
            None,
            "released"
        );
    }
}

/// Every acquisition, with an identity or without, records this process's
/// host and pid and the request's label beside the lock, read back through
/// another instance with how long the key has been held. (A backend under
/// test carries no label of its own.)
pub async fn every_acquisition_records_its_holders_host_pid_and_label(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let me = crate::HolderInfo::this_process(Some("conformance"));
    for identity in [None, Some("web-3")] {
        let key = fresh_key("recorded");
        let owner = OwnerId::random().expect("random");
        let request = AcquireRequest::new(&key, &owner, Duration::from_secs(30))
            .with_identity(identity)
            .with_label(Some("conformance"));
        let Attempt::Acquired(grant) = backend.try_acquire(&request).await.expect("acquire") else {
            panic!("`{key}` must be free");
        };
        let holding = another
            .holder(&key)
            .await
            .expect("holder")
            .expect("the key is held");
        assert!(
            holding.token.is_none() || holding.token == Some(grant.token),
            "the holder's own token: {:?} for {}",
            holding.token,
            grant.token
        );
        let holder = holding
            .holder
            .unwrap_or_else(|| panic!("no holder recorded for `{key}` ({identity:?})"));
        assert_eq!(
            (holder.host.as_str(), holder.pid, holder.label.as_deref()),
            (me.host.as_str(), me.pid, Some("conformance")),
            "the recorded holder"
        );
        if let Some(held_for) = holder.held_for {
            assert!(
                held_for < Duration::from_secs(30),
                "held for {held_for:?} right after a 30 s lease was taken"
            );
        }
        assert_eq!(
            release_as(&backend, &key, &owner).await,
            crate::ReleaseOutcome::Released
        );
        assert_eq!(another.holder(&key).await.expect("holder"), None);
    }
}

/// A caller that would not wait and finds the key held gets a
/// [`LockError::Held`] naming the holder (its host, pid and token) in its
/// field and in its message.
pub async fn a_refused_caller_is_told_who_holds_the_key(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let key = fresh_key("refused");
    let options = LockOptions::new(Duration::from_secs(30));
    let lease = options
        .acquire_on(Arc::clone(&backend), key.clone())
        .await
        .expect("a fresh key is free");
    // The holder is read after the refusal, within a bound of its own: a
    // read a stall pushed past it costs one refusal its holder. Of a few
    // refusals, one must name it.
    let mut tries = 0;
    let (holding, message) = loop {
        tries += 1;
        let refused = options.acquire_on(Arc::clone(&another), key.clone()).await;
        let Err(err @ LockError::Held { .. }) = refused else {
            panic!("the second caller must be refused as held: {refused:?}");
        };
        let message = err.to_string();
        let LockError::Held { holder, .. } = err else {
            unreachable!()
        };
        match holder {
            Some(holding) => break (holding, message),
            None if tries < 5 => {}
            None => panic!("{tries} refusals named no holder: {message}"),
        }
    };
    assert!(
        holding.token.is_none() || holding.token == Some(lease.token()),
        "the refusal names the holder's token: {:?} for {}",
        holding.token,
        lease.token()
    );
    let info = holding
        .holder
        .unwrap_or_else(|| panic!("the refusal names no host or pid: {message}"));
    assert_eq!(info.pid, std::process::id(), "{message}");
    assert!(
        message.contains(&format!("{} (pid {}", info.host, info.pid)),
        "the message names host and pid: {message}"
    );
    lease.release().await.expect("release");
}

/// `held` lists exactly the live locks whose keys start with a prefix,
/// sorted, with their tokens, through another instance: not a key beside
/// the prefix, not a released one, and keys with the characters stores
/// treat as patterns (`*?[]%_`) are data.
pub async fn held_lists_exactly_the_held_keys_under_a_prefix(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    let base = fresh_key("list");
    let prefix = format!("{base}:*?[a]%_:");
    let names = [
        format!("{prefix}b"),
        format!("{prefix}a"),
        format!("{prefix}odd*?[x]%_\\"),
    ];
    let beside = format!("{base}:*?[a]%_x");
    let glob_lookalike = format!("{base}:xx[a]%_:a");
    let like_lookalike = format!("{base}:*?[a]ab:a");
    let options = LockOptions::new(Duration::from_secs(30));
    let mut leases = Vec::new();
    for name in names
        .iter()
        .chain([&beside, &glob_lookalike, &like_lookalike])
    {
        let key = LockKey::new(name.clone()).expect("valid key");
        leases.push(
            options
                .acquire_on(Arc::clone(&backend), key)
                .await
                .expect("a fresh key is free"),
        );
    }
    let listed = another.held(&prefix).await.expect("held");
    let mut expected: Vec<(String, crate::FencingToken)> = names
        .iter()
        .zip(&leases)
        .map(|(name, lease)| (name.clone(), lease.token()))
        .collect();
    expected.sort();
    assert_eq!(
        listed
            .iter()
            .map(|(key, _)| key.clone())
            .collect::<Vec<_>>(),
        expected
            .iter()
            .map(|(key, _)| key.clone())
            .collect::<Vec<_>>(),
        "the keys under {prefix:?}, sorted"
    );
    for ((key, holding), (_, token)) in listed.iter().zip(&expected) {
        assert!(
            holding.token.is_none() || holding.token == Some(*token),
            "`{key}` lists its own holder's token: {:?} for {token}",
            holding.token
        );
    }
    let mut leases = leases.into_iter();
    let first = leases.next().expect("a lease");
    first.release().await.expect("release");
    let after: Vec<String> = another
        .held(&prefix)
        .await
        .expect("held")
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    assert!(
        !after.contains(&names[0]) && after.len() == names.len() - 1,
        "a released key is not listed: {after:?}"
    );
    assert_eq!(
        another.held(&format!("{base}:none:")).await.expect("held"),
        Vec::new(),
        "nothing is held under a prefix of no key"
    );
    for lease in leases {
        lease.release().await.expect("release");
    }
}

//! Force releases (rule R4 on the `Backend` trait): breaking a lock frees
//! the key and nothing else, and only the lease it names.

use super::*;

/// Breaking a lock by force frees the key and nothing else: the next
/// holder's token is still above every token issued before.
pub async fn tokens_keep_rising_after_a_force_release(backend: Arc<dyn Backend>) {
    let key = fresh_key("forced-tokens");
    let broken = take(&backend, &key, 10_000, Duration::ZERO, "free").await;
    assert!(
        backend.force_release(&key).await.expect("backend answers"),
        "a held key must be broken"
    );
    let next = take(
        &backend,
        &key,
        10_000,
        Duration::from_secs(5),
        "free once broken",
    )
    .await;
    assert!(
        next.token() > broken.token(),
        "token {} after a force release, not above {}",
        next.token(),
        broken.token()
    );
    next.release().await.expect("release");
    drop(broken);
}

/// A force release that names the holder it breaks
/// (`force_release_holding`, as an operator confirms a holder shown to
/// them) breaks only that lease. Through another instance (an
/// administrator's process): the holder is read, lets go and takes the key
/// again; naming the first lease then answers `HolderChanged` and breaks
/// nothing, the second lease keeps the key. Naming the second breaks it
/// (its holder is told), and naming it again answers `NotHeld`.
pub async fn a_force_release_naming_a_holder_that_changed_breaks_nothing(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    use crate::backend::ForceRelease;
    let key = fresh_key("forced-named");
    let first = take(&backend, &key, 10_000, Duration::ZERO, "free").await;
    let shown = another
        .holder(&key)
        .await
        .expect("backend answers")
        .expect("the key is held");
    assert_eq!(
        shown.token,
        Some(first.token()),
        "the holder read must name the lease's token"
    );
    first.release().await.expect("release");
    // Renewed every second: its holder is told soon once it is broken.
    let second = take(&backend, &key, 3_000, Duration::ZERO, "free again").await;
    let answer = another
        .force_release_holding(&key, &shown)
        .await
        .expect("backend answers");
    assert_eq!(
        answer,
        ForceRelease::HolderChanged,
        "a force release naming a lease that ended must find the holder changed"
    );
    let now = another
        .holder(&key)
        .await
        .expect("backend answers")
        .expect("the second lease must still hold the key");
    assert_eq!(now.token, Some(second.token()));
    assert!(
        second.check().is_ok(),
        "a force release naming another lease must not break this one"
    );
    let contender = options(10_000).acquire_on(another.clone(), &key).await;
    assert!(
        matches!(contender, Err(LockError::Held { .. })),
        "the second lease must still keep the key: {contender:?}"
    );

    let answer = another
        .force_release_holding(&key, &now)
        .await
        .expect("backend answers");
    assert_eq!(answer, ForceRelease::Released, "the named holder is broken");
    within(10, "the broken holder's lost signal", second.lost()).await;
    assert!(
        another
            .holder(&key)
            .await
            .expect("backend answers")
            .is_none(),
        "the key must be free once its named holder is broken"
    );
    let answer = another
        .force_release_holding(&key, &now)
        .await
        .expect("backend answers");
    assert_eq!(answer, ForceRelease::NotHeld, "nothing is left to break");
    drop(second);
}

/// A force release that names a lease breaks that lease or nothing, even
/// racing its holder: one instance takes the key and lets it go again in
/// a tight loop while another reads the holder and force-releases the
/// lease it read, over and over, as an operator answering `y` would. A
/// force release answered `Released` must have broken the lease it named
/// (whose own release then fails); one answered otherwise must have
/// broken nothing (the named lease's own release succeeds). A check and a
/// break in two steps fail this: the holder lets go between them and
/// takes the key again, and the break hits the next lease.
pub async fn a_force_release_racing_its_holder_breaks_only_the_lease_it_names(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    use crate::backend::{ForceRelease, ReleaseOutcome, ReleaseRequest};
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, Ordering};
    const RACE: Duration = Duration::from_secs(3);
    let key = fresh_key("forced-race");
    let stop = Arc::new(AtomicBool::new(false));
    let holder = tokio::spawn({
        let (backend, key, stop) = (backend.clone(), key.clone(), Arc::clone(&stop));
        async move {
            // Each lease's token, and what its own release answered.
            let mut released: HashMap<u64, Result<ReleaseOutcome, String>> = HashMap::new();
            // Half the time let go at once and take the key again (the
            // race of a check and a break), half the time held for up to
            // as long as a force release takes (breaks that land).
            let holds = [1, 2, 5, 20, 50].map(Duration::from_millis).into_iter();
            let mut holds = holds.cycle();
            let began = Instant::now();
            while !stop.load(Ordering::SeqCst) {
                let tight = (began.elapsed().as_millis() / 500).is_multiple_of(2);
                let owner = OwnerId::random().expect("an owner id");
                let request = AcquireRequest::new(&key, &owner, Duration::from_secs(10));
                match backend.try_acquire(&request).await {
                    Ok(Attempt::Acquired(grant)) => {
                        if tight {
                            tokio::task::yield_now().await;
                        } else {
                            sleep(holds.next().unwrap_or_default()).await;
                        }
                        let outcome = backend
                            .release(&ReleaseRequest::new(&key, &owner))
                            .await
                            .map_err(|err| err.to_string());
                        released.insert(grant.token.get(), outcome);
                    }
                    // Broken a moment ago (a session that comes back, say).
                    Ok(_) | Err(_) => sleep(Duration::from_millis(5)).await,
                }
            }
            released
        }
    });
    let mut answers = Vec::new();
    let began = Instant::now();
    while began.elapsed() < RACE {
        // A store in this process answers without a pause: a pause here
        // lets the holder's task run, and keeps this loop from taking a
        // whole core from the properties that run beside it.
        sleep(Duration::from_millis(1)).await;
        let shown = match another.holder(&key).await {
            Ok(Some(shown)) => shown,
            Ok(None) => continue,
            Err(err) => panic!("the holder read failed: {err}"),
        };
        let Some(token) = shown.token else { continue };
        let answer = another
            .force_release_holding(&key, &shown)
            .await
            .expect("backend answers");
        answers.push((token.get(), answer));
    }
    stop.store(true, Ordering::SeqCst);
    let released = within(30, "the holder's loop", holder)
        .await
        .expect("the holder's loop");
    let broken = answers
        .iter()
        .filter(|(_, answer)| *answer == ForceRelease::Released)
        .count();
    eprintln!(
        "{} force releases raced {} leases; {broken} answered released",
        answers.len(),
        released.len()
    );
    for (token, answer) in &answers {
        // A lease broken before its acquisition's answer reached its
        // holder: the holder never knew it, and has nothing to tell.
        let Some(own) = released.get(token) else {
            continue;
        };
        match answer {
            ForceRelease::Released => assert!(
                !matches!(own, Ok(ReleaseOutcome::Released)),
                "a force release naming lease {token} answered released, yet that lease's own \
                 release succeeded after it: the break hit another lease"
            ),
            other => assert!(
                matches!(own, Ok(ReleaseOutcome::Released)),
                "a force release naming lease {token} answered {other:?}, yet that lease's own \
                 release answered {own:?}: it broke something"
            ),
        }
    }
}

/// A force release that names one permit of a key held as permits breaks
/// that permit alone, or is refused with an error and breaks nothing:
/// never the key's other permits. With permits A and B held, naming B by
/// its token leaves A's release answering `Released`. With B released by
/// its holder, naming B (a lease shown a moment before) breaks nothing,
/// and A keeps its permit.
pub async fn a_force_release_naming_a_permit_breaks_only_that_permit(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    use crate::backend::{Access, ForceRelease, Holding, ReleaseOutcome, ReleaseRequest};
    let access = Access::Permits { permits: 2 };
    if !keeps_access(&backend, access).await {
        return;
    }
    let take_permit = |key: LockKey| {
        let backend = backend.clone();
        async move {
            let owner = OwnerId::random().expect("an owner id");
            let request =
                AcquireRequest::new(&key, &owner, Duration::from_secs(30)).with_access(access);
            match backend
                .try_acquire(&request)
                .await
                .expect("backend answers")
            {
                Attempt::Acquired(grant) => (owner, grant.token, grant.slot),
                other => panic!("a free permit must be granted: {other:?}"),
            }
        }
    };
    let release = |key: LockKey, owner: OwnerId, slot: Option<u32>| {
        let backend = backend.clone();
        async move {
            backend
                .release(&ReleaseRequest::new(&key, &owner).holding(access, slot))
                .await
                .expect("backend answers")
        }
    };

    // Both held: naming the one shown breaks that one at most.
    let key = fresh_key("forced-permit");
    let a = take_permit(key.clone()).await;
    let b = take_permit(key.clone()).await;
    let named = b.1;
    let (named_lease, other_lease) = (b, a);
    let answer = another
        .force_release_holding(&key, &Holding::new(Some(named), None))
        .await;
    let other_out = release(key.clone(), other_lease.0, other_lease.2).await;
    assert_eq!(
        other_out,
        ReleaseOutcome::Released,
        "naming permit {named} (answered {answer:?}) must not break permit {}",
        other_lease.1
    );
    let named_out = release(key.clone(), named_lease.0, named_lease.2).await;
    match answer {
        Ok(ForceRelease::Released) => assert_ne!(
            named_out,
            ReleaseOutcome::Released,
            "the permit named was answered broken, yet its holder still held it"
        ),
        // Refused, or not found: nothing may be broken.
        other => assert_eq!(
            named_out,
            ReleaseOutcome::Released,
            "a force release answering {other:?} must break nothing"
        ),
    }

    // The permit named was released by its holder meanwhile: nothing breaks.
    let key = fresh_key("forced-permit-gone");
    let a = take_permit(key.clone()).await;
    let b = take_permit(key.clone()).await;
    let named = b.1;
    let (gone, kept) = (b, a);
    assert_eq!(
        release(key.clone(), gone.0, gone.2).await,
        ReleaseOutcome::Released
    );
    let answer = another
        .force_release_holding(&key, &Holding::new(Some(named), None))
        .await;
    assert!(
        !matches!(answer, Ok(ForceRelease::Released)),
        "naming permit {named}, which its holder released, must break nothing: {answer:?}"
    );
    assert_eq!(
        release(key.clone(), kept.0, kept.2).await,
        ReleaseOutcome::Released,
        "naming a released permit ({answer:?}) must not break permit {}",
        kept.1
    );
}

//! Shared locks and permits (`LockOptions::mode`, `LockOptions::permits`,
//! rules M1 to M5 on the `Backend` trait). A backend without them must
//! refuse the acquisition rather than lock wrongly: on such a backend each
//! property checks that refusal.

use super::*;

/// N permits: at most N hold at once, each in its own slot of `0..N`; the
/// N+1th is refused until a slot is freed, and then takes that slot. Among
/// twelve concurrent acquirers of a fresh key, exactly N win.
pub async fn permits_at_most_n_hold_at_once_in_distinct_slots(backend: Arc<dyn Backend>) {
    const N: u32 = 3;
    if !keeps_access(&backend, crate::backend::Access::Permits { permits: N }).await {
        return;
    }
    let key = fresh_key("permits");
    let mut leases = Vec::new();
    for _ in 0..N {
        leases.push(
            permits(N, 30_000, Duration::ZERO)
                .acquire_on(backend.clone(), &key)
                .await
                .expect("a free permit"),
        );
    }
    let mut slots: Vec<u32> = leases
        .iter()
        .map(|lease| lease.slot().expect("a permit has a slot"))
        .collect();
    slots.sort_unstable();
    assert_eq!(slots, vec![0, 1, 2], "the slots are distinct, in 0..{N}");
    let over = permits(N, 30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await;
    assert!(
        matches!(over, Err(LockError::Held { .. })),
        "the permit beyond {N} is refused, got {over:?}"
    );
    let freed = leases.remove(1);
    let freed_slot = freed.slot();
    freed.release().await.expect("release");
    let next = permits(N, 30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the freed slot");
    assert_eq!(next.slot(), freed_slot, "the freed slot is taken again");
    next.release().await.expect("release");
    for lease in leases {
        lease.release().await.expect("release");
    }

    let key = fresh_key("permits-race");
    let barrier = Arc::new(Barrier::new(12));
    let racers: Vec<_> = (0..12)
        .map(|_| {
            let (backend, key, barrier) = (backend.clone(), key.clone(), Arc::clone(&barrier));
            tokio::spawn(async move {
                barrier.wait().await;
                permits(N, 30_000, Duration::ZERO)
                    .acquire_on(backend, key)
                    .await
            })
        })
        .collect();
    let mut won = Vec::new();
    for racer in racers {
        match within(20, "a permit racer", racer).await.expect("task") {
            Ok(lease) => won.push(lease),
            Err(LockError::Held { .. }) => {}
            Err(err) => panic!("a racer failed: {err}"),
        }
    }
    assert_eq!(won.len(), N as usize, "exactly {N} of twelve racers hold");
    let mut slots: Vec<_> = won.iter().map(crate::Lease::slot).collect();
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(slots.len(), N as usize, "the winners hold distinct slots");
    for lease in won {
        lease.release().await.expect("release");
    }
}

/// Readers overlap, and a writer overlaps no one: two readers hold at once;
/// a writer is refused while either does; a reader is refused while the
/// writer holds.
pub async fn readers_overlap_and_a_writer_overlaps_no_one(backend: Arc<dyn Backend>) {
    if !keeps_access(&backend, crate::backend::Access::Shared).await {
        return;
    }
    let key = fresh_key("rw");
    let first = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a free key");
    let second = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("readers overlap");
    for _ in 0..2 {
        let writer = options(30_000).acquire_on(backend.clone(), &key).await;
        assert!(
            matches!(writer, Err(LockError::Held { .. })),
            "a writer is refused while readers hold, got {writer:?}"
        );
    }
    first.release().await.expect("release");
    let writer = options(30_000).acquire_on(backend.clone(), &key).await;
    assert!(
        matches!(writer, Err(LockError::Held { .. })),
        "a writer is refused while one reader still holds, got {writer:?}"
    );
    second.release().await.expect("release");
    // The refused writers did not wait, so they left no writer-waiting
    // mark (rule M3): a reader still joins, and a writer that waits gets
    // the key once the readers have left.
    shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a writer that does not wait holds no reader back")
        .release()
        .await
        .expect("release");
    let writer = options(30_000)
        .wait(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the readers have gone");
    let reader = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await;
    assert!(
        matches!(reader, Err(LockError::Held { .. })),
        "a reader is refused while the writer holds, got {reader:?}"
    );
    let other_writer = options(30_000).acquire_on(backend.clone(), &key).await;
    assert!(
        matches!(other_writer, Err(LockError::Held { .. })),
        "a second writer is refused, got {other_writer:?}"
    );
    writer.release().await.expect("release");
    let reader = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free again");
    reader.release().await.expect("release");
}

/// A waiting writer is not starved by a stream of readers that overlap
/// (each new reader comes before the one before it leaves, so the key is
/// never free of readers): within a few turns new readers are refused, the
/// readers drain and the writer gets the key, with a token above theirs.
pub async fn a_waiting_writer_is_not_starved_by_a_stream_of_readers(backend: Arc<dyn Backend>) {
    const TURNS: usize = 50;
    if !keeps_access(&backend, crate::backend::Access::Shared).await {
        return;
    }
    let key = fresh_key("rw-starve");
    let mut current = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a free key");
    let reader_token = current.token();
    let writer = {
        let (backend, key) = (backend.clone(), key.clone());
        tokio::spawn(async move {
            options(30_000)
                .wait(Duration::from_secs(30))
                .acquire_on(backend, key)
                .await
        })
    };
    let mut turns = 0;
    loop {
        assert!(
            turns < TURNS,
            "the writer starved: {TURNS} overlapping readers in a row took the key"
        );
        turns += 1;
        // Give the writer's attempts a chance to reach the store.
        sleep(Duration::from_millis(20)).await;
        match shared(30_000, Duration::ZERO)
            .acquire_on(backend.clone(), &key)
            .await
        {
            Ok(next) => {
                assert_eq!(
                    next.token(),
                    reader_token,
                    "overlapping readers share a token"
                );
                let before = std::mem::replace(&mut current, next);
                before.release().await.expect("release");
            }
            Err(LockError::Held { .. }) => break,
            Err(err) => panic!("a reader failed: {err}"),
        }
    }
    current.release().await.expect("release");
    let writer = within(20, "the waiting writer", writer)
        .await
        .expect("task")
        .expect("the writer gets the key once the readers drained");
    assert!(
        writer.token() > reader_token,
        "the writer's token {} is above the readers' {reader_token}",
        writer.token()
    );
    writer.release().await.expect("release");
    let reader = shared(30_000, Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("readers go again after the writer");
    reader.release().await.expect("release");
}

/// Rule M3 for a fair writer, and across processes: a fair writer on one
/// instance is not starved by readers on another that keep joining the
/// key while readers of their own process hold it. A new reader comes
/// every 100 ms and each holds the key longer than a writer's mark lives
/// unless its waiter keeps it ([`QUEUE_ENTRY_TTL`] and a second), so the
/// key is never free of readers unless new ones are refused for as long
/// as the writer waits: then those that hold finish and the writer gets
/// the key, with a token above theirs.
///
/// [`QUEUE_ENTRY_TTL`]: crate::backend::QUEUE_ENTRY_TTL
pub async fn a_waiting_fair_writer_is_not_starved_by_another_processs_readers(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    if !keeps_access(&backend, crate::backend::Access::Shared).await
        || !keeps_fair_queues(&backend).await
    {
        return;
    }
    let hold = crate::backend::QUEUE_ENTRY_TTL + Duration::from_secs(1);
    let key = fresh_key("fair-rw-starve");
    let first = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a free key");
    let reader_token = first.token();
    let mut holding = std::collections::VecDeque::from([(first, Instant::now())]);
    let writer = {
        let key = key.clone();
        tokio::spawn(async move { fair(30_000, hold * 3).acquire_on(another, key).await })
    };
    while !writer.is_finished() {
        sleep(Duration::from_millis(100)).await;
        while holding
            .front()
            .is_some_and(|(_, since)| since.elapsed() >= hold)
        {
            if let Some((reader, _)) = holding.pop_front() {
                reader.release().await.expect("release");
            }
        }
        match shared(30_000, Duration::ZERO)
            .acquire_on(backend.clone(), &key)
            .await
        {
            Ok(reader) => holding.push_back((reader, Instant::now())),
            Err(LockError::Held { .. }) => {}
            Err(err) => panic!("a reader failed: {err}"),
        }
    }
    let writer = writer.await.expect("task").unwrap_or_else(|err| {
        panic!(
            "the fair writer starved: readers of another process kept joining for as long as \
             it waited ({err})"
        )
    });
    assert!(
        holding.is_empty(),
        "{} readers hold the key together with the fair writer",
        holding.len()
    );
    assert!(
        writer.token() > reader_token,
        "the writer's token {} is above the readers' {reader_token}",
        writer.token()
    );
    writer.release().await.expect("release");
}

/// Tokens of a read-write lock: an exclusive token is above every token
/// issued before for the key, readers' included; readers that overlap get
/// equal tokens, above the last writer's. So "accept `>=` the highest
/// accepted" refuses a stale writer and never a current reader.
pub async fn tokens_fence_stale_writers_and_never_current_readers(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    if !keeps_access(&backend, crate::backend::Access::Shared).await {
        return;
    }
    let key = fresh_key("rw-tokens");
    let w1 = options(30_000)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a free key");
    let w1_token = w1.token();
    w1.release().await.expect("release");
    let r1 = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let r2 = shared(30_000, Duration::ZERO)
        .acquire_on(another.clone(), &key)
        .await
        .expect("readers overlap, across instances");
    assert!(
        r1.token() > w1_token,
        "a reader's token is above the writer's before"
    );
    assert_eq!(
        r1.token(),
        r2.token(),
        "overlapping readers get equal tokens"
    );
    r1.release().await.expect("release");
    let r3 = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the phase is live");
    assert_eq!(
        r3.token(),
        r2.token(),
        "a reader joining a live phase gets its token"
    );
    let r3_token = r3.token();
    r2.release().await.expect("release");
    r3.release().await.expect("release");
    let w2 = options(30_000)
        .acquire_on(another.clone(), &key)
        .await
        .expect("free");
    assert!(
        w2.token() > r3_token,
        "a writer's token {} is above every reader's before, {r3_token}",
        w2.token(),
    );
    let w2_token = w2.token();
    w2.release().await.expect("release");
    let r4 = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    assert!(
        r4.token() > w2_token,
        "a new phase's token is above the writer's"
    );
    r4.release().await.expect("release");
}

/// A permit's token rises per slot: the next holder of a slot gets a
/// greater token than the one before in that slot.
pub async fn permit_tokens_rise_per_slot(backend: Arc<dyn Backend>, another: Arc<dyn Backend>) {
    if !keeps_access(&backend, crate::backend::Access::Permits { permits: 2 }).await {
        return;
    }
    let key = fresh_key("permit-tokens");
    let mut last: [Option<crate::FencingToken>; 2] = [None, None];
    for round in 0..4 {
        let via = if round % 2 == 0 { &backend } else { &another };
        let a = permits(2, 30_000, Duration::ZERO)
            .acquire_on(via.clone(), &key)
            .await
            .expect("a free permit");
        let b = permits(2, 30_000, Duration::ZERO)
            .acquire_on(via.clone(), &key)
            .await
            .expect("the second permit");
        for lease in [&a, &b] {
            let slot = lease.slot().expect("a slot") as usize;
            assert!(slot < 2, "slot {slot} is in 0..2");
            if let Some(before) = last[slot] {
                assert!(
                    lease.token() > before,
                    "slot {slot}'s token {} is above its last holder's {before}",
                    lease.token()
                );
            }
            last[slot] = Some(lease.token());
        }
        a.release().await.expect("release");
        b.release().await.expect("release");
    }
}

/// A permit holder that crashed (its lease never released, never renewed:
/// only the store's ttl can free it) frees its slot once the ttl is over.
pub async fn a_crashed_permit_holder_frees_its_slot_after_the_ttl(backend: Arc<dyn Backend>) {
    let access = crate::backend::Access::Permits { permits: 1 };
    if !keeps_access(&backend, access).await {
        return;
    }
    // The refused attempt must come within the ttl, counted from before
    // the crashed holder's request: one a stall pushed past it that is
    // let in proves nothing, and the round is run again on a fresh key
    // with a ttl twice as long.
    let mut ttl = Duration::from_millis(400);
    let key = loop {
        let key = fresh_key("permit-crash");
        let crashed = OwnerId::random().expect("random bytes");
        let asked = Instant::now();
        let taken = backend
            .try_acquire(&AcquireRequest::new(&key, &crashed, ttl).with_access(access))
            .await
            .expect("backend answers");
        let Attempt::Acquired(grant) = taken else {
            panic!("a fresh key's permit is free, got {taken:?}");
        };
        assert_eq!(grant.slot, Some(0), "the only slot is 0");
        let refused = permits(1, 30_000, Duration::ZERO)
            .acquire_on(backend.clone(), &key)
            .await;
        match refused {
            Err(LockError::Held { .. }) => break key,
            Ok(lease) if asked.elapsed() + ROUNDING >= ttl && ttl < Duration::from_secs(3) => {
                lease.release().await.expect("release");
                ttl *= 2;
            }
            other => panic!("the crashed holder's slot is held until its ttl, got {other:?}"),
        }
    };
    let next = permits(1, 30_000, Duration::from_secs(15))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the ttl frees the slot");
    assert_eq!(next.slot(), Some(0));
    next.release().await.expect("release");
}

/// Cancellation: a writer that waits behind readers and is dropped
/// mid-wait leaves no writer-waiting mark (a new reader gets the key well
/// before a mark's expiry would have freed it), and a permit acquisition
/// dropped at any await point leaves no slot held.
pub async fn a_cancelled_writer_leaves_no_mark_and_a_cancelled_permit_no_slot(
    backend: Arc<dyn Backend>,
) {
    if keeps_access(&backend, crate::backend::Access::Shared).await {
        let key = fresh_key("rw-cancel");
        let reader = shared(30_000, Duration::ZERO)
            .acquire_on(backend.clone(), &key)
            .await
            .expect("a free key");
        let counting = CountingBackend::new(backend.clone());
        let via: Arc<dyn Backend> = counting.clone();
        // Before the writer's first attempt: a mark it leaves was written
        // after this, and expires no earlier than a queue entry's life
        // later (less the milliseconds a server's clock rounds away).
        let mark_expiry =
            Instant::now() + crate::backend::QUEUE_ENTRY_TTL - Duration::from_millis(5);
        {
            let writer = options(30_000).wait(Duration::from_secs(30));
            let waiting = writer.acquire_on(via, &key);
            let mut waiting = std::pin::pin!(waiting);
            // Until its attempt was answered `Held` (the mark is left).
            within(10, "the writer's first attempt", async {
                while counting.answered() == 0 {
                    let _ = timeout(Duration::from_millis(10), waiting.as_mut()).await;
                }
            })
            .await;
        }
        // Until the mark's earliest expiry: only a removed mark lets it in.
        let joined = shared(
            30_000,
            mark_expiry.saturating_duration_since(Instant::now()),
        )
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the cancelled writer's mark is gone");
        joined.release().await.expect("release");
        reader.release().await.expect("release");
    }
    let access = crate::backend::Access::Permits { permits: 1 };
    if !keeps_access(&backend, access).await {
        return;
    }
    // What the core sends for an attempt abandoned before its answer: a
    // release naming no slot, which frees the owner's slot (rule M4).
    let key = fresh_key("permit-give-back");
    let abandoned = OwnerId::random().expect("random bytes");
    let taken = backend
        .try_acquire(
            &AcquireRequest::new(&key, &abandoned, Duration::from_secs(30)).with_access(access),
        )
        .await
        .expect("backend answers");
    assert!(
        matches!(taken, Attempt::Acquired(_)),
        "a fresh key's permit is free, got {taken:?}"
    );
    let given_back = backend
        .release(&crate::backend::ReleaseRequest::new(&key, &abandoned).holding(access, None))
        .await
        .expect("backend answers");
    assert_eq!(
        given_back,
        crate::backend::ReleaseOutcome::Released,
        "a release naming no slot gives the owner's slot back"
    );
    permits(1, 30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("the given-back slot is free")
        .release()
        .await
        .expect("release");
    for polls in 0..6 {
        let key = fresh_key("permit-cancel");
        poll_then_drop(
            permits(1, 30_000, Duration::ZERO).acquire_on(backend.clone(), &key),
            polls,
        )
        .await;
        let next = permits(1, 30_000, Duration::from_secs(10))
            .acquire_on(backend.clone(), &key)
            .await
            .unwrap_or_else(|err| {
                panic!("a permit acquisition dropped after {polls} polls left its slot: {err}")
            });
        next.release().await.expect("release");
    }
}

/// Rule M3: only a writer that waits leaves a writer-waiting mark. A
/// try-lock writer refused by readers sends no release afterwards (it does
/// not wait, so the core has no mark to remove), so a mark it left would
/// hold every new reader back for the mark's whole expiry: a reader that
/// does not wait must be granted at once right after the refusal.
pub async fn a_writer_that_does_not_wait_leaves_no_mark(backend: Arc<dyn Backend>) {
    if !keeps_access(&backend, crate::backend::Access::Shared).await {
        return;
    }
    let key = fresh_key("rw-try-writer");
    let reader = shared(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a free key");
    for round in 0..3 {
        match options(30_000).acquire_on(backend.clone(), &key).await {
            Err(LockError::Held { .. }) => {}
            other => panic!("a writer beside a reader is refused, got {other:?}"),
        }
        let joined = shared(30_000, Duration::ZERO)
            .acquire_on(backend.clone(), &key)
            .await
            .unwrap_or_else(|err| {
                panic!("round {round}: a refused try-lock writer left a mark: {err}")
            });
        assert_eq!(
            joined.token(),
            reader.token(),
            "a reader joining the live phase shares its token"
        );
        joined.release().await.expect("release");
    }
    reader.release().await.expect("release");
}

//! Fair mode (`LockOptions::fair`, rules F1 to F3 on the `Backend` trait).
//! A backend without it must refuse a fair acquisition rather than lock
//! unfairly: on such a backend each fair property checks that refusal.

use super::*;

/// A fair waiter served: its index, its token, and when its acquisition
/// returned.
type Served = (usize, crate::FencingToken, Instant);

/// A fair waiter task on `backend` that records what it was [`Served`] in
/// `order` once it holds the key, holds it for `hold`, and releases it.
fn spawn_fair_waiter(
    backend: Arc<dyn Backend>,
    key: &LockKey,
    index: usize,
    hold: Duration,
    order: &Arc<std::sync::Mutex<Vec<Served>>>,
) -> tokio::task::JoinHandle<()> {
    let (key, order) = (key.clone(), Arc::clone(order));
    tokio::spawn(async move {
        let lease = fair(30_000, Duration::from_secs(30))
            .acquire_on(backend, key)
            .await
            .expect("a fair waiter is served");
        order
            .lock()
            .expect("order")
            .push((index, lease.token(), Instant::now()));
        sleep(hold).await;
        lease.release().await.expect("release");
    })
}

/// Queues `owner` for `key` as a fair waiter does, at the backend's level:
/// it registers for its handoff first, then joins with an entry that lives
/// `entry_ttl`. The notice is returned: a waiter held this way never polls,
/// so it holds the key only if a release hands it over.
async fn queue_at_backend(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    owner: &OwnerId,
    entry_ttl: Duration,
) -> crate::backend::Handoff {
    let notice = backend
        .subscribe_handoff(key, owner)
        .await
        .expect("handoff notice");
    let queued = backend
        .try_acquire(
            &AcquireRequest::new(key, owner, Duration::from_secs(30))
                .with_queue(crate::backend::Queue::Join { entry_ttl }),
        )
        .await
        .expect("backend answers");
    assert!(
        matches!(queued, Attempt::Held { .. }),
        "a waiter joins the queue of a held key: {queued:?}"
    );
    notice
}

/// Waits until `counting` has seen `owners` distinct fair waiters queue.
async fn until_queued(counting: &[&CountingBackend], owners: usize, what: &str) {
    within(10, what, async {
        while counting.iter().map(|c| c.joined()).sum::<usize>() < owners {
            sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
}

/// Fair waiters that queued at distinct times, through two instances of
/// the store, are served in arrival order, each by a handoff with a token
/// above the one before; a fair caller that would not wait is refused at
/// once and takes no place in the queue.
pub async fn fair_waiters_are_served_in_arrival_order_with_rising_tokens(
    backend: Arc<dyn Backend>,
    another: Arc<dyn Backend>,
) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-order");
    let holder = fair(30_000, Duration::ZERO)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("a free key is taken by a fair caller at once");
    let (one, two) = (
        CountingBackend::new(backend.clone()),
        CountingBackend::new(another.clone()),
    );
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for index in 0..5 {
        let via: Arc<dyn Backend> = if index % 2 == 0 {
            one.clone()
        } else {
            two.clone()
        };
        waiters.push(spawn_fair_waiter(
            via,
            &key,
            index,
            Duration::from_millis(5),
            &order,
        ));
        until_queued(&[&one, &two], index + 1, "the waiter joins the queue").await;
        if index == 2 {
            let impatient = fair(30_000, Duration::ZERO)
                .acquire_on(backend.clone(), &key)
                .await;
            assert!(
                matches!(impatient, Err(LockError::Held { .. })),
                "a fair caller that would not wait is refused at once: {impatient:?}"
            );
        }
    }
    let first = holder.token();
    holder.release().await.expect("release");
    for waiter in waiters {
        within(20, "the queued waiters", waiter)
            .await
            .expect("waiter task");
    }
    let order = order.lock().expect("order").clone();
    let served: Vec<usize> = order.iter().map(|(index, _, _)| *index).collect();
    assert_eq!(served, vec![0, 1, 2, 3, 4], "served in arrival order");
    let mut previous = first;
    for (index, token, _) in order {
        assert!(
            token > previous,
            "waiter {index}'s token {token} is above the previous holder's {previous}"
        );
        previous = token;
    }
}

/// A fair waiter cancelled in the middle of the queue does not hold it up:
/// the one behind it is served right after the one ahead, well within the
/// life of a queue entry, and the cancelled one never holds the key.
pub async fn fair_a_cancelled_waiter_in_the_middle_does_not_hold_up_the_queue(
    backend: Arc<dyn Backend>,
) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-cancel");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let counting = CountingBackend::new(backend.clone());
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let ahead = spawn_fair_waiter(counting.clone(), &key, 0, Duration::ZERO, &order);
    until_queued(&[&counting], 1, "the first waiter joins").await;
    // The cancelled waiter's entry is written after this, and lives a
    // queue entry's life from its latest write: held up by it, the waiter
    // behind could not be served before this and that life.
    let cancelled_spawned = Instant::now();
    let cancelled = spawn_fair_waiter(counting.clone(), &key, 1, Duration::ZERO, &order);
    until_queued(&[&counting], 2, "the second waiter joins").await;
    let behind = spawn_fair_waiter(counting.clone(), &key, 2, Duration::ZERO, &order);
    until_queued(&[&counting], 3, "the third waiter joins").await;
    cancelled.abort();
    assert!(
        cancelled.await.expect_err("cancelled").is_cancelled(),
        "the middle waiter was cancelled while queued"
    );
    holder.release().await.expect("release");
    within(20, "the first waiter", ahead).await.expect("task");
    within(20, "the waiter behind the cancelled one", behind)
        .await
        .expect("task");
    let order = order.lock().expect("order").clone();
    let served: Vec<usize> = order.iter().map(|o| o.0).collect();
    assert_eq!(
        served,
        vec![0, 2],
        "the cancelled waiter never held the key"
    );
    // Until the waiter behind was granted, not until its task was joined.
    let waited = order[1].2.duration_since(cancelled_spawned);
    assert!(
        waited < crate::backend::QUEUE_ENTRY_TTL,
        "the waiter behind a cancelled one was served {waited:?} after the cancelled \
         one asked, past its entry's earliest expiry: the cancelled waiter's entry held \
         the queue up"
    );
}

/// An entry whose waiter vanished without a word (a frozen process: its
/// notice is still registered, but it never refreshes its entry) is skipped
/// once it expired: the release hands the key straight to the live waiter
/// behind it.
pub async fn fair_an_expired_entry_is_skipped_by_the_release(backend: Arc<dyn Backend>) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-expired");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let vanished = OwnerId::random().expect("owner");
    let entry_ttl = Duration::from_millis(300);
    // Kept registered to the end: the entry is skipped for its expiry, not
    // for a notice nobody listens to.
    let _vanished_notice = queue_at_backend(&backend, &key, &vanished, entry_ttl).await;
    let live = OwnerId::random().expect("owner");
    let live_notice = queue_at_backend(&backend, &key, &live, Duration::from_secs(30)).await;
    sleep(entry_ttl + Duration::from_millis(200)).await;
    let first = holder.token();
    holder.release().await.expect("release");
    let handed = within(
        10,
        "the handoff to the live waiter behind the expired entry",
        live_notice,
    )
    .await;
    assert!(
        handed.token > first,
        "a handed-over key's token {} is above its previous holder's {first}",
        handed.token
    );
    assert_eq!(
        release_as(&backend, &key, &vanished).await,
        crate::backend::ReleaseOutcome::NotOwner,
        "the vanished waiter never held the key"
    );
    assert_eq!(
        release_as(&backend, &key, &live).await,
        crate::backend::ReleaseOutcome::Released,
        "the live waiter held the handed-over key"
    );
}

/// A grant takes its owner out of the queue, whatever the attempt's mode:
/// a queued owner that takes the key with a plain attempt (its holder's
/// lease ran out, nobody was handed the key) is not handed the key again
/// by its own release, whatever it did with other keys meanwhile; the
/// waiter queued behind it is.
pub async fn fair_an_owner_granted_by_a_plain_attempt_leaves_the_queue(backend: Arc<dyn Backend>) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-plain-grant");
    let elsewhere = fresh_key("fair-plain-grant-elsewhere");
    let owner = || OwnerId::random().expect("owner");
    let (holder, first, second) = (owner(), owner(), owner());
    let held = attempt_as(&backend, &key, &holder, Duration::from_millis(300)).await;
    assert!(
        matches!(held, Attempt::Acquired(_)),
        "a free key is taken: {held:?}"
    );
    let _first_notice = queue_at_backend(&backend, &key, &first, Duration::from_secs(30)).await;
    let second_notice = queue_at_backend(&backend, &key, &second, Duration::from_secs(30)).await;
    // Meanwhile the first waiter's owner takes and lets go of another key,
    // and lets go of one it never held.
    let other = attempt_as(&backend, &elsewhere, &first, Duration::from_secs(30)).await;
    assert!(
        matches!(other, Attempt::Acquired(_)),
        "another free key is taken: {other:?}"
    );
    assert_eq!(
        release_as(&backend, &elsewhere, &first).await,
        crate::backend::ReleaseOutcome::Released,
        "the other key is let go"
    );
    let never = fresh_key("fair-plain-grant-never");
    assert_eq!(
        release_as(&backend, &never, &first).await,
        crate::backend::ReleaseOutcome::NotOwner,
        "a key never held is not released"
    );
    // The holder's lease runs out; the first waiter then takes the key with
    // a plain attempt (or, where the store hands it over by itself, holds
    // it already and the attempt is its retry).
    let taken = within(
        10,
        "the queued owner's plain attempt after the ttl",
        async {
            loop {
                if let Attempt::Acquired(grant) =
                    attempt_as(&backend, &key, &first, Duration::from_secs(30)).await
                {
                    return grant.token;
                }
                sleep(Duration::from_millis(20)).await;
            }
        },
    )
    .await;
    assert_eq!(
        release_as(&backend, &key, &first).await,
        crate::backend::ReleaseOutcome::Released,
        "the owner that took the key with a plain attempt releases it"
    );
    let handed = within(
        10,
        "the handoff to the waiter queued behind the owner granted by a plain attempt",
        second_notice,
    )
    .await;
    assert!(
        handed.token > taken,
        "the handed-over key's token {} is above the plain holder's {taken}",
        handed.token
    );
    assert_eq!(
        release_as(&backend, &key, &first).await,
        crate::backend::ReleaseOutcome::NotOwner,
        "the owner granted by a plain attempt was not handed the key again"
    );
    assert_eq!(
        release_as(&backend, &key, &second).await,
        crate::backend::ReleaseOutcome::Released,
        "the waiter behind it holds the key"
    );
}

/// A handoff to a waiter that never listens (it died after refreshing its
/// entry) is taken back by the time its entry would have expired: the
/// live waiter behind it gets the key soon after.
pub async fn fair_a_handoff_to_a_waiter_that_never_listens_comes_back_within_its_entry_ttl(
    backend: Arc<dyn Backend>,
) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-deaf");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let deaf = OwnerId::random().expect("owner");
    let entry_ttl = Duration::from_millis(800);
    let queued = backend
        .try_acquire(
            &AcquireRequest::new(&key, &deaf, Duration::from_secs(30))
                .with_queue(crate::backend::Queue::Join { entry_ttl }),
        )
        .await
        .expect("backend answers");
    assert!(matches!(queued, Attempt::Held { .. }), "{queued:?}");
    let counting = CountingBackend::new(backend.clone());
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let live = spawn_fair_waiter(counting.clone(), &key, 0, Duration::ZERO, &order);
    until_queued(&[&counting], 1, "the live waiter joins").await;
    let released_at = Instant::now();
    holder.release().await.expect("release");
    within(20, "the live waiter", live).await.expect("task");
    // Until the live waiter was granted, not until its task was joined.
    let waited = order.lock().expect("order")[0]
        .2
        .duration_since(released_at);
    // The entry's life, then the live waiter's next look (a third of a
    // queue entry's life at most), with as much again to spare.
    let bound = (entry_ttl + crate::backend::QUEUE_ENTRY_TTL / 3) * 2;
    assert!(
        waited < bound,
        "the live waiter waited {waited:?} (bound {bound:?}): a handoff to a waiter \
         that never listened kept the key"
    );
}

/// A handoff that reached a waiter as it gave up is passed on by the
/// release the giving-up waiter sends (rule F3): the next waiter holds the
/// key, with a token above both earlier holders'.
pub async fn fair_a_handoff_that_arrived_after_its_waiter_gave_up_is_passed_on(
    backend: Arc<dyn Backend>,
) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-late");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let late = OwnerId::random().expect("owner");
    // Entries that outlive any stall of the test: the release must find
    // both waiters live.
    let notice = queue_at_backend(&backend, &key, &late, Duration::from_secs(30)).await;
    let next = OwnerId::random().expect("owner");
    let next_notice = queue_at_backend(&backend, &key, &next, Duration::from_secs(30)).await;
    let first = holder.token();
    holder.release().await.expect("release");
    let handed = within(10, "the handoff to the first waiter", notice).await;
    assert!(
        handed.token > first,
        "a handed-over key's token {} is above its previous holder's {first}",
        handed.token
    );
    // The waiter gave up as the handoff arrived: its way out is a release,
    // which passes the key on.
    assert_eq!(
        release_as(&backend, &key, &late).await,
        crate::backend::ReleaseOutcome::Released,
        "the waiter that gave up held the handed-over key, and released it"
    );
    let passed = within(10, "the handoff passed on to the next waiter", next_notice).await;
    assert!(
        passed.token > handed.token,
        "{} is above {}",
        passed.token,
        handed.token
    );
    assert_eq!(
        release_as(&backend, &key, &next).await,
        crate::backend::ReleaseOutcome::Released,
        "the next waiter held the passed-on key"
    );
}

/// No fair waiter starves: 16 tasks loop on one key, and between asking
/// for the key and getting it, none waits more than about 16 turns of the
/// others (counted, not timed).
pub async fn fair_no_waiter_starves_among_sixteen_looping_tasks(backend: Arc<dyn Backend>) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    const TASKS: usize = 16;
    const ROUNDS: usize = 3;
    let key = fresh_key("fair-starve");
    let turns = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(TASKS));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (backend, key, turns, start) = (
                backend.clone(),
                key.clone(),
                Arc::clone(&turns),
                Arc::clone(&start),
            );
            tokio::spawn(async move {
                use std::sync::atomic::Ordering;
                start.wait().await;
                let mut longest = 0;
                for _ in 0..ROUNDS {
                    // Turns are counted from when the waiter is in the
                    // queue (its attempt that joined was answered), not
                    // from before the round trips that get it there.
                    let counting = CountingBackend::with_clock(backend.clone(), Arc::clone(&turns));
                    let asked = turns.load(Ordering::SeqCst);
                    let lease = fair(30_000, Duration::from_secs(60))
                        .acquire_on(counting.clone(), &key)
                        .await
                        .expect("every fair waiter is served");
                    let asked_at = counting.queued_at().unwrap_or(asked);
                    let turn = turns.fetch_add(1, Ordering::SeqCst);
                    longest = longest.max(turn - asked_at);
                    sleep(Duration::from_millis(3)).await;
                    lease.release().await.expect("release");
                }
                longest
            })
        })
        .collect();
    let mut longest = Vec::new();
    for task in tasks {
        longest.push(within(60, "the looping tasks", task).await.expect("task"));
    }
    let worst = longest.iter().copied().max().unwrap_or(0);
    assert!(
        worst <= TASKS + 2,
        "a task waited through {worst} turns of others (of {TASKS} tasks): {longest:?}"
    );
}

/// A handed-over lease is a lease like any other: it outlives several
/// ttls by renewal, and dropping it hands the key on to the next waiter.
pub async fn fair_a_handed_over_lease_renews_and_hands_on_when_dropped(backend: Arc<dyn Backend>) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-renew");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let counting = CountingBackend::new(backend.clone());
    let first = {
        let (counting, key) = (counting.clone(), key.clone());
        tokio::spawn(async move {
            fair(2_000, Duration::from_secs(20))
                .acquire_on(counting, key)
                .await
        })
    };
    until_queued(&[&counting], 1, "the waiter joins").await;
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let second = spawn_fair_waiter(counting.clone(), &key, 1, Duration::ZERO, &order);
    until_queued(&[&counting], 2, "the second waiter joins").await;
    holder.release().await.expect("release");
    let lease = within(20, "the handoff", first)
        .await
        .expect("task")
        .expect("the first waiter is handed the key");
    // A ttl of 2 s renewed every third of it survives a stall of ~1.3 s.
    sleep(Duration::from_millis(7_000)).await;
    lease
        .check()
        .expect("a handed-over lease is renewed past three ttls");
    let token = lease.token();
    drop(lease);
    within(20, "the second waiter", second).await.expect("task");
    let (_, next, _) = order.lock().expect("order")[0];
    assert!(next > token, "{next} is above {token}");
}

/// A handed-over lease taken without background renewal is kept by the
/// store for its whole ttl, not only for the short life a store may give a
/// handoff until its first renewal ([`crate::backend::Grant::valid_for`]).
pub async fn fair_a_handed_over_lease_without_renewal_is_kept_for_its_whole_ttl(
    backend: Arc<dyn Backend>,
) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    let key = fresh_key("fair-no-renew");
    let holder = take(&backend, &key, 30_000, Duration::ZERO, "free").await;
    let counting = CountingBackend::new(backend.clone());
    let ttl = crate::backend::QUEUE_ENTRY_TTL * 4;
    let waiter = {
        let (counting, key) = (counting.clone(), key.clone());
        tokio::spawn(async move {
            LockOptions::new(ttl)
                .renew(false)
                .wait(Duration::from_secs(20))
                .fair(true)
                .acquire_on(counting, key)
                .await
        })
    };
    until_queued(&[&counting], 1, "the waiter joins").await;
    holder.release().await.expect("release");
    let lease = within(20, "the handoff", waiter)
        .await
        .expect("task")
        .expect("the waiter is handed the key");
    let holding = backend
        .holder(&key)
        .await
        .expect("holder")
        .expect("the handed-over key is held");
    if let Some(left) = holding.expires_in {
        assert!(
            left > crate::backend::QUEUE_ENTRY_TTL * 2,
            "the store keeps a handed-over lease without renewal for its ttl {ttl:?}, \
             but it expires in {left:?}"
        );
    }
    lease.release().await.expect("release");
}

/// A handed-over lease whose ttl is shorter than the time since its
/// waiter's last attempt (the core counts a handoff's lease from that
/// attempt's send, up to a third of the queue entry's life back) is not
/// returned spent: its holder gets a live lease, not one lost at once
/// though nobody else could take the key.
///
/// A 600 ms lease is spent by a stall of this process as long as a third
/// of it (its renewal cannot run), and a waiter that looked again before
/// the release is handed a lease counted from that look: a run in which
/// either happened proves nothing either way, says so, and is run again
/// (at most eight runs; a failure in a run without them fails at once).
pub async fn fair_a_handed_over_lease_with_a_short_ttl_is_not_spent_on_arrival(
    backend: Arc<dyn Backend>,
) {
    if !keeps_fair_queues(&backend).await {
        return;
    }
    const RUNS: usize = 8;
    for run in 1..=RUNS {
        match short_ttl_handoff(&backend).await {
            Ok(()) => return,
            Err(void) if run < RUNS => eprintln!("short-ttl handoff, run {run} void: {void}"),
            Err(void) => panic!("short-ttl handoff: {RUNS} runs void, the last: {void}"),
        }
    }
}

/// One run of the short-ttl handoff: `Err` when it was void (see the
/// property), a panic when the lease was spent with no stall to explain it.
async fn short_ttl_handoff(backend: &Arc<dyn Backend>) -> Result<(), String> {
    let key = fresh_key("fair-short-ttl");
    let holder = take(backend, &key, 30_000, Duration::ZERO, "free").await;
    let counting = CountingBackend::new(backend.clone());
    let ttl = Duration::from_millis(600);
    let waiter = {
        let (counting, key) = (counting.clone(), key.clone());
        tokio::spawn(async move {
            LockOptions::new(ttl)
                .wait(Duration::from_secs(20))
                .fair(true)
                .acquire_on(counting, key)
                .await
        })
    };
    until_queued(&[&counting], 1, "the waiter joins").await;
    let looks = counting.attempts();
    let stalls = Stalls::watch();
    // Longer than the ttl, shorter than the waiter's next refresh (a third
    // of the entry's life after it joined).
    sleep(Duration::from_millis(800)).await;
    let looked_again = counting.attempts() > looks;
    holder.release().await.expect("release");
    let lease = within(20, "the handoff", waiter)
        .await
        .expect("task")
        .expect("the waiter is handed the key");
    let spent = if lease.is_lost() {
        Some("was lost when its caller got it".to_owned())
    } else {
        timeout(ttl / 3, lease.lost())
            .await
            .ok()
            .map(|lost| format!("was lost within a third of it: {lost}"))
    };
    let stalled = stalls.worst();
    let _ = lease.release().await;
    if looked_again {
        return Err("the waiter looked again before the release".into());
    }
    match spent {
        None => Ok(()),
        Some(spent) if stalled >= ttl / 3 => Err(format!(
            "the lease {spent}, and this process stalled {stalled:?}"
        )),
        Some(spent) => panic!(
            "a handed-over lease with a {ttl:?} ttl {spent} (the longest stall seen: {stalled:?})"
        ),
    }
}

/// The longest this runtime was late to wake a task napping 5 ms, from
/// [`Stalls::watch`] on: how long a lease's renewal could have been held
/// up meanwhile.
struct Stalls {
    worst: Arc<std::sync::Mutex<Duration>>,
    task: tokio::task::JoinHandle<()>,
}

impl Stalls {
    fn watch() -> Self {
        let worst = Arc::new(std::sync::Mutex::new(Duration::ZERO));
        let task = {
            let worst = Arc::clone(&worst);
            tokio::spawn(async move {
                let nap = Duration::from_millis(5);
                loop {
                    let before = Instant::now();
                    sleep(nap).await;
                    let late = before.elapsed().saturating_sub(nap);
                    let mut worst = worst.lock().unwrap_or_else(|e| e.into_inner());
                    *worst = (*worst).max(late);
                }
            })
        };
        Self { worst, task }
    }

    fn worst(&self) -> Duration {
        *self.worst.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Stalls {
    fn drop(&mut self) {
        self.task.abort();
    }
}

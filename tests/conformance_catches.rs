//! The conformance suite must refuse a backend that breaks a rule: each
//! test here wraps `MemoryBackend` with one rule broken and asserts that
//! `check_all` panics naming the property that guards that rule. A test
//! that fails here is a rule a broken backend can slip past, and with it
//! every user of that backend.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use dlock::memory::MemoryBackend;
use dlock::{Backend, LockError, LockKey};
use dlock_runtime::FencingToken;
use dlock_runtime::backend::{
    AcquireRequest, Attempt, ForceRelease, Grant, OwnerId, ReleaseNotice, ReleaseOutcome,
    ReleaseRequest, Renewal,
};
use dlock_runtime::conformance::Property;

/// The one rule a [`Wrong`] backend breaks.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Flaw {
    /// A same-owner retry answered `Held`.
    SameOwnerRetryHeld,
    /// `extend` by any owner renews whoever holds the key.
    ExtendAnyOwner,
    /// `extend_many` answers `Ok(true)` for every lease.
    ExtendManyAlwaysTrue,
    /// `extend_many` answers, for every lease, what the FIRST lease's extend
    /// answered (wrong per-lease answers in a batch).
    ExtendManyFirstAnswerForAll,
    /// `extend` of a lease that ended re-takes the key for the old owner
    /// instead of answering `Ok(false)` (resurrection).
    ExtendResurrects,
    /// `release` deletes whoever holds the key.
    ReleaseAnyOwner,
    /// Tokens come from a counter local to this backend instance (as a
    /// backend that keeps its counter in the process would): two instances
    /// (two processes) hand out the same tokens for one key.
    InstanceLocalTokens,
    /// `try_acquire` is not cancel safe at its SECOND await point: dropped
    /// after the store granted the key, it leaves an in-process marker
    /// that answers `Held` for ever.
    NotCancelSafeAfterGrant,
    /// The store keeps every lease (acquired or renewed) for half the ttl
    /// asked for: the key is free while the holder still believes.
    HalfTtl,
    /// A same-owner retry answers `Acquired` with the token but does not
    /// count the lease's lifetime anew (rule 3): the store frees the key at
    /// the FIRST attempt's expiry.
    RetryKeepsOldExpiry,
    /// `force_release` also loses the key's counter: the next token
    /// starts again from 1.
    ForceReleaseResetsTokens,
    /// `extend_many` renews every lease of a batch for the first lease's
    /// ttl.
    ExtendManyFirstTtl,
    /// `extend_many` renews only the first four leases of a batch, and
    /// answers `true` for every one.
    ExtendManyFirstFour,
    /// As `NotCancelSafeAfterGrant`, with await points that are 25 ms
    /// round trips to a server rather than yields.
    SlowGrantWedge,
    /// `force_release_holding` breaks whoever holds the key, not only the
    /// holder it names (a re-check and a blind break as two steps, with
    /// the holder changed before the re-check).
    ForceReleaseHoldingBreaksAnyHolder,
    /// `force_release_holding` reads the holder, compares its token, and
    /// breaks the key in a second step: a holder that let go and took
    /// the key again in between loses its next lease.
    ForceReleaseHoldingChecksThenBreaks,
}

/// One store shared by every instance (as one server is shared by many
/// processes).
fn shared_store() -> Arc<MemoryBackend> {
    static STORE: OnceLock<Arc<MemoryBackend>> = OnceLock::new();
    STORE.get_or_init(|| Arc::new(MemoryBackend::new())).clone()
}

/// The memory backend with one flaw; every instance shares one store.
struct Wrong {
    flaw: Flaw,
    inner: Arc<MemoryBackend>,
    holders: Mutex<HashMap<LockKey, OwnerId>>,
    local_tokens: AtomicU64,
    stuck: Mutex<HashMap<LockKey, ()>>,
    /// Per (key, owner) the local token handed out, so a same-owner retry
    /// gets the same one (InstanceLocalTokens).
    given: Mutex<HashMap<(LockKey, OwnerId), u64>>,
    /// Per (key, owner): token and store expiry of the first attempt.
    first: Mutex<HashMap<(LockKey, OwnerId), (FencingToken, std::time::Instant)>>,
    /// Keys broken by force, with the tokens counted again from 1 since
    /// (ForceReleaseResetsTokens).
    restarted: Mutex<HashMap<LockKey, u64>>,
}

impl Wrong {
    fn new(flaw: Flaw) -> Self {
        Self {
            flaw,
            inner: shared_store(),
            holders: Mutex::new(HashMap::new()),
            local_tokens: AtomicU64::new(0),
            stuck: Mutex::new(HashMap::new()),
            given: Mutex::new(HashMap::new()),
            first: Mutex::new(HashMap::new()),
            restarted: Mutex::new(HashMap::new()),
        }
    }
    fn holder(&self, key: &LockKey) -> Option<OwnerId> {
        self.holders.lock().unwrap().get(key).copied()
    }
}

#[async_trait]
impl Backend for Wrong {
    fn kind(&self) -> &'static str {
        "wrong"
    }

    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        let wedges = matches!(
            self.flaw,
            Flaw::NotCancelSafeAfterGrant | Flaw::SlowGrantWedge
        );
        if wedges {
            if self.stuck.lock().unwrap().contains_key(request.key) {
                return Ok(Attempt::Held { expires_in: None });
            }
            // First await point: harmless.
            self.await_point().await;
        }
        if self.flaw == Flaw::SameOwnerRetryHeld && self.holder(request.key) == Some(*request.owner)
        {
            return Ok(Attempt::Held { expires_in: None });
        }
        if self.flaw == Flaw::RetryKeepsOldExpiry {
            let known = self
                .first
                .lock()
                .unwrap()
                .get(&(request.key.clone(), *request.owner))
                .copied();
            if let Some((token, until)) = known
                && until > std::time::Instant::now()
            {
                return Ok(Attempt::Acquired(Grant::new(token)));
            }
        }
        let half;
        let request = if self.flaw == Flaw::HalfTtl {
            half = AcquireRequest::new(request.key, request.owner, request.ttl / 2);
            &half
        } else {
            request
        };
        let answer = self.inner.try_acquire(request).await?;
        let answer = match answer {
            Attempt::Acquired(grant) => {
                self.holders
                    .lock()
                    .unwrap()
                    .insert(request.key.clone(), *request.owner);
                self.first.lock().unwrap().insert(
                    (request.key.clone(), *request.owner),
                    (grant.token, std::time::Instant::now() + request.ttl),
                );
                if self.flaw == Flaw::InstanceLocalTokens {
                    let t = *self
                        .given
                        .lock()
                        .unwrap()
                        .entry((request.key.clone(), *request.owner))
                        .or_insert_with(|| self.local_tokens.fetch_add(1, Ordering::SeqCst) + 1);
                    Attempt::Acquired(Grant::new(FencingToken::new(t)))
                } else {
                    Attempt::Acquired(grant)
                }
            }
            other => other,
        };
        let answer = match answer {
            Attempt::Acquired(_) if self.flaw == Flaw::ForceReleaseResetsTokens => {
                match self.restarted.lock().unwrap().get_mut(request.key) {
                    Some(count) => {
                        *count += 1;
                        Attempt::Acquired(Grant::new(FencingToken::new(*count)))
                    }
                    None => answer,
                }
            }
            other => other,
        };
        if wedges {
            // Second await point: a marker set before it and cleared after.
            self.stuck.lock().unwrap().insert(request.key.clone(), ());
            self.await_point().await;
            self.stuck.lock().unwrap().remove(request.key);
        }
        Ok(answer)
    }

    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        match self.flaw {
            Flaw::ExtendAnyOwner => {
                let Some(holder) = self.holder(renewal.key) else {
                    return self.inner.extend(renewal).await;
                };
                self.inner
                    .extend(&Renewal::new(renewal.key, &holder, renewal.ttl))
                    .await
            }
            Flaw::ExtendResurrects => {
                if self.inner.extend(renewal).await? {
                    return Ok(true);
                }
                match self
                    .inner
                    .try_acquire(&AcquireRequest::new(
                        renewal.key,
                        renewal.owner,
                        renewal.ttl,
                    ))
                    .await?
                {
                    Attempt::Acquired(_) => Ok(true),
                    _ => Ok(false),
                }
            }
            Flaw::HalfTtl => {
                self.inner
                    .extend(&Renewal::new(renewal.key, renewal.owner, renewal.ttl / 2))
                    .await
            }
            _ => self.inner.extend(renewal).await,
        }
    }

    async fn extend_many(&self, renewals: &[Renewal<'_>]) -> Vec<Result<bool, LockError>> {
        match self.flaw {
            Flaw::ExtendManyAlwaysTrue => {
                for r in renewals {
                    let _ = self.inner.extend(r).await;
                }
                renewals.iter().map(|_| Ok(true)).collect()
            }
            Flaw::ExtendManyFirstTtl => {
                let Some(first) = renewals.first() else {
                    return Vec::new();
                };
                let mut answers = Vec::new();
                for r in renewals {
                    answers.push(
                        self.inner
                            .extend(&Renewal::new(r.key, r.owner, first.ttl))
                            .await,
                    );
                }
                answers
            }
            Flaw::ExtendManyFirstFour => {
                for r in renewals.iter().take(4) {
                    let _ = self.inner.extend(r).await;
                }
                renewals.iter().map(|_| Ok(true)).collect()
            }
            Flaw::ExtendManyFirstAnswerForAll => {
                let mut first = None;
                for r in renewals {
                    let a = self.inner.extend(r).await;
                    if first.is_none() {
                        first = Some(matches!(a, Ok(true)));
                    }
                }
                renewals
                    .iter()
                    .map(|_| Ok(first.unwrap_or(false)))
                    .collect()
            }
            _ => {
                let mut answers = Vec::new();
                for r in renewals {
                    answers.push(self.extend(r).await);
                }
                answers
            }
        }
    }

    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
        if self.flaw == Flaw::ReleaseAnyOwner
            && let Some(holder) = self.holder(lease.key)
        {
            return self
                .inner
                .release(&ReleaseRequest::new(lease.key, &holder))
                .await;
        }
        self.inner.release(lease).await
    }

    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        self.inner.subscribe(key).await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        if self.flaw == Flaw::ForceReleaseResetsTokens {
            self.restarted.lock().unwrap().insert(key.clone(), 0);
        }
        self.inner.force_release(key).await
    }

    async fn force_release_holding(
        &self,
        key: &LockKey,
        expected: &dlock::backend::Holding,
    ) -> Result<ForceRelease, LockError> {
        if self.flaw == Flaw::ForceReleaseHoldingBreaksAnyHolder {
            return Ok(if self.inner.force_release(key).await? {
                ForceRelease::Released
            } else {
                ForceRelease::NotHeld
            });
        }
        if self.flaw == Flaw::ForceReleaseHoldingChecksThenBreaks {
            let now = self.inner.holder(key).await?;
            let Some(now) = now else {
                return Ok(ForceRelease::NotHeld);
            };
            if now.token != expected.token {
                return Ok(ForceRelease::HolderChanged);
            }
            // The second round trip.
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            return Ok(if self.inner.force_release(key).await? {
                ForceRelease::Released
            } else {
                ForceRelease::NotHeld
            });
        }
        self.inner.force_release_holding(key, expected).await
    }

    async fn holder(&self, key: &LockKey) -> Result<Option<dlock::backend::Holding>, LockError> {
        self.inner.holder(key).await
    }

    async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        self.inner.watch_holder(key).await
    }
}

impl Wrong {
    /// An await point of `try_acquire`: a yield, or a server's round trip.
    async fn await_point(&self) {
        if self.flaw == Flaw::SlowGrantWedge {
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        } else {
            tokio::task::yield_now().await;
        }
    }
}

/// Runs the whole suite on a backend with `flaw` and returns the panic
/// message of `check_all` (which names every broken property), or fails
/// the test if the suite passed the backend.
async fn rejection_of(flaw: Flaw) -> String {
    let run = tokio::spawn(dlock_runtime::conformance::check_all(move || async move {
        Arc::new(Wrong::new(flaw)) as Arc<dyn Backend>
    }))
    .await;
    let Err(failed) = run else {
        panic!("the conformance suite passed a backend with {flaw:?}");
    };
    let panic = failed.into_panic();
    let message = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default();
    eprintln!("{flaw:?}: {message}");
    message
}

/// How often a property that missed its flaw within `check_all` runs
/// again alone. Some flaws show only in a window of time (a lease freed a
/// second early must be seen by a waiter within that second): on a loaded
/// machine a stalled task can miss the window. The flaw is then made to
/// hit by running the property again, a bounded number of times; a
/// property that never catches it still fails the test.
const RETRIES_OF_A_MISSED_PROPERTY: usize = 4;

/// Runs one property alone on backends with `flaw` (as many as it takes);
/// true if it panicked: it caught the flaw.
async fn caught_alone<Takes, P: Property<Takes>>(flaw: Flaw, property: P) -> bool {
    let backends = (0..P::BACKENDS)
        .map(|_| Arc::new(Wrong::new(flaw)) as Arc<dyn Backend>)
        .collect();
    tokio::spawn(property.run(backends)).await.is_err()
}

/// One test: the suite refuses a backend with `$flaw`, naming `$property`
/// (at once, or in a bounded number of runs of that property alone when
/// the whole suite's run missed a flaw that shows only in a window of
/// time).
macro_rules! rejects {
    ($test:ident, $flaw:expr, $property:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $test() {
            let message = rejection_of($flaw).await;
            if message.contains(stringify!($property)) {
                return;
            }
            for retry in 1..=RETRIES_OF_A_MISSED_PROPERTY {
                eprintln!(
                    "{:?}: `{}` missed it in the whole suite's run; running it alone, try {retry}",
                    $flaw,
                    stringify!($property)
                );
                if caught_alone($flaw, dlock_runtime::conformance::$property).await {
                    return;
                }
            }
            panic!(
                "{:?} must break `{}`, which missed it in the whole suite and in {} runs alone; \
                 the suite said: {message}",
                $flaw,
                stringify!($property),
                RETRIES_OF_A_MISSED_PROPERTY
            );
        }
    };
}

// Rules the suite has always held backends to.
rejects!(
    the_suite_rejects_a_backend_that_answers_the_holding_owner_s_retry_held,
    Flaw::SameOwnerRetryHeld,
    a_retry_by_the_owner_that_holds_the_key_counts_as_acquired
);
rejects!(
    the_suite_rejects_a_backend_whose_extend_renews_for_any_owner,
    Flaw::ExtendAnyOwner,
    extend_by_non_owner_fails_and_changes_nothing
);
rejects!(
    the_suite_rejects_a_backend_whose_extend_many_always_answers_true,
    Flaw::ExtendManyAlwaysTrue,
    lost_signal_fires_when_the_lease_is_taken_away
);
rejects!(
    the_suite_rejects_a_backend_whose_release_frees_any_owner_s_key,
    Flaw::ReleaseAnyOwner,
    release_by_non_owner_fails_and_changes_nothing
);
rejects!(
    the_suite_rejects_a_backend_that_keeps_leases_for_half_their_ttl,
    Flaw::HalfTtl,
    expiry_frees_the_key
);

// Rules a broken backend could slip past before.
rejects!(
    the_suite_rejects_a_backend_whose_extend_many_answers_every_lease_alike,
    Flaw::ExtendManyFirstAnswerForAll,
    extend_many_answers_each_lease_on_its_own
);
rejects!(
    the_suite_rejects_a_backend_whose_extend_takes_back_an_ended_lease,
    Flaw::ExtendResurrects,
    extend_of_an_ended_lease_is_refused_and_takes_nothing
);
rejects!(
    the_suite_rejects_a_backend_whose_tokens_rise_only_within_one_instance,
    Flaw::InstanceLocalTokens,
    tokens_strictly_increase_across_keys_and_backend_instances
);
rejects!(
    the_suite_rejects_a_backend_whose_owner_retry_keeps_the_first_expiry,
    Flaw::RetryKeepsOldExpiry,
    a_retry_by_the_owner_restarts_the_lease_with_its_ttl
);
rejects!(
    the_suite_rejects_a_backend_whose_try_acquire_dropped_after_the_grant_blocks_the_key,
    Flaw::NotCancelSafeAfterGrant,
    a_try_acquire_dropped_half_way_leaves_nothing_stuck
);
rejects!(
    the_suite_rejects_a_backend_whose_named_force_release_breaks_a_later_holder,
    Flaw::ForceReleaseHoldingBreaksAnyHolder,
    a_force_release_naming_a_holder_that_changed_breaks_nothing
);
rejects!(
    the_suite_rejects_a_backend_whose_named_force_release_checks_then_breaks,
    Flaw::ForceReleaseHoldingChecksThenBreaks,
    a_force_release_racing_its_holder_breaks_only_the_lease_it_names
);
rejects!(
    the_suite_rejects_a_backend_whose_force_release_restarts_the_tokens,
    Flaw::ForceReleaseResetsTokens,
    tokens_keep_rising_after_a_force_release
);
rejects!(
    the_suite_rejects_a_backend_whose_extend_many_uses_the_first_lease_s_ttl_for_all,
    Flaw::ExtendManyFirstTtl,
    extend_many_renews_each_lease_for_its_own_ttl_in_a_long_batch
);
rejects!(
    the_suite_rejects_a_backend_whose_extend_many_renews_only_the_first_leases,
    Flaw::ExtendManyFirstFour,
    extend_many_renews_each_lease_for_its_own_ttl_in_a_long_batch
);
rejects!(
    the_suite_rejects_a_backend_that_wedges_a_key_when_dropped_after_a_slow_grant,
    Flaw::SlowGrantWedge,
    a_try_acquire_dropped_half_way_leaves_nothing_stuck
);

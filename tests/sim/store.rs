//! The simulated store as one process sees it: the schedule's shared
//! `MemoryBackend` behind a fault layer. Each call may be held back, lost
//! before the store applied it, lost after (the caller hears nothing of
//! what was done), or answered with an error, all drawn from the
//! schedule's one random source; a frozen process's calls stop until it
//! thaws. What the store applied is recorded for the checks.
//!
//! A release whose reply is lost is answered as a real store's client
//! answers it (the Redis backend): it asks once more, and a retry that
//! finds the key not held says `Unconfirmed`, so the core's judgement of
//! such a release is exercised.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock::backend::{
    Access, AcquireRequest, Attempt, Backend, ForceRelease, Handoff, Holding, OwnerId,
    ReleaseNotice, ReleaseOutcome, ReleaseRequest, Renewal,
};
use dlock::error::Operation;
use dlock::memory::MemoryBackend;
use dlock::{LockError, LockKey};
use tokio::sync::oneshot;

use crate::world::{Side, World};

/// How long a call is held back at most, when it is: longer than the
/// core's own patience (half a second per call of a waiting caller) and
/// than a short ttl, so that cut-off calls and spent leases happen.
const LONGEST_DELAY_MS: u64 = 1500;

/// What befalls one call.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// The request never reached the store.
    LostBefore,
    /// The store applied it; the reply never came back.
    LostAfter,
    /// The store refused it with an error.
    Error,
}

struct Call {
    fault: Fault,
    reply_delay: Duration,
}

/// One process's view of the schedule's store.
pub struct FaultyStore {
    world: Arc<World>,
    process: usize,
}

impl FaultyStore {
    pub fn new(world: Arc<World>, process: usize) -> Self {
        Self { world, process }
    }

    fn error(&self, operation: Operation, key: &str, what: &str) -> LockError {
        LockError::backend("sim", operation, key, format!("simulated: {what}"))
    }

    /// The way to the store: refused off the schedule's thread, stopped
    /// while frozen, maybe held back, lost or refused. The store to apply
    /// the call to is read once the request arrives (it may have lost its
    /// data meanwhile).
    async fn send(
        &self,
        operation: Operation,
        key: &str,
    ) -> Result<(MemoryBackend, Call), LockError> {
        if !self.world.on_sim_thread() {
            // dlock's fallback thread runs on real time: answering it from
            // the simulated store would mix clocks and spoil determinism.
            // It gets what an unreachable store gives, and the ttl frees
            // whatever it meant to release.
            self.world.state().off_thread += 1;
            return Err(self.error(
                operation,
                key,
                "the store cannot be reached from this thread",
            ));
        }
        self.world.thawed(self.process).await;
        let (fault, request_delay, reply_delay) = {
            let mut state = self.world.state();
            state.store_calls += 1;
            let plan = state.plan.clone();
            let rng = &mut state.rng;
            let fault = if rng.chance(plan.lost_before) {
                Fault::LostBefore
            } else if rng.chance(plan.lost_after) {
                Fault::LostAfter
            } else if rng.chance(plan.error) {
                Fault::Error
            } else {
                Fault::None
            };
            let delayed = rng.chance(plan.delay);
            let delay = if delayed {
                rng.millis(1, LONGEST_DELAY_MS)
            } else {
                rng.millis(0, 1)
            };
            let (request, reply) = if rng.chance(500) {
                (delay, Duration::ZERO)
            } else {
                (Duration::ZERO, delay)
            };
            if fault != Fault::None || delayed {
                state.processes[self.process].faults += 1;
            }
            (fault, request, reply)
        };
        if fault != Fault::None || request_delay + reply_delay > Duration::from_millis(1) {
            self.world.count(match (fault, operation) {
                (Fault::LostBefore, _) => "lost before applied",
                (Fault::LostAfter, Operation::Release) => "release reply lost after applied",
                (Fault::LostAfter, _) => "lost after applied",
                (Fault::Error, _) => "error",
                (Fault::None, _) => "held back",
            });
        }
        {
            let what = match fault {
                Fault::None => "",
                Fault::LostBefore => " lost before",
                Fault::LostAfter => " lost after",
                Fault::Error => " error",
            };
            self.world.log(format_args!(
                "p{} {operation:?} {key}{what} delay {}+{}ms",
                self.process,
                request_delay.as_millis(),
                reply_delay.as_millis()
            ));
        }
        if !request_delay.is_zero() {
            tokio::time::sleep(request_delay).await;
            self.world.thawed(self.process).await;
        }
        match fault {
            Fault::LostBefore => return Err(self.error(operation, key, "request lost")),
            Fault::Error => return Err(self.error(operation, key, "store error")),
            Fault::None | Fault::LostAfter => {}
        }
        let store = self.world.state().store.clone();
        Ok((store, Call { fault, reply_delay }))
    }

    /// The way back: maybe held back, stopped while frozen, maybe lost.
    async fn reply<T>(
        &self,
        call: &Call,
        operation: Operation,
        key: &str,
        answer: T,
    ) -> Result<T, LockError> {
        if !call.reply_delay.is_zero() {
            tokio::time::sleep(call.reply_delay).await;
        }
        self.world.thawed(self.process).await;
        if call.fault == Fault::LostAfter {
            return Err(self.error(operation, key, "reply lost"));
        }
        Ok(answer)
    }

    /// Traces a store call's answer and records what the store did.
    fn applied_attempt(&self, request: &AcquireRequest<'_>, answer: &Result<Attempt, LockError>) {
        let key = request.key.as_str();
        let side = Side::of(request.access);
        self.world
            .state()
            .asked_ttl
            .insert(*request.owner, request.ttl);
        let said = match answer {
            Ok(Attempt::Acquired(grant)) => {
                self.world.granted(
                    self.process,
                    key,
                    request.owner,
                    grant.token,
                    side,
                    request.ttl,
                );
                let mut state = self.world.state();
                format!(
                    "Acquired({}{})",
                    state.trace.token(grant.token),
                    slot(grant.slot)
                )
            }
            Ok(Attempt::Held { expires_in }) => {
                format!("Held({:?})", expires_in.map(|d| d.as_millis()))
            }
            Ok(other) => format!("{other:?}"),
            Err(err) => format!("Err({err})"),
        };
        if let Ok(Attempt::Acquired(_)) = answer {
            self.world.notify(key);
        }
        let owner = self.world.state().trace.owner(request.owner);
        self.world.log(format_args!(
            "p{} try_acquire {key} {owner} {side:?} {:?} ttl={}ms -> {said}",
            self.process,
            request.queue,
            request.ttl.as_millis()
        ));
    }

    fn applied_extend(&self, renewal: &Renewal<'_>, answer: &Result<bool, LockError>) {
        if let Ok(true) = answer {
            self.world.extended(renewal.owner, renewal.ttl);
        }
        let owner = self.world.state().trace.owner(renewal.owner);
        self.world.log(format_args!(
            "p{} extend {} {owner} ttl={}ms -> {:?}",
            self.process,
            renewal.key,
            renewal.ttl.as_millis(),
            answer.as_ref().ok()
        ));
    }

    fn applied_release(
        &self,
        lease: &ReleaseRequest<'_>,
        answer: &Result<ReleaseOutcome, LockError>,
        label: &str,
    ) {
        if let Ok(ReleaseOutcome::Released) = answer {
            self.world.released(lease.owner);
        }
        self.world.notify(lease.key.as_str());
        let owner = self.world.state().trace.owner(lease.owner);
        self.world.log(format_args!(
            "p{} {label} {} {owner} -> {:?}",
            self.process,
            lease.key,
            answer.as_ref().ok()
        ));
    }
}

fn slot(slot: Option<u32>) -> String {
    slot.map_or(String::new(), |slot| format!(" slot {slot}"))
}

#[async_trait]
impl Backend for FaultyStore {
    fn kind(&self) -> &'static str {
        "sim"
    }

    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        let key = request.key.as_str();
        let (store, call) = self.send(Operation::Acquire, key).await?;
        let answer = store.try_acquire(request).await;
        self.applied_attempt(request, &answer);
        self.reply(&call, Operation::Acquire, key, answer).await?
    }

    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        let key = renewal.key.as_str();
        let (store, call) = self.send(Operation::Extend, key).await?;
        let answer = store.extend(renewal).await;
        self.applied_extend(renewal, &answer);
        self.reply(&call, Operation::Extend, key, answer).await?
    }

    /// One call for the batch, as a pipeline is: one fault for all.
    async fn extend_many(&self, renewals: &[Renewal<'_>]) -> Vec<Result<bool, LockError>> {
        let key = renewals.first().map_or("", |r| r.key.as_str());
        let failed = |err: &LockError| {
            renewals
                .iter()
                .map(|_| Err(self.error(Operation::Extend, key, &err.to_string())))
                .collect()
        };
        let (store, call) = match self.send(Operation::Extend, key).await {
            Ok(sent) => sent,
            Err(err) => return failed(&err),
        };
        let answers = store.extend_many(renewals).await;
        for (renewal, answer) in renewals.iter().zip(&answers) {
            self.applied_extend(renewal, answer);
        }
        match self.reply(&call, Operation::Extend, key, answers).await {
            Ok(answers) => answers,
            Err(err) => failed(&err),
        }
    }

    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
        let key = lease.key.as_str();
        let (store, call) = self.send(Operation::Release, key).await?;
        let answer = store.release(lease).await;
        self.applied_release(lease, &answer, "release");
        if call.fault != Fault::LostAfter {
            return self.reply(&call, Operation::Release, key, answer).await?;
        }
        // The reply was lost: ask once more, as a real client does.
        let store = self.world.state().store.clone();
        let again = store.release(lease).await;
        self.applied_release(lease, &again, "release (asked again)");
        let answer = match again {
            Ok(ReleaseOutcome::NotOwner) => {
                self.world.count("release answered Unconfirmed");
                Ok(ReleaseOutcome::Unconfirmed)
            }
            other => other,
        };
        let call = Call {
            fault: Fault::None,
            ..call
        };
        self.reply(&call, Operation::Release, key, answer).await?
    }

    /// The store's own notices are not used: tokio's `watch` wakes its
    /// receivers in a random order (it spreads them over several
    /// `Notify`s, picked at random), which no seed controls. These wake
    /// in the order they were subscribed, on every release the store was
    /// asked for (whatever it answered: a spare wake-up is a hint, a
    /// missing one would be a bug) and on a loss of its data.
    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        let (_, call) = self.send(Operation::Wait, key.as_str()).await?;
        let notice = self.world.notice(key.as_str());
        let notice = ReleaseNotice::new(async move {
            let _ = notice.await;
        });
        self.reply(&call, Operation::Wait, key.as_str(), notice)
            .await
    }

    fn supports_fair(&self) -> bool {
        true
    }

    fn supports_access(&self, access: Access) -> bool {
        self.world.state().store.supports_access(access)
    }

    fn queued_here(&self, key: &LockKey) -> bool {
        self.world.state().store.queued_here(key)
    }

    /// The store's handoff notice, forwarded by a task of the
    /// simulator's that records the grant the moment the store makes it
    /// (the waiter may be busy with a slow call then, and read its notice
    /// later), and held back while the process is frozen. The task lets
    /// go of the store's notice once the waiter drops its own, so the
    /// store still sees a waiter that has gone.
    async fn subscribe_handoff(
        &self,
        key: &LockKey,
        owner: &OwnerId,
    ) -> Result<Handoff, LockError> {
        let (store, call) = self.send(Operation::Wait, key.as_str()).await?;
        let inner = store.subscribe_handoff(key, owner).await?;
        let (world, process, key_name, owner) = (
            Arc::clone(&self.world),
            self.process,
            key.to_string(),
            *owner,
        );
        let (forward, forwarded) = oneshot::channel();
        tokio::spawn(async move {
            let mut forward = forward;
            // Biased: an unbiased `select!` draws from tokio's random source.
            let grant = tokio::select! {
                biased;
                () = forward.closed() => return,
                grant = inner => grant,
            };
            let ttl = world
                .state()
                .asked_ttl
                .get(&owner)
                .copied()
                .unwrap_or_default();
            world.granted(
                process,
                &key_name,
                &owner,
                grant.token,
                Side::Exclusive,
                ttl,
            );
            world.count(if ttl < Duration::from_secs(1) {
                "handoff of a ttl under 1 s"
            } else {
                "handoff"
            });
            let (name, token) = {
                let mut state = world.state();
                (state.trace.owner(&owner), state.trace.token(grant.token))
            };
            world.log(format_args!(
                "p{process} handoff {key_name} {name} -> {token}"
            ));
            let _ = forward.send(grant);
        });
        let world = Arc::clone(&self.world);
        let process = self.process;
        let handoff = Handoff::new(async move {
            match forwarded.await {
                Ok(grant) => {
                    world.thawed(process).await;
                    grant
                }
                Err(_) => std::future::pending().await,
            }
        });
        self.reply(&call, Operation::Wait, key.as_str(), handoff)
            .await
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let store = self.world.state().store.clone();
        store.force_release(key).await
    }

    async fn force_release_holding(
        &self,
        key: &LockKey,
        expected: &Holding,
    ) -> Result<ForceRelease, LockError> {
        let store = self.world.state().store.clone();
        store.force_release_holding(key, expected).await
    }

    async fn holder(&self, key: &LockKey) -> Result<Option<Holding>, LockError> {
        let (store, call) = self.send(Operation::Acquire, key.as_str()).await?;
        let holding = store.holder(key).await;
        self.reply(&call, Operation::Acquire, key.as_str(), holding)
            .await?
    }

    /// As `subscribe`, also woken by every grant.
    async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        self.subscribe(key).await
    }

    async fn held(&self, prefix: &str) -> Result<Vec<(String, Holding)>, LockError> {
        let store = self.world.state().store.clone();
        store.held(prefix).await
    }
}

//! The [`crate::Backend`] implementation: the in-process exclusion
//! in front of the server, renewal as one check per session, release,
//! waiting and the administrator's force release.

use std::collections::HashMap;
use std::sync::Arc;

use super::connection::{Failure, no_runtime};
use super::home::NoRuntime;
use super::session::LockSession;
use super::{
    Entry, Inner, KIND, PgBackend, State, TERMINATE_WAIT_MS, UNWATCHED_RECHECK,
    refuse_own_lock_name, sql,
};
use crate::backend::kit::after;
use crate::backend::kit::detach::AbandonedWith;
use crate::backend::{
    Access, AcquireRequest, Attempt, Backend, ForceRelease, Grant, Handoff, OwnerId,
    QUEUE_ENTRY_TTL, Queue, ReleaseNotice, ReleaseOutcome, ReleaseRequest, Renewal,
};
use crate::error::{LockError, Operation};
use crate::key::LockKey;
use async_trait::async_trait;
use tokio::sync::watch;
use tokio::time::Instant;

/// The session `owner`'s live lease on `key` is held on, if there is one.
pub(super) fn live_session(
    keys: &HashMap<LockKey, Entry>,
    key: &LockKey,
    owner: &OwnerId,
) -> Option<Arc<LockSession>> {
    keys.get(key)
        .filter(|entry| entry.owner == *owner)
        .and_then(Entry::holding)
        .filter(|h| h.deadline() > Instant::now())
        .map(|h| Arc::clone(&h.session))
}

/// What the check of a lock session said, for `extend_many`.
enum Check {
    /// It answered: its leases are renewed.
    Live,
    /// It is gone: its leases are lost.
    Ended,
    /// It could not tell: the failure as text, and as the error itself for
    /// the first lease it fails (the others get its text).
    Failed(String, Option<Failure>),
}

#[async_trait]
impl Backend for PgBackend {
    fn kind(&self) -> &'static str {
        KIND
    }

    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        refuse_own_lock_name(request.key)?;
        if request.access != Access::Exclusive {
            return self.inner.try_mode(request).await;
        }
        // A fair waiter waits in the server's queue of the key, on a
        // session of its own (see `fair`). `Respect` is the plain attempt,
        // which the server refuses while anyone is queued, after a look at
        // this process's own waiters (one may be on its way to the queue),
        // unless it is a retry by the owner that holds the key (rule 3).
        match request.queue {
            Queue::Join { entry_ttl } => return self.inner.join(request, entry_ttl).await,
            Queue::Respect
                if self.inner.fair_waiter_queued(request.key)
                    && !self.inner.holds(request.key, request.owner) =>
            {
                return Ok(Attempt::Held { expires_in: None });
            }
            _ => {}
        }
        let (key, owner, ttl, waits) = (request.key, request.owner, request.ttl, request.waits);
        let mut refused_here = false;
        {
            // In-process exclusion first: never ask the server for a key
            // this process holds or is taking (re-entrancy would say yes).
            let mut keys = self.inner.keys();
            if let Some(entry) = keys.get_mut(key) {
                let now = Instant::now();
                // A retry by the owner that holds it (its first answer was
                // lost): it has the key, with its token, for a ttl from now.
                if entry.owner == *owner
                    && let State::Held(holding) = &mut entry.state
                    && holding.deadline() > now
                {
                    holding.deadline_slot = self.inner.deadlines.moved(
                        holding.deadline_slot,
                        key,
                        *owner,
                        after(now, ttl),
                    );
                    return Ok(Attempt::Acquired(
                        Grant::new(holding.token).lost_with(holding.session.loss_group()),
                    ));
                }
                return Ok(Attempt::Held {
                    expires_in: entry
                        .holding()
                        .map(|h| h.deadline().saturating_duration_since(now)),
                });
            }
            if !self.inner.modes.busy(key) {
                keys.insert(key.clone(), Entry::new(*owner));
            } else {
                refused_here = true;
            }
        }
        if refused_here {
            // Readers or permits of this process hold it (the server would
            // let this writer through one of their sessions): refused here,
            // leaving the writer's mark against new readers if it waits
            // (rule M3: one that does not wait sends no release to take
            // the mark away).
            if request.waits {
                self.inner.mark_writer(key, *owner).await;
            }
            return Ok(Attempt::Held {
                expires_in: Some(QUEUE_ENTRY_TTL / 3),
            });
        }
        // If the caller is cancelled after the server granted the lock, the
        // rest runs on in a task of its own, which gives the lock back
        // instead of leaking it.
        let give_back = GiveBack {
            inner: Arc::clone(&self.inner),
            key: key.clone(),
            owner: *owner,
        };
        let owner = *owner;
        let identity = request.identity.map(Arc::<str>::from);
        let holder = request.holder_record(self.inner.options.label.as_deref());
        let attempt = {
            let (inner, key) = (Arc::clone(&self.inner), key.clone());
            async move {
                inner
                    .acquire_on_server(&key, owner, ttl, identity, holder)
                    .await
            }
        };
        let outcome = match self.inner.home.run_detachable(attempt, give_back).await {
            Ok(outcome) => outcome,
            Err(NoRuntime) => {
                self.inner.forget(key, owner);
                return Err(no_runtime(Operation::Acquire, key));
            }
        };
        match outcome {
            // Rule M3: refused by readers elsewhere, a writer that waits
            // leaves its mark and looks again before it runs out.
            Ok(Attempt::Held { expires_in })
                if waits && self.inner.mark_writer(key, owner).await =>
            {
                let again = QUEUE_ENTRY_TTL / 3;
                Ok(Attempt::Held {
                    expires_in: Some(expires_in.map_or(again, |e| e.min(again))),
                })
            }
            Ok(Attempt::Acquired(grant)) => {
                // Taking the key clears the owner's mark.
                self.inner.unmark_writer(key, owner).await;
                Ok(Attempt::Acquired(grant))
            }
            other => other,
        }
    }

    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        self.extend_many(std::slice::from_ref(renewal))
            .await
            .pop()
            .unwrap_or(Ok(false))
    }

    /// A lock lives exactly as long as its session, so one round trip on a
    /// session proves every lease on it: the batch costs one check per
    /// session, however many leases it renews. On a session where the batch
    /// renewed a lease taken with an identity, the check is followed by a
    /// statement that makes sure the identity records are there (see
    /// `Inner::rewrite_records_later`), which no renewal waits for.
    async fn extend_many(&self, leases: &[Renewal<'_>]) -> Vec<Result<bool, LockError>> {
        let held_on: Vec<Option<Arc<LockSession>>> = {
            let keys = self.inner.keys();
            leases
                .iter()
                .map(|lease| match lease.access {
                    Access::Exclusive => live_session(&keys, lease.key, lease.owner),
                    _ => self.inner.modes.live_session(lease.key, lease.owner),
                })
                .collect()
        };
        // Per session, what its check said.
        let mut checked: Vec<(u64, Check)> = Vec::new();
        for session in held_on.iter().flatten() {
            if checked.iter().any(|(id, _)| *id == session.id) {
                continue;
            }
            let check = match session.check_connection().await {
                Ok(()) => {
                    let recorded = leases
                        .iter()
                        .zip(&held_on)
                        .filter(|(lease, on)| {
                            lease.recorded.is_some()
                                && on.as_ref().is_some_and(|on| on.id == session.id)
                        })
                        .map(|(lease, _)| (lease.key.clone(), *lease.owner))
                        .collect();
                    self.inner.rewrite_records_later(session, recorded);
                    Check::Live
                }
                // The connection is gone, and the session's locks with it
                // as far as this process can ever use them (the server
                // drops them as the connection ends): its leases are lost,
                // not in doubt. Ended here too, in case the connection's
                // own end has not been seen yet.
                Err(err) if sql::session_gone(&err) => {
                    session.end(format!("the lock session ended: {err}"));
                    Check::Ended
                }
                Err(err) => {
                    let failure = Failure::new("lock session check failed", err);
                    Check::Failed(failure.to_string(), Some(failure))
                }
            };
            checked.push((session.id, check));
        }
        let mut keys = self.inner.keys();
        let now = Instant::now();
        leases
            .iter()
            .zip(held_on)
            .map(|(lease, session)| {
                let Some(session) = session else {
                    return Ok(false);
                };
                match checked.iter_mut().find(|(id, _)| *id == session.id) {
                    Some((_, Check::Live)) => {}
                    Some((_, Check::Ended)) | None => return Ok(false),
                    Some((_, Check::Failed(text, failure))) => {
                        let failure = failure.take().unwrap_or_else(|| Failure::msg(text.clone()));
                        return Err(LockError::backend(
                            KIND,
                            Operation::Extend,
                            lease.key.as_str(),
                            failure,
                        ));
                    }
                }
                if lease.access != Access::Exclusive {
                    return Ok(self.inner.extend_mode(
                        lease.key,
                        lease.owner,
                        session.id,
                        after(now, lease.ttl),
                    ));
                }
                match live_session(&keys, lease.key, lease.owner) {
                    Some(now_on) if now_on.id == session.id => {
                        if let Some(State::Held(holding)) =
                            keys.get_mut(lease.key).map(|e| &mut e.state)
                        {
                            holding.deadline_slot = self.inner.deadlines.moved(
                                holding.deadline_slot,
                                lease.key,
                                *lease.owner,
                                after(now, lease.ttl),
                            );
                        }
                        Ok(true)
                    }
                    _ => Ok(false),
                }
            })
            .collect()
    }

    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
        let (key, owner) = (lease.key, lease.owner);
        // Rule F3: a fair waiter that gives up leaves the queue. A handoff
        // that reached it first is its lease by now, released below.
        if lease.access != Access::Exclusive {
            // Its own side (rule M4): the owner's read hold, or its slot,
            // whichever it is (a slot not known yet included).
            let released = self.inner.unlock(key, Some(*owner), false).await?;
            return Ok(ReleaseOutcome::from_released(released));
        }
        self.inner.leave_queue(key, owner).await;
        let released = self.inner.unlock(key, Some(*owner), false).await?;
        if !released {
            // A writer that gave up takes its mark with it (rule M3).
            self.inner.unmark_writer(key, *owner).await;
        }
        Ok(ReleaseOutcome::from_released(released))
    }

    fn supports_access(&self, access: Access) -> bool {
        matches!(
            access,
            Access::Exclusive | Access::Shared | Access::Permits { .. }
        )
    }

    fn supports_fair(&self) -> bool {
        true
    }

    async fn subscribe_handoff(
        &self,
        key: &LockKey,
        owner: &OwnerId,
    ) -> Result<Handoff, LockError> {
        Ok(self.inner.subscribe_handoff(key, owner))
    }

    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        if let Some(entry) = self.inner.keys().get_mut(key) {
            // Held (or being taken) here: its entry going away is the signal.
            let mut gone = entry
                .gone
                .get_or_insert_with(|| watch::channel(()).0)
                .subscribe();
            return Ok(ReleaseNotice::new(async move {
                let _ = gone.changed().await;
            }));
        }
        if let Some(notice) = self.inner.modes.subscribe(key) {
            return Ok(notice);
        }
        Ok(self.inner.waits.watch(key).unwrap_or_else(|| {
            ReleaseNotice::new(std::future::pending()).recheck_within(UNWATCHED_RECHECK)
        }))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        // Held here: unlock it on our own session, so our other leases live on.
        if self.inner.unlock(key, None, false).await? {
            return Ok(true);
        }
        // Held elsewhere: only the holding session can drop an advisory
        // lock, so end that session.
        let session = self.inner.session().await?;
        let rows = session
            .query(
                &self.inner.terminate_sql,
                &[&key.as_str(), &self.inner.options.key_seed, &TERMINATE_WAIT_MS],
            )
            .await
            .map_err(|e| {
                self.inner.failed(
                    Operation::Release,
                    key,
                    "cannot end the session holding it (needs pg_signal_backend or the holder's role)",
                    e,
                )
            })?;
        for row in &rows {
            let pid: Option<i32> = row.try_get(0).ok();
            let gone: bool = row.try_get(1).unwrap_or(false);
            tracing::warn!(key = %key, pid, gone, "force release: ended the PostgreSQL session holding the key");
        }
        Ok(!rows.is_empty())
    }

    /// A lease of this process is compared in process and unlocked
    /// owner-checked on its own session, so its other leases live on. A
    /// lease of another process: its session is ended only if it holds the
    /// key for the lease named, read and ended under the key's release
    /// gate (`Inner::terminate_named`).
    async fn force_release_holding(
        &self,
        key: &LockKey,
        expected: &crate::backend::Holding,
    ) -> Result<ForceRelease, LockError> {
        let named = crate::backend::named_token(KIND, key, expected)?;
        // Taken, held or let go here: this process decides, and never ends
        // its own session.
        let own = self
            .inner
            .keys()
            .get(key)
            .map(|entry| entry.holding().map(|held| (entry.owner, held.token)));
        match own {
            Some(Some((owner, token))) if token == named => {
                return Ok(if self.inner.unlock(key, Some(owner), false).await? {
                    ForceRelease::Released
                } else {
                    ForceRelease::NotHeld
                });
            }
            Some(_) => return Ok(ForceRelease::HolderChanged),
            None => {}
        }
        let Ok(token) = i64::try_from(named.get()) else {
            return Ok(ForceRelease::HolderChanged);
        };
        let own_sessions: Vec<i32> = self
            .inner
            .slots
            .iter()
            .filter_map(|slot| slot.current().as_ref().map(|session| session.pid))
            .collect();
        let ended = self
            .inner
            .terminate_named(key, token, &own_sessions)
            .await
            .map_err(|failure| {
                LockError::backend(KIND, Operation::Release, key.as_str(), failure)
            })?;
        if ended {
            return Ok(ForceRelease::Released);
        }
        // Nothing was ended: only the answer's wording depends on this read.
        // The holder read, not only the exclusive lock's: a key held as
        // permits or shared is held, and is not answered `NotHeld`.
        let held = self.inner.holder(key).await?.is_some();
        Ok(if held {
            ForceRelease::HolderChanged
        } else {
            ForceRelease::NotHeld
        })
    }

    async fn holder(&self, key: &LockKey) -> Result<Option<crate::backend::Holding>, LockError> {
        self.inner.holder(key).await
    }

    async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        self.inner.watch_holder(key).await
    }

    async fn held(
        &self,
        prefix: &str,
    ) -> Result<Vec<(String, crate::backend::Holding)>, LockError> {
        self.inner.held(prefix).await
    }
}

/// Gives back a lock, a shared lock or a permit the server granted to a
/// caller that stopped waiting (`Inner::unlock` tells which).
pub(super) struct GiveBack {
    pub(super) inner: Arc<Inner>,
    pub(super) key: LockKey,
    pub(super) owner: OwnerId,
}

impl AbandonedWith<Result<Attempt, LockError>> for GiveBack {
    async fn handle(self, outcome: Result<Attempt, LockError>) {
        if let Ok(Attempt::Acquired(_)) = outcome {
            let _ = self.inner.unlock(&self.key, Some(self.owner), false).await;
        }
    }
}

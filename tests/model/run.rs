//! The runner: sends a run's operations to the real store through
//! `Arc<dyn Backend>`, one at a time, and checks each answer against the
//! reference model. Its first violation ends the run.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock::backend::{
    Access, AcquireRequest, Attempt, ForceRelease, Handoff, Holding, OwnerId, Queue,
    ReleaseOutcome, ReleaseRequest, Renewal,
};
use dlock::{Backend, FencingToken, LockKey};

use crate::ops::{Abilities, KEYS, Mode, Op, PERMITS, RW_KEY};
use crate::reference::{Answer, Hold, Model, Owner};

/// Every lease's ttl, and a fair entry's life: longer than any run, so
/// nothing ends by itself and the model is exact.
pub const TTL: Duration = Duration::from_secs(300);
/// How long a handoff notice gets to arrive before the waiter looks for
/// itself (rule F2 allows either).
const HANDOFF_WAIT: Duration = Duration::from_secs(2);

/// A store the model runs on: its backend instances (the "processes") and
/// the faults an operator can inflict on it.
#[async_trait]
pub trait Store: Send + Sync {
    /// The name printed in `model: <name>: …`.
    fn name(&self) -> &'static str;
    /// What the backend keeps and which faults the store can inflict.
    fn abilities(&self) -> Abilities;
    /// The backend instances, one per process.
    fn backends(&self) -> Vec<Arc<dyn Backend>>;
    /// Inflicts the fault `op`, and moves the model by what it did.
    async fn fault(&self, op: &Op, run: &mut Run) -> Result<(), String>;
    /// The raw value under `key`'s lock (Redis), to check that a foreign
    /// value is never changed; `None` where the store has no such value.
    async fn lock_value(&self, key: &LockKey) -> Option<String> {
        let _ = key;
        None
    }
}

/// One lease the run took (or tried to): how it holds its key.
#[derive(Clone, Copy, Debug)]
struct Lease {
    p: usize,
    access: Access,
    slot: Option<u32>,
}

/// A run in progress: the keys, the owners and the model.
pub struct Run {
    pub backends: Vec<Arc<dyn Backend>>,
    pub keys: Vec<LockKey>,
    pub prefix: String,
    pub model: Model,
    owners: HashMap<Owner, OwnerId>,
    leases: HashMap<Owner, Lease>,
    handoffs: HashMap<Owner, Handoff>,
    /// Foreign values written under lock keys: key -> value.
    pub foreign: HashMap<usize, String>,
    /// Owners that released or gave up: the core never sends another
    /// attempt with an owner id after its release, so neither does a run.
    retired: HashSet<Owner>,
    /// See [`Abilities::handoff_needs_mark`].
    pub handoff_needs_mark: bool,
    /// See [`Abilities::force_ends_sessions`].
    pub force_ends_sessions: bool,
    pub faults: usize,
}

pub fn access_of(mode: Mode) -> Access {
    match mode {
        Mode::Shared => Access::Shared,
        Mode::Permit => Access::Permits { permits: PERMITS },
        _ => Access::Exclusive,
    }
}

fn answer_of(attempt: Result<Attempt, dlock::LockError>) -> Answer {
    match attempt {
        Ok(Attempt::Acquired(grant)) => Answer::Acquired {
            token: grant.token.get(),
            slot: grant.slot,
        },
        Ok(Attempt::Held { .. }) => Answer::Held,
        Ok(Attempt::Behind { .. }) => Answer::Behind,
        Ok(other) => Answer::Failed(format!("an unknown answer {other:?}")),
        Err(err) => Answer::Failed(err.to_string()),
    }
}

impl Run {
    /// A run on fresh keys under a fresh prefix.
    pub fn new(backends: Vec<Arc<dyn Backend>>) -> Self {
        let id = OwnerId::random().expect("random bytes").to_string();
        let prefix = format!("dlock-model:{}:", &id[..12]);
        let keys = (0..KEYS)
            .map(|k| LockKey::new(format!("{prefix}{k}")).expect("a valid key"))
            .collect();
        Self {
            backends,
            keys,
            prefix,
            model: Model::new(KEYS),
            owners: HashMap::new(),
            leases: HashMap::new(),
            handoffs: HashMap::new(),
            foreign: HashMap::new(),
            retired: HashSet::new(),
            handoff_needs_mark: false,
            force_ends_sessions: false,
            faults: 0,
        }
    }

    /// The owner id of owner `o`, if it has one yet.
    pub fn owner_id(&self, o: Owner) -> OwnerId {
        self.owners
            .get(&o)
            .copied()
            .unwrap_or_else(|| OwnerId::parse_hex(&"0".repeat(32)).expect("an owner id"))
    }

    fn owner(&mut self, o: Owner) -> OwnerId {
        *self
            .owners
            .entry(o)
            .or_insert_with(|| OwnerId::random().expect("random bytes"))
    }

    /// The lease record of `o`, made for its acquisition through `p` in
    /// `mode` if it has none.
    fn lease(&mut self, o: Owner, p: usize, mode: Mode) -> Lease {
        *self.leases.entry(o).or_insert(Lease {
            p,
            access: access_of(mode),
            slot: None,
        })
    }

    /// The lease record of `o`, if it ever tried to acquire (else an
    /// exclusive lease of process 0, which holds nothing).
    fn lease_of(&self, o: Owner) -> Lease {
        self.leases.get(&o).copied().unwrap_or(Lease {
            p: 0,
            access: Access::Exclusive,
            slot: None,
        })
    }

    /// The owners whose leases went through process `p`.
    pub fn owners_of(&self, p: usize) -> Vec<Owner> {
        self.leases
            .iter()
            .filter(|(_, lease)| lease.p == p)
            .map(|(o, _)| *o)
            .collect()
    }

    /// Whether a fair waiter of process `p` is queued anywhere.
    pub fn queued_in(&self, p: usize) -> bool {
        let mine = self.owners_of(p);
        self.model
            .keys
            .iter()
            .any(|key| key.queue.iter().any(|o| mine.contains(o)))
    }

    /// Sends one operation and checks its answers.
    pub async fn step(&mut self, store: &dyn Store, op: &Op) -> Result<(), String> {
        match *op {
            Op::Acquire { p, k, o, mode } if !self.retired.contains(&o) => {
                self.acquire(p, k, o, mode, false).await.map(drop)
            }
            Op::Acquire { .. } => Ok(()),
            Op::Extend { k, o } => self.extend(k, o).await,
            Op::Release { k, o } => self.release(k, o).await,
            Op::ForceRelease { p, k } if self.force_ends_sessions => {
                self.force_sessions(p, k).await
            }
            Op::ForceRelease { p, k } => {
                let answer = self.backends[p].force_release(&self.keys[k]).await;
                self.model.force(k, answer.map_err(|e| e.to_string()))?;
                self.settle(k).await
            }
            Op::ForceNamed { p, k } => self.force_named(p, k).await,
            Op::ForceStale { p, k } => self.force_stale(p, k).await,
            Op::Holder { p, k } => self.holder(p, k).await.map(drop),
            Op::Held { p } => self.held(p).await,
            Op::WriterWaits { p, o, reader } => self.writer_waits(p, o, reader).await,
            _ => {
                self.faults += 1;
                store.fault(op, self).await
            }
        }?;
        self.foreign_untouched(store).await
    }

    /// `try_acquire` by `o` in `mode`; the answer, once checked.
    pub async fn acquire(
        &mut self,
        p: usize,
        k: usize,
        o: Owner,
        mode: Mode,
        waits: bool,
    ) -> Result<Answer, String> {
        let owner = self.owner(o);
        let mut lease = self.lease(o, p, mode);
        if !self.model.keys[k].holds(o) {
            // A new acquisition by this owner: in the mode it asks now.
            lease.access = access_of(mode);
            lease.slot = None;
            self.leases.insert(o, lease);
        }
        let backend = Arc::clone(&self.backends[lease.p]);
        let key = self.keys[k].clone();
        let queue = match mode {
            Mode::Respect => Queue::Respect,
            Mode::Join => Queue::Join { entry_ttl: TTL },
            _ => Queue::Barge,
        };
        if mode == Mode::Join && !self.handoffs.contains_key(&o) && !self.model.keys[k].holds(o) {
            let handoff = backend
                .subscribe_handoff(&key, &owner)
                .await
                .map_err(|err| format!("subscribe_handoff of owner {o} failed: {err}"))?;
            self.handoffs.insert(o, handoff);
        }
        let request = AcquireRequest::new(&key, &owner, TTL)
            .with_access(lease.access)
            .with_queue(queue)
            .with_waits(waits);
        let free_behind = match self.model.keys[k].queue.first() {
            Some(first) if *first != o && self.model.keys[k].hold == Hold::Free => Some(*first),
            _ => None,
        };
        let answer = answer_of(backend.try_acquire(&request).await);
        self.model.acquire(k, o, mode, &answer)?;
        if let (Some(first), Answer::Held, Mode::Respect | Mode::Join) =
            (free_behind, &answer, mode)
        {
            // A fair attempt that finds the key free with a waiter first
            // may hand it to that waiter rather than leave it idle.
            let read = self.backends[0]
                .holder(&self.keys[k])
                .await
                .map_err(|err| format!("holder failed: {err}"))?;
            if read.is_some() {
                self.model.keys[k].queue.retain(|w| *w != first);
                self.take_handoff(k, first).await?;
            }
        }
        if let Answer::Acquired { slot, .. } = answer
            && let Some(lease) = self.leases.get_mut(&o)
        {
            lease.slot = slot;
        }
        if !self.model.keys[k].queue.contains(&o) {
            self.handoffs.remove(&o);
        }
        Ok(answer)
    }

    async fn extend(&mut self, k: usize, o: Owner) -> Result<(), String> {
        let answer = self.renew(k, o).await;
        self.model.extend(k, o, answer)
    }

    /// `extend` of `o`'s lease through the process that took it, unchecked.
    pub async fn renew(&mut self, k: usize, o: Owner) -> Result<bool, String> {
        let owner = self.owner(o);
        let lease = self.lease_of(o);
        let renewal = Renewal::new(&self.keys[k], &owner, TTL).holding(lease.access, lease.slot);
        self.backends[lease.p]
            .extend(&renewal)
            .await
            .map_err(|err| format!("extend of owner {o} failed: {err}"))
    }

    /// `release` by `o`; a handoff it makes is checked too.
    pub async fn release(&mut self, k: usize, o: Owner) -> Result<(), String> {
        let owner = self.owner(o);
        let lease = self.lease_of(o);
        let request = ReleaseRequest::new(&self.keys[k], &owner).holding(lease.access, lease.slot);
        let answer = match self.backends[lease.p].release(&request).await {
            Ok(ReleaseOutcome::Released) => Ok(true),
            Ok(ReleaseOutcome::NotOwner) => Ok(false),
            Ok(other) => Err(format!("answered {other:?} with no reply lost")),
            Err(err) => Err(err.to_string()),
        };
        let next = self.model.release(k, o, answer)?;
        self.handoffs.remove(&o);
        self.retired.insert(o);
        match next {
            Some(next) => self.handed(k, next).await,
            None => Ok(()),
        }
    }

    /// Rule F2: the release handed the key to `next`: the key reads held,
    /// and `next` holds it (its notice tells, or its next look finds it
    /// its own, rule 3).
    async fn handed(&mut self, k: usize, next: Owner) -> Result<(), String> {
        let read = self.backends[0]
            .holder(&self.keys[k])
            .await
            .map_err(|err| format!("holder failed: {err}"))?;
        if read.is_none() && self.model.keys[k].counter_broken {
            // The handoff's token could not be drawn: the key is left
            // free, the waiter first in the queue still.
            self.model.keys[k].queue.insert(0, next);
            return Ok(());
        }
        if read.is_none() && self.handoff_needs_mark && !self.model.keys[k].marked {
            // Nobody looked since a plain attempt took the key: the
            // release left it free, and the first waiter takes it now.
            self.model.keys[k].queue.insert(0, next);
            return self.settle(k).await;
        }
        if read.is_none() {
            return Err(format!(
                "rule F2: the release left the key free, not handed to owner {next}"
            ));
        }
        self.take_handoff(k, next).await
    }

    /// `next` was handed the key: its notice tells the token, or its next
    /// look finds the key its own (rule 3).
    async fn take_handoff(&mut self, k: usize, next: Owner) -> Result<(), String> {
        let token = match self.handoffs.remove(&next) {
            Some(notice) => tokio::time::timeout(HANDOFF_WAIT, notice)
                .await
                .ok()
                .map(|grant| grant.token.get()),
            None => None,
        };
        let token = match token {
            Some(token) => token,
            None => {
                let owner = self.owner(next);
                let lease = self.lease_of(next);
                let request = AcquireRequest::new(&self.keys[k], &owner, TTL)
                    .with_queue(Queue::Join { entry_ttl: TTL });
                match answer_of(self.backends[lease.p].try_acquire(&request).await) {
                    Answer::Acquired { token, .. } => token,
                    other => {
                        return Err(format!(
                            "rule F2: owner {next}, handed the key, found it not its own: {other:?}"
                        ));
                    }
                }
            }
        };
        self.model.handed(k, next, token)
    }

    /// Every fair waiter of `k` looks again, in queue order, as the core's
    /// waiters do: the first takes a key left free (after a fault, or a
    /// force release, which hands nothing over).
    pub async fn settle(&mut self, k: usize) -> Result<(), String> {
        for o in self.model.keys[k].queue.clone() {
            let p = self.leases.get(&o).map_or(0, |lease| lease.p);
            let first = self.model.keys[k].queue.first() == Some(&o);
            match self.acquire(p, k, o, Mode::Join, false).await {
                Ok(_) => {}
                // A key whose holder's session ended is handed over by
                // the store, a moment later (PostgreSQL's waiting
                // statement): the first waiter's look may come first.
                Err(violation) if first && self.model.keys[k].hold == Hold::Free => {
                    if !self.handed_by_itself(k, o).await? {
                        return Err(violation);
                    }
                }
                Err(violation) => return Err(violation),
            }
        }
        Ok(())
    }

    /// Whether the store handed `k` to its first waiter `first` by
    /// itself within a few seconds (a holder's session ended, or was
    /// ended by a force release): the handoff, if so, is checked.
    async fn handed_by_itself(&mut self, k: usize, first: Owner) -> Result<bool, String> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while tokio::time::Instant::now() < deadline {
            let read = self.backends[0]
                .holder(&self.keys[k])
                .await
                .map_err(|err| format!("holder failed: {err}"))?;
            if read.is_some() {
                self.model.keys[k].queue.retain(|o| *o != first);
                self.take_handoff(k, first).await?;
                return Ok(true);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(false)
    }

    /// `holder` through `p`, checked; the holding read.
    pub async fn holder(&mut self, p: usize, k: usize) -> Result<Option<Holding>, String> {
        let read = self.backends[p]
            .holder(&self.keys[k])
            .await
            .map_err(|err| format!("holder failed: {err}"))?;
        self.model
            .holder(k, read.as_ref().map(|h| h.token.map(FencingToken::get)))?;
        Ok(read)
    }

    async fn held(&mut self, p: usize) -> Result<(), String> {
        let listed = self.backends[p]
            .held(&self.prefix)
            .await
            .map_err(|err| format!("held failed: {err}"))?;
        let mut keys = Vec::new();
        for (name, holding) in &listed {
            let Some(k) = self.keys.iter().position(|key| key.as_str() == name) else {
                return Err(format!("held listed {name:?}, no key of the run"));
            };
            self.model
                .holder(k, Some(holding.token.map(FencingToken::get)))
                .map_err(|err| format!("held: {err}"))?;
            keys.push(k);
        }
        let expected = self.model.held_keys();
        if keys != expected {
            return Err(format!(
                "held listed keys {keys:?}, not the held keys {expected:?}"
            ));
        }
        Ok(())
    }

    /// A force release on a store that breaks a holder by ending its
    /// session (PostgreSQL): every lease on that session ends with it,
    /// and shared and permit holders, which the store keeps no record of,
    /// may be broken or not. The key's exclusive holder is broken exactly
    /// when the answer says so; then every holding is renewed, and those
    /// that answer false are lost, by the model too.
    async fn force_sessions(&mut self, p: usize, k: usize) -> Result<(), String> {
        let answer = self.backends[p]
            .force_release(&self.keys[k])
            .await
            .map_err(|err| format!("force_release failed: {err}"))?;
        if !self.model.hidden(k) {
            let held = self.model.keys[k].hold != Hold::Free;
            if answer != held {
                return Err(format!(
                    "force_release answered {answer}, with the key {:?}",
                    self.model.keys[k].hold
                ));
            }
        }
        let broken = self.model.keys[k].holders();
        let lost = self.sessions_ended().await?;
        if !self.model.hidden(k) && !broken.iter().all(|o| lost.contains(o)) {
            return Err(format!(
                "force_release answered true, and holder {broken:?} renewed"
            ));
        }
        Ok(())
    }

    /// Some session ended with every lease on it: each holding is renewed,
    /// and those that answer false are lost, by the model too; the keys
    /// left free go to their first waiters. The owners lost.
    async fn sessions_ended(&mut self) -> Result<Vec<Owner>, String> {
        let mut lost = Vec::new();
        for key in 0..self.keys.len() {
            for o in self.model.keys[key].holders() {
                if !self.renew(key, o).await? {
                    lost.push(o);
                }
            }
        }
        self.model.lose_owners(&lost);
        for key in 0..self.keys.len() {
            if self.model.keys[key].hold == Hold::Free {
                self.settle(key).await?;
            }
        }
        Ok(lost)
    }

    /// Reads the holder and breaks the lease it names.
    async fn force_named(&mut self, p: usize, k: usize) -> Result<(), String> {
        let Some(shown) = self.holder(p, k).await? else {
            return Ok(());
        };
        let Some(token) = shown.token else {
            return Ok(());
        };
        let answer = self.backends[p]
            .force_release_holding(&self.keys[k], &shown)
            .await;
        let key = &mut self.model.keys[k];
        let matches = match &key.hold {
            Hold::Exclusive { token: t, .. } | Hold::Shared { token: t, .. } => *t == token.get(),
            _ => false,
        };
        if let Hold::Permits { slots } = &mut key.hold {
            // A permit named by its token: that one is broken, or none
            // (a store whose slots keep no token refuses).
            let named = slots
                .iter()
                .find(|(_, (_, t))| *t == token.get())
                .map(|(s, _)| *s);
            return match (named, answer) {
                (_, Err(_)) | (None, Ok(ForceRelease::HolderChanged)) => Ok(()),
                (Some(slot), Ok(ForceRelease::Released)) => {
                    slots.remove(&slot);
                    if slots.is_empty() {
                        key.hold = Hold::Free;
                    }
                    Ok(())
                }
                (named, answer) => Err(format!(
                    "force_release_holding naming permit token {token} (slot {named:?}) answered {answer:?}"
                )),
            };
        }
        match (&key.hold, answer) {
            (_, Ok(ForceRelease::Released)) if matches => {
                key.hold = Hold::Free;
                if self.force_ends_sessions {
                    self.sessions_ended().await.map(drop)
                } else {
                    self.settle(k).await
                }
            }
            (_, Ok(ForceRelease::HolderChanged)) if !matches => Ok(()),
            (hold, answer) => Err(format!(
                "force_release_holding naming token {token} answered {answer:?}, with the key {hold:?}"
            )),
        }
    }

    /// Names a lease that ended long ago: nothing is broken.
    async fn force_stale(&mut self, p: usize, k: usize) -> Result<(), String> {
        let stale = Holding::new(Some(FencingToken::new(1)), None);
        let answer = self.backends[p]
            .force_release_holding(&self.keys[k], &stale)
            .await;
        if self.model.hidden(k) {
            return match answer {
                Ok(ForceRelease::NotHeld) => Ok(()),
                other => Err(format!(
                    "force_release_holding of a key only members hold answered {other:?}"
                )),
            };
        }
        let hold = &self.model.keys[k].hold;
        match (hold, answer) {
            (Hold::Free, Ok(ForceRelease::NotHeld)) => Ok(()),
            (Hold::Permits { .. }, Err(_)) => Ok(()),
            (Hold::Free, _) => {
                Err("force_release_holding of a free key did not answer NotHeld".into())
            }
            (_, Ok(ForceRelease::HolderChanged)) => Ok(()),
            (hold, answer) => Err(format!(
                "force_release_holding naming token 1 answered {answer:?}, with the key {hold:?}"
            )),
        }
    }

    /// Rule M3: a waiting writer that finds readers leaves a mark that
    /// keeps new readers out until it gives up.
    async fn writer_waits(&mut self, p: usize, o: Owner, reader: Owner) -> Result<(), String> {
        if self.retired.contains(&o) || self.leases.contains_key(&o) {
            return Ok(());
        }
        self.retired.insert(reader);
        let readers_hold = matches!(self.model.keys[RW_KEY].hold, Hold::Shared { .. });
        let answer = self.acquire(p, RW_KEY, o, Mode::Exclusive, true).await?;
        if readers_hold && matches!(answer, Answer::Held) {
            let owner = self.owner(reader);
            let request =
                AcquireRequest::new(&self.keys[RW_KEY], &owner, TTL).with_access(Access::Shared);
            match answer_of(self.backends[p].try_acquire(&request).await) {
                Answer::Held => {}
                other => {
                    return Err(format!(
                        "rule M3: a reader was answered {other:?} while writer {o}'s mark stood"
                    ));
                }
            }
        }
        self.release(RW_KEY, o).await
    }

    /// A foreign value under a lock key is never changed by dlock (but by
    /// a force release, which the model knows of).
    async fn foreign_untouched(&mut self, store: &dyn Store) -> Result<(), String> {
        let planted: Vec<(usize, String)> =
            self.foreign.iter().map(|(k, v)| (*k, v.clone())).collect();
        for (k, value) in planted {
            if self.model.keys[k].hold != Hold::Foreign {
                self.foreign.remove(&k);
                continue;
            }
            let now = store.lock_value(&self.keys[k]).await;
            if now.as_deref() != Some(value.as_str()) {
                return Err(format!(
                    "the foreign value {value:?} under key {k}'s lock became {now:?}"
                ));
            }
        }
        Ok(())
    }

    /// Lets go of everything the run holds (keys on a shared server).
    pub async fn clean(&mut self) {
        // Queued waiters leave (PostgreSQL keeps a statement waiting for
        // each).
        for k in 0..self.keys.len() {
            for o in self.model.keys[k].queue.clone() {
                let owner = self.owner(o);
                let lease = self.lease_of(o);
                let request = ReleaseRequest::new(&self.keys[k], &owner);
                let _ =
                    tokio::time::timeout(HANDOFF_WAIT, self.backends[lease.p].release(&request))
                        .await;
            }
        }
        self.handoffs.clear();
        for key in &self.keys {
            // Bounded: after an operation that never answered, the key
            // may never answer again.
            let _ = tokio::time::timeout(HANDOFF_WAIT, self.backends[0].force_release(key)).await;
        }
    }
}

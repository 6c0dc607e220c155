//! `MemoryBackend`: locks shared by the tasks of one process.
//!
//! For tests and local development, and as the reference every other backend
//! is checked against: it keeps the full semantics (ttl expiry, fencing
//! tokens, waiting without polling, owner-checked release and extend, fair
//! queues, shared locks with writer preference, and permits: rules F1 to
//! F3 and M1 to M5 on [`Backend`]).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use crate::backend::kit::after;
use crate::backend::{
    self, Access, AcquireRequest, Attempt, Backend, ForceRelease, Grant, Handoff, Holding, OwnerId,
    QUEUE_ENTRY_TTL, Queue, ReleaseNotice, ReleaseOutcome, ReleaseRequest, Renewal,
};
use crate::error::LockError;
use crate::holder::HolderInfo;
use crate::key::LockKey;
use crate::token::FencingToken;

mod attempts;

/// How many keys may be added between two sweeps of idle entries.
const SWEEP_EVERY: usize = 1024;

/// Locks held in this process's memory.
///
/// Fencing tokens come from one counter for the whole backend, seeded from
/// the wall clock in microseconds, so tokens keep rising across a restart of
/// the process as long as the clock does not move backwards.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_runtime::LockError> {
/// use std::{sync::Arc, time::Duration};
/// use dlock_runtime::{memory::MemoryBackend, Backend, LockOptions};
///
/// let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
/// let options = LockOptions::new(Duration::from_secs(10));
/// let first = options.acquire_on(backend.clone(), "job").await?;
/// assert!(options.acquire_on(backend.clone(), "job").await.is_err());
/// let first_token = first.token();
/// first.release().await?;
/// let second = options.acquire_on(backend.clone(), "job").await?;
/// assert!(second.token() > first_token);
/// second.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct MemoryBackend {
    inner: Arc<Inner>,
}

struct Inner {
    entries: Mutex<Entries>,
    counter: AtomicU64,
    /// The label acquisitions record, over the process's
    /// ([`MemoryBackend::with_label`]).
    label: Option<String>,
}

#[derive(Default)]
struct Entries {
    by_key: HashMap<LockKey, Entry>,
    added_since_sweep: usize,
}

struct Entry {
    /// The exclusive holder.
    holder: Option<Holder>,
    /// The shared holders (rule M1).
    readers: HashMap<OwnerId, Holder>,
    /// The token of the read phase: drawn by its first reader, granted to
    /// every reader that joins while one still holds (rule M2).
    phase: Option<FencingToken>,
    /// A waiting writer's mark, and when it runs out (rule M3).
    writer_waiting: Option<(OwnerId, Instant)>,
    /// The permit holders, by slot (`None`: free).
    slots: Vec<Option<Holder>>,
    /// Bumped on every release; waiters hold receivers.
    released: watch::Sender<u64>,
    /// Bumped on every release and acquisition; holder watchers hold
    /// receivers.
    changed: watch::Sender<u64>,
    /// Fair waiters, in arrival order.
    queue: VecDeque<Queued>,
    /// Where each fair waiter hears of its handoff
    /// ([`Backend::subscribe_handoff`]).
    handoffs: HashMap<OwnerId, oneshot::Sender<Grant>>,
}

/// A fair waiter's entry in a key's queue.
struct Queued {
    owner: OwnerId,
    /// The ttl its attempt asked for: a handoff holds the key that long.
    ttl: std::time::Duration,
    identity: Option<String>,
    label: Option<String>,
    /// Skipped from then on, unless refreshed.
    expires_at: Instant,
}

struct Holder {
    owner: OwnerId,
    token: FencingToken,
    expires_at: Instant,
    identity: Option<String>,
    /// Who took it (host, pid, label), and when.
    info: HolderInfo,
    since: Instant,
}

impl Holder {
    fn holding(&self, now: Instant) -> Holding {
        Holding::new(Some(self.token), self.identity.clone())
            .expiring_in(self.expires_at - now)
            .held_by(Some(self.info.clone().held_for(now - self.since)))
    }
}

impl Entry {
    fn new() -> Self {
        Self {
            holder: None,
            readers: HashMap::new(),
            phase: None,
            writer_waiting: None,
            slots: Vec::new(),
            released: watch::channel(0).0,
            changed: watch::channel(0).0,
            queue: VecDeque::new(),
            handoffs: HashMap::new(),
        }
    }

    /// Drops the queue's expired entries.
    fn drop_expired_waiters(&mut self, now: Instant) {
        self.queue.retain(|queued| queued.expires_at > now);
    }

    /// Whether `owner` may take the free key: no live entry ahead of it.
    fn first_in_line(&self, owner: &OwnerId) -> bool {
        self.queue.front().is_none_or(|first| first.owner == *owner)
    }

    /// Puts `owner` at the end of the queue, or refreshes its place.
    fn join_queue(
        &mut self,
        request: &AcquireRequest<'_>,
        entry_ttl: std::time::Duration,
        now: Instant,
    ) {
        if let Some(queued) = self.queue.iter_mut().find(|q| q.owner == *request.owner) {
            queued.expires_at = after(now, entry_ttl);
            queued.ttl = request.ttl;
            return;
        }
        self.queue.push_back(Queued {
            owner: *request.owner,
            ttl: request.ttl,
            identity: request.identity.map(str::to_owned),
            label: request.label.map(str::to_owned),
            expires_at: after(now, entry_ttl),
        });
    }

    /// Removes `owner`'s entry and its handoff registration.
    fn leave_queue(&mut self, owner: &OwnerId) {
        self.queue.retain(|queued| queued.owner != *owner);
        self.handoffs.remove(owner);
    }

    /// The live holder, if any (an expired lease holds nothing).
    fn live_holder(&self, now: Instant) -> Option<&Holder> {
        self.holder.as_ref().filter(|h| h.expires_at > now)
    }

    /// How long the longest-lived live reader has left, if any holds.
    fn readers_left(&self, now: Instant) -> Option<std::time::Duration> {
        self.readers
            .values()
            .filter(|r| r.expires_at > now)
            .map(|r| r.expires_at - now)
            .max()
    }

    /// The live permit holders, with their slots.
    fn live_slots(&self, now: Instant) -> impl Iterator<Item = (u32, &Holder)> {
        self.slots.iter().enumerate().filter_map(move |(slot, h)| {
            let holder = h.as_ref().filter(|h| h.expires_at > now)?;
            Some((u32::try_from(slot).ok()?, holder))
        })
    }

    /// The live writer-waiting mark's owner and how long it has left.
    fn live_mark(&self, now: Instant) -> Option<(OwnerId, std::time::Duration)> {
        self.writer_waiting
            .filter(|(_, until)| *until > now)
            .map(|(owner, until)| (owner, until - now))
    }

    /// Who reads as the key's holder: the exclusive one, else the reader
    /// whose lease runs longest, else the lowest live slot.
    fn shown_holder(&self, now: Instant) -> Option<&Holder> {
        self.live_holder(now)
            .or_else(|| {
                self.readers
                    .values()
                    .filter(|r| r.expires_at > now)
                    .max_by_key(|r| r.expires_at)
            })
            .or_else(|| self.live_slots(now).next().map(|(_, h)| h))
    }

    /// Slot of `owner`'s permit, if it holds one live.
    fn slot_of(&self, owner: &OwnerId, now: Instant) -> Option<u32> {
        self.live_slots(now)
            .find(|(_, h)| h.owner == *owner)
            .map(|(slot, _)| slot)
    }

    /// Breaks every lease on the key (an administrator's force release):
    /// its holder, readers and permits, and a writer's mark.
    fn break_all(&mut self) {
        self.holder = None;
        self.readers.clear();
        self.slots.clear();
        self.writer_waiting = None;
        self.announce_release();
    }

    fn announce_release(&self) {
        self.released.send_modify(|n| *n = n.wrapping_add(1));
        self.announce_change();
    }

    fn announce_change(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn idle(&self, now: Instant) -> bool {
        self.shown_holder(now).is_none()
            && self.live_mark(now).is_none()
            && self.queue.is_empty()
            && self.handoffs.is_empty()
            && self.released.receiver_count() == 0
            && self.changed.receiver_count() == 0
    }
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBackend {
    /// An empty backend.
    pub fn new() -> Self {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        Self {
            inner: Arc::new(Inner {
                entries: Mutex::default(),
                counter: AtomicU64::new(seed),
                label: None,
            }),
        }
    }

    /// An empty backend whose acquisitions record `label` as their
    /// application label, over the process's
    /// ([`Registry::set_label`](crate::Registry::set_label)). Refused if
    /// [`check_label`](crate::holder::check_label) refuses it.
    pub fn with_label(label: &str) -> Result<Self, LockError> {
        crate::holder::check_label(label)?;
        let mut backend = Self::new();
        Arc::get_mut(&mut backend.inner)
            .expect("a new backend is not shared yet")
            .label = Some(label.to_owned());
        Ok(backend)
    }

    /// How many keys the backend tracks (held or waited on), for tests of
    /// its memory use.
    pub fn tracked_keys(&self) -> usize {
        self.lock().by_key.len()
    }

    /// How many fair waiters are queued for `key` now (live entries), for
    /// tests of fair mode.
    pub fn queued_waiters(&self, key: &LockKey) -> usize {
        let now = Instant::now();
        self.lock().by_key.get(key).map_or(0, |entry| {
            entry
                .queue
                .iter()
                .filter(|queued| queued.expires_at > now)
                .count()
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.inner
            .entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn next_token(&self) -> FencingToken {
        FencingToken::new(self.inner.counter.fetch_add(1, Ordering::SeqCst) + 1)
    }
}

impl Entries {
    fn entry(&mut self, key: &LockKey) -> &mut Entry {
        if !self.by_key.contains_key(key) {
            self.added_since_sweep += 1;
            if self.added_since_sweep >= SWEEP_EVERY {
                let now = Instant::now();
                self.by_key.retain(|_, entry| !entry.idle(now));
                self.added_since_sweep = 0;
            }
        }
        self.by_key.entry(key.clone()).or_insert_with(Entry::new)
    }

    /// Drops the entry of `key` if nothing refers to it any more.
    fn forget_if_idle(&mut self, key: &LockKey) {
        let now = Instant::now();
        if self.by_key.get(key).is_some_and(|entry| entry.idle(now)) {
            self.by_key.remove(key);
        }
    }
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("tracked_keys", &self.tracked_keys())
            .finish()
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    fn kind(&self) -> &'static str {
        "memory"
    }

    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        let now = Instant::now();
        let mut entries = self.lock();
        let entry = entries.entry(request.key);
        match request.access {
            Access::Exclusive => Ok(self.try_exclusive(entry, request, now)),
            Access::Shared => Ok(self.try_shared(entry, request, now)),
            Access::Permits { permits } => Ok(self.try_permit(entry, request, permits, now)),
        }
    }

    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        let (key, owner, ttl) = (renewal.key, renewal.owner, renewal.ttl);
        let now = Instant::now();
        let mut entries = self.lock();
        let Some(entry) = entries.by_key.get_mut(key) else {
            return Ok(false);
        };
        let holder = match renewal.access {
            Access::Exclusive => entry.holder.as_mut(),
            Access::Shared => entry.readers.get_mut(owner),
            Access::Permits { .. } => {
                let slot = renewal.slot.or_else(|| entry.slot_of(owner, now));
                slot.and_then(|slot| entry.slots.get_mut(slot as usize))
                    .and_then(Option::as_mut)
            }
        };
        let Some(holder) = holder else {
            return Ok(false);
        };
        if holder.owner != *owner || holder.expires_at <= now {
            return Ok(false);
        }
        holder.expires_at = after(now, ttl);
        Ok(true)
    }

    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
        let now = Instant::now();
        let mut entries = self.lock();
        let Some(entry) = entries.by_key.get_mut(lease.key) else {
            return Ok(ReleaseOutcome::NotOwner);
        };
        let released = match lease.access {
            Access::Exclusive => self.release_exclusive(entry, lease.owner, now),
            Access::Shared => {
                let ours = entry
                    .readers
                    .remove(lease.owner)
                    .is_some_and(|reader| reader.expires_at > now);
                // The phase's last reader: writers may go (rule M4).
                if ours && entry.readers_left(now).is_none() {
                    entry.readers.clear();
                    entry.phase = None;
                    entry.announce_release();
                }
                ours
            }
            Access::Permits { .. } => {
                let slot = lease.slot.or_else(|| entry.slot_of(lease.owner, now));
                let taken = slot.and_then(|slot| entry.slots.get_mut(slot as usize));
                match taken {
                    Some(place)
                        if place
                            .as_ref()
                            .is_some_and(|h| h.owner == *lease.owner && h.expires_at > now) =>
                    {
                        *place = None;
                        entry.announce_release();
                        true
                    }
                    _ => false,
                }
            }
        };
        entries.forget_if_idle(lease.key);
        Ok(ReleaseOutcome::from_released(released))
    }

    fn supports_fair(&self) -> bool {
        true
    }

    fn supports_access(&self, access: Access) -> bool {
        match access {
            Access::Exclusive | Access::Shared => true,
            Access::Permits { permits } => permits > 0,
        }
    }

    /// Every waiter of a memory backend is of this process: its queue.
    fn queued_here(&self, key: &LockKey) -> bool {
        self.queued_waiters(key) > 0
    }

    async fn subscribe_handoff(
        &self,
        key: &LockKey,
        owner: &OwnerId,
    ) -> Result<Handoff, LockError> {
        let (sender, receiver) = oneshot::channel();
        self.lock().entry(key).handoffs.insert(*owner, sender);
        Ok(Handoff::new(async move {
            match receiver.await {
                Ok(grant) => grant,
                // Left the queue (or the backend dropped): no handoff will
                // come; the waiter's next attempt decides.
                Err(_) => std::future::pending().await,
            }
        }))
    }

    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        let mut receiver = self.lock().entry(key).released.subscribe();
        // Every waiter hears every release: nothing to pass on.
        Ok(ReleaseNotice::new(async move {
            // A closed channel (backend dropped) also ends the wait.
            let _ = receiver.changed().await;
        }))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let now = Instant::now();
        let mut entries = self.lock();
        let Some(entry) = entries.by_key.get_mut(key) else {
            return Ok(false);
        };
        let was_held = entry.shown_holder(now).is_some();
        entry.break_all();
        entries.forget_if_idle(key);
        Ok(was_held)
    }

    /// Compares the holder `holder` shows with the one named and breaks
    /// the key under the one mutex, so no acquisition comes in between. A
    /// key held as permits loses only the permit whose token is named.
    async fn force_release_holding(
        &self,
        key: &LockKey,
        expected: &Holding,
    ) -> Result<ForceRelease, LockError> {
        let named = backend::named_token(self.kind(), key, expected)?;
        let now = Instant::now();
        let mut entries = self.lock();
        let Some(entry) = entries.by_key.get_mut(key) else {
            return Ok(ForceRelease::NotHeld);
        };
        let by_permits = entry.live_holder(now).is_none() && entry.readers_left(now).is_none();
        if by_permits && entry.live_slots(now).next().is_some() {
            // Held as permits: only the permit named is broken, its slot
            // found by its own token; the others keep theirs.
            let Some(slot) = entry
                .live_slots(now)
                .find(|(_, holder)| holder.token == named)
                .and_then(|(slot, _)| usize::try_from(slot).ok())
            else {
                return Ok(ForceRelease::HolderChanged);
            };
            if let Some(held) = entry.slots.get_mut(slot) {
                *held = None;
            }
            entry.announce_release();
            entries.forget_if_idle(key);
            return Ok(ForceRelease::Released);
        }
        let shown = entry.shown_holder(now).map(|holder| Some(holder.token));
        let answer = ForceRelease::compare(shown, named);
        if answer == ForceRelease::Released {
            entry.break_all();
            entries.forget_if_idle(key);
        }
        Ok(answer)
    }

    async fn holder(&self, key: &LockKey) -> Result<Option<Holding>, LockError> {
        let now = Instant::now();
        let entries = self.lock();
        Ok(entries
            .by_key
            .get(key)
            .and_then(|entry| entry.shown_holder(now))
            .map(|holder| holder.holding(now)))
    }

    async fn held(&self, prefix: &str) -> Result<Vec<(String, Holding)>, LockError> {
        let now = Instant::now();
        let entries = self.lock();
        let mut held: Vec<(String, Holding)> = entries
            .by_key
            .iter()
            .filter(|(key, _)| key.as_str().starts_with(prefix))
            .filter_map(|(key, entry)| {
                let holder = entry.shown_holder(now)?;
                Some((key.to_string(), holder.holding(now)))
            })
            .collect();
        held.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(held)
    }

    async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        let mut receiver = self.lock().entry(key).changed.subscribe();
        // Every acquisition and release is announced; an expiry is not, and
        // the reader looks again when the lease it read runs out.
        Ok(ReleaseNotice::new(async move {
            let _ = receiver.changed().await;
        }))
    }
}

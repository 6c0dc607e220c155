//! # Implementing a backend
//!
//! A backend is a lock store: it implements the few primitives of
//! [`Backend`](super::Backend), and the core gives every lease renewal, the
//! lost signal, waiting, release on drop, several keys and the macro. This
//! chapter walks through one, small but complete: locks kept in the
//! process's memory. It is the shape every backend has; a real one talks to
//! its store where this one takes a mutex.
//!
//! ## The rules, in short
//!
//! The full text is on each method of [`Backend`](super::Backend); these are
//! the ones every backend must get right:
//!
//! 1. **One atomic step each.** `try_acquire` sets the holder *and* draws the
//!    fencing token together; `extend` and `release` compare the owner *and*
//!    act together. Split, two callers interleave between the steps.
//! 2. **Tokens only rise per key**, through every instance (every process)
//!    on the store and across restarts of the store: draw them from a
//!    durable counter in the store, floored at the store's clock in
//!    microseconds if the counter can be lost.
//! 3. **A retry by the owner that holds the key is a success**, with the
//!    token already drawn or a new one (rule 2 holds either way), and the
//!    lease runs anew for the retry's ttl: the core retries with the same
//!    owner after a lost reply.
//! 4. **`extend` only renews a lease that is still held**: one that ended
//!    answers `false` and never takes the key again; `extend_many` answers
//!    each lease of a batch on its own.
//! 5. **`Held { expires_in }`** says how long the current holder's lease
//!    has left, if the store knows (`None` otherwise): the core looks again
//!    then even if no release is announced.
//! 6. **A release notice resolves when the lease it waits on is
//!    released**: the core subscribes, then tries the key, and waits only
//!    if that attempt found it held; the notice must resolve on the release
//!    of the lease the attempt found (or of any later one), so the release
//!    can never fall between the two steps. A backend may learn from the
//!    failed attempt that someone waits (Redis marks the holder's value so
//!    that only a waited-on release is published); a lease that ends by
//!    expiry instead is covered by rule 5. A notice that cannot promise
//!    that says how soon to look again (`ReleaseNotice::recheck_within`).
//! 7. **Every lock can end without its holder**: a ttl on the store, or a
//!    session the store ends when the holder dies.
//! 8. **Who holds it is read as one state**: `holder` answers the live
//!    holder's token and the identity its acquisition recorded
//!    (`AcquireRequest::identity`, set by leader election), never an
//!    earlier lease's; `watch_holder` resolves on each release and each
//!    acquisition that recorded an identity, or says how soon to look
//!    again.
//! 9. **Every acquisition records who holds it**: the record
//!    `AcquireRequest::holder_record` gives (host, pid, label), kept in the
//!    same step as the holder, read back by `holder` with how long the key
//!    has been held by the store's clock ([`HolderInfo`](crate::HolderInfo));
//!    `held(prefix)` lists the live holders under a prefix, or fails: a
//!    store that cannot enumerate its locks must say so, never answer a
//!    short list.
//! 10. **A force release can name what it breaks**:
//!     `force_release_holding` breaks the key only while its holder is the
//!     lease named (by the token `holder` read), the comparison and the
//!     break in one step; otherwise it changes nothing and says whether
//!     another holds the key or nobody does. The default refuses every
//!     call, which is safe, but leaves `dlock release` unable to break a
//!     lock on the store.
//!
//! Fair mode is optional. A backend that leaves
//! [`supports_fair`](crate::Backend::supports_fair) at its default `false`
//! keeps only the rules above, and the core refuses fair acquisitions on it
//! (the suite's fair properties then check that refusal). One that keeps
//! queues follows rules F1 to F3 on the [`Backend`](crate::Backend) trait:
//! attempts read [`AcquireRequest::queue`](crate::backend::AcquireRequest::queue),
//! the holder's release hands the key to the first live queued owner in the
//! same atomic step and resolves its
//! [`subscribe_handoff`](crate::Backend::subscribe_handoff) notice, and a
//! non-holder's release removes its entry. The memory backend's queue is
//! the shortest complete example. A store whose handoff subscription is
//! shared within a process can also answer
//! [`queued_here`](crate::Backend::queued_here), which spares a caller
//! behind a waiter of its own process a first try it could only lose.
//!
//! Shared locks and permits are optional too. A backend that leaves
//! [`supports_access`](crate::Backend::supports_access) at its default
//! (exclusive only) reads nothing new: the core refuses `mode = "shared"`
//! and `permits` on it with `InvalidOption` before sending anything, and
//! the suite's shared and permit properties check that refusal. One that
//! keeps them follows rules M1 to M5 on the [`Backend`](crate::Backend)
//! trait, each attempt one atomic step (one round trip):
//!
//! - [`AcquireRequest::access`](crate::backend::AcquireRequest::access)
//!   says how to hold the key ([`Access`](crate::backend::Access)).
//!   `Shared`: refuse (`Held`) while an exclusive holder, a permit, or a
//!   live writer-waiting mark stands; else join the read phase (its token
//!   if a reader still holds, else a freshly drawn one, kept as the
//!   phase's). `Exclusive`: while readers hold, a caller that
//!   [`waits`](crate::backend::AcquireRequest::waits) leaves or refreshes
//!   its mark (expiry [`QUEUE_ENTRY_TTL`](crate::backend::QUEUE_ENTRY_TTL))
//!   and answer `Held` with `expires_in` at most a third of that; taking
//!   the key clears the owner's mark. `Permits { permits }`: take the first
//!   free slot in `0..permits`, all slots tried in the one step, and answer
//!   it with [`Grant::in_slot`](crate::backend::Grant::in_slot).
//! - [`Renewal`](crate::backend::Renewal) and
//!   [`ReleaseRequest`](crate::backend::ReleaseRequest) carry `access` and
//!   `slot`: act on that side only. A permit release with `slot: None`
//!   releases the owner's slot, whichever; an exclusive release by an
//!   owner that holds nothing removes its mark and wakes waiters.
//! - The last reader's release, a permit's release and a mark's removal
//!   announce a release to [`subscribe`](crate::Backend::subscribe)rs.
//!
//! On Redis that is a script over a readers' hash (owner → expiry), the
//! phase token, a mark key with a `PX` ttl and one key per slot; on
//! PostgreSQL `pg_try_advisory_lock_shared` on an owned session for
//! readers, the phase token and the mark in a row, and one advisory lock
//! per slot tried in one statement. The memory backend is the reference.
//!
//! A real store needs more than the trait: a round trip that cannot be
//! taken back when its caller gives up half-way (a timeout around
//! `try_acquire`), credentials in a connection URL that must never be
//! shown. The in-tree backends name only dlock's public items, and what
//! they build on besides the trait is in [`backend::kit`](super::kit):
//! [`Detachable`](super::kit::detach::Detachable) finishes such a round trip
//! and gives back what it took, [`percent`](super::kit::percent) and
//! [`userinfo`](super::kit::userinfo) read a URL the way every in-tree
//! backend does.
//!
//! Then run the shipped suite against a real store: with the `conformance`
//! feature, `dlock::conformance_suite!(make_backend);` in a test file makes
//! one test per property. `make_backend` is called once per instance a
//! property takes (some take two, as two processes would connect), and
//! every instance it makes must reach the same store.
//!
//! ## A complete backend
//!
//! ```
//! # #[cfg(feature = "conformance")]
//! # mod doc {
//! use std::collections::HashMap;
//! use std::sync::{Arc, Mutex};
//! use std::time::{Duration, SystemTime, UNIX_EPOCH};
//!
//! use async_trait::async_trait;
//! use dlock_runtime::backend::kit::after;
//! use dlock_runtime::backend::{
//!     AcquireRequest, Attempt, Backend, ForceRelease, Grant, Holding, OwnerId, ReleaseNotice,
//!     ReleaseOutcome, ReleaseRequest, Renewal,
//! };
//! use dlock_runtime::{FencingToken, HolderInfo, LockError, LockKey};
//! use tokio::sync::watch;
//! use tokio::time::Instant;
//!
//! /// Locks in this process's memory, for the example.
//! #[derive(Default)]
//! pub struct Skeleton {
//!     keys: Mutex<HashMap<LockKey, Slot>>,
//! }
//!
//! struct Slot {
//!     holder: Option<(OwnerId, FencingToken, Instant)>,
//!     /// The identity the holder's acquisition recorded.
//!     identity: Option<String>,
//!     /// The holder record (host, pid, label) and when it was taken.
//!     recorded: Option<(String, Instant)>,
//!     /// The last token drawn for the key.
//!     last_token: u64,
//!     /// Bumped on every release and every acquisition; each waiter and
//!     /// each watcher holds a receiver (a waiter woken by an acquisition
//!     /// just finds the key held again).
//!     released: watch::Sender<u64>,
//! }
//!
//! impl Slot {
//!     /// The live holder as `holder` answers it (rules 8 and 9).
//!     fn holding(&self, now: Instant) -> Option<Holding> {
//!         let (_, token, until) = self.holder?;
//!         let holder = self.recorded.as_ref().and_then(|(record, since)| {
//!             Some(HolderInfo::decode(record)?.held_for(now - *since))
//!         });
//!         Some(
//!             Holding::new(Some(token), self.identity.clone())
//!                 .expiring_in(until - now)
//!                 .held_by(holder),
//!         )
//!     }
//! }
//!
//! impl Skeleton {
//!     fn with_slot<T>(&self, key: &LockKey, f: impl FnOnce(&mut Slot, Instant) -> T) -> T {
//!         let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
//!         let slot = keys.entry(key.clone()).or_insert_with(|| Slot {
//!             holder: None,
//!             identity: None,
//!             recorded: None,
//!             last_token: 0,
//!             released: watch::channel(0).0,
//!         });
//!         let now = Instant::now();
//!         // An expired lease holds nothing.
//!         if slot.holder.is_some_and(|(_, _, until)| until <= now) {
//!             slot.holder = None;
//!         }
//!         f(slot, now)
//!     }
//! }
//!
//! #[async_trait]
//! impl Backend for Skeleton {
//!     fn kind(&self) -> &'static str {
//!         "skeleton"
//!     }
//!
//!     async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
//!         let (owner, ttl) = (*request.owner, request.ttl);
//!         Ok(self.with_slot(request.key, |slot, now| match slot.holder {
//!             // Rule 3: the owner's own retry, for the retry's ttl.
//!             Some((holder, token, _)) if holder == owner => {
//!                 slot.holder = Some((owner, token, after(now, ttl)));
//!                 slot.identity = request.identity.map(str::to_owned);
//!                 Attempt::Acquired(Grant::new(token))
//!             }
//!             // Rule 5: say when the holder's lease runs out.
//!             Some((_, _, until)) => Attempt::Held { expires_in: Some(until - now) },
//!             None => {
//!                 // Rules 1 and 2: the holder and the token in one step,
//!                 // the token above the last one and the clock.
//!                 let clock = SystemTime::now()
//!                     .duration_since(UNIX_EPOCH)
//!                     .map_or(0, |d| d.as_micros() as u64);
//!                 slot.last_token = (slot.last_token + 1).max(clock);
//!                 let token = FencingToken::new(slot.last_token);
//!                 slot.holder = Some((owner, token, after(now, ttl)));
//!                 // Rules 8 and 9: the identity and the holder record in
//!                 // the same step as the holder.
//!                 slot.identity = request.identity.map(str::to_owned);
//!                 slot.recorded = Some((request.holder_record(None), now));
//!                 slot.released.send_modify(|n| *n += 1);
//!                 Attempt::Acquired(Grant::new(token))
//!             }
//!         }))
//!     }
//!
//!     async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
//!         // Rule 4: only the live holder's lease; an ended one stays ended.
//!         Ok(self.with_slot(renewal.key, |slot, now| match &mut slot.holder {
//!             Some((holder, _, until)) if holder == renewal.owner => {
//!                 *until = after(now, renewal.ttl);
//!                 true
//!             }
//!             _ => false,
//!         }))
//!     }
//!
//!     async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
//!         Ok(self.with_slot(lease.key, |slot, _| match slot.holder {
//!             Some((holder, _, _)) if holder == *lease.owner => {
//!                 slot.holder = None;
//!                 slot.released.send_modify(|n| *n += 1);
//!                 ReleaseOutcome::Released
//!             }
//!             _ => ReleaseOutcome::NotOwner,
//!         }))
//!     }
//!
//!     async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
//!         // Rule 6: subscribed before the caller tries again, so no release
//!         // between the two is missed.
//!         let mut released = self.with_slot(key, |slot, _| slot.released.subscribe());
//!         Ok(ReleaseNotice::new(async move {
//!             let _ = released.changed().await;
//!         }))
//!     }
//!
//!     async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
//!         Ok(self.with_slot(key, |slot, _| {
//!             let held = slot.holder.take().is_some();
//!             slot.released.send_modify(|n| *n += 1);
//!             held
//!         }))
//!     }
//!
//!     async fn force_release_holding(
//!         &self,
//!         key: &LockKey,
//!         expected: &Holding,
//!     ) -> Result<ForceRelease, LockError> {
//!         // Rule 10: compare the holder named and break it in one step.
//!         let named = dlock_runtime::backend::named_token(self.kind(), key, expected)?;
//!         Ok(self.with_slot(key, |slot, _| {
//!             let now = slot.holder.as_ref().map(|(_, token, _)| Some(*token));
//!             let answer = ForceRelease::compare(now, named);
//!             if answer == ForceRelease::Released {
//!                 slot.holder = None;
//!                 slot.released.send_modify(|n| *n += 1);
//!             }
//!             answer
//!         }))
//!     }
//!
//!     async fn holder(&self, key: &LockKey) -> Result<Option<Holding>, LockError> {
//!         Ok(self.with_slot(key, |slot, now| slot.holding(now)))
//!     }
//!
//!     async fn held(&self, prefix: &str) -> Result<Vec<(String, Holding)>, LockError> {
//!         let keys: Vec<LockKey> = {
//!             let keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
//!             keys.keys().filter(|k| k.as_str().starts_with(prefix)).cloned().collect()
//!         };
//!         let mut held: Vec<(String, Holding)> = keys
//!             .into_iter()
//!             .filter_map(|key| {
//!                 let holding = self.with_slot(&key, |slot, now| slot.holding(now))?;
//!                 Some((key.to_string(), holding))
//!             })
//!             .collect();
//!         held.sort_by(|a, b| a.0.cmp(&b.0));
//!         Ok(held)
//!     }
//!
//!     async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
//!         // Rule 8: acquisitions and releases both bump the channel.
//!         self.subscribe(key).await
//!     }
//! }
//! # }
//!
//! // The shipped suite, every property at once. Each backend it asks for
//! // must reach the same store, as every process reaches one server: here,
//! // the one skeleton's memory.
//! # #[cfg(feature = "conformance")]
//! # #[tokio::main]
//! # async fn main() {
//! # use doc::Skeleton;
//! use std::sync::Arc;
//! let store = Arc::new(Skeleton::default());
//! dlock_runtime::conformance::check_all(|| {
//!     let store = Arc::clone(&store);
//!     async move { store as Arc<dyn dlock_runtime::Backend> }
//! })
//! .await;
//! # }
//! # #[cfg(not(feature = "conformance"))]
//! # fn main() {}
//! ```

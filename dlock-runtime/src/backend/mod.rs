//! The `Backend` trait: the few primitive operations a lock store provides,
//! and the values they take and answer.
//!
//! Everything else (waiting, renewal, the lost signal, release on drop,
//! several keys) is written once in the core on top of these primitives.
//! Owner ids ([`OwnerId`]), loss groups ([`LossGroup`]), release notices
//! ([`ReleaseNotice`]) and the requests ([`AcquireRequest`], [`Renewal`],
//! [`ReleaseRequest`]) have modules of their own.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::{LockError, Operation};
use crate::holder::HolderInfo;
use crate::key::LockKey;
use crate::token::FencingToken;

mod handoff;
mod loss;
mod notice;
mod owner;
mod request;

pub use handoff::{Handoff, QUEUE_ENTRY_TTL, Queue};
pub use loss::LossGroup;
pub(crate) use loss::LossSink;
pub use notice::ReleaseNotice;
pub use owner::OwnerId;
pub(crate) use owner::forks;
pub use request::{Access, AcquireRequest, Look, MAX_IDENTITY_LEN, ReleaseRequest, Renewal};

pub mod implementing;
pub mod kit;

/// A lock store. Implement these primitives and the core gives every lease
/// renewal, the lost signal, waiting, release on drop and multi-key locking.
/// The [`implementing`] chapter builds one from scratch, and the shipped
/// conformance suite (feature `conformance`) checks one against every rule
/// below.
///
/// # The rules every backend keeps
///
/// 1. **One atomic step each.** `try_acquire` sets the holder *and* draws
///    the fencing token in one step; `extend` and `release` compare the
///    owner *and* act in one step. Split, another caller can slip in
///    between (the reference article's `releaseScript`).
/// 2. **Tokens only rise per key**: every grant's token is strictly
///    greater than every token issued before for that key, through any
///    instance of the backend on the store (every process shares one
///    sequence per key: keep the counter in the store, not in the instance),
///    also across a restart of the store. A counter the store can lose (a restart without
///    persistence, a failover, a restore) is floored at the store's clock in
///    microseconds, so it restarts above every earlier token.
/// 3. **A retry by the owner that holds the key is a success**, with the
///    lease's lifetime counted anew from the retry's ttl (the key stays
///    held past the first attempt's expiry, as the caller counts its lease
///    from the retry), and the token already drawn, or a new one (rule 2
///    holds either way; the first answer never reached the caller). Owner
///    ids are random per acquisition, so only a retry of the same
///    acquisition can carry it, and the core retries with the same owner
///    after a reply was lost. A store whose counter can go back (the Redis
///    backend) draws anew, so the clock floor is under the token.
/// 4. **Every lock ends without its holder**: a ttl the store enforces, or a
///    session the store ends when the holder dies. Nothing holds forever.
/// 5. **Keys are data**: passed as arguments, never spliced into code.
///
/// # Callers that give up
///
/// The core never drops a `try_acquire` or a `release` future half-way while
/// a runtime runs: if its own caller gives up (a timeout, a `select!`, an
/// aborted request), the rest of the call runs on in a task of its own, and
/// a grant that arrives after the caller left, or an attempt that failed and
/// may have reached the store anyway, is given back with an owner-checked
/// `release`. Each method's `# Cancel safety` section says what a backend
/// must still guarantee when it is called directly and dropped.
///
/// # Fair mode
///
/// A backend that keeps a queue of waiters per key says so with
/// [`Backend::supports_fair`], and then keeps these rules too:
///
/// - **F1. First come, first served.** `try_acquire` reads
///    [`AcquireRequest::queue`] ([`Queue`]): a fair attempt never takes a
///    key past a live queued entry ahead of it, and a [`Queue::Join`] that
///    does not take the key keeps its owner's place, or joins at the end.
///    A grant takes its owner out of the queue, whatever the attempt's
///    mode: a queued owner that takes the key with a [`Queue::Barge`]
///    attempt is never handed it again.
/// - **F2. A release hands over.** A holder's `release` gives the key to the
///    first live entry in one atomic step: its owner holds it, with a token
///    drawn as an acquisition's (rule 2) and the ttl its attempt asked for
///    (or less, said by [`Grant::valid_for`]), and the waiter's
///    [`Backend::subscribe_handoff`] notice resolves with the grant. An
///    expired entry is skipped; so is one whose waiter the store sees is
///    gone.
/// - **F3. Leaving the queue.** A `release` by an owner that does not hold the
///    key but has an entry removes the entry (and answers `NotOwner`): the
///    core sends it for every fair waiter that gives up, times out or is
///    cancelled, so a handoff that came after the waiter left is passed on
///    by the same call (the owner then holds the key and releases it).
///
/// # Shared locks and permits
///
/// [`AcquireRequest::access`] says how an acquisition holds its key
/// ([`Access`]). A backend that keeps shared holders or numbered permits
/// says which with [`Backend::supports_access`]; the core refuses any
/// other access with [`LockError::InvalidOption`] before anything is sent,
/// rather than lock wrongly. A backend that supports them keeps these rules:
///
/// - **M1. Who coexists.** Shared holders of a key coexist; an exclusive
///    holder coexists with no one. `Permits { permits: n }` holders take
///    numbered slots `0..n`, at most one owner a slot, so at most `n` hold
///    at once; the attempt picks a free slot itself, trying every slot in
///    one atomic step, and answers it in [`Grant::slot`]. A key is used in
///    one way: permit holders and exclusive or shared ones exclude each
///    other, and callers of one key agree on `n`.
/// - **M2. Tokens.** An exclusive grant's token is greater than every
///    token issued before for the key, shared ones included (rule 2). The
///    shared holders of a key form a *read phase*: the first of a phase
///    draws a token as an acquisition does (the counter advanced, floored at
///    the store's clock where the counter can be lost) and records it as
///    the phase token; a shared attempt that finds the phase live (a shared
///    holder still holds) is granted the phase token. The phase ends when
///    its last holder does. So a reader's token is above every writer's
///    before it and not above any token issued after it. A permit's token
///    is drawn anew per grant (rule 2 for the key, so it rises per slot).
/// - **M3. Writers are not starved.** An exclusive attempt of a caller
///    that waits ([`AcquireRequest::waits`]) that finds the key held by
///    shared holders leaves a *writer-waiting mark*: its owner
///    and an expiry [`QUEUE_ENTRY_TTL`] away, refreshed by the same owner's
///    retries, and answers `Held` with `expires_in` no longer than a third
///    of that (so the core retries before the mark runs out). A shared
///    attempt answers `Held` while a live mark of any owner stands, even in
///    a live phase. The mark goes when its owner is granted the key, or
///    sends a `release` (which answers `NotOwner`, and wakes waiters as a
///    release does): the core sends one for every exclusive waiter that
///    gives up, times out or is cancelled on a backend that supports
///    [`Access::Shared`]. A mark whose owner vanished lives its expiry. A
///    caller that does not wait leaves no mark (and sends no release).
/// - **M4. Renewals and releases name the side.** [`Renewal`] and
///    [`ReleaseRequest`] carry the lease's access and slot; a shared or
///    permit lease is extended and released on its own side (its slot) and
///    only there. A `release` of a permit whose slot is `None` (an attempt
///    abandoned before its answer) releases the owner's slot, whichever it
///    is. The last shared holder's release, and a permit's, announce a
///    release as an exclusive one does ([`Backend::subscribe`]).
/// - **M5. Same lifecycle.** Every shared holder and every permit ends by
///   its own ttl (rule 4); a retry by an owner that holds is a success
///   (rule 3) with its slot, or with the phase token.
///
/// # Waiting behind this process's own waiters
///
/// [`AcquireRequest::look`] says where in its wait an attempt stands
/// ([`Look`]). A backend may answer a [`Look::First`] attempt, or a
/// [`Look::Subscribed`] one whose notice is queued behind another waiter
/// of this process, with [`Attempt::Behind`] instead of asking its store,
/// but only when every release it announces wakes a waiter of this process
/// that then asks the store, the waiter ahead will be woken before the
/// caller, and the answer bounds the caller's nap by the earliest expiry
/// the store last told of (so a holder that ends by its ttl, which
/// announces nothing, is noticed as soon as it would have been). A
/// [`Look::Again`] attempt always asks the store. The core, in turn, never
/// lets a caller whose every answer was `Behind` wait long or fail on the
/// backend's word: it asks with [`Look::Again`] within 200 ms, or at its
/// deadline if that comes first.
///
/// Each rule fits in one round trip per attempt: a Redis script reads the
/// readers' hash, the mark and the slots and answers; PostgreSQL takes
/// `pg_try_advisory_lock_shared` on an owned session (the mark in a row).
///
/// [`implementing`]: crate::backend::implementing
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// The kind of store, for errors and traces (`"memory"`, `"file"`, …).
    fn kind(&self) -> &'static str;

    /// Takes `request.key` for `request.owner` for `request.ttl` if nobody
    /// holds it, drawing a fencing token greater than every token issued for
    /// the key before (rules 1 and 2). A retry by the owner that holds it
    /// answers `Acquired` (rule 3).
    ///
    /// When someone else holds it, the answer is [`Attempt::Held`] with how
    /// long the holder's lease has left if the store knows it (the core
    /// looks again then even if no release is announced), or `None` if it
    /// does not (the core then relies on the release notice).
    ///
    /// # Cancel safety
    ///
    /// Dropped half-way, at any of its await points, the attempt may still
    /// take the key on the store; it must then end by the ttl (rule 4).
    /// In-process state must not be left blocking the key: once that ttl is
    /// over, another owner's attempt must get the key.
    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError>;

    /// Sets the remaining lifetime of `renewal.owner`'s lease on
    /// `renewal.key` to `renewal.ttl`. `Ok(false)` when that owner no longer
    /// holds the key (the core then marks the lease lost): its lease was
    /// released, broken, or ran out, whether or not anyone held the key
    /// since. An extend never takes a key: a lease that ended stays ended,
    /// and the key stays free for others.
    ///
    /// # Cancel safety
    ///
    /// Dropping it only loses the answer: the core counts a renewal without
    /// an answer as failed and retries until the lease's validity runs out.
    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError>;

    /// Renews several leases at once: exactly one answer per lease, in
    /// order, each meaning what [`Backend::extend`]'s answer means. The
    /// core's renewal gathers the leases that are due together and sends
    /// them here, so a backend that can answer many in one round trip (a
    /// Redis pipeline, one check of a PostgreSQL session) should override
    /// this; the default calls `extend` for each in turn.
    ///
    /// Each lease gets its own answer: in one batch, a lease that ended (or
    /// that its owner does not hold) is answered `Ok(false)` and changed in
    /// nothing, while the held ones beside it, before or after, are renewed
    /// and answered `Ok(true)`. On a partial failure, likewise, one lease's
    /// error (a type error on its key, say) must not fail the others, and a
    /// failure of the whole batch (a lost connection) is an `Err` for every
    /// lease. A missing answer counts as a failure of that lease.
    ///
    /// # Cancel safety
    ///
    /// As [`Backend::extend`]: dropping it only loses the answers.
    async fn extend_many(&self, renewals: &[Renewal<'_>]) -> Vec<Result<bool, LockError>> {
        let mut answers = Vec::with_capacity(renewals.len());
        for renewal in renewals {
            answers.push(self.extend(renewal).await);
        }
        answers
    }

    /// Releases `lease.key` if `lease.owner` holds it; see
    /// [`ReleaseOutcome`] for the answers. Nothing is changed when that
    /// owner does not hold it.
    ///
    /// # Cancel safety
    ///
    /// Dropped half-way, the key may stay held until its ttl (rule 4), never
    /// longer, and in-process state must not be left blocking the key.
    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError>;

    /// Registers interest in the release of `key`. The caller then tries
    /// the key and waits on the notice only if that attempt found it held;
    /// the notice must resolve on the release of the lease that attempt
    /// found (or of any later one; an expiry the backend can see may wake
    /// it too), so that a waiter can never miss the release between the
    /// two steps. Backends may rely on that attempt: the Redis backend
    /// publishes a release only when an attempt found the key held. A notice
    /// that cannot promise that says how soon to look again
    /// ([`ReleaseNotice::recheck_within`]); one that wakes only some
    /// waiters passes the wake-up on ([`ReleaseNotice::passing_on`]).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a subscription dropped before it returned, or a notice
    /// dropped unresolved, leaves nothing registered.
    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError>;

    /// How much longer than its ttl the store may keep a lease that is not
    /// renewed: the granularity of its expiry (etcd counts lease ttls in
    /// whole seconds, with a minimum) and how often it sweeps expired
    /// leases. The holder is told its lease is lost at the ttl whatever the
    /// store does; this is how much later, at most, others find the key
    /// free. A longer hold keeps exclusion; it is never shorter. The
    /// conformance suite waits this much longer for an expiry. The default
    /// is zero: the store ends a lease at its ttl.
    fn expiry_slack(&self) -> Duration {
        Duration::ZERO
    }

    /// Whether this backend keeps fair queues (rules F1 to F3, and
    /// [`Backend::subscribe_handoff`]). The core refuses a fair acquisition
    /// on a backend that answers `false` (the default) with
    /// [`LockError::InvalidOption`], rather than lock unfairly.
    fn supports_fair(&self) -> bool {
        false
    }

    /// Whether this backend keeps `access` (rules M1 to M5). The core
    /// refuses an acquisition with any other access with
    /// [`LockError::InvalidOption`] before anything is sent. The default
    /// keeps [`Access::Exclusive`] only.
    fn supports_access(&self, access: Access) -> bool {
        matches!(access, Access::Exclusive)
    }

    /// Fair mode, a hint read without I/O: whether fair waiters of this
    /// process are queued on `key` now, listening for a handoff. The core
    /// then skips its [`Queue::Respect`] try, which could only find the
    /// queue taken, and queues at once ([`Backend::subscribe_handoff`],
    /// then [`Queue::Join`]). Either answer is safe and fair: a wrong
    /// `true` costs nothing (a `Join` takes a free key with an empty queue
    /// as the try would), a wrong `false` one losing attempt. Answer `true`
    /// only where `subscribe_handoff` then costs no round trip. The default
    /// is `false`.
    fn queued_here(&self, key: &LockKey) -> bool {
        let _ = key;
        false
    }

    /// Fair mode: registers interest in a release handing `key` to `owner`,
    /// before the [`Queue::Join`] attempt that queues it (so no handoff is
    /// missed between the two). The notice resolves with the grant of the
    /// handed-over lease. The default answers an error: only backends that
    /// [support fair mode](Backend::supports_fair) are asked.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a registration dropped before it returned, or a notice
    /// dropped unresolved, leaves nothing registered. A notice dropped after
    /// a handoff reached it leaves the key held by the owner: the core then
    /// releases it (rule F3).
    async fn subscribe_handoff(
        &self,
        key: &LockKey,
        owner: &OwnerId,
    ) -> Result<Handoff, LockError> {
        let _ = owner;
        Err(LockError::backend(
            self.kind(),
            Operation::Wait,
            key.as_str(),
            format!("the {} backend has no fair mode", self.kind()),
        ))
    }

    /// Administrative: releases `key` whoever holds it. Its holder finds out
    /// at its next renewal (or at once, through its loss group) and sees its
    /// lease lost. `Ok(false)` if the key was not held.
    ///
    /// It breaks whoever holds the key when the call reaches the store: to
    /// break only a holder that was read and shown first (an operator's
    /// confirmation takes a while), use [`Backend::force_release_holding`].
    ///
    /// # Cancel safety
    ///
    /// Dropped half-way, the lock may or may not be broken; the call can be
    /// repeated.
    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError>;

    /// Administrative: breaks `key` as [`Backend::force_release`] does, but
    /// only if its holder is still the lease `expected` names, a
    /// [`Backend::holder`] answer read before: the lease whose fencing token
    /// is `expected.token` (tokens rise per key, so no two leases share one;
    /// the shared holders of one read phase share it, and the phase is that
    /// lease). The comparison and the break are one atomic step (a script,
    /// one statement, a transaction, the store's own lock), so a holder that
    /// changed between the read and this call is never broken instead:
    /// the answer is then [`ForceRelease::HolderChanged`], or
    /// [`ForceRelease::NotHeld`] when nobody holds the key, and nothing is
    /// changed.
    ///
    /// A holding without a token cannot be told from a later holder's: it
    /// is refused with an error, and nothing is changed. So is every call
    /// to the default, for a backend that does not implement it: refusing is
    /// safe, breaking whoever holds the key would not be.
    ///
    /// # Cancel safety
    ///
    /// As [`Backend::force_release`]: dropped half-way, the named lease may
    /// or may not be broken (never another); the call can be repeated.
    async fn force_release_holding(
        &self,
        key: &LockKey,
        expected: &Holding,
    ) -> Result<ForceRelease, LockError> {
        let _ = expected;
        Err(LockError::backend(
            self.kind(),
            Operation::Release,
            key.as_str(),
            format!(
                "the {} backend cannot break only a named holder's lease; nothing was released",
                self.kind()
            ),
        ))
    }

    /// Who holds `key` now: `None` when nobody does. The answer carries the
    /// identity the acquisition recorded ([`AcquireRequest::identity`]) and
    /// its token when the store keeps them beside the lock, and how long the
    /// lease has left if the store knows. Leader election reads the leader
    /// with it.
    ///
    /// A store must record an acquisition's identity and token in the same
    /// atomic step that takes the key, or leave them unreported until they
    /// are written ([`Holding::identity`] `None`): a reader must never see
    /// a holder paired with the identity or the token of an earlier lease.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    async fn holder(&self, key: &LockKey) -> Result<Option<Holding>, LockError>;

    /// Registers interest in the next change of `key`'s holder: a notice
    /// that resolves on a release (as [`Backend::subscribe`]'s does) and on
    /// an acquisition that recorded an identity. Register first, then read
    /// [`Backend::holder`]: a change after the read wakes the notice.
    ///
    /// A store that cannot announce one of them sets
    /// [`ReleaseNotice::recheck_within`] to how soon the reader must look
    /// again; a notice without it promises to resolve on every such change.
    /// Unlike [`Backend::subscribe`], no attempt on the key comes first: a
    /// store that publishes releases only to waiters it knows of (the Redis
    /// backend) publishes every release of a lease taken with an identity.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a registration dropped before it returned, or a notice
    /// dropped unresolved, leaves nothing registered.
    async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError>;

    /// Every key held now whose name starts with `prefix` (all of them for
    /// `""`), each with its [`Backend::holder`] answer, sorted by key. The
    /// `dlock list` inspector reads it. A store that cannot enumerate its
    /// locks answers an error ([`Operation::List`]), never a short list:
    /// the default does, so a backend that overrides nothing says so.
    ///
    /// A lock whose key name the store does not keep (a PostgreSQL advisory
    /// lock taken without a record) cannot be listed; each backend's module
    /// says which those are.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only reads.
    async fn held(&self, prefix: &str) -> Result<Vec<(String, Holding)>, LockError> {
        Err(LockError::backend(
            self.kind(),
            Operation::List,
            prefix,
            format!("the {} backend cannot list the keys it holds", self.kind()),
        ))
    }
}

/// Who holds a key, as [`Backend::holder`] reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holding {
    /// The holder's fencing token, when the store can tell it.
    pub token: Option<FencingToken>,
    /// The identity its acquisition recorded, if it recorded one.
    pub identity: Option<String>,
    /// How long its lease has left unless renewed, when the store knows:
    /// never less than the lease has, so the key is free by then unless
    /// renewed. A store that tells time left coarsely rounds up, and adds
    /// how late it may delete an expired lease's key (within
    /// [`Backend::expiry_slack`]).
    pub expires_in: Option<Duration>,
    /// The host, pid and label its acquisition recorded, and how long it
    /// has held the key, when the store keeps them (see [`crate::holder`]).
    pub holder: Option<HolderInfo>,
}

impl Holding {
    /// A holding with the given token and identity, and no known expiry.
    pub fn new(token: Option<FencingToken>, identity: Option<String>) -> Self {
        Self {
            token,
            identity,
            expires_in: None,
            holder: None,
        }
    }

    /// The same holding, whose lease has `expires_in` left.
    pub fn expiring_in(mut self, expires_in: Duration) -> Self {
        self.expires_in = Some(expires_in);
        self
    }

    /// The same holding, whose acquisition recorded `holder`.
    pub fn held_by(mut self, holder: Option<HolderInfo>) -> Self {
        self.holder = holder;
        self
    }
}

/// The answer to one [`Backend::force_release_holding`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForceRelease {
    /// The lease named held the key, and is broken: its holder sees its
    /// lease lost.
    Released,
    /// Another lease holds the key now: nothing was changed.
    HolderChanged,
    /// Nobody holds the key: nothing was changed.
    NotHeld,
}

impl ForceRelease {
    /// The answer for a key whose holder now has token `now` (`None`: the
    /// key is free), when the lease named had token `named`: `Released`
    /// when they are the same (the caller then breaks the lease, in the
    /// same atomic step as the read).
    pub fn compare(now: Option<Option<FencingToken>>, named: FencingToken) -> Self {
        match now {
            None => Self::NotHeld,
            Some(Some(token)) if token == named => Self::Released,
            Some(_) => Self::HolderChanged,
        }
    }
}

/// The token a [`Backend::force_release_holding`] call compares: the
/// holding's, or the error that refuses a holding without one.
pub fn named_token(
    kind: &'static str,
    key: &LockKey,
    expected: &Holding,
) -> Result<FencingToken, LockError> {
    expected.token.ok_or_else(|| {
        LockError::backend(
            kind,
            Operation::Release,
            key.as_str(),
            "the holder named has no fencing token, so it cannot be told from a later \
             holder; nothing was released",
        )
    })
}

/// The answer to one [`Backend::try_acquire`].
#[non_exhaustive]
pub enum Attempt {
    /// The key was free (or already this owner's) and is now held by the
    /// caller.
    Acquired(Grant),
    /// Someone else holds the key.
    Held {
        /// How long until the current holder's lease runs out unless
        /// renewed, if the store knows: the waiter looks again then even if
        /// no release is announced. `None` when it does not know (a lock of
        /// another process whose ttl it cannot see): the waiter then relies
        /// on the release notice.
        expires_in: Option<Duration>,
    },
    /// Someone else holds the key, answered without asking the store: a
    /// waiter of this process queued ahead of the caller is woken first by
    /// the next release and asks the store then (see "Waiting behind this
    /// process's own waiters" on [`Backend`]). Only ever the answer to a
    /// [`Look::First`] or [`Look::Subscribed`] attempt of a caller that
    /// waits.
    Behind {
        /// How long until the earliest expiry the store last told of: the
        /// caller looks again then even if nothing wakes it.
        expires_in: Duration,
    },
}

impl fmt::Debug for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attempt::Acquired(grant) => f.debug_tuple("Acquired").field(&grant.token).finish(),
            Attempt::Held { expires_in } => f
                .debug_struct("Held")
                .field("expires_in", expires_in)
                .finish(),
            Attempt::Behind { expires_in } => f
                .debug_struct("Behind")
                .field("expires_in", expires_in)
                .finish(),
        }
    }
}

/// A successful acquisition.
#[non_exhaustive]
pub struct Grant {
    /// The fencing token of this acquisition.
    pub token: FencingToken,
    /// The group whose end the backend announces when it learns by itself
    /// that the lease is gone, before renewal would (`None` when only
    /// renewal can tell).
    pub loss: Option<Arc<LossGroup>>,
    /// A handed-over lease that the store keeps for less than the ttl until
    /// its first renewal (so that a handoff to a waiter that has gone ends
    /// soon): how long, from the waiter's latest attempt answered `Held`.
    /// `None`: the ttl.
    pub valid_for: Option<Duration>,
    /// The permit slot taken, in `0..permits` ([`Access::Permits`]);
    /// `None` for other access.
    pub slot: Option<u32>,
}

impl Grant {
    /// A grant whose loss only renewal can detect.
    pub fn new(token: FencingToken) -> Self {
        Self {
            token,
            loss: None,
            valid_for: None,
            slot: None,
        }
    }

    /// The same grant, of permit slot `slot`.
    pub fn in_slot(mut self, slot: u32) -> Self {
        self.slot = Some(slot);
        self
    }

    /// The same grant, of a handed-over lease the store keeps `valid_for`
    /// until its first renewal.
    pub fn valid_for(mut self, valid_for: Duration) -> Self {
        self.valid_for = Some(valid_for);
        self
    }

    /// A grant whose loss the backend announces through `group` (every
    /// lease on one PostgreSQL session, say).
    pub fn lost_with(mut self, group: Arc<LossGroup>) -> Self {
        self.loss = Some(group);
        self
    }
}

/// The answer to one [`Backend::release`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The caller held the key, and now nobody does.
    Released,
    /// The caller did not hold the key (its lease had run out, or was
    /// broken or taken over); nothing was changed.
    NotOwner,
    /// The reply to a first request was lost (a broken connection) and a
    /// retry found the key not held by the caller: either the lost request
    /// released it, or the lease had ended before. The core decides with
    /// the lease's own deadline: a release *sent* while the lease was still
    /// valid by the holder's clock let go of a key that was still the
    /// holder's, whether the lost request freed it or the ttl did after it.
    Unconfirmed,
}

impl ReleaseOutcome {
    /// `Released` for `true`, `NotOwner` for `false`.
    pub fn from_released(released: bool) -> Self {
        if released {
            Self::Released
        } else {
            Self::NotOwner
        }
    }
}

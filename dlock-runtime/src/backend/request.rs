//! What the core asks of a backend: an acquisition (its access, its
//! queue rule, its identity and holder record), a renewal and a release.

use super::*;

/// The longest identity an acquisition may record, in bytes.
pub const MAX_IDENTITY_LEN: usize = 256;

/// How an acquisition holds its key (rules M1 to M5 on [`Backend`]).
///
/// `#[non_exhaustive]`: a backend outside dlock ends each `match` on it with
/// a `_` arm. [`Backend::supports_access`] answers `false` there, and the
/// core then never sends an access the backend does not know; the other
/// primitives may refuse one with [`LockError::InvalidOption`] naming
/// [`option`](Self::option).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Access {
    /// Alone: today's lock, the write side of a read-write lock.
    #[default]
    Exclusive,
    /// Beside other shared holders, never beside an exclusive one: the
    /// read side of a read-write lock.
    Shared,
    /// One of `permits` numbered slots: at most `permits` holders at once.
    Permits {
        /// How many may hold the key at once (at least 1).
        permits: u32,
    },
}

impl Access {
    /// The option a caller sets for this access (`"mode"` or `"permits"`),
    /// for errors.
    pub fn option(self) -> &'static str {
        match self {
            Access::Exclusive | Access::Shared => "mode",
            Access::Permits { .. } => "permits",
        }
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Access::Exclusive => f.write_str("exclusive"),
            Access::Shared => f.write_str("shared"),
            Access::Permits { permits } => write!(f, "{permits} permits"),
        }
    }
}

/// What [`Backend::try_acquire`] is asked to take. More terms will come as
/// fields, so a backend reads the fields it knows; the core builds it.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct AcquireRequest<'a> {
    /// The key to take.
    pub key: &'a LockKey,
    /// The random identity of this acquisition (rule 3).
    pub owner: &'a OwnerId,
    /// How long the lease lasts unless renewed.
    pub ttl: Duration,
    /// Who the acquirer says it is (a leader election's campaigner), to be
    /// recorded beside the lock with the token for [`Backend::holder`]:
    /// at most [`MAX_IDENTITY_LEN`] bytes, no control characters. `None`
    /// records nothing.
    pub identity: Option<&'a str>,
    /// The application label of the acquiring process
    /// ([`crate::Registry::set_label`]), recorded with its host and pid
    /// unless the backend carries a label of its own.
    pub label: Option<&'a str>,
    /// How the attempt stands toward the key's queue of fair waiters
    /// (rules F1 to F3); [`Queue::Barge`] for a plain lock.
    pub queue: Queue,
    /// How the key is held (rules M1 to M5); [`Access::Exclusive`] unless
    /// the backend [supports](Backend::supports_access) another.
    pub access: Access,
    /// Whether the caller waits for the key if this attempt is refused
    /// (it will try again): only a waiting writer leaves a writer-waiting
    /// mark (rule M3). `false` unless set.
    pub waits: bool,
    /// Where in the caller's wait this attempt stands; [`Look::Again`]
    /// (ask the store) unless set. See "Waiting behind this process's own
    /// waiters" on [`Backend`].
    pub look: Look,
}

/// Where in its caller's wait an attempt stands
/// ([`AcquireRequest::look`]): what lets a backend answer a caller that
/// arrives behind waiters of its own process without asking its store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Look {
    /// The caller's first attempt, before it waits for anything.
    First,
    /// The attempt right after the caller subscribed to the key's release
    /// notice ([`Backend::subscribe`]), before it napped: it catches a
    /// release that came between the first attempt and the subscription.
    Subscribed {
        /// Whether the caller's notice is queued behind another waiter of
        /// this process that a release wakes first
        /// ([`ReleaseNotice::is_queued_behind`]).
        queued_behind: bool,
    },
    /// Any other attempt: after a nap (a release notice, a holder's
    /// expiry, the safety net), after a failure, or made on its own. The
    /// store is asked.
    Again,
}

impl<'a> AcquireRequest<'a> {
    /// A request for an exclusive lock on `key` for `owner`, for `ttl`.
    pub fn new(key: &'a LockKey, owner: &'a OwnerId, ttl: Duration) -> Self {
        Self {
            key,
            owner,
            ttl,
            identity: None,
            label: None,
            queue: Queue::Barge,
            access: Access::Exclusive,
            waits: false,
            look: Look::Again,
        }
    }

    /// The same request, from a caller that waits (`true`) or not.
    pub fn with_waits(mut self, waits: bool) -> Self {
        self.waits = waits;
        self
    }

    /// The same request, standing in its caller's wait as `look` says.
    pub fn with_look(mut self, look: Look) -> Self {
        self.look = look;
        self
    }

    /// The same request, holding the key as `access` says.
    pub fn with_access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }

    /// The same request, standing toward the key's queue as `queue` says.
    pub fn with_queue(mut self, queue: Queue) -> Self {
        self.queue = queue;
        self
    }

    /// The same request, recording `identity` beside the lock.
    pub fn with_identity(mut self, identity: Option<&'a str>) -> Self {
        self.identity = identity;
        self
    }

    /// The same request, from a process labelled `label`.
    pub fn with_label(mut self, label: Option<&'a str>) -> Self {
        self.label = label;
        self
    }

    /// The holder record to keep beside the lock ([`HolderInfo::encode`]):
    /// this process's host and pid, and `backend_label` if the backend has
    /// one, else the request's label.
    pub fn holder_record(&self, backend_label: Option<&str>) -> String {
        HolderInfo::this_process(backend_label.or(self.label)).encode()
    }
}

/// One lease to renew ([`Backend::extend`], [`Backend::extend_many`]).
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Renewal<'a> {
    /// The leased key.
    pub key: &'a LockKey,
    /// The owner that holds it.
    pub owner: &'a OwnerId,
    /// The lifetime to set.
    pub ttl: Duration,
    /// The identity the lease was taken with, if any, and its token: a
    /// store that keeps the identity apart from the lock (Redis, PostgreSQL)
    /// writes the record again if it went missing (an operator deleted it,
    /// a table was truncated), so a lost record hides a leader for at most
    /// one renewal interval.
    pub recorded: Option<(&'a str, FencingToken)>,
    /// How the lease holds the key, and the permit slot it holds (rule M4).
    pub access: Access,
    /// The permit slot ([`Grant::slot`]); `None` for other access.
    pub slot: Option<u32>,
    /// How long the lease stays valid, from when the renewal is sent, if
    /// this renewal does not go through; `None` if not known (a renewal
    /// sent outside the lease scheduler). A backend that waits for an
    /// answer, or tries more than once, within one renewal keeps each try
    /// to a share of it, so an answer that never comes does not use up the
    /// time in which a retry could still keep the lease (etcd: a request
    /// stuck on a dead leader member).
    pub time_left: Option<Duration>,
}

impl<'a> Renewal<'a> {
    /// A renewal of `owner`'s lease on `key` for `ttl`.
    pub fn new(key: &'a LockKey, owner: &'a OwnerId, ttl: Duration) -> Self {
        Self {
            key,
            owner,
            ttl,
            recorded: None,
            access: Access::Exclusive,
            slot: None,
            time_left: None,
        }
    }

    /// The same renewal, of a lease that stays valid for `left` from when
    /// the renewal is sent if the renewal does not go through
    /// ([`Renewal::time_left`]).
    pub fn expiring_in(mut self, left: Duration) -> Self {
        self.time_left = Some(left);
        self
    }

    /// The same renewal, of a lease held as `access` (in `slot`, for a
    /// permit).
    pub fn holding(mut self, access: Access, slot: Option<u32>) -> Self {
        self.access = access;
        self.slot = slot;
        self
    }

    /// The same renewal, of a lease taken with `identity` that drew `token`.
    pub fn recording(mut self, identity: &'a str, token: FencingToken) -> Self {
        self.recorded = Some((identity, token));
        self
    }
}

/// One lease to end ([`Backend::release`]).
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct ReleaseRequest<'a> {
    /// The leased key.
    pub key: &'a LockKey,
    /// The owner that holds it.
    pub owner: &'a OwnerId,
    /// How the lease holds the key (rule M4).
    pub access: Access,
    /// The permit slot, if known: `None` for other access, and for a permit
    /// attempt abandoned before its answer (the owner's slot, whichever).
    pub slot: Option<u32>,
}

impl<'a> ReleaseRequest<'a> {
    /// The release of `owner`'s lease on `key`.
    pub fn new(key: &'a LockKey, owner: &'a OwnerId) -> Self {
        Self {
            key,
            owner,
            access: Access::Exclusive,
            slot: None,
        }
    }

    /// The same release, of a lease held as `access` (in `slot`, for a
    /// permit).
    pub fn holding(mut self, access: Access, slot: Option<u32>) -> Self {
        self.access = access;
        self.slot = slot;
        self
    }
}

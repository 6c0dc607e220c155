//! The `Backend` trait: the few primitive operations a lock store provides,
//! and the values they take and answer.
//!
//! Everything else (waiting, renewal, the lost signal, release on drop,
//! several keys) is written once in the core on top of these primitives.
//! Owner ids ([`OwnerId`]), loss groups ([`LossGroup`]) and release notices
//! ([`ReleaseNotice`]) have modules of their own.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::LockError;
use crate::key::LockKey;
use crate::token::FencingToken;

mod loss;
mod notice;
mod owner;

pub use loss::LossGroup;
pub(crate) use loss::LossSink;
pub use notice::ReleaseNotice;
pub use owner::OwnerId;

/// A lock store. Implement these primitives and the core gives every lease
/// renewal, the lost signal, waiting, release on drop and multi-key locking.
///
/// All operations must be atomic on the store: `try_acquire` sets the owner
/// and draws the fencing token in one step, and `extend`/`release` compare
/// the owner and act in one step.
///
/// Callers that give up: the core never drops a `try_acquire` or a
/// `release` future half-way while a runtime runs. If its own caller gives
/// up (a timeout, a `select!`, an aborted request), the rest of the call
/// runs on in a task of its own, and a grant that arrives after the caller
/// left, or an attempt that failed and may have reached the store anyway
/// (a lost reply), is given back with an owner-checked `release`. A
/// `try_acquire` that answers `Ok(Attempt::Acquired)` for an `owner` that
/// already holds the key (a retry after a lost reply) is what lets the core
/// retry safely.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// The kind of store, for errors and traces (`"memory"`, `"file"`, …).
    fn kind(&self) -> &'static str;

    /// Takes `key` for `owner` for `ttl` if nobody holds it, drawing a
    /// fencing token greater than every token issued for `key` before.
    async fn try_acquire(
        &self,
        key: &LockKey,
        owner: &OwnerId,
        ttl: Duration,
    ) -> Result<Attempt, LockError>;

    /// Sets the remaining lifetime of `owner`'s lease on `key` to `ttl`.
    /// `Ok(false)` when `owner` no longer holds `key`.
    async fn extend(
        &self,
        key: &LockKey,
        owner: &OwnerId,
        ttl: Duration,
    ) -> Result<bool, LockError>;

    /// Renews several leases at once: one answer per lease, in order, each
    /// meaning what [`Backend::extend`]'s answer means. The core's renewal
    /// gathers the leases that are due together and sends them here, so a
    /// backend that can answer many in one round trip (a Redis pipeline,
    /// one check of a PostgreSQL session) should override this; the default
    /// calls `extend` for each in turn.
    async fn extend_many(&self, leases: &[Renewal<'_>]) -> Vec<Result<bool, LockError>> {
        let mut answers = Vec::with_capacity(leases.len());
        for lease in leases {
            answers.push(self.extend(lease.key, lease.owner, lease.ttl).await);
        }
        answers
    }

    /// Releases `key` if `owner` holds it; see [`ReleaseOutcome`] for the
    /// answers. Nothing is changed when `owner` does not hold it.
    async fn release(&self, key: &LockKey, owner: &OwnerId) -> Result<ReleaseOutcome, LockError>;

    /// Registers interest in the release of `key`. The notice must resolve
    /// after any release (or expiry the backend can see) that happens after
    /// this call returns, so that a waiter that subscribes and then tries
    /// again can never miss the release between the two steps.
    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError>;

    /// Administrative: releases `key` whoever holds it. Its holder finds out
    /// at its next renewal and sees its lease lost. `Ok(false)` if the key
    /// was not held.
    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError>;
}

/// The answer to one [`Backend::try_acquire`].
pub enum Attempt {
    /// The key was free and is now held by the caller.
    Acquired(Grant),
    /// Someone else holds the key.
    Held {
        /// How long until the current holder's lease runs out, if the
        /// backend knows: the waiter retries then even if no release is
        /// announced.
        expires_in: Option<Duration>,
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
        }
    }
}

/// A successful acquisition.
pub struct Grant {
    /// The fencing token of this acquisition.
    pub token: FencingToken,
    /// The group whose end the backend announces when it learns by itself
    /// that the lease is gone, before renewal would (`None` when only
    /// renewal can tell).
    pub loss: Option<Arc<LossGroup>>,
}

impl Grant {
    /// A grant whose loss only renewal can detect.
    pub fn new(token: FencingToken) -> Self {
        Self { token, loss: None }
    }
}

/// One lease to renew in a [`Backend::extend_many`] batch.
#[derive(Clone, Copy, Debug)]
pub struct Renewal<'a> {
    /// The leased key.
    pub key: &'a LockKey,
    /// The owner that holds it.
    pub owner: &'a OwnerId,
    /// The lifetime to set.
    pub ttl: Duration,
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
    /// the lease's own deadline: a retry answered while the lease was still
    /// valid by the holder's clock means the first request released it.
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

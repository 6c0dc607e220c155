//! Fair mode's vocabulary: how an attempt stands toward a key's queue of
//! waiters ([`Queue`]), and how a queued waiter learns that a release
//! handed it the key ([`Handoff`]).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use super::Grant;

/// How long a queued waiter's entry lives unless its waiter refreshes it:
/// the core refreshes it (another [`Queue::Join`] attempt) every third of
/// this. A waiter that died or went away without leaving the queue blocks
/// it for at most this long.
pub const QUEUE_ENTRY_TTL: Duration = Duration::from_secs(3);

/// How an attempt stands toward the key's queue of fair waiters
/// ([`crate::LockOptions::fair`]). A backend that keeps queues says so with
/// [`Backend::supports_fair`](super::Backend::supports_fair); the core
/// never sends anything but [`Queue::Barge`] to one that does not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Queue {
    /// Today's lock: take the key if nobody holds it, whoever waits.
    #[default]
    Barge,
    /// A fair caller's first try: take the key only if nobody holds it and
    /// no live entry waits in its queue; join nothing either way. An
    /// uncontended fair acquisition costs what a plain one does.
    Respect,
    /// A fair waiter's attempt: take the key if nobody holds it and this
    /// owner's entry is the first live one in the queue (or the queue has
    /// none); otherwise join the queue at its end, or keep the place this
    /// owner already has, and answer [`Attempt::Held`](super::Attempt::Held).
    /// The entry lives `entry_ttl` from this attempt unless refreshed by
    /// another `Join`; an expired entry is skipped as if it were not there.
    Join {
        /// How long the entry lives from this attempt (the core sends
        /// [`QUEUE_ENTRY_TTL`]).
        entry_ttl: Duration,
    },
}

impl Queue {
    /// True for [`Queue::Respect`] and [`Queue::Join`]: the attempt is a
    /// fair caller's.
    pub fn is_fair(self) -> bool {
        !matches!(self, Queue::Barge)
    }
}

/// A future that resolves when a release handed the key to the queued
/// owner that registered it ([`Backend::subscribe_handoff`]), with the
/// grant of the lease it now holds: the waiter holds the key without
/// another attempt.
///
/// The grant's lease is counted from the send of the waiter's latest
/// attempt that was answered `Held` (the handoff came after it), for
/// [`Grant::valid_for`] if set, else the request's ttl.
///
/// It may never resolve (a dropped channel, a handoff to an entry that had
/// expired): the waiter's periodic [`Queue::Join`] attempt then finds the
/// key its own (rule 3) or takes it as the first live entry.
///
/// [`Backend::subscribe_handoff`]: super::Backend::subscribe_handoff
#[must_use = "a handoff notice only tells of a handoff while it is awaited"]
pub struct Handoff {
    wait: Pin<Box<dyn Future<Output = Grant> + Send + 'static>>,
}

impl Handoff {
    /// A notice that resolves with the grant `wait` resolves with.
    pub fn new(wait: impl Future<Output = Grant> + Send + 'static) -> Self {
        Self {
            wait: Box::pin(wait),
        }
    }
}

impl Future for Handoff {
    type Output = Grant;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Grant> {
        self.wait.as_mut().poll(cx)
    }
}

impl fmt::Debug for Handoff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handoff").finish_non_exhaustive()
    }
}

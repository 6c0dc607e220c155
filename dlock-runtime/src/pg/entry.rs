//! What this process knows of each key it holds or is taking: its owner,
//! the state of its attempt or hold, and, once held, the session, the
//! advisory key claimed there, the token and the deadline.
//!
//! Its own file because every path of the backend (locks, releases,
//! renewals, fair waiters, holder reads) reads or moves these, and a
//! newcomer meets them before any statement.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::time::Instant;

use super::deadlines::{Deadlines, Slot};
use super::session::LockSession;
use crate::backend::OwnerId;
use crate::token::FencingToken;

/// What this process knows of one key it holds or is taking.
pub(super) struct Entry {
    pub(super) owner: OwnerId,
    /// Dropped with the entry, which wakes this process's waiters; made
    /// only once a waiter of this process asks (most keys never have one).
    pub(super) gone: Option<watch::Sender<()>>,
    pub(super) state: State,
}

pub(super) enum State {
    /// An attempt is on its way to the server.
    Acquiring,
    /// Held on `session`.
    Held(Holding),
    /// An unlock is on its way to the server.
    Releasing,
}

/// Made only once `session` granted a `claim` of
/// `advisory_key`, which its drop gives back: so a session's claims are
/// exactly the advisory keys of the `Held` entries on it (and, while it
/// runs, the one of a failed lock statement's undo).
pub(super) struct Holding {
    pub(super) session: Arc<LockSession>,
    pub(super) advisory_key: i64,
    /// The token drawn for it, for a retry by the same owner.
    pub(super) token: FencingToken,
    /// Whether its lock statement wrote a holder record (which its unlock
    /// deletes with an identity, or leaves for the session's batch delete).
    pub(super) recorded: bool,
    /// Whether a named lease's token marks were taken (see `names`): its
    /// unlock drops them if they were. `None` for other leases.
    pub(super) marks: Option<bool>,
    /// A named lease's place among the backend's marked leases, given
    /// back when the hold ends, however it ends (see `names::MAX_MARKED`).
    pub(super) _mark_slot: Option<super::names::MarkSlot>,
    /// The identity recorded beside the lock, with what a renewal writes
    /// again should the record go missing, if its lock statement wrote a
    /// record with an identity.
    pub(super) identity: Option<Box<Identified>>,
    /// When the backend unlocks the key unless it is extended (the
    /// deadline), and the hold's place in the backend's deadline queue, which
    /// it leaves when the hold ends.
    pub(super) deadline_slot: Slot,
    pub(super) deadlines: Arc<Deadlines>,
}

/// The record of a lease taken with an identity, as its lock statement
/// wrote it: what a renewal writes again (see `holders_rewrite`).
pub(super) struct Identified {
    pub(super) identity: Arc<str>,
    /// The holder record ([`crate::HolderInfo::encode`]).
    pub(super) holder: Box<str>,
    /// The server's time of acquisition, in microseconds since 1970.
    pub(super) since_us: i64,
}

impl Holding {
    pub(super) fn deadline(&self) -> Instant {
        self.deadline_slot.0
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        self.deadlines.remove(self.deadline_slot);
        self.session.claims.unclaim(self.advisory_key);
    }
}

impl Entry {
    pub(super) fn new(owner: OwnerId) -> Self {
        Self {
            owner,
            gone: None,
            state: State::Acquiring,
        }
    }

    pub(super) fn holding(&self) -> Option<&Holding> {
        match &self.state {
            State::Held(holding) => Some(holding),
            State::Acquiring | State::Releasing => None,
        }
    }
}

//! Permit waiters of one process take turns: a caller that arrives while
//! others of this process already wait for the key's permits queues
//! behind them without asking the server.
//!
//! A release publishes once, and the subscriber wakes the longest-waiting
//! waiter of each process, who tries again and takes the slot. A caller
//! that arrived meanwhile (often the releaser itself, looping back) would
//! otherwise ask first: its attempt and the post-subscription look that
//! follows every refusal take a round trip each, and whichever of it and
//! the woken waiter loses costs another. Here its first two attempts (the
//! first, and the look right after it subscribed) are answered in process,
//! so it waits in line, subscribed, and asks the server once woken (or
//! after [`QUEUED_RECHECK`], should nothing wake it). A handoff then costs
//! the release and the woken waiter's attempt.
//!
//! Only callers that wait are queued this way: a single try always asks
//! the server, so it is never refused while a permit is free.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::backend::OwnerId;

/// How soon a caller queued here looks on its own if no release wakes it.
pub(super) const QUEUED_RECHECK: Duration = Duration::from_millis(250);
/// How many owners are remembered before the list starts afresh (callers
/// that gave up are not told to the backend). A caller forgotten so may be
/// answered here once more: it then looks again after [`QUEUED_RECHECK`].
const KEPT: usize = 4096;

/// Where a permit caller of this process stands, by owner.
#[derive(Default)]
pub(super) struct Newcomers {
    seen: Mutex<HashMap<OwnerId, Stage>>,
}

#[derive(Clone, Copy)]
enum Stage {
    /// Its first attempt was answered here.
    Arrived,
    /// Its look after subscribing was answered here too: it waits in line.
    Queued,
    /// It asks the server from now on.
    Asks,
}

impl Newcomers {
    /// Whether `owner`'s attempt is answered here (held) rather than sent:
    /// `others_wait` says whether waiters of this process wait on the
    /// key's release channel now.
    pub(super) fn queue_here(&self, owner: &OwnerId, others_wait: bool) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        match seen.get(owner).copied() {
            None => {
                if seen.len() >= KEPT {
                    seen.clear();
                }
                // One that asked first asks on: its look after subscribing
                // must go out, and it is itself a waiter by then.
                let stage = if others_wait {
                    Stage::Arrived
                } else {
                    Stage::Asks
                };
                seen.insert(*owner, stage);
                others_wait
            }
            Some(Stage::Arrived) => {
                seen.insert(*owner, Stage::Queued);
                true
            }
            Some(Stage::Queued) => {
                seen.insert(*owner, Stage::Asks);
                false
            }
            Some(Stage::Asks) => false,
        }
    }

    /// `owner`'s acquisition ended (granted, or failed): forgotten.
    pub(super) fn done(&self, owner: &OwnerId) {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if !seen.is_empty() {
            seen.remove(owner);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Newcomers;
    use crate::backend::OwnerId;

    #[test]
    fn a_newcomer_behind_waiters_is_answered_twice_here_then_asks_the_server() {
        let newcomers = Newcomers::default();
        let owner = OwnerId::random().expect("an owner id");
        assert!(newcomers.queue_here(&owner, true), "the first attempt");
        assert!(
            newcomers.queue_here(&owner, true),
            "the look after subscribing"
        );
        assert!(!newcomers.queue_here(&owner, true), "woken: asks");
        assert!(!newcomers.queue_here(&owner, true), "and keeps asking");
        newcomers.done(&owner);
        assert!(
            newcomers.queue_here(&owner, true),
            "a new acquisition queues again"
        );
    }

    #[test]
    fn a_caller_with_nobody_waiting_asks_the_server_at_once_and_after_subscribing() {
        let newcomers = Newcomers::default();
        let owner = OwnerId::random().expect("an owner id");
        assert!(!newcomers.queue_here(&owner, false), "the first attempt");
        // Refused, it subscribed: now it is a waiter itself.
        assert!(
            !newcomers.queue_here(&owner, true),
            "the look after subscribing"
        );
        assert!(!newcomers.queue_here(&owner, true), "woken");
    }
}

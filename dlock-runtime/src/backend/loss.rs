//! [`LossGroup`]: leases a backend can lose all at once by itself (every
//! lease on one PostgreSQL session, say), told without a task or a timer
//! per lease.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use crate::error::LostReason;

/// Leases a backend can lose all at once by itself, before any renewal
/// would tell: for example every lease held on one PostgreSQL session, lost
/// the moment the session ends. The backend makes one group per such unit
/// and hands it out with each [`Grant`](super::Grant); the core attaches the lease to the
/// group and detaches it when the lease ends; [`LossGroup::end`] marks
/// every attached lease lost at once (and any lease attached later). No
/// task or timer per lease.
pub struct LossGroup {
    state: Mutex<GroupState>,
}

#[derive(Default)]
struct GroupState {
    /// Why the group ended, once it has.
    ended: Option<LostReason>,
    next_id: u64,
    members: HashMap<u64, Weak<dyn LossSink>>,
}

/// What a [`LossGroup`] tells when it ends: implemented by the core's lease
/// state.
pub(crate) trait LossSink: Send + Sync {
    /// The lease is lost for `reason` (a no-op if it already ended).
    fn lost(&self, reason: LostReason);
}

impl LossGroup {
    /// A group that has not ended.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::default(),
        })
    }

    fn state(&self) -> MutexGuard<'_, GroupState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks every attached lease lost for `reason`, and every lease
    /// attached from now on. Only the first call counts.
    pub fn end(&self, reason: LostReason) {
        let members = {
            let mut state = self.state();
            if state.ended.is_some() {
                return;
            }
            state.ended = Some(reason.clone());
            std::mem::take(&mut state.members)
        };
        // Told outside the lock: marking a lease lost logs and wakes tasks.
        for member in members.into_values().filter_map(|m| m.upgrade()) {
            member.lost(reason.clone());
        }
    }

    /// True once [`LossGroup::end`] was called.
    pub fn is_ended(&self) -> bool {
        self.state().ended.is_some()
    }

    /// Attaches a lease: `Ok(id)` to detach it with, or the reason the
    /// group already ended.
    pub(crate) fn attach(&self, member: Weak<dyn LossSink>) -> Result<u64, LostReason> {
        let mut state = self.state();
        if let Some(reason) = &state.ended {
            return Err(reason.clone());
        }
        let id = state.next_id;
        state.next_id += 1;
        state.members.insert(id, member);
        Ok(id)
    }

    /// Detaches the lease attached as `id`.
    pub(crate) fn detach(&self, id: u64) {
        self.state().members.remove(&id);
    }
}

impl fmt::Debug for LossGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("LossGroup")
            .field("ended", &state.ended)
            .field("members", &state.members.len())
            .finish()
    }
}

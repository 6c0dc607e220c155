//! The promises every schedule is held to, each checked where it can
//! first break:
//!
//! - **exclusion** (at every acquisition that returns, the only moment a
//!   new belief begins): at most one exclusive holder believes it holds
//!   (a lease not `is_lost()`), at most N permit holders, no writer beside
//!   a reader. The one window docs/safety.md grants is modelled: a holder
//!   whose grant the store lost with its data ("a restart without
//!   persistence") believes until its next renewal, and is excused. A
//!   frozen holder needs no excuse: `is_lost()` compares the clock with
//!   its validity, so it stops believing at its ttl, frozen or not.
//! - **tokens rise per key** (at every grant, in `World::granted`).
//! - **told by the ttl** (every step): a holder is told its lease ended
//!   no later than the store's own expiry of it, plus `TOLD_SLACK`.
//! - **no loss for nothing**: a lease reported lost (not released) while
//!   the store still held it, in a process no fault touched since the
//!   acquisition began, was lost for no reason; and a release the store
//!   applied to a lease it still held must not come back `LeaseLost`.
//! - **deadlines**: a caller that waits `d` returns within `d` plus the
//!   core's least patience per call (`LEAST_PER_CALL`), plus the time its
//!   process was frozen.
//! - **nothing held** once every caller has gone and the ttls passed.

use std::time::Duration;

use dlock::{LockError, LostReason, LostSignal};
use tokio::time::Instant;

use crate::world::{Held, Side, World};

/// How late after the store's expiry a holder may be told: the core's
/// expiry timer fires at the lease's validity, which is never later
/// than the store's; a step's granularity on top.
const TOLD_SLACK: Duration = Duration::from_millis(5);
/// The least time the core gives one call of a waiting caller past its
/// deadline (`LEAST_PER_CALL` in lease/acquire.rs), and a little more.
const DEADLINE_SLACK: Duration = Duration::from_millis(520);

impl World {
    /// Registers a lease its caller now holds, and checks exclusion
    /// against every other lease of its key.
    pub fn hold(
        &self,
        process: usize,
        key: &str,
        side: Side,
        signal: LostSignal,
        renew: bool,
        faults_before: u64,
    ) -> usize {
        let token = signal.token().get();
        let mut state = self.state();
        let id = state.leases.len();
        let epoch = state.epoch;
        // A grant the store lost with its data is excused (see above),
        // the new lease's as much as an older one's: a reply held back
        // across the loss brings a grant the store has forgotten.
        // Only a lease the store did grant, every grant of it before the
        // latest loss: one it never granted has no excuse.
        let stale = |state: &crate::world::State, key: &str, token: u64, process: usize| {
            state
                .granted
                .values()
                .filter(|g| g.key == key && g.token == token && g.process == process)
                .fold(None, |all, g| Some(all.unwrap_or(true) && g.epoch < epoch))
                .unwrap_or(false)
        };
        let mut clash = None;
        let mut permits = 1;
        // A lease that arrives already over (its reply came after its
        // validity), or stale, is not compared.
        let believes = !signal.is_lost() && !stale(&state, key, token, process);
        for held in state.leases.iter().filter(|h| believes && h.key == key) {
            if held.signal.is_lost() || stale(&state, &held.key, held.token, held.process) {
                continue;
            }
            match (side, held.side) {
                (Side::Permit(_), Side::Permit(_)) => permits += 1,
                (Side::Shared, Side::Shared) => {}
                _ => clash = Some((held.process, held.signal.token(), held.side)),
            }
        }
        let name = state.trace.token(signal.token());
        let clash = clash.map(|(process, token, side)| (process, state.trace.token(token), side));
        state.leases.push(Held {
            process,
            key: key.to_owned(),
            token,
            side,
            signal,
            renew,
            faults_before,
            told: None,
            flagged_late: false,
        });
        drop(state);
        if let Some((other, other_token, other_side)) = clash {
            self.violation(format_args!(
                "exclusion: p{process} holds {key} {side:?} {name} while p{other} still believes it holds it {other_side:?} {other_token}"
            ));
        }
        if let Side::Permit(n) = side
            && permits > n
        {
            self.violation(format_args!(
                "permits: {permits} holders of {key} believe they hold one of {n}"
            ));
        }
        id
    }

    /// The holder of lease `id` was told it ended (`error`, from its lost
    /// signal): checks it was not lost for nothing.
    pub fn told(&self, id: usize, error: &LockError) {
        let now = Instant::now();
        let reason = match error {
            LockError::LeaseLost { reason, .. } => reason.clone(),
            _ => LostReason::Released,
        };
        let mut state = self.state();
        let faults = {
            let held = &state.leases[id];
            state.processes[held.process].faults + u64::from(state.epoch)
        };
        let held = &state.leases[id];
        let for_nothing = held.renew
            && held.side != Side::Shared
            && !matches!(reason, LostReason::Released | LostReason::RuntimeGone)
            && faults == held.faults_before
            && state.granted.values().any(|g| {
                g.key == held.key
                    && g.token == held.token
                    && g.process == held.process
                    && g.ended.is_none()
                    && g.until > now
            });
        let line = format!(
            "p{} told {} lease {id} ended: {reason:?}",
            held.process, held.key
        );
        let (process, key) = (held.process, held.key.clone());
        state.leases[id].told = Some(now);
        drop(state);
        self.log(format_args!("{line}"));
        if for_nothing {
            self.violation(format_args!(
                "lost for nothing: p{process}'s lease {id} on {key} reported lost ({reason:?}) while the store still held it, and no fault struck its process"
            ));
        }
    }

    /// Every step: each holder whose lease the store let go of by now
    /// (its last grant or extension plus the ttl) has been told.
    pub fn check_told_by_ttl(&self) {
        let now = Instant::now();
        let mut late = Vec::new();
        {
            let mut state = self.state();
            let state = &mut *state;
            for (id, held) in state
                .leases
                .iter_mut()
                .enumerate()
                .filter(|(_, h)| h.told.is_none() && !h.flagged_late)
            {
                let until = state
                    .granted
                    .values()
                    .filter(|g| {
                        g.key == held.key && g.token == held.token && g.process == held.process
                    })
                    .map(|g| g.until)
                    .max();
                if let Some(until) = until
                    && now > until + TOLD_SLACK
                {
                    held.flagged_late = true;
                    late.push((held.process, held.key.clone(), id, now - until));
                }
            }
        }
        for (process, key, id, late_by) in late {
            self.violation(format_args!(
                "told by the ttl: p{process}'s lease {id} on {key} ended on the store {late_by:?} ago and its holder was not told"
            ));
        }
    }

    /// A caller's release of lease `id` answered `result`: a release the
    /// store applied (it still held the lease) is not a loss.
    ///
    /// Only for a lease no fault touched while it was held (`faults_now`,
    /// the process's count as its release was sent): a renewal whose
    /// answer was held back or lost leaves the store holding a lease
    /// whose holder rightly counts it over, and its release then finds a
    /// key the holder no longer knew to be its own. A fault of the
    /// release itself (its reply lost) is what this check is about.
    pub fn check_release(&self, id: usize, faults_now: u64, result: &Result<(), LockError>) {
        let Err(LockError::LeaseLost {
            reason: LostReason::NotOwner,
            ..
        }) = result
        else {
            return;
        };
        let state = self.state();
        let held = &state.leases[id];
        if held.side == Side::Shared || faults_now != held.faults_before {
            return;
        }
        let applied = state.granted.values().any(|g| {
            g.key == held.key && g.token == held.token && g.process == held.process && g.released
        });
        let (process, key) = (held.process, held.key.clone());
        drop(state);
        if applied {
            self.violation(format_args!(
                "release: p{process}'s release of lease {id} on {key} was applied by the store while it held the lease, yet reported LeaseLost"
            ));
        }
    }

    /// A caller that waited `wait` (from `started`) has its answer now.
    pub fn check_deadline(
        &self,
        process: usize,
        started: Instant,
        wait: Duration,
        frozen_before: Duration,
    ) {
        if wait.is_zero() {
            // A caller that does not wait has no deadline to keep.
            return;
        }
        let took = Instant::now() - started;
        let frozen = self.frozen_for(process).saturating_sub(frozen_before);
        if took > wait + DEADLINE_SLACK + frozen {
            self.violation(format_args!(
                "deadline: p{process} waited {took:?} for a key with wait {wait:?} (frozen {frozen:?} meanwhile)"
            ));
        }
    }

    /// Once every caller has gone and every ttl passed: nothing is held.
    pub async fn check_nothing_held(&self) {
        let store = self.state().store.clone();
        let held = dlock::Backend::held(&store, "").await.unwrap_or_default();
        for (key, holding) in held {
            self.violation(format_args!(
                "nothing held: {key} still held after every caller had gone ({holding:?})"
            ));
        }
    }
}

//! Shared locks and permits on the file backend (rules M1 to M5 on
//! [`Backend`](crate::Backend)).
//!
//! Shared holders (readers) and permit holders of a key form its *group*,
//! kept in the state beside where an exclusive holder is kept:
//!
//! - The state's `owner` line names the group (a random id drawn when its
//!   first member joins), `expires_us` is its latest member's expiry and a
//!   bare `group` field says so. Each member is a field of its own:
//!   `reader OWNER TOKEN EXPIRES_US SINCE_US +RECORD` or
//!   `permit SLOT OWNER TOKEN EXPIRES_US SINCE_US +RECORD`.
//! - Every member locks its own `NAME.OWNER.alive` exclusively, as an
//!   exclusive holder does, so a member killed with SIGKILL is gone at the
//!   next look (its slot free at once), and `NAME.GROUP.alive` *shared*,
//!   the group's file, which stays locked while any member's process
//!   lives.
//! - A writer-waiting mark (rule M3) is a field `mark OWNER EXPIRES_US`,
//!   and the waiting writer locks its own `NAME.OWNER.alive` while its
//!   mark stands (it becomes its lease's file once it takes the key), so
//!   readers held back by the mark wake when the writer gives up (its
//!   release closes the file) or dies.
//!
//! Why the group is written as the owner: a version of this backend
//! without shared locks reads the `owner` and `expires_us` lines and skips
//! the fields it does not know. It sees the key held by the group until the
//! latest member's expiry, and probes `NAME.GROUP.alive` as it probes a
//! holder's: it cannot lock it while any member holds its shared lock, so
//! it never takes a key readers or permit holders hold, and once every
//! member's process is gone it can, so the key is free to it at once as
//! after a killed holder. What it does not do: watch the group's file for a
//! release (its waiters' shared lock is granted at once, so they retry in a
//! loop until the group is gone), and its forced release drops the group's
//! fields with the rest.
//!
//! Tokens come from the key's one durable counter: a new read phase draws
//! one (its members share it), every permit grant draws one, and each is
//! made durable (the state synced with its directory) before it is handed
//! out. A reader joining a live phase reuses the phase token and draws
//! nothing.
//!
//! Waiters: a writer behind readers watches the group's file with an
//! exclusive lock, which it gets when the last member's shared lock goes
//! (release or death); a permit waiter watches every member's own file, so
//! any permit's release wakes it; readers behind a mark watch the mark
//! owner's file. A fair waiter behind a group joins the key's queue as
//! behind a holder (and leaves its mark behind readers); the release that
//! ends the group hands the key to the first live entry in the same
//! locked step, and a waiter's notice that finds the group gone (its
//! members killed) does it itself.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::ops::ControlFlow;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use super::state::{Member, State, expiry_after, now_us};
use super::{Alive, HolderWatch, Inner};
use crate::backend::{Access, Attempt, Grant, Holding, OwnerId, QUEUE_ENTRY_TTL};
use crate::holder::HolderInfo;
use crate::token::FencingToken;

impl Inner {
    /// Drops from `state` what no longer stands at `now`: members whose
    /// lease ran out or whose process died (their alive file can be
    /// locked; `remove_dead` removes it, for a caller that writes the
    /// state back), and expired marks or marks whose owner's process died.
    /// A group left with no member ends (its file removed when
    /// `remove_dead`). True if anything changed.
    pub(super) fn normalize(
        &self,
        name: &str,
        state: &mut State,
        now: u64,
        remove_dead: bool,
    ) -> io::Result<bool> {
        let before = (state.members.len(), state.marks.len(), state.group);
        let mut members = std::mem::take(&mut state.members);
        let mut kept = Vec::with_capacity(members.len());
        for member in members.drain(..) {
            if member.expires_at_us > now
                && self.alive_file_locked(name, &member.owner, true, remove_dead)?
            {
                kept.push(member);
            }
        }
        state.members = kept;
        let mut marks = Vec::with_capacity(state.marks.len());
        for &(owner, expires_at_us) in &state.marks {
            if expires_at_us > now && self.alive_file_locked(name, &owner, true, false)? {
                marks.push((owner, expires_at_us));
            }
        }
        state.marks = marks;
        if state.group {
            if state.members.is_empty() {
                if let Some(group) = state.owner.take()
                    && remove_dead
                {
                    let _ = fs::remove_file(self.alive_path(name, &group));
                }
                state.group = false;
                state.expires_at_us = 0;
            } else {
                state.expires_at_us = latest_expiry(&state.members);
            }
        }
        Ok(before != (state.members.len(), state.marks.len(), state.group))
    }

    /// An exclusive attempt on a key a group holds: behind readers, from a
    /// caller that waits, it leaves or refreshes its mark (rule M3) and
    /// locks its alive file for readers to watch; behind permit holders,
    /// or from a caller that does not wait (and so sends no release that
    /// would remove a mark), it is only refused.
    pub(super) fn writer_behind_group(
        &self,
        name: &str,
        state: &mut State,
        owner: OwnerId,
        now: u64,
        waits: bool,
    ) -> io::Result<Attempt> {
        let remaining = Duration::from_micros(state.expires_at_us.saturating_sub(now));
        if !waits || state.members.iter().any(|m| m.slot.is_some()) {
            return Ok(Attempt::Held {
                expires_in: Some(remaining),
            });
        }
        let expires_at_us = expiry_after(now, QUEUE_ENTRY_TTL);
        state.marks.retain(|(by, _)| *by != owner);
        state.marks.push((owner, expires_at_us));
        self.hold_mark_file(name, owner, expires_at_us)?;
        self.write_state(name, state, false)?;
        Ok(Attempt::Held {
            expires_in: Some(remaining.min(QUEUE_ENTRY_TTL / 3)),
        })
    }

    /// Locks `owner`'s alive file while its mark stands (unless this
    /// process holds it already, as a fair waiter's registration).
    fn hold_mark_file(&self, name: &str, owner: OwnerId, expires_at_us: u64) -> io::Result<()> {
        let mut alive = self.alive.lock().unwrap_or_else(PoisonError::into_inner);
        let id = (name.to_owned(), owner);
        if let Some(held) = alive.get_mut(&id) {
            if held.waiting.is_none() {
                held.expires_at_us = held.expires_at_us.max(expires_at_us);
            }
            return Ok(());
        }
        let file = File::create(self.alive_path(name, &owner))?;
        file.lock()?;
        alive.insert(id, Alive::holding(file, expires_at_us));
        Ok(())
    }

    /// A shared or permit attempt (`access` is not exclusive), one step
    /// with the key locked.
    pub(super) fn join_group(
        &self,
        name: &str,
        key: &str,
        owner: OwnerId,
        ttl: Duration,
        record: &str,
        access: Access,
    ) -> io::Result<Attempt> {
        let _guard = self.lock_key(name)?;
        let now = now_us();
        let mut state = self.read_state(name)?.unwrap_or_else(|| State {
            // A key never seen starts its counter at the wall clock.
            counter: now,
            key: key.to_owned(),
            ..State::default()
        });
        if self.normalize(name, &mut state, now, true)? {
            self.write_state(name, &state, false)?;
        }
        let reader = matches!(access, Access::Shared);
        let expires_at_us = expiry_after(now, ttl);
        // A retry by a member (rule M5): its slot, its token.
        if self.holds_alive(name, &owner)
            && let Some(member) = state
                .members
                .iter_mut()
                .find(|m| m.owner == owner && m.slot.is_none() == reader)
        {
            member.expires_at_us = expires_at_us;
            let grant = grant_of(member);
            state.expires_at_us = latest_expiry(&state.members);
            self.write_state(name, &state, false)?;
            self.set_alive_expiry(name, &owner, expires_at_us);
            return Ok(Attempt::Acquired(grant));
        }
        if self.live_holder(name, &state, now, false)?.is_some() {
            return Ok(Attempt::Held {
                expires_in: Some(Duration::from_micros(state.expires_at_us - now)),
            });
        }
        let slot = match member_place(&state, access, reader, now) {
            ControlFlow::Break(held) => return Ok(held),
            ControlFlow::Continue(slot) => slot,
        };
        let phase = state
            .members
            .first()
            .filter(|_| reader)
            .map(|member| member.token);
        let token = match phase {
            Some(token) => token,
            None => state
                .counter
                .max(1)
                .checked_add(1)
                .ok_or_else(|| io::Error::other("fencing counter exhausted"))?,
        };
        if !state.group {
            if let Some(earlier) = state.owner {
                // An exclusive holder whose lease ran out or whose process
                // died: its file can go, as the state is rewritten below.
                self.holder_alive(name, &earlier, true)?;
            }
            state.owner = Some(OwnerId::random().map_err(io::Error::other)?);
            state.group = true;
            state.identity = None;
            state.holder = None;
        }
        let member = Member {
            owner,
            slot,
            token,
            expires_at_us,
            since_us: now,
            record: record.to_owned(),
        };
        self.add_member(name, &mut state, member, phase.is_none(), now)
    }

    /// Adds `member` to the key's group: the group's file locked shared,
    /// the member's own alive file locked, and the state written
    /// (`durable` when the member's token was drawn for it).
    fn add_member(
        &self,
        name: &str,
        state: &mut State,
        member: Member,
        durable: bool,
        now: u64,
    ) -> io::Result<Attempt> {
        let (owner, slot, token, expires_at_us) = (
            member.owner,
            member.slot,
            member.token,
            member.expires_at_us,
        );
        let group = state
            .owner
            .ok_or_else(|| io::Error::other("a group without its id"))?;
        // The group's file first: an earlier version (and a writer's
        // watch) sees the key held from the moment the state says so.
        let group_file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.alive_path(name, &group))?;
        group_file.lock_shared()?;
        let alive_path = self.alive_path(name, &owner);
        // A lease of this owner that ended here without its release (broken
        // by force, or a writer's mark) may still lock its alive file in
        // this process: let go of it first, or the lock below would wait
        // for this very process, forever, with the key's step locked for
        // every process.
        drop(
            self.alive
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&(name.to_owned(), owner)),
        );
        let alive = File::create(&alive_path)?;
        alive.lock()?;
        state.counter = state.counter.max(token);
        state.members.push(member);
        state.expires_at_us = latest_expiry(&state.members);
        // A drawn token is made durable before it is handed out.
        if let Err(err) = self.write_state(name, state, durable) {
            let _ = fs::remove_file(&alive_path);
            return Err(err);
        }
        self.close_expired(now);
        self.alive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                (name.to_owned(), owner),
                Alive {
                    file: alive,
                    expires_at_us,
                    waiting: None,
                    _group: Some(group_file),
                },
            );
        let grant = Grant::new(FencingToken::new(token));
        Ok(Attempt::Acquired(match slot {
            Some(slot) => grant.in_slot(slot),
            None => grant,
        }))
    }

    /// Renews `owner`'s membership (rule M4: in `slot`, if named).
    pub(super) fn extend_member(
        &self,
        name: &str,
        owner: OwnerId,
        ttl: Duration,
        slot: Option<u32>,
    ) -> io::Result<bool> {
        let guard = self.lock_key(name)?;
        let now = now_us();
        let mut state = self.read_state(name)?.unwrap_or_default();
        let expires_at_us = expiry_after(now, ttl);
        let renewed = state.group
            && state
                .members
                .iter_mut()
                .filter(|m| m.owner == owner && m.expires_at_us > now)
                .find(|m| slot.is_none() || m.slot == slot)
                .map(|member| member.expires_at_us = expires_at_us)
                .is_some();
        if !renewed {
            drop(guard);
            self.drop_lease_alive(name, &owner);
            return Ok(false);
        }
        state.expires_at_us = latest_expiry(&state.members);
        self.write_state(name, &state, false)?;
        self.set_alive_expiry(name, &owner, expires_at_us);
        self.restore_alive(name, &owner);
        Ok(true)
    }

    /// Releases `owner`'s lease held as `access` (in `slot`, or whichever
    /// it holds: rule M4). True if it held it. Its alive files closed, the
    /// key's waiters wake: a permit's, and the last reader's, release
    /// announces a release.
    pub(super) fn release_as(
        &self,
        name: &str,
        owner: OwnerId,
        access: Access,
        slot: Option<u32>,
    ) -> io::Result<bool> {
        if access == Access::Exclusive {
            return self.release(name, owner);
        }
        let guard = self.lock_key(name)?;
        let now = now_us();
        let mut ours = false;
        if let Some(mut state) = self.read_state(name)?
            && state.group
        {
            let reader = access == Access::Shared;
            let before = state.members.len();
            state.members.retain(|m| {
                let mine = m.owner == owner
                    && m.slot.is_none() == reader
                    && (slot.is_none() || m.slot == slot);
                ours |= mine && m.expires_at_us > now;
                !mine
            });
            if state.members.len() != before {
                self.normalize(name, &mut state, now, true)?;
                if !state.group && state.queued && self.hand_to_first(name, &mut state, now)? {
                    // Handed over, the state written durably.
                } else {
                    self.write_state(name, &state, false)?;
                }
            }
        }
        drop(guard);
        self.drop_alive(name, &owner);
        Ok(ours)
    }

    /// A force release naming the permit whose token is `named`, with the
    /// key's file locked by the caller: `None` if the key is not held as
    /// permits. Else only that permit is dropped (its holder finds it gone
    /// at its next renewal) and the answer is `Released`, or
    /// `HolderChanged` when no live permit has that token (nothing is
    /// changed): the key's other permits are never broken.
    pub(super) fn force_release_permit(
        &self,
        name: &str,
        state: &mut State,
        named: u64,
        now: u64,
    ) -> io::Result<Option<crate::backend::ForceRelease>> {
        use crate::backend::ForceRelease;
        let live_permit = |m: &Member| m.slot.is_some() && m.expires_at_us > now;
        if !state.group || !state.members.iter().any(live_permit) {
            return Ok(None);
        }
        let before = state.members.len();
        state
            .members
            .retain(|m| !(live_permit(m) && m.token == named));
        if state.members.len() == before {
            return Ok(Some(ForceRelease::HolderChanged));
        }
        self.normalize(name, state, now, true)?;
        if !state.group && state.queued && self.hand_to_first(name, state, now)? {
            // Handed over, the state written durably.
        } else {
            self.write_state(name, state, false)?;
        }
        Ok(Some(ForceRelease::Released))
    }

    /// The group just ended: hands the key to the first live fair waiter,
    /// as an exclusive holder's release does. True if it did (the queue
    /// and the state written); else the queue is pruned and `state.queued`
    /// says whether anyone still queues.
    fn hand_to_first(&self, name: &str, state: &mut State, now: u64) -> io::Result<bool> {
        let mut waiters = self.read_queue(name)?;
        let pruned = self.prune_front(name, &mut waiters, now, None)?;
        if waiters.is_empty() {
            state.queued = false;
            if pruned {
                self.write_queue(name, &waiters)?;
            }
            return Ok(false);
        }
        self.hand_over(name, state, &mut waiters, now)?;
        Ok(true)
    }

    /// A receiver that turns true when the group's last member is gone.
    pub(super) fn watch_group(
        self: &Arc<Self>,
        name: &str,
        state: &State,
    ) -> io::Result<Option<watch::Receiver<bool>>> {
        match state.owner.filter(|_| state.group) {
            Some(group) => self.watch_file(self.alive_path(name, &group), true),
            None => Ok(None),
        }
    }

    /// How a waiter hears that a key no exclusive holder holds may let it
    /// in: the group's end (a writer), any permit's release, any mark's
    /// removal (a reader).
    pub(super) fn watch_members(
        self: &Arc<Self>,
        name: &str,
        state: &State,
    ) -> io::Result<HolderWatch> {
        let mut receivers = Vec::new();
        let mut unwatchable = false;
        let mut watch = |rx: Option<watch::Receiver<bool>>| match rx {
            Some(rx) => receivers.push(rx),
            None => unwatchable = true,
        };
        for (owner, _) in &state.marks {
            watch(self.watch_alive(self.alive_path(name, owner))?);
        }
        if state.members.iter().any(|m| m.slot.is_some()) {
            for member in &state.members {
                watch(self.watch_alive(self.alive_path(name, &member.owner))?);
            }
        } else if state.group {
            watch(self.watch_group(name, state)?);
        }
        Ok(match (receivers.is_empty(), unwatchable) {
            (false, _) => HolderWatch::Any(receivers),
            (true, true) => HolderWatch::Unwatchable,
            (true, false) => HolderWatch::Free,
        })
    }
}

/// Where a shared or permit attempt joins a group that holds no
/// exclusive holder: `Continue` with its slot (none for a reader), or
/// `Break` with the answer when it must wait.
fn member_place(
    state: &State,
    access: Access,
    reader: bool,
    now: u64,
) -> ControlFlow<Attempt, Option<u32>> {
    // Permit holders and readers exclude each other (M1).
    if state.members.iter().any(|m| m.slot.is_none() != reader) {
        return ControlFlow::Break(held_until(&state.members, now));
    }
    let slot = match access {
        Access::Permits { permits } => {
            let taken = |slot: u32| state.members.iter().any(|m| m.slot == Some(slot));
            match (0..permits).find(|&slot| !taken(slot)) {
                Some(slot) => Some(slot),
                None => return ControlFlow::Break(held_until(&state.members, now)),
            }
        }
        _ => {
            // A live mark holds new readers back, even in a live
            // phase (M3).
            if let Some(soonest) = state.marks.iter().map(|(_, e)| *e).min() {
                return ControlFlow::Break(Attempt::Held {
                    expires_in: Some(Duration::from_micros(soonest.saturating_sub(now))),
                });
            }
            None
        }
    };
    ControlFlow::Continue(slot)
}

/// The latest expiry of `members`.
fn latest_expiry(members: &[Member]) -> u64 {
    members.iter().map(|m| m.expires_at_us).max().unwrap_or(0)
}

/// `Held`, until the soonest of `members` ends.
fn held_until(members: &[Member], now: u64) -> Attempt {
    let soonest = members.iter().map(|m| m.expires_at_us).min().unwrap_or(now);
    Attempt::Held {
        expires_in: Some(Duration::from_micros(soonest.saturating_sub(now))),
    }
}

/// A member's grant: its token, in its slot.
fn grant_of(member: &Member) -> Grant {
    let grant = Grant::new(FencingToken::new(member.token));
    match member.slot {
        Some(slot) => grant.in_slot(slot),
        None => grant,
    }
}

/// What `holder` answers for a key a group holds: the highest member token
/// (the phase token, for readers), no identity, the group's latest expiry,
/// and the record of its first member.
pub(super) fn group_holding(state: State, now: u64) -> (String, Holding) {
    let token = state.members.iter().map(|m| m.token).max();
    let holder = state.members.first().and_then(|member| {
        let info = HolderInfo::decode(&member.record)?;
        Some(info.held_for(Duration::from_micros(now.saturating_sub(member.since_us))))
    });
    let holding = Holding::new(token.map(FencingToken::new), None)
        .expiring_in(Duration::from_micros(
            state.expires_at_us.saturating_sub(now),
        ))
        .held_by(holder);
    (state.key, holding)
}

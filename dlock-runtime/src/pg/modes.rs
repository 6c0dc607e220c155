//! Shared locks (the read side of a read-write lock) and permits, rules M1
//! to M5 on [`Backend`](crate::Backend).
//!
//! A reader holds the key's advisory lock *shared*
//! (`pg_try_advisory_lock_shared`), which PostgreSQL lets coexist with
//! other shared holders and with no exclusive one, and a shared lock on the
//! key's *phase key*, which only readers take: the read phase is live while
//! a session holds that. The phase token and the writer-waiting mark live
//! in a row of `<schema>.dlock_phases` (see [`sql::MODES_SETUP`]). A permit
//! is one exclusive advisory lock per (key, slot), every slot tried in one
//! statement. Each attempt is one statement, prepared once per session
//! (see [`ModeStatement`]), on a session the backend owns, so a holder whose
//! process dies frees its hold the moment its connection ends, and a
//! session that ends marks every lease on it lost.
//!
//! In process: advisory locks are re-entrant per session, so the backend
//! decides here who of this process may ask the server. A key held or
//! being taken exclusively here refuses readers and permits, and a key
//! with readers or permits here refuses a writer (who leaves its mark).
//! The readers of one key in this process share one hold on the server
//! (a [`ReadHold`]): the first one's attempt takes it, the others join it
//! in process, asking the server only whether a writer's mark stands, and
//! the last one out drops it. So no shared attempt is ever sent on a
//! session that holds the key (the server's phase probe could not tell
//! the session's own hold from none), and while the hold is being dropped
//! the next reader waits for that before it asks the server anew. Permit
//! attempts of one key take turns in process and skip the slots this
//! process holds, so a slot is never granted twice through a re-entrant
//! session.
//!
//! This file keeps the book of holds, the attempt's entry and the
//! releases; the readers' shared hold is `read_hold`'s, and the statement
//! on the server, the objects it needs and writers' marks are
//! `mode_statements`'.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{Mutex as AsyncMutex, watch};
use tokio::time::Instant;

use super::backend::GiveBack;
use super::claims::PermitClaim;
use super::connection::no_runtime;
use super::deadlines::Slot;
use super::home::NoRuntime;
use super::mode_sql::{ModeSql, ModeStatement};
use super::read_hold::ReadHold;
use super::session::LockSession;
use super::{Inner, sql};
use crate::backend::kit::after;
use crate::backend::{Access, AcquireRequest, Attempt, Grant, OwnerId, ReleaseNotice};
use crate::error::{LockError, Operation};
use crate::key::LockKey;
use crate::token::FencingToken;

/// How soon a waiter for a key held shared or as permits looks again on
/// its own: the wait probe hears only of exclusive holders going.
const RECHECK: Duration = Duration::from_millis(100);
/// How long a failed look for the functions of [`sql::MODES_SETUP`] is
/// believed before a refused writer looks again.
pub(super) const ABSENT_BELIEVED: Duration = Duration::from_secs(10);
/// How soon an owner whose own hold of the key is on its way out looks
/// again.
const OWN_RELEASE_PENDING: Duration = Duration::from_millis(10);
/// How many keys waiters poll for before the list is started afresh.
const POLLED_KEPT: usize = 4096;

/// The shared and permit holds of this process, and what the server
/// needs for them.
pub(super) struct Modes {
    keys: Mutex<HashMap<LockKey, ModeKey>>,
    /// Keys whose waiters look again on their own (see [`RECHECK`]).
    polled: Mutex<HashSet<LockKey>>,
    /// The writer-waiting marks this process left, by key and owner.
    pub(super) marked: Mutex<HashSet<(LockKey, OwnerId)>>,
    /// Whether the table and functions exist (made by [`sql::MODES_SETUP`]
    /// on this backend's first shared or permit attempt), and, if a writer
    /// looked for them and found none, when.
    pub(super) ready: AsyncMutex<(bool, Option<Instant>)>,
    pub(super) setup_sql: String,
    /// The statements each lock session prepares for shared locks and
    /// permits.
    pub(super) statements: ModeSql,
    pub(super) mark_sql: String,
    pub(super) unmark_sql: String,
    pub(super) exists_sql: String,
    /// Names each [`ReadHold`].
    pub(super) next_read: AtomicU64,
}

/// One key's holds in this process.
#[derive(Default)]
pub(super) struct ModeKey {
    pub(super) holds: HashMap<OwnerId, ModeHold>,
    /// Attempts of this process on their way to the server.
    pending: usize,
    /// How the key is held or taken here, while it is.
    access: Option<Access>,
    /// Permit attempts take turns (see the module docs).
    turn: Arc<AsyncMutex<()>>,
    /// Dropped with the entry, which wakes this process's waiters.
    gone: Option<watch::Sender<()>>,
    /// The server's shared hold of the key that this process's readers
    /// share, from the grant of the first until the unlock of the last.
    pub(super) read: Option<ReadHold>,
}

impl ModeKey {
    /// Nothing here holds, takes or gives back the key.
    pub(super) fn unused(&self) -> bool {
        self.holds.is_empty() && self.pending == 0 && self.read.is_none()
    }
}

pub(super) struct ModeHold {
    session: Arc<LockSession>,
    pub(super) slot: Option<u32>,
    token: FencingToken,
    deadline_slot: Slot,
    /// An unlock is on its way.
    releasing: bool,
    /// A permit's hold of its slot's advisory key, counted in the
    /// session's claims while this hold lives.
    _slot_claim: Option<PermitClaim>,
}

impl Modes {
    pub(super) fn new(quoted_schema: &str) -> Self {
        Self {
            keys: Mutex::default(),
            polled: Mutex::default(),
            marked: Mutex::default(),
            ready: AsyncMutex::new((false, None)),
            setup_sql: sql::render(sql::MODES_SETUP, quoted_schema),
            statements: ModeSql {
                try_shared: sql::render(sql::TRY_SHARED, quoted_schema),
                unlock_shared: sql::render(sql::UNLOCK_SHARED, quoted_schema),
                try_permit: sql::render(sql::TRY_PERMIT, quoted_schema),
                unlock_permit: sql::render(sql::UNLOCK_PERMIT, quoted_schema),
                marked: sql::render(sql::MARKED, quoted_schema),
            },
            mark_sql: sql::render(sql::MARK, quoted_schema),
            unmark_sql: sql::render(sql::UNMARK, quoted_schema),
            exists_sql: sql::render(sql::MODES_EXIST, quoted_schema),
            next_read: AtomicU64::new(0),
        }
    }

    pub(super) fn keys(&self) -> MutexGuard<'_, HashMap<LockKey, ModeKey>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn poll(&self, key: &LockKey) {
        let mut polled = self.polled.lock().unwrap_or_else(PoisonError::into_inner);
        if polled.len() >= POLLED_KEPT {
            polled.clear();
        }
        polled.insert(key.clone());
    }

    /// Whether readers or permits of this process hold or are taking `key`:
    /// a writer of this process is refused (the server would let it through
    /// a session of theirs).
    pub(super) fn busy(&self, key: &LockKey) -> bool {
        self.keys().get(key).is_some_and(|entry| !entry.unused())
    }

    /// The session `owner`'s live shared or permit lease on `key` is held on.
    pub(super) fn live_session(&self, key: &LockKey, owner: &OwnerId) -> Option<Arc<LockSession>> {
        self.keys()
            .get(key)
            .and_then(|entry| entry.holds.get(owner))
            .filter(|hold| !hold.releasing && hold.deadline_slot.0 > Instant::now())
            .map(|hold| Arc::clone(&hold.session))
    }

    /// A release notice for `key` if it is held shared or as permits here,
    /// or a waiter of this process was refused by readers, permits or a
    /// mark: the wait probe would not hear of those going.
    pub(super) fn subscribe(&self, key: &LockKey) -> Option<ReleaseNotice> {
        if let Some(entry) = self.keys().get_mut(key) {
            let mut gone = entry
                .gone
                .get_or_insert_with(|| watch::channel(()).0)
                .subscribe();
            return Some(
                ReleaseNotice::new(async move {
                    let _ = gone.changed().await;
                })
                .recheck_within(RECHECK),
            );
        }
        let polled = self.polled.lock().unwrap_or_else(PoisonError::into_inner);
        polled
            .contains(key)
            .then(|| ReleaseNotice::new(std::future::pending()).recheck_within(RECHECK))
    }
}

/// The end of an attempt in flight, however it ends: the key's entry
/// forgets it, and goes if nothing else holds it.
struct Pending<'a> {
    inner: &'a Inner,
    key: &'a LockKey,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let mut keys = self.inner.modes.keys();
        if let Some(entry) = keys.get_mut(self.key) {
            entry.pending = entry.pending.saturating_sub(1);
            if entry.unused() {
                keys.remove(self.key);
            }
        }
    }
}

impl Inner {
    /// A shared or permit attempt (rules M1, M2, M5): the in-process
    /// exclusion, then one statement on a lock session.
    pub(super) async fn try_mode(
        self: &Arc<Self>,
        request: &AcquireRequest<'_>,
    ) -> Result<Attempt, LockError> {
        let (key, owner, ttl, access) = (request.key, request.owner, request.ttl, request.access);
        let turn = {
            let exclusive = self.keys();
            if let Some(entry) = exclusive.get(key) {
                let now = Instant::now();
                return Ok(Attempt::Held {
                    expires_in: entry
                        .holding()
                        .map(|h| h.deadline().saturating_duration_since(now)),
                });
            }
            let mut keys = self.modes.keys();
            let entry = keys.entry(key.clone()).or_default();
            if let Some(hold) = entry.holds.get_mut(owner)
                && !hold.releasing
                && hold.deadline_slot.0 > Instant::now()
            {
                // A retry by the owner that holds (rule M5).
                hold.deadline_slot = self.deadlines.moved(
                    hold.deadline_slot,
                    key,
                    *owner,
                    after(Instant::now(), ttl),
                );
                let grant = Grant::new(hold.token).lost_with(hold.session.loss_group());
                return Ok(Attempt::Acquired(match hold.slot {
                    Some(slot) => grant.in_slot(slot),
                    None => grant,
                }));
            }
            if entry.access.is_some_and(|held| held != access) {
                // A key is used one way (rule M1).
                return Ok(Attempt::Held { expires_in: None });
            }
            if entry.holds.contains_key(owner) {
                // The owner's hold is being released, or ran out and is
                // about to be: a new grant must not take its place in the
                // book while its release is on the way.
                return Ok(Attempt::Held {
                    expires_in: Some(OWN_RELEASE_PENDING),
                });
            }
            entry.access = Some(access);
            entry.pending += 1;
            Arc::clone(&entry.turn)
        };
        let give_back = GiveBack {
            inner: Arc::clone(self),
            key: key.clone(),
            owner: *owner,
        };
        let attempt = {
            let (inner, key, owner) = (Arc::clone(self), key.clone(), *owner);
            async move {
                let _pending = Pending {
                    inner: &inner,
                    key: &key,
                };
                match access {
                    Access::Permits { .. } => {
                        let _turn = turn.lock().await;
                        inner.mode_on_server(&key, owner, ttl, access).await
                    }
                    _ => inner.shared_attempt(&key, owner, ttl, &turn).await,
                }
            }
        };
        match self.home.run_detachable(attempt, give_back).await {
            Ok(outcome) => outcome,
            Err(NoRuntime) => Err(no_runtime(Operation::Acquire, key)),
        }
    }

    /// Books `owner`'s grant of `key` in its entry, with its deadline.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn book(
        self: &Arc<Self>,
        entry: &mut ModeKey,
        key: &LockKey,
        owner: OwnerId,
        ttl: Duration,
        session: &Arc<LockSession>,
        slot: Option<(u32, PermitClaim)>,
        token: FencingToken,
    ) {
        let deadline_slot =
            self.deadlines
                .add(Arc::downgrade(self), key, owner, after(Instant::now(), ttl));
        let (slot, slot_claim) = slot.unzip();
        entry.holds.insert(
            owner,
            ModeHold {
                session: Arc::clone(session),
                slot,
                token,
                deadline_slot,
                releasing: false,
                _slot_claim: slot_claim,
            },
        );
    }

    /// Moves the deadline of `owner`'s shared or permit lease on `key`, if
    /// it is still held on `session_id`. True if it was.
    pub(super) fn extend_mode(
        &self,
        key: &LockKey,
        owner: &OwnerId,
        session_id: u64,
        to: Instant,
    ) -> bool {
        let mut keys = self.modes.keys();
        let Some(hold) = keys
            .get_mut(key)
            .and_then(|entry| entry.holds.get_mut(owner))
        else {
            return false;
        };
        if hold.releasing || hold.session.id != session_id || hold.deadline_slot.0 <= Instant::now()
        {
            return false;
        }
        hold.deadline_slot = self.deadlines.moved(hold.deadline_slot, key, *owner, to);
        true
    }

    /// Unlocks shared or permit holds of `key` held here: `owner`'s, or
    /// every one (`None`, the administrator's force); `overdue` only a hold
    /// whose deadline passed. `None` if this process holds `key` neither
    /// shared nor as permits. `Ok(true)` when a live hold was released.
    pub(super) async fn unlock_mode(
        self: &Arc<Self>,
        key: &LockKey,
        owner: Option<OwnerId>,
        overdue: bool,
    ) -> Option<Result<bool, LockError>> {
        let now = Instant::now();
        let picked: Vec<(OwnerId, Arc<LockSession>, Option<u32>, bool)>;
        let read = {
            let mut keys = self.modes.keys();
            let entry = keys.get_mut(key)?;
            picked = entry
                .holds
                .iter_mut()
                .filter(|(holder, hold)| {
                    owner.is_none_or(|owner| owner == **holder)
                        && !hold.releasing
                        && !(overdue && hold.deadline_slot.0 > now)
                })
                .map(|(holder, hold)| {
                    hold.releasing = true;
                    (
                        *holder,
                        Arc::clone(&hold.session),
                        hold.slot,
                        hold.deadline_slot.0 > now,
                    )
                })
                .collect();
            if picked.is_empty() && owner.is_some_and(|o| !entry.holds.contains_key(&o)) {
                return None;
            }
            // Every shared hold here is a member of the key's read hold,
            // but for those on a session that just ended (whose hold went
            // with it).
            entry.read.as_ref().map(|read| (read.id, read.session.id))
        };
        let inner = Arc::clone(self);
        let unlocked_key = key.clone();
        let unlocking = self.home.run_detachable(
            async move {
                let key = unlocked_key;
                let mut released = Ok(false);
                for (holder, session, slot, live) in picked {
                    let seed = inner.options.key_seed;
                    let answer = match slot.map(i32::try_from) {
                        Some(slot) => {
                            let slot = slot.unwrap_or(i32::MAX);
                            async {
                                let statement = session
                                    .mode_statement(
                                        ModeStatement::UnlockPermit,
                                        &inner.modes.statements,
                                    )
                                    .await?;
                                session
                                    .query(statement, &[&key.as_str(), &seed, &slot])
                                    .await
                            }
                            .await
                        }
                        None => {
                            inner.forget_mode(&key, holder);
                            if let Some((read, on)) = read
                                && on == session.id
                            {
                                inner.leave_read(&key, read).await;
                            }
                            if live && matches!(released, Ok(false)) {
                                released = Ok(true);
                            }
                            continue;
                        }
                    };
                    inner.forget_mode(&key, holder);
                    match answer {
                        Ok(_) => {
                            if live && matches!(released, Ok(false)) {
                                released = Ok(true);
                            }
                        }
                        Err(err) if err.is_closed() || session.is_ended() => {}
                        Err(err) => {
                            session.end(format!("could not release `{key}`"));
                            released =
                                Err(inner.failed(Operation::Release, &key, "unlock failed", err));
                        }
                    }
                }
                released
            },
            crate::backend::kit::detach::Ignore,
        );
        Some(match unlocking.await {
            Ok(released) => released,
            Err(NoRuntime) => Err(no_runtime(Operation::Release, key)),
        })
    }

    /// A lock session ended: its shared locks and slots are gone on the
    /// server, so this process forgets the holds on it (which wakes its
    /// waiters once a key has no other). How many it forgot.
    pub(super) fn session_ended_modes(&self, id: u64) -> usize {
        let mut keys = self.modes.keys();
        let mut forgotten = 0;
        keys.retain(|_, entry| {
            entry.holds.retain(|_, hold| {
                let on_it = hold.session.id == id;
                if on_it {
                    self.deadlines.remove(hold.deadline_slot);
                    forgotten += 1;
                }
                !on_it
            });
            if entry
                .read
                .as_ref()
                .is_some_and(|read| read.session.id == id)
            {
                entry.read = None;
            }
            !entry.unused()
        });
        forgotten
    }

    /// Forgets `owner`'s hold of `key`, and the key's entry (waking this
    /// process's waiters) once nothing here holds or takes it.
    fn forget_mode(&self, key: &LockKey, owner: OwnerId) {
        let mut keys = self.modes.keys();
        let Some(entry) = keys.get_mut(key) else {
            return;
        };
        if let Some(hold) = entry.holds.remove(&owner) {
            self.deadlines.remove(hold.deadline_slot);
        }
        if entry.unused() {
            keys.remove(key);
        }
    }
}

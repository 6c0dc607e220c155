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
//! Over 700 lines: shared locks and permits on advisory locks, both modes
//! sharing one group bookkeeping; the redesign of the PostgreSQL backend splits
//! it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{Mutex as AsyncMutex, watch};
use tokio::time::Instant;
use tokio_postgres::error::SqlState;

use super::claims::PermitClaim;
use super::connection::Failure;
use super::deadlines::Slot;
use super::home::NoRuntime;
use super::locks::no_runtime;
use super::session::{LockSession, ModeSql, ModeStatement};
use super::{Inner, KIND, sql, xact};
use crate::backend::kit::detach::AbandonedWith;
use crate::backend::{
    Access, AcquireRequest, Attempt, Grant, OwnerId, QUEUE_ENTRY_TTL, ReleaseNotice,
};
use crate::error::{LockError, Operation};
use crate::key::LockKey;
use crate::token::FencingToken;

/// How soon a waiter for a key held shared or as permits looks again on
/// its own: the wait probe hears only of exclusive holders going.
const RECHECK: Duration = Duration::from_millis(100);
/// How long a failed look for the functions of [`sql::MODES_SETUP`] is
/// believed before a refused writer looks again.
const ABSENT_BELIEVED: Duration = Duration::from_secs(10);
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
    marked: Mutex<HashSet<(LockKey, OwnerId)>>,
    /// Whether the table and functions exist (made by [`sql::MODES_SETUP`]
    /// on this backend's first shared or permit attempt), and, if a writer
    /// looked for them and found none, when.
    ready: AsyncMutex<(bool, Option<Instant>)>,
    setup_sql: String,
    /// The statements each lock session prepares for shared locks and
    /// permits.
    statements: ModeSql,
    mark_sql: String,
    unmark_sql: String,
    exists_sql: String,
    /// Names each [`ReadHold`].
    next_read: AtomicU64,
}

/// One key's holds in this process.
#[derive(Default)]
struct ModeKey {
    holds: HashMap<OwnerId, ModeHold>,
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
    read: Option<ReadHold>,
}

impl ModeKey {
    /// Nothing here holds, takes or gives back the key.
    fn unused(&self) -> bool {
        self.holds.is_empty() && self.pending == 0 && self.read.is_none()
    }
}

/// One shared hold of a key on a lock session, shared by this process's
/// readers of the key (see the module docs).
struct ReadHold {
    id: u64,
    session: Arc<LockSession>,
    token: FencingToken,
    /// Readers counted on it: their leases, and joins on their way.
    members: usize,
    /// While its unlock is on its way: changes (its sender drops) once the
    /// unlock is done.
    unlocking: Option<watch::Receiver<()>>,
}

/// What a shared attempt does, decided in process.
enum ReadStep {
    /// Joins this process's hold (counted on it already).
    Join {
        id: u64,
        session: Arc<LockSession>,
        token: FencingToken,
    },
    /// Waits for the unlock of this process's hold.
    AfterUnlock(watch::Receiver<()>),
    /// Asks the server.
    Start,
}

struct ModeHold {
    session: Arc<LockSession>,
    slot: Option<u32>,
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

    fn keys(&self) -> MutexGuard<'_, HashMap<LockKey, ModeKey>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn poll(&self, key: &LockKey) {
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

/// Gives back a shared lock or permit the server granted to a caller that
/// stopped waiting.
struct ModeGiveBack {
    inner: Arc<Inner>,
    key: LockKey,
    owner: OwnerId,
}

impl AbandonedWith<Result<Attempt, LockError>> for ModeGiveBack {
    async fn handle(self, outcome: Result<Attempt, LockError>) {
        if let Ok(Attempt::Acquired(_)) = outcome {
            let _ = self
                .inner
                .unlock_mode(&self.key, Some(self.owner), false)
                .await;
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
                hold.deadline_slot =
                    self.deadlines
                        .moved(hold.deadline_slot, key, *owner, Instant::now() + ttl);
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
        let give_back = ModeGiveBack {
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

    /// A shared attempt: joins this process's hold of the key, or, taking
    /// the key's turn, asks the server for one (see the module docs).
    async fn shared_attempt(
        self: &Arc<Self>,
        key: &LockKey,
        owner: OwnerId,
        ttl: Duration,
        turn: &AsyncMutex<()>,
    ) -> Result<Attempt, LockError> {
        loop {
            if let ReadStep::Join { id, session, token } = self.read_step(key) {
                match self.join_read(key, owner, ttl, id, session, token).await? {
                    Some(attempt) => return Ok(attempt),
                    None => continue,
                }
            }
            let _turn = turn.lock().await;
            match self.read_step(key) {
                ReadStep::Start => {
                    return self.mode_on_server(key, owner, ttl, Access::Shared).await;
                }
                ReadStep::Join { id, .. } => {
                    // Another attempt took the hold while this one waited
                    // for the turn: joined above, on the next round.
                    self.leave_read(key, id).await;
                }
                ReadStep::AfterUnlock(mut unlocked) => {
                    let _ = unlocked.changed().await;
                }
            }
        }
    }

    /// What a shared attempt of `key` does now; a join is counted on the
    /// hold at once, so the hold cannot be dropped under it.
    fn read_step(&self, key: &LockKey) -> ReadStep {
        let mut keys = self.modes.keys();
        let Some(entry) = keys.get_mut(key) else {
            return ReadStep::Start;
        };
        match entry.read.as_mut() {
            Some(read) if read.session.is_ended() => {
                // Gone with its session on the server; the session's end
                // is being told to the leases on it.
                entry.read = None;
                ReadStep::Start
            }
            Some(ReadHold {
                unlocking: Some(unlocked),
                ..
            }) => ReadStep::AfterUnlock(unlocked.clone()),
            Some(read) => {
                read.members += 1;
                ReadStep::Join {
                    id: read.id,
                    session: Arc::clone(&read.session),
                    token: read.token,
                }
            }
            None => ReadStep::Start,
        }
    }

    /// A reader joins this process's hold `id` of `key` (counted on it by
    /// [`Inner::read_step`]), unless a writer's mark stands (rule M3: asked
    /// of the server, so a stream of this process's readers does not starve
    /// a writer elsewhere). `None` if the hold went with its session
    /// meanwhile: the attempt starts over.
    async fn join_read(
        self: &Arc<Self>,
        key: &LockKey,
        owner: OwnerId,
        ttl: Duration,
        id: u64,
        session: Arc<LockSession>,
        token: FencingToken,
    ) -> Result<Option<Attempt>, LockError> {
        match self.writer_marked(key).await {
            Ok(false) => {}
            Ok(true) => {
                self.leave_read(key, id).await;
                self.modes.poll(key);
                return Ok(Some(Attempt::Held {
                    expires_in: Some(QUEUE_ENTRY_TTL / 3),
                }));
            }
            Err(err) => {
                self.leave_read(key, id).await;
                return Err(err);
            }
        }
        {
            let mut keys = self.modes.keys();
            let Some(entry) = keys.get_mut(key) else {
                return Ok(None);
            };
            if entry.read.as_ref().is_none_or(|read| read.id != id) || session.is_ended() {
                return Ok(None);
            }
            self.book(entry, key, owner, ttl, &session, None, token);
        }
        Ok(Some(Attempt::Acquired(
            Grant::new(token).lost_with(session.loss_group()),
        )))
    }

    /// Whether a writer's mark on `key` stands ([`sql::MARKED`]).
    async fn writer_marked(self: &Arc<Self>, key: &LockKey) -> Result<bool, LockError> {
        let session = self.session().await?;
        let answer = async {
            let statement = session
                .mode_statement(ModeStatement::Marked, &self.modes.statements)
                .await?;
            session
                .query_one(statement, &[&key.as_str(), &self.options.key_seed])
                .await?
                .try_get::<_, bool>(0)
        }
        .await;
        match answer {
            Ok(marked) => Ok(marked),
            Err(err) => {
                // A join asks the server nothing else, so it makes what is
                // gone again itself: the next join finds it.
                if self.remake_if_missing(key, &err).await
                    && let Err(failure) = self.modes_ready(Operation::Acquire, key).await
                {
                    tracing::warn!(key = %key, error = %failure, "cannot make the phase table again");
                }
                Err(self.failed(
                    Operation::Acquire,
                    key,
                    "asking for a writer's mark failed",
                    err,
                ))
            }
        }
    }

    /// Books `owner`'s grant of `key` in its entry, with its deadline.
    #[allow(clippy::too_many_arguments)]
    fn book(
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
                .add(Arc::downgrade(self), key, owner, Instant::now() + ttl);
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

    /// One reader leaves this process's hold `id` of `key`; the last one
    /// out drops it on the server, and the next reader waits for that.
    async fn leave_read(&self, key: &LockKey, id: u64) {
        let (session, unlocked) = {
            let mut keys = self.modes.keys();
            let Some(read) = keys
                .get_mut(key)
                .and_then(|entry| entry.read.as_mut())
                .filter(|read| read.id == id && read.unlocking.is_none())
            else {
                return;
            };
            read.members = read.members.saturating_sub(1);
            if read.members > 0 {
                return;
            }
            let (unlocked, waiting) = watch::channel(());
            read.unlocking = Some(waiting);
            (Arc::clone(&read.session), unlocked)
        };
        let seed = self.options.key_seed;
        let answer = async {
            let statement = session
                .mode_statement(ModeStatement::UnlockShared, &self.modes.statements)
                .await?;
            session.query(statement, &[&key.as_str(), &seed]).await
        }
        .await;
        if let Err(err) = answer
            && !err.is_closed()
            && !session.is_ended()
        {
            // Whether the hold is gone is unknown: ending the session
            // drops it for sure (and tells the leases on it).
            tracing::warn!(key = %key, error = %err, "dropping a shared hold failed");
            session.end(format!("could not release `{key}`"));
        }
        let mut keys = self.modes.keys();
        if let Some(entry) = keys.get_mut(key) {
            if entry.read.as_ref().is_some_and(|read| read.id == id) {
                entry.read = None;
            }
            if entry.unused() {
                keys.remove(key);
            }
        }
        drop(unlocked);
    }

    async fn mode_on_server(
        self: &Arc<Self>,
        key: &LockKey,
        owner: OwnerId,
        ttl: Duration,
        access: Access,
    ) -> Result<Attempt, LockError> {
        self.modes_ready(Operation::Acquire, key).await?;
        let session = self.session().await?;
        let seed = self.options.key_seed;
        let which = match access {
            Access::Permits { .. } => ModeStatement::TryPermit,
            _ => ModeStatement::TryShared,
        };
        // A prepare takes no lock: one that fails (what it names is gone
        // or changed, or locked by a DBA past the session's lock_timeout)
        // leaves the session and the other leases on it alone.
        let statement = match session.mode_statement(which, &self.modes.statements).await {
            Ok(statement) => statement,
            Err(err) => return Err(self.mode_unprepared(key, err).await),
        };
        // A permit statement may take any of its slots' advisory keys:
        // counted in flight until its hold is booked, and not sent while an
        // undo on the session may unlock one (see `Claims::claim_for_undo`).
        // A shared statement takes no exclusive session lock: nothing an
        // undo's unlock could drop.
        let in_flight = match access {
            Access::Permits { permits } => {
                match session
                    .claims
                    .mark_permit(key.as_str(), permits, self.options.key_seed)
                {
                    Some(mark) => Some(mark),
                    None => {
                        self.modes.poll(key);
                        return Ok(Attempt::Held { expires_in: None });
                    }
                }
            }
            _ => None,
        };
        let answer = match access {
            Access::Permits { permits } => {
                let n = i32::try_from(permits).unwrap_or(i32::MAX);
                let mut skipped: Vec<i32> = self
                    .modes
                    .keys()
                    .get(key)
                    .map(|entry| {
                        entry
                            .holds
                            .values()
                            .filter_map(|hold| hold.slot)
                            .filter_map(|slot| i32::try_from(slot).ok())
                            .collect()
                    })
                    .unwrap_or_default();
                // Nor a slot with the advisory key of a lease of this
                // session (the server would grant it again, re-entrant):
                // marked in flight above, so a lease's statement sent from
                // now on reads the permit's hold on the server.
                skipped.extend(session.claims.slots_held_here(key.as_str(), permits, seed));
                async {
                    let row = session
                        .query_one(statement, &[&key.as_str(), &seed, &n, &skipped])
                        .await?;
                    Ok((
                        row.try_get::<_, Option<i64>>(1)?,
                        row.try_get::<_, Option<i32>>(0)?,
                        false,
                    ))
                }
                .await
            }
            _ => {
                async {
                    let row = session
                        .query_one(statement, &[&key.as_str(), &seed])
                        .await?;
                    Ok((
                        row.try_get::<_, Option<i64>>(0)?,
                        None,
                        row.try_get::<_, Option<bool>>(1)?.unwrap_or(false),
                    ))
                }
                .await
            }
        };
        let (token, slot, marked) = match answer {
            Ok(answer) => answer,
            Err(err) => return Err(self.mode_failed(&session, key, err).await),
        };
        let Some(token) = token else {
            // Held by a writer, a mark, readers or every slot: the wait
            // probe hears only of exclusive holders, so waiters poll.
            self.modes.poll(key);
            let expires_in = marked.then_some(QUEUE_ENTRY_TTL / 3);
            return Ok(Attempt::Held { expires_in });
        };
        let slot = match slot.map(u32::try_from) {
            Some(Ok(slot)) => Some(slot),
            Some(Err(_)) => {
                session.end("the permit statement answered a negative slot".to_owned());
                return Err(LockError::backend(
                    KIND,
                    Operation::Acquire,
                    key.as_str(),
                    Failure::msg("the permit statement answered a negative slot"),
                ));
            }
            None => None,
        };
        let token = match xact::to_token(token, key.as_str()) {
            Ok(token) => token,
            Err(err) => {
                session.end(format!("a bad token for `{key}`"));
                return Err(err);
            }
        };
        let slot_number = slot;
        let slot = match slot {
            Some(slot) => match self.claim_slot(&session, key, slot).await? {
                Some(claim) => Some((slot, claim)),
                None => {
                    self.modes.poll(key);
                    return Ok(Attempt::Held { expires_in: None });
                }
            },
            None => None,
        };
        {
            let mut keys = self.modes.keys();
            let entry = keys.entry(key.clone()).or_default();
            self.book(entry, key, owner, ttl, &session, slot, token);
            if access == Access::Shared {
                entry.read = Some(ReadHold {
                    id: self.modes.next_read.fetch_add(1, Ordering::Relaxed),
                    session: Arc::clone(&session),
                    token,
                    members: 1,
                    unlocking: None,
                });
            }
        }
        drop(in_flight);
        let grant = Grant::new(token).lost_with(session.loss_group());
        Ok(Attempt::Acquired(match slot_number {
            Some(slot) => grant.in_slot(slot),
            None => grant,
        }))
    }

    /// Counts the hold of `key`'s permit `slot`, just taken on `session`,
    /// in the session's claims, by its advisory key: computed here, or
    /// asked of the server where it cannot be. `None` when a lease of this
    /// process holds that advisory key on the session (the server granted
    /// the slot again only because advisory locks are re-entrant): the
    /// slot is given back, as held. A failure ends the session, which
    /// drops the slot for sure.
    async fn claim_slot(
        &self,
        session: &Arc<LockSession>,
        key: &LockKey,
        slot: u32,
    ) -> Result<Option<PermitClaim>, LockError> {
        let seed = self.options.key_seed;
        let slot_key = format!("dlock-permit:{slot}:{key}");
        let advisory_key = match session.claims.advisory_key_of(&slot_key, seed) {
            Some(h) => Ok(h),
            None => session
                .query_one(sql::ADVISORY_KEY, &[&slot_key, &seed])
                .await
                .and_then(|row| row.try_get::<_, i64>(0)),
        };
        let gone = |what: &str, err: tokio_postgres::Error| {
            session.end(format!("{what} of `{key}`"));
            self.failed(Operation::Acquire, key, what, err)
        };
        let advisory_key = advisory_key
            .map_err(|err| gone("cannot tell the advisory key of a permit's slot", err))?;
        if let Some(claim) = session.claims.claim_permit(advisory_key) {
            return Ok(Some(claim));
        }
        let slot = i32::try_from(slot).unwrap_or(i32::MAX);
        let given_back = async {
            let statement = session
                .mode_statement(ModeStatement::UnlockPermit, &self.modes.statements)
                .await?;
            session
                .query(statement, &[&key.as_str(), &seed, &slot])
                .await
        }
        .await;
        given_back.map_err(|err| gone("cannot give back a permit's slot", err))?;
        Ok(None)
    }

    /// The error of a shared or permit statement that failed. The
    /// statement gives back what it took when its draw fails or a lock it
    /// waited for timed out; after any other failure on a live connection
    /// (a cancel, which no exception handler catches) it may have left a
    /// lock behind, and ending the session is the one sure way to drop it.
    async fn mode_failed(
        &self,
        session: &LockSession,
        key: &LockKey,
        err: tokio_postgres::Error,
    ) -> LockError {
        let missing = self.remake_if_missing(key, &err).await;
        // The functions give back what they took when a statement inside
        // them fails (a lock they waited for past the session's
        // lock_timeout among them: a DBA's LOCK TABLE or TRUNCATE left
        // open), so the session and the other leases on it live on.
        // Nor does a key the server's encoding lacks: it fails at bind,
        // before anything ran.
        let refused = err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE)
            || sql::unencodable(&err)
            || err
                .as_db_error()
                .is_some_and(|db| db.message().contains(sql::REFUSED));
        if !missing && !refused && !err.is_closed() && !session.is_ended() {
            session.end(format!("a shared or permit statement for `{key}` failed"));
        }
        self.failed(
            Operation::Acquire,
            key,
            "the shared or permit statement failed",
            err,
        )
    }

    /// The error of a shared or permit statement that could not be
    /// prepared: it ran nothing, so the session lives on.
    async fn mode_unprepared(&self, key: &LockKey, err: tokio_postgres::Error) -> LockError {
        self.remake_if_missing(key, &err).await;
        self.failed(
            Operation::Acquire,
            key,
            "the shared or permit statement could not be prepared",
            err,
        )
    }

    /// Whether `err` says that what shared locks and permits need is gone
    /// (the table, a function or the token sequence, dropped while the
    /// service runs): it is made again, for the next attempt.
    async fn remake_if_missing(&self, key: &LockKey, err: &tokio_postgres::Error) -> bool {
        let missing = err.code().is_some_and(|code| {
            *code == SqlState::UNDEFINED_FUNCTION
                || *code == SqlState::UNDEFINED_TABLE
                || *code == SqlState::INVALID_SCHEMA_NAME
        });
        if missing {
            *self.modes.ready.lock().await = (false, None);
            if sql::sequence_missing(err)
                && let Err(failure) = Box::pin(self.restore_objects()).await
            {
                tracing::warn!(key = %key, error = %failure, "cannot create the token sequence again");
            }
        }
        missing
    }

    /// Makes the table and functions of [`sql::MODES_SETUP`] once.
    async fn modes_ready(
        self: &Arc<Self>,
        operation: Operation,
        key: &LockKey,
    ) -> Result<(), LockError> {
        let mut ready = self.modes.ready.lock().await;
        if ready.0 {
            return Ok(());
        }
        let session = self.session().await?;
        session
            .query(&self.modes.setup_sql, &[])
            .await
            .map_err(|e| {
                self.failed(
                    operation,
                    key,
                    "cannot create the table and functions of shared locks and permits (needs \
                     CREATE on the schema)",
                    e,
                )
            })?;
        *ready = (true, None);
        Ok(())
    }

    /// Whether shared locks or permits are in use in this schema, so a
    /// refused writer has readers to leave a mark for: the functions exist.
    /// Looked up at most every [`ABSENT_BELIEVED`] while they do not, so a
    /// service that never takes shared locks creates nothing.
    async fn modes_in_use(self: &Arc<Self>) -> bool {
        let mut ready = self.modes.ready.lock().await;
        if ready.0 {
            return true;
        }
        if ready.1.is_some_and(|at| at.elapsed() < ABSENT_BELIEVED) {
            return false;
        }
        let Ok(session) = self.session().await else {
            return false;
        };
        let exists = session
            .query_one(&self.modes.exists_sql, &[])
            .await
            .ok()
            .and_then(|row| row.try_get::<_, bool>(0).ok())
            .unwrap_or(false);
        *ready = (exists, (!exists).then(Instant::now));
        exists
    }

    /// Rule M3: a writer refused while readers hold leaves or refreshes its
    /// mark. True if readers hold (the mark is left, or another writer's
    /// stands).
    pub(super) async fn mark_writer(self: &Arc<Self>, key: &LockKey, owner: OwnerId) -> bool {
        if !self.modes_in_use().await {
            return false;
        }
        let Ok(session) = self.session().await else {
            return false;
        };
        let hex = owner.to_hex();
        let me = std::str::from_utf8(&hex).unwrap_or_default();
        let ttl_ms = i64::try_from(QUEUE_ENTRY_TTL.as_millis()).unwrap_or(i64::MAX);
        let marked = session
            .query_one(
                &self.modes.mark_sql,
                &[&key.as_str(), &self.options.key_seed, &me, &ttl_ms],
            )
            .await
            .and_then(|row| row.try_get::<_, bool>(0));
        match marked {
            Ok(true) => {
                self.modes
                    .marked
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert((key.clone(), owner));
                self.modes.poll(key);
                true
            }
            Ok(false) => false,
            Err(err) => {
                tracing::debug!(key = %key, error = %err, "leaving a writer-waiting mark failed");
                false
            }
        }
    }

    /// Removes `owner`'s mark on `key`, if this process left one (the
    /// writer got the key, or gave up). True if it had one.
    pub(super) async fn unmark_writer(self: &Arc<Self>, key: &LockKey, owner: OwnerId) -> bool {
        let had = self
            .modes
            .marked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&(key.clone(), owner));
        if !had {
            return false;
        }
        let hex = owner.to_hex();
        let me = std::str::from_utf8(&hex).unwrap_or_default();
        let removed = match self.session().await {
            Ok(session) => session
                .query(
                    &self.modes.unmark_sql,
                    &[&key.as_str(), &self.options.key_seed, &me],
                )
                .await
                .map(drop),
            Err(err) => {
                tracing::debug!(key = %key, error = %err, "no session to remove a writer-waiting mark on");
                return true;
            }
        };
        if let Err(err) = removed {
            // The mark lives out its expiry.
            tracing::debug!(key = %key, error = %err, "removing a writer-waiting mark failed");
        }
        true
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

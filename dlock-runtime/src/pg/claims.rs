//! What a lock session's process knows of the advisory keys on it: the
//! ones its leases hold (claims), the lock statements in flight and the
//! advisory keys they may take, and whether the server's advisory keys
//! are the ones the `hash` module computes. The backend decides from it,
//! before a statement is sent, whether another lease or statement on the
//! session shares its advisory key, and when a failed statement's undo
//! can unlock without dropping someone else's hold.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// The `classid`s of the two token marks of `advisory_key`, as
/// `sql::TRY_LOCK_NAMED` takes them (`mark_class_a!`, `mark_class_b!`).
fn mark_classes(advisory_key: i64) -> (i64, i64) {
    const MASK: i64 = 0xffff_ffff;
    (
        ((advisory_key >> 32) ^ 0x544f_4b4e) & MASK,
        (((advisory_key << 32) >> 32) ^ 0x544f_4b4d) & MASK,
    )
}

/// How many slots of a permit statement in flight are hashed to see
/// whether it may take an advisory key: one of more slots may take any.
const SLOTS_HASHED: u32 = 4096;

/// The claims and in-flight statements of one lock session.
pub(super) struct Claims {
    /// The session's server process id, for warnings.
    pid: i32,
    /// The advisory keys this process's leases and permits hold on the
    /// session: the index behind the backend's collision check, so it
    /// costs one lookup instead of a scan of every key held.
    claimed: Mutex<Claimed>,
    /// The lock statements in flight on the session (see
    /// [`already_holds`](Self::already_holds)).
    in_flight: Mutex<Flying>,
    /// Cleared when the server's advisory keys are not the ones the `hash`
    /// module computes (see [`advisory_key_of`](Self::advisory_key_of)).
    hashes: AtomicBool,
    /// Whether the server's encoding is UTF-8: else only ASCII keys have
    /// the advisory keys the `hash` module computes.
    utf8: AtomicBool,
}

/// The advisory keys held on a session: one lease each (a second is
/// contention), and the slots of permits, counted.
#[derive(Default)]
struct Claimed {
    leases: HashSet<i64>,
    permits: HashMap<i64, usize>,
}

impl Claimed {
    fn holds(&self, advisory_key: i64) -> bool {
        self.leases.contains(&advisory_key) || self.permits.contains_key(&advisory_key)
    }
}

/// Lock statements in flight on a session: how many of each advisory
/// key, how many whose advisory key is not known before the answer (on a
/// session that stopped trusting its own hash), the permit statements
/// (which try slot after slot), and the advisory keys undos claim between
/// their claim and their unlock (see [`Claims::claim_for_undo`]).
#[derive(Default)]
struct Flying {
    keys: HashMap<i64, usize>,
    unknown: usize,
    permits: HashMap<u64, PermitFlight>,
    next_permit: u64,
    undoing: Vec<i64>,
}

/// A permit statement in flight: its key, how many slots it may try, and
/// the seed their advisory keys are hashed with.
struct PermitFlight {
    key: Box<str>,
    slots: u32,
    seed: i64,
}

impl PermitFlight {
    /// Whether one of the slots may have `advisory_key` (any, past
    /// [`SLOTS_HASHED`] slots or where the slots' keys cannot be hashed
    /// here).
    fn may_take(&self, claims: &Claims, advisory_key: i64) -> bool {
        self.slots > SLOTS_HASHED
            || (0..self.slots).any(|slot| {
                claims
                    .advisory_key_of(&format!("dlock-permit:{slot}:{}", self.key), self.seed)
                    .is_none_or(|h| h == advisory_key)
            })
    }
}

/// What a statement in flight may take.
enum Flight {
    Key(i64),
    Unknown,
    Permit(u64),
}

/// A lock statement counted in flight on its session until dropped (see
/// [`Claims::already_holds`]): dropped once its lease claimed its
/// advisory key, or gave it back.
pub(super) struct InFlight {
    claims: Arc<Claims>,
    flight: Flight,
}

impl InFlight {
    /// The advisory key of the statement, if it was known when sent.
    pub(super) fn advisory_key(&self) -> Option<i64> {
        match self.flight {
            Flight::Key(h) => Some(h),
            _ => None,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut flying = self.claims.flying();
        match self.flight {
            Flight::Key(h) => uncount(&mut flying.keys, h),
            Flight::Unknown => flying.unknown = flying.unknown.saturating_sub(1),
            Flight::Permit(id) => {
                flying.permits.remove(&id);
            }
        }
    }
}

/// An undo's claim of an advisory key (see [`Claims::claim_for_undo`]),
/// given up when dropped.
pub(super) struct UndoClaim {
    claims: Arc<Claims>,
    advisory_key: i64,
}

impl Drop for UndoClaim {
    fn drop(&mut self) {
        let mut flying = self.claims.flying();
        if let Some(at) = flying.undoing.iter().position(|&h| h == self.advisory_key) {
            flying.undoing.swap_remove(at);
        }
    }
}

/// A permit's hold of its slot's advisory key on a session, counted in
/// the session's claims until dropped with the permit's hold.
pub(super) struct PermitClaim {
    claims: Arc<Claims>,
    advisory_key: i64,
}

impl Drop for PermitClaim {
    fn drop(&mut self) {
        uncount(&mut self.claims.claimed().permits, self.advisory_key);
    }
}

/// Takes one off `advisory_key`'s count in `counts`, and the entry with
/// its last.
fn uncount(counts: &mut HashMap<i64, usize>, advisory_key: i64) {
    if let Some(count) = counts.get_mut(&advisory_key) {
        *count -= 1;
        if *count == 0 {
            counts.remove(&advisory_key);
        }
    }
}

impl Claims {
    pub(super) fn new(pid: i32) -> Arc<Self> {
        Arc::new(Self {
            pid,
            claimed: Mutex::default(),
            in_flight: Mutex::default(),
            hashes: AtomicBool::new(true),
            utf8: AtomicBool::new(true),
        })
    }

    fn claimed(&self) -> std::sync::MutexGuard<'_, Claimed> {
        self.claimed.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn flying(&self) -> std::sync::MutexGuard<'_, Flying> {
        self.in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// True when no lease of this process holds a lock on this session.
    pub(super) fn holds_nothing(&self) -> bool {
        let claimed = self.claimed();
        claimed.leases.is_empty() && claimed.permits.is_empty()
    }

    /// Records that a lease now holds `advisory_key` on this session; false
    /// (and nothing recorded) when another lease or a permit already does:
    /// the server granted it again only because advisory locks are
    /// re-entrant. A permit whose statement took it meanwhile claims it
    /// after this (see [`claim_permit`](Self::claim_permit)): whichever
    /// claims first keeps it, the other gives its hold back.
    pub(super) fn claim(&self, advisory_key: i64) -> bool {
        let mut claimed = self.claimed();
        !claimed.permits.contains_key(&advisory_key) && claimed.leases.insert(advisory_key)
    }

    /// Whether a lease held on this session, or a lock statement in flight
    /// on it, other than of `advisory_key` itself, has a key whose token
    /// marks share a `classid` with `advisory_key`'s (see
    /// `sql::TRY_LOCK_NAMED`): an undo of its marks could then drop
    /// another lease's.
    pub(super) fn marks_collide(&self, advisory_key: i64) -> bool {
        let classes = mark_classes(advisory_key);
        let collides = |other: i64| {
            let theirs = mark_classes(other);
            other != advisory_key
                && [classes.0, classes.1]
                    .iter()
                    .any(|c| *c == theirs.0 || *c == theirs.1)
        };
        let claimed = self.claimed();
        let flying = self.flying();
        claimed.leases.iter().any(|h| collides(*h))
            || claimed.permits.keys().any(|h| collides(*h))
            || flying.keys.keys().any(|h| collides(*h))
            || flying.unknown > 0
    }

    /// Undoes a [`claim`](Self::claim) when the hold ends.
    pub(super) fn unclaim(&self, advisory_key: i64) {
        self.claimed().leases.remove(&advisory_key);
    }

    /// Counts a permit's hold of its slot's advisory key on this session
    /// until the returned claim is dropped; `None`, and nothing counted,
    /// when a lease holds that advisory key here: the server granted the
    /// slot again only because advisory locks are re-entrant.
    pub(super) fn claim_permit(self: &Arc<Self>, advisory_key: i64) -> Option<PermitClaim> {
        let mut claimed = self.claimed();
        if claimed.leases.contains(&advisory_key) {
            return None;
        }
        *claimed.permits.entry(advisory_key).or_default() += 1;
        Some(PermitClaim {
            claims: Arc::clone(self),
            advisory_key,
        })
    }

    /// Claims `advisory_key` for the undo of a failed lock statement
    /// (`own`: its in-flight mark) that cannot tell whether it took it,
    /// until the returned claim is dropped (after the undo's unlock).
    /// `None`, and nothing claimed, when a lease or a permit holds it, or
    /// another lock statement that may take it waits for its answer on
    /// this session (one of the same advisory key, a permit statement one
    /// of whose slots may have it, or one whose advisory key is not
    /// known): that statement may have a fresh hold of it, not yet
    /// claimed, which the undo's one unlock would drop instead of its own.
    /// While the claim stands, no statement that may take the advisory key
    /// is sent on this session (see [`already_holds`](Self::already_holds)
    /// and [`mark_permit`](Self::mark_permit)), so the unlock drops what
    /// the failed statement took, or nothing.
    pub(super) fn claim_for_undo(
        self: &Arc<Self>,
        advisory_key: i64,
        own: &InFlight,
    ) -> Option<UndoClaim> {
        let claimed = self.claimed();
        let mut flying = self.flying();
        let same = flying.keys.get(&advisory_key).copied().unwrap_or(0);
        let same = same.saturating_sub(usize::from(own.advisory_key() == Some(advisory_key)));
        let unknown = flying
            .unknown
            .saturating_sub(usize::from(matches!(own.flight, Flight::Unknown)));
        let permit = flying
            .permits
            .values()
            .any(|permit| permit.may_take(self, advisory_key));
        if same > 0 || unknown > 0 || permit || claimed.holds(advisory_key) {
            return None;
        }
        flying.undoing.push(advisory_key);
        Some(UndoClaim {
            claims: Arc::clone(self),
            advisory_key,
        })
    }

    /// For a lock statement of a key whose advisory key is `advisory_key`
    /// (`None`: not known before the answer), about to be sent: `None`
    /// when a lease or a permit of this process, or an undo, claims that
    /// advisory key on this session (the attempt is answered held in
    /// process; the server would grant it only because advisory locks are
    /// re-entrant). Else whether the session holds the advisory key
    /// already, decided in process: `Some(true)` also when another lock
    /// statement of it is in flight (its lease may be the holder by the
    /// time this one runs), and `None` (the statement reads `pg_locks`)
    /// when a permit statement or a statement of an unknown advisory key
    /// is in flight, or this one's is unknown. Until the returned mark is
    /// dropped, the statement counts as in flight.
    pub(super) fn already_holds(
        self: &Arc<Self>,
        advisory_key: Option<i64>,
    ) -> Option<(Option<bool>, InFlight)> {
        let claimed = self.claimed();
        let mut flying = self.flying();
        let answer = match advisory_key {
            Some(h) if claimed.holds(h) || flying.undoing.contains(&h) => return None,
            None if !flying.undoing.is_empty() => return None,
            Some(h) if flying.unknown == 0 && flying.permits.is_empty() => {
                Some(flying.keys.contains_key(&h))
            }
            _ => None,
        };
        let flight = match advisory_key {
            Some(h) => {
                *flying.keys.entry(h).or_default() += 1;
                Flight::Key(h)
            }
            None => {
                flying.unknown += 1;
                Flight::Unknown
            }
        };
        Some((
            answer,
            InFlight {
                claims: Arc::clone(self),
                flight,
            },
        ))
    }

    /// The slots of a permit of `key`, among its first `slots` (at most
    /// [`SLOTS_HASHED`]), whose advisory keys a lease of this process holds
    /// on this session, or a lock statement in flight on it may take: a
    /// permit statement must not take one of them a second time beside
    /// that lease.
    pub(super) fn slots_held_here(&self, key: &str, slots: u32, seed: i64) -> Vec<i32> {
        let claimed = self.claimed();
        let flying = self.flying();
        if claimed.leases.is_empty() && flying.keys.is_empty() {
            return Vec::new();
        }
        (0..slots.min(SLOTS_HASHED))
            .filter(|slot| {
                self.advisory_key_of(&format!("dlock-permit:{slot}:{key}"), seed)
                    .is_some_and(|h| claimed.leases.contains(&h) || flying.keys.contains_key(&h))
            })
            .filter_map(|slot| i32::try_from(slot).ok())
            .collect()
    }

    /// Counts a permit statement of `key` that may try `slots` slots in
    /// flight until the returned mark is dropped (after its hold is
    /// booked); `None`, and the statement must not be sent, while an undo
    /// on this session is between its claim and its unlock of an advisory
    /// key one of the slots may have.
    pub(super) fn mark_permit(
        self: &Arc<Self>,
        key: &str,
        slots: u32,
        seed: i64,
    ) -> Option<InFlight> {
        let permit = PermitFlight {
            key: key.into(),
            slots,
            seed,
        };
        let mut flying = self.flying();
        if flying.undoing.iter().any(|&h| permit.may_take(self, h)) {
            return None;
        }
        let id = flying.next_permit;
        flying.next_permit += 1;
        flying.permits.insert(id, permit);
        Some(InFlight {
            claims: Arc::clone(self),
            flight: Flight::Permit(id),
        })
    }

    /// The advisory key of `key` with `seed`, computed in process; `None`
    /// for a key outside ASCII on a server whose encoding is not UTF-8,
    /// and for any key once this session found that the server computes
    /// another (see [`check_advisory_key`](Self::check_advisory_key)).
    pub(super) fn advisory_key_of(&self, key: &str, seed: i64) -> Option<i64> {
        let known = self.hashes.load(Ordering::Acquire)
            && (key.is_ascii() || self.utf8.load(Ordering::Acquire));
        known.then(|| super::hash::advisory_key(key, seed))
    }

    /// Takes what a new session learned of the server: whether it hashes
    /// the probe as the `hash` module does, and whether its encoding is
    /// UTF-8.
    pub(super) fn hashes_agree(&self, (probe, utf8): (bool, bool)) {
        self.utf8.store(utf8, Ordering::Release);
        if !probe {
            self.distrust_hashes();
        }
    }

    /// Stops computing advisory keys in process on this session: the
    /// server's differ (see the `hash` module).
    pub(super) fn distrust_hashes(&self) {
        if self.hashes.swap(false, Ordering::AcqRel) {
            tracing::warn!(
                pid = self.pid,
                "the server's advisory keys differ from the ones dlock computes: this lock \
                 session asks the server instead"
            );
        }
    }

    /// Compares the advisory key `expected` of `key` (computed in process)
    /// with the one the server answered, and stops trusting the former on
    /// this session when they differ.
    pub(super) fn check_advisory_key(&self, key: &str, expected: Option<i64>, server: i64) {
        if expected.is_some_and(|h| h != server) {
            tracing::warn!(
                key,
                expected,
                server,
                "an advisory key differs from the server's"
            );
            self.distrust_hashes();
        }
    }
}

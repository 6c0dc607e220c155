//! Naming the holder of a lease without an identity with no write per
//! acquisition: who each lock session is and which key each advisory key
//! stands for, each written once ([`sql::NAME_LEASE`]), and read back
//! beside `pg_locks` ([`sql::SESSION_HOLDERS`], [`sql::HELD_NAMED`]).
//!
//! Its own file because it is the one state of the lock path that spans
//! sessions: the keys this process named, and whether the tables of names
//! may be used at all.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::OnceCell;
use tokio::time::Instant;
use tokio_postgres::Statement;
use tokio_postgres::error::SqlState;

use super::session::LockSession;
use super::{Inner, sql};
use crate::holder::HolderInfo;
use crate::key::LockKey;

/// How long this process takes a key (or a session its holder) it named
/// for named: it names it again (a probe of the table's primary key, no
/// write when the row is there) at its first lock after that, so a DBA who
/// emptied `dlock_keys` or `dlock_sessions` hides a key from `held`, or a
/// session's holder, for this long at most once the key is locked again.
pub(super) const KEPT: Duration = Duration::from_secs(600);

/// How many named keys this process remembers: past that it forgets them
/// all, and names each again at its next lock.
const MAX_KEPT: usize = 65_536;

/// How many leases of a backend carry token marks at once: each costs the
/// server two more entries of its lock table while held (see
/// `sql::TRY_LOCK_NAMED`), which is sized for about
/// `max_locks_per_transaction` × `max_connections` (6,400 by default) for
/// every client of the server. Past these, a lease without an identity
/// records itself in `dlock_holders` instead, as where the tables of names
/// cannot be used: one entry, and a write per acquisition. So a backend
/// holding many leases at once (thousands, for long) needs no more of the
/// lock table than before, and a cycle of a few hundred leases at a time
/// writes nothing.
pub(super) const MAX_MARKED: usize = 512;

/// How long a naming statement waits for a lock on the tables of names
/// (see [`sql::NAME_LEASE`]): every statement behind it on the session
/// waits as long.
const NAME_LOCK_WAIT: Duration = Duration::from_millis(100);

/// How long no naming statement is sent after one waited too long for the
/// tables (a DBA's `LOCK TABLE`, `TRUNCATE`, `ALTER TABLE`): the leases
/// taken meanwhile go unnamed rather than each wait again.
const LOCKED_PAUSE: Duration = Duration::from_secs(10);

/// What this backend named, and whether it may name at all.
#[derive(Default)]
pub(super) struct Names {
    /// Whether the tables of names exist and the role may use them, as the
    /// last look at the table of holder records found them (see
    /// `holders_table`): if not, leases without an identity record their
    /// holder with every acquisition, the older way.
    usable: AtomicBool,
    /// The keys this process named, with when.
    keys: Mutex<HashMap<Box<str>, Instant>>,
    /// Until when no naming statement is sent (see [`LOCKED_PAUSE`]).
    paused_until: Mutex<Option<Instant>>,
    /// How many leases carry token marks, or are being taken with them.
    marked: Arc<AtomicUsize>,
    /// When this process last swept names of keys no longer locked.
    swept_at: Mutex<Option<Instant>>,
}

/// A lease's place among a backend's marked leases (see [`MAX_MARKED`]),
/// given back when dropped.
pub(super) struct MarkSlot(Arc<AtomicUsize>);

impl Drop for MarkSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a lock session keeps of names.
#[derive(Default)]
struct NamedSession {
    /// The statements of named leases, prepared on the first such lease.
    statements: OnceCell<NamedStatements>,
    /// The holders this session named, with when: one, unless its leases
    /// carry several labels.
    holders: Mutex<Vec<(Box<str>, Instant)>>,
}

/// A lock session's statements of named leases.
pub(super) struct NamedStatements {
    /// [`sql::TRY_LOCK_NAMED`].
    pub(super) lock: Statement,
    /// [`sql::TRY_LOCK_NAMED_QUICK`].
    pub(super) quick: Statement,
    /// [`sql::UNLOCK_NAMED`].
    pub(super) unlock: Statement,
}

impl LockSession {
    /// The statements of named leases, with `inner`'s SQL, prepared on
    /// first use (pipelined: one round trip).
    pub(super) async fn named_statements(
        &self,
        inner: &Inner,
    ) -> Result<&NamedStatements, tokio_postgres::Error> {
        self.feature::<NamedSession>()
            .statements
            .get_or_try_init(|| async {
                let (lock, quick, unlock) = tokio::try_join!(
                    self.prepare(&inner.try_lock_named_sql),
                    self.prepare(inner.quick.sql(true)),
                    self.prepare(&inner.unlock_named_sql),
                )?;
                Ok(NamedStatements {
                    lock,
                    quick,
                    unlock,
                })
            })
            .await
    }

    /// Whether this session named `holder` within `kept`.
    fn named(&self, holder: &str, kept: Duration) -> bool {
        self.feature::<NamedSession>()
            .holders
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .any(|(named, at)| **named == *holder && at.elapsed() < kept)
    }

    /// Whether this session named holders, none of them `holder`: a
    /// reader would name a lease of `holder` on it with theirs (see
    /// [`session_holder`]).
    fn named_others_only(&self, holder: &str) -> bool {
        let named = self
            .feature::<NamedSession>()
            .holders
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        !named.is_empty() && named.iter().all(|(n, _)| **n != *holder)
    }

    /// Notes that this session named `holder` now.
    fn name(&self, holder: &str) {
        let mut named = self
            .feature::<NamedSession>()
            .holders
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        named.retain(|(n, _)| **n != *holder);
        named.push((holder.into(), Instant::now()));
    }
}

impl Names {
    pub(super) fn usable(&self) -> bool {
        self.usable.load(Ordering::Acquire)
    }

    pub(super) fn set_usable(&self, usable: bool) {
        self.usable.store(usable, Ordering::Release);
    }

    /// A place for a lease that carries token marks: `None` when the tables
    /// of names cannot be used, or [`MAX_MARKED`] leases carry marks.
    pub(super) fn mark_slot(&self) -> Option<MarkSlot> {
        if !self.usable() {
            return None;
        }
        self.marked
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_MARKED).then_some(n + 1)
            })
            .ok()?;
        Some(MarkSlot(Arc::clone(&self.marked)))
    }

    fn paused(&self) -> bool {
        self.paused_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|until| Instant::now() < until)
    }

    fn pause(&self) {
        *self
            .paused_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now() + LOCKED_PAUSE);
    }

    /// Whether the naming about to be sent sweeps names of keys no longer
    /// locked (see [`sql::NAME_LEASE`]): once per [`KEPT`], counted from
    /// the first.
    fn sweep_due(&self) -> bool {
        let mut swept = self.swept_at.lock().unwrap_or_else(PoisonError::into_inner);
        if swept.is_some_and(|at| at.elapsed() < KEPT) {
            return false;
        }
        *swept = Some(Instant::now());
        true
    }

    /// Whether `key` is to be named before its next lock.
    fn key_due(&self, key: &str) -> bool {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .is_none_or(|at| at.elapsed() >= KEPT)
    }

    /// Forgets which keys this process named, so each is named again at
    /// its next lock: after a lock session was lost, as a crash or a
    /// failover empties `dlock_keys` (unlogged), which would otherwise hide
    /// held keys from `held` for up to [`KEPT`].
    pub(super) fn forget_keys(&self) {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    fn key_named(&self, key: &str) {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if keys.len() >= MAX_KEPT && !keys.contains_key(key) {
            keys.clear();
        }
        keys.insert(key.into(), Instant::now());
    }
}

impl Inner {
    /// Names, on `session`, what a lock of `key` without an identity needs
    /// named and this process has not named yet: the session's `holder`
    /// ([`HolderInfo::encode`]) and the key. Polled before the lock
    /// statement is sent on the same session, so the server runs it first
    /// (see [`sql::NAME_LEASE`]). Best effort: a name that could not be
    /// written leaves the lease out of `held` (and, when its session was
    /// not named before, without its holder's name) until its key is
    /// locked again and named then, never without its lock: renewals write
    /// only the records of leases with an identity. False when the session's holder
    /// could not be named while the session named others: readers would
    /// name the lease with those, so the lease is taken again with a
    /// record (see `Inner::try_lock`).
    pub(super) async fn name_lease(
        &self,
        session: &LockSession,
        key: &LockKey,
        holder: &str,
    ) -> bool {
        if session.started.is_none() {
            return true;
        }
        if self.names.paused() {
            return !session.named_others_only(holder);
        }
        let name_key = self.names.key_due(key.as_str());
        // A key named anew names its session again too (a probe when the
        // row is there), so a DBA's emptied table heals at the next new key.
        let name_session = name_key || !session.named(holder, KEPT);
        if !name_session && !name_key {
            return true;
        }
        let statement = sql::name_lease(
            &self.name_lease_sql,
            (NAME_LOCK_WAIT.min(self.lock_timeout()), KEPT),
            (holder, name_session),
            (key.as_str(), self.options.key_seed, name_key),
            name_key && self.names.sweep_due(),
        );
        match session.simple_query(&statement).await {
            Ok(_) => {
                if name_session {
                    session.name(holder);
                }
                if name_key {
                    self.names.key_named(key.as_str());
                }
                return true;
            }
            // Dropped since: the next acquisition looks at the tables
            // again, and creates them.
            Err(err) if sql::sequence_missing(&err) => {
                self.names.set_usable(false);
                *self.holders_table.lock().await = false;
                self.holders_state.set_unchecked();
                tracing::debug!(key = %key, error = %err, "the tables of names are missing");
            }
            Err(err) if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                self.names.pause();
                tracing::warn!(
                    key = %key,
                    error = %err,
                    "the tables {s}.dlock_sessions and {s}.dlock_keys are locked by another \
                     transaction (a LOCK TABLE, TRUNCATE or ALTER TABLE left open?): locks \
                     taken in the next {LOCKED_PAUSE:?} are held all the same, but their \
                     holder or key may read as unknown until they are taken again",
                    s = self.quoted_schema,
                );
            }
            Err(err) => {
                tracing::debug!(key = %key, error = %err, "could not name a lease's holder");
            }
        };
        !session.named_others_only(holder)
    }
}

/// The holder of a session that named `records` ([`sql::SESSION_HOLDERS`]):
/// the one it named, or, for a session whose leases carried several
/// labels, its host and pid alone. `None` when it named none that reads.
pub(super) fn session_holder(records: &[String]) -> Option<HolderInfo> {
    let mut named = records.iter().filter_map(|r| HolderInfo::decode(r));
    let first = named.next()?;
    named.try_fold(first, |one, other| {
        (one.host == other.host && one.pid == other.pid).then(|| HolderInfo {
            label: if one.label == other.label {
                one.label
            } else {
                None
            },
            ..one
        })
    })
}

/// How long a lease without a record has held its key: the server's clock
/// now (`now_us`) less its `token`, which the draw took from that clock
/// (see `sql::TRY_LOCK`). Short by how far the token was ahead of the clock
/// at its draw: up to the sequence's token lead (10 ms on a sequence dlock
/// creates, see `draw_token!`; exact without one), more after a burst of
/// tokens drawn faster than one a microsecond or a DBA's `setval` ahead;
/// never less than zero.
pub(super) fn held_for(token: i64, now_us: i64) -> Duration {
    Duration::from_micros(u64::try_from(now_us.saturating_sub(token)).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_with_several_labels_is_named_by_its_host_and_pid_alone() {
        let billing = HolderInfo::this_process(Some("billing")).encode();
        let export = HolderInfo::this_process(Some("export")).encode();
        let one = session_holder(std::slice::from_ref(&billing)).expect("named");
        assert_eq!(one.label.as_deref(), Some("billing"));
        let both = session_holder(&[billing.clone(), export]).expect("named");
        assert_eq!(
            (both.host.as_str(), both.pid, both.label),
            (one.host.as_str(), one.pid, None)
        );
        assert_eq!(session_holder(&["garbage".to_owned()]), None);
        assert_eq!(session_holder(&[]), None);
    }

    #[test]
    fn a_token_ahead_of_the_clock_reads_as_held_for_no_time() {
        assert_eq!(held_for(1_000, 3_500), Duration::from_micros(2_500));
        assert_eq!(held_for(4_000, 3_500), Duration::ZERO);
    }
}

//! What a lock session keeps of the holder records its lock statements
//! write in `dlock_holders` (leases with an identity, and plain ones where
//! the tables of names cannot be used), and what a recording statement's
//! answer and failures mean for its record.
//!
//! Its own file: the lock path, releases, fair waiters and renewals all
//! meet this state, which the session itself does not know.

use std::collections::HashSet;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{Mutex as AsyncMutex, OnceCell};
use tokio::time::Instant;
use tokio_postgres::Statement;
use tokio_postgres::error::SqlState;

use super::connection::Failure;
use super::session::LockSession;
use super::{Inner, KIND, sql};
use crate::error::{LockError, Operation};
use crate::key::LockKey;

/// What a lock session keeps of holder records (see the module docs).
#[derive(Default)]
pub(super) struct Records {
    /// The statements of leases that record an identity, prepared on the
    /// first such lease (they name a table that only exists from then on).
    statements: OnceCell<Recording>,
    /// Held while identity records are written or deleted on this session
    /// (a renewal writing missing ones again, an unlock deleting one), so
    /// that a renewal's write is never sent after the lease's unlock.
    pub(super) writes: AsyncMutex<()>,
    /// Until when renewals write no identity records again on this
    /// session: set after such a write failed (see
    /// `Inner::rewrite_records`).
    rewrites_paused_until: Mutex<Option<Instant>>,
    /// The keys whose holder records lock statements wrote on this
    /// session (see [`wrote_a_record`](Self::wrote_a_record)).
    keys: Mutex<HashSet<String>>,
    /// Holder records of plain leases released on this session, not yet
    /// deleted (see [`sql::DELETE_RELEASED`]).
    released: Mutex<Released>,
}

/// A lock session's statements for leases that record an identity.
pub(super) struct Recording {
    pub(super) try_lock: Statement,
    pub(super) unlock: Statement,
    pub(super) delete_released: Statement,
}

/// How many released records a session keeps before it deletes them.
const RELEASED_BATCH: usize = 64;

/// How long the oldest released record waits for its batch, at most
/// until the next release after that.
const RELEASED_WAIT: Duration = Duration::from_secs(1);

/// The released records of a session waiting for their batch delete:
/// advisory keys and tokens, pairwise, and when the first came.
#[derive(Default)]
pub(super) struct Released {
    pub(super) lock_ids: Vec<i64>,
    pub(super) tokens: Vec<i64>,
    pub(super) since: Option<Instant>,
}

impl LockSession {
    /// What this session keeps of holder records.
    pub(super) fn records(&self) -> &Records {
        self.feature()
    }
}

impl Records {
    /// Keeps the record of a plain lease released on this session for its
    /// batch delete, and hands back the batch when one is due: when
    /// [`RELEASED_BATCH`] have come, or the first came [`RELEASED_WAIT`] ago.
    pub(super) fn released(&self, advisory_key: i64, token: i64) -> Option<Released> {
        let mut released = self.released.lock().unwrap_or_else(PoisonError::into_inner);
        released.lock_ids.push(advisory_key);
        released.tokens.push(token);
        let first = *released.since.get_or_insert_with(Instant::now);
        let due = released.lock_ids.len() >= RELEASED_BATCH || first.elapsed() >= RELEASED_WAIT;
        due.then(|| std::mem::take(&mut *released))
    }

    /// Puts back a batch of released records whose delete failed: they are
    /// still this session's to delete, with its next batch.
    pub(super) fn keep_released(&self, batch: Released) {
        let mut released = self.released.lock().unwrap_or_else(PoisonError::into_inner);
        let since = match (batch.since, released.since) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        released.lock_ids.extend(batch.lock_ids);
        released.tokens.extend(batch.tokens);
        released.since = since;
    }

    /// Whether renewals may write identity records again on this session
    /// (none failed within the pause set by
    /// [`pause_rewrites`](Self::pause_rewrites)).
    pub(super) fn may_rewrite(&self) -> bool {
        self.rewrites_paused_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none_or(|until| until <= Instant::now())
    }

    /// No renewal writes identity records again on this session for `pause`.
    pub(super) fn pause_rewrites(&self, pause: Duration) {
        *self
            .rewrites_paused_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now() + pause);
    }

    /// The statements of leases that record an identity (the SQL of
    /// [`sql::TRY_LOCK_RECORDING`] and [`sql::UNLOCK_RECORDED`] with the
    /// schema filled in), prepared on first use.
    pub(super) async fn recording(
        &self,
        session: &LockSession,
        try_lock_sql: &str,
        unlock_sql: &str,
        delete_released_sql: &str,
    ) -> Result<&Recording, tokio_postgres::Error> {
        self.statements
            .get_or_try_init(|| async {
                Ok(Recording {
                    try_lock: session.prepare(try_lock_sql).await?,
                    unlock: session.prepare(unlock_sql).await?,
                    delete_released: session.prepare(delete_released_sql).await?,
                })
            })
            .await
    }

    /// The recording statements, if they were prepared.
    pub(super) fn recording_prepared(&self) -> Option<&Recording> {
        self.statements.get()
    }

    /// Notes that a lock statement wrote a holder record of `key` on this
    /// session. The session never takes a lease of that key without one
    /// (see `Inner::try_lock`): the record of an earlier lease may still be
    /// there, whatever the session did to delete it (a delete that failed,
    /// or that a DBA's trigger or rule skipped without an error), and it
    /// names this session and the key, so a reader would take it for the
    /// holder's of a lease of the key taken here without one.
    pub(super) fn wrote_a_record(&self, key: &str) {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if !keys.contains(key) {
            keys.insert(key.to_owned());
        }
    }

    /// Whether a lock statement wrote a record of `key` on this session
    /// (see [`wrote_a_record`](Self::wrote_a_record)).
    pub(super) fn may_have_a_record_of(&self, key: &str) -> bool {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(key)
    }
}

impl Inner {
    /// The error of a recording `statement` of `key` that took the lock
    /// (given back since) and wrote no record: none for a lease without
    /// an identity (`identified` false), taken again without its record.
    pub(super) fn no_record_written(
        &self,
        statement: &str,
        key: &LockKey,
        identified: bool,
    ) -> Option<LockError> {
        let what = format!(
            "the {statement} of `{key}` wrote no record, which a trigger \
             or a rule on {}.dlock_holders skips: the lock was not taken",
            self.quoted_schema
        );
        if !identified {
            self.records_unusable(&what);
            return None;
        }
        Some(LockError::backend(
            KIND,
            Operation::Acquire,
            key.as_str(),
            Failure::msg(what),
        ))
    }

    /// Whether a lease without an identity (`identified` false) whose
    /// `recording` lock statement failed with `err` is taken without its
    /// record: it never fails for its record, since what stopped the
    /// recording statement (a privilege revoked, the table locked by a DBA
    /// or changed), the plain one does not meet. Says why the records are
    /// given up when they are.
    pub(super) fn records_refused(
        &self,
        key: &LockKey,
        identified: bool,
        recording: bool,
        err: &tokio_postgres::Error,
    ) -> bool {
        if identified
            || !recording
            || err.as_db_error().is_none()
            || sql::refused_sequence(err).is_some()
        {
            return false;
        }
        if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
            self.records_locked(key, err);
        } else {
            self.records_unusable(err);
        }
        true
    }
}

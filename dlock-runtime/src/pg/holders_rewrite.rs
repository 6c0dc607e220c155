//! A renewal's rewrite of the identity records of the leases it renewed,
//! when a DBA truncated the table or deleted a row, and the table's
//! recreation when it was dropped.
//!
//! Its own file because it runs beside renewals, in tasks of its own,
//! with waits and pauses of its own that bound what it costs the session
//! whose other statements queue behind it.

use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::SimpleQueryMessage;
use tokio_postgres::error::SqlState;

use super::session::LockSession;
use super::{Entry, Inner, KIND, sql};
use crate::backend::OwnerId;
use crate::error::{LockError, Operation};
use crate::key::LockKey;

/// How long a renewal's write of identity records ([`sql::REWRITE_RECORDS`])
/// waits for a lock on their table before it gives up: every statement
/// sent after it on the session (renewals' checks included) waits as long.
const REWRITE_LOCK_WAIT: Duration = Duration::from_millis(100);

/// How long a session sends no write of identity records after one failed
/// for another reason than waiting too long for a lock (a missing
/// privilege, say), which the next renewals would only meet again. A write
/// that waited too long is tried again at the next renewal: a DBA's lock
/// on the table ends by itself, and then the next renewal writes the
/// record, each try costing the session one wait of [`REWRITE_LOCK_WAIT`]
/// meanwhile.
const REWRITE_PAUSE: Duration = Duration::from_secs(10);

/// At most one warning every this long of writes of identity records that
/// waited too long for the table, which every renewal meets while a DBA
/// holds it locked.
pub(super) const REWRITE_LOCK_WARN_EVERY: Duration = Duration::from_secs(10);

/// How long renewals that found the table of identity records missing
/// wait after a failed try to create it before they try again: each try
/// opens a connection of its own.
const RECREATE_PAUSE: Duration = Duration::from_secs(10);

/// What a renewal writes again of a lease taken with an identity.
struct RewriteOf {
    identity: Arc<str>,
    holder: Box<str>,
    since_us: i64,
}

impl Inner {
    /// After a renewal checked `session`, makes sure the identity records
    /// of `leases` (the leases of the batch that are on it and were taken
    /// with an identity) are there and are theirs, and writes again the
    /// ones that are not ([`sql::REWRITE_RECORDS`]): a DBA who truncates
    /// the table, or deletes a row, hides a leader for one renewal interval
    /// at most after the DBA's transaction ends. In a task of its own, so
    /// no renewal ever waits for it, and best effort: a record that cannot
    /// be written is logged, never a failed renewal, as the lock itself is
    /// held all the same.
    pub(super) fn rewrite_records_later(
        self: &Arc<Self>,
        session: &Arc<LockSession>,
        leases: Vec<(LockKey, OwnerId)>,
    ) {
        // A session that could not tell when it started records nothing.
        if leases.is_empty() || session.started.is_none() || !session.records().may_rewrite() {
            return;
        }
        let (inner, session) = (Arc::clone(self), Arc::clone(session));
        self.home.spawn(async move {
            inner.rewrite_records(&session, &leases).await;
        });
    }

    /// See [`rewrite_records_later`](Self::rewrite_records_later). Bounds
    /// what a write that waits costs the session, whose other statements
    /// queue behind it: it waits at most [`REWRITE_LOCK_WAIT`] for a lock,
    /// one at a time per session, and is tried again at the next renewal
    /// if it waited longer; after it failed otherwise the session sends
    /// none for [`REWRITE_PAUSE`]. A missing table is created again in the
    /// background, as the first acquisition with an identity creates it;
    /// the next renewal writes the records.
    async fn rewrite_records(
        self: &Arc<Self>,
        session: &LockSession,
        leases: &[(LockKey, OwnerId)],
    ) {
        // An unlock deleting a record on this session, or another write
        // in flight: the next renewal looks at the records.
        let Ok(_writes) = session.records().writes.try_lock() else {
            return;
        };
        if session.is_ended() || !session.records().may_rewrite() {
            return;
        }
        // Only leases held at this moment, under the lock an unlock takes
        // before it deletes: so this write reaches the server before any
        // of their unlocks.
        let held = self.held_on(session, leases);
        let Some(&(first, ..)) = held.first() else {
            return;
        };
        let rows: Vec<sql::RecordRow<'_>> = held
            .iter()
            .map(|(key, lock_id, token, of)| sql::RecordRow {
                lock_id: *lock_id,
                key: key.as_str(),
                token: *token,
                identity: &of.identity,
                holder: &of.holder,
                since_us: of.since_us,
            })
            .collect();
        let wait = REWRITE_LOCK_WAIT.min(self.lock_timeout());
        let statement = sql::rewrite_records(&self.rewrite_records_sql, wait, &rows);
        let err = match session.simple_query(&statement).await {
            Ok(answers) => {
                let written = answers.iter().rev().find_map(|answer| match answer {
                    SimpleQueryMessage::CommandComplete(rows) => Some(*rows),
                    _ => None,
                });
                if written.is_some_and(|rows| rows > 0) {
                    tracing::warn!(
                        schema = self.quoted_schema,
                        records = written,
                        key = %first,
                        "identity records of held leases were missing or changed (the table \
                         truncated, a row deleted?); the renewal wrote them again"
                    );
                }
                return;
            }
            // No answer: the session may be gone, which its liveness
            // check and the next renewal see.
            Err(err) if err.as_db_error().is_none() => {
                tracing::debug!(key = %first, error = %err, "no answer to a write of identity records");
                return;
            }
            Err(err) => err,
        };
        self.rewrite_failed(session, first, err, wait).await;
    }

    /// Of `leases`, those this process holds on `session` now with an
    /// identity recorded: each with its advisory key, its token and what
    /// [`rewrite_records`](Self::rewrite_records) writes again.
    fn held_on<'a>(
        &self,
        session: &LockSession,
        leases: &'a [(LockKey, OwnerId)],
    ) -> Vec<(&'a LockKey, i64, i64, RewriteOf)> {
        let keys = self.keys();
        leases
            .iter()
            .filter_map(|(key, owner)| {
                let holding = keys
                    .get(key)
                    .filter(|entry| entry.owner == *owner)
                    .and_then(Entry::holding)
                    .filter(|holding| holding.session.id == session.id)?;
                let identified = holding.identity.as_ref()?;
                let of = RewriteOf {
                    identity: Arc::clone(&identified.identity),
                    holder: identified.holder.clone(),
                    since_us: identified.since_us,
                };
                // The token as drawn: a positive int8.
                Some((key, holding.advisory_key, holding.token.get() as i64, of))
            })
            .collect()
    }

    /// What a write of identity records that the server failed (`err`,
    /// for the batch whose first key is `first`, waiting at most `wait`)
    /// leads to: the table recreated, a warning, or a pause of the
    /// session's writes.
    async fn rewrite_failed(
        self: &Arc<Self>,
        session: &LockSession,
        first: &LockKey,
        err: tokio_postgres::Error,
        wait: Duration,
    ) {
        // The server answered, so the session, and its locks, live.
        if sql::sequence_missing(&err) {
            // Fails before it waits for anything; the recreation has a
            // pause of its own.
            self.recreate_holders_table(first, &err);
            return;
        }
        if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
            // No pause: the next renewal tries again, so the record is
            // back one renewal interval after the DBA's lock ends.
            if !self.rewrite_lock_warnings.due() {
                tracing::debug!(key = %first, error = %err, "an identity record still waits for its table");
                return;
            }
            tracing::warn!(
                key = %first,
                error = %err,
                "a renewal could not write an identity record again: the table {s}.dlock_holders \
                 is locked by another transaction (an ALTER TABLE, VACUUM FULL, TRUNCATE or LOCK \
                 TABLE) for longer than the write waits ({wait:?}); the lock is held all the \
                 same, and the next renewal tries again (further such warnings within \
                 {REWRITE_LOCK_WARN_EVERY:?} are logged at debug level)",
                s = self.quoted_schema,
            );
            return;
        }
        session.records().pause_rewrites(REWRITE_PAUSE);
        if err.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) {
            let lacks = self
                .holders_privileges(session)
                .await
                .unwrap_or_else(|| self.lacks_on_holders("the role", "INSERT or UPDATE"));
            tracing::warn!(
                key = %first,
                error = %err,
                "a renewal could not write an identity record again: {lacks} (the lock is held \
                 all the same; until then its holder reads as unknown, and this session tries \
                 again every {REWRITE_PAUSE:?})"
            );
        } else {
            tracing::warn!(
                key = %first,
                error = %err,
                "a renewal could not write an identity record again (the lock is held all the \
                 same; this session tries again in {REWRITE_PAUSE:?})"
            );
        }
    }

    /// Creates the table of identity records again, in the background
    /// (`err`: how a renewal of `key` found it, or its schema, missing).
    /// One try at a time, and, after a try that failed, none for
    /// [`RECREATE_PAUSE`].
    fn recreate_holders_table(self: &Arc<Self>, key: &LockKey, err: &tokio_postgres::Error) {
        let schema_gone = err.code() == Some(&SqlState::INVALID_SCHEMA_NAME);
        {
            let mut tried = self
                .holders_recreated
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if tried.is_some_and(|at| at.elapsed() < RECREATE_PAUSE) {
                return;
            }
            *tried = Some(Instant::now());
        }
        let (inner, key) = (Arc::clone(self), key.clone());
        self.home.spawn(async move {
            let restored = async {
                if schema_gone {
                    inner.restore_objects().await.map_err(|e| {
                        LockError::backend(KIND, Operation::Extend, key.as_str(), e)
                    })?;
                }
                inner.ensure_holders_table(&key, true).await
            };
            let restored = restored.await;
            if restored.is_ok() {
                *inner
                    .holders_recreated
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = None;
            }
            match restored {
                Ok(()) => tracing::warn!(
                    schema = inner.quoted_schema,
                    "a renewal found the table of identity records missing (dropped while the \
                     service runs?); it exists again, and the next renewal writes the records"
                ),
                Err(err) => tracing::warn!(
                    schema = inner.quoted_schema,
                    error = %err,
                    "a renewal found the table of identity records missing, and it could not \
                     be created again: holders of keys taken with an identity read as unknown \
                     (their locks are held all the same)"
                ),
            }
        });
    }
}

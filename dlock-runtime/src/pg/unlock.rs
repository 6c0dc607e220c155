//! Dropping one key's session advisory lock: a lease's release, with its
//! identity record where it has one, the batch delete of plain leases'
//! records, giving back a lock nobody owns, and undoing what a failed lock
//! statement may have taken.
//!
//! Its own file: what a release does when the record cannot go (a
//! privilege revoked, the table locked, a trigger) is read apart from the
//! lock statement and its answer (see `locks`).

use std::sync::Arc;

use tokio::time::Instant;
use tokio_postgres::error::SqlState;

use super::claims::InFlight;
use super::connection::{Failure, no_runtime};
use super::home::NoRuntime;
use super::locks::Unfinished;
use super::session::LockSession;
use super::{Inner, KIND, State, sql};
use crate::backend::OwnerId;
use crate::backend::kit::detach::Ignore;
use crate::error::{LockError, Operation};
use crate::key::LockKey;

impl Inner {
    /// Undoes what a lock statement that failed with `err` may have left on
    /// `session`: the lock of the key's advisory key, if the statement took
    /// it before a later step failed. Only what this attempt took: a plain
    /// unlock of the advisory key drops one hold, which, if this attempt
    /// took none, is the hold of another lease of this session whose key
    /// has the same 64-bit hash. A recording statement `told_already`
    /// (see `sql::TRY_LOCK_RECORDING` on `already`) took no session lock:
    /// nothing to undo. `own` counts the statement in flight.
    pub(super) async fn undo_failed_lock(
        &self,
        session: &Arc<LockSession>,
        key: &LockKey,
        err: &tokio_postgres::Error,
        (recording, told_already, named): (bool, bool, bool),
        own: &InFlight,
    ) {
        if recording && told_already {
            return;
        }
        let left = sql::lock_left_by(err, recording);
        if named && !matches!(left, sql::LockLeft::No) {
            self.undo_marks(session, key, own).await;
        }
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
            [&key.as_str(), &self.options.key_seed];
        match left {
            sql::LockLeft::No => {}
            // This attempt holds the lock (once more, if another lease of
            // the session holds the same advisory key): one unlock drops
            // exactly its hold.
            sql::LockLeft::Yes => {
                if session.query_one(sql::UNLOCK_KEY, &params).await.is_err() {
                    session.end(format!("could not undo a failed lock of `{key}`"));
                }
            }
            sql::LockLeft::Unknown => {
                let advisory_key = match own.advisory_key() {
                    Some(h) => Ok(h),
                    None => match session.query_one(sql::ADVISORY_KEY, &params).await {
                        Ok(row) => row.try_get::<_, i64>(0),
                        Err(err) => Err(err),
                    },
                };
                let Ok(advisory_key) = advisory_key else {
                    session.end(format!("could not undo a failed lock of `{key}`"));
                    return;
                };
                // A claim of its own while it unlocks: no statement that
                // may take the advisory key is sent on this session until
                // the unlock ran. A lease that holds it, a statement that
                // may have taken it (of the same advisory key, or of one
                // not known before its answer) or a permit held with it
                // would lose its hold to this unlock: the session ends
                // instead.
                let Some(_claim) = session.claims.claim_for_undo(advisory_key, own) else {
                    session.end(format!(
                        "a lock statement for `{key}` failed without saying whether it took the \
                         lock, while a lease, a permit or another lock statement on this session \
                         may hold the same advisory key: only ending the session surely drops what it \
                         took"
                    ));
                    return;
                };
                if self
                    .unlock_behind_gate(session, advisory_key)
                    .await
                    .is_err()
                {
                    session.end(format!("could not undo a failed lock of `{key}`"));
                }
            }
        }
    }

    /// Drops the token marks a named lock statement of `key` that failed
    /// may have taken after its lock (see [`sql::UNDO_MARKS`]), under the
    /// statement's count in flight (`own`), which keeps any statement of
    /// the same advisory key off the session meanwhile. Marks that another
    /// lease's could share, or that cannot be dropped, leave the session
    /// retired instead: it takes no new lock, so no later lease of it is
    /// read with them.
    async fn undo_marks(&self, session: &LockSession, key: &LockKey, own: &InFlight) {
        let clear = own
            .advisory_key()
            .is_some_and(|h| !session.claims.marks_collide(h));
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
            [&key.as_str(), &self.options.key_seed];
        if !clear || session.query_one(sql::UNDO_MARKS, &params).await.is_err() {
            session.retire();
        }
    }

    /// Drops one hold of `advisory_key` on `session` that no lease owns,
    /// with the identity record its lock statement wrote, if it wrote one
    /// (`record`: its token), or the token marks it took (`marked`: the
    /// token, and which marks).
    pub(super) async fn give_back(
        &self,
        session: &LockSession,
        advisory_key: i64,
        record: Option<i64>,
        marked: Option<Marked>,
    ) {
        if self
            .unlock_on(session, advisory_key, (record, marked), true)
            .await
            .is_err()
        {
            session.end("could not give back an unowned lock".to_owned());
        }
    }

    /// Drops one hold of `advisory_key` on `session`, and, for a lease that
    /// recorded its identity (`record`: its token), the record with it (see
    /// [`sql::UNLOCK_RECORDED`]), or, for a named lease (`marked`: its
    /// token and which of its token marks it took), its marks (see
    /// [`sql::UNLOCK_NAMED`]).
    ///
    /// A plain lease's record stays (unless `immediate`) and goes in its
    /// session's next batch delete ([`sql::DELETE_RELEASED`]); a lease
    /// with an identity deletes its record with the unlock.
    pub(super) async fn unlock_on(
        &self,
        session: &LockSession,
        advisory_key: i64,
        (record, marked): (Option<i64>, Option<Marked>),
        immediate: bool,
    ) -> Result<Unlocked, tokio_postgres::Error> {
        if let Some((token, marks)) = marked {
            let unlock = &session.named_statements(self).await?.unlock;
            let row = match session
                .query_one(unlock, &[&advisory_key, &token, &marks, &true])
                .await
            {
                // As `unlock_behind_gate`: let go without the gate.
                Err(err) if gate_refused(&err) => {
                    tracing::warn!(
                        advisory_key,
                        "a release could not take the key's release gate (another session holds \
                         it past the lock timeout, or the server's lock table is full); \
                         released without it"
                    );
                    session
                        .query_one(unlock, &[&advisory_key, &token, &marks, &false])
                        .await?
                }
                answer => answer?,
            };
            return Ok(Unlocked::plain(row.try_get(0).unwrap_or(false)));
        }
        if let Some(token) = record.filter(|_| !immediate) {
            let row = self.unlock_behind_gate(session, advisory_key).await?;
            if let Some(batch) = session.records().released(advisory_key, token) {
                self.delete_batch(session, batch).await;
            }
            return Ok(Unlocked::plain(row.try_get(0).unwrap_or(false)));
        }
        if let Some(token) = record {
            let statements = session
                .records()
                .recording(
                    session,
                    &self.try_lock_recording_sql,
                    &self.unlock_recorded_sql,
                    &self.delete_released_sql,
                )
                .await?;
            // Not while a renewal writes records on this session: its write
            // must reach the server before this delete, never after.
            let _writes = session.records().writes.lock().await;
            match session
                .query_one(&statements.unlock, &[&advisory_key, &token])
                .await
            {
                Ok(row) => return Ok(Unlocked::plain(row.try_get(0).unwrap_or(false))),
                // The table (or its schema) was dropped: the statement ran
                // nothing, and no record is left to delete.
                Err(err) if sql::sequence_missing(&err) => {}
                // The role may not delete the record (a DBA revoked DELETE
                // on the table): the statement ran nothing, so the lock is
                // held. The lock goes, the record stays. It names this
                // session, so the session takes no new lock: no lease of
                // this key (or of one with the same advisory key) can hold
                // it here again and be read with this record. Its other
                // leases live on.
                // The table was locked past the session's lock_timeout (a
                // DBA's TRUNCATE, LOCK TABLE, ALTER, a non-concurrent
                // CREATE INDEX): the statement ran nothing, so the lock is
                // held. It goes as a plain lease's does, and the record
                // with the session's next batch: a record left is never
                // read once its session lets go of the key. Ending the
                // session here would lose every other lease on it for
                // the sake of a record. Or a lock of the commit's (the
                // lock of notifying commits a DBA's trigger needs) timed
                // out after the statement ran: its unlock stands (a
                // session lock is no part of the transaction), the
                // delete does not. Either way the lease held the key on
                // this live session until now, and it is released.
                Err(err) if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                    self.unlock_behind_gate(session, advisory_key).await?;
                    if let Some(batch) = session.records().released(advisory_key, token) {
                        self.delete_batch(session, batch).await;
                    }
                    return Ok(Unlocked::plain(true));
                }
                // A DBA's trigger on the table failed the statement (an
                // `AFTER DELETE` one after the unlock ran, a `BEFORE` one
                // before it), or a rule refused it before anything ran:
                // the lock goes, if it is still held (this lease's claim
                // keeps every other lease of the session off its advisory
                // key, so an unlock of a lock already dropped drops
                // nothing), and the record stays. The session wrote it,
                // so no lease of the key on it is ever read with it (see
                // `Records::wrote_a_record`); ending the session would
                // lose every other lease on it.
                Err(err)
                    if sql::raised_by_a_trigger(&err)
                        || err.code() == Some(&SqlState::FEATURE_NOT_SUPPORTED) =>
                {
                    tracing::warn!(
                        advisory_key,
                        error = %err,
                        "a release could not delete its identity record: a trigger or a rule on the \
                         table of holder records refused it; released without deleting it"
                    );
                    self.unlock_behind_gate(session, advisory_key).await?;
                    return Ok(Unlocked::plain(true));
                }
                Err(err) if err.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
                    session.retire();
                    let row = self.unlock_behind_gate(session, advisory_key).await?;
                    return Ok(Unlocked {
                        held: row.try_get(0).unwrap_or(false),
                        record_left: Some(err),
                    });
                }
                Err(err) => return Err(err),
            }
        }
        let row = self.unlock_behind_gate(session, advisory_key).await?;
        Ok(Unlocked::plain(row.try_get(0).unwrap_or(false)))
    }

    /// Drops one hold of `advisory_key` on `session` with the session's
    /// unlock statement, behind the key's release gate where holders are
    /// recorded ([`sql::UNLOCK_GATED`]). A gate held past the session's
    /// `lock_timeout` is no force release of dlock's (that holds it for
    /// the server's work alone) but another session's lock on the same
    /// pair of numbers: the lock is then dropped without the gate
    /// ([`sql::UNLOCK`]), rather than ending the session and every lease
    /// on it.
    pub(super) async fn unlock_behind_gate(
        &self,
        session: &LockSession,
        advisory_key: i64,
    ) -> Result<tokio_postgres::Row, tokio_postgres::Error> {
        match session.query_one(&session.unlock, &[&advisory_key]).await {
            Err(err) if gate_refused(&err) => {
                tracing::warn!(
                    advisory_key,
                    "a release could not take the key's release gate (another session holds it \
                     past the lock timeout, or the server's lock table is full); released \
                     without it"
                );
                session.query_one(sql::UNLOCK, &[&advisory_key]).await
            }
            unlocked => unlocked,
        }
    }

    /// Deletes the records of released leases `batch` of `session` (see
    /// [`sql::DELETE_RELEASED`]). A failure keeps them for the next batch:
    /// until then the session takes no lock that records nothing of their
    /// keys without deleting them first (see `try_lock`).
    async fn delete_batch(&self, session: &LockSession, batch: super::recording::Released) {
        let (Some(started), Some(statements)) =
            (session.started, session.records().recording_prepared())
        else {
            return;
        };
        let deleted = session
            .query_one(
                &statements.delete_released,
                &[&batch.lock_ids, &batch.tokens, &started],
            )
            .await;
        if deleted.is_err() {
            session.records().keep_released(batch);
        }
    }

    /// The error of a release that dropped `key`'s lock but could not
    /// delete its identity record (`err`): which privileges the role lacks
    /// and the GRANT that gives them, as an acquisition's error says, read
    /// on `session`. The next acquisition with an identity checks the
    /// table again, and is refused until the grant is made.
    async fn record_left_error(
        &self,
        session: &LockSession,
        key: &LockKey,
        err: tokio_postgres::Error,
    ) -> LockError {
        *self.holders_table.lock().await = false;
        self.holders_state.set_unchecked();
        let lacks = self
            .holders_privileges(session)
            .await
            .unwrap_or_else(|| self.lacks_on_holders("the role", "DELETE"));
        let what = format!(
            "cannot delete the identity record of `{key}`: {lacks} the lock was released all \
             the same, and the record left is never read (it names a session that takes no new \
             lock)"
        );
        LockError::backend(
            KIND,
            Operation::Release,
            key.as_str(),
            Failure::new(what, err),
        )
    }

    /// Unlocks `key` on its session. `owner: None` is the administrator's
    /// force; `overdue` only unlocks a lease whose deadline has passed.
    /// `Ok(true)` when a live lease of `owner` was released.
    pub(super) async fn unlock(
        self: &Arc<Self>,
        key: &LockKey,
        owner: Option<OwnerId>,
        overdue: bool,
    ) -> Result<bool, LockError> {
        // A key held shared or as permits here is never held exclusively
        // here too (see `modes`).
        if let Some(unlocked) = self.unlock_mode(key, owner, overdue).await {
            return unlocked;
        }
        let (session, advisory_key, (record, marked), immediate, live, entry_owner) = {
            let mut keys = self.keys();
            let Some(entry) = keys.get_mut(key) else {
                return Ok(false);
            };
            if owner.is_some_and(|owner| owner != entry.owner) {
                return Ok(false);
            }
            let Some(holding) = entry.holding() else {
                return Ok(false);
            };
            let live = holding.deadline() > Instant::now();
            if overdue && live {
                return Ok(false);
            }
            let State::Held(holding) = std::mem::replace(&mut entry.state, State::Releasing) else {
                return Ok(false);
            };
            // The token as drawn: a positive int8.
            let record = holding.recorded.then(|| holding.token.get() as i64);
            let marked = holding
                .marks
                .map(|marks| (holding.token.get() as i64, marks));
            let immediate = holding.identity.is_some();
            (
                Arc::clone(&holding.session),
                holding.advisory_key,
                (record, marked),
                immediate,
                live,
                entry.owner,
            )
        };
        // Finished even if the caller gives up half-way, so the key cannot
        // stay marked as releasing for ever: at home (see `home`).
        let inner = Arc::clone(self);
        let unlocked_key = key.clone();
        let unlocked_on = Arc::clone(&session);
        let unlocking = self.home.run_detachable(
            async move {
                let key = unlocked_key;
                let mut unfinished = Unfinished::new(&inner, &key, entry_owner);
                unfinished.in_flight = Some(Arc::clone(&session));
                let outcome = inner
                    .unlock_on(&session, advisory_key, (record, marked), immediate)
                    .await;
                unfinished.finish();
                inner.forget(&key, entry_owner);
                match outcome {
                    Ok(Unlocked {
                        held,
                        record_left: None,
                    }) => {
                        // A fair session is kept for the next fair waiter.
                        inner.fair_session_free(&session);
                        Ok(held)
                    }
                    Ok(Unlocked {
                        record_left: Some(err),
                        ..
                    }) => Err(inner.record_left_error(&session, &key, err).await),
                    // The session is gone, and every lock it held with it.
                    Err(err) if err.is_closed() || session.is_ended() => Ok(false),
                    Err(err) => {
                        // Ending the session is the one sure way to drop the lock.
                        session.end(format!("could not release `{key}`"));
                        Err(inner.failed(Operation::Release, &key, "unlock failed", err))
                    }
                }
            },
            Ignore,
        );
        match unlocking.await {
            Ok(released) => Ok(live && released?),
            Err(NoRuntime) => {
                // Not unlocked, and nowhere to do it: ending the session
                // frees the lock on the server.
                self.forget(key, entry_owner);
                unlocked_on.end(format!("no runtime left to release `{key}` on"));
                Err(no_runtime(Operation::Release, key))
            }
        }
    }
}

/// A named lease's token, and whether its token marks were taken (see
/// `sql::TRY_LOCK_NAMED`): what its unlock drops beside the lock.
pub(super) type Marked = (i64, bool);

/// Whether an unlock behind the key's release gate failed for the gate
/// alone, and is to be sent again without it: another session holds the
/// gate's numbers past the session's `lock_timeout`, or the server's lock
/// table has no room for the gate (a full table must cost the lease being
/// let go nothing, and the session's other leases nothing either: ending
/// the session would drop every lock it holds).
fn gate_refused(err: &tokio_postgres::Error) -> bool {
    err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE)
        || err.code() == Some(&SqlState::OUT_OF_MEMORY)
}

/// What an unlock did.
pub(super) struct Unlocked {
    /// Whether the session held the lock.
    pub(super) held: bool,
    /// Why the lease's identity record could not be deleted with it, if
    /// it could not (the lock was dropped all the same).
    pub(super) record_left: Option<tokio_postgres::Error>,
}

impl Unlocked {
    fn plain(held: bool) -> Self {
        Self {
            held,
            record_left: None,
        }
    }
}

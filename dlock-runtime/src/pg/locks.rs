//! Taking and dropping one key's session advisory lock: the lock statement
//! and its token, the in-process claim, undoing a failed statement, giving
//! back a lock nobody owns, and the clean-up of work cut short.
//!
//! Over 700 lines: the lock statement's answer handling and its undo belong
//! together; the redesign of the PostgreSQL backend removes the recording
//! paths.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::claims::InFlight;
use super::connection::Failure;
use super::home::NoRuntime;
use super::session::LockSession;
use super::{Holding, Inner, KIND, State, sql, xact};
use crate::backend::kit::detach::{AbandonedWith, Ignore};
use crate::backend::{Attempt, Grant, OwnerId};
use crate::error::{LockError, Operation};
use crate::key::LockKey;
use tokio::time::Instant;
use tokio_postgres::error::SqlState;

impl Inner {
    /// Held by another process, whose ttl this process cannot see: the
    /// waiter relies on the release notice (a server-side probe, or a
    /// recheck when none could watch the key).
    pub(super) fn held_elsewhere(&self) -> Attempt {
        Attempt::Held { expires_in: None }
    }

    /// Sends the lock statement: the one that records the holder
    /// (`holder`, the encoded [`crate::HolderInfo`]) and `identity` with
    /// the lock (see [`sql::TRY_LOCK_RECORDING`]) when the lease has an
    /// identity, or has none and the table of holder records is usable
    /// (see `Inner::may_record`); else the plain one. A session found dead
    /// is replaced once.
    pub(super) async fn try_lock(
        self: &Arc<Self>,
        key: &LockKey,
        identity: Option<&str>,
        holder: &str,
        in_flight: &mut Option<Arc<LockSession>>,
    ) -> Result<Locked, LockError> {
        let mut record = if identity.is_some() {
            self.ensure_holders_table(key, false).await?;
            true
        } else {
            self.may_record(key).await
        };
        let mut retried = false;
        let mut restored = false;
        loop {
            let session = self.session().await?;
            *in_flight = Some(Arc::clone(&session));
            // A session that could not tell when it started cannot name
            // itself in a record: its leases record nothing.
            let recording = session.started.filter(|_| record);
            if recording.is_none() && session.may_have_a_record_of(key.as_str()) {
                // A record it wrote of an earlier lease could be read for a
                // lease it takes now without one (see
                // `LockSession::wrote_a_record`): it takes no new lease,
                // and the next session (a new one, if need be) takes this.
                session.retire();
                continue;
            }
            let mut flight = None;
            // Whether the statement was told the session holds the key's
            // advisory key already, so that it took no session lock.
            let mut told_already = false;
            let expected = session
                .claims
                .advisory_key_of(key.as_str(), self.options.key_seed);
            // A lease of a colliding key, or an undo, claims the advisory
            // key on this session: held, without a statement.
            let held_here = || Locked {
                session: Arc::clone(&session),
                advisory_key: expected.unwrap_or_default(),
                token: None,
                since: None,
                in_flight: None,
            };
            let answer = match recording {
                None => {
                    // Counted in flight as a recording statement is: one
                    // sent behind it is told it may hold the advisory key.
                    let Some((_, flying)) = session.claims.already_holds(expected) else {
                        return Ok(held_here());
                    };
                    flight = Some(flying);
                    session
                        .query_one(&session.try_lock, &[&key.as_str(), &self.options.key_seed])
                        .await
                        .map(|row| (Ok(row), false))
                }
                Some(started) => {
                    match session
                        .recording(
                            &self.try_lock_recording_sql,
                            &self.unlock_recorded_sql,
                            &self.delete_released_sql,
                        )
                        .await
                    {
                        Ok(statements) => {
                            let Some((already, flying)) = session.claims.already_holds(expected)
                            else {
                                return Ok(held_here());
                            };
                            flight = Some(flying);
                            told_already = already == Some(true);
                            session
                                .query_one(
                                    &statements.try_lock,
                                    &[
                                        &key.as_str(),
                                        &self.options.key_seed,
                                        &identity,
                                        &started,
                                        &holder,
                                        &already,
                                    ],
                                )
                                .await
                                .map(|row| (Ok(row), true))
                        }
                        // Preparing runs nothing: there is nothing to undo.
                        Err(err) => Ok((Err(err), true)),
                    }
                }
            };
            let err = match answer {
                Ok((Ok(row), recording)) => {
                    let taken = row
                        .try_get::<_, i64>(0)
                        .and_then(|h| Ok((h, row.try_get::<_, Option<i64>>(1)?)));
                    // And whether the record it was to write is missing: a
                    // token drawn for a key the session held for no other
                    // lease (`already`), and no record written.
                    let since = if recording {
                        sql::recorded_since(&row, 2, Some(3))
                            .map(|(since, already)| (since, !already && since.is_none()))
                    } else {
                        Ok((None, false))
                    };
                    return match (taken, since) {
                        // A DBA's trigger or rule skipped the write: the
                        // record there, if any, is an earlier lease's. The
                        // lock goes back; a lease without an identity is
                        // taken without its record.
                        (Ok((advisory_key, Some(_))), Ok((_, true))) => {
                            // A trigger may have written a row of its own
                            // making: the session takes no lease of the
                            // key without a record from now on.
                            session.wrote_a_record(key.as_str());
                            self.give_back(&session, advisory_key, None).await;
                            let what = format!(
                                "the lock statement of `{key}` wrote no record, which a trigger \
                                 or a rule on {}.dlock_holders skips: the lock was not taken",
                                self.quoted_schema
                            );
                            if identity.is_none() {
                                self.records_unusable(&what);
                                record = false;
                                continue;
                            }
                            Err(LockError::backend(
                                KIND,
                                Operation::Acquire,
                                key.as_str(),
                                Failure::msg(what),
                            ))
                        }
                        (Ok((advisory_key, token)), Ok((since, _))) => {
                            if since.is_some() {
                                session.wrote_a_record(key.as_str());
                            }
                            session
                                .claims
                                .check_advisory_key(key.as_str(), expected, advisory_key);
                            Ok(Locked {
                                session,
                                advisory_key,
                                token,
                                since,
                                in_flight: flight,
                            })
                        }
                        // An answer it cannot read (a DBA changed the type
                        // of a column of the table of records): what the
                        // statement took and wrote goes back, and a lease
                        // without an identity is taken without its record,
                        // on another session (the record may be there).
                        (Ok((advisory_key, token)), Err(e)) => {
                            session.wrote_a_record(key.as_str());
                            if token.is_some() {
                                self.give_back(&session, advisory_key, token).await;
                            }
                            if identity.is_none() {
                                self.records_unusable(&e);
                                record = false;
                                continue;
                            }
                            Err(self.failed(Operation::Acquire, key, "unexpected answer", e))
                        }
                        (Err(e), _) => {
                            session.end(format!(
                                "the lock statement of `{key}` answered what it cannot read: \
                                 only ending the session surely drops what it took"
                            ));
                            Err(self.failed(Operation::Acquire, key, "unexpected answer", e))
                        }
                    };
                }
                Ok((Err(err), _)) => err,
                Err(err) => {
                    // A session lock outlives the statement that took it, so a
                    // failure after `pg_try_advisory_lock` leaves the lock held.
                    if let Some(own) = &flight
                        && !err.is_closed()
                        && !session.is_ended()
                    {
                        let undo = self.undo_failed_lock(
                            &session,
                            key,
                            &err,
                            (recording.is_some(), told_already),
                            own,
                        );
                        Box::pin(undo).await;
                    }
                    err
                }
            };
            if (err.is_closed() || session.is_ended()) && !retried {
                retried = true;
                continue;
            }
            *in_flight = None;
            if sql::sequence_missing(&err) && !restored {
                restored = true;
                Box::pin(self.restore_objects())
                    .await
                    .map_err(|e| LockError::backend(KIND, Operation::Acquire, key.as_str(), e))?;
                if identity.is_some() {
                    // Or the table of holder records went.
                    self.ensure_holders_table(key, true).await?;
                } else if recording.is_some() {
                    self.holders_state.set_unchecked();
                    record = self.may_record(key).await;
                }
                continue;
            }
            // A lease without an identity never fails for its record: what
            // stopped the recording statement (a privilege revoked, the
            // table locked by a DBA or changed), the plain one does not
            // meet. The failed statement was undone above.
            if identity.is_none()
                && recording.is_some()
                && err.as_db_error().is_some()
                && sql::refused_sequence(&err).is_none()
            {
                if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
                    self.records_locked(key, &err);
                } else {
                    self.records_unusable(&err);
                }
                record = false;
                continue;
            }
            return Err(self.lock_error(key, err, recording.is_some()));
        }
    }

    /// The error of a lock statement (plain, or `recording` the holder)
    /// that failed with `err` and is not tried again: what it lacked, or
    /// what held it up, in words a DBA can act on.
    pub(super) fn lock_error(
        &self,
        key: &LockKey,
        err: tokio_postgres::Error,
        recording: bool,
    ) -> LockError {
        if recording && err.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) {
            let what = format!(
                "cannot take `{key}` with its identity recorded: the role needs SELECT, \
                 INSERT, UPDATE and DELETE on {s}.dlock_holders (and USAGE on \
                 {s}.dlock_token_seq); the lock was not taken",
                s = self.quoted_schema
            );
            return LockError::backend(
                KIND,
                Operation::Acquire,
                key.as_str(),
                Failure::new(what, err),
            );
        }
        if let Some(unfit) = sql::refused_sequence(&err) {
            let what = super::sequence::refusal(unfit, &self.quoted_schema);
            return LockError::backend(KIND, Operation::Acquire, key.as_str(), Failure::msg(what));
        }
        if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
            // A wait for a row names it in the error's context; a
            // wait for a relation names nothing.
            let on_record = err
                .as_db_error()
                .and_then(|db| db.where_())
                .is_some_and(|context| context.contains("relation \"dlock_holders\""));
            let locked = if recording && on_record {
                format!(
                    "the identity record of `{key}` in {}.dlock_holders is locked by another \
                     transaction (an UPDATE, a DELETE or a SELECT … FOR UPDATE left open?)",
                    self.quoted_schema
                )
            } else if recording {
                format!(
                    "the token sequence {s}.dlock_token_seq or the table {s}.dlock_holders \
                     (an ALTER, a TRUNCATE or a DROP left open?), or another lock the \
                     statement needed, is held by another transaction",
                    s = self.quoted_schema
                )
            } else {
                format!(
                    "the token sequence {}.dlock_token_seq is locked by another transaction \
                     (an ALTER SEQUENCE or a DROP left open?)",
                    self.quoted_schema
                )
            };
            let what = format!(
                "{locked} for longer than a lock session waits for it ({:?}): the lock was \
                 not taken; try again once that transaction has ended",
                self.lock_timeout()
            );
            return LockError::backend(
                KIND,
                Operation::Acquire,
                key.as_str(),
                Failure::new(what, err),
            );
        }
        self.failed(Operation::Acquire, key, "lock statement failed", err)
    }

    pub(super) async fn acquire_on_server(
        self: &Arc<Self>,
        key: &LockKey,
        owner: OwnerId,
        ttl: Duration,
        identity: Option<Arc<str>>,
        holder: String,
    ) -> Result<Attempt, LockError> {
        let mut unfinished = Unfinished::new(self, key, owner);
        let attempt = self
            .try_lock(key, identity.as_deref(), &holder, &mut unfinished.in_flight)
            .await;
        let Locked {
            session,
            advisory_key,
            token,
            since,
            in_flight: _in_flight,
        } = match attempt {
            Ok(answer) => answer,
            Err(err) => {
                unfinished.finish();
                self.forget(key, owner);
                return Err(err);
            }
        };
        let Some(token) = token else {
            unfinished.finish();
            self.forget(key, owner);
            return Ok(self.held_elsewhere());
        };
        // The record this attempt wrote, to delete with the lock should it
        // give the lock back.
        let recorded = since.is_some();
        let record = recorded.then_some(token);
        let token = match xact::to_token(token, key.as_str()) {
            Ok(token) => token,
            Err(err) => {
                self.forget(key, owner);
                Box::pin(self.give_back(&session, advisory_key, record)).await;
                unfinished.finish();
                return Err(err);
            }
        };
        let deadline = Instant::now() + ttl;
        let held_with_identity = recorded && identity.is_some();
        let held = {
            let mut keys = self.keys();
            match keys.get_mut(key) {
                // The claim fails when a different key with the same
                // advisory key is held on the same session (this key's own
                // entry is still `Acquiring`, so it has no claim): the server
                // said yes only because advisory locks are re-entrant. That
                // is contention, not a grant. Claimed under the key map's
                // lock, so the check and the hold are one step.
                Some(entry)
                    if entry.owner == owner
                        && matches!(entry.state, State::Acquiring)
                        && session.claims.claim(advisory_key) =>
                {
                    // Queued under the key map's lock, so the hold and its
                    // deadline are one step.
                    let deadline_slot =
                        self.deadlines
                            .add(Arc::downgrade(self), key, owner, deadline);
                    entry.state = State::Held(Holding {
                        session: Arc::clone(&session),
                        advisory_key,
                        token,
                        recorded,
                        identity: identity.zip(since).map(|(identity, since)| {
                            Box::new(super::Identified {
                                identity,
                                holder: holder.into_boxed_str(),
                                since_us: micros_since_1970(since),
                            })
                        }),
                        deadline_slot,
                        deadlines: Arc::clone(&self.deadlines),
                    });
                    true
                }
                _ => false,
            }
        };
        if !held {
            self.forget(key, owner);
            Box::pin(self.give_back(&session, advisory_key, record)).await;
            unfinished.finish();
            return Ok(Attempt::Held { expires_in: None });
        }
        unfinished.finish();
        if held_with_identity {
            // For watches of the free key, in other processes too.
            self.announce_later(&session, key, advisory_key);
        }
        Ok(Attempt::Acquired(
            Grant::new(token).lost_with(session.loss_group()),
        ))
    }

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
        (recording, told_already): (bool, bool),
        own: &InFlight,
    ) {
        if recording && told_already {
            return;
        }
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
            [&key.as_str(), &self.options.key_seed];
        match sql::lock_left_by(err, recording) {
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

    /// Drops one hold of `advisory_key` on `session` that no lease owns,
    /// with the identity record its lock statement wrote, if it wrote one
    /// (`record`: its token).
    pub(super) async fn give_back(
        &self,
        session: &LockSession,
        advisory_key: i64,
        record: Option<i64>,
    ) {
        if self
            .unlock_on(session, advisory_key, record, true)
            .await
            .is_err()
        {
            session.end("could not give back an unowned lock".to_owned());
        }
    }

    /// Drops one hold of `advisory_key` on `session`, and, for a lease that
    /// recorded its identity (`record`: its token), the record with it (see
    /// [`sql::UNLOCK_RECORDED`]).
    ///
    /// A plain lease's record stays (unless `immediate`) and goes in its
    /// session's next batch delete ([`sql::DELETE_RELEASED`]); a lease
    /// with an identity deletes its record with the unlock.
    pub(super) async fn unlock_on(
        &self,
        session: &LockSession,
        advisory_key: i64,
        record: Option<i64>,
        immediate: bool,
    ) -> Result<Unlocked, tokio_postgres::Error> {
        if let Some(token) = record.filter(|_| !immediate) {
            let row = self.unlock_behind_gate(session, advisory_key).await?;
            if let Some(batch) = session.released(advisory_key, token) {
                self.delete_batch(session, batch).await;
            }
            return Ok(Unlocked::plain(row.try_get(0).unwrap_or(false)));
        }
        if let Some(token) = record {
            let statements = session
                .recording(
                    &self.try_lock_recording_sql,
                    &self.unlock_recorded_sql,
                    &self.delete_released_sql,
                )
                .await?;
            // Not while a renewal writes records on this session: its write
            // must reach the server before this delete, never after.
            let _writes = session.record_writes.lock().await;
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
                    if let Some(batch) = session.released(advisory_key, token) {
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
                // `LockSession::wrote_a_record`); ending the session would
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
    async fn unlock_behind_gate(
        &self,
        session: &LockSession,
        advisory_key: i64,
    ) -> Result<tokio_postgres::Row, tokio_postgres::Error> {
        match session.query_one(&session.unlock, &[&advisory_key]).await {
            Err(err) if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                tracing::warn!(
                    advisory_key,
                    "a release waited past the lock timeout for the key's release gate, which \
                     another session holds; released without it"
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
    async fn delete_batch(&self, session: &LockSession, batch: super::session::Released) {
        let (Some(started), Some(statements)) = (session.started, session.recording_prepared())
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
            session.keep_released(batch);
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
        let (session, advisory_key, record, immediate, live, entry_owner) = {
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
            let immediate = holding.identity.is_some();
            (
                Arc::clone(&holding.session),
                holding.advisory_key,
                record,
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
                    .unlock_on(&session, advisory_key, record, immediate)
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

/// What a lock statement answered.
pub(super) struct Locked {
    pub(super) session: Arc<LockSession>,
    pub(super) advisory_key: i64,
    /// The token drawn; `None` when the key is held by someone else.
    pub(super) token: Option<i64>,
    /// When it wrote a holder record, by the server's clock, if it wrote one.
    pub(super) since: Option<SystemTime>,
    /// Counts the statement in flight until the lease claimed its key.
    pub(super) in_flight: Option<InFlight>,
}

/// `at` in microseconds since 1970 (negative before).
pub(super) fn micros_since_1970(at: SystemTime) -> i64 {
    match at.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(after) => i64::try_from(after.as_micros()).unwrap_or(i64::MAX),
        Err(before) => -i64::try_from(before.duration().as_micros()).unwrap_or(i64::MAX),
    }
}

/// Cleans up after work on a key that is dropped before it finished, which
/// happens only when the runtime running it shuts down: forgets the key's
/// entry, so this process does not take it for held or being taken for
/// ever, and ends the session a statement of it was sent on, which may hold
/// a lock nobody will give back (that session's connection most likely
/// went with the same runtime; this makes sure).
pub(super) struct Unfinished<'a> {
    inner: &'a Inner,
    key: &'a LockKey,
    owner: OwnerId,
    in_flight: Option<Arc<LockSession>>,
    finished: bool,
}

impl<'a> Unfinished<'a> {
    pub(super) fn new(inner: &'a Inner, key: &'a LockKey, owner: OwnerId) -> Self {
        Self {
            inner,
            key,
            owner,
            in_flight: None,
            finished: false,
        }
    }

    /// The work got to its end: nothing to clean up.
    pub(super) fn finish(&mut self) {
        self.finished = true;
    }
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        self.inner.forget(self.key, self.owner);
        if let Some(session) = self.in_flight.take() {
            session.end(format!(
                "work on `{}` was dropped half-way (its runtime shut down)",
                self.key
            ));
        }
    }
}

/// The error when no runtime is left to run the backend's work on.
pub(super) fn no_runtime(operation: Operation, key: &LockKey) -> LockError {
    LockError::backend(
        KIND,
        operation,
        key.as_str(),
        Failure::msg(
            "the runtime the PostgreSQL backend runs on shut down, and no other runtime is \
             there to take over",
        ),
    )
}

/// Gives back a lock the server granted to a caller that stopped waiting.
pub(super) struct GiveBack {
    pub(super) inner: Arc<Inner>,
    pub(super) key: LockKey,
    pub(super) owner: OwnerId,
}

impl AbandonedWith<Result<Attempt, LockError>> for GiveBack {
    async fn handle(self, outcome: Result<Attempt, LockError>) {
        if let Ok(Attempt::Acquired(_)) = outcome {
            let _ = self.inner.unlock(&self.key, Some(self.owner), false).await;
        }
    }
}

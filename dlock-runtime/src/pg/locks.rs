//! Taking one key's session advisory lock: the lock statement and its
//! token, the in-process claim, undoing a failed statement, and the
//! clean-up of work cut short. Dropping it is `unlock`'s; what the
//! recording statement's answer and failures mean for its record is
//! `recording`'s.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::claims::InFlight;
use super::connection::Failure;
use super::session::LockSession;
use super::{Holding, Inner, KIND, State, quick, sql, xact};
use crate::backend::kit::after;
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
    /// identity; else the plain one. A lease without an identity whose
    /// holder is recorded (see `Inner::may_record`) has its session and
    /// key named first instead, in the same round trip (see `names`), or,
    /// where the tables of names cannot be used, the recording statement.
    /// A session found dead is replaced once.
    pub(super) async fn try_lock(
        self: &Arc<Self>,
        key: &LockKey,
        identity: Option<&str>,
        holder: &str,
        in_flight: &mut Option<Arc<LockSession>>,
    ) -> Result<Locked, LockError> {
        // A named lease's place among the backend's marked ones (see
        // `names::MAX_MARKED`): past them, it records itself instead.
        let (mut record, mut slot) = if identity.is_some() {
            self.ensure_holders_table(key, false).await?;
            (true, None)
        } else if self.may_record(key).await {
            let slot = self.names.mark_slot();
            (slot.is_none(), slot)
        } else {
            (false, None)
        };
        let mut retried = false;
        let mut restored = false;
        loop {
            let session = self.session().await?;
            *in_flight = Some(Arc::clone(&session));
            // A session that could not tell when it started cannot name
            // itself in a record: its leases record nothing.
            let recording = session.started.filter(|_| record);
            let named = slot.is_some() && recording.is_none() && session.started.is_some();
            if recording.is_none() && session.records().may_have_a_record_of(key.as_str()) {
                // A record it wrote of an earlier lease could be read for a
                // lease it takes now without one (see
                // `Records::wrote_a_record`). A lease that would be named
                // records itself instead, its record written over the
                // earlier one; any other, where no record can be written,
                // is taken by the next session (a new one, if need be), as
                // this one takes no new lease. Retiring for a named lease
                // opened a connection each time a key went past the marked
                // leases and back, each kept open by its other leases.
                if slot.is_some() && session.started.is_some() {
                    slot = None;
                    record = true;
                } else {
                    session.retire();
                }
                continue;
            }
            let expected = session
                .claims
                .advisory_key_of(key.as_str(), self.options.key_seed);
            let sent = self
                .send_lock_statement(
                    &session,
                    key,
                    (identity, holder, named),
                    recording,
                    expected,
                )
                .await;
            let Some(Sent {
                answer,
                flight,
                told_already,
                misnamed,
            }) = sent
            else {
                // A lease of a colliding key, or an undo, claims the
                // advisory key on this session: held, without a statement.
                return Ok(Locked {
                    session,
                    advisory_key: expected.unwrap_or_default(),
                    token: None,
                    since: None,
                    marks: None,
                    slot: None,
                    in_flight: None,
                });
            };
            let err = match answer {
                Ok((Ok(row), recording)) => {
                    let answer = self.read_lock_answer(
                        session,
                        key,
                        identity,
                        row,
                        (recording, named),
                        (expected, flight),
                    );
                    match answer.await {
                        Some(Ok(mut locked)) => {
                            // Taken again with a record, which a reader
                            // believes first, when its marks were refused
                            // (another client holds one's numbers: without
                            // them a reader could pair other leases' marks
                            // of the session into a token nobody holds), or
                            // when its holder could not be named on a
                            // session that named others (a reader would
                            // name it with theirs). The lock, and any marks
                            // it took, go back first.
                            let retake = match (locked.marks, locked.token) {
                                (Some(false), Some(token)) => Some((token, false)),
                                (Some(true), Some(token)) if misnamed => Some((token, true)),
                                _ => None,
                            };
                            if let Some(marked) = retake {
                                self.give_back(
                                    &locked.session,
                                    locked.advisory_key,
                                    None,
                                    Some(marked),
                                )
                                .await;
                                drop(locked);
                                slot = None;
                                record = true;
                                continue;
                            }
                            if locked.marks.is_some() {
                                locked.slot = slot.take();
                            }
                            return Ok(locked);
                        }
                        Some(locked) => return locked,
                        None => {
                            record = false;
                            continue;
                        }
                    }
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
                            (recording.is_some(), told_already, named),
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
            // Dropped before the statement was planned, or while it ran
            // (then it may have taken the key: undone above).
            if sql::missing_or_dropped(&err) && !restored {
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
            // A lease without an identity never fails for its record (see
            // `records_refused`). The failed statement was undone above.
            if self.records_refused(key, identity.is_some(), recording.is_some(), &err) {
                record = false;
                continue;
            }
            return Err(self.lock_error(key, err, recording.is_some()));
        }
    }

    /// Sends the lock statement for `key` on `session`, counted in flight:
    /// the one that records the holder when `recording` (the session's
    /// start), else the plain one, behind the names of the session's
    /// holder and the key when `named` (see [`Inner::name_lease`]).
    /// `None`, with nothing sent, when the session claims `expected`, the
    /// key's advisory key, for a lease of a colliding key or for an undo.
    async fn send_lock_statement(
        &self,
        session: &LockSession,
        key: &LockKey,
        (identity, holder, named): (Option<&str>, &str, bool),
        recording: Option<SystemTime>,
        expected: Option<i64>,
    ) -> Option<Sent> {
        let flight;
        let mut told_already = false;
        let mut misnamed = false;
        let answer = match recording {
            None => {
                let statements = async {
                    Ok(match named {
                        true => {
                            let named = session.named_statements(self).await?;
                            (&named.quick, &named.lock)
                        }
                        false => (&session.try_lock_quick, &session.try_lock),
                    })
                };
                match statements.await {
                    Ok(statements) => {
                        // Counted in flight as a recording statement is: one
                        // sent behind it is told it may hold the advisory key.
                        let (_, flying) = session.claims.already_holds(expected)?;
                        flight = Some(flying);
                        let name = key.as_str();
                        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
                            [&name, &self.options.key_seed];
                        let lock = self.quick.lock(session, statements, named, &params);
                        match named {
                            // The names are polled first, so sent first.
                            true => {
                                let (named_right, row) =
                                    tokio::join!(self.name_lease(session, key, holder), lock);
                                misnamed = !named_right;
                                row
                            }
                            false => lock.await,
                        }
                        .map(|row| (Ok(row), false))
                    }
                    // Preparing runs nothing: there is nothing to undo.
                    Err(err) => {
                        flight = None;
                        Ok((Err(err), false))
                    }
                }
            }
            Some(started) => {
                match session
                    .records()
                    .recording(
                        session,
                        &self.try_lock_recording_sql,
                        &self.unlock_recorded_sql,
                        &self.delete_released_sql,
                    )
                    .await
                {
                    Ok(statements) => {
                        let (already, flying) = session.claims.already_holds(expected)?;
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
                    Err(err) => {
                        flight = None;
                        Ok((Err(err), true))
                    }
                }
            }
        };
        Some(Sent {
            answer,
            flight,
            told_already,
            misnamed,
        })
    }

    /// Reads the lock statement's answer `row` on `session` (`recording`:
    /// the statement that records the holder; `named`: the plain one,
    /// behind names), `expected` the advisory key computed in process and
    /// `flight` the statement's count in flight: the lease's lock, or the
    /// attempt's error. `None` when a lease without an identity is to be
    /// taken again, without its record.
    async fn read_lock_answer(
        &self,
        session: Arc<LockSession>,
        key: &LockKey,
        identity: Option<&str>,
        row: tokio_postgres::Row,
        (recording, named): (bool, bool),
        (expected, flight): (Option<i64>, Option<InFlight>),
    ) -> Option<Result<Locked, LockError>> {
        // A named lease's token comes with whether each of its token
        // marks was taken (see `sql::TRY_LOCK_NAMED`).
        let mut marks = None;
        let taken = row.try_get::<_, i64>(0).and_then(|h| {
            if recording {
                return Ok((h, row.try_get::<_, Option<i64>>(1)?));
            }
            let token = quick::answer(&row)?.and_then(|answer| match answer[..] {
                [token, marked, ..] if named => {
                    marks = Some(marked == 1);
                    Some(token)
                }
                [token, ..] if !named => Some(token),
                _ => None,
            });
            Ok((h, token))
        });
        // And whether the record it was to write is missing: a
        // token drawn for a key the session held for no other
        // lease (`already`), and no record written.
        let since = if recording {
            sql::recorded_since(&row, 2, Some(3))
                .map(|(since, already)| (since, !already && since.is_none()))
        } else {
            Ok((None, false))
        };
        Some(match (taken, since) {
            // A DBA's trigger or rule skipped the write: the
            // record there, if any, is an earlier lease's. The
            // lock goes back; a lease without an identity is
            // taken without its record.
            (Ok((advisory_key, Some(_))), Ok((_, true))) => {
                // A trigger may have written a row of its own
                // making: the session takes no lease of the
                // key without a record from now on.
                session.records().wrote_a_record(key.as_str());
                self.give_back(&session, advisory_key, None, None).await;
                return self
                    .no_record_written("lock statement", key, identity.is_some())
                    .map(Err);
            }
            (Ok((advisory_key, token)), Ok((since, _))) => {
                if since.is_some() {
                    session.records().wrote_a_record(key.as_str());
                }
                session
                    .claims
                    .check_advisory_key(key.as_str(), expected, advisory_key);
                Ok(Locked {
                    session,
                    advisory_key,
                    token,
                    since,
                    marks,
                    slot: None,
                    in_flight: flight,
                })
            }
            // An answer it cannot read (a DBA changed the type
            // of a column of the table of records): what the
            // statement took and wrote goes back, and a lease
            // without an identity is taken without its record,
            // on another session (the record may be there).
            (Ok((advisory_key, token)), Err(e)) => {
                session.records().wrote_a_record(key.as_str());
                if token.is_some() {
                    self.give_back(&session, advisory_key, token, None).await;
                }
                if identity.is_none() {
                    self.records_unusable(&e);
                    return None;
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
        })
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
        if let Some(what) = super::sequence::failure(&err, &self.quoted_schema) {
            return LockError::backend(
                KIND,
                Operation::Acquire,
                key.as_str(),
                Failure::new(what, err),
            );
        }
        if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
            // A wait for a row names its table in the error's context (in
            // the server's language); a wait for a relation names nothing.
            let on_record = err
                .as_db_error()
                .and_then(|db| db.where_())
                .is_some_and(|context| context.contains("dlock_holders"));
            let locked = if recording && on_record {
                format!(
                    "the identity record of `{key}` in {}.dlock_holders is locked by another \
                     transaction (an UPDATE, a DELETE or a SELECT … FOR UPDATE left open?)",
                    self.quoted_schema
                )
            } else if recording {
                format!(
                    "the token sequence {s}.dlock_token_seq, {draw_lock} or the table \
                     {s}.dlock_holders (an ALTER, a TRUNCATE or a DROP left open?), or another \
                     lock the statement needed, is held by another transaction",
                    s = self.quoted_schema,
                    draw_lock = super::sequence::DRAW_LOCK,
                )
            } else {
                format!(
                    "the token sequence {}.dlock_token_seq (an ALTER SEQUENCE or a DROP left \
                     open?) or {} is locked by another transaction",
                    self.quoted_schema,
                    super::sequence::DRAW_LOCK,
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
            marks,
            slot,
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
        // The token marks it took, to drop with the lock likewise.
        let marked = marks.map(|marks| (token, marks));
        let token = match xact::to_token(token, key.as_str()) {
            Ok(token) => token,
            Err(err) => {
                self.forget(key, owner);
                Box::pin(self.give_back(&session, advisory_key, record, marked)).await;
                unfinished.finish();
                return Err(err);
            }
        };
        let deadline = after(Instant::now(), ttl);
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
                        marks,
                        _mark_slot: slot,
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
            Box::pin(self.give_back(&session, advisory_key, record, marked)).await;
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
}

/// A lock statement sent, with what undoing its failure needs.
struct Sent {
    /// Its answer, and whether it was the statement that records the
    /// holder; an error inside when that one could not be prepared (it ran
    /// nothing).
    answer:
        Result<(Result<tokio_postgres::Row, tokio_postgres::Error>, bool), tokio_postgres::Error>,
    /// Counts the statement in flight.
    flight: Option<InFlight>,
    /// Whether the statement was told the session holds the key's
    /// advisory key already, so that it took no session lock.
    told_already: bool,
    /// Whether a named lease's holder could not be named on a session
    /// that named other holders, which readers would name it with (see
    /// `Inner::name_lease`).
    misnamed: bool,
}

/// What a lock statement answered.
pub(super) struct Locked {
    pub(super) session: Arc<LockSession>,
    pub(super) advisory_key: i64,
    /// The token drawn; `None` when the key is held by someone else.
    pub(super) token: Option<i64>,
    /// When it wrote a holder record, by the server's clock, if it wrote one.
    pub(super) since: Option<SystemTime>,
    /// Whether a named lease's token marks were taken (see
    /// `sql::TRY_LOCK_NAMED`): `None` for other leases.
    pub(super) marks: Option<bool>,
    /// A named lease's place among the backend's marked leases.
    pub(super) slot: Option<super::names::MarkSlot>,
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
    pub(super) in_flight: Option<Arc<LockSession>>,
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

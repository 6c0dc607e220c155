//! A shared or permit attempt on the server: its statement, what the
//! answer means (a permit's slot counted in the session's claims), the
//! errors of one that failed, the table and functions it needs (made once,
//! and again when a DBA dropped them), and writers' marks (rule M3).
//!
//! Its own file: what is asked of the server, apart from the in-process
//! book of holds in `modes`.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::Statement;
use tokio_postgres::error::SqlState;

use super::claims::PermitClaim;
use super::connection::Failure;
use super::mode_sql::ModeStatement;
use super::modes::ABSENT_BELIEVED;
use super::read_hold::ReadHold;
use super::session::LockSession;
use super::{Inner, KIND, sql, xact};
use crate::backend::{Access, Attempt, Grant, OwnerId, QUEUE_ENTRY_TTL};
use crate::error::{LockError, Operation};
use crate::key::LockKey;

impl Inner {
    /// Asks the server for `key` shared or as permits (`access`) for
    /// `owner`, on a lock session, and books the grant (see the module
    /// docs of `modes`).
    pub(super) async fn mode_on_server(
        self: &Arc<Self>,
        key: &LockKey,
        owner: OwnerId,
        ttl: Duration,
        access: Access,
    ) -> Result<Attempt, LockError> {
        let mut retried = false;
        loop {
            self.modes_ready(Operation::Acquire, key).await?;
            let session = self.session().await?;
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
            let answer = self
                .send_mode_statement(&session, statement, key, access)
                .await;
            let (token, slot, marked) = match answer {
                Ok(answer) => answer,
                Err(err) => {
                    // An object dropped while the functions ran: made again by
                    // `mode_failed`, and the attempt sent once more on the
                    // session, which lives on, as an exclusive one is. Not
                    // after an error from elsewhere (a DBA's trigger at the
                    // commit), which ends the session: the caller's wait, if
                    // it has one, rides that out.
                    let dropped =
                        sql::dropped_while_running(&err) && sql::raised_by_the_mode_call(&err);
                    let failed = self.mode_failed(&session, key, err).await;
                    if dropped && !retried {
                        retried = true;
                        continue;
                    }
                    return Err(failed);
                }
            };
            let Some(token) = token else {
                // Held by a writer, a mark, readers or every slot: the wait
                // probe hears only of exclusive holders, so waiters poll.
                self.modes.poll(key);
                let expires_in = marked.then_some(QUEUE_ENTRY_TTL / 3);
                return Ok(Attempt::Held { expires_in });
            };
            let slot = answered_slot(&session, key, slot)?;
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
            return Ok(Attempt::Acquired(match slot_number {
                Some(slot) => grant.in_slot(slot),
                None => grant,
            }));
        }
    }

    /// Sends the shared or permit `statement` for `key` (`access`) on
    /// `session`: a permit statement skips the slots this process holds.
    /// Its answer: the token drawn (none if the key is held), the permit's
    /// slot, and whether a writer's mark stands.
    async fn send_mode_statement(
        &self,
        session: &LockSession,
        statement: &Statement,
        key: &LockKey,
        access: Access,
    ) -> Result<(Option<i64>, Option<i32>, bool), tokio_postgres::Error> {
        let seed = self.options.key_seed;
        match access {
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
                // marked in flight by the caller, so a lease's statement
                // sent from now on reads the permit's hold on the server.
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
        }
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
        // open; an object dropped while they ran, `missing`: only their
        // statements open relations, inside those blocks), so the session
        // and the other leases on it live on. Nor does a key the server's
        // encoding lacks take anything: it fails at bind. But only an error
        // of the call itself or from inside the functions: a DBA's trigger
        // that fails at the statement's commit (a deferred constraint
        // trigger on the table of read phases) runs after the function
        // returned with its locks, whatever its error says.
        let refused = err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE)
            || err
                .as_db_error()
                .is_some_and(|db| db.message().contains(sql::REFUSED));
        let gave_back =
            sql::unencodable(&err) || ((missing || refused) && sql::raised_by_the_mode_call(&err));
        if !gave_back && !err.is_closed() && !session.is_ended() {
            session.end(format!("a shared or permit statement for `{key}` failed"));
        }
        let what = if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
            format!(
                "the shared or permit statement waited longer than a lock session does ({:?}) \
                 for a lock another transaction holds: the token sequence {s}.dlock_token_seq, \
                 {draw_lock} or the table {s}.dlock_phases (an ALTER, a TRUNCATE, a LOCK or a \
                 row left open?); {not_taken}",
                self.lock_timeout(),
                s = self.quoted_schema,
                draw_lock = super::sequence::DRAW_LOCK,
                not_taken = super::sequence::NOT_TAKEN,
            )
        } else {
            "the shared or permit statement failed".to_owned()
        };
        self.failed(Operation::Acquire, key, &what, err)
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
    pub(super) async fn remake_if_missing(
        &self,
        key: &LockKey,
        err: &tokio_postgres::Error,
    ) -> bool {
        // Dropped while the statement ran: inside the functions, whose
        // handlers gave back what they took (see `mode_failed`).
        let dropped = sql::dropped_while_running(err);
        let missing = dropped
            || err.code().is_some_and(|code| {
                *code == SqlState::UNDEFINED_FUNCTION
                    || *code == SqlState::UNDEFINED_TABLE
                    || *code == SqlState::INVALID_SCHEMA_NAME
            });
        if missing {
            *self.modes.ready.lock().await = (false, None);
            if sql::missing_or_dropped(err)
                && let Err(failure) = Box::pin(self.restore_objects()).await
            {
                tracing::warn!(key = %key, error = %failure, "cannot create the token sequence again");
            }
        }
        missing
    }

    /// Makes the table and functions of [`sql::MODES_SETUP`] once.
    pub(super) async fn modes_ready(
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
                // Only a refused privilege is the DBA's to grant: a lock
                // waited for too long or a lost connection says so itself.
                let what = if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) {
                    "cannot create the table and functions of shared locks and permits (the \
                     role needs CREATE on the schema)"
                } else {
                    "cannot create the table and functions of shared locks and permits"
                };
                self.failed(operation, key, what, e)
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
}

/// The permit's slot a statement answered, if any: a negative one, which
/// no statement of dlock's answers, ends the session.
fn answered_slot(
    session: &LockSession,
    key: &LockKey,
    slot: Option<i32>,
) -> Result<Option<u32>, LockError> {
    match slot.map(u32::try_from) {
        Some(Ok(slot)) => Ok(Some(slot)),
        Some(Err(_)) => {
            session.end("the permit statement answered a negative slot".to_owned());
            Err(LockError::backend(
                KIND,
                Operation::Acquire,
                key.as_str(),
                Failure::msg("the permit statement answered a negative slot"),
            ))
        }
        None => Ok(None),
    }
}

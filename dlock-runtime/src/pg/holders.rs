//! Who holds a key ([`Backend::holder`](crate::Backend::holder)), the keys
//! held under a prefix ([`Backend::held`](crate::Backend::held)) and
//! watching a key's holder change
//! ([`Backend::watch_holder`](crate::Backend::watch_holder)).
//!
//! The holder is the session `pg_locks` shows holding the key's advisory
//! lock exclusively. Every lease records, in `{schema}.dlock_holders`, in
//! the statement that takes the lock, its key, token, session, identity (if
//! any), holder record (host, pid, label) and the server's time of
//! acquisition (`sql::TRY_LOCK_RECORDING`); a lease with an identity
//! deletes the row in the statement that drops the lock
//! (`sql::UNLOCK_RECORDED`), a plain one leaves it for its session's next
//! batch delete (`sql::DELETE_RELEASED`). While the statement that took
//! the lock has not committed, its session holds the key's `rewriting`
//! mark, and the record read may be an earlier lease's: the holder is read
//! again, and reads as unknown if the mark stays. Each renewal of a
//! lease taken with an identity writes its record again if it went missing
//! (`sql::REWRITE_RECORDS`; a lease without one is not rewritten, so a
//! truncated table hides it until it is taken again). A record is believed
//! only when it names the session that holds the lock (its pid and its
//! start): a record not yet committed, one of a session that died, or one
//! of another key with the same advisory key leaves the holder unknown
//! (`Holding::new(None, None)`), never paired with an earlier lease. Other
//! holders (a lease whose record could not be written, a
//! [`TransactionLock`](super::TransactionLock), any client's advisory lock)
//! are unknown too, except this process's own leases, whose token, identity
//! and deadline it knows.
//!
//! A table the role cannot use costs leases without an identity their
//! record, never their lock (see [`Inner::may_record`]).
//!
//! Over 700 lines: the table of holder records, its migration and its reads;
//! the redesign of the PostgreSQL backend drops the per-acquisition record and
//! most of this file.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, sleep, timeout};
use tokio_postgres::SimpleQueryMessage;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

use super::connection::Failure;
use super::session::LockSession;
use super::{Entry, Inner, KIND, TERMINATE_WAIT_MS, UNWATCHED_RECHECK, sql, xact};
use crate::backend::{self, OwnerId, ReleaseNotice};
use crate::error::{LockError, Operation};
use crate::holder::HolderInfo;
use crate::key::LockKey;

/// How soon a reader watching a key looks again when no announcement of
/// its acquisition can reach the watch: while this process is taking or
/// letting go of the key (its entry's end wakes the watch, but the
/// server's state moves on its own), or while no listening connection
/// could be opened (see the `listen` module).
const FREE_RECHECK: Duration = Duration::from_millis(50);

/// How soon a reader watching a free key looks again although the
/// listening connection would wake it: an acquisition that was not
/// announced (by a dlock that predates announcements, as in a rolling
/// upgrade, or whose announcement failed, see the `announce` module)
/// would otherwise go unseen until the reader's own timer, 10 s for an
/// election's observer. One read a second for each such watch, where
/// [`FREE_RECHECK`] costs twenty.
pub(super) const ANNOUNCED_RECHECK: Duration = Duration::from_secs(1);

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

/// The session holding a key, as [`sql::HOLDER_SESSION`] reads it.
struct HolderSession {
    pid: i32,
    /// `None` when the role may not see it (another role's session).
    started: Option<SystemTime>,
    /// Whether the table of identity records exists.
    records: bool,
    /// Whether the session's lock statement of the key is still running
    /// (see [`sql::HOLDER_SESSION`]): its record may not be visible yet.
    rewriting: bool,
}

/// What one run of `sql::FORCE_RELEASE_NAMED` did.
enum NamedEnds {
    /// The key's release gate was taken (a release under way): nothing
    /// was read or ended; try again.
    GateBusy,
    /// The session with this pid holds the key, and its start is hidden
    /// from this role: nothing was ended.
    Hidden(String),
    /// Whether a session was ended.
    Ended(bool),
}

/// Reads the answer of `sql::FORCE_RELEASE_NAMED`: the gate's try is the
/// third statement's row, the sessions found the fifth's rows.
fn named_ends(messages: &[SimpleQueryMessage], key: &LockKey, token: i64) -> NamedEnds {
    let mut completed = 0;
    let mut ended = false;
    for message in messages {
        match message {
            SimpleQueryMessage::CommandComplete(_) => completed += 1,
            SimpleQueryMessage::Row(row) if completed == 2 && row.get(0) != Some("true") => {
                return NamedEnds::GateBusy;
            }
            SimpleQueryMessage::Row(row) if completed == 4 => {
                let pid = row.get(0).unwrap_or("?");
                if row.get(1) == Some("t") {
                    return NamedEnds::Hidden(pid.to_owned());
                }
                if let Some(gone) = row.get(2) {
                    ended = true;
                    tracing::warn!(key = %key, pid, gone, token, "force release: ended the PostgreSQL session holding the named lease");
                }
            }
            _ => {}
        }
    }
    NamedEnds::Ended(ended)
}

impl Inner {
    /// Who holds `key`: see the module docs.
    pub(super) async fn holder(
        self: &Arc<Self>,
        key: &LockKey,
    ) -> Result<Option<backend::Holding>, LockError> {
        let mut found = self.holder_session(key).await?;
        // A lock statement commits within microseconds: read again a few
        // times rather than report the holder unknown.
        for _ in 0..3 {
            match &found {
                Some(session) if session.rewriting => {
                    tokio::task::yield_now().await;
                    found = self.holder_session(key).await?;
                }
                _ => break,
            }
        }
        let Some(found) = found else {
            return Ok(None);
        };
        let unknown = Some(backend::Holding::new(None, None));
        if found.rewriting {
            return Ok(unknown);
        }
        // Without the session's start, a record naming its pid could be a
        // dead session's whose pid the server gave to this one.
        let Some(started) = found.started else {
            return Ok(unknown);
        };
        let own = self.own_holding(key, found.pid, started);
        if !found.records {
            return Ok(own.or(unknown));
        }
        let session = self.session().await?;
        let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 4] = [
            (&key.as_str(), Type::TEXT),
            (&self.options.key_seed, Type::INT8),
            (&found.pid, Type::INT4),
            (&started, Type::TIMESTAMPTZ),
        ];
        let rows = match session.query_typed(&self.holder_record_sql, &params).await {
            Ok(rows) => rows,
            // Dropped since: no record to read.
            Err(err) if sql::sequence_missing(&err) => return Ok(own.or(unknown)),
            // A table of an earlier dlock that this role may not bring to
            // this version's shape (only its owner may): the lock works, and
            // its holder is unknown, as without a table.
            Err(err) if err.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_COLUMN) => {
                return Ok(own.or(unknown));
            }
            Err(err) => {
                return Err(self.failed(
                    Operation::Inspect,
                    key,
                    "cannot read the holder record",
                    err,
                ));
            }
        };
        let Some(row) = rows.first() else {
            return Ok(own.or(unknown));
        };
        let record = Record::from_row(row, 0)
            .map_err(|e| self.failed(Operation::Inspect, key, "unexpected answer", e))?;
        Ok(Some(record.holding(key, own)?))
    }

    /// Every key held now whose name starts with `prefix`, as
    /// [`Backend::held`](crate::Backend::held) answers: the keys the table
    /// of holder records names, each believed as [`holder`](Self::holder)
    /// believes a record ([`sql::HELD`]), sorted by key. A key held
    /// without a record is not listed (see the module docs).
    pub(super) async fn held(
        self: &Arc<Self>,
        prefix: &str,
    ) -> Result<Vec<(String, backend::Holding)>, LockError> {
        let failed = |what: &str, err: tokio_postgres::Error| {
            LockError::backend(KIND, Operation::List, prefix, Failure::new(what, err))
        };
        let session = self.session().await?;
        let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 2] =
            [(&prefix, Type::TEXT), (&self.options.key_seed, Type::INT8)];
        let rows = match session.query_typed(&self.held_sql, &params).await {
            Ok(rows) => rows,
            // No table (or schema): nothing was ever recorded.
            Err(err) if sql::sequence_missing(&err) => return Ok(Vec::new()),
            Err(err) => return Err(failed("cannot list the holder records", err)),
        };
        let mut held = Vec::with_capacity(rows.len());
        for row in &rows {
            let read = || {
                Ok::<_, tokio_postgres::Error>((
                    row.try_get::<_, String>(0)?,
                    Record::from_row(row, 1)?,
                    row.try_get::<_, i32>(5)?,
                    row.try_get::<_, SystemTime>(6)?,
                ))
            };
            let (name, record, pid, started) =
                read().map_err(|e| failed("unexpected answer", e))?;
            // The table holds keys of every client of the schema: one
            // that is not a valid key here is not one of dlock's.
            let Ok(key) = LockKey::new(name.clone()) else {
                continue;
            };
            let own = self.own_holding(&key, pid, started);
            held.push((name, record.holding(&key, own)?));
        }
        held.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(held)
    }

    /// A notice of the next change of `key`'s holder. A release is
    /// announced: by this process's entry for the key going away, or by a
    /// wait probe (see the `wait` module). An acquisition with an identity
    /// is announced with `NOTIFY` (see the `announce` module), which the
    /// backend's listening connection hears (see the `listen` module): a
    /// free key's notice resolves on it, and asks the reader to look again
    /// within [`ANNOUNCED_RECHECK`] all the same, for an acquisition that
    /// was not announced; if no connection could listen, within
    /// [`FREE_RECHECK`], as does the notice of a key being taken or let go
    /// here. A held key changes holder only through a release, so its
    /// notice needs no recheck.
    ///
    /// The watch of a free key is made after the read that found it free:
    /// an acquisition in between is not announced to it, but it came
    /// before the reader's own read, which comes after this returns, and
    /// shows it.
    pub(super) async fn watch_holder(
        self: &Arc<Self>,
        key: &LockKey,
    ) -> Result<ReleaseNotice, LockError> {
        if let Some(entry) = self.keys().get_mut(key) {
            let settled = entry.holding().is_some();
            let mut gone = entry
                .gone
                .get_or_insert_with(|| watch::channel(()).0)
                .subscribe();
            let notice = ReleaseNotice::new(async move {
                let _ = gone.changed().await;
            });
            return Ok(if settled {
                notice
            } else {
                notice.recheck_within(FREE_RECHECK)
            });
        }
        let (lock_id, held) = self.key_held(key).await?;
        if !held {
            return Ok(match self.listener.watch(lock_id).await {
                Some(notice) => notice.recheck_within(ANNOUNCED_RECHECK),
                None => ReleaseNotice::new(std::future::pending()).recheck_within(FREE_RECHECK),
            });
        }
        // Released since the read, the probe is granted at once: the notice
        // resolves, as it should.
        Ok(self.waits.watch(key).unwrap_or_else(|| {
            ReleaseNotice::new(std::future::pending()).recheck_within(UNWATCHED_RECHECK)
        }))
    }

    /// `key`'s advisory key, and whether a session holds it exclusively.
    pub(super) async fn key_held(
        self: &Arc<Self>,
        key: &LockKey,
    ) -> Result<(i64, bool), LockError> {
        let session = self.session().await?;
        let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 2] = [
            (&key.as_str(), Type::TEXT),
            (&self.options.key_seed, Type::INT8),
        ];
        let rows = session
            .query_typed(sql::KEY_HELD, &params)
            .await
            .map_err(|e| {
                self.failed(
                    Operation::Inspect,
                    key,
                    "cannot read whether the key is held",
                    e,
                )
            })?;
        let Some(row) = rows.first() else {
            let what = Failure::msg("no answer to whether the key is held");
            return Err(LockError::backend(
                KIND,
                Operation::Inspect,
                key.as_str(),
                what,
            ));
        };
        let read = || Ok::<_, tokio_postgres::Error>((row.try_get(0)?, row.try_get(1)?));
        read().map_err(|e| self.failed(Operation::Inspect, key, "unexpected answer", e))
    }

    /// The session holding `key` exclusively, if any.
    async fn holder_session(
        self: &Arc<Self>,
        key: &LockKey,
    ) -> Result<Option<HolderSession>, LockError> {
        let session = self.session().await?;
        let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 2] = [
            (&key.as_str(), Type::TEXT),
            (&self.options.key_seed, Type::INT8),
        ];
        let rows = session
            .query_typed(&self.holder_session_sql, &params)
            .await
            .map_err(|e| {
                self.failed(Operation::Inspect, key, "cannot read who holds the key", e)
            })?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let read = || {
            Ok::<_, tokio_postgres::Error>(HolderSession {
                pid: row.try_get(0)?,
                started: row.try_get(1)?,
                records: row.try_get(2)?,
                rewriting: row.try_get(3)?,
            })
        };
        read()
            .map(Some)
            .map_err(|e| self.failed(Operation::Inspect, key, "unexpected answer", e))
    }

    /// This process's lease on `key`, if it holds it on the session the
    /// server says holds the key: its token, identity and time left.
    fn own_holding(
        &self,
        key: &LockKey,
        pid: i32,
        started: SystemTime,
    ) -> Option<backend::Holding> {
        let keys = self.keys();
        let holding = keys.get(key)?.holding()?;
        let session = &holding.session;
        if session.pid != pid || session.started != Some(started) || session.is_ended() {
            return None;
        }
        let left = holding.deadline().saturating_duration_since(Instant::now());
        let identity = holding.identity.as_ref().map(|i| i.identity.to_string());
        Some(backend::Holding::new(Some(holding.token), identity).expiring_in(left))
    }

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
        if leases.is_empty() || session.started.is_none() || !session.may_rewrite() {
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
        let Ok(_writes) = session.record_writes.try_lock() else {
            return;
        };
        if session.is_ended() || !session.may_rewrite() {
            return;
        }
        // Only leases held at this moment, under the lock an unlock takes
        // before it deletes: so this write reaches the server before any
        // of their unlocks.
        let held: Vec<(&LockKey, i64, i64, RewriteOf)> = {
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
        };
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
        session.pause_rewrites(REWRITE_PAUSE);
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

    /// Makes sure the table of holder records exists, has this version's
    /// shape and the role may use it, creating or migrating it if needed,
    /// before an acquisition of `key` that records; checked once per
    /// backend (`recheck`: again, as a lock statement found it missing).
    pub(super) async fn ensure_holders_table(
        self: &Arc<Self>,
        key: &LockKey,
        recheck: bool,
    ) -> Result<(), LockError> {
        let mut ready = self.holders_table.lock().await;
        if *ready && !recheck {
            return Ok(());
        }
        *ready = false;
        self.holders_state.set_unchecked();
        // Usually it exists: a look on a lock session, no connection of
        // its own.
        let session = self.session().await?;
        self.check_holders_table(&session)
            .await
            .map_err(|e| LockError::backend(KIND, Operation::Acquire, key.as_str(), e))?;
        *ready = true;
        self.holders_state.set_usable();
        Ok(())
    }

    /// Whether an acquisition of `key` without an identity records its
    /// holder: yes once the table is usable ([`ensure_holders_table`](Self::ensure_holders_table)).
    /// A table that is not (a role that may not create it, nor migrate an
    /// older dlock's, nor write it) costs such leases their record, never
    /// their lock: they lock without one, their holder reads as unknown,
    /// one warning says why, and the table is looked at again after
    /// [`UNUSABLE_RECHECK`] (or at once by an acquisition with an
    /// identity, which needs it).
    pub(super) async fn may_record(self: &Arc<Self>, key: &LockKey) -> bool {
        if !self.options.record_holders {
            return false;
        }
        if let Some(known) = self.holders_state.known() {
            return known;
        }
        match self.ensure_holders_table(key, false).await {
            Ok(()) => true,
            Err(err) => {
                self.records_unusable(&err);
                false
            }
        }
    }

    /// Leases without an identity record nothing for a while (see
    /// [`may_record`](Self::may_record)), because of `err`.
    pub(super) fn records_unusable(&self, err: &dyn std::fmt::Display) {
        if self.holders_state.set_unusable(UNUSABLE_RECHECK) {
            tracing::warn!(
                schema = self.quoted_schema,
                error = %err,
                "locks without an identity are taken without a holder record: their holder \
                 reads as unknown and `held` does not list them until the table \
                 {s}.dlock_holders is usable (looked at again every {UNUSABLE_RECHECK:?}); \
                 the locks themselves work as ever",
                s = self.quoted_schema,
            );
        }
    }

    /// Leases without an identity record nothing for [`LOCKED_PAUSE`]:
    /// one waited the session's `lock_timeout` for the table (`err`), which
    /// a DBA's `ALTER TABLE`, `VACUUM FULL`, `TRUNCATE` or `LOCK TABLE`
    /// holds. Every statement sent on the session meanwhile (renewals'
    /// checks, other leases' locks) waits as long, so the next ones lock
    /// without a record rather than wait again.
    pub(super) fn records_locked(&self, key: &LockKey, err: &tokio_postgres::Error) {
        if self.holders_state.set_unusable(LOCKED_PAUSE) {
            tracing::warn!(
                key = %key,
                error = %err,
                "the table {s}.dlock_holders is locked by another transaction for longer than \
                 a lock session waits: locks without an identity are taken without a holder \
                 record for the next {LOCKED_PAUSE:?}",
                s = self.quoted_schema,
            );
        }
    }

    async fn check_holders_table(&self, session: &LockSession) -> Result<(), Failure> {
        let schema = self.options.schema.as_str();
        let inspect_failed = |e| Failure::new("cannot inspect the table of holder records", e);
        let rows = session
            .query_typed(sql::INSPECT_HOLDERS_TABLE, &[(&schema, Type::TEXT)])
            .await
            .map_err(inspect_failed)?;
        let mut found = rows
            .first()
            .map(TableInspection::from_row)
            .transpose()
            .map_err(inspect_failed)?;
        if !found.as_ref().is_some_and(|t| t.exists && t.shaped) {
            self.create_holders_table(found.as_ref().map(|t| t.role.as_str()))
                .await?;
            let rows = session
                .query_typed(sql::INSPECT_HOLDERS_TABLE, &[(&schema, Type::TEXT)])
                .await
                .map_err(inspect_failed)?;
            found = rows
                .first()
                .map(TableInspection::from_row)
                .transpose()
                .map_err(inspect_failed)?;
        }
        let Some(found) = found.filter(|t| t.exists && t.shaped) else {
            return Err(Failure::msg(format!(
                "the table {}.dlock_holders vanished or changed while it was being checked",
                self.quoted_schema
            )));
        };
        let missing = found.missing();
        if !missing.is_empty() {
            return Err(Failure::msg(
                self.lacks_on_holders(&found.role, &missing.join(", ")),
            ));
        }
        Ok(())
    }

    /// What a role lacks on the table of identity records, and the GRANT
    /// that gives it, for errors.
    pub(super) fn lacks_on_holders(&self, role: &str, privileges: &str) -> String {
        format!(
            "role {role} lacks {privileges} on {s}.dlock_holders, where a lock taken with an \
             identity records who holds it; have a DBA run: GRANT SELECT, INSERT, UPDATE, \
             DELETE ON {s}.dlock_holders TO {role};",
            s = self.quoted_schema,
        )
    }

    /// [`lacks_on_holders`](Self::lacks_on_holders) for this role, read on
    /// `session`; `None` if the table is missing, the role lacks nothing,
    /// or it could not be read.
    pub(super) async fn holders_privileges(&self, session: &LockSession) -> Option<String> {
        let schema = self.options.schema.as_str();
        let rows = session
            .query_typed(sql::INSPECT_HOLDERS_TABLE, &[(&schema, Type::TEXT)])
            .await
            .ok()?;
        let found = TableInspection::from_row(rows.first()?).ok()?;
        let missing = found.missing();
        (found.exists && !missing.is_empty())
            .then(|| self.lacks_on_holders(&found.role, &missing.join(", ")))
    }

    /// Ends the session of another process that holds `key` for the lease
    /// whose token is `token`: true if one was ended, false if the lease
    /// named does not hold the key (nothing was ended). Never a session of
    /// `own` (this backend's).
    ///
    /// On a connection of its own, in one round trip
    /// ([`sql::FORCE_RELEASE_NAMED`]): under the key's release gate, the
    /// lock table is read, and only then, with a snapshot taken after that
    /// read, the records. Read in one statement, the records would be the
    /// statement's snapshot, older than the lock table: a holder that let
    /// go of the named lease and took the key again in between would be
    /// ended for the lease it no longer held, with every other lock of its
    /// session. The server runs the whole of it without waiting for this
    /// client, so the gate, which the holder's own releases of the key
    /// wait for, is held for as long as the server works, never for a
    /// round trip or a client that stalls; and the client gives up on it
    /// after the waits it sets, plus a connect timeout for the answer.
    pub(super) async fn terminate_named(
        &self,
        key: &LockKey,
        token: i64,
        own: &[i32],
    ) -> Result<bool, Failure> {
        const WHY: &str =
            "cannot end the session holding it (needs pg_signal_backend or the holder's role)";
        let connect = self.connector.connect_timeout();
        let terminate_wait = Duration::from_millis(TERMINATE_WAIT_MS.unsigned_abs());
        // The gate waits only for releases under way (one statement each),
        // and the lock table read for the lock manager.
        let gate = self.lock_timeout();
        let statement_wait = gate + terminate_wait + connect;
        let script = sql::force_release_named(
            &self.force_release_named_sql,
            key.as_str(),
            self.options.key_seed,
            token,
            own,
            &sql::ForceWaits {
                gate,
                statement: statement_wait,
                terminate: terminate_wait,
            },
        );
        // Dropping `close` closes the connection (and the server rolls
        // back whatever it had not finished).
        let (close, closed) = oneshot::channel();
        let client = self.connector.open(connect, closed, |_| {}).await?;
        let give_up = Instant::now() + gate;
        let mut pause = Duration::from_millis(1);
        let ended = loop {
            let bound = statement_wait * 3 + connect;
            let messages = match timeout(bound, client.simple_query(&script)).await {
                Ok(Ok(messages)) => messages,
                // No table of records: no lease of another process could
                // be named by its token.
                Ok(Err(err)) if sql::sequence_missing(&err) => break Ok(false),
                Ok(Err(err)) if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                    break Err(Failure::new(
                        "cannot end the session holding it: the table of holder records stayed \
                         locked past the lock timeout (an ALTER TABLE, VACUUM FULL or TRUNCATE \
                         on it?); nothing was ended",
                        err,
                    ));
                }
                Ok(Err(err)) => break Err(Failure::new(WHY, err)),
                Err(_) => break Err(Failure::msg(format!("{WHY}: no answer within {bound:?}"))),
            };
            match named_ends(&messages, key, token) {
                NamedEnds::GateBusy if Instant::now() < give_up => {
                    sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(20));
                }
                NamedEnds::GateBusy => {
                    break Err(Failure::msg(format!(
                        "cannot end the session holding it: releases of the key kept its release \
                         gate busy for {gate:?} (or another session holds it); nothing was ended"
                    )));
                }
                NamedEnds::Hidden(pid) => {
                    break Err(Failure::msg(format!(
                        "cannot tell whether the session holding it (pid {pid}) is the one the \
                         lease named: its start is hidden from this role (grant it \
                         pg_read_all_stats, or use the holder's role); nothing was ended"
                    )));
                }
                NamedEnds::Ended(ended) => break Ok(ended),
            }
        };
        drop(close);
        ended
    }

    /// Creates the table of holder records, or brings an older dlock's to
    /// this version's shape, on a connection of its own (that needs a
    /// transaction, and a lock session carries other leases' statements),
    /// under the setup lock the schema objects are created under.
    async fn create_holders_table(&self, role: Option<&str>) -> Result<(), Failure> {
        // Dropping `close` closes the connection.
        let (close, closed) = oneshot::channel();
        let mut client = self
            .connector
            .open(self.connector.connect_timeout(), closed, |_| {})
            .await?;
        let schema = self.options.schema.as_str();
        let mut migrating = false;
        let created = async {
            let tx = self.setup_transaction(&mut client).await?;
            // Look again under the lock: CREATE checks the privilege before
            // IF NOT EXISTS, so a role that may not create must not try
            // when another has just created it (nor migrate one another
            // has just migrated: only the owner may).
            let again = tx.query_one(sql::INSPECT_HOLDERS_TABLE, &[&schema]).await?;
            let exists: bool = again.try_get(0)?;
            let shaped = again.try_get::<_, Option<bool>>(6)?.unwrap_or(false);
            if !exists {
                tx.batch_execute(&sql::render(sql::CREATE_HOLDERS_TABLE, &self.quoted_schema))
                    .await?;
            } else if !shaped {
                migrating = true;
                tx.batch_execute(&sql::render(
                    sql::MIGRATE_HOLDERS_TABLE,
                    &self.quoted_schema,
                ))
                .await?;
            }
            tx.commit().await
        }
        .await;
        drop(close);
        if created.is_ok() && migrating {
            tracing::info!(
                schema = self.quoted_schema,
                "the table of holder records of an older dlock now has the columns of the \
                 holder record (holder, holder_token, since; identity nullable)"
            );
        }
        created.map_err(|err| {
            let denied = err.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE);
            let role = role.unwrap_or("the role");
            let what = if denied && migrating {
                format!(
                    "role {role} may not bring the table {s}.dlock_holders of an older dlock to \
                     this version's shape (only its owner may); have its owner run: {ddl}",
                    s = self.quoted_schema,
                    ddl = sql::holders_migration_ddl_for_dba(&self.quoted_schema),
                )
            } else if denied {
                format!(
                    "role {role} may not create the table {s}.dlock_holders (it needs CREATE on \
                     schema {s}), where a lock records who holds it; have a DBA run: {ddl}",
                    s = self.quoted_schema,
                    ddl = sql::holders_ddl_for_dba(&self.quoted_schema, role),
                )
            } else if migrating {
                format!(
                    "cannot bring the table {}.dlock_holders to this version's shape",
                    self.quoted_schema
                )
            } else {
                format!(
                    "cannot create the table {}.dlock_holders",
                    self.quoted_schema
                )
            };
            Failure::new(what, err)
        })
    }
}

/// A holder record as [`sql::HOLDER_RECORD`] and [`sql::HELD`] read it.
struct Record {
    token: i64,
    /// NULL for a lease without one.
    identity: Option<String>,
    /// The encoded holder record, if the row's acquisition wrote one.
    holder: Option<String>,
    /// How long ago it was taken, by the server's clock, in microseconds.
    held_for_us: Option<i64>,
}

impl Record {
    /// Reads the record's four columns, from the `first`.
    fn from_row(row: &tokio_postgres::Row, first: usize) -> Result<Self, tokio_postgres::Error> {
        Ok(Self {
            token: row.try_get(first)?,
            identity: row.try_get(first + 1)?,
            holder: row.try_get(first + 2)?,
            held_for_us: row.try_get(first + 3)?,
        })
    }

    /// The holding it tells of `key`; `own`, this process's lease on the
    /// session the record names, knows the token, the identity and the
    /// time left, and gets the holder record when it is its own.
    fn holding(
        self,
        key: &LockKey,
        own: Option<backend::Holding>,
    ) -> Result<backend::Holding, LockError> {
        let held_for = self
            .held_for_us
            .map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)));
        let info = self
            .holder
            .as_deref()
            .and_then(HolderInfo::decode)
            .map(|info| match held_for {
                Some(held_for) => info.held_for(held_for),
                None => info,
            });
        match own {
            Some(own) if own.token.is_some_and(|t| t.get() as i64 == self.token) => {
                Ok(own.held_by(info))
            }
            Some(own) => Ok(own),
            None => {
                let token = xact::to_token(self.token, key.as_str())?;
                Ok(backend::Holding::new(Some(token), self.identity).held_by(info))
            }
        }
    }
}

/// What a renewal writes again of a lease taken with an identity.
struct RewriteOf {
    identity: Arc<str>,
    holder: Box<str>,
    since_us: i64,
}

/// How long leases without an identity go without a record after the
/// table of holder records was found unusable (missing and not creatable,
/// of an old shape the role may not change, short of a privilege) before
/// an acquisition looks at it again: each look may open a connection.
const UNUSABLE_RECHECK: Duration = Duration::from_secs(60);

/// How long leases without an identity record nothing after one waited
/// too long for the table of holder records (see `Inner::records_locked`).
const LOCKED_PAUSE: Duration = Duration::from_secs(10);

/// Whether acquisitions without an identity record their holder, as the
/// last look at the table found it: read on every such acquisition, so
/// an atomic, and a look only when it is unknown or due again.
#[derive(Default)]
pub(super) struct TableState {
    /// [`UNCHECKED`], [`USABLE`] or [`UNUSABLE`].
    state: AtomicU8,
    /// When it was found unusable.
    unusable_at: Mutex<Option<Instant>>,
    /// Whether the warning that leases record nothing has been logged
    /// since the table was last usable.
    warned: AtomicBool,
}

const UNCHECKED: u8 = 0;
const USABLE: u8 = 1;
const UNUSABLE: u8 = 2;

impl TableState {
    pub(super) fn set_usable(&self) {
        self.state.store(USABLE, Ordering::Release);
        self.warned.store(false, Ordering::Relaxed);
    }

    pub(super) fn set_unchecked(&self) {
        let _ = self
            .state
            .compare_exchange(USABLE, UNCHECKED, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Marks it unusable for `pause`; true if the warning is due.
    fn set_unusable(&self, pause: Duration) -> bool {
        // Due again `UNUSABLE_RECHECK` after the instant recorded.
        let at = Instant::now()
            .checked_sub(UNUSABLE_RECHECK.saturating_sub(pause))
            .unwrap_or_else(Instant::now);
        *self
            .unusable_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(at);
        self.state.store(UNUSABLE, Ordering::Release);
        !self.warned.swap(true, Ordering::Relaxed)
    }

    /// `Some(answer)` when no look at the table is needed.
    fn known(&self) -> Option<bool> {
        match self.state.load(Ordering::Acquire) {
            USABLE => Some(true),
            UNUSABLE => {
                let at = *self
                    .unusable_at
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                at.is_some_and(|at| at.elapsed() < UNUSABLE_RECHECK)
                    .then_some(false)
            }
            _ => None,
        }
    }
}

/// A row of [`sql::INSPECT_HOLDERS_TABLE`].
struct TableInspection {
    exists: bool,
    select: bool,
    insert: bool,
    update: bool,
    delete: bool,
    role: String,
    /// Whether it has this version's shape ([`sql::MIGRATE_HOLDERS_TABLE`]).
    shaped: bool,
}

impl TableInspection {
    fn from_row(row: &tokio_postgres::Row) -> Result<Self, tokio_postgres::Error> {
        Ok(Self {
            exists: row.try_get(0)?,
            select: row.try_get(1)?,
            insert: row.try_get(2)?,
            update: row.try_get(3)?,
            delete: row.try_get(4)?,
            role: row.try_get(5)?,
            shaped: row.try_get::<_, Option<bool>>(6)?.unwrap_or(false),
        })
    }

    /// The privileges the role lacks on the table.
    fn missing(&self) -> Vec<&'static str> {
        [
            (self.select, "SELECT"),
            (self.insert, "INSERT"),
            (self.update, "UPDATE"),
            (self.delete, "DELETE"),
        ]
        .into_iter()
        .filter(|(has, _)| !has)
        .map(|(_, privilege)| privilege)
        .collect()
    }
}

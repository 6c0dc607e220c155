//! Who holds a key ([`Backend::holder`](crate::Backend::holder)), the keys
//! held under a prefix ([`Backend::held`](crate::Backend::held)) and
//! watching a key's holder change
//! ([`Backend::watch_holder`](crate::Backend::watch_holder)).
//!
//! The holder is the session `pg_locks` shows holding the key's advisory
//! lock exclusively. A lease without an identity writes no record: its
//! token is in `pg_locks` too, in its token marks (`sql::TRY_LOCK_NAMED`),
//! its session named itself once (`names`), and the time held is read
//! from the token. A lease with an identity records, in
//! `{schema}.dlock_holders`, in the statement that takes the lock, its key,
//! token, session, identity, holder record (host, pid, label) and the
//! server's time of acquisition (`sql::TRY_LOCK_RECORDING`), and deletes
//! the row in the statement that drops the lock (`sql::UNLOCK_RECORDED`);
//! so does a plain lease where the tables of names cannot be used, but it
//! leaves its row for its session's next batch delete
//! (`sql::DELETE_RELEASED`), as every plain lease of an older dlock does.
//! While the statement that took the lock has not committed, its session
//! holds the key's `rewriting` mark, and the record read may be an
//! earlier lease's: the holder is read again, and reads as unknown if the
//! mark stays. Each renewal of a lease taken with an identity writes its
//! record again if it went missing (`sql::REWRITE_RECORDS`). A record is
//! believed only when it names the session that holds the lock (its pid
//! and its start): a record not yet committed, one of a session that
//! died, or one of another key with the same advisory key leaves the
//! holder to the marks and the session's name, never paired with an
//! earlier lease. Other holders (a [`TransactionLock`](super::TransactionLock),
//! any client's advisory lock) are unknown, except this process's own
//! leases, whose token, identity and deadline it knows.
//!
//! A table the role cannot use costs leases without an identity their
//! record, never their lock (see [`Inner::may_record`]).
//!
//! The table itself (made, judged usable) is in `holders_table`,
//! a renewal's rewrite of missing records in `holders_rewrite`, and the
//! force release that names a lease in `holders_force`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_postgres::types::Type;

use super::announce::ANNOUNCED_RECHECK;
use super::connection::Failure;
use super::{Inner, KIND, UNWATCHED_RECHECK, names, sql, xact};
use crate::backend::{self, ReleaseNotice};
use crate::error::{LockError, Operation};
use crate::holder::HolderInfo;
use crate::key::LockKey;

/// How soon a reader watching a key looks again when no announcement of
/// its acquisition can reach the watch: while this process is taking or
/// letting go of the key (its entry's end wakes the watch, but the
/// server's state moves on its own), or while no listening connection
/// could be opened (see the `listen` module).
const FREE_RECHECK: Duration = Duration::from_millis(50);

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
    /// The token in the session's token marks of the key (see `names`).
    marked: Option<i64>,
    /// The server's clock, in microseconds.
    now_us: i64,
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
        // dead session's whose pid the server gave to this one; the token
        // marks were read with the lock, and are the session's own.
        let marked = found
            .marked
            .map(|token| xact::to_token(token, key.as_str()))
            .transpose()?;
        let Some(started) = found.started else {
            return Ok(Some(backend::Holding::new(marked, None)));
        };
        let own = self.own_holding(key, found.pid, started);
        let session = self.session().await?;
        let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 4] = [
            (&key.as_str(), Type::TEXT),
            (&self.options.key_seed, Type::INT8),
            (&found.pid, Type::INT4),
            (&started, Type::TIMESTAMPTZ),
        ];
        // No table of records (never made, or dropped since), or one
        // without the columns of the holder record: no record to read, and
        // the holder is read from its marks and its session's name.
        let rows = if !found.records {
            Vec::new()
        } else {
            match session.query_typed(&self.holder_record_sql, &params).await {
                Ok(rows) => rows,
                Err(err)
                    if sql::sequence_missing(&err)
                        || err.code()
                            == Some(&tokio_postgres::error::SqlState::UNDEFINED_COLUMN) =>
                {
                    Vec::new()
                }
                Err(err) => {
                    return Err(self.failed(
                        Operation::Inspect,
                        key,
                        "cannot read the holder record",
                        err,
                    ));
                }
            }
        };
        let Some(row) = rows.first() else {
            // No record: a named lease (see `names`), with the token its
            // marks carry and the name its session gave, if any.
            let named = self.session_holder(&session, found.pid, started).await;
            let holding = own.unwrap_or_else(|| backend::Holding::new(marked, None));
            let holding = match named {
                Some(info) if holding.holder.is_none() => {
                    let info = match found.marked {
                        Some(token) => info.held_for(names::held_for(token, found.now_us)),
                        None => info,
                    };
                    holding.held_by(Some(info))
                }
                _ => holding,
            };
            return Ok(Some(holding));
        };
        let record = Record::from_row(row, 0)
            .map_err(|e| self.failed(Operation::Inspect, key, "unexpected answer", e))?;
        Ok(Some(record.holding(key, own)?))
    }

    /// Who the session `pid` that started at `started` is, as it named
    /// itself ([`sql::SESSION_HOLDERS`]): `None` if it did not, or the
    /// names cannot be read (missing tables, a role without SELECT), which
    /// leaves the holder unnamed rather than failing the read.
    async fn session_holder(
        &self,
        session: &super::session::LockSession,
        pid: i32,
        started: SystemTime,
    ) -> Option<HolderInfo> {
        let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 2] =
            [(&pid, Type::INT4), (&started, Type::TIMESTAMPTZ)];
        let rows = session
            .query_typed(&self.session_holders_sql, &params)
            .await
            .inspect_err(|err| tracing::debug!(error = %err, "cannot read a session's name"))
            .ok()?;
        let named: Vec<String> = rows.iter().filter_map(|row| row.try_get(0).ok()).collect();
        names::session_holder(&named)
    }

    /// Every key held now whose name starts with `prefix`, as
    /// [`Backend::held`](crate::Backend::held) answers: the keys the table
    /// of holder records names, each believed as [`holder`](Self::holder)
    /// believes a record ([`sql::HELD`]), and the keys held without one
    /// that a dlock named ([`sql::HELD_NAMED`]), sorted by key. A key held
    /// with neither is not listed (see the module docs).
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
            // No table of records (or no schema): nothing recorded, and
            // the named keys are listed all the same.
            Err(err) if sql::sequence_missing(&err) => Vec::new(),
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
        self.held_named(&session, prefix, &mut held).await?;
        held.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(held)
    }

    /// Adds to `held` the keys under `prefix` held without a record that
    /// a dlock named ([`sql::HELD_NAMED`]): with no token (unless this
    /// process holds the key) and the name of the session holding it.
    /// Missing tables of names (an older dlock's schema) add none.
    async fn held_named(
        &self,
        session: &super::session::LockSession,
        prefix: &str,
        held: &mut Vec<(String, backend::Holding)>,
    ) -> Result<(), LockError> {
        let params: [(&(dyn tokio_postgres::types::ToSql + Sync), Type); 2] =
            [(&prefix, Type::TEXT), (&self.options.key_seed, Type::INT8)];
        let rows = match session.query_typed(&self.held_named_sql, &params).await {
            Ok(rows) => rows,
            Err(err) if sql::sequence_missing(&err) => return Ok(()),
            Err(err) => {
                return Err(LockError::backend(
                    KIND,
                    Operation::List,
                    prefix,
                    Failure::new("cannot list the named keys", err),
                ));
            }
        };
        let recorded: std::collections::HashSet<String> =
            held.iter().map(|(name, _)| name.clone()).collect();
        for row in &rows {
            let read = || {
                Ok::<_, tokio_postgres::Error>((
                    row.try_get::<_, String>(0)?,
                    row.try_get::<_, i32>(1)?,
                    row.try_get::<_, Option<SystemTime>>(2)?,
                    row.try_get::<_, Option<Vec<String>>>(3)?,
                    row.try_get::<_, Option<i64>>(4)?,
                    row.try_get::<_, i64>(5)?,
                ))
            };
            let (name, pid, started, named, marked, now_us) = read().map_err(|e| {
                LockError::backend(
                    KIND,
                    Operation::List,
                    prefix,
                    Failure::new("unexpected answer", e),
                )
            })?;
            let Ok(key) = LockKey::new(name.clone()) else {
                continue;
            };
            if recorded.contains(&name) {
                continue;
            }
            let info =
                named
                    .and_then(|named| names::session_holder(&named))
                    .map(|info| match marked {
                        Some(token) => info.held_for(names::held_for(token, now_us)),
                        None => info,
                    });
            let own = started.and_then(|started| self.own_holding(&key, pid, started));
            let holding = match own {
                Some(own) => own,
                None => {
                    let token = marked
                        .map(|token| xact::to_token(token, key.as_str()))
                        .transpose()?;
                    backend::Holding::new(token, None)
                }
            };
            held.push((name, holding.held_by(info)));
        }
        Ok(())
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
                marked: row.try_get(4)?,
                now_us: row.try_get(5)?,
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

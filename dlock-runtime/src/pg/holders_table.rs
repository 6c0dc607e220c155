//! The table of holder records: making sure it exists and the role may use
//! it (creating it on a connection of its own), and whether acquisitions without an identity record their
//! holder while it is not usable.
//!
//! Its own file because it is setup, run once per backend or after a
//! failure, and the state that spares every other acquisition a look at
//! the table.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;

use super::connection::Failure;
use super::session::LockSession;
use super::{Inner, KIND, sql};
use crate::error::{LockError, Operation};
use crate::key::LockKey;

impl Inner {
    /// Makes sure the table of holder records exists and the role may use
    /// it, creating it if needed, before an acquisition of `key` that records; checked once per
    /// backend (`recheck`: again, as a lock statement found it missing).
    ///
    /// Boxed: the check and the creation are large futures, and every
    /// lock path that may call this would otherwise carry their size in its
    /// own, copied into a box at each acquisition.
    pub(super) async fn ensure_holders_table(
        self: &Arc<Self>,
        key: &LockKey,
        recheck: bool,
    ) -> Result<(), LockError> {
        Box::pin(self.ensure_holders_table_now(key, recheck)).await
    }

    async fn ensure_holders_table_now(
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
    /// A table that is not (a role that may not create it, nor write it)
    /// costs such leases their record, never
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

    /// Reads [`sql::INSPECT_HOLDERS_TABLE`] on `session`.
    async fn inspect_holders_table(
        &self,
        session: &LockSession,
    ) -> Result<Option<TableInspection>, Failure> {
        let schema = self.options.schema.as_str();
        let inspect_failed = |e| Failure::new("cannot inspect the table of holder records", e);
        let rows = session
            .query_typed(sql::INSPECT_HOLDERS_TABLE, &[(&schema, Type::TEXT)])
            .await
            .map_err(inspect_failed)?;
        rows.first()
            .map(TableInspection::from_row)
            .transpose()
            .map_err(inspect_failed)
    }

    async fn check_holders_table(&self, session: &LockSession) -> Result<(), Failure> {
        let mut found = self.inspect_holders_table(session).await?;
        if !found.as_ref().is_some_and(|t| t.exists) {
            self.create_holders_table(found.as_ref().map(|t| t.role.as_str()))
                .await?;
            found = self.inspect_holders_table(session).await?;
        }
        let Some(mut found) = found.filter(|t| t.exists) else {
            return Err(Failure::msg(format!(
                "the table {}.dlock_holders vanished while it was being checked",
                self.quoted_schema
            )));
        };
        let missing = found.missing();
        if !missing.is_empty() {
            return Err(Failure::msg(
                self.lacks_on_holders(&found.role, &missing.join(", ")),
            ));
        }
        if !found.names_exist {
            // Beside an older dlock's table: made now, or never used.
            if let Err(err) = self.create_names_tables().await {
                tracing::warn!(
                    schema = self.quoted_schema,
                    error = %err,
                    "the tables that name a lock's holder without a write per acquisition \
                     (dlock_sessions, dlock_keys) could not be created: locks without an \
                     identity record their holder with every acquisition instead"
                );
            }
            if let Some(again) = self.inspect_holders_table(session).await? {
                found = again;
            }
        }
        let usable = found.names_exist && found.names_usable;
        if found.names_exist && !usable && !self.names.usable() {
            tracing::warn!(
                schema = self.quoted_schema,
                role = found.role,
                "the role may not use the tables that name a lock's holder without a write per \
                 acquisition: locks without an identity record their holder with every \
                 acquisition instead; have a DBA run: GRANT SELECT, INSERT, DELETE ON \
                 {s}.dlock_sessions TO {r}; GRANT SELECT, INSERT, UPDATE, DELETE ON \
                 {s}.dlock_keys TO {r};",
                s = self.quoted_schema,
                r = found.role,
            );
        }
        self.names.set_usable(usable);
        Ok(())
    }

    /// Creates the tables of names ([`sql::CREATE_NAMES_TABLES`]) beside a
    /// table of holder records made without them, on a connection of its
    /// own, under the setup lock.
    async fn create_names_tables(&self) -> Result<(), Failure> {
        let created = self
            .on_own_connection(async |client| {
                let tx = self.setup_transaction(client).await?;
                tx.batch_execute(&sql::render(sql::CREATE_NAMES_TABLES, &self.quoted_schema))
                    .await?;
                tx.commit().await
            })
            .await?;
        created.map_err(|err| Failure::new("cannot create the tables of names", err))
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
        let found = self.inspect_holders_table(session).await.ok()??;
        let missing = found.missing();
        (found.exists && !missing.is_empty())
            .then(|| self.lacks_on_holders(&found.role, &missing.join(", ")))
    }

    /// Creates the table of holder records on a connection of its own
    /// (that needs a transaction, and a lock session carries other leases'
    /// statements), under the setup lock the schema objects are created
    /// under.
    async fn create_holders_table(&self, role: Option<&str>) -> Result<(), Failure> {
        let schema = self.options.schema.as_str();
        let created = self
            .on_own_connection(async |client| {
                let tx = self.setup_transaction(client).await?;
                // Look again under the lock: CREATE checks the privilege
                // before IF NOT EXISTS, so a role that may not create must
                // not try when another has just created it.
                let again = tx.query_one(sql::INSPECT_HOLDERS_TABLE, &[&schema]).await?;
                let exists: bool = again.try_get(0)?;
                if !exists {
                    tx.batch_execute(&sql::render(sql::CREATE_HOLDERS_TABLE, &self.quoted_schema))
                        .await?;
                }
                tx.commit().await
            })
            .await?;
        created.map_err(|err| {
            let denied = err.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE);
            let role = role.unwrap_or("the role");
            let what = if denied {
                format!(
                    "role {role} may not create the table {s}.dlock_holders (it needs CREATE on \
                     schema {s}), where a lock records who holds it; have a DBA run: {ddl}",
                    s = self.quoted_schema,
                    ddl = sql::holders_ddl_for_dba(&self.quoted_schema, role),
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

/// How long leases without an identity go without a record after the
/// table of holder records was found unusable (missing and not creatable,
/// short of a privilege) before
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
    /// Whether the tables of names exist ([`sql::CREATE_NAMES_TABLES`]),
    /// and the role may use them.
    names_exist: bool,
    names_usable: bool,
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
            names_exist: row.try_get(6)?,
            names_usable: row.try_get(7)?,
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

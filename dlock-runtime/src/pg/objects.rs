//! The schema objects dlock needs (the schema and the token sequence):
//! inspecting, creating and repairing them, with errors that say what a DBA
//! must run.

use std::sync::atomic::Ordering;

use super::connection::Failure;
use super::{Inner, sequence, sql};
use tokio::sync::oneshot;
use tokio_postgres::error::SqlState;

impl Inner {
    /// A transaction that creates the backend's objects: it holds the
    /// setup lock, so backends creating at the same moment take turns. A
    /// lock session waits for locks only briefly (see
    /// `sql::SESSION_DEFAULTS`); this waits for another backend's setup up
    /// to the connect timeout.
    pub(super) async fn setup_transaction<'a>(
        &self,
        client: &'a mut tokio_postgres::Client,
    ) -> Result<tokio_postgres::Transaction<'a>, tokio_postgres::Error> {
        let tx = client.transaction().await?;
        let setup_wait = self
            .connector
            .connect_timeout()
            .as_millis()
            .max(1)
            .to_string();
        tx.query_one(sql::SET_LOCAL_LOCK_TIMEOUT, &[&setup_wait])
            .await?;
        tx.query_one(sql::SETUP_LOCK, &[]).await?;
        Ok(tx)
    }

    /// Runs `work` on a connection of its own, closed when it is done: for
    /// setup, which needs a transaction, while a lock session carries other
    /// leases' statements. `Err` only if the connection cannot be opened.
    pub(super) async fn on_own_connection<T>(
        &self,
        work: impl AsyncFnOnce(&mut tokio_postgres::Client) -> T,
    ) -> Result<T, Failure> {
        // Dropping `close` closes the connection.
        let (close, closed) = oneshot::channel();
        let mut client = self
            .connector
            .open(self.connector.connect_timeout(), closed, |_| {})
            .await?;
        let done = work(&mut client).await;
        drop(close);
        Ok(done)
    }

    /// Creates the schema and the token sequence when missing, checks the
    /// privileges on them, and refuses a sequence whose settings cannot give
    /// rising tokens.
    pub(super) async fn ensure_objects(
        &self,
        client: &mut tokio_postgres::Client,
    ) -> Result<(), Failure> {
        let schema = self.options.schema.as_str();
        let inspect_sql = sql::INSPECT_OBJECTS;
        let inspect_failed = |e: tokio_postgres::Error| {
            let what = if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
                "cannot inspect the token sequence: another transaction holds a lock on it \
                 (an ALTER SEQUENCE or a DROP left open?)"
            } else {
                "cannot inspect the schema objects"
            };
            Failure::new(what, e)
        };
        let row = client
            .query_one(inspect_sql, &[&schema])
            .await
            .map_err(inspect_failed)?;
        let mut found = Inspection::from_row(&row).map_err(inspect_failed)?;
        if !found.schema_exists || !found.sequence_exists {
            let created = async {
                let tx = self.setup_transaction(&mut *client).await?;
                // Look again under the lock: another backend may just have
                // created them, and CREATE checks privileges before IF NOT EXISTS.
                let again = Inspection::from_row(&tx.query_one(inspect_sql, &[&schema]).await?)?;
                if !again.schema_exists {
                    tx.batch_execute(&sql::render(sql::CREATE_SCHEMA, &self.quoted_schema))
                        .await?;
                }
                if !again.sequence_exists {
                    tx.batch_execute(&sql::render(sql::CREATE_SEQUENCE, &self.quoted_schema))
                        .await?;
                    // The token lead only in a schema new to everyone: a
                    // sequence made again may still be drawn from by an
                    // earlier dlock, which writes without the draw lock.
                    if !again.schema_exists {
                        tx.batch_execute(&sql::render(sql::SET_TOKEN_LEAD, &self.quoted_schema))
                            .await?;
                    }
                }
                tx.commit().await
            };
            if let Err(err) = created.await {
                let what = if err.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) {
                    format!(
                        "role {} may not create the objects dlock needs in schema {}; \
                         have a DBA run: {} (or choose a usable schema with PgOptions::schema)",
                        found.role,
                        self.quoted_schema,
                        sql::ddl_for_dba(&self.quoted_schema, &found.role)
                    )
                } else {
                    format!("cannot create the schema objects in {}", self.quoted_schema)
                };
                return Err(Failure::new(what, err));
            }
            let row = client
                .query_one(inspect_sql, &[&schema])
                .await
                .map_err(inspect_failed)?;
            found = Inspection::from_row(&row).map_err(inspect_failed)?;
        }
        if !found.schema_usable || !found.sequence_usable {
            return Err(Failure::msg(format!(
                "role {} lacks privileges on the objects dlock needs (USAGE on schema {s}, \
                 USAGE on sequence {s}.dlock_token_seq); have a DBA run: {}",
                found.role,
                sql::ddl_for_dba(&self.quoted_schema, &found.role),
                s = self.quoted_schema,
            )));
        }
        match &found.settings {
            Some(settings) => settings.check(&self.quoted_schema)?,
            // Dropped again between creating it and looking at it.
            None => {
                return Err(Failure::msg(format!(
                    "the token sequence {}.dlock_token_seq vanished while it was being checked",
                    self.quoted_schema
                )));
            }
        }
        if let Some(others) = &found.other_schemas {
            self.warn_other_schemas(others);
        }
        if !found.sequence_updatable {
            tracing::warn!(
                role = found.role,
                schema = self.quoted_schema,
                "no UPDATE on the token sequence: fencing tokens rest on the server clock \
                 alone, so a clock step back lowers them; GRANT UPDATE on it to protect them"
            );
        }
        Ok(())
    }

    /// Says, once per backend, that other schemas of the database hold
    /// token sequences too. The advisory lock of a key depends on the key
    /// and the key seed only, not on the schema: clients that use another
    /// schema with the same seed share this backend's locks but draw their
    /// tokens from another sequence, and two sequences need not agree (one
    /// ahead of the other after a clock step back), so the tokens of one
    /// key could go back between them. Fine when those clients lock other
    /// keys or use another seed; dlock cannot see which from here.
    fn warn_other_schemas(&self, others: &str) {
        if self.warned_other_schemas.swap(true, Ordering::Relaxed) {
            return;
        }
        tracing::warn!(
            schema = self.quoted_schema,
            key_seed = self.options.key_seed,
            other_schemas = others,
            "other schemas of this database hold dlock token sequences too; a lock is \
             per key and key seed, not per schema, so clients that lock the same keys \
             with the same key seed must use the same schema, or the tokens of a key come \
             from two sequences and can go back; give unrelated deployments their own \
             key seed (PgOptions::key_seed, TransactionLock::key_seed)"
        );
    }

    /// Recreates what a lock statement found missing — a DBA dropped the
    /// token sequence, or its schema, while the service runs — so locking
    /// goes on instead of failing until someone notices. Safe because every
    /// token is floored by the clock: a fresh sequence cannot hand out a
    /// token at or below an earlier one. A role that may not create it gets
    /// the error naming the DDL for a DBA.
    ///
    /// On a connection of its own: creating needs a transaction, and a lock
    /// session carries other leases' statements. Acquisitions that failed
    /// together try once, and share the outcome.
    pub(super) async fn restore_objects(&self) -> Result<(), Failure> {
        let seen = self.restorations.load(Ordering::Acquire);
        let mut last_failure = self.restoring.lock().await;
        if self.restorations.load(Ordering::Acquire) != seen {
            // Tried while this caller waited: its outcome is this caller's.
            return match &*last_failure {
                None => Ok(()),
                Some(why) => Err(Failure::msg(why.clone())),
            };
        }
        let restored = self
            .on_own_connection(async |client| self.ensure_objects(client).await)
            .await
            .flatten()
            .map_err(|e| {
                e.context(format!(
                    "the token sequence {}.dlock_token_seq is missing (dropped while the \
                     service runs?)",
                    self.quoted_schema
                ))
            });
        *last_failure = restored.as_ref().err().map(ToString::to_string);
        self.restorations.fetch_add(1, Ordering::AcqRel);
        if restored.is_ok() {
            tracing::warn!(
                schema = self.quoted_schema,
                "a lock statement found the token sequence missing; it exists again \
                 (tokens stay above the clock)"
            );
        }
        restored
    }
}

pub(super) struct Inspection {
    schema_exists: bool,
    sequence_exists: bool,
    schema_usable: bool,
    sequence_usable: bool,
    role: String,
    sequence_updatable: bool,
    settings: Option<sequence::Settings>,
    /// Other schemas with a `dlock_token_seq`, quoted, comma-separated.
    other_schemas: Option<String>,
}

impl Inspection {
    /// Reads a row of [`sql::INSPECT_OBJECTS`].
    pub(super) fn from_row(row: &tokio_postgres::Row) -> Result<Self, tokio_postgres::Error> {
        let increment: Option<i64> = row.try_get(6)?;
        let settings = match increment {
            Some(increment) => Some(sequence::Settings {
                increment,
                cache: row.try_get(7)?,
                cycle: row.try_get(8)?,
                max: row.try_get(9)?,
                data_type: row.try_get(10)?,
                clock_us: row.try_get(11)?,
                last_value: row.try_get(12)?,
                start: row.try_get(13)?,
            }),
            None => None,
        };
        Ok(Self {
            schema_exists: row.try_get(0)?,
            sequence_exists: row.try_get(1)?,
            schema_usable: row.try_get(2)?,
            sequence_usable: row.try_get(3)?,
            role: row.try_get(4)?,
            sequence_updatable: row.try_get(5)?,
            settings,
            other_schemas: row.try_get(14)?,
        })
    }
}

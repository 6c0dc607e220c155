//! PostgreSQL: three backends on the shared server, in a schema of the
//! run's own (so that its token sequence may be set back), and what a DBA
//! does there: `setval` of the sequence, `pg_terminate_backend` of a
//! process's lock sessions, a `LOCK TABLE` of dlock's tables.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock::Backend;
use dlock::pg::PgBackend;
use dlock::pg::tokio_postgres::Client;

use crate::ops::{Abilities, Mode, Op, PERMIT_KEY};
use crate::pg_support::{ScratchSchema, shared_client, shared_conn};
use crate::run::{Run, Store};

/// dlock's tables a DBA may lock.
const TABLES: [&str; 2] = ["dlock_holders", "dlock_phases"];
/// How long a DBA keeps a table locked.
const TABLE_LOCK: Duration = Duration::from_millis(100);

/// The PostgreSQL store.
pub struct Pg {
    schema: ScratchSchema,
    pgs: Vec<PgBackend>,
    admin: Client,
    dba: Client,
}

impl Pg {
    pub async fn open() -> Self {
        let schema = ScratchSchema::new("model");
        let mut pgs = Vec::new();
        for p in 0..3 {
            pgs.push(
                PgBackend::connect_with(&named(&schema, p), schema.options())
                    .await
                    .expect("PostgreSQL at 127.0.0.1:5432 or DLOCK_PG_URL"),
            );
        }
        Self {
            schema,
            pgs,
            admin: shared_client().await,
            dba: shared_client().await,
        }
    }

    /// Ends process `p`'s sessions (its lock sessions and its fair
    /// waits' alike); every lease on them is lost.
    async fn terminate(&self, run: &mut Run, p: usize) -> Result<(), String> {
        // A waiter whose session ends may or may not keep its place: not
        // a question for this model.
        if run.queued_in(p) {
            return Ok(());
        }
        self.admin
            .query(
                "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity \
                 WHERE application_name = $1",
                &[&application_name(&self.schema, p)],
            )
            .await
            .map_err(|err| format!("pg_terminate_backend failed: {err}"))?;
        let lost: Vec<bool> = (0..run.keys.len())
            .map(|k| {
                run.model.keys[k]
                    .holders()
                    .iter()
                    .any(|o| run.owners_of(p).contains(o))
            })
            .collect();
        run.model.lose_owners(&run.owners_of(p));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while run.backends[p].holder(&run.keys[0]).await.is_err() {
            if tokio::time::Instant::now() > deadline {
                return Err("the backend never answered after its sessions ended".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for (k, lost) in lost.into_iter().enumerate() {
            if lost && run.model.keys[k].hold == crate::reference::Hold::Free {
                run.settle(k).await?;
            }
        }
        Ok(())
    }

    /// A DBA locks one of dlock's tables while an acquisition runs: the
    /// acquisition waits, then answers as the rules say.
    async fn table_locked(
        &self,
        run: &mut Run,
        table: usize,
        p: usize,
        k: usize,
        o: u32,
    ) -> Result<(), String> {
        let locked = self
            .dba
            .batch_execute(&format!(
                "BEGIN; SET LOCAL lock_timeout = '5s'; LOCK TABLE {}.{} IN ACCESS EXCLUSIVE MODE",
                self.schema.name, TABLES[table]
            ))
            .await;
        if let Err(err) = locked {
            let _ = self.dba.batch_execute("ROLLBACK").await;
            if err.code() == Some(&dlock::pg::tokio_postgres::error::SqlState::UNDEFINED_TABLE) {
                // Not created yet (the table of read phases comes with the
                // first reader).
                return Ok(());
            }
            let holders = self
                .admin
                .query(
                    "SELECT l.pid, l.mode, l.granted, a.state, left(a.query, 200) \
                     FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
                     JOIN pg_stat_activity a ON a.pid = l.pid WHERE c.relname = $1",
                    &[&TABLES[table]],
                )
                .await
                .map(|rows| {
                    rows.iter()
                        .map(|r| {
                            format!(
                                "{:?} {:?} {:?} {:?} {:?}",
                                r.get::<_, i32>(0),
                                r.get::<_, String>(1),
                                r.get::<_, bool>(2),
                                r.get::<_, Option<String>>(3),
                                r.get::<_, Option<String>>(4)
                            )
                        })
                        .collect::<Vec<_>>()
                })
                .map_err(|e| e.to_string());
            return Err(format!(
                "a DBA could not lock {} within 5 s: {err}; its lockers: {holders:?}",
                TABLES[table]
            ));
        }
        let mode = match (k, table) {
            (PERMIT_KEY, _) => Mode::Permit,
            (_, 1) => Mode::Shared,
            _ => Mode::Exclusive,
        };
        let unlock = async {
            tokio::time::sleep(TABLE_LOCK).await;
            self.dba.batch_execute("COMMIT").await
        };
        let (answer, unlocked) = tokio::join!(run.acquire(p, k, o, mode, false), unlock);
        unlocked.map_err(|err| format!("the DBA's COMMIT failed: {err}"))?;
        answer.map(drop)
    }
}

/// The application name of process `p`'s sessions.
fn application_name(schema: &ScratchSchema, p: usize) -> String {
    format!("{}-{p}", schema.name)
}

/// The shared server's connection string, naming process `p`'s sessions.
fn named(schema: &ScratchSchema, p: usize) -> String {
    let conn = shared_conn();
    let name = application_name(schema, p);
    if conn.starts_with("postgres") {
        let joint = if conn.contains('?') { '&' } else { '?' };
        format!("{conn}{joint}application_name={name}")
    } else {
        format!("{conn} application_name={name}")
    }
}

#[async_trait]
impl Store for Pg {
    fn name(&self) -> &'static str {
        "pg"
    }

    fn abilities(&self) -> Abilities {
        Abilities {
            members_hidden: true,
            force_ends_sessions: true,
            // A session ended takes a reconnection (about 0.2 s): fewer.
            fault_percent: 5,
            rewind: true,
            terminate: true,
            table_lock: true,
            ..Abilities::every_mode()
        }
    }

    fn backends(&self) -> Vec<Arc<dyn Backend>> {
        self.pgs
            .iter()
            .map(|pg| Arc::new(pg.clone()) as Arc<dyn Backend>)
            .collect()
    }

    async fn fault(&self, op: &Op, run: &mut Run) -> Result<(), String> {
        match *op {
            Op::Rewind { .. } => {
                let sequence = format!("{}.dlock_token_seq", self.schema.name);
                self.admin
                    .execute(&format!("SELECT setval('{sequence}', 1)"), &[])
                    .await
                    .map_err(|err| format!("setval failed: {err}"))?;
                Ok(())
            }
            Op::Terminate { p } => self.terminate(run, p).await,
            Op::TableLocked { table, p, k, o } => self.table_locked(run, table, p, k, o).await,
            _ => Err(format!("PostgreSQL has no fault {op:?}")),
        }
    }
}

//! PostgreSQL restarted: a server of the run's own (password and TLS, as
//! `pg_support::OwnServer` starts it), stopped and started again under
//! three backends, as a DBA's restart or a crash recovery does.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock::Backend;
use dlock::pg::PgBackend;

use crate::ops::{Abilities, Op};
use crate::pg_support::{OwnServer, PASSWORD};
use crate::run::{Run, Store};

pub struct PgRestart {
    server: OwnServer,
    backends: Vec<Arc<dyn Backend>>,
}

impl PgRestart {
    pub async fn open() -> Self {
        let server = tokio::task::spawn_blocking(OwnServer::start)
            .await
            .expect("a PostgreSQL server of the run's own");
        let mut backends: Vec<Arc<dyn Backend>> = Vec::new();
        for _ in 0..3 {
            let backend = PgBackend::connect(&server.conn(PASSWORD, ""))
                .await
                .expect("the run's own PostgreSQL");
            backends.push(Arc::new(backend));
        }
        Self { server, backends }
    }
}

#[async_trait]
impl Store for PgRestart {
    fn name(&self) -> &'static str {
        "pg_restart"
    }

    fn abilities(&self) -> Abilities {
        Abilities {
            members_hidden: true,
            force_ends_sessions: true,
            restart: true,
            // A restart takes a second or two: one operation in a hundred.
            fault_percent: 1,
            ..Abilities::every_mode()
        }
    }

    fn backends(&self) -> Vec<Arc<dyn Backend>> {
        self.backends.clone()
    }

    /// A fast shutdown and a start: every session ends, so every lease is
    /// lost, and tokens keep rising after it (the sequence is the
    /// server's, floored by its clock).
    async fn fault(&self, op: &Op, run: &mut Run) -> Result<(), String> {
        let Op::Wipe { .. } = op else {
            return Err(format!("the restarted PostgreSQL has no fault {op:?}"));
        };
        // Waiters' statements are sent again in whatever order their
        // reconnections take: not a question for this model.
        if run.model.keys.iter().any(|key| !key.queue.is_empty()) {
            return Ok(());
        }
        let stopped = self.server.pg_ctl_stop("fast");
        if !stopped.status.success() {
            return Err(format!("pg_ctl stop failed: {stopped:?}"));
        }
        self.server.pg_ctl_start();
        for k in 0..run.keys.len() {
            run.model.lose(k, false);
        }
        for backend in &run.backends {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while backend.holder(&run.keys[0]).await.is_err() {
                if tokio::time::Instant::now() > deadline {
                    return Err("a backend never answered after the restart".into());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }
}

//! Redis: a server of the run's own (so it may be wiped and restarted),
//! or a Redis Cluster of three masters, and what an operator does to
//! dlock's keys there (see the keyspace table of `dlock::redis`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use dlock::backend::{AcquireRequest, Attempt, OwnerId};
use dlock::redis::RedisBackend;
use dlock::{Backend, LockKey};

use crate::ops::{Abilities, FENCE_VALUES, FOREIGN_VALUES, Mode, Op, PARTS, Part};
use crate::redis_support::{RedisServer, cli, start_cluster};
use crate::reference::Hold;
use crate::run::{Run, Store, TTL};

/// A Redis store: its servers and three backend instances on them.
pub struct Redis {
    servers: Mutex<Vec<RedisServer>>,
    backends: Vec<Arc<dyn Backend>>,
    cluster: bool,
    /// Whether the first and last instances begin fair queues as lists
    /// (`RedisBuilder::list_queues`; the middle one begins strings).
    lists: bool,
}

impl Redis {
    /// A lone server of the run's own.
    pub async fn standalone() -> Self {
        let server = RedisServer::start(&[]);
        let url = server.url();
        Self::on(vec![server], &url, false, false).await
    }

    /// A lone server of the run's own, two of whose instances begin fair
    /// queues as lists and one as strings: a queue is of the kind its
    /// first waiter's instance begins, and every instance serves both.
    pub async fn standalone_with_lists() -> Self {
        let server = RedisServer::start(&[]);
        let url = server.url();
        Self::on(vec![server], &url, false, true).await
    }

    /// A cluster of three masters of the run's own.
    pub async fn cluster() -> Self {
        let servers = start_cluster();
        let url = servers[0].url();
        Self::on(servers, &url, true, false).await
    }

    async fn on(servers: Vec<RedisServer>, url: &str, cluster: bool, lists: bool) -> Self {
        let mut backends: Vec<Arc<dyn Backend>> = Vec::new();
        for instance in 0..3 {
            let mut builder = RedisBackend::builder(url).list_queues(lists && instance != 1);
            if cluster {
                builder = builder.cluster(true);
            }
            let backend = builder.connect().await;
            backends.push(Arc::new(backend.expect("the run's own Redis")));
        }
        Self {
            servers: Mutex::new(servers),
            backends,
            cluster,
            lists,
        }
    }

    /// `redis-cli` on the server that keeps `name` (`-c` follows a
    /// cluster's redirection).
    fn cli(&self, args: &[&str]) -> String {
        let port = self.servers.lock().expect("servers")[0].port.to_string();
        if self.cluster {
            cli(&["-c", "-p", &port], args)
        } else {
            cli(&["-p", &port], args)
        }
    }
}

/// The Redis name of `key`'s record `part` (the run's keys need no
/// escaping).
fn name(key: &LockKey, part: Part) -> String {
    let suffix = match part {
        Part::Lock => "lock",
        Part::Fence => "fence",
        Part::Info => "info",
        Part::Phase => "phase",
        Part::Readers => "readers",
        Part::Slots => "slots",
        Part::Queue => "queue",
    };
    format!("dlock:{{{key}}}:{suffix}")
}

/// Whether `INCR` can raise `value` (Redis's strict integer syntax, below
/// the 64-bit maximum).
fn counts(value: &str) -> bool {
    let digits = value.strip_prefix('-').unwrap_or(value);
    !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'))
        && value.parse::<i64>().is_ok_and(|n| n < i64::MAX)
}

#[async_trait]
impl Store for Redis {
    fn name(&self) -> &'static str {
        match (self.cluster, self.lists) {
            (true, _) => "redis_cluster",
            (false, true) => "redis_lists",
            (false, false) => "redis",
        }
    }

    fn abilities(&self) -> Abilities {
        Abilities {
            handoff_needs_mark: true,
            deletes: PARTS.to_vec(),
            rewind: true,
            foreign: true,
            flush: true,
            restart: !self.cluster,
            ..Abilities::every_mode()
        }
    }

    fn backends(&self) -> Vec<Arc<dyn Backend>> {
        self.backends.clone()
    }

    async fn fault(&self, op: &Op, run: &mut Run) -> Result<(), String> {
        match *op {
            Op::Delete { k, part } => self.delete(run, k, part).await,
            Op::Rewind { k, value } => {
                let value = FENCE_VALUES[value];
                self.cli(&["SET", &name(&run.keys[k], Part::Fence), value]);
                let key = &mut run.model.keys[k];
                key.counter_touched = true;
                key.counter_broken = !counts(value);
                Ok(())
            }
            Op::Foreign { k, value } => {
                let value = FOREIGN_VALUES[value];
                let ttl = TTL.as_millis().to_string();
                self.cli(&["SET", &name(&run.keys[k], Part::Lock), value, "PX", &ttl]);
                run.model.lose(k, true);
                run.foreign.insert(k, value.to_owned());
                Ok(())
            }
            Op::Wipe { restart } => self.wipe(run, restart).await,
            _ => Err(format!("Redis has no fault {op:?}")),
        }
    }

    async fn lock_value(&self, key: &LockKey) -> Option<String> {
        Some(self.cli(&["GET", &name(key, Part::Lock)]))
    }
}

impl Redis {
    /// An operator deletes one of `k`'s records.
    async fn delete(&self, run: &mut Run, k: usize, part: Part) -> Result<(), String> {
        let deleted = self.cli(&["DEL", &name(&run.keys[k], part)]) == "1";
        if !deleted {
            return Ok(());
        }
        let hold = run.model.keys[k].hold.clone();
        match part {
            Part::Lock => {
                run.model.lose(k, false);
                run.settle(k).await
            }
            Part::Fence => {
                let key = &mut run.model.keys[k];
                key.counter_touched = true;
                key.counter_broken = false;
                Ok(())
            }
            Part::Queue => {
                // The order is lost with the queue; the waiters' entries
                // live on, and each joins again, at the end, at its next
                // look: every one of them, in the order they look (here the
                // reverse of their old one), ahead of whoever joins later.
                let waiters = std::mem::take(&mut run.model.keys[k].queue);
                for &o in waiters.iter().rev() {
                    run.acquire(0, k, o, Mode::Join, false).await?;
                }
                Ok(())
            }
            Part::Phase | Part::Readers | Part::Slots => self.lost_members(run, k, &hold).await,
            Part::Info => Ok(()),
        }
    }

    /// A read phase's or the permits' record deleted: the sentinel stands
    /// for holders the store no longer knows. Each of them is told it lost
    /// at its renewal, and nobody joins until the key is broken (or its
    /// sentinel's ttl ends): the run breaks it.
    async fn lost_members(&self, run: &mut Run, k: usize, hold: &Hold) -> Result<(), String> {
        if !matches!(hold, Hold::Shared { .. } | Hold::Permits { .. }) {
            return Ok(());
        }
        for o in run.model.keys[k].holders() {
            let renewed = run.renew(k, o).await?;
            if renewed {
                return Err(format!(
                    "owner {o} renewed its holding after the store lost its record ({hold:?})"
                ));
            }
        }
        let mode = if matches!(hold, Hold::Shared { .. }) {
            Mode::Shared
        } else {
            Mode::Permit
        };
        let owner = OwnerId::random().expect("random bytes");
        let request =
            AcquireRequest::new(&run.keys[k], &owner, TTL).with_access(crate::run::access_of(mode));
        match run.backends[0].try_acquire(&request).await {
            Ok(Attempt::Held { .. }) => {}
            other => {
                return Err(format!(
                    "a {mode:?} attempt beside lost holders answered {other:?}"
                ));
            }
        }
        let broken = run.backends[0].force_release(&run.keys[k]).await;
        if !matches!(broken, Ok(true)) {
            return Err(format!(
                "breaking the key of lost holders answered {broken:?}"
            ));
        }
        run.model.lose(k, false);
        Ok(())
    }

    /// The store loses everything: `FLUSHALL`, or a restart without
    /// persistence. Every backend answers again before the run goes on.
    async fn wipe(&self, run: &mut Run, restart: bool) -> Result<(), String> {
        if restart {
            self.servers.lock().expect("servers")[0].restart();
        } else {
            // Every master of a cluster.
            for server in self.servers.lock().expect("servers").iter() {
                server.cli(&["FLUSHALL"]);
            }
        }
        for k in 0..run.keys.len() {
            run.model.lose(k, false);
            let key = &mut run.model.keys[k];
            key.counter_touched = true;
            key.counter_broken = false;
        }
        run.foreign.clear();
        for backend in &run.backends {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
            while backend.holder(&run.keys[0]).await.is_err() {
                if tokio::time::Instant::now() > deadline {
                    return Err("a backend never answered after the store was wiped".into());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        // The queues went with everything else: each waiter joins again.
        for k in 0..run.keys.len() {
            let waiters = std::mem::take(&mut run.model.keys[k].queue);
            for o in waiters {
                run.acquire(0, k, o, Mode::Join, false).await?;
            }
        }
        Ok(())
    }
}

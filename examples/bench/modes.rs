//! Scenario 9: read-write locks and permits. The shared acquire/release
//! cycle beside the exclusive one (and, where one exists, the same done by
//! hand), and permits contended by more tasks than there are permits,
//! with the backend calls each handoff costs counted.
//!
//! Generic over the backend: a backend that keeps shared locks and
//! permits (`Backend::supports_access`) is one more entry in the report's
//! list.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use dlock::backend::{
    Access, AcquireRequest, Attempt, Handoff, OwnerId, ReleaseNotice, ReleaseOutcome,
    ReleaseRequest, Renewal,
};
use dlock::pg::tokio_postgres::Statement;
use dlock::{Backend, Holding, LockError, LockKey, LockMode, LockOptions};
use tokio::time::Instant;

use crate::cycle::{Row, TTL, pg_client, spawn_all};
use crate::stats::{Measured, median_f64};
use crate::{Config, Res};

/// Permits of the contended key.
pub const PERMITS: u32 = 8;
/// Tasks contending for them.
pub const TASKS: usize = 64;

/// The exclusive and the shared cycle of `backend` (`kind` names it), each
/// task on a key of its own, as in scenario 1.
pub fn cycle_rows(kind: &str, backend: Arc<dyn Backend>, run: &str) -> Vec<Row> {
    [
        (LockMode::Exclusive, "exclusive", "modesx"),
        (LockMode::Shared, "shared", "modess"),
    ]
    .into_iter()
    .map(|(mode, name, tag)| {
        let (backend, run) = (backend.clone(), run.to_owned());
        Row::new(
            format!(
                "dlock {kind}, {name}: LockOptions::mode({mode:?}).acquire_on + Lease::release"
            ),
            move |tasks, deadline| {
                let (backend, run) = (backend.clone(), run.clone());
                async move {
                    spawn_all(tasks, |i| {
                        let backend = backend.clone();
                        let key = LockKey::new(format!("bench:{run}:{tag}:{i}"));
                        async move {
                            let key = key?;
                            let options = LockOptions::new(TTL).mode(mode);
                            crate::cycle::timed!(deadline, {
                                let lease = options.acquire_on(backend.clone(), &key).await?;
                                lease.release().await?;
                            })
                        }
                    })
                    .await
                }
            },
        )
    })
    .collect()
}

/// The rounds of the shared-against-exclusive rows: at least nine, for the
/// paired ratio's median.
pub fn rounds(configured: usize) -> usize {
    if configured <= 1 {
        configured
    } else {
        configured.max(9)
    }
}

/// The cost of the shared row against the exclusive one, paired round by
/// round (each round runs the two back to back): the median of the
/// rounds' exclusive-over-shared throughput ratios, and the lowest and
/// highest.
pub fn paired_cost(exclusive: &Measured, shared: &Measured) -> (f64, f64, f64) {
    let ratios: Vec<f64> = exclusive
        .rates
        .iter()
        .zip(&shared.rates)
        .map(|(x, s)| x / s.max(1e-9))
        .collect();
    let lowest = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let highest = ratios.iter().copied().fold(0.0, f64::max);
    (median_f64(&ratios), lowest, highest)
}

/// `VACUUM`s dlock's PostgreSQL tables (holder records, read phases): with
/// autovacuum off, as on the benchmark's server, every earlier run's
/// upserts leave dead row versions that slow the next run's.
pub async fn vacuum_pg(cfg: &Config) -> Res<()> {
    let client = pg_client(&cfg.pg_conn).await?;
    for table in ["dlock.dlock_holders", "dlock.dlock_phases"] {
        // A table a fresh server does not have yet is nothing to vacuum.
        if let Err(err) = client.batch_execute(&format!("VACUUM {table}")).await {
            eprintln!("VACUUM {table}: {err}");
        }
    }
    Ok(())
}

/// The hand-written PostgreSQL peers: `pg_try_advisory_lock_shared` +
/// `pg_advisory_unlock_shared` (and the exclusive pair beside them, for
/// what the server's own shared lock costs), prepared, on two raw
/// tokio-postgres connections (dlock's default number of lock sessions).
pub async fn pg_hand_rows(cfg: &Config) -> Res<Vec<Row>> {
    let mut sessions: Vec<Arc<(dlock::pg::tokio_postgres::Client, [Statement; 4])>> = Vec::new();
    for _ in 0..2 {
        let client = pg_client(&cfg.pg_conn).await?;
        let statements = [
            client
                .prepare("SELECT pg_try_advisory_lock($1::bigint)")
                .await?,
            client
                .prepare("SELECT pg_advisory_unlock($1::bigint)")
                .await?,
            client
                .prepare("SELECT pg_try_advisory_lock_shared($1::bigint)")
                .await?,
            client
                .prepare("SELECT pg_advisory_unlock_shared($1::bigint)")
                .await?,
        ];
        sessions.push(Arc::new((client, statements)));
    }
    let sessions = Arc::new(sessions);
    // Apart from scenario 1's advisory keys.
    let seed = cfg.run_seed.wrapping_add(1 << 20);
    let rows = [
        (
            0,
            "hand-written pg_try_advisory_lock + pg_advisory_unlock (no token, no ttl)",
        ),
        (
            2,
            "hand-written pg_try_advisory_lock_shared + pg_advisory_unlock_shared (no token, no ttl, no writer preference)",
        ),
    ];
    Ok(rows
        .into_iter()
        .map(|(first, name)| {
            let sessions = sessions.clone();
            Row::new(name, move |tasks, deadline| {
                let sessions = sessions.clone();
                async move {
                    spawn_all(tasks, |i| {
                        let session = sessions[i % sessions.len()].clone();
                        let advisory = seed.wrapping_add(i as i64);
                        async move {
                            let (client, statements) = &*session;
                            let (lock, unlock) = (&statements[first], &statements[first + 1]);
                            crate::cycle::timed!(deadline, {
                                let row = client.query_one(lock, &[&advisory]).await?;
                                if !row.try_get::<_, bool>(0)? {
                                    return Err("pg hand-written: held".into());
                                }
                                client.query_one(unlock, &[&advisory]).await?;
                            })
                        }
                    })
                    .await
                }
            })
        })
        .collect())
}

/// The calls a backend received, by kind.
#[derive(Debug, Default)]
pub struct Calls {
    /// `try_acquire`.
    pub attempts: AtomicU64,
    /// Attempts answered with a grant.
    pub granted: AtomicU64,
    /// Attempts the backend answered in process, behind waiters of this
    /// process (`Attempt::Behind`): no round trip.
    pub behind: AtomicU64,
    /// `release`.
    pub releases: AtomicU64,
    /// `extend` and `extend_many` (one call each).
    pub renewals: AtomicU64,
    /// `subscribe` (in process on PostgreSQL; a pub/sub subscription on
    /// Redis, shared per backend).
    pub subscribes: AtomicU64,
    /// Everything else (holder, force_release, ...), which the contended
    /// loop should never send.
    pub other: AtomicU64,
}

impl Calls {
    fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// The calls that each go to the server as (at least) one round trip:
    /// attempts that asked the store, releases and renewals.
    pub fn round_trips(&self) -> u64 {
        Self::get(&self.attempts) - Self::get(&self.behind)
            + Self::get(&self.releases)
            + Self::get(&self.renewals)
    }
}

/// A backend that counts the calls it passes on (the idea of the
/// conformance suite's `CountingBackend`).
pub struct Counting {
    inner: Arc<dyn Backend>,
    /// What it counted.
    pub calls: Calls,
}

impl Counting {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            calls: Calls::default(),
        })
    }

    fn count(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

#[async_trait]
impl Backend for Counting {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        Self::count(&self.calls.attempts);
        let answer = self.inner.try_acquire(request).await;
        match answer {
            Ok(Attempt::Acquired(_)) => Self::count(&self.calls.granted),
            Ok(Attempt::Behind { .. }) => Self::count(&self.calls.behind),
            _ => {}
        }
        answer
    }
    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        Self::count(&self.calls.renewals);
        self.inner.extend(renewal).await
    }
    async fn extend_many(&self, renewals: &[Renewal<'_>]) -> Vec<Result<bool, LockError>> {
        Self::count(&self.calls.renewals);
        self.inner.extend_many(renewals).await
    }
    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
        Self::count(&self.calls.releases);
        self.inner.release(lease).await
    }
    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        Self::count(&self.calls.subscribes);
        self.inner.subscribe(key).await
    }
    fn expiry_slack(&self) -> Duration {
        self.inner.expiry_slack()
    }
    fn supports_fair(&self) -> bool {
        self.inner.supports_fair()
    }
    fn supports_access(&self, access: Access) -> bool {
        self.inner.supports_access(access)
    }
    fn queued_here(&self, key: &LockKey) -> bool {
        self.inner.queued_here(key)
    }
    async fn subscribe_handoff(
        &self,
        key: &LockKey,
        owner: &OwnerId,
    ) -> Result<Handoff, LockError> {
        Self::count(&self.calls.other);
        self.inner.subscribe_handoff(key, owner).await
    }
    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        Self::count(&self.calls.other);
        self.inner.force_release(key).await
    }
    async fn holder(&self, key: &LockKey) -> Result<Option<Holding>, LockError> {
        Self::count(&self.calls.other);
        self.inner.holder(key).await
    }
    async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        Self::count(&self.calls.other);
        self.inner.watch_holder(key).await
    }
    async fn held(&self, prefix: &str) -> Result<Vec<(String, Holding)>, LockError> {
        Self::count(&self.calls.other);
        self.inner.held(prefix).await
    }
}

/// What the contended permits did.
#[derive(Debug, Default)]
pub struct PermitOutcome {
    /// Acquisitions per second, by anyone.
    pub turns_per_s: f64,
    /// Acquisitions per second of a slot whose previous holder was
    /// another task: a permit handed over.
    pub handoffs_per_s: f64,
    /// Handoffs counted (see [`PermitOutcome::handoffs_per_s`]).
    pub handoffs: u64,
    /// How many of the tasks ever held a permit.
    pub tasks_served: usize,
    /// Backend calls, by kind, over the run.
    pub attempts: u64,
    /// Attempts refused (the key's permits all held).
    pub refused: u64,
    /// Of those, the ones answered in process (`Attempt::Behind`).
    pub behind: u64,
    /// Releases.
    pub releases: u64,
    /// Renewals (none expected at a 30 s ttl over seconds).
    pub renewals: u64,
    /// Scripts the server ran over the run, where it was counted there
    /// (Redis, on a server of the benchmark's own): round trips as the
    /// server saw them, where attempts answered in process are not.
    pub server_round_trips: Option<u64>,
    /// Subscriptions (a waiter's "tell me of a release").
    pub subscribes: u64,
    /// Any other call.
    pub other: u64,
    /// Attempts that asked the store + releases + renewals.
    pub round_trips: u64,
}

/// What the permit contenders write down as they acquire.
#[derive(Default)]
struct PermitBook {
    /// Per slot, the task that held it last.
    last_holder: HashMap<u32, usize>,
    turns: u64,
    handoffs: u64,
    /// Per task, its turns.
    per_task: Vec<u64>,
}

/// `TASKS` tasks of one process loop on one key with `PERMITS` permits:
/// acquire (waiting), no work, release, for `time`, through a counting
/// wrapper around `backend`.
pub async fn permits(backend: Arc<dyn Backend>, key: &str, time: Duration) -> Res<PermitOutcome> {
    let counting = Counting::new(backend);
    let key = LockKey::new(key)?;
    let book = Arc::new(Mutex::new(PermitBook {
        per_task: vec![0; TASKS],
        ..PermitBook::default()
    }));
    let started = Instant::now();
    let deadline = started + time;
    let handles: Vec<_> = (0..TASKS)
        .map(|i| {
            let (backend, key, book) = (
                counting.clone() as Arc<dyn Backend>,
                key.clone(),
                book.clone(),
            );
            tokio::spawn(async move {
                let options = LockOptions::new(TTL)
                    .permits(PERMITS)
                    .wait(Duration::from_secs(60));
                while Instant::now() < deadline {
                    let lease = options.acquire_on(backend.clone(), &key).await?;
                    let slot = lease.slot().ok_or("a permit lease without a slot")?;
                    {
                        let mut book = book.lock().unwrap_or_else(PoisonError::into_inner);
                        let previous = book.last_holder.insert(slot, i);
                        book.turns += 1;
                        if previous.is_some_and(|p| p != i) {
                            book.handoffs += 1;
                        }
                        book.per_task[i] += 1;
                    }
                    lease.release().await?;
                }
                Res::Ok(())
            })
        })
        .collect();
    for handle in handles {
        handle.await??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let book = book.lock().unwrap_or_else(PoisonError::into_inner);
    let calls = &counting.calls;
    let attempts = Calls::get(&calls.attempts);
    Ok(PermitOutcome {
        turns_per_s: book.turns as f64 / elapsed,
        handoffs_per_s: book.handoffs as f64 / elapsed,
        handoffs: book.handoffs,
        tasks_served: book.per_task.iter().filter(|&&n| n > 0).count(),
        attempts,
        refused: attempts - Calls::get(&calls.granted),
        behind: Calls::get(&calls.behind),
        releases: Calls::get(&calls.releases),
        renewals: Calls::get(&calls.renewals),
        subscribes: Calls::get(&calls.subscribes),
        other: Calls::get(&calls.other),
        round_trips: calls.round_trips(),
        server_round_trips: None,
    })
}

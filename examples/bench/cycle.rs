//! Scenario 1: the uncontended cycle (acquire + release of a key no one
//! else wants), for dlock and for what a user would write instead.

use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use dlock::pg::tokio_postgres::{self, NoTls, Statement};
use dlock::{Backend, LockKey, LockOptions};
use redis::Script;
use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

use crate::document::Section;
use crate::pg_cpu::ServerCpu;
use crate::plots;
use crate::stats::Measured;
use crate::{Config, Res};

/// The ttl every cycle asks for.
pub const TTL: Duration = Duration::from_secs(30);

type Round = Pin<Box<dyn Future<Output = Res<Vec<Duration>>> + Send>>;

/// One way of locking, run at a given concurrency for a given time.
pub struct Row {
    /// What the row measures.
    pub name: String,
    /// Runs `tasks` tasks until the deadline; every cycle's latency.
    run: Box<dyn Fn(usize, Instant) -> Round + Send + Sync>,
    /// The PostgreSQL server processes serving the row, whose CPU time
    /// each round reads.
    server: Option<ServerCpu>,
}

impl Row {
    /// A row named `name` whose rounds `make` runs.
    pub fn new<F, Fut>(name: impl Into<String>, make: F) -> Self
    where
        F: Fn(usize, Instant) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Res<Vec<Duration>>> + Send + 'static,
    {
        Self {
            name: name.into(),
            run: Box::new(move |tasks, deadline| Box::pin(make(tasks, deadline))),
            server: None,
        }
    }

    /// The row, its rounds reading the CPU time of `server`'s processes.
    pub fn serving(self, server: ServerCpu) -> Self {
        Self {
            server: Some(server),
            ..self
        }
    }
}

/// Runs `tasks` copies of `task` and gathers their samples.
pub async fn spawn_all<F, Fut>(tasks: usize, task: F) -> Res<Vec<Duration>>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Res<Vec<Duration>>> + Send + 'static,
{
    let handles: Vec<_> = (0..tasks).map(|i| tokio::spawn(task(i))).collect();
    let mut all = Vec::new();
    for handle in handles {
        all.extend(handle.await??);
    }
    Ok(all)
}

/// Times `body` in a loop until `deadline`.
macro_rules! timed {
    ($deadline:expr, $body:block) => {{
        let mut samples = Vec::with_capacity(4096);
        while Instant::now() < $deadline {
            let started = Instant::now();
            $body
            samples.push(started.elapsed());
        }
        Ok::<_, $crate::BoxError>(samples)
    }};
}
pub(crate) use timed;

/// The dlock row of a backend: `LockOptions::acquire_on` + `Lease::release`
/// of keys `bench:<run>:<tag>:<task>`.
pub fn dlock_row(kind: &str, backend: Arc<dyn Backend>, run: &str, tag: &'static str) -> Row {
    let run = run.to_owned();
    Row::new(
        format!("dlock {kind}: LockOptions::acquire_on + Lease::release"),
        move |tasks, deadline| {
            let (backend, run) = (backend.clone(), run.clone());
            async move {
                spawn_all(tasks, |i| {
                    let backend = backend.clone();
                    let key = LockKey::new(format!("bench:{run}:{tag}:{i}"));
                    async move {
                        let key = key?;
                        let options = LockOptions::new(TTL);
                        timed!(deadline, {
                            let lease = options.acquire_on(backend.clone(), &key).await?;
                            lease.release().await?;
                        })
                    }
                })
                .await
            }
        },
    )
}

/// Runs every row at every concurrency: `rounds` interleaved rounds of
/// `round` each, after a short warm-up. Returns, per row and concurrency,
/// the measurement, with the server's CPU time where the row reads it.
pub async fn measure(
    rows: &[Row],
    concurrency: &[usize],
    rounds: usize,
    round: Duration,
) -> Res<Vec<Vec<Measured>>> {
    let mut results = vec![vec![Measured::default(); concurrency.len()]; rows.len()];
    for row in rows {
        for &tasks in concurrency {
            (row.run)(tasks, Instant::now() + round / 4).await?;
        }
    }
    for _ in 0..rounds {
        for (r, row) in rows.iter().enumerate() {
            for (c, &tasks) in concurrency.iter().enumerate() {
                let server = match &row.server {
                    Some(server) => server.snapshot().await?,
                    None => None,
                };
                let started = Instant::now();
                let samples = (row.run)(tasks, started + round).await?;
                let elapsed = started.elapsed();
                let ops = samples.len() as u64;
                if let Some(cpu) = server.and_then(|s| s.elapsed()) {
                    results[r][c].add_server(cpu, ops);
                }
                results[r][c].add_round(samples, ops, elapsed);
            }
        }
    }
    Ok(results)
}

/// A 32-hex-digit owner id, as dlock writes them, made without a syscall.
pub fn owner_hex(task: usize, n: u64) -> String {
    format!("{:016x}{n:016x}", task as u64)
}

/// The Redis rows: the floor (dlock's own two scripts sent by hand over one
/// multiplexed connection), dlock, rslock, and a bare SET NX PX + DEL.
pub async fn redis_rows(cfg: &Config) -> Res<Vec<Row>> {
    let client = redis::Client::open(cfg.redis_url.as_str())?;
    let conn = client.get_multiplexed_async_connection().await?;
    let acquire = Arc::new(Script::new(dlock::redis::protocol::ACQUIRE_LUA));
    let release = Arc::new(Script::new(dlock::redis::protocol::RELEASE_LUA));
    let run = cfg.run.clone();

    let floor = {
        let (conn, run) = (conn.clone(), run.clone());
        Row::new(
            "floor: dlock's acquire + release scripts by hand (EVALSHA ×2, raw redis-rs)",
            move |tasks, deadline| {
                let (conn, run, acquire, release) =
                    (conn.clone(), run.clone(), acquire.clone(), release.clone());
                async move {
                    spawn_all(tasks, |i| {
                        let (mut conn, acquire, release) =
                            (conn.clone(), acquire.clone(), release.clone());
                        let tag = format!("bench:{run}:floor:{i}");
                        async move {
                            let mut n = 0u64;
                            timed!(deadline, {
                                n += 1;
                                floor_cycle(&mut conn, &acquire, &release, &tag, &owner_hex(i, n))
                                    .await?;
                            })
                        }
                    })
                    .await
                }
            },
        )
    };

    let backend: Arc<dyn Backend> =
        Arc::new(dlock::redis::RedisBackend::connect(&cfg.redis_url).await?);
    let dlock_row = dlock_row("RedisBackend", backend, &run, "dlock");

    let manager = rslock::LockManager::new(vec![cfg.redis_url.clone()]);
    let rslock_row = {
        let run = run.clone();
        Row::new(
            "rslock 0.10: lock + unlock (SET NX PX, EVAL unlock script; no token)",
            move |tasks, deadline| {
                let (manager, run) = (manager.clone(), run.clone());
                async move {
                    spawn_all(tasks, |i| {
                        let manager = manager.clone();
                        let key = format!("bench:{run}:rslock:{i}");
                        async move {
                            timed!(deadline, {
                                let lock = manager
                                    .lock(key.as_bytes(), TTL)
                                    .await
                                    .map_err(|e| format!("rslock: {e}"))?;
                                manager.unlock(&lock).await;
                            })
                        }
                    })
                    .await
                }
            },
        )
    };

    let bare = {
        let (conn, run) = (conn.clone(), run.clone());
        Row::new(
            "bare SET NX PX + DEL (no owner check, no token; context)",
            move |tasks, deadline| {
                let (conn, run) = (conn.clone(), run.clone());
                async move {
                    spawn_all(tasks, |i| {
                        let mut conn = conn.clone();
                        let key = format!("bench:{run}:bare:{i}");
                        async move {
                            let mut n = 0u64;
                            timed!(deadline, {
                                n += 1;
                                bare_cycle(&mut conn, &key, &owner_hex(i, n)).await?;
                            })
                        }
                    })
                    .await
                }
            },
        )
    };
    Ok(vec![floor, dlock_row, rslock_row, bare])
}

/// The holder record dlock's acquisitions write into the lock's value:
/// this process's host and pid, no label (the bench sets none).
static HOLDER_RECORD: LazyLock<String> =
    LazyLock::new(|| dlock::HolderInfo::this_process(None).encode());

/// One cycle of the Redis floor: dlock's acquire and release scripts sent
/// by hand on the keys dlock would use for `tag`, with the arguments dlock
/// sends (the holder record too).
pub async fn floor_cycle(
    conn: &mut MultiplexedConnection,
    acquire: &Script,
    release: &Script,
    tag: &str,
    owner: &str,
) -> Res<()> {
    let (lock, fence) = (
        format!("dlock:{{{tag}}}:lock"),
        format!("dlock:{{{tag}}}:fence"),
    );
    // The protocol's value: the owner id and the "nobody waits" mark.
    let value = format!("{owner}-");
    // The token as text when taken, the holder's remaining ttl if held.
    let got: redis::Value = acquire
        .key(&lock)
        .key(&fence)
        .arg(&value)
        .arg(TTL.as_millis() as u64)
        .arg(HOLDER_RECORD.as_str())
        .invoke_async(conn)
        .await?;
    if !matches!(&got, redis::Value::BulkString(token) if !token.is_empty()) {
        return Err(format!("floor: {lock} was held: {got:?}").into());
    }
    let released: i64 = release.key(&lock).arg(&value).invoke_async(conn).await?;
    if released != 1 {
        return Err(format!("floor: {lock} was not ours").into());
    }
    Ok(())
}

/// One bare cycle: `SET NX PX` + `DEL`, no owner check, no token.
pub async fn bare_cycle(conn: &mut MultiplexedConnection, key: &str, owner: &str) -> Res<()> {
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(owner)
        .arg("NX")
        .arg("PX")
        .arg(TTL.as_millis() as u64)
        .query_async(conn)
        .await?;
    if set.is_none() {
        return Err(format!("bare: {key} was held").into());
    }
    let _: i64 = redis::cmd("DEL").arg(key).query_async(conn).await?;
    Ok(())
}

/// A plain client connection driven in its own task.
pub async fn pg_client(conn: &str) -> Res<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(conn, NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// A raw connection and the hand-written rows' statements, prepared.
struct RawSession {
    client: tokio_postgres::Client,
    /// `pg_try_advisory_lock` alone: the hand-written pair's lock.
    try_lock: Statement,
    /// `pg_try_advisory_lock` and, only if it was taken, `nextval` of
    /// dlock's token sequence, in one statement: the floor's lock.
    try_lock_token: Statement,
    /// `pg_advisory_unlock`: both rows' unlock.
    unlock: Statement,
}

/// The PostgreSQL rows: the floor (the least a fenced advisory lock
/// sends), dlock by default and without holder records, and the
/// hand-written pair users compare against. Every row spreads its cycles
/// over two connections in turn, as dlock spreads its acquisitions over
/// its lock sessions, and reads its server processes' CPU time.
pub async fn pg_rows(cfg: &Config) -> Res<Vec<Row>> {
    // Dead row versions of earlier runs' holder records would slow the
    // recording row (autovacuum is off on the benchmark's server).
    crate::modes::vacuum_pg(cfg).await?;
    let admin = Arc::new(pg_client(&cfg.pg_conn).await?);
    let cpu =
        |what: &str| ServerCpu::new(admin.clone(), &format!("dlock-bench-{}-{what}", cfg.run));
    let (recorded_cpu, plain_cpu, raw_cpu) = (cpu("recorded"), cpu("plain"), cpu("raw"));

    let backend: Arc<dyn Backend> =
        Arc::new(dlock::pg::PgBackend::connect(&recorded_cpu.conn(&cfg.pg_conn)).await?);
    // The first acquisition creates dlock's token sequence, which the
    // floor's statement names: one comes first, so a fresh database
    // prepares it.
    let key = LockKey::new(format!("bench:{}:pg-setup", cfg.run))?;
    LockOptions::new(TTL)
        .acquire_on(backend.clone(), &key)
        .await?
        .release()
        .await?;
    let recorded = dlock_row(
        "PgBackend, default (holder named)",
        backend,
        &cfg.run,
        "pgdlock",
    )
    .serving(recorded_cpu);
    let unrecorded = dlock::pg::PgBackend::connect_with(
        &plain_cpu.conn(&cfg.pg_conn),
        dlock::pg::PgOptions::default().record_holders(false),
    )
    .await?;
    let unrecorded = dlock_row(
        "PgBackend, record_holders(false)",
        Arc::new(unrecorded),
        &cfg.run,
        "pgplain",
    )
    .serving(plain_cpu);

    let sessions = 2; // PgOptions' default, which `connect` uses.
    let mut raw = Vec::new();
    for _ in 0..sessions {
        let client = pg_client(&raw_cpu.conn(&cfg.pg_conn)).await?;
        // What dlock's lock statement sets for its own transaction: the
        // sequence's WAL record (every 32 values) is not waited for. Set
        // once here, so the floor pays nothing per cycle for it.
        client
            .batch_execute("SET synchronous_commit TO off")
            .await?;
        raw.push(RawSession {
            try_lock: client
                .prepare("SELECT pg_try_advisory_lock($1::bigint)")
                .await?,
            try_lock_token: client
                .prepare(
                    "SELECT CASE WHEN pg_try_advisory_lock($1::bigint) \
                     THEN nextval('dlock.dlock_token_seq') END",
                )
                .await?,
            unlock: client
                .prepare("SELECT pg_advisory_unlock($1::bigint)")
                .await?,
            client,
        });
    }
    let raw = Arc::new(raw);
    let floor = raw_row(
        format!(
            "floor: pg_try_advisory_lock + nextval in one statement, pg_advisory_unlock (prepared, {sessions} connections in turn, raw tokio-postgres)"
        ),
        raw.clone(),
        cfg.run_seed,
        true,
    )
    .serving(raw_cpu.clone());
    let pair = raw_row(
        "hand-written pg_try_advisory_lock + pg_advisory_unlock (no token, no ttl)".into(),
        raw,
        cfg.run_seed,
        false,
    )
    .serving(raw_cpu);
    Ok(vec![floor, recorded, unrecorded, pair])
}

/// Scenario 1's PostgreSQL rows (floor, dlock by default, dlock with
/// `record_holders(false)`, the hand-written pair) against the pair, with
/// the server CPU per cycle of each, at each of `concurrency`'s task
/// counts (1 first, 64 last), and the targets judged on them.
pub fn pg_against_pair(
    s: &mut Section,
    rows: &[Row],
    concurrency: &[usize],
    results: &[Vec<Measured>],
) {
    let [_, recorded, unrecorded, pair] = results else {
        return;
    };
    let (one, many) = (0, concurrency.len() - 1);
    let _ = writeln!(
        s.body,
        "\nThe PostgreSQL rows against the hand-written pair, with the server CPU per cycle: the CPU time of the server processes serving the row's connections, over all rounds (see *What each row does*).\n\n| implementation | tasks | throughput vs pair | median latency vs pair | server CPU per cycle | server CPU vs pair |\n| --- | ---: | ---: | ---: | ---: | ---: |"
    );
    for (row, per_tasks) in rows.iter().zip(results) {
        for (c, m) in per_tasks.iter().enumerate() {
            let base = &pair[c];
            let cpu = m.server_per_op();
            let cpu_ratio = cpu
                .zip(base.server_per_op())
                .map_or("?".into(), |(cpu, base)| {
                    format!("{:.2}", cpu.as_secs_f64() / base.as_secs_f64())
                });
            let _ = writeln!(
                s.body,
                "| {} | {} | {:.2} | {:.2} | {} | {cpu_ratio} |",
                plots::short(&row.name),
                concurrency[c],
                m.rate() / base.rate(),
                m.median().as_secs_f64() / base.median().as_secs_f64(),
                cpu.map_or("? (server not local)".into(), |cpu| format!(
                    "{:.1} µs",
                    cpu.as_secs_f64() * 1e6
                )),
            );
        }
    }
    let throughput = recorded[many].rate() / pair[many].rate();
    s.target(
        "PostgreSQL uncontended cycle, 64 tasks: default dlock >= 0.5 x the hand-written pair",
        format!("{throughput:.2} x"),
        throughput >= 0.5,
    );
    let latency = recorded[one].median().as_secs_f64() / pair[one].median().as_secs_f64();
    s.target(
        "PostgreSQL uncontended cycle, 1 task: default dlock's median latency <= 1.3 x the hand-written pair's",
        format!("{latency:.2} x"),
        latency <= 1.3,
    );
    let cost = 1.0 - recorded[many].rate() / unrecorded[many].rate();
    s.target(
        "PostgreSQL uncontended cycle, 64 tasks: naming the holder costs <= 10 % of record_holders(false)'s throughput",
        format!("{:.0} %", cost * 100.0),
        cost <= 0.10,
    );
}

/// A hand-written row: task `i` locks and unlocks advisory key `seed + i`,
/// each cycle on the next session in turn; `token` draws a token with the
/// lock.
fn raw_row(name: String, sessions: Arc<Vec<RawSession>>, seed: i64, token: bool) -> Row {
    Row::new(name, move |tasks, deadline| {
        let sessions = sessions.clone();
        let turns = Arc::new(AtomicUsize::new(0));
        async move {
            spawn_all(tasks, |i| {
                let (sessions, turns) = (sessions.clone(), turns.clone());
                let advisory = seed.wrapping_add(i as i64);
                async move {
                    timed!(deadline, {
                        let turn = turns.fetch_add(1, Ordering::Relaxed);
                        let session = &sessions[turn % sessions.len()];
                        let taken = if token {
                            let row = session
                                .client
                                .query_one(&session.try_lock_token, &[&advisory])
                                .await?;
                            row.try_get::<_, Option<i64>>(0)?.is_some()
                        } else {
                            let row = session
                                .client
                                .query_one(&session.try_lock, &[&advisory])
                                .await?;
                            row.try_get::<_, bool>(0)?
                        };
                        if !taken {
                            return Err(format!("pg: advisory key {advisory} was held").into());
                        }
                        let row = session
                            .client
                            .query_one(&session.unlock, &[&advisory])
                            .await?;
                        if !row.try_get::<_, bool>(0)? {
                            return Err(format!("pg: advisory key {advisory} was not held").into());
                        }
                    })
                }
            })
            .await
        }
    })
}

//! Scenario 1: the uncontended cycle (acquire + release of a key no one
//! else wants), for dlock and for what a user would write instead.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use dlock::pg::tokio_postgres::{self, NoTls, Statement};
use dlock::{Backend, LockKey, LockOptions};
use redis::Script;
use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

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
/// the measurement.
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
                let started = Instant::now();
                let samples = (row.run)(tasks, started + round).await?;
                let elapsed = started.elapsed();
                let ops = samples.len() as u64;
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

/// A raw connection with the statements the PostgreSQL rows send: dlock's
/// lock (the one that records the holder, as every dlock acquisition does
/// by default), its plain unlock and its batch delete of released records,
/// and the hand-written pair; when the session started, which dlock's lock
/// statement records; and the records released and not yet deleted.
type PgSession = (
    tokio_postgres::Client,
    Statement,
    Statement,
    Statement,
    Statement,
    std::time::SystemTime,
    Statement,
    std::sync::Mutex<(Vec<i64>, Vec<i64>)>,
);

/// How many released records a session deletes at once, as dlock does.
const RELEASED_BATCH: usize = 64;

/// A plain client connection driven in its own task.
pub async fn pg_client(conn: &str) -> Res<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(conn, NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// The PostgreSQL rows: the floor (dlock's own two statements sent by hand
/// on as many connections as dlock has lock sessions), dlock, and a
/// hand-written `pg_try_advisory_lock`/`pg_advisory_unlock` pair.
pub async fn pg_rows(cfg: &Config) -> Res<Vec<Row>> {
    let backend: Arc<dyn Backend> = Arc::new(dlock::pg::PgBackend::connect(&cfg.pg_conn).await?);
    // The first acquisition that records a holder creates its table, which
    // the floor's statements name: one comes first, so a fresh database
    // prepares them.
    let key = LockKey::new(format!("bench:{}:pg-setup", cfg.run))?;
    LockOptions::new(TTL)
        .acquire_on(backend.clone(), &key)
        .await?
        .release()
        .await?;
    let sessions = 2; // PgOptions' default, which `connect` uses.
    let mut clients = Vec::new();
    for _ in 0..sessions {
        let client = pg_client(&cfg.pg_conn).await?;
        let schema = |sql: &str| sql.replace("{schema}", "\"dlock\"");
        let try_lock = client
            .prepare(&schema(dlock::pg::protocol::TRY_LOCK_RECORDING))
            .await?;
        let unlock = client.prepare(dlock::pg::protocol::UNLOCK_GATED).await?;
        let delete_released = client
            .prepare(&schema(dlock::pg::protocol::DELETE_RELEASED))
            .await?;
        let started = client
            .query_one(
                "SELECT backend_start FROM pg_stat_get_activity(pg_backend_pid())",
                &[],
            )
            .await?
            .try_get(0)?;
        let pair_lock = client
            .prepare("SELECT pg_try_advisory_lock($1::bigint)")
            .await?;
        let pair_unlock = client
            .prepare("SELECT pg_advisory_unlock($1::bigint)")
            .await?;
        clients.push(Arc::new((
            client,
            try_lock,
            unlock,
            pair_lock,
            pair_unlock,
            started,
            delete_released,
            std::sync::Mutex::default(),
        )));
    }
    let clients: Arc<Vec<Arc<PgSession>>> = Arc::new(clients);
    let run = cfg.run.clone();

    // What dlock records beside each lock: this process's host and pid,
    // no label (the benchmark sets none).
    let holder: Arc<str> = dlock::HolderInfo::this_process(None).encode().into();
    let floor = {
        let (clients, run) = (clients.clone(), run.clone());
        Row::new(
            format!(
                "floor: dlock's lock + unlock statements by hand (holder recorded, released records deleted per 64; prepared, {sessions} connections, raw tokio-postgres)"
            ),
            move |tasks, deadline| {
                let (clients, run, holder) = (clients.clone(), run.clone(), holder.clone());
                async move {
                    spawn_all(tasks, |i| {
                        let session = clients[i % clients.len()].clone();
                        let key = format!("bench:{run}:pgfloor:{i}");
                        let holder = holder.clone();
                        async move {
                            let (client, try_lock, unlock, _, _, started, delete, released) =
                                &*session;
                            let identity: Option<&str> = None;
                            // What dlock passes for a key it has locked on
                            // the session before and that no lease of it
                            // holds there: not held already.
                            let already = Some(false);
                            timed!(deadline, {
                                let row = client
                                    .query_one(
                                        try_lock,
                                        &[
                                            &key.as_str(),
                                            &0i64,
                                            &identity,
                                            started,
                                            &&*holder,
                                            &already,
                                        ],
                                    )
                                    .await?;
                                let (advisory, token): (i64, Option<i64>) =
                                    (row.try_get(0)?, row.try_get(1)?);
                                let Some(token) = token else {
                                    return Err(format!("pg floor: {key} was held").into());
                                };
                                client.query_one(unlock, &[&advisory]).await?;
                                let batch = {
                                    let mut left = released
                                        .lock()
                                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                                    left.0.push(advisory);
                                    left.1.push(token);
                                    (left.0.len() >= RELEASED_BATCH)
                                        .then(|| std::mem::take(&mut *left))
                                };
                                if let Some((ids, tokens)) = batch {
                                    client.query_one(delete, &[&ids, &tokens, started]).await?;
                                }
                            })
                        }
                    })
                    .await
                }
            },
        )
    };

    let recorded_row = dlock_row("PgBackend", backend, &run, "pgdlock");
    // The same without holder records: what recording costs.
    let unrecorded = dlock::pg::PgBackend::connect_with(
        &cfg.pg_conn,
        dlock::pg::PgOptions::default().record_holders(false),
    )
    .await?;
    let unrecorded_row = dlock_row(
        "PgBackend, record_holders(false)",
        Arc::new(unrecorded),
        &run,
        "pgplain",
    );

    let seed = cfg.run_seed;
    let pair = Row::new(
        "hand-written pg_try_advisory_lock + pg_advisory_unlock (no token, no ttl)",
        move |tasks, deadline| {
            let clients = clients.clone();
            async move {
                spawn_all(tasks, |i| {
                    let session = clients[i % clients.len()].clone();
                    let advisory = seed.wrapping_add(i as i64);
                    async move {
                        let (client, _, _, lock, unlock, ..) = &*session;
                        timed!(deadline, {
                            let row = client.query_one(lock, &[&advisory]).await?;
                            if !row.try_get::<_, bool>(0)? {
                                return Err("pg pair: held".into());
                            }
                            client.query_one(unlock, &[&advisory]).await?;
                        })
                    }
                })
                .await
            }
        },
    );
    Ok(vec![floor, recorded_row, unrecorded_row, pair])
}

//! What `PgBackend` costs the client over the bare protocol: 64 tasks run
//! the uncontended acquire + release cycle in alternating rounds, through
//! dlock (`record_holders(false)`) and through dlock's own statements for
//! it sent by hand on two raw tokio-postgres connections, and the program
//! prints the process's CPU time per cycle for each, and the median ratio
//! of their throughputs over the pairs of rounds.
//!
//! ```sh
//! cargo run --release --example pg_overhead             # 127.0.0.1:5432
//! cargo run --release --example pg_overhead -- 8        # 8 tasks instead of 64
//! DLOCK_PG_URL=postgresql://... cargo run --release --example pg_overhead
//! ```
//!
//! CPU time is read from `/proc/self/stat` (Linux). It measures and prints;
//! it asserts nothing about time.

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::protocol::{TRY_LOCK, TRY_LOCK_QUICK, UNLOCK};
use dlock::pg::tokio_postgres::types::ToSql;
use dlock::pg::tokio_postgres::{self, NoTls, Statement};
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, LockKey, LockOptions};
use tokio::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const DEFAULT_TASKS: usize = 64;
const ROUND: Duration = Duration::from_millis(700);
const PAIRS: usize = 12;

/// A raw connection with dlock's lock and unlock statements prepared.
struct Raw {
    client: tokio_postgres::Client,
    lock: Statement,
    quick: Statement,
    unlock: Statement,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Res<()> {
    let conn = std::env::var("DLOCK_PG_URL").unwrap_or_else(|_| {
        "host=127.0.0.1 port=5432 user=postgres dbname=test sslmode=disable".to_owned()
    });
    let tasks = match std::env::args().nth(1) {
        Some(arg) => arg.parse()?,
        None => DEFAULT_TASKS,
    };
    // The plain statements, which the raw connections send too.
    let options = PgOptions::new().record_holders(false);
    let backend: Arc<dyn Backend> = Arc::new(PgBackend::connect_with(&conn, options).await?);
    // As many raw connections as dlock has lock sessions by default, with
    // the commit dlock's sessions set.
    let mut raw = Vec::new();
    for _ in 0..2 {
        let (client, connection) = tokio_postgres::connect(&conn, NoTls).await?;
        tokio::spawn(connection);
        client.batch_execute("SET synchronous_commit = off").await?;
        let schema = |sql: &str| sql.replace("{schema}", "\"dlock\"");
        let lock = client.prepare(&schema(TRY_LOCK)).await?;
        let quick = client.prepare(&schema(TRY_LOCK_QUICK)).await?;
        let unlock = client.prepare(UNLOCK).await?;
        raw.push(Arc::new(Raw {
            client,
            lock,
            quick,
            unlock,
        }));
    }
    let prefix = format!("pg-overhead:{}", std::process::id());
    round(tasks, false, &backend, &raw, &prefix).await?; // warm-up
    let (mut cpu, mut cycles) = ([0.0f64; 2], [0u64; 2]);
    let mut ratios = Vec::new();
    let mut rate_samples = [Vec::new(), Vec::new()];
    for pair in 0..PAIRS {
        let mut rates = [0.0f64; 2];
        // Which goes first alternates, so neither always follows the other.
        for floor in [pair % 2 == 0, pair % 2 == 1] {
            let side = usize::from(floor);
            let before = cpu_seconds()?;
            let done = round(tasks, floor, &backend, &raw, &prefix).await?;
            cpu[side] += cpu_seconds()? - before;
            cycles[side] += done;
            rates[side] = done as f64 / ROUND.as_secs_f64();
            rate_samples[side].push(rates[side]);
        }
        ratios.push(rates[0] / rates[1]);
    }
    ratios.sort_by(f64::total_cmp);
    for samples in &mut rate_samples {
        samples.sort_by(f64::total_cmp);
    }
    let median_rate = |side: usize| rate_samples[side][rate_samples[side].len() / 2];
    let per_cycle = |side: usize| cpu[side] / cycles[side] as f64 * 1e6;
    println!(
        "{tasks} tasks, {PAIRS} pairs of {ROUND:?} rounds\n\
         cycles/s (median round): dlock {:.0}, floor {:.0}\n\
         client CPU per cycle: dlock {:.1} µs, floor {:.1} µs (+{:.1} µs)\n\
         dlock / floor throughput: median {:.3} (min {:.3}, max {:.3})",
        median_rate(0),
        median_rate(1),
        per_cycle(0),
        per_cycle(1),
        per_cycle(0) - per_cycle(1),
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1],
    );
    Ok(())
}

/// One round of `tasks` tasks cycling on keys of their own; the cycles done.
async fn round(
    tasks: usize,
    floor: bool,
    backend: &Arc<dyn Backend>,
    raw: &[Arc<Raw>],
    prefix: &str,
) -> Res<u64> {
    let end = Instant::now() + ROUND;
    let mut handles = Vec::new();
    for i in 0..tasks {
        let backend = Arc::clone(backend);
        let raw = Arc::clone(&raw[i % raw.len()]);
        let key = LockKey::new(format!("{prefix}:{i}"))?;
        handles.push(tokio::spawn(async move {
            let options = LockOptions::new(Duration::from_secs(30));
            let mut done = 0u64;
            while Instant::now() < end {
                if floor {
                    // The quick statement, and the full one when it gave
                    // the lock back (`{0}`): dlock's two statements, less
                    // its choice of when to send which.
                    let params: [&(dyn ToSql + Sync); 2] = [&key.as_str(), &0i64];
                    let mut row = raw.client.query_one(&raw.quick, &params).await?;
                    if row.try_get::<_, Option<Vec<i64>>>(1)?.as_deref() == Some(&[0]) {
                        row = raw.client.query_one(&raw.lock, &params).await?;
                    }
                    let (advisory, token): (i64, Option<Vec<i64>>) =
                        (row.try_get(0)?, row.try_get(1)?);
                    if token.is_none() {
                        return Err(format!("{key} was held").into());
                    }
                    raw.client.query_one(&raw.unlock, &[&advisory]).await?;
                } else {
                    let lease = options.acquire_on(Arc::clone(&backend), &key).await?;
                    lease.release().await?;
                }
                done += 1;
            }
            Res::Ok(done)
        }));
    }
    let mut total = 0;
    for handle in handles {
        total += handle.await??;
    }
    Ok(total)
}

/// The process's user + system CPU time so far, in seconds.
fn cpu_seconds() -> Res<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // Fields after the command name (which is in parentheses): state is
    // field 3, utime and stime are fields 14 and 15, in clock ticks.
    let rest = stat
        .rsplit_once(") ")
        .map(|(_, rest)| rest)
        .ok_or("odd /proc/self/stat")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11).ok_or("no utime")?.parse::<u64>()?
        + fields.get(12).ok_or("no stime")?.parse::<u64>()?;
    // Linux reports these in USER_HZ, which is 100 on every mainstream build.
    Ok(ticks as f64 / 100.0)
}

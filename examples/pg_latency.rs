//! Measures the PostgreSQL backend: acquire+release on one task, and the
//! handoff from a release to the next holder with 8 waiters, next to a plain
//! `SELECT 1` round trip measured in the same run.
//!
//! ```sh
//! cargo run --release --example pg_latency            # 127.0.0.1:5432
//! DLOCK_PG_URL=postgresql://... cargo run --release --example pg_latency
//! ```
//!
//! It measures and prints; it asserts nothing about time. Both the lock
//! sessions and the `SELECT 1` client connect without TLS (the default
//! string says `sslmode=disable`), so the figures compare like with like.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock::backend::OwnerId;
use dlock::pg::PgBackend;
use dlock::pg::tokio_postgres::{self, NoTls};
use dlock::{Backend, LockError, LockKey, LockOptions};
use tokio::time::Instant;

const ROUND_TRIPS: usize = 2_000;
const CYCLES: usize = 2_000;
const WAITERS: usize = 8;
const HANDOFFS_PER_WAITER: usize = 50;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let conn = std::env::var("DLOCK_PG_URL").unwrap_or_else(|_| {
        "host=127.0.0.1 port=5432 user=postgres dbname=test sslmode=disable".to_owned()
    });

    let before = select_one(&conn).await?;
    let cycles = acquire_release(&conn).await?;
    let separate = handoff(&conn, true).await?;
    let shared = handoff(&conn, false).await?;
    let after = select_one(&conn).await?;

    println!(
        "PostgreSQL backend latency ({} on this machine)",
        describe(&conn)
    );
    println!("{:<58} {:>10} {:>10} {:>6}", "", "median", "p99", "n");
    report("plain SELECT 1 round trip (before)", &before);
    report("acquire + release, one task", &cycles);
    report(
        "handoff release -> next acquire, 8 waiters, 8 processes*",
        &separate,
    );
    report(
        "handoff release -> next acquire, 8 waiters, 1 backend",
        &shared,
    );
    report("plain SELECT 1 round trip (after)", &after);
    println!("* eight backends with sessions of their own, as eight processes would have");
    Ok(())
}

fn describe(conn: &str) -> String {
    conn.parse::<tokio_postgres::Config>()
        .ok()
        .and_then(|c| match c.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => Some(h.clone()),
            _ => None,
        })
        .unwrap_or_else(|| "local socket".to_owned())
}

fn report(what: &str, samples: &[Duration]) {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let at = |q: f64| {
        sorted
            .get(((sorted.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or_default()
    };
    println!(
        "{what:<58} {:>10} {:>10} {:>6}",
        format!("{:.0?}", at(0.5)),
        format!("{:.0?}", at(0.99)),
        sorted.len()
    );
}

fn fresh_key(label: &str) -> Result<LockKey, LockError> {
    LockKey::new(format!("dlock-latency:{label}:{}", OwnerId::random()?))
}

/// `SELECT 1` on a prepared statement: one round trip, the floor.
async fn select_one(conn: &str) -> Result<Vec<Duration>, Box<dyn std::error::Error>> {
    let (client, connection) = tokio_postgres::connect(conn, NoTls).await?;
    tokio::spawn(connection);
    let statement = client.prepare("SELECT 1").await?;
    let mut samples = Vec::with_capacity(ROUND_TRIPS);
    for _ in 0..ROUND_TRIPS {
        let started = Instant::now();
        client.query_one(&statement, &[]).await?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}

async fn acquire_release(conn: &str) -> Result<Vec<Duration>, Box<dyn std::error::Error>> {
    let backend: Arc<dyn Backend> = Arc::new(PgBackend::connect(conn).await?);
    let key = fresh_key("cycle")?;
    let options = LockOptions::new(Duration::from_secs(30));
    let mut samples = Vec::with_capacity(CYCLES);
    for _ in 0..CYCLES {
        let started = Instant::now();
        let lease = options.acquire_on(backend.clone(), &key).await?;
        lease.release().await?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}

/// Eight tasks contend for one key; each time one releases, the time until
/// the next one holds it is a handoff. `separate`: each task has a backend
/// of its own (the handoff goes through the server: release, the waiters'
/// server-side wait returns, a new attempt); otherwise they share one
/// backend (the handoff is woken in process).
async fn handoff(conn: &str, separate: bool) -> Result<Vec<Duration>, Box<dyn std::error::Error>> {
    let key = fresh_key("handoff")?;
    let shared: Arc<dyn Backend> = Arc::new(PgBackend::connect(conn).await?);
    let released_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let samples: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let mut tasks = Vec::new();
    for _ in 0..WAITERS {
        let backend: Arc<dyn Backend> = if separate {
            Arc::new(PgBackend::connect(conn).await?)
        } else {
            shared.clone()
        };
        let (key, released_at, samples) = (key.clone(), released_at.clone(), samples.clone());
        tasks.push(tokio::spawn(async move {
            let options = LockOptions::new(Duration::from_secs(30)).wait(Duration::from_secs(60));
            for _ in 0..HANDOFFS_PER_WAITER {
                let lease = options.acquire_on(backend.clone(), &key).await?;
                let now = Instant::now();
                if let Some(released) = released_at.lock().map_err(|_| "poisoned")?.take() {
                    samples.lock().map_err(|_| "poisoned")?.push(now - released);
                }
                // Hold briefly, so the others are all waiting by the release.
                tokio::time::sleep(Duration::from_micros(500)).await;
                *released_at.lock().map_err(|_| "poisoned")? = Some(Instant::now());
                lease.release().await?;
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        }));
    }
    for task in tasks {
        task.await?.map_err(|e| e.to_string())?;
    }
    let samples = samples.lock().map_err(|_| "poisoned")?.clone();
    Ok(samples)
}

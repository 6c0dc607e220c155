//! Measures the Redis backend on the Redis at `DLOCK_REDIS_URL` (default
//! `redis://127.0.0.1:6379`):
//!
//! 1. acquire + release of one key by one task, N cycles: median and p99;
//! 2. handoff: 8 waiter tasks contend for one key; each holder releases and
//!    the time until the next waiter holds it is measured: median and p99.
//!
//! ```sh
//! cargo run --release --example redis_latency [CYCLES] [HANDOFFS]
//! redis-benchmark -h 127.0.0.1 -p 6379 -t ping -n 100000 -q   # same minute
//! ```
//!
//! It measures and prints; it asserts nothing about time.

use std::sync::Arc;
use std::time::Duration;

use dlock::backend::OwnerId;
use dlock::redis::RedisBackend;
use dlock::{Backend, LockError, LockOptions};
use tokio::sync::Mutex;
use tokio::time::Instant;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn report(what: &str, mut samples: Vec<Duration>) {
    samples.sort();
    println!(
        "{what}: n={} median={:.1}µs p99={:.1}µs",
        samples.len(),
        percentile(&samples, 0.5).as_secs_f64() * 1e6,
        percentile(&samples, 0.99).as_secs_f64() * 1e6,
    );
}

#[tokio::main]
async fn main() -> Result<(), LockError> {
    let mut args = std::env::args().skip(1);
    let cycles: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5000);
    let handoffs: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2000);
    let url =
        std::env::var("DLOCK_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let redis = RedisBackend::connect(&url).await?;
    println!("backend: {redis:?}");
    let backend: Arc<dyn Backend> = Arc::new(redis);
    let run = OwnerId::random()?;
    let options = LockOptions::new(Duration::from_secs(30));

    // 1. One task, uncontended.
    let key = format!("dlock-bench:single:{run}");
    for _ in 0..200 {
        options
            .acquire_on(backend.clone(), key.as_str())
            .await?
            .release()
            .await?;
    }
    let mut samples = Vec::with_capacity(cycles);
    for _ in 0..cycles {
        let started = Instant::now();
        let lease = options.acquire_on(backend.clone(), key.as_str()).await?;
        lease.release().await?;
        samples.push(started.elapsed());
    }
    report("acquire+release, one task", samples);

    // 2. Handoff between 8 waiters. Each holder notes when it releases; the
    // next holder subtracts that from when it got the lock.
    let key = format!("dlock-bench:handoff:{run}");
    let released_at: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let samples: Arc<Mutex<Vec<Duration>>> = Arc::new(Mutex::new(Vec::with_capacity(handoffs)));
    let waiting = options.clone().wait(Duration::from_secs(60));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (backend, key, waiting) = (backend.clone(), key.clone(), waiting.clone());
        let (released_at, samples) = (released_at.clone(), samples.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let lease = waiting.acquire_on(backend.clone(), key.as_str()).await?;
                let got = Instant::now();
                let mut samples = samples.lock().await;
                if let Some(at) = released_at.lock().await.take() {
                    samples.push(got - at);
                }
                let done = samples.len() >= handoffs;
                drop(samples);
                // Hold briefly so the other seven are all waiting.
                tokio::time::sleep(Duration::from_micros(200)).await;
                *released_at.lock().await = Some(Instant::now());
                lease.release().await?;
                if done {
                    return Ok::<(), LockError>(());
                }
            }
        }));
    }
    for task in tasks {
        task.await.map_err(|e| {
            LockError::backend("redis", dlock::error::Operation::Wait, key.as_str(), e)
        })??;
    }
    let samples = std::mem::take(&mut *samples.lock().await);
    report("handoff release -> next waiter holds, 8 waiters", samples);
    Ok(())
}

//! Scenario 3: what the attribute costs over the programmatic API, on the
//! memory backend (no I/O: the pure CPU path of the core), and what the
//! lease's metrics and span cost a cycle when nothing records them.

use std::hint::black_box;
use std::time::Duration;

use dlock::{LockError, LockKey, LockOptions, distributed_lock};
use tokio::time::Instant;

use crate::Res;
use crate::stats::{Measured, median_f64};

/// The registry name the memory backend is registered under.
pub const BACKEND: &str = "bench-memory";

/// The locked function, written with the attribute.
#[distributed_lock(key = "bench:macro:{n}", ttl = "30s", backend = "bench-memory")]
async fn annotated(n: u32) -> Result<u32, LockError> {
    Ok(black_box(n))
}

/// The same lock through the programmatic API, as a user would write it.
async fn programmatic(n: u32) -> Result<u32, LockError> {
    let key = LockKey::builder().lit("bench:macro:").value(&n).finish()?;
    let lease = LockOptions::new(Duration::from_secs(30))
        .backend(BACKEND)
        .acquire(key)
        .await?;
    let out = black_box(n);
    lease.release().await?;
    Ok(out)
}

/// Both measured: `blocks` pairs of back-to-back blocks of `calls` calls.
/// Returns (annotated, programmatic, the median over the pairs of the
/// annotated / programmatic time per call).
pub async fn measure(blocks: usize, calls: u32) -> Res<(Measured, Measured, f64)> {
    dlock::registry().register(BACKEND, dlock::memory::MemoryBackend::new());
    let (mut macro_side, mut api_side) = (Measured::default(), Measured::default());
    let mut ratios = Vec::new();
    for n in 0..calls {
        annotated(n % 1024).await?;
        programmatic(n % 1024).await?;
    }
    for block in 0..blocks {
        // Which goes first alternates, so neither always runs on a warmer cache.
        let mut per_call = [0.0f64; 2];
        for side in [block % 2, 1 - block % 2] {
            let mut samples = Vec::with_capacity(calls as usize);
            let started = Instant::now();
            for n in 0..calls {
                let call = Instant::now();
                if side == 0 {
                    annotated(n % 1024).await?;
                } else {
                    programmatic(n % 1024).await?;
                }
                samples.push(call.elapsed());
            }
            per_call[side] = started.elapsed().as_secs_f64() / f64::from(calls);
            let target = if side == 0 {
                &mut macro_side
            } else {
                &mut api_side
            };
            target.add_round(samples, u64::from(calls), started.elapsed());
        }
        ratios.push(per_call[0] / per_call[1]);
    }
    let ratio = median_f64(&ratios);
    Ok((macro_side, api_side, ratio))
}

/// What recording one cycle (its metrics and its `dlock.hold` span) adds
/// to it, in the calls the lease makes, timed alone: this program installs
/// no metrics recorder and no tracing subscriber, so this is what a cycle
/// pays for them when nobody listens. The median over `blocks` blocks of
/// `calls` calls of the time per cycle (a block is timed whole: one call
/// is not much longer than a clock read).
pub fn instrumentation(blocks: usize, calls: u32) -> Res<Duration> {
    let key = LockKey::new("bench:macro:0")?;
    let started = Instant::now();
    let cycle =
        || dlock::lease::metrics::record_one_cycle(black_box("memory"), black_box(&key), started);
    for _ in 0..calls {
        cycle();
    }
    let mut per_cycle = Vec::with_capacity(blocks);
    for _ in 0..blocks {
        let started = Instant::now();
        for _ in 0..calls {
            cycle();
        }
        per_cycle.push(started.elapsed().as_secs_f64() / f64::from(calls));
    }
    Ok(Duration::from_secs_f64(median_f64(&per_cycle)))
}

//! Scenario 2: contended handoff. 16 tasks loop on one key: acquire (with
//! wait), no work, release.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use dlock::{Backend, LockKey, LockOptions};
use tokio::time::Instant;

use crate::cycle::TTL;
use crate::stats::{Measured, quantile};
use crate::{Config, Res};

/// How many tasks contend.
pub const TASKS: usize = 16;
/// How often the SET NX polling loop looks again.
pub const POLL_EVERY: Duration = Duration::from_millis(1);

/// The bookkeeping every contender updates while it holds the key.
#[derive(Default)]
struct Book {
    last_holder: Option<usize>,
    released_at: Option<Instant>,
    /// Release (start) to the next acquisition, whoever acquires.
    turns: Vec<Duration>,
    /// The same, only when the next holder is another task.
    handoffs: Vec<Duration>,
    holders: [u64; TASKS],
    /// Turns taken again by the previous holder once every task had held
    /// the key: before that, a task may take it again because nobody
    /// else had queued yet.
    repeats_once_all_served: usize,
}

/// What one implementation did.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Acquisitions per second, by anyone.
    pub turns_per_s: f64,
    /// Acquisitions per second by a task other than the previous holder.
    pub handoffs_per_s: f64,
    /// Release to next acquisition, any holder.
    pub turn: Measured,
    /// Release to next acquisition by another task.
    pub handoff: Measured,
    /// How many of the tasks ever held the key.
    pub tasks_served: usize,
    /// Turns taken again by the previous holder once every task had held
    /// the key (see `Book`).
    pub repeats_once_all_served: usize,
}

#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Book>>, Arc<tokio::sync::Notify>);

impl Shared {
    fn acquired(&self, task: usize) {
        let got = Instant::now();
        self.1.notify_waiters();
        let mut book = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(at) = book.released_at.take() {
            book.turns.push(got - at);
            if book.last_holder != Some(task) {
                book.handoffs.push(got - at);
            } else if book.holders.iter().all(|&n| n > 0) {
                book.repeats_once_all_served += 1;
            }
        }
        book.last_holder = Some(task);
        book.holders[task] += 1;
    }

    fn releasing(&self) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .released_at = Some(Instant::now());
    }

    /// Waits until a task other than `task` has taken the key (or
    /// `deadline` passed).
    async fn next_holder(&self, task: usize, deadline: Instant) {
        loop {
            let notified = self.1.notified();
            let last = self
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .last_holder;
            if last != Some(task) {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return;
            }
        }
    }
}

/// When a releasing task asks for the key again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Again {
    /// At once: it queues behind the others while the key is handed on.
    AtOnce,
    /// Once another task took the key: the handoff runs with the releaser
    /// out of the way.
    AfterTheNextHolder,
}

/// Runs `TASKS` contenders built by `task` for `time`.
async fn contend<F, Fut>(time: Duration, task: F) -> Res<Outcome>
where
    F: Fn(usize, Instant, Shared) -> Fut,
    Fut: Future<Output = Res<()>> + Send + 'static,
{
    let shared = Shared::default();
    let started = Instant::now();
    let deadline = started + time;
    let handles: Vec<_> = (0..TASKS)
        .map(|i| tokio::spawn(task(i, deadline, shared.clone())))
        .collect();
    for handle in handles {
        handle.await??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let book = std::mem::take(&mut *shared.0.lock().unwrap_or_else(PoisonError::into_inner));
    let mut outcome = Outcome {
        turns_per_s: book.turns.len() as f64 / elapsed,
        handoffs_per_s: book.handoffs.len() as f64 / elapsed,
        tasks_served: book.holders.iter().filter(|&&n| n > 0).count(),
        repeats_once_all_served: book.repeats_once_all_served,
        ..Outcome::default()
    };
    outcome.turn.samples = book.turns;
    outcome.handoff.samples = book.handoffs;
    Ok(outcome)
}

/// dlock on a shared backend: waiting on pub/sub (Redis) or the server-side
/// probe and in-process wake-ups (PostgreSQL); with `fair`, queued in
/// arrival order and handed the key by the release.
pub async fn dlock(
    backend: Arc<dyn Backend>,
    key: &str,
    time: Duration,
    fair: bool,
    again: Again,
) -> Res<Outcome> {
    let key = LockKey::new(key)?;
    contend(time, |i, deadline, book| {
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            let options = LockOptions::new(TTL)
                .wait(Duration::from_secs(60))
                .fair(fair);
            while Instant::now() < deadline {
                let lease = options.acquire_on(backend.clone(), &key).await?;
                book.acquired(i);
                book.releasing();
                lease.release().await?;
                if again == Again::AfterTheNextHolder {
                    book.next_holder(i, deadline).await;
                }
            }
            Ok(())
        }
    })
    .await
}

/// rslock with its default retry settings (3 tries, up to 200 ms apart),
/// through `acquire_no_guard`, which loops until it holds the key.
pub async fn rslock(cfg: &Config, key: &str, time: Duration) -> Res<Outcome> {
    let manager = rslock::LockManager::new(vec![cfg.redis_url.clone()]);
    let key = key.to_owned();
    contend(time, |i, deadline, book| {
        let (manager, key) = (manager.clone(), key.clone());
        async move {
            while Instant::now() < deadline {
                let lock = manager
                    .acquire_no_guard(key.as_bytes(), TTL)
                    .await
                    .map_err(|e| format!("rslock: {e}"))?;
                book.acquired(i);
                book.releasing();
                manager.unlock(&lock).await;
            }
            Ok(())
        }
    })
    .await
}

/// A raw `SET NX PX` polling loop (every [`POLL_EVERY`]) and `DEL`.
pub async fn set_nx_poll(cfg: &Config, key: &str, time: Duration) -> Res<Outcome> {
    let conn = redis::Client::open(cfg.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let key = key.to_owned();
    contend(time, |i, deadline, book| {
        let (mut conn, key) = (conn.clone(), key.clone());
        async move {
            while Instant::now() < deadline {
                loop {
                    let set: Option<String> = redis::cmd("SET")
                        .arg(&key)
                        .arg(i)
                        .arg("NX")
                        .arg("PX")
                        .arg(TTL.as_millis() as u64)
                        .query_async(&mut conn)
                        .await?;
                    if set.is_some() {
                        break;
                    }
                    tokio::time::sleep(POLL_EVERY).await;
                }
                book.acquired(i);
                book.releasing();
                let _: i64 = redis::cmd("DEL").arg(&key).query_async(&mut conn).await?;
            }
            Ok(())
        }
    })
    .await
}

/// The server's time in scripts so far: `INFO commandstats`' `evalsha`
/// line, in µs (read before and after a row, nothing reset, so a shared
/// server's statistics are left alone).
pub async fn script_micros(cfg: &Config) -> Res<u64> {
    let mut conn = redis::Client::open(cfg.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await?;
    Ok(info
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:"))
        .and_then(|stats| {
            stats
                .split(',')
                .find_map(|field| field.strip_prefix("usec="))
        })
        .and_then(|usec| usec.trim().parse().ok())
        .unwrap_or(0))
}

/// The median of `n` PINGs on a multiplexed connection: one round trip.
pub async fn redis_round_trip(cfg: &Config, n: usize) -> Res<Duration> {
    let mut conn = redis::Client::open(cfg.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        samples.push(started.elapsed());
    }
    Ok(quantile(&samples, 0.5))
}

/// The median of `n` prepared `SELECT 1`s: one PostgreSQL round trip.
pub async fn pg_round_trip(cfg: &Config, n: usize) -> Res<Duration> {
    let client = crate::cycle::pg_client(&cfg.pg_conn).await?;
    let statement = client.prepare("SELECT 1").await?;
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let started = Instant::now();
        client.query_one(&statement, &[]).await?;
        samples.push(started.elapsed());
    }
    Ok(quantile(&samples, 0.5))
}

/// The floor of any handoff told through Redis pub/sub, on an idle
/// server: a script that sets a key and publishes to a channel, sent on a
/// multiplexed connection, until the message wakes another task, which a
/// reader task on a pub/sub connection passes it to (the way dlock's
/// subscriber passes a handoff to its waiter). Median of `n`.
pub async fn redis_publish_floor(cfg: &Config, key: &str, n: usize) -> Res<Duration> {
    use futures_util::StreamExt;

    let client = redis::Client::open(cfg.redis_url.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut pubsub = client.get_async_pubsub().await?;
    let channel = format!("{key}:floor");
    pubsub.subscribe(&channel).await?;
    let (to_waiter, mut heard) = tokio::sync::mpsc::unbounded_channel::<()>();
    let reader = tokio::spawn(async move {
        let mut messages = pubsub.into_on_message();
        while messages.next().await.is_some() {
            if to_waiter.send(()).is_err() {
                break;
            }
        }
    });
    let (woke, mut wake_times) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let waiter = tokio::spawn(async move {
        while heard.recv().await.is_some() {
            if woke.send(Instant::now()).is_err() {
                break;
            }
        }
    });
    let script = redis::Script::new(
        "redis.call('SET', KEYS[1], ARGV[1]) redis.call('PUBLISH', ARGV[2], ARGV[1]) return 1",
    );
    let mut samples = Vec::with_capacity(n);
    // The first round loads the script and is not counted.
    for round in 0..=n {
        let started = Instant::now();
        let _: i64 = script
            .key(key)
            .arg(round)
            .arg(&channel)
            .invoke_async(&mut conn)
            .await?;
        let woke_at = wake_times
            .recv()
            .await
            .ok_or("the pub/sub reader ended before the message came")?;
        if round > 0 {
            samples.push(woke_at - started);
        }
    }
    reader.abort();
    waiter.abort();
    let _: i64 = redis::cmd("DEL").arg(key).query_async(&mut conn).await?;
    Ok(quantile(&samples, 0.5))
}

/// The same floor told through a list instead: the script pushes to a
/// list that another task waits on with `BLPOP` on a connection of its
/// own. Median of `n`.
pub async fn redis_blpop_floor(cfg: &Config, key: &str, n: usize) -> Res<Duration> {
    let client = redis::Client::open(cfg.redis_url.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut blocking = client.get_multiplexed_async_connection().await?;
    let list = format!("{key}:list");
    let (woke, mut wake_times) = tokio::sync::mpsc::unbounded_channel::<Instant>();
    let waiter = {
        let list = list.clone();
        tokio::spawn(async move {
            loop {
                let got: redis::RedisResult<Option<(String, String)>> = redis::cmd("BLPOP")
                    .arg(&list)
                    .arg(5)
                    .query_async(&mut blocking)
                    .await;
                if !matches!(got, Ok(Some(_))) || woke.send(Instant::now()).is_err() {
                    break;
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let script = redis::Script::new(
        "redis.call('SET', KEYS[1], ARGV[1]) redis.call('RPUSH', KEYS[2], ARGV[1]) return 1",
    );
    let mut samples = Vec::with_capacity(n);
    for round in 0..=n {
        let started = Instant::now();
        let _: i64 = script
            .key(key)
            .key(&list)
            .arg(round)
            .invoke_async(&mut conn)
            .await?;
        let woke_at = wake_times.recv().await.ok_or("the BLPOP waiter ended")?;
        if round > 0 {
            samples.push(woke_at - started);
        }
    }
    waiter.abort();
    let _: i64 = redis::cmd("DEL")
        .arg(key)
        .arg(&list)
        .query_async(&mut conn)
        .await?;
    Ok(quantile(&samples, 0.5))
}

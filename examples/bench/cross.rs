//! Scenario 5: three processes contend on one key through each backend
//! that works across processes. The benchmark starts copies of itself
//! (`--child`), each looping acquire (with wait) / release, and merges the
//! intervals they report on the shared wall clock of this host.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dlock::{Backend, LockOptions};
use tokio::io::AsyncReadExt as _;
use tokio::process::{Child, Command};

use crate::stats::Measured;
use crate::{Config, Res};

/// How many processes contend.
pub const PROCESSES: usize = 3;

/// What the processes did together.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Acquisitions per second, all processes together.
    pub turns_per_s: f64,
    /// Acquisitions per second by a process other than the previous holder.
    pub handoffs_per_s: f64,
    /// Release (start) to the next acquisition by another process.
    pub handoff: Measured,
    /// Intervals that overlapped the previous holder's (mutual exclusion
    /// broken): must be 0.
    pub overlaps: usize,
    /// Acquisitions per process.
    pub per_process: Vec<usize>,
}

/// Nanoseconds on the host's wall clock (CLOCK_REALTIME), which every
/// process of the host reads alike.
pub fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// Connects to `backend` as a child process would.
pub async fn connect(cfg: &Config, backend: &str, dir: &Path) -> Res<Arc<dyn Backend>> {
    Ok(match backend {
        "file" => Arc::new(dlock::file::FileBackend::open(dir)?),
        "redis" => Arc::new(dlock::redis::RedisBackend::connect(&cfg.redis_url).await?),
        "pg" => Arc::new(dlock::pg::PgBackend::connect(&cfg.pg_conn).await?),
        other => return Err(format!("unknown backend {other}").into()),
    })
}

/// The child's side: waits for the common start, loops until the common
/// end, prints one `acquired_ns release_ns` line per acquisition.
pub async fn child(
    cfg: &Config,
    backend: &str,
    key: &str,
    dir: &Path,
    start_ns: u128,
    end_ns: u128,
    fair: bool,
) -> Res<()> {
    let backend = connect(cfg, backend, dir).await?;
    let options = LockOptions::new(Duration::from_secs(30))
        .wait(Duration::from_secs(60))
        .fair(fair);
    let wait = start_ns.saturating_sub(now_ns());
    tokio::time::sleep(Duration::from_nanos(wait as u64)).await;
    let mut out = String::new();
    while now_ns() < end_ns {
        let lease = options.acquire_on(backend.clone(), key).await?;
        let acquired = now_ns();
        let releasing = now_ns();
        lease.release().await?;
        out.push_str(&format!("{acquired} {releasing}\n"));
    }
    print!("{out}");
    Ok(())
}

/// Starts this program again with `args` (a child's role and its
/// arguments), on the same servers, its stdout piped back. The child is
/// killed if its handle is dropped.
pub fn spawn_self(cfg: &Config, args: &[&str], stdin: Stdio) -> Res<Child> {
    Ok(Command::new(std::env::current_exe()?)
        .args(args)
        .env("DLOCK_REDIS_URL", &cfg.redis_url)
        .env("DLOCK_PG_URL", &cfg.pg_conn)
        .stdin(stdin)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?)
}

/// Starts the processes on `backend` (in fair mode if `fair`) and merges
/// what they saw.
pub async fn run(cfg: &Config, backend: &str, time: Duration, fair: bool) -> Res<Outcome> {
    let dir = std::env::temp_dir().join(format!("dlock-bench-{}", cfg.run));
    std::fs::create_dir_all(&dir)?;
    let mode = if fair { "fair" } else { "plain" };
    let key = format!("bench:{}:cross:{backend}:{mode}", cfg.run);
    // Time for the children to start and connect before the common start.
    let lead = if cfg.smoke {
        500_000_000
    } else {
        1_500_000_000
    };
    let start_ns = now_ns() + lead;
    let end_ns = start_ns + time.as_nanos();
    let mut children = Vec::new();
    for _ in 0..PROCESSES {
        let child = spawn_self(
            cfg,
            &[
                "--child",
                backend,
                &key,
                &dir.display().to_string(),
                &start_ns.to_string(),
                &end_ns.to_string(),
                mode,
            ],
            Stdio::inherit(),
        )?;
        children.push(child);
    }
    let mut intervals: Vec<(u128, u128, usize)> = Vec::new();
    let mut per_process = Vec::new();
    for (p, mut child) in children.into_iter().enumerate() {
        let mut text = String::new();
        if let Some(mut stdout) = child.stdout.take() {
            stdout.read_to_string(&mut text).await?;
        }
        let status = child.wait().await?;
        if !status.success() {
            return Err(format!("cross-process child {p} on {backend} failed: {status}").into());
        }
        let before = intervals.len();
        for line in text.lines() {
            let mut parts = line
                .split_whitespace()
                .filter_map(|n| n.parse::<u128>().ok());
            if let (Some(a), Some(r)) = (parts.next(), parts.next()) {
                intervals.push((a, r, p));
            }
        }
        per_process.push(intervals.len() - before);
    }
    let _ = std::fs::remove_dir_all(&dir);
    intervals.sort_unstable();
    let mut outcome = Outcome {
        per_process,
        ..Outcome::default()
    };
    let mut handoffs = 0usize;
    for pair in intervals.windows(2) {
        let ((_, released, from), (acquired, _, to)) = (pair[0], pair[1]);
        if acquired < released {
            outcome.overlaps += 1;
        } else if from != to {
            handoffs += 1;
            outcome
                .handoff
                .samples
                .push(Duration::from_nanos((acquired - released) as u64));
        }
    }
    let secs = time.as_secs_f64();
    outcome.turns_per_s = intervals.len() as f64 / secs;
    outcome.handoffs_per_s = handoffs as f64 / secs;
    Ok(outcome)
}

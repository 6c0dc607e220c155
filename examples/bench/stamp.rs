//! The facts a section is stamped with: when and by which command it was
//! measured, on what machine and how loaded, against which servers (and
//! their round trip in that run), with which build. Each section carries
//! its own, since `--only` replaces one section and keeps the others.

use std::time::Duration;

use crate::stats::show;
use crate::{Config, cycle};

/// What every section of one run shares.
pub struct RunFacts {
    /// The command that ran the benchmark, as one would type it.
    command: String,
    commit: String,
    machine: String,
    redis_version: String,
    pg_version: String,
    /// One round trip (median): Redis PING, PostgreSQL prepared `SELECT 1`.
    pub redis_rtt: Duration,
    pub pg_rtt: Duration,
    build: String,
}

impl RunFacts {
    /// Gathers the run's facts; the round trips are measured by the caller.
    pub async fn gather(cfg: &Config, redis_rtt: Duration, pg_rtt: Duration) -> Self {
        let (redis_version, pg_version) = server_versions(cfg).await;
        let args: Vec<String> = std::env::args().skip(1).collect();
        let profile = if cfg!(debug_assertions) {
            "cargo run --example bench"
        } else {
            "cargo run --release --example bench"
        };
        let command = if args.is_empty() {
            profile.to_owned()
        } else {
            format!("{profile} -- {}", args.join(" "))
        };
        let root = env!("CARGO_MANIFEST_DIR");
        RunFacts {
            command,
            commit: commit(root),
            machine: machine(),
            redis_version,
            pg_version,
            redis_rtt,
            pg_rtt,
            build: format!(
                "{}; dlock {}, redis-rs {}, rslock {}, tokio-postgres {}, tokio {}; profile: {}",
                first_line_of("rustc", &["--version"]),
                env!("CARGO_PKG_VERSION"),
                locked("redis"),
                locked("rslock"),
                locked("tokio-postgres"),
                locked("tokio"),
                if cfg!(debug_assertions) {
                    "debug"
                } else {
                    "release"
                }
            ),
        }
    }

    /// The stamp of a section measured from `started` (UTC, as
    /// [`now_utc`] gives it), under these load averages at its start and end.
    pub fn stamp(&self, started: &str, load_start: &str, load_end: &str) -> String {
        format!(
            "> Measured {started} by `{}` at commit {}.\n> Machine: {}; load average (1/5/15 min) {load_start} at the start, {load_end} at the end.\n> Servers on loopback: Redis {}, PostgreSQL {}; one round trip (median): Redis PING {}, PostgreSQL prepared `SELECT 1` {}.\n> {}.\n",
            self.command,
            self.commit,
            self.machine,
            self.redis_version,
            self.pg_version,
            show(self.redis_rtt),
            show(self.pg_rtt),
            self.build
        )
    }
}

/// The commit the sources are at, and whether they differ from it (the
/// report and its charts aside, which a run of the benchmark rewrites).
fn commit(root: &str) -> String {
    let head = first_line_of("git", &["-C", root, "rev-parse", "--short", "HEAD"]);
    // No optional locks: `git status` would otherwise refresh the index
    // of the developer's checkout, and could collide with their own git
    // command while the suite runs the smoke.
    let status = std::process::Command::new("git")
        .args([
            "--no-optional-locks",
            "-C",
            root,
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
        ])
        .args([".", ":(exclude)BENCHMARKS.md", ":(exclude)benchmarks"])
        .output();
    match status {
        Ok(out) if out.status.success() && !out.stdout.is_empty() => {
            format!("{head} (with uncommitted changes)")
        }
        _ => head,
    }
}

/// The date and time, UTC, to the minute.
pub fn now_utc() -> String {
    first_line_of("date", &["-u", "+%Y-%m-%d %H:%M UTC"])
}

fn first_line_of(cmd: &str, args: &[&str]) -> String {
    std::process::Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".into())
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The version of `name` in Cargo.lock.
fn locked(name: &str) -> String {
    let lock = include_str!("../../Cargo.lock");
    let marker = format!("name = \"{name}\"\nversion = \"");
    lock.split(&marker)
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or("?")
        .to_owned()
}

fn machine() -> String {
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map_or("unknown CPU".into(), |m| m.trim().to_owned());
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let mem = read("/proc/meminfo")
        .lines()
        .next()
        .and_then(|l| {
            l.split_whitespace()
                .nth(1)
                .and_then(|k| k.parse::<u64>().ok())
        })
        .map_or("?".into(), |kb| {
            format!("{:.1} GiB", kb as f64 / 1024.0 / 1024.0)
        });
    format!(
        "{model}, {cores} cores available to the process, {mem} RAM, Linux {}",
        read("/proc/sys/kernel/osrelease").trim()
    )
}

pub fn load() -> String {
    read("/proc/loadavg")
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

async fn server_versions(cfg: &Config) -> (String, String) {
    let redis = async {
        let mut conn = redis::Client::open(cfg.redis_url.as_str())?
            .get_multiplexed_async_connection()
            .await?;
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn)
            .await?;
        Ok::<_, crate::BoxError>(
            info.lines()
                .find_map(|l| l.strip_prefix("redis_version:"))
                .unwrap_or("?")
                .trim()
                .to_owned(),
        )
    };
    let pg = async {
        let client = cycle::pg_client(&cfg.pg_conn).await?;
        let row = client.query_one("SHOW server_version", &[]).await?;
        let version = row.try_get::<_, String>(0)?;
        // The token lead decides how often a draw writes the sequence
        // (docs/postgres.md): the PostgreSQL rows depend on it.
        let lead = client
            .query_one(
                "SELECT obj_description(to_regclass('dlock.dlock_token_seq'), 'pg_class')",
                &[],
            )
            .await?
            .try_get::<_, Option<String>>(0)?;
        let lead = match lead
            .as_deref()
            .and_then(|c| c.strip_prefix("dlock-token-lead-us="))
        {
            Some(us) => format!("token lead {us} µs"),
            None => "no token lead".to_owned(),
        };
        Ok::<_, crate::BoxError>(format!("{version}, dlock.dlock_token_seq with {lead}"))
    };
    (
        redis.await.unwrap_or_else(|e| format!("? ({e})")),
        pg.await.unwrap_or_else(|e| format!("? ({e})")),
    )
}

//! dlock's benchmark: dlock against the physical floor (the same commands
//! sent by hand) and against the crates users would pick instead, on the
//! local Redis and PostgreSQL, in one run. Writes `BENCHMARKS.md`, one
//! section per scenario, each stamped with the run that measured it, and
//! SVG charts beside it (`benchmarks/`, `plots.rs`); a run of some
//! scenarios replaces their sections and charts and keeps the others
//! (`document.rs`).
//!
//! ```sh
//! cargo run --release --example bench                 # full run (~11 min), writes BENCHMARKS.md
//! cargo run --example bench -- --smoke                # ~20 s, writes target/bench-smoke.md
//! cargo run --release --example bench -- --only cycle,handoff   # replaces these sections
//! cargo run --release --example bench -- --only server         # Redis server CPU per cycle
//! cargo run --release --example bench -- --only election --out /tmp/election.md
//! cargo run --release --example bench -- --only acks      # replica acks
//! cargo run --release --example bench -- --only modes     # read-write locks, permits
//! ```
//!
//! Servers: `DLOCK_REDIS_URL` (default `redis://127.0.0.1:6379`) and
//! `DLOCK_PG_URL` (default `host=127.0.0.1 user=postgres dbname=test
//! sslmode=disable`). It measures and reports; it never asserts a time.

mod acks;
mod cross;
mod cycle;
mod document;
mod election;
mod handoff;
mod heap;
mod held;
mod modes;
mod overhead;
mod pg_cpu;
mod plots;
mod report;
mod server;
mod stamp;
mod stats;

use std::path::PathBuf;
use std::time::Duration;

use dlock::backend::OwnerId;

#[global_allocator]
static ALLOCATOR: heap::Counting = heap::Counting;

/// Errors of the benchmark.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Results of the benchmark.
pub type Res<T> = Result<T, BoxError>;

/// How long and how hard each scenario runs.
#[derive(Clone, Debug)]
pub struct Config {
    /// Redis URL.
    pub redis_url: String,
    /// PostgreSQL connection string.
    pub pg_conn: String,
    /// A random tag for this run's keys.
    pub run: String,
    /// A random number for this run's advisory keys.
    pub run_seed: i64,
    /// The 10-second CI version.
    pub smoke: bool,
    /// Where the report goes.
    pub out: PathBuf,
    /// Scenarios to run (all when empty).
    pub only: Vec<String>,
    /// Interleaved rounds per uncontended row.
    pub rounds: usize,
    /// Length of one round.
    pub round: Duration,
    /// Length of one handoff run.
    pub handoff_time: Duration,
    /// Blocks and calls per block of the macro comparison.
    pub macro_blocks: usize,
    /// Calls per block.
    pub macro_calls: u32,
    /// Leases held in scenario 4.
    pub held_leases: usize,
    /// How long they are held.
    pub held_window: Duration,
    /// Length of one cross-process run.
    pub cross_time: Duration,
    /// Cycles per implementation and round in the server-CPU scenario.
    pub server_cycles: u64,
    /// Rounds of the server-CPU scenario.
    pub server_rounds: usize,
    /// Resignations timed per backend in the election scenario.
    pub election_resignations: usize,
    /// Leaders killed per backend in the election scenario.
    pub election_kills: usize,
}

/// What this process is: the benchmark, or a copy of it the benchmark
/// started.
enum Role {
    Bench,
    /// `--child`: a contender of the cross-process scenario.
    Child(Vec<String>),
    /// `--campaigner`: a campaigner of the election scenario.
    Campaigner(Vec<String>),
}

impl Config {
    fn from_args() -> Res<(Self, Role)> {
        let mut args = std::env::args().skip(1);
        let mut smoke = false;
        let mut out = None;
        let mut only = Vec::new();
        let mut role = Role::Bench;
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--smoke" => smoke = true,
                "--out" => out = args.next().map(PathBuf::from),
                "--only" => {
                    only = args.next().unwrap_or_default().split(',').map(str::to_owned).collect();
                    if let Some(unknown) = only.iter().find(|s| !document::ORDER.contains(&s.as_str())) {
                        return Err(format!("unknown scenario {unknown:?} after --only (the scenarios: {})", document::ORDER.join(",")).into());
                    }
                }
                "--child" => role = Role::Child(args.by_ref().collect()),
                "--campaigner" => role = Role::Campaigner(args.by_ref().collect()),
                // `cargo bench` passes this to every bench target.
                "--bench" => {}
                other => return Err(format!("unknown argument {other} (try --smoke, --out PATH, --only cycle,handoff,macro,held,cross,server,election,acks,modes)").into()),
            }
        }
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let id = OwnerId::random()?;
        let seed = i64::from_le_bytes(id.as_bytes()[..8].try_into().unwrap_or_default()) >> 1;
        let cfg = Config {
            redis_url: std::env::var("DLOCK_REDIS_URL")
                .unwrap_or_else(|_| "redis://127.0.0.1:6379".into()),
            pg_conn: std::env::var("DLOCK_PG_URL").unwrap_or_else(|_| {
                "host=127.0.0.1 user=postgres dbname=test sslmode=disable".into()
            }),
            run: id.to_string()[..12].to_owned(),
            run_seed: seed,
            smoke,
            out: out.unwrap_or_else(|| {
                if smoke {
                    root.join("target/bench-smoke.md")
                } else {
                    root.join("BENCHMARKS.md")
                }
            }),
            only,
            rounds: if smoke { 1 } else { 5 },
            round: if smoke {
                Duration::from_millis(150)
            } else {
                Duration::from_millis(1500)
            },
            handoff_time: if smoke {
                Duration::from_millis(400)
            } else {
                Duration::from_secs(5)
            },
            macro_blocks: if smoke { 2 } else { 60 },
            macro_calls: if smoke { 2_000 } else { 10_000 },
            held_leases: if smoke { 1_000 } else { 10_000 },
            held_window: if smoke {
                Duration::from_millis(500)
            } else {
                Duration::from_secs(60)
            },
            cross_time: if smoke {
                Duration::from_millis(300)
            } else {
                Duration::from_secs(5)
            },
            server_cycles: if smoke { 1_000 } else { 20_000 },
            server_rounds: if smoke { 1 } else { 5 },
            election_resignations: if smoke { 3 } else { 20 },
            election_kills: if smoke { 1 } else { 5 },
        };
        Ok((cfg, role))
    }

    fn wants(&self, scenario: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|s| s == scenario)
    }
}

fn main() -> Res<()> {
    let (cfg, role) = Config::from_args()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        match role {
            Role::Bench => {}
            Role::Child(args) => {
                return match args.as_slice() {
                    [backend, key, dir, start, end, mode] => {
                        cross::child(
                            &cfg,
                            backend,
                            key,
                            dir.as_ref(),
                            start.parse()?,
                            end.parse()?,
                            mode == "fair",
                        )
                        .await
                    }
                    _ => Err("--child BACKEND KEY DIR START_NS END_NS fair|plain".into()),
                };
            }
            Role::Campaigner(args) => {
                return match args.as_slice() {
                    [backend, name, dir, ttl_ms] => {
                        election::campaigner(
                            &cfg,
                            backend,
                            name,
                            dir.as_ref(),
                            Duration::from_millis(ttl_ms.parse()?),
                        )
                        .await
                    }
                    _ => Err("--campaigner BACKEND NAME DIR TTL_MS".into()),
                };
            }
        }
        // Read first: a report it could not update is refused before
        // minutes of measuring, not after. A whole run keeps nothing, so
        // it writes any file anew.
        let existing = if cfg.only.is_empty() {
            Vec::new()
        } else {
            document::existing_sections(&cfg.out)?
        };
        let (facts, sections) = report::run_all(&cfg).await?;
        let report = document::write(&cfg, &existing, &facts, &sections)?;
        println!("{report}");
        eprintln!("wrote {}", cfg.out.display());
        Ok(())
    })
}

//! The reference article's timeline, live.
//!
//! Three replica processes run one "hourly" job on a fast clock (a tick every
//! second), each guarded by `#[distributed_lock]` on the file backend. Each
//! tick exactly one replica runs it. At tick 3 the replica that runs the job
//! is paused (SIGSTOP, as a long GC pause or a stalled disk would) for longer
//! than its ttl; at tick 4 another replica takes the lock over with a higher
//! fencing token. When the paused replica resumes it still believes it holds
//! the lock and writes — and the fenced store rejects its stale token.
//!
//! Run it with `cargo run --example demo`. No server is needed. The same
//! timeline on Redis or PostgreSQL: `-- --redis redis://127.0.0.1:6379` or
//! `-- --pg "host=127.0.0.1 user=postgres dbname=test"`.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock::fence::FencedCell;
use dlock::file::FileBackend;
#[cfg(feature = "pg")]
use dlock::pg::PgBackend;
#[cfg(feature = "redis")]
use dlock::redis::RedisBackend;
use dlock::{FencingToken, LockError, distributed_lock, registry};
use tokio::sync::oneshot;

const REPLICAS: usize = 3;
const TICKS: u64 = 6;
const TICK: Duration = Duration::from_secs(1);
const PAUSE_AT_TICK: u64 = 3;
const PAUSE_FOR: Duration = Duration::from_millis(2500);

/// Which lock store the replicas share.
#[derive(Clone, Debug)]
enum Store {
    File(PathBuf),
    #[cfg(feature = "redis")]
    Redis(String),
    #[cfg(feature = "pg")]
    Pg(String),
}

impl Store {
    /// How the coordinator tells a replica which store to use.
    fn to_args(&self) -> [String; 2] {
        match self {
            Store::File(dir) => ["file".into(), dir.display().to_string()],
            #[cfg(feature = "redis")]
            Store::Redis(url) => ["redis".into(), url.clone()],
            #[cfg(feature = "pg")]
            Store::Pg(conn) => ["pg".into(), conn.clone()],
        }
    }

    fn from_args(kind: &str, arg: &str) -> Option<Store> {
        match kind {
            "file" => Some(Store::File(PathBuf::from(arg))),
            #[cfg(feature = "redis")]
            "redis" => Some(Store::Redis(arg.to_owned())),
            #[cfg(feature = "pg")]
            "pg" => Some(Store::Pg(arg.to_owned())),
            _ => None,
        }
    }

    fn describe(&self) -> String {
        match self {
            Store::File(dir) => format!("file backend in {}", dir.display()),
            #[cfg(feature = "redis")]
            Store::Redis(_) => "Redis backend".into(),
            #[cfg(feature = "pg")]
            Store::Pg(_) => "PostgreSQL backend".into(),
        }
    }
}

const USAGE: &str = "usage: cargo run --example demo [-- --dir LOCK_DIR | --redis URL | --pg CONN]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    // Only the directory the demo made for itself is removed at the end:
    // one given with --dir is the user's.
    let mut own_dir = None;
    let store = match words.as_slice() {
        ["--replica", kind, arg] => {
            return match Store::from_args(kind, arg) {
                Some(store) => replica(store),
                None => ExitCode::FAILURE,
            };
        }
        [] => {
            let dir = std::env::temp_dir().join(format!("dlock-demo-{}", std::process::id()));
            own_dir = Some(dir.clone());
            Store::File(dir)
        }
        ["--dir", dir] => Store::File(PathBuf::from(dir)),
        #[cfg(feature = "redis")]
        ["--redis", url] => Store::Redis((*url).to_owned()),
        #[cfg(feature = "pg")]
        ["--pg", conn] => Store::Pg((*conn).to_owned()),
        #[cfg(not(feature = "redis"))]
        ["--redis", _] => return without_feature("redis"),
        #[cfg(not(feature = "pg"))]
        ["--pg", _] => return without_feature("pg"),
        ["--help" | "-h"] => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = coordinator(store);
    if let Some(dir) = &own_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    outcome
}

/// `--redis` or `--pg` asked of a demo built without that backend.
#[cfg(not(all(feature = "redis", feature = "pg")))]
fn without_feature(backend: &str) -> ExitCode {
    eprintln!(
        "demo: --{backend} needs dlock's `{backend}` feature (on by default): \
         cargo run --example demo --features {backend} -- --{backend} ..."
    );
    ExitCode::FAILURE
}

// ---------------------------------------------------------------- replica --

/// The job every replica runs on every tick: at most one replica at a time,
/// and the key stays held for at least 800ms so a replica that comes late to
/// the same tick does not run it twice. `on_lost = "finish"` lets a paused
/// holder carry on as a real one would: only the fenced store can stop it.
#[distributed_lock(
    key = "hourly-report",
    ttl = "1s",
    wait = "600ms",
    min_hold = "800ms",
    backend = "demo",
    on_lost = "finish"
)]
async fn hourly_report(
    tick: u64,
    store: Arc<StoreClient>,
    token: FencingToken,
) -> Result<(), LockError> {
    say(&format!("RAN {tick} {token}"));
    // The work. The coordinator may pause this process right here.
    tokio::time::sleep(Duration::from_millis(200)).await;
    store.write(tick, token).await
}

/// This replica's side of the store: writes go to the coordinator, which
/// holds the fenced resource, and come back accepted or rejected.
#[derive(Default)]
struct StoreClient {
    pending: Mutex<HashMap<u64, oneshot::Sender<Result<(), LockError>>>>,
}

impl StoreClient {
    async fn write(&self, tick: u64, token: FencingToken) -> Result<(), LockError> {
        let (tx, rx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(tick, tx);
        say(&format!("WRITE {tick} {token}"));
        rx.await.unwrap_or_else(|_| {
            Err(LockError::InvalidOption {
                option: "store",
                reason: "the coordinator went away".into(),
            })
        })
    }

    fn answer(&self, tick: u64, outcome: Result<(), LockError>) {
        if let Some(tx) = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&tick)
        {
            let _ = tx.send(outcome);
        }
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn replica(store: Store) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("replica: {err}");
            return ExitCode::FAILURE;
        }
    };
    let registered = runtime.block_on(async {
        match store {
            Store::File(dir) => FileBackend::open(dir).map(|b| registry().register("demo", b)),
            #[cfg(feature = "redis")]
            Store::Redis(url) => RedisBackend::connect(&url)
                .await
                .map(|b| registry().register("demo", b)),
            #[cfg(feature = "pg")]
            Store::Pg(conn) => PgBackend::connect(&conn)
                .await
                .map(|b| registry().register("demo", b)),
        }
    });
    if let Err(err) = registered {
        eprintln!("replica: {err}");
        return ExitCode::FAILURE;
    }
    runtime.block_on(async {
        let store = Arc::new(StoreClient::default());
        let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut jobs = Vec::new();
        while let Some(line) = lines.recv().await {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["TICK", tick] => {
                    let Ok(tick) = tick.parse::<u64>() else {
                        continue;
                    };
                    let store = store.clone();
                    jobs.push(tokio::spawn(async move {
                        match hourly_report(tick, store).await {
                            Ok(()) => say(&format!("DONE {tick}")),
                            Err(err) if err.is_contention() => say(&format!("SKIP {tick}")),
                            Err(LockError::StaleToken {
                                offered, highest, ..
                            }) => say(&format!("STALE {tick} {offered} {highest}")),
                            Err(err) => say(&format!("FAIL {tick} {err}")),
                        }
                    }));
                }
                ["ACK", tick, "ok"] => {
                    if let Ok(tick) = tick.parse() {
                        store.answer(tick, Ok(()));
                    }
                }
                ["ACK", tick, "stale", offered, highest] => {
                    if let (Ok(tick), Ok(offered), Ok(highest)) =
                        (tick.parse(), offered.parse(), highest.parse())
                    {
                        store.answer(
                            tick,
                            Err(LockError::StaleToken {
                                resource: "report-store".into(),
                                offered: FencingToken::new(offered),
                                highest: FencingToken::new(highest),
                            }),
                        );
                    }
                }
                ["QUIT"] => break,
                _ => {}
            }
        }
        for job in jobs {
            let _ = job.await;
        }
    });
    ExitCode::SUCCESS
}

// ------------------------------------------------------------ coordinator --

struct Replica {
    name: String,
    child: Child,
    stdin: ChildStdin,
    paused: bool,
}

impl Replica {
    fn send(&mut self, line: &str) {
        let _ = writeln!(self.stdin, "{line}");
        let _ = self.stdin.flush();
    }

    fn signal(&self, signal: libc::c_int) -> bool {
        // SAFETY: kill(2) on our own child's pid has no memory-safety
        // preconditions.
        unsafe { libc::kill(self.child.id() as libc::pid_t, signal) == 0 }
    }
}

/// The timeline, and what must hold for the demo to pass.
#[derive(Default)]
struct Story {
    ran: BTreeMap<u64, Vec<String>>,
    accepted: u64,
    stale_rejected: u64,
    paused: bool,
    took_over: bool,
    failures: Vec<String>,
}

fn coordinator(store_kind: Store) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(err) => {
            eprintln!("demo: cannot find its own binary: {err}");
            return ExitCode::FAILURE;
        }
    };
    let started = Instant::now();
    let log = |line: &str| println!("[{:5.2}s] {line}", started.elapsed().as_secs_f64());
    println!(
        "dlock demo: {REPLICAS} replicas, one \"hourly\" job, a tick every {TICK:?}; lock ttl 1s, {}",
        store_kind.describe()
    );
    // A PostgreSQL session lock lives as long as its connection: a paused
    // holder keeps it (nobody takes over, nobody else writes), which is safe
    // too, just different from a ttl store.
    #[cfg(feature = "pg")]
    let expect_takeover = !matches!(store_kind, Store::Pg(_));
    #[cfg(not(feature = "pg"))]
    let expect_takeover = true;
    if !expect_takeover {
        println!(
            "(PostgreSQL: a paused holder keeps its session and so its lock; the ticks during \
             the pause are skipped rather than taken over)"
        );
    }

    let (events_tx, events) = mpsc::channel::<(usize, String)>();
    let mut replicas = Vec::new();
    for i in 0..REPLICAS {
        let spawned = Command::new(&exe)
            .arg("--replica")
            .args(store_kind.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(err) => {
                eprintln!("demo: cannot start a replica: {err}");
                return ExitCode::FAILURE;
            }
        };
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            eprintln!("demo: replica pipes missing");
            return ExitCode::FAILURE;
        };
        let tx = events_tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send((i, line)).is_err() {
                    break;
                }
            }
        });
        replicas.push(Replica {
            name: format!("replica-{}", i + 1),
            child,
            stdin,
            paused: false,
        });
    }

    let store = FencedCell::new("report-store", Vec::<u64>::new());
    let mut story = Story::default();
    let mut resume_at: Option<(usize, Instant)> = None;
    let mut tokens: HashMap<(usize, u64), u64> = HashMap::new();
    let end = started + TICK * (TICKS as u32) + PAUSE_FOR;
    let mut next_tick = (1u64, started + Duration::from_millis(300));

    while Instant::now() < end {
        let now = Instant::now();
        if next_tick.0 <= TICKS && now >= next_tick.1 {
            log(&format!("tick {}", next_tick.0));
            for replica in replicas.iter_mut().filter(|r| !r.paused) {
                replica.send(&format!("TICK {}", next_tick.0));
            }
            next_tick = (next_tick.0 + 1, next_tick.1 + TICK);
        }
        if let Some((i, at)) = resume_at
            && now >= at
        {
            replicas[i].signal(libc::SIGCONT);
            replicas[i].paused = false;
            resume_at = None;
            log(&format!(
                "  {} resumes (SIGCONT), still believing it holds the lock",
                replicas[i].name
            ));
        }
        let wait = [next_tick.1, resume_at.map_or(end, |(_, at)| at), end]
            .into_iter()
            .min()
            .unwrap_or(end)
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let Ok((i, line)) = events.recv_timeout(wait) else {
            continue;
        };
        let name = replicas[i].name.clone();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["RAN", tick, token] => {
                let (Ok(tick), Ok(token)) = (tick.parse::<u64>(), token.parse::<u64>()) else {
                    continue;
                };
                tokens.insert((i, tick), token);
                let ran = story.ran.entry(tick).or_default();
                ran.push(name.clone());
                let takeover = story.paused && !story.took_over && tick > PAUSE_AT_TICK;
                log(&format!(
                    "  {name} takes the lock and runs the job (token {token}){}",
                    if takeover {
                        " — the paused holder's ttl ran out, so it takes over"
                    } else {
                        ""
                    }
                ));
                story.took_over |= takeover;
                if tick == PAUSE_AT_TICK && !story.paused && replicas[i].signal(libc::SIGSTOP) {
                    replicas[i].paused = true;
                    story.paused = true;
                    resume_at = Some((i, Instant::now() + PAUSE_FOR));
                    log(&format!(
                        "  {name} is paused (SIGSTOP) for {PAUSE_FOR:?}, longer than its 1s ttl: \
                         a GC pause, a stalled disk"
                    ));
                }
            }
            ["SKIP", tick] => log(&format!("  {name} skips tick {tick}: the lock is held")),
            ["WRITE", tick, token] => {
                let (Ok(tick), Ok(token)) = (tick.parse::<u64>(), token.parse::<u64>()) else {
                    continue;
                };
                match store.write(FencingToken::new(token), |reports| reports.push(tick)) {
                    Ok(()) => {
                        story.accepted += 1;
                        log(&format!(
                            "  store accepts {name}'s report for tick {tick} (token {token})"
                        ));
                        replicas[i].send(&format!("ACK {tick} ok"));
                    }
                    Err(LockError::StaleToken {
                        offered, highest, ..
                    }) => {
                        story.stale_rejected += 1;
                        log(&format!(
                            "  store REJECTS {name}'s write for tick {tick}: stale token {offered}, \
                             it has already accepted {highest}"
                        ));
                        replicas[i].send(&format!("ACK {tick} stale {offered} {highest}"));
                    }
                    Err(err) => story.failures.push(format!("{name}: {err}")),
                }
            }
            ["DONE", _] | ["STALE", ..] => {}
            ["FAIL", rest @ ..] => story.failures.push(format!("{name}: {}", rest.join(" "))),
            _ => {}
        }
    }

    for replica in &mut replicas {
        if replica.paused {
            replica.signal(libc::SIGCONT);
        }
        replica.send("QUIT");
    }
    for replica in &mut replicas {
        let _ = replica.child.wait();
    }
    let (reports, highest) = store.read();
    println!();
    println!(
        "summary: {} ticks, writes accepted: {}, stale writes rejected: {}, stale writes accepted: 0",
        TICKS, story.accepted, story.stale_rejected
    );
    println!(
        "store holds reports for ticks {reports:?}, highest token {}",
        highest.map_or_else(|| "none".into(), |t| t.to_string())
    );

    let mut problems = story.failures.clone();
    for tick in 1..=TICKS {
        match story.ran.get(&tick).map(Vec::len) {
            Some(1) => {}
            Some(n) => problems.push(format!("tick {tick} ran {n} times")),
            None if !expect_takeover => {}
            None => problems.push(format!("tick {tick} ran on no replica")),
        }
    }
    if expect_takeover && !story.took_over {
        problems.push("no replica took over from the paused one".into());
    }
    if expect_takeover && story.stale_rejected == 0 {
        problems.push("the paused replica's stale write was not rejected".into());
    }
    if problems.is_empty() {
        if expect_takeover {
            println!(
                "every tick ran on exactly one replica; the paused holder's write was fenced off."
            );
        } else {
            println!("no tick ran twice; the paused holder kept its lock until it resumed.");
        }
        ExitCode::SUCCESS
    } else {
        for problem in problems {
            eprintln!("demo: unexpected: {problem}");
        }
        ExitCode::FAILURE
    }
}

//! Leader election, live: three replicas of a tiny service, one of which
//! runs a periodic job as leader.
//!
//! Each replica process campaigns in the election `leader-example` with
//! `Election::lead`; the leader runs its job every 300ms, checking its term
//! before each run and printing the term's fencing token. The coordinator
//! follows the election with `Election::observe` and prints every change.
//! Then it kills the leader (SIGKILL) and another replica is elected; asks
//! the new leader to resign and the third replica takes over at once; and
//! stops them all. The fencing tokens of the terms rise, and no job ever
//! runs under an older term after a newer one began.
//!
//! Run it with `cargo run --example leader`: the file backend in a temporary
//! directory, no server needed, and a killed leader is replaced at once (its
//! lock dies with its process). On Redis, which cannot see a process die,
//! the killed leader is replaced when its 2s ttl runs out:
//! `-- --redis redis://127.0.0.1:6379`. On PostgreSQL, whose locks end with
//! the leader's session, at once again:
//! `-- --pg "host=127.0.0.1 user=postgres dbname=test"`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dlock::election::{Election, Leader, Term};
use dlock::file::FileBackend;
#[cfg(feature = "pg")]
use dlock::pg::PgBackend;
#[cfg(feature = "redis")]
use dlock::redis::RedisBackend;
use dlock::{Backend, FencingToken, LockError};
use tokio::sync::watch;

const REPLICAS: usize = 3;
const ELECTION: &str = "leader-example";
/// A crashed leader is replaced within this on a store that cannot see it
/// die; a live one renews every third of it.
const TTL: Duration = Duration::from_secs(2);
const JOB_EVERY: Duration = Duration::from_millis(300);
/// How many job runs each leader shows before the coordinator acts.
const RUNS_PER_TERM: usize = 4;
/// The longest the coordinator waits for any one step of the timeline.
const STEP_TIMEOUT: Duration = Duration::from_secs(15);

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

    async fn connect(&self) -> Result<Arc<dyn Backend>, LockError> {
        Ok(match self {
            Store::File(dir) => Arc::new(FileBackend::open(dir)?),
            #[cfg(feature = "redis")]
            Store::Redis(url) => Arc::new(RedisBackend::connect(url).await?),
            #[cfg(feature = "pg")]
            Store::Pg(conn) => Arc::new(PgBackend::connect(conn).await?),
        })
    }
}

const USAGE: &str = "usage: cargo run --example leader [-- --redis URL | --pg CONN]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let (store, own_dir) = match words.as_slice() {
        ["--replica", number, kind, arg] => {
            return match (number.parse(), Store::from_args(kind, arg)) {
                (Ok(number), Some(store)) => replica(number, store),
                _ => ExitCode::FAILURE,
            };
        }
        [] => {
            let dir = std::env::temp_dir().join(format!("dlock-leader-{}", std::process::id()));
            (Store::File(dir.clone()), Some(dir))
        }
        #[cfg(feature = "redis")]
        ["--redis", url] => (Store::Redis((*url).to_owned()), None),
        #[cfg(feature = "pg")]
        ["--pg", conn] => (Store::Pg((*conn).to_owned()), None),
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

/// `--redis` or `--pg` asked of an example built without that backend.
#[cfg(not(all(feature = "redis", feature = "pg")))]
fn without_feature(backend: &str) -> ExitCode {
    eprintln!(
        "leader: --{backend} needs dlock's `{backend}` feature (on by default): \
         cargo run --example leader --features {backend} -- --{backend} ..."
    );
    ExitCode::FAILURE
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// One line to the coordinator; a coordinator gone is no reason to panic.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

// ---------------------------------------------------------------- replica --

/// What the coordinator asks of a replica, one line on its stdin.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Order {
    Serve,
    /// End the job loop, so `lead` resigns; campaign no more.
    Resign,
    /// Stop: resign if leading, stop campaigning otherwise.
    Quit,
}

fn replica(number: usize, store: Store) -> ExitCode {
    let identity = format!("replica-{number} (pid {})", std::process::id());
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("{identity}: {err}");
            return ExitCode::FAILURE;
        }
    };
    let (orders_tx, orders) = watch::channel(Order::Serve);
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines().map_while(Result::ok) {
            match line.trim() {
                "resign" => orders_tx.send_replace(Order::Resign),
                "quit" => orders_tx.send_replace(Order::Quit),
                _ => continue,
            };
        }
        // The coordinator went away: stop too.
        orders_tx.send_replace(Order::Quit);
    });
    runtime.block_on(async move {
        let election = match campaigner(&store, &identity).await {
            Ok(election) => election,
            Err(err) => {
                say(&format!("{identity}: error: {err}"));
                return ExitCode::FAILURE;
            }
        };
        // Leads until told to quit: then a campaign just stops, and a leader
        // drops its job and resigns before `lead_until` returns, so the
        // next replica is elected at once.
        let mut quit = orders.clone();
        let shutdown = async move {
            let _ = quit.wait_for(|order| *order == Order::Quit).await;
        };
        let outcome = election
            .lead_until(|term| periodic_job(term, orders.clone()), shutdown)
            .await;
        match outcome {
            Ok(Some(runs)) => say(&format!(
                "{identity}: resigned after {runs} job runs; campaigns no more"
            )),
            Ok(None) => say(&format!("{identity}: stops")),
            Err(err) => {
                say(&format!("{identity}: error: {err}"));
                return ExitCode::FAILURE;
            }
        }
        ExitCode::SUCCESS
    })
}

async fn campaigner(store: &Store, identity: &str) -> Result<Election, LockError> {
    Ok(Election::new(ELECTION, identity, TTL)?.on(store.connect().await?))
}

/// The leader's work: a job run every [`JOB_EVERY`] until the coordinator
/// asks this replica to resign or quit; returns how many runs it made.
async fn periodic_job(term: Term, mut orders: watch::Receiver<Order>) -> usize {
    let (identity, token) = (term.identity(), term.token());
    say(&format!("{identity}: elected, token {token}"));
    let mut runs = 0;
    loop {
        tokio::select! {
            _ = orders.wait_for(|order| *order != Order::Serve) => return runs,
            () = tokio::time::sleep(JOB_EVERY) => {}
        }
        if term.check().is_err() {
            // Lost: never run on a term known to be over. `lead_until`
            // counts the return as the loss and campaigns again.
            return runs;
        }
        runs += 1;
        say(&format!("{identity}: job run {runs} under token {token}"));
    }
}

// ------------------------------------------------------------ coordinator --

/// What reaches the coordinator: replicas' lines, and the observer's news.
enum Event {
    Line(String),
    Closed(usize),
    Leader(Option<Leader>),
    WatchFailed(String),
}

struct Replica {
    identity: String,
    child: Child,
    stdin: ChildStdin,
    running: bool,
}

impl Replica {
    fn send(&mut self, line: &str) {
        let _ = writeln!(self.stdin, "{line}");
        let _ = self.stdin.flush();
    }
}

struct Coordinator {
    started: Instant,
    events: mpsc::Receiver<Event>,
    replicas: Vec<Replica>,
    /// Every leader the observer reported, in order.
    terms: Vec<Leader>,
    /// The last observer report: `Some(None)` while nobody leads.
    current: Option<Option<Leader>>,
    /// Job runs by token, and the tokens of all runs in the order reported.
    runs: HashMap<FencingToken, usize>,
    run_tokens: Vec<FencingToken>,
    /// The last step the coordinator took and when, to time the hand-over.
    last_step: Option<(&'static str, Instant)>,
    problems: Vec<String>,
}

impl Coordinator {
    fn log(&self, line: &str) {
        println!("[{:5.2}s] {line}", self.started.elapsed().as_secs_f64());
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Line(line) => {
                self.log(&format!("  {line}"));
                let Some((_, said)) = line.split_once(": ") else {
                    return;
                };
                let words: Vec<&str> = said.split_whitespace().collect();
                if let ["job", "run", _, "under", "token", token] = words.as_slice()
                    && let Ok(token) = token.parse()
                {
                    let token = FencingToken::new(token);
                    *self.runs.entry(token).or_default() += 1;
                    self.run_tokens.push(token);
                } else if said.starts_with("error:") {
                    self.problems.push(line.clone());
                }
            }
            Event::Closed(i) => self.replicas[i].running = false,
            Event::Leader(None) => {
                self.log("leader: nobody");
                self.current = Some(None);
            }
            Event::Leader(Some(leader)) => {
                let after = self
                    .last_step
                    .take()
                    .map_or_else(String::new, |(step, at)| {
                        format!(" ({:.2}s after the {step})", at.elapsed().as_secs_f64())
                    });
                self.log(&format!(
                    "leader: {}, token {}{after}",
                    leader.identity, leader.token
                ));
                self.terms.push(leader.clone());
                self.current = Some(Some(leader));
            }
            Event::WatchFailed(err) => self.log(&format!("observer: {err} (watching on)")),
        }
    }

    /// Relays events until `ready` says what it waited for.
    fn wait_for<T>(
        &mut self,
        what: &str,
        within: Duration,
        mut ready: impl FnMut(&Self) -> Option<T>,
    ) -> Result<T, String> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(found) = ready(self) {
                return Ok(found);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(event) => self.handle(event),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(format!("no {what} within {within:?}"));
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(format!(
                        "no {what}: every replica and the observer are gone"
                    ));
                }
            }
        }
    }

    /// Waits for a leader newer than `after`, one of the replicas, to have
    /// run [`RUNS_PER_TERM`] jobs; returns its index and term.
    fn leader_with_runs(&mut self, after: Option<FencingToken>) -> Result<(usize, Leader), String> {
        self.wait_for("new leader running its job", STEP_TIMEOUT, |me| {
            let leader = me.current.clone().flatten()?;
            if after.is_some_and(|after| leader.token <= after)
                || me.runs.get(&leader.token).copied().unwrap_or(0) < RUNS_PER_TERM
            {
                return None;
            }
            let index = me
                .replicas
                .iter()
                .position(|r| r.running && r.identity == leader.identity)?;
            Some((index, leader))
        })
    }

    /// The timeline: kill the first leader, make the second resign, let the
    /// third run.
    fn run(&mut self) -> Result<(), String> {
        let (first, leader) = self.leader_with_runs(None)?;
        self.log(&format!(
            "kill -KILL {} (replica-{}, the leader)",
            self.replicas[first].child.id(),
            first + 1
        ));
        // `Child::kill` is SIGKILL on Unix: no chance to resign.
        self.replicas[first]
            .child
            .kill()
            .map_err(|err| format!("cannot kill the leader: {err}"))?;
        let _ = self.replicas[first].child.wait();
        self.last_step = Some(("kill", Instant::now()));

        let (second, leader) = self.leader_with_runs(Some(leader.token))?;
        self.log(&format!(
            "asking {} to resign",
            self.replicas[second].identity
        ));
        self.replicas[second].send("resign");
        self.last_step = Some(("resignation", Instant::now()));

        self.leader_with_runs(Some(leader.token))?;
        Ok(())
    }

    fn stop(&mut self) {
        self.log("stopping the replicas");
        self.last_step = None;
        for replica in self.replicas.iter_mut().filter(|r| r.running) {
            replica.send("quit");
        }
        let stopped = self.wait_for("stop of every replica", TTL * 2, |me| {
            me.replicas.iter().all(|r| !r.running).then_some(())
        });
        if let Err(err) = stopped {
            self.problems.push(err);
        }
        for replica in &mut self.replicas {
            let _ = replica.child.kill();
            let _ = replica.child.wait();
        }
        // The last leader resigned: show the observer saying so.
        let _ = self.wait_for("report of nobody leading", Duration::from_secs(1), |me| {
            (me.current == Some(None)).then_some(())
        });
    }
}

fn coordinator(store: Store) -> ExitCode {
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("leader: {err}");
            return ExitCode::FAILURE;
        }
    };
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(err) => {
            eprintln!("leader: cannot find its own binary: {err}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "dlock leader election: {REPLICAS} replicas, the leader runs a job every {JOB_EVERY:?}; \
         ttl {TTL:?}, {}",
        store.describe()
    );
    let (events_tx, events) = mpsc::channel();

    // The observer: every change of leader, as any process could follow it.
    let watch = runtime.block_on(async {
        Election::new(ELECTION, "coordinator", TTL)?
            .on(store.connect().await?)
            .observe()
    });
    let mut watch = match watch {
        Ok(watch) => watch,
        Err(err) => {
            eprintln!("leader: cannot follow the election: {err}");
            return ExitCode::FAILURE;
        }
    };
    let tx = events_tx.clone();
    runtime.spawn(async move {
        loop {
            let event = match watch.changed().await {
                Ok(leader) => Event::Leader(leader),
                Err(err) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Event::WatchFailed(err.to_string())
                }
            };
            if tx.send(event).is_err() {
                break;
            }
        }
    });

    let mut replicas = Vec::new();
    for i in 0..REPLICAS {
        let spawned = Command::new(&exe)
            .arg("--replica")
            .arg((i + 1).to_string())
            .args(store.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(err) => {
                eprintln!("leader: cannot start a replica: {err}");
                return ExitCode::FAILURE;
            }
        };
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            eprintln!("leader: replica pipes missing");
            return ExitCode::FAILURE;
        };
        let tx = events_tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(Event::Line(line)).is_err() {
                    return;
                }
            }
            let _ = tx.send(Event::Closed(i));
        });
        replicas.push(Replica {
            identity: format!("replica-{} (pid {})", i + 1, child.id()),
            child,
            stdin,
            running: true,
        });
    }
    drop(events_tx);

    let mut coordinator = Coordinator {
        started: Instant::now(),
        events,
        replicas,
        terms: Vec::new(),
        current: None,
        runs: HashMap::new(),
        run_tokens: Vec::new(),
        last_step: None,
        problems: Vec::new(),
    };
    if let Err(err) = coordinator.run() {
        coordinator.problems.push(err);
    }
    coordinator.stop();
    drop(runtime);
    summary(coordinator)
}

fn summary(coordinator: Coordinator) -> ExitCode {
    let Coordinator {
        terms,
        runs,
        run_tokens,
        mut problems,
        ..
    } = coordinator;
    println!();
    println!("summary: {} terms, in order:", terms.len());
    for term in &terms {
        let ran = runs.get(&term.token).copied().unwrap_or(0);
        println!("  token {} {} ({ran} job runs)", term.token, term.identity);
    }
    for pair in terms.windows(2) {
        if pair[1].token <= pair[0].token {
            problems.push(format!("observed {} after {}", pair[1], pair[0]));
        }
    }
    // A run under an older term after one under a newer term means two
    // leaders ran the job at once.
    for pair in run_tokens.windows(2) {
        if pair[1] < pair[0] {
            problems.push(format!(
                "a job ran under token {} after one under token {}",
                pair[1], pair[0]
            ));
        }
    }
    if terms.len() < REPLICAS {
        problems.push(format!("{REPLICAS} terms expected, {} seen", terms.len()));
    }
    if problems.is_empty() {
        println!("tokens rose with every term; one leader at a time ran the job.");
        ExitCode::SUCCESS
    } else {
        for problem in problems {
            eprintln!("leader: unexpected: {problem}");
        }
        ExitCode::FAILURE
    }
}

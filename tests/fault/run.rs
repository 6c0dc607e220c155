//! One fault run: start the lock server (if the backend has one), the
//! proxies and the worker processes; drive the seeded fault schedule; stop;
//! read the register; check; clean everything up (drop guards kill every
//! process the run started and remove its directories).
//!
//! A run writes what it says (the schedule first, the report last) to its
//! [`Report::log`], and to stdout as it goes when [`Settings::echo`] is on
//! (runs made in a thread of their own, as `fault::overlap` makes them,
//! print it from the test that asked for it instead).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::{BufRead as _, BufReader};
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dlock::backend::OwnerId;
use dlock::file::FileBackend;
use dlock::pg::fence::PgFence;
use dlock::pg::tokio_postgres::{self, NoTls};
use dlock::pg::{PgBackend, PgOptions};
use dlock::redis::fence::RedisFence;
use dlock::{Backend, LockKey};
use tokio::runtime::Runtime;

use super::check::{self, Cut, Event, History, Pause, Verdict};
use super::rng::Rng;
use super::worker::{self, PG_REGISTER_TABLE, TTL, WORKER_ENV, order_abandon};
use super::{now_us, pg_conn, redis_url};
use crate::redis_support::RedisServer;
use crate::support::ScratchDir;
use crate::support::proxy::Proxy;
use crate::support::seeds::{env_seed, fresh_seed};

/// What the workers do with the run's lock store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scenario {
    /// Take the lock through `#[distributed_lock]`, one increment a lease.
    Lock,
    /// Campaign with `Election::lead` (the lock's key names the election);
    /// the leader increments step after step under its term's token.
    Election,
    /// As `Lock`, with `#[distributed_lock(fair = true, wait = "8s")]`:
    /// waiters queue and a release hands the key to the first. The checker
    /// also looks at every acquisition that timed out (`check::FairVerdict`).
    Fair,
    /// Take one of `worker::PERMITS` permits of the key and increment the
    /// slot's own fenced register (`<run>:pool:<slot>`); the checker bounds
    /// the holders at once (`modes::PermitsVerdict`).
    Permits,
    /// Half the leases write (`mode = "exclusive"`, an increment), half
    /// read (`mode = "shared"`, fenced touches); the checker adds that no
    /// current reader is refused (`modes::ReadWriteVerdict`).
    ReadWrite,
}

/// Where the locks live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lock {
    /// `FileBackend` in a directory of the run's own (memory locks cannot
    /// span processes; the file backend is their multi-process twin).
    File,
    /// `RedisBackend` on a redis-server of the run's own.
    Redis,
    /// `PgBackend` on the shared PostgreSQL server.
    Pg,
    /// `EtcdBackend` on a three-member etcd cluster of the run's own, each
    /// worker through its proxy to one member.
    #[cfg(feature = "etcd")]
    Etcd,
}

/// Where the fenced register lives (always on a server the faults leave
/// alone, so that only the fence decides what lands).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Register {
    /// A row in the shared PostgreSQL, fenced by `PgFence`.
    Pg,
    /// A hash in the shared Redis, fenced by `RedisFence`.
    Redis,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    /// SIGSTOP a holder for longer than the ttl, then SIGCONT.
    Pause,
    /// SIGKILL a holder, then start it again.
    Kill,
    /// Redis: restart the run's server (its data is lost). PostgreSQL:
    /// `pg_terminate_backend` of the holder's lock session. File: the
    /// administrator's `force_release` of the held key. etcd: SIGKILL the
    /// cluster's leader, then start it again.
    Server,
    /// Freeze a holder's link (Redis, PostgreSQL: to the lock server; file,
    /// which has no server: to the register) past the ttl, then cut it or
    /// let the held bytes through late.
    Partition,
    /// A worker makes its next few acquisitions and gives up on each at a
    /// seeded moment of a few milliseconds, as callers with deadlines do.
    Abandon,
    /// The lock store's token source goes back while a worker holds the
    /// lock. Redis: the key's fence counter is set to 1 (a promoted replica
    /// that missed writes). PostgreSQL, seeded: the token sequence is set
    /// back to 1 and every session of the workers' lock backends is
    /// terminated (a failover to a replica that missed WAL, a point-in-time
    /// restore), or a DBA drops and recreates the sequence. Not on the file
    /// backend: its counter is a durable file.
    Rewind,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fault::Pause => "pause",
            Fault::Kill => "kill",
            Fault::Server => "server",
            Fault::Partition => "partition",
            Fault::Abandon => "abandon",
            Fault::Rewind => "rewind",
        })
    }
}

/// The faults an election run drives, on every lock store: those that
/// take a leader's term away (a pause, a kill, the server-side break of the
/// run's store, a partition of the lock link; on the file backend, which
/// has no link, of the register link). Abandon and rewind are faults of
/// acquisitions and of the token source, which an election shares with the
/// lock, and the lock runs cover them.
pub fn election_faults() -> Vec<Fault> {
    vec![Fault::Pause, Fault::Kill, Fault::Server, Fault::Partition]
}

/// How long the store keeps the key of a holder that went silent (killed,
/// stopped, cut off) after its last word: the ttl; on PostgreSQL, until the
/// server ends the idle session (`idle_session_timeout` 1.5 s in the
/// workers), with half a second for the server to notice.
pub fn silent_hold(lock: Lock) -> Duration {
    match lock {
        Lock::File | Lock::Redis => TTL,
        Lock::Pg => Duration::from_secs(2),
        // A lease of whole seconds (the 1 s ttl), revoked at the leader's
        // next sweep of expired leases (500 ms) through one round of
        // consensus.
        #[cfg(feature = "etcd")]
        Lock::Etcd => Duration::from_secs(2),
    }
}

/// The faults a lock run (or a fair run) on `lock` drives.
pub fn faults_for(lock: Lock) -> Vec<Fault> {
    let mut faults = vec![
        Fault::Pause,
        Fault::Kill,
        Fault::Server,
        Fault::Partition,
        Fault::Abandon,
    ];
    // Not on the file backend (a durable counter file) nor on etcd (the
    // token is the cluster's revision, which nothing can set back short of
    // restoring another cluster's snapshot).
    if matches!(lock, Lock::Redis | Lock::Pg) {
        faults.push(Fault::Rewind);
    }
    faults
}

#[derive(Clone, Debug)]
pub struct Settings {
    pub scenario: Scenario,
    pub lock: Lock,
    pub register: Register,
    pub seed: u64,
    pub duration: Duration,
    pub workers: usize,
    /// Off: workers read and write the register plainly (the negative run).
    pub fenced: bool,
    /// Election scenario, off: leaders neither check their term nor record
    /// its loss (the negative run).
    pub heeds_term: bool,
    pub faults: Vec<Fault>,
    /// Print the run's lines as they come (else only into the report's log).
    pub echo: bool,
}

impl Settings {
    /// The settings of a lock run on `lock`, overridable through the
    /// environment (`DLOCK_FAULT_SEED`, `DLOCK_FAULT_SECS`).
    pub fn from_env(lock: Lock, default_secs: u64) -> Self {
        // The run tests set their own seeds (`fault::overlap`); this one is
        // the long run's.
        let seed = env_seed("DLOCK_FAULT_SEED")
            .or_else(|| env_seed("DLOCK_SEED"))
            .unwrap_or_else(fresh_seed);
        let secs = std::env::var("DLOCK_FAULT_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default_secs);
        Self {
            scenario: Scenario::Lock,
            lock,
            register: match lock {
                Lock::File | Lock::Redis => Register::Pg,
                Lock::Pg => Register::Redis,
                #[cfg(feature = "etcd")]
                Lock::Etcd => Register::Pg,
            },
            seed,
            duration: Duration::from_secs(secs),
            workers: 5,
            fenced: true,
            heeds_term: true,
            faults: faults_for(lock),
            echo: true,
        }
    }

    /// The same run in the election scenario, with its faults.
    pub fn election(mut self) -> Self {
        self.scenario = Scenario::Election;
        self.faults = election_faults();
        self
    }

    /// The same run in the fair scenario, on the lock runs' faults.
    pub fn fair(mut self) -> Self {
        self.scenario = Scenario::Fair;
        self.faults = faults_for(self.lock);
        self
    }

    /// The same run in the permits scenario, on the lock runs' faults.
    pub fn permits(mut self) -> Self {
        self.scenario = Scenario::Permits;
        self.faults = faults_for(self.lock);
        self
    }

    /// The same run in the read-write scenario, on the lock runs' faults.
    pub fn read_write(mut self) -> Self {
        self.scenario = Scenario::ReadWrite;
        self.faults = faults_for(self.lock);
        self
    }

    /// The fenced resources of the run's register `run`: the run's own, or
    /// (permits) one per slot.
    fn resources(&self, run: &str) -> Vec<String> {
        match self.scenario {
            Scenario::Permits => (0..worker::PERMITS)
                .map(|slot| worker::slot_resource(run, slot))
                .collect(),
            _ => vec![run.to_owned()],
        }
    }
}

/// One planned fault: the seed fixes all of it; which process holds the
/// lock at that moment (the target) is the run's.
#[derive(Clone, Debug)]
pub struct Planned {
    pub at: Duration,
    pub kind: Fault,
    pub length: Duration,
    /// Target when no process holds the lock within a few seconds.
    pub fallback_slot: usize,
    /// Partition: cut the connections at the end (else let them through).
    pub cut: bool,
    /// Abandon: after how long the worker gives up on each acquisition.
    pub give_up_after: Vec<Duration>,
    /// PostgreSQL rewind: drop and recreate the sequence (else set it back
    /// and end the workers' sessions).
    pub recreate: bool,
    /// A spare place at the end of the schedule: taken by a retry of a
    /// kind that has not hit yet, else left empty.
    pub spare: bool,
}

/// How many times a kind of fault that has not hit yet is injected again,
/// in place of the next seeded kind, before the run gives up on it. A fault
/// lands on a moment of a live system (a holder found, an acquisition in
/// flight), and a seed cannot fix that moment: so a miss is retried, not
/// taken as the run's verdict.
pub const RETRIES: usize = 6;

/// The schedule for `settings`: every fault kind once first (in a seeded
/// order), then seeded kinds at seeded moments until the end.
pub fn plan(settings: &Settings) -> Vec<Planned> {
    let mut rng = Rng::new(settings.seed);
    let mut first = settings.faults.clone();
    rng.shuffle(&mut first);
    let mut at = Duration::from_millis(rng.range(2_000, 3_000));
    let end = settings.duration.saturating_sub(Duration::from_secs(4));
    let mut planned = Vec::new();
    let mut index = 0;
    while at < end || index < first.len() {
        let kind = if index < first.len() {
            first[index]
        } else {
            settings.faults[rng.range(0, settings.faults.len() as u64 - 1) as usize]
        };
        let fault = draw(settings, kind, at, &mut rng);
        at += fault.length + Duration::from_millis(rng.range(1_000, 3_000));
        planned.push(fault);
        index += 1;
    }
    // Spare places up to the end, a second apart, taken only by the
    // retries of kinds that have not hit yet.
    while at < settings.duration {
        let mut spare = draw(settings, Fault::Abandon, at, &mut rng);
        spare.spare = true;
        planned.push(spare);
        at += Duration::from_secs(1);
    }
    planned
}

/// The retry of a kind that has not hit yet, in place of `planned`: its
/// own seeded shape, drawn from the seed and the place in the schedule, so
/// a seed replays its retries too.
fn retry(settings: &Settings, kind: Fault, planned: &Planned, index: usize) -> Planned {
    let mut rng = Rng::new(settings.seed ^ (index as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
    draw(settings, kind, planned.at, &mut rng)
}

/// One fault of `kind` at `at`, its shape drawn from `rng`.
fn draw(settings: &Settings, kind: Fault, at: Duration, rng: &mut Rng) -> Planned {
    // PostgreSQL frees a silent holder's lock only when the server ends its
    // session (idle_session_timeout 1.5 s in the workers), so pauses and
    // partitions there last longer.
    let (low, high) = match settings.lock {
        Lock::Pg => (2_500, 4_000),
        Lock::File | Lock::Redis => (1_500, 3_000),
        // The store keeps a silent holder's key up to 2 s.
        #[cfg(feature = "etcd")]
        Lock::Etcd => (2_500, 4_000),
    };
    let length = match kind {
        Fault::Pause | Fault::Partition => Duration::from_millis(rng.range(low, high)),
        Fault::Kill => Duration::from_millis(rng.range(200, 800)),
        Fault::Server => Duration::from_millis(rng.range(100, 500)),
        Fault::Abandon | Fault::Rewind => Duration::ZERO,
    };
    let give_up_after = match kind {
        // Given up within a millisecond: a Redis script is often
        // answered in less, so later give-ups (up to 3 ms) left whole
        // rounds with nothing given up mid-flight; and a PostgreSQL
        // reader's attempt, one statement, is as quick. Eight to
        // sixteen of them; a round where none lands mid-flight still
        // happens on a loaded machine, and is retried (`RETRIES`).
        Fault::Abandon => (0..rng.range(8, 16))
            .map(|_| Duration::from_micros(rng.range(0, 1_000)))
            .collect(),
        _ => Vec::new(),
    };
    Planned {
        at,
        kind,
        length,
        fallback_slot: rng.range(0, settings.workers as u64 - 1) as usize,
        cut: rng.chance(50),
        give_up_after,
        recreate: rng.chance(50),
        spare: false,
    }
}

/// Whether `fault` counts as a hit of its kind (pauses: of a holder, for
/// longer than the ttl).
fn counts_as_hit(fault: &Injected) -> bool {
    fault.hit && (fault.kind != Fault::Pause || fault.length > TTL)
}

/// What the driver injects in the place of the seeded `planned` (the
/// `index`th of the schedule): a kind not tried yet, in the seeded order
/// of the schedule's first round; else a kind that was tried and has not
/// hit yet, while it has retries left (the first such of `kinds`); else
/// `planned`'s own. So every kind has its first try early, and a fault
/// that missed is tried again at the next free place.
fn next_kind(
    kinds: &[Fault],
    schedule: &[Planned],
    injected: &[Injected],
    retried: &BTreeMap<Fault, usize>,
) -> Option<Fault> {
    let tried = |kind: Fault| injected.iter().any(|f| f.kind == kind);
    let untried = schedule[..kinds.len().min(schedule.len())]
        .iter()
        .map(|p| p.kind)
        .find(|&kind| !tried(kind));
    untried.or_else(|| {
        kinds.iter().copied().find(|&kind| {
            retried.get(&kind).copied().unwrap_or(0) < RETRIES && !has_hit(kind, injected)
        })
    })
}

/// Whether a fault of `kind` among `injected` hit.
fn has_hit(kind: Fault, injected: &[Injected]) -> bool {
    injected.iter().any(|f| f.kind == kind && counts_as_hit(f))
}

/// A fault that happened.
#[derive(Clone, Debug)]
pub struct Injected {
    pub kind: Fault,
    pub slot: usize,
    /// The fault hit: the target held the lock (server: a holder's lock was
    /// broken; abandon: at least one acquisition was given up mid-flight;
    /// rewind: the token source went back while a worker held the lock).
    pub hit: bool,
    pub length: Duration,
    /// What happened, for the report (abandon: how many were given up).
    pub note: String,
}

pub struct Report {
    pub settings: Settings,
    pub injected: Vec<Injected>,
    pub verdict: Verdict,
    pub elapsed: Duration,
    /// Everything the run said: the schedule, the report, the first
    /// violations (printed already if `settings.echo`).
    pub log: String,
}

impl Report {
    /// Prints the run's log, unless the run printed it as it went.
    pub fn print_log(&self) {
        if !self.settings.echo {
            print!("{}", self.log);
        }
    }

    /// How many faults of `kind` hit (pauses: a holder, for longer than the
    /// ttl).
    pub fn hits(&self, kind: Fault) -> usize {
        self.injected
            .iter()
            .filter(|f| f.kind == kind && counts_as_hit(f))
            .count()
    }

    pub fn by_kind(&self) -> BTreeMap<Fault, usize> {
        let mut counts = BTreeMap::new();
        for fault in &self.injected {
            *counts.entry(fault.kind).or_default() += 1;
        }
        counts
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let faults: Vec<String> = self
            .by_kind()
            .iter()
            .map(|(kind, n)| format!("{kind} {n} ({} hit)", self.hits(*kind)))
            .collect();
        let notes: Vec<String> = self
            .injected
            .iter()
            .filter(|f| !f.note.is_empty())
            .map(|f| format!("{} (slot {}): {}", f.kind, f.slot, f.note))
            .collect();
        let notes = if notes.is_empty() {
            String::new()
        } else {
            format!("\n  notes: {}", notes.join("; "))
        };
        write!(
            f,
            "fault run {:?} on {:?} locks, {:?} register, fencing {}{}, seed {}, {:?} ({} workers):\n  faults: {}{}\n  {}",
            self.settings.scenario,
            self.settings.lock,
            self.settings.register,
            if self.settings.fenced { "on" } else { "OFF" },
            heeds_term_note(&self.settings),
            self.settings.seed,
            self.elapsed,
            self.settings.workers,
            faults.join(", "),
            notes,
            self.verdict,
        )
    }
}

/// ", leaders ignore their term" for the election's negative run.
fn heeds_term_note(settings: &Settings) -> &'static str {
    if settings.scenario == Scenario::Election && !settings.heeds_term {
        ", leaders IGNORE their term"
    } else {
        ""
    }
}

/// What a run says: kept for the report, printed at once if `echo`.
struct Log {
    echo: bool,
    text: String,
}

impl Log {
    fn line(&mut self, line: &str) {
        if self.echo {
            println!("{line}");
        }
        self.text.push_str(line);
        self.text.push('\n');
    }
}

// ------------------------------------------------------------ processes --

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Idle,
    Holding,
    Working,
}

#[derive(Default)]
struct Shared {
    events: Vec<Event>,
    /// Per slot: the live process and what it is doing.
    phase: HashMap<usize, (usize, Phase)>,
    /// Per slot: whether its current or last lease was a reader's.
    reading: HashMap<usize, bool>,
}

/// The worker processes; every one is SIGKILLed and reaped on drop.
struct Workers {
    slots: Vec<Option<Child>>,
    process_of: Vec<usize>,
    next_process: usize,
    configs: Vec<worker::Config>,
    shared: Arc<Mutex<Shared>>,
    readers: Vec<JoinHandle<()>>,
    killed_at: HashMap<usize, u64>,
}

impl Workers {
    fn spawn(&mut self, slot: usize) {
        let exe = std::env::current_exe().expect("test binary path");
        let mut command = Command::new(exe);
        command
            .args([
                "fault_worker_entry",
                "--exact",
                "--ignored",
                "--nocapture",
                "--quiet",
            ])
            .env(WORKER_ENV, {
                self.configs[slot].process = self.next_process;
                self.configs[slot].encode()
            })
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: prctl is async-signal-safe; the kernel kills the worker if
        // the thread that started it (the test's) ends without cleaning up.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = command.spawn().expect("spawn a worker");
        let process = self.next_process;
        self.next_process += 1;
        self.process_of[slot] = process;
        let stdout = child.stdout.take().expect("piped stdout");
        let shared = self.shared.clone();
        self.readers.push(std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let Some(event) = Event::parse(process, &line) else {
                    continue;
                };
                let mut shared = shared.lock().unwrap_or_else(PoisonError::into_inner);
                let phase = match event.what.as_str() {
                    "BEGIN" | "TAKE" => Some(Phase::Holding),
                    "READ" => Some(Phase::Working),
                    "SEND" | "RSTALE" | "RERR" => Some(Phase::Holding),
                    "LOST" | "END" => Some(Phase::Idle),
                    _ => None,
                };
                if let Some(phase) = phase
                    && shared.phase.get(&slot).is_none_or(|(p, _)| *p <= process)
                {
                    shared.phase.insert(slot, (process, phase));
                    if matches!(event.what.as_str(), "BEGIN" | "TAKE") {
                        shared.reading.insert(slot, event.detail == "shared");
                    }
                }
                shared.events.push(event);
            }
        }));
        self.slots[slot] = Some(child);
    }

    fn pid(&self, slot: usize) -> Option<i32> {
        self.slots[slot].as_ref().map(|c| c.id() as i32)
    }

    fn signal(&self, slot: usize, signal: libc::c_int) -> bool {
        // SAFETY: kill(2) on the id of our own live (unreaped) child.
        self.pid(slot)
            .is_some_and(|pid| unsafe { libc::kill(pid, signal) } == 0)
    }

    fn kill(&mut self, slot: usize) {
        if let Some(mut child) = self.slots[slot].take() {
            // Read before the signal: from this instant on the process may
            // run no more code, so no belief of it lasts past it, and the
            // store's hold of its key runs from a word said before it.
            let killed_us = now_us();
            let _ = child.kill();
            let _ = child.wait();
            self.killed_at.insert(self.process_of[slot], killed_us);
            self.shared
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .phase
                .insert(slot, (self.process_of[slot], Phase::Idle));
        }
    }

    /// Whether the process in `slot` is between its read and its write of
    /// the register, by what it printed.
    fn is_working(&self, slot: usize) -> bool {
        let shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        shared.phase.get(&slot) == Some(&(self.process_of[slot], Phase::Working))
    }

    /// Whether another process began a lease between `from_us` and `to_us`
    /// beside the one the process in `slot` held then (in its permit slot,
    /// with permits), by what the processes printed.
    fn began_beside(&self, slot: usize, from_us: u64, to_us: u64) -> bool {
        let process = self.process_of[slot];
        let shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        let held_slot = shared
            .events
            .iter()
            .rev()
            .find(|ev| ev.process == process && ev.what == "BEGIN" && ev.t_us <= from_us)
            .and_then(|ev| ev.slot);
        shared.events.iter().any(|ev| {
            ev.process != process
                && ev.what == "BEGIN"
                && (from_us..=to_us).contains(&ev.t_us)
                && (held_slot.is_none() || ev.slot == held_slot)
        })
    }

    /// Whether the process in `slot` holds the key, by what it printed.
    fn is_holding(&self, slot: usize) -> bool {
        let shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        matches!(
            shared.phase.get(&slot),
            Some(&(process, Phase::Holding | Phase::Working)) if process == self.process_of[slot]
        )
    }

    /// Whether the process in `slot` holds the key, and not as a reader,
    /// by what it printed.
    fn holds_as_writer(&self, slot: usize) -> bool {
        let shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        matches!(
            shared.phase.get(&slot),
            Some(&(process, Phase::Holding | Phase::Working)) if process == self.process_of[slot]
        ) && shared.reading.get(&slot) != Some(&true)
    }

    /// A slot whose process holds the lock, preferring one between its read
    /// and its write (waiting up to `for_working` for one); waits up to
    /// `patience` for any.
    fn holder(&self, patience: Duration, for_working: Duration) -> Option<usize> {
        self.holder_where(patience, for_working, false)
    }

    /// [`Workers::holder`], of a writer's lease only if `writer`.
    fn holder_where(
        &self,
        patience: Duration,
        for_working: Duration,
        writer: bool,
    ) -> Option<usize> {
        let started = Instant::now();
        let deadline = started + patience;
        loop {
            let best = {
                let shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
                let pick = |want: Phase| {
                    shared
                        .phase
                        .iter()
                        .find(|(slot, (process, phase))| {
                            *phase == want
                                && self.process_of[**slot] == *process
                                && !(writer && shared.reading.get(slot) == Some(&true))
                        })
                        .map(|(slot, _)| *slot)
                };
                match pick(Phase::Working) {
                    None if started.elapsed() >= for_working => pick(Phase::Holding),
                    working => working,
                }
            };
            match best {
                Some(slot) if self.slots[slot].is_some() => return Some(slot),
                _ if Instant::now() >= deadline => return None,
                _ => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    }

    /// The first event `what` printed by the process now in `slot` at or
    /// after position `from` of the history, waiting up to `patience`.
    fn await_event(
        &self,
        slot: usize,
        what: &str,
        from: usize,
        patience: Duration,
    ) -> Option<Event> {
        let deadline = Instant::now() + patience;
        loop {
            let found = {
                let shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
                shared.events[from.min(shared.events.len())..]
                    .iter()
                    .find(|ev| ev.process == self.process_of[slot] && ev.what == what)
                    .cloned()
            };
            if found.is_some() || Instant::now() >= deadline {
                return found;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// How many events the workers have printed so far.
    fn events_seen(&self) -> usize {
        self.shared
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .events
            .len()
    }

    /// Waits for every worker to finish on its own (they stop at the
    /// deadline), then kills whatever is left.
    fn stop(&mut self, patience: Duration) {
        let deadline = Instant::now() + patience;
        for slot in 0..self.slots.len() {
            if let Some(child) = self.slots[slot].as_mut() {
                while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            self.kill(slot);
        }
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for slot in 0..self.slots.len() {
            // SIGKILL ends stopped (paused) processes too.
            self.kill(slot);
        }
    }
}

/// The PostgreSQL schema of a run's own token sequence, so that rewinding
/// it disturbs no other test on the shared server. Dropped (CASCADE) on
/// drop however the run ends; declared before the workers, so that they are
/// dead (and cannot create it again) by then.
struct RunSchema(String);

impl Drop for RunSchema {
    fn drop(&mut self) {
        // A runtime of its own: this may run while unwinding, after the
        // run's runtime is gone.
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        runtime.block_on(async {
            let Ok(Ok((client, connection))) = tokio::time::timeout(
                Duration::from_secs(10),
                tokio_postgres::connect(&pg_conn(), NoTls),
            )
            .await
            else {
                return;
            };
            tokio::spawn(connection);
            let drop_schema = format!(
                "SET lock_timeout = '10s'; DROP SCHEMA IF EXISTS {} CASCADE",
                self.0
            );
            let _ =
                tokio::time::timeout(Duration::from_secs(15), client.batch_execute(&drop_schema))
                    .await;
        });
    }
}

/// The Redis name of `key`'s fence counter (`dlock:{T}:fence`, `T` being
/// the key with `%`, `{` and `}` percent-encoded: the keyspace in the
/// module docs of `dlock_runtime::redis`).
fn redis_fence_counter(key: &LockKey) -> String {
    let mut tag = String::new();
    for c in key.as_str().chars() {
        match c {
            '%' | '{' | '}' => tag.push_str(&format!("%{:02X}", c as u32)),
            other => tag.push(other),
        }
    }
    format!("dlock:{{{tag}}}:fence")
}

// ------------------------------------------------------------------ run --

/// `host:port` of the shared PostgreSQL server, and its connection string
/// without host and port.
fn pg_parts() -> (String, String) {
    let config: tokio_postgres::Config = pg_conn().parse().expect("PostgreSQL connection string");
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let mut rest = Vec::new();
    if let Some(user) = config.get_user() {
        rest.push(format!("user={user}"));
    }
    if let Some(db) = config.get_dbname() {
        rest.push(format!("dbname={db}"));
    }
    if let Some(password) = config.get_password() {
        let password = String::from_utf8_lossy(password)
            .replace('\\', "\\\\")
            .replace('\'', "\\'");
        rest.push(format!("password='{password}'"));
    }
    (format!("{host}:{port}"), rest.join(" "))
}

/// `host:port` of the shared Redis server and the URL through `port`.
fn redis_parts() -> (String, impl Fn(u16) -> String) {
    let url = redis_url();
    let rest = url
        .split_once("://")
        .map_or(url.as_str(), |(_, rest)| rest)
        .to_owned();
    let (auth, hostport) = match rest.rsplit_once('@') {
        Some((auth, hostport)) => (format!("{auth}@"), hostport.to_owned()),
        None => (String::new(), rest.clone()),
    };
    let (hostport, db) = match hostport.split_once('/') {
        Some((hp, db)) => (hp.to_owned(), format!("/{db}")),
        None => (hostport, String::new()),
    };
    let scheme = url.split_once("://").map_or("redis", |(s, _)| s).to_owned();
    (hostport, move |port| {
        format!("{scheme}://{auth}127.0.0.1:{port}{db}")
    })
}

pub fn run(settings: Settings) -> Report {
    let started = Instant::now();
    let schedule = plan(&settings);
    let shown: Vec<String> = schedule
        .iter()
        .filter(|p| !p.spare)
        .map(|p| {
            format!(
                "{:.1}s {} {:.1}s",
                p.at.as_secs_f64(),
                p.kind,
                p.length.as_secs_f64()
            )
        })
        .collect();
    let mut log = Log {
        echo: settings.echo,
        text: String::new(),
    };
    log.line(&format!(
        "fault run: {:?} on {:?} locks, {:?} register, fencing {}{}, {} workers, {:?}, seed {} \
         (DLOCK_FAULT_SEED={} reproduces this schedule)\n  schedule: {}",
        settings.scenario,
        settings.lock,
        settings.register,
        if settings.fenced { "on" } else { "OFF" },
        heeds_term_note(&settings),
        settings.workers,
        settings.duration,
        settings.seed,
        settings.seed,
        shown.join("; ")
    ));
    let runtime = Runtime::new().expect("runtime");
    let id = OwnerId::random().expect("random");
    let run_id = format!("dlock-fault-{id}");
    // The key the workers' `#[distributed_lock(key = "dlock-fault:{run}")]` builds.
    let key = worker::lock_key(&run_id);
    // PostgreSQL locks: the run's own token sequence, and a name on the
    // workers' lock sessions that finds them all (and only them).
    let pg_schema = format!("dlock_fault_{id}");
    let pg_schema_guard = (settings.lock == Lock::Pg).then(|| RunSchema(pg_schema.clone()));
    let pg_lock_sessions = format!("dlock-fault-lock-{id}");

    // The lock store.
    let mut redis_server: Option<RedisServer> = None;
    #[cfg(feature = "etcd")]
    let mut etcd_cluster: Option<crate::etcd_support::Cluster> = None;
    let scratch = ScratchDir::new(&format!("dlock-fault-{id}"));
    let (pg_addr, pg_rest) = pg_parts();
    let (redis_addr, redis_through) = redis_parts();
    let lock_upstream = match settings.lock {
        Lock::File => None,
        Lock::Redis => {
            let server = RedisServer::start(&[]);
            let address = server.address();
            redis_server = Some(server);
            Some(address)
        }
        Lock::Pg => Some(pg_addr.clone()),
        #[cfg(feature = "etcd")]
        Lock::Etcd => {
            let cluster = crate::etcd_support::Cluster::start(3);
            let address = format!("127.0.0.1:{}", cluster.members[0].client_port);
            etcd_cluster = Some(cluster);
            Some(address)
        }
    };
    let admin_file = FileBackend::open(scratch.join("locks")).expect("lock directory");
    let admin_pg = match settings.lock {
        Lock::Pg => Some(
            runtime
                .block_on(PgBackend::connect_with(
                    &pg_conn(),
                    PgOptions::new().schema(pg_schema.as_str()),
                ))
                .expect("PostgreSQL"),
        ),
        _ => None,
    };
    let (pg_admin, pg_admin_conn) = runtime
        .block_on(tokio_postgres::connect(&pg_conn(), NoTls))
        .expect("PostgreSQL at 127.0.0.1:5432 or DLOCK_PG_URL");
    runtime.spawn(pg_admin_conn);

    // The register.
    match settings.register {
        Register::Pg => runtime.block_on(async {
            PgFence::new().create_table(&pg_admin).await.expect("fence table");
            // Fault runs start in parallel: `CREATE TABLE IF NOT EXISTS`
            // alone races another run's (a duplicate row type), so the
            // creations take turns under an advisory lock.
            pg_admin
                .batch_execute(&format!(
                    "BEGIN; \
                     SELECT pg_advisory_xact_lock(hashtext('{PG_REGISTER_TABLE}')); \
                     CREATE TABLE IF NOT EXISTS {PG_REGISTER_TABLE} (resource text PRIMARY KEY, value text NOT NULL); \
                     COMMIT"
                ))
                .await
                .expect("register table");
            for resource in settings.resources(&run_id) {
                pg_admin
                    .execute(
                        &format!("INSERT INTO {PG_REGISTER_TABLE} VALUES ($1, '0:0')"),
                        &[&resource],
                    )
                    .await
                    .expect("register row");
            }
        }),
        Register::Redis => {}
    }

    // Proxies: one per worker and link.
    let register_upstream = match settings.register {
        Register::Pg => pg_addr.clone(),
        Register::Redis => redis_addr.clone(),
    };
    let lock_proxies: Vec<Option<Proxy>> = (0..settings.workers)
        .map(|_| {
            lock_upstream
                .clone()
                .map(|up| Proxy::start(runtime.handle(), up))
        })
        .collect();
    let register_proxies: Vec<Proxy> = (0..settings.workers)
        .map(|_| Proxy::start(runtime.handle(), register_upstream.clone()))
        .collect();

    let deadline_us = now_us() + settings.duration.as_micros() as u64;
    let configs = (0..settings.workers)
        .map(|slot| worker::Config {
            scenario: match settings.scenario {
                Scenario::Lock => "lock",
                Scenario::Fair => "fair",
                Scenario::Election => "election",
                Scenario::Permits => "permits",
                Scenario::ReadWrite => "rw",
            }
            .to_owned(),
            lock: match settings.lock {
                Lock::File => "file",
                Lock::Redis => "redis",
                Lock::Pg => "pg",
                #[cfg(feature = "etcd")]
                Lock::Etcd => "etcd",
            }
            .to_owned(),
            lock_target: match (settings.lock, &lock_proxies[slot]) {
                (Lock::File, _) | (_, None) => scratch.join("locks").display().to_string(),
                (Lock::Redis, Some(proxy)) => format!("redis://127.0.0.1:{}", proxy.port),
                #[cfg(feature = "etcd")]
                (Lock::Etcd, Some(proxy)) => format!("http://127.0.0.1:{}", proxy.port),
                (Lock::Pg, Some(proxy)) => format!(
                    "host=127.0.0.1 port={} {pg_rest} application_name={pg_lock_sessions}-{slot}",
                    proxy.port
                ),
            },
            register: match settings.register {
                Register::Pg => "pg",
                Register::Redis => "redis",
            }
            .to_owned(),
            register_target: match settings.register {
                Register::Pg => format!(
                    "host=127.0.0.1 port={} {pg_rest} application_name=dlock-fault-register",
                    register_proxies[slot].port
                ),
                Register::Redis => redis_through(register_proxies[slot].port),
            },
            run: run_id.clone(),
            slot,
            fenced: settings.fenced,
            heeds_term: settings.heeds_term,
            deadline_us,
            seed: settings.seed,
            pg_schema: pg_schema.clone(),
            scratch: scratch.display().to_string(),
            process: 0,
        })
        .collect();
    let mut workers = Workers {
        slots: (0..settings.workers).map(|_| None).collect(),
        process_of: vec![0; settings.workers],
        next_process: 0,
        configs,
        shared: Arc::default(),
        readers: Vec::new(),
        killed_at: HashMap::new(),
    };
    for slot in 0..settings.workers {
        workers.spawn(slot);
    }

    // The driver.
    let begun = Instant::now();
    let mut injected = Vec::new();
    let mut pauses = Vec::new();
    let mut partitions = Vec::new();
    let mut server_faults = Vec::new();
    // A retry longer than the fault it replaces moves the rest of the
    // schedule later by the difference, so that faults keep their gaps.
    let mut shift = Duration::ZERO;
    let mut retried = BTreeMap::new();
    for (index, seeded) in schedule.iter().enumerate() {
        let instead;
        let planned = match next_kind(&settings.faults, &schedule, &injected, &retried) {
            Some(kind) if kind != seeded.kind || seeded.spare => {
                instead = retry(&settings, kind, seeded, index);
                &instead
            }
            Some(_) => seeded,
            None if seeded.spare => continue,
            None => seeded,
        };
        let wait = (planned.at + shift).saturating_sub(begun.elapsed());
        shift += planned.length.saturating_sub(seeded.length);
        std::thread::sleep(wait);
        if begun.elapsed() + planned.length > settings.duration {
            break;
        }
        if injected.iter().any(|f| f.kind == planned.kind) && !has_hit(planned.kind, &injected) {
            let retries = retried.entry(planned.kind).or_insert(0);
            *retries += 1;
            log.line(&format!(
                "  {:.1}s: {} has not hit yet: injected again (retry {retries} of {RETRIES})",
                begun.elapsed().as_secs_f64(),
                planned.kind,
            ));
        }
        // An abandon order goes to any worker (its acquisitions are the
        // target, not its lease); every other fault waits for a holder. An
        // election's leader, and the holder of an unfenced (negative) run,
        // is paused between its read and its write, so that it resumes with
        // a write on its way: the stale write the negative run must show.
        let target = match (planned.kind, settings.scenario) {
            (Fault::Abandon, _) => None,
            (Fault::Pause, Scenario::Election) => {
                workers.holder(Duration::from_secs(3), Duration::from_secs(1))
            }
            (Fault::Pause, _) if !settings.fenced => {
                workers.holder(Duration::from_secs(3), Duration::from_secs(1))
            }
            // A paused reader leaves the key to the other readers, and a
            // writer gets in only once the pause outlasts the reader's
            // lease on the server too: a paused writer is the one whose
            // pause lets another worker in, which the run must show.
            (Fault::Pause, Scenario::ReadWrite) => workers
                .holder_where(Duration::from_secs(3), Duration::ZERO, true)
                .or_else(|| workers.holder(Duration::from_secs(1), Duration::ZERO)),
            _ => workers.holder(Duration::from_secs(3), Duration::ZERO),
        };
        let slot = target.unwrap_or(planned.fallback_slot);
        let on_holder = target.is_some();
        let mut note = String::new();
        let from_us = now_us();
        let hit = match planned.kind {
            Fault::Pause => 'pause: {
                if !workers.signal(slot, libc::SIGSTOP) {
                    note = "its process was gone".to_owned();
                    break 'pause false;
                }
                let stopped_us = now_us();
                std::thread::sleep(planned.length);
                // Read before SIGCONT: every line printed after the resume
                // is later.
                let resumed_us = now_us();
                // Stopped, the process printed nothing since the signal, and
                // its reader has long read what came before: the phase is
                // the one it was stopped in.
                let mid_step = workers.is_working(slot);
                // Chosen as a holder a moment before the signal, it may have
                // let go meanwhile: only a pause of a holder counts.
                let holding = workers.is_holding(slot);
                let writer_held = workers.holds_as_writer(slot);
                workers.signal(slot, libc::SIGCONT);
                // What the others printed while it was stopped has reached
                // their readers by now (a line takes microseconds; this
                // leaves a loaded machine room).
                std::thread::sleep(Duration::from_millis(200));
                let let_in = workers.began_beside(slot, stopped_us, resumed_us);
                if planned.length > TTL {
                    pauses.push(Pause {
                        process: workers.process_of[slot],
                        stopped_us,
                        resumed_us,
                    });
                }
                // A leader, or an unfenced holder, is paused to resume with
                // a stale write on its way (what those runs must show): a
                // pause that caught it elsewhere is tried again.
                let wants_mid_step = settings.scenario == Scenario::Election || !settings.fenced;
                // A paused reader leaves the key to the other readers: only
                // a paused writer lets another worker in beside it, which a
                // read-write run must show.
                let wants_writer = settings.scenario == Scenario::ReadWrite;
                // A fenced run must show a pause letting another worker in
                // beside the holder (into its slot, with permits): a pause
                // during which nobody came (the other permit was free, the
                // others were between leases) is tried again.
                let wants_let_in = settings.scenario != Scenario::Election && settings.fenced;
                on_holder
                    && holding
                    && (mid_step || !wants_mid_step)
                    && (writer_held || !wants_writer)
                    && (let_in || !wants_let_in)
            }
            Fault::Kill => {
                workers.kill(slot);
                std::thread::sleep(planned.length);
                workers.spawn(slot);
                on_holder
            }
            Fault::Server => match settings.lock {
                Lock::Redis => {
                    if let Some(server) = redis_server.as_mut() {
                        server.kill();
                        std::thread::sleep(planned.length);
                        server.restart();
                    }
                    on_holder
                }
                Lock::Pg => runtime.block_on(async {
                    let Some(admin) = admin_pg.as_ref() else {
                        return false;
                    };
                    // Leases last tens of milliseconds: the holder found
                    // may have let go before the question, so ask again
                    // for a while (another worker takes the key at once).
                    let give_up = Instant::now() + Duration::from_secs(2);
                    let pids = loop {
                        let pids: Vec<i32> =
                            if matches!(settings.scenario, Scenario::Permits | Scenario::ReadWrite)
                            {
                                // Readers and permit holders hold no exclusive
                                // lock of the key: the workers' lock sessions
                                // holding an advisory lock (the run's key, or
                                // a slot of it) are the holders.
                                pg_admin
                                    .query(
                                        "SELECT DISTINCT l.pid FROM pg_locks AS l \
                                     JOIN pg_stat_activity AS a ON a.pid = l.pid \
                                     WHERE l.locktype = 'advisory' AND l.granted \
                                     AND a.application_name LIKE $1 || '-%'",
                                        &[&pg_lock_sessions],
                                    )
                                    .await
                                    .map(|rows| rows.iter().map(|row| row.get(0)).collect())
                                    .unwrap_or_default()
                            } else {
                                admin.holder_pids(&key).await.unwrap_or_default()
                            };
                        if !pids.is_empty() || Instant::now() >= give_up {
                            break pids;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    };
                    for pid in &pids {
                        let _ = pg_admin
                            .execute("SELECT pg_terminate_backend($1)", &[pid])
                            .await;
                    }
                    !pids.is_empty()
                }),
                Lock::File => runtime
                    .block_on(admin_file.force_release(&key))
                    .unwrap_or(false),
                #[cfg(feature = "etcd")]
                Lock::Etcd => match etcd_cluster.as_mut() {
                    Some(cluster) => {
                        let leader = runtime.block_on(cluster.leader());
                        cluster.members[leader].kill();
                        note = format!("leader m{leader} killed");
                        std::thread::sleep(planned.length);
                        cluster.members[leader].launch();
                        on_holder
                    }
                    None => false,
                },
            },
            Fault::Partition => 'partition: {
                let proxy = match settings.lock {
                    Lock::File => Some(&register_proxies[slot]),
                    Lock::Redis | Lock::Pg => lock_proxies[slot].as_ref(),
                    #[cfg(feature = "etcd")]
                    Lock::Etcd => lock_proxies[slot].as_ref(),
                };
                let Some(proxy) = proxy else {
                    note = "no proxy on its link".to_owned();
                    break 'partition false;
                };
                let frozen_us = now_us();
                proxy.freeze();
                std::thread::sleep(planned.length);
                if planned.cut {
                    proxy.cut();
                } else {
                    proxy.thaw();
                }
                partitions.push(Cut {
                    process: workers.process_of[slot],
                    from_us: frozen_us,
                    to_us: now_us(),
                });
                on_holder
            }
            Fault::Abandon => {
                let from = workers.events_seen();
                order_abandon(&scratch, slot, &planned.give_up_after);
                // The worker takes the order between two leases.
                let report = workers.await_event(slot, "ABANDONED", from, Duration::from_secs(10));
                let abandoned = report
                    .as_ref()
                    .and_then(|ev| ev.detail.split(' ').next()?.parse::<usize>().ok())
                    .unwrap_or(0);
                note = report.map_or_else(
                    || "no report from the worker".to_owned(),
                    |ev| format!("{} given up mid-flight", ev.detail),
                );
                abandoned >= 1
            }
            Fault::Rewind => {
                let rewound = match settings.lock {
                    Lock::Redis => redis_server.as_ref().is_some_and(|server| {
                        let reply = server.cli(&["SET", &redis_fence_counter(&key), "1"]);
                        note = format!("the key's fence counter set to 1: {reply}");
                        reply == "OK"
                    }),
                    Lock::Pg => runtime.block_on(async {
                        let sequence = format!("{pg_schema}.dlock_token_seq");
                        if planned.recreate {
                            // A DBA's drop and create, in one implicit
                            // transaction: no acquisition sees it missing.
                            let done = pg_admin
                                .batch_execute(&format!(
                                    "DROP SEQUENCE {sequence}; CREATE SEQUENCE {sequence} AS bigint"
                                ))
                                .await;
                            note = match &done {
                                Ok(()) => "sequence dropped and recreated".to_owned(),
                                Err(err) => format!("dropping the sequence failed: {err}"),
                            };
                            done.is_ok()
                        } else {
                            let set = pg_admin
                                .execute(&format!("SELECT setval('{sequence}', 1)"), &[])
                                .await;
                            // The failover: every session ends, and the
                            // workers reconnect to the rewound server.
                            let ended = pg_admin
                                .query(
                                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                                     WHERE application_name LIKE $1 || '-%' AND pid <> pg_backend_pid()",
                                    &[&pg_lock_sessions],
                                )
                                .await
                                .map_or(0, |rows| rows.len());
                            note = match &set {
                                Ok(_) => format!(
                                    "sequence set back to 1, {ended} sessions of the workers ended"
                                ),
                                Err(err) => format!("setting the sequence back failed: {err}"),
                            };
                            set.is_ok()
                        }
                    }),
                    Lock::File => false,
                    #[cfg(feature = "etcd")]
                    Lock::Etcd => false,
                };
                rewound && on_holder
            }
        };
        if matches!(planned.kind, Fault::Server | Fault::Rewind) {
            server_faults.push((from_us, now_us()));
        }
        injected.push(Injected {
            kind: planned.kind,
            slot,
            hit,
            length: planned.length,
            note,
        });
    }
    let left = Duration::from_micros(deadline_us.saturating_sub(now_us()));
    std::thread::sleep(left);
    workers.stop(Duration::from_secs(30));
    let end_us = now_us();

    // The register's final values, read directly (no proxy).
    let resources = settings.resources(&run_id);
    let finals: Vec<String> = runtime.block_on(async {
        let mut finals = Vec::new();
        for resource in &resources {
            finals.push(match settings.register {
                Register::Pg => pg_admin
                    .query_one(
                        &format!("SELECT value FROM {PG_REGISTER_TABLE} WHERE resource = $1"),
                        &[resource],
                    )
                    .await
                    .expect("register row")
                    .get::<_, String>(0),
                Register::Redis => {
                    let mut conn = redis::Client::open(redis_url())
                        .expect("Redis URL")
                        .get_multiplexed_async_connection()
                        .await
                        .expect("Redis");
                    let key = RedisFence::new().key(resource);
                    let value: Option<String> = redis::cmd("HGET")
                        .arg(&key)
                        .arg("value")
                        .query_async(&mut conn)
                        .await
                        .expect("register");
                    let _: Result<(), _> = redis::cmd("DEL").arg(&key).query_async(&mut conn).await;
                    value.unwrap_or_else(|| "0:0".to_owned())
                }
            });
        }
        finals
    });
    if settings.register == Register::Pg {
        runtime.block_on(async {
            for resource in &resources {
                let _ = pg_admin
                    .execute(
                        &format!("DELETE FROM {PG_REGISTER_TABLE} WHERE resource = $1"),
                        &[resource],
                    )
                    .await;
                let _ = pg_admin
                    .execute(
                        "DELETE FROM dlock.dlock_fence WHERE resource = $1",
                        &[resource],
                    )
                    .await;
            }
        });
    }
    let permits = (settings.scenario == Scenario::Permits).then_some(worker::PERMITS);
    let (final_value, slot_finals) = match permits {
        Some(_) => (String::new(), (0..).zip(finals).collect()),
        None => (
            finals.into_iter().next().unwrap_or_default(),
            BTreeMap::new(),
        ),
    };

    let history = History {
        events: std::mem::take(
            &mut workers
                .shared
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .events,
        ),
        killed_at: std::mem::take(&mut workers.killed_at),
        pauses,
        partitions,
        server_faults,
        end_us,
        final_value,
        election: settings.scenario == Scenario::Election,
        fair: settings.scenario == Scenario::Fair,
        read_write: settings.scenario == Scenario::ReadWrite,
        permits,
        slot_finals,
        silent_hold_us: silent_hold(settings.lock).as_micros() as u64,
    };
    let verdict = check::check(&history);
    let mut report = Report {
        settings,
        injected,
        verdict,
        elapsed: started.elapsed(),
        log: String::new(),
    };
    log.line(&report.to_string());
    for violation in report.verdict.violations.iter().take(10) {
        log.line(&format!("  violation: {violation}"));
    }
    report.log = log.text;
    drop(workers);
    drop(pg_schema_guard);
    drop(lock_proxies);
    drop(register_proxies);
    drop(redis_server);
    #[cfg(feature = "etcd")]
    drop(etcd_cluster);
    drop(scratch);
    report
}

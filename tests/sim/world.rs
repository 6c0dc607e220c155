//! What one schedule shares: the random source, the trace, the simulated
//! store (swapped for an empty one when it "loses its data"), each
//! process's frozen switch and fault count, and what the store really did
//! for each acquisition, which the checks hold the holders' beliefs
//! against.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dlock::backend::{Access, OwnerId};
use dlock::memory::MemoryBackend;
use dlock::{FencingToken, LostSignal};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::rng::Rng;
use crate::trace::{Record, Trace, write_line};

/// The shape of one schedule and how often each fault strikes, all drawn
/// from its seed.
#[derive(Clone, Debug)]
pub struct Plan {
    /// How many processes share the store, how many callers each runs,
    /// how many turns each caller takes, and how many steps the driver
    /// takes (each a pause, maybe a fault, and the checks).
    pub processes: usize,
    pub callers: usize,
    pub ops: usize,
    pub steps: usize,
    /// Per store call, per mille: a reply (or request) held back, lost
    /// before the store applied it, lost after, or answered with an error.
    pub delay: u32,
    pub lost_before: u32,
    pub lost_after: u32,
    pub error: u32,
    /// Per step, per mille: a process frozen, the store's data lost, a
    /// process's tasks aborted.
    pub freeze: u32,
    pub data_loss: u32,
    pub abort: u32,
}

impl Plan {
    /// The plan of a schedule: about one in five runs with no fault at
    /// all (so that anything lost there was lost for no reason), the rest
    /// with a light or a heavy dose.
    pub fn draw(rng: &mut Rng) -> Self {
        let dose = rng.pick(&[0u32, 1, 1, 2, 2]);
        let rate = |rng: &mut Rng, most: u32| {
            if dose == 0 {
                0
            } else {
                rng.below(u64::from(most * dose)) as u32
            }
        };
        Self {
            processes: 2 + rng.below(3) as usize,
            callers: 1 + rng.below(2) as usize,
            ops: 2 + rng.below(4) as usize,
            steps: 20 + rng.below(30) as usize,
            delay: rate(rng, 60),
            lost_before: rate(rng, 25),
            lost_after: rate(rng, 25),
            error: rate(rng, 25),
            freeze: rate(rng, 40),
            data_loss: rate(rng, 8),
            abort: rate(rng, 10),
        }
    }
}

/// How a lease holds its key, as the checks count holders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Exclusive,
    Shared,
    Permit(u32),
}

impl Side {
    pub fn of(access: Access) -> Self {
        match access {
            Access::Shared => Side::Shared,
            Access::Permits { permits } => Side::Permit(permits),
            _ => Side::Exclusive,
        }
    }
}

/// What the store did for one acquisition (one owner id): the truth the
/// holders' beliefs are checked against.
pub struct Granted {
    pub process: usize,
    pub key: String,
    pub token: u64,
    pub side: Side,
    /// The store epoch that granted it (bumped by each loss of data).
    pub epoch: u32,
    /// Until when the store keeps it unless renewed: its latest grant or
    /// extension that the store applied, plus the ttl.
    pub until: Instant,
    /// When the store stopped holding it before `until`: its release, or
    /// the store losing its data.
    pub ended: Option<Instant>,
    /// The store answered `Released` to this owner's release.
    pub released: bool,
}

/// A lease as a caller holds it, for the checks.
pub struct Held {
    pub process: usize,
    pub key: String,
    pub token: u64,
    pub side: Side,
    pub signal: LostSignal,
    pub renew: bool,
    /// The process's fault count when the acquisition began.
    pub faults_before: u64,
    /// When its holder was told the lease ended, and whether a check
    /// already said it was told late.
    pub told: Option<Instant>,
    pub flagged_late: bool,
}

/// One simulated process.
#[derive(Default)]
pub struct Process {
    /// Faults that struck it (its calls, a freeze, an abort).
    pub faults: u64,
    pub frozen_since: Option<Instant>,
    pub frozen_total: Duration,
    /// Who waits for the thaw, in the order they began to wait.
    pub thaw_waiters: Vec<oneshot::Sender<()>>,
}

/// The mutable part of a schedule's world.
pub struct State {
    pub rng: Rng,
    pub trace: Trace,
    pub plan: Plan,
    pub store: MemoryBackend,
    pub epoch: u32,
    pub processes: Vec<Process>,
    pub granted: HashMap<OwnerId, Granted>,
    /// The ttl each owner's latest attempt asked for: a handoff holds
    /// the key that long.
    pub asked_ttl: HashMap<OwnerId, Duration>,
    /// The highest token granted per key.
    pub highest: BTreeMap<String, u64>,
    pub leases: Vec<Held>,
    pub violations: Vec<String>,
    /// Store calls made from another thread (dlock's fallback thread),
    /// refused without touching the store.
    pub off_thread: u64,
    pub store_calls: u64,
    /// How often each fault and event happened, for the run's summary.
    pub counts: BTreeMap<&'static str, u64>,
    /// Release and holder-change notices waiting, per key, in the order
    /// they were subscribed (see `FaultyStore::subscribe`).
    pub notices: BTreeMap<String, Vec<oneshot::Sender<()>>>,
}

/// A schedule's world.
pub struct World {
    state: Mutex<State>,
    thread: ThreadId,
    start: Instant,
}

impl World {
    /// The world of `seed`, on the current thread and paused clock,
    /// recording what `record` says of its trace.
    pub fn new(seed: u64, record: Record) -> Arc<Self> {
        let mut rng = Rng::new(seed);
        let plan = Plan::draw(&mut rng);
        let mut trace = Trace::new(record);
        write_line(&mut trace, format_args!("plan {plan:?}"));
        let processes = (0..plan.processes).map(|_| Process::default()).collect();
        Arc::new(Self {
            state: Mutex::new(State {
                rng,
                trace,
                plan,
                store: MemoryBackend::new(),
                epoch: 0,
                processes,
                granted: HashMap::new(),
                asked_ttl: HashMap::new(),
                highest: BTreeMap::new(),
                leases: Vec::new(),
                violations: Vec::new(),
                off_thread: 0,
                store_calls: 0,
                notices: BTreeMap::new(),
                counts: BTreeMap::new(),
            }),
            thread: std::thread::current().id(),
            start: Instant::now(),
        })
    }

    pub fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the caller runs on the schedule's thread.
    pub fn on_sim_thread(&self) -> bool {
        std::thread::current().id() == self.thread
    }

    /// Simulated milliseconds since the schedule began.
    pub fn ms(&self, at: Instant) -> u128 {
        at.saturating_duration_since(self.start).as_millis()
    }

    /// Counts one `what` for the run's summary.
    pub fn count(&self, what: &'static str) {
        *self.state().counts.entry(what).or_default() += 1;
    }

    /// Appends a line stamped with the simulated time.
    pub fn log(&self, args: std::fmt::Arguments<'_>) {
        let at = self.ms(Instant::now());
        let mut state = self.state();
        if !state.trace.is_on() {
            return;
        }
        write_line(&mut state.trace, format_args!("{at:>6}ms {args}"));
    }

    /// Counts a violation and traces it.
    pub fn violation(&self, args: std::fmt::Arguments<'_>) {
        let text = format!("{:>6}ms VIOLATION {args}", self.ms(Instant::now()));
        let mut state = self.state();
        state.trace.line(&text);
        state.violations.push(text);
    }

    /// Waits while `process` is frozen. (Not a `watch` channel: tokio's
    /// wakes its receivers in a random order.)
    pub async fn thawed(&self, process: usize) {
        loop {
            let thaw = {
                let mut state = self.state();
                let p = &mut state.processes[process];
                if p.frozen_since.is_none() {
                    return;
                }
                let (sender, receiver) = oneshot::channel();
                p.thaw_waiters.push(sender);
                receiver
            };
            let _ = thaw.await;
        }
    }

    pub fn is_frozen(&self, process: usize) -> bool {
        self.state().processes[process].frozen_since.is_some()
    }

    /// Freezes `process`: its calls and its callers stop until `thaw`.
    pub fn freeze(&self, process: usize) {
        let now = Instant::now();
        let mut state = self.state();
        let p = &mut state.processes[process];
        p.faults += 1;
        p.frozen_since = Some(now);
    }

    /// Thaws `process`: its waiters go on in the order they stopped.
    pub fn thaw(&self, process: usize) {
        let now = Instant::now();
        let waiters = {
            let mut state = self.state();
            let p = &mut state.processes[process];
            if let Some(since) = p.frozen_since.take() {
                p.frozen_total += now - since;
            }
            std::mem::take(&mut p.thaw_waiters)
        };
        for waiter in waiters {
            let _ = waiter.send(());
        }
    }

    /// How long `process` has been frozen in all, up to now.
    pub fn frozen_for(&self, process: usize) -> Duration {
        let state = self.state();
        let p = &state.processes[process];
        p.frozen_total
            + p.frozen_since
                .map_or(Duration::ZERO, |since| Instant::now() - since)
    }

    /// Faults that struck `process` so far, a loss of the store's data
    /// counting for every process.
    pub fn faults(&self, process: usize) -> u64 {
        let state = self.state();
        state.processes[process].faults + u64::from(state.epoch)
    }

    /// The store loses everything, its token counter included: an empty
    /// store takes its place. Its counter starts from the wall clock, as
    /// a restarted server's floor does; the swap waits until that clock is
    /// past every token issued, as it would be after a real restart (a
    /// simulated schedule issues tokens far faster than a real store).
    pub fn lose_data(&self) {
        let highest = self.state().highest.values().copied().max().unwrap_or(0);
        while SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64)
            <= highest
        {
            std::thread::yield_now();
        }
        let now = Instant::now();
        let mut state = self.state();
        state.store = MemoryBackend::new();
        state.epoch += 1;
        for granted in state.granted.values_mut() {
            granted.ended.get_or_insert(now);
        }
        let epoch = state.epoch;
        let keys: Vec<String> = state.notices.keys().cloned().collect();
        drop(state);
        for key in keys {
            self.notify(&key);
        }
        self.log(format_args!("store lost its data (epoch {epoch})"));
    }

    /// Records a grant by the store (an attempt's, or a handoff's) and
    /// checks that its token rose (rules 2 and M2).
    pub fn granted(
        &self,
        process: usize,
        key: &str,
        owner: &OwnerId,
        token: FencingToken,
        side: Side,
        ttl: Duration,
    ) {
        let now = Instant::now();
        let token = token.get();
        let mut state = self.state();
        let retry = state
            .granted
            .get(owner)
            .is_some_and(|g| g.token == token && g.ended.is_none());
        let joins_phase = side == Side::Shared
            && state.granted.values().any(|g| {
                g.key == key
                    && g.side == Side::Shared
                    && g.token == token
                    && g.ended.is_none()
                    && g.until > now
            });
        let highest = state.highest.get(key).copied().unwrap_or(0);
        let epoch = state.epoch;
        state.highest.insert(key.to_owned(), highest.max(token));
        let rose = retry || joins_phase || token > highest;
        state.granted.insert(
            *owner,
            Granted {
                process,
                key: key.to_owned(),
                token,
                side,
                epoch,
                until: now + ttl,
                ended: None,
                released: false,
            },
        );
        let names = (!rose).then(|| {
            let token = state.trace.token(FencingToken::new(token));
            (token, state.trace.token(FencingToken::new(highest)))
        });
        drop(state);
        if let Some((token, highest)) = names {
            self.violation(format_args!(
                "tokens rise per key: {key} granted {token} after {highest}"
            ));
        }
    }

    /// The store applied a renewal (`true`) of `owner`'s lease for `ttl`.
    ///
    /// The excuse a holder has while its grant is lost with the store's
    /// data lasts until this renewal: the store cannot renew what it no
    /// longer has, nor what it released.
    pub fn extended(&self, owner: &OwnerId, ttl: Duration) {
        let now = Instant::now();
        let ended = {
            let mut state = self.state();
            let granted = state.granted.get_mut(owner);
            match granted {
                Some(granted) if granted.ended.is_some() => {
                    Some((granted.process, granted.key.clone(), granted.released))
                }
                Some(granted) => {
                    granted.until = now + ttl;
                    None
                }
                None => None,
            }
        };
        if let Some((process, key, released)) = ended {
            let why = if released {
                "released"
            } else {
                "lost with its data"
            };
            self.violation(format_args!(
                "renewal: the store renewed p{process}'s lease on {key}, which it had {why}"
            ));
        }
    }

    /// A notice of `key`'s next release or change of holder.
    pub fn notice(&self, key: &str) -> oneshot::Receiver<()> {
        let (sender, receiver) = oneshot::channel();
        self.state()
            .notices
            .entry(key.to_owned())
            .or_default()
            .push(sender);
        receiver
    }

    /// Wakes every notice of `key`, in the order they were subscribed.
    pub fn notify(&self, key: &str) {
        let waiting = self.state().notices.remove(key).unwrap_or_default();
        for sender in waiting {
            let _ = sender.send(());
        }
    }

    /// The store answered `Released` to `owner`'s release.
    pub fn released(&self, owner: &OwnerId) {
        let now = Instant::now();
        if let Some(granted) = self.state().granted.get_mut(owner) {
            granted.ended.get_or_insert(now);
            granted.released = true;
        }
    }
}

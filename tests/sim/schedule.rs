//! One schedule: a current-thread runtime on a paused clock, the
//! processes' callers spawned on it, and a driver that, step by step,
//! lets simulated time pass, strikes the schedule's faults (a process
//! frozen then thawed, the store's data lost, a process's tasks aborted
//! as its runtime shutting down would) and runs the checks. Then every
//! caller is waited for, time runs past every ttl, and nothing may be
//! held.

use std::sync::Arc;
use std::time::Duration;

use dlock::Backend;
use tokio::task::JoinHandle;
use tokio::time::{sleep, timeout};

use crate::actors::caller;
use crate::store::FaultyStore;
use crate::trace::Record;
use crate::world::World;

/// The longest (simulated) time the callers may take once the steps are
/// over: every wait and hold they draw is bounded far below it, so one
/// still running has hung.
const CALLERS_WITHIN: Duration = Duration::from_secs(600);
/// How long after the last caller the store must be empty: past the
/// longest ttl, a queue entry's ttl and the renewal scheduler's linger.
const SETTLE: Duration = Duration::from_secs(12);

/// What one schedule did.
pub struct Outcome {
    pub steps: usize,
    pub store_calls: u64,
    pub off_thread: u64,
    pub violations: Vec<String>,
    pub digest: u64,
    pub lines: usize,
    pub trace: Option<String>,
    pub counts: std::collections::BTreeMap<&'static str, u64>,
}

/// Runs the schedule of `seed`, recording what `record` says of its trace.
pub fn run(seed: u64, record: Record) -> Outcome {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    let world = runtime.block_on(async {
        let world = World::new(seed, record);
        drive(&world).await;
        world
    });
    // Whatever is left (watchers, renewal schedulers that linger) goes
    // with the runtime; calls it hands to the fallback thread are refused
    // (see `FaultyStore::send`).
    drop(runtime);
    let mut state = world.state();
    // The leases' lost signals hold the stores, which hold the world: a
    // cycle, which the leases taken out here break, or every schedule's
    // world would stay in memory for the rest of the run.
    drop(std::mem::take(&mut state.leases));
    Outcome {
        steps: state.plan.steps,
        store_calls: state.store_calls,
        off_thread: state.off_thread,
        violations: state.violations.clone(),
        digest: state.trace.digest(),
        lines: state.trace.lines(),
        trace: state.trace.text().map(str::to_owned),
        counts: state.counts.clone(),
    }
}

/// What the driver does at one step.
enum Event {
    Nothing,
    Freeze { process: usize, for_: Duration },
    LoseData,
    Abort { process: usize },
}

fn draw_step(world: &World) -> (Duration, Event) {
    let mut state = world.state();
    let plan = state.plan.clone();
    let rng = &mut state.rng;
    let pause = rng.millis(1, 250);
    let process = rng.below(plan.processes as u64) as usize;
    let event = if rng.chance(plan.freeze) {
        Event::Freeze {
            process,
            for_: rng.millis(10, 4000),
        }
    } else if rng.chance(plan.data_loss) {
        Event::LoseData
    } else if rng.chance(plan.abort) {
        Event::Abort { process }
    } else {
        Event::Nothing
    };
    (pause, event)
}

async fn drive(world: &Arc<World>) {
    let plan = world.state().plan.clone();
    let mut callers: Vec<Vec<JoinHandle<()>>> = Vec::new();
    for process in 0..plan.processes {
        let store: Arc<dyn Backend> = Arc::new(FaultyStore::new(Arc::clone(world), process));
        let tasks = (0..plan.callers)
            .map(|c| {
                tokio::spawn(caller(
                    Arc::clone(world),
                    Arc::clone(&store),
                    process,
                    c,
                    plan.ops,
                ))
            })
            .collect();
        callers.push(tasks);
    }
    for step in 0..plan.steps {
        let (pause, event) = draw_step(world);
        sleep(pause).await;
        match event {
            Event::Nothing => {}
            Event::Freeze { process, for_ } if !world.is_frozen(process) => {
                world.log(format_args!(
                    "step {step}: p{process} frozen for {}ms",
                    for_.as_millis()
                ));
                world.count(if for_ > Duration::from_secs(1) {
                    "freeze over 1 s"
                } else {
                    "freeze"
                });
                world.freeze(process);
                let world = Arc::clone(world);
                tokio::spawn(async move {
                    sleep(for_).await;
                    world.log(format_args!("p{process} thawed"));
                    world.thaw(process);
                });
            }
            Event::Freeze { .. } => {}
            Event::LoseData => {
                world.count("store lost its data");
                world.lose_data();
            }
            Event::Abort { process } => {
                world.log(format_args!("step {step}: p{process}'s tasks aborted"));
                world.count("process's tasks aborted");
                world.state().processes[process].faults += 1;
                for task in &callers[process] {
                    task.abort();
                }
            }
        }
        world.check_told_by_ttl();
    }
    let all = async {
        for task in callers.into_iter().flatten() {
            let _ = task.await;
        }
    };
    if timeout(CALLERS_WITHIN, all).await.is_err() {
        world.violation(format_args!(
            "a caller had not returned {CALLERS_WITHIN:?} after the last step"
        ));
    }
    world.log(format_args!("every caller has gone"));
    sleep(SETTLE).await;
    world.check_told_by_ttl();
    world.check_nothing_held().await;
}

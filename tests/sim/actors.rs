//! The callers of a simulated process: each takes a few leases in turn,
//! in every way the core offers (exclusive, fair, shared, a permit, an
//! election's term), holds each a while and ends it by a release or a
//! drop; some give up on the acquisition half-way. Everything they choose
//! comes from the schedule's random source.

use std::sync::Arc;
use std::time::Duration;

use dlock::election::Election;
use dlock::{Backend, LockError, LockMode, LockOptions, LostSignal};
use tokio::time::{Instant, sleep, timeout};

use crate::world::{Side, World};

/// The keys: one taken exclusively (plainly or fairly) and shared, one
/// held as permits, one an election's.
const LOCK_KEY: &str = "k0";
const PERMIT_KEY: &str = "k1";
const PERMITS: u32 = 2;
const ELECTION_KEY: &str = "e0";

/// What a caller does next.
#[derive(Debug)]
enum Way {
    Exclusive { fair: bool },
    Shared,
    Permit,
    Elect,
}

/// One turn of a caller, drawn at once so that the draw's order does not
/// depend on how the turn goes.
#[derive(Debug)]
struct Turn {
    way: Way,
    ttl: Duration,
    wait: Duration,
    renew: bool,
    min_hold: Duration,
    /// The caller gives up on the acquisition after this (a timeout, a
    /// dropped future).
    give_up: Option<Duration>,
    hold: Duration,
    release: bool,
    pause: Duration,
}

impl Turn {
    fn draw(world: &World) -> Self {
        let mut state = world.state();
        let rng = &mut state.rng;
        let way = match rng.below(10) {
            0..=2 => Way::Exclusive { fair: false },
            3..=4 => Way::Exclusive { fair: true },
            5..=6 => Way::Shared,
            7..=8 => Way::Permit,
            _ => Way::Elect,
        };
        // Short ttls on purpose: a fair waiter's handoff comes up to a
        // second after its last attempt, which a ttl under that outlives
        // only if the core renews it on arrival.
        let ttl = Duration::from_millis(rng.pick(&[30, 80, 200, 500, 1200, 3000]));
        let wait = Duration::from_millis(rng.pick(&[0, 50, 300, 1000, 4000]));
        let renew = !rng.chance(100);
        let min_hold = if rng.chance(80) {
            ttl / 2
        } else {
            Duration::ZERO
        };
        let give_up = rng.chance(150).then(|| rng.millis(1, 1500));
        let hold = rng.millis(1, 2 * ttl.as_millis() as u64 + 10);
        let release = !rng.chance(300);
        let pause = rng.millis(0, 300);
        Self {
            way,
            ttl,
            wait,
            renew,
            min_hold,
            give_up,
            hold,
            release,
            pause,
        }
    }
}

/// One caller of `process`: `turns` turns on its store.
pub async fn caller(
    world: Arc<World>,
    store: Arc<dyn Backend>,
    process: usize,
    caller: usize,
    turns: usize,
) {
    for _ in 0..turns {
        world.thawed(process).await;
        let turn = Turn::draw(&world);
        world.log(format_args!("p{process}c{caller} turn {turn:?}"));
        sleep(turn.pause).await;
        world.thawed(process).await;
        match turn.way {
            Way::Elect => elect(&world, &store, process, caller, &turn).await,
            _ => lock(&world, &store, process, &turn).await,
        }
    }
}

/// The options of a lock turn, and its key.
fn options(turn: &Turn) -> (LockOptions, &'static str) {
    let options = LockOptions::new(turn.ttl)
        .wait(turn.wait)
        .renew(turn.renew)
        .min_hold(turn.min_hold);
    match turn.way {
        Way::Exclusive { fair } => (options.fair(fair), LOCK_KEY),
        Way::Shared => (options.mode(LockMode::Shared), LOCK_KEY),
        _ => (options.permits(PERMITS), PERMIT_KEY),
    }
}

/// A lock turn: acquire, hold, release or drop.
async fn lock(world: &Arc<World>, store: &Arc<dyn Backend>, process: usize, turn: &Turn) {
    let (options, key) = options(turn);
    let (started, faults, frozen) = (
        Instant::now(),
        world.faults(process),
        world.frozen_for(process),
    );
    let acquiring = options.acquire_on(Arc::clone(store), key);
    let acquired = match turn.give_up {
        Some(after) => timeout(after, acquiring).await.ok(),
        None => Some(acquiring.await),
    };
    if turn.give_up.is_none() {
        world.check_deadline(process, started, turn.wait, frozen);
    }
    let lease = match acquired {
        None => {
            world.count("caller gave up");
            return world.log(format_args!("p{process} gave up on {key}"));
        }
        Some(Err(err)) => {
            return world.log(format_args!(
                "p{process} acquire {key} failed: {}",
                short(&err)
            ));
        }
        Some(Ok(lease)) => lease,
    };
    let side = Side::of(lease.access());
    world.count(match (side, &turn.way) {
        (Side::Exclusive, Way::Exclusive { fair: true }) => "fair lease held",
        (Side::Exclusive, _) => "exclusive lease held",
        (Side::Shared, _) => "shared lease held",
        (Side::Permit(_), _) => "permit held",
    });
    let id = watch(
        world,
        process,
        key,
        side,
        lease.lost_signal(),
        turn.renew,
        faults,
    );
    world.log(format_args!("p{process} holds {key} {side:?} lease {id}"));
    sleep(turn.hold).await;
    world.thawed(process).await;
    if turn.release {
        let faults_now = world.faults(process);
        let result = lease.release().await;
        world.log(format_args!(
            "p{process} released lease {id}: {}",
            outcome(&result)
        ));
        world.check_release(id, faults_now, &result);
    } else {
        drop(lease);
        world.log(format_args!("p{process} dropped lease {id}"));
    }
}

/// An election turn: campaign (giving up after a while), lead, resign or
/// step down by a drop.
async fn elect(
    world: &Arc<World>,
    store: &Arc<dyn Backend>,
    process: usize,
    caller: usize,
    turn: &Turn,
) {
    let identity = format!("p{process}c{caller}");
    let Ok(election) = Election::new(ELECTION_KEY, identity, turn.ttl) else {
        return world.violation(format_args!("an election's options were refused"));
    };
    let election = election.on(Arc::clone(store));
    let faults = world.faults(process);
    let campaign = turn.give_up.unwrap_or(turn.wait + Duration::from_millis(1));
    let leadership = match timeout(campaign, election.campaign()).await {
        Err(_) => return world.log(format_args!("p{process} stopped campaigning")),
        Ok(Err(err)) => {
            return world.log(format_args!("p{process} campaign failed: {}", short(&err)));
        }
        Ok(Ok(leadership)) => leadership,
    };
    world.count("term led");
    let id = watch(
        world,
        process,
        ELECTION_KEY,
        Side::Exclusive,
        leadership.lost_signal(),
        true,
        faults,
    );
    world.log(format_args!("p{process} leads lease {id}"));
    sleep(turn.hold).await;
    world.thawed(process).await;
    if turn.release {
        let faults_now = world.faults(process);
        let result = leadership.resign().await;
        world.log(format_args!(
            "p{process} resigned lease {id}: {}",
            outcome(&result)
        ));
        world.check_release(id, faults_now, &result);
    } else {
        drop(leadership);
        world.log(format_args!("p{process} stepped down lease {id} by a drop"));
    }
}

/// Registers a held lease (checking exclusion) and a task that notes
/// when its holder is told it ended. The task is the simulator's, not the
/// process's: it is not frozen or aborted with it.
fn watch(
    world: &Arc<World>,
    process: usize,
    key: &str,
    side: Side,
    signal: LostSignal,
    renew: bool,
    faults: u64,
) -> usize {
    let id = world.hold(process, key, side, signal.clone(), renew, faults);
    let world = Arc::clone(world);
    tokio::spawn(async move {
        let error = signal.lost().await;
        world.told(id, &error);
    });
    id
}

fn outcome(result: &Result<(), LockError>) -> String {
    match result {
        Ok(()) => "ok".to_owned(),
        Err(err) => short(err),
    }
}

/// An error as the trace shows it: its kind and reason, without times.
fn short(err: &LockError) -> String {
    match err {
        LockError::LeaseLost { reason, .. } => format!("LeaseLost({reason:?})"),
        LockError::Held { .. } => "Held".to_owned(),
        LockError::Timeout { .. } => "Timeout".to_owned(),
        LockError::Backend { .. } => "Backend".to_owned(),
        other => format!("{other}"),
    }
}

//! The operations of a model run: what the generator draws, the runner
//! sends, the shrinker removes and a red run prints as Rust.
//!
//! An operation names its key (`k`, an index into the run's keys), the
//! process it goes through (`p`, an index into the backend instances) and
//! the acquisition (`o`, an owner number the run maps to a fresh
//! [`dlock::backend::OwnerId`]). Every operation stays meaningful when
//! others are removed (an extend of an owner that never acquired just finds
//! it does not hold), so any subsequence of a run is a run.

use crate::rng::Rng;

/// The keys of a run: each is used in one way, so that every answer is
/// exact (rule M1: a key is used in one way).
pub const KEYS: usize = 3;
/// Key 0: exclusive and shared holders.
pub const RW_KEY: usize = 0;
/// Key 1: permits.
pub const PERMIT_KEY: usize = 1;
/// Key 2: fair (queued) and plain exclusive holders.
pub const FAIR_KEY: usize = 2;
/// How many permits the permit key has.
pub const PERMITS: u32 = 2;

/// How an acquisition asks for its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Exclusive, not queued (`Queue::Barge`).
    Exclusive,
    /// A reader (`Access::Shared`).
    Shared,
    /// One of [`PERMITS`] permits.
    Permit,
    /// A fair caller's first try (`Queue::Respect`).
    Respect,
    /// A fair waiter's attempt, which queues it (`Queue::Join`), after it
    /// registered for a handoff.
    Join,
}

/// The fence values an operator's rewind writes (Redis): lower counters,
/// and values that are no counter at all, some of exactly the clock's 16
/// characters.
pub const FENCE_VALUES: [&str; 8] = [
    "1",
    "0000000000000001",
    "000000000000000a",
    "abcdefghijklmnop",
    "-999999999999999",
    "1.5e15",
    "9223372036854775807",
    "",
];

/// Foreign values an application writes under dlock's lock keys: the
/// length of dlock's own (32 hex digits and a mark), and not of its form.
pub const FOREIGN_VALUES: [&str; 4] = [
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
    "gggggggggggggggggggggggggggggggg-",
    "0123456789abcdef0123456789abcdef!",
    "0123456789abcdef0123456789abcde -",
];

/// Which of a key's store-side records a deletion removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The lock itself (Redis `…:lock`, the file backend's lock file,
    /// the etcd lock key).
    Lock,
    /// The token counter (Redis `…:fence`).
    Fence,
    /// The holder record (Redis `…:info`).
    Info,
    /// The read phase's record (Redis `…:phase`).
    Phase,
    /// The readers' hash (Redis `…:readers`).
    Readers,
    /// The permits' slots (Redis `…:slots`).
    Slots,
    /// The fair queue (Redis `…:queue`).
    Queue,
}

pub const PARTS: [Part; 7] = [
    Part::Lock,
    Part::Fence,
    Part::Info,
    Part::Phase,
    Part::Readers,
    Part::Slots,
    Part::Queue,
];

/// One step of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `try_acquire` (a retry when `o` already holds).
    Acquire {
        p: usize,
        k: usize,
        o: u32,
        mode: Mode,
    },
    /// `extend` of `o`'s lease, through the process that took it.
    Extend { k: usize, o: u32 },
    /// `release` of `o`'s lease (a fair waiter's leaving, if it queues).
    Release { k: usize, o: u32 },
    /// `force_release`.
    ForceRelease { p: usize, k: usize },
    /// `holder`, then `force_release_holding` naming what it read.
    ForceNamed { p: usize, k: usize },
    /// `force_release_holding` naming a token below every live one.
    ForceStale { p: usize, k: usize },
    /// `holder`.
    Holder { p: usize, k: usize },
    /// `held` of the run's prefix.
    Held { p: usize },
    /// Rule M3: a waiting writer's attempt (`waits`), a reader's attempt
    /// while its mark stands, and the writer's giving up.
    WriterWaits { p: usize, o: u32, reader: u32 },
    /// Fault: an operator deletes one of the key's records.
    Delete { k: usize, part: Part },
    /// Fault: the key's token counter set to [`FENCE_VALUES`]`[value]`
    /// (Redis), or the token sequence set back (PostgreSQL).
    Rewind { k: usize, value: usize },
    /// Fault: an application writes [`FOREIGN_VALUES`]`[value]` under the
    /// key's lock (Redis).
    Foreign { k: usize, value: usize },
    /// Fault: the store loses everything (Redis: `FLUSHALL`, or with
    /// `restart` a restart of the server without persistence).
    Wipe { restart: bool },
    /// Fault: the sessions of process `p` end (PostgreSQL:
    /// `pg_terminate_backend`).
    Terminate { p: usize },
    /// Fault: a DBA locks dlock's table number `table` for a moment, while
    /// `then` runs with a deadline (PostgreSQL).
    TableLocked {
        table: usize,
        p: usize,
        k: usize,
        o: u32,
    },
}

/// The faults a store can inflict, and what a backend can do.
#[derive(Clone, Debug, Default)]
pub struct Abilities {
    pub shared: bool,
    pub permits: bool,
    pub fair: bool,
    pub held: bool,
    pub named_force: bool,
    /// A release hands the key over only if an attempt found it held
    /// since it was taken (Redis's waiter mark): a key taken past the
    /// queue by a plain attempt, and released before any waiter looked
    /// again, is left free for the first waiter's next look.
    pub handoff_needs_mark: bool,
    /// Shared and permit holders are hidden from `holder`, `held` and the
    /// force releases (PostgreSQL keeps no record of them: those calls
    /// know exclusive holders only).
    pub members_hidden: bool,
    /// A force release breaks a holder of another process by ending its
    /// session, and every lease on that session with it (PostgreSQL).
    pub force_ends_sessions: bool,
    /// How often an operation is a fault, in percent (0: the default, 8).
    pub fault_percent: u64,
    /// The parts [`Op::Delete`] may remove.
    pub deletes: Vec<Part>,
    pub rewind: bool,
    pub foreign: bool,
    pub flush: bool,
    pub restart: bool,
    pub terminate: bool,
    pub table_lock: bool,
}

/// How often, in percent, a draw is a turn of the fair key's queue.
const FAIR_TURNS: u64 = 15;

impl Abilities {
    /// A backend of every mode (shared, permits, fair) that lists its
    /// holders and breaks a named one, and has no faults yet.
    pub fn every_mode() -> Self {
        Self {
            shared: true,
            permits: true,
            fair: true,
            held: true,
            named_force: true,
            ..Self::default()
        }
    }
}

impl Op {
    /// Whether this is an operator's fault rather than a call of dlock's.
    pub fn is_fault(&self) -> bool {
        matches!(
            self,
            Op::Delete { .. }
                | Op::Rewind { .. }
                | Op::Foreign { .. }
                | Op::Wipe { .. }
                | Op::Terminate { .. }
                | Op::TableLocked { .. }
        )
    }

    /// The operation as a Rust expression, for a regression test.
    pub fn to_rust(self) -> String {
        format!("Op::{self:?}")
            .replace("mode: ", "mode: Mode::")
            .replace("part: ", "part: Part::")
    }
}

/// Draws a run's operations.
pub struct Generator {
    rng: Rng,
    can: Abilities,
    processes: usize,
    /// Owners drawn so far: their key and process.
    owners: Vec<(usize, usize)>,
    /// Operations due in so many draws: the repair of a counter set to a
    /// value that is no counter.
    due: Vec<(u32, Op)>,
}

impl Generator {
    pub fn new(seed: u64, can: Abilities, processes: usize) -> Self {
        Self {
            rng: Rng::new(seed),
            can,
            processes,
            owners: Vec::new(),
            due: Vec::new(),
        }
    }

    fn pick(&mut self, n: usize) -> usize {
        self.rng.range(0, n as u64 - 1) as usize
    }

    /// An owner of key `k`: most often one drawn before (a retry, an
    /// extend, a release), else a new one, with the process it uses.
    fn owner(&mut self, k: usize, fresh: bool) -> (u32, usize) {
        let known: Vec<usize> = (0..self.owners.len())
            .filter(|o| self.owners[*o].0 == k)
            .collect();
        if !fresh && !known.is_empty() {
            // Recent owners more often: they are the ones that hold.
            let from = known.len().saturating_sub(6);
            let o = known[from + self.pick(known.len() - from)];
            return (o as u32, self.owners[o].1);
        }
        let p = self.pick(self.processes);
        self.owners.push((k, p));
        ((self.owners.len() - 1) as u32, p)
    }

    fn key(&mut self) -> usize {
        self.pick(KEYS)
    }

    /// The mode of an acquisition of `k`, among those the backend keeps.
    fn mode(&mut self, k: usize) -> Mode {
        match k {
            RW_KEY if self.can.shared && self.rng.chance(50) => Mode::Shared,
            PERMIT_KEY if self.can.permits => Mode::Permit,
            FAIR_KEY if self.can.fair => match self.pick(3) {
                0 => Mode::Exclusive,
                1 => Mode::Respect,
                _ => Mode::Join,
            },
            _ => Mode::Exclusive,
        }
    }

    /// The next operation; a fault about one time in `1 / fault_percent`.
    pub fn next(&mut self, fault_percent: u64) -> Op {
        for due in &mut self.due {
            due.0 = due.0.saturating_sub(1);
        }
        if let Some(at) = self.due.iter().position(|(left, _)| *left == 0) {
            return self.due.remove(at).1;
        }
        if self.rng.chance(fault_percent)
            && let Some(fault) = self.fault()
        {
            return fault;
        }
        if self.can.fair && self.rng.chance(FAIR_TURNS) {
            return self.fair_turn();
        }
        let k = self.key();
        let p = self.pick(self.processes);
        match self.rng.range(0, 99) {
            0..=34 => {
                let fresh = self.rng.chance(60);
                let (o, p) = self.owner(k, fresh);
                let mode = self.mode(k);
                Op::Acquire { p, k, o, mode }
            }
            35..=49 => Op::Extend {
                k,
                o: self.owner(k, false).0,
            },
            50..=69 => Op::Release {
                k,
                o: self.owner(k, false).0,
            },
            70..=74 => Op::ForceRelease { p, k },
            75..=79 if self.can.named_force => Op::ForceNamed { p, k },
            80..=82 if self.can.named_force => Op::ForceStale { p, k },
            83..=87 if self.can.held => Op::Held { p },
            88..=91 if self.can.shared => {
                let (o, p) = self.owner(RW_KEY, true);
                let (reader, _) = self.owner(RW_KEY, true);
                Op::WriterWaits { p, o, reader }
            }
            _ => Op::Holder { p, k },
        }
    }

    /// A turn of the fair key's queue: a fresh owner joins, or a known
    /// owner of the key releases (the holder, handing over) or leaves.
    /// Drawn on their own, the three keys' many operations rarely release
    /// a fair key while someone queues for it.
    fn fair_turn(&mut self) -> Op {
        let k = FAIR_KEY;
        if self.rng.chance(50) {
            let (o, p) = self.owner(k, true);
            Op::Acquire {
                p,
                k,
                o,
                mode: Mode::Join,
            }
        } else {
            Op::Release {
                k,
                o: self.owner(k, false).0,
            }
        }
    }

    /// A fault the store can inflict, if it has any.
    fn fault(&mut self) -> Option<Op> {
        let mut kinds = Vec::new();
        if !self.can.deletes.is_empty() {
            kinds.extend([0, 0, 0]);
        }
        if self.can.rewind {
            kinds.extend([1, 1]);
        }
        if self.can.foreign {
            kinds.push(2);
        }
        if self.can.flush || self.can.restart {
            kinds.push(3);
        }
        if self.can.terminate {
            kinds.push(4);
        }
        if self.can.table_lock {
            kinds.push(5);
        }
        if kinds.is_empty() {
            return None;
        }
        let k = self.key();
        let kind = kinds[self.pick(kinds.len())];
        Some(match kind {
            0 => {
                let i = self.pick(self.can.deletes.len());
                let part = self.can.deletes[i];
                Op::Delete { k, part }
            }
            1 => {
                // Most of these values are no counter, which refuses every
                // grant of the key until an operator repairs it: the
                // repair (the fence deleted) comes a few draws later, or
                // a quarter of a run would test refusals only.
                if self.can.deletes.contains(&Part::Fence) {
                    let after = self.rng.range(2, 12) as u32;
                    self.due.push((
                        after,
                        Op::Delete {
                            k,
                            part: Part::Fence,
                        },
                    ));
                }
                Op::Rewind {
                    k,
                    value: self.pick(FENCE_VALUES.len()),
                }
            }
            2 => Op::Foreign {
                k,
                value: self.pick(FOREIGN_VALUES.len()),
            },
            3 => Op::Wipe {
                restart: self.can.restart && (!self.can.flush || self.rng.chance(30)),
            },
            4 => Op::Terminate {
                p: self.pick(self.processes),
            },
            _ => {
                // Not the fair key: an abandoned fair attempt is not
                // exactly given back by one release.
                let k = self.pick(2);
                let (o, p) = self.owner(k, true);
                Op::TableLocked {
                    table: self.pick(2),
                    p,
                    k,
                    o,
                }
            }
        })
    }
}

//! The reference model: what the rules of `dlock::Backend` (rules 1 to 4,
//! F1 to F3, M1 to M5) allow a store to answer, given every answer before.
//!
//! Each method takes the answer the real store gave, checks it against the
//! rules, and moves the model on by it: `Err` names the rule broken. Where
//! the rules leave a choice (which permit slot, whether a retry draws a new
//! token), the model takes the store's. Where an operator's fault makes
//! several answers legal (a holder's token read after the counter was set
//! back), the model allows exactly those.

use std::collections::{BTreeMap, BTreeSet};

use crate::ops::{Mode, PERMITS};

/// An owner number of the run (see `ops`).
pub type Owner = u32;

/// Who holds a key, by the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hold {
    Free,
    Exclusive {
        owner: Owner,
        token: u64,
    },
    /// A read phase: its readers and its token (rule M2).
    Shared {
        owners: BTreeSet<Owner>,
        token: u64,
    },
    /// Permit slots: slot -> (owner, token).
    Permits {
        slots: BTreeMap<u32, (Owner, u64)>,
    },
    /// A value someone else wrote under the lock: held, by nobody of dlock.
    Foreign,
}

/// What a `try_acquire` answered, as the model reads it.
#[derive(Clone, Debug)]
pub enum Answer {
    Acquired {
        token: u64,
        slot: Option<u32>,
    },
    Held,
    /// `Attempt::Behind`, which no attempt of the model may get (they all
    /// ask the store, `Look::Again`).
    Behind,
    Failed(String),
}

/// One key's state.
#[derive(Clone, Debug)]
pub struct KeyModel {
    pub hold: Hold,
    /// The highest token granted on the key (rule 2).
    pub max: u64,
    /// Fair waiters, in queue order (rule F1).
    pub queue: Vec<Owner>,
    /// The token counter holds no counter (Redis): a grant that must draw
    /// may fail instead, leaving the key as it was.
    pub counter_broken: bool,
    /// The counter was set back or deleted since the last grant: a read
    /// of permit holders may name any token (Redis keeps no token per
    /// permit, and reads theirs from the counter).
    pub counter_touched: bool,
    /// An attempt found the key held since it was last granted (Redis
    /// marks the holder's value, so its release looks at the queue).
    pub marked: bool,
}

impl KeyModel {
    fn new() -> Self {
        Self {
            hold: Hold::Free,
            max: 0,
            queue: Vec::new(),
            counter_broken: false,
            counter_touched: false,
            marked: false,
        }
    }

    /// Whether `owner` holds the key.
    pub fn holds(&self, owner: Owner) -> bool {
        match &self.hold {
            Hold::Exclusive { owner: o, .. } => *o == owner,
            Hold::Shared { owners, .. } => owners.contains(&owner),
            Hold::Permits { slots } => slots.values().any(|(o, _)| *o == owner),
            Hold::Free | Hold::Foreign => false,
        }
    }

    /// Every owner that holds the key.
    pub fn holders(&self) -> Vec<Owner> {
        match &self.hold {
            Hold::Exclusive { owner, .. } => vec![*owner],
            Hold::Shared { owners, .. } => owners.iter().copied().collect(),
            Hold::Permits { slots } => slots.values().map(|(o, _)| *o).collect(),
            Hold::Free | Hold::Foreign => Vec::new(),
        }
    }

    /// A fresh token: above every one granted before (rule 2).
    fn fresh(&mut self, token: u64, what: &str) -> Result<(), String> {
        if token <= self.max {
            return Err(format!(
                "rule 2: {what} was granted token {token}, not above the key's last token {}",
                self.max
            ));
        }
        self.max = token;
        self.counter_touched = false;
        self.marked = false;
        Ok(())
    }
}

/// The model of a run's keys.
#[derive(Clone, Debug)]
pub struct Model {
    pub keys: Vec<KeyModel>,
    /// See `Abilities::members_hidden`.
    pub members_hidden: bool,
}

impl Model {
    pub fn new(keys: usize) -> Self {
        Self {
            keys: (0..keys).map(|_| KeyModel::new()).collect(),
            members_hidden: false,
        }
    }

    /// Checks a `try_acquire` of `k` by `owner` in `mode`.
    pub fn acquire(
        &mut self,
        k: usize,
        owner: Owner,
        mode: Mode,
        answer: &Answer,
    ) -> Result<(), String> {
        let key = &mut self.keys[k];
        let what = format!("{mode:?} attempt of owner {owner}");
        let (token, slot) = match answer {
            Answer::Behind => {
                return Err(format!(
                    "{what}: answered Behind to an attempt that asks the store"
                ));
            }
            Answer::Failed(err) => {
                // Only a grant that must draw from a broken counter may fail.
                // (A fair attempt that finds the key free hands it to the
                // first waiter, which draws too.)
                if key.counter_broken
                    && (Self::would_draw(key, owner, mode) || key.hold == Hold::Free)
                {
                    // Refused, and nothing left held: an exclusive
                    // holder's retry, which draws anew, gives the key up (a
                    // permit's keeps its slot as it was).
                    if key.holds(owner) && matches!(key.hold, Hold::Exclusive { .. }) {
                        Self::drop_holder(key, owner);
                    }
                    return Ok(());
                }
                return Err(format!("{what} failed: {err}"));
            }
            Answer::Held => {
                if key.holds(owner) {
                    return Err(format!(
                        "rule 3: {what} holds the key, and its retry was refused"
                    ));
                }
                if Self::may_take(key, owner, mode) {
                    return Err(format!(
                        "{what} was refused a key it may take: {:?}, queue {:?}",
                        key.hold, key.queue
                    ));
                }
                key.marked = true;
                if mode == Mode::Join && !key.queue.contains(&owner) {
                    key.queue.push(owner);
                }
                return Ok(());
            }
            Answer::Acquired { token, slot } => (*token, *slot),
        };
        // A counter that cannot rise refuses every draw (Redis puts the
        // value back and `INCR` fails): a new grant from it is a token
        // made up from a value that is no counter.
        if key.counter_broken && !key.holds(owner) && Self::would_draw(key, owner, mode) {
            return Err(format!(
                "{what} was granted token {token} though the key's counter cannot rise"
            ));
        }
        if key.holds(owner) {
            return Self::retried(key, owner, token, slot, &what);
        }
        if !Self::may_take(key, owner, mode) {
            return Err(format!(
                "{what} was granted (token {token}) a key held as {:?}, queue {:?}",
                key.hold, key.queue
            ));
        }
        key.queue.retain(|o| *o != owner);
        match (&mut key.hold, mode) {
            (
                Hold::Shared {
                    owners,
                    token: phase,
                },
                Mode::Shared,
            ) => {
                if token != *phase {
                    return Err(format!(
                        "rule M2: {what} joined a live read phase with token {token}, not the phase token {phase}"
                    ));
                }
                owners.insert(owner);
                Ok(())
            }
            (Hold::Permits { slots }, Mode::Permit) => {
                let slot = Self::free_slot(slots, slot, &what)?;
                key.fresh(token, &what)?;
                if let Hold::Permits { slots } = &mut key.hold {
                    slots.insert(slot, (owner, token));
                }
                Ok(())
            }
            (Hold::Free, Mode::Permit) => {
                let slot = Self::free_slot(&BTreeMap::new(), slot, &what)?;
                key.fresh(token, &what)?;
                key.hold = Hold::Permits {
                    slots: BTreeMap::from([(slot, (owner, token))]),
                };
                Ok(())
            }
            (Hold::Free, Mode::Shared) => {
                key.fresh(token, &what)?;
                key.hold = Hold::Shared {
                    owners: BTreeSet::from([owner]),
                    token,
                };
                Ok(())
            }
            (Hold::Free, _) => {
                key.fresh(token, &what)?;
                key.hold = Hold::Exclusive { owner, token };
                Ok(())
            }
            (hold, _) => Err(format!("{what} was granted beside {hold:?}")),
        }
    }

    /// Rule 3: a retry by the owner that holds is a success, with the
    /// token already drawn or a new one, in the same slot.
    fn retried(
        key: &mut KeyModel,
        owner: Owner,
        token: u64,
        slot: Option<u32>,
        what: &str,
    ) -> Result<(), String> {
        match &mut key.hold {
            Hold::Exclusive { token: had, .. } => {
                if token != *had {
                    key.fresh(token, what)?;
                    key.hold = Hold::Exclusive { owner, token };
                }
                Ok(())
            }
            Hold::Shared { token: phase, .. } => {
                if token != *phase {
                    return Err(format!(
                        "rule M5: {what}, a retry of a reader, got token {token}, not the phase token {phase}"
                    ));
                }
                Ok(())
            }
            Hold::Permits { slots } => {
                let Some((&held, &(_, had))) = slots.iter().find(|(_, (o, _))| *o == owner) else {
                    unreachable!("the owner holds a slot")
                };
                if slot != Some(held) {
                    return Err(format!(
                        "rule M5: {what}, a retry of slot {held}'s holder, answered slot {slot:?}"
                    ));
                }
                if token != had {
                    key.fresh(token, what)?;
                    if let Hold::Permits { slots } = &mut key.hold {
                        slots.insert(held, (owner, token));
                    }
                }
                Ok(())
            }
            Hold::Free | Hold::Foreign => unreachable!("the owner holds"),
        }
    }

    fn free_slot(
        slots: &BTreeMap<u32, (Owner, u64)>,
        slot: Option<u32>,
        what: &str,
    ) -> Result<u32, String> {
        match slot {
            Some(slot) if slot < PERMITS && !slots.contains_key(&slot) => Ok(slot),
            other => Err(format!(
                "rule M1: {what} was granted slot {other:?}, with slots {slots:?} taken of {PERMITS}"
            )),
        }
    }

    /// Whether the rules let `owner`'s attempt in `mode` take the key now.
    fn may_take(key: &KeyModel, owner: Owner, mode: Mode) -> bool {
        if key.holds(owner) {
            return true;
        }
        let queue_free = match mode {
            Mode::Respect => key.queue.is_empty(),
            Mode::Join => key.queue.first().is_none_or(|first| *first == owner),
            _ => true,
        };
        match (&key.hold, mode) {
            (Hold::Free, _) => queue_free,
            (Hold::Shared { .. }, Mode::Shared) => true,
            (Hold::Permits { slots }, Mode::Permit) => (slots.len() as u32) < PERMITS,
            _ => false,
        }
    }

    /// Whether a grant to `owner` now would draw a token from the counter
    /// (every grant but a reader's in a live phase).
    fn would_draw(key: &KeyModel, owner: Owner, mode: Mode) -> bool {
        Self::may_take(key, owner, mode)
            && !matches!((&key.hold, mode), (Hold::Shared { .. }, Mode::Shared))
    }

    /// Checks an `extend` of `owner`'s lease: true exactly while it holds.
    pub fn extend(
        &self,
        k: usize,
        owner: Owner,
        answer: Result<bool, String>,
    ) -> Result<(), String> {
        let holds = self.keys[k].holds(owner);
        match answer {
            Ok(extended) if extended == holds => Ok(()),
            Ok(extended) => Err(format!(
                "extend of owner {owner} answered {extended}, but it {} the key ({:?})",
                if holds { "holds" } else { "does not hold" },
                self.keys[k].hold
            )),
            Err(err) => Err(format!("extend of owner {owner} failed: {err}")),
        }
    }

    /// Checks a `release` of `owner`'s lease. `Ok(Some(next))`: the
    /// release handed the key over to the fair waiter `next` (rule F2),
    /// whose token the caller reads and passes to [`Model::handed`].
    pub fn release(
        &mut self,
        k: usize,
        owner: Owner,
        released: Result<bool, String>,
    ) -> Result<Option<Owner>, String> {
        let key = &mut self.keys[k];
        let holds = key.holds(owner);
        let released = released.map_err(|err| format!("release of owner {owner} failed: {err}"))?;
        if released != holds {
            return Err(format!(
                "release of owner {owner} answered {}, but it {} the key ({:?})",
                if released { "Released" } else { "NotOwner" },
                if holds { "holds" } else { "does not hold" },
                key.hold
            ));
        }
        // Rule F3: a waiter that leaves takes its entry with it.
        key.queue.retain(|o| *o != owner);
        if !holds {
            return Ok(None);
        }
        Self::drop_holder(key, owner);
        if key.hold == Hold::Free && !key.queue.is_empty() {
            return Ok(Some(key.queue.remove(0)));
        }
        Ok(None)
    }

    /// `owner` holds the key no more.
    fn drop_holder(key: &mut KeyModel, owner: Owner) {
        match &mut key.hold {
            Hold::Shared { owners, .. } => {
                owners.remove(&owner);
                if owners.is_empty() {
                    key.hold = Hold::Free;
                }
            }
            Hold::Permits { slots } => {
                slots.retain(|_, (o, _)| *o != owner);
                if slots.is_empty() {
                    key.hold = Hold::Free;
                }
            }
            _ => key.hold = Hold::Free,
        }
    }

    /// Rule F2: the key was handed to `owner` with `token`.
    pub fn handed(&mut self, k: usize, owner: Owner, token: u64) -> Result<(), String> {
        let key = &mut self.keys[k];
        key.fresh(token, &format!("the handoff to owner {owner}"))?;
        key.hold = Hold::Exclusive { owner, token };
        Ok(())
    }

    /// Checks a `force_release`: true exactly when the key was held; every
    /// holder loses it.
    pub fn force(&mut self, k: usize, answer: Result<bool, String>) -> Result<(), String> {
        if self.hidden(k) {
            return match answer {
                Ok(false) => Ok(()),
                other => Err(format!(
                    "force_release of a key only members hold answered {other:?}"
                )),
            };
        }
        let key = &mut self.keys[k];
        let held = key.hold != Hold::Free;
        match answer {
            Ok(broken) if broken == held => {
                key.hold = Hold::Free;
                Ok(())
            }
            Ok(broken) => Err(format!(
                "force_release answered {broken}, with the key {:?}",
                key.hold
            )),
            Err(err) => Err(format!("force_release failed: {err}")),
        }
    }

    /// The token a holder read must name, if the rules fix it: `Ok(None)`
    /// for any. `Err` if the key must read as free or held and did not.
    pub fn holder(&self, k: usize, read: Option<Option<u64>>) -> Result<(), String> {
        if self.hidden(k) {
            return match read {
                None => Ok(()),
                Some(_) => Err(format!("holder read {read:?} of a key only members hold")),
            };
        }
        let key = &self.keys[k];
        let wrong = || {
            format!(
                "holder read {read:?} with the key {:?} (last token {})",
                key.hold, key.max
            )
        };
        match (&key.hold, read) {
            (Hold::Free, None) => Ok(()),
            (Hold::Free, Some(_)) | (_, None) => Err(wrong()),
            (Hold::Permits { .. }, Some(_)) if key.counter_touched => Ok(()),
            (Hold::Exclusive { token, .. }, Some(Some(read))) if read == *token => Ok(()),
            (Hold::Shared { token, .. }, Some(read)) if read.is_none_or(|read| read == *token) => {
                Ok(())
            }
            (Hold::Permits { .. }, Some(read)) if read.is_none_or(|read| read <= key.max) => Ok(()),
            (Hold::Foreign, Some(None)) => Ok(()),
            _ => Err(wrong()),
        }
    }

    /// Every key the model says is held.
    pub fn held_keys(&self) -> Vec<usize> {
        (0..self.keys.len())
            .filter(|k| self.keys[*k].hold != Hold::Free && !self.hidden(*k))
            .collect()
    }

    /// Whether `k` is held by shared or permit holders the store hides.
    pub fn hidden(&self, k: usize) -> bool {
        self.members_hidden
            && matches!(
                self.keys[k].hold,
                Hold::Shared { .. } | Hold::Permits { .. }
            )
    }

    /// An operator's fault ended every holding of `k` (the lock deleted,
    /// the store wiped, a foreign value written over it).
    pub fn lose(&mut self, k: usize, foreign: bool) {
        self.keys[k].hold = if foreign { Hold::Foreign } else { Hold::Free };
    }

    /// The sessions of a process ended: every holding of `owners` ends.
    pub fn lose_owners(&mut self, owners: &[Owner]) {
        for key in &mut self.keys {
            match &mut key.hold {
                Hold::Exclusive { owner, .. } if owners.contains(owner) => key.hold = Hold::Free,
                Hold::Shared {
                    owners: readers, ..
                } => {
                    readers.retain(|o| !owners.contains(o));
                    if readers.is_empty() {
                        key.hold = Hold::Free;
                    }
                }
                Hold::Permits { slots } => {
                    slots.retain(|_, (o, _)| !owners.contains(o));
                    if slots.is_empty() {
                        key.hold = Hold::Free;
                    }
                }
                _ => {}
            }
        }
    }
}

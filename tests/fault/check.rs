//! The checker: reads the history the workers printed, the driver's kill
//! and pause times and the register's final value, and says whether any
//! stale write was accepted, whether accepted tokens rose strictly, whether
//! any increment was lost — and how often two workers both believed they
//! held the lock.
//!
//! The unit of work is a step: a read of the register, then one write of
//! `count + 1` built on it. A lease of the lock scenario makes one step; a
//! term of the election scenario makes one after another under its one
//! token, numbered from 1, so every write is told apart by its token and
//! step (`<token>/<step>` in the events and in the values it writes).
//!
//! "Accepted tokens strictly increase" is checked per write: along the
//! order in which writes were accepted (each accepted write read the value
//! of the one before it), the token rises, or stays with a later step of
//! the same term.
//!
//! That order cannot see a token source that went back (a rewound counter,
//! a restored sequence): the rewound holder's read is refused as stale, and
//! the old holder's higher-token write is accepted — the very thing fencing
//! is there to stop, and every accepted token still rises. So tokens are
//! also checked per process: one worker process takes its leases one after
//! another, so each lease's token must be above that process's previous
//! lease's token. No clocks are compared, only the order of one process's
//! own lines (a restarted worker is a new process).
//!
//! The election scenario adds what an election promises (see
//! [`ElectionVerdict`]): a leader paused past its ttl and deposed meanwhile
//! learns of its loss after resuming, not by a write of its own getting
//! through; every write it still attempts is refused; and the terms'
//! accepted writes never interleave.
//!
//! The fair scenario adds what a fair lock promises a waiter (see
//! [`FairVerdict`]): one that timed out did so while the key was held, not
//! while it lay free with the waiter still queued behind nobody alive.
//!
//! The permits and read-write scenarios add theirs in `fault::modes`: a
//! permits history is checked slot by slot and for the holders at once;
//! a read-write history's readers (`BEGIN <t> shared`) take part in the
//! checks with their fenced reads, may share a token and overlap without
//! counting as double belief, and must not be refused while current.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;

use dlock::backend::QUEUE_ENTRY_TTL;

use super::modes::{PermitsVerdict, ReadWriteVerdict, check_permits, check_readers};
use super::worker::TTL;

/// One line a worker printed.
#[derive(Clone, Debug)]
pub struct Event {
    /// The worker process (a restarted worker is a new one).
    pub process: usize,
    pub t_us: u64,
    pub what: String,
    pub token: u64,
    /// The step of a term (election scenario); 0 in the lock scenario,
    /// where a lease makes a single step.
    pub step: u64,
    /// The permit slot of the lease (permits scenario: `<token>@<slot>`).
    pub slot: Option<u32>,
    pub detail: String,
}

impl Event {
    /// Parses `EV <µs> <WHAT> <token>[/<step>|@<slot>] [detail]`.
    pub fn parse(process: usize, line: &str) -> Option<Self> {
        let mut words = line.strip_prefix("EV ")?.splitn(4, ' ');
        let t_us = words.next()?.parse().ok()?;
        let what = words.next()?.to_owned();
        let token_word = words.next()?;
        let (token, slot) = match token_word.split_once('@') {
            Some((token, slot)) => (token, Some(slot.parse().ok()?)),
            None => (token_word, None),
        };
        let (token, step) = parse_token(token)?;
        let detail = words.next().unwrap_or_default().to_owned();
        Some(Self {
            process,
            t_us,
            what,
            token,
            step,
            slot,
            detail,
        })
    }
}

/// `<token>` or `<token>/<step>`.
fn parse_token(text: &str) -> Option<(u64, u64)> {
    match text.split_once('/') {
        Some((token, step)) => Some((token.parse().ok()?, step.parse().ok()?)),
        None => Some((text.parse().ok()?, 0)),
    }
}

/// A pause the driver made: the process was stopped (SIGSTOP) from
/// `stopped_us` until `resumed_us` (SIGCONT), for longer than the ttl.
#[derive(Clone, Copy, Debug)]
pub struct Pause {
    pub process: usize,
    pub stopped_us: u64,
    /// Taken just before SIGCONT: every line the resumed process prints is
    /// later.
    pub resumed_us: u64,
}

/// A partition the driver made: the process's link was frozen from
/// `from_us` until `to_us` (then cut, or let through).
#[derive(Clone, Copy, Debug)]
pub struct Cut {
    pub process: usize,
    pub from_us: u64,
    pub to_us: u64,
}

/// What the checker reads.
#[derive(Debug, Default)]
pub struct History {
    pub events: Vec<Event>,
    /// When the driver SIGKILLed a process: its belief ends there.
    pub killed_at: HashMap<usize, u64>,
    /// The driver's pauses past the ttl.
    pub pauses: Vec<Pause>,
    /// The driver's partitions.
    pub partitions: Vec<Cut>,
    /// When the driver broke things on the lock store's side (from, to, in
    /// µs): a server fault, a rewind of the token source.
    pub server_faults: Vec<(u64, u64)>,
    /// When the run ended (belief of anyone still holding ends there).
    pub end_us: u64,
    /// The register's value after every worker has stopped.
    pub final_value: String,
    /// The election scenario: check what an election promises too.
    pub election: bool,
    /// The fair scenario: check the acquisitions that timed out too.
    pub fair: bool,
    /// How long the store keeps the key of a holder that went silent
    /// (killed, stopped, cut off) after its last word: the ttl, or on
    /// PostgreSQL the server's idle-session timeout.
    pub silent_hold_us: u64,
    /// The read-write scenario: readers (`BEGIN <t> shared`) must never be
    /// refused while current (see `fault::modes::ReadWriteVerdict`).
    pub read_write: bool,
    /// The permits scenario: how many permits the key has; the history is
    /// checked per slot, and for the number of holders at once.
    pub permits: Option<u32>,
    /// Permits: each slot's register value after every worker has
    /// stopped.
    pub slot_finals: BTreeMap<u32, String>,
}

/// A lease (lock scenario) or a term (election scenario) of one process.
#[derive(Debug, Default)]
struct Lease {
    process: usize,
    token: u64,
    begin: u64,
    /// A `BEGIN` line was printed (an election's term: elected).
    began: bool,
    /// A reader's lease (`BEGIN <t> shared`): readers coexist.
    shared: bool,
    believe_end: Option<u64>,
    /// The first `LOST` line: when, and how (`check`, `signal`).
    noticed: Option<(u64, String)>,
}

/// One step: a read, and the write built on it.
#[derive(Debug, Default)]
struct Attempt {
    read: Option<(u64, String)>,
    send: Option<(u64, String)>,
    /// Sent by a leader that had already lost its term (`LATE`).
    late: bool,
    outcome: Option<(u64, &'static str)>,
}

/// (process, token, step)
type StepId = (usize, u64, u64);

/// The checker's findings.
#[derive(Debug, Default)]
pub struct Verdict {
    pub leases: usize,
    pub writes_sent: usize,
    /// Writes the register accepted (answered, or settled from the history).
    pub writes_accepted: usize,
    /// Of those, writes whose answer never came back, settled as accepted
    /// because a later read saw their value (or it is the final value).
    pub settled_accepted: usize,
    /// Writes whose answer never came back and that no one ever saw.
    pub settled_refused: usize,
    /// Stale writes the fence refused (and stale reads).
    pub stale_writes_rejected: usize,
    pub stale_reads_rejected: usize,
    /// Accepted writes sent after the register had answered a higher token
    /// (a read, which records its token, or a write), or built on a value
    /// written under a higher token.
    pub stale_writes_accepted: usize,
    /// Accepted writes whose token and step are not above the ones of the
    /// write they overwrote.
    pub tokens_not_increasing: usize,
    /// Leases whose token is not above the token of the previous lease of
    /// the same process: the lock store handed out a token it had passed.
    pub tokens_went_back: usize,
    /// Accepted increments overwritten by another write that read the same
    /// value.
    pub lost_increments: usize,
    /// Reads of a value that no accepted write wrote.
    pub phantom_reads: usize,
    pub final_count: u64,
    /// Double-belief moments: pairs of leases of different workers whose
    /// belief intervals (from the body's start to the lost signal or the
    /// body's end, or the process's death) overlap. A holder paused past
    /// its ttl overlaps every lease taken while it was stopped.
    pub double_belief: usize,
    /// The election scenario's findings.
    pub election: Option<ElectionVerdict>,
    /// The fair scenario's findings.
    pub fair: Option<FairVerdict>,
    /// The permits scenario's findings.
    pub permits: Option<PermitsVerdict>,
    /// The read-write scenario's findings.
    pub read_write: Option<ReadWriteVerdict>,
    /// Acquisitions that failed with an error other than contention
    /// (`LERR` lines), and the first one's message.
    pub lock_errors: usize,
    pub first_lock_error: Option<String>,
    pub violations: Vec<String>,
}

impl Verdict {
    /// No stale write accepted, tokens rising (along the accepted writes
    /// and within each process), no increment lost, the register equal to
    /// the number of accepted writes, and (elections) every deposed leader
    /// told and refused.
    pub fn is_safe(&self) -> bool {
        self.violations.is_empty()
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "leases {}, writes sent {}, writes accepted {} ({} settled from the history, {} unseen ones refused), \
             stale writes rejected {}, stale reads rejected {}, double-belief moments {} (overlapping lease pairs), \
             stale writes accepted {}, tokens not increasing {}, tokens gone back within a process {}, lost increments {}, \
             phantom reads {}, register count {}",
            self.leases,
            self.writes_sent,
            self.writes_accepted,
            self.settled_accepted,
            self.settled_refused,
            self.stale_writes_rejected,
            self.stale_reads_rejected,
            self.double_belief,
            self.stale_writes_accepted,
            self.tokens_not_increasing,
            self.tokens_went_back,
            self.lost_increments,
            self.phantom_reads,
            self.final_count,
        )?;
        if self.lock_errors > 0 {
            write!(
                f,
                ", lock errors {} (first: {})",
                self.lock_errors,
                self.first_lock_error.as_deref().unwrap_or_default()
            )?;
        }
        if let Some(election) = &self.election {
            write!(f, "\n  {election}")?;
        }
        if let Some(fair) = &self.fair {
            write!(f, "\n  {fair}")?;
        }
        if let Some(permits) = &self.permits {
            write!(f, "\n  {permits}")?;
        }
        if let Some(read_write) = &self.read_write {
            write!(f, "\n  {read_write}")?;
        }
        Ok(())
    }
}

/// What the election scenario promises, checked over every pause past the
/// ttl that stopped a leader mid-term:
///
/// 1. Every write the paused leader attempted after resuming (its own, or
///    a late one: see `fault::election`) is refused once a newer term has
///    read or written the register before it resumed — and the refusal is
///    the fence's, since the checker counts what the register accepted.
/// 2. If another was elected while it was stopped, it learned of its loss
///    (a `LOST` line: `Term::check` failed, or the lost signal fired) after
///    resuming, and before any write of its own was accepted.
/// 3. At most one term writes at a time as the fence accepts them: no
///    write of an older term is accepted after a newer term's (this
///    follows from the fence; the stale-write checks find each such pair).
#[derive(Debug, Default)]
pub struct ElectionVerdict {
    /// Terms (`BEGIN` lines), and how many had a write accepted.
    pub terms: usize,
    pub terms_written: usize,
    /// Pauses past the ttl that stopped a process mid-term.
    pub paused_leaders: usize,
    /// Of those, the ones whose term another process won before the pause
    /// ended.
    pub deposed_by_pause: usize,
    /// Deposed paused leaders that printed `LOST` after resuming, by
    /// `Term::check` or by the lost signal.
    pub noticed_lost: usize,
    pub noticed_by_check: usize,
    pub noticed_by_signal: usize,
    /// The longest wait from a resume to its `LOST` line.
    pub slowest_notice_us: u64,
    /// Deposed paused leaders that never printed `LOST` (a violation).
    pub unnoticed: usize,
    /// Deposed paused leaders killed within a ttl of resuming, before they
    /// printed anything: nothing to check.
    pub killed_before_noticing: usize,
    /// Steps a deposed paused leader had read for before the pause and
    /// whose write it did not send as its own after resuming (check() or
    /// the lost signal stopped it).
    pub steps_stopped: usize,
    /// Writes deposed paused leaders attempted after resuming (late ones
    /// included), and what became of them.
    pub deposed_writes: usize,
    pub deposed_writes_refused: usize,
    /// Accepted although a newer term had read or written the register
    /// before the resume (a violation).
    pub deposed_writes_accepted: usize,
    /// Accepted with no newer term's read or write answered before: the
    /// fence had nothing to refuse them by (the new leader had not yet
    /// touched the register).
    pub deposed_writes_let_through: usize,
    /// Every `LATE` write of the run (losses of any kind), and how many the
    /// register refused.
    pub late_writes: usize,
    pub late_writes_refused: usize,
    /// Pairs of terms whose accepted writes interleave (a violation).
    pub terms_overlapping: usize,
}

impl fmt::Display for ElectionVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "election: terms {} ({} wrote), pauses of a leader past the ttl {} ({} deposed meanwhile: \
             {} noticed the loss after resuming ({} by check(), {} by the lost signal, slowest {:.1} ms), \
             {} never did, {} killed first), steps cut short {}, deposed leaders' writes after resuming {} \
             ({} refused, {} accepted, {} let through before any newer term touched the register), \
             late writes {} ({} refused), overlapping terms {}",
            self.terms,
            self.terms_written,
            self.paused_leaders,
            self.deposed_by_pause,
            self.noticed_lost,
            self.noticed_by_check,
            self.noticed_by_signal,
            self.slowest_notice_us as f64 / 1000.0,
            self.unnoticed,
            self.killed_before_noticing,
            self.steps_stopped,
            self.deposed_writes,
            self.deposed_writes_refused,
            self.deposed_writes_accepted,
            self.deposed_writes_let_through,
            self.late_writes,
            self.late_writes_refused,
            self.terms_overlapping,
        )
    }
}

/// The token and step of the write that wrote `value` (`"0:0"`: none).
fn written_by(value: &str) -> (u64, u64) {
    value
        .split(':')
        .nth(1)
        .and_then(parse_token)
        .unwrap_or((0, 0))
}

fn count_of(value: &str) -> u64 {
    value
        .split(':')
        .next()
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// "token 7", or "token 7 step 3" for a step of an election's term.
fn write_name(token: u64, step: u64) -> String {
    if step == 0 {
        format!("token {token}")
    } else {
        format!("token {token} step {step}")
    }
}

/// An accepted write.
struct Write<'a> {
    id: StepId,
    sent: u64,
    acked: Option<u64>,
    read: &'a str,
    value: &'a str,
}

pub fn check(history: &History) -> Verdict {
    if let Some(permits) = history.permits {
        return check_permits(history, permits);
    }
    let mut verdict = Verdict::default();
    // Leases by (process, token), steps by (process, token, step).
    let mut leases: BTreeMap<(usize, u64), Lease> = BTreeMap::new();
    let mut attempts: BTreeMap<StepId, Attempt> = BTreeMap::new();
    // Every answer the register gave a token (a read records it, a write
    // sets it): (when, token).
    let mut answered: Vec<(u64, u64)> = Vec::new();
    for ev in &history.events {
        if ev.what == "LERR" {
            verdict.lock_errors += 1;
            if verdict.first_lock_error.is_none() {
                verdict.first_lock_error = Some(ev.detail.clone());
            }
        }
        if ev.token == 0 {
            continue; // set-up errors, timeouts: not tied to a lease
        }
        let lease = leases
            .entry((ev.process, ev.token))
            .or_insert_with(|| Lease {
                process: ev.process,
                token: ev.token,
                begin: ev.t_us,
                ..Lease::default()
            });
        let id = (ev.process, ev.token, ev.step);
        match ev.what.as_str() {
            "BEGIN" => {
                lease.begin = ev.t_us;
                lease.began = true;
                lease.shared = ev.detail == "shared";
            }
            "LOST" | "END" => {
                lease.believe_end = Some(lease.believe_end.map_or(ev.t_us, |t| t.min(ev.t_us)));
                if ev.what == "LOST" && lease.noticed.is_none() {
                    lease.noticed = Some((ev.t_us, ev.detail.clone()));
                }
            }
            "READ" => {
                attempts.entry(id).or_default().read = Some((ev.t_us, ev.detail.clone()));
                answered.push((ev.t_us, ev.token));
            }
            "RSTALE" => verdict.stale_reads_rejected += 1,
            "SEND" | "LATE" => {
                let attempt = attempts.entry(id).or_default();
                attempt.send = Some((ev.t_us, ev.detail.clone()));
                attempt.late = ev.what == "LATE";
            }
            "OK" => {
                attempts.entry(id).or_default().outcome = Some((ev.t_us, "accepted"));
                answered.push((ev.t_us, ev.token));
            }
            "STALE" => {
                attempts.entry(id).or_default().outcome = Some((ev.t_us, "stale"));
                verdict.stale_writes_rejected += 1;
            }
            "WERR" => attempts.entry(id).or_default().outcome = Some((ev.t_us, "unknown")),
            _ => {}
        }
    }
    verdict.leases = leases.len();
    answered.sort_unstable();

    // Which writes the register accepted.
    let seen: HashSet<&str> = attempts
        .values()
        .filter_map(|a| a.read.as_ref().map(|(_, v)| v.as_str()))
        .chain(std::iter::once(history.final_value.as_str()))
        .collect();
    let mut accepted: Vec<Write<'_>> = Vec::new();
    for (&id, attempt) in &attempts {
        let Some((sent, value)) = &attempt.send else {
            continue;
        };
        verdict.writes_sent += 1;
        let acked = match attempt.outcome {
            Some((t, "accepted")) => Some(t),
            Some((_, "stale")) => continue,
            _ => {
                if seen.contains(value.as_str()) {
                    verdict.settled_accepted += 1;
                    None
                } else {
                    verdict.settled_refused += 1;
                    continue;
                }
            }
        };
        accepted.push(Write {
            id,
            sent: *sent,
            acked,
            read: attempt.read.as_ref().map_or("0:0", |(_, v)| v.as_str()),
            value,
        });
    }
    verdict.writes_accepted = accepted.len();

    // 1. Stale writes accepted, by the clock: sent after the register had
    // answered a higher token (a fenced read records its token, so a write
    // under a lower one must be refused from then on).
    let mut by_send: Vec<&Write<'_>> = accepted.iter().collect();
    by_send.sort_by_key(|w| w.sent);
    let (mut next, mut highest) = (0, 0u64);
    let mut stale: HashSet<StepId> = HashSet::new();
    // (older token, newer token) of writes that interleave.
    let mut overlapping: BTreeSet<(u64, u64)> = BTreeSet::new();
    for w in &by_send {
        while next < answered.len() && answered[next].0 < w.sent {
            highest = highest.max(answered[next].1);
            next += 1;
        }
        let (_, token, step) = w.id;
        if token < highest {
            stale.insert(w.id);
            overlapping.insert((token, highest));
            verdict.violations.push(format!(
                "stale write accepted: {} wrote {:?} after the register had answered token {highest}",
                write_name(token, step),
                w.value
            ));
        }
    }

    // 2. Along the order of acceptance (each accepted write read its
    // predecessor's value): tokens and steps rise, no two writes build on
    // one value.
    let values: HashSet<&str> = accepted.iter().map(|w| w.value).collect();
    let mut successors: HashMap<&str, Vec<u64>> = HashMap::new();
    for w in &accepted {
        let (_, token, step) = w.id;
        successors.entry(w.read).or_default().push(token);
        let (before, before_step) = written_by(w.read);
        if token < before {
            overlapping.insert((token, before));
            if stale.insert(w.id) {
                verdict.violations.push(format!(
                    "stale write accepted: {} overwrote {:?}, written under the higher token {before}",
                    write_name(token, step),
                    w.read
                ));
            }
        } else if token == before && step <= before_step {
            verdict.tokens_not_increasing += 1;
            verdict.violations.push(format!(
                "accepted tokens not strictly increasing: {} overwrote {:?}, written under the same token",
                write_name(token, step),
                w.read
            ));
        }
        if w.read != "0:0" && !values.contains(w.read) {
            verdict.phantom_reads += 1;
            verdict.violations.push(format!(
                "{} read {:?}, which no accepted write wrote",
                write_name(token, step),
                w.read
            ));
        }
    }
    verdict.stale_writes_accepted = stale.len();
    for (read, tokens) in &successors {
        if tokens.len() > 1 {
            verdict.lost_increments += tokens.len() - 1;
            verdict.violations.push(format!(
                "lost increment: tokens {tokens:?} were all accepted on top of {read:?}"
            ));
        }
    }

    // 3. The register equals the number of accepted writes.
    verdict.final_count = count_of(&history.final_value);
    if verdict.final_count != accepted.len() as u64 {
        verdict.violations.push(format!(
            "the register holds {:?} but {} writes were accepted",
            history.final_value,
            accepted.len()
        ));
    }

    // 4. Within one process, leases follow one another (`BEGIN`: the
    // macro's body starts, or a term; `TAKE`: an acquisition of an abandon
    // round that completed in time), so their tokens must rise in the
    // order printed. A reader (`BEGIN <t> shared`) may join the read phase
    // it read in before, with the same token: its token must not fall.
    let mut previous: HashMap<usize, u64> = HashMap::new();
    for ev in &history.events {
        if !matches!(ev.what.as_str(), "BEGIN" | "TAKE") {
            continue;
        }
        let reader = ev.detail == "shared";
        if let Some(before) = previous.insert(ev.process, ev.token)
            && (ev.token < before || (ev.token == before && !reader))
        {
            verdict.tokens_went_back += 1;
            verdict.violations.push(format!(
                "tokens went back: process {} took a lease with token {} after its lease with token {before}",
                ev.process, ev.token
            ));
        }
    }

    // Double belief: belief intervals of different processes that overlap
    // (two readers may: they share the key).
    let mut intervals: Vec<(u64, u64, usize, bool)> = leases
        .values()
        .map(|l| {
            let end = l
                .believe_end
                .or_else(|| history.killed_at.get(&l.process).copied())
                .unwrap_or(history.end_us);
            (l.begin, end.max(l.begin), l.process, l.shared)
        })
        .collect();
    intervals.sort_unstable();
    let mut active: Vec<(u64, usize, bool)> = Vec::new();
    for (start, end, process, shared) in intervals {
        active.retain(|&(e, _, _)| e > start);
        verdict.double_belief += active
            .iter()
            .filter(|&&(_, p, s)| p != process && !(s && shared))
            .count();
        active.push((end, process, shared));
    }

    if history.election {
        let first_pass = FirstPass {
            leases: &leases,
            attempts: &attempts,
            accepted: accepted.iter().map(|w| w.id).collect(),
            answered: &answered,
        };
        verdict.election = Some(check_election(
            history,
            &first_pass,
            &overlapping,
            &mut verdict.violations,
        ));
    }
    if history.fair {
        verdict.fair = Some(check_fair(history, &leases, &mut verdict.violations));
    }
    if history.read_write {
        verdict.read_write = Some(check_readers(history, &mut verdict.violations));
    }
    verdict
}

/// What the election checks read of the first pass.
struct FirstPass<'a> {
    leases: &'a BTreeMap<(usize, u64), Lease>,
    attempts: &'a BTreeMap<StepId, Attempt>,
    accepted: HashSet<StepId>,
    answered: &'a [(u64, u64)],
}

fn check_election(
    history: &History,
    pass: &FirstPass<'_>,
    overlapping: &BTreeSet<(u64, u64)>,
    violations: &mut Vec<String>,
) -> ElectionVerdict {
    let mut verdict = ElectionVerdict {
        terms: pass.leases.values().filter(|l| l.began).count(),
        terms_written: pass
            .accepted
            .iter()
            .map(|&(_, token, _)| token)
            .collect::<HashSet<_>>()
            .len(),
        ..ElectionVerdict::default()
    };
    for (id, attempt) in pass.attempts {
        if attempt.late && attempt.send.is_some() {
            verdict.late_writes += 1;
            if !pass.accepted.contains(id) {
                verdict.late_writes_refused += 1;
            }
        }
    }

    for pause in &history.pauses {
        let process = pause.process;
        // The term the process led when it was stopped.
        let Some(term) = pass
            .leases
            .values()
            .filter(|l| l.process == process && l.began && l.begin < pause.stopped_us)
            .filter(|l| l.believe_end.is_none_or(|end| end >= pause.stopped_us))
            .max_by_key(|l| l.begin)
        else {
            continue;
        };
        verdict.paused_leaders += 1;
        // Another process won a newer term before this one resumed.
        let Some(successor) = pass
            .leases
            .values()
            .filter(|l| l.process != process && l.began && l.token > term.token)
            .filter(|l| l.begin < pause.resumed_us)
            .min_by_key(|l| l.begin)
        else {
            continue;
        };
        verdict.deposed_by_pause += 1;
        let token = term.token;
        let what = format!(
            "process {process}'s term {token}, stopped for {:.1} s while term {} was elected",
            pause.resumed_us.saturating_sub(pause.stopped_us) as f64 / 1e6,
            successor.token
        );

        // (2) It learned of its loss after resuming.
        let notice = term
            .noticed
            .as_ref()
            .filter(|(t, _)| *t >= pause.stopped_us);
        match notice {
            Some((t, how)) => {
                verdict.noticed_lost += 1;
                if how == "check" {
                    verdict.noticed_by_check += 1;
                } else {
                    verdict.noticed_by_signal += 1;
                }
                verdict.slowest_notice_us = verdict
                    .slowest_notice_us
                    .max(t.saturating_sub(pause.resumed_us));
            }
            None if history
                .killed_at
                .get(&process)
                .is_some_and(|&k| k < pause.resumed_us + TTL.as_micros() as u64) =>
            {
                verdict.killed_before_noticing += 1;
            }
            None => {
                verdict.unnoticed += 1;
                violations.push(format!(
                    "deposed leader never told: {what}; after resuming it never learned it had lost"
                ));
            }
        }

        // (1) Every write it attempted after resuming is refused once a
        // newer term had been answered by the register.
        let newer_answered = pass
            .answered
            .iter()
            .take_while(|&&(at, _)| at < pause.resumed_us)
            .map(|&(_, answered)| answered)
            .filter(|&answered| answered > token)
            .max();
        for (&id, attempt) in pass
            .attempts
            .range((process, token, 0)..=(process, token, u64::MAX))
        {
            let Some((sent, value)) = &attempt.send else {
                if attempt
                    .read
                    .as_ref()
                    .is_some_and(|(t, _)| *t < pause.stopped_us)
                {
                    verdict.steps_stopped += 1;
                }
                continue;
            };
            if *sent < pause.resumed_us {
                continue;
            }
            if attempt.late
                && attempt
                    .read
                    .as_ref()
                    .is_some_and(|(t, _)| *t < pause.stopped_us)
            {
                verdict.steps_stopped += 1;
            }
            verdict.deposed_writes += 1;
            if !pass.accepted.contains(&id) {
                verdict.deposed_writes_refused += 1;
                continue;
            }
            let name = write_name(token, id.2);
            if notice.is_none_or(|(t, _)| *sent < *t) {
                violations.push(format!(
                    "deposed leader learned of its loss only by writing: {what}; its write {value:?} ({name}) was accepted before it noticed"
                ));
            }
            match newer_answered {
                Some(newer) => {
                    verdict.deposed_writes_accepted += 1;
                    violations.push(format!(
                        "deposed leader's write accepted: {what}; after resuming it wrote {value:?} ({name}), \
                         although the register had answered token {newer} before"
                    ));
                }
                None => verdict.deposed_writes_let_through += 1,
            }
        }
    }

    // (3) One term at a time: pairs found by the stale-write checks.
    verdict.terms_overlapping = overlapping.len();
    for (older, newer) in overlapping {
        violations.push(format!(
            "two terms wrote at once: term {older} had a write accepted after term {newer} was answered"
        ));
    }
    verdict
}

/// How often a fair waiter refreshes its queue entry and looks at the key
/// again (another `Join`): a key that falls free without a handoff (its
/// holder's lease ran out, the store broke it) is taken by the first live
/// waiter in the queue within this.
const REFRESH_US: u64 = QUEUE_ENTRY_TTL.as_micros() as u64 / 3;
/// How long a waiter's queue entry lives without a refresh: a waiter that
/// vanished (killed, stopped, cut off) keeps its place ahead of the others
/// at most this long.
const ENTRY_TTL_US: u64 = QUEUE_ENTRY_TTL.as_micros() as u64;
/// How much longer than its `BEGIN` and `END` lines say a lease held the
/// key: the grant reaches the body (a reply, a handoff notice) before
/// `BEGIN` is printed, and the release is sent after `END`.
const LINE_LAG_US: u64 = 100_000;
/// Room for the rest: round trips, a loaded machine's scheduling.
const SLACK_US: u64 = 500_000;

/// What a fair lock promises a waiter, checked over every acquisition of
/// the fair scenario that waited its whole `wait` and timed out (a
/// `TIMEOUT` line and the moment its wait began): the key was held for most
/// of the wait, not left free while the waiter queued behind nobody alive.
/// The waits that got the key (a `BEGIN` line with the moment its wait
/// began) are judged the same way, for the report.
///
/// A lease covers the key from its `BEGIN` to its `END` when it ended
/// cleanly, and to its holder's last word plus the time the store keeps a
/// silent holder's key (the ttl; PostgreSQL: the idle-session timeout) when
/// its holder was killed, stopped or cut off, or its lease was lost: the
/// store keeps the key until then. Each lease is given [`LINE_LAG_US`]
/// before its `BEGIN` and, ended cleanly, after its `END`. The free time of
/// a wait is the part of it no lease covers.
///
/// The queue's rules bound the free time of a wait. The key falls free
/// without a handoff when a lease runs out or is broken; the first live
/// waiter takes it at its next `Join`, within one refresh
/// (`QUEUE_ENTRY_TTL / 3`, 1 s): one refresh for the wait, and one for
/// every lease that ended uncleanly within it. A waiter ahead that vanished
/// (another process killed, stopped or cut off while not holding) keeps
/// its place until its entry expires (`QUEUE_ENTRY_TTL`, 3 s), may be
/// handed the key just before that and hold it as a silent holder does (at
/// most `min(ttl, entry ttl)`, or PostgreSQL's idle timeout), and then the
/// next live waiter takes it within a refresh: that much for each such
/// vanishing near the wait. Plus [`SLACK_US`]. With no fault near, a wait
/// may see 1.5 s of free time; the fair worker waits 8 s.
///
/// A wait that overlaps a fault on the store's side (a server fault, a
/// rewind; and an entry's life after it, while the queue it disturbed
/// settles) or a pause or partition of the waiter itself (its entry
/// expired, it lost its place) is excused: counted, not checked.
#[derive(Debug, Default)]
pub struct FairVerdict {
    /// Acquisitions that timed out.
    pub timed_out: usize,
    /// Of those, excused (see above), and checked.
    pub excused: usize,
    pub checked: usize,
    /// The largest free time of a checked wait, and what that wait allowed.
    pub largest_free_us: u64,
    pub largest_free_allowed_us: u64,
    /// The largest free time of any timed-out wait, excused ones included.
    pub largest_free_any_us: u64,
    /// Checked waits whose free time passed what they allowed (a violation).
    pub starved: usize,
    /// Waits that got the key, judged the same way for the report (not
    /// asserted: the promise is about waiters that gave up): how many, the
    /// largest free time of one not excused and what it allowed, and how
    /// many passed what they allowed.
    pub granted: usize,
    pub largest_free_granted_us: u64,
    pub largest_free_granted_allowed_us: u64,
    pub granted_past_allowance: usize,
}

impl fmt::Display for FairVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "fair: acquisitions timed out {} ({} checked, {} excused by a fault on the store's side or of the waiter), \
             largest free time in a checked wait {:.2} s (allowed {:.2} s), in any {:.2} s, \
             waiters timed out while the key lay free {}; waits that got the key {}, largest free time in one \
             {:.2} s (allowed {:.2} s), past what it allowed {}",
            self.timed_out,
            self.checked,
            self.excused,
            self.largest_free_us as f64 / 1e6,
            self.largest_free_allowed_us as f64 / 1e6,
            self.largest_free_any_us as f64 / 1e6,
            self.starved,
            self.granted,
            self.largest_free_granted_us as f64 / 1e6,
            self.largest_free_granted_allowed_us as f64 / 1e6,
            self.granted_past_allowance,
        )
    }
}

/// Where the store kept the key for one lease, as the checker reckons it.
struct Coverage {
    process: usize,
    /// From `BEGIN` to the believed end (`END`, `LOST`, the kill, the run's
    /// end): the process held the key then, and was queued nowhere.
    begin: u64,
    believed_end: u64,
    /// The end of the key's hold on the store's side.
    store_end: u64,
    clean: bool,
}

fn coverage(history: &History, lease: &Lease) -> Coverage {
    let hold = history.silent_hold_us;
    let process = lease.process;
    let killed = history.killed_at.get(&process).copied();
    let believed_end = lease
        .believe_end
        .or(killed)
        .unwrap_or(history.end_us)
        .max(lease.begin);
    // Until its release went out, a disturbance could keep the key held.
    let window = (lease.begin, believed_end + hold);
    let overlaps = |from: u64, to: u64| from <= window.1 && to >= window.0;
    let killed_near = killed.filter(|&k| overlaps(k, k));
    let paused = history
        .pauses
        .iter()
        .filter(|p| p.process == process && overlaps(p.stopped_us, p.resumed_us))
        .min_by_key(|p| p.stopped_us);
    let cut = history
        .partitions
        .iter()
        .any(|c| c.process == process && overlaps(c.from_us, c.to_us));
    let ended = lease.believe_end.is_some() && lease.noticed.is_none();
    let clean = ended && killed_near.is_none() && paused.is_none() && !cut;
    let store_end = if clean {
        believed_end + LINE_LAG_US
    } else {
        // The holder's last word: a stopped process renews nothing, so a
        // pause longer than the hold ends the key's hold; otherwise the
        // belief's end, or the kill if later (a release not yet sent).
        let last = match paused {
            Some(p)
                if p.stopped_us >= lease.begin
                    && p.stopped_us <= believed_end
                    && p.resumed_us - p.stopped_us >= hold =>
            {
                p.stopped_us
            }
            _ => believed_end.max(killed_near.unwrap_or(0)),
        };
        last + hold
    };
    Coverage {
        process,
        begin: lease.begin,
        believed_end,
        store_end,
        clean,
    }
}

fn check_fair(
    history: &History,
    leases: &BTreeMap<(usize, u64), Lease>,
    violations: &mut Vec<String>,
) -> FairVerdict {
    let mut verdict = FairVerdict::default();
    let judge = Judge::new(history, leases);
    for ev in &history.events {
        // A wait's window: from the moment it began to the `TIMEOUT` line,
        // or to the `BEGIN` line of the lease it got (which carries it).
        let timed_out = match ev.what.as_str() {
            "TIMEOUT" => true,
            "BEGIN" if !ev.detail.is_empty() => false,
            _ => continue,
        };
        let end = ev.t_us;
        let Ok(start) = ev.detail.trim().parse::<u64>() else {
            continue;
        };
        let start = start.min(end);
        let wait = judge.wait(ev.process, start, end);
        if !timed_out {
            verdict.granted += 1;
            if let Some(allowed) = wait.allowed {
                if wait.free > verdict.largest_free_granted_us
                    || verdict.largest_free_granted_allowed_us == 0
                {
                    verdict.largest_free_granted_us = wait.free;
                    verdict.largest_free_granted_allowed_us = allowed;
                }
                if wait.free > allowed {
                    verdict.granted_past_allowance += 1;
                }
            }
            continue;
        }
        verdict.timed_out += 1;
        verdict.largest_free_any_us = verdict.largest_free_any_us.max(wait.free);
        let Some(allowed) = wait.allowed else {
            verdict.excused += 1;
            continue;
        };
        verdict.checked += 1;
        if wait.free > verdict.largest_free_us || verdict.largest_free_allowed_us == 0 {
            verdict.largest_free_us = wait.free;
            verdict.largest_free_allowed_us = allowed;
        }
        if wait.free > allowed {
            verdict.starved += 1;
            violations.push(format!(
                "fair waiter timed out while the key lay free: process {} waited {:.2} s and the key was free for \
                 {:.2} s of it, past the {:.2} s the queue's rules allow ({} leases ran out in the wait, \
                 {} other waiters vanished near it)",
                ev.process,
                (end - start) as f64 / 1e6,
                wait.free as f64 / 1e6,
                allowed as f64 / 1e6,
                wait.lapsed,
                wait.vanished,
            ));
        }
    }
    verdict
}

/// One wait, judged.
struct Wait {
    /// The part of the wait no lease covered.
    free: u64,
    /// The free time the queue's rules allow it; `None`: excused.
    allowed: Option<u64>,
    /// Leases that ran out within it, other waiters that vanished near it.
    lapsed: u64,
    vanished: u64,
}

/// What the fair check knows of the whole run: where leases kept the key,
/// and who went silent when.
struct Judge<'a> {
    history: &'a History,
    covers: Vec<Coverage>,
    /// The leases' spans on the store's side, merged.
    held: Vec<(u64, u64)>,
    /// Processes gone silent (killed, stopped, cut off): (process, when).
    vanishings: Vec<(usize, u64)>,
    /// What one vanished waiter ahead may cost a wait.
    vanished_us: u64,
}

impl<'a> Judge<'a> {
    fn new(history: &'a History, leases: &BTreeMap<(usize, u64), Lease>) -> Self {
        let covers: Vec<Coverage> = leases.values().map(|l| coverage(history, l)).collect();
        let mut spans: Vec<(u64, u64)> = covers
            .iter()
            .map(|c| (c.begin.saturating_sub(LINE_LAG_US), c.store_end))
            .collect();
        spans.sort_unstable();
        let mut held: Vec<(u64, u64)> = Vec::new();
        for (from, to) in spans {
            match held.last_mut() {
                Some(last) if from <= last.1 => last.1 = last.1.max(to),
                _ => held.push((from, to)),
            }
        }
        let vanishings = history
            .killed_at
            .iter()
            .map(|(&p, &t)| (p, t))
            .chain(history.pauses.iter().map(|p| (p.process, p.stopped_us)))
            .chain(history.partitions.iter().map(|c| (c.process, c.from_us)))
            .collect();
        let hold = history.silent_hold_us;
        Self {
            history,
            covers,
            held,
            vanishings,
            vanished_us: ENTRY_TTL_US + hold.min(ENTRY_TTL_US) + REFRESH_US,
        }
    }

    /// The wait of `waiter` from `start` to `end`.
    fn wait(&self, waiter: usize, start: u64, end: u64) -> Wait {
        let history = self.history;
        let covered: u64 = self
            .held
            .iter()
            .map(|&(a, b)| b.min(end).saturating_sub(a.max(start)))
            .sum();
        let free = (end - start).saturating_sub(covered);
        let overlaps = |from: u64, to: u64| from <= end && to >= start;
        let excused = history
            .server_faults
            .iter()
            .any(|&(from, to)| overlaps(from, to + ENTRY_TTL_US))
            || history
                .pauses
                .iter()
                .any(|p| p.process == waiter && overlaps(p.stopped_us, p.resumed_us))
            || history
                .partitions
                .iter()
                .any(|c| c.process == waiter && overlaps(c.from_us, c.to_us));
        let lapsed = self
            .covers
            .iter()
            .filter(|c| !c.clean && start <= c.store_end && c.store_end <= end)
            .count() as u64;
        let holding = |process: usize, at: u64| {
            self.covers
                .iter()
                .any(|c| c.process == process && c.begin <= at && at <= c.believed_end)
        };
        let vanished = self
            .vanishings
            .iter()
            .filter(|&&(p, t)| p != waiter && !holding(p, t) && overlaps(t, t + self.vanished_us))
            .count() as u64;
        let allowed = SLACK_US + REFRESH_US * (1 + lapsed) + self.vanished_us * vanished;
        Wait {
            free,
            allowed: (!excused).then_some(allowed),
            lapsed,
            vanished,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Event, History, Pause, check};

    fn history(lines: &[(usize, &str)], final_value: &str) -> History {
        History {
            events: lines
                .iter()
                .filter_map(|(process, line)| Event::parse(*process, line))
                .collect(),
            final_value: final_value.to_owned(),
            end_us: 1_000,
            ..History::default()
        }
    }

    #[test]
    fn checker_passes_a_clean_chain_and_counts_the_overlap_of_a_paused_holder() {
        // 0 (token 7) reads and pauses; 1 (token 8) takes over and writes;
        // 0 resumes and is refused.
        let h = history(
            &[
                (0, "EV 10 BEGIN 7"),
                (0, "EV 11 READ 7 0:0"),
                (1, "EV 20 BEGIN 8"),
                (1, "EV 21 READ 8 0:0"),
                (1, "EV 22 SEND 8 1:8"),
                (1, "EV 23 OK 8"),
                (1, "EV 24 END 8"),
                (0, "EV 30 SEND 7 1:7"),
                (0, "EV 31 STALE 7 8"),
                (0, "EV 32 LOST 7"),
            ],
            "1:8",
        );
        let verdict = check(&h);
        assert!(verdict.is_safe(), "{:?}", verdict.violations);
        assert_eq!(verdict.writes_accepted, 1);
        assert_eq!(verdict.stale_writes_rejected, 1);
        assert_eq!(verdict.double_belief, 1);
    }

    #[test]
    fn checker_catches_a_stale_write_and_the_lost_increment_it_causes() {
        let h = history(
            &[
                (0, "EV 10 BEGIN 7"),
                (0, "EV 11 READ 7 0:0"),
                (1, "EV 20 BEGIN 8"),
                (1, "EV 21 READ 8 0:0"),
                (1, "EV 22 SEND 8 1:8"),
                (1, "EV 23 OK 8"),
                (0, "EV 30 SEND 7 1:7"),
                (0, "EV 31 OK 7"),
            ],
            "1:7",
        );
        let verdict = check(&h);
        assert!(!verdict.is_safe());
        assert_eq!(verdict.stale_writes_accepted, 1);
        assert_eq!(verdict.lost_increments, 1);
    }

    #[test]
    fn checker_settles_an_unanswered_write_by_whether_anyone_saw_it() {
        // Token 7's answer was lost, but token 8 read its value: accepted.
        // Token 9's answer was lost and nobody saw its value: refused.
        let h = history(
            &[
                (0, "EV 10 BEGIN 7"),
                (0, "EV 11 READ 7 0:0"),
                (0, "EV 12 SEND 7 1:7"),
                (0, "EV 13 WERR 7 timed out"),
                (1, "EV 20 BEGIN 8"),
                (1, "EV 21 READ 8 1:7"),
                (1, "EV 22 SEND 8 2:8"),
                (1, "EV 23 OK 8"),
                (2, "EV 30 BEGIN 9"),
                (2, "EV 31 READ 9 2:8"),
                (2, "EV 32 SEND 9 3:9"),
                (2, "EV 33 WERR 9 timed out"),
            ],
            "2:8",
        );
        let verdict = check(&h);
        assert!(verdict.is_safe(), "{:?}", verdict.violations);
        assert_eq!((verdict.settled_accepted, verdict.settled_refused), (1, 1));
        assert_eq!(verdict.writes_accepted, 2);
    }

    #[test]
    fn checker_passes_tokens_that_rise_within_every_process() {
        // Each process's tokens rise (across processes they interleave), and
        // an abandon round's lease taken and released at once counts too.
        let h = history(
            &[
                (0, "EV 10 BEGIN 7"),
                (0, "EV 11 READ 7 0:0"),
                (0, "EV 12 SEND 7 1:7"),
                (0, "EV 13 OK 7"),
                (0, "EV 14 END 7"),
                (1, "EV 20 TAKE 8"),
                (1, "EV 21 END 8"),
                (1, "EV 22 ABANDONED 0 2 of 3"),
                (1, "EV 30 BEGIN 9"),
                (1, "EV 31 READ 9 1:7"),
                (1, "EV 32 SEND 9 2:9"),
                (1, "EV 33 OK 9"),
                (1, "EV 34 END 9"),
                (0, "EV 40 BEGIN 10"),
                (0, "EV 41 READ 10 2:9"),
                (0, "EV 42 SEND 10 3:10"),
                (0, "EV 43 OK 10"),
                (0, "EV 44 END 10"),
            ],
            "3:10",
        );
        let verdict = check(&h);
        assert!(verdict.is_safe(), "{:?}", verdict.violations);
        assert_eq!(verdict.tokens_went_back, 0);
        assert_eq!((verdict.leases, verdict.writes_accepted), (4, 3));
    }

    #[test]
    fn checker_catches_a_rewound_token_that_the_write_order_hides() {
        // Process 1 writes under token 90. Process 0 takes token 100, reads,
        // and stalls. The store's counter is set back: process 1's next
        // lease gets token 2, and its read is refused as stale; then process
        // 0, whose lease the new one should have fenced off, writes and is
        // accepted. Along the accepted writes the tokens still rise (90,
        // 100), so only the per-process order shows the rewind.
        let h = history(
            &[
                (1, "EV 10 BEGIN 90"),
                (1, "EV 11 READ 90 0:0"),
                (1, "EV 12 SEND 90 1:90"),
                (1, "EV 13 OK 90"),
                (1, "EV 14 END 90"),
                (0, "EV 20 BEGIN 100"),
                (0, "EV 21 READ 100 1:90"),
                (0, "EV 22 LOST 100"),
                (1, "EV 30 BEGIN 2"),
                (1, "EV 31 RSTALE 2 100"),
                (1, "EV 32 END 2"),
                (0, "EV 40 SEND 100 2:100"),
                (0, "EV 41 OK 100"),
                (0, "EV 42 END 100"),
            ],
            "2:100",
        );
        let verdict = check(&h);
        assert!(!verdict.is_safe());
        assert_eq!(verdict.tokens_went_back, 1);
        assert_eq!(verdict.violations.len(), 1, "{:?}", verdict.violations);
        assert!(
            verdict.violations[0]
                .contains("process 1 took a lease with token 2 after its lease with token 90"),
            "{:?}",
            verdict.violations
        );
        // Everything the write order can see looks right.
        assert_eq!(verdict.writes_accepted, 2);
        assert_eq!(verdict.stale_writes_accepted, 0);
        assert_eq!(verdict.lost_increments, 0);
        assert_eq!(verdict.stale_reads_rejected, 1);
    }

    /// Process 0 leads term 7 and is stopped mid-step (it read `1:7/1`);
    /// process 1 wins term 9 meanwhile and increments; then what process 0
    /// prints after resuming.
    fn deposed_leader(after_resume: &[&'static str], final_value: &str) -> History {
        let mut lines = vec![
            (0, "EV 10 BEGIN 7"),
            (0, "EV 11 READ 7/1 0:0"),
            (0, "EV 12 SEND 7/1 1:7/1"),
            (0, "EV 13 OK 7/1"),
            (0, "EV 14 READ 7/2 1:7/1"),
            (1, "EV 30 BEGIN 9"),
            (1, "EV 31 READ 9/1 1:7/1"),
            (1, "EV 32 SEND 9/1 2:9/1"),
            (1, "EV 33 OK 9/1"),
        ];
        lines.extend(after_resume.iter().map(|line| (0, *line)));
        let mut h = history(&lines, final_value);
        h.pauses = vec![Pause {
            process: 0,
            stopped_us: 15,
            resumed_us: 40,
        }];
        h.election = true;
        h
    }

    #[test]
    fn checker_passes_a_deposed_leader_told_after_resuming_whose_late_write_is_refused() {
        let h = deposed_leader(
            &[
                "EV 41 LOST 7 check",
                "EV 42 LATE 7/2 2:7/2",
                "EV 43 STALE 7/2 9",
            ],
            "2:9/1",
        );
        let verdict = check(&h);
        assert!(verdict.is_safe(), "{:?}", verdict.violations);
        let election = verdict.election.expect("an election verdict");
        assert_eq!((election.terms, election.terms_written), (2, 2));
        assert_eq!(
            (
                election.paused_leaders,
                election.deposed_by_pause,
                election.noticed_by_check
            ),
            (1, 1, 1)
        );
        assert_eq!(
            (
                election.deposed_writes,
                election.deposed_writes_refused,
                election.steps_stopped
            ),
            (1, 1, 1)
        );
        assert_eq!(election.terms_overlapping, 0);
    }

    #[test]
    fn checker_catches_a_deposed_leader_never_told_whose_late_write_gets_through() {
        // No fence: the late write lands on top of term 9's increment.
        let h = deposed_leader(
            &["EV 42 LATE 7/2 2:7/2", "EV 43 OK 7/2", "EV 44 END 7"],
            "2:7/2",
        );
        let verdict = check(&h);
        let election = verdict.election.as_ref().expect("an election verdict");
        assert_eq!((election.deposed_by_pause, election.unnoticed), (1, 1));
        assert_eq!(election.deposed_writes_accepted, 1);
        assert_eq!(election.terms_overlapping, 1);
        assert_eq!(
            (verdict.stale_writes_accepted, verdict.lost_increments),
            (1, 1)
        );
        for expected in [
            "deposed leader never told",
            "deposed leader learned of its loss only by writing",
            "deposed leader's write accepted",
            "two terms wrote at once: term 7",
        ] {
            assert!(
                verdict.violations.iter().any(|v| v.contains(expected)),
                "no {expected:?} in {:?}",
                verdict.violations
            );
        }
    }

    /// A fair run's history: `lines` with times in ms (printed as µs), the
    /// run ending at 20 s, a silent holder's key kept for the 1 s ttl.
    fn fair_history(lines: &[(usize, u64, &str)], final_value: &str) -> History {
        let printed: Vec<(usize, String)> = lines
            .iter()
            .map(|(process, ms, rest)| (*process, format!("EV {} {rest}", ms * 1_000)))
            .collect();
        let borrowed: Vec<(usize, &str)> = printed.iter().map(|(p, l)| (*p, l.as_str())).collect();
        let mut h = history(&borrowed, final_value);
        h.end_us = 20_000_000;
        h.fair = true;
        h.silent_hold_us = 1_000_000;
        h
    }

    #[test]
    fn checker_catches_a_fair_waiter_that_timed_out_while_the_key_lay_free() {
        // Process 0 holds the key from 1.0 s to 1.5 s and releases it;
        // process 1, waiting since 1.0 s, is never handed it and times out
        // at 9.0 s, the key free for 7.4 s of its 8 s wait (the lease
        // covers 0.6 s of it, the lag after its END line included).
        let h = fair_history(
            &[
                (0, 1_000, "BEGIN 7"),
                (0, 1_100, "READ 7 0:0"),
                (0, 1_200, "SEND 7 1:7"),
                (0, 1_300, "OK 7"),
                (0, 1_500, "END 7"),
                (1, 9_000, "TIMEOUT 0 1000000"),
            ],
            "1:7",
        );
        let verdict = check(&h);
        let fair = verdict.fair.as_ref().expect("a fair verdict");
        assert_eq!(
            (fair.timed_out, fair.checked, fair.starved),
            (1, 1, 1),
            "{fair}"
        );
        assert_eq!(fair.largest_free_us, 7_400_000);
        assert_eq!(fair.largest_free_allowed_us, 1_500_000);
        assert!(!verdict.is_safe());
        assert_eq!(verdict.violations.len(), 1, "{:?}", verdict.violations);
        assert!(
            verdict.violations[0]
                .contains("fair waiter timed out while the key lay free: process 1"),
            "{:?}",
            verdict.violations
        );
    }

    #[test]
    fn checker_passes_fair_waiters_that_timed_out_behind_held_keys_and_excuses_a_paused_one() {
        // Process 0 holds the key from 1 s to 4 s; it is killed at 4 s, so
        // the store keeps its key a ttl longer (to 5 s), and process 2
        // holds it from 5.2 s to 9.5 s. Process 1 waited from 1 s to 9 s:
        // 0.1 s free (5.0 to 5.1 s), as did process 2, whose wait for its
        // lease had begun at 1 s too. Process 3 waited from 9.5 s to 17.5 s
        // with the key free, but was itself stopped meanwhile: excused.
        let mut h = fair_history(
            &[
                (0, 1_000, "BEGIN 7"),
                (0, 1_100, "READ 7 0:0"),
                (0, 1_200, "SEND 7 1:7"),
                (0, 1_300, "OK 7"),
                (2, 5_200, "BEGIN 8 1000000"),
                (2, 5_300, "READ 8 1:7"),
                (2, 5_400, "SEND 8 2:8"),
                (2, 5_500, "OK 8"),
                (2, 9_500, "END 8"),
                (1, 9_000, "TIMEOUT 0 1000000"),
                (3, 17_500, "TIMEOUT 0 9500000"),
            ],
            "2:8",
        );
        h.killed_at.insert(0, 4_000_000);
        h.pauses.push(Pause {
            process: 3,
            stopped_us: 10_000_000,
            resumed_us: 12_000_000,
        });
        let verdict = check(&h);
        assert!(verdict.is_safe(), "{:?}", verdict.violations);
        let fair = verdict.fair.as_ref().expect("a fair verdict");
        assert_eq!(
            (fair.timed_out, fair.checked, fair.excused, fair.starved),
            (2, 1, 1, 0),
            "{fair}"
        );
        assert_eq!(fair.largest_free_us, 100_000);
        // One refresh for the wait, one for the killed holder's lapse.
        assert_eq!(fair.largest_free_allowed_us, 2_500_000);
        assert!(fair.largest_free_any_us > 7_000_000, "{fair}");
        assert_eq!(
            (
                fair.granted,
                fair.largest_free_granted_us,
                fair.granted_past_allowance
            ),
            (1, 100_000, 0)
        );
    }
}

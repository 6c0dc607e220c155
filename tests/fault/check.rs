//! The checker: reads the history the workers printed, the driver's kill
//! times and the register's final value, and says whether any stale write
//! was accepted, whether accepted tokens rose strictly, whether any
//! increment was lost — and how often two workers both believed they held
//! the lock.
//!
//! "Accepted tokens strictly increase" is checked per write: each lease
//! reads once and writes once, so every accepted write carries its own
//! token, and along the order in which writes were accepted (each accepted
//! write read the value of the one before it) the tokens must rise.
//!
//! That order cannot see a token source that went back (a rewound counter,
//! a restored sequence): the rewound holder's read is refused as stale, and
//! the old holder's higher-token write is accepted — the very thing fencing
//! is there to stop, and every accepted token still rises. So tokens are
//! also checked per process: one worker process takes its leases one after
//! another, so each lease's token must be above that process's previous
//! lease's token. No clocks are compared, only the order of one process's
//! own lines (a restarted worker is a new process).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

/// One line a worker printed.
#[derive(Clone, Debug)]
pub struct Event {
    /// The worker process (a restarted worker is a new one).
    pub process: usize,
    pub t_us: u64,
    pub what: String,
    pub token: u64,
    pub detail: String,
}

impl Event {
    /// Parses `EV <µs> <WHAT> <token> [detail]`.
    pub fn parse(process: usize, line: &str) -> Option<Self> {
        let mut words = line.strip_prefix("EV ")?.splitn(4, ' ');
        let t_us = words.next()?.parse().ok()?;
        let what = words.next()?.to_owned();
        let token = words.next()?.parse().ok()?;
        let detail = words.next().unwrap_or_default().to_owned();
        Some(Self {
            process,
            t_us,
            what,
            token,
            detail,
        })
    }
}

/// What the checker reads.
#[derive(Debug, Default)]
pub struct History {
    pub events: Vec<Event>,
    /// When the driver SIGKILLed a process: its belief ends there.
    pub killed_at: HashMap<usize, u64>,
    /// When the run ended (belief of anyone still holding ends there).
    pub end_us: u64,
    /// The register's value after every worker has stopped.
    pub final_value: String,
}

#[derive(Debug, Default)]
struct Lease {
    process: usize,
    token: u64,
    begin: u64,
    believe_end: Option<u64>,
    read: Option<String>,
    send: Option<(u64, String)>,
    outcome: Option<(u64, &'static str)>,
}

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
    /// Accepted writes whose token is lower than one accepted before them.
    pub stale_writes_accepted: usize,
    /// Accepted writes whose token is not above the one they overwrote.
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
    pub violations: Vec<String>,
}

impl Verdict {
    /// No stale write accepted, tokens rising (along the accepted writes
    /// and within each process), no increment lost, and the register equal
    /// to the number of accepted writes.
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
        )
    }
}

fn token_of(value: &str) -> u64 {
    value
        .split(':')
        .nth(1)
        .and_then(|t| t.parse().ok())
        .unwrap_or(0)
}

fn count_of(value: &str) -> u64 {
    value
        .split(':')
        .next()
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

pub fn check(history: &History) -> Verdict {
    let mut verdict = Verdict::default();
    // Leases by (process, token), in the order they began.
    let mut leases: BTreeMap<(usize, u64), Lease> = BTreeMap::new();
    for ev in &history.events {
        if ev.token == 0 {
            continue; // set-up errors, not tied to a lease
        }
        let lease = leases
            .entry((ev.process, ev.token))
            .or_insert_with(|| Lease {
                process: ev.process,
                token: ev.token,
                begin: ev.t_us,
                ..Lease::default()
            });
        match ev.what.as_str() {
            "BEGIN" => lease.begin = ev.t_us,
            "READ" => lease.read = Some(ev.detail.clone()),
            "RSTALE" => verdict.stale_reads_rejected += 1,
            "SEND" => lease.send = Some((ev.t_us, ev.detail.clone())),
            "OK" => lease.outcome = Some((ev.t_us, "accepted")),
            "STALE" => {
                lease.outcome = Some((ev.t_us, "stale"));
                verdict.stale_writes_rejected += 1;
            }
            "WERR" => lease.outcome = Some((ev.t_us, "unknown")),
            "LOST" | "END" => {
                lease.believe_end = Some(lease.believe_end.map_or(ev.t_us, |t| t.min(ev.t_us)));
            }
            _ => {}
        }
    }
    verdict.leases = leases.len();

    // Which writes the register accepted.
    let seen: HashSet<&str> = leases
        .values()
        .filter_map(|l| l.read.as_deref())
        .chain(std::iter::once(history.final_value.as_str()))
        .collect();
    struct Write<'a> {
        token: u64,
        sent: u64,
        acked: Option<u64>,
        read: &'a str,
        value: &'a str,
    }
    let mut accepted: Vec<Write<'_>> = Vec::new();
    for lease in leases.values() {
        let Some((sent, value)) = &lease.send else {
            continue;
        };
        verdict.writes_sent += 1;
        let acked = match lease.outcome {
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
            token: lease.token,
            sent: *sent,
            acked,
            read: lease.read.as_deref().unwrap_or("0:0"),
            value,
        });
    }
    verdict.writes_accepted = accepted.len();

    // 1. Stale writes accepted, by the clock: sent after a write with a
    // higher token was acknowledged.
    let mut by_ack: Vec<(u64, u64)> = accepted
        .iter()
        .filter_map(|w| w.acked.map(|a| (a, w.token)))
        .collect();
    by_ack.sort_unstable();
    let mut by_send: Vec<&Write<'_>> = accepted.iter().collect();
    by_send.sort_by_key(|w| w.sent);
    let (mut next, mut highest) = (0, 0u64);
    let mut stale: HashSet<(u64, &str)> = HashSet::new();
    for w in &by_send {
        while next < by_ack.len() && by_ack[next].0 < w.sent {
            highest = highest.max(by_ack[next].1);
            next += 1;
        }
        if w.token < highest {
            stale.insert((w.token, w.value));
            verdict.violations.push(format!(
                "stale write accepted: token {} wrote {:?} after token {highest} had been accepted",
                w.token, w.value
            ));
        }
    }

    // 2. Along the order of acceptance (each accepted write read its
    // predecessor's value): tokens rise, no two writes build on one value.
    let values: HashSet<&str> = accepted.iter().map(|w| w.value).collect();
    let mut successors: HashMap<&str, Vec<u64>> = HashMap::new();
    for w in &accepted {
        successors.entry(w.read).or_default().push(w.token);
        let before = token_of(w.read);
        if w.token < before {
            if stale.insert((w.token, w.value)) {
                verdict.violations.push(format!(
                    "stale write accepted: token {} overwrote {:?}, written under the higher token {before}",
                    w.token, w.read
                ));
            }
        } else if w.token == before {
            verdict.tokens_not_increasing += 1;
            verdict.violations.push(format!(
                "accepted tokens not strictly increasing: token {} overwrote its own {:?}",
                w.token, w.read
            ));
        }
        if w.read != "0:0" && !values.contains(w.read) {
            verdict.phantom_reads += 1;
            verdict.violations.push(format!(
                "token {} read {:?}, which no accepted write wrote",
                w.token, w.read
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
    // macro's body starts; `TAKE`: an acquisition of an abandon round that
    // completed in time), so their tokens must rise in the order printed.
    let mut previous: HashMap<usize, u64> = HashMap::new();
    for ev in &history.events {
        if !matches!(ev.what.as_str(), "BEGIN" | "TAKE") {
            continue;
        }
        if let Some(before) = previous.insert(ev.process, ev.token)
            && ev.token <= before
        {
            verdict.tokens_went_back += 1;
            verdict.violations.push(format!(
                "tokens went back: process {} took a lease with token {} after its lease with token {before}",
                ev.process, ev.token
            ));
        }
    }

    // Double belief: belief intervals of different processes that overlap.
    let mut intervals: Vec<(u64, u64, usize)> = leases
        .values()
        .map(|l| {
            let end = l
                .believe_end
                .or_else(|| history.killed_at.get(&l.process).copied())
                .unwrap_or(history.end_us);
            (l.begin, end.max(l.begin), l.process)
        })
        .collect();
    intervals.sort_unstable();
    let mut active: Vec<(u64, usize)> = Vec::new();
    for (start, end, process) in intervals {
        active.retain(|&(e, _)| e > start);
        verdict.double_belief += active.iter().filter(|&&(_, p)| p != process).count();
        active.push((end, process));
    }
    verdict
}

#[cfg(test)]
mod tests {
    use super::{Event, History, check};

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
}

//! The checks of the permits and read-write scenarios, beside the lock
//! scenario's (`fault::check`).
//!
//! **Permits.** A permit's token rises per (key, slot) and each slot is
//! fenced as a resource of its own, so the history is split by slot (a
//! lease's lines name it `<token>@<slot>`) and every slot's history gets
//! the lock scenario's checks: no stale write accepted on the slot, tokens
//! rising along the slot's accepted writes and within each process, no
//! increment lost, the slot's register equal to its accepted writes. Over
//! all slots, the checker then counts, for every moment, the holders
//! (process, token, slot) whose fenced writes were accepted within their
//! lease: a holder counts from its accepted read's answer to the sending
//! of its accepted write (the resource accepted both, so the holder had
//! the resource at least that long; the window is the part of the true one
//! that the history proves, so a count above the permits is a real
//! breach, never an artefact of clocks). At no moment may more than the
//! permits count; and no lease may hold a slot outside `0..permits`.
//!
//! **Read-write.** Writers (`mode = "exclusive"`) increment the register
//! under their token and readers (`mode = "shared"`) touch it, a fenced
//! read that records their token with the same `>=` rule. The lock
//! scenario's checks cover the writers with the readers' tokens in them:
//! a writer's write accepted after the register had answered a higher
//! token (a later writer's or a later read phase's) is a stale write
//! accepted, and no increment may be lost. And no current reader may be
//! refused ([`ReadWriteVerdict`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;

use super::check::{Event, History, Verdict, check};
use super::worker::TTL;

/// What the permits scenario promises.
#[derive(Debug, Default)]
pub struct PermitsVerdict {
    pub permits: u32,
    /// The slots leases held, and how many leases each.
    pub leases_per_slot: BTreeMap<u32, usize>,
    /// Holders whose fenced write was accepted.
    pub holders_accepted: usize,
    /// The most holders with accepted fenced writes at one moment.
    pub max_concurrent: usize,
    /// Moments at which more than `permits` such holders held at once.
    pub over_the_bound: usize,
    /// Leases of a slot outside `0..permits`, or of none.
    pub out_of_range: usize,
}

impl fmt::Display for PermitsVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "permits {}: leases per slot {:?}, holders with accepted writes {}, \
             most holders with accepted writes at once {} (bound {}), moments over the bound {}, \
             leases of a slot out of range {}",
            self.permits,
            self.leases_per_slot,
            self.holders_accepted,
            self.max_concurrent,
            self.permits,
            self.over_the_bound,
            self.out_of_range
        )
    }
}

/// The permits scenario: the lock scenario's checks per slot, and the
/// bound on holders at once.
pub fn check_permits(history: &History, permits: u32) -> Verdict {
    let mut found = PermitsVerdict {
        permits,
        ..PermitsVerdict::default()
    };
    let mut violations = Vec::new();
    let mut by_slot: BTreeMap<u32, Vec<Event>> = BTreeMap::new();
    let mut unslotted = Vec::new();
    for ev in &history.events {
        match ev.slot {
            Some(slot) => by_slot.entry(slot).or_default().push(ev.clone()),
            None if ev.token == 0 => unslotted.push(ev.clone()),
            None => {
                found.out_of_range += 1;
                violations.push(format!(
                    "a permit lease without a slot: process {} printed {} {}",
                    ev.process, ev.what, ev.token
                ));
            }
        }
        if matches!(ev.what.as_str(), "BEGIN" | "TAKE")
            && let Some(slot) = ev.slot
        {
            *found.leases_per_slot.entry(slot).or_default() += 1;
            if slot >= permits {
                found.out_of_range += 1;
                violations.push(format!(
                    "process {} took slot {slot} (token {}) of a key with {permits} permits",
                    ev.process, ev.token
                ));
            }
        }
    }
    // Every slot that has a final value is checked, leases or not (its
    // register must then say 0).
    for slot in history.slot_finals.keys() {
        by_slot.entry(*slot).or_default();
    }

    let mut verdict = Verdict::default();
    let mut first = true;
    for (slot, events) in by_slot {
        let mut events = events;
        if first {
            // Set-up errors and other lines of no lease, counted once.
            events.extend(std::mem::take(&mut unslotted));
            events.sort_by_key(|ev| ev.t_us);
            first = false;
        }
        let sub = History {
            events,
            killed_at: history.killed_at.clone(),
            pauses: history.pauses.clone(),
            partitions: history.partitions.clone(),
            server_faults: history.server_faults.clone(),
            end_us: history.end_us,
            final_value: history
                .slot_finals
                .get(&slot)
                .cloned()
                .unwrap_or_else(|| "0:0".to_owned()),
            silent_hold_us: history.silent_hold_us,
            ..History::default()
        };
        let part = check(&sub);
        merge(&mut verdict, part, slot);
    }
    verdict.violations.extend(violations);

    // Holders at once: per (process, token, slot), the accepted read's
    // answer to the sending of the accepted write.
    let seen: HashMap<u32, HashSet<&str>> = {
        let mut seen: HashMap<u32, HashSet<&str>> = HashMap::new();
        for ev in &history.events {
            if ev.what == "READ"
                && let Some(slot) = ev.slot
            {
                seen.entry(slot).or_default().insert(ev.detail.as_str());
            }
        }
        for (slot, value) in &history.slot_finals {
            seen.entry(*slot).or_default().insert(value.as_str());
        }
        seen
    };
    #[derive(Default)]
    struct Holder<'a> {
        read: Option<u64>,
        send: Option<(u64, &'a str)>,
        outcome: Option<&'a str>,
    }
    let mut holders: BTreeMap<(usize, u64, u32), Holder<'_>> = BTreeMap::new();
    for ev in &history.events {
        let Some(slot) = ev.slot else { continue };
        let holder = holders.entry((ev.process, ev.token, slot)).or_default();
        match ev.what.as_str() {
            "READ" => holder.read = Some(ev.t_us),
            "SEND" => holder.send = Some((ev.t_us, ev.detail.as_str())),
            "OK" | "STALE" | "WERR" => holder.outcome = Some(ev.what.as_str()),
            _ => {}
        }
    }
    let mut edges: Vec<(u64, i8)> = Vec::new();
    for (&(_, _, slot), holder) in &holders {
        let (Some(read), Some((sent, value))) = (holder.read, holder.send) else {
            continue;
        };
        let accepted = match holder.outcome {
            Some("OK") => true,
            Some("STALE") => false,
            _ => seen.get(&slot).is_some_and(|s| s.contains(value)),
        };
        if accepted {
            found.holders_accepted += 1;
            // Starts sort before ends at one moment: the windows are closed.
            edges.push((read, 0));
            edges.push((sent.max(read), 1));
        }
    }
    edges.sort_unstable();
    let mut now = 0usize;
    for (t, edge) in edges {
        if edge == 0 {
            now += 1;
            found.max_concurrent = found.max_concurrent.max(now);
            if now > permits as usize {
                found.over_the_bound += 1;
                verdict.violations.push(format!(
                    "{now} holders had fenced writes accepted at once at {t} µs, above the {permits} permits"
                ));
            }
        } else {
            now -= 1;
        }
    }
    verdict.permits = Some(found);
    verdict
}

/// Adds one slot's verdict to the run's.
fn merge(into: &mut Verdict, part: Verdict, slot: u32) {
    into.leases += part.leases;
    into.writes_sent += part.writes_sent;
    into.writes_accepted += part.writes_accepted;
    into.settled_accepted += part.settled_accepted;
    into.settled_refused += part.settled_refused;
    into.stale_writes_rejected += part.stale_writes_rejected;
    into.stale_reads_rejected += part.stale_reads_rejected;
    into.stale_writes_accepted += part.stale_writes_accepted;
    into.tokens_not_increasing += part.tokens_not_increasing;
    into.tokens_went_back += part.tokens_went_back;
    into.lost_increments += part.lost_increments;
    into.phantom_reads += part.phantom_reads;
    into.final_count += part.final_count;
    into.double_belief += part.double_belief;
    into.lock_errors += part.lock_errors;
    if into.first_lock_error.is_none() {
        into.first_lock_error = part.first_lock_error;
    }
    into.violations.extend(
        part.violations
            .into_iter()
            .map(|v| format!("slot {slot}: {v}")),
    );
}

/// What the read-write scenario promises its readers: a reader is refused
/// only once its read phase is over. A refusal (`RSTALE <t> <highest>`)
/// is
///
/// - by a writer: the register had accepted a writer's token above the
///   reader's — the reader's phase had ended (a writer gets the key only
///   after the readers leave or their leases run out), as it must;
/// - excused: the reader's lease was touched by what ends a lease under a
///   reader's feet — its lost signal fired (at any time in the lease), its
///   process was paused or its link frozen between its `BEGIN` and the
///   refusal, a fault hit the lock store's side meanwhile, or half a ttl
///   or more passed between its `BEGIN` and the refusal (a starved
///   process whose lease may have run out without a fault of the
///   driver's): its phase may have ended and a new phase begun with a
///   higher token, so the refusal is the fence doing its work;
/// - otherwise a current reader refused, a violation: nothing ended its
///   lease, yet a token above its phase's reached the register, so the
///   store let a writer in or began a new read phase while the reader
///   held (or issued a reader a token below one issued before it).
#[derive(Debug, Default)]
pub struct ReadWriteVerdict {
    pub reader_leases: usize,
    pub writer_leases: usize,
    /// Fenced reads of readers that the register answered.
    pub reads_accepted: usize,
    pub readers_refused: usize,
    pub refused_by_a_writer: usize,
    pub refused_excused: usize,
    pub current_readers_refused: usize,
}

impl fmt::Display for ReadWriteVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "read-write: reader leases {}, writer leases {}, reader touches accepted {}, readers refused {} \
             ({} by a writer's higher token, {} after a fault or a starved lease), current readers refused {}",
            self.reader_leases,
            self.writer_leases,
            self.reads_accepted,
            self.readers_refused,
            self.refused_by_a_writer,
            self.refused_excused,
            self.current_readers_refused
        )
    }
}

/// The readers' check of the read-write scenario (see
/// [`ReadWriteVerdict`]).
pub fn check_readers(history: &History, violations: &mut Vec<String>) -> ReadWriteVerdict {
    let mut found = ReadWriteVerdict::default();
    let writer_tokens: BTreeSet<u64> = history
        .events
        .iter()
        .filter(|ev| (ev.what == "BEGIN" && ev.detail != "shared") || ev.what == "TAKE")
        .map(|ev| ev.token)
        .collect();
    let lost: HashMap<(usize, u64), Vec<u64>> = history
        .events
        .iter()
        .filter(|ev| ev.what == "LOST")
        .fold(HashMap::new(), |mut lost, ev| {
            lost.entry((ev.process, ev.token))
                .or_default()
                .push(ev.t_us);
            lost
        });
    // The reader leases now running: (process, token) -> (the process's
    // line before its `BEGIN`, the `BEGIN`). The grant came after the
    // former: a loaded machine may print `BEGIN` well after the grant, and
    // a fault between the two ended the lease all the same.
    let mut reading: HashMap<(usize, u64), (u64, u64)> = HashMap::new();
    let mut previous_line: HashMap<usize, u64> = HashMap::new();
    for ev in &history.events {
        let id = (ev.process, ev.token);
        let asked = previous_line.insert(ev.process, ev.t_us).unwrap_or(0);
        match ev.what.as_str() {
            "BEGIN" if ev.detail == "shared" => {
                found.reader_leases += 1;
                reading.insert(id, (asked, ev.t_us));
            }
            "BEGIN" => found.writer_leases += 1,
            "READ" if reading.contains_key(&id) => found.reads_accepted += 1,
            "RSTALE" => {
                let Some(&(asked, begin)) = reading.get(&id) else {
                    continue; // a writer's refused read: the lock checks
                };
                found.readers_refused += 1;
                let highest: u64 = ev
                    .detail
                    .split(' ')
                    .next()
                    .and_then(|h| h.parse().ok())
                    .unwrap_or(0);
                let (from, to) = (asked, ev.t_us);
                let touched = |a: u64, b: u64| a <= to && b >= from;
                if writer_tokens.contains(&highest) && highest > ev.token {
                    found.refused_by_a_writer += 1;
                } else if lost
                    .get(&id)
                    .is_some_and(|times| times.iter().any(|&t| t >= begin))
                    || history
                        .pauses
                        .iter()
                        .any(|p| p.process == ev.process && touched(p.stopped_us, p.resumed_us))
                    || history
                        .partitions
                        .iter()
                        .any(|c| c.process == ev.process && touched(c.from_us, c.to_us))
                    || history.server_faults.iter().any(|&(a, b)| touched(a, b))
                    || to.saturating_sub(begin) >= TTL.as_micros() as u64 / 2
                {
                    found.refused_excused += 1;
                } else {
                    found.current_readers_refused += 1;
                    violations.push(format!(
                        "a current reader was refused: process {} (token {}, since {begin} µs) was refused at {} µs \
                         by token {highest}, which no writer held, with no fault on its lease",
                        ev.process, ev.token, ev.t_us
                    ));
                }
            }
            "END" => {
                reading.remove(&id);
            }
            _ => {}
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::super::check::{Event, History, check};

    fn history(lines: &[(usize, &str)]) -> History {
        History {
            events: lines
                .iter()
                .filter_map(|(process, line)| Event::parse(*process, line))
                .collect(),
            end_us: 1_000,
            ..History::default()
        }
    }

    /// Two slots, each a holder whose write is accepted, then a paused
    /// holder of slot 0 refused after its successor took the slot.
    fn two_slots() -> Vec<(usize, &'static str)> {
        vec![
            (0, "EV 10 BEGIN 5@0"),
            (0, "EV 11 READ 5@0 0:0"),
            (1, "EV 12 BEGIN 3@1"),
            (1, "EV 13 READ 3@1 0:0"),
            (0, "EV 20 SEND 5@0 1:5"),
            (0, "EV 21 OK 5@0"),
            (1, "EV 22 SEND 3@1 1:3"),
            (1, "EV 23 OK 3@1"),
            (0, "EV 24 END 5@0"),
            (1, "EV 25 END 3@1"),
            (2, "EV 30 BEGIN 6@0"),
            (2, "EV 31 READ 6@0 1:5"),
            (3, "EV 32 BEGIN 7@0"),
            (3, "EV 33 READ 7@0 1:5"),
            (3, "EV 34 SEND 7@0 2:7"),
            (3, "EV 35 OK 7@0"),
            (2, "EV 40 SEND 6@0 2:6"),
            (2, "EV 41 STALE 6@0 7"),
            (3, "EV 42 END 7@0"),
            (2, "EV 43 END 6@0"),
        ]
    }

    #[test]
    fn permits_checker_passes_two_holders_at_once_and_a_refused_stale_slot_holder() {
        let mut h = history(&two_slots());
        h.permits = Some(2);
        h.slot_finals = [(0, "2:7".to_owned()), (1, "1:3".to_owned())].into();
        let verdict = check(&h);
        assert!(verdict.is_safe(), "{:?}", verdict.violations);
        let permits = verdict.permits.as_ref().expect("a permits verdict");
        assert_eq!(permits.max_concurrent, 2);
        assert_eq!(permits.holders_accepted, 3);
        assert_eq!(verdict.writes_accepted, 3);
        assert_eq!(verdict.stale_writes_rejected, 1);
        assert_eq!(verdict.stale_writes_accepted, 0);
    }

    #[test]
    fn permits_checker_catches_three_holders_accepted_at_once_with_two_permits() {
        // A third holder in a slot the store should never have handed out
        // writes while the other two do.
        let mut lines = two_slots();
        lines.extend([
            (4, "EV 14 BEGIN 2@2"),
            (4, "EV 15 READ 2@2 0:0"),
            (4, "EV 19 SEND 2@2 1:2"),
            (4, "EV 26 OK 2@2"),
            (4, "EV 27 END 2@2"),
        ]);
        let mut h = history(&lines);
        h.permits = Some(2);
        h.slot_finals = [
            (0, "2:7".to_owned()),
            (1, "1:3".to_owned()),
            (2, "1:2".to_owned()),
        ]
        .into();
        let verdict = check(&h);
        let permits = verdict.permits.as_ref().expect("a permits verdict");
        assert_eq!(permits.max_concurrent, 3);
        assert!(permits.over_the_bound >= 1);
        assert!(!verdict.is_safe());
        // With three permits the same history is fine.
        h.permits = Some(3);
        let verdict = check(&h);
        assert!(verdict.is_safe(), "{:?}", verdict.violations);
    }

    #[test]
    fn permits_checker_catches_a_stale_write_accepted_on_one_slot() {
        // Slot 0's paused holder (token 6) writes after its successor (7)
        // read: accepted, it loses 7's increment.
        let lines: Vec<(usize, &str)> = two_slots()
            .into_iter()
            .map(|(p, l)| {
                if l == "EV 41 STALE 6@0 7" {
                    (p, "EV 41 OK 6@0")
                } else {
                    (p, l)
                }
            })
            .collect();
        let mut h = history(&lines);
        h.permits = Some(2);
        h.slot_finals = [(0, "2:6".to_owned()), (1, "1:3".to_owned())].into();
        let verdict = check(&h);
        assert!(verdict.stale_writes_accepted >= 1);
        assert!(verdict.violations.iter().any(|v| v.starts_with("slot 0:")));
    }

    fn read_write(lines: &[(usize, &'static str)], final_value: &str) -> History {
        let mut h = history(lines);
        h.read_write = true;
        h.final_value = final_value.to_owned();
        h
    }

    #[test]
    fn read_write_checker_passes_readers_sharing_a_phase_and_a_stale_reader_refused_by_a_writer() {
        let h = read_write(
            &[
                (0, "EV 10 BEGIN 4"),
                (0, "EV 11 READ 4 0:0"),
                (0, "EV 12 SEND 4 1:4"),
                (0, "EV 13 OK 4"),
                (0, "EV 14 END 4"),
                // Two readers of one phase, same token.
                (1, "EV 20 BEGIN 5 shared"),
                (2, "EV 21 BEGIN 5 shared"),
                (1, "EV 22 READ 5 1:4"),
                (2, "EV 23 READ 5 1:4"),
                (1, "EV 24 END 5"),
                // 2 is paused; a writer comes after its phase.
                (3, "EV 30 BEGIN 6"),
                (3, "EV 31 READ 6 1:4"),
                (3, "EV 32 SEND 6 2:6"),
                (3, "EV 33 OK 6"),
                (3, "EV 34 END 6"),
                (2, "EV 40 RSTALE 5 6"),
                (2, "EV 41 END 5"),
            ],
            "2:6",
        );
        let verdict = check(&h);
        assert!(verdict.is_safe(), "{:?}", verdict.violations);
        let rw = verdict.read_write.as_ref().expect("a read-write verdict");
        assert_eq!((rw.reader_leases, rw.writer_leases), (2, 2));
        assert_eq!((rw.readers_refused, rw.refused_by_a_writer), (1, 1));
        // Readers overlapping each other are no double belief; the writer
        // beside the paused reader is.
        assert_eq!(verdict.double_belief, 1);
    }

    #[test]
    fn read_write_checker_catches_a_stale_writer_accepted_after_a_reader() {
        // Writer 4 reads, pauses; a read phase (5) touches; 4's write is
        // accepted all the same.
        let h = read_write(
            &[
                (0, "EV 10 BEGIN 4"),
                (0, "EV 11 READ 4 0:0"),
                (1, "EV 20 BEGIN 5 shared"),
                (1, "EV 21 READ 5 0:0"),
                (1, "EV 22 END 5"),
                (0, "EV 30 SEND 4 1:4"),
                (0, "EV 31 OK 4"),
                (0, "EV 32 END 4"),
            ],
            "1:4",
        );
        let verdict = check(&h);
        assert_eq!(verdict.stale_writes_accepted, 1);
        assert!(!verdict.is_safe());
    }

    #[test]
    fn read_write_checker_catches_a_current_reader_refused() {
        // Reader 5 is refused at once by a later phase's token, with
        // nothing ending its lease.
        let mut lines = vec![
            (1, "EV 20 BEGIN 7 shared"),
            (1, "EV 21 READ 7 0:0"),
            (1, "EV 22 END 7"),
            (2, "EV 30 BEGIN 5 shared"),
            (2, "EV 31 RSTALE 5 7"),
            (2, "EV 32 END 5"),
        ];
        let verdict = check(&read_write(&lines, "0:0"));
        let rw = verdict.read_write.as_ref().expect("a read-write verdict");
        assert_eq!(rw.current_readers_refused, 1);
        assert!(!verdict.is_safe());
        // Had its lease been lost, the refusal is the fence at work.
        lines.push((2, "EV 33 LOST 5"));
        let verdict = check(&read_write(&lines, "0:0"));
        assert!(verdict.is_safe(), "{:?}", verdict.violations);
    }

    #[test]
    fn read_write_checker_excuses_a_reader_whose_lease_a_fault_hit_before_its_begin_line() {
        // Reader 5 was granted after its process's line at 25 and printed
        // `BEGIN` at 30; the key was broken at 27, in between, and a new
        // phase (7) refuses it. Excused: the fault ended its phase.
        let lines = vec![
            (2, "EV 25 END 4"),
            (2, "EV 30 BEGIN 5 shared"),
            (1, "EV 31 BEGIN 7 shared"),
            (1, "EV 32 READ 7 0:0"),
            (2, "EV 33 RSTALE 5 7"),
            (2, "EV 34 END 5"),
            (1, "EV 35 END 7"),
        ];
        let mut h = read_write(&lines, "0:0");
        h.server_faults = vec![(27, 28)];
        let verdict = check(&h);
        assert!(verdict.is_safe(), "{:?}", verdict.violations);
        // A fault before the process's line at 25 excuses nothing.
        h.server_faults = vec![(20, 21)];
        let verdict = check(&h);
        let rw = verdict.read_write.as_ref().expect("a read-write verdict");
        assert_eq!(rw.current_readers_refused, 1, "{:?}", verdict.violations);
    }
}

//! A schedule's trace: one line per step, store call, answer, caller's
//! outcome and fault, with simulated times and with owners and tokens
//! named by stable small numbers (owner ids are drawn from the operating
//! system, tokens from the wall clock, so neither is the same twice).
//! Two runs of one seed must give the same text, byte for byte; the
//! 64-bit FNV-1a digest of the text says so in one number.

use std::collections::HashMap;
use std::fmt::Write as _;

use dlock::FencingToken;
use dlock::backend::OwnerId;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// How much of a trace a run keeps.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// Nothing: the bulk run, which replays a failing seed with its text.
    /// Formatting every line was most of a schedule's cost, and a trace
    /// only observes: a seed runs the same schedule whatever it records.
    Nothing,
    /// The digest only.
    Digest,
    /// The digest and the text.
    Text,
}

/// The trace of one schedule.
pub struct Trace {
    record: Record,
    /// The text, kept only when it will be printed (a replay).
    text: Option<String>,
    digest: u64,
    lines: usize,
    owners: HashMap<OwnerId, usize>,
    tokens: HashMap<u64, usize>,
}

impl Trace {
    /// An empty trace that keeps what `record` says.
    pub fn new(record: Record) -> Self {
        Self {
            record,
            text: (record == Record::Text).then(String::new),
            digest: FNV_OFFSET,
            lines: 0,
            owners: HashMap::new(),
            tokens: HashMap::new(),
        }
    }

    /// Whether lines are recorded at all.
    pub fn is_on(&self) -> bool {
        self.record != Record::Nothing
    }

    /// Appends one line.
    pub fn line(&mut self, line: &str) {
        for byte in line.bytes().chain(std::iter::once(b'\n')) {
            self.digest = (self.digest ^ u64::from(byte)).wrapping_mul(FNV_PRIME);
        }
        self.lines += 1;
        if let Some(text) = &mut self.text {
            text.push_str(line);
            text.push('\n');
        }
    }

    /// The stable name of `owner`: `o<n>`, numbered by first appearance.
    pub fn owner(&mut self, owner: &OwnerId) -> String {
        let next = self.owners.len();
        format!("o{}", self.owners.entry(*owner).or_insert(next))
    }

    /// The stable name of `token`: `t<n>`, numbered by first appearance
    /// (a rank would need every token in advance; comparing is done on the
    /// raw values, not on these names).
    pub fn token(&mut self, token: FencingToken) -> String {
        let next = self.tokens.len();
        format!("t{}", self.tokens.entry(token.get()).or_insert(next))
    }

    /// The digest of every line so far.
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// How many lines so far.
    pub fn lines(&self) -> usize {
        self.lines
    }

    /// The text, if kept.
    pub fn text(&self) -> Option<&str> {
        self.text.as_deref()
    }
}

/// Formats a line into `trace`, if it records lines.
pub fn write_line(trace: &mut Trace, args: std::fmt::Arguments<'_>) {
    if !trace.is_on() {
        return;
    }
    let mut line = String::with_capacity(64);
    let _ = line.write_fmt(args);
    trace.line(&line);
}

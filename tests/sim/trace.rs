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

/// The trace of one schedule.
pub struct Trace {
    /// The text, kept only when it will be printed (a replay): the bulk
    /// run keeps the digest alone.
    text: Option<String>,
    digest: u64,
    lines: usize,
    owners: HashMap<OwnerId, usize>,
    tokens: HashMap<u64, usize>,
}

impl Trace {
    /// An empty trace that keeps its text if `keep`.
    pub fn new(keep: bool) -> Self {
        Self {
            text: keep.then(String::new),
            digest: FNV_OFFSET,
            lines: 0,
            owners: HashMap::new(),
            tokens: HashMap::new(),
        }
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

/// `format!` into a line of `trace` only when something will read it: the
/// digest needs every line, so this always formats; kept as one place to
/// change should formatting ever cost too much.
pub fn write_line(trace: &mut Trace, args: std::fmt::Arguments<'_>) {
    let mut line = String::with_capacity(64);
    let _ = line.write_fmt(args);
    trace.line(&line);
}

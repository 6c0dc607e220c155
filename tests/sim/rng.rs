//! The one random source of a schedule: SplitMix64, seeded by the
//! schedule's seed. Everything the simulator chooses (which caller does
//! what, which call fails, when a process freezes) is drawn from it, in
//! the order the single-threaded runtime runs, so a seed is a schedule.

use std::time::Duration;

use crate::support::seeds;
pub use seeds::mix;

/// SplitMix64 (`support::seeds::splitmix`): tiny, fast, and good enough
/// to choose schedules; no crate needed.
pub struct Rng(u64);

impl Rng {
    /// The generator of `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        seeds::splitmix(&mut self.0)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// True `per_mille` times in a thousand.
    pub fn chance(&mut self, per_mille: u32) -> bool {
        self.below(1000) < u64::from(per_mille)
    }

    /// A duration of `lo..=hi` milliseconds.
    pub fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }

    /// One of `choices`, each equally likely.
    pub fn pick<T: Copy>(&mut self, choices: &[T]) -> T {
        choices[self.below(choices.len() as u64) as usize]
    }
}

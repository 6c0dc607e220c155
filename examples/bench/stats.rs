//! Samples, percentiles and the rows of the report.

use std::time::Duration;

/// What one measured row produced: latency samples and a throughput.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    /// One sample per operation (a cycle, a handoff, a call).
    pub samples: Vec<Duration>,
    /// Throughput of each round (operations per second), to take the median
    /// of: rounds of different rows are interleaved, so a burst of load from
    /// elsewhere on the machine hits every row rather than one.
    pub rates: Vec<f64>,
    /// The server's CPU time over the rounds it was read for, and their
    /// operations.
    pub server: Option<(Duration, u64)>,
}

impl Measured {
    /// Adds one round.
    pub fn add_round(&mut self, mut samples: Vec<Duration>, ops: u64, elapsed: Duration) {
        self.samples.append(&mut samples);
        self.rates
            .push(ops as f64 / elapsed.as_secs_f64().max(1e-9));
    }

    /// Adds the server's CPU time of one round of `ops` operations.
    pub fn add_server(&mut self, cpu: Duration, ops: u64) {
        let (sum, count) = self.server.get_or_insert_default();
        *sum += cpu;
        *count += ops;
    }

    /// The server's CPU time per operation, over the rounds it was read for.
    pub fn server_per_op(&self) -> Option<Duration> {
        let (cpu, ops) = self.server?;
        (ops > 0).then(|| cpu.div_f64(ops as f64))
    }

    /// The median throughput of the rounds, operations per second.
    pub fn rate(&self) -> f64 {
        median_f64(&self.rates)
    }

    /// The `q` quantile (0..=1) of the samples.
    pub fn quantile(&self, q: f64) -> Duration {
        quantile(&self.samples, q)
    }

    /// Median sample.
    pub fn median(&self) -> Duration {
        self.quantile(0.5)
    }

    /// 99th percentile sample.
    pub fn p99(&self) -> Duration {
        self.quantile(0.99)
    }
}

/// The `q` quantile of unsorted samples (nearest rank).
pub fn quantile(samples: &[Duration], q: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let rank = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// The median of a few numbers.
pub fn median_f64(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    }
}

/// A duration for a table cell: µs below 10 ms, ms above.
pub fn show(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 10_000.0 {
        format!("{us:.0} µs")
    } else {
        format!("{:.1} ms", us / 1000.0)
    }
}

/// A rate for a table cell.
pub fn show_rate(rate: f64) -> String {
    if rate >= 100.0 {
        format!("{:.0}", rate)
    } else {
        format!("{rate:.1}")
    }
}

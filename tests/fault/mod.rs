//! The fault-injection harness: N worker processes take one lock through
//! `#[distributed_lock]` (the lock scenario; the fair scenario with
//! `fair = true`; the read-write scenario with writers and
//! `mode = "shared"` readers; the permits scenario with one of two
//! permits, each slot's register a resource of its own) or campaign in
//! one election with `Election::lead` (the election scenario), and
//! read-modify-write one fenced register, while a fault driver pauses, kills, partitions and
//! breaks things at moments drawn from a seed; afterwards a checker reads
//! the history.
//!
//! - [`rng`]: the seeded generator; the seed fixes the fault schedule.
//! - `support::proxy`: a loopback TCP proxy per worker and link that the
//!   driver can freeze (stop forwarding, sockets kept open) and cut.
//! - [`worker`]: what one worker process does and prints (lock and fair
//!   scenarios), and its set-up shared by every scenario.
//! - [`election`]: what one worker process does and prints as a
//!   campaigner and leader (election scenario).
//! - [`check`]: the checker over the printed history and the final register.
//! - [`modes`]: the permits scenario's checks (per slot, and the holders at
//!   once) and the read-write scenario's readers' check.
//! - [`run`]: servers, processes, the driver, the report.
//! - [`overlap`]: the binary's runs launched together, each test waiting
//!   for its own run's report.
//!
//! The register holds `"<count>:<token of the write>"` (election scenario:
//! `"<count>:<token>/<step>"`, a term writing many times). Every step (a
//! lease, or one step of a term) reads it once and writes `count + 1` once,
//! so each accepted write has a value no other write has, and an accepted
//! write is visible to the next reader: that lets the checker settle writes
//! whose answer never came back (the writer was killed, or its connection
//! cut) — accepted if and only if some later read saw its value or it is
//! the final value.

#![allow(dead_code)]

pub mod check;
pub mod election;
pub mod modes;
pub mod overlap;
pub mod rng;
pub mod run;
pub mod worker;

use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock microseconds: every process of the run shares the host clock,
/// so events of different workers can be ordered.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The connection string of the shared PostgreSQL server.
pub fn pg_conn() -> String {
    std::env::var("DLOCK_PG_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".to_owned())
}

/// The URL of the shared Redis server.
pub fn redis_url() -> String {
    std::env::var("DLOCK_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

//! `RedisBackend`, one file per aspect: the conformance suite and what the
//! backend promises against the shared Redis (`lock`), fair mode (`fair`),
//! shared locks and permits across processes (`modes`), servers of a
//! test's own that restart, die or want a password (`server`), a Redis
//! Cluster (`cluster`), Redis Sentinel (`sentinel`) and a rolling upgrade
//! from the previous protocol (`upgrade`).
//!
//! The shared Redis is the one at `DLOCK_REDIS_URL` (default
//! `redis://127.0.0.1:6379`); the other servers are started by the tests
//! on free loopback ports. Tests that spawn child processes re-run this
//! binary with the `child_process_entry` of their own module
//! (`support::child_command`).

#[path = "../redis_support/mod.rs"]
mod redis_support;
#[path = "../support/mod.rs"]
mod support;

mod cluster;
mod fair;
mod list_queue;
mod lock;
mod lost_queue;
mod modes;
mod queued_barge;
mod sentinel;
mod server;
mod upgrade;
mod upgrade_lists;
mod upgrade_record;
mod values;

//! The election scenario's worker: until its deadline, campaign with
//! `Election::lead` for the run's election (named by the lock scenario's
//! key, on the run's lock backend) and, as leader, increment the register
//! step after step under the term's token. It prints what it does as the
//! lock scenario's worker does (`fault::worker`), with the step after the
//! token:
//!
//! | what | when |
//! | --- | --- |
//! | `BEGIN t` | elected: term `t` begins |
//! | `READ t/s v` / `RSTALE t/s h` / `RERR t/s` | step `s`'s read, refused as stale, or failed |
//! | `SEND t/s v` | step `s`'s write of `v` (`<count>:t/s`) is sent |
//! | `OK t/s` / `STALE t/s h` / `WERR t/s` | the write was accepted, refused, or its answer lost |
//! | `LOST t check` | noticed lost: `Term::check` before a step failed |
//! | `LOST t signal` | noticed lost: the lost signal fired and `lead` dropped the work (or the work stepped down on a term already lost) |
//! | `END t` | the term ended otherwise: the leader resigned after its steps, stepped down when the register refused it, or the run ended |
//! | `LATE t/s v` | step `s`'s write, sent after the loss (see below) |
//!
//! A leader checks its term before each read and before each write. After
//! a pause past its ttl, `Term::check` fails by the lease's own clock (and
//! the lost signal fires) before anything is sent. A step cut short between
//! its read and its write still sends that write once, with the old token
//! (`LATE`): a write already on its way when the loss came, a queued
//! request or a retry. The fence must refuse it once a newer term has read
//! the register, and the checker verifies that it did.
//!
//! A leader resigns after a seeded 10 to 40 steps and steps down when the
//! register refuses it, so terms also change hands without faults.
//!
//! With `heeds_term` off (the negative run), the leader neither checks its
//! term nor records its loss, and finishes a write it has begun even when
//! `lead` drops its work on the lost signal.

use std::sync::Arc;
use std::time::Duration;

use dlock::FencingToken;
use dlock::election::{Election, Term};
use tokio::time::{Instant, sleep, sleep_until};

use super::now_us;
use super::rng::Rng;
use super::worker::{Answer, Config, Register, TTL, lock_key, one_line, say};

/// How many steps a leader makes before it resigns (inclusive range).
const STEPS: (u64, u64) = (10, 40);

/// Campaigns and leads until the run's deadline.
pub async fn campaign(config: &Config, register: Arc<Register>) {
    let identity = format!("fault-worker-{} (pid {})", config.slot, std::process::id());
    let election = match Election::new(lock_key(&config.run), identity, TTL) {
        Ok(election) => election.backend("fault"),
        Err(err) => return say(&format!("LERR 0 {}", one_line(&err.to_string()))),
    };
    let deadline =
        Instant::now() + Duration::from_micros(config.deadline_us.saturating_sub(now_us()));
    while now_us() < config.deadline_us {
        let led = election
            .lead_until(
                |term| lead(term, register.clone(), config.seed, config.heeds_term),
                sleep_until(deadline),
            )
            .await;
        match led {
            // Resigned after its steps, or stepped down: campaign again.
            Ok(Some(())) => {}
            Ok(None) => return,
            Err(err) => {
                say(&format!("LERR 0 {}", one_line(&err.to_string())));
                sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// One term: steps of read, work, write `count + 1`, each under the term's
/// token.
async fn lead(term: Term, register: Arc<Register>, seed: u64, heeds_term: bool) {
    let token = term.token();
    say(&format!("BEGIN {token}"));
    let mut record = TermRecord {
        term,
        register: register.clone(),
        heeds_term,
        noticed: false,
        in_flight: None,
    };
    let mut rng = Rng::new(seed ^ token.get());
    let steps = rng.range(STEPS.0, STEPS.1);
    for step in 1..=steps {
        if record.lost_by_check() {
            return;
        }
        let read = match register.read(token).await {
            Answer::Done(value) => value,
            // A newer term has read the register: step down.
            Answer::Stale(highest) => return say(&format!("RSTALE {token}/{step} {highest}")),
            Answer::Failed(err) => {
                say(&format!("RERR {token}/{step} {}", one_line(&err)));
                sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        say(&format!("READ {token}/{step} {read}"));
        let count: u64 = read
            .split(':')
            .next()
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let value = format!("{}:{token}/{step}", count + 1);
        record.in_flight = Some((step, value.clone()));
        // The work: the moment the driver likes to pause a leader.
        sleep(Duration::from_millis(rng.range(30, 90))).await;
        if record.lost_by_check() {
            return;
        }
        record.in_flight = None;
        let write = send(register.clone(), token, step, value, "SEND");
        let refused = if heeds_term {
            write.await
        } else {
            // Ignoring its term, the leader does not let `lead` stop a
            // write it has begun: it finishes in a task of its own.
            tokio::spawn(write).await.unwrap_or(false)
        };
        if refused {
            // A newer term has been answered: step down.
            return;
        }
        sleep(Duration::from_millis(rng.range(0, 20))).await;
    }
    // The term's steps are done: `lead` resigns.
}

/// Sends step `step`'s write of `value`, printed as `what` (`SEND`,
/// `LATE`), and prints its outcome; true if the register refused it.
async fn send(
    register: Arc<Register>,
    token: FencingToken,
    step: u64,
    value: String,
    what: &str,
) -> bool {
    say(&format!("{what} {token}/{step} {value}"));
    match register.write(token, &value).await {
        Answer::Done(()) => say(&format!("OK {token}/{step}")),
        Answer::Stale(highest) => {
            say(&format!("STALE {token}/{step} {highest}"));
            return true;
        }
        Answer::Failed(err) => say(&format!("WERR {token}/{step} {}", one_line(&err))),
    }
    false
}

/// What a term's work leaves behind when it ends, however it ends: returned
/// or dropped by `lead` (on the lost signal, or at the run's end). It
/// prints the line that ends the leader's belief, and sends a step's write
/// that the loss cut short.
struct TermRecord {
    term: Term,
    register: Arc<Register>,
    heeds_term: bool,
    /// `LOST` was printed.
    noticed: bool,
    /// The step between its read and its write: its number and value.
    in_flight: Option<(u64, String)>,
}

impl TermRecord {
    /// `Term::check` before a step: true once the term is lost, printing
    /// `LOST t check`. Always false when the leader ignores its term.
    fn lost_by_check(&mut self) -> bool {
        if !self.heeds_term || self.term.check().is_ok() {
            return false;
        }
        say(&format!("LOST {} check", self.term.token()));
        self.noticed = true;
        true
    }
}

impl Drop for TermRecord {
    fn drop(&mut self) {
        let token = self.term.token();
        let lost = self.term.is_lost();
        if !self.noticed {
            if lost && self.heeds_term {
                say(&format!("LOST {token} signal"));
            } else {
                say(&format!("END {token}"));
            }
        }
        let Some((step, value)) = self.in_flight.take().filter(|_| lost) else {
            return;
        };
        // A task of its own: the work is being dropped.
        tokio::spawn(send(self.register.clone(), token, step, value, "LATE"));
    }
}

//! What the lease lifecycle records: metrics through the [`metrics`]
//! facade, and a `dlock.hold` [`tracing`] span around every hold.
//!
//! dlock installs no recorder and no subscriber: the application does (a
//! Prometheus exporter, an OpenTelemetry layer, …). With none installed,
//! nothing is recorded and the cost is a thread-local read and an atomic
//! load per value.
//!
//! # Metrics
//!
//! | name | type | unit | labels | counts |
//! | --- | --- | --- | --- | --- |
//! | `dlock_acquisitions_total` | counter | | `backend`, `outcome` | acquisitions, by how they ended: `acquired`, `held` (held by someone else and the call did not wait), `timeout` (waited, still held), `error` (the backend failed, or the call was made outside a runtime) |
//! | `dlock_wait_seconds` | histogram | seconds | `backend`, `outcome` | how long each acquisition took, from the call to its outcome (the waiting and the round trips) |
//! | `dlock_hold_seconds` | histogram | seconds | `backend` | how long each lease was held, from its acquisition to its release (explicit or on drop) or its loss |
//! | `dlock_leases_held` | gauge | | `backend` | leases held by this process now |
//! | `dlock_leases_lost_total` | counter | | `backend`, `reason` | leases lost, by why: `expired`, `not_owner`, `unreachable`, `session_ended`, `runtime_gone` (the [`LostReason`] variants; a released lease is not lost) |
//! | `dlock_renewal_failures_total` | counter | | `backend` | renewals of one lease that failed (an error, no answer, no answer in time); they are retried until the lease's ttl runs out |
//!
//! `backend` is the backend's [`kind`](crate::Backend::kind) (`memory`,
//! `file`, `redis`, `pg`, or a backend of your own), not its registry name.
//!
//! Each lease is counted once, however it ends: one `acquired`, one wait
//! and one hold sample, +1 and −1 on the gauge, and at most one loss. A
//! [`LeaseSet`](crate::LeaseSet) counts each of its keys as a lease; when it
//! fails half-way, the keys it had taken count as acquired and released, and
//! the key it could not take counts under its outcome. An acquisition its
//! caller cancels (a dropped future, a `select!` that went the other way) is
//! counted under no outcome, and what it may have been granted meanwhile,
//! which the core gives back, is not an acquisition either. A lease lost
//! and then released is lost, not released; a release that finds the key
//! no longer the holder's (its ttl ran out unnoticed, someone broke it)
//! counts as lost with reason `not_owner`, as [`Lease::release`] says.
//! `dlock_hold_seconds` ends when the holder lets go, not when a minimum
//! hold lets the key go.
//!
//! **Key names are never labels**: a key usually carries an id (`export:{tenant}`),
//! so one series per key would grow without bound in the recorder and the
//! monitoring system behind it. To follow one key, use the span below.
//!
//! [`describe`] gives an installed recorder the units and descriptions (a
//! Prometheus exporter prints them as `# HELP`); recording works without it.
//!
//! # The `dlock.hold` span
//!
//! Every acquisition opens an `INFO` span named `dlock.hold`, a child of
//! whatever span is current where it is called (a request's, say), and
//! closes it when the hold is over: when the release is done (awaited, or
//! in the background after a drop), when the lease is lost, or at once when
//! the acquisition fails. Its fields:
//!
//! | field | recorded | value |
//! | --- | --- | --- |
//! | `key` | at the start | the key |
//! | `backend` | at the start | the backend's kind |
//! | `token` | when acquired | the fencing token |
//! | `wait_ms` | when the acquisition ends | how long it took, in milliseconds |
//! | `outcome` | at the end | `released`, `lost`, `error` (an awaited release failed; the ttl frees the key), or, when nothing was held, `held`, `timeout`, `error` or `cancelled` |
//! | `reason` | when lost | as the `reason` label above |
//!
//! It is never entered around your code, so it is not the parent of the
//! spans and events your locked code makes (they keep their own parent);
//! its children are dlock's own: the `dlock.acquire` debug span of the
//! waiting, the "lease lost" warning and the "lease released" debug event.
//! An exporter shows it as one bar from acquisition to release beside your
//! work; `tracing_subscriber::fmt` prints it when it closes with
//! `.with_span_events(FmtSpan::CLOSE)`, its idle time being the hold.
//!
//! [`Lease::release`]: crate::Lease::release

use std::cell::Cell;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use ::metrics::{Key, Label, Level, Metadata, Unit};
use tracing::Span;
use tracing::field::Empty;

use crate::error::{LockError, LostReason};
use crate::key::LockKey;

/// Acquisitions, by `backend` and `outcome` (counter).
pub const ACQUISITIONS: &str = "dlock_acquisitions_total";
/// How long acquisitions took, by `backend` and `outcome` (histogram,
/// seconds).
pub const WAIT: &str = "dlock_wait_seconds";
/// How long leases were held, by `backend` (histogram, seconds).
pub const HOLD: &str = "dlock_hold_seconds";
/// Leases held now, by `backend` (gauge).
pub const LEASES_HELD: &str = "dlock_leases_held";
/// Leases lost, by `backend` and `reason` (counter).
pub const LEASES_LOST: &str = "dlock_leases_lost_total";
/// Failed renewals, by `backend` (counter).
pub const RENEWAL_FAILURES: &str = "dlock_renewal_failures_total";

/// Gives the installed recorder the unit and description of each metric.
/// Call it once the recorder is installed (descriptions given before that
/// are lost); values are recorded whether or not it was called.
pub fn describe() {
    ::metrics::describe_counter!(
        ACQUISITIONS,
        "Lock acquisitions, by backend and outcome (acquired, held, timeout, error)."
    );
    ::metrics::describe_histogram!(
        WAIT,
        Unit::Seconds,
        "How long lock acquisitions took, waiting included, by backend and outcome."
    );
    ::metrics::describe_histogram!(
        HOLD,
        Unit::Seconds,
        "How long leases were held, from acquisition to release or loss, by backend."
    );
    ::metrics::describe_gauge!(LEASES_HELD, "Leases this process holds now, by backend.");
    ::metrics::describe_counter!(
        LEASES_LOST,
        "Leases lost before their holder released them, by backend and reason."
    );
    ::metrics::describe_counter!(
        RENEWAL_FAILURES,
        "Lease renewals that failed (and were retried), by backend."
    );
}

/// How an acquisition ended: the `outcome` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Acquired,
    Held,
    Timeout,
    Error,
}

impl Outcome {
    const ALL: [Outcome; 4] = [
        Outcome::Acquired,
        Outcome::Held,
        Outcome::Timeout,
        Outcome::Error,
    ];

    /// The outcome of an acquisition that failed with `err`.
    pub(crate) fn of_error(err: &LockError) -> Self {
        match err {
            LockError::Held { .. } => Outcome::Held,
            LockError::Timeout { .. } => Outcome::Timeout,
            _ => Outcome::Error,
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Outcome::Acquired => "acquired",
            Outcome::Held => "held",
            Outcome::Timeout => "timeout",
            Outcome::Error => "error",
        }
    }
}

/// The `reason` labels, in the order of [`reason_index`].
const REASONS: [&str; 6] = [
    "expired",
    "not_owner",
    "unreachable",
    "session_ended",
    "released",
    "runtime_gone",
];

/// The place of `reason`'s label in [`REASONS`]. Exhaustive on purpose: a
/// new variant must be given a label here.
fn reason_index(reason: &LostReason) -> usize {
    match reason {
        LostReason::Expired => 0,
        LostReason::NotOwner => 1,
        LostReason::Unreachable(_) => 2,
        LostReason::SessionEnded(_) => 3,
        LostReason::Released => 4,
        LostReason::RuntimeGone => 5,
    }
}

/// The `reason` label (and span field) of `reason`.
pub(crate) fn reason_label(reason: &LostReason) -> &'static str {
    REASONS[reason_index(reason)]
}

/// Passed with every value: what a recorder may filter on.
static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

/// The metric keys of one kind of backend, built once per kind: recording a
/// value then neither allocates nor hashes a key, which keeps the cost with
/// no recorder installed at a thread-local read and an atomic load.
pub(crate) struct Meters {
    kind: &'static str,
    acquisitions: [Key; 4],
    wait: [Key; 4],
    hold: Key,
    held: Key,
    lost: [Key; REASONS.len()],
    renewal_failures: Key,
}

/// Every kind's keys, made on first use and kept for the process's life
/// (backend kinds are `&'static str`: a program has a handful).
static KINDS: Mutex<Vec<&'static Meters>> = Mutex::new(Vec::new());

thread_local! {
    /// The kind this thread recorded for last: most threads use one.
    static LAST: Cell<Option<&'static Meters>> = const { Cell::new(None) };
}

impl Meters {
    /// The keys of backends of `kind`.
    pub(crate) fn of(kind: &'static str) -> &'static Meters {
        if let Some(meters) = LAST.with(Cell::get)
            && meters.kind == kind
        {
            return meters;
        }
        let meters = {
            let mut kinds = KINDS.lock().unwrap_or_else(PoisonError::into_inner);
            match kinds.iter().find(|meters| meters.kind == kind) {
                Some(meters) => *meters,
                None => {
                    let meters: &'static Meters = Box::leak(Box::new(Meters::new(kind)));
                    kinds.push(meters);
                    meters
                }
            }
        };
        LAST.with(|last| last.set(Some(meters)));
        meters
    }

    fn new(kind: &'static str) -> Self {
        let backend = || Label::from_static_parts("backend", kind);
        let with = |name: &'static str, label: &'static str, value: &'static str| {
            Key::from_parts(
                name,
                vec![backend(), Label::from_static_parts(label, value)],
            )
        };
        Self {
            kind,
            acquisitions: Outcome::ALL.map(|o| with(ACQUISITIONS, "outcome", o.label())),
            wait: Outcome::ALL.map(|o| with(WAIT, "outcome", o.label())),
            hold: Key::from_parts(HOLD, vec![backend()]),
            held: Key::from_parts(LEASES_HELD, vec![backend()]),
            lost: REASONS.map(|reason| with(LEASES_LOST, "reason", reason)),
            renewal_failures: Key::from_parts(RENEWAL_FAILURES, vec![backend()]),
        }
    }

    /// An acquisition took a lease after `wait`: the lease is held.
    pub(crate) fn acquired(&self, wait: Duration) {
        ::metrics::with_recorder(|recorder| {
            self.record_acquisition(recorder, Outcome::Acquired, wait);
            recorder
                .register_gauge(&self.held, &METADATA)
                .increment(1.0);
        });
    }

    /// An acquisition failed with `outcome` after `wait`.
    pub(crate) fn failed(&self, outcome: Outcome, wait: Duration) {
        ::metrics::with_recorder(|recorder| self.record_acquisition(recorder, outcome, wait));
    }

    fn record_acquisition(
        &self,
        recorder: &dyn ::metrics::Recorder,
        outcome: Outcome,
        wait: Duration,
    ) {
        let i = outcome as usize;
        recorder
            .register_counter(&self.acquisitions[i], &METADATA)
            .increment(1);
        recorder
            .register_histogram(&self.wait[i], &METADATA)
            .record(wait.as_secs_f64());
    }

    /// A lease was held for `held_for` and is no more: released by its
    /// holder, or lost for `lost`.
    pub(crate) fn lease_ended(&self, held_for: Duration, lost: Option<&LostReason>) {
        ::metrics::with_recorder(|recorder| {
            recorder
                .register_gauge(&self.held, &METADATA)
                .decrement(1.0);
            recorder
                .register_histogram(&self.hold, &METADATA)
                .record(held_for.as_secs_f64());
        });
        if let Some(reason) = lost {
            self.lost(reason);
        }
    }

    /// A lease that had ended was found lost for `reason` (its release
    /// found the key gone).
    pub(crate) fn lost(&self, reason: &LostReason) {
        ::metrics::with_recorder(|recorder| {
            recorder
                .register_counter(&self.lost[reason_index(reason)], &METADATA)
                .increment(1);
        });
    }

    /// `count` renewals failed.
    pub(crate) fn renewals_failed(&self, count: usize) {
        ::metrics::with_recorder(|recorder| {
            recorder
                .register_counter(&self.renewal_failures, &METADATA)
                .increment(count as u64);
        });
    }
}

/// The span of a hold of `key` on a backend of `kind` (see the module docs).
pub(crate) fn hold_span(key: &LockKey, kind: &'static str) -> Span {
    tracing::info_span!(
        "dlock.hold",
        key = %key,
        backend = kind,
        token = Empty,
        wait_ms = Empty,
        outcome = Empty,
        reason = Empty,
    )
}

/// Milliseconds, for the span's `wait_ms`.
pub(crate) fn millis(wait: Duration) -> u64 {
    u64::try_from(wait.as_millis()).unwrap_or(u64::MAX)
}

/// What recording adds to one uncontended acquire + release cycle that
/// began at `started`, in the calls the lease makes, for the benchmark to
/// time with no recorder and no subscriber installed: the kind's keys
/// looked up, the hold's span opened, filled and closed, the one clock
/// read the acquisition adds (the release reuses one it made anyway), and
/// the values. Not public API.
#[doc(hidden)]
pub fn record_one_cycle(kind: &'static str, key: &LockKey, started: tokio::time::Instant) {
    let meters = Meters::of(kind);
    let span = hold_span(key, kind);
    let granted = tokio::time::Instant::now();
    let wait = granted.saturating_duration_since(started);
    span.record("wait_ms", millis(wait));
    meters.acquired(wait);
    span.record("token", tracing::field::display(1));
    meters.lease_ended(granted.saturating_duration_since(started), None);
    span.record("outcome", "released");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every loss reason has a label of its own, and the labels are the
    /// documented ones.
    #[test]
    fn every_lost_reason_has_its_own_label() {
        let reasons = [
            LostReason::Expired,
            LostReason::NotOwner,
            LostReason::Unreachable("refused".into()),
            LostReason::SessionEnded("closed".into()),
            LostReason::Released,
            LostReason::RuntimeGone,
        ];
        let labels: Vec<&str> = reasons.iter().map(reason_label).collect();
        assert_eq!(labels, REASONS);
        let mut unique = labels.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), labels.len());
    }

    /// The outcome label follows the error's kind.
    #[test]
    fn outcomes_follow_the_error() {
        let held = LockError::Held {
            key: "k".into(),
            holder: None,
        };
        let timeout = LockError::Timeout {
            key: "k".into(),
            waited: Duration::from_secs(1),
        };
        let failed = LockError::NoRuntime { key: "k".into() };
        assert_eq!(Outcome::of_error(&held).label(), "held");
        assert_eq!(Outcome::of_error(&timeout).label(), "timeout");
        assert_eq!(Outcome::of_error(&failed).label(), "error");
        assert_eq!(Outcome::Acquired.label(), "acquired");
    }

    /// One kind's keys are made once and shared by every thread.
    #[test]
    fn keys_are_made_once_per_kind() {
        let here = Meters::of("metrics-unit-test") as *const Meters;
        let there =
            std::thread::spawn(|| Meters::of("metrics-unit-test") as *const Meters as usize)
                .join()
                .expect("thread runs");
        assert_eq!(here as usize, there);
        assert_ne!(here, Meters::of("metrics-unit-test-2") as *const Meters);
    }
}

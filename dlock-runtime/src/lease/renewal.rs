//! Background renewal, written once for every lease: one scheduler task per
//! backend instance (and runtime) keeps the timing of all of that backend's
//! leases, and sends the renewals that fall due together as one
//! [`Backend::extend_many`](crate::Backend::extend_many) batch — a Redis pipeline, one check per
//! PostgreSQL session — instead of one task, two timers and one round trip
//! per lease.
//!
//! The lost signal keeps its meaning: a lease whose renewal is refused is
//! lost at once; one whose renewals fail (or do not come back) is lost when
//! its ttl runs out.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::runtime::{Handle, Id as RuntimeId};
use tokio::sync::Notify;
use tokio::time::{Instant, sleep_until, timeout};

use super::Shared;
use crate::backend::Renewal;
use crate::error::LostReason;

/// A renewal may go out up to this fraction of its interval early, so that
/// leases due at nearby moments share one batch.
const EARLY_DIVISOR: u32 = 4;
/// The furthest ahead a renewal is ever sent early.
const MAX_EARLY: Duration = Duration::from_secs(60);
/// The most leases in one `extend_many` call.
const MAX_BATCH: usize = 1000;
/// The longest pause between renewal retries after a failed renewal.
const MAX_RENEW_RETRY: Duration = Duration::from_secs(1);
/// How long an idle scheduler waits for new leases before it ends.
const LINGER: Duration = Duration::from_secs(5);

/// The scheduler of each (backend instance, runtime). A scheduler runs on
/// the runtime whose leases it renews, so it lives as long as they can.
type SchedulerKey = (usize, RuntimeId);
static SCHEDULERS: LazyLock<Mutex<HashMap<SchedulerKey, Arc<Renewer>>>> =
    LazyLock::new(Mutex::default);

fn schedulers() -> MutexGuard<'static, HashMap<SchedulerKey, Arc<Renewer>>> {
    SCHEDULERS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The renewal scheduler of one backend instance on one runtime.
pub(super) struct Renewer {
    schedule: Mutex<Schedule>,
    wake: Notify,
}

#[derive(Default)]
struct Schedule {
    next_id: u64,
    leases: HashMap<u64, Entry>,
    /// (renewal deadline, lease) for leases with a renewal to send.
    renewals: BTreeSet<(Instant, u64)>,
    /// (end of validity, lease) for every lease.
    expiries: BTreeSet<(Instant, u64)>,
    /// When the scheduler task wakes next, if it sleeps.
    sleeping_until: Option<Instant>,
    /// The task has ended: register with a new one.
    closed: bool,
}

struct Entry {
    shared: Arc<Shared>,
    ttl: Duration,
    valid_until: Instant,
    /// When to renew; `None` while a renewal is in flight or renewal is off.
    next_renewal: Option<Instant>,
    renew: bool,
    last_error: Option<String>,
}

impl Entry {
    fn interval(&self) -> Duration {
        self.ttl / 3
    }
}

impl Schedule {
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.leases.remove(&id)?;
        self.expiries.remove(&(entry.valid_until, id));
        if let Some(at) = entry.next_renewal {
            self.renewals.remove(&(at, id));
        }
        Some(entry)
    }

    fn set_renewal(&mut self, id: u64, at: Instant) {
        if let Some(entry) = self.leases.get_mut(&id) {
            if let Some(old) = entry.next_renewal.replace(at) {
                self.renewals.remove(&(old, id));
            }
            self.renewals.insert((at, id));
        }
    }

    /// True if an event at `at` comes before the sleeping task would wake.
    fn wakes_later_than(&self, at: Instant) -> bool {
        self.sleeping_until.is_some_and(|until| at < until)
    }
}

impl Renewer {
    fn schedule(&self) -> MutexGuard<'_, Schedule> {
        self.schedule.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Renews lease `id` now rather than at its time: its backend suspects
    /// the store lost it (a broken link to a server that may have
    /// restarted), and a lease the store no longer has must be told lost
    /// before its next renewal would. A lease with renewal off, or with a
    /// renewal in flight, is left as it is.
    pub(super) fn renew_now(&self, id: u64) {
        let now = Instant::now();
        let mut schedule = self.schedule();
        let due = schedule
            .leases
            .get(&id)
            .is_some_and(|entry| entry.renew && entry.next_renewal.is_some_and(|at| at > now));
        if !due {
            return;
        }
        schedule.set_renewal(id, now);
        let wake = schedule.wakes_later_than(now);
        drop(schedule);
        if wake {
            self.wake.notify_one();
        }
    }
}

/// A lease's place in its scheduler; [`Registration::cancel`] takes it out.
pub(super) struct Registration {
    renewer: Arc<Renewer>,
    id: u64,
}

impl Registration {
    /// Stops renewing and watching the lease (released or dropped).
    pub(super) fn cancel(&self) {
        self.renewer.schedule().remove(self.id);
    }
}

/// Hands a fresh lease to its backend's scheduler on `runtime`: valid for
/// `valid` (the ttl, or less for a handed-over lease) until `valid_until`,
/// renewed a third of the way into that, then every third of `ttl`, if
/// `renew`; lost at `valid_until` unless renewed.
pub(super) fn register(
    runtime: &Handle,
    shared: Arc<Shared>,
    valid_until: Instant,
    valid: Duration,
    ttl: Duration,
    renew: bool,
) -> Registration {
    let key = (
        Arc::as_ptr(&shared.backend) as *const () as usize,
        runtime.id(),
    );
    let mut all = schedulers();
    let renewer = match all.get(&key) {
        Some(renewer) if !renewer.schedule().closed => Arc::clone(renewer),
        _ => {
            let renewer = Arc::new(Renewer {
                schedule: Mutex::default(),
                wake: Notify::new(),
            });
            all.insert(key, Arc::clone(&renewer));
            // The guard goes in as an argument, so it is dropped with the
            // task even if the runtime shuts down before the task ever ran.
            runtime.spawn(run(
                Arc::clone(&renewer),
                Unlist {
                    key,
                    renewer: Arc::clone(&renewer),
                },
            ));
            renewer
        }
    };
    // Inserted under the registry lock, which the task also takes to close:
    // a lease never lands in a scheduler that has just ended.
    let mut schedule = renewer.schedule();
    let id = schedule.next_id;
    schedule.next_id += 1;
    // A third of the way into the lease's first validity: the ttl's, or a
    // handed-over lease's shorter one (`Grant::valid_for`).
    let next_renewal = renew.then(|| {
        valid_until
            .checked_sub(valid - valid / 3)
            .unwrap_or_else(Instant::now)
    });
    let _ = shared.renewal.set((Arc::downgrade(&renewer), id));
    schedule.leases.insert(
        id,
        Entry {
            shared,
            ttl,
            valid_until,
            next_renewal,
            renew,
            last_error: None,
        },
    );
    schedule.expiries.insert((valid_until, id));
    let first = match next_renewal {
        Some(at) => {
            schedule.renewals.insert((at, id));
            at
        }
        None => valid_until,
    };
    let wake = schedule.wakes_later_than(first);
    drop(schedule);
    drop(all);
    if wake {
        renewer.wake.notify_one();
    }
    Registration { renewer, id }
}

/// Removes the registry entry when the task ends, however it ends (also
/// when its runtime shuts down).
struct Unlist {
    key: SchedulerKey,
    renewer: Arc<Renewer>,
}

impl Drop for Unlist {
    fn drop(&mut self) {
        let orphans = {
            let mut all = schedulers();
            let mut schedule = self.renewer.schedule();
            schedule.closed = true;
            if all
                .get(&self.key)
                .is_some_and(|r| Arc::ptr_eq(r, &self.renewer))
            {
                all.remove(&self.key);
            }
            schedule.renewals.clear();
            schedule.expiries.clear();
            std::mem::take(&mut schedule.leases)
        };
        // The task ends with leases still in its care only when its runtime
        // shuts down: nobody will renew them, so their holders are told now
        // rather than left believing (outside the locks: telling wakes tasks).
        for entry in orphans.into_values() {
            entry.shared.mark_lost(LostReason::RuntimeGone);
        }
    }
}

type Batch = Vec<(u64, Arc<Shared>, Duration, Instant)>;

/// The scheduler task: marks expired leases lost, sends due renewals in
/// batches, sleeps until the next event, and ends once it has had no lease
/// for [`LINGER`].
async fn run(renewer: Arc<Renewer>, unlist: Unlist) {
    let _unlist = unlist;
    let mut idle_since: Option<Instant> = None;
    loop {
        let now = Instant::now();
        let mut batch: Batch = Vec::new();
        let wake_at = {
            let mut guard = renewer.schedule();
            let schedule = &mut *guard;
            expire(schedule, now);
            collect_due(schedule, now, &mut batch);
            let wake_at = if schedule.leases.is_empty() {
                let since = *idle_since.get_or_insert(now);
                if now >= since + LINGER {
                    // Closed by `Unlist`, under the registry lock.
                    return;
                }
                since + LINGER
            } else {
                idle_since = None;
                let renewal = schedule.renewals.first().map(|&(at, _)| at);
                let expiry = schedule.expiries.first().map(|&(at, _)| at);
                match (renewal, expiry) {
                    (Some(r), Some(e)) => r.min(e),
                    (Some(at), None) | (None, Some(at)) => at,
                    (None, None) => now + LINGER,
                }
            };
            // Set in the same step that decided it: whoever adds an earlier
            // event afterwards sees it and leaves a wake-up permit.
            schedule.sleeping_until = Some(wake_at);
            wake_at
        };
        while !batch.is_empty() {
            let rest = batch.split_off(batch.len().min(MAX_BATCH));
            tokio::spawn(send(Arc::clone(&renewer), batch));
            batch = rest;
        }
        // Biased, the wake-up first: either way the loop reads the
        // schedule afresh, but a wake-up left unconsumed (when the sleep
        // was polled first and was due too) would run the loop once more
        // for nothing, at the pick of tokio's random source.
        tokio::select! {
            biased;
            _ = renewer.wake.notified() => {}
            _ = sleep_until(wake_at) => {}
        }
    }
}

/// Marks every lease whose validity ended lost.
fn expire(schedule: &mut Schedule, now: Instant) {
    while let Some(&(at, id)) = schedule.expiries.first() {
        if at > now {
            break;
        }
        if let Some(entry) = schedule.remove(id) {
            entry.shared.mark_lost(match entry.last_error {
                Some(err) => LostReason::Unreachable(err),
                None => LostReason::Expired,
            });
        }
    }
}

/// Takes out every renewal that is due, or, once one is due, may go early.
fn collect_due(schedule: &mut Schedule, now: Instant, batch: &mut Batch) {
    if schedule.renewals.first().is_none_or(|&(at, _)| at > now) {
        return;
    }
    let horizon = now + MAX_EARLY;
    let candidates: Vec<(Instant, u64)> = schedule
        .renewals
        .iter()
        .take_while(|&&(at, _)| at <= horizon)
        .copied()
        .collect();
    for (at, id) in candidates {
        let Some(entry) = schedule.leases.get(&id) else {
            continue;
        };
        let early = (entry.interval() / EARLY_DIVISOR).min(MAX_EARLY);
        if at.checked_sub(early).is_some_and(|from| from > now) {
            continue;
        }
        if entry.shared.is_ended() {
            // Lost through its backend's loss group: nothing to renew.
            schedule.remove(id);
            continue;
        }
        schedule.renewals.remove(&(at, id));
        if let Some(entry) = schedule.leases.get_mut(&id) {
            entry.next_renewal = None;
            batch.push((id, Arc::clone(&entry.shared), entry.ttl, entry.valid_until));
        }
    }
}

/// Sends one batch and files the answers.
async fn send(renewer: Arc<Renewer>, batch: Batch) {
    let Some(backend) = batch
        .first()
        .map(|(_, shared, ..)| Arc::clone(&shared.backend))
    else {
        return;
    };
    let sent = Instant::now();
    let renewals: Vec<Renewal<'_>> = batch
        .iter()
        .map(|(_, shared, ttl, valid_until)| {
            let renewal = shared
                .renewal(*ttl)
                .expiring_in(valid_until.saturating_duration_since(sent));
            match &shared.identity {
                Some(identity) => renewal.recording(identity, shared.token),
                None => renewal,
            }
        })
        .collect();
    // Past the last lease's validity every answer is moot: the expiry has
    // marked them all lost by then.
    let last_valid = batch.iter().map(|b| b.3).max().unwrap_or(sent);
    let answers = timeout(
        last_valid.saturating_duration_since(sent),
        backend.extend_many(&renewals),
    )
    .await;
    drop(renewals);
    let meters = batch.first().map(|(_, shared, ..)| shared.meters);
    let Ok(answers) = answers else {
        // No answer in time: every renewal of the batch failed.
        if let Some(meters) = meters {
            meters.renewals_failed(batch.len());
        }
        return;
    };
    let now = Instant::now();
    let mut failed: Option<(usize, String)> = None;
    let mut earliest = None::<Instant>;
    let mut guard = renewer.schedule();
    let schedule = &mut *guard;
    for (i, (id, shared, ttl, _)) in batch.iter().enumerate() {
        let Some(entry) = schedule.leases.get_mut(id) else {
            continue;
        };
        let answer = answers.get(i);
        match answer {
            // Renewed in time: valid for a ttl from when the request left.
            Some(Ok(true)) if entry.valid_until > now => {
                let old = std::mem::replace(&mut entry.valid_until, sent + *ttl);
                shared.renewed_until(sent + *ttl);
                entry.last_error = None;
                let next = sent + entry.interval();
                schedule.expiries.remove(&(old, *id));
                schedule.expiries.insert((sent + *ttl, *id));
                schedule.set_renewal(*id, next);
                earliest = Some(earliest.map_or(next, |e| e.min(next)));
                tracing::trace!(key = %shared.key, token = %shared.token, "lease renewed");
            }
            // Too late: the expiry, due now, marks it lost.
            Some(Ok(true)) => {}
            Some(Ok(false)) => {
                schedule.remove(*id);
                shared.mark_lost(LostReason::NotOwner);
            }
            Some(Err(_)) | None => {
                let text = match answer {
                    Some(Err(err)) => err.to_string(),
                    _ => "the backend gave no answer for this lease".to_owned(),
                };
                let retry = now + (*ttl / 10).min(MAX_RENEW_RETRY);
                entry.last_error = Some(text.clone());
                if entry.renew {
                    schedule.set_renewal(*id, retry);
                }
                earliest = Some(earliest.map_or(retry, |e| e.min(retry)));
                failed.get_or_insert((0, text)).0 += 1;
            }
        }
    }
    let wake = earliest.is_some_and(|at| schedule.wakes_later_than(at));
    drop(guard);
    if wake {
        renewer.wake.notify_one();
    }
    if let Some((count, error)) = failed {
        if let Some(meters) = meters {
            meters.renewals_failed(count);
        }
        tracing::warn!(
            backend = backend.kind(),
            leases = count,
            %error,
            "lease renewal failed; retrying"
        );
    }
}

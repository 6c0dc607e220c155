//! Enforcing the ttl of the backend's leases. A session advisory lock does
//! not expire while its connection lives, so the backend enforces each
//! lease's deadline itself: it unlocks a lease whose deadline passed without
//! an extend. One queue per backend holds every deadline and
//! one task sleeps until the earliest: no task or timer per lease.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::{Instant, timeout};

use super::Inner;
use super::home::Home;
use crate::backend::OwnerId;
use crate::key::LockKey;

/// How long the task waits with an empty queue before it ends (the next
/// hold starts a new one).
const LINGER: Duration = Duration::from_secs(5);

/// A lease's place in the queue: its deadline and a number of its own.
pub(super) type Slot = (Instant, u64);

/// The deadlines of the backend's held leases.
pub(super) struct Deadlines {
    queue: Mutex<Queue>,
    wake: Notify,
    /// Where the task runs: not on the runtime of whichever caller happens
    /// to take the first hold, which may shut down with holds queued.
    home: Arc<Home>,
}

#[derive(Default)]
struct Queue {
    next_id: u64,
    /// Every live hold, by deadline.
    due: BTreeMap<Slot, (LockKey, OwnerId)>,
    /// Which task runs the queue, if one does (a number per task, so a task
    /// that ends only clears its own mark).
    task: Option<u64>,
    tasks_started: u64,
    /// When the task wakes next, if it sleeps.
    sleeping_until: Option<Instant>,
}

impl Deadlines {
    pub(super) fn new(home: Arc<Home>) -> Self {
        Self {
            queue: Mutex::default(),
            wake: Notify::new(),
            home,
        }
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues a new hold, starting the task at home if none runs. Returns the hold's slot, to move or remove it with.
    pub(super) fn add(
        self: &Arc<Self>,
        inner: Weak<Inner>,
        key: &LockKey,
        owner: OwnerId,
        deadline: Instant,
    ) -> Slot {
        let mut queue = self.queue();
        let id = queue.next_id;
        queue.next_id += 1;
        queue.due.insert((deadline, id), (key.clone(), owner));
        let start = queue.task.is_none().then(|| {
            queue.tasks_started += 1;
            queue.task = Some(queue.tasks_started);
            queue.tasks_started
        });
        let wake = queue.sleeping_until.is_some_and(|until| deadline < until);
        drop(queue);
        if let Some(number) = start {
            // Dropped unstarted if there is no runtime at all; its mark is
            // cleared then, and the next hold tries again.
            self.home.spawn(run(
                Arc::clone(self),
                inner,
                Unmark {
                    deadlines: Arc::clone(self),
                    number,
                },
            ));
        } else if wake {
            self.wake.notify_one();
        }
        (deadline, id)
    }

    /// Moves a hold to a new deadline (an extend: usually later, but a
    /// release within a minimum hold shortens the lease to what is left of
    /// the hold). Returns its new slot.
    pub(super) fn moved(&self, slot: Slot, key: &LockKey, owner: OwnerId, to: Instant) -> Slot {
        let mut queue = self.queue();
        // Gone if the task already took it as due: the unlock it started
        // sees the new deadline and leaves the lock alone, and the hold
        // goes back in the queue here.
        let hold = queue
            .due
            .remove(&slot)
            .unwrap_or_else(|| (key.clone(), owner));
        queue.due.insert((to, slot.1), hold);
        // A task asleep past the new deadline must wake for it.
        let wake = queue.sleeping_until.is_some_and(|until| to < until);
        drop(queue);
        if wake {
            self.wake.notify_one();
        }
        (to, slot.1)
    }

    /// Takes a hold out of the queue (released, lost, or unlocked).
    pub(super) fn remove(&self, slot: Slot) {
        self.queue().due.remove(&slot);
    }
}

/// Clears the task's mark however the task ends (also when its runtime
/// shuts down), so the next hold starts a new one.
struct Unmark {
    deadlines: Arc<Deadlines>,
    number: u64,
}

impl Drop for Unmark {
    fn drop(&mut self) {
        let mut queue = self.deadlines.queue();
        if queue.task == Some(self.number) {
            queue.task = None;
            queue.sleeping_until = None;
        }
    }
}

/// Sleeps until the earliest deadline and unlocks every hold that is due.
async fn run(deadlines: Arc<Deadlines>, inner: Weak<Inner>, unmark: Unmark) {
    let _unmark = unmark;
    loop {
        let now = Instant::now();
        let (due, next) = {
            let mut queue = deadlines.queue();
            let mut due = Vec::new();
            while let Some(entry) = queue.due.first_entry()
                && entry.key().0 <= now
            {
                due.push(entry.remove());
            }
            let next = queue.due.first_key_value().map(|(slot, _)| slot.0);
            queue.sleeping_until = Some(next.unwrap_or(now + LINGER));
            (due, next)
        };
        if !due.is_empty() {
            let Some(inner) = inner.upgrade() else { return };
            for (key, owner) in due {
                // Each unlock in a task of its own, so one slow unlock does
                // not hold up the others; it only unlocks a hold whose
                // deadline (which an extend may just have moved) has passed.
                let inner = Arc::clone(&inner);
                tokio::spawn(async move {
                    match inner.unlock(&key, Some(owner), true).await {
                        Ok(_) => tracing::debug!(key = %key, "lease deadline checked"),
                        Err(err) => {
                            tracing::warn!(key = %key, error = %err, "unlocking a lease past its deadline failed")
                        }
                    }
                });
            }
        }
        match next {
            Some(at) => {
                let _ = timeout(
                    at.saturating_duration_since(Instant::now()),
                    deadlines.wake.notified(),
                )
                .await;
            }
            None => {
                if timeout(LINGER, deadlines.wake.notified()).await.is_err() {
                    let mut queue = deadlines.queue();
                    if queue.due.is_empty() {
                        // Ended under the lock `add` takes: a hold queued
                        // from now on starts a new task.
                        queue.task = None;
                        queue.sleeping_until = None;
                        return;
                    }
                }
            }
        }
        if inner.strong_count() == 0 {
            return;
        }
    }
}

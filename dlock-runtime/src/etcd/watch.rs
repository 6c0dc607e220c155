//! One etcd watch per waited-on lock key per backend, shared by every
//! waiter and holder watch of the process.
//!
//! A watch is created when the first notice for its key is asked for, and
//! the notice is handed out only once etcd confirmed the watch (its
//! `created` answer): the watch then sees every change after that, so a
//! release after the caller's next attempt is never missed (rule 6). It is
//! cancelled when its last notice goes.
//!
//! A delete of the lock key (a release, an expired lease, a broken lock)
//! wakes ONE waiter of this process, the longest waiting: only one can take
//! the key, and waking them all would send one doomed attempt each. A
//! woken waiter that gives up before its attempt is answered passes the
//! wake-up on. Holder watches hear every change (deletes and puts). When
//! the watch breaks (the member went away, etcd cancelled it), every
//! notice resolves, so its waiter looks again, and the next notice opens
//! a new watch.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use etcd_client::{Client, EventType, WatchOptions};
use tokio::sync::{Notify, watch};
use tokio::task::AbortHandle;
use tokio::time::timeout;

use crate::backend::ReleaseNotice;

/// The shared watches of one backend.
pub(super) struct Watches {
    shared: Arc<Shared>,
}

struct Shared {
    client: Client,
    response_timeout: Duration,
    keys: Mutex<HashMap<String, Arc<Slot>>>,
}

/// One lock key's place: the live watch, if any.
#[derive(Default)]
struct Slot {
    /// Held while a watch is being created, so one is created at a time.
    creating: tokio::sync::Mutex<()>,
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    /// Notices alive (waiters and holder watches).
    users: usize,
    /// The watch, while it runs and has not broken.
    live: Option<Live>,
    /// Waiters in the order they subscribed; a delete wakes the first.
    queue: VecDeque<Arc<Ticket>>,
}

struct Live {
    /// Bumped on every event: wakes every holder watch.
    changed: watch::Sender<u64>,
    /// Set once the watch broke: wakes everyone.
    broken: watch::Sender<bool>,
    task: AbortHandle,
}

impl Drop for Live {
    fn drop(&mut self) {
        // Dropping the stream (with the task) cancels the watch.
        self.task.abort();
    }
}

/// One waiter's place in its key's queue.
#[derive(Default)]
struct Ticket {
    notify: Notify,
    /// Taken off the queue by a delete.
    woken: AtomicBool,
    /// The waiter's notice resolved (it goes on to try the key).
    heard: AtomicBool,
}

impl SlotState {
    /// Wakes the longest-waiting waiter, if any.
    fn wake_one(&mut self) {
        if let Some(ticket) = self.queue.pop_front() {
            ticket.woken.store(true, Ordering::SeqCst);
            ticket.notify.notify_one();
        }
    }
}

impl Slot {
    fn state(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A notice's registration: dropped with the notice (or on an error
/// before it was made), it gives its place back.
struct Interest {
    shared: Weak<Shared>,
    name: String,
    slot: Arc<Slot>,
    ticket: Option<Arc<Ticket>>,
}

impl Drop for Interest {
    fn drop(&mut self) {
        let idle = {
            let mut state = self.slot.state();
            if let Some(ticket) = &self.ticket {
                let before = state.queue.len();
                state.queue.retain(|t| !Arc::ptr_eq(t, ticket));
                // Woken but gone without trying: the wake-up is not lost.
                if state.queue.len() == before
                    && ticket.woken.load(Ordering::SeqCst)
                    && !ticket.heard.load(Ordering::SeqCst)
                {
                    state.wake_one();
                }
            }
            state.users -= 1;
            if state.users == 0 {
                state.live = None;
                true
            } else {
                false
            }
        };
        if idle && let Some(shared) = self.shared.upgrade() {
            let mut keys = shared.keys();
            if keys
                .get(&self.name)
                .is_some_and(|slot| Arc::ptr_eq(slot, &self.slot) && slot.state().users == 0)
            {
                keys.remove(&self.name);
            }
        }
    }
}

impl Watches {
    pub(super) fn new(client: Client, response_timeout: Duration) -> Self {
        Self {
            shared: Arc::new(Shared {
                client,
                response_timeout,
                keys: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// A waiter's notice for the release of the lock named `name`: one
    /// wake-up per delete for the process, passed on if dropped unused.
    pub(super) async fn release(&self, name: &str) -> Result<ReleaseNotice, String> {
        let ticket = Arc::new(Ticket::default());
        let (interest, mut broken, _) = self.register(name, Some(&ticket)).await?;
        let wait = {
            let ticket = Arc::clone(&ticket);
            async move {
                let _interest = interest;
                tokio::select! {
                    _ = broken.wait_for(|broken| *broken) => {}
                    () = ticket.notify.notified() => {}
                }
                ticket.heard.store(true, Ordering::SeqCst);
            }
        };
        // Heard, but given up before the attempt it led to was answered:
        // the next waiter of this process gets the wake-up instead.
        let shared = Arc::downgrade(&self.shared);
        let name = name.to_owned();
        Ok(ReleaseNotice::passing_on(wait, move || {
            if let Some(shared) = shared.upgrade()
                && let Some(slot) = shared.keys().get(&name)
            {
                slot.state().wake_one();
            }
        }))
    }

    /// A holder watch's notice: resolves on the next change of the lock
    /// named `name` (a release or an acquisition).
    pub(super) async fn change(&self, name: &str) -> Result<ReleaseNotice, String> {
        let (interest, mut broken, mut changed) = self.register(name, None).await?;
        Ok(ReleaseNotice::new(async move {
            let _interest = interest;
            tokio::select! {
                _ = broken.wait_for(|broken| *broken) => {}
                _ = changed.changed() => {}
            }
        }))
    }

    /// How many lock keys are watched now (for tests).
    pub(super) fn watched_keys(&self) -> usize {
        self.shared
            .keys()
            .values()
            .filter(|slot| slot.state().live.is_some())
            .count()
    }

    async fn register(
        &self,
        name: &str,
        ticket: Option<&Arc<Ticket>>,
    ) -> Result<(Interest, watch::Receiver<bool>, watch::Receiver<u64>), String> {
        let slot = {
            let mut keys = self.shared.keys();
            let slot = Arc::clone(keys.entry(name.to_owned()).or_default());
            slot.state().users += 1;
            slot
        };
        let interest = Interest {
            shared: Arc::downgrade(&self.shared),
            name: name.to_owned(),
            slot: Arc::clone(&slot),
            ticket: None,
        };
        // From here on, dropping `interest` (on an error, or with the
        // notice) gives the registration back.
        let _creating = slot.creating.lock().await;
        let running = slot.state().live.as_ref().map(|live| {
            (
                live.broken.subscribe(),
                live.changed.subscribe(),
                *live.broken.borrow(),
            )
        });
        let (broken, changed) = match running {
            Some((broken, changed, false)) => (broken, changed),
            _ => self.start(name, &slot).await?,
        };
        let mut interest = interest;
        if let Some(ticket) = ticket {
            slot.state().queue.push_back(Arc::clone(ticket));
            interest.ticket = Some(Arc::clone(ticket));
        }
        Ok((interest, broken, changed))
    }

    /// Creates the watch of `name` and waits for etcd to confirm it.
    async fn start(
        &self,
        name: &str,
        slot: &Arc<Slot>,
    ) -> Result<(watch::Receiver<bool>, watch::Receiver<u64>), String> {
        let limit = self.shared.response_timeout;
        let mut client = self.shared.client.watch_client();
        let created = timeout(limit, async {
            let mut stream = client
                .watch(name, Some(WatchOptions::new()))
                .await
                .map_err(|err| err.to_string())?;
            match stream.message().await {
                Ok(Some(answer)) if answer.created() && !answer.canceled() => Ok(stream),
                Ok(Some(answer)) => Err(format!(
                    "etcd did not create the watch: {}",
                    answer.cancel_reason()
                )),
                Ok(None) => Err("the watch stream ended before etcd created the watch".into()),
                Err(err) => Err(err.to_string()),
            }
        })
        .await;
        let mut stream = match created {
            Ok(created) => created?,
            Err(_) => return Err(format!("etcd did not create a watch within {limit:?}")),
        };
        let (changed, changed_rx) = watch::channel(0_u64);
        let (broken, broken_rx) = watch::channel(false);
        let weak = Arc::downgrade(slot);
        let task = tokio::spawn(async move {
            loop {
                let answer = match stream.message().await {
                    Ok(Some(answer)) if !answer.canceled() => answer,
                    // Ended, cancelled (compacted, the member left) or
                    // broken: every notice resolves, its waiter looks
                    // again, and the next notice opens a new watch.
                    _ => break,
                };
                let Some(slot) = weak.upgrade() else { return };
                let mut state = slot.state();
                for event in answer.events() {
                    if event.event_type() == EventType::Delete {
                        state.wake_one();
                    }
                }
                if let Some(live) = &state.live
                    && !answer.events().is_empty()
                {
                    live.changed.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
            if let Some(slot) = weak.upgrade()
                && let Some(live) = &slot.state().live
            {
                live.broken.send_replace(true);
            }
            // Keeps the watch's client alive while the stream runs.
            drop(client);
        });
        slot.state().live = Some(Live {
            changed,
            broken,
            task: task.abort_handle(),
        });
        Ok((broken_rx, changed_rx))
    }
}

impl Shared {
    fn keys(&self) -> MutexGuard<'_, HashMap<String, Arc<Slot>>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

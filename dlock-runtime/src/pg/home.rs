//! Where the backend's own work runs.
//!
//! A session advisory lock never expires by itself: whatever the backend
//! still has to do for a lock — give back one granted to a caller that gave
//! up, finish an unlock, enforce a ttl, check a session's liveness, probe a
//! key for waiters, drive a connection — must run on a runtime that outlives
//! the caller that started it. A backend made on the main runtime may well
//! be used from a short-lived one (`block_on` in a blocking library, a
//! runtime per request), which takes every task of its own with it when it
//! shuts down.
//!
//! So the backend has a *home*: the runtime it was connected on. Its
//! connections are opened and driven there, and its background work is
//! spawned there; a caller on another runtime has its acquisition or
//! release run there too (one task and a channel, the price of not being
//! home), so that giving up half-way leaves the rest to a runtime that
//! goes on. Should the home runtime itself shut down, every connection
//! opened there closes with it (the server frees their locks, and their
//! leases are told), and the next caller's runtime becomes the new home.
//!
//! The alternative, a thread of the backend's own with a runtime on it,
//! never shuts down under the backend, but then every acquisition and
//! release is a task on that thread and every statement crosses threads
//! twice. Measured with the `pg_overhead` example (64 tasks, two cores
//! shared with the server), it took the client's CPU per cycle from about
//! 17-22 µs to 28-44 µs and the throughput from 0.82-0.97 of the raw
//! protocol's to 0.65-0.72; a home on the caller's runtime costs callers
//! on it nothing measurable.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::runtime::{Handle, Id};
use tokio::sync::oneshot;

use crate::backend::kit::detach::{AbandonedWith, Detachable, Spawn};

/// The runtime the backend's work runs on; see the module docs.
pub(super) struct Home {
    current: Mutex<Runtime>,
}

struct Runtime {
    handle: Handle,
    id: Id,
    /// Cleared when the runtime shuts down.
    alive: Arc<AtomicBool>,
    /// Dropped with the home, which ends the watching task.
    _stop: oneshot::Sender<()>,
}

impl Runtime {
    /// `handle`'s runtime, watched by a task that waits for the home to go:
    /// the runtime drops the task if it shuts down first, which clears
    /// `alive`.
    fn watch(handle: Handle) -> Self {
        let alive = Arc::new(AtomicBool::new(true));
        let cleared_on_drop = ClearOnDrop(Arc::clone(&alive));
        let (stop, stopped) = oneshot::channel::<()>();
        handle.spawn(async move {
            let _cleared_on_drop = cleared_on_drop;
            let _ = stopped.await;
        });
        Self {
            id: handle.id(),
            handle,
            alive,
            _stop: stop,
        }
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }
}

struct ClearOnDrop(Arc<AtomicBool>);

impl Drop for ClearOnDrop {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The home runtime had shut down and no other was there to take over, or
/// it shut down while the work ran.
#[derive(Debug)]
pub(super) struct NoRuntime;

impl Home {
    /// The current runtime as home, if there is one.
    pub(super) fn here() -> Option<Self> {
        let handle = Handle::try_current().ok()?;
        Some(Self {
            current: Mutex::new(Runtime::watch(handle)),
        })
    }

    fn current(&self) -> MutexGuard<'_, Runtime> {
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// True when the caller runs on the home runtime (and it lives).
    pub(super) fn is_here(&self) -> bool {
        let Ok(here) = Handle::try_current() else {
            return false;
        };
        let home = self.current();
        home.id == here.id() && home.is_alive()
    }

    /// The home runtime's handle. If it has shut down, the caller's runtime
    /// becomes home; `None` when there is none.
    pub(super) fn handle(&self) -> Option<Handle> {
        let mut home = self.current();
        if !home.is_alive() {
            // Not the fallback runtime: it only finishes what callers left
            // behind, and the sessions of a home that shut down are closed,
            // with their locks, already.
            if crate::backend::kit::on_fallback_runtime() {
                return None;
            }
            let here = Handle::try_current().ok()?;
            *home = Runtime::watch(here);
            tracing::debug!(
                "the PostgreSQL backend's runtime shut down; it runs on the caller's now"
            );
        }
        Some(home.handle.clone())
    }

    /// Spawns `work` at home. False when there is no runtime to run it (it
    /// is dropped: work spawned here cleans up after itself when dropped).
    pub(super) fn spawn(&self, work: impl Future<Output = ()> + Send + 'static) -> bool {
        match self.handle() {
            Some(handle) => {
                handle.spawn(work);
                true
            }
            None => false,
        }
    }

    /// Runs `work` to its end at home: in the caller's task if it is home,
    /// else in a task there, whose output it waits for.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> Result<T, NoRuntime> {
        if self.is_here() {
            return Ok(work.await);
        }
        let (send, receive) = oneshot::channel();
        if !self.spawn(async move {
            let _ = send.send(work.await);
        }) {
            return Err(NoRuntime);
        }
        receive.await.map_err(|_| NoRuntime)
    }

    /// Runs `work` at home, like [`run`](Self::run), and if the caller
    /// stops waiting, the rest of it carries on there and its output goes
    /// to `abandoned`. At home it runs in the caller's task and is moved to
    /// a task of its own only if the caller gives up (see
    /// [`Detachable`]).
    pub(super) async fn run_detachable<F, A>(
        self: &Arc<Self>,
        work: F,
        abandoned: A,
    ) -> Result<F::Output, NoRuntime>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
        A: AbandonedWith<F::Output>,
    {
        if self.is_here() {
            return Ok(Detachable::spawned_by(work, abandoned, AtHome(Arc::clone(self))).await);
        }
        let (send, receive) = oneshot::channel();
        if !self.spawn(async move {
            let output = work.await;
            if let Err(output) = send.send(output) {
                abandoned.handle(output).await;
            }
        }) {
            return Err(NoRuntime);
        }
        receive.await.map_err(|_| NoRuntime)
    }
}

/// Spawns the rest of abandoned work at home.
struct AtHome(Arc<Home>);

impl Spawn for AtHome {
    /// `unfinished` is dropped: work at home is dropped unfinished only when
    /// the home runtime shuts down, which closes every session opened there
    /// and the locks they held with them (see `locks::Unfinished`).
    fn spawn(
        self,
        work: impl Future<Output = ()> + Send + 'static,
        _unfinished: impl Future<Output = ()> + Send + 'static,
    ) {
        self.0.spawn(work);
    }
}

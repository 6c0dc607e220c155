//! The fallback runtime: where work that must happen after its caller is
//! gone (a release on drop, giving back an abandoned acquisition) runs when
//! the runtime it was spawned on shuts down, or when there is no runtime.
//!
//! Such work is spawned on the caller's runtime, which costs nothing extra
//! while that runtime lives, together with a way to start it over from
//! scratch: what it needs (the backend, the key, the owner), never the
//! half-polled future. A runtime that shuts down drops its tasks, unpolled
//! or half-way, and spawning on one that is shutting down drops the task at
//! once; either way the guard around the work hands the fresh start to one
//! process-wide thread, started on first use, that runs a current-thread
//! runtime of its own. Work there is bounded by [`LIMIT`].
//!
//! Nothing here blocks: handing work over is a send on an unbounded
//! channel, so a `Drop` and `Runtime::drop` never wait for it. The thread
//! is never joined and does not keep the process alive: a process that
//! exits right after its runtime shut down may still leave its keys to
//! their ttl (or, for PostgreSQL, to the server seeing its sessions close).

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::mpsc;

/// The longest a piece of work runs on the fallback runtime: a store that
/// cannot be reached from there (a connection that cannot be reopened) must
/// not pile work up for the rest of the process's life.
const LIMIT: Duration = Duration::from_secs(10);

/// Work for the fallback runtime, boxed: also the type of work that hands
/// itself over for another try ([`try_again`]), which must be named.
pub(crate) type Work = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The fallback thread's queue (`None` if the thread could not be
/// started), with the process it was started in, counted in forks: a
/// forked child inherits the queue but not the thread, and starts its own.
static FALLBACK: Mutex<Option<(u64, Option<mpsc::UnboundedSender<Work>>)>> = Mutex::new(None);

/// The fallback thread's queue in this process, started on first use.
fn queue() -> Option<mpsc::UnboundedSender<Work>> {
    let forks = crate::backend::forks();
    let mut fallback = FALLBACK.lock().unwrap_or_else(PoisonError::into_inner);
    match &*fallback {
        Some((started_in, queue)) if *started_in == forks => queue.clone(),
        _ => {
            let queue = start();
            // A queue inherited through fork() is forgotten, not dropped:
            // dropping it would wake the parent's fallback task through a
            // copy of the parent's runtime, whose locks a parent thread
            // may have held at the fork, and hang this child.
            if let Some(inherited) = fallback.replace((forks, queue.clone())) {
                std::mem::forget(inherited);
            }
            queue
        }
    }
}

thread_local! {
    /// Set on the fallback thread, the one thread its runtime runs on.
    static ON_FALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// Spawns `work` on the current runtime. If that runtime drops it before it
/// finished (it shut down), `unfinished` runs on the fallback runtime
/// instead; it starts the work over, so it must be safe to run after part
/// of `work` (owner-checked releases are). With no runtime at all, `work`
/// itself runs on the fallback runtime.
pub(crate) fn spawn(
    work: impl Future<Output = ()> + Send + 'static,
    unfinished: impl Future<Output = ()> + Send + 'static,
) {
    let Ok(runtime) = Handle::try_current() else {
        run(work);
        return;
    };
    let guard = Unfinished(Some(unfinished));
    runtime.spawn(async move {
        work.await;
        guard.finished();
    });
}

/// Runs `work` on the fallback runtime, within [`LIMIT`].
pub(crate) fn run(work: impl Future<Output = ()> + Send + 'static) {
    let Some(queue) = queue() else {
        return;
    };
    let _ = queue.send(Box::pin(async move {
        if tokio::time::timeout(LIMIT, work).await.is_err() {
            tracing::warn!(
                limit_s = LIMIT.as_secs(),
                "a release handed to dlock's fallback runtime did not finish in time; \
                 the ttl will free its key"
            );
        }
    }));
}

/// Gives work that failed one more try on the fallback runtime, unless it
/// ran there already: false then, and the caller reports the failure. A
/// release can fail because the runtime it ran on is shutting down under it
/// (its connection or its blocking threads gone), which it cannot tell
/// from other failures; an owner-checked release tried twice is harmless.
pub(crate) fn try_again(work: impl Future<Output = ()> + Send + 'static) -> bool {
    if is_current() {
        return false;
    }
    run(work);
    true
}

/// True on the fallback runtime.
pub(crate) fn is_current() -> bool {
    ON_FALLBACK.get()
}

/// Hands the work it holds to the fallback runtime when dropped with it.
struct Unfinished<U: Future<Output = ()> + Send + 'static>(Option<U>);

impl<U: Future<Output = ()> + Send + 'static> Unfinished<U> {
    /// The work got to its end: nothing to hand over.
    fn finished(mut self) {
        self.0 = None;
    }
}

impl<U: Future<Output = ()> + Send + 'static> Drop for Unfinished<U> {
    fn drop(&mut self) {
        if let Some(unfinished) = self.0.take() {
            tracing::debug!(
                "a runtime shut down before work left to it was done; \
                 finishing it on dlock's fallback runtime"
            );
            run(unfinished);
        }
    }
}

/// Starts the fallback thread, which makes its runtime itself: a runtime
/// must not be dropped where blocking is not allowed, as it would be here
/// should the thread not start. Each piece of work is a task of its own
/// there, so one that waits does not hold up the others.
fn start() -> Option<mpsc::UnboundedSender<Work>> {
    let (queue, mut work) = mpsc::unbounded_channel::<Work>();
    let started = std::thread::Builder::new()
        .name("dlock-fallback".into())
        .spawn(move || {
            ON_FALLBACK.set(true);
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(err) => {
                    tracing::warn!(
                        error = %err,
                        "cannot start dlock's fallback runtime; releases left behind by a \
                         runtime that shuts down will wait for the ttl"
                    );
                    return;
                }
            };
            runtime.block_on(async move {
                while let Some(work) = work.recv().await {
                    tokio::spawn(work);
                }
            });
        });
    match started {
        Ok(_) => Some(queue),
        Err(err) => {
            tracing::warn!(
                error = %err,
                "cannot start dlock's fallback thread; releases left behind by a runtime \
                 that shuts down will wait for the ttl"
            );
            None
        }
    }
}

//! Work that must finish even if its caller stops waiting: a lock the
//! server granted to a caller that gave up must be given back, and an
//! unlock half-way must not leave its key marked as releasing for ever.
//! Should the runtime the rest runs on shut down too, it is started over on
//! dlock's fallback runtime (see [`on_fallback_runtime`](super::on_fallback_runtime)).
//!
//! A caller gives up by dropping the future: a timeout around
//! `try_acquire`, a `select!` that another branch won, a cancelled task.
//! Wrap the round trip that cannot be taken back in a [`Detachable`], and
//! say with an [`AbandonedWith`] what to do with its answer if nobody is
//! there to read it.
//!
//! ```
//! use std::time::Duration;
//!
//! use dlock_runtime::backend::kit::detach::{AbandonedWith, Detachable};
//!
//! /// Gives back a lock the store granted after its caller gave up.
//! struct GiveBack;
//!
//! impl AbandonedWith<Option<u64>> for GiveBack {
//!     async fn handle(self, granted: Option<u64>) {
//!         if let Some(token) = granted {
//!             // Here a backend releases the lock it took under `token`.
//!             println!("giving back the lock granted with token {token}");
//!         }
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // The round trip that takes the lock: once sent, the store may grant it
//! // whether or not the caller is still there to hear.
//! let (store, answer) = tokio::sync::oneshot::channel::<u64>();
//! let round_trip = async move { answer.await.ok() };
//! // The caller gives up after 10 ms, before the store answers; the round
//! // trip goes on in a task of its own.
//! let gave_up = tokio::time::timeout(
//!     Duration::from_millis(10),
//!     Detachable::new(round_trip, GiveBack),
//! )
//! .await;
//! assert!(gave_up.is_err());
//! // The store grants the lock after all: `GiveBack` hands it back.
//! store.send(7).expect("the detached round trip still waits for its answer");
//! # tokio::time::sleep(Duration::from_millis(100)).await;
//! # }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Runs `work` in the caller's task. If the caller drops it before it
/// finished, the rest of `work` runs in a task of its own, spawned by `S`
/// (on the current runtime unless said otherwise), and its output goes to
/// `abandoned`; if that task is dropped unfinished as well (its runtime
/// shut down), `abandoned` says what to do instead. Unlike spawning the
/// work up front, the common case (nobody gives up) costs no task, no
/// wake-up of another worker and no channel.
pub struct Detachable<F, A, S = CurrentRuntime>
where
    F: Future + Send + 'static,
    F::Output: Send,
    A: AbandonedWith<F::Output>,
    S: Spawn,
{
    work: Option<Pin<Box<F>>>,
    abandoned: Option<A>,
    spawner: Option<S>,
}

/// Where the rest of abandoned work runs: [`CurrentRuntime`] unless said
/// otherwise. A backend whose work must run on a runtime of its choosing (the
/// one its connections were opened on, say) implements it and builds its
/// work with [`Detachable::spawned_by`].
pub trait Spawn: Send + Unpin + 'static {
    /// Spawns `work`, and should it be dropped unfinished, runs
    /// `unfinished` instead where it can (or drops it, if the work cleans up
    /// after itself when dropped).
    fn spawn(
        self,
        work: impl Future<Output = ()> + Send + 'static,
        unfinished: impl Future<Output = ()> + Send + 'static,
    );
}

/// The runtime the work is abandoned on, and dlock's fallback runtime
/// should that one shut down before the work is done (see
/// [`on_fallback_runtime`](super::on_fallback_runtime)).
pub struct CurrentRuntime;

impl Spawn for CurrentRuntime {
    fn spawn(
        self,
        work: impl Future<Output = ()> + Send + 'static,
        unfinished: impl Future<Output = ()> + Send + 'static,
    ) {
        crate::fallback::spawn(work, unfinished);
    }
}

/// What to do with the output of work whose caller gave up.
pub trait AbandonedWith<T>: Send + Unpin + 'static {
    /// Handles the output; runs in the task that finished the work.
    fn handle(self, output: T) -> impl Future<Output = ()> + Send;

    /// What to do if the work never finishes (the runtime running it shut
    /// down half-way): made before the work is handed over, run only if it
    /// is dropped unfinished. Nothing, unless said otherwise.
    fn unfinished(&self) -> impl Future<Output = ()> + Send + 'static {
        async {}
    }
}

impl<F, A> Detachable<F, A>
where
    F: Future + Send + 'static,
    F::Output: Send,
    A: AbandonedWith<F::Output>,
{
    /// `work`, run in the caller's task; should the caller drop it
    /// unfinished, the rest runs on the current runtime (or the fallback
    /// runtime) and its output goes to `abandoned`.
    pub fn new(work: F, abandoned: A) -> Self {
        Self::spawned_by(work, abandoned, CurrentRuntime)
    }
}

impl<F, A, S> Detachable<F, A, S>
where
    F: Future + Send + 'static,
    F::Output: Send,
    A: AbandonedWith<F::Output>,
    S: Spawn,
{
    /// As [`new`](Detachable::new), with the rest spawned by `spawner`.
    pub fn spawned_by(work: F, abandoned: A, spawner: S) -> Self {
        Self {
            work: Some(Box::pin(work)),
            abandoned: Some(abandoned),
            spawner: Some(spawner),
        }
    }
}

impl<F, A, S> Future for Detachable<F, A, S>
where
    F: Future + Send + 'static,
    F::Output: Send,
    A: AbandonedWith<F::Output>,
    S: Spawn,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let Some(work) = this.work.as_mut() else {
            panic!("Detachable polled after it finished");
        };
        let output = std::task::ready!(work.as_mut().poll(cx));
        this.work = None;
        Poll::Ready(output)
    }
}

impl<F, A, S> Drop for Detachable<F, A, S>
where
    F: Future + Send + 'static,
    F::Output: Send,
    A: AbandonedWith<F::Output>,
    S: Spawn,
{
    fn drop(&mut self) {
        let (Some(work), Some(abandoned), Some(spawner)) =
            (self.work.take(), self.abandoned.take(), self.spawner.take())
        else {
            return;
        };
        let unfinished = abandoned.unfinished();
        spawner.spawn(
            async move {
                let output = work.await;
                abandoned.handle(output).await;
            },
            unfinished,
        );
    }
}

/// Nothing more to do: the work cleans up after itself (its output, if
/// any, holds nothing that must be given back).
pub struct Ignore;

impl<T: Send + 'static> AbandonedWith<T> for Ignore {
    #[allow(clippy::manual_async_fn)]
    fn handle(self, _output: T) -> impl Future<Output = ()> + Send {
        async {}
    }
}

//! Work that must finish even if its caller stops waiting: a lock the
//! server granted to a caller that gave up must be given back, and an
//! unlock half-way must not leave its key marked as releasing for ever.
//! Should the runtime the rest runs on shut down too, it is started over on
//! the [fallback runtime](crate::fallback).

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
pub(crate) struct Detachable<F, A, S = CurrentRuntime>
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

/// Where the rest of abandoned work runs.
pub(crate) trait Spawn: Send + Unpin + 'static {
    /// Spawns `work`, and should it be dropped unfinished, runs
    /// `unfinished` instead where it can (or drops it, if the work cleans up
    /// after itself when dropped).
    fn spawn(
        self,
        work: impl Future<Output = ()> + Send + 'static,
        unfinished: impl Future<Output = ()> + Send + 'static,
    );
}

/// The runtime the work is abandoned on, and the fallback runtime should
/// that one shut down before the work is done (see [`crate::fallback`]).
pub(crate) struct CurrentRuntime;

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
pub(crate) trait AbandonedWith<T>: Send + Unpin + 'static {
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
    pub(crate) fn new(work: F, abandoned: A) -> Self {
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
    pub(crate) fn spawned_by(work: F, abandoned: A, spawner: S) -> Self {
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

/// Nothing more to do: the work cleans up after itself.
#[cfg(feature = "pg")]
pub(crate) struct Ignore;

#[cfg(feature = "pg")]
impl<T: Send + 'static> AbandonedWith<T> for Ignore {
    #[allow(clippy::manual_async_fn)]
    fn handle(self, _output: T) -> impl Future<Output = ()> + Send {
        async {}
    }
}

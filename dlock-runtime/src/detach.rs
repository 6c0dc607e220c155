//! Work that must finish even if its caller stops waiting: a lock the
//! server granted to a caller that gave up must be given back, and an
//! unlock half-way must not leave its key marked as releasing for ever.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::runtime::Handle;

/// Runs `work` in the caller's task. If the caller drops it before it
/// finished, the rest of `work` runs in a task of its own and its output
/// goes to `abandoned`. Unlike spawning the work up front, the common case
/// (nobody gives up) costs no task, no wake-up of another worker and no
/// channel.
pub(crate) struct Detachable<F, A>
where
    F: Future + Send + 'static,
    F::Output: Send,
    A: AbandonedWith<F::Output>,
{
    work: Option<Pin<Box<F>>>,
    abandoned: Option<A>,
}

/// What to do with the output of work whose caller gave up.
pub(crate) trait AbandonedWith<T>: Send + Unpin + 'static {
    /// Handles the output; runs in the task that finished the work.
    fn handle(self, output: T) -> impl Future<Output = ()> + Send;
}

impl<F, A> Detachable<F, A>
where
    F: Future + Send + 'static,
    F::Output: Send,
    A: AbandonedWith<F::Output>,
{
    pub(crate) fn new(work: F, abandoned: A) -> Self {
        Self {
            work: Some(Box::pin(work)),
            abandoned: Some(abandoned),
        }
    }
}

impl<F, A> Future for Detachable<F, A>
where
    F: Future + Send + 'static,
    F::Output: Send,
    A: AbandonedWith<F::Output>,
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

impl<F, A> Drop for Detachable<F, A>
where
    F: Future + Send + 'static,
    F::Output: Send,
    A: AbandonedWith<F::Output>,
{
    fn drop(&mut self) {
        let (Some(work), Some(abandoned)) = (self.work.take(), self.abandoned.take()) else {
            return;
        };
        // With no runtime left the process is going away, and the server
        // drops the session's locks with its connection.
        if let Ok(runtime) = Handle::try_current() {
            runtime.spawn(async move {
                let output = work.await;
                abandoned.handle(output).await;
            });
        }
    }
}

/// Nothing more to do: the work cleans up after itself.
pub(crate) struct Ignore;

impl<T: Send + 'static> AbandonedWith<T> for Ignore {
    #[allow(clippy::manual_async_fn)]
    fn handle(self, _output: T) -> impl Future<Output = ()> + Send {
        async {}
    }
}

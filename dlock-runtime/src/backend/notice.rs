//! [`ReleaseNotice`]: how a waiter hears that a key may have been released.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// A future that resolves when a key *may* have been released: a hint to
/// try again, never a promise that the key is free.
///
/// A backend that wakes only some of its waiters on a release (one, say, as
/// only one can take the key) makes the notice with
/// [`ReleaseNotice::passing_on`]: should the woken waiter give up before its
/// next attempt is answered (its deadline passes, it is cancelled, the
/// attempt fails), dropping the notice passes the wake-up on, so a release
/// is never swallowed. The core calls [`ReleaseNotice::answered`] once the
/// attempt that followed the wake-up got an answer.
#[must_use = "a notice only tells of a release while it is awaited"]
pub struct ReleaseNotice {
    wait: Pin<Box<dyn Future<Output = ()> + Send + 'static>>,
    woken: bool,
    pass_on: Option<Box<dyn FnOnce() + Send + 'static>>,
    recheck: Option<Duration>,
    queued_behind: Option<Box<dyn Fn() -> bool + Send + 'static>>,
}

impl ReleaseNotice {
    /// A notice that resolves when `wait` does; for backends that wake
    /// every waiter on a release.
    pub fn new(wait: impl Future<Output = ()> + Send + 'static) -> Self {
        Self {
            wait: Box::pin(wait),
            woken: false,
            pass_on: None,
            recheck: None,
            queued_behind: None,
        }
    }

    /// A notice that resolves when `wait` does and, if it is dropped after
    /// it resolved but before [`ReleaseNotice::answered`], calls `pass_on`
    /// to wake another waiter in its place.
    pub fn passing_on(
        wait: impl Future<Output = ()> + Send + 'static,
        pass_on: impl FnOnce() + Send + 'static,
    ) -> Self {
        Self {
            wait: Box::pin(wait),
            woken: false,
            pass_on: Some(Box::new(pass_on)),
            recheck: None,
            queued_behind: None,
        }
    }

    /// For a notice that may miss a release (it could not watch the key,
    /// its link is degraded): the waiter looks again within `every` even if
    /// the notice has not resolved. Without it, a notice promises to resolve
    /// after every release, and the waiter only keeps a long safety net.
    pub fn recheck_within(mut self, every: Duration) -> Self {
        self.recheck = Some(every);
        self
    }

    /// For a backend that wakes its waiters one at a time in the order
    /// they subscribed: `behind` tells whether this notice is still queued
    /// behind another waiter of the process, one that a release wakes
    /// first ([`crate::backend::Look::Subscribed`]).
    pub fn queued_by(mut self, behind: impl Fn() -> bool + Send + 'static) -> Self {
        self.queued_behind = Some(Box::new(behind));
        self
    }

    /// Whether this notice, unresolved, is queued behind another waiter of
    /// the process that a release wakes first. `false` for a notice that
    /// keeps no such order, and once it has resolved.
    pub fn is_queued_behind(&self) -> bool {
        !self.woken && self.queued_behind.as_ref().is_some_and(|behind| behind())
    }

    /// How soon the waiter must look again on its own, if the notice may
    /// miss a release.
    pub fn recheck(&self) -> Option<Duration> {
        self.recheck
    }

    /// True once the notice has resolved.
    pub fn is_woken(&self) -> bool {
        self.woken
    }

    /// The waiter it woke has made its next attempt and got an answer
    /// (acquired, or held by someone else): the wake-up served its purpose
    /// and is not passed on.
    pub fn answered(mut self) {
        self.pass_on = None;
    }
}

impl Future for ReleaseNotice {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        if self.woken {
            return std::task::Poll::Ready(());
        }
        std::task::ready!(self.wait.as_mut().poll(cx));
        self.woken = true;
        std::task::Poll::Ready(())
    }
}

impl Drop for ReleaseNotice {
    fn drop(&mut self) {
        if self.woken
            && let Some(pass_on) = self.pass_on.take()
        {
            pass_on();
        }
    }
}

impl fmt::Debug for ReleaseNotice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleaseNotice")
            .field("woken", &self.woken)
            .field("passes_on", &self.pass_on.is_some())
            .field("recheck", &self.recheck)
            .finish()
    }
}

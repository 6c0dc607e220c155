//! How a lease ends: the release a lease sends (awaited, or detached when
//! it is dropped), given back in the background if its caller gives up
//! half way, and the outcome it reports.

use super::*;

/// Ends the lease on the backend: releases it, or, while a minimum hold is
/// still running, shortens it to `keep_for` and releases it when that is
/// over (which lets backends whose locks do not expire by themselves, and
/// those that keep per-lease resources, let go).
///
/// `span` is the hold's, closed by the caller once this is done.
pub(super) async fn finish(
    shared: &Arc<Shared>,
    keep_for: Duration,
    span: &Span,
) -> Result<ReleaseOutcome, LockError> {
    let outcome = if keep_for.is_zero() {
        shared.backend.release(&shared.release_request()).await
    } else {
        let kept = shared.backend.extend(&shared.renewal(keep_for)).await;
        // Should this runtime shut down before the hold is over, the key's
        // ttl, just cut to the hold, frees it at the same moment.
        if matches!(kept, Ok(true))
            && let Ok(runtime) = Handle::try_current()
        {
            let shared = Arc::clone(shared);
            runtime.spawn(async move {
                tokio::time::sleep(keep_for).await;
                // Owner-checked: a no-op if the key expired and moved on.
                let _ = shared.backend.release(&shared.release_request()).await;
            });
        }
        kept.map(ReleaseOutcome::from_released)
    };
    span.in_scope(|| {
        tracing::debug!(
            key = %shared.key,
            backend = shared.backend.kind(),
            token = %shared.token,
            kept_for_ms = keep_for.as_millis() as u64,
            outcome = ?outcome.as_ref().ok(),
            "lease released"
        );
    });
    outcome
}

/// [`finish`], carried on in the background if the caller stops waiting:
/// a release abandoned half-way must not leave the key held for its ttl.
pub(super) fn finish_detached(
    shared: &Arc<Shared>,
    keep_for: Duration,
    now: Instant,
    span: &Span,
) -> impl Future<Output = Result<ReleaseOutcome, LockError>> + Send + 'static {
    let release = Release {
        shared: Arc::clone(shared),
        hold_until: now + keep_for,
        span: span.clone(),
    };
    let (shared, span) = (Arc::clone(shared), span.clone());
    Detachable::new(
        async move { finish(&shared, keep_for, &span).await },
        release,
    )
}

/// A lease's release that nobody waits for (a drop, a caller that gave up
/// on [`Lease::release`]), which can be started over: `finish` is
/// owner-checked, so running it again after part of it ran is harmless.
pub(super) struct Release {
    pub(super) shared: Arc<Shared>,
    /// Until when the minimum hold keeps the key.
    pub(super) hold_until: Instant,
    /// The hold's span, closed when the release is done.
    pub(super) span: Span,
}

impl Release {
    pub(super) fn run(self) -> Work {
        Box::pin(async move {
            let keep_for = self.hold_until.saturating_duration_since(Instant::now());
            if let Err(err) = finish(&self.shared, keep_for, &self.span).await {
                self.failed(err);
            }
        })
    }

    /// Tries once more on the fallback runtime, or says the ttl will do.
    fn failed(self, err: LockError) {
        let key = self.shared.key.clone();
        if fallback::try_again(self.run()) {
            tracing::debug!(
                key = %key,
                error = %err,
                "releasing in the background failed; trying again on dlock's fallback runtime"
            );
        } else {
            tracing::warn!(
                key = %key,
                error = %err,
                "releasing in the background failed; the ttl will free the key"
            );
        }
    }

    pub(super) fn again(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            hold_until: self.hold_until,
            span: self.span.clone(),
        }
    }
}

impl AbandonedWith<Result<ReleaseOutcome, LockError>> for Release {
    async fn handle(self, outcome: Result<ReleaseOutcome, LockError>) {
        if let Err(err) = outcome {
            self.failed(err);
        }
    }

    fn unfinished(&self) -> impl Future<Output = ()> + Send + 'static {
        self.again().run()
    }
}

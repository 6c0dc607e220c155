//! The attempt loop of a fair acquisition: a first try that respects the
//! queue, then the handoff notice and the queue entry kept alive until a
//! release hands the key over (rules F1 to F3 on `Backend`).

use super::*;

/// The attempt loop of a fair acquisition ([`Terms::fair`]): one
/// [`Queue::Respect`] try, which costs what a plain one does when nobody
/// holds or waits for the key; then the handoff notice, and a
/// [`Queue::Join`] attempt that queues this owner, repeated every third of
/// [`QUEUE_ENTRY_TTL`] to keep its entry alive (and to take the key as the
/// first live entry should its holder's lease run out rather than be
/// released). The release that hands the key over resolves the notice, and
/// the caller holds the key without another attempt.
///
/// Returns the grant and the instant its lease counts from: for a handoff,
/// the send of the latest attempt answered `Held`, since the handoff came
/// after it was answered.
///
/// However it ends without the key (deadline, failure, the caller dropping
/// the future), the owner leaves the queue through a release (rule F3),
/// which also passes on a handoff that arrived as it gave up.
pub(super) async fn take_fair(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    owner: &OwnerId,
    terms: &Terms,
    deadline: Instant,
    started: Instant,
) -> Result<(Grant, Instant), LockError> {
    if !backend.supports_fair() {
        return Err(LockError::InvalidOption {
            option: "fair",
            reason: format!(
                "the {} backend has no fair mode: it cannot queue waiters",
                backend.kind()
            ),
        });
    }
    let contended = |now: Instant| contended(key, terms, now - started);
    let may_retry = |err: &LockError| may_retry(terms, err);
    let kind = backend.kind();
    // Armed until the key is had: dropped armed (an error, the deadline,
    // the caller gone), it leaves the queue and gives back any handoff.
    let mut leave = LeaveQueue {
        give_back: Some((Arc::clone(backend), key.clone(), *owner)),
        notice: None,
    };
    debug_assert_eq!(
        terms.access,
        Access::Exclusive,
        "options refuse fair shared"
    );
    let mut failure: Option<LockError> = None;
    // The first try, unless waiters of this process are known to queue
    // on the key (it could only lose to them): then straight to the queue.
    if !backend.queued_here(key) {
        let first = attempt(backend, key, *owner, terms, Queue::Respect, Look::First);
        match by_deadline(kind, Operation::Acquire, key, terms, deadline, first).await {
            Ok(Attempt::Acquired(grant)) => {
                leave.disarm();
                return Ok((grant, started));
            }
            Ok(Attempt::Held { .. } | Attempt::Behind { .. }) => {}
            // Kept, so a deadline that passes before the store answers
            // again names the failure rather than a timeout.
            Err(err) if may_retry(&err) => failure = Some(err),
            Err(err) => return Err(err),
        }
    }
    let join = Queue::Join {
        entry_ttl: QUEUE_ENTRY_TTL,
    };
    let mut backoff = MIN_BACKOFF;
    let outcome = loop {
        let now = Instant::now();
        if now >= deadline {
            break Err(failure.unwrap_or_else(|| contended(now)));
        }
        if let Some(err) = &failure {
            tracing::warn!(key = %key, error = %err, "lock backend failed while queued; retrying");
            tokio::time::sleep(backoff.min(deadline - now)).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
        // Registered before the attempt that queues: a handoff right after
        // it reaches the notice.
        if leave.notice.is_none() {
            let subscribed = backend.subscribe_handoff(key, owner);
            match by_deadline(kind, Operation::Wait, key, terms, deadline, subscribed).await {
                Ok(notice) => leave.notice = Some(notice),
                Err(err) if may_retry(&err) => {
                    failure = Some(err);
                    continue;
                }
                Err(err) => break Err(err),
            }
        }
        // A handoff already here before the attempt (it came during a
        // backoff, or a failed attempt) is not dated by any answer: see
        // `confirm_handoff`.
        if let Some(grant) = leave.notice.as_mut().and_then(handed_over) {
            match confirm_handoff(backend, key, owner, terms, (grant, None), deadline).await {
                Some(taken) => break Ok(taken),
                None => {
                    leave.notice = None;
                    continue;
                }
            }
        }
        let sent = Instant::now();
        let joined = attempt(backend, key, *owner, terms, join, Look::Again);
        let expires_in =
            match by_deadline(kind, Operation::Acquire, key, terms, deadline, joined).await {
                Ok(Attempt::Acquired(grant)) => break Ok((grant, sent)),
                Ok(Attempt::Held { expires_in }) => expires_in,
                Ok(Attempt::Behind { expires_in }) => Some(expires_in),
                Err(err) if may_retry(&err) => {
                    failure = Some(err);
                    continue;
                }
                Err(err) => break Err(err),
            };
        failure = None;
        backoff = MIN_BACKOFF;
        let now = Instant::now();
        if now >= deadline {
            break Err(contended(now));
        }
        let nap = (QUEUE_ENTRY_TTL / 3).min(deadline - now);
        // Not past the holder's expiry: the key may be free by then.
        let nap = expires_in.map_or(nap, |expires_in| nap.min(expires_in + EXPIRY_SLACK));
        if let Some(handoff) = nap_for_handoff(leave.notice.as_mut(), nap, sent).await {
            let confirmed = confirm_handoff(backend, key, owner, terms, handoff, deadline).await;
            match confirmed {
                Some(taken) => break Ok(taken),
                // A resolved notice is spent: a handoff not confirmed (the
                // key was no longer this owner's) waits for the next one.
                None => leave.notice = None,
            }
        }
    };
    if outcome.is_ok() {
        leave.disarm();
    }
    outcome
}

/// Naps up to `nap` on `notice` for a handoff, after an attempt sent at
/// `sent` was answered `Held`: the grant, and the instant it counts from.
/// Only a handoff that comes during the nap is known to be later than the
/// attempt's send; one already here as the nap begins came while the
/// attempt was under way, maybe before the store saw it, so it is dated by
/// nothing (`None`, see [`confirm_handoff`]).
async fn nap_for_handoff(
    notice: Option<&mut Handoff>,
    nap: Duration,
    sent: Instant,
) -> Option<(Grant, Option<Instant>)> {
    let notice = notice?;
    if let Some(grant) = handed_over(notice) {
        return Some((grant, None));
    }
    timeout(nap, notice)
        .await
        .ok()
        .map(|grant| (grant, Some(sent)))
}

/// The grant of a handoff that has reached `notice` already, if one has.
fn handed_over(notice: &mut Handoff) -> Option<Grant> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::Pin::new(notice).poll(&mut cx) {
        std::task::Poll::Ready(grant) => Some(grant),
        std::task::Poll::Pending => None,
    }
}

/// Makes sure a handed-over lease is not returned already spent. Its
/// lifetime counts from `sent`, the send of the waiter's latest attempt
/// answered `Held` (the handoff came after it), which may lie up to a
/// third of [`QUEUE_ENTRY_TTL`] back: a lease with a short ttl would be
/// over, or nearly, when its caller got it, and lost at once though nobody
/// else could have the key. So when less than a third of its validity
/// ([`Grant::valid_for`], else the ttl) is left by that count, it is
/// extended here, once, to its ttl, counted from the extension's send; so
/// is one the store keeps for less than the ttl while it is not renewed in
/// the background ([`crate::LockOptions::renew`] off), so that it lasts
/// the ttl it asked for. A handed-over lease with time left is otherwise
/// renewed by the renewal scheduler a third of the way into its validity.
///
/// `None` when the extension finds the key no longer this owner's (the
/// handoff's short lease ran out first): the waiter waits on. Should the
/// extension fail, or not answer by the caller's `deadline` (as any call
/// of a waiting caller, [`by_deadline`]), the lease is returned as it
/// was, and its holder is told when it ends.
///
/// A handoff with no `sent` (`None`) is
/// *unsure*: it reached the waiter before it napped, during a backoff or
/// while an attempt was under way, so it may have been made before the
/// store saw the attempt and have run out since (a short ttl, a waiter
/// that was paused), another caller holding the key now; the attempt's
/// `Held` answer says nothing of when it came. It is always extended, and
/// an extension that fails returns `None` as well: the waiter's next
/// attempt finds the key its own if it is (rule 3).
pub(super) async fn confirm_handoff(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    owner: &OwnerId,
    terms: &Terms,
    (grant, sent): (Grant, Option<Instant>),
    deadline: Instant,
) -> Option<(Grant, Instant)> {
    let valid = grant
        .valid_for
        .map_or(terms.ttl, |valid| valid.min(terms.ttl));
    let spent = sent.is_none_or(|sent| {
        let left = (sent + valid).saturating_duration_since(Instant::now());
        left < valid / 3
    });
    let short = !terms.renew && valid < terms.ttl;
    if let Some(sent) = sent
        && !spent
        && !short
    {
        return Some((grant, sent));
    }
    let extended_at = Instant::now();
    let renewal = crate::backend::Renewal::new(key, owner, terms.ttl);
    let extended = backend.extend(&renewal);
    match by_deadline(
        backend.kind(),
        Operation::Extend,
        key,
        terms,
        deadline,
        extended,
    )
    .await
    {
        Ok(true) => Some((
            Grant {
                valid_for: None,
                ..grant
            },
            extended_at,
        )),
        Ok(false) => {
            tracing::debug!(key = %key, "a handed-over lease ran out before it was confirmed; waiting on");
            None
        }
        Err(err) => {
            tracing::debug!(key = %key, error = %err, "could not extend a handed-over lease");
            sent.map(|sent| (grant, sent))
        }
    }
}

//! The attempt loop of a plain acquisition (not a fair one): attempts
//! until the key is taken or the deadline passes, napping on the key's
//! release notice between them and riding out backend failures.

use super::*;

/// The attempt loop. Returns the grant and the instant its request was sent,
/// from which the lease's lifetime is counted (never later than the server's).
///
/// A caller that may wait also rides out backend failures (a restarting
/// server, a dropped connection) until its deadline, retrying with backoff;
/// if the deadline passes first, the last failure is returned rather than a
/// timeout, so the cause is not hidden.
///
/// Nothing is left held when the caller gives up: an attempt abandoned
/// half-way is finished in the background and its grant given back (see
/// [`attempt`]), and an attempt that failed may have reached the store all
/// the same (a lost reply), so a failed acquisition gives its owner's key
/// back too. The wake-up that ended a nap is kept until the attempt after
/// it is answered: a waiter that gives up in between passes it on.
///
/// Each attempt says where in the wait it stands ([`Look`]), so a backend
/// may answer a caller that arrives behind waiters of its own process
/// without asking its store ([`Attempt::Behind`]); a caller whose every
/// answer was that asks the store after [`FIRST_ASK_WITHIN`] or at its
/// deadline, whichever comes first, so none waits long, or times out, on
/// the backend's word alone.
pub(super) async fn take(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    owner: &OwnerId,
    terms: &Terms,
    deadline: Instant,
    started: Instant,
) -> Result<(Grant, Instant), LockError> {
    let mut taking = Taking {
        backend,
        key,
        owner,
        terms,
        deadline,
        started,
        kind: backend.kind(),
        failure: None,
        unsure: false,
        may_mark: may_mark(backend, terms),
        clear_mark: LeaveQueue {
            give_back: None,
            notice: None,
        },
        asked: true,
        just_subscribed: true,
    };
    let outcome = taking.attempts().await;
    if outcome.is_ok() {
        taking.clear_mark.disarm();
    } else if taking.unsure {
        taking.clear_mark.disarm();
        spawn_give_back(backend, key, *owner, terms.access);
    }
    // Still armed: the give back removes the mark as it drops.
    outcome
}

/// One plain acquisition on its way through its attempts: what it asks
/// for, and what its answers so far have told it.
struct Taking<'a> {
    backend: &'a Arc<dyn Backend>,
    key: &'a LockKey,
    owner: &'a OwnerId,
    terms: &'a Terms,
    deadline: Instant,
    started: Instant,
    kind: &'static str,
    /// The last backend failure, while the caller rides failures out.
    failure: Option<LockError>,
    /// Whether an attempt failed in a way that may have taken the key anyway.
    unsure: bool,
    /// Whether an attempt answered `Held` may have left a writer-waiting
    /// mark ([`may_mark`]).
    may_mark: bool,
    /// Armed once an exclusive attempt was answered `Held` on a backend with
    /// shared locks: dropped armed (the deadline, an error, the caller gone),
    /// it removes the writer-waiting mark the attempt may have left (M3).
    clear_mark: LeaveQueue,
    /// Whether the store itself answered an attempt (not the backend in
    /// process, behind this process's waiters).
    asked: bool,
    /// Whether the next attempt is the look right after subscribing.
    just_subscribed: bool,
}

impl Taking<'_> {
    fn contended(&self, now: Instant) -> LockError {
        contended(self.key, self.terms, now - self.started)
    }

    fn may_retry(&self, err: &LockError) -> bool {
        may_retry(self.terms, err)
    }

    /// An attempt was answered `Held`: arms the removal of the mark it may
    /// have left.
    fn held(&mut self) {
        if self.may_mark && self.clear_mark.give_back.is_none() {
            self.clear_mark.give_back =
                Some((Arc::clone(self.backend), self.key.clone(), *self.owner));
        }
    }

    /// Attempts until one takes the key, a failure is not ridden out, or
    /// the deadline passes.
    async fn attempts(&mut self) -> Result<(Grant, Instant), LockError> {
        if let Some(outcome) = self.first_attempt().await {
            return outcome;
        }
        let mut backoff = MIN_BACKOFF;
        let mut woken_by: Option<ReleaseNotice> = None;
        loop {
            let now = Instant::now();
            // Past the deadline, a caller whose every answer came from the
            // backend in process goes round once more: the store has the
            // last word before it is told "held".
            let past = now >= self.deadline;
            if past && self.asked {
                return Err(self.failure.take().unwrap_or_else(|| self.contended(now)));
            }
            if let Some(err) = &self.failure {
                tracing::warn!(key = %self.key, error = %err, "lock backend failed while waiting; retrying");
                tokio::time::sleep(backoff.min(self.deadline - now)).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
            // Subscribe first, then try again: a release that lands between
            // the failed attempt and the subscription is seen by this retry,
            // and one that lands after it wakes the notice. No wake-up is lost.
            let Some(mut notice) = self.subscribe().await? else {
                continue;
            };
            let look = if std::mem::take(&mut self.just_subscribed) && !past {
                Look::Subscribed {
                    queued_behind: notice.is_queued_behind(),
                }
            } else {
                Look::Again
            };
            let sent = Instant::now();
            let again = attempt(
                self.backend,
                self.key,
                *self.owner,
                self.terms,
                Queue::Barge,
                look,
            );
            let answer = by_deadline(
                self.kind,
                Operation::Acquire,
                self.key,
                self.terms,
                self.deadline,
                again,
            )
            .await;
            if answer.is_ok()
                && let Some(woken) = woken_by.take()
            {
                woken.answered();
            }
            let expires_in = match answer {
                Ok(Attempt::Acquired(grant)) => return Ok((grant, sent)),
                Ok(Attempt::Held { expires_in }) => {
                    self.held();
                    self.asked = true;
                    expires_in
                }
                Ok(Attempt::Behind { expires_in }) => Some(expires_in),
                Err(err) => {
                    self.unsure = true;
                    self.asked = true;
                    // Dropped unanswered: the wake-up goes to another waiter.
                    woken_by = None;
                    if !self.may_retry(&err) {
                        return Err(err);
                    }
                    self.failure = Some(err);
                    continue;
                }
            };
            self.failure = None;
            backoff = MIN_BACKOFF;
            let now = Instant::now();
            if now >= self.deadline {
                if !self.asked {
                    // The loop's head asks the store before it says "held".
                    continue;
                }
                return Err(self.contended(now));
            }
            let nap = self.nap(expires_in, &notice, now);
            let _ = timeout(nap, &mut notice).await;
            woken_by = notice.is_woken().then_some(notice);
        }
    }

    /// The first attempt: `Some` with the outcome if it ends the
    /// acquisition.
    async fn first_attempt(&mut self) -> Option<Result<(Grant, Instant), LockError>> {
        // The first attempt goes out just after the call began: its start
        // serves as the instant the attempt was sent (a little early, so
        // the lease's lifetime is, if anything, counted short).
        let sent = self.started;
        let first = attempt(
            self.backend,
            self.key,
            *self.owner,
            self.terms,
            Queue::Barge,
            Look::First,
        );
        match by_deadline(
            self.kind,
            Operation::Acquire,
            self.key,
            self.terms,
            self.deadline,
            first,
        )
        .await
        {
            Ok(Attempt::Acquired(grant)) => return Some(Ok((grant, sent))),
            Ok(Attempt::Held { .. }) => self.held(),
            Ok(Attempt::Behind { .. }) => self.asked = false,
            Err(err) => {
                self.unsure = true;
                if !self.may_retry(&err) {
                    return Some(Err(err));
                }
                self.failure = Some(err);
                self.just_subscribed = false;
            }
        }
        None
    }

    /// Subscribes to the key's release: `None` after a failure the caller
    /// rides out.
    async fn subscribe(&mut self) -> Result<Option<ReleaseNotice>, LockError> {
        let subscribed = self.backend.subscribe(self.key);
        match by_deadline(
            self.kind,
            Operation::Wait,
            self.key,
            self.terms,
            self.deadline,
            subscribed,
        )
        .await
        {
            Ok(notice) => Ok(Some(notice)),
            Err(err) if self.may_retry(&err) => {
                self.failure = Some(err);
                self.just_subscribed = false;
                Ok(None)
            }
            Err(err) => Err(err),
        }
    }

    /// How long to wait on `notice` before the next attempt.
    fn nap(&self, expires_in: Option<Duration>, notice: &ReleaseNotice, now: Instant) -> Duration {
        // Until the holder's lease runs out, or as soon as a notice that
        // may miss a release asks, and never longer than the safety net.
        [
            expires_in.map(|expires_in| expires_in + EXPIRY_SLACK),
            notice.recheck(),
            (!self.asked).then_some(FIRST_ASK_WITHIN),
        ]
        .into_iter()
        .flatten()
        .fold(MAX_NAP, Duration::min)
        .min(self.deadline - now)
    }
}

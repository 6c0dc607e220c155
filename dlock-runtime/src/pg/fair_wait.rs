//! A fair wait's task: one owner's place in one key's queue on the server
//! (see the `fair` module docs), from its session and its statement to what
//! comes of the answer, and the statement sent again after a cut-off.
//!
//! Its own file: the task runs apart from the owner's attempts, which only
//! meet it through the queues in `fair_queue`.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::sleep;
use tokio_postgres::error::SqlState;

use super::connection::Failure;
use super::fair_grant::deliver;
use super::fair_queue::{FairTicket, Reserved, Wait};
use super::fair_statement::{WaitRows, granted, send_wait};
use super::session::LockSession;
use super::{Inner, KIND, sql};
use crate::error::{LockError, Operation};

/// The longest pause between two waits sent again after a cut-off.
const MAX_RESTART_PAUSE: Duration = Duration::from_secs(1);

/// The task of one fair wait (see the module docs): a session of its own,
/// the wait statement, and what comes of it.
pub(super) async fn wait_in_queue(mut wait: Wait, reserved: Reserved) {
    let inner = Arc::clone(&wait.inner);
    let (session, ticket) = match reserved {
        Reserved::Session(session) => (Some(session), None),
        Reserved::Ticket(ticket) => (None, Some(ticket)),
    };
    let mut rounds = Rounds {
        ticket,
        session,
        record: None,
        restored: false,
        pause: Duration::ZERO,
    };
    loop {
        if !rounds.pause.is_zero() {
            tokio::select! {
                () = sleep(rounds.pause) => {}
                () = wait.unwanted() => return,
            }
        }
        let Some(on) = rounds.session(&inner, &mut wait).await else {
            return;
        };
        // Recorded by the rules of a plain acquisition (`Inner::try_lock`).
        let recording = if wait.identity.is_some() {
            if let Err(err) = inner.ensure_holders_table(&wait.key, false).await {
                inner.fair_session_free(&on);
                return wait.fail(err);
            }
            true
        } else {
            match rounds.record {
                Some(record) => record,
                None => inner.may_record(&wait.key).await,
            }
        };
        let recording = on.started.filter(|_| recording);
        if recording.is_none() && on.records().may_have_a_record_of(wait.key.as_str()) {
            // A record it wrote of an earlier lease could be read for this
            // one (see `Records::wrote_a_record`): another session.
            on.end(
                "a fair session that wrote holder records takes no lease without one".to_owned(),
            );
            continue;
        }
        if !wait.until_first_in_process().await {
            // Nobody wants it any more: the session was not used.
            inner.fair_session_free(&on);
            return;
        }
        on.set_waiting(true);
        let Some(answer) = answer_of_wait(&inner, &mut wait, &on, recording).await else {
            return;
        };
        on.set_waiting(false);
        let err = match answer {
            Ok(rows) => {
                match granted(&rows, recording) {
                    // Granted, and the record written if it was to be.
                    Some(Ok((advisory_key, Some(token), since)))
                        if recording.is_none() || since.is_some() =>
                    {
                        if since.is_some() {
                            on.records().wrote_a_record(wait.key.as_str());
                        }
                        return deliver(wait, on, advisory_key, token, since).await;
                    }
                    // Granted, and a DBA's trigger or rule skipped the write:
                    // the record there, if any, is an earlier lease's. The
                    // lock goes back; a lease without an identity waits
                    // again without its record.
                    Some(Ok((_, Some(_), _))) => {
                        match rounds.no_record_written(&inner, &mut wait, on).await {
                            ControlFlow::Continue(()) => continue,
                            ControlFlow::Break(()) => return,
                        }
                    }
                    // An answer it cannot read: the record may be there.
                    Some(Err(err)) => {
                        if recording.is_some() {
                            on.records().wrote_a_record(wait.key.as_str());
                        }
                        err
                    }
                    // Never: the statement waits until it is granted.
                    _ => {
                        if inner.drop_fair_locks(&on).await {
                            inner.fair_session_free(&on);
                        }
                        return wait.fail(LockError::backend(
                            KIND,
                            Operation::Acquire,
                            wait.key.as_str(),
                            Failure::msg("the fair wait statement answered no token"),
                        ));
                    }
                }
            }
            Err(err) => err,
        };
        let then = rounds.after_failure(&inner, &mut wait, on, err, recording);
        if then.await.is_break() {
            return;
        }
    }
}

/// Sends the wait statement on `on` (recording the holder, the session's
/// start given, or not) and waits for its answer, telling the first
/// attempt once the server shows the wait queued. `None` if nobody wants
/// the wait any more: it has left the queue then.
async fn answer_of_wait(
    inner: &Arc<Inner>,
    wait: &mut Wait,
    on: &Arc<LockSession>,
    recording: Option<SystemTime>,
) -> Option<Result<WaitRows, tokio_postgres::Error>> {
    let sent = send_wait(
        Arc::clone(inner),
        Arc::clone(on),
        wait.key.clone(),
        wait.identity.clone(),
        wait.holder.clone(),
        recording,
    );
    tokio::pin!(sent);
    let queued = inner.until_queued(on.pid);
    tokio::pin!(queued);
    let mut reporting = wait.first.is_some();
    let wanted = loop {
        tokio::select! {
            biased;
            answer = &mut sent => break Some(answer),
            () = &mut queued, if reporting => {
                reporting = false;
                wait.report_queued();
            }
            () = wait.unwanted() => break None,
        }
    };
    match wanted {
        Some(answer) => Some(answer),
        None => {
            // Nobody wants the wait any more: it leaves the queue
            // before the task ends (a release of its owner returns
            // only then).
            inner.cancel_wait(on, wait, &mut sent, recording).await;
            None
        }
    }
}

/// What a fair wait keeps from one wait statement to the next (see
/// [`wait_in_queue`]).
struct Rounds {
    /// The right to open the first session, until it is used.
    ticket: Option<FairTicket>,
    /// The session to send the next statement on, if one is kept.
    session: Option<Arc<LockSession>>,
    /// Whether leases without an identity record: `None` asks again.
    record: Option<bool>,
    /// Whether the objects were made again once already.
    restored: bool,
    /// The pause before the next statement.
    pause: Duration,
}

impl Rounds {
    /// The session for the next statement: the one kept, if it lives, or
    /// a new one. `None` when the task ends instead: no session may be
    /// opened (the wait failed), or nobody wants the wait any more.
    async fn session(&mut self, inner: &Arc<Inner>, wait: &mut Wait) -> Option<Arc<LockSession>> {
        if let Some(on) = self.session.take().filter(|on| !on.is_ended()) {
            return Some(on);
        }
        let Some(ticket) = self.ticket.take().or_else(|| inner.fair.ticket()) else {
            wait.fail(inner.fair_sessions_busy(&wait.key));
            return None;
        };
        let opened = tokio::select! {
            opened = inner.open_fair_session(ticket) => opened,
            () = wait.unwanted() => return None,
        };
        match opened {
            Ok(on) => Some(on),
            Err(err) => {
                let err = LockError::backend(KIND, Operation::Acquire, wait.key.as_str(), err);
                wait.fail(err);
                None
            }
        }
    }

    /// The lock was granted on `on` to a recording statement that wrote no
    /// record: the lock goes back, and the wait is sent again without its
    /// record (`Continue`), or, for a lease with an identity, ends with the
    /// error (`Break`).
    async fn no_record_written(
        &mut self,
        inner: &Arc<Inner>,
        wait: &mut Wait,
        on: Arc<LockSession>,
    ) -> ControlFlow<()> {
        // A trigger may have written a row of its own
        // making (see `Inner::try_lock`).
        on.records().wrote_a_record(wait.key.as_str());
        if !inner.drop_fair_locks(&on).await {
            self.pause = restart_pause(self.pause);
            return ControlFlow::Continue(());
        }
        let identified = wait.identity.is_some();
        let Some(err) = inner.no_record_written("fair lock statement", &wait.key, identified)
        else {
            self.record = Some(false);
            self.session = Some(on);
            return ControlFlow::Continue(());
        };
        inner.fair_session_free(&on);
        wait.fail(err);
        ControlFlow::Break(())
    }

    /// The wait statement on `on` (`recording` or not) failed with `err`:
    /// it is sent again (`Continue`), on the same session or another, or
    /// the wait ends with the error (`Break`).
    async fn after_failure(
        &mut self,
        inner: &Arc<Inner>,
        wait: &mut Wait,
        on: Arc<LockSession>,
        err: tokio_postgres::Error,
        recording: Option<SystemTime>,
    ) -> ControlFlow<()> {
        // A session lock outlives the statement that took it: a failure
        // after the grant leaves the lock held, and a fair session holds
        // no other.
        let alive = !err.is_closed() && !on.is_ended() && inner.drop_fair_locks(&on).await;
        if !alive {
            // The session went (terminated, a restart, a half-open
            // connection found by its keepalives): queue again on another.
            tracing::debug!(key = %wait.key, error = %err, "a fair wait's session ended; queuing again");
            self.pause = restart_pause(self.pause);
            return ControlFlow::Continue(());
        }
        if err.code() == Some(&SqlState::QUERY_CANCELED) {
            // Not this backend's cancel (that one ends the session): a
            // DBA's, or a timeout set despite the session's settings.
            tracing::warn!(
                key = %wait.key,
                error = %err,
                "a fair wait was cancelled on the server; it queues again, at the end of the queue"
            );
            self.session = Some(on);
            self.pause = restart_pause(self.pause);
            return ControlFlow::Continue(());
        }
        // A drop that struck while the statement ran (it may have taken
        // the lock: dropped with the fair locks above) is retried alike.
        if sql::missing_or_dropped(&err) && !self.restored {
            self.restored = true;
            if let Err(err) = Box::pin(inner.restore_objects()).await {
                inner.fair_session_free(&on);
                let err = LockError::backend(KIND, Operation::Acquire, wait.key.as_str(), err);
                wait.fail(err);
                return ControlFlow::Break(());
            }
            if wait.identity.is_some() {
                // Or the table of holder records went.
                if let Err(err) = inner.ensure_holders_table(&wait.key, true).await {
                    inner.fair_session_free(&on);
                    wait.fail(err);
                    return ControlFlow::Break(());
                }
            } else if recording.is_some() {
                inner.holders_state.set_unchecked();
                self.record = None;
            }
            self.session = Some(on);
            return ControlFlow::Continue(());
        }
        // A lease without an identity never fails for its record (see
        // `Inner::try_lock`).
        if inner.records_refused(
            &wait.key,
            wait.identity.is_some(),
            recording.is_some(),
            &err,
        ) {
            self.record = Some(false);
            self.session = Some(on);
            return ControlFlow::Continue(());
        }
        inner.fair_session_free(&on);
        wait.fail(inner.lock_error(&wait.key, err, recording.is_some()));
        ControlFlow::Break(())
    }
}

/// The pause before a wait is sent again after a cut-off: 10 ms, doubling
/// up to [`MAX_RESTART_PAUSE`].
fn restart_pause(pause: Duration) -> Duration {
    if pause.is_zero() {
        Duration::from_millis(10)
    } else {
        (pause * 2).min(MAX_RESTART_PAUSE)
    }
}

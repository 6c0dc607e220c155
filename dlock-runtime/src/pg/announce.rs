//! Announcing acquisitions with an identity, for watches of a free key
//! (see the `listen` module): after the lock statement, never in it, with
//! a statement of its own ([`sql::ANNOUNCE`]) that may fail. Best effort:
//! a watch of a free key also reads again every [`ANNOUNCED_RECHECK`],
//! which covers an announcement that failed, or that an older dlock never
//! made.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use super::session::LockSession;
use super::{Inner, sql};
use crate::key::LockKey;

/// How long an announcement waits for PostgreSQL's lock of notifying
/// commits: every statement sent after it on the session waits as long.
const ANNOUNCE_LOCK_WAIT: Duration = Duration::from_millis(100);

/// At most one warning of failed announcements every this long: while
/// another transaction holds the lock of notifying commits, every
/// acquisition with an identity fails to announce.
pub(super) const WARN_EVERY: Duration = Duration::from_secs(60);

/// How soon a reader watching a free key looks again although the
/// listening connection would wake it: an acquisition that was not
/// announced (by a dlock that predates announcements, as in a rolling
/// upgrade, or whose announcement failed) would otherwise go unseen until
/// the reader's own timer, 10 s for an election's observer. One read a
/// second for each such watch, where `holders::FREE_RECHECK` costs twenty.
pub(super) const ANNOUNCED_RECHECK: Duration = Duration::from_secs(1);

/// A session's acquisitions waiting to be announced.
#[derive(Default)]
struct Announcements {
    /// Their advisory keys, with their keys for the logs.
    pending: Vec<(i64, LockKey)>,
    /// Whether a task is sending them.
    sending: bool,
}

impl Inner {
    /// Announces that `session` took `key` (advisory key `lock_id`) with
    /// its identity recorded, in a task of its own: no acquisition waits
    /// for it or fails with it. One announcement at a time per session,
    /// the acquisitions made meanwhile going together in the next one: a
    /// lock of notifying commits held elsewhere costs the session's other
    /// statements one wait of at most [`ANNOUNCE_LOCK_WAIT`] at a time,
    /// however many acquisitions it makes.
    pub(super) fn announce_later(
        self: &Arc<Self>,
        session: &Arc<LockSession>,
        key: &LockKey,
        lock_id: i64,
    ) {
        {
            let mut announcements = announcements(session);
            announcements.pending.push((lock_id, key.clone()));
            if announcements.sending {
                return;
            }
            announcements.sending = true;
        }
        let (inner, on) = (Arc::clone(self), Arc::clone(session));
        let spawned = self.home.spawn(async move {
            let mut sending = Sending {
                session: &on,
                done: false,
            };
            inner.announce(&mut sending).await;
        });
        if !spawned {
            // The runtime shut down, and the session with it.
            let mut announcements = announcements(session);
            announcements.pending.clear();
            announcements.sending = false;
        }
    }

    /// Sends the session's pending announcements until none is left.
    async fn announce(&self, sending: &mut Sending<'_>) {
        let session = sending.session;
        loop {
            let batch = {
                let mut announcements = announcements(session);
                if session.is_ended() {
                    announcements.pending.clear();
                }
                if announcements.pending.is_empty() {
                    // Under the lock: an acquisition after this starts
                    // another task.
                    announcements.sending = false;
                    sending.done = true;
                    return;
                }
                std::mem::take(&mut announcements.pending)
            };
            let Some((_, first)) = batch.first() else {
                continue;
            };
            let wait = ANNOUNCE_LOCK_WAIT.min(self.lock_timeout());
            let wait_ms = wait.as_millis().max(1).to_string();
            let lock_ids: Vec<i64> = batch.iter().map(|(lock_id, _)| *lock_id).collect();
            let params: [(&(dyn ToSql + Sync), Type); 3] = [
                (&wait_ms, Type::TEXT),
                (&self.listener.channel(), Type::TEXT),
                (&lock_ids, Type::INT8_ARRAY),
            ];
            if let Err(err) = session.query_typed(sql::ANNOUNCE, &params).await {
                self.announce_failed(first, batch.len(), wait, &err);
            }
        }
    }

    fn announce_failed(
        &self,
        key: &LockKey,
        acquisitions: usize,
        wait: Duration,
        err: &tokio_postgres::Error,
    ) {
        // No answer: the session may be gone, which its liveness check
        // sees; its leases go with it.
        if err.as_db_error().is_none() || !self.announce_warnings.due() {
            tracing::debug!(key = %key, acquisitions, error = %err, "an acquisition was not announced");
            return;
        }
        if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
            tracing::warn!(
                key = %key,
                acquisitions,
                error = %err,
                "could not announce an acquisition with an identity: another transaction held \
                 PostgreSQL's lock of notifying commits for longer than the announcement waits \
                 ({wait:?}), such as a NOTIFY whose commit waits for a synchronous standby; the \
                 lock is held all the same, and observers of the key read it within \
                 {ANNOUNCED_RECHECK:?} (further failures within {WARN_EVERY:?} are logged at \
                 debug level)"
            );
        } else {
            tracing::warn!(
                key = %key,
                acquisitions,
                error = %err,
                "could not announce an acquisition with an identity (NOTIFY failed); the lock is \
                 held all the same, and observers of the key read it within \
                 {ANNOUNCED_RECHECK:?} (further failures within {WARN_EVERY:?} are logged at \
                 debug level)"
            );
        }
    }
}

fn announcements(session: &LockSession) -> MutexGuard<'_, Announcements> {
    session
        .feature::<Mutex<Announcements>>()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// A session's announcing task. Dropped before it is `done` (its runtime
/// shut down half-way), it marks the task gone, so that the next
/// acquisition starts another; what was pending is dropped with it.
struct Sending<'a> {
    session: &'a LockSession,
    done: bool,
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut announcements = announcements(self.session);
        announcements.pending.clear();
        announcements.sending = false;
    }
}

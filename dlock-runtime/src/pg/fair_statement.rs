//! The fair wait statement on the server: sending it, seeing it queued,
//! reading its answer, and cancelling it when nobody wants the wait any
//! more.
//!
//! Its own file: what a fair wait asks of the server, apart from the
//! task's decisions in `fair_wait`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::{Instant, sleep, timeout};
use tokio_postgres::types::Type;

use super::fair_queue::Wait;
use super::session::LockSession;
use super::{Inner, sql};
use crate::key::LockKey;

impl Inner {
    /// Waits until the server shows the server process `pid` waiting in an
    /// advisory lock's queue, asking on a lock session; gives up after the
    /// connect timeout (the wait is then taken as queued).
    pub(super) async fn until_queued(self: &Arc<Self>, pid: i32) {
        let give_up = Instant::now() + self.connector.connect_timeout();
        let mut pause = Duration::from_millis(1);
        while Instant::now() < give_up {
            if let Ok(session) = self.session().await
                && let Ok(rows) = session
                    .query_typed(sql::WAITS_IN_QUEUE, &[(&pid, Type::INT4)])
                    .await
                && rows.first().and_then(|row| row.try_get(0).ok()) == Some(true)
            {
                return;
            }
            sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// Drops every advisory lock `session` holds (a fair session holds
    /// none but what its failed statement may have taken); ends the session
    /// if that fails. False if the session is gone.
    pub(super) async fn drop_fair_locks(&self, session: &LockSession) -> bool {
        match session.query_typed(sql::UNLOCK_ALL, &[]).await {
            Ok(_) => true,
            Err(_) => {
                session.end("could not drop the locks of a failed fair wait".to_owned());
                false
            }
        }
    }

    /// Ends a wait nobody wants any more (its statement `sent`, on
    /// `session`): asks the server to cancel the statement, and waits (at
    /// most the connect timeout) until it ended, so the session has left
    /// the key's queue. A lock granted in the race is given back, with the
    /// record it wrote, and the session kept; a session whose statement
    /// does not end, or whose clean-up fails, is closed, which drops
    /// everything it held.
    pub(super) async fn cancel_wait<F>(
        self: &Arc<Self>,
        session: &Arc<LockSession>,
        wait: &Wait,
        sent: &mut std::pin::Pin<&mut F>,
        recording: Option<SystemTime>,
    ) where
        F: Future<Output = Result<WaitRows, tokio_postgres::Error>>,
    {
        let key = &wait.key;
        if let Err(err) = self.fair_connector.cancel(session.cancel_token()).await {
            tracing::debug!(
                key = %key,
                error = %err,
                "could not cancel a fair wait; closing its session (the server drops the wait \
                 when it checks the connection, or when the key reaches it)"
            );
            session.set_waiting(false);
            session.end(format!("the fair wait for `{key}` was given up"));
            return;
        }
        let ended = timeout(self.connector.connect_timeout(), sent.as_mut()).await;
        session.set_waiting(false);
        match ended {
            // Granted before the cancel came.
            Ok(Ok(rows)) => match granted(&rows, recording) {
                Some(Ok((advisory_key, Some(token), since))) => {
                    let immediate = since.is_some() && wait.identity.is_some();
                    let record = since.map(|_| token);
                    self.give_back_fair(session, advisory_key, record, immediate)
                        .await;
                }
                _ => session.end(format!("the fair wait for `{key}` was given up")),
            },
            // Cancelled (a cancel that struck after the grant, in the
            // draw, leaves the lock held, and nothing else).
            Ok(Err(err)) if !err.is_closed() && !session.is_ended() => {
                if self.drop_fair_locks(session).await {
                    self.fair_session_free(session);
                }
            }
            _ => session.end(format!("the fair wait for `{key}` was given up")),
        }
    }
}

/// The advisory key, the token, and the time of the record (if `recording`)
/// of a wait statement's answer.
pub(super) type Granted = (i64, Option<i64>, Option<SystemTime>);

/// What a fair wait's statements answered: the wait's rows
/// ([`sql::FAIR_LOCK`] or [`sql::FAIR_LOCK_MARKED`]) and, once granted to
/// a waiter whose holder is recorded, the record's ([`sql::FAIR_RECORD`]).
pub(super) struct WaitRows {
    wait: Vec<tokio_postgres::Row>,
    record: Option<Vec<tokio_postgres::Row>>,
}

/// Reads a wait's answer; `None` without a row.
pub(super) fn granted(
    answer: &WaitRows,
    recording: Option<SystemTime>,
) -> Option<Result<Granted, tokio_postgres::Error>> {
    answer.wait.first().map(|row| {
        let record = answer.record.as_deref().and_then(<[_]>::first);
        let since = match (recording, record) {
            (Some(_), Some(record)) => sql::recorded_since(record, 0, None)?.0,
            _ => None,
        };
        Ok((row.try_get(0)?, row.try_get(1)?, since))
    })
}

/// Sends the wait statement for `key` on `session`, and, once it is
/// granted, the statement that records the holder (`identity` and
/// `holder`, the session's start given) if it is recorded: the wait names
/// none of dlock's tables (see [`sql::FAIR_LOCK_MARKED`]). Unprepared.
pub(super) async fn send_wait(
    inner: Arc<Inner>,
    session: Arc<LockSession>,
    key: LockKey,
    identity: Option<Arc<str>>,
    holder: String,
    recording: Option<SystemTime>,
) -> Result<WaitRows, tokio_postgres::Error> {
    let key = key.as_str();
    let seed = &inner.options.key_seed;
    let Some(started) = recording else {
        let wait = session
            .query_typed(
                &inner.fair_lock_sql,
                &[(&key, Type::TEXT), (seed, Type::INT8)],
            )
            .await?;
        return Ok(WaitRows { wait, record: None });
    };
    let wait = session
        .query_typed(
            &inner.fair_lock_marked_sql,
            &[(&key, Type::TEXT), (seed, Type::INT8)],
        )
        .await?;
    let taken = wait.first().and_then(|row| {
        let advisory_key: i64 = row.try_get(0).ok()?;
        let token: i64 = row.try_get::<_, Option<i64>>(1).ok()??;
        Some((advisory_key, token))
    });
    let Some((advisory_key, token)) = taken else {
        return Ok(WaitRows { wait, record: None });
    };
    let identity = identity.as_deref();
    let record = session
        .query_typed(
            &inner.fair_record_sql,
            &[
                (&key, Type::TEXT),
                (&advisory_key, Type::INT8),
                (&identity, Type::TEXT),
                (&started, Type::TIMESTAMPTZ),
                (&holder, Type::TEXT),
                (&token, Type::INT8),
            ],
        )
        .await?;
    Ok(WaitRows {
        wait,
        record: Some(record),
    })
}

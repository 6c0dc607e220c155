//! The force release that names a lease
//! ([`Backend::force_release_holding`](crate::Backend::force_release_holding)
//! of another process's lease): it ends the holder's session only if the
//! record of the key names that lease.
//!
//! Its own file because it is the one place that ends sessions on the
//! records' word, in one round trip on a connection of its own under the
//! key's release gate.

use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::{Instant, sleep, timeout};
use tokio_postgres::SimpleQueryMessage;
use tokio_postgres::error::SqlState;

use super::connection::Failure;
use super::{Inner, TERMINATE_WAIT_MS, sql};
use crate::key::LockKey;

/// What one run of `sql::FORCE_RELEASE_NAMED` did.
enum NamedEnds {
    /// The key's release gate was taken (a release under way): nothing
    /// was read or ended; try again.
    GateBusy,
    /// The session with this pid holds the key, and its start is hidden
    /// from this role: nothing was ended.
    Hidden(String),
    /// Whether a session was ended.
    Ended(bool),
}

/// Reads the answer of `sql::FORCE_RELEASE_NAMED`: the gate's try is the
/// third statement's row, the sessions found the fifth's rows.
fn named_ends(messages: &[SimpleQueryMessage], key: &LockKey, token: i64) -> NamedEnds {
    let mut completed = 0;
    let mut ended = false;
    for message in messages {
        match message {
            SimpleQueryMessage::CommandComplete(_) => completed += 1,
            SimpleQueryMessage::Row(row) if completed == 2 && row.get(0) != Some("true") => {
                return NamedEnds::GateBusy;
            }
            SimpleQueryMessage::Row(row) if completed == 4 => {
                let pid = row.get(0).unwrap_or("?");
                if row.get(1) == Some("t") {
                    return NamedEnds::Hidden(pid.to_owned());
                }
                if let Some(gone) = row.get(2) {
                    ended = true;
                    tracing::warn!(key = %key, pid, gone, token, "force release: ended the PostgreSQL session holding the named lease");
                }
            }
            _ => {}
        }
    }
    NamedEnds::Ended(ended)
}

impl Inner {
    /// Ends the session of another process that holds `key` for the lease
    /// whose token is `token`: true if one was ended, false if the lease
    /// named does not hold the key (nothing was ended). Never a session of
    /// `own` (this backend's).
    ///
    /// On a connection of its own, in one round trip
    /// ([`sql::FORCE_RELEASE_NAMED`]): under the key's release gate, the
    /// lock table is read, and only then, with a snapshot taken after that
    /// read, the records. Read in one statement, the records would be the
    /// statement's snapshot, older than the lock table: a holder that let
    /// go of the named lease and took the key again in between would be
    /// ended for the lease it no longer held, with every other lock of its
    /// session. The server runs the whole of it without waiting for this
    /// client, so the gate, which the holder's own releases of the key
    /// wait for, is held for as long as the server works, never for a
    /// round trip or a client that stalls; and the client gives up on it
    /// after the waits it sets, plus a connect timeout for the answer.
    pub(super) async fn terminate_named(
        &self,
        key: &LockKey,
        token: i64,
        own: &[i32],
    ) -> Result<bool, Failure> {
        const WHY: &str =
            "cannot end the session holding it (needs pg_signal_backend or the holder's role)";
        let connect = self.connector.connect_timeout();
        let terminate_wait = Duration::from_millis(TERMINATE_WAIT_MS.unsigned_abs());
        // The gate waits only for releases under way (one statement each),
        // and the lock table read for the lock manager.
        let gate = self.lock_timeout();
        let statement_wait = gate + terminate_wait + connect;
        let script = sql::force_release_named(
            &self.force_release_named_sql,
            key.as_str(),
            self.options.key_seed,
            token,
            own,
            &sql::ForceWaits {
                gate,
                statement: statement_wait,
                terminate: terminate_wait,
            },
        );
        // Dropping `close` closes the connection (and the server rolls
        // back whatever it had not finished).
        let (close, closed) = oneshot::channel();
        let client = self.connector.open(connect, closed, |_| {}).await?;
        let give_up = Instant::now() + gate;
        let mut pause = Duration::from_millis(1);
        let ended = loop {
            let bound = statement_wait * 3 + connect;
            let messages = match timeout(bound, client.simple_query(&script)).await {
                Ok(Ok(messages)) => messages,
                // No table of records: no lease of another process could
                // be named by its token.
                Ok(Err(err)) if sql::sequence_missing(&err) => break Ok(false),
                Ok(Err(err)) if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                    break Err(Failure::new(
                        "cannot end the session holding it: the table of holder records stayed \
                         locked past the lock timeout (an ALTER TABLE, VACUUM FULL or TRUNCATE \
                         on it?); nothing was ended",
                        err,
                    ));
                }
                Ok(Err(err)) => break Err(Failure::new(WHY, err)),
                Err(_) => break Err(Failure::msg(format!("{WHY}: no answer within {bound:?}"))),
            };
            match named_ends(&messages, key, token) {
                NamedEnds::GateBusy if Instant::now() < give_up => {
                    sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(20));
                }
                NamedEnds::GateBusy => {
                    break Err(Failure::msg(format!(
                        "cannot end the session holding it: releases of the key kept its release \
                         gate busy for {gate:?} (or another session holds it); nothing was ended"
                    )));
                }
                NamedEnds::Hidden(pid) => {
                    break Err(Failure::msg(format!(
                        "cannot tell whether the session holding it (pid {pid}) is the one the \
                         lease named: its start is hidden from this role (grant it \
                         pg_read_all_stats, or use the holder's role); nothing was ended"
                    )));
                }
                NamedEnds::Ended(ended) => break Ok(ended),
            }
        };
        drop(close);
        ended
    }
}

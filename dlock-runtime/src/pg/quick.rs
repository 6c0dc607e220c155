//! The quick lock statements ([`sql::TRY_LOCK_QUICK`],
//! [`sql::TRY_LOCK_NAMED_QUICK`]): what a lock session sends instead of the
//! full one while the token sequence is known to lead the clock.
//!
//! Both statements draw by the same rules; the quick one leaves out the
//! branches a sequence ahead of the clock never takes, which PostgreSQL
//! would build at every execution all the same. The full statement
//! answers how far its token leads the clock; until that time has passed
//! (measured from when the statement was sent, so never later than the
//! server's clock says), the backend's next acquisitions send the quick
//! one. So a service that locks once a second sends the full statement
//! each time, one round trip as before, and a busy one sends the full
//! statement about once per lead (10 ms on a sequence dlock creates).
//! Should the quick statement find the sequence not fit after all (a DBA
//! set it back, a server clock stepped ahead), it gives its lock back in
//! the same statement and the full one follows on the same session.
//!
//! Its own file: the plain and the named lock both take it, and the
//! backend's time it keeps belongs to neither.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Error, Row, Statement};

use super::session::LockSession;
use super::sql;
use crate::backend::kit::after;

/// A backend's choice between the quick and the full lock statement, and
/// the quick statements' SQL, the schema filled in (each session prepares
/// them with the full ones).
pub(super) struct QuickDraw {
    /// Until when the sequence leads the clock, as the last full statement
    /// said; `None` when it did not, or a quick statement found otherwise.
    until: Mutex<Option<Instant>>,
    plain_sql: String,
    named_sql: String,
}

impl QuickDraw {
    pub(super) fn new(quoted_schema: &str) -> Self {
        Self {
            until: Mutex::new(None),
            plain_sql: sql::render(sql::TRY_LOCK_QUICK, quoted_schema),
            named_sql: sql::render(sql::TRY_LOCK_NAMED_QUICK, quoted_schema),
        }
    }

    /// The SQL of the quick statement (`named`: a named lease's).
    pub(super) fn sql(&self, named: bool) -> &str {
        if named {
            &self.named_sql
        } else {
            &self.plain_sql
        }
    }

    /// `quick` (a session's quick statement), with the time until which
    /// the sequence leads the clock, while it does; else `None`.
    pub(super) fn due<'s>(&self, quick: &'s Statement) -> Option<(&'s Statement, Instant)> {
        let until = (*self.until.lock().unwrap_or_else(PoisonError::into_inner))?;
        (Instant::now() < until).then_some((quick, until))
    }

    /// Sends the quick statement when there is one (from
    /// [`due`](Self::due)), and `full` when there is none or the quick one
    /// gave its lock back, with `params` (the key and its seed) on
    /// `session`: answers as `full` does (see [`answer`]), without the
    /// clock when the quick one did. An error may come after a lock was
    /// taken, as from the one statement.
    pub(super) async fn lock(
        &self,
        session: &LockSession,
        (quick, full): (Option<(&Statement, Instant)>, &Statement),
        named: bool,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, Error> {
        if let Some((quick, seen)) = quick {
            let row = session.query_one(quick, params).await?;
            // `{0}` or `{0,0}`: a token is never 0.
            if answer(&row)?.and_then(|answer| answer.first().copied()) != Some(0) {
                return Ok(row);
            }
            // Unless a full statement answered meanwhile: it read the
            // sequence after this one.
            let mut until = self.until.lock().unwrap_or_else(PoisonError::into_inner);
            if *until == Some(seen) {
                *until = None;
            }
        }
        let sent = Instant::now();
        let row = session.query_one(full, params).await?;
        // `{token, clock}`, or `{token, marks, clock}` for a named lease.
        if let Some(answer) = answer(&row)?
            && answer.len() == 2 + usize::from(named)
        {
            // Believed however far ahead (the full statement refuses a
            // sequence more than a day ahead): the quick one checks the
            // sequence itself, so a lead that ended early costs a round
            // trip, never a token.
            let lead = answer[0].saturating_sub(answer[answer.len() - 1]);
            let lead = Duration::from_micros(u64::try_from(lead).unwrap_or(0));
            let mut until = self.until.lock().unwrap_or_else(PoisonError::into_inner);
            // Answers of concurrent statements come in any order: the
            // sequence only goes forward, so the latest time said holds.
            *until = (*until).max(Some(after(sent, lead)));
        }
        Ok(row)
    }
}

/// A lock statement's answer after its advisory key: the token first,
/// then what the statement adds; NULL when the key was held.
pub(super) fn answer(row: &Row) -> Result<Option<Vec<i64>>, Error> {
    row.try_get(1)
}

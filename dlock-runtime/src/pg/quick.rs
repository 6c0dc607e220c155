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
//! one. Once half of it has passed, one acquisition at a time sends the
//! full statement, which then writes the sequence a lead ahead again
//! (`draw_token!` writes at half the lead), while the others go on with
//! the quick one. So a busy backend's acquisitions do not all send the
//! full statement at once when the lead runs out, each waiting on the
//! server for the draw lock the others hold, unless that one's answer
//! comes after the lead (a server farther away than half the lead). A
//! service that locks once a second sends the full statement each time,
//! one round trip as before, and a busy one sends it about once per half
//! lead (5 ms on a sequence dlock creates).
//! Should the quick statement find the sequence not fit after all (a DBA
//! set it back, a server clock stepped ahead), it gives its lock back in
//! the same statement and the full one follows on the same session.
//!
//! Its own file: the plain and the named lock both take it, and the
//! backend's time it keeps belongs to neither.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{Mutex as Gate, MutexGuard};
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
    /// How long the sequence leads the clock, as the last full statement
    /// said; `None` before any, when it did not lead, or when a quick
    /// statement found otherwise.
    window: Mutex<Option<Window>>,
    /// Held by the acquisition that sends the full statement past half a
    /// window: one at a time, since each holds the draw lock exclusively
    /// on the server; the others go on quick.
    turn: Gate<()>,
    plain_sql: String,
    named_sql: String,
}

/// What a full statement said of the sequence's lead over the clock.
#[derive(Clone, Copy)]
struct Window {
    /// Until when the sequence leads the clock.
    until: Instant,
    /// From when a full statement is sent again (half the lead).
    refresh: Instant,
}

impl QuickDraw {
    pub(super) fn new(quoted_schema: &str) -> Self {
        Self {
            window: Mutex::new(None),
            turn: Gate::new(()),
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

    fn window(&self) -> Option<Window> {
        *self.window.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Which statement this acquisition sends: the quick one, with the
    /// window it relies on, or the full one, with the turn when it holds
    /// it. Within a window the quick one, unless half of it has passed and
    /// the turn is free: then this one refreshes it. Without one (the first
    /// acquisition, no lead, a window over, a quick statement that found
    /// the sequence unfit) each sends the full statement: none waits for
    /// another's, whose answer may be slow (a held draw lock, a server
    /// farther away than the lead).
    fn choose(&self) -> (Option<Instant>, Option<MutexGuard<'_, ()>>) {
        match self.window() {
            Some(window) if Instant::now() < window.until => {
                let refresh = Instant::now() >= window.refresh;
                match refresh.then(|| self.turn.try_lock().ok()).flatten() {
                    Some(turn) => (None, Some(turn)),
                    None => (Some(window.until), None),
                }
            }
            _ => (None, None),
        }
    }

    /// Sends `quick` or `full` (a session's statements, see
    /// [`choose`](Self::choose)), and `full` after a quick one that gave
    /// its lock back, with `params` (the key and its seed) on `session`:
    /// answers as `full` does (see [`answer`]), without the clock when the
    /// quick one did. An error may come after a lock was taken, as from
    /// the one statement.
    pub(super) async fn lock(
        &self,
        session: &LockSession,
        (quick, full): (&Statement, &Statement),
        named: bool,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, Error> {
        let (seen, turn) = self.choose();
        if let Some(seen) = seen {
            let row = session.query_one(quick, params).await?;
            // `{0}` or `{0,0}`: a token is never 0.
            if answer(&row)?.and_then(|answer| answer.first().copied()) != Some(0) {
                return Ok(row);
            }
            // Unless a full statement answered meanwhile: it read the
            // sequence after this one.
            let mut window = self.window.lock().unwrap_or_else(PoisonError::into_inner);
            if window.is_some_and(|window| window.until == seen) {
                *window = None;
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
            let said = Window {
                until: after(sent, lead),
                refresh: after(sent, lead / 2),
            };
            let mut window = self.window.lock().unwrap_or_else(PoisonError::into_inner);
            // Answers of concurrent statements come in any order: the
            // sequence only goes forward, so the latest time said holds.
            if lead.is_zero() || said.until <= Instant::now() {
                // No lead, or one over before its answer came.
                *window = None;
            } else if window.is_none_or(|window| window.until < said.until) {
                *window = Some(said);
            }
        }
        // The turn is given back once the window is said.
        drop(turn);
        Ok(row)
    }
}

/// A lock statement's answer after its advisory key: the token first,
/// then what the statement adds; NULL when the key was held.
pub(super) fn answer(row: &Row) -> Result<Option<Vec<i64>>, Error> {
    row.try_get(1)
}

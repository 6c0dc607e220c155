//! The quick draw (see `sql::quick_draw!`): the lock statement a session
//! sends while the token sequence is ahead of the clock, and the draw it
//! sends after it, the lock held, when the quick draw gave no token.
//!
//! Its own file: the plain and the named lock statement both take it, and
//! what it keeps (the backend's choice of statement, each session's
//! prepared copies) belongs to neither.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::OnceCell;
use tokio::time::Instant;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Error, Row, Statement};

use super::session::LockSession;
use super::sql;

/// How long a backend sends the one-statement lock ([`sql::TRY_LOCK`],
/// [`sql::TRY_LOCK_NAMED`]) after a draw left the sequence not ahead of
/// the clock: a sequence without a lead, or a role without UPDATE on it,
/// whose every draw is behind. The quick draw is tried again after it,
/// so a lead a DBA switches on is taken up within this time. Only the
/// cost differs: both statements draw by the same rules.
const ONE_STATEMENT_FOR: Duration = Duration::from_secs(600);

/// Whether a backend's lock statements take the quick draw, and their
/// SQL, the schema filled in.
pub(super) struct QuickDraw {
    /// Until when the one-statement lock is sent instead.
    one_statement_until: Mutex<Option<Instant>>,
    try_lock: String,
    try_lock_named: String,
    draw: String,
    draw_named: String,
}

impl QuickDraw {
    pub(super) fn new(quoted_schema: &str) -> Self {
        Self {
            one_statement_until: Mutex::new(None),
            try_lock: sql::render(sql::TRY_LOCK_QUICK, quoted_schema),
            try_lock_named: sql::render(sql::TRY_LOCK_NAMED_QUICK, quoted_schema),
            draw: sql::render(sql::DRAW_HELD, quoted_schema),
            draw_named: sql::render(sql::DRAW_HELD_NAMED, quoted_schema),
        }
    }

    /// The quick statements of a lock (`named`: a named lease's) on
    /// `session`, prepared on their first use there, the draw with them (so
    /// that no prepare can fail once the lock is taken); `None` while the
    /// backend sends the one-statement lock.
    pub(super) async fn statements<'s>(
        &self,
        session: &'s LockSession,
        named: bool,
    ) -> Result<Option<&'s QuickStatements>, Error> {
        let until = *self
            .one_statement_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if until.is_some_and(|until| Instant::now() < until) {
            return Ok(None);
        }
        let (lock, draw) = if named {
            (&self.try_lock_named, &self.draw_named)
        } else {
            (&self.try_lock, &self.draw)
        };
        let prepared = &session.feature::<Prepared>().0[usize::from(named)];
        prepared
            .get_or_try_init(|| async {
                Ok(QuickStatements {
                    lock: session.prepare(lock).await?,
                    draw: session.prepare(draw).await?,
                    named,
                })
            })
            .await
            .map(Some)
    }

    /// Sends the quick lock statement with `params` (the key and its seed)
    /// on `session` and, when it took the lock without a token, the draw:
    /// answers as the one-statement lock does. An error may come after the
    /// lock was taken, as from the one statement; an error of the draw
    /// sets `left` to say the lock was taken, whatever the error (a
    /// sequence dropped in between, which the one statement meets before
    /// its lock, fails the draw after it).
    pub(super) async fn lock(
        &self,
        session: &LockSession,
        statements: &QuickStatements,
        params: &[&(dyn ToSql + Sync)],
        left: &mut Option<sql::LockLeft>,
    ) -> Result<Row, Error> {
        let row = session.query_one(&statements.lock, params).await?;
        if !statements.drawn_later(&row)? {
            return Ok(row);
        }
        *left = Some(sql::LockLeft::Yes);
        let advisory_key: i64 = row.try_get(0)?;
        let row = session
            .query_one(&statements.draw, &[&advisory_key])
            .await?;
        if !row.try_get::<_, bool>(2)? {
            *self
                .one_statement_until
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now() + ONE_STATEMENT_FOR);
        }
        Ok(row)
    }
}

/// A session's quick lock statement and the draw sent after it.
pub(super) struct QuickStatements {
    lock: Statement,
    draw: Statement,
    named: bool,
}

impl QuickStatements {
    /// Whether the quick statement's answer `row` took the lock without a
    /// token: `0` ([`sql::TRY_LOCK_QUICK`]), or `{NULL, 0}`
    /// ([`sql::TRY_LOCK_NAMED_QUICK`]).
    fn drawn_later(&self, row: &Row) -> Result<bool, Error> {
        Ok(if self.named {
            row.try_get::<_, Option<Vec<Option<i64>>>>(1)?
                .is_some_and(|answer| answer.first() == Some(&None))
        } else {
            row.try_get::<_, Option<i64>>(1)? == Some(0)
        })
    }
}

/// A session's quick statements, plain and named, each prepared on first
/// use.
#[derive(Default)]
struct Prepared([OnceCell<QuickStatements>; 2]);

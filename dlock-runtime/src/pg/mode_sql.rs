//! The statements of shared locks and permits (see the `modes` module):
//! their SQL, and each lock session's prepared copies of them.
//!
//! Its own file: the book of holds, the readers' shared hold and the
//! statements on the server all send them.

use tokio::sync::OnceCell;
use tokio_postgres::Statement;

use super::session::LockSession;

/// A statement of shared locks and permits (see the `modes` module),
/// prepared once per lock session, so each attempt and each release is
/// one round trip, and the server plans none of them again.
#[derive(Clone, Copy)]
pub(super) enum ModeStatement {
    TryShared,
    UnlockShared,
    TryPermit,
    UnlockPermit,
    Marked,
}

impl ModeStatement {
    const COUNT: usize = 5;
}

/// The SQL of each [`ModeStatement`], the schema filled in.
pub(super) struct ModeSql {
    pub(super) try_shared: String,
    pub(super) unlock_shared: String,
    pub(super) try_permit: String,
    pub(super) unlock_permit: String,
    pub(super) marked: String,
}

impl ModeSql {
    fn of(&self, statement: ModeStatement) -> &str {
        match statement {
            ModeStatement::TryShared => &self.try_shared,
            ModeStatement::UnlockShared => &self.unlock_shared,
            ModeStatement::TryPermit => &self.try_permit,
            ModeStatement::UnlockPermit => &self.unlock_permit,
            ModeStatement::Marked => &self.marked,
        }
    }
}

/// A lock session's statements of shared locks and permits (by
/// [`ModeStatement`]), each prepared on its first use on this session:
/// they name functions and a table that exist only once shared locks or
/// permits are in use, and each names only what it needs, so a change to
/// what one names reaches no other.
#[derive(Default)]
struct Prepared([OnceCell<Statement>; ModeStatement::COUNT]);

impl LockSession {
    /// `statement` (its SQL in `sql`), prepared on its first use on this
    /// session (after the backend made what it names).
    pub(super) async fn mode_statement(
        &self,
        statement: ModeStatement,
        sql: &ModeSql,
    ) -> Result<&Statement, tokio_postgres::Error> {
        self.feature::<Prepared>().0[statement as usize]
            .get_or_try_init(|| self.prepare(sql.of(statement)))
            .await
    }
}

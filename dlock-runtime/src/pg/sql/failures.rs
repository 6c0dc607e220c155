//! What a lock statement's error says: that the token sequence is gone or
//! refused, that a trigger or an unencodable parameter failed it, and
//! whether its session was left holding the key.
//!
//! Its own file because these read the errors of statements from every
//! other file here, and decide what the backend undoes after a failure.

use super::REFUSED;

/// True when a statement failed because the token sequence (or its schema)
/// does not exist: a DBA dropped it after the backend connected. The lock
/// statements name it, so a prepared one fails when it is re-planned.
pub(in crate::pg) fn sequence_missing(err: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    err.code().is_some_and(|code| {
        *code == SqlState::UNDEFINED_TABLE || *code == SqlState::INVALID_SCHEMA_NAME
    })
}

/// True when the sequence (or another of dlock's objects) is gone, dropped
/// before the statement was planned or while it ran: what an acquisition
/// that undid its failed statement restores and retries on.
pub(in crate::pg) fn missing_or_dropped(err: &tokio_postgres::Error) -> bool {
    sequence_missing(err) || dropped_while_running(err)
}

/// Whether `err`, a statement's on a lock session, says the session is
/// over: its connection closed, or the server ended it (a `FATAL` error:
/// terminated by a DBA, shut down, an idle timeout).
pub(in crate::pg) fn session_gone(err: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::Severity;
    err.is_closed()
        || err.as_db_error().is_some_and(|db| {
            matches!(
                db.parsed_severity(),
                Some(Severity::Fatal | Severity::Panic)
            )
        })
}

/// True when a statement failed because a relation it was planned with was
/// dropped while it ran: a DBA's `DROP SEQUENCE` (or `DROP TABLE`, or a
/// `DROP` and `CREATE` in one transaction) that committed while the
/// statement waited for the relation's lock, or just before it opened it.
/// The server reports it as an internal error (`XX000`), in text that is
/// never translated. Unlike [`sequence_missing`], the statement may have
/// taken its key's lock first ([`LockLeft::Unknown`]), so only a caller
/// that undid the failed statement may retry on it.
pub(in crate::pg) fn dropped_while_running(err: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    err.code() == Some(&SqlState::INTERNAL_ERROR)
        && err.as_db_error().is_some_and(|db| {
            db.message().starts_with("could not open relation with OID")
                || db.message().starts_with("cache lookup failed for relation")
        })
}

/// The lines of an error's context that came from what ran on the
/// statement's behalf (functions, the statements they ran, a DBA's
/// triggers), innermost first: the context without its last line when that
/// one names a parameter of the statement's own (`$1`), which the server
/// adds, outermost, to an error while binding it; and to every error of a
/// statement sent with parameters where `log_parameter_max_length_on_error`
/// is set, which every session dlock opens turns off (`SESSION_DEFAULTS`:
/// the values listed there, a key's newlines included, would span lines).
/// Told by shape, not by words: the server writes its contexts in its own
/// language (`lc_messages`).
fn nested_context(err: &tokio_postgres::Error) -> Vec<&str> {
    let Some(context) = err.as_db_error().and_then(|db| db.where_()) else {
        return Vec::new();
    };
    let mut lines: Vec<&str> = context.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.last().is_some_and(|last| lists_parameters(last)) {
        lines.pop();
    }
    lines
}

/// Whether a context line lists a statement's parameters: `$1 = '…'`, or
/// a bare `$1` at its end. A statement's text (`WHERE id = $1 FOR KEY
/// SHARE`, `VALUES ($1)`) has neither.
fn lists_parameters(line: &str) -> bool {
    line.split('$').skip(1).any(|after| {
        let rest = after.trim_start_matches(|c: char| c.is_ascii_digit());
        rest.len() < after.len() && (rest.trim_end().is_empty() || rest.starts_with(" = "))
    })
}

/// Whether a shared or permit statement's error came from the call itself
/// (binding or planning it: the error names no context of its own) or from
/// inside dlock's functions (`dlock_join_readers`, `dlock_take_permit_slot`,
/// named in its context), whose handlers give back what they took. Not so an
/// error of a DBA's trigger that runs at the statement's commit (a
/// deferred constraint trigger on the table of read phases), after the
/// function returned with its locks: its context names only the trigger.
pub(in crate::pg) fn raised_by_the_mode_call(err: &tokio_postgres::Error) -> bool {
    let context = nested_context(err);
    context.is_empty()
        || context.iter().any(|line| {
            line.contains("dlock_join_readers(") || line.contains("dlock_take_permit_slot(")
        })
}

/// True when the error came from a function or a statement run on a lock
/// statement's behalf (a DBA's trigger on the table of records, a foreign
/// key's check), not from the statement itself: it has a context of its
/// own ([`nested_context`]), which names them. The lock statements call no
/// function that runs SQL, so their own errors have none.
pub(in crate::pg) fn raised_by_a_trigger(err: &tokio_postgres::Error) -> bool {
    !nested_context(err).is_empty()
}

/// What a lock statement refused its token sequence for (see
/// `draw_token!` and [`REFUSED`]), if that is why it failed.
///
/// [`REFUSED`]: super::REFUSED
pub(in crate::pg) fn refused_sequence(err: &tokio_postgres::Error) -> Option<Unfit> {
    use tokio_postgres::error::SqlState;
    if err.code() != Some(&SqlState::INVALID_TEXT_REPRESENTATION) {
        return None;
    }
    let message = err.as_db_error()?.message();
    let reason = &message[message.find(REFUSED)? + REFUSED.len()..];
    Some(if reason.starts_with("the token sequence is far ahead") {
        Unfit::AheadOfClock
    } else {
        Unfit::Settings
    })
}

/// Reads what a recording statement ([`TRY_LOCK_RECORDING`],
/// [`FAIR_RECORD`]) says of its record: the time of the record it
/// wrote (`None`: it wrote none; the time now, if a DBA's trigger blanked
/// the row's), from the columns `since` (at `at`) and `wrote` (after it,
/// and after `already` when the statement has that column, `already`:
/// whose value comes second).
///
/// [`TRY_LOCK_RECORDING`]: super::TRY_LOCK_RECORDING
/// [`FAIR_RECORD`]: super::FAIR_RECORD
pub(in crate::pg) fn recorded_since(
    row: &tokio_postgres::Row,
    at: usize,
    already: Option<usize>,
) -> Result<(Option<std::time::SystemTime>, bool), tokio_postgres::Error> {
    let since: Option<std::time::SystemTime> = row.try_get(at)?;
    let held_already = match already {
        Some(column) => row.try_get(column)?,
        None => false,
    };
    let wrote: bool = row.try_get(already.unwrap_or(at) + 1)?;
    let since = wrote.then(|| since.unwrap_or_else(std::time::SystemTime::now));
    Ok((since, held_already))
}

/// Why a lock statement refused the token sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::pg) enum Unfit {
    /// `CACHE` above 1, `CYCLE`, or a non-positive increment.
    Settings,
    /// More than a day ahead of the server clock in microseconds.
    AheadOfClock,
}

/// Whether a lock statement ([`TRY_LOCK`], [`TRY_LOCK_RECORDING`]) that
/// failed left its session holding the key's lock.
///
/// [`TRY_LOCK`]: super::TRY_LOCK
/// [`TRY_LOCK_RECORDING`]: super::TRY_LOCK_RECORDING
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::pg) enum LockLeft {
    /// It failed before `pg_try_advisory_lock` ran.
    No,
    /// It failed in the token draw, which runs only once the lock was
    /// taken.
    Yes,
    /// The error does not say where it failed.
    Unknown,
}

/// Where a failed [`TRY_LOCK`] (or, `recording`, [`TRY_LOCK_RECORDING`])
/// stopped, from its error code.
///
/// [`TRY_LOCK`]: super::TRY_LOCK
/// [`TRY_LOCK_RECORDING`]: super::TRY_LOCK_RECORDING
pub(in crate::pg) fn lock_left_by(err: &tokio_postgres::Error, recording: bool) -> LockLeft {
    use tokio_postgres::error::SqlState;
    if recording {
        // It takes the session lock as its last step, after the draw and the
        // write, so their failures (the sequence refused or at its end) left
        // nothing held. But what a DBA hangs on the table of records runs
        // later still (an `AFTER` trigger, a deferred constraint trigger at
        // commit, a foreign key's check) and can fail the same ways: its
        // errors name the function or the statement they came from. A lock
        // waited for past `lock_timeout` may be one of the commit's, after
        // the last step, with no function named (a DBA's deferred unique
        // constraint checked against a row another transaction writes, the
        // lock of notifying commits a DBA's trigger needs). A cancel can
        // strike anywhere.
        return match err.code() {
            _ if raised_by_a_trigger(err) => LockLeft::Unknown,
            _ if unencodable(err) => LockLeft::No,
            _ if sequence_missing(err) => LockLeft::No,
            _ if refused_sequence(err).is_some() => LockLeft::No,
            Some(code) if *code == SqlState::SEQUENCE_GENERATOR_LIMIT_EXCEEDED => LockLeft::No,
            _ => LockLeft::Unknown,
        };
    }
    match err.code() {
        _ if unencodable(err) => LockLeft::No,
        // Planning names the sequence (a prepared statement is planned
        // again once it is dropped), so this is found before anything ran.
        _ if sequence_missing(err) => LockLeft::No,
        // The draw refused the sequence: it runs only once the lock is taken.
        _ if refused_sequence(err).is_some() => LockLeft::Yes,
        // Only the draw waits for a lock (`nextval` and `setval`, on the
        // sequence; `pg_try_advisory_lock` never waits), only it writes (a
        // read-only transaction, a hot standby), and only it reaches the
        // sequence's maximum.
        Some(code)
            if *code == SqlState::LOCK_NOT_AVAILABLE
                || *code == SqlState::READ_ONLY_SQL_TRANSACTION
                || *code == SqlState::SEQUENCE_GENERATOR_LIMIT_EXCEEDED =>
        {
            LockLeft::Yes
        }
        // A cancel or a statement timeout can strike anywhere, and a
        // missing privilege can be the schema's (planning) or the
        // sequence's (the draw).
        _ => LockLeft::Unknown,
    }
}

/// Whether `err` says that a parameter (the key, an identity) has a
/// character the server's encoding lacks: the server converts parameters
/// when it binds them, before the statement runs, so it took nothing.
pub(in crate::pg) fn unencodable(err: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    err.code().is_some_and(|code| {
        *code == SqlState::UNTRANSLATABLE_CHARACTER
            || *code == SqlState::CHARACTER_NOT_IN_REPERTOIRE
    })
}

#[cfg(test)]
mod tests {
    use super::lists_parameters;

    #[test]
    fn a_line_of_parameters_is_told_from_a_statements_text_in_any_language() {
        for line in [
            "unnamed portal parameter $1",
            "unnamed portal parameter $2 = '\u{e9}t\u{e9}'",
            "unnamed portal with parameters: $1 = '-58', $2 = '1796'",
            "unbenannter Portal-Parameter $1 = \u{bb}x\u{ab}",
        ] {
            assert!(lists_parameters(line), "{line}");
        }
        for line in [
            "PL/pgSQL function audit() line 1 at RAISE",
            "PL/pgSQL-Funktion audit() Zeile 1 bei RAISE",
            "SQL statement \"SELECT 1 FROM ONLY \"t\" x WHERE \"id\" = $1 FOR KEY SHARE OF x\"",
            "SQL statement \"INSERT INTO log VALUES ($1)\"",
            "costs $ 5",
        ] {
            assert!(!lists_parameters(line), "{line}");
        }
    }
}

//! The statements of shared locks and permits (see the `modes` module of
//! the backend): the setup that creates their table and functions, and the
//! attempts, marks and unlocks that call them.
//!
//! Its own file because these make and use schema objects that plain locks
//! never touch, created only on the first shared or permit attempt.

/// Creates the table of read phases and the three functions that make each
/// shared or permit attempt one statement: `modes.sql`, whose comments say
/// how and why. Its two token draws are `draw_token!`'s text written out (a
/// file holds no macro); a test keeps them equal.
pub(in crate::pg) const MODES_SETUP: &str = include_str!("modes.sql");

/// A shared attempt: one statement (see [`MODES_SETUP`]), sent only on a
/// session that holds nothing of the key. Returns the token (NULL:
/// refused) and whether a writer's mark refused it.
pub(in crate::pg) const TRY_SHARED: &str = "SELECT s.granted_token, s.marked FROM {schema}.dlock_join_readers($1::pg_catalog.text, $2::pg_catalog.int8) AS s";

/// Drops this process's shared hold of a key (its last reader left), of
/// phase token `$3`: the phase key first, so that once the key
/// itself is free no phase looks live (a reader that came after a writer
/// who took the key in between would otherwise be granted the old phase's
/// token, below the writer's), then the phase's token lock (see
/// [`MODES_SETUP`]), then the key.
pub(in crate::pg) const UNLOCK_SHARED: &str = "\
SELECT pg_catalog.pg_advisory_unlock_shared(pg_catalog.hashtextextended(
           'dlock-phase:'::pg_catalog.text OPERATOR(pg_catalog.||) $1::pg_catalog.text, $2::pg_catalog.int8)),
       pg_catalog.pg_advisory_unlock_shared(pg_catalog.hashtextextended(pg_catalog.concat(
           'dlock-phase-token:'::pg_catalog.text, $3::pg_catalog.int8, ':'::pg_catalog.text, $1::pg_catalog.text),
           $2::pg_catalog.int8)),
       pg_catalog.pg_advisory_unlock_shared(pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8))";

/// Leaves or refreshes a writer-waiting mark while readers hold (rule
/// M3); answers whether readers hold.
pub(in crate::pg) const MARK: &str = "SELECT {schema}.dlock_mark($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.text, $4::pg_catalog.int8)";

/// Whether a writer's mark on the key is live: a reader of this process
/// that joins the read phase it holds (see the `modes` module) asks this
/// instead of the server's locks, so a stream of such readers does not
/// starve a waiting writer of another process (rule M3).
pub(in crate::pg) const MARKED: &str = "\
SELECT EXISTS (SELECT FROM {schema}.dlock_phases AS t
               WHERE t.lock_id OPERATOR(pg_catalog.=) pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8)
                 AND t.mark_until OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp())";

/// Removes `owner`'s writer-waiting mark, if it is the key's mark.
pub(in crate::pg) const UNMARK: &str = "\
UPDATE {schema}.dlock_phases SET mark_owner = NULL, mark_until = NULL
WHERE lock_id OPERATOR(pg_catalog.=) pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8)
  AND mark_owner OPERATOR(pg_catalog.=) $3::pg_catalog.text";

/// A permit attempt: every slot tried in one statement (see
/// [`MODES_SETUP`]). Returns the slot and the token, both NULL if every
/// slot is held.
pub(in crate::pg) const TRY_PERMIT: &str = "\
SELECT s.granted_slot, s.granted_token
FROM {schema}.dlock_take_permit_slot($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.int4, $4::pg_catalog.int4[]) AS s";

/// Drops a permit slot's lock (see [`MODES_SETUP`]).
pub(in crate::pg) const UNLOCK_PERMIT: &str = "\
SELECT pg_catalog.pg_advisory_unlock(pg_catalog.hashtextextended(pg_catalog.concat(
    'dlock-permit:'::pg_catalog.text, $3::pg_catalog.int4, ':'::pg_catalog.text, $1::pg_catalog.text), $2::pg_catalog.int8))";

/// Whether the functions of [`MODES_SETUP`] exist: a refused writer leaves
/// a mark only where shared locks are in use.
pub(in crate::pg) const MODES_EXIST: &str = "SELECT pg_catalog.to_regprocedure(\
'{schema}.dlock_mark(pg_catalog.text,pg_catalog.int8,pg_catalog.text,pg_catalog.int8)'::pg_catalog.text) IS NOT NULL";

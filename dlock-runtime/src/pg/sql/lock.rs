//! The exclusive lock on a lock session: the session's setup, the
//! attempt that takes a key and draws its token, the unlocks, the
//! server-side wait for a release, and the same lock inside a caller's
//! transaction ([`TransactionLock`](crate::pg::TransactionLock)).
//!
//! Its own file because these are what every plain acquisition sends, with
//! [`TRY_LOCK`]'s proof of why the tokens of one key rise strictly.

/// Takes the session advisory lock of a key and, only if it was taken, draws
/// the fencing token (see `draw_token!`). One statement, so the token comes
/// back in the same round trip as the lock and no token is ever drawn for a
/// lock that was not taken: `CASE` evaluates the draw only after
/// `pg_try_advisory_lock` returned true. The sequence is not transactional,
/// so a value once drawn is never drawn again, whatever happens to the
/// transaction. Returns the advisory key and `{token, clock}` (NULL: held
/// by someone else), the clock the draw read in microseconds: until the
/// token's lead over it has passed, the backend sends [`TRY_LOCK_QUICK`]
/// instead (see `quick::QuickDraw`).
///
/// The statement's own transaction commits asynchronously
/// (`synchronous_commit` off for the whole lock session, see
/// `SESSION_DEFAULTS`). `setval` writes WAL and takes a transaction id (once per
/// lead, or at nearly every draw without one), so a synchronous commit
/// would wait for a WAL flush on those locks. Safe here, because the
/// commit protects nothing but the sequence's position: the advisory lock
/// is not logged, and a crash that loses the last `setval`s (or
/// `nextval`s) leaves the sequence *behind* tokens already handed out —
/// exactly the sequence going back that the clock floor covers (a server
/// takes far longer than the 10 ms lead to come back). Only on
/// the sessions the backend owns: a [`TransactionLock`](crate::pg::TransactionLock)
/// draws in the caller's transaction, whose durability is the caller's.
///
/// Why the tokens of one key rise strictly:
///
/// 1. A token is a value its own statement drew or wrote: `nextval` when
///    the clock is not past it, else the clock plus the lead, which it
///    writes — never what the sequence holds afterwards.
/// 2. Acquisitions of one key are serialised by its advisory lock, and the
///    draw comes after the lock is taken. A holder lets go only by a later
///    statement or by its session ending, so the next holder's `nextval`
///    and clock reading come after the previous holder's statement ended,
///    `setval` included.
/// 3. When that statement ended the sequence held at least its token (the
///    token was `nextval`'s value, or the value it `setval`ed), so the next
///    holder's `nextval` is above it, whatever the clock does. A `setval`
///    of another key's statement cannot lower the sequence in between:
///    every draw holds the draw lock from before its `nextval` to its
///    end, a draw that may write exclusively (see `draw_token!`), so no
///    `nextval` lands between a writer's `nextval` and its `setval`, and
///    the write (the clock plus the lead, the sequence being behind the
///    clock) is above every value drawn before it.
/// 4. The clock is `clock_timestamp()`, read then — not `now()`, the start
///    of the transaction, which for a waiting `XACT_LOCK` lies before the
///    previous holder let go. Between two holders' readings lie at least an
///    unlock and a lock, round trips of their own, so if the clock does not
///    go back the next holder reads a strictly later microsecond. No token
///    is above the clock plus the lead at its draw (from the sequence only
///    while the sequence is at or below that, unless tokens come faster
///    than one a microsecond), and a draw that finds the sequence behind
///    hands out its own clock plus the lead: above every earlier token —
///    which is what carries tokens when the sequence was set back, lost or
///    recreated.
///
/// Why a draw writes the sequence whenever it is behind the clock: the
/// sequence must hold the last token, or a clock stepped back would lower
/// tokens. With the lead (10 ms on a sequence dlock creates, see
/// `token_lead!`) that write moves the sequence 10 ms ahead, and the draws
/// of those 10 ms take `nextval` and write nothing, which is why the lead
/// also moves the floor up by as much: a token from the sequence is up to
/// the lead above the clock, so the floor after a loss must be too. A
/// write costs WAL and a transaction id (with an asynchronous commit, no
/// flush); with the lead it comes about once per half lead per busy
/// server (see `draw_token!`) instead of at nearly every draw. The rest of the draw (the clock reading, the
/// settings check, the privilege check) costs little beside the advisory
/// lock itself, written without subqueries (see `draw_token!`). A sequence a DBA made `UNLOGGED`
/// (PostgreSQL 15+) writes no WAL and keeps every rule above while the
/// server runs, but a crash or a failover resets it: a counter lost more
/// often, see docs/postgres.md ("What a token costs").
///
/// So a lower token needs two faults at once: the sequence behind the
/// key's last token (set back or lost) *and*
/// that token ahead of the server clock plus the lead: the clock stepped
/// back past it, a DBA `setval`ed the sequence ahead of the clock (by less
/// than the day the draw allows, or, with a lead, set it back to a value
/// less than the lead above the clock) and tokens were drawn from it
/// before it went back, or, after a failover, a new primary's clock is
/// behind the old one's by more than the failover took; or a role without
/// UPDATE on the sequence and a clock that steps back. A process of a
/// dlock without the draw lock writes out of order with a leading one:
/// the lead is switched on only where none draws (see `token_lead!`). A
/// process of a dlock from before every draw took the draw lock draws
/// without it, so a write can still land below its `nextval` (rule 3)
/// until every process draws under it (docs/postgres.md, "Rolling
/// upgrades").
pub const TRY_LOCK: &str = concat!(
    "SELECT k.h, CASE WHEN pg_catalog.pg_try_advisory_lock(k.h) THEN (",
    draw_token!("ARRAY[", ", t.clock]"),
    ") END
FROM (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k"
);

/// [`TRY_LOCK`] with the quick draw (`quick_draw!`), what a lock session
/// sends while its backend's last draw left the sequence ahead of the
/// clock by more than the time since (see `quick::QuickDraw`). Returns
/// the advisory key and `{token}` (NULL: held by someone else), or `{0}`
/// when the sequence was not fit for the quick draw after all: the statement
/// then gave the lock back at once (`COALESCE` evaluates its second
/// argument only when the first is NULL), held for no longer than its own
/// execution, and the backend sends [`TRY_LOCK`]. A token is never 0: one
/// from here is at or above the clock in microseconds. The `nextval` it
/// drew for nothing is a value skipped.
pub const TRY_LOCK_QUICK: &str = concat!(
    "SELECT k.h, CASE WHEN pg_catalog.pg_try_advisory_lock(k.h) THEN ARRAY[COALESCE((",
    quick_draw!(),
    "), CASE WHEN pg_catalog.pg_advisory_unlock(k.h) THEN 0::pg_catalog.int8 END)] END
FROM (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k"
);

/// [`TRY_LOCK`] for a lease without an identity whose holder is named
/// rather than recorded (see `NAME_LEASE`): once the token is drawn, the
/// session also takes its two token marks (see `token_mark_a!`,
/// `token_mark_b!`), shared, for as long as it holds the key. So the token
/// is in `pg_locks` beside the lock, for readers in other processes
/// (`Backend::holder`, `held`) and for a force release that names the
/// lease, and taking the lock writes nothing: no row, no WAL beyond the
/// draw's own, no transaction id. A mark costs the server one more entry
/// in its lock table while the lease lives (see `names::MAX_MARKED`).
///
/// The marks are tried (`pg_try_advisory_lock_shared`), never waited for:
/// only another client's exclusive lock on the very same pair of numbers
/// refuses one. A lease has both marks or neither: the second is tried
/// only once the first is taken, and the first is dropped again if the
/// second is refused, so a lease that could not mark itself reads with no
/// token. One `CASE` (`token_marks!`). Not subqueries: the server builds the executor
/// state of every subquery of a plan at each execution, and three of them
/// cost a named lock about a tenth of its server time. Returns the
/// advisory key and `{token, marks, clock}`: whether the marks were taken
/// (1 or 0; the release drops them only if they were), and the clock the
/// draw read, as [`TRY_LOCK`].
///
/// A reader believes a token only when it finds exactly one mark of each
/// half for the key on the session holding it. Both or neither is what
/// keeps another lease's mark from posing as one of this lease's beside
/// its own: two keys of one session whose marks share a half find two
/// rows of that half, and read as unknown. A lease with no marks could
/// find other leases' marks in both halves (two keys of its session whose
/// `classid`s are its own, which a known key seed lets one choose): so a
/// lease whose marks were refused gives its lock back at once, and is
/// taken again with a record (`TRY_LOCK_RECORDING`), which readers and
/// the force release believe over marks. A mark left over (a failed
/// statement, after which the marks are dropped, or the session takes no
/// new lock) makes the token unknown, never another lease's.
pub const TRY_LOCK_NAMED: &str = concat!(
    "SELECT k.h, CASE WHEN pg_catalog.pg_try_advisory_lock(k.h) THEN (
    SELECT ARRAY[d.token, ",
    token_marks!("k.h", "d.token"),
    ", d.clock]
    FROM (",
    draw_token!("", ", t.clock"),
    " OFFSET 0) AS d(token, clock)) END
FROM (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k"
);

/// [`TRY_LOCK_NAMED`] with the quick draw, as [`TRY_LOCK_QUICK`] is
/// [`TRY_LOCK`]: the marks are taken only beside a token, and when the
/// sequence was not fit for the quick draw the statement gives the lock
/// back at once and answers `{0,0}`, having taken no mark.
pub const TRY_LOCK_NAMED_QUICK: &str = concat!(
    "SELECT k.h, CASE WHEN pg_catalog.pg_try_advisory_lock(k.h) THEN (
    SELECT CASE WHEN d.token IS NOT NULL THEN ARRAY[d.token, ",
    token_marks!("k.h", "d.token"),
    "]
                WHEN pg_catalog.pg_advisory_unlock(k.h) THEN ARRAY[0::pg_catalog.int8, 0::pg_catalog.int8] END
    FROM (",
    quick_draw!(),
    " OFFSET 0) AS d(token)) END
FROM (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k"
);

/// Drops this session's token marks of the key `$1` (with its key seed
/// `$2`; see
/// [`TRY_LOCK_NAMED`]), whatever their tokens: sent after a named lock
/// statement failed, which may have taken them after its lock, under the
/// same claim as the undo of its lock, and only when no other lease or
/// statement of the session has a key whose marks share a `classid` with
/// these (see `Claims::marks_collide`). A mark's numbers are read back
/// from `pg_locks` as unsigned, and turned into the `int4`s they were.
pub(in crate::pg) const UNDO_MARKS: &str = concat!(
    "SELECT pg_catalog.count(pg_catalog.pg_advisory_unlock_shared(
    (m.classid::pg_catalog.int8 - CASE WHEN m.classid::pg_catalog.int8 >= 2147483648::pg_catalog.int8
                                        THEN 4294967296::pg_catalog.int8 ELSE 0::pg_catalog.int8 END)::pg_catalog.int4,
    (m.objid::pg_catalog.int8 - CASE WHEN m.objid::pg_catalog.int8 >= 2147483648::pg_catalog.int8
                                      THEN 4294967296::pg_catalog.int8 ELSE 0::pg_catalog.int8 END)::pg_catalog.int4))
FROM pg_catalog.pg_locks AS m,
     (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k
WHERE ",
    held_mark!("pg_catalog.pg_backend_pid()"),
    "
  AND m.classid::pg_catalog.int8 IN (",
    mark_class_a!("k.h"),
    ", ",
    mark_class_b!("k.h"),
    ")"
);

/// Drops a named lease's lock and its token marks (see [`TRY_LOCK_NAMED`]):
/// `$1` the advisory key, `$2` the token, `$3` whether its marks were
/// taken. Behind the key's release gate, as [`UNLOCK_GATED`], unless `$4`
/// is false: sent so when the gate was held past the session's
/// `lock_timeout`, or could not be taken for want of room in the server's
/// lock table (see `Inner::unlock_behind_gate`). The order of the drops
/// does not matter to a reader: marks without the lock are nobody's, and
/// the lock without its marks reads with no token. Both marks are dropped
/// in an array, which evaluates both (an `AND` could skip the second).
pub const UNLOCK_NAMED: &str = concat!(
    "SELECT pg_catalog.pg_advisory_unlock(g.h),
       CASE WHEN $3::pg_catalog.bool THEN ARRAY[",
    token_mark_a!("pg_catalog.pg_advisory_unlock_shared", "g.h", "g.t"),
    ", ",
    token_mark_b!("pg_catalog.pg_advisory_unlock_shared", "g.h", "g.t"),
    "] END
FROM (SELECT $1::pg_catalog.int8 AS h, $2::pg_catalog.int8 AS t,
             CASE WHEN $4::pg_catalog.bool THEN pg_catalog.pg_advisory_xact_lock_shared(",
    release_gate!("$1::pg_catalog.int8"),
    ") END AS gate
      OFFSET 0) AS g"
);

/// Drops one session advisory lock of this session. Only the session that
/// took a lock can drop it, and the backend checks the lease's owner in
/// process before sending this on the session that holds it, so owner check
/// and release cannot interleave with another owner's acquisition.
pub const UNLOCK: &str = "SELECT pg_catalog.pg_advisory_unlock($1::pg_catalog.int8)";

/// [`UNLOCK`] behind the key's release gate (see `release_gate!`), taken
/// shared until the statement ends: what a session that records holders
/// sends, so a force release naming one of its leases never ends it just
/// after the lease was let go. `OFFSET 0` keeps the gate's subquery from
/// being merged into the unlock, so the gate is taken first.
pub const UNLOCK_GATED: &str = concat!(
    "SELECT pg_catalog.pg_advisory_unlock(g.h)
FROM (SELECT $1::pg_catalog.int8 AS h,
             pg_catalog.pg_advisory_xact_lock_shared(",
    release_gate!("$1::pg_catalog.int8"),
    ") AS gate
      OFFSET 0) AS g"
);

/// Drops one hold of a key's advisory lock by the key itself (its hash
/// computed on the server): sent only to undo a lock statement that failed
/// after it may have taken the lock, when no other lease of the session
/// holds the same hash (see `undo_failed_lock`).
pub(in crate::pg) const UNLOCK_KEY: &str = "SELECT pg_catalog.pg_advisory_unlock(\
pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8))";

/// Drops every advisory lock of a session. Sent only on wait sessions, which
/// hold nothing else: it clears a shared lock granted in the very instant
/// `lock_timeout` fired (the statement then fails, but a session-level lock
/// survives the failed statement).
pub(in crate::pg) const UNLOCK_ALL: &str = "SELECT pg_catalog.pg_advisory_unlock_all()";

/// The server-side wait: queues for a *shared* lock on the key, which is
/// granted the moment the exclusive holder lets go — by release, by the
/// backend's ttl enforcement, or because its session died — and drops it in
/// the same statement. `OFFSET 0` keeps the subquery (which waits) from being
/// merged into the outer query (which unlocks), so the order is fixed.
/// Bounded by the session's `lock_timeout`.
pub(in crate::pg) const WAIT_FOR_RELEASE: &str = "\
SELECT pg_catalog.pg_advisory_unlock_shared(w.h)
FROM (SELECT k.h, pg_catalog.pg_advisory_lock_shared(k.h)
      FROM (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k
      OFFSET 0) AS w";

/// Sets up a lock session and returns its server process id and when the
/// session started (`backend_start`: with the pid, what names the session
/// beside an identity record, see [`TRY_LOCK_RECORDING`]).
///
/// `idle_session_timeout` (`$1`, milliseconds as text, or NULL to leave
/// the server's setting alone) makes the server end a lock session that
/// has sent nothing for this long: a holder process that is frozen or cut
/// off then loses its locks on the server's side too. PostgreSQL 14 added
/// the setting; older servers skip it.
///
/// Last, the advisory key of the probe `$2` with the seed `$3`, which the
/// session compares with its own hash, and whether the server's encoding
/// is UTF-8 (see `hash`).
///
/// [`TRY_LOCK_RECORDING`]: super::TRY_LOCK_RECORDING
pub(in crate::pg) const LOCK_SESSION_SETUP: &str = "\
SELECT pg_catalog.pg_backend_pid(),
       (SELECT a.backend_start
        FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) AS a),
       CASE WHEN $1::pg_catalog.text IS NOT NULL
             AND pg_catalog.current_setting('server_version_num'::pg_catalog.text)::pg_catalog.int4
                 >= 140000::pg_catalog.int4
            THEN pg_catalog.set_config('idle_session_timeout'::pg_catalog.text, $1::pg_catalog.text, false)
       END,
       pg_catalog.hashtextextended($2::pg_catalog.text, $3::pg_catalog.int8),
       pg_catalog.current_setting('server_encoding'::pg_catalog.text) OPERATOR(pg_catalog.=) 'UTF8'::pg_catalog.text";

/// Transaction-scoped, no wait: takes the transaction advisory lock.
/// Returns whether it was taken; the token is drawn next, by
/// [`DRAW_IN_SAVEPOINT`], before the caller sees the lock, so the
/// argument of [`TRY_LOCK`] for rising tokens holds word for word (the
/// lock is let go by the caller's COMMIT or ROLLBACK, a later message).
pub(in crate::pg) const XACT_TRY_LOCK: &str = "SELECT pg_catalog.pg_try_advisory_xact_lock(
    pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8))";

/// Transaction-scoped, waiting under `lock_timeout` (set just before, inside
/// a savepoint). Should the lock be granted in the instant the timeout
/// fires, the statement still fails, and rolling back to the savepoint
/// drops the lock it took. The token is drawn next, by
/// [`DRAW_IN_SAVEPOINT`], with the clock read after the wait (see
/// [`TRY_LOCK`]).
pub(in crate::pg) const XACT_LOCK: &str = "SELECT pg_catalog.pg_advisory_xact_lock(
    pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8))::pg_catalog.text";

/// The draw of a transaction lock, sent as one simple query in the
/// caller's transaction, after its lock: `draw_token!` in a savepoint that the same message
/// rolls back, which gives the draw lock back before the server answers
/// (the `setval` stays: a sequence is not transactional). So the draw lock
/// is held for the draw alone, however long the caller's transaction, and
/// even if the caller stops waiting for the answer. Its only row is the
/// token. The draw lock is waited for 1 s at most, whatever the caller's
/// `lock_timeout` (0, no bound, by default): it is held for a draw alone,
/// so a longer wait means something else holds it. Should the draw fail,
/// the rest of the message is skipped and the backend rolls back the
/// savepoint of the lock, which holds this one.
pub(in crate::pg) const DRAW_IN_SAVEPOINT: &str = concat!(
    "SAVEPOINT dlock_draw; SET LOCAL lock_timeout = '1s'; ",
    draw_token!(),
    "; ROLLBACK TO SAVEPOINT dlock_draw; RELEASE SAVEPOINT dlock_draw"
);

/// Sets `lock_timeout` for the rest of the (sub)transaction and returns the
/// value it had, to be put back once the lock is taken.
pub(in crate::pg) const XACT_SWAP_LOCK_TIMEOUT: &str = "\
SELECT s.prev, pg_catalog.set_config('lock_timeout'::pg_catalog.text, $1::pg_catalog.text, true)
FROM (SELECT pg_catalog.current_setting('lock_timeout'::pg_catalog.text) AS prev OFFSET 0) AS s";

/// Sets `lock_timeout` for the rest of the transaction (milliseconds, as
/// text): puts it back after a transaction lock, and lets the creation of
/// the schema objects wait longer than a lock session's statements.
pub(in crate::pg) const SET_LOCAL_LOCK_TIMEOUT: &str =
    "SELECT pg_catalog.set_config('lock_timeout'::pg_catalog.text, $1::pg_catalog.text, true)";

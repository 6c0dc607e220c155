//! Every statement the PostgreSQL backend sends, one named constant a step.
//!
//! `{schema}` stands for the quoted schema name set by
//! [`PgOptions::schema`](super::PgOptions::schema) and is filled in once, at
//! connect time, from a validated identifier: keys are never part of the SQL
//! text, they are bound parameters (or, in the one statement sent as a
//! simple query, [`REWRITE_RECORDS`], hex digits the server decodes).
//!
//! # Names are never looked up on the search path
//!
//! A role with CREATE on a schema of the search path (`public`, before
//! PostgreSQL 15, for every role) can define `public.nextval(text)`: an
//! untyped literal argument prefers it to `pg_catalog.nextval(regclass)`,
//! and a `search_path` that names `public` before `pg_catalog` prefers even
//! a function or operator with dlock's exact argument types. It would then
//! run, as the lock role, in every statement, and choose the tokens, the
//! locks and the fence's verdict. So every function is written
//! `pg_catalog.<name>`, every literal and parameter carries its exact type
//! (`'…'::pg_catalog.regclass`, `$1::pg_catalog.text`), relations are
//! qualified, and the statements that run in the caller's transaction
//! ([`XACT_TRY_LOCK`], [`XACT_LOCK`], the PostgreSQL fence), under the
//! caller's `search_path`, write operators as `OPERATOR(pg_catalog.<=)`.
//! `greatest`, `CASE`, `COALESCE` and `EXTRACT` are grammar, not names
//! looked up (`EXTRACT` calls `pg_catalog.extract`, or `date_part`
//! before PostgreSQL 14), and `bigint` is a keyword for `pg_catalog.int8`.
//! On its own sessions the backend sets `search_path` to `pg_catalog,
//! pg_temp` when they open ([`SESSION_DEFAULTS`]) as well, which also
//! overrides an `ALTER ROLE … SET search_path`.
//!
//! Over 700 lines: every SQL statement of the backend with the proof of its
//! order, in one place so a reviewer reads them side by side; the redesign of
//! the PostgreSQL backend removes the recording statements.

/// Settings of every connection the backend opens, sent first: the search
/// path (see the module docs; `pg_temp` last, so a temporary table cannot
/// shadow a relation either), and how long a statement may wait for a lock
/// (`$1`, milliseconds as text).
///
/// On a lock session the wait is below the liveness interval. `nextval`
/// and `setval` wait for an `ALTER SEQUENCE` or a `DROP` left open in
/// another transaction; without a bound the lock statement would wait as
/// long as that transaction, the session's liveness ping would queue
/// behind it and get no answer in time, and the session would be ended
/// with every lease on it. With it the statement fails fast, with an error
/// that says why. Set before the session's setup too, which reads the
/// sequence's position (and so waits for the same lock).
///
/// And read committed, whatever isolation a DBA set for the role or the
/// database: a shared attempt that joins a read phase reads its token
/// with a snapshot taken after it waited for the phase's start (see
/// [`MODES_SETUP`]), which a snapshot held from the statement's start
/// would not see.
pub(super) const SESSION_DEFAULTS: &str = "\
SELECT pg_catalog.set_config('search_path'::pg_catalog.text, 'pg_catalog, pg_temp'::pg_catalog.text, false),
       pg_catalog.set_config('lock_timeout'::pg_catalog.text, $1::pg_catalog.text, false),
       pg_catalog.set_config('default_transaction_isolation'::pg_catalog.text, 'read committed'::pg_catalog.text, false)";

/// The advisory key of a lock key: `hashtextextended(key, seed)`, the 64-bit
/// text hash PostgreSQL itself uses for hash partitioning, so it is stable
/// across releases and any client in any language computes the same lock.
/// Shown in the docs and used by the statements below.
pub(super) const ADVISORY_KEY: &str =
    "SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8)";

/// Whether the row a recording lock statement's upsert returned
/// (`recorded`) is the one it meant to write, value by value: the key's
/// advisory key, key, token (twice), session and its start, identity and
/// holder, from the statement's parameters (`$1` key, `$3` identity, `$4`
/// session start, `$5` holder) and the draw `t`. A `BEFORE` trigger that
/// kept or changed the row is caught here.
macro_rules! wrote_row {
    () => {
        "recorded.lock_id OPERATOR(pg_catalog.=) t.h
                     AND recorded.key OPERATOR(pg_catalog.=) $1::pg_catalog.text
                     AND recorded.token OPERATOR(pg_catalog.=) t.token
                     AND recorded.holder_token OPERATOR(pg_catalog.=) t.token
                     AND recorded.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()
                     AND recorded.session_start OPERATOR(pg_catalog.=) $4::pg_catalog.timestamptz
                     AND recorded.identity IS NOT DISTINCT FROM $3::pg_catalog.text
                     AND recorded.holder IS NOT DISTINCT FROM $5::pg_catalog.text"
    };
}

/// Draws a fencing token once the lock is taken, for the three lock
/// statements below: `greatest(nextval, clock)`, the clock being the
/// server's `clock_timestamp()` in microseconds since 1970 — the Redis
/// backend's rule, and the same two guarantees as there:
///
/// - The clock floor keeps tokens above every token handed out before when
///   the sequence goes back: a DBA drops and recreates it or `setval`s it,
///   a failover to an asynchronous replica or a point-in-time restore
///   brings back an older copy, a crash loses its last moves.
/// - The sequence holds at least the last token, so a server clock that
///   steps back cannot lower tokens: whenever the clock wins, the same
///   statement `setval`s the sequence to it (the token) — if the role has
///   UPDATE on it, which the second `WHEN` asks only then. Without UPDATE
///   tokens rest on the clock alone. `setval` returns the value it set, so
///   every branch yields `greatest(seq, clock)`.
///
/// Before all that, the draw refuses (fails the statement, which takes back
/// the lock it took: see [`REFUSED`]) a sequence that cannot keep tokens
/// rising, as a lock session refuses one when it opens: one a DBA altered
/// while services run to `CACHE` above 1 (sessions draw from blocks of
/// their own, so tokens interleave), `CYCLE` or a non-positive increment,
/// or one more than a day ahead of the clock, whose tokens rest on the
/// sequence alone (set ahead, or the server clock stepped back by that
/// much), so that losing it would send tokens back. Checked in the
/// statement that draws, so no acquisition ever uses such a sequence,
/// whether it came by a [`TransactionLock`](super::TransactionLock) (which
/// has no session of its own to check on) or on a lock session opened
/// before the change. The check reads `pg_sequence`'s row of the sequence
/// by its unique index.
///
/// `$extra` is a further column of the innermost subquery, evaluated with
/// `nextval` (the lock sessions' statement makes its commit asynchronous
/// there, see [`TRY_LOCK`]); `$after` is the row source the draw must come
/// after. `OFFSET 0` keeps each subquery from being merged into the next
/// (and the planner keeps a volatile column it does not need), so the
/// order is fixed: the lock (the caller's `CASE`, or `$after`), then
/// `nextval`, then the clock reading, then `setval`.
macro_rules! draw_token {
    ($extra:literal, $after:literal) => {
        concat!(
            "SELECT CASE WHEN t.seq OPERATOR(pg_catalog.>) (t.clock OPERATOR(pg_catalog.+) 86400000000::pg_catalog.int8)
            THEN pg_catalog.int8in(pg_catalog.textout(pg_catalog.concat(
                     'dlock-refused: the token sequence is far ahead of the clock: '::pg_catalog.text,
                     t.seq, ' at '::pg_catalog.text, t.clock)))
            WHEN EXISTS (SELECT FROM pg_catalog.pg_sequence AS q
                         WHERE q.seqrelid OPERATOR(pg_catalog.=)
                               '{schema}.dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid
                           AND ((q.seqcache OPERATOR(pg_catalog.<>) 1::pg_catalog.int8) OR q.seqcycle
                                OR (q.seqincrement OPERATOR(pg_catalog.<=) 0::pg_catalog.int8)))
            THEN pg_catalog.int8in(pg_catalog.textout(pg_catalog.concat(
                     'dlock-refused: the token sequence has unfit settings: '::pg_catalog.text,
                     t.seq)))
            WHEN t.clock OPERATOR(pg_catalog.<=) t.seq THEN t.seq
            WHEN pg_catalog.has_sequence_privilege(
                     '{schema}.dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid,
                     'UPDATE'::pg_catalog.text)
            THEN pg_catalog.setval('{schema}.dlock_token_seq'::pg_catalog.regclass, t.clock)
            ELSE t.clock END
FROM (SELECT s.seq,
             (EXTRACT(epoch FROM pg_catalog.clock_timestamp())
              OPERATOR(pg_catalog.*) 1000000::pg_catalog.int8)::pg_catalog.int8 AS clock
      FROM (SELECT pg_catalog.nextval('{schema}.dlock_token_seq'::pg_catalog.regclass) AS seq",
            $extra,
            " ",
            $after,
            " OFFSET 0) AS s OFFSET 0) AS t"
        )
    };
}

/// The mark of a draw that refused its sequence (see `draw_token!`): the
/// statement fails with `invalid input syntax for type bigint` on a text
/// that starts with this, and the backend turns that into an error naming
/// the problem and its fix (`sequence::refusal`). The text is built from
/// the row (`concat` with the drawn value), so the planner cannot fold the
/// failing call into a constant and fail every statement while planning.
pub(super) const REFUSED: &str = "dlock-refused: ";

/// Takes the session advisory lock of a key and, only if it was taken, draws
/// the fencing token (see `draw_token!`). One statement, so the token comes
/// back in the same round trip as the lock and no token is ever drawn for a
/// lock that was not taken: `CASE` evaluates the draw only after
/// `pg_try_advisory_lock` returned true. The sequence is not transactional,
/// so a value once drawn is never drawn again, whatever happens to the
/// transaction. Returns the advisory key and the token (NULL: held by
/// someone else).
///
/// The statement's own transaction commits asynchronously
/// (`synchronous_commit` off for this transaction only, set before it
/// commits). `setval` writes WAL and takes a transaction id, and almost
/// every draw `setval`s (the clock has moved on since the last one), so a
/// synchronous commit would wait for a WAL flush on every lock. Safe here,
/// because the commit protects nothing but the sequence's position: the
/// advisory lock is not logged, and a crash that loses the last `setval`s
/// (or `nextval`s) leaves the sequence *behind* tokens already handed out
/// — exactly the sequence going back that the clock floor covers. Only on
/// the sessions the backend owns: a [`TransactionLock`](super::TransactionLock)
/// draws in the caller's transaction, whose durability is the caller's.
///
/// Why the tokens of one key rise strictly:
///
/// 1. A token is the `greatest` of the two values its own statement read,
///    never what the sequence holds afterwards.
/// 2. Acquisitions of one key are serialised by its advisory lock, and the
///    draw comes after the lock is taken. A holder lets go only by a later
///    statement or by its session ending, so the next holder's `nextval`
///    and clock reading come after the previous holder's statement ended,
///    `setval` included.
/// 3. When that statement ended the sequence held at least its token (the
///    token was `nextval`'s value, or the clock it `setval`ed), so the next
///    holder's `nextval` is above it, whatever the clock does. A `setval`
///    of another key's statement can lower the sequence in between only if
///    that statement overlapped this one: its `nextval` came first and its
///    `setval`, of a clock reading below this token, lands after. (A
///    statement that starts later draws a `nextval` above the sequence, so
///    a clock reading that beats it is above the token too.) That clock
///    reading is below the token by at most the overlap — microseconds,
///    unless a server process is descheduled right between its reading and
///    its `setval` — or by how far the sequence ran ahead of the clock,
///    which it does only while tokens are drawn faster than one a
///    microsecond, by that burst's excess.
/// 4. The clock is `clock_timestamp()`, read then — not `now()`, the start
///    of the transaction, which for a waiting `XACT_LOCK` lies before the
///    previous holder let go. Between two holders' readings lie at least an
///    unlock and a lock, round trips of their own, so if the clock does not
///    go back the next holder reads a strictly later microsecond, and its
///    token is above every previous one that came from the clock — which
///    is what carries tokens when the sequence was set back, lost or
///    recreated, or moved down by the race in 3.
///
/// So a lower token needs two faults at once: the sequence behind the
/// key's last token (set back, lost, or that race) *and* that token ahead
/// of the server clock: the clock stepped back past it, a DBA `setval`ed
/// the sequence ahead of the clock (by less than the day the draw allows)
/// and tokens were drawn from it before it went back, or, after a
/// failover, a new primary's clock is behind the old one's by more than
/// the failover took; or a role without UPDATE on the sequence and a
/// clock that steps back.
pub const TRY_LOCK: &str = concat!(
    "SELECT k.h, CASE WHEN pg_catalog.pg_try_advisory_lock(k.h) THEN (",
    draw_token!(
        ", pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, true)
              AS commit_mode",
        ""
    ),
    ") END
FROM (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k"
);

/// Drops one session advisory lock of this session. Only the session that
/// took a lock can drop it, and the backend checks the lease's owner in
/// process before sending this on the session that holds it, so owner check
/// and release cannot interleave with another owner's acquisition.
pub const UNLOCK: &str = "SELECT pg_catalog.pg_advisory_unlock($1::pg_catalog.int8)";

/// The two `int4` halves of a key's *release gate*, from its advisory key
/// `h` (an SQL expression): the bitwise complement of each half, in the
/// `(int4, int4)` form (`objsubid` 2, never one of dlock's keys). The
/// complement is never the `rewriting` mark's pair of the same key (a
/// number is never its own complement), so a gate never waits for a fair
/// waiter's mark.
///
/// A session that may hold a recorded lease takes its key's gate *shared*
/// for the length of each statement that drops the key's lock
/// ([`UNLOCK_GATED`], [`UNLOCK_RECORDED`]); a force release that names a
/// lease takes it *exclusively* for its whole transaction
/// ([`RELEASE_GATE`]). While the force release holds it, the session
/// holding the key cannot let go of it, so what the force release read of
/// that session and its record is still so when it ends the session.
macro_rules! release_gate {
    ($h:literal) => {
        concat!(
            "(OPERATOR(pg_catalog.~) (",
            $h,
            " OPERATOR(pg_catalog.>>) 32::pg_catalog.int4))::pg_catalog.int4,
             (OPERATOR(pg_catalog.~) ((",
            $h,
            " OPERATOR(pg_catalog.<<) 32::pg_catalog.int4) OPERATOR(pg_catalog.>>) 32::pg_catalog.int4))::pg_catalog.int4"
        )
    };
}

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
pub(super) const UNLOCK_KEY: &str = "SELECT pg_catalog.pg_advisory_unlock(\
pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8))";

/// Drops every advisory lock of a session. Sent only on wait sessions, which
/// hold nothing else: it clears a shared lock granted in the very instant
/// `lock_timeout` fired (the statement then fails, but a session-level lock
/// survives the failed statement).
pub(super) const UNLOCK_ALL: &str = "SELECT pg_catalog.pg_advisory_unlock_all()";

/// The server-side wait: queues for a *shared* lock on the key, which is
/// granted the moment the exclusive holder lets go — by release, by the
/// backend's ttl enforcement, or because its session died — and drops it in
/// the same statement. `OFFSET 0` keeps the subquery (which waits) from being
/// merged into the outer query (which unlocks), so the order is fixed.
/// Bounded by the session's `lock_timeout`.
pub(super) const WAIT_FOR_RELEASE: &str = "\
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
pub(super) const LOCK_SESSION_SETUP: &str = "\
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

/// The condition on a `pg_locks` row `l` that it is a granted exclusive
/// hold, in this database, of the advisory key `k.h`. A `bigint` advisory
/// key shows in `pg_locks` split into `classid` (high 32 bits) and `objid`
/// (low 32 bits) with `objsubid = 1`.
macro_rules! exclusive_hold {
    () => {
        "l.locktype = 'advisory'::pg_catalog.text AND l.granted
  AND l.mode = 'ExclusiveLock'::pg_catalog.text AND l.objsubid = 1::pg_catalog.int2
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database())
  AND l.classid::pg_catalog.int8 = ((k.h >> 32::pg_catalog.int4) & 4294967295::pg_catalog.int8)
  AND l.objid::pg_catalog.int8 = (k.h & 4294967295::pg_catalog.int8)"
    };
}

/// The sessions (other than this one) that hold a key's advisory lock
/// exclusively, as a query of one column, `pid`, for [`HOLDERS`] and
/// [`TERMINATE_HOLDERS`] (see `exclusive_hold!`).
macro_rules! holders {
    () => {
        concat!(
            "SELECT l.pid
FROM pg_catalog.pg_locks AS l,
     (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k
WHERE ",
            exclusive_hold!(),
            "
  AND l.pid <> pg_catalog.pg_backend_pid()"
        )
    };
}

/// The sessions (other than this one) that hold a key's advisory lock
/// exclusively (see `holders!`).
pub(super) const HOLDERS: &str = holders!();

/// Ends the sessions holding a key (administrative force release): an
/// advisory lock can only be dropped by its own session, so breaking it
/// means ending that session. Waits (up to `$3` ms, PostgreSQL 13+) until
/// each session is gone, so its locks are free when this returns.
pub(super) const TERMINATE_HOLDERS: &str = concat!(
    "SELECT h.pid, pg_catalog.pg_terminate_backend(h.pid, $3::pg_catalog.int8)
FROM (",
    holders!(),
    ") AS h"
);

/// The force release that names a lease (`Backend::force_release_holding`
/// of a lease of another process): five statements sent in one simple
/// query, so in one implicit transaction and one round trip, on a
/// connection of the force release's own ([`force_release_named`] fills
/// in the key, its seed, the token, this backend's own sessions and the
/// waits). The server runs them to the end without waiting for the client,
/// so the gate is never held across a round trip, nor kept by a client
/// that stalls.
///
/// 1. Bounds every wait below (`lock_timeout`, `statement_timeout`), for
///    this transaction only.
/// 2. Takes the records table's lock (`ACCESS SHARE`, until the end)
///    before the gate: a DBA's `ALTER TABLE` or `VACUUM FULL`, granted or
///    queued, is waited for here, with no gate held for the holder's
///    releases to wait behind.
/// 3. Tries the key's release gate exclusively (see `release_gate!`)
///    until the transaction ends, without queueing: a release of the key
///    under way (one statement) holds it shared, and the try fails, which
///    the transaction keeps in a setting (`dlock.force_release_gate`) for
///    the next statement and the client reads (it tries again a moment
///    later). A force release never queues on the gate, so the holder's
///    releases never wait behind one that waits. Taken, the gate holds off
///    the next releases, so the session holding the key keeps holding it
///    until the end.
/// 4. Reads the lock table once, only if the gate was taken, (a CTE read twice is computed once, so
///    the hold and the mark are seen at one instant): the sessions that
///    hold the key exclusively, other than this one and this backend's
///    own (whose leases it unlocks itself), and not in the middle of a
///    lock statement (one that holds the key's `rewriting` mark has not
///    committed its record yet, see [`TRY_LOCK_RECORDING`]). It keeps
///    their pids in a setting of the transaction, for the next statement.
/// 5. Reads the records, with a snapshot taken after the lock table was
///    read, and ends each session found whose record of the key names the
///    lease with the token given and that session (its pid and its start,
///    so a later session that got the same pid is never taken for it),
///    waiting as [`TERMINATE_HOLDERS`] does. A row per session found:
///    its pid, whether its start is hidden from this role (it then cannot
///    be told from a later session with its pid, and is not ended; a
///    session gone meanwhile is not hidden, only not ended), and whether
///    it was ended (NULL: its record names another lease, or it is gone).
///
/// A session found holding the key in 4, not in a lock statement,
/// committed the record of the lease it holds before that read; under the
/// gate it can neither let go of the key nor take it again, nor can any
/// other session take it, until this ends. So the record read in 5 is the
/// record of the lease the session holds when it is ended: a holder that
/// changed since an operator was shown it, a lease let go a moment
/// before, or another session holding the key meanwhile, is never ended.
pub(super) const FORCE_RELEASE_NAMED: &str = concat!(
    "SELECT pg_catalog.set_config('lock_timeout'::pg_catalog.text, '{lock_wait}'::pg_catalog.text, true),
       pg_catalog.set_config('statement_timeout'::pg_catalog.text, '{statement_wait}'::pg_catalog.text, true);
SELECT FROM {schema}.dlock_holders LIMIT 0;
SELECT pg_catalog.set_config('dlock.force_release_gate'::pg_catalog.text,
                             pg_catalog.pg_try_advisory_xact_lock(",
    release_gate!("k.h"),
    ")::pg_catalog.text, true)
FROM (SELECT pg_catalog.hashtextextended({key}, {seed}::pg_catalog.int8) AS h) AS k;
WITH k AS (SELECT pg_catalog.hashtextextended({key}, {seed}::pg_catalog.int8) AS h),
a AS (
  SELECT l.pid, l.mode, l.granted, l.objsubid, l.classid, l.objid
  FROM pg_catalog.pg_locks AS l
  WHERE l.locktype = 'advisory'::pg_catalog.text
    AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                      WHERE d.datname = pg_catalog.current_database())
)
SELECT pg_catalog.set_config('dlock.force_release_pids'::pg_catalog.text,
                             COALESCE(pg_catalog.string_agg(l.pid::pg_catalog.text, ','::pg_catalog.text),
                                      ''::pg_catalog.text),
                             true)
FROM a AS l, k
WHERE l.granted AND l.mode = 'ExclusiveLock'::pg_catalog.text AND l.objsubid = 1::pg_catalog.int2
  AND l.classid::pg_catalog.int8 = ((k.h >> 32::pg_catalog.int4) & 4294967295::pg_catalog.int8)
  AND l.objid::pg_catalog.int8 = (k.h & 4294967295::pg_catalog.int8)
  AND l.pid <> pg_catalog.pg_backend_pid()
  AND l.pid <> ALL ('{own}'::pg_catalog.int4[])
  AND pg_catalog.current_setting('dlock.force_release_gate'::pg_catalog.text)::pg_catalog.bool
  AND NOT EXISTS (SELECT FROM a AS m
                  WHERE m.pid = l.pid AND m.objsubid = 2::pg_catalog.int2
                    AND m.classid = l.classid AND m.objid = l.objid);
SELECT l.pid, a.pid IS NOT NULL AND a.backend_start IS NULL,
       CASE WHEN r.session_start = a.backend_start
            THEN pg_catalog.pg_terminate_backend(l.pid, {terminate_wait}::pg_catalog.int8) END
FROM pg_catalog.unnest(pg_catalog.string_to_array(
         pg_catalog.current_setting('dlock.force_release_pids'::pg_catalog.text),
         ','::pg_catalog.text)::pg_catalog.int4[]) AS l(pid)
JOIN {schema}.dlock_holders AS r
  ON r.lock_id = pg_catalog.hashtextextended({key}, {seed}::pg_catalog.int8)
 AND r.key = {key} AND r.token = {token}::pg_catalog.int8 AND r.pid = l.pid
LEFT JOIN LATERAL pg_catalog.pg_stat_get_activity(l.pid) AS a ON true"
);

/// The waits of [`FORCE_RELEASE_NAMED`].
pub(super) struct ForceWaits {
    /// For the key's release gate (the releases of the key under way).
    pub(super) gate: std::time::Duration,
    /// For each statement.
    pub(super) statement: std::time::Duration,
    /// For a session ended to be gone.
    pub(super) terminate: std::time::Duration,
}

/// [`FORCE_RELEASE_NAMED`] (its schema filled in, as `rendered`) for the
/// key `key` with key seed `seed`, naming the lease with token `token`,
/// never ending a session of `own`: the key goes in hex-encoded (no
/// quoting to get wrong), the numbers as decimal literals, and the waits
/// as `waits` says.
pub(super) fn force_release_named(
    rendered: &str,
    key: &str,
    seed: i64,
    token: i64,
    own: &[i32],
    waits: &ForceWaits,
) -> String {
    let mut hex = String::with_capacity(key.len() * 2);
    push_hex(&mut hex, key);
    let key = format!(
        "pg_catalog.convert_from(pg_catalog.decode('{hex}'::pg_catalog.text, 'hex'::pg_catalog.text), \
         'UTF8'::pg_catalog.name)"
    );
    let own = own.iter().map(i32::to_string).collect::<Vec<_>>().join(",");
    let ms = |wait: std::time::Duration| wait.as_millis().max(1).to_string();
    rendered
        .replace("{lock_wait}", &ms(waits.gate))
        .replace("{statement_wait}", &ms(waits.statement))
        .replace("{terminate_wait}", &ms(waits.terminate))
        .replace("{own}", &format!("{{{own}}}"))
        .replace("{seed}", &format!("'{seed}'"))
        .replace("{token}", &format!("'{token}'"))
        .replace("{key}", &key)
}

/// Takes a key's session advisory lock and draws its token as [`TRY_LOCK`]
/// does, and, only if it was taken, records who took it in
/// `{schema}.dlock_holders` (`CREATE_HOLDERS_TABLE`), for
/// [`Backend::holder`](crate::Backend::holder) and
/// [`Backend::held`](crate::Backend::held): the key (`$1`), the token,
/// this session (its pid and its start, `$4`, from
/// `LOCK_SESSION_SETUP`), the identity (`$3`, NULL for a lease without
/// one), the holder record (`$5`: the client's host, pid and label,
/// [`HolderInfo::encode`](crate::HolderInfo::encode)) and the server's time
/// of acquisition (`now()`, the statement's start). Returns the advisory
/// key, the token (NULL: held by someone else, or by another lease of this
/// session), the time of the row it
/// wrote, `already` (see below) and `wrote`: whether the row the upsert
/// returns holds the token drawn and this session's pid. A token with
/// neither `wrote` nor `already` is a write that a DBA's trigger or rule
/// skipped or changed, and the backend gives the lock back: `wrote` asks
/// that the row hold every value a reader believes (its `lock_id`, key,
/// token, session, identity and holder), so a `BEFORE` trigger that keeps
/// the old row (`RETURN OLD`), moves the row to another `lock_id` or keeps
/// an old identity is caught; one that blanks the time leaves the row this
/// statement's all the same. What an `AFTER` trigger changes later in the
/// statement, no statement can see.
///
/// `holder_token` repeats the token, for a reader to tell a holder record
/// this statement wrote from one left behind: a dlock that predates the
/// holder record writes its rows without `holder`, `holder_token` and
/// `since`, and its upsert over an older row keeps that row's values of
/// them, which belong to another lease. A reader believes them only when
/// `holder_token` is the row's token (see `HOLDER_RECORD`).
///
/// One statement, so no lease is ever taken without its record, nor
/// recorded without the lease. The record is visible
/// at commit and the lock at once, so for an instant a reader sees the
/// lock and an older record (or none): a record names its session, and a
/// reader believes it only when that session holds the lock (see
/// `HOLDER_SESSION`). A record of a session that died stays (the server
/// drops the lock, not the row) until the key's next recorded acquisition
/// overwrites it; the session's start keeps a later session that happens
/// to get the same pid from being taken for it.
///
/// `already` (`$6`): advisory locks are re-entrant, so
/// `pg_try_advisory_xact_lock` also says yes when this session already
/// holds the advisory key for a lease of another key with the same 64-bit
/// hash. Nothing is recorded then (the record would name a lease that does
/// not exist, over the holder's own), and the session lock is not taken:
/// the answer is no token, held. A statement the backend told so (`$6`
/// true) that fails took nothing, and the backend undoes nothing; one that
/// read `pg_locks` itself may have taken the lock, and its undo is the
/// claim-guarded one (see `undo_failed_lock`). The backend knows which
/// advisory keys its leases hold on the session, computes the key's
/// advisory key in process (see `hash`), and passes the answer; NULL (a
/// permit statement, whose slot is not known before its answer, in flight
/// on the session, or a server that hashes otherwise) has the statement
/// read it from `pg_locks` before the lock is tried, a scan of the lock table that
/// takes every partition of it (each CTE reads the one before it; a CTE
/// that calls a volatile function is computed once, in order, never
/// folded into the next; `COALESCE` reads no further than its first
/// value that is not NULL).
///
/// `rewriting`: a shared transaction-level advisory lock on the key's two
/// halves (the `(int4, int4)` form, `objsubid` 2: never one of dlock's
/// keys), taken before the key's lock and held until the statement
/// commits, which makes its record visible first and drops the mark
/// after. A released lease's record stays until its session deletes it in
/// a batch ([`DELETE_RELEASED`]), so when the same session takes the key
/// again a reader could see the new lock with the old lease's record for
/// an instant; it sees the mark too, and does not believe the record (see
/// `HOLDER_SESSION`).
///
/// The lock is taken for the transaction first
/// (`pg_try_advisory_xact_lock`), and for the session only as the last
/// step, once the token is drawn and the record written (the outer
/// `SELECT` reads `recorded` before it calls `pg_advisory_lock`, which
/// never waits on a lock this session already holds). So a statement that
/// fails on its way (a record's row or the sequence locked past
/// `lock_timeout`, the sequence refused, a privilege missing) leaves its
/// session holding nothing: the mark goes with the failed transaction, and
/// a session that kept the lock would hold it, until the backend undid it,
/// under a record the mark no longer covers, the record of a lease the
/// session released earlier, which a force release naming that lease would
/// take for the holder. What runs after the last step (a DBA's `AFTER`
/// trigger on the table, a deferred constraint trigger, a cancel) can
/// still fail it with the lock held: the backend then unlocks the key
/// (see `lock_left_by`), one round trip later.
///
/// The commit is asynchronous, as [`TRY_LOCK`]'s: the table is `UNLOGGED`,
/// and its rows are worth nothing after a crash, which ends every session
/// and drops every lock with it.
///
/// It announces nothing: a commit that notifies needs PostgreSQL's one
/// cluster-wide lock of notifying commits, which another application's
/// notifying commit holds for as long as that commit waits (for a
/// synchronous standby that is down, say), and every acquisition with an
/// identity would then fail. The acquisition is announced after it, by a
/// statement of its own that may fail (`ANNOUNCE`).
pub const TRY_LOCK_RECORDING: &str = concat!(
    "WITH k AS (
  SELECT k.h, COALESCE($6::pg_catalog.bool,
                       EXISTS (SELECT FROM pg_catalog.pg_locks AS l
                               WHERE l.pid = pg_catalog.pg_backend_pid() AND ",
    exclusive_hold!(),
    ")) AS already,
         pg_catalog.pg_advisory_xact_lock_shared(
             (k.h OPERATOR(pg_catalog.>>) 32::pg_catalog.int4)::pg_catalog.int4,
             ((k.h OPERATOR(pg_catalog.<<) 32::pg_catalog.int4)
              OPERATOR(pg_catalog.>>) 32::pg_catalog.int4)::pg_catalog.int4) AS rewriting
  FROM (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k
),
t AS (
  SELECT k.h, k.already, CASE WHEN k.rewriting IS NOT NULL
                               AND pg_catalog.pg_try_advisory_xact_lock(k.h) THEN (",
    draw_token!(
        ", pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, true)
              AS commit_mode",
        ""
    ),
    ") END AS token
  FROM k
),
recorded AS (
  INSERT INTO {schema}.dlock_holders AS r
         (lock_id, key, token, pid, session_start, identity, holder, holder_token, since)
  SELECT t.h, $1::pg_catalog.text, t.token, pg_catalog.pg_backend_pid(),
         $4::pg_catalog.timestamptz, $3::pg_catalog.text, $5::pg_catalog.text, t.token,
         pg_catalog.now()
  FROM t WHERE t.token IS NOT NULL AND NOT t.already
  ON CONFLICT (lock_id) DO UPDATE
  SET key = EXCLUDED.key, token = EXCLUDED.token, pid = EXCLUDED.pid,
      session_start = EXCLUDED.session_start, identity = EXCLUDED.identity,
      holder = EXCLUDED.holder, holder_token = EXCLUDED.holder_token, since = EXCLUDED.since
  RETURNING r.lock_id, r.key, r.token, r.holder_token, r.pid, r.session_start, r.identity,
            r.holder, r.since
)
SELECT s.h, CASE WHEN s.token IS NOT NULL AND NOT s.already
                      AND pg_catalog.pg_advisory_lock(s.h) IS NOT NULL
                 THEN s.token END,
       s.since, s.already, COALESCE(s.wrote, false)
FROM (SELECT t.h, t.token, t.already, (SELECT recorded.since FROM recorded) AS since,
             (SELECT ",
    wrote_row!(),
    " FROM recorded) AS wrote
      FROM t OFFSET 0) AS s"
);

/// The channel [`ANNOUNCE`] announces acquisitions on for the
/// schema `schema`: `dlock_holders_<schema>`, or, for a schema too long
/// for a channel name's 63 bytes, `dlock_holders_`, the schema's first 32
/// bytes, `_` and 16 hex digits of a hash of it (FNV-1a, the same in every
/// process and every version). A schema is a plain lowercase identifier,
/// so the channel has only `[a-z0-9_]` and goes into SQL as it is, in a
/// literal as in a quoted identifier. Two schemas that share a channel
/// would only wake each other's watches for nothing.
pub(super) fn holders_channel(schema: &str) -> String {
    const PREFIX: &str = "dlock_holders_";
    const MAX: usize = 63;
    if PREFIX.len() + schema.len() <= MAX {
        return format!("{PREFIX}{schema}");
    }
    let hash = schema
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    // ASCII only, so any byte is a character boundary.
    let head = schema.get(..32).unwrap_or(schema);
    format!("{PREFIX}{head}_{hash:016x}")
}

/// Announces acquisitions with an identity this session made, for watches
/// of a free key (see the `listen` module): `pg_notify` on the schema's
/// channel (`$2`, see [`holders_channel`]) with each advisory key of `$3`
/// as text. Sent after [`TRY_LOCK_RECORDING`] committed, so a reader woken
/// by it reads the record; PostgreSQL delivers the notifications when this
/// statement's own transaction commits. A `NOTIFY` needs no privilege, and
/// goes into the server's queue whether or not anyone listens.
///
/// Best effort, and bounded: the commit takes PostgreSQL's one
/// cluster-wide lock of notifying commits, which another transaction may
/// hold for long (a notifying commit that waits for a synchronous standby
/// holds it until the standby answers), and the session's other
/// statements queue behind this one. So it waits at most `$1`
/// milliseconds for that lock, far below the session's `lock_timeout`,
/// and then fails, which costs an announcement, never a lock: a watch of
/// a free key reads again on a timer as well. `set_config(…, true)` ends
/// with the statement's own transaction, so nothing else runs under the
/// short wait. The commit is asynchronous, as [`TRY_LOCK`]'s: one that
/// waited for a standby would hold the lock of notifying commits, and the
/// session, while it waits, beyond any `lock_timeout`.
pub(super) const ANNOUNCE: &str = "\
SELECT pg_catalog.set_config('lock_timeout'::pg_catalog.text, $1::pg_catalog.text, true),
       pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, true),
       (SELECT pg_catalog.count(pg_catalog.pg_notify($2::pg_catalog.text, k.h::pg_catalog.text))
        FROM pg_catalog.unnest($3::pg_catalog.int8[]) AS k(h))";

/// Listens on the channel acquisitions are announced on (`{channel}`, see
/// [`holders_channel`]), on the backend's listening connection.
pub(super) const LISTEN: &str = "LISTEN \"{channel}\"";

/// The advisory key of a key, and whether a session holds it exclusively
/// (see `exclusive_hold!`): what a watch of the key's holder needs to know
/// which wake-up to wait for. An announced acquisition names its advisory
/// key.
pub(super) const KEY_HELD: &str = concat!(
    "SELECT k.h, EXISTS (SELECT FROM pg_catalog.pg_locks AS l WHERE ",
    exclusive_hold!(),
    ")
FROM (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k"
);

/// Deletes a lease's holder record and drops its lock (`$1`, the
/// advisory key) in one statement: sent for leases with an identity,
/// whose records election readers and watches read; a plain lease's
/// record is deleted later, in a batch ([`DELETE_RELEASED`]). In one statement, so no later lease of this session
/// (sessions carry many leases, and may take the same key again at once)
/// is ever read with it. Only the lease's own record: its token (`$2`) and
/// this session. The count consumes the delete before the unlock runs, so
/// a delete that fails leaves the lock held (and the backend ends the
/// session, which drops both). The key's release gate is taken shared
/// before the unlock too, as [`UNLOCK_GATED`] takes it. Asynchronous
/// commit, as [`TRY_LOCK_RECORDING`].
pub const UNLOCK_RECORDED: &str = concat!(
    "WITH gone AS (
  DELETE FROM {schema}.dlock_holders AS r
  WHERE r.lock_id = $1::pg_catalog.int8 AND r.token = $2::pg_catalog.int8
    AND r.pid = pg_catalog.pg_backend_pid()
  RETURNING r.lock_id
)
SELECT pg_catalog.pg_advisory_unlock($1::pg_catalog.int8),
       pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, true)
FROM (SELECT pg_catalog.count(*) AS deleted,
             pg_catalog.pg_advisory_xact_lock_shared(",
    release_gate!("$1::pg_catalog.int8"),
    ") AS gate
      FROM gone OFFSET 0) AS g"
);

/// Deletes, in one statement, holder records of leases this session
/// released: the advisory keys `$1` and tokens `$2` (pairwise), of this
/// session (its pid, and its start `$3`). A plain lease's release sends
/// only [`UNLOCK`] and leaves its record: a record is believed only while
/// the session it names holds the key and its token is the row's (see
/// `HOLDER_SESSION`), so a released one is never read, and deleting it
/// with every unlock cost a third of an uncontended cycle. The session
/// keeps the released records and deletes them in batches. A record a
/// later lease overwrote has another token or another session, and is
/// never deleted here. Asynchronous commit, as [`TRY_LOCK_RECORDING`].
pub const DELETE_RELEASED: &str = "\
WITH gone AS (
  DELETE FROM {schema}.dlock_holders AS r
  USING ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]),
                  pg_catalog.unnest($2::pg_catalog.int8[])) AS g(lock_id, token)
  WHERE r.lock_id = g.lock_id AND r.token = g.token
    AND r.pid = pg_catalog.pg_backend_pid() AND r.session_start = $3::pg_catalog.timestamptz
  RETURNING r.lock_id
)
SELECT pg_catalog.count(*),
       pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, true)
FROM gone";

/// Writes again the identity records of leases this session holds, when
/// they are missing or not theirs (a DBA truncated the table, deleted a
/// row): sent after a renewal checked the leases' session, on that
/// session, only when the batch renewed a lease that recorded one. One row
/// per lease in `{rows}` ([`rewrite_records`] fills it in): its advisory
/// key, key, token and identity, with this session (its pid, and its start
/// as [`LOCK_SESSION_SETUP`] read it). Its command tag counts the records
/// written.
///
/// The `NOT EXISTS` keeps records already right out of the `INSERT`, so
/// when all is well the statement writes nothing: no transaction id, no
/// row lock, one index probe a lease. A conflicting row left is another
/// session's or another lease's, never a live one (this session holds the
/// advisory key), and is overwritten as [`TRY_LOCK_RECORDING`] does. The
/// backend sends it only for leases it holds at that moment, under the
/// session's lock that [`UNLOCK_RECORDED`] is sent under too, so it never
/// runs after a lease's unlock and writes back a record nobody deletes.
///
/// Its wait for a lock is bounded by `{wait}` (milliseconds), far below
/// the session's `lock_timeout`: a DBA's `ALTER TABLE`, `VACUUM FULL` or
/// `TRUNCATE` holds the table for as long as it runs, and every statement
/// sent on the session after this one (renewals' checks, other leases'
/// locks and unlocks) queues behind it. The table's lock is taken while
/// the `INSERT` is planned, before anything in it runs, so the bound must
/// be set by an earlier statement, and only for this one: the two go as
/// one simple query, which the server runs as one transaction, with no
/// other statement between them (a `SET` of its own would apply to
/// whatever other leases send next on the shared connection), and
/// `set_config(…, true)` ends with that transaction. A simple query takes
/// no parameters, so the rows are literals: numbers, and the key and the
/// identity as hex digits of their UTF-8, decoded by the server. Nothing
/// the caller wrote is ever SQL text.
pub(super) const REWRITE_RECORDS: &str = "\
SELECT pg_catalog.set_config('lock_timeout'::pg_catalog.text, '{wait}'::pg_catalog.text, true);
INSERT INTO {schema}.dlock_holders AS r
       (lock_id, key, token, pid, session_start, identity, holder, holder_token, since)
SELECT w.lock_id, w.key, w.token, pg_catalog.pg_backend_pid(), w.started, w.identity,
       w.holder, w.token, w.since
FROM (SELECT v.lock_id, v.token,
             pg_catalog.convert_from(pg_catalog.decode(v.key, 'hex'::pg_catalog.text),
                                     'UTF8'::pg_catalog.name) AS key,
             pg_catalog.convert_from(pg_catalog.decode(v.identity, 'hex'::pg_catalog.text),
                                     'UTF8'::pg_catalog.name) AS identity,
             pg_catalog.convert_from(pg_catalog.decode(v.holder, 'hex'::pg_catalog.text),
                                     'UTF8'::pg_catalog.name) AS holder,
             'epoch'::pg_catalog.timestamptz OPERATOR(pg_catalog.+)
             ('1 microsecond'::pg_catalog.interval OPERATOR(pg_catalog.*)
              v.since::pg_catalog.float8) AS since,
             (SELECT a.backend_start
              FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) AS a) AS started
      FROM (VALUES {rows}) AS v(lock_id, key, token, identity, holder, since)) AS w
WHERE NOT EXISTS (
  SELECT FROM {schema}.dlock_holders AS h
  WHERE h.lock_id = w.lock_id AND h.key = w.key AND h.token = w.token
    AND h.pid = pg_catalog.pg_backend_pid() AND h.session_start = w.started
    AND h.identity = w.identity AND h.holder = w.holder AND h.holder_token = w.token
    AND h.since = w.since)
ON CONFLICT (lock_id) DO UPDATE
SET key = EXCLUDED.key, token = EXCLUDED.token, pid = EXCLUDED.pid,
    session_start = EXCLUDED.session_start, identity = EXCLUDED.identity,
    holder = EXCLUDED.holder, holder_token = EXCLUDED.holder_token, since = EXCLUDED.since";

/// A record [`REWRITE_RECORDS`] writes again.
pub(super) struct RecordRow<'a> {
    pub(super) lock_id: i64,
    pub(super) key: &'a str,
    pub(super) token: i64,
    pub(super) identity: &'a str,
    /// The holder record ([`HolderInfo::encode`](crate::HolderInfo::encode)).
    pub(super) holder: &'a str,
    /// When the lock was taken, by the server's clock: microseconds since
    /// 1970.
    pub(super) since_us: i64,
}

/// Appends `text`'s bytes to `out` as hex digits, for a literal that
/// `decode(…, 'hex')` reads: no character of the text can end it.
fn push_hex(out: &mut String, text: &str) {
    use std::fmt::Write as _;
    for byte in text.bytes() {
        let _ = write!(out, "{byte:02x}");
    }
}

/// [`REWRITE_RECORDS`] (its schema already filled in: `rendered`) with
/// `wait` and `rows` filled in. Numbers go in quoted (`'-1'::int8`: a
/// bare `-9223372036854775808::int8` would cast before negating, and
/// overflow), strings as hex digits: no character of them can end a
/// literal.
pub(super) fn rewrite_records(
    rendered: &str,
    wait: std::time::Duration,
    rows: &[RecordRow<'_>],
) -> String {
    use std::fmt::Write as _;
    let mut values = String::new();
    for (i, row) in rows.iter().enumerate() {
        if i > 0 {
            values.push_str(", ");
        }
        let _ = write!(values, "('{}'::pg_catalog.int8, '", row.lock_id);
        push_hex(&mut values, row.key);
        let _ = write!(
            values,
            "'::pg_catalog.text, '{}'::pg_catalog.int8, '",
            row.token
        );
        push_hex(&mut values, row.identity);
        values.push_str("'::pg_catalog.text, '");
        push_hex(&mut values, row.holder);
        let _ = write!(
            values,
            "'::pg_catalog.text, '{}'::pg_catalog.int8)",
            row.since_us
        );
    }
    rendered
        .replace("{wait}", &wait.as_millis().max(1).to_string())
        .replace("{rows}", &values)
}

/// The first half of a fair wait's statement (see [`FAIR_LOCK`]): a row
/// of the key's advisory key `h` and the session's `lock_timeout` as it
/// was (`prev`), once the session holds the key's advisory lock. In
/// order, each subquery fenced off by `OFFSET 0` (and the planner keeps a
/// volatile column nobody reads): read `lock_timeout`, set it to 0 for
/// the rest of the statement's transaction (`set_config(…, true)`), then
/// wait in the key's queue with `pg_advisory_lock`.
macro_rules! fair_wait {
    () => {
        "SELECT u.h, u.prev, pg_catalog.pg_advisory_lock(u.h) AS locked
      FROM (SELECT k.h, k.prev,
                   pg_catalog.set_config('lock_timeout'::pg_catalog.text, '0'::pg_catalog.text, true)
                       AS unbounded
            FROM (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h,
                         pg_catalog.current_setting('lock_timeout'::pg_catalog.text) AS prev
                  OFFSET 0) AS k
            OFFSET 0) AS u
      OFFSET 0"
    };
}

/// A fair waiter's statement (fair mode, see the `fair` module), sent on
/// a session of its own: waits in PostgreSQL's queue of the key's advisory
/// lock (`pg_advisory_lock`, which the lock manager grants in arrival
/// order, and hands to the first waiter the moment its holder lets go),
/// and once granted draws the token as [`TRY_LOCK`] does, in the same
/// statement: its argument for rising tokens holds word for word, the
/// clock being read after the wait (`clock_timestamp()`, never `now()`,
/// the statement's start). Returns the advisory key and the token.
///
/// The wait is bounded by nothing but the statement itself: it sets
/// `lock_timeout` to 0 before `pg_advisory_lock` (see `fair_wait!`) and
/// puts back the session's own value before the draw, so the sequence's
/// lock and the rest are waited for as long as on a lock session, no
/// longer. The session's `statement_timeout` is 0 ([`FAIR_SESSION_SETUP`]),
/// and the backend cancels the wait itself when its waiter leaves.
///
/// A statement that fails after the lock was granted (the draw refused
/// the sequence, a cancel struck during the draw) leaves the session lock
/// held; the session holds nothing else while it waits, so the backend
/// drops it with [`UNLOCK_ALL`].
pub(super) const FAIR_LOCK: &str = concat!(
    "SELECT w.h, CASE WHEN pg_catalog.set_config('lock_timeout'::pg_catalog.text, w.prev, true)
                      IS NOT NULL THEN (",
    draw_token!(
        ", pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, true)
              AS commit_mode",
        ""
    ),
    ") END
FROM (",
    fair_wait!(),
    ") AS w"
);

/// [`FAIR_LOCK`] that also records the holder as [`TRY_LOCK_RECORDING`]
/// does, once the lock is granted, in the same statement: the key (`$1`),
/// the token, this session (its pid and its start, `$4`), the identity
/// (`$3`, NULL for a lease without one) and the holder record (`$5`), and
/// as the time of acquisition the clock after the wait
/// (`clock_timestamp()`; `now()` is the statement's start, before the
/// wait). Returns the advisory key, the token, the time of the row it
/// wrote and `wrote`, as [`TRY_LOCK_RECORDING`] does.
///
/// It takes the `rewriting` mark first, as [`TRY_LOCK_RECORDING`] does (a
/// pooled fair session may take a key again whose released record it has
/// not deleted yet), and holds it while it waits: the mark is only ever
/// taken shared, and readers look for it only on the session that holds
/// the key. There is no `already`: a fair session holds no other lock
/// while it waits. It waits for the lock as the transaction's
/// (`pg_advisory_xact_lock`, in the same queue as the session lock) and
/// takes it for the session as its last step, as [`TRY_LOCK_RECORDING`]
/// does: a statement that fails after the grant leaves nothing held.
///
/// Its `INSERT` holds the table's `ROW EXCLUSIVE` lock from the start of
/// the statement, through the wait: a DBA's `ALTER TABLE`, `TRUNCATE`,
/// `VACUUM FULL` or `LOCK TABLE` on the table waits for the fair waiters
/// of the moment (see the module docs of `fair`).
pub(super) const FAIR_LOCK_RECORDING: &str = concat!(
    "WITH k AS (
  SELECT k.h, pg_catalog.current_setting('lock_timeout'::pg_catalog.text) AS prev,
         pg_catalog.pg_advisory_xact_lock_shared(
             (k.h OPERATOR(pg_catalog.>>) 32::pg_catalog.int4)::pg_catalog.int4,
             ((k.h OPERATOR(pg_catalog.<<) 32::pg_catalog.int4)
              OPERATOR(pg_catalog.>>) 32::pg_catalog.int4)::pg_catalog.int4) AS rewriting
  FROM (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k
),
u AS (
  SELECT k.h, k.prev,
         pg_catalog.set_config('lock_timeout'::pg_catalog.text, '0'::pg_catalog.text, true) AS unbounded
  FROM k WHERE k.rewriting IS NOT NULL
),
w AS (
  SELECT u.h, u.prev, pg_catalog.pg_advisory_xact_lock(u.h) AS locked
  FROM u WHERE u.unbounded IS NOT NULL
),
t AS (
  SELECT w.h, CASE WHEN pg_catalog.set_config('lock_timeout'::pg_catalog.text, w.prev, true)
                        IS NOT NULL THEN (",
    draw_token!(
        ", pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, true)
              AS commit_mode",
        ""
    ),
    ") END AS token
  FROM w WHERE w.locked IS NOT NULL
),
recorded AS (
  INSERT INTO {schema}.dlock_holders AS r
         (lock_id, key, token, pid, session_start, identity, holder, holder_token, since)
  SELECT t.h, $1::pg_catalog.text, t.token, pg_catalog.pg_backend_pid(),
         $4::pg_catalog.timestamptz, $3::pg_catalog.text, $5::pg_catalog.text, t.token,
         pg_catalog.clock_timestamp()
  FROM t WHERE t.token IS NOT NULL
  ON CONFLICT (lock_id) DO UPDATE
  SET key = EXCLUDED.key, token = EXCLUDED.token, pid = EXCLUDED.pid,
      session_start = EXCLUDED.session_start, identity = EXCLUDED.identity,
      holder = EXCLUDED.holder, holder_token = EXCLUDED.holder_token, since = EXCLUDED.since
  RETURNING r.lock_id, r.key, r.token, r.holder_token, r.pid, r.session_start, r.identity,
            r.holder, r.since
)
SELECT s.h, CASE WHEN s.token IS NOT NULL AND pg_catalog.pg_advisory_lock(s.h) IS NOT NULL
                 THEN s.token END,
       s.since, COALESCE(s.wrote, false)
FROM (SELECT t.h, t.token, (SELECT recorded.since FROM recorded) AS since,
             (SELECT ",
    wrote_row!(),
    " FROM recorded) AS wrote
      FROM t OFFSET 0) AS s"
);

/// Whether the session `$1` waits in an advisory lock's queue now: what a
/// fair waiter's first attempt waits for before it answers `Held`, so that
/// an attempt answered later is queued later. Reads that one server
/// process's entry (`pg_stat_get_activity(pid)`), no lock table.
pub(super) const WAITS_IN_QUEUE: &str = "\
SELECT COALESCE((SELECT a.wait_event_type OPERATOR(pg_catalog.=) 'Lock'::pg_catalog.text
                    AND a.wait_event OPERATOR(pg_catalog.=) 'advisory'::pg_catalog.text
                 FROM pg_catalog.pg_stat_get_activity($1::pg_catalog.int4) AS a), false)";

/// The settings of a fair session beyond a lock session's, sent when it
/// opens: no `statement_timeout` and (PostgreSQL 17+) no
/// `transaction_timeout`, whatever a DBA set for the role or the database,
/// since its one statement waits in a key's queue for as long as its
/// waiter waits (the backend ends the wait itself when the waiter
/// leaves); a `transaction_timeout` would even end the session.
pub(super) const FAIR_SESSION_SETUP: &str = "\
SELECT pg_catalog.set_config('statement_timeout'::pg_catalog.text, '0'::pg_catalog.text, false),
       CASE WHEN pg_catalog.current_setting('server_version_num'::pg_catalog.text)::pg_catalog.int4
                 >= 170000::pg_catalog.int4
            THEN pg_catalog.set_config('transaction_timeout'::pg_catalog.text, '0'::pg_catalog.text, false)
       END";

/// Has the server look for a closed client connection every `$1`
/// milliseconds (as text) while a statement runs (PostgreSQL 14+,
/// `client_connection_check_interval`): a fair waiter whose process died
/// then leaves the key's queue by itself, within that time, instead of
/// being granted the key first. Best effort: the server refuses it on a
/// platform without the kernel events it needs, and older servers skip it.
pub(super) const CLIENT_CONNECTION_CHECK: &str = "\
SELECT CASE WHEN pg_catalog.current_setting('server_version_num'::pg_catalog.text)::pg_catalog.int4
                 >= 140000::pg_catalog.int4
            THEN pg_catalog.set_config('client_connection_check_interval'::pg_catalog.text,
                                       $1::pg_catalog.text, false)
       END";

/// The session holding a key's advisory lock exclusively, whichever it is
/// (this one included): its pid, when it started (NULL when the role
/// asking may not see it: another role's session, unless the role is a
/// member of it or of `pg_read_all_stats`), and whether the table of
/// identity records exists. No row: nobody holds the key.
///
/// Read *before* [`HOLDER_RECORD`], in a statement of its own: the record
/// is read under a snapshot taken after this, so a record found of the
/// session seen here was written by a lease that held the key at some
/// moment between the two, or by an earlier lease of that session, left
/// until its batch delete ([`DELETE_RELEASED`]). The fourth column says
/// which: whether the session holds the key's `rewriting` mark (see
/// [`TRY_LOCK_RECORDING`]), read with the lock (`pg_locks` reads the whole
/// lock table at one instant). Without the mark, the statement that took
/// the lock has committed, and its record (or a later one) is what the
/// next snapshot sees; with it, the record may be the earlier lease's. Read the other way round,
/// an old snapshot could still show the record of a lease the session
/// has since released and followed with another.
pub(super) const HOLDER_SESSION: &str = concat!(
    "SELECT l.pid,
       (SELECT a.backend_start FROM pg_catalog.pg_stat_get_activity(l.pid) AS a),
       pg_catalog.to_regclass('{schema}.dlock_holders'::pg_catalog.text) IS NOT NULL,
       EXISTS (SELECT FROM pg_catalog.pg_locks AS m
               WHERE m.pid = l.pid AND m.locktype = 'advisory'::pg_catalog.text
                 AND m.objsubid = 2::pg_catalog.int2 AND m.database = l.database
                 AND m.classid = l.classid AND m.objid = l.objid)
FROM pg_catalog.pg_locks AS l,
     (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k
WHERE ",
    exclusive_hold!(),
    "
LIMIT 1"
);

/// The holder record of a row `r` and how long ago it was taken (in
/// microseconds, by the server's clock, never below 0), as two columns,
/// each NULL unless the statement that wrote the row's token wrote them
/// too (see [`TRY_LOCK_RECORDING`] on `holder_token`).
macro_rules! believed_holder {
    () => {
        "CASE WHEN r.holder_token OPERATOR(pg_catalog.=) r.token THEN r.holder END,
       CASE WHEN r.holder_token OPERATOR(pg_catalog.=) r.token THEN
            greatest(0::pg_catalog.int8,
                     (EXTRACT(epoch FROM pg_catalog.now() OPERATOR(pg_catalog.-) r.since)
                      OPERATOR(pg_catalog.*) 1000000::pg_catalog.int8)::pg_catalog.int8)
       END"
    };
}

/// The record of a key (`$1`, with its key seed `$2`) written by the
/// session `$3` that started at `$4`, the holder [`HOLDER_SESSION`] found:
/// its token, its identity (NULL: a lease without one), and, when the
/// acquisition that wrote the row wrote them (see [`TRY_LOCK_RECORDING`]
/// on `holder_token`), the holder record and how long ago it was taken in
/// microseconds, by the server's clock alone. A record of another session
/// (one that died holding the key) or of another key with the same
/// advisory key is not the holder's.
pub(super) const HOLDER_RECORD: &str = concat!(
    "SELECT r.token, r.identity, ",
    believed_holder!(),
    "
FROM {schema}.dlock_holders AS r
WHERE r.lock_id = pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8)
  AND r.key = $1::pg_catalog.text AND r.pid = $3::pg_catalog.int4
  AND r.session_start = $4::pg_catalog.timestamptz"
);

/// Every key recorded in `{schema}.dlock_holders` whose name starts with
/// `$1` (`starts_with`: the prefix is data, `%` and `_` included) and whose
/// record is believed as [`HOLDER_RECORD`] believes one: the session it
/// names (pid and start) holds the key's advisory lock exclusively now,
/// and the advisory key is the key's under this backend's key seed (`$2`).
/// One row a key: the key, the token, the identity, the holder record and
/// how long it has been held (see `believed_holder!`), and the session's
/// pid and start. Unsorted: the caller sorts by the key's bytes.
///
/// A key held without a record (by a dlock that predates records for
/// every lease, with recording off, by a [`TransactionLock`](super::TransactionLock)
/// or any other client) is not listed: only the record keeps its name.
pub(super) const HELD: &str = concat!(
    "SELECT r.key, r.token, r.identity, ",
    believed_holder!(),
    ", r.pid, r.session_start
FROM {schema}.dlock_holders AS r
WHERE pg_catalog.starts_with(r.key, $1::pg_catalog.text)
  AND r.lock_id OPERATOR(pg_catalog.=) pg_catalog.hashtextextended(r.key, $2::pg_catalog.int8)
  AND r.session_start OPERATOR(pg_catalog.=)
      (SELECT a.backend_start FROM pg_catalog.pg_stat_get_activity(r.pid) AS a)
  AND (r.pid, (r.lock_id >> 32::pg_catalog.int4) & 4294967295::pg_catalog.int8,
       r.lock_id & 4294967295::pg_catalog.int8) IN (
    SELECT l.pid, l.classid::pg_catalog.int8, l.objid::pg_catalog.int8
    FROM pg_catalog.pg_locks AS l
    WHERE l.locktype = 'advisory'::pg_catalog.text AND l.granted
      AND l.mode = 'ExclusiveLock'::pg_catalog.text AND l.objsubid = 1::pg_catalog.int2
      AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                        WHERE d.datname = pg_catalog.current_database()))"
);

/// Whether the table of holder records exists, and the privileges the
/// role has on it (SELECT, INSERT, UPDATE, DELETE), the role, and whether
/// the table has this version's shape ([`MIGRATE_HOLDERS_TABLE`]: the
/// columns of the holder record, and `identity` nullable).
pub(super) const INSPECT_HOLDERS_TABLE: &str = "\
SELECT c.oid IS NOT NULL,
       COALESCE(pg_catalog.has_table_privilege(c.oid, 'SELECT'::pg_catalog.text), false),
       COALESCE(pg_catalog.has_table_privilege(c.oid, 'INSERT'::pg_catalog.text), false),
       COALESCE(pg_catalog.has_table_privilege(c.oid, 'UPDATE'::pg_catalog.text), false),
       COALESCE(pg_catalog.has_table_privilege(c.oid, 'DELETE'::pg_catalog.text), false),
       pg_catalog.quote_ident(current_user::pg_catalog.text),
       (SELECT pg_catalog.count(*) = 3
        FROM pg_catalog.pg_attribute AS a
        WHERE a.attrelid = c.oid AND NOT a.attisdropped
          AND a.attname IN ('holder'::pg_catalog.name, 'holder_token'::pg_catalog.name,
                            'since'::pg_catalog.name))
       AND NOT COALESCE((SELECT a.attnotnull FROM pg_catalog.pg_attribute AS a
                         WHERE a.attrelid = c.oid AND NOT a.attisdropped
                           AND a.attname = 'identity'::pg_catalog.name), true)
FROM (SELECT 1) AS one
LEFT JOIN pg_catalog.pg_namespace AS n ON n.nspname = $1::pg_catalog.text::pg_catalog.name
LEFT JOIN pg_catalog.pg_class AS c
       ON c.relnamespace = n.oid AND c.relname = 'dlock_holders'::pg_catalog.name
      AND c.relkind = 'r'::pg_catalog.\"char\"";

/// The table of holder records (see [`TRY_LOCK_RECORDING`]), created
/// only when missing, by the first acquisition that records. `UNLOGGED`:
/// no WAL for the rows, which a crash would make worthless anyway (it
/// ends every session, and every lock with it), and none on a standby,
/// where no lock session runs. `identity` is NULL for a lease without
/// one; `holder`, `holder_token` and `since` are NULL in rows written by
/// a dlock that predates them.
pub(super) const CREATE_HOLDERS_TABLE: &str = "\
CREATE UNLOGGED TABLE IF NOT EXISTS {schema}.dlock_holders (
    lock_id pg_catalog.int8 PRIMARY KEY,
    key pg_catalog.text NOT NULL,
    token pg_catalog.int8 NOT NULL,
    pid pg_catalog.int4 NOT NULL,
    session_start pg_catalog.timestamptz NOT NULL,
    identity pg_catalog.text,
    holder pg_catalog.text,
    holder_token pg_catalog.int8,
    since pg_catalog.timestamptz
)";

/// Brings a table of holder records made by a dlock that recorded only
/// leases with an identity to this version's shape: the holder record's
/// columns, and `identity` nullable for leases without one. Sent in the
/// setup transaction, only when [`INSPECT_HOLDERS_TABLE`] says the shape
/// is old; it takes the table's `ACCESS EXCLUSIVE` lock for an instant
/// (no rewrite: the new columns have no default). Rows of an older dlock
/// keep working: it names the columns it writes, and reads only those.
pub(super) const MIGRATE_HOLDERS_TABLE: &str = "\
ALTER TABLE {schema}.dlock_holders
    ADD COLUMN IF NOT EXISTS holder pg_catalog.text,
    ADD COLUMN IF NOT EXISTS holder_token pg_catalog.int8,
    ADD COLUMN IF NOT EXISTS since pg_catalog.timestamptz,
    ALTER COLUMN identity DROP NOT NULL";

/// Which of the backend's objects exist and are usable (the schema, the
/// token sequence, the privileges on them), the role asking, and the
/// sequence's settings and position (its last value, NULL if none was drawn
/// yet, and its start) with the server clock in microseconds to judge its
/// maximum and its position against, and the other schemas of the database
/// that hold a dlock token sequence (see `warn_other_schemas`). Reads the
/// catalogs by name, so it works even without USAGE on the schema;
/// `pg_sequence` is readable by every role, unlike the sequence itself.
pub(super) const INSPECT_OBJECTS: &str = "\
SELECT n.oid IS NOT NULL,
       s.oid IS NOT NULL,
       COALESCE(pg_catalog.has_schema_privilege(n.oid, 'USAGE'::pg_catalog.text), false),
       COALESCE(pg_catalog.has_sequence_privilege(s.oid, 'USAGE'::pg_catalog.text), false),
       pg_catalog.quote_ident(current_user::pg_catalog.text),
       COALESCE(pg_catalog.has_sequence_privilege(s.oid, 'UPDATE'::pg_catalog.text), false),
       q.seqincrement, q.seqcache, q.seqcycle, q.seqmax,
       pg_catalog.format_type(q.seqtypid, NULL::pg_catalog.int4),
       (EXTRACT(epoch FROM pg_catalog.clock_timestamp()) * 1000000::pg_catalog.int8)::pg_catalog.int8,
       CASE WHEN pg_catalog.has_sequence_privilege(s.oid, 'SELECT, USAGE'::pg_catalog.text)
            THEN pg_catalog.pg_sequence_last_value(s.oid::pg_catalog.regclass) END,
       q.seqstart,
       (SELECT pg_catalog.string_agg(pg_catalog.quote_ident(o.nspname::pg_catalog.text),
                                     ', '::pg_catalog.text ORDER BY o.nspname)
        FROM pg_catalog.pg_class AS c
        JOIN pg_catalog.pg_namespace AS o ON o.oid = c.relnamespace
        WHERE c.relname = 'dlock_token_seq'::pg_catalog.name
          AND c.relkind = 'S'::pg_catalog.\"char\"
          AND o.nspname <> $1::pg_catalog.text::pg_catalog.name)
FROM (SELECT 1) AS one
LEFT JOIN pg_catalog.pg_namespace AS n ON n.nspname = $1::pg_catalog.text::pg_catalog.name
LEFT JOIN pg_catalog.pg_class AS s
       ON s.relnamespace = n.oid AND s.relname = 'dlock_token_seq'::pg_catalog.name
      AND s.relkind = 'S'::pg_catalog.\"char\"
LEFT JOIN pg_catalog.pg_sequence AS q ON q.seqrelid = s.oid";

/// Serialises object creation between backends connecting at the same
/// moment (two concurrent `CREATE ... IF NOT EXISTS` can still collide on
/// the catalog's unique indexes). The key is `hashtextextended('dlock:setup', 0)`
/// computed on the server, so it never meets a lock key by accident more
/// than any other key would.
pub(super) const SETUP_LOCK: &str = "SELECT pg_catalog.pg_advisory_xact_lock(
    pg_catalog.hashtextextended('dlock:setup'::pg_catalog.text, 0::pg_catalog.int8))";

/// Creates the schema (only sent when it is missing: PostgreSQL checks the
/// CREATE privilege before `IF NOT EXISTS`).
pub(super) const CREATE_SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS {schema}";

/// Creates the token sequence (only sent when it is missing).
pub(super) const CREATE_SEQUENCE: &str =
    "CREATE SEQUENCE IF NOT EXISTS {schema}.dlock_token_seq AS bigint";

/// Transaction-scoped, no wait: takes the transaction advisory lock and, only
/// if taken, draws the token — one statement, for the reasons of
/// [`TRY_LOCK`], whose argument for rising tokens holds here word for word
/// (the lock is let go by the caller's COMMIT or ROLLBACK, a later message).
pub(super) const XACT_TRY_LOCK: &str = concat!(
    "SELECT CASE WHEN pg_catalog.pg_try_advisory_xact_lock(
                pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8)) THEN (",
    draw_token!("", ""),
    ") END"
);

/// Transaction-scoped, waiting under `lock_timeout` (set just before, inside
/// a savepoint): the innermost subquery waits for the lock, and only then
/// the token is drawn, with the clock read after the wait (see
/// [`TRY_LOCK`]). Should the lock be granted in the instant the timeout
/// fires, the statement still fails, and rolling back to the savepoint
/// drops the lock it took.
pub(super) const XACT_LOCK: &str = draw_token!(
    "",
    "FROM (SELECT pg_catalog.pg_advisory_xact_lock(
                pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8))
      OFFSET 0) AS locked"
);

/// Sets `lock_timeout` for the rest of the (sub)transaction and returns the
/// value it had, to be put back once the lock is taken.
pub(super) const XACT_SWAP_LOCK_TIMEOUT: &str = "\
SELECT s.prev, pg_catalog.set_config('lock_timeout'::pg_catalog.text, $1::pg_catalog.text, true)
FROM (SELECT pg_catalog.current_setting('lock_timeout'::pg_catalog.text) AS prev OFFSET 0) AS s";

/// Sets `lock_timeout` for the rest of the transaction (milliseconds, as
/// text): puts it back after a transaction lock, and lets the creation of
/// the schema objects wait longer than a lock session's statements.
pub(super) const SET_LOCAL_LOCK_TIMEOUT: &str =
    "SELECT pg_catalog.set_config('lock_timeout'::pg_catalog.text, $1::pg_catalog.text, true)";

/// True when a statement failed because the token sequence (or its schema)
/// does not exist: a DBA dropped it after the backend connected. The lock
/// statements name it, so a prepared one fails when it is re-planned.
pub(super) fn sequence_missing(err: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    err.code().is_some_and(|code| {
        *code == SqlState::UNDEFINED_TABLE || *code == SqlState::INVALID_SCHEMA_NAME
    })
}

/// True when the error came from a function or a statement run on a lock
/// statement's behalf (a DBA's trigger on the table of records, a foreign
/// key's check), not from the statement itself: its context names them.
/// The lock statements call no function that runs SQL.
pub(super) fn raised_by_a_trigger(err: &tokio_postgres::Error) -> bool {
    err.as_db_error()
        .and_then(|db| db.where_())
        .is_some_and(|context| context.contains("function") || context.contains("SQL statement"))
}

/// What a lock statement refused its token sequence for (see
/// `draw_token!` and [`REFUSED`]), if that is why it failed.
pub(super) fn refused_sequence(err: &tokio_postgres::Error) -> Option<Unfit> {
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

/// Reads what a recording lock statement ([`TRY_LOCK_RECORDING`],
/// [`FAIR_LOCK_RECORDING`]) says of its record: the time of the record it
/// wrote (`None`: it wrote none; the time now, if a DBA's trigger blanked
/// the row's), from the columns `since` (at `at`) and `wrote` (after it,
/// and after `already` when the statement has that column, `already`:
/// whose value comes second).
pub(super) fn recorded_since(
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
pub(super) enum Unfit {
    /// `CACHE` above 1, `CYCLE`, or a non-positive increment.
    Settings,
    /// More than a day ahead of the server clock in microseconds.
    AheadOfClock,
}

/// Whether a lock statement ([`TRY_LOCK`], [`TRY_LOCK_RECORDING`]) that
/// failed left its session holding the key's lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LockLeft {
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
pub(super) fn lock_left_by(err: &tokio_postgres::Error, recording: bool) -> LockLeft {
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
pub(super) fn unencodable(err: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    err.code().is_some_and(|code| {
        *code == SqlState::UNTRANSLATABLE_CHARACTER
            || *code == SqlState::CHARACTER_NOT_IN_REPERTOIRE
    })
}

/// Fills `{schema}` in a statement.
pub(crate) fn render(statement: &str, quoted_schema: &str) -> String {
    statement.replace("{schema}", quoted_schema)
}

/// The DDL a DBA runs to bring a table of holder records of an older dlock
/// to this version's shape (as the table's owner), for errors.
pub(super) fn holders_migration_ddl_for_dba(quoted_schema: &str) -> String {
    render(MIGRATE_HOLDERS_TABLE, quoted_schema)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        + ";"
}

/// The DDL a DBA runs to create the table of holder records, for errors.
pub(super) fn holders_ddl_for_dba(quoted_schema: &str, role_hint: &str) -> String {
    format!(
        "{create}; GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.dlock_holders TO {r};",
        create = render(CREATE_HOLDERS_TABLE, quoted_schema)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
        s = quoted_schema,
        r = role_hint,
    )
}

/// The DDL a DBA runs to pre-create the backend's objects, for errors.
pub(super) fn ddl_for_dba(quoted_schema: &str, role_hint: &str) -> String {
    format!(
        "CREATE SCHEMA IF NOT EXISTS {s}; \
         CREATE SEQUENCE IF NOT EXISTS {s}.dlock_token_seq AS bigint; \
         GRANT USAGE ON SCHEMA {s} TO {r}; \
         GRANT USAGE, UPDATE ON SEQUENCE {s}.dlock_token_seq TO {r};",
        s = quoted_schema,
        r = role_hint,
    )
}

/// A granted shared hold of the advisory key `p` (a read phase's
/// membership lock, see [`MODES_SETUP`]) in this database.
macro_rules! phase_hold {
    () => {
        "SELECT FROM pg_catalog.pg_locks AS l
  WHERE l.locktype = 'advisory'::pg_catalog.text AND l.granted
  AND l.mode = 'ShareLock'::pg_catalog.text AND l.objsubid = 1::pg_catalog.int2
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database())
  AND l.classid::pg_catalog.int8 = ((p >> 32::pg_catalog.int4) & 4294967295::pg_catalog.int8)
  AND l.objid::pg_catalog.int8 = (p & 4294967295::pg_catalog.int8)"
    };
}

/// Creates what shared locks and permits need, once per backend, before
/// the first shared attempt, permit attempt or writer-waiting mark: the
/// table of read phases (a key's phase token and its writer-waiting mark,
/// rule M3) and the three functions that make each attempt one statement.
/// Serialised across processes by a transaction-level advisory lock, as
/// `CREATE OR REPLACE FUNCTION` run at once by two sessions fails.
///
/// Keys are never spliced into the functions: they take the key as an
/// argument and hash it on the server as every lock statement does.
///
/// - `dlock_try_shared(key, seed)`: tries the shared advisory lock of the
///   key (`pg_try_advisory_lock_shared`, which conflicts with any exclusive
///   holder, of dlock or not), then refuses (`marked`) while a writer's
///   mark is live. A reader also holds a shared lock on the phase key
///   `hashtextextended('dlock-phase:' || key, seed)`, which only readers
///   take: the phase is live while a session holds it (the wait probe's
///   brief shared locks on the key itself could not be told apart from a
///   reader's). Whether another session does is one non-blocking
///   transaction-level exclusive try of the phase key: granted, no phase
///   is live, and the attempt starts one, drawing the token as
///   [`TRY_LOCK`] does and writing it into the key's row while it still
///   holds that exclusive lock, which the commit drops only once the row
///   is visible. Refused, the reader takes the phase key shared (waiting,
///   at most for a starter's end) and tries again: granted now, whoever it
///   waited behind left without a phase (rolled back, or its session
///   ended), and it starts one itself; refused, the others hold it as
///   members of a committed phase, and it joins, reading the phase token
///   with a snapshot taken after its grant (lock sessions run read
///   committed, see [`SESSION_DEFAULTS`]). A failure or a cancel inside
///   gives back what the attempt took, so no session holds the phase key
///   without its phase's row. The try
///   cannot tell the session's own holds from none, so the backend never
///   sends this on a session that holds the key shared (readers of one
///   process share one hold, see the `modes` module). No row is locked
///   and no lock table is scanned: a reader costs what a writer does. A
///   live phase whose row lost its token (a DBA truncated the table)
///   refuses new readers until it ends: a token drawn anew would be above
///   the current readers', whom a `>=` fence would then refuse. A failed
///   draw gives back what the attempt took (session locks outlive a failed
///   statement).
/// - `dlock_mark(key, seed, owner, ttl_ms)`: while readers hold, leaves or
///   refreshes `owner`'s mark (expiring `ttl_ms` from now) (a live mark of another owner stays: one
///   waiting writer is enough to hold new readers off); answers whether
///   readers hold.
/// - `dlock_try_permit(key, seed, n, skipped)`: tries the slots `0..n` in
///   order, except those in `skipped` (this process's own slots, which a
///   re-entrant grant on the same session would hand out twice), one
///   `pg_try_advisory_lock` each on `hashtextextended('dlock-permit:' ||
///   slot || ':' || key, seed)`, and stops at the first taken: a loop, so
///   no try after the winning one runs and no extra lock is left. The
///   token is drawn only for the slot taken.
pub(super) const MODES_SETUP: &str = concat!(
    "DO $setup$
BEGIN
PERFORM pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended('dlock-modes-setup'::pg_catalog.text, 0::pg_catalog.int8));
CREATE UNLOGGED TABLE IF NOT EXISTS {schema}.dlock_phases (
    lock_id pg_catalog.int8 PRIMARY KEY, phase_token pg_catalog.int8,
    mark_owner pg_catalog.text, mark_until pg_catalog.timestamptz);
CREATE OR REPLACE FUNCTION {schema}.dlock_try_shared(k pg_catalog.text, seed pg_catalog.int8,
    OUT granted_token pg_catalog.int8, OUT marked pg_catalog.bool)
LANGUAGE plpgsql AS $f$
DECLARE
    h pg_catalog.int8 := pg_catalog.hashtextextended(k, seed);
    p pg_catalog.int8 := pg_catalog.hashtextextended('dlock-phase:'::pg_catalog.text OPERATOR(pg_catalog.||) k, seed);
    took_p pg_catalog.bool := false;
    starts pg_catalog.bool;
BEGIN
    PERFORM pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, true);
    marked := false;
    IF NOT pg_catalog.pg_try_advisory_lock_shared(h) THEN RETURN; END IF;
    BEGIN
        marked := EXISTS (SELECT FROM {schema}.dlock_phases AS t
                          WHERE t.lock_id OPERATOR(pg_catalog.=) h
                            AND t.mark_until OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp());
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        PERFORM pg_catalog.pg_advisory_unlock_shared(h);
        RAISE;
    END;
    IF marked THEN
        PERFORM pg_catalog.pg_advisory_unlock_shared(h);
        RETURN;
    END IF;
    -- The phase key's tries are outside every block: a transaction-level
    -- lock taken in a block that fails goes at once, before the handler
    -- gave back this session's locks, and a joiner waiting behind would
    -- then find the phase key still held and take the row for a phase's.
    starts := pg_catalog.pg_try_advisory_xact_lock(p);
    IF NOT starts THEN
        BEGIN
            PERFORM pg_catalog.pg_advisory_lock_shared(p);
        EXCEPTION WHEN OTHERS OR query_canceled THEN
            PERFORM pg_catalog.pg_advisory_unlock_shared(h);
            RAISE;
        END;
        took_p := true;
        -- Granted once no starter held the phase key: whoever this waited
        -- behind committed its phase, or left without one. A starter whose
        -- session ended (pg_terminate_backend) gives back its transaction's
        -- lock before its session's, so the grant can come while its shared
        -- hold of the phase key stands a moment longer: a refusal is asked
        -- again, a few milliseconds apart, before it is taken for a
        -- committed phase's members (whose row this would join).
        FOR attempt IN 1..10 LOOP
            starts := pg_catalog.pg_try_advisory_xact_lock(p);
            EXIT WHEN starts OR attempt OPERATOR(pg_catalog.=) 10;
            PERFORM pg_catalog.pg_sleep(0.005);
        END LOOP;
        IF NOT starts THEN
            BEGIN
                SELECT t.phase_token INTO granted_token FROM {schema}.dlock_phases AS t
                WHERE t.lock_id OPERATOR(pg_catalog.=) h;
            EXCEPTION WHEN OTHERS OR query_canceled THEN
                PERFORM pg_catalog.pg_advisory_unlock_shared(p);
                PERFORM pg_catalog.pg_advisory_unlock_shared(h);
                RAISE;
            END;
            IF granted_token IS NULL THEN
                PERFORM pg_catalog.pg_advisory_unlock_shared(p);
                PERFORM pg_catalog.pg_advisory_unlock_shared(h);
            END IF;
            RETURN;
        END IF;
    END IF;
    BEGIN
        IF NOT took_p THEN
            PERFORM pg_catalog.pg_advisory_lock_shared(p);
            took_p := true;
        END IF;
        granted_token := (",
    draw_token!("", ""),
    ");
        INSERT INTO {schema}.dlock_phases AS t (lock_id, phase_token) VALUES (h, granted_token)
        ON CONFLICT (lock_id) DO UPDATE SET phase_token = excluded.phase_token;
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        IF took_p THEN PERFORM pg_catalog.pg_advisory_unlock_shared(p); END IF;
        PERFORM pg_catalog.pg_advisory_unlock_shared(h);
        RAISE;
    END;
END
$f$;
CREATE OR REPLACE FUNCTION {schema}.dlock_mark(k pg_catalog.text, seed pg_catalog.int8, me pg_catalog.text,
    ttl_ms pg_catalog.int8)
RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $f$
DECLARE
    h pg_catalog.int8 := pg_catalog.hashtextextended(k, seed);
    p pg_catalog.int8 := pg_catalog.hashtextextended('dlock-phase:'::pg_catalog.text OPERATOR(pg_catalog.||) k, seed);
BEGIN
    IF NOT EXISTS (",
    phase_hold!(),
    ") THEN RETURN false; END IF;
    INSERT INTO {schema}.dlock_phases AS t (lock_id, mark_owner, mark_until)
    VALUES (h, me, pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+)
            (ttl_ms OPERATOR(pg_catalog.*) '1 millisecond'::pg_catalog.interval))
    ON CONFLICT (lock_id) DO UPDATE SET mark_owner = excluded.mark_owner, mark_until = excluded.mark_until
    WHERE t.mark_owner IS NULL OR t.mark_owner OPERATOR(pg_catalog.=) me
       OR t.mark_until OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp();
    RETURN true;
END
$f$;
CREATE OR REPLACE FUNCTION {schema}.dlock_try_permit(k pg_catalog.text, seed pg_catalog.int8,
    n pg_catalog.int4, skipped pg_catalog.int4[],
    OUT granted_slot pg_catalog.int4, OUT granted_token pg_catalog.int8)
LANGUAGE plpgsql AS $f$
DECLARE
    sh pg_catalog.int8;
BEGIN
    PERFORM pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, true);
    FOR slot_no IN 0 .. n OPERATOR(pg_catalog.-) 1 LOOP
        CONTINUE WHEN slot_no OPERATOR(pg_catalog.=) ANY (skipped);
        sh := pg_catalog.hashtextextended(pg_catalog.concat('dlock-permit:'::pg_catalog.text, slot_no, ':'::pg_catalog.text, k), seed);
        IF pg_catalog.pg_try_advisory_lock(sh) THEN
            BEGIN
                granted_token := (",
    draw_token!("", ""),
    ");
            EXCEPTION WHEN OTHERS OR query_canceled THEN
                PERFORM pg_catalog.pg_advisory_unlock(sh);
                RAISE;
            END;
            granted_slot := slot_no;
            RETURN;
        END IF;
    END LOOP;
END
$f$;
END
$setup$"
);

/// A shared attempt: one statement (see [`MODES_SETUP`]), sent only on a
/// session that holds nothing of the key. Returns the token (NULL:
/// refused) and whether a writer's mark refused it.
pub(super) const TRY_SHARED: &str = "SELECT s.granted_token, s.marked FROM {schema}.dlock_try_shared($1::pg_catalog.text, $2::pg_catalog.int8) AS s";

/// Drops this process's shared hold of a key (its last reader left): the phase key first, so that once the key
/// itself is free no phase looks live (a reader that came after a writer
/// who took the key in between would otherwise be granted the old phase's
/// token, below the writer's).
pub(super) const UNLOCK_SHARED: &str = "\
SELECT pg_catalog.pg_advisory_unlock_shared(pg_catalog.hashtextextended(
           'dlock-phase:'::pg_catalog.text OPERATOR(pg_catalog.||) $1::pg_catalog.text, $2::pg_catalog.int8)),
       pg_catalog.pg_advisory_unlock_shared(pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8))";

/// Leaves or refreshes a writer-waiting mark while readers hold (rule
/// M3); answers whether readers hold.
pub(super) const MARK: &str = "SELECT {schema}.dlock_mark($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.text, $4::pg_catalog.int8)";

/// Whether a writer's mark on the key is live: a reader of this process
/// that joins the read phase it holds (see the `modes` module) asks this
/// instead of the server's locks, so a stream of such readers does not
/// starve a waiting writer of another process (rule M3).
pub(super) const MARKED: &str = "\
SELECT EXISTS (SELECT FROM {schema}.dlock_phases AS t
               WHERE t.lock_id OPERATOR(pg_catalog.=) pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8)
                 AND t.mark_until OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp())";

/// Removes `owner`'s writer-waiting mark, if it is the key's mark.
pub(super) const UNMARK: &str = "\
UPDATE {schema}.dlock_phases SET mark_owner = NULL, mark_until = NULL
WHERE lock_id OPERATOR(pg_catalog.=) pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8)
  AND mark_owner OPERATOR(pg_catalog.=) $3::pg_catalog.text";

/// A permit attempt: every slot tried in one statement (see
/// [`MODES_SETUP`]). Returns the slot and the token, both NULL if every
/// slot is held.
pub(super) const TRY_PERMIT: &str = "\
SELECT s.granted_slot, s.granted_token
FROM {schema}.dlock_try_permit($1::pg_catalog.text, $2::pg_catalog.int8, $3::pg_catalog.int4, $4::pg_catalog.int4[]) AS s";

/// Drops a permit slot's lock (see [`MODES_SETUP`]).
pub(super) const UNLOCK_PERMIT: &str = "\
SELECT pg_catalog.pg_advisory_unlock(pg_catalog.hashtextextended(pg_catalog.concat(
    'dlock-permit:'::pg_catalog.text, $3::pg_catalog.int4, ':'::pg_catalog.text, $1::pg_catalog.text), $2::pg_catalog.int8))";

/// Whether the functions of [`MODES_SETUP`] exist: a refused writer leaves
/// a mark only where shared locks are in use.
pub(super) const MODES_EXIST: &str = "SELECT pg_catalog.to_regprocedure(\
'{schema}.dlock_mark(pg_catalog.text,pg_catalog.int8,pg_catalog.text,pg_catalog.int8)'::pg_catalog.text) IS NOT NULL";

#[cfg(test)]
mod tests {
    use super::holders_channel;

    #[test]
    fn a_holders_channel_fits_a_channel_name_and_tells_long_schemas_apart() {
        assert_eq!(holders_channel("dlock"), "dlock_holders_dlock");
        let fits = "s".repeat(49);
        assert_eq!(holders_channel(&fits), format!("dlock_holders_{fits}"));
        let (long, other) = ("a".repeat(63), format!("{}b", "a".repeat(62)));
        let channel = holders_channel(&long);
        assert_eq!(channel.len(), 63, "{channel}");
        assert!(channel.starts_with(&format!("dlock_holders_{}_", "a".repeat(32))));
        assert!(
            channel
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
            "{channel}"
        );
        assert_ne!(channel, holders_channel(&other));
        // Every process, of every version, must name the same channel.
        assert_eq!(
            channel,
            format!("dlock_holders_{}_51c1e07b2aee9066", "a".repeat(32))
        );
    }
}

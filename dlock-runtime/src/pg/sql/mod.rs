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
//! # Where each statement lives
//!
//! The DDL and the PL/pgSQL are `.sql` files with their why-comments, for
//! the schema [`FILE_SCHEMA`]: a DBA runs what dlock runs (docs/postgres.md).
//!
//! This file keeps what several kinds of statement share: the session
//! settings, the token draw (`draw_token!`) with its refusal mark, the
//! check of a recording statement's row (`wrote_row!`), a key's release
//! gate (`release_gate!`) and a key's exclusive hold in `pg_locks`
//! (`exclusive_hold!`). The statements themselves are grouped by what they
//! do, each group a file, and every one is reachable here by its name:
//!
//! - `lock`: the exclusive lock of a lock session and of a caller's
//!   transaction, its unlocks and the server-side wait for a release;
//! - `records`: the writes and deletes of holder records;
//! - `holders`: the reads of who holds a key, announcements and force
//!   releases;
//! - `fair`: the fair waiter's statements and its session's settings;
//! - `modes`: shared locks and permits;
//! - `schema`: the schema objects, their inspection and the DBA's DDL;
//! - `marks`: the text of a named lease's token marks, shared by its
//!   lock, its unlock and the reads of who holds a key;
//! - `failures`: what a failed lock statement's error says.

/// `token_mark_a!` and the other macros of a named lease's token marks.
#[macro_use]
mod marks;

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
///
/// And generic plans for prepared statements (`plan_cache_mode`,
/// PostgreSQL 12+), so each is planned once per session, not at every
/// execution. Left to choose, the server replans the lock statement that
/// records the holder ([`TRY_LOCK_RECORDING`]) at every bind: a custom
/// plan folds its `COALESCE($6, EXISTS (… pg_locks …))` to the value
/// given and looks far cheaper than the generic plan, which keeps the
/// scan of the lock table it never runs (`COALESCE` stops at its first
/// value that is not NULL). Planning that statement took 170 µs, more than
/// twice its execution, on every acquisition. dlock's statements only
/// compute with their parameters, whose values never change which plan is
/// best, so nothing is lost by planning them once.
///
/// And no parameters in the context of an error
/// (`log_parameter_max_length_on_error` 0, PostgreSQL 13+, which a DBA
/// may set for a role or the server): with it, every error of a statement
/// sent with parameters would carry their values in its context, over
/// several lines for a key holding a newline, and the backend tells an
/// error of a DBA's trigger by its context (see `raised_by_a_trigger`).
/// The server's log still shows every failed statement, without its
/// parameters' values.
///
/// And asynchronous commits (`synchronous_commit` off) for every statement
/// of the session, which none of them sets again: the call cost the server
/// 9 k of the 253 k instructions of a named lock and unlock (callgrind;
/// examples/bench/notes.md). A `nextval` logs once
/// in 32 values, and a commit that waited for it would wait for a WAL
/// flush. What dlock writes on its sessions is lost to a crash at no
/// cost: the sequence's position is floored by the clock, the tables of
/// names are unlogged, and a holder record is believed only beside its
/// session's live hold.
pub(super) const SESSION_DEFAULTS: &str = "\
SELECT pg_catalog.set_config('search_path'::pg_catalog.text, 'pg_catalog, pg_temp'::pg_catalog.text, false),
       pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, false),
       pg_catalog.set_config('lock_timeout'::pg_catalog.text, $1::pg_catalog.text, false),
       pg_catalog.set_config('default_transaction_isolation'::pg_catalog.text, 'read committed'::pg_catalog.text, false),
       CASE WHEN pg_catalog.current_setting('server_version_num'::pg_catalog.text)::pg_catalog.int4
                 OPERATOR(pg_catalog.>=) 120000::pg_catalog.int4
            THEN pg_catalog.set_config('plan_cache_mode'::pg_catalog.text,
                                       'force_generic_plan'::pg_catalog.text, false)
       END,
       CASE WHEN pg_catalog.current_setting('server_version_num'::pg_catalog.text)::pg_catalog.int4
                 OPERATOR(pg_catalog.>=) 130000::pg_catalog.int4
            THEN pg_catalog.set_config('log_parameter_max_length_on_error'::pg_catalog.text,
                                       '0'::pg_catalog.text, false)
       END";

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

/// Draws a fencing token once the lock is taken, for the lock statements
/// that run in a transaction of their own (the lock sessions' statements
/// and the shared and permit functions): the token is `nextval` while it
/// leads the clock by half the lead or more, else the clock plus the lead
/// (`nextval` still, for a role that may not write), the clock being the
/// server's `clock_timestamp()` in microseconds since 1970 and the lead the
/// sequence's token lead (see `token_lead!`; 0 unless switched on) — the
/// Redis backend's rule with the clock moved up by the lead, and the same
/// two guarantees as there:
///
/// - The clock floor keeps tokens above every token handed out before when
///   the sequence goes back: a DBA drops and recreates it or `setval`s it,
///   a failover to an asynchronous replica or a point-in-time restore
///   brings back an older copy, a crash loses its last moves. No token is
///   ever above the clock *plus the lead* at its draw (a token from the
///   sequence is drawn only while the sequence is at or below the clock
///   plus the lead it was last set with, unless tokens come faster than
///   one a microsecond), and the floor after a loss is a later clock plus
///   the same lead.
/// - The sequence holds at least the last token, so a server clock that
///   steps back cannot lower tokens: whenever the sequence leads the clock
///   by less than half the lead (is behind it, without a lead), the same
///   statement `setval`s it to the token — if the role has UPDATE on it,
///   which is asked only then. Without UPDATE tokens
///   rest on the bare clock, without the lead: a token above the clock
///   that the sequence does not hold could be undercut by a draw within
///   the lead after another's `setval` of an earlier clock reading. So such
///   a role's token is below the floor after a loss by up to the lead.
///   `setval` returns the value it set.
///
/// What the lead buys: a draw while the sequence is still ahead of the
/// clock hands out `nextval` and writes nothing (`nextval` logs once in
/// 32 values), so with a lead of 10 ms the sequence is written about once
/// per 5 ms per server, not at every acquisition. Without one, nearly
/// every draw writes (tokens come slower than one a microsecond), and a
/// write costs WAL and a transaction id. This statement writes at half
/// the lead, not when the sequence has fallen behind, so that a backend
/// that sends it once half the lead it last learned has passed (see
/// `quick::QuickDraw`) keeps the sequence ahead: its quick statements
/// never find it behind, and never all turn to this one at once.
///
/// A sequence more than a day behind the clock is taken for a new or a
/// lost one (recreated, set back to its start, restored from long ago):
/// its draw floors tokens at the clock plus 10 ms, the largest lead,
/// whatever its comment says. A sequence dropped and recreated loses its
/// comment, and with it the lead its last tokens were handed out with;
/// the floor must still be above them.
///
/// Every draw holds the *draw lock* (see `draw_lock!`) from before its
/// `nextval` to the end of its statement's transaction: exclusively here,
/// shared in the quick draw (`quick_draw!`). A sequence has no "raise to
/// at least" that is one step: `setval` is a write of its own after the
/// `nextval` that decided it, and a `nextval` of another session between
/// the two would be undone by it, so the next draw would hand out that
/// value again, to the same key perhaps (a writer descheduled between
/// its two calls while another session takes and lets go of a key). So
/// no draw takes `nextval` while a draw that may write holds the lock, and
/// a write is `setval` to the clock plus the lead, above the `nextval` it
/// follows (which was below the clock plus half the lead) and above every
/// value drawn before, none of which came in between. A draw in a caller's
/// transaction must not hold the draw lock until that transaction ends:
/// it draws in a savepoint of its own (see `DRAW_IN_SAVEPOINT`).
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
/// before the change. The check reads the settings with
/// `pg_sequence_parameters`, from the catalog's cache (it needs USAGE,
/// SELECT or UPDATE on the sequence, which every role that may `nextval`
/// has), not with a
/// subquery of `pg_sequence`, whose table and index the server would open
/// at every execution: that cost a draw twice what the calls do. One call,
/// a column of the innermost subquery beside `nextval` and after it, whose
/// fields the conditions read (a field of the call itself would call it
/// once a field: 11 k of a named lock's 253 k instructions, callgrind).
/// After `nextval`, in the same statement: an `ALTER SEQUENCE` waits for
/// the lock `nextval` takes on the sequence until the statement's
/// transaction ends, so the settings read are the ones `nextval` drew with.
///
/// The draw lock is the innermost row source, so the order is fixed: the
/// lock (the caller's `CASE`), the draw lock, `nextval`, the clock
/// reading. `OFFSET 0` keeps each subquery from being merged into the
/// next (and the planner keeps a volatile column it does not need). The
/// lead, the privilege and `setval` are conditions of one `CASE`, which
/// evaluates them in order and stops at the first that holds (the calls
/// are volatile, so none is folded while planning). Not subqueries: the
/// server builds the executor state of every subquery of a plan at each
/// execution, taken or not, and the write is taken once per half lead.
/// The write needs only UPDATE on the sequence, as `setval` does (no
/// `currval`, which needs USAGE or SELECT: a transaction lock's role may
/// have UPDATE alone).
macro_rules! draw_token {
    () => {
        draw_token!("", "")
    };
    ($head:literal, $tail:literal) => {
        concat!(
            "SELECT ",
            $head,
            "CASE WHEN ",
            far_ahead!(),
            "
            THEN pg_catalog.int8in(pg_catalog.textout(pg_catalog.concat(
                     'dlock-refused: the token sequence is far ahead of the clock: '::pg_catalog.text,
                     t.seq, ' at '::pg_catalog.text, t.clock)))
            WHEN ",
            unfit_settings!(),
            "
            THEN pg_catalog.int8in(pg_catalog.textout(pg_catalog.concat(
                     'dlock-refused: the token sequence has unfit settings: '::pg_catalog.text,
                     t.seq)))
            WHEN (t.clock OPERATOR(pg_catalog.+) (",
            lead!(),
            " OPERATOR(pg_catalog./) 2::pg_catalog.int8)) OPERATOR(pg_catalog.<=) t.seq THEN t.seq
            WHEN NOT pg_catalog.has_sequence_privilege(
                         '{schema}.dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid,
                         'UPDATE'::pg_catalog.text)
            THEN GREATEST(t.seq, t.clock)
            ELSE pg_catalog.setval('{schema}.dlock_token_seq'::pg_catalog.regclass,
                     t.clock OPERATOR(pg_catalog.+) ",
            lead!(),
            ") END",
            $tail,
            draw_from!("pg_advisory_xact_lock")
        )
    };
}

/// The lead of a draw behind the clock: the sequence's own (`token_lead!`),
/// or 10 ms for a sequence more than a day behind the clock (new or lost).
macro_rules! lead {
    () => {
        concat!(
            "(CASE WHEN t.seq OPERATOR(pg_catalog.<) (t.clock OPERATOR(pg_catalog.-) 86400000000::pg_catalog.int8)
                  THEN 10000::pg_catalog.int8
                  ELSE ",
            token_lead!(),
            " END)"
        )
    };
}

/// Whether the sequence (`t.seq`) is more than a day ahead of the clock
/// (`t.clock`): `draw_token!` refuses it, and `quick_draw!` leaves it to
/// `draw_token!`.
macro_rules! far_ahead {
    () => {
        "t.seq OPERATOR(pg_catalog.>) (t.clock OPERATOR(pg_catalog.+) 86400000000::pg_catalog.int8)"
    };
}

/// Whether the sequence's settings (`t.p`, from `pg_sequence_parameters`)
/// cannot give rising tokens: `draw_token!` refuses them, and
/// `quick_draw!` leaves them to `draw_token!`. One text for both, so a check added to the
/// draw is a check of the quick one too.
macro_rules! unfit_settings {
    () => {
        "(t.p).cache_size
                     OPERATOR(pg_catalog.<>) 1::pg_catalog.int8
                 OR (t.p).cycle_option
                 OR (t.p).increment
                     OPERATOR(pg_catalog.<=) 0::pg_catalog.int8"
    };
}

/// The rows a draw reads (`t.seq`, `t.p`, `t.clock`), for `draw_token!` and
/// `quick_draw!`: the draw lock taken with `$lock` (see `draw_lock!`),
/// then `nextval`, then the sequence's settings, then the clock, in that
/// order.
macro_rules! draw_from {
    ($lock:literal) => {
        concat!(
            "
FROM (SELECT s.seq, s.p,
             (EXTRACT(epoch FROM pg_catalog.clock_timestamp())
              OPERATOR(pg_catalog.*) 1000000::pg_catalog.int8)::pg_catalog.int8 AS clock
      FROM (SELECT pg_catalog.nextval('{schema}.dlock_token_seq'::pg_catalog.regclass) AS seq,
                   pg_catalog.pg_sequence_parameters(
                       '{schema}.dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid) AS p ",
            "FROM (SELECT ",
            draw_lock!($lock),
            " OFFSET 0) AS l",
            " OFFSET 0) AS s OFFSET 0) AS t"
        )
    };
}

/// The quick draw of the lock statements a lock session sends while its
/// token sequence leads the clock ([`TRY_LOCK_QUICK`],
/// [`TRY_LOCK_NAMED_QUICK`]): `draw_token!`'s token from `nextval`, under the
/// same checks (at or ahead of the clock, at most a day ahead, fit
/// settings), else NULL, and the statement gives its lock back at once.
/// It holds the draw lock shared, so no draw that may write runs beside
/// it (see `draw_token!`), and draws of this kind run beside each other.
/// None of `draw_token!`'s rarer branches is in it: no refusal text, no lead, no
/// `setval`. PostgreSQL 15 builds every expression of a
/// generic plan at each execution, branches never taken included, so a
/// statement costs what its text holds: those branches were more than a
/// third of a named lock's server instructions (examples/bench/notes.md).
///
/// A token from here is one `draw_token!` would have given in the same
/// place (rule 1 of [`TRY_LOCK`]); a sequence that fails any check gives
/// no token here, and the full statement draws, or refuses with its
/// reason.
macro_rules! quick_draw {
    () => {
        concat!(
            "SELECT CASE WHEN t.clock OPERATOR(pg_catalog.<=) t.seq
                  AND NOT ",
            far_ahead!(),
            "
                  AND NOT (",
            unfit_settings!(),
            ")
             THEN t.seq END",
            draw_from!("pg_advisory_xact_lock_shared")
        )
    };
}

/// A named lease's two token marks of the advisory key `$h` with the token
/// `$t` (see [`TRY_LOCK_NAMED`]), as one `CASE`, which evaluates its
/// conditions in order and stops at the first that holds (the calls are
/// volatile, so none is folded while planning): a key whose marks could
/// be the draw lock (`marks_on_the_draw_lock!`), 0, taking none; the first
/// mark refused, 0; the second taken, 1; else the first is dropped, 0.
macro_rules! token_marks {
    ($h:literal, $t:literal) => {
        concat!(
            "CASE WHEN ",
            marks_on_the_draw_lock!($h),
            " THEN 0::pg_catalog.int8
                      WHEN NOT ",
            token_mark_a!("pg_catalog.pg_try_advisory_lock_shared", $h, $t),
            " THEN 0::pg_catalog.int8
                      WHEN ",
            token_mark_b!("pg_catalog.pg_try_advisory_lock_shared", $h, $t),
            " THEN 1::pg_catalog.int8
                      WHEN ",
            token_mark_a!("pg_catalog.pg_advisory_unlock_shared", $h, $t),
            " THEN 0::pg_catalog.int8
                      ELSE 0::pg_catalog.int8 END"
        )
    };
}

/// The sequence's token lead in microseconds (see `draw_token!`), an
/// `int8` expression: what its comment says, `dlock-token-lead-us=N`
/// with N at most 10,000 (10 ms), else 0. At most 10 ms, because a server
/// that crashed and came back faster than the lead (its last `setval`
/// lost with the asynchronous commit) would find its sequence still ahead
/// of the clock and hand out again tokens drawn within the lead: no
/// server restarts or fails over in 10 ms. Kept in the
/// database, not in each backend, so every process that draws from the
/// sequence uses the same lead, and a DBA switches it for all of them at
/// once: on (`SET_TOKEN_LEAD` sets 10 ms on a sequence dlock creates
/// with its schema)
/// only once no process of a dlock without the draw lock draws from it,
/// whose writes could otherwise land out of order with a leading one
/// (see docs/postgres.md, "What a token costs"). A comment is readable
/// by every role. Read only by draws that must write.
macro_rules! token_lead {
    () => {
        "LEAST(COALESCE(pg_catalog.substring(
                    pg_catalog.obj_description('{schema}.dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid,
                                               'pg_class'::pg_catalog.name),
                    '^dlock-token-lead-us=([0-9]{1,7})$'::pg_catalog.text)::pg_catalog.int8,
                  0::pg_catalog.int8), 10000::pg_catalog.int8)"
    };
}

/// Takes the draw lock for the rest of the transaction with `$f`
/// (`pg_advisory_xact_lock`, or `pg_advisory_xact_lock_shared` for a draw
/// that never writes; see `draw_token!`): the advisory lock
/// `(0x64726177, sequence oid)` in the
/// `(int4, int4)` form (`objsubid` 2, never one of dlock's keys), the
/// oid's top bit dropped to fit an `int4` (two sequences whose oids
/// differ only there share one draw lock, which only serialises more).
/// One per sequence, so schemas do not wait for each other.
macro_rules! draw_lock {
    ($f:literal) => {
        concat!(
            "pg_catalog.",
            $f,
            "(1685217655::pg_catalog.int4,
                    (('{schema}.dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid::pg_catalog.int8)
                     OPERATOR(pg_catalog.&) 2147483647::pg_catalog.int8)::pg_catalog.int4)"
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
/// (`RELEASE_GATE`). While the force release holds it, the session
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

/// The two `int4` halves of a key's `rewriting` mark, from its advisory
/// key `h` (an SQL expression), in the `(int4, int4)` form (`objsubid` 2,
/// never one of dlock's keys): see `TRY_LOCK_RECORDING`, which takes it
/// for its transaction, and `FAIR_LOCK_MARKED`, which holds it for the
/// session while a fair waiter's record is not yet committed.
macro_rules! rewriting_mark {
    ($h:literal) => {
        concat!(
            "(",
            $h,
            " OPERATOR(pg_catalog.>>) 32::pg_catalog.int4)::pg_catalog.int4,
             ((",
            $h,
            " OPERATOR(pg_catalog.<<) 32::pg_catalog.int4) OPERATOR(pg_catalog.>>) 32::pg_catalog.int4)::pg_catalog.int4"
        )
    };
}

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

mod failures;
mod fair;
mod holders;
mod lock;
mod modes;
mod records;
mod schema;

pub(super) use self::failures::{
    LockLeft, Unfit, dropped_while_running, lock_left_by, missing_or_dropped, raised_by_a_trigger,
    raised_by_the_mode_call, recorded_since, refused_sequence, sequence_missing, session_gone,
    unencodable,
};
pub(super) use self::fair::{
    CLIENT_CONNECTION_CHECK, FAIR_LOCK, FAIR_LOCK_MARKED, FAIR_RECORD, FAIR_SESSION_SETUP,
    WAITS_IN_QUEUE,
};
pub(super) use self::holders::{
    ANNOUNCE, FORCE_RELEASE_NAMED, ForceWaits, HELD, HELD_NAMED, HOLDER_RECORD, HOLDER_SESSION,
    HOLDERS, KEY_HELD, LISTEN, SESSION_HOLDERS, TERMINATE_HOLDERS, force_release_named,
    holders_channel,
};
pub(super) use self::lock::{
    DRAW_IN_SAVEPOINT, LOCK_SESSION_SETUP, SET_LOCAL_LOCK_TIMEOUT, UNDO_MARKS, UNLOCK_ALL,
    UNLOCK_KEY, WAIT_FOR_RELEASE, XACT_LOCK, XACT_SWAP_LOCK_TIMEOUT, XACT_TRY_LOCK,
};
pub use self::lock::{
    TRY_LOCK, TRY_LOCK_NAMED, TRY_LOCK_NAMED_QUICK, TRY_LOCK_QUICK, UNLOCK, UNLOCK_GATED,
    UNLOCK_NAMED,
};
pub(super) use self::modes::{
    MARK, MARKED, MODES_EXIST, MODES_SETUP, TRY_PERMIT, TRY_SHARED, UNLOCK_PERMIT, UNLOCK_SHARED,
    UNMARK,
};
pub use self::records::{DELETE_RELEASED, TRY_LOCK_RECORDING, UNLOCK_RECORDED};
pub(super) use self::records::{
    NAME_LEASE, REWRITE_RECORDS, RecordRow, name_lease, rewrite_records,
};
pub(super) use self::schema::{
    CREATE_HOLDERS_TABLE, CREATE_NAMES_TABLES, CREATE_SCHEMA, CREATE_SEQUENCE,
    INSPECT_HOLDERS_TABLE, INSPECT_OBJECTS, SET_TOKEN_LEAD, SETUP_LOCK, ddl_for_dba,
    holders_ddl_for_dba, objects_ddl_for_dba,
};

/// Appends `text`'s bytes to `out` as hex digits, for a literal that
/// `decode(…, 'hex')` reads: no character of the text can end it.
fn push_hex(out: &mut String, text: &str) {
    use std::fmt::Write as _;
    for byte in text.bytes() {
        let _ = write!(out, "{byte:02x}");
    }
}

/// Fills the schema in a statement: `{schema}` in a constant,
/// [`FILE_SCHEMA`] (no other text of a file) in a `.sql` file.
pub(crate) fn render(statement: &str, quoted_schema: &str) -> String {
    statement
        .replace("{schema}", quoted_schema)
        .replace(FILE_SCHEMA, quoted_schema)
}

/// The schema a `.sql` file names: the default one, quoted as dlock
/// quotes it, so a DBA runs a file as is, and [`render`] puts another.
pub(crate) const FILE_SCHEMA: &str = "\"dlock\"";

//! The statements of fair mode (see the `fair` module of the backend): the
//! fair waiter's wait in the key's queue, with and without a holder record,
//! and the settings and probes of a fair session.
//!
//! Its own file because a fair waiter's statement waits on a session of its
//! own, with bounds of its own, and none of it runs for plain locks.

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
///
/// [`TRY_LOCK`]: super::TRY_LOCK
/// [`UNLOCK_ALL`]: super::UNLOCK_ALL
pub(in crate::pg) const FAIR_LOCK: &str = concat!(
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
///
/// [`TRY_LOCK_RECORDING`]: super::TRY_LOCK_RECORDING
pub(in crate::pg) const FAIR_LOCK_RECORDING: &str = concat!(
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
pub(in crate::pg) const WAITS_IN_QUEUE: &str = "\
SELECT COALESCE((SELECT a.wait_event_type OPERATOR(pg_catalog.=) 'Lock'::pg_catalog.text
                    AND a.wait_event OPERATOR(pg_catalog.=) 'advisory'::pg_catalog.text
                 FROM pg_catalog.pg_stat_get_activity($1::pg_catalog.int4) AS a), false)";

/// The settings of a fair session beyond a lock session's, sent when it
/// opens: no `statement_timeout` and (PostgreSQL 17+) no
/// `transaction_timeout`, whatever a DBA set for the role or the database,
/// since its one statement waits in a key's queue for as long as its
/// waiter waits (the backend ends the wait itself when the waiter
/// leaves); a `transaction_timeout` would even end the session.
pub(in crate::pg) const FAIR_SESSION_SETUP: &str = "\
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
pub(in crate::pg) const CLIENT_CONNECTION_CHECK: &str = "\
SELECT CASE WHEN pg_catalog.current_setting('server_version_num'::pg_catalog.text)::pg_catalog.int4
                 >= 140000::pg_catalog.int4
            THEN pg_catalog.set_config('client_connection_check_interval'::pg_catalog.text,
                                       $1::pg_catalog.text, false)
       END";

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
    draw_token!(),
    ") END
FROM (",
    fair_wait!(),
    ") AS w"
);

/// [`FAIR_LOCK`] for a fair waiter whose holder is recorded: the same
/// wait and draw, with the key's `rewriting` mark (see
/// [`TRY_LOCK_RECORDING`]) taken shared *for the session* before the wait,
/// so that a reader who sees the lock granted sees the mark too until
/// [`FAIR_RECORD`] has committed the record (a pooled fair session may
/// take a key again whose released record it has not deleted yet). The
/// mark is only ever taken shared, so taking it never waits.
///
/// It names none of dlock's tables: a statement that waits in a key's
/// queue for as long as its waiter waits must hold no lock on them, or a
/// DBA's `ALTER TABLE`, `TRUNCATE`, `VACUUM FULL` or `LOCK TABLE` of the
/// table would wait behind every fair waiter of the moment (and every
/// acquisition behind that DBA). The record is written once the lock is
/// granted, by [`FAIR_RECORD`], which waits for the table no longer than
/// any lock session's statement does. A statement that fails leaves the
/// mark (and perhaps the lock) held for the session: the backend drops
/// both with [`UNLOCK_ALL`], as after a failed [`FAIR_LOCK`].
///
/// [`TRY_LOCK_RECORDING`]: super::TRY_LOCK_RECORDING
/// [`UNLOCK_ALL`]: super::UNLOCK_ALL
pub(in crate::pg) const FAIR_LOCK_MARKED: &str = concat!(
    "SELECT w.h, CASE WHEN pg_catalog.set_config('lock_timeout'::pg_catalog.text, w.prev, true)
                      IS NOT NULL THEN (",
    draw_token!(),
    ") END
FROM (SELECT u.h, u.prev, pg_catalog.pg_advisory_lock(u.h) AS locked
      FROM (SELECT m.h, m.prev,
                   pg_catalog.set_config('lock_timeout'::pg_catalog.text, '0'::pg_catalog.text, true)
                       AS unbounded
            FROM (SELECT k.h, k.prev,
                         pg_catalog.pg_advisory_lock_shared(",
    rewriting_mark!("k.h"),
    ") AS marked
                  FROM (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h,
                               pg_catalog.current_setting('lock_timeout'::pg_catalog.text) AS prev
                        OFFSET 0) AS k
                  OFFSET 0) AS m
            OFFSET 0) AS u
      OFFSET 0) AS w"
);

/// Records the holder of a lock [`FAIR_LOCK_MARKED`] was just granted, as
/// [`TRY_LOCK_RECORDING`] records one: the key (`$1`), its advisory key
/// (`$2`), the token drawn (`$6`), this session (its pid and its start,
/// `$4`), the identity (`$3`, NULL for a lease without one), the holder
/// record (`$5`) and the server's time of acquisition (`now()`, this
/// statement's start, just after the grant). Returns the time of the row
/// it wrote and `wrote`, as [`TRY_LOCK_RECORDING`] does.
///
/// The `rewriting` mark goes from the session to this transaction: taken
/// for the transaction before the row is written, and let go for the
/// session after (`OFFSET 0` fixes the order), so it stays in the lock
/// table until the commit has made the record visible. Its wait for the
/// table is the session's `lock_timeout`, as any lock session statement's;
/// one that fails leaves the lock and the mark for the backend to drop.
/// Asynchronous commit, as [`TRY_LOCK_RECORDING`].
///
/// [`TRY_LOCK_RECORDING`]: super::TRY_LOCK_RECORDING
pub(in crate::pg) const FAIR_RECORD: &str = concat!(
    "WITH t AS (
  SELECT $2::pg_catalog.int8 AS h, $6::pg_catalog.int8 AS token,
         pg_catalog.pg_advisory_xact_lock_shared(",
    rewriting_mark!("$2::pg_catalog.int8"),
    ") AS rewriting
),
recorded AS (
  INSERT INTO {schema}.dlock_holders AS r
         (lock_id, key, token, pid, session_start, identity, holder, holder_token, since)
  SELECT t.h, $1::pg_catalog.text, t.token, pg_catalog.pg_backend_pid(),
         $4::pg_catalog.timestamptz, $3::pg_catalog.text, $5::pg_catalog.text, t.token,
         pg_catalog.now()
  FROM t WHERE t.rewriting IS NOT NULL
  ON CONFLICT (lock_id) DO UPDATE
  SET key = EXCLUDED.key, token = EXCLUDED.token, pid = EXCLUDED.pid,
      session_start = EXCLUDED.session_start, identity = EXCLUDED.identity,
      holder = EXCLUDED.holder, holder_token = EXCLUDED.holder_token, since = EXCLUDED.since
  RETURNING r.lock_id, r.key, r.token, r.holder_token, r.pid, r.session_start, r.identity,
            r.holder, r.since
)
SELECT s.since, COALESCE(s.wrote, false),
       pg_catalog.pg_advisory_unlock_shared(",
    rewriting_mark!("$2::pg_catalog.int8"),
    ")
FROM (SELECT (SELECT recorded.since FROM recorded) AS since,
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

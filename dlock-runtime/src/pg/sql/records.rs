//! The statements that write and delete holder records
//! (`{schema}.dlock_holders`): the lock statement that records who took
//! the key, the unlock that deletes an identity's record, the batch delete
//! of released ones, and a renewal's rewrite of missing records.
//!
//! Its own file because these run on every recording acquisition and
//! release, and their order (record before lock, gate before unlock) is
//! argued here, apart from the reads of the records.

use super::push_hex;

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
///
/// [`TRY_LOCK`]: super::TRY_LOCK
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
    draw_token!(),
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
///
/// [`UNLOCK_GATED`]: super::UNLOCK_GATED
pub const UNLOCK_RECORDED: &str = concat!(
    "WITH gone AS (
  DELETE FROM {schema}.dlock_holders AS r
  WHERE r.lock_id = $1::pg_catalog.int8 AND r.token = $2::pg_catalog.int8
    AND r.pid = pg_catalog.pg_backend_pid()
  RETURNING r.lock_id
)
SELECT pg_catalog.pg_advisory_unlock($1::pg_catalog.int8)
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
///
/// [`UNLOCK`]: super::UNLOCK
pub const DELETE_RELEASED: &str = "\
WITH gone AS (
  DELETE FROM {schema}.dlock_holders AS r
  USING ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]),
                  pg_catalog.unnest($2::pg_catalog.int8[])) AS g(lock_id, token)
  WHERE r.lock_id = g.lock_id AND r.token = g.token
    AND r.pid = pg_catalog.pg_backend_pid() AND r.session_start = $3::pg_catalog.timestamptz
  RETURNING r.lock_id
)
SELECT pg_catalog.count(*)
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
///
/// [`LOCK_SESSION_SETUP`]: super::LOCK_SESSION_SETUP
pub(in crate::pg) const REWRITE_RECORDS: &str = "\
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
pub(in crate::pg) struct RecordRow<'a> {
    pub(in crate::pg) lock_id: i64,
    pub(in crate::pg) key: &'a str,
    pub(in crate::pg) token: i64,
    pub(in crate::pg) identity: &'a str,
    /// The holder record ([`HolderInfo::encode`](crate::HolderInfo::encode)).
    pub(in crate::pg) holder: &'a str,
    /// When the lock was taken, by the server's clock: microseconds since
    /// 1970.
    pub(in crate::pg) since_us: i64,
}

/// [`REWRITE_RECORDS`] (its schema already filled in: `rendered`) with
/// `wait` and `rows` filled in. Numbers go in quoted (`'-1'::int8`: a
/// bare `-9223372036854775808::int8` would cast before negating, and
/// overflow), strings as hex digits: no character of them can end a
/// literal.
pub(in crate::pg) fn rewrite_records(
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

/// Names what a lease without an identity needs named before its lock,
/// without a write per acquisition: this session's holder
/// ([`HolderInfo::encode`](crate::HolderInfo::encode)) in
/// `{schema}.dlock_sessions` beside the session's pid and its start, when
/// `{session}` is true; and the key (with its key seed) in
/// `{schema}.dlock_keys` beside its advisory key, when `{key_named}` is
/// true ([`name_lease`] fills these in). The backend sends it only for
/// what it has not named lately: a session's holder once per session and
/// holder, a key the first time this process locks it, each again once
/// the memory of it is older than `names::KEPT` (which heals a DBA's
/// `TRUNCATE`). It goes on the lock session, pipelined ahead of the lock
/// statement, so what it names is committed before the lock can be seen.
///
/// So a lease without an identity writes nothing when it is taken or let
/// go: `pg_locks` tells which session holds a key and, in its token marks,
/// the lease's token (`TRY_LOCK_NAMED`); `dlock_sessions` who that session
/// is (`SESSION_HOLDERS`); `dlock_keys` which key the lock stands for
/// (`HELD_NAMED`). What is lost against a record: the exact time of
/// acquisition (such a lease reads with the time since its token, see
/// `names::held_for`).
///
/// Its wait for a lock is bounded by `{wait}` (milliseconds), far below
/// the session's `lock_timeout`, as [`REWRITE_RECORDS`]'s and for the same
/// reason: a DBA's `LOCK TABLE`, `TRUNCATE` or `ALTER TABLE` holds the
/// table while it runs, and every statement behind this one on the session
/// (the lock statement it goes ahead of, other leases' unlocks) waits as
/// long. So it is a simple query of two statements, the bound set by the
/// first before the second locks the tables, with its text as literals:
/// the key and the holder as hex digits of their UTF-8. A write that
/// cannot be made costs the lease its name, never its lock.
///
/// A session row is believed only while a session with its pid *and* its
/// start lives, so the row of a session that died (after this write,
/// before or while it held anything) never names a later session that got
/// its pid; this statement deletes such rows of its own pid, so the table
/// holds about one row per live session. A session whose leases carry
/// several labels has a row for each, and its holder reads with its host
/// and pid but no label. The key's hash is computed here, by the server,
/// as the lock statement computes it. Two names with the same advisory key
/// both stay (the primary key is the pair), and `held` lists both while
/// either is held: a chance of 2⁻⁶⁴ a pair of names. A key's row stays
/// when the key is let go; nothing reads it unless the key is held, and a
/// DBA may delete rows at any time.
///
/// Each naming of a key stamps its row's `named_at` when the stamp is
/// older than `{kept}` (`names::KEPT`, a write once per key and process in
/// that time). When `{sweep}` (once per `{kept}` and process, see
/// `names::Names::sweep_due`), it also deletes up to 10,000 rows stamped
/// over `{stale}` ago (twice `{kept}`) whose advisory key nobody holds:
/// the oldest first, found by the index on `named_at`, against one read
/// of the lock table. A process names again a key it locks once its
/// memory of it is `{kept}` old, by which time a stamp it found fresh is
/// not yet `{stale}` old, so no row a process takes for named is swept; a
/// service that locks a key per request leaves about as many rows as it
/// named keys in the last `{stale}`. Asynchronous commit, as
/// [`TRY_LOCK_RECORDING`]'s: the tables are `UNLOGGED`, and worth nothing
/// after a crash, which ends every session.
pub(in crate::pg) const NAME_LEASE: &str = "\
SELECT pg_catalog.set_config('lock_timeout'::pg_catalog.text, '{wait}'::pg_catalog.text, true);
WITH me AS (
  SELECT pg_catalog.pg_backend_pid() AS pid,
         (SELECT a.backend_start
          FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) AS a) AS started,
         pg_catalog.convert_from(pg_catalog.decode('{holder}'::pg_catalog.text, 'hex'::pg_catalog.text),
                                 'UTF8'::pg_catalog.name) AS holder,
         pg_catalog.convert_from(pg_catalog.decode('{key}'::pg_catalog.text, 'hex'::pg_catalog.text),
                                 'UTF8'::pg_catalog.name) AS key
),
gone AS (
  DELETE FROM {schema}.dlock_sessions AS s
  USING me
  WHERE {session} AND s.pid = me.pid AND s.session_start OPERATOR(pg_catalog.<>) me.started
),
session AS (
  INSERT INTO {schema}.dlock_sessions AS s (pid, session_start, holder)
  SELECT me.pid, me.started, me.holder FROM me WHERE {session} AND me.started IS NOT NULL
  ON CONFLICT DO NOTHING
),
key AS (
  INSERT INTO {schema}.dlock_keys AS n (lock_id, key, named_at)
  SELECT pg_catalog.hashtextextended(me.key, '{seed}'::pg_catalog.int8), me.key, pg_catalog.now()
  FROM me WHERE {key_named}
  ON CONFLICT (lock_id, key) DO UPDATE SET named_at = EXCLUDED.named_at
  WHERE n.named_at OPERATOR(pg_catalog.<)
        (pg_catalog.now() OPERATOR(pg_catalog.-) '{kept} milliseconds'::pg_catalog.interval)
),
held AS MATERIALIZED (
  SELECT (l.classid::pg_catalog.int8 << 32::pg_catalog.int4) | l.objid::pg_catalog.int8 AS lock_id
  FROM pg_catalog.pg_locks AS l
  WHERE l.locktype = 'advisory'::pg_catalog.text AND l.objsubid = 1::pg_catalog.int2
    AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                      WHERE d.datname = pg_catalog.current_database())
),
swept AS (
  DELETE FROM {schema}.dlock_keys AS n
  WHERE {sweep} AND n.ctid = ANY (ARRAY(
    SELECT o.ctid FROM {schema}.dlock_keys AS o
    WHERE o.named_at OPERATOR(pg_catalog.<)
          (pg_catalog.now() OPERATOR(pg_catalog.-) '{stale} milliseconds'::pg_catalog.interval)
      AND NOT EXISTS (SELECT FROM held WHERE held.lock_id = o.lock_id)
    ORDER BY o.named_at
    LIMIT 10000))
)
SELECT FROM me";

/// [`NAME_LEASE`] (its schema already filled in: `rendered`) with the
/// wait and how long a naming is kept, the holder, the key and its seed,
/// what to name, and whether to sweep, filled in.
pub(in crate::pg) fn name_lease(
    rendered: &str,
    (wait, kept): (std::time::Duration, std::time::Duration),
    (holder, session): (&str, bool),
    (key, seed, key_named): (&str, i64, bool),
    sweep: bool,
) -> String {
    let mut holder_hex = String::with_capacity(holder.len() * 2);
    push_hex(&mut holder_hex, holder);
    let mut key_hex = String::with_capacity(key.len() * 2);
    push_hex(&mut key_hex, key);
    rendered
        .replace("{kept}", &kept.as_millis().to_string())
        .replace("{stale}", &(2 * kept.as_millis()).to_string())
        .replace("{wait}", &wait.as_millis().max(1).to_string())
        .replace("{holder}", &holder_hex)
        .replace("{key}", &key_hex)
        .replace("{seed}", &seed.to_string())
        .replace("{session}", if session { "true" } else { "false" })
        .replace("{key_named}", if key_named { "true" } else { "false" })
        .replace("{sweep}", if sweep { "true" } else { "false" })
}

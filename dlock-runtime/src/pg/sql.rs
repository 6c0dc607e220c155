//! Every statement the PostgreSQL backend sends, one named constant a step.
//!
//! `{schema}` stands for the quoted schema name set by
//! [`PgOptions::schema`](super::PgOptions::schema) and is filled in once, at
//! connect time, from a validated identifier: keys are never part of the SQL
//! text, they are always bound parameters.

/// The advisory key of a lock key: `hashtextextended(key, seed)`, the 64-bit
/// text hash PostgreSQL itself uses for hash partitioning, so it is stable
/// across releases and any client in any language computes the same lock.
/// Shown in the docs and used by the statements below.
pub(super) const ADVISORY_KEY: &str = "SELECT hashtextextended($1::text, $2::bigint)";

/// Takes the session advisory lock of a key and, only if it was taken, draws
/// the fencing token. One statement, so the token comes back in the same
/// round trip as the lock and no token is ever drawn for a lock that was not
/// taken: `CASE` evaluates `nextval` only after `pg_try_advisory_lock`
/// returned true. The sequence is not transactional, so a token once drawn
/// is never handed out again, whatever happens to the transaction. Returns
/// the advisory key and the token (NULL: held by someone else).
pub const TRY_LOCK: &str = "\
SELECT k.h, CASE WHEN pg_try_advisory_lock(k.h) THEN nextval('{schema}.dlock_token_seq') END
FROM (SELECT hashtextextended($1::text, $2::bigint) AS h) AS k";

/// Drops one session advisory lock of this session. Only the session that
/// took a lock can drop it, and the backend checks the lease's owner in
/// process before sending this on the session that holds it, so owner check
/// and release cannot interleave with another owner's acquisition.
pub const UNLOCK: &str = "SELECT pg_advisory_unlock($1::bigint)";

/// Drops every advisory lock of a session. Sent only on wait sessions, which
/// hold nothing else: it clears a shared lock granted in the very instant
/// `lock_timeout` fired (the statement then fails, but a session-level lock
/// survives the failed statement).
pub(super) const UNLOCK_ALL: &str = "SELECT pg_advisory_unlock_all()";

/// The server-side wait: queues for a *shared* lock on the key, which is
/// granted the moment the exclusive holder lets go — by release, by the
/// backend's ttl enforcement, or because its session died — and drops it in
/// the same statement. `OFFSET 0` keeps the subquery (which waits) from being
/// merged into the outer query (which unlocks), so the order is fixed.
/// Bounded by the session's `lock_timeout`.
pub(super) const WAIT_FOR_RELEASE: &str = "\
SELECT pg_advisory_unlock_shared(w.h)
FROM (SELECT k.h, pg_advisory_lock_shared(k.h)
      FROM (SELECT hashtextextended($1::text, $2::bigint) AS h) AS k OFFSET 0) AS w";

/// Sets a wait session's `lock_timeout` (milliseconds, as text).
pub(super) const SET_LOCK_TIMEOUT: &str = "SELECT set_config('lock_timeout', $1::text, false)";

/// Makes the server end a lock session that has sent nothing for this long
/// (milliseconds, as text): a holder process that is frozen or cut off then
/// loses its locks on the server's side too. PostgreSQL 14 added the
/// setting; older servers skip it.
pub(super) const SET_IDLE_SESSION_TIMEOUT: &str = "\
SELECT CASE WHEN current_setting('server_version_num')::int >= 140000
            THEN set_config('idle_session_timeout', $1::text, false) END";

/// The sessions (other than this one) that hold a key's advisory lock
/// exclusively. A `bigint` advisory key shows in `pg_locks` split into
/// `classid` (high 32 bits) and `objid` (low 32 bits) with `objsubid = 1`.
pub(super) const HOLDERS: &str = "\
SELECT l.pid
FROM pg_locks AS l, (SELECT hashtextextended($1::text, $2::bigint) AS h) AS k
WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock' AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid::bigint = ((k.h >> 32) & 4294967295)
  AND l.objid::bigint = (k.h & 4294967295)
  AND l.pid <> pg_backend_pid()";

/// Ends the sessions holding a key (administrative force release): an
/// advisory lock can only be dropped by its own session, so breaking it
/// means ending that session. Waits (up to `$3` ms, PostgreSQL 13+) until
/// each session is gone, so its locks are free when this returns.
pub(super) const TERMINATE_HOLDERS: &str = "\
SELECT h.pid, pg_terminate_backend(h.pid, $3::bigint)
FROM (SELECT l.pid
      FROM pg_locks AS l, (SELECT hashtextextended($1::text, $2::bigint) AS h) AS k
      WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock' AND l.objsubid = 1
        AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        AND l.classid::bigint = ((k.h >> 32) & 4294967295)
        AND l.objid::bigint = (k.h & 4294967295)
        AND l.pid <> pg_backend_pid()) AS h";

/// Which of the backend's objects exist and are usable (the schema, the
/// token sequence, the privileges on them), and the role asking. Reads the
/// catalogs by name, so it works even without USAGE on the schema.
pub(super) const INSPECT_OBJECTS: &str = "\
SELECT n.oid IS NOT NULL,
       s.oid IS NOT NULL,
       COALESCE(has_schema_privilege(n.oid, 'USAGE'), false),
       COALESCE(has_sequence_privilege(s.oid, 'USAGE'), false),
       quote_ident(current_user)
FROM (SELECT 1) AS one
LEFT JOIN pg_namespace AS n ON n.nspname = $1::text
LEFT JOIN pg_class AS s
       ON s.relnamespace = n.oid AND s.relname = 'dlock_token_seq' AND s.relkind = 'S'";

/// Serialises object creation between backends connecting at the same
/// moment (two concurrent `CREATE ... IF NOT EXISTS` can still collide on
/// the catalog's unique indexes). The key is `hashtextextended('dlock:setup', 0)`
/// computed on the server, so it never meets a lock key by accident more
/// than any other key would.
pub(super) const SETUP_LOCK: &str =
    "SELECT pg_advisory_xact_lock(hashtextextended('dlock:setup', 0))";

/// Creates the schema (only sent when it is missing: PostgreSQL checks the
/// CREATE privilege before `IF NOT EXISTS`).
pub(super) const CREATE_SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS {schema}";

/// Creates the token sequence (only sent when it is missing).
pub(super) const CREATE_SEQUENCE: &str =
    "CREATE SEQUENCE IF NOT EXISTS {schema}.dlock_token_seq AS bigint";

/// Moves the token sequence up to the server clock in microseconds when it
/// lags behind by more than a million: a fresh sequence (or one restored
/// from an old backup, or recreated) then still issues tokens above every
/// token issued before, as long as fewer than a million tokens a second were
/// drawn on average. Never moves it down, and the margin keeps concurrent
/// `nextval` calls (which only add one each) from being overtaken.
pub(super) const SEED_SEQUENCE: &str = "\
SELECT setval('{schema}.dlock_token_seq', c.now_us)
FROM (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now_us) AS c
WHERE c.now_us > (SELECT last_value FROM {schema}.dlock_token_seq) + 1000000";

/// Transaction-scoped, no wait: takes the transaction advisory lock and, only
/// if taken, draws the token — one statement, for the reasons of
/// [`TRY_LOCK`]. Released by the caller's COMMIT or ROLLBACK.
pub(super) const XACT_TRY_LOCK: &str = "\
SELECT CASE WHEN pg_try_advisory_xact_lock(hashtextextended($1::text, $2::bigint))
            THEN nextval('{schema}.dlock_token_seq') END";

/// Transaction-scoped, waiting under `lock_timeout` (set just before, inside
/// a savepoint): the subquery waits for the lock, and only then the outer
/// query draws the token. Should the lock be granted in the instant the
/// timeout fires, the statement still fails, and rolling back to the
/// savepoint drops the lock it took.
pub(super) const XACT_LOCK: &str = "\
SELECT nextval('{schema}.dlock_token_seq')
FROM (SELECT pg_advisory_xact_lock(hashtextextended($1::text, $2::bigint)) OFFSET 0) AS locked";

/// Sets `lock_timeout` for the rest of the (sub)transaction and returns the
/// value it had, to be put back once the lock is taken.
pub(super) const XACT_SWAP_LOCK_TIMEOUT: &str = "\
SELECT s.prev, set_config('lock_timeout', $1::text, true)
FROM (SELECT current_setting('lock_timeout') AS prev OFFSET 0) AS s";

/// Puts `lock_timeout` back for the rest of the transaction.
pub(super) const XACT_RESTORE_LOCK_TIMEOUT: &str =
    "SELECT set_config('lock_timeout', $1::text, true)";

/// Fills `{schema}` in a statement.
pub(crate) fn render(statement: &str, quoted_schema: &str) -> String {
    statement.replace("{schema}", quoted_schema)
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

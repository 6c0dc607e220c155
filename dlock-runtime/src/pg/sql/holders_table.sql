-- The table of holder records, which lock statements that record write.
-- UNLOGGED: no WAL for the rows, which a crash would make worthless anyway
-- (it ends every session, and every lock with it), and none on a standby,
-- where no lock session runs. identity is NULL for a lease without one;
-- holder, holder_token and since are NULL in rows written by a dlock that
-- predates them.
CREATE UNLOGGED TABLE IF NOT EXISTS "dlock".dlock_holders (
    lock_id pg_catalog.int8 PRIMARY KEY,
    key pg_catalog.text NOT NULL,
    token pg_catalog.int8 NOT NULL,
    pid pg_catalog.int4 NOT NULL,
    session_start pg_catalog.timestamptz NOT NULL,
    identity pg_catalog.text,
    holder pg_catalog.text,
    holder_token pg_catalog.int8,
    since pg_catalog.timestamptz
);

-- The tables that name, without a write per acquisition, the holder of a
-- lease without an identity: who each lock session is, and which key each
-- advisory key stands for. UNLOGGED, as dlock_holders is. The primary key
-- of dlock_keys is the pair, so two names with the same advisory key both
-- stay; named_at (indexed) is when a process last named the key, which the
-- sweep of names of keys no longer locked goes by. The ALTER gives named_at
-- to a dlock_keys made before it.
CREATE UNLOGGED TABLE IF NOT EXISTS "dlock".dlock_sessions (
    pid pg_catalog.int4 NOT NULL,
    session_start pg_catalog.timestamptz NOT NULL,
    holder pg_catalog.text NOT NULL,
    PRIMARY KEY (pid, session_start, holder)
);
CREATE UNLOGGED TABLE IF NOT EXISTS "dlock".dlock_keys (
    lock_id pg_catalog.int8 NOT NULL,
    key pg_catalog.text NOT NULL,
    named_at pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (lock_id, key)
);
ALTER TABLE "dlock".dlock_keys
    ADD COLUMN IF NOT EXISTS named_at pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.now();
CREATE INDEX IF NOT EXISTS dlock_keys_named_at ON "dlock".dlock_keys (named_at);

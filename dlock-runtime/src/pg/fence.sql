-- The PostgreSQL fence's table (PgFence::create_table), with its schema.
-- The transaction-scoped advisory lock serializes concurrent creators: two
-- CREATE ... IF NOT EXISTS at the same moment can still collide on the
-- catalog's unique indexes. Run on the caller's connection, so every name
-- is qualified.
BEGIN;
SELECT pg_catalog.pg_advisory_xact_lock(
    pg_catalog.hashtextextended('dlock:fence-setup'::pg_catalog.text, 0::pg_catalog.int8));
CREATE SCHEMA IF NOT EXISTS "dlock";
CREATE TABLE IF NOT EXISTS "dlock".dlock_fence (
    resource pg_catalog.text PRIMARY KEY,
    token pg_catalog.int8 NOT NULL
);
COMMIT;

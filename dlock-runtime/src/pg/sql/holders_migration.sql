-- Brings a dlock_holders made by a dlock that recorded only leases with an
-- identity to this version's shape: the holder record's columns, and
-- identity nullable for leases without one. Run by the table's owner; it
-- takes the table's ACCESS EXCLUSIVE lock for an instant (no rewrite: the
-- new columns have no default). Rows of an older dlock keep working: it
-- names the columns it writes, and reads only those.
ALTER TABLE "dlock".dlock_holders
    ADD COLUMN IF NOT EXISTS holder pg_catalog.text,
    ADD COLUMN IF NOT EXISTS holder_token pg_catalog.int8,
    ADD COLUMN IF NOT EXISTS since pg_catalog.timestamptz,
    ALTER COLUMN identity DROP NOT NULL;

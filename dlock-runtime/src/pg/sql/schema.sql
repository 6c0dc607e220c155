-- The schema of dlock's objects (PgOptions::schema, "dlock" unless set).
CREATE SCHEMA IF NOT EXISTS "dlock";

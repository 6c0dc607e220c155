//! The schema objects: what inspects, creates and migrates the schema, the
//! token sequence and the table of holder records, and the DDL a DBA runs
//! instead.
//!
//! Its own file because these run at connect and on first use, never on a
//! lock's path, and several are shown to DBAs in errors.

use super::render;

/// Which of the backend's objects exist and are usable (the schema, the
/// token sequence, the privileges on them), the role asking, and the
/// sequence's settings and position (its last value, NULL if none was drawn
/// yet, and its start) with the server clock in microseconds to judge its
/// maximum and its position against, and the other schemas of the database
/// that hold a dlock token sequence (see `warn_other_schemas`). Reads the
/// catalogs by name, so it works even without USAGE on the schema;
/// `pg_sequence` is readable by every role, unlike the sequence itself.
pub(in crate::pg) const INSPECT_OBJECTS: &str = "\
SELECT n.oid IS NOT NULL,
       s.oid IS NOT NULL,
       COALESCE(pg_catalog.has_schema_privilege(n.oid, 'USAGE'::pg_catalog.text), false),
       COALESCE(pg_catalog.has_sequence_privilege(s.oid, 'USAGE'::pg_catalog.text), false),
       pg_catalog.quote_ident(current_user::pg_catalog.text),
       COALESCE(pg_catalog.has_sequence_privilege(s.oid, 'UPDATE'::pg_catalog.text), false),
       q.seqincrement, q.seqcache, q.seqcycle, q.seqmax,
       pg_catalog.format_type(q.seqtypid, NULL::pg_catalog.int4),
       (EXTRACT(epoch FROM pg_catalog.clock_timestamp()) * 1000000::pg_catalog.int8)::pg_catalog.int8,
       CASE WHEN pg_catalog.has_sequence_privilege(s.oid, 'SELECT, USAGE'::pg_catalog.text)
            THEN pg_catalog.pg_sequence_last_value(s.oid::pg_catalog.regclass) END,
       q.seqstart,
       (SELECT pg_catalog.string_agg(pg_catalog.quote_ident(o.nspname::pg_catalog.text),
                                     ', '::pg_catalog.text ORDER BY o.nspname)
        FROM pg_catalog.pg_class AS c
        JOIN pg_catalog.pg_namespace AS o ON o.oid = c.relnamespace
        WHERE c.relname = 'dlock_token_seq'::pg_catalog.name
          AND c.relkind = 'S'::pg_catalog.\"char\"
          AND o.nspname <> $1::pg_catalog.text::pg_catalog.name)
FROM (SELECT 1) AS one
LEFT JOIN pg_catalog.pg_namespace AS n ON n.nspname = $1::pg_catalog.text::pg_catalog.name
LEFT JOIN pg_catalog.pg_class AS s
       ON s.relnamespace = n.oid AND s.relname = 'dlock_token_seq'::pg_catalog.name
      AND s.relkind = 'S'::pg_catalog.\"char\"
LEFT JOIN pg_catalog.pg_sequence AS q ON q.seqrelid = s.oid";

/// Serialises object creation between backends connecting at the same
/// moment (two concurrent `CREATE ... IF NOT EXISTS` can still collide on
/// the catalog's unique indexes). The key is `hashtextextended('dlock:setup', 0)`
/// computed on the server, so it never meets a lock key by accident more
/// than any other key would.
pub(in crate::pg) const SETUP_LOCK: &str = "SELECT pg_catalog.pg_advisory_xact_lock(
    pg_catalog.hashtextextended('dlock:setup'::pg_catalog.text, 0::pg_catalog.int8))";

/// Creates the schema (only sent when it is missing: PostgreSQL checks the
/// CREATE privilege before `IF NOT EXISTS`).
pub(in crate::pg) const CREATE_SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS {schema}";

/// Creates the token sequence (only sent when it is missing), with a token
/// lead of 10 ms (see `token_lead!`): a sequence dlock creates is drawn
/// from by this version and later ones only, which serialise their writes
/// under the draw lock.
pub(in crate::pg) const CREATE_SEQUENCE: &str = "\
CREATE SEQUENCE IF NOT EXISTS {schema}.dlock_token_seq AS bigint;
COMMENT ON SEQUENCE {schema}.dlock_token_seq IS 'dlock-token-lead-us=10000'";

/// The DDL a DBA runs to pre-create the backend's objects, for errors.
pub(in crate::pg) fn ddl_for_dba(quoted_schema: &str, role_hint: &str) -> String {
    format!(
        "CREATE SCHEMA IF NOT EXISTS {s}; \
         CREATE SEQUENCE IF NOT EXISTS {s}.dlock_token_seq AS bigint; \
         COMMENT ON SEQUENCE {s}.dlock_token_seq IS 'dlock-token-lead-us=10000'; \
         GRANT USAGE ON SCHEMA {s} TO {r}; \
         GRANT USAGE, UPDATE ON SEQUENCE {s}.dlock_token_seq TO {r};",
        s = quoted_schema,
        r = role_hint,
    )
}

/// Whether the table of holder records exists, and the privileges the
/// role has on it (SELECT, INSERT, UPDATE, DELETE), the role, whether
/// the table has this version's shape ([`MIGRATE_HOLDERS_TABLE`]: the
/// columns of the holder record, and `identity` nullable), whether the
/// tables of names ([`CREATE_NAMES_TABLES`]) exist, and whether the role
/// may use them (SELECT, INSERT and DELETE on `dlock_sessions`; SELECT,
/// INSERT, UPDATE and DELETE on `dlock_keys`); a `dlock_keys` without its
/// `named_at` is taken for missing, and [`CREATE_NAMES_TABLES`] adds it.
pub(in crate::pg) const INSPECT_HOLDERS_TABLE: &str = "\
SELECT c.oid IS NOT NULL,
       COALESCE(pg_catalog.has_table_privilege(c.oid, 'SELECT'::pg_catalog.text), false),
       COALESCE(pg_catalog.has_table_privilege(c.oid, 'INSERT'::pg_catalog.text), false),
       COALESCE(pg_catalog.has_table_privilege(c.oid, 'UPDATE'::pg_catalog.text), false),
       COALESCE(pg_catalog.has_table_privilege(c.oid, 'DELETE'::pg_catalog.text), false),
       pg_catalog.quote_ident(current_user::pg_catalog.text),
       (SELECT pg_catalog.count(*) = 3
        FROM pg_catalog.pg_attribute AS a
        WHERE a.attrelid = c.oid AND NOT a.attisdropped
          AND a.attname IN ('holder'::pg_catalog.name, 'holder_token'::pg_catalog.name,
                            'since'::pg_catalog.name))
       AND NOT COALESCE((SELECT a.attnotnull FROM pg_catalog.pg_attribute AS a
                         WHERE a.attrelid = c.oid AND NOT a.attisdropped
                           AND a.attname = 'identity'::pg_catalog.name), true),
       s.oid IS NOT NULL AND k.oid IS NOT NULL
       AND EXISTS (SELECT FROM pg_catalog.pg_attribute AS a
                   WHERE a.attrelid = k.oid AND NOT a.attisdropped
                     AND a.attname = 'named_at'::pg_catalog.name),
       COALESCE(pg_catalog.has_table_privilege(s.oid, 'SELECT'::pg_catalog.text)
                AND pg_catalog.has_table_privilege(s.oid, 'INSERT'::pg_catalog.text)
                AND pg_catalog.has_table_privilege(s.oid, 'DELETE'::pg_catalog.text)
                AND pg_catalog.has_table_privilege(k.oid, 'SELECT'::pg_catalog.text)
                AND pg_catalog.has_table_privilege(k.oid, 'INSERT'::pg_catalog.text)
                AND pg_catalog.has_table_privilege(k.oid, 'UPDATE'::pg_catalog.text)
                AND pg_catalog.has_table_privilege(k.oid, 'DELETE'::pg_catalog.text), false)
FROM (SELECT 1) AS one
LEFT JOIN pg_catalog.pg_namespace AS n ON n.nspname = $1::pg_catalog.text::pg_catalog.name
LEFT JOIN pg_catalog.pg_class AS c
       ON c.relnamespace = n.oid AND c.relname = 'dlock_holders'::pg_catalog.name
      AND c.relkind = 'r'::pg_catalog.\"char\"
LEFT JOIN pg_catalog.pg_class AS s
       ON s.relnamespace = n.oid AND s.relname = 'dlock_sessions'::pg_catalog.name
      AND s.relkind = 'r'::pg_catalog.\"char\"
LEFT JOIN pg_catalog.pg_class AS k
       ON k.relnamespace = n.oid AND k.relname = 'dlock_keys'::pg_catalog.name
      AND k.relkind = 'r'::pg_catalog.\"char\"";

/// The table of holder records (see [`TRY_LOCK_RECORDING`]), created
/// only when missing, by the first acquisition that records. `UNLOGGED`:
/// no WAL for the rows, which a crash would make worthless anyway (it
/// ends every session, and every lock with it), and none on a standby,
/// where no lock session runs. `identity` is NULL for a lease without
/// one; `holder`, `holder_token` and `since` are NULL in rows written by
/// a dlock that predates them.
///
/// [`TRY_LOCK_RECORDING`]: super::TRY_LOCK_RECORDING
pub(in crate::pg) const CREATE_HOLDERS_TABLE: &str = "\
CREATE UNLOGGED TABLE IF NOT EXISTS {schema}.dlock_holders (
    lock_id pg_catalog.int8 PRIMARY KEY,
    key pg_catalog.text NOT NULL,
    token pg_catalog.int8 NOT NULL,
    pid pg_catalog.int4 NOT NULL,
    session_start pg_catalog.timestamptz NOT NULL,
    identity pg_catalog.text,
    holder pg_catalog.text,
    holder_token pg_catalog.int8,
    since pg_catalog.timestamptz
)";

/// The tables that name, without a write per acquisition, the holder of a
/// lease without an identity (see `NAME_LEASE`): who each lock session is
/// (`NAME_LEASE`) and which key each advisory key stands for. Created
/// beside the table of holder records when missing, in a transaction of
/// their own (one made before `named_at` gets it); a role that may not create or write them records such leases
/// the older way, a record written by every acquisition. `UNLOGGED`, as
/// that table is. The primary key of `dlock_keys` is the pair, so two
/// names with the same advisory key both stay; `named_at` (indexed) is
/// when a process last named the key, which the sweep of names of keys
/// no longer locked goes by (see `NAME_LEASE`).
pub(in crate::pg) const CREATE_NAMES_TABLES: &str = "\
CREATE UNLOGGED TABLE IF NOT EXISTS {schema}.dlock_sessions (
    pid pg_catalog.int4 NOT NULL,
    session_start pg_catalog.timestamptz NOT NULL,
    holder pg_catalog.text NOT NULL,
    PRIMARY KEY (pid, session_start, holder)
);
CREATE UNLOGGED TABLE IF NOT EXISTS {schema}.dlock_keys (
    lock_id pg_catalog.int8 NOT NULL,
    key pg_catalog.text NOT NULL,
    named_at pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.now(),
    PRIMARY KEY (lock_id, key)
);
ALTER TABLE {schema}.dlock_keys
    ADD COLUMN IF NOT EXISTS named_at pg_catalog.timestamptz NOT NULL DEFAULT pg_catalog.now();
CREATE INDEX IF NOT EXISTS dlock_keys_named_at ON {schema}.dlock_keys (named_at)";

/// Brings a table of holder records made by a dlock that recorded only
/// leases with an identity to this version's shape: the holder record's
/// columns, and `identity` nullable for leases without one. Sent in the
/// setup transaction, only when [`INSPECT_HOLDERS_TABLE`] says the shape
/// is old; it takes the table's `ACCESS EXCLUSIVE` lock for an instant
/// (no rewrite: the new columns have no default). Rows of an older dlock
/// keep working: it names the columns it writes, and reads only those.
pub(in crate::pg) const MIGRATE_HOLDERS_TABLE: &str = "\
ALTER TABLE {schema}.dlock_holders
    ADD COLUMN IF NOT EXISTS holder pg_catalog.text,
    ADD COLUMN IF NOT EXISTS holder_token pg_catalog.int8,
    ADD COLUMN IF NOT EXISTS since pg_catalog.timestamptz,
    ALTER COLUMN identity DROP NOT NULL";

/// The DDL a DBA runs to bring a table of holder records of an older dlock
/// to this version's shape (as the table's owner), for errors.
pub(in crate::pg) fn holders_migration_ddl_for_dba(quoted_schema: &str) -> String {
    render(MIGRATE_HOLDERS_TABLE, quoted_schema)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        + ";"
}

/// The DDL a DBA runs to create the table of holder records, for errors.
pub(in crate::pg) fn holders_ddl_for_dba(quoted_schema: &str, role_hint: &str) -> String {
    format!(
        "{create}; {names}; GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.dlock_holders TO {r}; \
         GRANT SELECT, INSERT, DELETE ON {s}.dlock_sessions TO {r}; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.dlock_keys TO {r};",
        create = render(CREATE_HOLDERS_TABLE, quoted_schema)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
        names = render(CREATE_NAMES_TABLES, quoted_schema)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
        s = quoted_schema,
        r = role_hint,
    )
}

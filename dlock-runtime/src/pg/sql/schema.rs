//! The schema objects: what inspects and creates the schema, the token
//! sequence and the table of holder records, and the DDL a DBA runs
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

/// Creates the schema, `schema.sql` (only sent when it is missing:
/// PostgreSQL checks the CREATE privilege before `IF NOT EXISTS`).
pub(in crate::pg) const CREATE_SCHEMA: &str = include_str!("schema.sql");

/// Creates the token sequence, `token_seq.sql` (only sent when it is
/// missing).
pub(in crate::pg) const CREATE_SEQUENCE: &str = include_str!("token_seq.sql");

/// Gives the token sequence its token lead of 10 ms, `token_lead.sql` (see
/// `token_lead!`): sent only with a sequence created in a schema dlock
/// created in the same transaction, where no process of an earlier dlock
/// can be drawing.
pub(in crate::pg) const SET_TOKEN_LEAD: &str = include_str!("token_lead.sql");

/// The DDL that creates the schema and the token sequence, for errors.
pub(in crate::pg) fn objects_ddl_for_dba(quoted_schema: &str) -> String {
    let schema = one_line(CREATE_SCHEMA, quoted_schema);
    format!("{schema} {}", one_line(CREATE_SEQUENCE, quoted_schema))
}

/// The DDL a DBA runs to pre-create the backend's objects, for errors.
pub(in crate::pg) fn ddl_for_dba(quoted_schema: &str, role_hint: &str) -> String {
    format!(
        "{} {} GRANT USAGE ON SCHEMA {s} TO {r}; \
         GRANT USAGE, UPDATE ON SEQUENCE {s}.dlock_token_seq TO {r};",
        objects_ddl_for_dba(quoted_schema),
        one_line(SET_TOKEN_LEAD, quoted_schema),
        s = quoted_schema,
        r = role_hint,
    )
}

/// Whether the table of holder records exists, and the privileges the
/// role has on it (SELECT, INSERT, UPDATE, DELETE), the role, whether the
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

/// The table of holder records, `holders_table.sql`, created only when
/// missing, by the first acquisition that records.
pub(in crate::pg) const CREATE_HOLDERS_TABLE: &str = include_str!("holders_table.sql");

/// The tables of names, `names_tables.sql` (see `NAME_LEASE`), created
/// beside the table of holder records when missing; a role that may not
/// create or write them records such leases with a write per acquisition.
pub(in crate::pg) const CREATE_NAMES_TABLES: &str = include_str!("names_tables.sql");

/// The DDL a DBA runs to create the table of holder records, for errors.
pub(in crate::pg) fn holders_ddl_for_dba(quoted_schema: &str, role_hint: &str) -> String {
    format!(
        "{} {} GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.dlock_holders TO {r}; \
         GRANT SELECT, INSERT, DELETE ON {s}.dlock_sessions TO {r}; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.dlock_keys TO {r};",
        one_line(CREATE_HOLDERS_TABLE, quoted_schema),
        one_line(CREATE_NAMES_TABLES, quoted_schema),
        s = quoted_schema,
        r = role_hint,
    )
}

/// A `.sql` file for `quoted_schema` on one line, its comments left out,
/// as an error shows it.
fn one_line(file: &str, quoted_schema: &str) -> String {
    let text = render(file, quoted_schema);
    let lines = text
        .lines()
        .filter(|line| !line.trim_start().starts_with("--"));
    lines
        .flat_map(str::split_whitespace)
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::super::{FILE_SCHEMA, MODES_SETUP};
    use super::*;
    use crate::pg::{DEFAULT_SCHEMA, quote_schema};

    const FILES: [&str; 7] = [
        CREATE_SCHEMA,
        CREATE_SEQUENCE,
        SET_TOKEN_LEAD,
        CREATE_HOLDERS_TABLE,
        CREATE_NAMES_TABLES,
        MODES_SETUP,
        include_str!("../fence.sql"),
    ];

    #[test]
    fn a_dba_runs_the_sql_files_as_is_for_the_default_schema() {
        assert_eq!(quote_schema(DEFAULT_SCHEMA).unwrap(), FILE_SCHEMA);
    }

    #[test]
    fn every_object_a_sql_file_names_is_in_the_schema_it_is_sent_for() {
        for file in FILES {
            assert!(!file.contains("{schema}"), "{file}");
            let sent = render(file, "\"dlock_2\"");
            assert!(!sent.contains(FILE_SCHEMA), "{sent}");
            for (at, _) in sent.match_indices(".dlock_") {
                assert!(sent[..at].ends_with("\"dlock_2\""), "{}", &sent[..at]);
            }
        }
    }

    #[test]
    fn the_ddl_errors_show_is_the_statements_of_the_files_dlock_sends() {
        let s = "\"dlock_2\"";
        assert_eq!(
            ddl_for_dba(s, "app"),
            "CREATE SCHEMA IF NOT EXISTS \"dlock_2\"; CREATE SEQUENCE IF NOT EXISTS \
             \"dlock_2\".dlock_token_seq AS bigint; COMMENT ON SEQUENCE \"dlock_2\".dlock_token_seq \
             IS 'dlock-token-lead-us=10000'; GRANT USAGE ON SCHEMA \"dlock_2\" TO app; \
             GRANT USAGE, UPDATE ON SEQUENCE \"dlock_2\".dlock_token_seq TO app;"
        );
        let tables = holders_ddl_for_dba(s, "app");
        let index = "ON \"dlock_2\".dlock_keys (named_at); GRANT SELECT, INSERT, UPDATE, DELETE";
        assert!(!tables.contains("--") && tables.contains(index), "{tables}");
    }

    #[test]
    fn the_mode_functions_draw_tokens_as_the_lock_statements_do() {
        let draw = draw_token!().replace("{schema}", FILE_SCHEMA);
        assert_eq!(MODES_SETUP.matches(&draw).count(), 2, "{draw}");
    }
}

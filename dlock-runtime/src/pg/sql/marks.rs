//! The token marks of a named lease: the two shared `(int4, int4)`
//! advisory locks that carry its token in `pg_locks` (see
//! `TRY_LOCK_NAMED`), the expressions that take and drop them and the
//! reads that find them again. Macros, like the rest of the statements'
//! shared text, so the statements are `concat!`ed constants.

/// The first of the two `(int4, int4)` advisory locks (`objsubid` 2) that
/// carry the token `t` of a named lease of the advisory key `h` (SQL
/// expressions) in `pg_locks`, as a call of `$f`: the key's high half XOR
/// `TOKN` (`0x544f4b4e`), with the token's high half. Taken shared, by the
/// lease's session, for as long as the lease holds the key (see
/// `TRY_LOCK_NAMED`). The constants keep the marks off the key's own
/// `rewriting` mark and release gate (the halves, and their complements).
macro_rules! token_mark_a {
    ($f:literal, $h:literal, $t:literal) => {
        concat!(
            $f,
            "(",
            mark_classid_a!($h),
            ", (",
            $t,
            " OPERATOR(pg_catalog.>>) 32::pg_catalog.int4)::pg_catalog.int4)"
        )
    };
}

/// The first token mark's `classid` of the advisory key `$h`, as taken.
macro_rules! mark_classid_a {
    ($h:literal) => {
        concat!(
            "((",
            $h,
            " OPERATOR(pg_catalog.>>) 32::pg_catalog.int4) OPERATOR(pg_catalog.#) 1414482766::pg_catalog.int8)::pg_catalog.int4"
        )
    };
}

/// The second token mark (see `token_mark_a!`): the key's low half XOR
/// `TOKM` (`0x544f4b4d`), with the token's low half.
macro_rules! token_mark_b {
    ($f:literal, $h:literal, $t:literal) => {
        concat!(
            $f,
            "(",
            mark_classid_b!($h),
            ", ((",
            $t,
            " OPERATOR(pg_catalog.<<) 32::pg_catalog.int4) OPERATOR(pg_catalog.>>) 32::pg_catalog.int4)::pg_catalog.int4)"
        )
    };
}

/// The second token mark's `classid` of the advisory key `$h`, as taken.
macro_rules! mark_classid_b {
    ($h:literal) => {
        concat!(
            "(((",
            $h,
            " OPERATOR(pg_catalog.<<) 32::pg_catalog.int4) OPERATOR(pg_catalog.>>) 32::pg_catalog.int4) OPERATOR(pg_catalog.#) 1414482765::pg_catalog.int8)::pg_catalog.int4"
        )
    };
}

/// Whether a token mark of the advisory key `$h` has the draw lock's
/// `classid` (`draw_lock!`, 1685217655): a mark with the draw lock's
/// numbers, held shared for a lease's life, would keep every full draw of
/// the schema (which takes it exclusively) waiting, and fail them, for
/// as long as the lease lives. Such a mark needs the token's half to equal
/// the sequence's oid as well, which a DBA's `setval` (or a key chosen by
/// whoever may name keys, taken at the right microsecond) can arrange: so
/// a key whose marks have that `classid` (one in 2^31) takes none, and its
/// lease records itself instead, as one whose marks were refused.
macro_rules! marks_on_the_draw_lock {
    ($h:literal) => {
        concat!(
            "(",
            mark_classid_a!($h),
            "
                OPERATOR(pg_catalog.=) 1685217655::pg_catalog.int4)
              OR ((",
            mark_classid_b!($h),
            "
                OPERATOR(pg_catalog.=) 1685217655::pg_catalog.int4))"
        )
    };
}

/// The `classid` in `pg_locks` (as an `int8`) of the first token mark of
/// the advisory key `$h` (see `token_mark_a!`).
macro_rules! mark_class_a {
    ($h:literal) => {
        concat!(
            "(((",
            $h,
            " >> 32::pg_catalog.int4) # 1414482766::pg_catalog.int8) & 4294967295::pg_catalog.int8)"
        )
    };
}

/// The `classid` in `pg_locks` (as an `int8`) of the second token mark of
/// the advisory key `$h` (see `token_mark_a!`).
macro_rules! mark_class_b {
    ($h:literal) => {
        concat!(
            "((((",
            $h,
            " << 32::pg_catalog.int4) >> 32::pg_catalog.int4) # 1414482765::pg_catalog.int8) \
             & 4294967295::pg_catalog.int8)"
        )
    };
}

/// The condition on a `pg_locks` row `m` that it is a token mark (a
/// shared `(int4, int4)` advisory lock) held by the session `$pid` in this
/// database.
macro_rules! held_mark {
    ($pid:literal) => {
        concat!(
            "m.pid = ",
            $pid,
            " AND m.locktype = 'advisory'::pg_catalog.text AND m.granted
    AND m.mode = 'ShareLock'::pg_catalog.text AND m.objsubid = 2::pg_catalog.int2
    AND m.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                      WHERE d.datname = pg_catalog.current_database())"
        )
    };
}

/// The token the session `$pid` carries for the advisory key `$h` in its
/// token marks (see `token_mark_a!`), read from `pg_locks` (as `$locks`):
/// NULL unless exactly one mark of each half is there. Two keys of one
/// session whose marks share a half make both unknown, never wrong.
macro_rules! marked_token {
    ($locks:literal, $pid:literal, $h:literal) => {
        concat!(
            "(SELECT CASE WHEN pg_catalog.count(*) FILTER (WHERE m.classid::pg_catalog.int8 = ",
            mark_class_a!($h),
            ") = 1
              AND pg_catalog.count(*) FILTER (WHERE m.classid::pg_catalog.int8 = ",
            mark_class_b!($h),
            ") = 1
         THEN (pg_catalog.max(m.objid::pg_catalog.int8) FILTER (WHERE m.classid::pg_catalog.int8 = ",
            mark_class_a!($h),
            ") << 32::pg_catalog.int4)
              | pg_catalog.max(m.objid::pg_catalog.int8) FILTER (WHERE m.classid::pg_catalog.int8 = ",
            mark_class_b!($h),
            ")
         END
  FROM ",
            $locks,
            " AS m
  WHERE ",
            held_mark!($pid),
            ")"
        )
    };
}

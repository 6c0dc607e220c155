//! The statements that read who holds a key: the holding sessions in
//! `pg_locks`, the records that name them, the keys held under a prefix,
//! the announcements a watch hears, and the force releases that end a
//! holder's session.
//!
//! Its own file because these only read (or end sessions): no acquisition
//! sends them, and they are reviewed against the records' writers in
//! `records`.

use super::push_hex;

/// The sessions (other than this one) that hold a key's advisory lock
/// exclusively, as a query of one column, `pid`, for [`HOLDERS`] and
/// [`TERMINATE_HOLDERS`] (see `exclusive_hold!`).
macro_rules! holders {
    () => {
        concat!(
            "SELECT l.pid
FROM pg_catalog.pg_locks AS l,
     (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k
WHERE ",
            exclusive_hold!(),
            "
  AND l.pid <> pg_catalog.pg_backend_pid()"
        )
    };
}

/// The sessions (other than this one) that hold a key's advisory lock
/// exclusively (see `holders!`).
pub(in crate::pg) const HOLDERS: &str = holders!();

/// Ends the sessions holding a key (administrative force release): an
/// advisory lock can only be dropped by its own session, so breaking it
/// means ending that session. Waits (up to `$3` ms, PostgreSQL 13+) until
/// each session is gone, so its locks are free when this returns.
pub(in crate::pg) const TERMINATE_HOLDERS: &str = concat!(
    "SELECT h.pid, pg_catalog.pg_terminate_backend(h.pid, $3::pg_catalog.int8)
FROM (",
    holders!(),
    ") AS h"
);

/// The force release that names a lease (`Backend::force_release_holding`
/// of a lease of another process): five statements sent in one simple
/// query, so in one implicit transaction and one round trip, on a
/// connection of the force release's own ([`force_release_named`] fills
/// in the key, its seed, the token, this backend's own sessions and the
/// waits). The server runs them to the end without waiting for the client,
/// so the gate is never held across a round trip, nor kept by a client
/// that stalls.
///
/// 1. Bounds every wait below (`lock_timeout`, `statement_timeout`), for
///    this transaction only.
/// 2. Takes the records table's lock (`ACCESS SHARE`, until the end)
///    before the gate: a DBA's `ALTER TABLE` or `VACUUM FULL`, granted or
///    queued, is waited for here, with no gate held for the holder's
///    releases to wait behind.
/// 3. Tries the key's release gate exclusively (see `release_gate!`)
///    until the transaction ends, without queueing: a release of the key
///    under way (one statement) holds it shared, and the try fails, which
///    the transaction keeps in a setting (`dlock.force_release_gate`) for
///    the next statement and the client reads (it tries again a moment
///    later). A force release never queues on the gate, so the holder's
///    releases never wait behind one that waits. Taken, the gate holds off
///    the next releases, so the session holding the key keeps holding it
///    until the end.
/// 4. Reads the lock table once, only if the gate was taken, (a CTE read twice is computed once, so
///    the hold and the mark are seen at one instant): the sessions that
///    hold the key exclusively, other than this one and this backend's
///    own (whose leases it unlocks itself), and not in the middle of a
///    lock statement (one that holds the key's `rewriting` mark has not
///    committed its record yet, see [`TRY_LOCK_RECORDING`]). It keeps
///    their pids in a setting of the transaction, for the next statement.
/// 5. Reads the records, with a snapshot taken after the lock table was
///    read, and ends each session found whose record of the key names the
///    lease with the token given and that session (its pid and its start,
///    so a later session that got the same pid is never taken for it), or
///    whose token marks of the key, read from the lock table again, carry
///    the token given while no record of the key names that session (a
///    lease taken without a record, see [`TRY_LOCK_NAMED`]; under the gate
///    its session can neither drop them nor take the key again; a record
///    of the session, written by a lease whose marks were refused, is
///    believed over marks that other leases' marks could make up),
///    waiting as [`TERMINATE_HOLDERS`] does. A row per session found:
///    its pid, whether its start is hidden from this role (it then cannot
///    be told from a later session with its pid, and is not ended; a
///    session gone meanwhile is not hidden, only not ended), and whether
///    it was ended (NULL: its record names another lease, or it is gone).
///
/// A session found holding the key in 4, not in a lock statement,
/// committed the record of the lease it holds before that read; under the
/// gate it can neither let go of the key nor take it again, nor can any
/// other session take it, until this ends. So the record read in 5 is the
/// record of the lease the session holds when it is ended: a holder that
/// changed since an operator was shown it, a lease let go a moment
/// before, or another session holding the key meanwhile, is never ended.
///
/// [`TRY_LOCK_NAMED`]: super::TRY_LOCK_NAMED
/// [`TRY_LOCK_RECORDING`]: super::TRY_LOCK_RECORDING
pub(in crate::pg) const FORCE_RELEASE_NAMED: &str = concat!(
    "SELECT pg_catalog.set_config('lock_timeout'::pg_catalog.text, '{lock_wait}'::pg_catalog.text, true),
       pg_catalog.set_config('statement_timeout'::pg_catalog.text, '{statement_wait}'::pg_catalog.text, true);
SELECT FROM {schema}.dlock_holders LIMIT 0;
SELECT pg_catalog.set_config('dlock.force_release_gate'::pg_catalog.text,
                             pg_catalog.pg_try_advisory_xact_lock(",
    release_gate!("k.h"),
    ")::pg_catalog.text, true)
FROM (SELECT pg_catalog.hashtextextended({key}, {seed}::pg_catalog.int8) AS h) AS k;
WITH k AS (SELECT pg_catalog.hashtextextended({key}, {seed}::pg_catalog.int8) AS h),
a AS (
  SELECT l.pid, l.mode, l.granted, l.objsubid, l.classid, l.objid
  FROM pg_catalog.pg_locks AS l
  WHERE l.locktype = 'advisory'::pg_catalog.text
    AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                      WHERE d.datname = pg_catalog.current_database())
)
SELECT pg_catalog.set_config('dlock.force_release_pids'::pg_catalog.text,
                             COALESCE(pg_catalog.string_agg(l.pid::pg_catalog.text, ','::pg_catalog.text),
                                      ''::pg_catalog.text),
                             true)
FROM a AS l, k
WHERE l.granted AND l.mode = 'ExclusiveLock'::pg_catalog.text AND l.objsubid = 1::pg_catalog.int2
  AND l.classid::pg_catalog.int8 = ((k.h >> 32::pg_catalog.int4) & 4294967295::pg_catalog.int8)
  AND l.objid::pg_catalog.int8 = (k.h & 4294967295::pg_catalog.int8)
  AND l.pid <> pg_catalog.pg_backend_pid()
  AND l.pid <> ALL ('{own}'::pg_catalog.int4[])
  AND pg_catalog.current_setting('dlock.force_release_gate'::pg_catalog.text)::pg_catalog.bool
  AND NOT EXISTS (SELECT FROM a AS m
                  WHERE m.pid = l.pid AND m.objsubid = 2::pg_catalog.int2
                    AND m.classid = l.classid AND m.objid = l.objid);
SELECT l.pid, r.pid IS NOT NULL AND a.pid IS NOT NULL AND a.backend_start IS NULL
              AND t.token IS DISTINCT FROM {token}::pg_catalog.int8,
       CASE WHEN r.session_start = a.backend_start
              OR (t.token = {token}::pg_catalog.int8
                  AND NOT EXISTS (SELECT FROM {schema}.dlock_holders AS o
                                  WHERE o.lock_id = k.h AND o.key = {key} AND o.pid = l.pid))
            THEN pg_catalog.pg_terminate_backend(l.pid, {terminate_wait}::pg_catalog.int8) END
FROM pg_catalog.unnest(pg_catalog.string_to_array(
         pg_catalog.current_setting('dlock.force_release_pids'::pg_catalog.text),
         ','::pg_catalog.text)::pg_catalog.int4[]) AS l(pid)
CROSS JOIN (SELECT pg_catalog.hashtextextended({key}, {seed}::pg_catalog.int8) AS h) AS k
LEFT JOIN {schema}.dlock_holders AS r
  ON r.lock_id = k.h AND r.key = {key} AND r.token = {token}::pg_catalog.int8 AND r.pid = l.pid
LEFT JOIN LATERAL pg_catalog.pg_stat_get_activity(l.pid) AS a ON true
LEFT JOIN LATERAL (SELECT ",
    marked_token!("pg_catalog.pg_locks", "l.pid", "k.h"),
    ") AS t(token) ON true
WHERE r.pid IS NOT NULL OR t.token = {token}::pg_catalog.int8"
);

/// The waits of [`FORCE_RELEASE_NAMED`].
pub(in crate::pg) struct ForceWaits {
    /// For the key's release gate (the releases of the key under way).
    pub(in crate::pg) gate: std::time::Duration,
    /// For each statement.
    pub(in crate::pg) statement: std::time::Duration,
    /// For a session ended to be gone.
    pub(in crate::pg) terminate: std::time::Duration,
}

/// [`FORCE_RELEASE_NAMED`] (its schema filled in, as `rendered`) for the
/// key `key` with key seed `seed`, naming the lease with token `token`,
/// never ending a session of `own`: the key goes in hex-encoded (no
/// quoting to get wrong), the numbers as decimal literals, and the waits
/// as `waits` says.
pub(in crate::pg) fn force_release_named(
    rendered: &str,
    key: &str,
    seed: i64,
    token: i64,
    own: &[i32],
    waits: &ForceWaits,
) -> String {
    let mut hex = String::with_capacity(key.len() * 2);
    push_hex(&mut hex, key);
    let key = format!(
        "pg_catalog.convert_from(pg_catalog.decode('{hex}'::pg_catalog.text, 'hex'::pg_catalog.text), \
         'UTF8'::pg_catalog.name)"
    );
    let own = own.iter().map(i32::to_string).collect::<Vec<_>>().join(",");
    let ms = |wait: std::time::Duration| wait.as_millis().max(1).to_string();
    rendered
        .replace("{lock_wait}", &ms(waits.gate))
        .replace("{statement_wait}", &ms(waits.statement))
        .replace("{terminate_wait}", &ms(waits.terminate))
        .replace("{own}", &format!("{{{own}}}"))
        .replace("{seed}", &format!("'{seed}'"))
        .replace("{token}", &format!("'{token}'"))
        .replace("{key}", &key)
}

/// The channel [`ANNOUNCE`] announces acquisitions on for the
/// schema `schema`: `dlock_holders_<schema>`, or, for a schema too long
/// for a channel name's 63 bytes, `dlock_holders_`, the schema's first 32
/// bytes, `_` and 16 hex digits of a hash of it (FNV-1a, the same in every
/// process and every version). A schema is a plain lowercase identifier,
/// so the channel has only `[a-z0-9_]` and goes into SQL as it is, in a
/// literal as in a quoted identifier. Two schemas that share a channel
/// would only wake each other's watches for nothing.
pub(in crate::pg) fn holders_channel(schema: &str) -> String {
    const PREFIX: &str = "dlock_holders_";
    const MAX: usize = 63;
    if PREFIX.len() + schema.len() <= MAX {
        return format!("{PREFIX}{schema}");
    }
    let hash = schema
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    // ASCII only, so any byte is a character boundary.
    let head = schema.get(..32).unwrap_or(schema);
    format!("{PREFIX}{head}_{hash:016x}")
}

/// Announces acquisitions with an identity this session made, for watches
/// of a free key (see the `listen` module): `pg_notify` on the schema's
/// channel (`$2`, see [`holders_channel`]) with each advisory key of `$3`
/// as text. Sent after [`TRY_LOCK_RECORDING`] committed, so a reader woken
/// by it reads the record; PostgreSQL delivers the notifications when this
/// statement's own transaction commits. A `NOTIFY` needs no privilege, and
/// goes into the server's queue whether or not anyone listens.
///
/// Best effort, and bounded: the commit takes PostgreSQL's one
/// cluster-wide lock of notifying commits, which another transaction may
/// hold for long (a notifying commit that waits for a synchronous standby
/// holds it until the standby answers), and the session's other
/// statements queue behind this one. So it waits at most `$1`
/// milliseconds for that lock, far below the session's `lock_timeout`,
/// and then fails, which costs an announcement, never a lock: a watch of
/// a free key reads again on a timer as well. `set_config(…, true)` ends
/// with the statement's own transaction, so nothing else runs under the
/// short wait. The commit is asynchronous, as [`TRY_LOCK`]'s: one that
/// waited for a standby would hold the lock of notifying commits, and the
/// session, while it waits, beyond any `lock_timeout`.
///
/// [`TRY_LOCK_RECORDING`]: super::TRY_LOCK_RECORDING
/// [`TRY_LOCK`]: super::TRY_LOCK
pub(in crate::pg) const ANNOUNCE: &str = "\
SELECT pg_catalog.set_config('lock_timeout'::pg_catalog.text, $1::pg_catalog.text, true),
       (SELECT pg_catalog.count(pg_catalog.pg_notify($2::pg_catalog.text, k.h::pg_catalog.text))
        FROM pg_catalog.unnest($3::pg_catalog.int8[]) AS k(h))";

/// Listens on the channel acquisitions are announced on (`{channel}`, see
/// [`holders_channel`]), on the backend's listening connection.
pub(in crate::pg) const LISTEN: &str = "LISTEN \"{channel}\"";

/// The advisory key of a key, and whether a session holds it exclusively
/// (see `exclusive_hold!`): what a watch of the key's holder needs to know
/// which wake-up to wait for. An announced acquisition names its advisory
/// key.
pub(in crate::pg) const KEY_HELD: &str = concat!(
    "SELECT k.h, EXISTS (SELECT FROM pg_catalog.pg_locks AS l WHERE ",
    exclusive_hold!(),
    ")
FROM (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k"
);

/// The session holding a key's advisory lock exclusively, whichever it is
/// (this one included): its pid, when it started (NULL when the role
/// asking may not see it: another role's session, unless the role is a
/// member of it or of `pg_read_all_stats`), and whether the table of
/// identity records exists. No row: nobody holds the key.
///
/// Read *before* [`HOLDER_RECORD`], in a statement of its own: the record
/// is read under a snapshot taken after this, so a record found of the
/// session seen here was written by a lease that held the key at some
/// moment between the two, or by an earlier lease of that session, left
/// until its batch delete ([`DELETE_RELEASED`]). The fourth column says
/// which: whether the session holds the key's `rewriting` mark (see
/// [`TRY_LOCK_RECORDING`]), read with the lock (`pg_locks` reads the whole
/// lock table at one instant). Without the mark, the statement that took
/// the lock has committed, and its record (or a later one) is what the
/// next snapshot sees; with it, the record may be the earlier lease's. Read the other way round,
/// an old snapshot could still show the record of a lease the session
/// has since released and followed with another.
///
/// The fifth column is the token the session carries in its token marks
/// for the key (see `marked_token!`): a lease taken with
/// [`TRY_LOCK_NAMED`] has no record, and this is how its token is read.
/// The sixth is the server's clock in microseconds, which the time such a
/// lease has been held is read against (see `names::held_for`).
///
/// [`DELETE_RELEASED`]: super::DELETE_RELEASED
/// [`TRY_LOCK_NAMED`]: super::TRY_LOCK_NAMED
/// [`TRY_LOCK_RECORDING`]: super::TRY_LOCK_RECORDING
pub(in crate::pg) const HOLDER_SESSION: &str = concat!(
    "SELECT l.pid,
       (SELECT a.backend_start FROM pg_catalog.pg_stat_get_activity(l.pid) AS a),
       pg_catalog.to_regclass('{schema}.dlock_holders'::pg_catalog.text) IS NOT NULL,
       EXISTS (SELECT FROM pg_catalog.pg_locks AS m
               WHERE m.pid = l.pid AND m.locktype = 'advisory'::pg_catalog.text
                 AND m.objsubid = 2::pg_catalog.int2 AND m.database = l.database
                 AND m.classid = l.classid AND m.objid = l.objid),
       ",
    marked_token!("pg_catalog.pg_locks", "l.pid", "k.h"),
    ",
       (EXTRACT(epoch FROM pg_catalog.clock_timestamp())
        OPERATOR(pg_catalog.*) 1000000::pg_catalog.int8)::pg_catalog.int8
FROM pg_catalog.pg_locks AS l,
     (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k
WHERE ",
    exclusive_hold!(),
    "
LIMIT 1"
);

/// The holder record of a row `r` and how long ago it was taken (in
/// microseconds, by the server's clock, never below 0), as two columns,
/// each NULL unless the statement that wrote the row's token wrote them
/// too (see [`TRY_LOCK_RECORDING`] on `holder_token`).
///
/// [`TRY_LOCK_RECORDING`]: super::TRY_LOCK_RECORDING
macro_rules! believed_holder {
    () => {
        "CASE WHEN r.holder_token OPERATOR(pg_catalog.=) r.token THEN r.holder END,
       CASE WHEN r.holder_token OPERATOR(pg_catalog.=) r.token THEN
            greatest(0::pg_catalog.int8,
                     (EXTRACT(epoch FROM pg_catalog.now() OPERATOR(pg_catalog.-) r.since)
                      OPERATOR(pg_catalog.*) 1000000::pg_catalog.int8)::pg_catalog.int8)
       END"
    };
}

/// The record of a key (`$1`, with its key seed `$2`) written by the
/// session `$3` that started at `$4`, the holder [`HOLDER_SESSION`] found:
/// its token, its identity (NULL: a lease without one), and, when the
/// acquisition that wrote the row wrote them (see [`TRY_LOCK_RECORDING`]
/// on `holder_token`), the holder record and how long ago it was taken in
/// microseconds, by the server's clock alone. A record of another session
/// (one that died holding the key) or of another key with the same
/// advisory key is not the holder's.
///
/// [`TRY_LOCK_RECORDING`]: super::TRY_LOCK_RECORDING
pub(in crate::pg) const HOLDER_RECORD: &str = concat!(
    "SELECT r.token, r.identity, ",
    believed_holder!(),
    "
FROM {schema}.dlock_holders AS r
WHERE r.lock_id = pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8)
  AND r.key = $1::pg_catalog.text AND r.pid = $3::pg_catalog.int4
  AND r.session_start = $4::pg_catalog.timestamptz"
);

/// Every key recorded in `{schema}.dlock_holders` whose name starts with
/// `$1` (`starts_with`: the prefix is data, `%` and `_` included) and whose
/// record is believed as [`HOLDER_RECORD`] believes one: the session it
/// names (pid and start) holds the key's advisory lock exclusively now,
/// and the advisory key is the key's under this backend's key seed (`$2`).
/// One row a key: the key, the token, the identity, the holder record and
/// how long it has been held (see `believed_holder!`), and the session's
/// pid and start. Unsorted: the caller sorts by the key's bytes.
///
/// A key held without a record is listed by [`HELD_NAMED`] if a dlock
/// named it; one held by a dlock that predates names, with recording off,
/// by a [`TransactionLock`](crate::pg::TransactionLock) or any other
/// client is not listed: nothing keeps its name.
pub(in crate::pg) const HELD: &str = concat!(
    "SELECT r.key, r.token, r.identity, ",
    believed_holder!(),
    ", r.pid, r.session_start
FROM {schema}.dlock_holders AS r
WHERE pg_catalog.starts_with(r.key, $1::pg_catalog.text)
  AND r.lock_id OPERATOR(pg_catalog.=) pg_catalog.hashtextextended(r.key, $2::pg_catalog.int8)
  AND r.session_start OPERATOR(pg_catalog.=)
      (SELECT a.backend_start FROM pg_catalog.pg_stat_get_activity(r.pid) AS a)
  AND (r.pid, (r.lock_id >> 32::pg_catalog.int4) & 4294967295::pg_catalog.int8,
       r.lock_id & 4294967295::pg_catalog.int8) IN (
    SELECT l.pid, l.classid::pg_catalog.int8, l.objid::pg_catalog.int8
    FROM pg_catalog.pg_locks AS l
    WHERE l.locktype = 'advisory'::pg_catalog.text AND l.granted
      AND l.mode = 'ExclusiveLock'::pg_catalog.text AND l.objsubid = 1::pg_catalog.int2
      AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                        WHERE d.datname = pg_catalog.current_database()))"
);

/// Who the session `$1` that started at `$2` is, as [`NAME_LEASE`]
/// named it: one row per holder record it named (one, unless its leases
/// carry several labels). A session holding a lease without an identity
/// taken without a record (see [`NAME_LEASE`]) is named only here. No row: a session that named nobody (an older dlock, a
/// [`TransactionLock`](crate::pg::TransactionLock), any other client), or
/// a later session with a dead one's pid.
///
/// /// [`NAME_LEASE`]: super::NAME_LEASE
pub(in crate::pg) const SESSION_HOLDERS: &str = "\
SELECT s.holder
FROM {schema}.dlock_sessions AS s
WHERE s.pid = $1::pg_catalog.int4 AND s.session_start = $2::pg_catalog.timestamptz";

/// Every key named in `{schema}.dlock_keys` (see [`NAME_LEASE`]) whose name
/// starts with `$1` (`starts_with`: the prefix is data) and whose advisory
/// key, under this backend's key seed (`$2`), a session holds exclusively
/// now: the key, the session's pid and start (NULL when this role may not
/// see it), the holders that session named ([`SESSION_HOLDERS`]), the
/// token in the session's token marks (see `marked_token!`), and the
/// server's clock in microseconds.
/// What [`HELD`] lists from a record too is listed once, from the record
/// (the caller merges the two). The lock table is read once, and each held
/// advisory key looked up by the table's primary key, so the table's other
/// names (keys let go long ago) cost nothing. `classid` and `objid` are
/// the advisory key's two halves, each an unsigned 32-bit `oid`.
///
/// [`NAME_LEASE`]: super::NAME_LEASE
pub(in crate::pg) const HELD_NAMED: &str = concat!(
    "SELECT n.key, l.pid, a.backend_start,
       (SELECT pg_catalog.array_agg(s.holder ORDER BY s.holder)
        FROM {schema}.dlock_sessions AS s
        WHERE s.pid = l.pid AND s.session_start = a.backend_start),
       ",
    marked_token!("pg_catalog.pg_locks", "l.pid", "n.lock_id"),
    ",
       (EXTRACT(epoch FROM pg_catalog.clock_timestamp())
        OPERATOR(pg_catalog.*) 1000000::pg_catalog.int8)::pg_catalog.int8
FROM pg_catalog.pg_locks AS l
JOIN {schema}.dlock_keys AS n
  ON n.lock_id = ((l.classid::pg_catalog.int8 << 32::pg_catalog.int4)
                  | l.objid::pg_catalog.int8)
LEFT JOIN LATERAL pg_catalog.pg_stat_get_activity(l.pid) AS a ON true
WHERE l.locktype = 'advisory'::pg_catalog.text AND l.granted
  AND l.mode = 'ExclusiveLock'::pg_catalog.text AND l.objsubid = 1::pg_catalog.int2
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database())
  AND pg_catalog.starts_with(n.key, $1::pg_catalog.text)
  AND n.lock_id OPERATOR(pg_catalog.=) pg_catalog.hashtextextended(n.key, $2::pg_catalog.int8)"
);

#[cfg(test)]
mod tests {
    use super::holders_channel;

    #[test]
    fn a_holders_channel_fits_a_channel_name_and_tells_long_schemas_apart() {
        assert_eq!(holders_channel("dlock"), "dlock_holders_dlock");
        let fits = "s".repeat(49);
        assert_eq!(holders_channel(&fits), format!("dlock_holders_{fits}"));
        let (long, other) = ("a".repeat(63), format!("{}b", "a".repeat(62)));
        let channel = holders_channel(&long);
        assert_eq!(channel.len(), 63, "{channel}");
        assert!(channel.starts_with(&format!("dlock_holders_{}_", "a".repeat(32))));
        assert!(
            channel
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
            "{channel}"
        );
        assert_ne!(channel, holders_channel(&other));
        // Every process, of every version, must name the same channel.
        assert_eq!(
            channel,
            format!("dlock_holders_{}_51c1e07b2aee9066", "a".repeat(32))
        );
    }
}

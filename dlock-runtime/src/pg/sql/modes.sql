-- Creates what shared locks and permits need, once per backend, before
-- the first shared attempt, permit attempt or writer-waiting mark: the
-- table of read phases (a key's phase token and its writer-waiting mark,
-- rule M3) and the three functions that make each attempt one statement.
-- Serialised across processes by a transaction-level advisory lock, as
-- `CREATE OR REPLACE FUNCTION` run at once by two sessions fails.
--
-- Keys are never spliced into the functions: they take the key as an
-- argument and hash it on the server as every lock statement does. Each
-- token draw is `draw_token!` of sql/mod.rs written out; a test keeps them equal.
--
-- - `dlock_join_readers(key, seed)`: tries the shared advisory lock of the
--   key (`pg_try_advisory_lock_shared`, which conflicts with any exclusive
--   holder, of dlock or not), then refuses (`marked`) while a writer's
--   mark is live. A reader also holds a shared lock on the phase key
--   `hashtextextended('dlock-phase:' || key, seed)`, which only readers
--   take: the phase is live while a session holds it (the wait probe's
--   brief shared locks on the key itself could not be told apart from a
--   reader's). Whether another session does is one non-blocking
--   transaction-level exclusive try of the phase key: granted, no phase
--   is live, and the attempt starts one, drawing the token as
--   `TRY_LOCK` does and writing it into the key's row while it still
--   holds that exclusive lock, which the commit drops only once the row
--   is visible. Refused, the reader takes the phase key shared (waiting,
--   at most for a starter's end) and tries again: granted now, whoever it
--   waited behind left without a phase (rolled back, or its session
--   ended), and it starts one itself; refused, the others hold it as
--   members of a committed phase, and it joins, reading the phase token
--   with a snapshot taken after its grant (lock sessions run read
--   committed, see `SESSION_DEFAULTS`). A failure or a cancel inside
--   gives back what the attempt took. Every member also holds the
--   phase's token lock shared, `hashtextextended('dlock-phase-token:' ||
--   token || ':' || key, seed)`, taken by the starter with the token it
--   drew: a joiner joins the row's token only while another session
--   holds that token's lock, and is refused otherwise. A session may
--   hold the phase key beside the row of a phase long over: a starter
--   whose transaction ended without its phase and without its handler
--   (a server process terminated gives back its transaction's locks at
--   once and its session's only as it exits), whose row rolled back;
--   the joiner would otherwise take the old phase's token, below a
--   writer's since. The try
--   cannot tell the session's own holds from none, so the backend never
--   sends this on a session that holds the key shared (readers of one
--   process share one hold, see the `modes` module). No row is locked
--   and no lock table is scanned but by a joiner, which looks up the
--   token lock's holders: a starting reader costs what a writer does.
--   Named apart from `dlock_try_reader` and `dlock_try_read_phase` (and
--   `dlock_take_permit_slot` from `dlock_try_permit_slot` and
--   `dlock_try_permit`), their forms from before every draw took the draw
--   lock, and before the draw lock, which processes of an earlier dlock
--   keep calling and making again: a body of theirs left in place by the
--   last `CREATE OR REPLACE` would take `nextval` without the draw lock,
--   where a write could undo it (see `draw_token!`), for every process.
--   Named apart from `dlock_try_shared`, its form before token locks,
--   which processes of an earlier dlock keep calling: their unlock drops
--   no token lock, so a shared body would leave their sessions one per
--   phase. A joiner here refuses their phases (no token lock) until
--   they end. A
--   live phase whose row lost its token (a DBA truncated the table)
--   refuses new readers until it ends: a token drawn anew would be above
--   the current readers', whom a `>=` fence would then refuse. A failed
--   draw gives back what the attempt took (session locks outlive a failed
--   statement).
-- - `dlock_mark(key, seed, owner, ttl_ms)`: while readers hold, leaves or
--   refreshes `owner`'s mark (expiring `ttl_ms` from now) (a live mark of another owner stays: one
--   waiting writer is enough to hold new readers off); answers whether
--   readers hold.
-- - `dlock_take_permit_slot(key, seed, n, skipped)`: tries the slots `0..n` in
--   order, except those in `skipped` (this process's own slots, which a
--   re-entrant grant on the same session would hand out twice), one
--   `pg_try_advisory_lock` each on `hashtextextended('dlock-permit:' ||
--   slot || ':' || key, seed)`, and stops at the first taken: a loop, so
--   no try after the winning one runs and no extra lock is left. The
--   token is drawn only for the slot taken.
DO $setup$
BEGIN
PERFORM pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended('dlock-modes-setup'::pg_catalog.text, 0::pg_catalog.int8));
CREATE UNLOGGED TABLE IF NOT EXISTS "dlock".dlock_phases (
    lock_id pg_catalog.int8 PRIMARY KEY, phase_token pg_catalog.int8,
    mark_owner pg_catalog.text, mark_until pg_catalog.timestamptz);
CREATE OR REPLACE FUNCTION "dlock".dlock_join_readers(k pg_catalog.text, seed pg_catalog.int8,
    OUT granted_token pg_catalog.int8, OUT marked pg_catalog.bool)
LANGUAGE plpgsql AS $f$
DECLARE
    h pg_catalog.int8 := pg_catalog.hashtextextended(k, seed);
    p pg_catalog.int8 := pg_catalog.hashtextextended('dlock-phase:'::pg_catalog.text OPERATOR(pg_catalog.||) k, seed);
    e pg_catalog.int8;
    took_p pg_catalog.bool := false;
    took_e pg_catalog.bool := false;
    starts pg_catalog.bool;
BEGIN
    PERFORM pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, true);
    marked := false;
    IF NOT pg_catalog.pg_try_advisory_lock_shared(h) THEN RETURN; END IF;
    BEGIN
        marked := EXISTS (SELECT FROM "dlock".dlock_phases AS t
                          WHERE t.lock_id OPERATOR(pg_catalog.=) h
                            AND t.mark_until OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp());
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        PERFORM pg_catalog.pg_advisory_unlock_shared(h);
        RAISE;
    END;
    IF marked THEN
        PERFORM pg_catalog.pg_advisory_unlock_shared(h);
        RETURN;
    END IF;
    -- The phase key's tries are outside every block: a transaction-level
    -- lock taken in a block that fails goes at once, before the handler
    -- gave back this session's locks, and a joiner waiting behind would
    -- then find the phase key still held and take the row for a phase's.
    starts := pg_catalog.pg_try_advisory_xact_lock(p);
    IF NOT starts THEN
        BEGIN
            PERFORM pg_catalog.pg_advisory_lock_shared(p);
        EXCEPTION WHEN OTHERS OR query_canceled THEN
            PERFORM pg_catalog.pg_advisory_unlock_shared(h);
            RAISE;
        END;
        took_p := true;
        -- Granted once no starter held the phase key: whoever this waited
        -- behind committed its phase, or left without one. Asked once more:
        -- refused, the phase key is held by the members of a phase, or by a
        -- starter whose session ended (pg_terminate_backend gives back its
        -- transaction's lock before its session's), beside the row of a
        -- phase long over; the token lock below tells the two apart.
        starts := pg_catalog.pg_try_advisory_xact_lock(p);
        IF NOT starts THEN
            -- The row's token is the live phase's only while a member of
            -- that phase holds its token lock: a starter whose transaction
            -- ended without its phase (its row rolled back) may hold the
            -- phase key a while longer, beside the row of a phase long over.
            BEGIN
                SELECT t.phase_token INTO granted_token FROM "dlock".dlock_phases AS t
                WHERE t.lock_id OPERATOR(pg_catalog.=) h;
                IF granted_token IS NOT NULL THEN
                    e := pg_catalog.hashtextextended(pg_catalog.concat('dlock-phase-token:'::pg_catalog.text,
                        granted_token, ':'::pg_catalog.text, k), seed);
                    IF EXISTS (SELECT FROM pg_catalog.pg_locks AS l
  WHERE l.locktype = 'advisory'::pg_catalog.text AND l.granted
  AND l.mode = 'ShareLock'::pg_catalog.text AND l.objsubid = 1::pg_catalog.int2
  AND l.pid OPERATOR(pg_catalog.<>) pg_catalog.pg_backend_pid()
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database())
  AND l.classid::pg_catalog.int8 = ((e >> 32::pg_catalog.int4) & 4294967295::pg_catalog.int8)
  AND l.objid::pg_catalog.int8 = (e & 4294967295::pg_catalog.int8)) THEN
                        PERFORM pg_catalog.pg_advisory_lock_shared(e);
                        took_e := true;
                    ELSE
                        granted_token := NULL;
                    END IF;
                END IF;
            EXCEPTION WHEN OTHERS OR query_canceled THEN
                IF took_e THEN PERFORM pg_catalog.pg_advisory_unlock_shared(e); END IF;
                PERFORM pg_catalog.pg_advisory_unlock_shared(p);
                PERFORM pg_catalog.pg_advisory_unlock_shared(h);
                RAISE;
            END;
            IF granted_token IS NULL THEN
                PERFORM pg_catalog.pg_advisory_unlock_shared(p);
                PERFORM pg_catalog.pg_advisory_unlock_shared(h);
            END IF;
            RETURN;
        END IF;
    END IF;
    BEGIN
        IF NOT took_p THEN
            PERFORM pg_catalog.pg_advisory_lock_shared(p);
            took_p := true;
        END IF;
        granted_token := (SELECT CASE WHEN t.seq OPERATOR(pg_catalog.>) (t.clock OPERATOR(pg_catalog.+) 86400000000::pg_catalog.int8)
            THEN pg_catalog.int8in(pg_catalog.textout(pg_catalog.concat(
                     'dlock-refused: the token sequence is far ahead of the clock: '::pg_catalog.text,
                     t.seq, ' at '::pg_catalog.text, t.clock)))
            WHEN (t.p).cache_size
                     OPERATOR(pg_catalog.<>) 1::pg_catalog.int8
                 OR (t.p).cycle_option
                 OR (t.p).increment
                     OPERATOR(pg_catalog.<=) 0::pg_catalog.int8
            THEN pg_catalog.int8in(pg_catalog.textout(pg_catalog.concat(
                     'dlock-refused: the token sequence has unfit settings: '::pg_catalog.text,
                     t.seq)))
            WHEN (t.clock OPERATOR(pg_catalog.+) ((CASE WHEN t.seq OPERATOR(pg_catalog.<) (t.clock OPERATOR(pg_catalog.-) 86400000000::pg_catalog.int8)
                  THEN 10000::pg_catalog.int8
                  ELSE LEAST(COALESCE(pg_catalog.substring(
                    pg_catalog.obj_description('"dlock".dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid,
                                               'pg_class'::pg_catalog.name),
                    '^dlock-token-lead-us=([0-9]{1,7})$'::pg_catalog.text)::pg_catalog.int8,
                  0::pg_catalog.int8), 10000::pg_catalog.int8) END) OPERATOR(pg_catalog./) 2::pg_catalog.int8)) OPERATOR(pg_catalog.<=) t.seq THEN t.seq
            WHEN NOT pg_catalog.has_sequence_privilege(
                         '"dlock".dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid,
                         'UPDATE'::pg_catalog.text)
            THEN GREATEST(t.seq, t.clock)
            ELSE pg_catalog.setval('"dlock".dlock_token_seq'::pg_catalog.regclass,
                     t.clock OPERATOR(pg_catalog.+) (CASE WHEN t.seq OPERATOR(pg_catalog.<) (t.clock OPERATOR(pg_catalog.-) 86400000000::pg_catalog.int8)
                  THEN 10000::pg_catalog.int8
                  ELSE LEAST(COALESCE(pg_catalog.substring(
                    pg_catalog.obj_description('"dlock".dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid,
                                               'pg_class'::pg_catalog.name),
                    '^dlock-token-lead-us=([0-9]{1,7})$'::pg_catalog.text)::pg_catalog.int8,
                  0::pg_catalog.int8), 10000::pg_catalog.int8) END)) END
FROM (SELECT s.seq, s.p,
             (EXTRACT(epoch FROM pg_catalog.clock_timestamp())
              OPERATOR(pg_catalog.*) 1000000::pg_catalog.int8)::pg_catalog.int8 AS clock
      FROM (SELECT pg_catalog.nextval('"dlock".dlock_token_seq'::pg_catalog.regclass) AS seq,
                   pg_catalog.pg_sequence_parameters(
                       '"dlock".dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid) AS p FROM (SELECT pg_catalog.pg_advisory_xact_lock(1685217655::pg_catalog.int4,
                    (('"dlock".dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid::pg_catalog.int8)
                     OPERATOR(pg_catalog.&) 2147483647::pg_catalog.int8)::pg_catalog.int4) OFFSET 0) AS l OFFSET 0) AS s OFFSET 0) AS t);
        e := pg_catalog.hashtextextended(pg_catalog.concat('dlock-phase-token:'::pg_catalog.text,
            granted_token, ':'::pg_catalog.text, k), seed);
        PERFORM pg_catalog.pg_advisory_lock_shared(e);
        took_e := true;
        INSERT INTO "dlock".dlock_phases AS t (lock_id, phase_token) VALUES (h, granted_token)
        ON CONFLICT (lock_id) DO UPDATE SET phase_token = excluded.phase_token;
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        IF took_e THEN PERFORM pg_catalog.pg_advisory_unlock_shared(e); END IF;
        IF took_p THEN PERFORM pg_catalog.pg_advisory_unlock_shared(p); END IF;
        PERFORM pg_catalog.pg_advisory_unlock_shared(h);
        RAISE;
    END;
END
$f$;
CREATE OR REPLACE FUNCTION "dlock".dlock_mark(k pg_catalog.text, seed pg_catalog.int8, me pg_catalog.text,
    ttl_ms pg_catalog.int8)
RETURNS pg_catalog.bool
LANGUAGE plpgsql AS $f$
DECLARE
    h pg_catalog.int8 := pg_catalog.hashtextextended(k, seed);
    p pg_catalog.int8 := pg_catalog.hashtextextended('dlock-phase:'::pg_catalog.text OPERATOR(pg_catalog.||) k, seed);
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_locks AS l
  WHERE l.locktype = 'advisory'::pg_catalog.text AND l.granted
  AND l.mode = 'ShareLock'::pg_catalog.text AND l.objsubid = 1::pg_catalog.int2
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database())
  AND l.classid::pg_catalog.int8 = ((p >> 32::pg_catalog.int4) & 4294967295::pg_catalog.int8)
  AND l.objid::pg_catalog.int8 = (p & 4294967295::pg_catalog.int8)) THEN RETURN false; END IF;
    INSERT INTO "dlock".dlock_phases AS t (lock_id, mark_owner, mark_until)
    VALUES (h, me, pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+)
            (ttl_ms OPERATOR(pg_catalog.*) '1 millisecond'::pg_catalog.interval))
    ON CONFLICT (lock_id) DO UPDATE SET mark_owner = excluded.mark_owner, mark_until = excluded.mark_until
    WHERE t.mark_owner IS NULL OR t.mark_owner OPERATOR(pg_catalog.=) me
       OR t.mark_until OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp();
    RETURN true;
END
$f$;
CREATE OR REPLACE FUNCTION "dlock".dlock_take_permit_slot(k pg_catalog.text, seed pg_catalog.int8,
    n pg_catalog.int4, skipped pg_catalog.int4[],
    OUT granted_slot pg_catalog.int4, OUT granted_token pg_catalog.int8)
LANGUAGE plpgsql AS $f$
DECLARE
    sh pg_catalog.int8;
BEGIN
    PERFORM pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, true);
    FOR slot_no IN 0 .. n OPERATOR(pg_catalog.-) 1 LOOP
        CONTINUE WHEN slot_no OPERATOR(pg_catalog.=) ANY (skipped);
        sh := pg_catalog.hashtextextended(pg_catalog.concat('dlock-permit:'::pg_catalog.text, slot_no, ':'::pg_catalog.text, k), seed);
        IF pg_catalog.pg_try_advisory_lock(sh) THEN
            BEGIN
                granted_token := (SELECT CASE WHEN t.seq OPERATOR(pg_catalog.>) (t.clock OPERATOR(pg_catalog.+) 86400000000::pg_catalog.int8)
            THEN pg_catalog.int8in(pg_catalog.textout(pg_catalog.concat(
                     'dlock-refused: the token sequence is far ahead of the clock: '::pg_catalog.text,
                     t.seq, ' at '::pg_catalog.text, t.clock)))
            WHEN (t.p).cache_size
                     OPERATOR(pg_catalog.<>) 1::pg_catalog.int8
                 OR (t.p).cycle_option
                 OR (t.p).increment
                     OPERATOR(pg_catalog.<=) 0::pg_catalog.int8
            THEN pg_catalog.int8in(pg_catalog.textout(pg_catalog.concat(
                     'dlock-refused: the token sequence has unfit settings: '::pg_catalog.text,
                     t.seq)))
            WHEN (t.clock OPERATOR(pg_catalog.+) ((CASE WHEN t.seq OPERATOR(pg_catalog.<) (t.clock OPERATOR(pg_catalog.-) 86400000000::pg_catalog.int8)
                  THEN 10000::pg_catalog.int8
                  ELSE LEAST(COALESCE(pg_catalog.substring(
                    pg_catalog.obj_description('"dlock".dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid,
                                               'pg_class'::pg_catalog.name),
                    '^dlock-token-lead-us=([0-9]{1,7})$'::pg_catalog.text)::pg_catalog.int8,
                  0::pg_catalog.int8), 10000::pg_catalog.int8) END) OPERATOR(pg_catalog./) 2::pg_catalog.int8)) OPERATOR(pg_catalog.<=) t.seq THEN t.seq
            WHEN NOT pg_catalog.has_sequence_privilege(
                         '"dlock".dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid,
                         'UPDATE'::pg_catalog.text)
            THEN GREATEST(t.seq, t.clock)
            ELSE pg_catalog.setval('"dlock".dlock_token_seq'::pg_catalog.regclass,
                     t.clock OPERATOR(pg_catalog.+) (CASE WHEN t.seq OPERATOR(pg_catalog.<) (t.clock OPERATOR(pg_catalog.-) 86400000000::pg_catalog.int8)
                  THEN 10000::pg_catalog.int8
                  ELSE LEAST(COALESCE(pg_catalog.substring(
                    pg_catalog.obj_description('"dlock".dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid,
                                               'pg_class'::pg_catalog.name),
                    '^dlock-token-lead-us=([0-9]{1,7})$'::pg_catalog.text)::pg_catalog.int8,
                  0::pg_catalog.int8), 10000::pg_catalog.int8) END)) END
FROM (SELECT s.seq, s.p,
             (EXTRACT(epoch FROM pg_catalog.clock_timestamp())
              OPERATOR(pg_catalog.*) 1000000::pg_catalog.int8)::pg_catalog.int8 AS clock
      FROM (SELECT pg_catalog.nextval('"dlock".dlock_token_seq'::pg_catalog.regclass) AS seq,
                   pg_catalog.pg_sequence_parameters(
                       '"dlock".dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid) AS p FROM (SELECT pg_catalog.pg_advisory_xact_lock(1685217655::pg_catalog.int4,
                    (('"dlock".dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid::pg_catalog.int8)
                     OPERATOR(pg_catalog.&) 2147483647::pg_catalog.int8)::pg_catalog.int4) OFFSET 0) AS l OFFSET 0) AS s OFFSET 0) AS t);
            EXCEPTION WHEN OTHERS OR query_canceled THEN
                PERFORM pg_catalog.pg_advisory_unlock(sh);
                RAISE;
            END;
            granted_slot := slot_no;
            RETURN;
        END IF;
    END LOOP;
END
$f$;
END
$setup$;

CREATE OR REPLACE FUNCTION {schema}.dlock_mark(k text, seed bigint, me text, ttl_ms bigint)
 RETURNS boolean
 LANGUAGE plpgsql
AS $function$
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
    INSERT INTO {schema}.dlock_phases AS t (lock_id, mark_owner, mark_until)
    VALUES (h, me, pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+)
            (ttl_ms OPERATOR(pg_catalog.*) '1 millisecond'::pg_catalog.interval))
    ON CONFLICT (lock_id) DO UPDATE SET mark_owner = excluded.mark_owner, mark_until = excluded.mark_until
    WHERE t.mark_owner IS NULL OR t.mark_owner OPERATOR(pg_catalog.=) me
       OR t.mark_until OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp();
    RETURN true;
END
$function$
;
CREATE OR REPLACE FUNCTION {schema}.dlock_try_permit(k text, seed bigint, n integer, skipped integer[], OUT granted_slot integer, OUT granted_token bigint)
 RETURNS record
 LANGUAGE plpgsql
AS $function$
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
            WHEN EXISTS (SELECT FROM pg_catalog.pg_sequence AS q
                         WHERE q.seqrelid OPERATOR(pg_catalog.=)
                               '{schema}.dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid
                           AND ((q.seqcache OPERATOR(pg_catalog.<>) 1::pg_catalog.int8) OR q.seqcycle
                                OR (q.seqincrement OPERATOR(pg_catalog.<=) 0::pg_catalog.int8)))
            THEN pg_catalog.int8in(pg_catalog.textout(pg_catalog.concat(
                     'dlock-refused: the token sequence has unfit settings: '::pg_catalog.text,
                     t.seq)))
            WHEN t.clock OPERATOR(pg_catalog.<=) t.seq THEN t.seq
            WHEN pg_catalog.has_sequence_privilege(
                     '{schema}.dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid,
                     'UPDATE'::pg_catalog.text)
            THEN pg_catalog.setval('{schema}.dlock_token_seq'::pg_catalog.regclass, t.clock)
            ELSE t.clock END
FROM (SELECT s.seq,
             (EXTRACT(epoch FROM pg_catalog.clock_timestamp())
              OPERATOR(pg_catalog.*) 1000000::pg_catalog.int8)::pg_catalog.int8 AS clock
      FROM (SELECT pg_catalog.nextval('{schema}.dlock_token_seq'::pg_catalog.regclass) AS seq  OFFSET 0) AS s OFFSET 0) AS t);
            EXCEPTION WHEN OTHERS OR query_canceled THEN
                PERFORM pg_catalog.pg_advisory_unlock(sh);
                RAISE;
            END;
            granted_slot := slot_no;
            RETURN;
        END IF;
    END LOOP;
END
$function$
;
CREATE OR REPLACE FUNCTION {schema}.dlock_try_read_phase(k text, seed bigint, OUT granted_token bigint, OUT marked boolean)
 RETURNS record
 LANGUAGE plpgsql
AS $function$
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
        marked := EXISTS (SELECT FROM {schema}.dlock_phases AS t
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
                SELECT t.phase_token INTO granted_token FROM {schema}.dlock_phases AS t
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
            WHEN EXISTS (SELECT FROM pg_catalog.pg_sequence AS q
                         WHERE q.seqrelid OPERATOR(pg_catalog.=)
                               '{schema}.dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid
                           AND ((q.seqcache OPERATOR(pg_catalog.<>) 1::pg_catalog.int8) OR q.seqcycle
                                OR (q.seqincrement OPERATOR(pg_catalog.<=) 0::pg_catalog.int8)))
            THEN pg_catalog.int8in(pg_catalog.textout(pg_catalog.concat(
                     'dlock-refused: the token sequence has unfit settings: '::pg_catalog.text,
                     t.seq)))
            WHEN t.clock OPERATOR(pg_catalog.<=) t.seq THEN t.seq
            WHEN pg_catalog.has_sequence_privilege(
                     '{schema}.dlock_token_seq'::pg_catalog.regclass::pg_catalog.oid,
                     'UPDATE'::pg_catalog.text)
            THEN pg_catalog.setval('{schema}.dlock_token_seq'::pg_catalog.regclass, t.clock)
            ELSE t.clock END
FROM (SELECT s.seq,
             (EXTRACT(epoch FROM pg_catalog.clock_timestamp())
              OPERATOR(pg_catalog.*) 1000000::pg_catalog.int8)::pg_catalog.int8 AS clock
      FROM (SELECT pg_catalog.nextval('{schema}.dlock_token_seq'::pg_catalog.regclass) AS seq  OFFSET 0) AS s OFFSET 0) AS t);
        e := pg_catalog.hashtextextended(pg_catalog.concat('dlock-phase-token:'::pg_catalog.text,
            granted_token, ':'::pg_catalog.text, k), seed);
        PERFORM pg_catalog.pg_advisory_lock_shared(e);
        took_e := true;
        INSERT INTO {schema}.dlock_phases AS t (lock_id, phase_token) VALUES (h, granted_token)
        ON CONFLICT (lock_id) DO UPDATE SET phase_token = excluded.phase_token;
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        IF took_e THEN PERFORM pg_catalog.pg_advisory_unlock_shared(e); END IF;
        IF took_p THEN PERFORM pg_catalog.pg_advisory_unlock_shared(p); END IF;
        PERFORM pg_catalog.pg_advisory_unlock_shared(h);
        RAISE;
    END;
END
$function$

;

WITH k AS (
  SELECT k.h, COALESCE($6::pg_catalog.bool,
                       EXISTS (SELECT FROM pg_catalog.pg_locks AS l
                               WHERE l.pid = pg_catalog.pg_backend_pid() AND l.locktype = 'advisory'::pg_catalog.text AND l.granted
  AND l.mode = 'ExclusiveLock'::pg_catalog.text AND l.objsubid = 1::pg_catalog.int2
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database())
  AND l.classid::pg_catalog.int8 = ((k.h >> 32::pg_catalog.int4) & 4294967295::pg_catalog.int8)
  AND l.objid::pg_catalog.int8 = (k.h & 4294967295::pg_catalog.int8))) AS already,
         pg_catalog.pg_advisory_xact_lock_shared(
             (k.h OPERATOR(pg_catalog.>>) 32::pg_catalog.int4)::pg_catalog.int4,
             ((k.h OPERATOR(pg_catalog.<<) 32::pg_catalog.int4)
              OPERATOR(pg_catalog.>>) 32::pg_catalog.int4)::pg_catalog.int4) AS rewriting
  FROM (SELECT pg_catalog.hashtextextended($1::pg_catalog.text, $2::pg_catalog.int8) AS h) AS k
),
t AS (
  SELECT k.h, k.already, CASE WHEN k.rewriting IS NOT NULL
                               AND pg_catalog.pg_try_advisory_xact_lock(k.h) THEN (SELECT CASE WHEN t.seq OPERATOR(pg_catalog.>) (t.clock OPERATOR(pg_catalog.+) 86400000000::pg_catalog.int8)
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
      FROM (SELECT pg_catalog.nextval('{schema}.dlock_token_seq'::pg_catalog.regclass) AS seq, pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, true)
              AS commit_mode  OFFSET 0) AS s OFFSET 0) AS t) END AS token
  FROM k
),
recorded AS (
  INSERT INTO {schema}.dlock_holders AS r
         (lock_id, key, token, pid, session_start, identity, holder, holder_token, since)
  SELECT t.h, $1::pg_catalog.text, t.token, pg_catalog.pg_backend_pid(),
         $4::pg_catalog.timestamptz, $3::pg_catalog.text, $5::pg_catalog.text, t.token,
         pg_catalog.now()
  FROM t WHERE t.token IS NOT NULL AND NOT t.already
  ON CONFLICT (lock_id) DO UPDATE
  SET key = EXCLUDED.key, token = EXCLUDED.token, pid = EXCLUDED.pid,
      session_start = EXCLUDED.session_start, identity = EXCLUDED.identity,
      holder = EXCLUDED.holder, holder_token = EXCLUDED.holder_token, since = EXCLUDED.since
  RETURNING r.lock_id, r.key, r.token, r.holder_token, r.pid, r.session_start, r.identity,
            r.holder, r.since
)
SELECT s.h, CASE WHEN s.token IS NOT NULL AND NOT s.already
                      AND pg_catalog.pg_advisory_lock(s.h) IS NOT NULL
                 THEN s.token END,
       s.since, s.already, COALESCE(s.wrote, false)
FROM (SELECT t.h, t.token, t.already, (SELECT recorded.since FROM recorded) AS since,
             (SELECT recorded.lock_id OPERATOR(pg_catalog.=) t.h
                     AND recorded.key OPERATOR(pg_catalog.=) $1::pg_catalog.text
                     AND recorded.token OPERATOR(pg_catalog.=) t.token
                     AND recorded.holder_token OPERATOR(pg_catalog.=) t.token
                     AND recorded.pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()
                     AND recorded.session_start OPERATOR(pg_catalog.=) $4::pg_catalog.timestamptz
                     AND recorded.identity IS NOT DISTINCT FROM $3::pg_catalog.text
                     AND recorded.holder IS NOT DISTINCT FROM $5::pg_catalog.text FROM recorded) AS wrote
      FROM t OFFSET 0) AS s
WITH gone AS (
  DELETE FROM {schema}.dlock_holders AS r
  USING ROWS FROM (pg_catalog.unnest($1::pg_catalog.int8[]),
                  pg_catalog.unnest($2::pg_catalog.int8[])) AS g(lock_id, token)
  WHERE r.lock_id = g.lock_id AND r.token = g.token
    AND r.pid = pg_catalog.pg_backend_pid() AND r.session_start = $3::pg_catalog.timestamptz
  RETURNING r.lock_id
)
SELECT pg_catalog.count(*),
       pg_catalog.set_config('synchronous_commit'::pg_catalog.text, 'off'::pg_catalog.text, true)
FROM gone
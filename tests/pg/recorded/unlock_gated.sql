SELECT pg_catalog.pg_advisory_unlock(g.h)
FROM (SELECT $1::pg_catalog.int8 AS h,
             pg_catalog.pg_advisory_xact_lock_shared((OPERATOR(pg_catalog.~) ($1::pg_catalog.int8 OPERATOR(pg_catalog.>>) 32::pg_catalog.int4))::pg_catalog.int4,
             (OPERATOR(pg_catalog.~) (($1::pg_catalog.int8 OPERATOR(pg_catalog.<<) 32::pg_catalog.int4) OPERATOR(pg_catalog.>>) 32::pg_catalog.int4))::pg_catalog.int4) AS gate
      OFFSET 0) AS g
-- The token sequence every lock draws its fencing token from, with the
-- server clock: tokens rise across restarts of every client. Its settings
-- are checked by every draw (CACHE 1, NO CYCLE, a positive increment).
CREATE SEQUENCE IF NOT EXISTS "dlock".dlock_token_seq AS bigint;

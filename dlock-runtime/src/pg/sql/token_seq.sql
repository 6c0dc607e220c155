-- The token sequence every lock draws its fencing token from, with the
-- server clock: tokens rise across restarts of every client. Its settings
-- are checked by every draw (CACHE 1, NO CYCLE, a positive increment).
CREATE SEQUENCE IF NOT EXISTS "dlock".dlock_token_seq AS bigint;
-- Its token lead, 10 ms: a draw that finds the sequence behind the clock
-- sets it 10 ms ahead, and the draws of the next 10 ms write nothing (see
-- draw_token! in mod.rs). Left out while a dlock from before the lead
-- still draws from the sequence: it writes without the draw lock.
COMMENT ON SEQUENCE "dlock".dlock_token_seq IS 'dlock-token-lead-us=10000';

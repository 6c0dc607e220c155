-- The token sequence's token lead, 10 ms: a draw that finds the sequence
-- behind the clock sets it 10 ms ahead, and the draws of the next 10 ms
-- write nothing (see draw_token! in mod.rs). dlock sets it only on a
-- sequence it creates with its schema, never on one it finds or makes
-- again beside other processes: a dlock from before the lead writes the
-- sequence without the draw lock, out of order with a leading draw. Run it
-- once no such process draws from the sequence.
COMMENT ON SEQUENCE "dlock".dlock_token_seq IS 'dlock-token-lead-us=10000';

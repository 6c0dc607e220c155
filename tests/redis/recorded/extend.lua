-- dlock's Redis protocol before the holder record moved into the lock's
-- value: the renewal, word for word (a rolling upgrade's replicas not yet upgraded).
local held = redis.pcall('GET', KEYS[1])
if held == ARGV[1] or type(held) == 'string' and #held == #ARGV[1]
    and string.sub(held, 1, -2) == string.sub(ARGV[1], 1, -2) then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0

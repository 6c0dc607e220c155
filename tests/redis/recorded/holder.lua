-- dlock's Redis protocol before the holder record moved into the lock's
-- value: the holder read, word for word (a rolling upgrade's replicas not yet upgraded).
local held = redis.pcall('GET', KEYS[1])
if not held then
  return false
end
local ttl = redis.call('PTTL', KEYS[1])
if type(held) ~= 'string' or #held ~= 33 or not string.find(held, '^%x+[-+]$') then
  return {ttl, '', '', '', -1}
end
local owner = string.sub(held, 1, 32) .. ' '
local record = redis.pcall('GET', KEYS[3])
if type(record) ~= 'string' or string.sub(record, 1, 33) ~= owner then
  record = ''
end
local fence = redis.pcall('GET', KEYS[2])
if type(fence) ~= 'string' then
  fence = ''
end
local info, held_for = '', -1
local recorded = redis.pcall('GET', KEYS[4])
if type(recorded) == 'string' and string.sub(recorded, 1, 33) == owner then
  local since, rest = string.match(recorded, '^(%d+) (.*)$', 34)
  if since and #since <= 16 then
    local now = redis.call('TIME')
    local micros = tonumber(now[1]) * 1000000 + tonumber(now[2]) - tonumber(since)
    info, held_for = rest, math.max(micros, 0)
  end
end
return {ttl, record, fence, info, held_for}

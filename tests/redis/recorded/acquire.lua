-- dlock's Redis protocol before the holder record moved into the lock's
-- value: the acquire script, word for word (a rolling upgrade's replicas not yet upgraded).
local waits = ARGV[4] == 'w'

if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local held = redis.pcall('GET', KEYS[1])
  if held ~= ARGV[1] and not (type(held) == 'string' and #held == #ARGV[1]
      and string.sub(held, 1, -2) == string.sub(ARGV[1], 1, -2)) then
    local reading = type(held) == 'string' and #held == 33
      and string.sub(held, 1, 32) == '00000000000000000000000000000000'
    if reading and waits then
      local writer = string.sub(KEYS[1], 1, -5) .. 'writer'
      local marked = redis.pcall('GET', writer)
      if not marked then
        redis.call('SET', writer, string.sub(ARGV[1], 1, 32) .. '-', 'PX', 3000)
      elseif type(marked) == 'string' and string.sub(marked, 1, 32) == string.sub(ARGV[1], 1, 32) then
        redis.call('PEXPIRE', writer, 3000)
      end
    end
    if type(held) == 'string' and #held == 33 and string.find(held, '^%x+%-$') then
      local marked = redis.pcall('SETRANGE', KEYS[1], 32, '+')
      if type(marked) == 'table' then
        return {redis.call('PTTL', KEYS[1]), marked.err}
      end
    end
    if reading then
      return math.min(redis.call('PTTL', KEYS[1]), 1000)
    end
    return redis.call('PTTL', KEYS[1])
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if held ~= ARGV[1] and string.byte(ARGV[1], -1) == 43 then
    redis.call('SETRANGE', KEYS[1], #ARGV[1] - 1, '+')
  end
end
local writer = string.sub(KEYS[1], 1, -5) .. 'writer'
local waiting = redis.pcall('GET', writer)
if type(waiting) == 'string' and string.sub(waiting, 1, 32) == string.sub(ARGV[1], 1, 32) then
  redis.call('DEL', writer)
  if string.byte(waiting, -1) == 43 then
    redis.call('SETRANGE', KEYS[1], 32, '+')
  end
end
local now = redis.call('TIME')
local clock = now[2]
if #clock < 6 then
  clock = string.rep('0', 6 - #clock) .. clock
end
clock = now[1] .. clock
redis.call('SET', KEYS[3], string.sub(ARGV[1], 1, 32) .. ' ' .. clock .. ' ' .. ARGV[3], 'PX', ARGV[2])
local last = redis.pcall('SET', KEYS[2], clock, 'GET')
if not last or #last == #clock and last < clock and string.find(last, '^[1-9]%d*$') then
  return clock
end
if type(last) == 'string' then
  redis.call('SET', KEYS[2], last)
end
local token = redis.pcall('INCR', KEYS[2])
if type(token) == 'table' then
  redis.call('DEL', KEYS[1], KEYS[3])
  redis.call('PUBLISH', string.sub(KEYS[1], 1, -5) .. 'released', 'released')
  return redis.error_reply('ERR the fencing counter ' .. KEYS[2] .. ' cannot rise: ' .. (string.gsub(token.err, '^ERR ', '')))
end
if token < tonumber(clock) then
  redis.call('SET', KEYS[2], clock)
  return clock
end
return redis.call('GET', KEYS[2])

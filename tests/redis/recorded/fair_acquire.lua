-- dlock's Redis protocol before the holder record moved into the lock's
-- value: the fair acquire, word for word (a rolling upgrade's replicas not yet upgraded).
local function take()
local waits = ARGV[5] == 'w'

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
end

local function clock_of(now)
  local micros = now[2]
  if #micros < 6 then
    micros = string.rep('0', 6 - #micros) .. micros
  end
  return now[1] .. micros
end
local function server_time()
  return clock_of(redis.call('TIME'))
end
local function draw(fence, clock)
  local last = redis.pcall('SET', fence, clock, 'GET')
  if not last or #last == #clock and last < clock and string.find(last, '^[1-9]%d*$') then
    return clock
  end
  if type(last) == 'string' then
    redis.call('SET', fence, last)
  end
  local token = redis.pcall('INCR', fence)
  if type(token) == 'table' then
    return nil
  end
  if token < tonumber(clock) then
    redis.call('SET', fence, clock)
    return clock
  end
  return redis.call('GET', fence)
end

local function waiter(queue, owner)
  return string.sub(queue, 1, -6) .. 'waiter:' .. owner
end
local function first_live(text, queue)
  local at = 1
  while true do
    local owner, stop = string.match(text, '^(%x+)[^\n]*\n()', at)
    if not owner or #owner ~= 32 then
      return nil, #text + 1
    end
    local name = waiter(queue, owner)
    local entry = redis.pcall('GET', name)
    if type(entry) == 'string' then
      local ttl, record = string.match(entry, '^(%d+) (.*)$')
      if ttl then
        return {owner, ttl, record, name}, at, stop
      end
    end
    at = stop
  end
end
local function write(queue, text, life)
  if text == '' then
    redis.call('DEL', queue)
  elseif life then
    redis.call('SET', queue, text, 'PX', math.max(redis.call('PTTL', queue), life))
  else
    redis.call('SET', queue, text, 'KEEPTTL')
  end
end
local function hand_over(entry, clock, lock, fence, info)
  local px = entry[2]
  local left = redis.call('PTTL', entry[4])
  if left > 0 and left < tonumber(px) then
    px = tostring(left)
  end
  redis.call('SET', lock, entry[1] .. '+', 'PX', px)
  redis.call('SET', info, entry[1] .. ' ' .. clock .. ' ' .. entry[3], 'PX', px)
  local token = draw(fence, clock)
  if not token then
    redis.call('DEL', lock, info)
    return nil
  end
  redis.call('DEL', entry[4])
  redis.call('PUBLISH', string.sub(lock, 1, -5) .. 'handoff', entry[1] .. ' ' .. token .. ' ' .. px)
  return px
end
local function without(text, owner)
  local at = string.find('\n' .. text, '\n' .. owner, 1, true)
  if not at then
    return text
  end
  local stop = string.find(text, '\n', at, true) or #text
  return string.sub(text, 1, at - 1) .. string.sub(text, stop + 1)
end
local function leave(queue, text, owner)
  local rest = without(text, owner)
  if rest ~= text then
    write(queue, rest)
  end
end

local owner = string.sub(ARGV[1], 1, 32)
local life = ARGV[4] ~= '' and tonumber(ARGV[4])
local function enter(text)
  local old = redis.pcall('SET', KEYS[5], ARGV[2] .. ' ' .. ARGV[3], 'PX', ARGV[4], 'GET')
  if type(old) == 'string' and string.find('\n' .. text, '\n' .. owner, 1, true) then
    return text
  end
  return without(text, owner) .. owner .. '\n'
end
if not redis.pcall('GET', KEYS[1]) then
  local text = redis.pcall('GET', KEYS[4])
  if type(text) ~= 'string' then
    text = ''
  end
  local clock = server_time()
  local entry, start, stop = first_live(text, KEYS[4])
  if entry and (not life or entry[1] ~= owner) then
    local handed = hand_over(entry, clock, KEYS[1], KEYS[2], KEYS[3])
    local rest = string.sub(text, handed and stop or start)
    if life then
      rest = enter(rest)
    end
    if rest ~= text then
      write(KEYS[4], rest, life)
    end
    if handed then
      return tonumber(handed)
    end
    return -1
  end
  local reply = take()
  if type(reply) == 'string' and text ~= '' then
    local rest = entry and string.sub(text, stop) or ''
    write(KEYS[4], rest)
    redis.call('DEL', KEYS[5])
    if rest ~= '' then
      redis.call('SETRANGE', KEYS[1], 32, '+')
    end
  end
  return reply
end
local reply = take()
if type(reply) == 'string' then
  if redis.call('DEL', KEYS[5]) == 1 then
    local text = redis.pcall('GET', KEYS[4])
    if type(text) == 'string' and text ~= '' then
      leave(KEYS[4], text, owner)
    end
  end
elseif life and not (type(reply) == 'table' and reply.err) then
  local old = redis.pcall('SET', KEYS[5], ARGV[2] .. ' ' .. ARGV[3], 'PX', ARGV[4], 'GET')
  local left = redis.call('PTTL', KEYS[4])
  if type(old) == 'string' and left ~= -2 then
    if left < life then
      redis.call('PEXPIRE', KEYS[4], life)
    end
  else
    local text = redis.pcall('GET', KEYS[4])
    if type(text) ~= 'string' then
      text = ''
    end
    write(KEYS[4], without(text, owner) .. owner .. '\n', life)
  end
end
return reply

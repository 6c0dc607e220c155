-- dlock's Redis protocol before the holder record moved into the lock's
-- value: the release, word for word (a rolling upgrade's replicas not yet upgraded).
local held = redis.pcall('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
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
local stem = string.sub(KEYS[1], 1, -5)
local queue, fence = stem .. 'queue', stem .. 'fence'
if type(held) == 'string' and #held == #ARGV[1]
    and string.sub(held, 1, -2) == owner then
  local text = redis.pcall('GET', queue)
  if type(text) == 'string' and text ~= '' then
    local clock = server_time()
    local entry, start, stop = first_live(text, queue)
    if entry and hand_over(entry, clock, KEYS[1], fence, KEYS[2]) then
      write(queue, string.sub(text, stop))
      return 1
    end
    if start > 1 then
      write(queue, string.sub(text, start))
    end
  end
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('PUBLISH', stem .. 'released', 'released')
  return 1
end
local writer = stem .. 'writer'
local waiting = redis.pcall('GET', writer)
if type(waiting) == 'string' and string.sub(waiting, 1, 32) == owner then
  redis.call('DEL', writer)
  redis.call('PUBLISH', stem .. 'released', 'released')
end
redis.call('DEL', waiter(queue, owner))
local text = redis.pcall('GET', queue)
if type(text) == 'string' and text ~= '' then
  leave(queue, text, owner)
end
return 0

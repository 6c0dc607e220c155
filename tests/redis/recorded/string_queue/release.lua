
local held = redis.pcall('GET', KEYS[1])
local mine = type(held) == 'string' and string.sub(held, 1, 32) == string.sub(ARGV[1], 1, 32)
  and (#held == 33 or string.find(held, '^ %d+ %d+ ', 34))
if mine and #held > 33 and string.byte(held, 33) == 45 then
  redis.call('DEL', KEYS[1])
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
    local owner, shape, stop = string.match(text, '^(%x+)([^\n]*)\n()', at)
    if not owner or #owner ~= 32 then
      return nil, #text + 1
    end
    local name = waiter(queue, owner)
    local entry = redis.pcall('GET', name)
    if type(entry) == 'string' then
      local ttl, record = string.match(entry, '^(%d+) ([^\n]*)')
      if ttl then
        return {owner, ttl, record, name, string.sub(shape, 1, 2) == ' v'}, at, stop
      end
    end
    at = stop
  end
end
local function stamp_of(text)
  return string.match(text, '^[^\n]* g(%w+)\n')
end
local function stamped(text, stamp)
  local line, rest = string.match(text, '^([^\n]*)(\n.*)$')
  if not line or string.sub(line, -#stamp - 2) == ' g' .. stamp then
    return text
  end
  return string.gsub(line, ' g%w+$', '') .. ' g' .. stamp .. rest
end
local function write(queue, text, life, left, from)
  if text ~= '' then
    text = stamped(text, stamp_of(from or text) or stamp_of(text)
      or server_time() .. string.sub(text, 1, 8))
  end
  if text == from then
    if life and (left or redis.call('PTTL', queue)) < life then
      redis.call('PEXPIRE', queue, life)
    end
  elseif text == '' then
    redis.call('DEL', queue)
  elseif life then
    redis.call('SET', queue, text, 'PX', math.max(left or redis.call('PTTL', queue), life))
  else
    redis.call('SET', queue, text, 'KEEPTTL')
  end
  return text
end
local function hand_over(entry, clock, lock, fence)
  local px = entry[2]
  local left = redis.call('PTTL', entry[4])
  if left > 0 and left < tonumber(px) then
    px = tostring(left)
  end
  local token = draw(fence, clock)
  if not token then
    return nil
  end
  if entry[5] then
    redis.call('SET', lock, entry[1] .. '+ ' .. token .. ' ' .. clock .. ' ' .. entry[3], 'PX', px)
  else
    redis.call('SET', lock, entry[1] .. '+', 'PX', px)
    redis.call('SET', string.sub(lock, 1, -5) .. 'info', entry[1] .. ' ' .. clock .. ' ' .. entry[3], 'PX', px)
  end
  redis.call('DEL', entry[4])
  -- The waiter's writer-waiting mark, if it left one behind readers, goes
  -- as when it takes the key itself: it holds the key now.
  local writer = string.sub(lock, 1, -5) .. 'writer'
  local waiting = redis.pcall('GET', writer)
  if type(waiting) == 'string' and string.sub(waiting, 1, 32) == entry[1] then
    redis.call('DEL', writer)
  end
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
    write(queue, rest, nil, nil, text)
  end
end

local owner = string.sub(ARGV[1], 1, 32)
local stem = string.sub(KEYS[1], 1, -5)
local queue, fence = stem .. 'queue', stem .. 'fence'
if mine then
  if string.byte(held, 33) == 43 then
    local text = redis.pcall('GET', queue)
    if type(text) == 'string' and text ~= '' then
      local clock = server_time()
      local entry, start, stop = first_live(text, queue)
      if entry then
        if hand_over(entry, clock, KEYS[1], fence) then
          write(queue, string.sub(text, stop), nil, nil, text)
          return 1
        end
      end
      if start > 1 then
        write(queue, string.sub(text, start), nil, nil, text)
      end
    end
  end
  if #held == 33 then
    redis.call('DEL', KEYS[1], stem .. 'info')
  else
    redis.call('DEL', KEYS[1])
  end
  if string.byte(held, 33) == 43 then
    redis.call('PUBLISH', stem .. 'released', 'released')
  end
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

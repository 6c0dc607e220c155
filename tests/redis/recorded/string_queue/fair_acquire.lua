local function take(prefetched)
local waits = ARGV[5] == 'w'
local held = prefetched

local owner, mark = string.sub(ARGV[1], 1, 32), string.sub(ARGV[1], 33)
if held then
  if not (type(held) == 'string' and string.sub(held, 1, 32) == owner
      and (#held == 33 or string.find(held, '^ %d+ %d+ ', 34))) then
    local reading = type(held) == 'string' and #held == 33
      and string.sub(held, 1, 32) == '00000000000000000000000000000000'
    if reading and waits then
      local writer = string.sub(KEYS[1], 1, -5) .. 'writer'
      local marked = redis.pcall('GET', writer)
      if not marked then
        redis.call('SET', writer, owner .. '-', 'PX', 3000)
      elseif type(marked) == 'string' and string.sub(marked, 1, 32) == owner then
        redis.call('PEXPIRE', writer, 3000)
      end
    end
    if type(held) == 'string' and select(2, string.find(held, '^%x+%-')) == 33
        and (#held == 33 or string.find(held, '^ %d+ %d+ ', 34)) then
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
  if string.byte(held, 33) == 43 then
    mark = '+'
  end
end
if waits then
  local writer = string.sub(KEYS[1], 1, -5) .. 'writer'
  local waiting = redis.pcall('GET', writer)
  if type(waiting) == 'string' and string.sub(waiting, 1, 32) == owner then
    redis.call('DEL', writer)
    if string.byte(waiting, -1) == 43 then
      mark = '+'
    end
  end
end
local now = redis.call('TIME')
local clock = now[2]
if #clock < 6 then
  clock = string.rep('0', 6 - #clock) .. clock
end
clock = now[1] .. clock
local token = clock
local last = redis.pcall('SET', KEYS[2], clock, 'GET')
if last and not (#last == #clock and last < clock and string.find(last, '^[1-9]%d*$')) then
  if type(last) == 'string' then
    redis.call('SET', KEYS[2], last)
  end
  local drawn = redis.pcall('INCR', KEYS[2])
  if type(drawn) == 'table' then
    redis.call('DEL', KEYS[1])
    redis.call('PUBLISH', string.sub(KEYS[1], 1, -5) .. 'released', 'released')
    return redis.error_reply('ERR the fencing counter ' .. KEYS[2] .. ' cannot rise: ' .. (string.gsub(drawn.err, '^ERR ', '')))
  end
  if drawn < tonumber(clock) then
    redis.call('SET', KEYS[2], clock)
  else
    token = redis.call('GET', KEYS[2])
  end
end
redis.call('SET', KEYS[1], owner .. mark .. ' ' .. token .. ' ' .. clock .. ' ' .. ARGV[3], 'PX', ARGV[2])
return token
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
local life = ARGV[4] ~= '' and tonumber(ARGV[4])
local rejoin = string.sub(KEYS[3], 1, -6) .. 'rejoin'
local function refresh(stamp)
  return redis.pcall('SET', KEYS[4], ARGV[2] .. ' ' .. ARGV[3] .. '\n' .. (stamp or ''),
    'PX', ARGV[4], 'GET')
end
local function enter(text, old)
  local lost = type(old) == 'string'
  if lost and string.find('\n' .. text, '\n' .. owner, 1, true) then
    return text
  end
  if lost or text == '' then
    redis.call('SET', rejoin, '1', 'PX', ARGV[4])
  end
  return without(text, owner) .. owner .. ' v\n'
end
local function settle(stored, stamp)
  local now = stamp_of(stored)
  if now ~= stamp then
    refresh(now)
  end
end
local held = redis.pcall('GET', KEYS[1])
if not held then
  local text = redis.pcall('GET', KEYS[3])
  if type(text) ~= 'string' then
    text = ''
  end
  local clock = server_time()
  local entry, start, stop = first_live(text, KEYS[3])
  if entry and (not life or entry[1] ~= owner) then
    local handed = hand_over(entry, clock, KEYS[1], KEYS[2])
    local rest = string.sub(text, handed and stop or start)
    if life then
      local stamp = stamp_of(text)
      rest = enter(rest, refresh(stamp))
      settle(write(KEYS[3], rest, life, nil, text), stamp)
    elseif rest ~= text then
      write(KEYS[3], rest, nil, nil, text)
    end
    if handed then
      return tonumber(handed)
    end
    return -1
  end
  local reply = take(false)
  if type(reply) == 'string' and text ~= '' then
    local rest = entry and string.sub(text, stop) or ''
    write(KEYS[3], rest, nil, nil, text)
    redis.call('DEL', KEYS[4])
    if rest ~= '' then
      redis.call('SETRANGE', KEYS[1], 32, '+')
    end
  end
  return reply
end
local reply = take(held)
if type(reply) == 'string' then
  if redis.call('DEL', KEYS[4]) == 1 then
    local text = redis.pcall('GET', KEYS[3])
    if type(text) == 'string' and text ~= '' then
      leave(KEYS[3], text, owner)
    end
  end
elseif life and not (type(reply) == 'table' and reply.err) then
  local head = redis.pcall('GETRANGE', KEYS[3], 0, 127)
  local stamp = type(head) == 'string' and stamp_of(head) or nil
  local old = refresh(stamp)
  local left = redis.call('PTTL', KEYS[3])
  local kept
  if type(head) == 'string' then
    kept = stamp and type(old) == 'string' and string.match(old, '\n(%w*)$') == stamp
  else
    kept = type(old) == 'string' and left ~= -2 and not redis.pcall('GET', rejoin)
  end
  if kept then
    if left < life then
      redis.call('PEXPIRE', KEYS[3], life)
    end
  else
    local text = redis.pcall('GET', KEYS[3])
    if type(text) ~= 'string' then
      text = ''
    end
    settle(write(KEYS[3], enter(text, old), life, left, text), stamp)
  end
  if type(head) == 'table' and type(reply) == 'number' then
    return {reply, head.err, 'getrange'}
  end
end
return reply

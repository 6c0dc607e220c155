//! The Lua functions of fair mode's queue (`queue_lua!`), in both of its
//! kinds: the string queue every version reads, and the list a backend
//! with `RedisBuilder::list_queues` begins. A file of its own because the
//! release and the fair acquire script (`fair.rs`) both build on it, and
//! its rules (the stamp, the entry keys, what a foreign type or a refused
//! command is read as) are one concern apart from the lock's own scripts.

/// The Lua functions of fair mode's queue, shared by [`RELEASE_LUA`](super::RELEASE_LUA) and
/// `FAIR_ACQUIRE_LUA`. A key's queue keeps two things apart:
///
/// - **The order**, in `dlock:{T}:queue`: a string of one line per waiter,
///   in arrival order, its owner id's 32 hex digits, ` v` and `\n`. The
///   ` v` says the waiter takes its holder record in the lock's value; a
///   line without it is a waiter on the previous protocol (which reads
///   only the owner id of a line), handed the key in that protocol's
///   shape: the value of 33 characters, and its record in the info key.
///   Written only when someone joins, leaves, or is handed the key or
///   found dead at the front; its `PX` is never shorter than its
///   longest-lived entry's, so an abandoned queue goes away by itself.
///   The first line ends in the queue's **stamp**, ` g<stamp>` (the
///   server clock in µs and the first 8 digits of the owner id that began
///   it), which every rewrite moves onto the new first line: a queue
///   begun anew after a loss has another stamp. A line without the
///   stamp (a queue last written by the previous protocol, which drops
///   it with the first line) gets a new one at the next rewrite.
/// - **Each entry's life**, in `dlock:{T}:waiter:<owner id>`: `<ttl>
///   <holder record>` (the ttl the waiter's attempt asked for, in ms, and
///   [`crate::HolderInfo::encode`]'s record), then a line break and the
///   stamp of the queue its line is in (the previous protocol reads the
///   stamp as part of the record; a record read from an info key is cut
///   at the line break), with `PX` the entry's life.
///   A waiter's refresh sets this small key again and touches nothing
///   else (the queue's `PX` is stretched in place when it would die
///   first), so keeping n waiters alive costs the server O(1) per waiter
///   and second, not a rewrite of the whole queue each. An entry is live
///   exactly while its key exists: no clock is compared.
///
/// **Or a list**, for a backend with
/// [`list_queues`](crate::redis::RedisBuilder::list_queues): the same queue, the
/// same key, as a Redis list of owner ids in arrival order with the stamp
/// last, as its own element `g<stamp>`. A handoff pops the front (`LPOP`)
/// and a waiter joins by moving the stamp back behind it (`RPOP`, then
/// `RPUSH` of both), where a string is read and written whole at each, a
/// copy of every line made in Lua (whose strings Redis hashes byte by
/// byte as it makes them). Every script serves a queue of either kind,
/// which it tells by the type error (`WRONGTYPE`) a string command meets
/// on a list: the option only says what a queue this backend begins is.
/// A refresh reads the stamp with `LINDEX -1`, and only a refresh whose
/// stamp differs looks for its line (`LPOS`). Entry keys are the same.
///
/// The string queue needs only the commands a lock already needs (the
/// least-privilege ACL is unchanged): `GET`, `SET`, `DEL`, `PTTL`,
/// `PEXPIRE`, `INCR`, `TIME`, `PUBLISH`; a list, `LPUSH`, `RPUSH`, `LPOP`,
/// `RPOP`, `LINDEX`, `LPOS` and `LREM` besides. The entry keys of other waiters
/// are named from the queue's (`KEYS`) in the script: they share its hash
/// tag, so they live in its slot on a cluster, where a script may touch
/// any key of the slot it runs on.
///
/// The scripts never take the queue apart: they look at its first lines
/// (dead ones, which they drop, and the first live one), find an owner's
/// line with a plain search, and cut and join the rest as whole strings
/// (the copying is Redis's C). An entry that dies behind a live one stays
/// until it comes first, and is dropped then.
///
/// After `token_lua!`'s `server_time()` and `draw(fence, clock)`:
///
/// - `waiter(queue, owner)`: the name of `owner`'s entry key.
/// - `first_live(text, queue)`: the first live entry of a queue's text, as
///   `{owner, ttl, record, entry key, whether its line has the ` v`}`,
///   and the offsets where its line
///   starts and where the next one does (every line before it is dead);
///   `nil` and the queue's end when nobody live is first (a line of
///   another shape ends the queue).
/// - `write(queue, text, life, left)`: stores the queue's new text (`DEL`
///   when empty), keeping its `PX`, or stretching it to at least `life` ms
///   for an entry that was just written (from `left`, its `PTTL`, when the
///   caller read it already).
/// - `hand_over(entry, clock, lock, fence)`: gives the free key to
///   `entry` (see [`RELEASE_LUA`](super::RELEASE_LUA)) and deletes its entry key; the lease's
///   ms, or `nil` when the counter cannot rise (the key is then left free,
///   the entry kept).
/// - `stamp_of(text)`: the stamp a queue's text begins with, if any;
///   `stamped(text, stamp)` the text with its first line carrying it.
/// - `write(queue, text, life, left, from)` as above, stamping the text
///   with the stamp of `from` (the text it was made from), else its own,
///   else a new one; nothing is written when that is `from` itself.
///   Returns the text stored.
/// - `without(text, owner)`: the queue's text without `owner`'s line.
/// - `leave(queue, text, owner)`: removes `owner`'s line, if any.
///
/// Of a list queue:
///
/// - `is_list(reply)`: whether a string command's reply was the type error
///   a list gives it (another type gives the same: the list commands below
///   tell, and a key of another type, or a list this user may not read,
///   is served as before lists, as no queue).
/// - `list_stamp(queue)`: its stamp (its last element's, without the `g`),
///   and whether the queue is a list this user may read.
/// - `pop_live(queue)`: pops its front up to and including the first live
///   entry, returned as `first_live` returns it (`nil` when nobody live is
///   queued: the list is then gone; `nil, true` when the queue is not a
///   list or the ACL refuses `LPOP`); a list left with its stamp alone is
///   deleted, as an empty string queue is.
/// - `unpop(queue, entry)`: puts a popped entry back in front (a handoff
///   or a take that failed), the list living at least as long as it.
/// - `append(queue, owner, life, px)`: queues `owner` last (a new list,
///   with a new stamp, when there was none), the list living at least
///   `life` ms (`px`, the same as the argument's text);
///   returns the stamp, or `nil` and the refusal when the ACL refuses
///   `RPOP`. A new list sets the rejoin mark, as a new string queue does:
///   a waiter of an earlier dlock whose queue was lost reads the list as
///   a refused `GETRANGE` and looks for its line only while the mark
///   stands.
/// - `drop(queue, owner)`: removes `owner`'s element, and the list when
///   only its stamp is left (nothing, when the queue is not a list or the
///   ACL refuses `LREM`).
macro_rules! queue_lua {
    () => {
        concat!(
            token_lua!(),
            r"
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
  local told = redis.pcall('PUBLISH', string.sub(lock, 1, -5) .. 'handoff',
    entry[1] .. ' ' .. token .. ' ' .. px)
  return px, type(told) == 'table'
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
local function is_list(reply)
  return type(reply) == 'table' and type(reply.err) == 'string'
    and string.find(reply.err, 'WRONGTYPE', 1, true) == 1
end
local function list_stamp(queue)
  local last = redis.pcall('LINDEX', queue, '-1')
  if type(last) == 'table' then
    return nil, false
  end
  if last and string.byte(last, 1) == 103 then
    return string.sub(last, 2), true
  end
  return nil, true
end
local function pop_live(queue)
  while true do
    local owner = redis.pcall('LPOP', queue)
    if type(owner) == 'table' then
      return nil, true
    end
    if not owner then
      return nil
    end
    if #owner == 32 then
      local name = waiter(queue, owner)
      local entry = redis.pcall('GET', name)
      if type(entry) == 'string' then
        local ttl, record = string.match(entry, '^(%d+) ([^\n]*)')
        if ttl then
          local next = redis.pcall('LINDEX', queue, '0')
          if type(next) == 'string' and string.byte(next, 1) == 103 then
            redis.call('DEL', queue)
          end
          return {owner, ttl, record, name, true}
        end
      end
    elseif redis.pcall('LINDEX', queue, '0') == false then
      return nil
    end
  end
end
local function unpop(queue, entry)
  redis.call('LPUSH', queue, entry[1])
  local left = redis.call('PTTL', entry[4])
  if left > 0 and redis.call('PTTL', queue) < left then
    redis.call('PEXPIRE', queue, left)
  end
end
local function append(queue, owner, life, px)
  local last = redis.pcall('RPOP', queue)
  if type(last) == 'table' then
    return nil, last.err
  end
  local stamp = last
  if not last or string.byte(last, 1) ~= 103 then
    if last then
      redis.call('RPUSH', queue, last)
    else
      redis.call('SET', string.sub(queue, 1, -6) .. 'rejoin', '1', 'PX', px)
    end
    stamp = 'g' .. server_time() .. string.sub(owner, 1, 8)
  end
  redis.call('RPUSH', queue, owner, stamp)
  if redis.call('PTTL', queue) < life then
    redis.call('PEXPIRE', queue, px)
  end
  return string.sub(stamp, 2)
end
local function drop(queue, owner)
  if redis.pcall('LREM', queue, '1', owner) == 1 then
    local first = redis.pcall('LINDEX', queue, '0')
    if type(first) == 'string' and string.byte(first, 1) == 103 then
      redis.call('DEL', queue)
    end
  end
end
"
        )
    };
}

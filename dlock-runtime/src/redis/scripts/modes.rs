//! The scripts of shared locks and permits (rules M1 to M5 on `Backend`),
//! and the Lua functions they share. The token draw they share with the
//! exclusive scripts (`token_lua!`) comes from the parent module.

use std::sync::LazyLock;

use ::redis::Script;

/// The Lua functions of shared locks and permits, shared by their scripts.
///
/// A read phase or a set of permits holds the lock key too, with a
/// *sentinel* value of the lock's shape (32 hex digits and the waiter
/// mark): `READ_PHASE` (`0…0`, 32 zeros) while readers hold, `PERMITS`
/// (`0…01`) while permits do, with a `PX` no shorter than its
/// longest-lived holder's. So an exclusive attempt, of this dlock or an
/// older one, finds the key held and marks the sentinel `+` as it marks
/// any holder's value, and a release of the last reader or of a permit
/// publishes exactly when someone may wait. Owner ids are random 128-bit
/// values, so no owner's value is a sentinel. The holders themselves sit
/// in a hash beside it, read only while the sentinel stands (so a force
/// release, which deletes the lock key, ends them all at once):
///
/// - `dlock:{T}:phase`, the read phase: its token and, while it has one
///   reader, that reader's owner id (its expiry the key's own); with more,
///   `dlock:{T}:readers`, owner id → expiry;
/// - `dlock:{T}:slots`: slot → `<expiry ms> <owner id>`.
///
/// Expiries are the server's clock (`TIME`), never a client's; the dead
/// entries a script meets are pruned by it.
///
/// - `now_ms()`: the server clock in ms; `ms_of(time)` the same of a
///   `TIME` reply the script has (one `TIME` serves a script that also
///   draws a token); `ms(value)` an expiry written as the integer it is
///   (`tostring` would write a huge one in exponent form, which reads
///   back as a small number), at most 2^62 (an entry an operator wrote may
///   hold any expiry, and `%d` writes one of 2^63 or more as a negative
///   number: a `PEXPIRE` by it would delete the holders' keys).
/// - `live(hash, now, all)`: the live entries of a holders' hash, field →
///   value (its leading number is the expiry), the dead ones deleted; a
///   value of another type reads as none. `all`, if given, is the hash's
///   `HGETALL` the script already read.
/// - `last(entries)`: the latest expiry among `entries`, 0 for none.
/// - `stretch(names, left)`: sets every key of `names` to expire in `left`
///   ms (the sentinel, the hash, the phase key; written as an integer, as
///   `ms` writes one): they live exactly as
///   long as the longest-lived holder.
/// - `mark_waited(lock, held)`: marks a held value of the lock's shape `+`
///   (its release then publishes); the refusal, if the server refused it.
/// - `refused(lock, held)`: the answer to an attempt refused by `held`:
///   the lock's `PTTL`, with the refusal to mark it if any.
/// - `reading(held)`, `permitted(held)`: whether `held` is the read
///   phase's or the permits' sentinel.
/// - `phase_of(phase)`: the phase key's token and, if the phase has one
///   reader, its owner id and the ms it has left (the key's `PTTL`: `nil`
///   if the key has no expiry); `nil` for a missing or foreign value.
macro_rules! modes_lua {
    () => {
        r"
local READ_PHASE = '00000000000000000000000000000000'
local PERMITS = '00000000000000000000000000000001'
local function ms_of(now)
  return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end
-- 2^62 ms, some 146 million years: the longest expiry `ms` writes. An
-- operator-written entry's expiry may be any number; `%d` would write one
-- of 2^63 or more as a negative one, and a negative `PEXPIRE` deletes the
-- key.
local LONGEST_MS = 4611686018427387904
local function ms(value)
  return string.format('%d', math.min(value, LONGEST_MS))
end
local function now_ms()
  return ms_of(redis.call('TIME'))
end
local function live(hash, now, all)
  all = all or redis.pcall('HGETALL', hash)
  local entries, dead = {}, {}
  if type(all) ~= 'table' or all.err then
    return entries
  end
  for i = 1, #all, 2 do
    local expiry = tonumber(string.match(all[i + 1], '^%d+') or '')
    if expiry and expiry > now then
      entries[all[i]] = all[i + 1]
    else
      dead[#dead + 1] = all[i]
    end
  end
  if #dead > 0 then
    redis.call('HDEL', hash, unpack(dead))
  end
  return entries
end
local function last(entries)
  local latest = 0
  for _, value in pairs(entries) do
    latest = math.max(latest, tonumber(string.match(value, '^%d+')))
  end
  return latest
end
local function stretch(names, left)
  for _, name in ipairs(names) do
    redis.call('PEXPIRE', name, ms(math.max(left, 1)))
  end
end
local function mark_waited(lock, held)
  if select(2, string.find(held, '^%x+%-')) == 33 and (#held == 33 or string.find(held, '^ %d+ %d+ ', 34)) then
    local marked = redis.pcall('SETRANGE', lock, 32, '+')
    if type(marked) == 'table' then
      return marked.err
    end
  end
  return nil
end
local function refused(lock, held)
  local ttl = redis.call('PTTL', lock)
  if type(held) == 'string' then
    local refusal = mark_waited(lock, held)
    if refusal then
      return {ttl, refusal}
    end
  end
  return ttl
end
local function reading(held)
  return type(held) == 'string' and #held == 33 and string.sub(held, 1, 32) == READ_PHASE
end
local function permitted(held)
  return type(held) == 'string' and #held == 33 and string.sub(held, 1, 32) == PERMITS
end
local function phase_of(phase)
  local value = redis.pcall('GET', phase)
  if type(value) ~= 'string' then
    return nil
  end
  local token, lone = string.match(value, '^(%d+) (%x+)$')
  if not token then
    return string.match(value, '^(%d+)$')
  end
  local left = redis.call('PTTL', phase)
  if left <= 0 then
    return token, lone, nil
  end
  return token, lone, left
end
"
    };
}

/// A shared attempt ([`crate::backend::Access::Shared`]). `KEYS[1]` lock
/// key, `KEYS[2]` fence key, `KEYS[3]` readers' hash, `KEYS[4]` the
/// writer-waiting mark, `KEYS[5]` the phase key; `ARGV[1]` the owner id
/// (32 hex digits), `ARGV[2]` ttl in ms, `ARGV[3]` the waiter mark to take
/// the key with (`-` or `+`, as for [`ACQUIRE_LUA`](super::ACQUIRE_LUA)). Answers as
/// [`ACQUIRE_LUA`](super::ACQUIRE_LUA) does: the token as a bulk string, or the ms to look
/// again in (with the refusal to mark the holder, if any).
///
/// The phase key is the read phase: `<token> <owner>` while its first
/// reader is its only one (no hash is written; the key's `PX` is that
/// reader's expiry), `<token>` once a second reader joined, the readers
/// then in the hash (owner → expiry).
///
/// - No phase (the key free): refused while a live writer-waiting mark
///   stands (rule M3: the mark flagged `+`, so the writer takes the key
///   marked and its release publishes); else a new phase, its token drawn
///   as [`ACQUIRE_LUA`](super::ACQUIRE_LUA) draws one (the counter advanced, floored at the
///   server clock, so above every token before, across a lost counter
///   too), kept in the phase key with the caller as its one reader. This
///   path runs before the helpers are defined: it is the common one, and
///   it costs what an exclusive attempt does.
/// - An exclusive holder or permits hold the key: refused, the holder's
///   value marked `+` so its release wakes the caller.
/// - A live read phase: a reader of it retrying (rule M5) is granted the
///   phase token with its expiry renewed; anyone else joins it with the
///   phase token, unless a live writer-waiting mark stands (refused until
///   the mark's expiry, the mark flagged). The second reader moves the
///   first into the hash beside it (any hash already there is left from a
///   lost phase, and goes).
/// - A *lost* phase: the sentinel stands but its phase key is gone (an
///   operator's `DEL`, eviction under `maxmemory`) or lost its expiry (a
///   `PERSIST`), or no reader of it is live. Refused until the sentinel's `PTTL`, the sentinel marked `+`
///   (so the last reader's release wakes the caller), and nothing written
///   else: no new token is drawn and no live reader's entry deleted. The
///   readers the sentinel stands for may still believe they hold with the
///   phase's token, so a new phase's higher token would make a `>=` fence
///   refuse them, and, once it ended, let a writer in beside them. A lost
///   phase ends by the sentinel's expiry, which is its longest-lived
///   reader's; its readers are told they lost at their next renewal
///   ([`SHARED_EXTEND_LUA`] answers 0).
///
/// Why one atomic step: the sentinel, the readers and the mark are read
/// and written together, so no writer takes the key between a reader's
/// check and its join, and two first readers never draw two phase tokens.
pub(in crate::redis) const SHARED_ACQUIRE_LUA: &str = concat!(
    token_lua!(),
    r"
local owner = ARGV[1]
local function writer_waits()
  local mark = redis.pcall('GET', KEYS[4])
  if type(mark) ~= 'string' then
    return false
  end
  if string.byte(mark, -1) == 45 then
    redis.pcall('SETRANGE', KEYS[4], 32, '+')
  end
  return true
end
if redis.call('SET', KEYS[1], '00000000000000000000000000000000' .. ARGV[3], 'NX', 'PX', ARGV[2]) then
  -- The key was free: a new phase, unless a writer waits for the key.
  if writer_waits() then
    redis.call('DEL', KEYS[1])
    return redis.call('PTTL', KEYS[4])
  end
  local time = redis.call('TIME')
  local token = draw(KEYS[2], clock_of(time))
  if not token then
    redis.call('DEL', KEYS[1])
    return redis.error_reply('ERR the fencing counter ' .. KEYS[2] .. ' cannot rise')
  end
  redis.call('SET', KEYS[5], token .. ' ' .. owner, 'PX', ARGV[2])
  return token
end
local ttl = tonumber(ARGV[2])
",
    modes_lua!(),
    r"
local held = redis.pcall('GET', KEYS[1])
if not reading(held) then
  return refused(KEYS[1], held)
end
local now = now_ms()
local token, lone, left = phase_of(KEYS[5])
if not token or (lone and not left) then
  return refused(KEYS[1], held)
end
local function granted()
  if ARGV[3] == '+' then
    redis.pcall('SETRANGE', KEYS[1], 32, '+')
  end
  return token
end
if lone == owner then
  redis.call('SET', KEYS[5], token .. ' ' .. owner, 'PX', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return granted()
end
if lone then
  if writer_waits() then
    return redis.call('PTTL', KEYS[4])
  end
  -- The first reader lives as long as the sentinel does if that is
  -- longer: an operator who cut the phase key's ttl cut no lease. A
  -- sentinel without an expiry (an operator's PERSIST) tells none: the
  -- phase reads as lost, as a phase key without one does.
  local sentinel = redis.call('PTTL', KEYS[1])
  if sentinel <= 0 then
    return refused(KEYS[1], held)
  end
  left = math.max(left, sentinel)
  redis.call('DEL', KEYS[3])
  redis.call('HSET', KEYS[3], lone, ms(now + left), owner, ms(now + ttl))
  redis.call('SET', KEYS[5], token)
  stretch({KEYS[1], KEYS[3], KEYS[5]}, math.max(left, ttl))
  return granted()
end
local readers = live(KEYS[3], now)
if not next(readers) then
  return refused(KEYS[1], held)
end
if not readers[owner] and writer_waits() then
  return redis.call('PTTL', KEYS[4])
end
readers[owner] = ms(now + ttl)
redis.call('HSET', KEYS[3], owner, readers[owner])
stretch({KEYS[1], KEYS[3], KEYS[5]}, last(readers) - now)
return granted()
"
);

/// Renews a reader. `KEYS[1]` lock key, `KEYS[2]` readers' hash, `KEYS[3]`
/// phase key; `ARGV[1]` owner id, `ARGV[2]` ttl in ms. Returns 1 if
/// renewed, 0 if the caller holds no live share of the phase: a reader
/// whose entry is gone (the phase key or the hash deleted or evicted)
/// learns it lost, and is never written back.
///
/// Why one atomic step: checked apart, the reader's share could run out,
/// the phase end and a writer take the key between the check and the
/// write, which would then revive a share beside the writer.
pub(in crate::redis) const SHARED_EXTEND_LUA: &str = concat!(
    modes_lua!(),
    r"
if not reading(redis.pcall('GET', KEYS[1])) then
  return 0
end
local token, lone, left = phase_of(KEYS[3])
if not token then
  return 0
end
if lone then
  if lone ~= ARGV[1] or not left then
    return 0
  end
  redis.call('SET', KEYS[3], token .. ' ' .. lone, 'PX', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
local now = now_ms()
local readers = live(KEYS[2], now)
if not readers[ARGV[1]] then
  return 0
end
readers[ARGV[1]] = ms(now + tonumber(ARGV[2]))
redis.call('HSET', KEYS[2], ARGV[1], readers[ARGV[1]])
stretch({KEYS[1], KEYS[2], KEYS[3]}, last(readers) - now)
return 1
"
);

/// Releases a reader. `KEYS[1]` lock key, `KEYS[2]` readers' hash,
/// `KEYS[3]` phase key; `ARGV[1]` owner id. Returns 1 if released (2 if its
/// announcement was refused, see `RELEASE_LUA`), 0 if
/// the caller held no live share (its entry gone with a lost phase key, or
/// past its expiry). The last reader's release ends the phase (the
/// sentinel, the hash and the phase key deleted) and, when the sentinel is
/// marked `+` (a writer, or a waiter, found the phase), publishes on the
/// release channel (the lock key with `lock` replaced by `released`); an
/// earlier reader's cuts the sentinel's life to the longest-lived reader
/// left. The release of a phase's one reader runs before the helpers are
/// defined, as the first reader's attempt does.
///
/// Why one atomic step: the phase ends, and the release is announced,
/// exactly when the last share goes, so a waiting writer neither misses
/// it nor is woken while a reader holds.
pub(in crate::redis) const SHARED_RELEASE_LUA: &str = concat!(
    r"
local held = redis.pcall('GET', KEYS[1])
if not (type(held) == 'string' and #held == 33
    and string.sub(held, 1, 32) == '00000000000000000000000000000000') then
  return 0
end
local phase = redis.pcall('GET', KEYS[3])
if type(phase) ~= 'string' then
  return 0
end
local function ended()
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
  if string.byte(held, -1) == 43 and type(redis.pcall('PUBLISH',
      string.sub(KEYS[1], 1, -5) .. 'released', 'released')) == 'table' then
    return 2
  end
  return 1
end
if string.find(phase, ' ', 1, true) then
  -- The phase's one reader: the phase ends with it, if it is live (its
  -- expiry is the phase key's: one an operator took away is not).
  if string.sub(phase, -33) == ' ' .. ARGV[1] and redis.call('PTTL', KEYS[3]) > 0 then
    return ended()
  end
  return 0
end
",
    modes_lua!(),
    r"
local now = now_ms()
local readers = live(KEYS[2], now)
if not readers[ARGV[1]] then
  return 0
end
readers[ARGV[1]] = nil
if next(readers) then
  redis.call('HDEL', KEYS[2], ARGV[1])
  stretch({KEYS[1], KEYS[2], KEYS[3]}, last(readers) - now)
  return 1
end
return ended()
"
);

/// A permit attempt ([`crate::backend::Access::Permits`]). `KEYS[1]` lock
/// key, `KEYS[2]` fence key, `KEYS[3]` the slots' hash; `ARGV[1]` owner id,
/// `ARGV[2]` ttl in ms, `ARGV[3]` the waiter mark to take the key with,
/// `ARGV[4]` the number of permits. Returns `{token, slot, free}` when
/// the caller holds a slot of `0..permits` (`free`: how many slots are
/// still free; none tells the caller's process that every permit is
/// taken), else the ms until the soonest slot
/// runs out (or the exclusive or shared holder's `PTTL`), with the
/// refusal to mark the sentinel if any.
///
/// The step costs what the key's holders cost, never what its permits
/// would: it walks the live entries of the hash, not the slots, so a
/// count of `u32::MAX` blocks the server no longer than a count of 2 (a
/// Lua loop over the slots would run for minutes, the server answering
/// every other client `BUSY`, past the reach of `SCRIPT KILL` once the
/// script pruned a dead entry). The caller's own live slot is granted
/// again (a retry, rule M5), else the lowest slot no entry names: the
/// walk up from 0 stops at the first gap, so it steps over at most the
/// entries there are. A grant draws a token anew as [`ACQUIRE_LUA`](super::ACQUIRE_LUA) draws
/// one (so a slot's tokens rise, across a lost counter too), writes
/// `<expiry> <owner id>` to the slot and keeps the sentinel alive as long
/// as the longest-lived permit. A full set marks the sentinel `+`, so the
/// next permit's release publishes.
///
/// *Lost* permits: the sentinel stands but no slot of it is live (the
/// hash deleted or evicted, or of another type). Refused until the
/// sentinel's `PTTL`, the sentinel marked `+`, and nothing written but
/// the dead entries pruned, as a lost read phase is ([`SHARED_ACQUIRE_LUA`]): the holders the
/// sentinel stands for may still believe they hold, so a grant now would
/// put more than `permits` holders on the key. The sentinel lives as long
/// as its longest-lived holder; the holders are told they lost at their
/// next renewal ([`PERMIT_EXTEND_LUA`] answers 0).
///
/// Why one atomic step: two attempts that read the slots apart could both
/// find the same slot free and both take it.
pub(in crate::redis) const PERMIT_ACQUIRE_LUA: &str = concat!(
    token_lua!(),
    modes_lua!(),
    r"
local owner, ttl, permits = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4])
local held = redis.pcall('GET', KEYS[1])
if held and not permitted(held) then
  return refused(KEYS[1], held)
end
local time = redis.call('TIME')
local now = ms_of(time)
local slots = {}
if held then
  slots = live(KEYS[3], now)
  if not next(slots) then
    return refused(KEYS[1], held)
  end
end
-- The slots of `0..permits` the live entries name (a caller with another
-- count may have written others), and the caller's own among them.
local function counted(field)
  local slot = tonumber(string.match(field, '^%d+$') or '')
  return slot and slot < permits and ms(slot) == field
end
local taken, used = nil, 0
for field, value in pairs(slots) do
  if counted(field) then
    used = used + 1
    if not taken and string.sub(value, -32) == owner then
      taken = tonumber(field)
    end
  end
end
if not taken then
  local slot = 0
  while slots[ms(slot)] do
    slot = slot + 1
  end
  if slot < permits then
    taken = slot
    used = used + 1
  end
end
if not taken then
  local soonest
  for field, value in pairs(slots) do
    if counted(field) then
      local expiry = tonumber(string.match(value, '^%d+'))
      soonest = math.min(soonest or expiry, expiry)
    end
  end
  local refusal = mark_waited(KEYS[1], held)
  if refusal then
    return {soonest - now, refusal}
  end
  return soonest - now
end
local token = draw(KEYS[2], clock_of(time))
if not token then
  return redis.error_reply('ERR the fencing counter ' .. KEYS[2] .. ' cannot rise')
end
slots[ms(taken)] = ms(now + ttl) .. ' ' .. owner
if held then
  redis.call('HSET', KEYS[3], ms(taken), slots[ms(taken)])
  stretch({KEYS[1], KEYS[3]}, last(slots) - now)
  if ARGV[3] == '+' then
    redis.pcall('SETRANGE', KEYS[1], 32, '+')
  end
else
  -- The slot first: a refused HSET (an ACL without it) must fail the
  -- attempt before the lock key is taken, not after.
  redis.call('DEL', KEYS[3])
  redis.call('HSET', KEYS[3], ms(taken), slots[ms(taken)])
  redis.call('SET', KEYS[1], PERMITS .. ARGV[3], 'PX', ARGV[2])
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
end
return {token, taken, permits - used}
"
);

/// The Lua that finds an owner's permit: `held_slot(slots, owner, slot)`,
/// the field of `owner`'s live slot among `slots` (`live`'s answer): the
/// one named by `slot` if `owner` holds it, or with `slot` empty (an
/// attempt abandoned before its answer) whichever `owner` holds; `nil`.
macro_rules! held_slot_lua {
    () => {
        r"
local function held_slot(slots, owner, slot)
  if slot ~= '' then
    local value = slots[slot]
    if value and string.sub(value, -32) == owner then
      return slot
    end
    return nil
  end
  for field, value in pairs(slots) do
    if string.sub(value, -32) == owner then
      return field
    end
  end
  return nil
end
"
    };
}

/// Renews a permit. `KEYS[1]` lock key, `KEYS[2]` slots' hash; `ARGV[1]`
/// owner id, `ARGV[2]` ttl in ms, `ARGV[3]` the slot (empty: the owner's,
/// whichever). Returns 1 if renewed, 0 if the caller holds no such live
/// slot.
///
/// Why one atomic step: checked apart, the slot could run out and be taken
/// by another between the check and the write, which would then stretch
/// the new holder's slot on the old holder's say-so.
pub(in crate::redis) const PERMIT_EXTEND_LUA: &str = concat!(
    modes_lua!(),
    held_slot_lua!(),
    r"
if not permitted(redis.pcall('GET', KEYS[1])) then
  return 0
end
local now = now_ms()
local slots = live(KEYS[2], now)
local slot = held_slot(slots, ARGV[1], ARGV[3])
if not slot then
  return 0
end
slots[slot] = ms(now + tonumber(ARGV[2])) .. ' ' .. ARGV[1]
redis.call('HSET', KEYS[2], slot, slots[slot])
stretch({KEYS[1], KEYS[2]}, last(slots) - now)
return 1
"
);

/// Releases a permit. `KEYS[1]` lock key, `KEYS[2]` slots' hash;
/// `ARGV[1]` owner id, `ARGV[2]` the slot (empty: the owner's, whichever).
/// Returns 1 if released (2 if its announcement was refused, see
/// `RELEASE_LUA`), 0 if the caller held no such live slot. The
/// last permit's release deletes the sentinel and the hash; each release
/// publishes on the release channel when the sentinel is marked `+` (an
/// attempt found the permits taken).
///
/// Why one atomic step: the owner check and the freeing must not be split
/// (a slot that ran out and was taken again must stay its new holder's),
/// and the announcement goes out for exactly the slot freed.
pub(in crate::redis) const PERMIT_RELEASE_LUA: &str = concat!(
    modes_lua!(),
    held_slot_lua!(),
    r"
local held = redis.pcall('GET', KEYS[1])
if not permitted(held) then
  return 0
end
local now = now_ms()
local slots = live(KEYS[2], now)
local slot = held_slot(slots, ARGV[1], ARGV[2])
if not slot then
  return 0
end
redis.call('HDEL', KEYS[2], slot)
slots[slot] = nil
if next(slots) then
  stretch({KEYS[1], KEYS[2]}, last(slots) - now)
else
  redis.call('DEL', KEYS[1], KEYS[2])
end
if string.byte(held, -1) == 43 and type(redis.pcall('PUBLISH',
    string.sub(KEYS[1], 1, -5) .. 'released', 'released')) == 'table' then
  return 2
end
return 1
"
);

pub(in crate::redis) static SHARED_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(SHARED_ACQUIRE_LUA));
pub(in crate::redis) static SHARED_EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(SHARED_EXTEND_LUA));
pub(in crate::redis) static SHARED_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(SHARED_RELEASE_LUA));
pub(in crate::redis) static PERMIT_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(PERMIT_ACQUIRE_LUA));
pub(in crate::redis) static PERMIT_EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(PERMIT_EXTEND_LUA));
pub(in crate::redis) static PERMIT_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(PERMIT_RELEASE_LUA));

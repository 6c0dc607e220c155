//! The fair acquire script (rules F1 to F3 on `Backend`). Its queue's Lua
//! functions (`queue_lua!`) and the exclusive acquire it extends
//! (`acquire_lua!`) come from the parent module, which the release shares.

use std::sync::LazyLock;

use ::redis::Script;

/// A fair attempt ([`crate::backend::Queue::Respect`] or
/// [`crate::backend::Queue::Join`]): [`ACQUIRE_LUA`](super::ACQUIRE_LUA) with the key's queue
/// of fair waiters in front. `KEYS[1]`, `KEYS[2]` and `ARGV[1]` to
/// `ARGV[3]` as for [`ACQUIRE_LUA`](super::ACQUIRE_LUA), `KEYS[3]` the queue and `KEYS[4]`
/// the caller's entry key (see `queue_lua!`); `ARGV[4]` the entry's life
/// in ms for a `Join`, empty for a `Respect`, `b` for a `Barge` by an
/// owner that may be queued (below; with an identity, `KEYS[5]` its record
/// and `ARGV[7]` the identity), `ARGV[5]` `w` when the
/// caller waits (else empty), `ARGV[6]` `l` when a queue this attempt
/// begins is to be a list (else empty). Answers as [`ACQUIRE_LUA`](super::ACQUIRE_LUA) does, and `-1` (held, no
/// known expiry) when the key is free but a live entry that is not the
/// caller's comes first.
///
/// - The key is free and the first live entry is the caller's (a `Join`),
///   or nobody live is queued: it is taken as [`ACQUIRE_LUA`](super::ACQUIRE_LUA) takes it,
///   and the caller's entry and the dead ones in front of it are dropped. Live
///   entries left behind mark the new value `+`, so its release hands on.
/// - The key is free and someone else's live entry comes first (its
///   holder's lease ran out, or a plain holder released it unmarked): the
///   key is handed to that entry, as a release would ([`RELEASE_LUA`](super::RELEASE_LUA)),
///   rather than left idle until its waiter looks again; the caller is
///   answered held, for that lease's ms. A `Join` then keeps or takes its
///   place.
/// - Someone holds it: [`ACQUIRE_LUA`](super::ACQUIRE_LUA) answers (and marks the value `+`),
///   and a `Join` keeps its place in the queue, with its entry's life
///   renewed, or joins at the end; its entry records the ttl it asks for
///   and its holder record, for a handoff. A `Respect` joins nothing.
///   The renewal, what a waiter sends every second, is one `SET … PX …
///   GET` of the caller's own entry key, which says it was alive, a
///   `PTTL` of the queue (a `PEXPIRE` too when the queue would die before
///   the entry) and a `GET` of the key's rejoin mark (below): the queue
///   is neither read nor written, whatever its length. Only an entry key
///   found gone (a first `Join`, or an entry that died) reads the queue,
///   drops the owner's old line and appends one at the end.
/// - **A lost queue.** An entry key that lives on while its line is gone
///   means the queue was lost (deleted by an operator, evicted): the
///   order is not recoverable, so the waiter joins again at the end. The
///   refresh tells a lost queue by its **stamp**: it reads the queue's
///   first line (`GETRANGE`, a bounded prefix, whatever the queue's
///   length) and compares its stamp with the one its entry recorded; a
///   stamp that differs (a queue begun anew, by a newcomer or by another
///   waiter of the lost one) or is missing sends it to read the whole
///   queue and look for its line, and its entry then records the stamp of
///   the queue it is in. No other key is involved, so no second deletion
///   can hide the loss. With an ACL that refuses `GETRANGE`, the answer
///   carries the refusal (the caller warns once) and the refresh falls
///   back on the rejoin mark, `dlock:{T}:rejoin`, set for an entry's life
///   by a waiter that found its line gone and by a `Join` that begins a
///   queue: while it stands, or when the queue is gone (`PTTL` -2), the
///   refresh reads the queue and looks for its line.
/// - The caller holds it (rule 3, a retry): [`ACQUIRE_LUA`](super::ACQUIRE_LUA) answers, and
///   an entry of the caller's, if any, is dropped (the queue is read only
///   if there was one).
/// - **A `Barge` by a queued owner** (`b`): a caller may queue an owner
///   with a `Join` and then try it without the queue. It is answered as
///   [`ACQUIRE_LUA`](super::ACQUIRE_LUA) answers, whoever waits, and a
///   grant drops its entry and line as a retry's does: a grant takes its
///   owner out of the queue whatever its mode, or a later release would
///   hand the key to the line of an owner whose acquisition is over. A
///   queue left behind (a `GET` that finds anything there: the least
///   privilege ACL has no `EXISTS`) marks the new value `+`, so its
///   release hands on. A grant with an identity records it and announces
///   the acquisition as `ACQUIRE_AS_LUA` does. The backend sends it only
///   for an owner it queued (a plain attempt never pays for the queue).
///
/// - **A list queue** (see `queue_lua!`) keeps the same rules: a free key
///   pops the list's front up to its first live entry, which takes it or
///   is handed it; a `Join` keeps its place while its entry's stamp is
///   the list's (one `LINDEX`), or, when it differs, while `LPOS` finds
///   its line, and otherwise appends itself (a new entry first drops a
///   line of its owner's that died, with `LREM`); a retry by the holder
///   drops its element. A `Join` that would begin a queue as a list while
///   the ACL refuses `RPOP` begins a string instead, and its answer
///   carries the refusal (`{ms, refusal, 'list'}`, the caller warns
///   once). A queue that is not a list this user may read (the ACL
///   refuses `LINDEX`, or the key is of another type) is served as before
///   lists, and the answer says so the same way.
///
/// Why one atomic step: the queue is read and the key taken together, so
/// no attempt takes the key past a waiter that queued before it, and a
/// release that hands over never races a `Join`.
pub(in crate::redis) const FAIR_ACQUIRE_LUA: &str = concat!(
    "local function take(prefetched)\n",
    acquire_lua!("ARGV[5] == 'w'", "prefetched"),
    "end\n",
    queue_lua!(),
    r"
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
local function in_list(stamp, old, listed)
  if listed and type(old) == 'string' and (stamp and string.match(old, '\n(%w*)$') == stamp
      or redis.call('LPOS', KEYS[3], owner)) then
    if redis.call('PTTL', KEYS[3]) < life then
      redis.call('PEXPIRE', KEYS[3], ARGV[4])
    end
    return nil
  end
  if listed and type(old) ~= 'string' then
    redis.call('LREM', KEYS[3], '1', owner)
  end
  local now, refused = append(KEYS[3], owner, life, ARGV[4])
  if not now then
    return refused
  end
  if now ~= stamp then
    refresh(now)
  end
end
local function join_list()
  local stamp, listed = list_stamp(KEYS[3])
  if not listed then
    return nil, true
  end
  local refused = in_list(stamp, refresh(stamp), true)
  if refused then
    return redis.error_reply('ERR a fair waiter could not queue in the list ' .. KEYS[3] .. ': ' .. refused)
  end
end
local held = redis.pcall('GET', KEYS[1])
if not held and ARGV[4] ~= 'b' then
  local text = redis.pcall('GET', KEYS[3])
  local listed, entry, foreign = is_list(text)
  if listed then
    entry, foreign = pop_live(KEYS[3])
  end
  if listed and not foreign then
    if entry and (not life or entry[1] ~= owner) then
      local handed = hand_over(entry, server_time(), KEYS[1], KEYS[2])
      if not handed then
        unpop(KEYS[3], entry)
      end
      local refused = life and join_list()
      if refused then
        return refused
      end
      return handed and tonumber(handed) or -1
    end
    local reply = take(false)
    if type(reply) == 'string' then
      redis.call('DEL', KEYS[4])
      local first = redis.pcall('LINDEX', KEYS[3], '0')
      if type(first) == 'string' and #first == 32 then
        redis.pcall('SETRANGE', KEYS[1], '32', '+')
      end
    elseif entry then
      unpop(KEYS[3], entry)
    end
    return reply
  end
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
      redis.pcall('SETRANGE', KEYS[1], '32', '+')
    end
  end
  return reply
end
local reply = take(held)
if type(reply) == 'string' then
  if redis.call('DEL', KEYS[4]) == 1 then
    local text = redis.pcall('GET', KEYS[3])
    if is_list(text) then
      drop(KEYS[3], owner)
    elseif type(text) == 'string' and text ~= '' then
      leave(KEYS[3], text, owner)
    end
  end
  if ARGV[4] == 'b' then
    if redis.pcall('GET', KEYS[3]) then
      redis.pcall('SETRANGE', KEYS[1], '32', '+')
    end
    if ARGV[7] then
",
    identity_lua!("KEYS[5]", "ARGV[7]"),
    r"    end
  end
elseif life and not (type(reply) == 'table' and reply.err) then
  local head = redis.pcall('GETRANGE', KEYS[3], '0', '127')
  local refused, foreign
  if is_list(head) then
    refused, foreign = join_list()
    if refused then
      return refused
    end
    if not foreign then
      return reply
    end
  end
  local unlisted
  if head == '' and ARGV[6] == 'l' then
    unlisted = in_list(nil, refresh(nil), false)
    if not unlisted then
      return reply
    end
    if string.find(unlisted, 'WRONGTYPE', 1, true) == 1 then
      unlisted = nil
    end
  end
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
      redis.call('PEXPIRE', KEYS[3], ARGV[4])
    end
  else
    local text = redis.pcall('GET', KEYS[3])
    if type(text) ~= 'string' then
      text = ''
    end
    settle(write(KEYS[3], enter(text, old), life, left, text), stamp)
  end
  if type(head) == 'table' and type(reply) == 'number' then
    if is_list(head) then
      return {reply, head.err, 'list'}
    end
    return {reply, head.err, 'getrange'}
  end
  if unlisted and type(reply) == 'number' then
    return {reply, unlisted, 'list'}
  end
end
return reply
"
);

pub(in crate::redis) static FAIR_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(FAIR_ACQUIRE_LUA));

//! The Lua scripts the Redis backend sends. Every step that reads and then
//! writes runs as one script, because Redis runs a script atomically: no
//! other client's command lands between its reads and its writes.
//!
//! Keys always travel as `KEYS`, owner ids, ttls and channel names as
//! `ARGV`; nothing a user supplies is ever spliced into the Lua text.
//! `redis.pcall('GET', …)` is used where a foreign value of another type may
//! sit under a lock key: a type error then reads as "not the owner" instead
//! of failing the script.

use std::sync::LazyLock;

use ::redis::Script;

/// [`ACQUIRE_LUA`]'s text, as a literal that `concat!` can build on.
///
/// `$waits`: the Lua expression that says whether the caller waits (rule
/// M3: only a waiting writer leaves a writer-waiting mark), read from the
/// argument each script keeps for it.
macro_rules! acquire_lua {
    ($waits:literal) => {
        concat!(
            "local waits = ",
            $waits,
            "\n",
            r"
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
"
        )
    };
}

/// The Lua functions that draw a fencing token, shared by every script
/// that grants a key (exclusive, fair, shared, permit):
///
/// - `server_time()`: the server clock as the µs text tokens are drawn
///   from; `clock_of(time)` the same of a `TIME` reply the script has.
/// - `draw(fence, clock)`: a token exactly as [`ACQUIRE_LUA`] draws one
///   (the fast path when the clock is above the last token, else `INCR`
///   with the clock as its floor); `nil` when the counter cannot rise.
macro_rules! token_lua {
    () => {
        r"
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
"
    };
}

/// The Lua functions of fair mode's queue, shared by [`RELEASE_LUA`] and
/// `FAIR_ACQUIRE_LUA`. A key's queue keeps two things apart:
///
/// - **The order**, in `dlock:{T}:queue`: a string of one line per waiter,
///   in arrival order, its owner id's 32 hex digits and `\n` (a line of an
///   earlier shape, with more after the owner id, reads the same way).
///   Written only when someone joins, leaves, or is handed the key or
///   found dead at the front; its `PX` is never shorter than its
///   longest-lived entry's, so an abandoned queue goes away by itself.
/// - **Each entry's life**, in `dlock:{T}:waiter:<owner id>`: `<ttl>
///   <holder record>` (the ttl the waiter's attempt asked for, in ms, and
///   [`crate::HolderInfo::encode`]'s record), with `PX` the entry's life.
///   A waiter's refresh sets this small key again and touches nothing
///   else (the queue's `PX` is stretched in place when it would die
///   first), so keeping n waiters alive costs the server O(1) per waiter
///   and second, not a rewrite of the whole queue each. An entry is live
///   exactly while its key exists: no clock is compared.
///
/// Strings only, so the commands are the ones a lock already needs (the
/// least-privilege ACL is unchanged): `GET`, `SET`, `DEL`, `PTTL`,
/// `PEXPIRE`, `INCR`, `TIME`, `PUBLISH`. The entry keys of other waiters
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
///   `{owner, ttl, record, entry key}`, and the offsets where its line
///   starts and where the next one does (every line before it is dead);
///   `nil` and the queue's end when nobody live is first (a line of
///   another shape ends the queue).
/// - `write(queue, text, life)`: stores the queue's new text (`DEL` when
///   empty), keeping its `PX`, or stretching it to at least `life` ms for
///   an entry that was just written.
/// - `hand_over(entry, clock, lock, fence, info)`: gives the free key to
///   `entry` (see [`RELEASE_LUA`]) and deletes its entry key; the lease's
///   ms, or `nil` when the counter cannot rise (the key is then left free,
///   the entry kept).
/// - `without(text, owner)`: the queue's text without `owner`'s line.
/// - `leave(queue, text, owner)`: removes `owner`'s line, if any.
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
"
        )
    };
}

/// Takes a free key, records who took it and draws its fencing token.
///
/// `KEYS[1]` lock key, `KEYS[2]` fence key, `KEYS[3]` holder info key;
/// `ARGV[1]` the value to hold the key with (the owner id and a waiter
/// mark, see below), `ARGV[2]` ttl in milliseconds, `ARGV[3]` the holder
/// record ([`crate::HolderInfo::encode`]: host, pid, label), `ARGV[4]`
/// `w` when the caller waits (absent from older clients, which then leave
/// no writer-waiting mark). Returns the token as a bulk string (exact as u64) when the caller now holds the key,
/// the holder's remaining ttl in ms as an integer (negative if it has none)
/// when someone else does.
///
/// Why one atomic step: setting the owner and drawing the token must not be
/// split, or two acquisitions could interleave and hand out tokens in an
/// order that differs from the order they took the key (and a client dying
/// between the steps would leave a held key without a token).
///
/// **The holder info.** The acquisition writes `<owner id> <server time in
/// µs> <record>` to the info key with the lock's own `PX`, in this same
/// step, so the key never is held without it (but by an older dlock, which
/// writes none) and it expires with the lock; renewals stretch both,
/// releases delete both. A reader (`HOLDER_LUA`) takes it only if its
/// owner id is the lock's: an info key left behind (a lock deleted by hand
/// or by an older dlock's force release) never names a later holder.
///
/// The token is `max(last token + 1, server time in microseconds)`: a fence
/// key lost with the data (a restart without persistence, a failover to a
/// replica that missed writes) restarts from the clock, above every token
/// issued before, instead of from 1. That assumes the server clock never
/// moves backwards, and, after a failover, that the new primary's clock is
/// not behind the old one's by more than the failover took.
///
/// Drawing it costs one command in the usual case: `SET fence <clock> GET`
/// writes the clock and reads the last token back in one step. The clock
/// is written as the 16-digit decimal it is until the year 2286, so a last
/// token of the same length, all digits and without a leading zero,
/// compares as text exactly as it does as a number, in any collation (no
/// Lua number, which is exact only up to 2^53, is involved). Such a last
/// token below the clock: the clock is the token. Anything else (the same
/// microsecond as the last acquisition, a clock that stepped back, a
/// counter seeded above the clock or above 2^53, a value that is not a
/// plain decimal counter, a fence key of another type) takes the careful
/// path: the last value is put back and `INCR` draws from it, with the
/// clock as the floor.
/// `INCR` is exact in 64 bits, so the token is then read back as the
/// counter's text. A counter that cannot rise (at 2^63 - 1, or not an
/// integer) makes it fail: the lock just set is taken back (a script's
/// earlier writes survive its error), the counter is left as it was, and
/// the error returned (and the release announced, in case waiters marked
/// it). Refused, never wrapped, and nothing left held. The
/// reply is a plain `ERR` error (clients take an error reply's first word
/// for its code), with the failed command's own `ERR` taken off its reason.
///
/// If the key is already held by this very owner id (a retry of an attempt
/// whose reply was lost on a broken connection), the attempt counts as
/// acquired: owner ids are random per attempt. Its lifetime starts anew and
/// it draws a token of its own, like any acquisition, rather than reading
/// the counter back: the counter may have gone back since the first
/// attempt drew (a failover that lost writes), and only a draw puts the
/// clock floor under the token. The first attempt's token never reached
/// the caller, so a higher one is all it sees.
///
/// **The waiter mark.** The value is the 32-hex-digit owner id and one
/// character: `-` while nobody is known to wait for the key, `+` once
/// someone may. A failed attempt turns the holder's `-` into `+` (in place,
/// keeping the expiry; only a value of that exact form, 32 hex digits and
/// `-`, is ever written to); a caller that knows waiters of its own
/// process are queued for the key takes it with `+` at once. An attempt
/// refused the mark (an ACL without `SETRANGE`) still answers "held", as
/// `{remaining ttl, the refusal}`, so the caller can say why releases will
/// not wake its waiters. [`RELEASE_LUA`] publishes
/// the release only for a `+`, so an uncontended release costs the server
/// no `PUBLISH`. A value without the mark (a holder on an older dlock)
/// is never touched: older releases publish every time.
///
/// **Readers** (see `modes_lua!`). A key held by a read phase holds its
/// sentinel, so an exclusive attempt finds it held, marks it `+` (the last
/// reader's release then publishes) and, if its caller waits, leaves a
/// writer-waiting mark,
/// `dlock:{T}:writer` (the owner id and `-`, `PX` 3000 ms, which is
/// [`QUEUE_ENTRY_TTL`](crate::backend::QUEUE_ENTRY_TTL)), or refreshes
/// its own; new readers are refused while it stands (rule M3). It answers
/// at most 1000 ms then, a third of the mark's life, so the waiter's
/// retries keep the mark alive. The attempt that takes the key deletes its
/// owner's mark, and takes the key `+` if a reader was refused by the mark
/// (the mark's flag), so its release wakes that reader.
pub const ACQUIRE_LUA: &str = acquire_lua!("ARGV[4] == 'w'");

/// Renews a lease. `KEYS[1]` lock key, `KEYS[2]` holder info key;
/// `ARGV[1]` the owner id with the `-` mark, `ARGV[2]` ttl in
/// milliseconds. Returns 1 if renewed, 0 if the caller is not the owner.
/// The owner id is compared, whichever mark the value carries now. The
/// info key the caller's acquisition wrote gets the same new expiry, so it
/// lives exactly as long as the lock.
///
/// Why one atomic step: checked apart, the lease could expire and be taken
/// by a new owner between the check and the `PEXPIRE`, which would then
/// stretch the new owner's lease on the old owner's say-so.
pub const EXTEND_LUA: &str = r"
local held = redis.pcall('GET', KEYS[1])
if held == ARGV[1] or type(held) == 'string' and #held == #ARGV[1]
    and string.sub(held, 1, -2) == string.sub(ARGV[1], 1, -2) then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// Releases a lease, and hands the key to the first live fair waiter or
/// announces the release to whoever may wait. `KEYS[1]` lock key
/// (`…:lock`), `KEYS[2]` holder info key (deleted with the lock, in the
/// same `DEL`); `ARGV[1]` the owner id with the `-` mark. The release
/// channel, the key's queue of fair waiters and its fence key (for the
/// token of a handoff) are the lock key with `lock` replaced by
/// `released`, `queue` and `fence` (the same hash tag, so the same slot of
/// a cluster), named here only when a marked release needs them: every
/// argument costs the server, and the client, on every call, and a plain
/// release sends exactly what it sent before fair mode. Returns 1 if released (or handed over), 0 if
/// the caller was not the owner.
///
/// Why one atomic step: a holder whose lease ran out must never delete the
/// lock the next owner holds now (the reference article's `releaseScript`).
/// Deciding to publish in the same step as the delete means no waiter is
/// missed: a waiter subscribes before its attempt, and a failed attempt
/// marks the holder's value `+` in the same script that finds the key
/// held, so every waiter that could sleep through this release either
/// marked the value, or its attempt comes after this delete and finds the
/// key free. A value still at `-` (the common, uncontended case) is
/// deleted without a `PUBLISH`, and without a look at the queue.
///
/// **Fair waiters** (the fair acquire script, `FAIR_ACQUIRE_LUA`). A fair waiter's attempt that
/// finds the key held marks it `+` too, so a `+` release looks at the
/// queue: the first live entry (lines whose entry key has died are
/// dropped) gets the key in this same step, as an acquisition would have
/// taken it: the lock set to its owner id, its holder info written, its
/// token drawn exactly as [`ACQUIRE_LUA`] draws one (clock floor, `INCR`
/// path), and the token published on the key's handoff channel
/// (`dlock:{T}:handoff`) as `<owner id> <token> <ms>`: the lease lasts
/// `<ms>`, the smaller of the ttl its attempt asked for and what was left
/// of its entry's life (its entry key's `PTTL`), so a handoff to a waiter that died while queued
/// ends when its entry would have (`Grant::valid_for`). The new value
/// keeps the `+`, so its release looks at the queue again (and publishes
/// to plain waiters). With nobody live in the queue, the release is the
/// plain one. A counter that cannot rise fails the handoff, not the
/// release: the key is freed and announced, and the waiter's own attempt
/// meets the error.
///
/// A caller that does not hold the key leaves the queue instead (rule F3):
/// its entry key is deleted (named from the queue's, see `queue_lua!`) and
/// its line, if any, removed; and its writer-waiting mark, if it left one
/// behind readers ([`ACQUIRE_LUA`]), is deleted, and the removal announced,
/// so readers it held back go at once (rule M3).
pub const RELEASE_LUA: &str = concat!(
    r"
local held = redis.pcall('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
end
",
    queue_lua!(),
    r"
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
"
);

/// Breaks a lock whoever holds it: an exclusive holder, a read phase or
/// every permit (their hashes, the phase token and a writer-waiting mark
/// are deleted with the lock key, named from it). `KEYS[1]` lock key,
/// `KEYS[2]` holder info key (deleted too, held or not: without its lock
/// it names nobody);
/// `ARGV[1]` release channel. Returns 1 if a lock was deleted.
///
/// Why one atomic step: the announcement goes out for exactly the deletion
/// that happened, so waiters retry when the key is really free.
pub(super) const FORCE_RELEASE_LUA: &str = r"
local held = redis.call('PTTL', KEYS[1]) ~= -2
local stem = string.sub(KEYS[1], 1, -5)
redis.call('DEL', KEYS[1], KEYS[2], stem .. 'readers', stem .. 'phase', stem .. 'slots', stem .. 'writer')
if held then
  redis.call('PUBLISH', ARGV[1], 'released')
  return 1
end
return 0
";

/// Breaks a lock as [`FORCE_RELEASE_LUA`] does, only if its holder is the
/// lease the caller names by its token: the token [`HOLDER_LUA`] reads for
/// it (the identity record's, when the lock's owner wrote one, else the
/// key's last token drawn, for a value dlock wrote). `KEYS[1]` lock key,
/// `KEYS[2]` holder info key, `KEYS[3]` fence key, `KEYS[4]` identity
/// record; `ARGV[1]` release channel, `ARGV[2]` the token named. Returns 1
/// if the named lease was broken, 0 if another holds the key (or one whose
/// token cannot be read), -1 if nobody does, -2 (nothing changed) if the
/// key is held as permits: their slots keep no token, so the permit named
/// cannot be told from the others, and breaking the key would break them
/// all.
///
/// Why one atomic step: an operator confirms the holder they were shown; a
/// check and a break sent apart would break whoever took the key in
/// between.
pub(super) const FORCE_RELEASE_HOLDING_LUA: &str = r"
local stem = string.sub(KEYS[1], 1, -5)
if redis.call('EXISTS', stem .. 'slots') == 1 then
  return -2
end
local held = redis.pcall('GET', KEYS[1])
if not held then
  return -1
end
if type(held) ~= 'string' or #held ~= 33 or not string.find(held, '^%x+[-+]$') then
  return 0
end
local token
local record = redis.pcall('GET', KEYS[4])
if type(record) == 'string' and string.sub(record, 1, 33) == string.sub(held, 1, 32) .. ' ' then
  token = string.match(record, '^%x+ (%d+) ')
else
  token = redis.pcall('GET', KEYS[3])
end
if token ~= ARGV[2] then
  return 0
end
redis.call('DEL', KEYS[1], KEYS[2], stem .. 'readers', stem .. 'phase', stem .. 'writer')
redis.call('PUBLISH', ARGV[1], 'released')
return 1
";

/// [`ACQUIRE_LUA`] for a lease taken with an identity (leader election):
/// `KEYS[4]` the identity record, `ARGV[4]` the identity, `ARGV[5]` `w`
/// when the caller waits. In the same step
/// that takes the key, it records `<owner id> <token> <identity>` and
/// announces the acquisition on the release channel, which a leader's
/// observers listen to (lock waiters woken by it just find the key held).
/// The caller takes the key with the `+` mark, so its release is published
/// too, whoever waits.
///
/// Why one atomic step: a reader must never see the new holder with the
/// previous one's identity. The record names its owner id, and a reader
/// takes it only while that owner holds the lock.
pub(super) static ACQUIRE_AS_LUA: LazyLock<String> = LazyLock::new(|| {
    format!(
        "local function take()\n{}\nend\n\
         local reply = take()\n\
         if type(reply) == 'string' then\n  \
           redis.call('SET', KEYS[4], string.sub(ARGV[1], 1, 32) .. ' ' .. reply .. ' ' .. ARGV[4])\n  \
           redis.call('PUBLISH', string.sub(KEYS[1], 1, -5) .. 'released', 'acquired')\n\
         end\n\
         return reply\n",
        acquire_lua!("ARGV[5] == 'w'")
    )
});

/// A fair attempt ([`crate::backend::Queue::Respect`] or
/// [`crate::backend::Queue::Join`]): [`ACQUIRE_LUA`] with the key's queue
/// of fair waiters in front. `KEYS[1]` to `KEYS[3]` and `ARGV[1]` to
/// `ARGV[3]` as for [`ACQUIRE_LUA`], `KEYS[4]` the queue and `KEYS[5]`
/// the caller's entry key (see `queue_lua!`); `ARGV[4]` the entry's life
/// in ms for a `Join`, empty for a `Respect`, `ARGV[5]` `w` when the
/// caller waits. Answers as [`ACQUIRE_LUA`] does, and `-1` (held, no
/// known expiry) when the key is free but a live entry that is not the
/// caller's comes first.
///
/// - The key is free and the first live entry is the caller's (a `Join`),
///   or nobody live is queued: it is taken as [`ACQUIRE_LUA`] takes it,
///   and the caller's entry and the dead ones in front of it are dropped. Live
///   entries left behind mark the new value `+`, so its release hands on.
/// - The key is free and someone else's live entry comes first (its
///   holder's lease ran out, or a plain holder released it unmarked): the
///   key is handed to that entry, as a release would ([`RELEASE_LUA`]),
///   rather than left idle until its waiter looks again; the caller is
///   answered held, for that lease's ms. A `Join` then keeps or takes its
///   place.
/// - Someone holds it: [`ACQUIRE_LUA`] answers (and marks the value `+`),
///   and a `Join` keeps its place in the queue, with its entry's life
///   renewed, or joins at the end; its entry records the ttl it asks for
///   and its holder record, for a handoff. A `Respect` joins nothing.
///   The renewal, what a waiter sends every second, is one `SET … PX …
///   GET` of the caller's own entry key, which says it was alive, and a
///   `PTTL` of the queue (a `PEXPIRE` too when the queue would die before
///   the entry): the queue is neither read nor written, whatever its
///   length. Only an entry key found gone (a first `Join`, or an entry
///   that died) reads the queue, drops the owner's old line and appends
///   one at the end.
/// - The caller holds it (rule 3, a retry): [`ACQUIRE_LUA`] answers, and
///   an entry of the caller's, if any, is dropped (the queue is read only
///   if there was one).
///
/// Why one atomic step: the queue is read and the key taken together, so
/// no attempt takes the key past a waiter that queued before it, and a
/// release that hands over never races a `Join`.
pub(super) const FAIR_ACQUIRE_LUA: &str = concat!(
    "local function take()\n",
    acquire_lua!("ARGV[5] == 'w'"),
    "end\n",
    queue_lua!(),
    r"
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
"
);

/// Reads who holds a key. `KEYS[1]` lock key, `KEYS[2]` fence key,
/// `KEYS[3]` identity record, `KEYS[4]` holder info key. Returns `false`
/// when the key is free, else `{remaining ttl in ms, record, last token,
/// info, held for in µs}`: the record (owner id, token, identity) only if
/// the lock's holder wrote it, else an empty string; the last token drawn
/// for the key (the holder's, as only an acquisition draws) only for a
/// value dlock wrote, else an empty string; the holder info record (host,
/// pid, label: [`crate::HolderInfo::decode`] reads it) only if the lock's
/// holder wrote it, else an empty string, and then how long ago its
/// acquisition was by the server's clock (`TIME` now less the time it
/// recorded, never below 0; -1 without info). No client clock is involved.
///
/// Why one script: the lock, its records and its token are read as one
/// state, never a holder with another lease's record or info.
pub const HOLDER_LUA: &str = r"
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
";

/// [`EXTEND_LUA`] for a lease taken with an identity: `KEYS[3]` the
/// identity record, `ARGV[3]` the lease's token, `ARGV[4]` its identity. A renewal
/// that finds the caller still holding the key writes the record again if
/// it is not the caller's (an operator deleted it, eviction took it, a
/// failover brought back an older one), so a live leader is hidden from
/// readers for at most one renewal interval. Only the holder writes it, so
/// it never overwrites a later holder's record.
pub(super) static EXTEND_AS_LUA: LazyLock<String> = LazyLock::new(|| {
    format!(
        "local function extend()\n{EXTEND_LUA}\nend\n\
         local renewed = extend()\n\
         if renewed == 1 then\n  \
           local record = string.sub(ARGV[1], 1, 32) .. ' ' .. ARGV[3] .. ' ' .. ARGV[4]\n  \
           if redis.pcall('GET', KEYS[3]) ~= record then\n    \
             redis.call('SET', KEYS[3], record)\n  \
           end\n\
         end\n\
         return renewed\n"
    )
});

pub(super) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_LUA));
pub(super) static ACQUIRE_AS: LazyLock<Script> = LazyLock::new(|| Script::new(&ACQUIRE_AS_LUA));
pub(super) static HOLDER: LazyLock<Script> = LazyLock::new(|| Script::new(HOLDER_LUA));
pub(super) static EXTEND: LazyLock<Script> = LazyLock::new(|| Script::new(EXTEND_LUA));
pub(super) static EXTEND_AS: LazyLock<Script> = LazyLock::new(|| Script::new(&EXTEND_AS_LUA));
pub(super) static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_LUA));
pub(super) static FAIR_ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(FAIR_ACQUIRE_LUA));
pub(super) static FORCE_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(FORCE_RELEASE_LUA));
pub(super) static FORCE_RELEASE_HOLDING: LazyLock<Script> =
    LazyLock::new(|| Script::new(FORCE_RELEASE_HOLDING_LUA));

// ---------------------------------------------------------------------------
// Shared locks and permits (rules M1 to M5 on `Backend`).

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
  if #held == 33 and string.find(held, '^%x+%-$') then
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
/// the key with (`-` or `+`, as for [`ACQUIRE_LUA`]). Answers as
/// [`ACQUIRE_LUA`] does: the token as a bulk string, or the ms to look
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
///   as [`ACQUIRE_LUA`] draws one (the counter advanced, floored at the
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
pub(super) const SHARED_ACQUIRE_LUA: &str = concat!(
    token_lua!(),
    r"
local owner = ARGV[1]
local function writer_waits()
  local mark = redis.pcall('GET', KEYS[4])
  if type(mark) ~= 'string' then
    return false
  end
  if string.byte(mark, -1) == 45 then
    redis.call('SETRANGE', KEYS[4], 32, '+')
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
    redis.call('SETRANGE', KEYS[1], 32, '+')
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
pub(super) const SHARED_EXTEND_LUA: &str = concat!(
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
/// `KEYS[3]` phase key; `ARGV[1]` owner id. Returns 1 if released, 0 if
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
pub(super) const SHARED_RELEASE_LUA: &str = concat!(
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
  if string.byte(held, -1) == 43 then
    redis.call('PUBLISH', string.sub(KEYS[1], 1, -5) .. 'released', 'released')
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
/// entries there are. A grant draws a token anew as [`ACQUIRE_LUA`] draws
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
pub(super) const PERMIT_ACQUIRE_LUA: &str = concat!(
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
    redis.call('SETRANGE', KEYS[1], 32, '+')
  end
else
  redis.call('DEL', KEYS[3])
  redis.call('SET', KEYS[1], PERMITS .. ARGV[3], 'PX', ARGV[2])
  redis.call('HSET', KEYS[3], ms(taken), slots[ms(taken)])
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
pub(super) const PERMIT_EXTEND_LUA: &str = concat!(
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
/// Returns 1 if released, 0 if the caller held no such live slot. The
/// last permit's release deletes the sentinel and the hash; each release
/// publishes on the release channel when the sentinel is marked `+` (an
/// attempt found the permits taken).
///
/// Why one atomic step: the owner check and the freeing must not be split
/// (a slot that ran out and was taken again must stay its new holder's),
/// and the announcement goes out for exactly the slot freed.
pub(super) const PERMIT_RELEASE_LUA: &str = concat!(
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
if string.byte(held, -1) == 43 then
  redis.call('PUBLISH', string.sub(KEYS[1], 1, -5) .. 'released', 'released')
end
return 1
"
);

pub(super) static SHARED_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(SHARED_ACQUIRE_LUA));
pub(super) static SHARED_EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(SHARED_EXTEND_LUA));
pub(super) static SHARED_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(SHARED_RELEASE_LUA));
pub(super) static PERMIT_ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(PERMIT_ACQUIRE_LUA));
pub(super) static PERMIT_EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(PERMIT_EXTEND_LUA));
pub(super) static PERMIT_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(PERMIT_RELEASE_LUA));

#[cfg(test)]
mod tests {
    use super::*;

    /// The writer-waiting mark's life is written into the acquire script
    /// as a literal (the script's arguments are fixed by older clients):
    /// it must be the core's, and the answer a third of it.
    #[test]
    fn the_writer_mark_lives_the_queue_entry_ttl() {
        let ttl = crate::backend::QUEUE_ENTRY_TTL.as_millis();
        assert!(ACQUIRE_LUA.contains(&format!("'PX', {ttl})")));
        assert!(ACQUIRE_LUA.contains(&format!("PEXPIRE', writer, {ttl})")));
        assert!(ACQUIRE_LUA.contains(&format!("KEYS[1]), {})", ttl / 3)));
    }
}

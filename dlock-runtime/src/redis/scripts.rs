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

/// Takes a free key, records who took it and draws its fencing token.
///
/// `KEYS[1]` lock key, `KEYS[2]` fence key, `KEYS[3]` holder info key;
/// `ARGV[1]` the value to hold the key with (the owner id and a waiter
/// mark, see below), `ARGV[2]` ttl in milliseconds, `ARGV[3]` the holder
/// record ([`crate::HolderInfo::encode`]: host, pid, label). Returns the
/// token as a bulk string (exact as u64) when the caller now holds the key,
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
pub const ACQUIRE_LUA: &str = r"
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local held = redis.pcall('GET', KEYS[1])
  if held ~= ARGV[1] and not (type(held) == 'string' and #held == #ARGV[1]
      and string.sub(held, 1, -2) == string.sub(ARGV[1], 1, -2)) then
    if type(held) == 'string' and #held == 33 and string.find(held, '^%x+%-$') then
      local marked = redis.pcall('SETRANGE', KEYS[1], 32, '+')
      if type(marked) == 'table' then
        return {redis.call('PTTL', KEYS[1]), marked.err}
      end
    end
    return redis.call('PTTL', KEYS[1])
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if held ~= ARGV[1] and string.byte(ARGV[1], -1) == 43 then
    redis.call('SETRANGE', KEYS[1], #ARGV[1] - 1, '+')
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
";

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

/// Releases a lease and announces it to whoever may wait. `KEYS[1]` lock
/// key (`…:lock`), `KEYS[2]` holder info key (deleted with the lock, in
/// the same `DEL`); `ARGV[1]` the owner id with the `-` mark. The release
/// channel is the lock key with `lock` replaced by `released`, made here
/// only when it is published on (an argument costs the server on every
/// call). Returns 1 if released, 0 if the caller was not the owner
/// (nothing is changed then).
///
/// Why one atomic step: a holder whose lease ran out must never delete the
/// lock the next owner holds now (the reference article's `releaseScript`).
/// Deciding to publish in the same step as the delete means no waiter is
/// missed: a waiter subscribes before its attempt, and a failed attempt
/// marks the holder's value `+` in the same script that finds the key
/// held, so every waiter that could sleep through this release either
/// marked the value, or its attempt comes after this delete and finds the
/// key free. A value still at `-` (the common, uncontended case) is
/// deleted without a `PUBLISH`.
pub const RELEASE_LUA: &str = r"
local held = redis.pcall('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
end
if type(held) == 'string' and #held == #ARGV[1]
    and string.sub(held, 1, -2) == string.sub(ARGV[1], 1, -2) then
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('PUBLISH', string.sub(KEYS[1], 1, -5) .. 'released', 'released')
  return 1
end
return 0
";

/// Breaks a lock whoever holds it. `KEYS[1]` lock key, `KEYS[2]` holder
/// info key (deleted too, held or not: without its lock it names nobody);
/// `ARGV[1]` release channel. Returns 1 if a lock was deleted.
///
/// Why one atomic step: the announcement goes out for exactly the deletion
/// that happened, so waiters retry when the key is really free.
pub(super) const FORCE_RELEASE_LUA: &str = r"
local held = redis.call('PTTL', KEYS[1]) ~= -2
redis.call('DEL', KEYS[1], KEYS[2])
if held then
  redis.call('PUBLISH', ARGV[1], 'released')
  return 1
end
return 0
";

/// [`ACQUIRE_LUA`] for a lease taken with an identity (leader election):
/// `KEYS[4]` the identity record, `ARGV[4]` the identity. In the same step
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
        "local function take()\n{ACQUIRE_LUA}\nend\n\
         local reply = take()\n\
         if type(reply) == 'string' then\n  \
           redis.call('SET', KEYS[4], string.sub(ARGV[1], 1, 32) .. ' ' .. reply .. ' ' .. ARGV[4])\n  \
           redis.call('PUBLISH', string.sub(KEYS[1], 1, -5) .. 'released', 'acquired')\n\
         end\n\
         return reply\n"
    )
});

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
pub(super) static FORCE_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(FORCE_RELEASE_LUA));

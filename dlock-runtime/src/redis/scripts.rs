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

/// Takes a free key and draws its fencing token.
///
/// `KEYS[1]` lock key, `KEYS[2]` fence key; `ARGV[1]` owner id, `ARGV[2]`
/// ttl in milliseconds. Returns `{1, token}` when the caller now holds the
/// key, `{0, remaining ttl in ms (negative if none)}` when someone else does.
///
/// Why one atomic step: setting the owner and drawing the token must not be
/// split, or two acquisitions could interleave and hand out tokens in an
/// order that differs from the order they took the key (and a client dying
/// between the steps would leave a held key without a token).
///
/// The token is `max(last token + 1, server time in microseconds)`: a fence
/// key lost with the data (a restart without persistence, a failover to a
/// replica that missed writes) restarts from the clock, above every token
/// issued before, instead of from 1. That assumes the server clock never
/// moves backwards, and, after a failover, that the new primary's clock is
/// not behind the old one's by more than the failover took.
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
/// Lua numbers are doubles, exact only up to 2^53: a counter above that (a
/// migration may seed one) would round, and two acquisitions would get the
/// same token. `INCR` itself is exact (Redis counts in 64 bits), so above
/// 2^53 the token is read back as the counter's text, never as a Lua
/// number; the clock (about 2^51 µs today) cannot win there. A counter that
/// cannot rise (at 2^63 - 1, or not an integer) makes `INCR` fail: the lock
/// just set is taken back (a script's earlier writes survive its error) and
/// the error returned. Refused, never wrapped, and nothing left held. The
/// reply is a plain `ERR` error (clients take an error reply's first word
/// for its code), with `INCR`'s own `ERR` taken off its reason.
pub const ACQUIRE_LUA: &str = r"
if redis.replicate_commands then redis.replicate_commands() end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if redis.pcall('GET', KEYS[1]) ~= ARGV[1] then
    return {0, redis.call('PTTL', KEYS[1])}
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
local token = redis.pcall('INCR', KEYS[2])
if type(token) == 'table' then
  redis.call('DEL', KEYS[1])
  return redis.error_reply('ERR the fencing counter ' .. KEYS[2] .. ' cannot rise: ' .. (string.gsub(token.err, '^ERR ', '')))
end
if token >= 9007199254740992 then
  return {1, redis.call('GET', KEYS[2])}
end
local now = redis.call('TIME')
local clock = tonumber(now[1]) * 1000000 + tonumber(now[2])
if token < clock then
  token = clock
  redis.call('SET', KEYS[2], now[1] .. string.format('%06d', tonumber(now[2])))
end
return {1, token}
";

/// Renews a lease. `KEYS[1]` lock key; `ARGV[1]` owner id, `ARGV[2]` ttl in
/// milliseconds. Returns 1 if renewed, 0 if the caller is not the owner.
///
/// Why one atomic step: checked apart, the lease could expire and be taken
/// by a new owner between the check and the `PEXPIRE`, which would then
/// stretch the new owner's lease on the old owner's say-so.
pub const EXTEND_LUA: &str = r"
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

/// Releases a lease and announces it. `KEYS[1]` lock key; `ARGV[1]` owner
/// id, `ARGV[2]` release channel. Returns 1 if released, 0 if the caller was
/// not the owner (nothing is changed then).
///
/// Why one atomic step: a holder whose lease ran out must never delete the
/// lock the next owner holds now (the reference article's `releaseScript`).
/// Publishing in the same step means every waiter subscribed before the
/// release hears about it.
pub const RELEASE_LUA: &str = r"
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], 'released')
  return 1
end
return 0
";

/// Breaks a lock whoever holds it. `KEYS[1]` lock key; `ARGV[1]` release
/// channel. Returns 1 if a lock was deleted.
///
/// Why one atomic step: the announcement goes out for exactly the deletion
/// that happened, so waiters retry when the key is really free.
pub(super) const FORCE_RELEASE_LUA: &str = r"
if redis.call('DEL', KEYS[1]) == 1 then
  redis.call('PUBLISH', ARGV[1], 'released')
  return 1
end
return 0
";

pub(super) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_LUA));
pub(super) static EXTEND: LazyLock<Script> = LazyLock::new(|| Script::new(EXTEND_LUA));
pub(super) static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_LUA));
pub(super) static FORCE_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(FORCE_RELEASE_LUA));

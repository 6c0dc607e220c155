//! The scripts of operators and readers rather than of holders: who holds
//! a key (`dlock show`, `Backend::holder`), and the force releases
//! (`dlock release --force`, by holding or whoever holds). They read every
//! shape a lock value takes, the previous protocol's included, as the
//! holder scripts in the parent module write them.

use std::sync::LazyLock;

use ::redis::Script;

/// Breaks a lock whoever holds it: an exclusive holder, a read phase or
/// every permit (their hashes, the phase token and a writer-waiting mark
/// are deleted with the lock key, named from it, and so is a previous
/// protocol's info key, held or not: without its lock it names nobody).
/// `KEYS[1]` lock key; `ARGV[1]` release channel. Returns 1 if a lock was deleted.
///
/// Why one atomic step: the announcement goes out for exactly the deletion
/// that happened, so waiters retry when the key is really free.
pub(in crate::redis) const FORCE_RELEASE_LUA: &str = r"
local held = redis.call('PTTL', KEYS[1]) ~= -2
local stem = string.sub(KEYS[1], 1, -5)
redis.call('DEL', KEYS[1], stem .. 'info', stem .. 'readers', stem .. 'phase', stem .. 'slots', stem .. 'writer')
if held then
  redis.pcall('PUBLISH', ARGV[1], 'released')
  return 1
end
return 0
";

/// Breaks a lock as [`FORCE_RELEASE_LUA`] does, only if its holder is the
/// lease the caller names by its token: the token [`HOLDER_LUA`] reads for
/// it (the identity record's, when the lock's owner wrote one, else the
/// value's own, or the read phase's; for a value of the previous
/// protocol's shape, which carries none, the key's last token drawn, as
/// [`HOLDER_LUA`] reads it), read as a number as the client reads it. `KEYS[1]` lock key, `KEYS[2]` fence
/// key, `KEYS[3]` identity record; `ARGV[1]` release channel, `ARGV[2]`
/// the token named. Returns 1
/// if the named lease was broken, 0 if another holds the key (or one whose
/// token cannot be read), -1 if nobody does (whatever records are left
/// beside a lock that is gone), -2 (nothing changed) if the key is held as
/// permits (its lock holds their sentinel): their slots keep no token, so
/// the permit named cannot be told from the others, and breaking the key
/// would break them all.
///
/// Why one atomic step: an operator confirms the holder they were shown; a
/// check and a break sent apart would break whoever took the key in
/// between.
pub(in crate::redis) const FORCE_RELEASE_HOLDING_LUA: &str = r"
local stem = string.sub(KEYS[1], 1, -5)
local held = redis.pcall('GET', KEYS[1])
if not held then
  return -1
end
-- Held as permits: the lock holds their sentinel (a slots hash without
-- it is left over, read by nobody).
if type(held) == 'string' and #held == 33 and string.sub(held, 1, 32) == '00000000000000000000000000000001' then
  return -2
end
local owner, rest = string.match(type(held) == 'string' and held or '', '^(%x+)[-+](.*)$')
if not owner or #owner ~= 32 then
  return 0
end
local token
local record = redis.pcall('GET', KEYS[3])
if type(record) == 'string' and string.sub(record, 1, 33) == owner .. ' ' then
  token = string.match(record, '^%x+ (%d+) ')
elseif rest ~= '' then
  token = string.match(rest, '^ (%d+) %d+ ')
elseif owner == '00000000000000000000000000000000' then
  local phase = redis.pcall('GET', stem .. 'phase')
  token = type(phase) == 'string' and string.match(phase, '^%d+')
else
  local recorded = redis.pcall('GET', stem .. 'info')
  local last = redis.pcall('GET', KEYS[2])
  if type(recorded) ~= 'string' or string.sub(recorded, 1, 33) ~= owner .. ' '
      or string.match(recorded, '^(%d+) ', 34) == last then
    token = last
  end
end
-- As the client reads it: a number, whatever zeros an edit put before it.
if not token or string.gsub(token, '^0+(%d)', '%1') ~= ARGV[2] then
  return 0
end
redis.call('DEL', KEYS[1], stem .. 'info', stem .. 'readers', stem .. 'phase', stem .. 'writer')
redis.pcall('PUBLISH', ARGV[1], 'released')
return 1
";

/// Reads who holds a key. `KEYS[1]` lock key, `KEYS[2]` fence key,
/// `KEYS[3]` identity record, `KEYS[4]` holder info key. Returns `false`
/// when the key is free, else `{remaining ttl in ms, record, token,
/// info, held for in µs}`: the record (owner id, token, identity) only if
/// the lock's holder wrote it, else an empty string; the holder's token,
/// read from its value (a read phase's from its phase key; for the
/// permits' sentinel, the key's last token drawn: only an acquisition
/// draws), only for a value dlock wrote, else an empty string. A value of
/// the previous protocol's shape carries no token: it is read as the key's
/// last token drawn, but for a holder that recorded itself in the info key
/// only while the counter still reads the clock recorded there (that
/// protocol's token is that clock unless the counter ran ahead of it): a
/// counter an operator set back or forward since is not the holder's
/// token, and the holder is shown without one. (A holder of the protocol
/// before the info key left no record to check the counter against: it is
/// shown with the counter, as that protocol showed it.) the holder info record (host,
/// pid, label: [`crate::HolderInfo::decode`] reads it) from the value (or
/// the previous protocol's info key, only if the lock's
/// holder wrote it), else an empty string, and then how long ago its
/// acquisition was by the server's clock (`TIME` now less the time it
/// recorded, never below 0; -1 without info). No client clock is involved.
///
/// Why one script: the lock, its records and its token are read as one
/// state, never a holder with another lease's record or info.
pub(in crate::redis) const HOLDER_LUA: &str = r"
local held = redis.pcall('GET', KEYS[1])
if not held then
  return false
end
local ttl = redis.call('PTTL', KEYS[1])
local owner, rest = string.match(type(held) == 'string' and held or '', '^(%x+)[-+](.*)$')
if not owner or #owner ~= 32 then
  return {ttl, '', '', '', -1}
end
owner = owner .. ' '
local record = redis.pcall('GET', KEYS[3])
if type(record) ~= 'string' or string.sub(record, 1, 33) ~= owner then
  record = ''
end
local token, since, info = string.match(rest, '^ (%d+) (%d+) (.*)$')
if rest == '' and owner == '00000000000000000000000000000000 ' then
  local phase = redis.pcall('GET', string.sub(KEYS[1], 1, -5) .. 'phase')
  token = type(phase) == 'string' and string.match(phase, '^%d+')
elseif rest == '' then
  local recorded = redis.pcall('GET', KEYS[4])
  if type(recorded) == 'string' and string.sub(recorded, 1, 33) == owner then
    since, info = string.match(recorded, '^(%d+) (.*)$', 34)
  end
  local last = redis.pcall('GET', KEYS[2])
  if not since or last == since then
    token = last
  end
end
if type(token) ~= 'string' then
  token = ''
end
local held_for = -1
if since and #since <= 16 then
  local now = redis.call('TIME')
  held_for = math.max(tonumber(now[1]) * 1000000 + tonumber(now[2]) - tonumber(since), 0)
else
  info = ''
end
return {ttl, record, token, info, held_for}
";

pub(in crate::redis) static HOLDER: LazyLock<Script> = LazyLock::new(|| Script::new(HOLDER_LUA));
pub(in crate::redis) static FORCE_RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(FORCE_RELEASE_LUA));
pub(in crate::redis) static FORCE_RELEASE_HOLDING: LazyLock<Script> =
    LazyLock::new(|| Script::new(FORCE_RELEASE_HOLDING_LUA));

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
/// argument each script keeps for it. `$held`: the expression of the lock
/// key's value, `GET` here or by a script that read it already.
macro_rules! acquire_lua {
    ($waits:literal, $held:literal) => {
        concat!(
            "local waits = ",
            $waits,
            "\nlocal held = ",
            $held,
            "\n",
            r"
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
      local marked = redis.pcall('SETRANGE', KEYS[1], '32', '+')
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
    redis.pcall('PUBLISH', string.sub(KEYS[1], 1, -5) .. 'released', 'released')
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

/// What a grant with an identity writes, once `reply` holds its token:
/// the identity record at `$record` (`<owner id> <token> <identity>`, the
/// identity from `$identity`), and the acquisition announced on the
/// release channel, for a leader's observers. [`ACQUIRE_AS_LUA`]'s, and
/// the fair acquire script's for a queued owner's `Barge`.
macro_rules! identity_lua {
    ($record:literal, $identity:literal) => {
        concat!(
            "  redis.call('SET', ",
            $record,
            ", string.sub(ARGV[1], 1, 32) .. ' ' .. reply .. ' ' .. ",
            $identity,
            ")\n  redis.pcall('PUBLISH', string.sub(KEYS[1], 1, -5) .. 'released', 'acquired')\n"
        )
    };
}

/// `queue_lua!`: the functions of fair mode's queue, string and list.
#[macro_use]
mod queue;

/// Takes a free key, records who took it and draws its fencing token.
///
/// `KEYS[1]` lock key, `KEYS[2]` fence key;
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
/// **The holder record.** The key is written once, after the token is
/// drawn: `<owner id><mark> <token> <server time in µs> <record>`, with the
/// lock's `PX`. The record lives and dies with the lock, in the same key,
/// so a renewal stretches one key and a release deletes one, and a reader
/// (`HOLDER_LUA`) reads the holder's own token from it, whatever an
/// operator did to the counter since. Every check of the owner compares
/// the value's first 32 characters and its shape (33 characters, or a
/// space after the mark), so values of the previous protocol (the owner id
/// and the mark alone, their record in the `…:info` key) are still
/// compared, marked, renewed and released as before.
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
/// keeping the expiry; only a value of dlock's shapes, 32 hex digits and
/// `-`, alone or followed by a token and a time, is ever written to); a caller that knows waiters of its own
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
/// (the mark's flag), so its release wakes that reader. Only a caller that
/// waits can have left a mark (owner ids are per acquisition), so only its
/// attempts look for one: an attempt that does not wait costs no `GET` of
/// the mark.
pub const ACQUIRE_LUA: &str = acquire_lua!("ARGV[4] == 'w'", "redis.pcall('GET', KEYS[1])");

/// Renews a lease. `KEYS[1]` lock key; `ARGV[1]` the owner id with the
/// `-` mark, `ARGV[2]` ttl in milliseconds. Returns 1 if renewed, 0 if the
/// caller is not the owner. The owner id is compared, whichever mark the
/// value carries now. A value of the previous protocol's shape (handed
/// over by a replica not yet upgraded) has its info key stretched too, so
/// it lives as long as the lock.
///
/// Why one atomic step: checked apart, the lease could expire and be taken
/// by a new owner between the check and the `PEXPIRE`, which would then
/// stretch the new owner's lease on the old owner's say-so.
pub const EXTEND_LUA: &str = r"
local held = redis.pcall('GET', KEYS[1])
if type(held) == 'string' and string.sub(held, 1, 32) == string.sub(ARGV[1], 1, 32) then
  if #held == 33 then
    redis.call('PEXPIRE', string.sub(KEYS[1], 1, -5) .. 'info', ARGV[2])
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
  elseif string.find(held, '^ %d+ %d+ ', 34) then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
end
return 0
";

/// Releases a lease, and hands the key to the first live fair waiter or
/// announces the release to whoever may wait. `KEYS[1]` lock key
/// (`…:lock`); `ARGV[1]` the owner id with the `-` mark. The release
/// channel, the key's queue of fair waiters and its fence key (for the
/// token of a handoff) are the lock key with `lock` replaced by
/// `released`, `queue` and `fence` (the same hash tag, so the same slot of
/// a cluster), named here only when a marked release needs them: every
/// argument costs the server, and the client, on every call, and a plain
/// release sends exactly what it sent before fair mode. Returns 1 if released (or handed over), 0 if
/// the caller was not the owner, 2 if released (or handed over) but its announcement
/// (`PUBLISH`) was refused (an ACL without `+publish`): waiters then find out at their next look.
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
/// taken it: its token drawn exactly as [`ACQUIRE_LUA`] draws one (clock
/// floor, `INCR` path), the lock set to its owner id, token, time and the
/// holder record of its entry (in the previous protocol's shape for a
/// waiter whose line says so, see `queue_lua!`), and the token published on the key's handoff channel
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
/// A list queue (see `queue_lua!`) is served the same way: its front is
/// popped up to the first live entry, which is handed the key (and put
/// back should the counter fail to rise).
///
/// A caller that does not hold the key leaves the queue instead (rule F3):
/// its entry key is deleted (named from the queue's, see `queue_lua!`) and
/// its line, if any, removed; and its writer-waiting mark, if it left one
/// behind readers ([`ACQUIRE_LUA`]), is deleted, and the removal announced,
/// so readers it held back go at once (rule M3).
pub const RELEASE_LUA: &str = concat!(
    r"
local held = redis.pcall('GET', KEYS[1])
local mine = type(held) == 'string' and string.sub(held, 1, 32) == string.sub(ARGV[1], 1, 32)
  and (#held == 33 or string.find(held, '^ %d+ %d+ ', 34))
if mine and #held > 33 and string.byte(held, 33) == 45 then
  redis.call('DEL', KEYS[1])
  return 1
end
",
    queue_lua!(),
    r"
local owner = string.sub(ARGV[1], 1, 32)
local stem = string.sub(KEYS[1], 1, -5)
local queue, fence = stem .. 'queue', stem .. 'fence'
if mine then
  if string.byte(held, 33) == 43 then
    local text = redis.pcall('GET', queue)
    if is_list(text) then
      local entry = pop_live(queue)
      if entry then
        local handed, unannounced = hand_over(entry, server_time(), KEYS[1], fence)
        if handed then
          return unannounced and 2 or 1
        end
        pcall(unpop, queue, entry)
      end
    elseif type(text) == 'string' and text ~= '' then
      local clock = server_time()
      local entry, start, stop = first_live(text, queue)
      if entry then
        local handed, unannounced = hand_over(entry, clock, KEYS[1], fence)
        if handed then
          pcall(write, queue, string.sub(text, stop), nil, nil, text)
          return unannounced and 2 or 1
        end
      end
      if start > 1 then
        pcall(write, queue, string.sub(text, start), nil, nil, text)
      end
    end
  end
  if #held == 33 then
    redis.call('DEL', KEYS[1], stem .. 'info')
  else
    redis.call('DEL', KEYS[1])
  end
  if string.byte(held, 33) == 43
      and type(redis.pcall('PUBLISH', stem .. 'released', 'released')) == 'table' then
    return 2
  end
  return 1
end
local writer = stem .. 'writer'
local waiting = redis.pcall('GET', writer)
if type(waiting) == 'string' and string.sub(waiting, 1, 32) == owner then
  redis.call('DEL', writer)
  redis.pcall('PUBLISH', stem .. 'released', 'released')
end
redis.call('DEL', waiter(queue, owner))
local text = redis.pcall('GET', queue)
if is_list(text) then
  drop(queue, owner)
elseif type(text) == 'string' and text ~= '' then
  leave(queue, text, owner)
end
return 0
"
);

/// [`ACQUIRE_LUA`] for a lease taken with an identity (leader election):
/// `KEYS[3]` the identity record, `ARGV[4]` the identity, `ARGV[5]` `w`
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
         if type(reply) == 'string' then\n{}end\n\
         return reply\n",
        acquire_lua!("ARGV[5] == 'w'", "redis.pcall('GET', KEYS[1])"),
        identity_lua!("KEYS[3]", "ARGV[4]")
    )
});

/// [`EXTEND_LUA`] for a lease taken with an identity: `KEYS[2]` the
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
           if redis.pcall('GET', KEYS[2]) ~= record then\n    \
             redis.call('SET', KEYS[2], record)\n  \
           end\n\
         end\n\
         return renewed\n"
    )
});

pub(super) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(ACQUIRE_LUA));
pub(super) static ACQUIRE_AS: LazyLock<Script> = LazyLock::new(|| Script::new(&ACQUIRE_AS_LUA));
pub(super) static EXTEND: LazyLock<Script> = LazyLock::new(|| Script::new(EXTEND_LUA));
pub(super) static EXTEND_AS: LazyLock<Script> = LazyLock::new(|| Script::new(&EXTEND_AS_LUA));
pub(super) static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_LUA));

mod fair;
mod modes;
mod operator;

pub(super) use fair::*;
pub(super) use modes::*;
pub(super) use operator::*;

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

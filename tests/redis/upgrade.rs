//! A rolling upgrade: replicas still on the previous Redis protocol (owner
//! ids stored bare, a publish on every release) and replicas on this one
//! (owner ids with a waiter mark, a publish only when someone waits) share
//! keys for a while. They must still exclude each other, keep tokens
//! rising, and never make the other side's holder lose its lease.

use crate::redis_support;

use redis_support::{
    lock_name, shared_backend as backend, shared_cli as cli, shared_url as redis_url,
};

use std::sync::Arc;
use std::time::Duration;

use dlock::redis::RedisBackend;
use dlock::{Backend, LockKey, LockOptions};
use redis::Script;
use redis::aio::MultiplexedConnection;

/// The previous protocol's scripts, word for word.
const PREVIOUS_ACQUIRE: &str = r"
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
const PREVIOUS_EXTEND: &str = r"
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";
const PREVIOUS_RELEASE: &str = r"
if redis.pcall('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], 'released')
  return 1
end
return 0
";

/// A replica still on the previous protocol, speaking it by hand.
struct Previous {
    conn: MultiplexedConnection,
    owner: String,
}

impl Previous {
    async fn new(owner: char) -> Self {
        let conn = redis::Client::open(redis_url())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
        Self {
            conn,
            owner: std::iter::repeat_n(owner, 32).collect(),
        }
    }

    /// `Ok(token)` when taken, `Err(remaining ttl)` when held.
    async fn acquire(&mut self, key: &LockKey, ttl_ms: u64) -> Result<u64, i64> {
        let reply: Vec<i64> = Script::new(PREVIOUS_ACQUIRE)
            .key(lock_name(key))
            .key(format!("dlock:{{{key}}}:fence"))
            .arg(&self.owner)
            .arg(ttl_ms)
            .invoke_async(&mut self.conn)
            .await
            .expect("the previous acquire script");
        match reply.as_slice() {
            &[1, token] => Ok(u64::try_from(token).expect("positive")),
            &[0, remaining] => Err(remaining),
            other => panic!("unexpected reply {other:?}"),
        }
    }

    async fn extend(&mut self, key: &LockKey, ttl_ms: u64) -> i64 {
        Script::new(PREVIOUS_EXTEND)
            .key(lock_name(key))
            .arg(&self.owner)
            .arg(ttl_ms)
            .invoke_async(&mut self.conn)
            .await
            .expect("the previous extend script")
    }

    async fn release(&mut self, key: &LockKey) -> i64 {
        Script::new(PREVIOUS_RELEASE)
            .key(lock_name(key))
            .arg(&self.owner)
            .arg(format!("dlock:{{{key}}}:released"))
            .invoke_async(&mut self.conn)
            .await
            .expect("the previous release script")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_previous_holder_is_excluded_from_new_waiters_keeps_its_lease_and_wakes_them() {
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("upgrade-old-holder");
    let mut previous = Previous::new('a').await;
    let old_token = previous.acquire(&key, 60_000).await.expect("free");

    let refused = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await;
    assert!(
        refused.is_err(),
        "a new replica took a key an old one holds"
    );
    // A new replica waiting for the key: its failed attempts must leave the
    // old holder's value as the old release and renewal compare it.
    let waiter = tokio::spawn({
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            // Shorter than the old holder's 60 s ttl and the core's longest
            // nap: only the old release's publish can give it the key.
            LockOptions::new(Duration::from_secs(10))
                .wait(Duration::from_secs(5))
                .acquire_on(backend, &key)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(cli(&["GET", &lock_name(&key)]), previous.owner);
    assert_eq!(
        previous.extend(&key, 60_000).await,
        1,
        "the old holder's renewal"
    );
    assert_eq!(previous.release(&key).await, 1, "the old holder's release");
    let lease = waiter
        .await
        .expect("task")
        .expect("the new waiter is woken by the old release");
    assert!(lease.token().get() > old_token);
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_holder_excludes_previous_replicas_and_tokens_keep_rising_across_both() {
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("upgrade-new-holder");
    let mut previous = Previous::new('b').await;
    let lease = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let first = lease.token().get();
    assert!(
        previous.acquire(&key, 60_000).await.is_err(),
        "an old replica took a key a new one holds"
    );
    assert_eq!(previous.extend(&key, 60_000).await, 0);
    assert_eq!(
        previous.release(&key).await,
        0,
        "an old replica freed a new one's key"
    );
    assert_eq!(
        cli(&["EXISTS", &lock_name(&key)]),
        "1",
        "the new holder's key must still be there"
    );
    lease.release().await.expect("the new holder's release");

    let second = previous.acquire(&key, 60_000).await.expect("free again");
    assert!(second > first, "old token {second} after new token {first}");
    assert_eq!(previous.release(&key).await, 1);
    let lease = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free again");
    assert!(
        lease.token().get() > second,
        "new token {} after old token {second}",
        lease.token()
    );
    lease.release().await.expect("release");
}

/// Waits on `key` as a replica on the previous protocol does: subscribed,
/// it tries the key and, finding it held, waits for a release message.
/// True if a message came within `within`.
async fn previous_waiter_hears_a_release(
    previous: &mut Previous,
    key: &LockKey,
    release: impl std::future::Future<Output = ()>,
    within: Duration,
) -> bool {
    let client = redis::Client::open(redis_url()).expect("url");
    let mut pubsub = client.get_async_pubsub().await.expect("pub/sub");
    pubsub
        .subscribe(format!("dlock:{{{key}}}:released"))
        .await
        .expect("subscribe");
    assert!(
        previous.acquire(key, 60_000).await.is_err(),
        "the old replica took a held key"
    );
    release.await;
    let mut messages = pubsub.on_message();
    tokio::time::timeout(within, futures_util::StreamExt::next(&mut messages))
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_publish_every_release_a_previous_waiter_is_woken_by_a_new_holder() {
    // A previous replica's waiter does not mark the key: a new holder's
    // release is published to it only with the rolling-upgrade switch.
    let backend: Arc<dyn Backend> = Arc::new(
        RedisBackend::builder(&redis_url())
            .publish_every_release(true)
            .connect()
            .await
            .expect("connect"),
    );
    let key = dlock_runtime::conformance::fresh_key("upgrade-publish-all");
    let mut previous = Previous::new('c').await;
    let lease = LockOptions::new(Duration::from_secs(60))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let heard = previous_waiter_hears_a_release(
        &mut previous,
        &key,
        async move { lease.release().await.expect("release") },
        Duration::from_secs(5),
    )
    .await;
    assert!(heard, "the old waiter must hear the new holder's release");
    let token = previous.acquire(&key, 60_000).await.expect("free now");
    assert!(token > 0);
    assert_eq!(previous.release(&key).await, 1);
}

/// The protocol just before the holder info key: values with the waiter
/// mark, no info key written, renewed or deleted. Its scripts, word for
/// word.
const UNRECORDED_ACQUIRE: &str = r"
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
local last = redis.pcall('SET', KEYS[2], clock, 'GET')
if not last or #last == #clock and last < clock and string.find(last, '^[1-9]%d*$') then
  return clock
end
if type(last) == 'string' then
  redis.call('SET', KEYS[2], last)
end
local token = redis.pcall('INCR', KEYS[2])
if type(token) == 'table' then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', string.sub(KEYS[1], 1, -5) .. 'released', 'released')
  return redis.error_reply('ERR the fencing counter ' .. KEYS[2] .. ' cannot rise: ' .. (string.gsub(token.err, '^ERR ', '')))
end
if token < tonumber(clock) then
  redis.call('SET', KEYS[2], clock)
  return clock
end
return redis.call('GET', KEYS[2])
";
const UNRECORDED_RELEASE: &str = r"
local held = redis.pcall('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
if type(held) == 'string' and #held == #ARGV[1]
    and string.sub(held, 1, -2) == string.sub(ARGV[1], 1, -2) then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', string.sub(KEYS[1], 1, -5) .. 'released', 'released')
  return 1
end
return 0
";
const UNRECORDED_FORCE_RELEASE: &str = r"
if redis.call('DEL', KEYS[1]) == 1 then
  redis.call('PUBLISH', ARGV[1], 'released')
  return 1
end
return 0
";

/// A replica on the protocol before the holder info key, by hand.
struct Unrecorded {
    conn: MultiplexedConnection,
    /// The owner id with the "nobody waits" mark.
    value: String,
}

impl Unrecorded {
    async fn new(owner: char) -> Self {
        let conn = redis::Client::open(redis_url())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
        let mut value: String = std::iter::repeat_n(owner, 32).collect();
        value.push('-');
        Self { conn, value }
    }

    /// The token when taken; `None` when held.
    async fn acquire(&mut self, key: &LockKey, ttl_ms: u64) -> Option<u64> {
        let reply: redis::Value = Script::new(UNRECORDED_ACQUIRE)
            .key(lock_name(key))
            .key(format!("dlock:{{{key}}}:fence"))
            .arg(&self.value)
            .arg(ttl_ms)
            .invoke_async(&mut self.conn)
            .await
            .expect("the unrecorded acquire script");
        match reply {
            redis::Value::BulkString(token) => Some(
                String::from_utf8(token)
                    .expect("text")
                    .parse()
                    .expect("a token"),
            ),
            _ => None,
        }
    }

    async fn release(&mut self, key: &LockKey) -> i64 {
        Script::new(UNRECORDED_RELEASE)
            .key(lock_name(key))
            .arg(&self.value)
            .invoke_async(&mut self.conn)
            .await
            .expect("the unrecorded release script")
    }

    /// `dlock release --force` of that version: deletes the lock alone.
    async fn force_release(&mut self, key: &LockKey) -> i64 {
        Script::new(UNRECORDED_FORCE_RELEASE)
            .key(lock_name(key))
            .arg(format!("dlock:{{{key}}}:released"))
            .invoke_async(&mut self.conn)
            .await
            .expect("the unrecorded force-release script")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_info_record_left_behind_never_names_a_later_holder_on_the_older_protocol() {
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("upgrade-info-left");
    let info = format!("dlock:{{{key}}}:info");
    let mut older = Unrecorded::new('d').await;
    let mut recorder = crate::upgrade_record::Recorded::new('f').await;
    let me = dlock::HolderInfo::this_process(None);

    // A holder on the protocol with the info key records itself there; an
    // older replica's force release deletes its lock and leaves the info
    // key.
    let recorded_token = recorder.acquire(&key).await.expect("free");
    let recorded = backend
        .holder(&key)
        .await
        .expect("holder")
        .and_then(|holding| holding.holder)
        .expect("the holder is recorded");
    assert_eq!(
        (recorded.host.as_str(), recorded.pid),
        (me.host.as_str(), me.pid)
    );
    assert_eq!(older.force_release(&key).await, 1);
    // The broken holder's own release finds another value (none): it
    // deletes nothing, and says so.
    assert_eq!(recorder.release(&key).await, 0, "a broken holder released");
    assert_eq!(
        cli(&["EXISTS", &info]),
        "1",
        "the older force release left it"
    );

    // An older holder takes the key: it is held, by an unknown holder, and
    // never paired with the info record left behind.
    let token = older.acquire(&key, 60_000).await.expect("free again");
    assert!(token > recorded_token);
    let holding = backend
        .holder(&key)
        .await
        .expect("holder")
        .expect("the older replica holds it");
    assert_eq!(holding.token.map(|t| t.get()), Some(token));
    assert_eq!(
        holding.holder, None,
        "the older holder must not be named as the recorded one"
    );
    let listed = backend.held(key.as_str()).await.expect("held");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].1.holder, None);

    // Its release leaves the info key too: nobody holds the key.
    assert_eq!(older.release(&key).await, 1);
    assert_eq!(cli(&["EXISTS", &info]), "1", "the older release left it");
    assert_eq!(backend.holder(&key).await.expect("holder"), None);
    assert_eq!(backend.held(key.as_str()).await.expect("held"), Vec::new());

    // A new holder is read with its own record, never the one left
    // behind, and its release deletes its lock.
    let lease = LockOptions::new(Duration::from_secs(60))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free again");
    assert!(lease.token().get() > token);
    let holding = backend.holder(&key).await.expect("holder").expect("held");
    assert_eq!(holding.holder.map(|h| h.pid), Some(me.pid));
    lease.release().await.expect("release");
    assert_eq!(cli(&["EXISTS", &lock_name(&key)]), "0");
}

/// Shared locks need no upgrade of the writers: a read phase holds the
/// lock key, so a replica on the previous protocol is refused while
/// readers hold and gets the key, with a higher token, once they left;
/// and readers are refused while its writer holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_and_a_previous_replicas_writer_exclude_each_other() {
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("upgrade-readers");
    let mut previous = Previous::new('e').await;
    let read = LockOptions::new(Duration::from_secs(30)).mode(dlock::LockMode::Shared);
    let reader = read.acquire_on(backend.clone(), &key).await.expect("free");
    let phase = reader.token().get();
    assert!(
        previous.acquire(&key, 30_000).await.is_err(),
        "an old writer took a read-held key"
    );
    reader.release().await.expect("release");
    let written = previous
        .acquire(&key, 30_000)
        .await
        .expect("the readers left");
    assert!(
        written > phase,
        "the old writer's token is above the phase's"
    );
    let refused = read.acquire_on(backend.clone(), &key).await;
    assert!(
        matches!(refused, Err(dlock::LockError::Held { .. })),
        "a reader got in beside an old writer: {refused:?}"
    );
    assert_eq!(previous.release(&key).await, 1);
    let reader = read.acquire_on(backend.clone(), &key).await.expect("free");
    assert!(reader.token().get() > written);
    reader.release().await.expect("release");
}

//! Fencing a value kept in Redis: a Lua script sets it only under a token at
//! least as high as the highest one stored with it.
//!
//! A fenced resource `R` is one hash, `{prefix}R` (by default
//! `dlock:fenced:R`), with the fields `value` and `token` (the highest
//! accepted token, in decimal). One key, so the scripts are valid on a
//! Redis Cluster too. Tokens are compared as decimal strings, not as Lua
//! numbers (doubles), so every `u64` compares exactly.

use std::sync::LazyLock;

use ::redis::aio::ConnectionLike;
use ::redis::{Script, Value};

use crate::error::{LockError, Operation};
use crate::fence::check_resource;
use crate::token::FencingToken;

const KIND: &str = "redis";
const DEFAULT_PREFIX: &str = "dlock:fenced:";

/// The start both scripts share: returns `{0, highest}` when `ARGV[1]` (a
/// decimal token without leading zeros, compared as a number by length,
/// then digits) is below the highest token the resource hash `KEYS[1]` has
/// accepted; otherwise falls through.
macro_rules! token_check_lua {
    () => {
        r"
local function at_least(a, b)
  if #a ~= #b then return #a > #b end
  return a >= b
end
local highest = redis.call('HGET', KEYS[1], 'token')
if highest and not at_least(ARGV[1], highest) then
  return {0, highest}
end
"
    };
}

/// Sets the value under a token. `KEYS[1]` the resource hash; `ARGV[1]` the
/// token (decimal, no leading zeros), `ARGV[2]` the value. Returns
/// `{1, token}` when the value was set, `{0, highest}` when a higher token
/// was accepted before (nothing is changed then).
///
/// Why one atomic step: compared and set apart, a newer holder's write could
/// land between a stale holder's check and its set, which would then
/// overwrite the newer value — the very write fencing exists to refuse.
const WRITE_LUA: &str = concat!(
    token_check_lua!(),
    r"redis.call('HSET', KEYS[1], 'token', ARGV[1], 'value', ARGV[2])
return {1, ARGV[1]}
"
);

/// Reads the value under a token, recording the token as the highest seen.
/// `KEYS[1]` the resource hash; `ARGV[1]` the token. Returns `{1, value}`
/// (`value` nil when none was written) or `{0, highest}`.
///
/// Why one atomic step, and why a read records its token: a holder that
/// reads, then loses its lease, must not be able to write a value computed
/// from that read after a newer holder has read the same value — both
/// writes would be accepted in token order and one update lost. Raising the
/// highest token with the read refuses the older holder's write; checked
/// and raised apart, a newer reader's token could be overwritten by an
/// older one.
const READ_LUA: &str = concat!(
    token_check_lua!(),
    r"redis.call('HSET', KEYS[1], 'token', ARGV[1])
return {1, redis.call('HGET', KEYS[1], 'value')}
"
);

static WRITE: LazyLock<Script> = LazyLock::new(|| Script::new(WRITE_LUA));
static READ: LazyLock<Script> = LazyLock::new(|| Script::new(READ_LUA));

/// The resource-side check for values in Redis: [`RedisFence::write`] sets
/// a value only under a token at least as high as every token the resource
/// has seen, and [`RedisFence::read`] reads one while recording the reader's
/// token. Works on any redis-rs async connection (a `ConnectionManager`, a
/// `MultiplexedConnection`, a cluster connection), to any server: the
/// token may come from any dlock backend.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use dlock_runtime::redis::fence::RedisFence;
/// use dlock_runtime::{FencingToken, LockError};
///
/// let url = std::env::var("DLOCK_REDIS_URL").unwrap_or("redis://127.0.0.1:6379".into());
/// let mut conn = redis::Client::open(url)?.get_multiplexed_async_connection().await?;
/// let fence = RedisFence::new();
/// let resource = format!("doc:balance:{}", std::process::id());
///
/// fence.write(&mut conn, &resource, FencingToken::new(8), "70").await?; // the holder
/// let stale = fence.write(&mut conn, &resource, FencingToken::new(7), "40").await;
/// match stale {
///     Err(LockError::StaleToken { offered, highest, .. }) => {
///         assert_eq!((offered.get(), highest.get()), (7, 8));
///     }
///     other => panic!("a stale write must be refused: {other:?}"),
/// }
/// let value = fence.read(&mut conn, &resource, FencingToken::new(8)).await?;
/// assert_eq!(value.as_deref(), Some(&b"70"[..]));
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct RedisFence {
    prefix: String,
}

impl Default for RedisFence {
    fn default() -> Self {
        Self::new()
    }
}

impl RedisFence {
    /// Resources under the key prefix `dlock:fenced:`.
    pub fn new() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
        }
    }

    /// Resources under another key prefix (for ACLs or a shared keyspace).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The Redis key of `resource`.
    pub fn key(&self, resource: &str) -> String {
        format!("{}{resource}", self.prefix)
    }

    /// Sets `resource` to `value` if `token` is at least the highest token
    /// it has seen, and records `token`; otherwise changes nothing and
    /// returns [`LockError::StaleToken`]. One atomic script.
    pub async fn write<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        resource: &str,
        token: FencingToken,
        value: impl AsRef<[u8]>,
    ) -> Result<(), LockError> {
        check_resource(resource)?;
        let reply: Value = WRITE
            .key(self.key(resource))
            .arg(token.get().to_string())
            .arg(value.as_ref())
            .invoke_async(conn)
            .await
            .map_err(|e| redis_error(resource, "fenced write failed", e))?;
        match split_reply(resource, reply)? {
            (true, _) => Ok(()),
            (false, highest) => Err(stale(resource, token, highest)?),
        }
    }

    /// Reads `resource` if `token` is at least the highest token it has
    /// seen, and records `token`, so that no holder with a lower token can
    /// write afterwards; otherwise returns [`LockError::StaleToken`].
    /// `None` when no value was ever written. One atomic script.
    pub async fn read<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        resource: &str,
        token: FencingToken,
    ) -> Result<Option<Vec<u8>>, LockError> {
        check_resource(resource)?;
        let reply: Value = READ
            .key(self.key(resource))
            .arg(token.get().to_string())
            .invoke_async(conn)
            .await
            .map_err(|e| redis_error(resource, "fenced read failed", e))?;
        match split_reply(resource, reply)? {
            (true, value) => Ok(value),
            (false, highest) => Err(stale(resource, token, highest)?),
        }
    }

    /// The highest token `resource` has seen, if any.
    pub async fn highest<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        resource: &str,
    ) -> Result<Option<FencingToken>, LockError> {
        check_resource(resource)?;
        let reply: Option<Vec<u8>> = ::redis::cmd("HGET")
            .arg(self.key(resource))
            .arg("token")
            .query_async(conn)
            .await
            .map_err(|e| redis_error(resource, "cannot read the highest token", e))?;
        reply.map(|text| parse_token(resource, &text)).transpose()
    }
}

/// `{flag, bulk-or-nil}` into (accepted, bytes).
fn split_reply(resource: &str, reply: Value) -> Result<(bool, Option<Vec<u8>>), LockError> {
    let unexpected = || {
        LockError::backend(
            KIND,
            Operation::Fence,
            resource,
            "unexpected reply from the fence script",
        )
    };
    let Value::Array(items) = reply else {
        return Err(unexpected());
    };
    let mut items = items.into_iter();
    let accepted = match items.next() {
        Some(Value::Int(flag)) => flag == 1,
        _ => return Err(unexpected()),
    };
    let payload = match items.next() {
        Some(Value::BulkString(bytes)) => Some(bytes),
        Some(Value::SimpleString(text)) => Some(text.into_bytes()),
        Some(Value::Nil) | None => None,
        Some(_) => return Err(unexpected()),
    };
    Ok((accepted, payload))
}

fn stale(
    resource: &str,
    offered: FencingToken,
    highest: Option<Vec<u8>>,
) -> Result<LockError, LockError> {
    let highest = parse_token(resource, highest.as_deref().unwrap_or_default())?;
    Ok(LockError::StaleToken {
        resource: resource.to_owned(),
        offered,
        highest,
    })
}

/// A stored token; anything but a decimal `u64` means someone else wrote
/// the field, which is an error, not a silently reset fence.
fn parse_token(resource: &str, text: &[u8]) -> Result<FencingToken, LockError> {
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse::<u64>().ok())
        .map(FencingToken::new)
        .ok_or_else(|| {
            LockError::backend(
                KIND,
                Operation::Fence,
                resource,
                "the stored fencing token is not a number (the key was written by something else)",
            )
        })
}

fn redis_error(resource: &str, what: &str, err: ::redis::RedisError) -> LockError {
    LockError::backend(KIND, Operation::Fence, resource, format!("{what}: {err}"))
}

//! The one error type every dlock operation returns.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use crate::backend::Holding;
use crate::token::FencingToken;

/// A boxed error from a backend's client library, kept as the source.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Why a lock could not be had, kept, or released.
///
/// Every variant names the key (or the backend) it is about. A generated
/// `#[distributed_lock]` function returns these through `E: From<LockError>`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The key is held by another owner and the call was not allowed to wait.
    ///
    /// The message names the holder when the store could tell:
    /// ``lock `export:7` is held by web-3 (pid 4121, label "billing") since
    /// 12.4 s, expires in 17.6 s``.
    #[error("lock `{key}` is held by {}", held_by(holder.as_deref()))]
    Held {
        /// The key that was held.
        key: String,
        /// Who held it, as the store answered just after the refusal
        /// ([`crate::Backend::holder`]): `None` when it could not tell (it
        /// was released meanwhile, the store keeps no record, the read
        /// failed).
        holder: Option<Box<Holding>>,
    },

    /// The key stayed held for the whole time the call was allowed to wait.
    #[error("timed out after {waited:?} waiting for lock `{key}`")]
    Timeout {
        /// The key that stayed held.
        key: String,
        /// How long the call waited.
        waited: Duration,
    },

    /// The lease ended before its holder released it: the holder must assume
    /// another owner may have acted meanwhile.
    #[error("lease on `{key}` (fencing token {token}) was lost: {reason}")]
    LeaseLost {
        /// The key of the lost lease.
        key: String,
        /// The token the lost lease carried.
        token: FencingToken,
        /// What ended it.
        reason: LostReason,
    },

    /// No backend is registered under the requested name.
    #[error("no lock backend is registered as `{name}` (registered: {registered})")]
    UnknownBackend {
        /// The name that was looked up.
        name: String,
        /// The names that are registered, comma-separated, or `none`.
        registered: String,
    },

    /// The backend's server or storage failed; the source is kept.
    #[error(
        "lock backend `{backend}` failed to {operation}{}: {source}",
        for_key(key)
    )]
    Backend {
        /// The kind of backend (`memory`, `file`, `redis`, `pg`).
        backend: &'static str,
        /// What was being done.
        operation: Operation,
        /// The key it was done to (empty for operations on no key).
        key: String,
        /// The underlying error.
        #[source]
        source: BoxError,
    },

    /// The key is empty, too long or otherwise not usable.
    #[error("invalid lock key {key:?}: {reason}")]
    InvalidKey {
        /// The key, cut to its first 64 characters when longer.
        key: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An option has a value no lock can work with.
    #[error("invalid lock option `{option}`: {reason}")]
    InvalidOption {
        /// The option's name.
        option: &'static str,
        /// What is wrong with its value.
        reason: String,
    },

    /// A lock was used outside a Tokio runtime, which renewal needs.
    #[error("dlock needs a Tokio runtime to keep a lease on `{key}` (called outside one)")]
    NoRuntime {
        /// The key that was to be locked.
        key: String,
    },

    /// A write to a fenced resource carried a token lower than one the
    /// resource has already accepted: its writer's lease had ended.
    #[error(
        "stale fencing token {offered} for resource `{resource}`: it has already accepted token {highest}"
    )]
    StaleToken {
        /// The fenced resource.
        resource: String,
        /// The token the rejected write carried.
        offered: FencingToken,
        /// The highest token the resource had accepted.
        highest: FencingToken,
    },
}

impl LockError {
    /// Wraps a backend client error.
    pub fn backend(
        backend: &'static str,
        operation: Operation,
        key: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        LockError::Backend {
            backend,
            operation,
            key: key.into(),
            source: source.into(),
        }
    }

    /// An [`LockError::InvalidKey`] for `key`, cut to a printable length.
    pub fn invalid_key(key: &str, reason: impl Into<String>) -> Self {
        const SHOWN: usize = 64;
        let shown = match key.char_indices().nth(SHOWN) {
            Some((cut, _)) => format!("{}…", &key[..cut]),
            None => key.to_owned(),
        };
        LockError::InvalidKey {
            key: shown,
            reason: reason.into(),
        }
    }

    /// True when the error means "someone else has it" (held or timed out),
    /// as opposed to a failure.
    pub fn is_contention(&self) -> bool {
        matches!(self, LockError::Held { .. } | LockError::Timeout { .. })
    }
}

/// The holder in a [`LockError::Held`] message: `web-3 (pid 4121, label
/// "billing") since 12.4 s, expires in 17.6 s`, the parts the store could
/// tell, or `someone else`.
fn held_by(holding: Option<&Holding>) -> String {
    let Some(holding) = holding else {
        return "someone else".to_owned();
    };
    let mut text = match &holding.holder {
        Some(holder) => holder.to_string(),
        None => "someone else".to_owned(),
    };
    if let Some(identity) = &holding.identity {
        text.push_str(&format!(" as {identity:?}"));
    }
    if let Some(held_for) = holding.holder.as_ref().and_then(|h| h.held_for) {
        text.push_str(&format!(" since {:.1} s", held_for.as_secs_f64()));
    }
    if let Some(expires_in) = holding.expires_in {
        text.push_str(&format!(", expires in {:.1} s", expires_in.as_secs_f64()));
    }
    text
}

/// " `key`" for a message, or nothing when the operation had no key.
fn for_key(key: &str) -> String {
    if key.is_empty() {
        String::new()
    } else {
        format!(" `{key}`")
    }
}

/// What a backend was doing when it failed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Operation {
    /// Connecting or opening storage.
    Connect,
    /// Taking a lock.
    Acquire,
    /// Renewing a lease.
    Extend,
    /// Releasing a lease.
    Release,
    /// Waiting for a release.
    Wait,
    /// A fenced write.
    Fence,
    /// Reading who holds a key.
    Inspect,
    /// Listing the held keys under a prefix (the key is the prefix).
    List,
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Operation::Connect => "connect",
            Operation::Acquire => "acquire",
            Operation::Extend => "extend",
            Operation::Release => "release",
            Operation::Wait => "wait for",
            Operation::Fence => "fence a write to",
            Operation::Inspect => "read the holder of",
            Operation::List => "list the held keys under",
        })
    }
}

/// Why a lease was lost.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum LostReason {
    /// The ttl ran out before a renewal went through.
    Expired,
    /// The backend reports the key gone or owned by someone else.
    NotOwner,
    /// The backend could not be reached to renew before the ttl ran out;
    /// the text is the last error seen.
    Unreachable(String),
    /// The backend's session that held the lock ended (for example a
    /// PostgreSQL connection that died).
    SessionEnded(String),
    /// Its holder released it; nothing may be done under it any more.
    Released,
    /// The runtime whose task renewed it shut down: nobody renews it any
    /// more, so it is given up at once rather than trusted until its ttl.
    RuntimeGone,
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LostReason::Expired => f.write_str("its ttl ran out before it was renewed"),
            LostReason::NotOwner => f.write_str("the backend no longer has it under this owner"),
            LostReason::Unreachable(err) => {
                write!(
                    f,
                    "the backend was unreachable until the ttl ran out ({err})"
                )
            }
            LostReason::SessionEnded(why) => write!(f, "the session holding it ended ({why})"),
            LostReason::Released => f.write_str("its holder released it"),
            LostReason::RuntimeGone => {
                f.write_str("the runtime that renewed it shut down, so it is no longer renewed")
            }
        }
    }
}

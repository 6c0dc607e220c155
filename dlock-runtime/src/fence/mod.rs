//! Fencing at the resource: the check that makes a lock safe.
//!
//! A lease can end while its holder still believes it holds the lock (a
//! pause longer than the ttl, a partition). Only the protected resource can
//! tell such a stale holder from the current one: it remembers the highest
//! fencing token it has accepted and refuses writes that carry a lower one.
//!
//! ```text
//!  A: acquire (token 7) ── read ── ▒▒▒ paused past the ttl ▒▒▒ ── write(7) ✗ StaleToken
//!  B:                      ttl runs out ── acquire (token 8) ── read ── write(8) ✓
//! ```
//!
//! Three resources ship the check, all with the same rule (accept a token
//! `>=` the highest accepted, and remember it; otherwise
//! [`LockError::StaleToken`] naming the resource, the offered and the highest
//! token):
//!
//! - [`FencedCell`]: a value in memory, for tests and examples.
//! - [`PgFence`] in `dlock::pg::fence` (feature `pg`): a check inside the
//!   caller's own PostgreSQL transaction, backed by a table of resource →
//!   highest token.
//! - [`RedisFence`] in `dlock::redis::fence` (feature `redis`): a Lua script
//!   that sets a Redis value only under a token at least as high as the
//!   stored one.
//!
//! The PostgreSQL and Redis fences live beside their backends; this module
//! holds what every fence shares ([`check_resource`], [`MAX_RESOURCE_LEN`]),
//! so a fence for another store checks its resource names the same way.
//!
//! A token is a plain number, so the token of any backend fences any
//! resource: a Redis lock can guard a PostgreSQL table and vice versa. What
//! matters is that one resource is always written under one lock key, whose
//! tokens only rise.
//!
//! ## Reads count too
//!
//! A read-modify-write must show its token when it reads, not only when it
//! writes. Otherwise: A (token 7) reads 5 and pauses; B (token 8) reads 5;
//! A resumes and writes 6 under 7 (accepted: nothing above 7 was seen yet);
//! B writes 6 under 8 (accepted) — an increment is lost although no write
//! was stale. Once B's *read* has raised the highest token to 8, A's write
//! is refused. [`RedisFence::read`] records the reader's token; with
//! [`PgFence`], call `accept` in the transaction that reads as well as in
//! the one that writes (or do both in one transaction). [`FencedCell::write`]
//! reads and writes in one step, so it needs nothing more.
//!
//! ## Read-write locks and permits
//!
//! The same rule fences both sides of a read-write lock
//! ([`LockOptions::mode`](crate::LockOptions::mode)), on one resource
//! name: an exclusive token is above every token issued before for the key,
//! readers' included, and readers that overlap share one token (their read
//! phase's), above every writer's before them and not above any token
//! issued after. So "accept `>=` the highest" refuses a stale writer (a
//! later reader or writer raised the highest above it) and never a current
//! reader (its phase's token is the highest, or equal to it: no writer can
//! have come in while its phase lasts). A stale *reader*, one whose phase
//! ended and a writer came, is refused as well.
//!
//! A permit ([`LockOptions::permits`](crate::LockOptions::permits)) is
//! fenced per slot: its token rises per key and slot, not across the
//! slots of one key held at once, so give each slot a resource name of its
//! own (`"pool:3"`, from [`Lease::slot`](crate::Lease::slot)).
//!
//! [`PgFence`]: https://docs.rs/dlock/latest/dlock/pg/fence/struct.PgFence.html
//! [`RedisFence`]: https://docs.rs/dlock/latest/dlock/redis/fence/struct.RedisFence.html
//! [`RedisFence::read`]: https://docs.rs/dlock/latest/dlock/redis/fence/struct.RedisFence.html#method.read

use std::sync::{Mutex, PoisonError};

use crate::error::LockError;
use crate::token::FencingToken;

/// A value in memory that only accepts writes carrying a fencing token at
/// least as high as the highest it has accepted.
///
/// ```
/// use dlock_runtime::{fence::FencedCell, FencingToken, LockError};
///
/// let cell = FencedCell::new("balance", 100);
/// cell.write(FencingToken::new(8), |v| *v -= 30)?;      // the current holder
/// let stale = cell.write(FencingToken::new(7), |v| *v -= 30); // a paused one
/// assert!(matches!(stale, Err(LockError::StaleToken { .. })));
/// assert_eq!(cell.read(), (70, Some(FencingToken::new(8))));
/// # Ok::<(), LockError>(())
/// ```
#[derive(Debug)]
pub struct FencedCell<T> {
    resource: String,
    state: Mutex<(T, Option<FencingToken>)>,
}

impl<T> FencedCell<T> {
    /// A cell named `resource` (the name goes into stale-token errors).
    pub fn new(resource: impl Into<String>, value: T) -> Self {
        Self {
            resource: resource.into(),
            state: Mutex::new((value, None)),
        }
    }

    /// Applies `update` if `token` is at least the highest accepted token,
    /// and records `token`; otherwise changes nothing and returns
    /// [`LockError::StaleToken`]. The check and the update are one step.
    pub fn write<R>(
        &self,
        token: FencingToken,
        update: impl FnOnce(&mut T) -> R,
    ) -> Result<R, LockError> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(highest) = state.1
            && token < highest
        {
            return Err(LockError::StaleToken {
                resource: self.resource.clone(),
                offered: token,
                highest,
            });
        }
        state.1 = Some(token);
        Ok(update(&mut state.0))
    }

    /// The highest accepted token, if any write was accepted.
    pub fn highest(&self) -> Option<FencingToken> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).1
    }

    /// The resource name.
    pub fn resource(&self) -> &str {
        &self.resource
    }
}

impl<T: Clone> FencedCell<T> {
    /// The current value and the highest accepted token.
    pub fn read(&self) -> (T, Option<FencingToken>) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The longest resource name the PostgreSQL and Redis fences accept (the
/// same bound as a lock key).
pub const MAX_RESOURCE_LEN: usize = crate::key::MAX_KEY_LEN;

/// Checks a resource name before a fence sends it to its store: not empty,
/// at most [`MAX_RESOURCE_LEN`] bytes, no NUL (which PostgreSQL text cannot
/// hold). A refused name is [`LockError::InvalidOption`] for the option
/// `resource`, and nothing is sent.
///
/// ```
/// use dlock_runtime::fence::check_resource;
///
/// assert!(check_resource("invoice:42").is_ok());
/// assert!(check_resource("").is_err());
/// assert!(check_resource("a\0b").is_err());
/// ```
pub fn check_resource(resource: &str) -> Result<(), LockError> {
    let reason = if resource.is_empty() {
        "a fenced resource needs a non-empty name".to_owned()
    } else if resource.len() > MAX_RESOURCE_LEN {
        format!(
            "a fenced resource name is at most {MAX_RESOURCE_LEN} bytes, this one has {}",
            resource.len()
        )
    } else if resource.contains('\0') {
        "a fenced resource name must not contain NUL".to_owned()
    } else {
        return Ok(());
    };
    Err(LockError::InvalidOption {
        option: "resource",
        reason,
    })
}

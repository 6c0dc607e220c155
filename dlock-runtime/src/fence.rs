//! Fencing at the resource: the check that makes a lock safe.
//!
//! A lease can end while its holder still believes it holds the lock (a
//! pause longer than the ttl, a partition). Only the protected resource can
//! tell such a stale holder from the current one: it remembers the highest
//! fencing token it has accepted and refuses writes that carry a lower one.

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

//! What `#[distributed_lock]` expansions call: the support code of the
//! macro, reached by generated code as `dlock::__private::…` (the `dlock`
//! facade re-exports this module under that name, and `crate = "…"` points
//! generated code at another path to the facade).
//!
//! Not a public API: it is `#[doc(hidden)]`, outside semver, and may change
//! in any release together with the macro that calls it.

use std::future::Future;

pub use crate::registry::{BackendSlot, DEFAULT_BACKEND};
pub use crate::{
    FencingToken, FencingTokens, KeyBuilder, Lease, LeaseSet, LockError, LockOptions, LostSignal,
};
pub use core::time::Duration;

/// The return types a locked function may have: anything that can carry a
/// [`LockError`], that is `Result<T, E>` with `E: From<LockError>`.
#[diagnostic::on_unimplemented(
    message = "`#[distributed_lock]` needs a return type that can carry a `dlock::LockError`, found `{Self}`",
    label = "this type cannot carry a `dlock::LockError`",
    note = "return `Result<T, E>` where `E: From<dlock::LockError>` (for example `Result<T, dlock::LockError>`)"
)]
pub trait LockResult: Sized {
    /// Wraps a lock failure into the function's return type.
    fn from_lock_error(err: LockError) -> Self;
}

impl<T, E: From<LockError>> LockResult for Result<T, E> {
    fn from_lock_error(err: LockError) -> Self {
        Err(E::from(err))
    }
}

/// What happens to the body when the lease is lost while it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnLost {
    /// Cancel the body and return the `LeaseLost` error (the default).
    Abort,
    /// Let the body finish and return its result; the loss is logged.
    Finish,
}

/// Runs a locked body and releases the lease afterwards.
pub async fn run<R, F>(lease: Lease, on_lost: OnLost, body: F) -> R
where
    R: LockResult,
    F: Future<Output = R>,
{
    let out = match on_lost {
        OnLost::Abort => lease.run(body).await,
        OnLost::Finish => Ok(body.await),
    };
    conclude(out, lease.release().await)
}

/// [`run`] for a lease on several keys.
pub async fn run_many<R, F>(leases: LeaseSet, on_lost: OnLost, body: F) -> R
where
    R: LockResult,
    F: Future<Output = R>,
{
    let out = match on_lost {
        OnLost::Abort => leases.run(body).await,
        OnLost::Finish => Ok(body.await),
    };
    conclude(out, leases.release().await)
}

/// The function's result once the lease is released (also after a loss:
/// release is owner-checked, so it cannot touch whoever holds the key now).
fn conclude<R: LockResult>(out: Result<R, LockError>, released: Result<(), LockError>) -> R {
    match out {
        Ok(out) => {
            if let Err(err) = released {
                // The body's work is done and its writes carried the token;
                // its result is returned so it is not lost, and the failure
                // is logged.
                tracing::warn!(error = %err, "releasing after the locked body failed; the body's result is returned");
            }
            out
        }
        Err(lost) => R::from_lock_error(lost),
    }
}

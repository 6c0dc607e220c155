//! # dlock: distributed locks that are actually safe
//!
//! Annotate an async function and at most one replica runs it at a time for
//! a key; the body gets a monotonic [`FencingToken`] to send with every write,
//! and [`fence`] holds the resource-side checks that reject stale tokens.
//!
//! ```
//! use dlock::{distributed_lock, memory::MemoryBackend, registry, FencingToken, LockError};
//!
//! #[distributed_lock(key = "export:{tenant}", ttl = "30s")]
//! async fn export(tenant: u64, token: FencingToken) -> Result<String, LockError> {
//!     Ok(format!("tenant {tenant} exported under token {token}"))
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), LockError> {
//! registry().register("default", MemoryBackend::new());
//! let report = export(42).await?; // callers never pass the token
//! assert!(report.starts_with("tenant 42 exported"));
//! # Ok(())
//! # }
//! ```
//!
//! The same, without the attribute, through [`LockOptions`]:
//!
//! ```
//! # use dlock::{memory::MemoryBackend, registry, LockError, LockOptions, LockKey};
//! # use std::time::Duration;
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), LockError> {
//! # registry().register("default", MemoryBackend::new());
//! let tenant = 42;
//! let key = LockKey::builder().lit("export:").value(&tenant).finish()?;
//! let lease = LockOptions::new(Duration::from_secs(30)).acquire(key).await?;
//! let token = lease.token();
//! // ... work, sending `token` with every write ...
//! lease.release().await?;
//! # let _ = token;
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub use dlock_macros::distributed_lock;
#[cfg(feature = "axum")]
pub use dlock_runtime::http;
#[cfg(feature = "pg")]
pub use dlock_runtime::pg;
#[cfg(feature = "redis")]
pub use dlock_runtime::redis;
pub use dlock_runtime::{
    Backend, FencingToken, FencingTokens, HolderInfo, Holding, IntoLockKey, KeyBuilder, Lease,
    LeaseSet, LockError, LockKey, LockOptions, LostReason, LostSignal, Registry, registry,
};
pub use dlock_runtime::{
    backend, election, error, fence, file, holder, key, lease, memory, options, token,
};
#[cfg(feature = "conformance")]
pub use dlock_runtime::{conformance, conformance_suite};

// What `#[distributed_lock]` expansions call (`::dlock::__private::…`, or
// `<crate = "…">::__private::…`). It lives in the runtime and is not public
// API: it may change in any release.
#[doc(hidden)]
pub use dlock_runtime::__private;

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

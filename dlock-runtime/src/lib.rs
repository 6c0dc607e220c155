//! The runtime of [dlock](https://docs.rs/dlock): everything that runs.
//!
//! Users depend on the `dlock` facade, which re-exports this crate; the
//! `#[distributed_lock]` macro expands to calls into it.
//!
//! - [`FencingToken`]: the monotonic number every acquisition returns.
//! - [`Backend`]: the few primitives a lock store implements.
//! - [`Lease`]: a held lock, renewed in the background, with a lost signal,
//!   released explicitly or on drop.
//! - [`LockOptions`]: the programmatic API (ttl, wait, renewal, minimum hold,
//!   backend name) and `acquire`/`acquire_many`.
//! - [`registry()`]: backends by name.
//! - [`fence`]: resource-side checks that reject stale tokens.
//! - [`election`]: leader election on any backend.
//! - Backends: [`memory`] and [`file`](mod@file); with their features,
//!   `redis`, `pg` and `etcd`.
//! - With the `axum` feature, `http`: `LockError` as an HTTP response.

#![warn(missing_docs)]

// What `#[distributed_lock]` expansions call, re-exported by the facade as
// `dlock::__private`. Not public API: it may change in any release.
#[doc(hidden)]
pub mod __private;
pub mod backend;
#[cfg(feature = "conformance")]
pub mod conformance;
pub mod election;
pub mod error;
#[cfg(feature = "etcd")]
pub mod etcd;
mod fallback;
pub mod fence;
pub mod file;
pub mod holder;
#[cfg(feature = "axum")]
pub mod http;
pub mod key;
pub mod lease;
pub mod memory;
pub mod options;
#[cfg(feature = "pg")]
pub mod pg;
#[cfg(feature = "redis")]
pub mod redis;
pub mod registry;
pub mod token;

pub use backend::{
    Access, Attempt, Backend, ForceRelease, Grant, Holding, LossGroup, OwnerId, ReleaseNotice,
    ReleaseOutcome, Renewal,
};
pub use error::{BoxError, LockError, LostReason, Operation};
pub use holder::HolderInfo;
pub use key::{KeyBuilder, LockKey, MAX_KEY_LEN};
pub use lease::{Lease, LeaseSet, LostSignal};
pub use options::{IntoLockKey, LockMode, LockOptions, MAX_DURATION};
pub use registry::{DEFAULT_BACKEND, Registry, registry};
pub use token::{FencingToken, FencingTokens};

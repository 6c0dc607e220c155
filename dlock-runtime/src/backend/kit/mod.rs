//! What a backend needs besides the [`Backend`](crate::Backend) trait: the
//! helpers every in-tree backend builds on, public so that a backend of
//! your own builds on the same ones.
//!
//! The in-tree backends (`memory`, `file`, `redis`, `pg`, `etcd`) use from
//! the core only what is public; this module is the part of it that is not
//! the trait and its values:
//!
//! - [`detach`]: work that must finish even if its caller stops waiting
//!   ([`Detachable`](detach::Detachable)): a lock the store granted to a
//!   caller that gave up is given back, an unlock half-way is finished.
//! - [`on_fallback_runtime`]: whether the caller runs on dlock's fallback
//!   runtime, where work left behind by a runtime that shut down finishes.
//! - [`percent`]: `%xx` decoding of URLs, for a backend that takes its
//!   credentials in a connection URL.
//! - [`userinfo`]: where a URL's user info ends, one rule for every URL a
//!   backend reads, redacts or refuses, so that no part of a password is
//!   ever shown.
//! - [`after`]: a deadline `span` from now that never overflows, for the
//!   ttls and entry lives a backend is handed.
//!
//! Elsewhere in the public API, and also meant for backends:
//! [`named_token`](super::named_token) and
//! [`ForceRelease::compare`](super::ForceRelease::compare) for
//! `force_release_holding`, [`QUEUE_ENTRY_TTL`](super::QUEUE_ENTRY_TTL)
//! for fair queues and writer marks,
//! [`check_label`](crate::holder::check_label) for a backend's own label,
//! [`HolderInfo::encode`](crate::HolderInfo::encode) and
//! [`HolderInfo::decode`](crate::HolderInfo::decode) for the holder record,
//! and [`fence::check_resource`](crate::fence::check_resource) for a
//! resource-side fence on another store.
//!
//! The chapter [Implementing a backend](super::implementing) walks through a
//! complete backend.

pub mod detach;
pub mod percent;
pub mod userinfo;

/// The instant `span` after `now`, or a century on where the clock cannot
/// count that far. The core sends no ttl of 40 days or more (it refuses
/// them), but a caller of [`Backend`](crate::Backend) itself may send any
/// `Duration`, `Duration::MAX` included: a backend answers it, grant or
/// error, and never panics on `now + span`.
pub fn after(now: tokio::time::Instant, span: std::time::Duration) -> tokio::time::Instant {
    now.checked_add(span)
        .unwrap_or_else(|| now + std::time::Duration::from_secs(100 * 365 * 86_400))
}

/// True when the caller runs on dlock's fallback runtime: the one thread,
/// started on first use, where work that must happen after its caller is
/// gone (a release on drop, giving back an abandoned acquisition) finishes
/// when the runtime it was spawned on shuts down, or when there is none.
///
/// Work there only finishes what callers left behind, each piece bounded in
/// time. A backend that keeps state tied to a runtime (connections
/// opened and driven there, say) asks this before it adopts the caller's
/// runtime as its new home: the fallback runtime is no home to open
/// connections on.
///
/// ```
/// use dlock_runtime::backend::kit::on_fallback_runtime;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // An application's runtime is never the fallback one.
/// assert!(!on_fallback_runtime());
/// # }
/// ```
pub fn on_fallback_runtime() -> bool {
    crate::fallback::is_current()
}

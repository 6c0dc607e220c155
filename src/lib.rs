//! # dlock: distributed locks that are actually safe
//!
//! Annotate an async function and at most one replica runs it at a time for
//! a key; the body gets a monotonic [`FencingToken`] to send with every write,
//! and [`fence`] holds the resource-side checks that reject stale tokens.
//!
//! The three uses it is made for come first: a handler that runs on one
//! replica at a time per key, a scheduled job that runs at most once per
//! interval across the fleet, and a write the resource accepts only from the
//! current holder. The examples lock in this process's memory, so they run
//! without a server; to lock across a fleet, register a shared backend under
//! the same name instead: `RedisBackend::connect("redis://10.0.0.5/").await?`
//! (`dlock::redis`) or `PgBackend::connect("host=db user=app").await?`
//! (`dlock::pg`), both default features.
//!
//! ## A handler: one replica at a time per key
//!
//! A call for a key another replica holds does not wait (unless `wait = "5s"`
//! says so): it returns [`LockError::Held`], which names the holder when the
//! store can tell.
//!
//! ```
//! use std::time::Duration;
//! use dlock::{distributed_lock, memory::MemoryBackend, registry, LockError, LockOptions};
//!
//! #[distributed_lock(key = "order:{id}", ttl = "30s")]
//! async fn ship(id: u64) -> Result<String, LockError> {
//!     Ok(format!("order {id} shipped"))
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), LockError> {
//! registry().register("default", MemoryBackend::new());
//! assert_eq!(ship(7).await?, "order 7 shipped");
//!
//! // Another replica is shipping order 7 (here, a lease this process takes).
//! let shipping = LockOptions::new(Duration::from_secs(30)).acquire("order:7").await?;
//! match ship(7).await {
//!     Err(LockError::Held { holder, .. }) => {
//!         // Who holds it, when the store can tell: host, pid, label, held for.
//!         let who = holder.and_then(|holding| holding.holder);
//! #       assert_eq!(who.as_ref().map(|who| who.pid), Some(std::process::id()));
//!         match who {
//!             Some(who) => println!("order 7 is being shipped by {who}"),
//!             None => println!("order 7 is being shipped elsewhere"),
//!         }
//!     }
//!     result => panic!("expected Held, got {result:?}"),
//! }
//! shipping.release().await?;
//! assert!(ship(7).await.is_ok());
//! # Ok(())
//! # }
//! ```
//!
//! The error's own message says the same in one line: ``lock `order:7` is
//! held by web-3 (pid 4121) since 2.1 s, expires in 27.9 s``. With the
//! `axum` feature, `LockError` is an axum response (`Held` is 409 Conflict,
//! with a `Retry-After`), so a locked axum handler returns it as it is.
//!
//! ## A scheduled job: at most once per interval
//!
//! Every replica runs the same scheduler; on each tick, the one whose call
//! takes the key runs the job and the others get `Held`. `min_hold` keeps the
//! key held for that long after the job starts, however fast it ends, so a
//! replica whose tick comes a little later (clocks and timers drift) finds it
//! still held instead of running the job a second time (ShedLock's
//! `lockAtLeastFor`). Keep it a little under the interval, and at most the
//! ttl.
//!
//! ```
//! use std::time::Duration;
//! use dlock::{distributed_lock, memory::MemoryBackend, registry, LockError};
//!
//! #[distributed_lock(key = "job:hourly-report", ttl = "1h", min_hold = "55m")]
//! async fn hourly_report() -> Result<(), LockError> {
//!     // build and send the report
//!     Ok(())
//! }
//!
//! /// One tick of a replica's scheduler: whether this replica ran the job.
//! async fn tick() -> Result<bool, LockError> {
//!     match hourly_report().await {
//!         Ok(()) => Ok(true),
//!         Err(LockError::Held { .. }) => Ok(false), // another replica has this hour
//!         Err(err) => Err(err),
//!     }
//! }
//!
//! /// What every replica runs.
//! async fn scheduler(replica: &str) {
//!     let mut hourly = tokio::time::interval(Duration::from_secs(60 * 60));
//!     loop {
//!         hourly.tick().await;
//!         match tick().await {
//!             Ok(true) => println!("{replica}: report sent"),
//!             Ok(false) => {}
//!             Err(err) => eprintln!("{replica}: {err}"), // try again next hour
//!         }
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), LockError> {
//! registry().register("default", MemoryBackend::new());
//! // Three replicas tick at once: one of them runs the job.
//! let (a, b, c) = tokio::join!(tick(), tick(), tick());
//! assert_eq!([a?, b?, c?].into_iter().filter(|&ran| ran).count(), 1);
//! // A fourth ticks later, after the job has finished and released the
//! // key: within the 55 minutes it does not run it again.
//! assert!(!tick().await?);
//! # Ok(())
//! # }
//! ```
//!
//! ## A fenced write: a stale holder is refused
//!
//! A lease can end while its holder still believes it holds the key (a pause
//! longer than the ttl, a partition), and then another replica takes it. A
//! parameter of type [`FencingToken`] receives the lease's token, which rises
//! with every acquisition; the resource remembers the highest token it has
//! accepted and refuses lower ones with [`LockError::StaleToken`].
//! [`fence::FencedCell`] is that check in memory; for real resources,
//! `pg::fence::PgFence` checks inside your own PostgreSQL transaction and
//! `redis::fence::RedisFence` sets a Redis value in one script.
//!
//! ```
//! use std::time::Duration;
//! use dlock::{distributed_lock, fence::FencedCell, memory::MemoryBackend, registry};
//! use dlock::{FencingToken, LockError, LockOptions};
//!
//! #[distributed_lock(key = "account:{id}", ttl = "30s")]
//! async fn withdraw(
//!     balance: &FencedCell<i64>,
//!     id: u64,
//!     amount: i64,
//!     token: FencingToken, // bound by the lock: callers do not pass it
//! ) -> Result<i64, LockError> {
//!     balance.write(token, |balance| {
//!         *balance -= amount;
//!         *balance
//!     })
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), LockError> {
//! registry().register("default", MemoryBackend::new());
//! let balance = FencedCell::new("account:1", 100);
//!
//! // Replica A takes the key, then pauses past its ttl (here: it lets go).
//! let a = LockOptions::new(Duration::from_secs(30)).acquire("account:1").await?;
//! let a_token = a.token();
//! a.release().await?;
//!
//! // Replica B takes it with a higher token; its write is accepted.
//! assert_eq!(withdraw(&balance, 1, 30).await?, 70);
//!
//! // A wakes up and writes with its old token: refused, nothing changes.
//! let stale = balance.write(a_token, |balance| *balance -= 30);
//! assert!(matches!(stale, Err(LockError::StaleToken { .. })));
//! assert_eq!(balance.read().0, 70);
//! # Ok(())
//! # }
//! ```
//!
//! ## The attribute and its programmatic twin
//!
//! The attribute's options (`wait`, `renew`, `on_lost`, `keys`, `backend`,
//! ...) are listed on [`distributed_lock`]. A parameter of type
//! [`FencingToken`] (or [`LostSignal`]) is bound by the lock, and the
//! function returns `Result<T, E>` with `E: From<LockError>`:
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
//!
//! ## Where things are
//!
//! - Backends, registered by name in [`registry()`]: [`memory`] (one
//!   process), [`file`](mod@file) (the processes of one host), and with
//!   their features, `redis`, `pg` and `etcd`. [`Backend`] is the trait a backend
//!   of your own implements; feature `conformance` ships the suite it must
//!   pass.
//! - [`fence`]: the resource-side checks, in memory; those for PostgreSQL
//!   and Redis are `pg::fence` and `redis::fence`.
//! - [`election`]: leader election on any backend.
//! - [`holder`]: who holds a lock (host, pid, label, since when).
//! - [`Lease`]: a held lock, renewed in the background, with a lost signal.
//! - Feature `axum`: `http`, [`LockError`] as an HTTP response.

#![warn(missing_docs)]

pub use dlock_macros::distributed_lock;
#[cfg(feature = "etcd")]
pub use dlock_runtime::etcd;
#[cfg(feature = "axum")]
pub use dlock_runtime::http;
#[cfg(feature = "pg")]
pub use dlock_runtime::pg;
#[cfg(feature = "redis")]
pub use dlock_runtime::redis;
pub use dlock_runtime::{
    Backend, FencingToken, FencingTokens, HolderInfo, Holding, IntoLockKey, KeyBuilder, Lease,
    LeaseSet, LockError, LockKey, LockMode, LockOptions, LostReason, LostSignal, Registry,
    registry,
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

/// The examples of `docs/safety.md`, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/safety.md")]
pub struct SafetyDocDoctests;

/// The examples of `docs/macro.md`, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/macro.md")]
pub struct MacroDocDoctests;

/// The examples of `docs/backends.md`, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/backends.md")]
pub struct BackendsDocDoctests;

/// The examples of `docs/redis.md`, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/redis.md")]
pub struct RedisDocDoctests;

/// The examples of `docs/postgres.md`, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/postgres.md")]
pub struct PostgresDocDoctests;

/// The examples of `docs/etcd.md`, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/etcd.md")]
pub struct EtcdDocDoctests;

/// The examples of `docs/modes.md`, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/modes.md")]
pub struct ModesDocDoctests;

/// The examples of `docs/fair.md`, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/fair.md")]
pub struct FairDocDoctests;

/// The examples of `docs/election.md`, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/election.md")]
pub struct ElectionDocDoctests;

/// The examples of `docs/axum.md`, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/axum.md")]
pub struct AxumDocDoctests;

/// The examples of `docs/inspecting.md`, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/inspecting.md")]
pub struct InspectingDocDoctests;

/// The examples of `docs/metrics.md`, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/metrics.md")]
pub struct MetricsDocDoctests;

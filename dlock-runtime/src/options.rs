//! Lock options and the programmatic entry point: `LockOptions::acquire`.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::{Access, Backend};
use crate::error::LockError;
use crate::key::LockKey;
use crate::lease::{self, Lease, LeaseSet};
use crate::registry::{DEFAULT_BACKEND, registry};

/// The longest ttl, wait or minimum hold accepted (30 days): longer values
/// are almost certainly unit mistakes.
pub const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// How a lock is taken and kept: the programmatic twin of the
/// `#[distributed_lock(...)]` options.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_runtime::LockError> {
/// use std::time::Duration;
/// use dlock_runtime::{registry, memory::MemoryBackend, LockOptions};
///
/// registry().register("doc-options", MemoryBackend::new());
/// let options = LockOptions::new(Duration::from_secs(30))
///     .backend("doc-options")
///     .wait(Duration::from_secs(5));
/// let lease = options.acquire("export:42").await?;
/// println!("holding {} with token {}", lease.key(), lease.token());
/// lease.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct LockOptions {
    pub(crate) ttl: Duration,
    pub(crate) wait: Duration,
    pub(crate) renew: bool,
    pub(crate) min_hold: Duration,
    pub(crate) fair: bool,
    pub(crate) mode: LockMode,
    pub(crate) permits: Option<u32>,
    pub(crate) backend: Cow<'static, str>,
}

/// Which side of a read-write lock an acquisition takes
/// ([`LockOptions::mode`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockMode {
    /// Alone (the default): the write side, and today's plain lock.
    #[default]
    Exclusive,
    /// Beside other shared holders, never beside an exclusive one: the
    /// read side.
    Shared,
}

impl LockOptions {
    /// Options with the given ttl: no waiting, renewal on, no minimum hold,
    /// the backend registered as `"default"`.
    pub const fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            wait: Duration::ZERO,
            renew: true,
            min_hold: Duration::ZERO,
            fair: false,
            mode: LockMode::Exclusive,
            permits: None,
            backend: Cow::Borrowed(DEFAULT_BACKEND),
        }
    }

    /// How long to wait for a held key before failing with
    /// [`LockError::Timeout`]. Zero (the default) fails at once with
    /// [`LockError::Held`].
    ///
    /// The wait bounds the time spent waiting for the holder, not a single
    /// request to the backend: an attempt already sent when the wait runs
    /// out is answered first, within the backend's own timeouts (the Redis
    /// backend's `response_timeout`, for example).
    pub const fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Whether a live holder renews its lease in the background (on by
    /// default, every third of the ttl). Off, the lease is lost when the ttl
    /// runs out, and the holder is told.
    pub const fn renew(mut self, renew: bool) -> Self {
        self.renew = renew;
        self
    }

    /// Keeps the key held for at least this long after acquisition, even if
    /// released earlier (ShedLock's `lockAtLeastFor`): a job that runs fast
    /// on one replica is not run again at once by a replica whose clock is
    /// a little behind. Must not exceed the ttl.
    ///
    /// The store keeps the hold only as long as it keeps the lock: on Redis
    /// that outlives the holder's process, but a PostgreSQL session lock
    /// and a file lock end with the process that holds them, so a process
    /// that exits right after releasing ends its hold with it.
    pub const fn min_hold(mut self, min_hold: Duration) -> Self {
        self.min_hold = min_hold;
        self
    }

    /// Fair mode (off by default): waiters queue in arrival order, and a
    /// release hands the key straight to the first live one, which holds it
    /// without another attempt (one round trip from release to the next
    /// holder, where a plain lock's woken waiters race for it). A releaser
    /// that loops back joins the end of the queue.
    ///
    /// A waiter that dies, gives up or is cancelled never blocks the queue:
    /// it leaves the queue as it goes, and an entry whose waiter vanished
    /// without a word lives [`QUEUE_ENTRY_TTL`](crate::backend::QUEUE_ENTRY_TTL)
    /// at most. Fencing, renewal, the lost signal and release on drop are
    /// as for any lease; a handed-over key's token is greater than its
    /// previous holder's.
    ///
    /// Every shipped backend has it; a backend without it refuses the
    /// acquisition with [`LockError::InvalidOption`]. Plain callers on the
    /// same key are not queued: they take a free key whoever waits, so use
    /// one mode per key.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_runtime::LockError> {
    /// use std::time::Duration;
    /// use dlock_runtime::{registry, memory::MemoryBackend, LockOptions};
    ///
    /// registry().register("doc-fair", MemoryBackend::new());
    /// let options = LockOptions::new(Duration::from_secs(30))
    ///     .backend("doc-fair")
    ///     .wait(Duration::from_secs(5))
    ///     .fair(true);
    /// let lease = options.acquire("payouts").await?;
    /// lease.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub const fn fair(mut self, fair: bool) -> Self {
        self.fair = fair;
        self
    }

    /// Which side of a read-write lock to take: [`LockMode::Exclusive`]
    /// (the default) or [`LockMode::Shared`]. Shared holders of a key
    /// coexist and exclude exclusive ones; a writer that waits is not
    /// starved by a stream of readers (new readers wait behind it).
    ///
    /// Tokens: an exclusive lease's token is above every token issued
    /// before for the key, readers' included; readers that overlap share
    /// one token, above every writer's before them. A resource that fences
    /// with "accept a token `>=` the highest accepted" so refuses a stale
    /// writer and never a current reader (see [`crate::fence`]).
    ///
    /// A backend without shared locks refuses it with
    /// [`LockError::InvalidOption`]; not with [`LockOptions::fair`] nor
    /// [`LockOptions::permits`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_runtime::LockError> {
    /// use std::{sync::Arc, time::Duration};
    /// use dlock_runtime::{memory::MemoryBackend, Backend, LockMode, LockOptions};
    ///
    /// let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    /// let read = LockOptions::new(Duration::from_secs(30)).mode(LockMode::Shared);
    /// let a = read.acquire_on(backend.clone(), "config").await?;
    /// let b = read.acquire_on(backend.clone(), "config").await?;
    /// assert_eq!(a.token(), b.token());
    /// let write = LockOptions::new(Duration::from_secs(30));
    /// assert!(write.acquire_on(backend.clone(), "config").await.is_err());
    /// let read_token = a.token();
    /// a.release().await?;
    /// b.release().await?;
    /// let w = write.acquire_on(backend.clone(), "config").await?;
    /// assert!(w.token() > read_token);
    /// w.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub const fn mode(mut self, mode: LockMode) -> Self {
        self.mode = mode;
        self
    }

    /// A semaphore: at most `permits` holders of the key at once, across
    /// every process. Each lease holds a numbered slot in `0..permits`
    /// ([`Lease::slot`]), whose token rises per slot, so a resource can
    /// fence per slot. Must be at least 1; not with [`LockMode::Shared`]
    /// nor [`LockOptions::fair`]. Callers of one key agree on the number.
    /// A backend without permits refuses it with
    /// [`LockError::InvalidOption`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_runtime::LockError> {
    /// use std::{sync::Arc, time::Duration};
    /// use dlock_runtime::{memory::MemoryBackend, Backend, LockOptions};
    ///
    /// let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    /// let two = LockOptions::new(Duration::from_secs(30)).permits(2);
    /// let a = two.acquire_on(backend.clone(), "uploads").await?;
    /// let b = two.acquire_on(backend.clone(), "uploads").await?;
    /// assert_ne!(a.slot(), b.slot());
    /// assert!(two.acquire_on(backend.clone(), "uploads").await.is_err());
    /// a.release().await?;
    /// b.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub const fn permits(mut self, permits: u32) -> Self {
        self.permits = Some(permits);
        self
    }

    /// How the key is held, as the backend is asked ([`Access`]).
    pub fn access(&self) -> Access {
        match (self.permits, self.mode) {
            (Some(permits), _) => Access::Permits { permits },
            (None, LockMode::Shared) => Access::Shared,
            (None, _) => Access::Exclusive,
        }
    }

    /// The registry name of the backend to lock with.
    pub fn backend(mut self, name: impl Into<Cow<'static, str>>) -> Self {
        self.backend = name.into();
        self
    }

    /// The ttl.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Checks every value; [`LockOptions::acquire`] does this too.
    pub fn validate(&self) -> Result<(), LockError> {
        let bad = |option, reason: String| Err(LockError::InvalidOption { option, reason });
        if self.ttl.is_zero() {
            return bad("ttl", "must be greater than zero".into());
        }
        if self.ttl < Duration::from_millis(10) {
            return bad("ttl", format!("{:?} is below the 10ms minimum", self.ttl));
        }
        for (option, value) in [
            ("ttl", self.ttl),
            ("wait", self.wait),
            ("min_hold", self.min_hold),
        ] {
            if value > MAX_DURATION {
                return bad(option, format!("{value:?} is above the 30-day maximum"));
            }
        }
        if self.min_hold > self.ttl {
            return bad(
                "min_hold",
                format!(
                    "{:?} is longer than the ttl {:?}: a lease cannot be kept past its ttl",
                    self.min_hold, self.ttl
                ),
            );
        }
        if self.permits == Some(0) {
            return bad("permits", "must be at least 1".into());
        }
        if self.permits.is_some() && self.mode == LockMode::Shared {
            return bad(
                "permits",
                "permits are taken alone, not with mode shared: a permit is a slot, \
                 not a side of a read-write lock"
                    .into(),
            );
        }
        if self.fair && self.access() != Access::Exclusive {
            return bad(
                "fair",
                format!(
                    "fair mode queues exclusive waiters only, not {} ones",
                    self.access()
                ),
            );
        }
        if self.backend.is_empty() {
            return bad("backend", "the backend name must not be empty".into());
        }
        Ok(())
    }

    /// Acquires `key` on the named backend.
    pub async fn acquire(&self, key: impl IntoLockKey) -> Result<Lease, LockError> {
        let key = key.into_lock_key()?;
        let backend = registry().get(&self.backend)?;
        self.acquire_on(backend, key).await
    }

    /// Acquires `key` on a backend held directly rather than by name.
    pub async fn acquire_on(
        &self,
        backend: Arc<dyn Backend>,
        key: impl IntoLockKey,
    ) -> Result<Lease, LockError> {
        let key = key.into_lock_key()?;
        self.validate()?;
        lease::acquire(backend, key, self.terms(), self.deadline()).await
    }

    /// Acquires several keys at once, always in one global order (sorted,
    /// duplicates taken once), releasing what it took if a later key
    /// cannot be had. Two callers locking `{a, b}` and `{b, a}` therefore
    /// never deadlock. The wait, if any, covers all keys together.
    pub async fn acquire_many<I>(&self, keys: I) -> Result<LeaseSet, LockError>
    where
        I: IntoIterator,
        I::Item: IntoLockKey,
    {
        let keys = keys
            .into_iter()
            .map(IntoLockKey::into_lock_key)
            .collect::<Result<Vec<_>, _>>()?;
        let backend = registry().get(&self.backend)?;
        self.acquire_many_on(backend, keys).await
    }

    /// [`LockOptions::acquire_many`] on a backend held directly.
    pub async fn acquire_many_on<I>(
        &self,
        backend: Arc<dyn Backend>,
        keys: I,
    ) -> Result<LeaseSet, LockError>
    where
        I: IntoIterator,
        I::Item: IntoLockKey,
    {
        let keys = keys
            .into_iter()
            .map(IntoLockKey::into_lock_key)
            .collect::<Result<Vec<_>, _>>()?;
        if keys.is_empty() {
            return Err(LockError::InvalidOption {
                option: "keys",
                reason: "at least one key is needed".into(),
            });
        }
        if self.access() != Access::Exclusive {
            return Err(LockError::InvalidOption {
                option: self.access().option(),
                reason: format!(
                    "several keys are locked exclusively only, not as {}",
                    self.access()
                ),
            });
        }
        self.validate()?;
        lease::acquire_many(backend, keys, self.terms(), self.deadline()).await
    }

    /// The terms the lease is taken on.
    pub(crate) fn terms(&self) -> lease::Terms {
        lease::Terms {
            ttl: self.ttl,
            wait: self.wait,
            renew: self.renew,
            min_hold: self.min_hold,
            identity: None,
            fair: self.fair,
            access: self.access(),
        }
    }

    pub(crate) fn deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.wait
    }
}

/// Anything that names one lock key: `&str`, `String`, [`LockKey`], or the
/// result of building one.
pub trait IntoLockKey {
    /// Validates and converts.
    fn into_lock_key(self) -> Result<LockKey, LockError>;
}

impl IntoLockKey for LockKey {
    fn into_lock_key(self) -> Result<LockKey, LockError> {
        Ok(self)
    }
}

impl IntoLockKey for &LockKey {
    fn into_lock_key(self) -> Result<LockKey, LockError> {
        Ok(self.clone())
    }
}

impl IntoLockKey for &str {
    fn into_lock_key(self) -> Result<LockKey, LockError> {
        LockKey::new(self)
    }
}

impl IntoLockKey for String {
    fn into_lock_key(self) -> Result<LockKey, LockError> {
        LockKey::new(self)
    }
}

impl IntoLockKey for &String {
    fn into_lock_key(self) -> Result<LockKey, LockError> {
        LockKey::new(self.as_str())
    }
}

impl IntoLockKey for Result<LockKey, LockError> {
    fn into_lock_key(self) -> Result<LockKey, LockError> {
        self
    }
}

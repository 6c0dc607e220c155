//! The `Backend` trait: the few primitive operations a lock store provides.
//!
//! Everything else (waiting, renewal, the lost signal, release on drop,
//! several keys) is written once in the core on top of these primitives.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use async_trait::async_trait;

use crate::error::{LockError, LostReason, Operation};
use crate::key::LockKey;
use crate::token::FencingToken;

/// A future that resolves when a key *may* have been released: a hint to
/// try again, never a promise that the key is free.
///
/// A backend that wakes only some of its waiters on a release (one, say, as
/// only one can take the key) makes the notice with
/// [`ReleaseNotice::passing_on`]: should the woken waiter give up before its
/// next attempt is answered (its deadline passes, it is cancelled, the
/// attempt fails), dropping the notice passes the wake-up on, so a release
/// is never swallowed. The core calls [`ReleaseNotice::answered`] once the
/// attempt that followed the wake-up got an answer.
#[must_use = "a notice only tells of a release while it is awaited"]
pub struct ReleaseNotice {
    wait: Pin<Box<dyn Future<Output = ()> + Send + 'static>>,
    woken: bool,
    pass_on: Option<Box<dyn FnOnce() + Send + 'static>>,
}

impl ReleaseNotice {
    /// A notice that resolves when `wait` does; for backends that wake
    /// every waiter on a release.
    pub fn new(wait: impl Future<Output = ()> + Send + 'static) -> Self {
        Self {
            wait: Box::pin(wait),
            woken: false,
            pass_on: None,
        }
    }

    /// A notice that resolves when `wait` does and, if it is dropped after
    /// it resolved but before [`ReleaseNotice::answered`], calls `pass_on`
    /// to wake another waiter in its place.
    pub fn passing_on(
        wait: impl Future<Output = ()> + Send + 'static,
        pass_on: impl FnOnce() + Send + 'static,
    ) -> Self {
        Self {
            wait: Box::pin(wait),
            woken: false,
            pass_on: Some(Box::new(pass_on)),
        }
    }

    /// True once the notice has resolved.
    pub fn is_woken(&self) -> bool {
        self.woken
    }

    /// The waiter it woke has made its next attempt and got an answer
    /// (acquired, or held by someone else): the wake-up served its purpose
    /// and is not passed on.
    pub fn answered(mut self) {
        self.pass_on = None;
    }
}

impl Future for ReleaseNotice {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        if self.woken {
            return std::task::Poll::Ready(());
        }
        std::task::ready!(self.wait.as_mut().poll(cx));
        self.woken = true;
        std::task::Poll::Ready(())
    }
}

impl Drop for ReleaseNotice {
    fn drop(&mut self) {
        if self.woken
            && let Some(pass_on) = self.pass_on.take()
        {
            pass_on();
        }
    }
}

impl fmt::Debug for ReleaseNotice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleaseNotice")
            .field("woken", &self.woken)
            .field("passes_on", &self.pass_on.is_some())
            .finish()
    }
}

/// The answer to one [`Backend::release`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The caller held the key, and now nobody does.
    Released,
    /// The caller did not hold the key (its lease had run out, or was
    /// broken or taken over); nothing was changed.
    NotOwner,
    /// The reply to a first request was lost (a broken connection) and a
    /// retry found the key not held by the caller: either the lost request
    /// released it, or the lease had ended before. The core decides with
    /// the lease's own deadline: a retry answered while the lease was still
    /// valid by the holder's clock means the first request released it.
    Unconfirmed,
}

impl ReleaseOutcome {
    /// `Released` for `true`, `NotOwner` for `false`.
    pub fn from_released(released: bool) -> Self {
        if released {
            Self::Released
        } else {
            Self::NotOwner
        }
    }
}

/// Leases a backend can lose all at once by itself, before any renewal
/// would tell: for example every lease held on one PostgreSQL session, lost
/// the moment the session ends. The backend makes one group per such unit
/// and hands it out with each [`Grant`]; the core attaches the lease to the
/// group and detaches it when the lease ends; [`LossGroup::end`] marks
/// every attached lease lost at once (and any lease attached later). No
/// task or timer per lease.
pub struct LossGroup {
    state: Mutex<GroupState>,
}

#[derive(Default)]
struct GroupState {
    /// Why the group ended, once it has.
    ended: Option<LostReason>,
    next_id: u64,
    members: HashMap<u64, Weak<dyn LossSink>>,
}

/// What a [`LossGroup`] tells when it ends: implemented by the core's lease
/// state.
pub(crate) trait LossSink: Send + Sync {
    /// The lease is lost for `reason` (a no-op if it already ended).
    fn lost(&self, reason: LostReason);
}

impl LossGroup {
    /// A group that has not ended.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::default(),
        })
    }

    fn state(&self) -> MutexGuard<'_, GroupState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks every attached lease lost for `reason`, and every lease
    /// attached from now on. Only the first call counts.
    pub fn end(&self, reason: LostReason) {
        let members = {
            let mut state = self.state();
            if state.ended.is_some() {
                return;
            }
            state.ended = Some(reason.clone());
            std::mem::take(&mut state.members)
        };
        // Told outside the lock: marking a lease lost logs and wakes tasks.
        for member in members.into_values().filter_map(|m| m.upgrade()) {
            member.lost(reason.clone());
        }
    }

    /// True once [`LossGroup::end`] was called.
    pub fn is_ended(&self) -> bool {
        self.state().ended.is_some()
    }

    /// Attaches a lease: `Ok(id)` to detach it with, or the reason the
    /// group already ended.
    pub(crate) fn attach(&self, member: Weak<dyn LossSink>) -> Result<u64, LostReason> {
        let mut state = self.state();
        if let Some(reason) = &state.ended {
            return Err(reason.clone());
        }
        let id = state.next_id;
        state.next_id += 1;
        state.members.insert(id, member);
        Ok(id)
    }

    /// Detaches the lease attached as `id`.
    pub(crate) fn detach(&self, id: u64) {
        self.state().members.remove(&id);
    }
}

impl fmt::Debug for LossGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("LossGroup")
            .field("ended", &state.ended)
            .field("members", &state.members.len())
            .finish()
    }
}

/// Random bytes fetched from the OS at once for [`OwnerId::random`].
const RANDOM_POOL: usize = 512;

struct RandomPool {
    bytes: [u8; RANDOM_POOL],
    used: usize,
    /// The [`forks`] count when the pool was filled: a forked child must
    /// not hand out the ids its parent will hand out too.
    forks: u64,
}

/// How many times this process was forked into the process now running:
/// bumped in the child of every `fork()` (by an `atfork` handler), so
/// that a pool can tell it was copied without a system call per id.
#[cfg(unix)]
fn forks() -> u64 {
    use std::sync::Once;
    use std::sync::atomic::{AtomicU64, Ordering};
    static FORKS: AtomicU64 = AtomicU64::new(0);
    static HANDLER: Once = Once::new();
    extern "C" fn in_child() {
        FORKS.fetch_add(1, Ordering::SeqCst);
    }
    HANDLER.call_once(|| {
        // SAFETY: registers a handler that only bumps an atomic, which is
        // async-signal-safe as a fork handler must be.
        let registered = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
        assert_eq!(registered, 0, "pthread_atfork failed: {registered}");
    });
    FORKS.load(Ordering::SeqCst)
}

#[cfg(not(unix))]
fn forks() -> u64 {
    0
}

/// The random identity of one acquisition. Release and extend succeed only
/// for the owner that acquired, so a holder whose lease ran out can never
/// release or extend the lease of whoever holds the key now.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerId([u8; 16]);

impl OwnerId {
    /// 128 fresh random bits from the operating system.
    ///
    /// The bits are drawn from the OS a few hundred at a time into a
    /// per-thread buffer, each handed out once, so that an acquisition does
    /// not pay a system call of its own.
    pub fn random() -> Result<Self, LockError> {
        thread_local! {
            static POOL: std::cell::RefCell<RandomPool> = const {
                std::cell::RefCell::new(RandomPool { bytes: [0; RANDOM_POOL], used: RANDOM_POOL, forks: 0 })
            };
        }
        POOL.with(|pool| {
            let mut pool = pool.borrow_mut();
            let forks = forks();
            if pool.used + 16 > RANDOM_POOL || pool.forks != forks {
                getrandom::fill(&mut pool.bytes).map_err(|e| {
                    LockError::backend("system", Operation::Acquire, "", e.to_string())
                })?;
                pool.used = 0;
                pool.forks = forks;
            }
            let start = pool.used;
            let mut bytes = [0u8; 16];
            bytes.copy_from_slice(&pool.bytes[start..start + 16]);
            // Wiped as handed out: no id can be handed out twice.
            pool.bytes[start..start + 16].fill(0);
            pool.used += 16;
            Ok(Self(bytes))
        })
    }

    /// The 32-hex-digit form written by `Display`, without formatting
    /// machinery: what backends store and send.
    pub fn to_hex(&self) -> [u8; 32] {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = [0u8; 32];
        for (i, byte) in self.0.iter().enumerate() {
            out[2 * i] = DIGITS[usize::from(byte >> 4)];
            out[2 * i + 1] = DIGITS[usize::from(byte & 0x0f)];
        }
        out
    }

    /// Rebuilds an owner id from its bytes (as stored by a backend).
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The raw bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Parses the 32-hex-digit form written by `Display`.
    pub fn parse_hex(text: &str) -> Option<Self> {
        if text.len() != 32 || !text.is_ascii() {
            return None;
        }
        let mut bytes = [0u8; 16];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Self(bytes))
    }
}

impl fmt::Display for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex = self.to_hex();
        // Hex digits are ASCII.
        f.write_str(std::str::from_utf8(&hex).unwrap_or_default())
    }
}

impl fmt::Debug for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerId({self})")
    }
}

/// The answer to one [`Backend::try_acquire`].
pub enum Attempt {
    /// The key was free and is now held by the caller.
    Acquired(Grant),
    /// Someone else holds the key.
    Held {
        /// How long until the current holder's lease runs out, if the
        /// backend knows: the waiter retries then even if no release is
        /// announced.
        expires_in: Option<Duration>,
    },
}

impl fmt::Debug for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attempt::Acquired(grant) => f.debug_tuple("Acquired").field(&grant.token).finish(),
            Attempt::Held { expires_in } => f
                .debug_struct("Held")
                .field("expires_in", expires_in)
                .finish(),
        }
    }
}

/// A successful acquisition.
pub struct Grant {
    /// The fencing token of this acquisition.
    pub token: FencingToken,
    /// The group whose end the backend announces when it learns by itself
    /// that the lease is gone, before renewal would (`None` when only
    /// renewal can tell).
    pub loss: Option<Arc<LossGroup>>,
}

impl Grant {
    /// A grant whose loss only renewal can detect.
    pub fn new(token: FencingToken) -> Self {
        Self { token, loss: None }
    }
}

/// One lease to renew in a [`Backend::extend_many`] batch.
#[derive(Clone, Copy, Debug)]
pub struct Renewal<'a> {
    /// The leased key.
    pub key: &'a LockKey,
    /// The owner that holds it.
    pub owner: &'a OwnerId,
    /// The lifetime to set.
    pub ttl: Duration,
}

/// A lock store. Implement these primitives and the core gives every lease
/// renewal, the lost signal, waiting, release on drop and multi-key locking.
///
/// All operations must be atomic on the store: `try_acquire` sets the owner
/// and draws the fencing token in one step, and `extend`/`release` compare
/// the owner and act in one step.
///
/// Callers that give up: the core never drops a `try_acquire` or a
/// `release` future half-way while a runtime runs. If its own caller gives
/// up (a timeout, a `select!`, an aborted request), the rest of the call
/// runs on in a task of its own, and a grant that arrives after the caller
/// left, or an attempt that failed and may have reached the store anyway
/// (a lost reply), is given back with an owner-checked `release`. A
/// `try_acquire` that answers `Ok(Attempt::Acquired)` for an `owner` that
/// already holds the key (a retry after a lost reply) is what lets the core
/// retry safely.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// The kind of store, for errors and traces (`"memory"`, `"file"`, …).
    fn kind(&self) -> &'static str;

    /// Takes `key` for `owner` for `ttl` if nobody holds it, drawing a
    /// fencing token greater than every token issued for `key` before.
    async fn try_acquire(
        &self,
        key: &LockKey,
        owner: &OwnerId,
        ttl: Duration,
    ) -> Result<Attempt, LockError>;

    /// Sets the remaining lifetime of `owner`'s lease on `key` to `ttl`.
    /// `Ok(false)` when `owner` no longer holds `key`.
    async fn extend(
        &self,
        key: &LockKey,
        owner: &OwnerId,
        ttl: Duration,
    ) -> Result<bool, LockError>;

    /// Renews several leases at once: one answer per lease, in order, each
    /// meaning what [`Backend::extend`]'s answer means. The core's renewal
    /// gathers the leases that are due together and sends them here, so a
    /// backend that can answer many in one round trip (a Redis pipeline,
    /// one check of a PostgreSQL session) should override this; the default
    /// calls `extend` for each in turn.
    async fn extend_many(&self, leases: &[Renewal<'_>]) -> Vec<Result<bool, LockError>> {
        let mut answers = Vec::with_capacity(leases.len());
        for lease in leases {
            answers.push(self.extend(lease.key, lease.owner, lease.ttl).await);
        }
        answers
    }

    /// Releases `key` if `owner` holds it; see [`ReleaseOutcome`] for the
    /// answers. Nothing is changed when `owner` does not hold it.
    async fn release(&self, key: &LockKey, owner: &OwnerId) -> Result<ReleaseOutcome, LockError>;

    /// Registers interest in the release of `key`. The notice must resolve
    /// after any release (or expiry the backend can see) that happens after
    /// this call returns, so that a waiter that subscribes and then tries
    /// again can never miss the release between the two steps.
    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError>;

    /// Administrative: releases `key` whoever holds it. Its holder finds out
    /// at its next renewal and sees its lease lost. `Ok(false)` if the key
    /// was not held.
    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError>;
}

#[cfg(test)]
mod tests {
    use super::OwnerId;
    use std::collections::HashSet;

    #[test]
    fn owner_ids_are_distinct_and_round_trip_through_hex() {
        let mut seen = HashSet::new();
        for _ in 0..2000 {
            let id = OwnerId::random().unwrap_or_else(|e| panic!("{e}"));
            assert!(seen.insert(id), "an owner id came out twice");
            let text = id.to_string();
            assert_eq!(text.as_bytes(), id.to_hex());
            assert_eq!(OwnerId::parse_hex(&text), Some(id));
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_forked_child_never_hands_out_the_ids_its_parent_hands_out() {
        // The pool is partly used, so parent and child both start from the
        // same copied bytes unless the child notices the fork.
        let _ = OwnerId::random().unwrap_or_else(|e| panic!("{e}"));
        let mut fds = [0i32; 2];
        // SAFETY: plain pipe/fork/write/_exit; the child touches only the
        // thread-local pool (no allocation) before it exits.
        unsafe {
            assert_eq!(libc::pipe(fds.as_mut_ptr()), 0, "pipe");
            let pid = libc::fork();
            assert!(pid >= 0, "fork");
            if pid == 0 {
                let mut out = [0u8; 64];
                for chunk in out.chunks_mut(16) {
                    match OwnerId::random() {
                        Ok(id) => chunk.copy_from_slice(id.as_bytes()),
                        Err(_) => libc::_exit(1),
                    }
                }
                let written = libc::write(fds[1], out.as_ptr().cast(), out.len());
                libc::_exit(if written == 64 { 0 } else { 1 });
            }
            libc::close(fds[1]);
            let mut child = [0u8; 64];
            let mut got = 0;
            while got < 64 {
                let n = libc::read(fds[0], child[got..].as_mut_ptr().cast(), 64 - got);
                assert!(n > 0, "the child wrote no ids");
                got += n as usize;
            }
            libc::close(fds[0]);
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0);
            assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
            let parent: Vec<[u8; 16]> = (0..4)
                .map(|_| {
                    *OwnerId::random()
                        .unwrap_or_else(|e| panic!("{e}"))
                        .as_bytes()
                })
                .collect();
            for chunk in child.chunks(16) {
                assert!(
                    !parent.iter().any(|p| p.as_slice() == chunk),
                    "the child handed out an id its parent handed out too"
                );
            }
        }
    }
}

//! `FileBackend`: locks shared by the processes of one host, through a
//! directory.
//!
//! Per key, three kinds of file live in the directory:
//!
//! - `NAME.lock`: locked (OS file lock, exclusive) only for the few
//!   microseconds it takes to read and rewrite the state, so every operation
//!   on a key is one atomic step across processes.
//! - `NAME.state`: the fencing counter (the last token drawn, so the current
//!   holder's: only an acquisition draws), the current owner, when its lease
//!   expires (wall clock), the identity the owner gave, if any, and who the
//!   owner is (host, pid, label) and when it took the key. Rewritten
//!   through a temporary file and a rename; made durable before a token is
//!   handed out, so tokens keep rising across process restarts and host
//!   crashes.
//! - `NAME.OWNER.alive`: locked exclusively by the holder's process for as
//!   long as it holds the lease. The OS drops that lock the moment the
//!   process dies, so a holder killed with SIGKILL frees the key at once: a
//!   contender that can lock the file knows its holder is gone. Waiters block
//!   on a shared lock of it and wake the moment it is released. A missing
//!   alive file proves nothing (a temp-dir cleaner may have removed it): the
//!   key then stays held until its lease ends, waiters look again now and
//!   then, and the holder puts the file back at its next renewal.
//! - `NAME.queue`: the key's fair waiters in arrival order (see the `state`
//!   module for the format), only while some queue, changed only with the
//!   key locked. The state's `queued` field says it may hold entries, so a
//!   plain acquisition or release never opens it when nobody queues.
//!
//! Shared holders (readers) and permit holders of a key form a *group*
//! written in the state as its owner, each member with its own alive file
//! locked exclusively (a killed member is gone at the next look: its slot
//! free at once, the other readers holding on) and the group's
//! `NAME.GROUP.alive` locked shared, which an earlier version of this
//! backend probes as it probes a holder's, so it sees the key held while
//! any member lives. A writer behind readers leaves a writer-waiting mark
//! in the state and locks its own alive file while it waits. See the
//! `modes` module for the rules and the format.
//!
//! A fair waiter ([`LockOptions::fair`](crate::LockOptions::fair)) locks its
//! own `NAME.OWNER.alive` file from the moment it registers for its handoff
//! ([`Backend::subscribe_handoff`]) until it drops that notice or its
//! process dies: a release that finds it can lock a waiter's file (or finds
//! none) knows the waiter stopped listening and skips its entry at once. A
//! waiter handed the key holds it with that same file, so a waiter killed
//! right after its handoff frees the key at once too.
//!
//! A holder's release hands the key to the first live entry in the same
//! locked step: a token drawn as an acquisition draws it (the durable
//! counter), the ttl the waiter asked for, and the holder record and
//! identity its entry carries. The release then closes its alive file as
//! always, which wakes every waiter of the key on the host; the waiter that
//! now holds it reads the state and has its grant. A waiter that finds the
//! holder dead (its alive file unlocked by the OS) hands the key to the
//! first live entry itself, so a killed holder's key goes on at once in fair
//! mode as well.
//!
//! `NAME` is the key with every byte outside `[A-Za-z0-9_-]` percent-encoded,
//! or, for long keys, a 128-bit FNV-1a hash of it; the state keeps the whole
//! key, so a hash collision can only cause false contention, never two
//! holders.
//!
//! Expiry uses the host's wall clock, which every process on the host shares:
//! a clock stepped forward by more than a ttl ends leases early (fencing
//! tokens still protect the resource). The time a holder has held its key
//! ([`HolderInfo::held_for`]) is read from that clock too: a step forward
//! makes it look longer, a step back shorter, down to zero, never negative.
//!
//! [`Backend::held`] reads the directory: every state file whose key starts
//! with the prefix and whose holder is live. Files that are not state files
//! of this backend are skipped.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;

use crate::backend::{
    self, Access, AcquireRequest, Attempt, Backend, ForceRelease, Grant, Handoff, Holding, OwnerId,
    Queue, ReleaseNotice, ReleaseOutcome, ReleaseRequest, Renewal,
};
use crate::error::{LockError, Operation};
use crate::holder::{HolderInfo, check_label};
use crate::key::LockKey;
use crate::token::FencingToken;

mod exclusive;
mod files;
mod holders;
mod modes;
mod queue;
mod state;

use holders::HolderWatch;
use modes::group_holding;
use queue::{HandoffStep, join};
use state::{
    HolderRecord, State, Waiter, expiry_after, file_name, micros, now_us, parse_queue, parse_state,
    render_queue, render_state,
};

const KIND: &str = "file";

/// How often a waiter looks again at a key whose holder's alive file is
/// missing, so cannot tell of its release.
const UNWATCHED_RECHECK: Duration = Duration::from_millis(500);

/// How often a holder watch on a free key looks again: nothing announces an
/// acquisition.
const FREE_RECHECK: Duration = Duration::from_millis(50);

/// How often a fair waiter's handoff notice looks again at a key that
/// nobody holds and no live waiter queues for (its own entry not written
/// yet, or expired): its next attempt decides, this only wakes it sooner.
const HANDOFF_RECHECK: Duration = Duration::from_millis(100);

/// Locks coordinated through a directory on one host.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_runtime::LockError> {
/// use std::time::Duration;
/// use dlock_runtime::{file::FileBackend, registry, LockOptions};
///
/// let dir = std::env::temp_dir().join(format!("dlock-doc-{}", std::process::id()));
/// registry().register("doc-file", FileBackend::open(&dir)?);
/// let lease = LockOptions::new(Duration::from_secs(10))
///     .backend("doc-file")
///     .acquire("nightly-report")
///     .await?;
/// lease.release().await?;
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct FileBackend {
    inner: Arc<Inner>,
    /// The label acquisitions record, over the process's
    /// ([`FileBackend::with_label`]).
    label: Option<Arc<str>>,
}

struct Inner {
    dir: PathBuf,
    /// The alive files this process holds locked, one per lease it holds.
    alive: Mutex<HashMap<(String, OwnerId), Alive>>,
    /// One watcher thread per (alive file) being waited on, shared by every
    /// waiter of this process.
    watchers: Mutex<HashMap<PathBuf, watch::Receiver<bool>>>,
    /// Numbers the handoff registrations, so that a notice dropped late
    /// never ends a later registration of the same owner.
    registrations: AtomicU64,
}

/// One alive file this process holds locked, and when its lease runs out
/// (wall clock, µs), after which it is closed at the next acquisition even
/// if no release ever comes: a descriptor never outlives its lease for long.
///
/// A fair waiter's file, while it only waits, has no lease: it lives as
/// long as its handoff notice (`waiting` names the registration), and
/// becomes the lease's file when the waiter is handed or takes the key.
struct Alive {
    file: File,
    expires_at_us: u64,
    waiting: Option<u64>,
    /// A shared or permit holder's lock (shared) on its group's alive
    /// file, closed with `file`.
    _group: Option<File>,
}

impl Alive {
    fn holding(file: File, expires_at_us: u64) -> Self {
        Self {
            file,
            expires_at_us,
            waiting: None,
            _group: None,
        }
    }
}

impl FileBackend {
    /// Uses (and creates if needed) `dir` for lock files. Every process that
    /// must see the same locks opens the same directory.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, LockError> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(|e| {
            LockError::backend(
                KIND,
                Operation::Connect,
                "",
                io::Error::new(e.kind(), format!("cannot create {}: {e}", dir.display())),
            )
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                dir,
                alive: Mutex::default(),
                watchers: Mutex::default(),
                registrations: AtomicU64::new(1),
            }),
            label: None,
        })
    }

    /// The same backend, whose acquisitions record `label` as their
    /// application label, over the process's
    /// ([`Registry::set_label`](crate::Registry::set_label)). Refused if
    /// [`check_label`] refuses it.
    ///
    /// ```
    /// # fn main() -> Result<(), dlock_runtime::LockError> {
    /// use dlock_runtime::file::FileBackend;
    ///
    /// let dir = std::env::temp_dir().join(format!("dlock-doc-label-{}", std::process::id()));
    /// let backend = FileBackend::open(&dir)?.with_label("billing")?;
    /// assert!(FileBackend::open(&dir)?.with_label("two\nlines").is_err());
    /// # drop(backend);
    /// # std::fs::remove_dir_all(&dir).ok();
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_label(mut self, label: &str) -> Result<Self, LockError> {
        check_label(label)?;
        self.label = Some(label.into());
        Ok(self)
    }

    /// The directory the locks live in.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// Runs blocking file work off the async threads.
    async fn blocking<T: Send + 'static>(
        &self,
        operation: Operation,
        key: &str,
        work: impl FnOnce(&Arc<Inner>) -> io::Result<T> + Send + 'static,
    ) -> Result<T, LockError> {
        let inner = Arc::clone(&self.inner);
        let joined = tokio::task::spawn_blocking(move || work(&inner)).await;
        match joined {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) => Err(LockError::backend(KIND, operation, key, err)),
            Err(join) => Err(LockError::backend(
                KIND,
                operation,
                key,
                io::Error::other(format!("file operation did not finish: {join}")),
            )),
        }
    }
}

impl std::fmt::Debug for FileBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileBackend")
            .field("dir", &self.inner.dir)
            .field("label", &self.label)
            .finish()
    }
}

#[async_trait]
impl Backend for FileBackend {
    fn kind(&self) -> &'static str {
        KIND
    }

    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        let (key, owner, ttl) = (request.key, request.owner, request.ttl);
        let (name, text, owner) = (file_name(key), key.to_string(), *owner);
        let identity = request.identity.map(str::to_owned);
        let record = request.holder_record(self.label.as_deref());
        let (queue, access, waits) = (request.queue, request.access, request.waits);
        let taken = self
            .blocking(Operation::Acquire, key.as_str(), move |inner| {
                let attempt = match access {
                    Access::Exclusive => inner.try_acquire(
                        &name,
                        &text,
                        owner,
                        ttl,
                        identity.as_deref(),
                        &record,
                        queue,
                        waits,
                    )?,
                    access => inner.join_group(&name, &text, owner, ttl, &record, access)?,
                };
                Ok(Taken {
                    inner: Arc::clone(inner),
                    name,
                    owner,
                    access,
                    attempt: Some(attempt),
                })
            })
            .await?;
        Ok(taken.claim())
    }

    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        let (key, owner, ttl) = (renewal.key, renewal.owner, renewal.ttl);
        let (name, owner) = (file_name(key), *owner);
        let (access, slot) = (renewal.access, renewal.slot);
        self.blocking(Operation::Extend, key.as_str(), move |inner| match access {
            Access::Exclusive => inner.extend(&name, owner, ttl),
            _ => inner.extend_member(&name, owner, ttl, slot),
        })
        .await
    }

    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
        let (key, owner) = (lease.key, lease.owner);
        let (name, owner) = (file_name(key), *owner);
        let (access, slot) = (lease.access, lease.slot);
        self.blocking(Operation::Release, key.as_str(), move |inner| {
            inner.release_as(&name, owner, access, slot)
        })
        .await
        .map(ReleaseOutcome::from_released)
    }

    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        let name = file_name(key);
        let this = Arc::clone(&self.inner);
        let watch = self
            .blocking(Operation::Wait, key.as_str(), move |_| {
                this.watch_release(&name)
            })
            .await?;
        // Every waiter of a file hears its release; nobody holds it: the
        // caller's retry will tell; nothing to watch until the holder puts
        // its file back: look again now and then rather than wait out the
        // whole lease.
        Ok(watch.notice(ReleaseNotice::new(std::future::ready(()))))
    }

    /// Shared holders and permits live in the state beside the exclusive
    /// holder: see the module documentation.
    fn supports_access(&self, _access: Access) -> bool {
        true
    }

    /// Fair queues live in the lock directory beside the state: see the
    /// module documentation.
    fn supports_fair(&self) -> bool {
        true
    }

    /// Locks the waiter's alive file for as long as the notice lives (so a
    /// release skips a waiter that stopped listening or died, at once),
    /// then, while awaited, watches the holder's alive file as plain
    /// waiters do: its release wakes the notice, which reads the state and
    /// resolves if the key is now the waiter's. A key it finds with no live
    /// holder it hands to the first live waiter itself.
    async fn subscribe_handoff(
        &self,
        key: &LockKey,
        owner: &OwnerId,
    ) -> Result<Handoff, LockError> {
        let (name, owner) = (file_name(key), *owner);
        let listening = self
            .blocking(Operation::Wait, key.as_str(), move |inner| {
                inner.listen(&name, owner)
            })
            .await?;
        Ok(Handoff::new(async move {
            loop {
                let inner = Arc::clone(&listening.inner);
                let name = listening.name.clone();
                let step =
                    tokio::task::spawn_blocking(move || inner.handoff_step(&name, owner)).await;
                match step {
                    Ok(Ok(HandoffStep::Granted(token))) => {
                        drop(listening);
                        return Grant::new(token);
                    }
                    Ok(Ok(HandoffStep::Watch(mut released))) => {
                        let _ = released.wait_for(|released| *released).await;
                    }
                    Ok(Ok(HandoffStep::Recheck(after))) => tokio::time::sleep(after).await,
                    // The waiter's next attempt decides; look again later.
                    Ok(Err(_)) | Err(_) => tokio::time::sleep(UNWATCHED_RECHECK).await,
                }
            }
        }))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let name = file_name(key);
        self.blocking(Operation::Release, key.as_str(), move |inner| {
            inner.force_release(&name)
        })
        .await
    }

    /// Compares and breaks with the key's file locked (see
    /// [`Backend::force_release_holding`]).
    async fn force_release_holding(
        &self,
        key: &LockKey,
        expected: &Holding,
    ) -> Result<ForceRelease, LockError> {
        let named = backend::named_token(KIND, key, expected)?;
        let name = file_name(key);
        self.blocking(Operation::Release, key.as_str(), move |inner| {
            inner.force_release_holding(&name, named)
        })
        .await
    }

    /// Reads the state with the key locked. A holder whose process died
    /// (its alive file can be locked) holds nothing, as for `try_acquire`.
    async fn holder(&self, key: &LockKey) -> Result<Option<Holding>, LockError> {
        let name = file_name(key);
        self.blocking(Operation::Inspect, key.as_str(), move |inner| {
            inner.holder(&name)
        })
        .await
    }

    /// Nothing tells this backend of an acquisition, only of a release
    /// (the holder's alive file unlocked). So the notice resolves on the
    /// release while the key is held and its alive file can be watched,
    /// with no recheck; while the key is free it never resolves and says to
    /// look again within 50 ms, and while the holder's alive file is
    /// missing, within the waiters' 500 ms. An observer polls only while
    /// nobody holds the key; it learns of an expiry from the lease's
    /// `expires_in` that `holder` reads.
    async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        let name = file_name(key);
        let this = Arc::clone(&self.inner);
        let watch = self
            .blocking(Operation::Wait, key.as_str(), move |_| {
                this.watch_release(&name)
            })
            .await?;
        Ok(watch.notice(ReleaseNotice::new(std::future::pending()).recheck_within(FREE_RECHECK)))
    }

    /// Reads the directory: every state file whose key starts with
    /// `prefix` and whose holder is live (as `holder` tells it). Files that
    /// are not this backend's state files are skipped; a directory that
    /// cannot be read is an error. Holders are never waited on: a key
    /// that looks held has its lock taken for one read of its state.
    async fn held(&self, prefix: &str) -> Result<Vec<(String, Holding)>, LockError> {
        let owned = prefix.to_owned();
        self.blocking(Operation::List, prefix, move |inner| inner.held(&owned))
            .await
    }
}

/// An attempt's outcome on its way from the blocking thread to the caller.
/// A runtime that shuts down does not wait for its blocking threads: the
/// caller's task may be gone (and its give-back already run, finding
/// nothing) before the attempt ends. Dropped unclaimed, a key it took is
/// released on the spot, which also closes its alive file, so it is neither
/// held for its ttl nor kept open.
struct Taken {
    inner: Arc<Inner>,
    name: String,
    owner: OwnerId,
    access: Access,
    attempt: Option<Attempt>,
}

impl Taken {
    fn claim(mut self) -> Attempt {
        // Always set until here.
        self.attempt
            .take()
            .unwrap_or(Attempt::Held { expires_in: None })
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        if let Some(Attempt::Acquired(_)) = self.attempt.take() {
            // Owner-checked; a few microseconds of file work, like the
            // attempt itself, on whichever thread dropped it.
            let _ = self
                .inner
                .release_as(&self.name, self.owner, self.access, None);
        }
    }
}

#[cfg(test)]
mod tests;

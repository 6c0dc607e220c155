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
//!
//! Over 700 lines: the attempt, renewal and release paths share one locked
//! read-modify-write of the key's state file and are kept together; the fair
//! queue, the holder reads and the state format have modules of their own.

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

impl Inner {
    fn path(&self, name: &str, suffix: &str) -> PathBuf {
        self.dir.join(format!("{name}.{suffix}"))
    }

    fn alive_path(&self, name: &str, owner: &OwnerId) -> PathBuf {
        self.path(name, &format!("{owner}.alive"))
    }

    /// Locks `NAME.lock` for one read-modify-write of the state.
    fn lock_key(&self, name: &str) -> io::Result<File> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.path(name, "lock"))?;
        file.lock()?;
        Ok(file)
    }

    fn read_state(&self, name: &str) -> io::Result<Option<State>> {
        let path = self.path(name, "state");
        let mut text = String::new();
        match File::open(&path) {
            Ok(mut file) => file.read_to_string(&mut text)?,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(err),
        };
        parse_state(&text).map(Some).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} is corrupt; it holds the fencing counter, so it is not reset silently: \
                     remove it only when no process uses this key",
                    path.display()
                ),
            )
        })
    }

    /// Replaces the state atomically (temporary file + rename). `durable`
    /// also syncs the file and the directory, for writes that hand out a
    /// token: after a crash the counter must never go back.
    fn write_state(&self, name: &str, state: &State, durable: bool) -> io::Result<()> {
        let path = self.path(name, "state");
        let tmp = self.path(name, "state.tmp");
        let mut file = File::create(&tmp)?;
        file.write_all(render_state(state).as_bytes())?;
        if durable {
            file.sync_all()?;
        }
        drop(file);
        fs::rename(&tmp, &path)?;
        if durable {
            File::open(&self.dir)?.sync_all()?;
        }
        Ok(())
    }

    /// Whether `owner`'s process may still hold its lease. A file that can
    /// be locked belongs to a dead holder; `remove_dead` removes it. A
    /// missing file is no proof of death (anything may have removed it
    /// while its process holds it open): the lease's own end decides. So
    /// only a caller that then replaces the holder in the state may remove
    /// the file: a later reader would take the dead holder for a live one.
    fn holder_alive(&self, name: &str, owner: &OwnerId, remove_dead: bool) -> io::Result<bool> {
        self.alive_file_locked(name, owner, true, remove_dead)
    }

    /// Whether `owner`'s alive file of `name` is held locked by a live
    /// process (this one's, or another's): `if_missing` when there is no
    /// file; a file that can be locked belongs to a dead process, and
    /// `remove_dead` removes it.
    fn alive_file_locked(
        &self,
        name: &str,
        owner: &OwnerId,
        if_missing: bool,
        remove_dead: bool,
    ) -> io::Result<bool> {
        if self.holds_alive(name, owner) {
            return Ok(true);
        }
        let path = self.alive_path(name, owner);
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(if_missing),
            Err(err) => return Err(err),
        };
        match file.try_lock() {
            Ok(()) => {
                if remove_dead {
                    let _ = fs::remove_file(&path);
                }
                Ok(false)
            }
            Err(TryLockError::WouldBlock) => Ok(true),
            Err(TryLockError::Error(err)) => Err(err),
        }
    }

    /// The owner that holds the key by `state` at `now`, if any: its lease
    /// has not run out and its process is not known to be dead. The one
    /// test of "held" for `try_acquire`, `holder` and the watches, so that
    /// they never disagree. `remove_dead` removes a dead holder's alive
    /// file, expired or not (see `holder_alive`).
    fn live_holder(
        &self,
        name: &str,
        state: &State,
        now: u64,
        remove_dead: bool,
    ) -> io::Result<Option<OwnerId>> {
        let Some(holder) = state.owner.filter(|_| !state.group) else {
            return Ok(None);
        };
        let alive = self.holder_alive(name, &holder, remove_dead)?;
        Ok((alive && state.expires_at_us > now).then_some(holder))
    }

    /// Drops this process's alive file for a lease, waking its waiters.
    fn drop_alive(&self, name: &str, owner: &OwnerId) {
        let alive = self
            .alive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&(name.to_owned(), *owner));
        if let Some(alive) = alive {
            let _ = fs::remove_file(self.alive_path(name, owner));
            drop(alive.file);
        }
    }

    /// Closes the alive files of leases that ran out without a release
    /// (a holder that vanished without a runtime to release on drop):
    /// their keys are free by expiry already, and their descriptors must
    /// not stay open for the life of the process.
    fn close_expired(&self, now: u64) {
        let expired: Vec<(String, OwnerId)> = {
            let mut alive = self.alive.lock().unwrap_or_else(PoisonError::into_inner);
            let expired = alive
                .iter()
                .filter(|(_, a)| a.expires_at_us <= now)
                .map(|(id, _)| id.clone())
                .collect::<Vec<_>>();
            for id in &expired {
                alive.remove(id);
            }
            expired
        };
        for (name, owner) in expired {
            let _ = fs::remove_file(self.alive_path(&name, &owner));
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn try_acquire(
        &self,
        name: &str,
        key: &str,
        owner: OwnerId,
        ttl: Duration,
        identity: Option<&str>,
        record: &str,
        queue: Queue,
        waits: bool,
    ) -> io::Result<Attempt> {
        let _guard = self.lock_key(name)?;
        let now = now_us();
        let mut state = self.read_state(name)?;
        if let Some(current) = &mut state
            && self.normalize(name, current, now, true)?
        {
            self.write_state(name, current, false)?;
        }
        if let Some(current) = &mut state
            && current.group
        {
            // A fair waiter queues behind readers and permit holders as
            // behind a holder: the group's end hands it the key in order
            // (its notice watches the group's file).
            if let Queue::Join { entry_ttl } = queue {
                let mut waiters = self.read_queue(name)?;
                let entry = Waiter {
                    owner,
                    ttl_us: micros(ttl),
                    expires_at_us: expiry_after(now, entry_ttl),
                    record: record.to_owned(),
                    identity: identity.map(str::to_owned),
                };
                join(&mut waiters, entry, now);
                self.write_queue(name, &waiters)?;
                if !current.queued {
                    current.queued = true;
                    self.write_state(name, current, false)?;
                }
                self.restore_alive(name, &owner);
            }
            return self.writer_behind_group(name, current, owner, now, waits);
        }
        if let Some(current) = &state {
            // A retry by the owner that holds it (its first answer was
            // lost, or a release handed it the key and its notice was
            // lost): it has the key, with the token already drawn.
            if current.owner == Some(owner)
                && current.expires_at_us > now
                && self.holds_alive(name, &owner)
            {
                // The same acquisition: it has held the key since its first
                // answer was written.
                let holder = HolderRecord {
                    record: record.to_owned(),
                    since_us: now,
                };
                let state = State {
                    expires_at_us: expiry_after(now, ttl),
                    identity: identity.map(str::to_owned),
                    holder: current.holder.clone().or(Some(holder)),
                    ..current.clone()
                };
                self.write_state(name, &state, false)?;
                self.set_alive_expiry(name, &owner, state.expires_at_us);
                return Ok(Attempt::Acquired(Grant::new(FencingToken::new(
                    state.counter,
                ))));
            }
            if self.live_holder(name, current, now, false)?.is_some() {
                if let Queue::Join { entry_ttl } = queue {
                    let mut waiters = self.read_queue(name)?;
                    let entry = Waiter {
                        owner,
                        ttl_us: micros(ttl),
                        expires_at_us: expiry_after(now, entry_ttl),
                        record: record.to_owned(),
                        identity: identity.map(str::to_owned),
                    };
                    join(&mut waiters, entry, now);
                    self.write_queue(name, &waiters)?;
                    if !current.queued {
                        let marked = State {
                            queued: true,
                            ..current.clone()
                        };
                        self.write_state(name, &marked, false)?;
                    }
                    self.restore_alive(name, &owner);
                }
                return Ok(Attempt::Held {
                    expires_in: Some(Duration::from_micros(current.expires_at_us - now)),
                });
            }
        }
        // Nobody holds the key. A plain attempt takes it whoever queues
        // (and keeps the `queued` field for them); a fair one takes it only
        // as the first live entry, or when nobody queues.
        let mut queued = state.as_ref().is_some_and(|s| s.queued);
        if queue.is_fair() && (queued || matches!(queue, Queue::Join { .. })) {
            let mut waiters = self.read_queue(name)?;
            let mut changed = false;
            let me = match queue {
                Queue::Join { entry_ttl } => {
                    // An expired entry of this owner is no place in line.
                    let before = waiters.len();
                    waiters.retain(|w| w.owner != owner || w.expires_at_us > now);
                    changed = waiters.len() != before;
                    Some((owner, entry_ttl))
                }
                _ => None,
            };
            changed |= self.prune_front(name, &mut waiters, now, me.map(|(o, _)| o))?;
            match waiters.first() {
                Some(first) if first.owner == owner => {
                    waiters.remove(0);
                    changed = true;
                }
                Some(_) => {
                    // A live waiter is first: the free key is its, handed
                    // over as a release would, and this attempt queues.
                    if let Some((_, entry_ttl)) = me {
                        let entry = Waiter {
                            owner,
                            ttl_us: micros(ttl),
                            expires_at_us: expiry_after(now, entry_ttl),
                            record: record.to_owned(),
                            identity: identity.map(str::to_owned),
                        };
                        join(&mut waiters, entry, now);
                        self.restore_alive(name, &owner);
                    }
                    let mut current = state.unwrap_or_else(|| State {
                        counter: now,
                        key: key.to_owned(),
                        ..State::default()
                    });
                    let next = self.hand_over(name, &mut current, &mut waiters, now)?;
                    return Ok(Attempt::Held {
                        expires_in: Some(Duration::from_micros(next.ttl_us)),
                    });
                }
                None => {}
            }
            if changed {
                self.write_queue(name, &waiters)?;
            }
            queued = !waiters.is_empty();
        }
        if let Some(current) = &state
            && let Some(earlier) = current.owner
        {
            // The earlier holder's lease ran out or its process died: a
            // dead holder's file can go, as the state is rewritten below.
            self.holder_alive(name, &earlier, true)?;
        }
        let marks = state.as_ref().map_or_else(Vec::new, |s| {
            s.marks
                .iter()
                .filter(|(by, _)| *by != owner)
                .copied()
                .collect()
        });
        // A key never seen (or whose state was deleted) starts its counter
        // at the wall clock in microseconds, so tokens still rise.
        let counter = state.map_or(now, |s| s.counter).max(1);
        let token = counter
            .checked_add(1)
            .ok_or_else(|| io::Error::other("fencing counter exhausted"))?;
        // A fair waiter's registered file becomes its lease's.
        let registered = self
            .alive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&(name.to_owned(), owner));
        let alive_path = self.alive_path(name, &owner);
        let (alive, registration) = match registered {
            Some(registered) => (registered.file, registered.waiting),
            None => {
                let alive = File::create(&alive_path)?;
                alive.lock()?;
                (alive, None)
            }
        };
        let expires_at_us = expiry_after(now, ttl);
        let written = self.write_state(
            name,
            &State {
                counter: token,
                owner: Some(owner),
                expires_at_us,
                key: key.to_owned(),
                identity: identity.map(str::to_owned),
                holder: Some(HolderRecord {
                    record: record.to_owned(),
                    since_us: now,
                }),
                queued,
                // Granted the key, the owner's own mark goes (rule M3).
                marks,
                ..State::default()
            },
            true,
        );
        if let Err(err) = written {
            match registration {
                // Still a waiter: it keeps its registration.
                Some(_) => {
                    self.alive
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(
                            (name.to_owned(), owner),
                            Alive {
                                file: alive,
                                expires_at_us: u64::MAX,
                                waiting: registration,
                                _group: None,
                            },
                        );
                }
                None => {
                    let _ = fs::remove_file(&alive_path);
                }
            }
            return Err(err);
        }
        self.close_expired(now);
        self.alive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                (name.to_owned(), owner),
                Alive::holding(alive, expires_at_us),
            );
        Ok(Attempt::Acquired(Grant::new(FencingToken::new(token))))
    }

    fn extend(&self, name: &str, owner: OwnerId, ttl: Duration) -> io::Result<bool> {
        let guard = self.lock_key(name)?;
        let now = now_us();
        let state = self.read_state(name)?;
        let Some(mut state) = state.filter(|s| s.owner == Some(owner) && s.expires_at_us > now)
        else {
            drop(guard);
            self.drop_alive(name, &owner);
            return Ok(false);
        };
        state.expires_at_us = expiry_after(now, ttl);
        self.write_state(name, &state, false)?;
        self.set_alive_expiry(name, &owner, state.expires_at_us);
        self.restore_alive(name, &owner);
        Ok(true)
    }

    /// Puts back this process's alive file for a lease if something removed
    /// it, so the holder's death frees the key at once again and waiters
    /// can watch it. Called with the key locked: no contender looks at the
    /// new file before it is locked. On failure the lease stays valid, and
    /// its ttl alone frees the key should this process die.
    fn restore_alive(&self, name: &str, owner: &OwnerId) {
        let mut alive = self.alive.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(held) = alive.get_mut(&(name.to_owned(), *owner)) else {
            return;
        };
        let path = self.alive_path(name, owner);
        let restored = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .and_then(|file| file.lock().map(|()| file));
        match restored {
            Ok(file) => {
                tracing::warn!(
                    path = %path.display(),
                    "the alive file of a held lock or a fair waiter was removed (a cleaner \
                     in the lock directory?); it is put back"
                );
                // The old file's waiters wake on its close and watch the new one.
                held.file = file;
            }
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
            Err(err) => tracing::warn!(
                path = %path.display(),
                error = %err,
                "the alive file of a held lock was removed and cannot be put back; \
                 should this process die, the key is free only when its lease ends"
            ),
        }
    }

    /// True if this process holds `owner`'s alive file for `name`.
    fn holds_alive(&self, name: &str, owner: &OwnerId) -> bool {
        self.alive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(&(name.to_owned(), *owner))
    }

    /// Records a renewed lease's new end with its alive file (a fair
    /// waiter's registered file is its lease's from then on).
    fn set_alive_expiry(&self, name: &str, owner: &OwnerId, expires_at_us: u64) {
        if let Some(alive) = self
            .alive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(&(name.to_owned(), *owner))
        {
            alive.expires_at_us = expires_at_us;
            alive.waiting = None;
        }
    }

    /// Releases `owner`'s lease, handing the key to the first live fair
    /// waiter if any queue; or, for an owner that does not hold the key,
    /// removes its entry from the queue (rule F3). Either way its alive
    /// file (lease or registration) is closed, which wakes the key's
    /// waiters.
    fn release(&self, name: &str, owner: OwnerId) -> io::Result<bool> {
        let guard = self.lock_key(name)?;
        let now = now_us();
        let mut ours = false;
        if let Some(mut state) = self.read_state(name)? {
            if state.marks.iter().any(|(by, _)| *by == owner) {
                // An exclusive waiter gives up: its mark goes (rule M3);
                // closing its alive file below wakes the readers behind it.
                state.marks.retain(|(by, _)| *by != owner);
                self.write_state(name, &state, false)?;
            }
            let waiters = if state.queued {
                let mut waiters = self.read_queue(name)?;
                let before = waiters.len();
                waiters.retain(|w| w.owner != owner);
                Some((waiters.len() != before, waiters))
            } else {
                None
            };
            if state.owner == Some(owner) {
                ours = state.expires_at_us > now;
                state.owner = None;
                state.identity = None;
                state.holder = None;
                state.expires_at_us = 0;
                let mut handed = false;
                if let Some((mut changed, mut waiters)) = waiters {
                    changed |= self.prune_front(name, &mut waiters, now, None)?;
                    if waiters.is_empty() {
                        state.queued = false;
                    } else {
                        self.hand_over(name, &mut state, &mut waiters, now)?;
                        handed = true;
                    }
                    if changed && !handed {
                        self.write_queue(name, &waiters)?;
                    }
                }
                if !handed {
                    self.write_state(name, &state, false)?;
                }
            } else if let Some((true, waiters)) = waiters {
                self.write_queue(name, &waiters)?;
                if waiters.is_empty() {
                    state.queued = false;
                    self.write_state(name, &state, false)?;
                }
            }
        }
        drop(guard);
        self.drop_alive(name, &owner);
        Ok(ours)
    }

    fn force_release(&self, name: &str) -> io::Result<bool> {
        let _guard = self.lock_key(name)?;
        let now = now_us();
        let Some(state) = self.read_state(name)? else {
            return Ok(false);
        };
        self.break_all(name, state, now)
    }

    /// Compares the holder `holding` shows with the one named (`named`,
    /// its token) and breaks the key as [`Inner::force_release`] does,
    /// both with the key's file locked, so no acquisition comes in between.
    /// A key held as permits loses only the permit whose token is named
    /// ([`Inner::force_release_permit`]).
    fn force_release_holding(&self, name: &str, named: FencingToken) -> io::Result<ForceRelease> {
        let _guard = self.lock_key(name)?;
        let now = now_us();
        let Some(mut state) = self.read_state(name)? else {
            return Ok(ForceRelease::NotHeld);
        };
        if let Some(answer) = self.force_release_permit(name, &mut state, named.get(), now)? {
            return Ok(answer);
        }
        let shown = self
            .shown_holding(name, &mut state, now)?
            .map(|(_, holding)| holding.token);
        let answer = ForceRelease::compare(shown, named);
        if answer == ForceRelease::Released {
            self.break_all(name, state, now)?;
        }
        Ok(answer)
    }

    /// Breaks every lease of the key (its holder, or its read phase or
    /// permits), with the key's file locked by the caller; whether it was
    /// held.
    fn break_all(&self, name: &str, mut state: State, now: u64) -> io::Result<bool> {
        let was_held = state.owner.is_some() && state.expires_at_us > now;
        if state.group
            && let Some(group) = state.owner
        {
            let _ = fs::remove_file(self.alive_path(name, &group));
        }
        state.owner = None;
        state.identity = None;
        state.holder = None;
        state.expires_at_us = 0;
        state.group = false;
        state.members.clear();
        state.marks.clear();
        self.write_state(name, &state, false)?;
        Ok(was_held)
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

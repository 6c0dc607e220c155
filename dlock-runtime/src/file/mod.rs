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
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;

use crate::backend::{
    AcquireRequest, Attempt, Backend, Grant, Holding, OwnerId, ReleaseNotice, ReleaseOutcome,
    ReleaseRequest, Renewal,
};
use crate::error::{LockError, Operation};
use crate::holder::{HolderInfo, check_label};
use crate::key::LockKey;
use crate::token::FencingToken;

mod state;

use state::{HolderRecord, State, expiry_after, file_name, now_us, parse_state, render_state};

const KIND: &str = "file";

/// How often a waiter looks again at a key whose holder's alive file is
/// missing, so cannot tell of its release.
const UNWATCHED_RECHECK: Duration = Duration::from_millis(500);

/// How often a holder watch on a free key looks again: nothing announces an
/// acquisition.
const FREE_RECHECK: Duration = Duration::from_millis(50);

/// How a waiter hears of a holder's release.
enum HolderWatch {
    /// No live holder: try again at once.
    Free,
    /// Turns true when the holder's alive file is unlocked.
    Alive(watch::Receiver<bool>),
    /// The holder's alive file is missing: nothing to watch.
    Unwatchable,
}

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
}

/// One alive file this process holds locked, and when its lease runs out
/// (wall clock, µs), after which it is closed at the next acquisition even
/// if no release ever comes: a descriptor never outlives its lease for long.
struct Alive {
    file: File,
    expires_at_us: u64,
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
        if self.holds_alive(name, owner) {
            return Ok(true);
        }
        let path = self.alive_path(name, owner);
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(true),
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
        let Some(holder) = state.owner else {
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

    fn try_acquire(
        &self,
        name: &str,
        key: &str,
        owner: OwnerId,
        ttl: Duration,
        identity: Option<&str>,
        record: &str,
    ) -> io::Result<Attempt> {
        let _guard = self.lock_key(name)?;
        let now = now_us();
        // Who takes the key, and when, in the step that takes it.
        let holder = HolderRecord {
            record: record.to_owned(),
            since_us: now,
        };
        let state = self.read_state(name)?;
        if let Some(current) = &state {
            // A retry by the owner that holds it (its first answer was
            // lost): it has the key, with the token already drawn.
            if current.owner == Some(owner)
                && current.expires_at_us > now
                && self.holds_alive(name, &owner)
            {
                // The same acquisition: it has held the key since its first
                // answer was written.
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
            // A dead holder's file can go: the state is rewritten below.
            if self.live_holder(name, current, now, true)?.is_some() {
                return Ok(Attempt::Held {
                    expires_in: Some(Duration::from_micros(current.expires_at_us - now)),
                });
            }
        }
        // A key never seen (or whose state was deleted) starts its counter
        // at the wall clock in microseconds, so tokens still rise.
        let counter = state.map_or(now, |s| s.counter).max(1);
        let token = counter
            .checked_add(1)
            .ok_or_else(|| io::Error::other("fencing counter exhausted"))?;
        let alive_path = self.alive_path(name, &owner);
        let alive = File::create(&alive_path)?;
        alive.lock()?;
        let expires_at_us = expiry_after(now, ttl);
        let written = self.write_state(
            name,
            &State {
                counter: token,
                owner: Some(owner),
                expires_at_us,
                key: key.to_owned(),
                identity: identity.map(str::to_owned),
                holder: Some(holder),
            },
            true,
        );
        if let Err(err) = written {
            let _ = fs::remove_file(&alive_path);
            return Err(err);
        }
        self.close_expired(now);
        self.alive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                (name.to_owned(), owner),
                Alive {
                    file: alive,
                    expires_at_us,
                },
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
                    "the alive file of a held lock was removed (a cleaner in the lock \
                     directory?); it is put back"
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

    /// Records a renewed lease's new end with its alive file.
    fn set_alive_expiry(&self, name: &str, owner: &OwnerId, expires_at_us: u64) {
        if let Some(alive) = self
            .alive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(&(name.to_owned(), *owner))
        {
            alive.expires_at_us = expires_at_us;
        }
    }

    fn release(&self, name: &str, owner: OwnerId) -> io::Result<bool> {
        let guard = self.lock_key(name)?;
        let now = now_us();
        let mut ours = false;
        if let Some(mut state) = self.read_state(name)?
            && state.owner == Some(owner)
        {
            ours = state.expires_at_us > now;
            state.owner = None;
            state.identity = None;
            state.holder = None;
            state.expires_at_us = 0;
            self.write_state(name, &state, false)?;
        }
        drop(guard);
        self.drop_alive(name, &owner);
        Ok(ours)
    }

    fn force_release(&self, name: &str) -> io::Result<bool> {
        let _guard = self.lock_key(name)?;
        let now = now_us();
        let Some(mut state) = self.read_state(name)? else {
            return Ok(false);
        };
        let was_held = state.owner.is_some() && state.expires_at_us > now;
        state.owner = None;
        state.identity = None;
        state.holder = None;
        state.expires_at_us = 0;
        self.write_state(name, &state, false)?;
        Ok(was_held)
    }

    /// Who holds the key now, read with the key locked: the owner, token,
    /// identity and holder record of one rewrite of the state, so never a
    /// holder with an earlier lease's. With the key the state names.
    fn holding(&self, name: &str) -> io::Result<Option<(String, Holding)>> {
        let _guard = self.lock_key(name)?;
        let now = now_us();
        let Some(state) = self.read_state(name)? else {
            return Ok(None);
        };
        if self.live_holder(name, &state, now, false)?.is_none() {
            return Ok(None);
        }
        // The counter is the last token drawn, and only an acquisition
        // draws: it is the holder's token.
        let token = FencingToken::new(state.counter);
        // A holder an earlier version recorded has no record; one this
        // version cannot decode (a later version's) reads as none too.
        let holder = state.holder.as_ref().and_then(|held| {
            let info = HolderInfo::decode(&held.record)?;
            // The writer's clock is this host's, as the reader's: only a
            // clock stepped back since the acquisition makes it negative.
            let held_for = Duration::from_micros(now.saturating_sub(held.since_us));
            Some(info.held_for(held_for))
        });
        let holding = Holding::new(Some(token), state.identity)
            .expiring_in(Duration::from_micros(state.expires_at_us - now))
            .held_by(holder);
        Ok(Some((state.key, holding)))
    }

    fn holder(&self, name: &str) -> io::Result<Option<Holding>> {
        Ok(self.holding(name)?.map(|(_, holding)| holding))
    }

    /// Every live holder of a key starting with `prefix`, sorted by key.
    ///
    /// Each state file is first read without a lock (a rename replaces it
    /// whole, so a read sees one version of it): files that are not state
    /// files of this backend, and keys that are free or not under the
    /// prefix, are passed over without touching their lock. A key that
    /// looks held is read again as `holder` reads it, with its lock taken
    /// for that one read, never two at once: testing whether its holder is
    /// alive locks the holder's alive file for a moment, and an acquisition
    /// testing the same file then would take a dead holder for a live one.
    fn held(&self, prefix: &str) -> io::Result<Vec<(String, Holding)>> {
        let unreadable = |e: io::Error| {
            io::Error::new(e.kind(), format!("cannot read {}: {e}", self.dir.display()))
        };
        let mut held = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(unreadable)? {
            let entry = entry.map_err(unreadable)?;
            let file_name = entry.file_name();
            let Some(name) = file_name.to_str().and_then(|n| n.strip_suffix(".state")) else {
                continue;
            };
            if !entry.file_type()?.is_file() {
                continue;
            }
            let Some(state) = self.peek_state(name)? else {
                continue;
            };
            if !self.is_state_of(name, &state, prefix)
                || state.owner.is_none()
                || state.expires_at_us <= now_us()
            {
                continue;
            }
            if let Some((key, holding)) = self.holding(name)?
                && key.starts_with(prefix)
            {
                held.push((key, holding));
            }
        }
        held.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(held)
    }

    /// `NAME.state` read without a lock, or `None` if it is gone or is not
    /// a state file (not UTF-8, not in the format).
    fn peek_state(&self, name: &str) -> io::Result<Option<State>> {
        let path = self.path(name, "state");
        match fs::read(&path) {
            Ok(bytes) => Ok(String::from_utf8(bytes)
                .ok()
                .and_then(|text| parse_state(&text))),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(io::Error::new(
                err.kind(),
                format!("cannot read {}: {err}", path.display()),
            )),
        }
    }

    /// Whether `state` is the state of a key under `prefix` that this
    /// backend keeps in `NAME.state`: a state file copied or renamed by
    /// hand names a key of another file, whose holder it cannot tell.
    fn is_state_of(&self, name: &str, state: &State, prefix: &str) -> bool {
        state.key.starts_with(prefix)
            && LockKey::new(state.key.as_str()).is_ok_and(|key| file_name(&key) == name)
    }

    /// How a waiter hears of the current holder's release.
    fn watch_release(self: &Arc<Self>, name: &str) -> io::Result<HolderWatch> {
        // With the key locked: a holder rewrites the state before it
        // removes its alive file, so a file missing while the state names a
        // live holder was removed by someone else, not by a release.
        let _guard = self.lock_key(name)?;
        let state = self.read_state(name)?;
        let holder = match &state {
            Some(state) => self.live_holder(name, state, now_us(), false)?,
            None => None,
        };
        let Some(holder) = holder else {
            return Ok(HolderWatch::Free);
        };
        Ok(match self.watch_alive(self.alive_path(name, &holder))? {
            Some(released) => HolderWatch::Alive(released),
            None => HolderWatch::Unwatchable,
        })
    }

    /// A receiver that turns true once the holder's alive file is unlocked
    /// (release or death), or `None` if the file is missing. One blocking
    /// thread per file, shared by waiters.
    fn watch_alive(self: &Arc<Self>, path: PathBuf) -> io::Result<Option<watch::Receiver<bool>>> {
        let mut watchers = self.watchers.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(rx) = watchers.get(&path) {
            return Ok(Some(rx.clone()));
        }
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(err) => return Err(err),
        };
        let (tx, rx) = watch::channel(false);
        watchers.insert(path.clone(), rx.clone());
        let inner = Arc::clone(self);
        std::thread::Builder::new()
            .name("dlock-file-wait".into())
            .spawn(move || {
                // Blocks until the holder's exclusive lock is gone.
                let _ = file.lock_shared();
                drop(file);
                inner
                    .watchers
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&path);
                let _ = tx.send(true);
            })?;
        Ok(Some(rx))
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
        let taken = self
            .blocking(Operation::Acquire, key.as_str(), move |inner| {
                let attempt =
                    inner.try_acquire(&name, &text, owner, ttl, identity.as_deref(), &record)?;
                Ok(Taken {
                    inner: Arc::clone(inner),
                    name,
                    owner,
                    attempt: Some(attempt),
                })
            })
            .await?;
        Ok(taken.claim())
    }

    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        let (key, owner, ttl) = (renewal.key, renewal.owner, renewal.ttl);
        let (name, owner) = (file_name(key), *owner);
        self.blocking(Operation::Extend, key.as_str(), move |inner| {
            inner.extend(&name, owner, ttl)
        })
        .await
    }

    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
        let (key, owner) = (lease.key, lease.owner);
        let (name, owner) = (file_name(key), *owner);
        self.blocking(Operation::Release, key.as_str(), move |inner| {
            inner.release(&name, owner)
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
        Ok(match watch {
            // Every waiter of the file hears its release.
            HolderWatch::Alive(mut rx) => ReleaseNotice::new(async move {
                let _ = rx.wait_for(|released| *released).await;
            }),
            // Nobody holds it: the caller's retry will tell.
            HolderWatch::Free => ReleaseNotice::new(std::future::ready(())),
            // Nothing to watch until the holder puts its file back: look
            // again now and then rather than wait out the whole lease.
            HolderWatch::Unwatchable => {
                ReleaseNotice::new(std::future::pending()).recheck_within(UNWATCHED_RECHECK)
            }
        })
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let name = file_name(key);
        self.blocking(Operation::Release, key.as_str(), move |inner| {
            inner.force_release(&name)
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
        Ok(match watch {
            HolderWatch::Alive(mut rx) => ReleaseNotice::new(async move {
                let _ = rx.wait_for(|released| *released).await;
            }),
            HolderWatch::Free => {
                ReleaseNotice::new(std::future::pending()).recheck_within(FREE_RECHECK)
            }
            HolderWatch::Unwatchable => {
                ReleaseNotice::new(std::future::pending()).recheck_within(UNWATCHED_RECHECK)
            }
        })
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
            let _ = self.inner.release(&self.name, self.owner);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit_dir() -> PathBuf {
        std::env::temp_dir().join(format!(
            "dlock-file-unit-{}",
            OwnerId::random().expect("random")
        ))
    }

    #[test]
    fn a_ttl_with_a_fraction_of_a_microsecond_is_rounded_up_in_the_state() {
        let dir = std::env::temp_dir().join(format!(
            "dlock-file-unit-{}",
            OwnerId::random().expect("random")
        ));
        let backend = FileBackend::open(&dir).expect("dir");
        let owner = OwnerId::random().expect("random");
        let ttl = Duration::from_secs(10) + Duration::from_nanos(500);
        let attempt = backend.inner.try_acquire("k", "k", owner, ttl, None, "");
        assert!(matches!(attempt, Ok(Attempt::Acquired(_))), "{attempt:?}");
        let state = backend.inner.read_state("k").expect("readable");
        let _ = fs::remove_dir_all(&dir);
        // A new key's counter starts at the clock reading the expiry is
        // counted from, so the difference is the stored ttl exactly.
        let state = state.expect("written");
        assert_eq!(state.expires_at_us - (state.counter - 1), 10_000_001);
    }

    #[test]
    fn the_identity_is_written_with_the_owner_rewritten_by_a_retry_and_cleared_on_release() {
        let dir = std::env::temp_dir().join(format!(
            "dlock-file-unit-{}",
            OwnerId::random().expect("random")
        ));
        let backend = FileBackend::open(&dir).expect("dir");
        let inner = &backend.inner;
        let (owner, ttl) = (OwnerId::random().expect("random"), Duration::from_secs(10));
        let token = |attempt: io::Result<Attempt>| match attempt {
            Ok(Attempt::Acquired(grant)) => grant.token,
            other => panic!("not acquired: {other:?}"),
        };
        let identity = || {
            let state = inner.read_state("k").expect("readable").expect("written");
            state.identity
        };
        let first = token(inner.try_acquire("k", "k", owner, ttl, Some("a b\n%"), ""));
        assert_eq!(identity().as_deref(), Some("a b\n%"));
        let retried = token(inner.try_acquire("k", "k", owner, ttl, Some("again"), ""));
        assert_eq!(retried, first, "a retry keeps its token");
        assert_eq!(identity().as_deref(), Some("again"));
        let holding = inner.holder("k").expect("readable").expect("held");
        assert_eq!(
            (holding.token, holding.identity.as_deref()),
            (Some(first), Some("again"))
        );
        assert!(inner.release("k", owner).expect("released"));
        assert_eq!(identity(), None, "a release clears it");
        assert_eq!(inner.holder("k").expect("readable"), None);
        let other = OwnerId::random().expect("random");
        let next = token(inner.try_acquire("k", "k", other, ttl, None, ""));
        assert!(next > first);
        let holding = inner.holder("k").expect("readable").expect("held");
        assert_eq!((holding.token, holding.identity), (Some(next), None));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_holder_record_is_written_with_the_key_kept_by_a_retry_and_cleared_on_release() {
        let dir = unit_dir();
        let backend = FileBackend::open(&dir).expect("dir");
        let inner = &backend.inner;
        let (owner, ttl) = (OwnerId::random().expect("random"), Duration::from_secs(10));
        let me = HolderInfo::this_process(Some("unit"));
        let recorded = || {
            inner
                .read_state("k")
                .expect("readable")
                .expect("written")
                .holder
        };
        let before = now_us();
        let first = inner.try_acquire("k", "k", owner, ttl, None, &me.encode());
        assert!(matches!(first, Ok(Attempt::Acquired(_))), "{first:?}");
        let written = recorded().expect("every acquisition records its holder");
        assert_eq!(written.record, me.encode());
        assert!(written.since_us >= before && written.since_us <= now_us());
        let retried = inner.try_acquire("k", "k", owner, ttl, None, "1\tother\t1\t");
        assert!(matches!(retried, Ok(Attempt::Acquired(_))), "{retried:?}");
        assert_eq!(recorded(), Some(written), "a retry is the same acquisition");
        assert!(inner.extend("k", owner, ttl).expect("extend"));
        let holding = inner.holder("k").expect("readable").expect("held");
        let holder = holding.holder.expect("recorded");
        assert_eq!(
            (holder.host, holder.pid, holder.label),
            (me.host, me.pid, me.label)
        );
        assert!(inner.release("k", owner).expect("released"));
        assert_eq!(recorded(), None, "a release clears it");
        let other = OwnerId::random().expect("random");
        let next = inner.try_acquire("k", "k", other, ttl, None, "1\th\t2\t");
        assert!(matches!(next, Ok(Attempt::Acquired(_))), "{next:?}");
        assert!(inner.force_release("k").expect("forced"));
        assert_eq!(recorded(), None, "a forced release clears it");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_clock_stepped_back_since_the_acquisition_reads_as_no_time_held() {
        let dir = unit_dir();
        let backend = FileBackend::open(&dir).expect("dir");
        let inner = &backend.inner;
        let (owner, ttl) = (OwnerId::random().expect("random"), Duration::from_secs(10));
        let record = HolderInfo::this_process(None).encode();
        let taken = inner.try_acquire("k", "k", owner, ttl, None, &record);
        assert!(matches!(taken, Ok(Attempt::Acquired(_))), "{taken:?}");
        let mut state = inner.read_state("k").expect("readable").expect("written");
        if let Some(holder) = &mut state.holder {
            // As if the clock read an hour later when the key was taken.
            holder.since_us += 3_600_000_000;
        }
        inner.write_state("k", &state, false).expect("rewrite");
        let holding = inner.holder("k").expect("readable").expect("held");
        assert_eq!(
            holding.holder.and_then(|holder| holder.held_for),
            Some(Duration::ZERO)
        );
        let _ = fs::remove_dir_all(&dir);
    }
}

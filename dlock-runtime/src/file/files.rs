//! The key's files, as every path of the file backend reads and writes
//! them: the key's lock, its state file (read whole, replaced atomically),
//! and the alive files this process holds locked for its leases. Its own
//! file so that the attempt and release paths read as the steps they take.

use super::*;

impl Inner {
    pub(super) fn path(&self, name: &str, suffix: &str) -> PathBuf {
        self.dir.join(format!("{name}.{suffix}"))
    }

    pub(super) fn alive_path(&self, name: &str, owner: &OwnerId) -> PathBuf {
        self.path(name, &format!("{owner}.alive"))
    }

    /// Locks `NAME.lock` for one read-modify-write of the state.
    pub(super) fn lock_key(&self, name: &str) -> io::Result<File> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.path(name, "lock"))?;
        file.lock()?;
        Ok(file)
    }

    pub(super) fn read_state(&self, name: &str) -> io::Result<Option<State>> {
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
    pub(super) fn write_state(&self, name: &str, state: &State, durable: bool) -> io::Result<()> {
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
    pub(super) fn holder_alive(
        &self,
        name: &str,
        owner: &OwnerId,
        remove_dead: bool,
    ) -> io::Result<bool> {
        self.alive_file_locked(name, owner, true, remove_dead)
    }

    /// Whether `owner`'s alive file of `name` is held locked by a live
    /// process (this one's, or another's): `if_missing` when there is no
    /// file; a file that can be locked belongs to a dead process, and
    /// `remove_dead` removes it.
    pub(super) fn alive_file_locked(
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
    pub(super) fn live_holder(
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
    pub(super) fn drop_alive(&self, name: &str, owner: &OwnerId) {
        self.drop_alive_unless(name, owner, |_| false);
    }

    /// Drops this process's alive file for `owner`'s lease that ended, as
    /// [`Self::drop_alive`] does, unless it is a queued fair waiter's
    /// registration: a renewal that finds no lease changes nothing else,
    /// and a waiter whose file went would be skipped by the next release.
    pub(super) fn drop_lease_alive(&self, name: &str, owner: &OwnerId) {
        self.drop_alive_unless(name, owner, |alive| alive.waiting.is_some());
    }

    /// Removes and closes `owner`'s alive file for `name`, unless `keep`
    /// says its registration stays.
    fn drop_alive_unless(&self, name: &str, owner: &OwnerId, keep: impl FnOnce(&Alive) -> bool) {
        let id = (name.to_owned(), *owner);
        let removed = {
            let mut alive = self.alive.lock().unwrap_or_else(PoisonError::into_inner);
            match alive.get(&id) {
                Some(registered) if keep(registered) => None,
                _ => alive.remove(&id),
            }
        };
        if let Some(alive) = removed {
            let _ = fs::remove_file(self.alive_path(name, owner));
            drop(alive.file);
        }
    }

    /// Closes the alive files of leases that ran out without a release
    /// (a holder that vanished without a runtime to release on drop):
    /// their keys are free by expiry already, and their descriptors must
    /// not stay open for the life of the process.
    pub(super) fn close_expired(&self, now: u64) {
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

    /// Puts back this process's alive file for a lease if something removed
    /// it, so the holder's death frees the key at once again and waiters
    /// can watch it. Called with the key locked: no contender looks at the
    /// new file before it is locked. On failure the lease stays valid, and
    /// its ttl alone frees the key should this process die.
    pub(super) fn restore_alive(&self, name: &str, owner: &OwnerId) {
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
    pub(super) fn holds_alive(&self, name: &str, owner: &OwnerId) -> bool {
        self.alive
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(&(name.to_owned(), *owner))
    }

    /// Records a renewed lease's new end with its alive file (a fair
    /// waiter's registered file is its lease's from then on).
    pub(super) fn set_alive_expiry(&self, name: &str, owner: &OwnerId, expires_at_us: u64) {
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
}

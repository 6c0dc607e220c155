//! Who holds a key on the file backend: the holder read from a key's
//! state (a group's, or the one holder's), the keys held under a prefix,
//! and the watches that wake a reader when the holder changes.

use super::*;

impl Inner {
    /// Who holds the key now, read with the key locked: the owner, token,
    /// identity and holder record of one rewrite of the state, so never a
    /// holder with an earlier lease's. With the key the state names.
    pub(super) fn holding(&self, name: &str) -> io::Result<Option<(String, Holding)>> {
        let _guard = self.lock_key(name)?;
        let now = now_us();
        let Some(mut state) = self.read_state(name)? else {
            return Ok(None);
        };
        self.shown_holding(name, &mut state, now)
    }

    /// [`Inner::holding`] of `state`, read by the caller with the key's
    /// file locked.
    pub(super) fn shown_holding(
        &self,
        name: &str,
        state: &mut State,
        now: u64,
    ) -> io::Result<Option<(String, Holding)>> {
        self.normalize(name, state, now, false)?;
        if state.group {
            return Ok(Some(group_holding(state.clone(), now)));
        }
        if self.live_holder(name, state, now, false)?.is_none() {
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
        let holding = Holding::new(Some(token), state.identity.clone())
            .expiring_in(Duration::from_micros(state.expires_at_us - now))
            .held_by(holder);
        Ok(Some((state.key.clone(), holding)))
    }

    pub(super) fn holder(&self, name: &str) -> io::Result<Option<Holding>> {
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
    pub(super) fn held(&self, prefix: &str) -> io::Result<Vec<(String, Holding)>> {
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
    pub(super) fn peek_state(&self, name: &str) -> io::Result<Option<State>> {
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
    pub(super) fn is_state_of(&self, name: &str, state: &State, prefix: &str) -> bool {
        state.key.starts_with(prefix)
            && LockKey::new(state.key.as_str()).is_ok_and(|key| file_name(&key) == name)
    }

    /// How a waiter hears of the current holder's release.
    pub(super) fn watch_release(self: &Arc<Self>, name: &str) -> io::Result<HolderWatch> {
        // With the key locked: a holder rewrites the state before it
        // removes its alive file, so a file missing while the state names a
        // live holder was removed by someone else, not by a release.
        let _guard = self.lock_key(name)?;
        let mut state = self.read_state(name)?;
        let now = now_us();
        if let Some(state) = &mut state {
            self.normalize(name, state, now, false)?;
        }
        let holder = match &state {
            Some(state) => self.live_holder(name, state, now, false)?,
            None => None,
        };
        let Some(holder) = holder else {
            return match &state {
                Some(state) => self.watch_members(name, state),
                None => Ok(HolderWatch::Free),
            };
        };
        Ok(match self.watch_alive(self.alive_path(name, &holder))? {
            Some(released) => HolderWatch::Alive(released),
            None => HolderWatch::Unwatchable,
        })
    }

    /// A receiver that turns true once the holder's alive file is unlocked
    /// (release or death), or `None` if the file is missing. One blocking
    /// thread per file, shared by waiters.
    pub(super) fn watch_alive(
        self: &Arc<Self>,
        path: PathBuf,
    ) -> io::Result<Option<watch::Receiver<bool>>> {
        self.watch_file(path, false)
    }

    /// A receiver that turns true once no process holds `path` locked
    /// (`exclusive`: not even shared, as a group's members hold it), or
    /// `None` if the file is missing. One blocking thread per file, shared
    /// by waiters.
    pub(super) fn watch_file(
        self: &Arc<Self>,
        path: PathBuf,
        exclusive: bool,
    ) -> io::Result<Option<watch::Receiver<bool>>> {
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
                // Blocks until the holder's exclusive lock is gone (the
                // members' shared ones, for a group's file).
                let _ = if exclusive {
                    file.lock()
                } else {
                    file.lock_shared()
                };
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

/// How a waiter hears of a holder's release.
pub(super) enum HolderWatch {
    /// No live holder: try again at once.
    Free,
    /// Turns true when the holder's alive file is unlocked.
    Alive(watch::Receiver<bool>),
    /// The holder's alive file is missing: nothing to watch.
    Unwatchable,
    /// Shared or permit holders, or writer-waiting marks: any of these
    /// turning true may let a waiter in.
    Any(Vec<watch::Receiver<bool>>),
}

impl HolderWatch {
    /// The notice that resolves when the watch does: `free` while nobody
    /// holds the key, a recheck within the waiters' 500 ms while there is
    /// a holder whose file is missing.
    pub(super) fn notice(self, free: ReleaseNotice) -> ReleaseNotice {
        match self {
            HolderWatch::Alive(rx) => ReleaseNotice::new(first_released(vec![rx])),
            HolderWatch::Any(rxs) => ReleaseNotice::new(first_released(rxs)),
            HolderWatch::Free => free,
            HolderWatch::Unwatchable => {
                ReleaseNotice::new(std::future::pending()).recheck_within(UNWATCHED_RECHECK)
            }
        }
    }
}

/// Resolves when the first of `receivers` turns true (or its watcher is
/// gone).
pub(super) async fn first_released(receivers: Vec<watch::Receiver<bool>>) {
    let mut waits: Vec<_> = receivers
        .into_iter()
        .map(|mut rx| {
            Box::pin(async move {
                let _ = rx.wait_for(|released| *released).await;
            })
        })
        .collect();
    std::future::poll_fn(|cx| {
        if waits
            .iter_mut()
            .any(|wait| wait.as_mut().poll(cx).is_ready())
        {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
}

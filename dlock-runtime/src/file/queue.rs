//! Fair queues of the file backend: the key's queue file, a waiter's
//! registration for its handoff, and the release's handoff to the first
//! live waiter (see the module docs of `file`).

use super::*;

impl Inner {
    /// The key's fair waiters, first in line first; none if it has no
    /// queue file (or one that does not read as a queue).
    pub(super) fn read_queue(&self, name: &str) -> io::Result<Vec<Waiter>> {
        match fs::read(self.path(name, "queue")) {
            Ok(bytes) => Ok(String::from_utf8(bytes)
                .map(|text| parse_queue(&text))
                .unwrap_or_default()),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(err) => Err(err),
        }
    }

    /// Rewrites the queue in place (only ever read with the key locked),
    /// or removes its file once nobody queues.
    pub(super) fn write_queue(&self, name: &str, waiters: &[Waiter]) -> io::Result<()> {
        let path = self.path(name, "queue");
        if waiters.is_empty() {
            return match fs::remove_file(&path) {
                Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
                _ => Ok(()),
            };
        }
        fs::write(&path, render_queue(waiters))
    }

    /// Whether `owner`'s fair waiter still listens for its handoff: its
    /// process holds its registered file locked. Unlike a holder's, a
    /// missing file means it does not (it never registered, or its notice
    /// was dropped); one that can be locked belongs to a process that
    /// died, and is removed.
    pub(super) fn waiter_listening(&self, name: &str, owner: &OwnerId) -> io::Result<bool> {
        self.alive_file_locked(name, owner, false, true)
    }

    /// Drops entries from the front of `waiters` until the first is live:
    /// not expired, and its waiter listening (`me`, the caller's own
    /// owner, listens). True if it dropped any.
    pub(super) fn prune_front(
        &self,
        name: &str,
        waiters: &mut Vec<Waiter>,
        now: u64,
        me: Option<OwnerId>,
    ) -> io::Result<bool> {
        let mut dropped = 0;
        for waiter in waiters.iter() {
            let live = waiter.expires_at_us > now
                && (Some(waiter.owner) == me || self.waiter_listening(name, &waiter.owner)?);
            if live {
                break;
            }
            dropped += 1;
        }
        waiters.drain(..dropped);
        Ok(dropped > 0)
    }

    /// Gives the free key to the first of `waiters` (live: the caller
    /// pruned the front) in one step with the key locked: a token drawn as
    /// an acquisition draws it, the ttl its attempt asked for, its identity
    /// and holder record. Writes the queue, then the state, durably.
    /// Returns the entry handed the key.
    pub(super) fn hand_over(
        &self,
        name: &str,
        state: &mut State,
        waiters: &mut Vec<Waiter>,
        now: u64,
    ) -> io::Result<Waiter> {
        let next = waiters.remove(0);
        let token = state
            .counter
            .max(1)
            .checked_add(1)
            .ok_or_else(|| io::Error::other("fencing counter exhausted"))?;
        if let Some(earlier) = state.owner {
            // Its lease ran out or its process died (a dead holder's file
            // can go: the state is rewritten below).
            self.holder_alive(name, &earlier, true)?;
        }
        self.write_queue(name, waiters)?;
        *state = State {
            counter: token,
            owner: Some(next.owner),
            expires_at_us: now.saturating_add(next.ttl_us),
            key: std::mem::take(&mut state.key),
            identity: next.identity.clone(),
            holder: Some(HolderRecord {
                record: next.record.clone(),
                since_us: now,
            }),
            queued: !waiters.is_empty(),
            marks: std::mem::take(&mut state.marks)
                .into_iter()
                .filter(|(by, _)| *by != next.owner)
                .collect(),
            ..State::default()
        };
        self.write_state(name, state, true)?;
        Ok(next)
    }

    /// Registers `owner` as a fair waiter listening for its handoff: its
    /// alive file, locked for as long as the returned registration lives.
    pub(super) fn listen(self: &Arc<Self>, name: &str, owner: OwnerId) -> io::Result<Listening> {
        let number = self.registrations.fetch_add(1, Ordering::Relaxed);
        let mut alive = self.alive.lock().unwrap_or_else(PoisonError::into_inner);
        let registration = match alive.get_mut(&(name.to_owned(), owner)) {
            // Registered again: the new notice takes the file over.
            Some(held) if held.waiting.is_some() => {
                held.waiting = Some(number);
                Some(number)
            }
            // It holds the key already: the notice finds it so.
            Some(_) => None,
            None => {
                let file = File::create(self.alive_path(name, &owner))?;
                file.lock()?;
                alive.insert(
                    (name.to_owned(), owner),
                    Alive {
                        file,
                        expires_at_us: u64::MAX,
                        waiting: Some(number),
                        _group: None,
                    },
                );
                Some(number)
            }
        };
        Ok(Listening {
            inner: Arc::clone(self),
            name: name.to_owned(),
            owner,
            registration,
        })
    }

    /// Ends a fair waiter's registration, unless it became its lease's.
    pub(super) fn stop_listening(&self, name: &str, owner: &OwnerId, registration: u64) {
        let ended = {
            let mut alive = self.alive.lock().unwrap_or_else(PoisonError::into_inner);
            let id = (name.to_owned(), *owner);
            match alive.get(&id) {
                Some(held) if held.waiting == Some(registration) => alive.remove(&id),
                _ => None,
            }
        };
        if let Some(ended) = ended {
            let _ = fs::remove_file(self.alive_path(name, owner));
            drop(ended.file);
        }
    }

    /// Makes `owner`'s file this process's lease file for a lease that
    /// ends at `expires_at_us`: its registered file, or a new one if
    /// something removed it.
    pub(super) fn adopt(&self, name: &str, owner: &OwnerId, expires_at_us: u64) -> io::Result<()> {
        let mut alive = self.alive.lock().unwrap_or_else(PoisonError::into_inner);
        let id = (name.to_owned(), *owner);
        if let Some(held) = alive.get_mut(&id) {
            held.expires_at_us = expires_at_us;
            held.waiting = None;
            return Ok(());
        }
        let file = File::create(self.alive_path(name, owner))?;
        file.lock()?;
        alive.insert(id, Alive::holding(file, expires_at_us));
        Ok(())
    }

    /// One look of a fair waiter's handoff notice, with the key locked:
    /// the grant if a release handed `owner` the key; else what to wait
    /// for. A key nobody holds (its holder's lease ran out or its process
    /// died) is handed to the first live waiter here and now.
    pub(super) fn handoff_step(
        self: &Arc<Self>,
        name: &str,
        owner: OwnerId,
    ) -> io::Result<HandoffStep> {
        let _guard = self.lock_key(name)?;
        let now = now_us();
        let Some(mut state) = self.read_state(name)? else {
            return Ok(HandoffStep::Recheck(HANDOFF_RECHECK));
        };
        let granted = |state: &State| -> io::Result<HandoffStep> {
            self.adopt(name, &owner, state.expires_at_us)?;
            Ok(HandoffStep::Granted(FencingToken::new(state.counter)))
        };
        if state.owner == Some(owner) && state.expires_at_us > now && !state.group {
            return granted(&state);
        }
        if self.normalize(name, &mut state, now, true)? {
            self.write_state(name, &state, false)?;
        }
        if state.group {
            return Ok(match self.watch_group(name, &state)? {
                Some(released) => HandoffStep::Watch(released),
                None => HandoffStep::Recheck(UNWATCHED_RECHECK),
            });
        }
        let holder = match self.live_holder(name, &state, now, false)? {
            Some(holder) => holder,
            None => {
                let mut waiters = self.read_queue(name)?;
                let changed = self.prune_front(name, &mut waiters, now, None)?;
                if waiters.is_empty() {
                    if changed {
                        self.write_queue(name, &waiters)?;
                    }
                    return Ok(HandoffStep::Recheck(HANDOFF_RECHECK));
                }
                let next = self.hand_over(name, &mut state, &mut waiters, now)?;
                if next.owner == owner {
                    return granted(&state);
                }
                next.owner
            }
        };
        Ok(match self.watch_alive(self.alive_path(name, &holder))? {
            Some(released) => HandoffStep::Watch(released),
            None => HandoffStep::Recheck(UNWATCHED_RECHECK),
        })
    }
}

/// Puts `entry`'s owner at the end of `waiters`, or refreshes the place it
/// has (its entry's life and the ttl it asks for); expired entries go, as
/// if they were not there (so an owner whose entry expired joins anew).
pub(super) fn join(waiters: &mut Vec<Waiter>, entry: Waiter, now: u64) {
    waiters.retain(|w| w.expires_at_us > now);
    match waiters.iter_mut().find(|w| w.owner == entry.owner) {
        Some(place) => {
            place.ttl_us = entry.ttl_us;
            place.expires_at_us = entry.expires_at_us;
            place.identity = entry.identity;
        }
        None => waiters.push(entry),
    }
}

/// What a fair waiter's handoff notice does next.
pub(super) enum HandoffStep {
    /// A release handed it the key: the lease's token.
    Granted(FencingToken),
    /// Wait for the holder's alive file to be unlocked, then look again.
    Watch(watch::Receiver<bool>),
    /// Look again after this long.
    Recheck(Duration),
}

/// A fair waiter's registration for its handoff: dropped (with its
/// notice), it closes and removes the waiter's alive file unless the file
/// has become its lease's, so a release skips the waiter from then on.
pub(super) struct Listening {
    pub(super) inner: Arc<Inner>,
    pub(super) name: String,
    pub(super) owner: OwnerId,
    /// `None` when the owner held the key already at registration.
    pub(super) registration: Option<u64>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        if let Some(registration) = self.registration {
            self.inner
                .stop_listening(&self.name, &self.owner, registration);
        }
    }
}

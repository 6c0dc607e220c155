//! The exclusive holder's paths: the attempt, the renewal, the release and
//! the breaks, each one locked read-modify-write of the key's state file
//! (see the module docs of `file`). Shared holders and permits have the
//! `modes` module, fair queues the `queue` module.

use std::ops::ControlFlow;

use super::*;

impl Inner {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_acquire(
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
        let asking = Contender {
            name,
            key,
            owner,
            ttl,
            identity,
            record,
            queue,
            waits,
        };
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
            return self.queue_behind_group(&asking, current, now);
        }
        if let Some(current) = &mut state
            && let Some(answer) = self.answer_held(&asking, current, now)?
        {
            return Ok(answer);
        }
        // Nobody holds the key. A plain attempt takes it whoever queues
        // (and keeps the `queued` field for them); a fair one takes it only
        // as the first live entry, or when nobody queues.
        let mut queued = state.as_ref().is_some_and(|s| s.queued);
        if queue.is_fair() && (queued || matches!(queue, Queue::Join { .. })) {
            match self.take_turn(&asking, &mut state, now)? {
                ControlFlow::Break(handed) => return Ok(handed),
                ControlFlow::Continue(still_queued) => queued = still_queued,
            }
        }
        self.take_free(&asking, state, queued, now)
    }

    /// An attempt on a key that readers or permit holders hold: a fair
    /// waiter queues, and the attempt waits as a writer behind the group.
    fn queue_behind_group(
        &self,
        asking: &Contender<'_>,
        current: &mut State,
        now: u64,
    ) -> io::Result<Attempt> {
        // A fair waiter queues behind readers and permit holders as
        // behind a holder: the group's end hands it the key in order
        // (its notice watches the group's file).
        if let Queue::Join { entry_ttl } = asking.queue {
            self.join_queue(asking, current, entry_ttl, now)?;
        }
        self.writer_behind_group(asking.name, current, asking.owner, now, asking.waits)
    }

    /// The answer to an attempt on a key `current` shows held, if it is
    /// held: the key again for the owner that holds it, or `Held` (a fair
    /// waiter queued) while another live holder does. `None` when its
    /// holder's lease ran out or its process died.
    fn answer_held(
        &self,
        asking: &Contender<'_>,
        current: &mut State,
        now: u64,
    ) -> io::Result<Option<Attempt>> {
        let Contender {
            name,
            owner,
            ttl,
            identity,
            record,
            ..
        } = *asking;
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
            return Ok(Some(Attempt::Acquired(Grant::new(FencingToken::new(
                state.counter,
            )))));
        }
        if self.live_holder(name, current, now, false)?.is_none() {
            return Ok(None);
        }
        if let Queue::Join { entry_ttl } = asking.queue {
            self.join_queue(asking, current, entry_ttl, now)?;
        }
        Ok(Some(Attempt::Held {
            expires_in: Some(Duration::from_micros(current.expires_at_us - now)),
        }))
    }

    /// Puts a fair waiter's attempt in the key's queue (at its end, or at
    /// the place its owner has), marks the state queued, and puts back the
    /// waiter's alive file if something removed it.
    fn join_queue(
        &self,
        asking: &Contender<'_>,
        current: &mut State,
        entry_ttl: Duration,
        now: u64,
    ) -> io::Result<()> {
        let mut waiters = self.read_queue(asking.name)?;
        join(&mut waiters, asking.entry(now, entry_ttl), now);
        self.write_queue(asking.name, &waiters)?;
        if !current.queued {
            current.queued = true;
            self.write_state(asking.name, current, false)?;
        }
        self.restore_alive(asking.name, &asking.owner);
        Ok(())
    }

    /// A fair attempt on a free key: `Continue` (with whether anyone still
    /// queues) if it is the attempt's turn, its own entry gone from the
    /// queue; `Break` with its answer if a live waiter is first, to which
    /// the key is handed over.
    fn take_turn(
        &self,
        asking: &Contender<'_>,
        state: &mut Option<State>,
        now: u64,
    ) -> io::Result<ControlFlow<Attempt, bool>> {
        let (name, owner) = (asking.name, asking.owner);
        let mut waiters = self.read_queue(name)?;
        let mut changed = false;
        let me = match asking.queue {
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
                    join(&mut waiters, asking.entry(now, entry_ttl), now);
                    self.restore_alive(name, &owner);
                }
                let mut current = state.take().unwrap_or_else(|| State {
                    counter: now,
                    key: asking.key.to_owned(),
                    ..State::default()
                });
                let next = self.hand_over(name, &mut current, &mut waiters, now)?;
                return Ok(ControlFlow::Break(Attempt::Held {
                    expires_in: Some(Duration::from_micros(next.ttl_us)),
                }));
            }
            None => {}
        }
        if changed {
            self.write_queue(name, &waiters)?;
        }
        Ok(ControlFlow::Continue(!waiters.is_empty()))
    }

    /// Takes the free key: a token drawn from the counter, the owner's
    /// alive file locked, and the state written durably before the token
    /// is handed out.
    fn take_free(
        &self,
        asking: &Contender<'_>,
        state: Option<State>,
        queued: bool,
        now: u64,
    ) -> io::Result<Attempt> {
        let Contender {
            name,
            key,
            owner,
            ttl,
            identity,
            record,
            ..
        } = *asking;

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

    pub(super) fn extend(&self, name: &str, owner: OwnerId, ttl: Duration) -> io::Result<bool> {
        let guard = self.lock_key(name)?;
        let now = now_us();
        let state = self.read_state(name)?;
        let Some(mut state) = state.filter(|s| s.owner == Some(owner) && s.expires_at_us > now)
        else {
            drop(guard);
            self.drop_lease_alive(name, &owner);
            return Ok(false);
        };
        state.expires_at_us = expiry_after(now, ttl);
        self.write_state(name, &state, false)?;
        self.set_alive_expiry(name, &owner, state.expires_at_us);
        self.restore_alive(name, &owner);
        Ok(true)
    }

    /// Releases `owner`'s lease, handing the key to the first live fair
    /// waiter if any queue; or, for an owner that does not hold the key,
    /// removes its entry from the queue (rule F3). Either way its alive
    /// file (lease or registration) is closed, which wakes the key's
    /// waiters.
    pub(super) fn release(&self, name: &str, owner: OwnerId) -> io::Result<bool> {
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

    pub(super) fn force_release(&self, name: &str) -> io::Result<bool> {
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
    pub(super) fn force_release_holding(
        &self,
        name: &str,
        named: FencingToken,
    ) -> io::Result<ForceRelease> {
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

/// One exclusive attempt as `try_acquire` is asked it: the key, who asks,
/// for how long, and how it waits.
struct Contender<'a> {
    name: &'a str,
    key: &'a str,
    owner: OwnerId,
    ttl: Duration,
    identity: Option<&'a str>,
    record: &'a str,
    queue: Queue,
    waits: bool,
}

impl Contender<'_> {
    /// The attempt's entry in the key's fair queue, which lives
    /// `entry_ttl` from `now` unless refreshed.
    fn entry(&self, now: u64, entry_ttl: Duration) -> Waiter {
        Waiter {
            owner: self.owner,
            ttl_us: micros(self.ttl),
            expires_at_us: expiry_after(now, entry_ttl),
            record: self.record.to_owned(),
            identity: self.identity.map(str::to_owned),
        }
    }
}

//! The memory backend's attempts in each mode and its release of an
//! exclusive hold, with the handoff to the first fair waiter: the rules of
//! the `Backend` trait on one process's map of entries.

use super::*;

impl MemoryBackend {
    /// An exclusive attempt (rules 1 to 3, F1, M1 and M3).
    pub(super) fn try_exclusive(
        &self,
        entry: &mut Entry,
        request: &AcquireRequest<'_>,
        now: Instant,
    ) -> Attempt {
        let (owner, ttl) = (request.owner, request.ttl);
        if let Some(holder) = entry.holder.as_mut().filter(|h| h.expires_at > now) {
            // A retry by the owner that holds it (its first answer was
            // lost): it has the key, with the token already drawn, for a
            // ttl from now, as the caller counts it.
            if holder.owner == *owner {
                holder.expires_at = after(now, ttl);
                holder.identity = request.identity.map(str::to_owned);
                return Attempt::Acquired(Grant::new(holder.token));
            }
            let expires_in = Some(holder.expires_at - now);
            if let Queue::Join { entry_ttl } = request.queue {
                entry.drop_expired_waiters(now);
                entry.join_queue(request, entry_ttl, now);
            }
            return Attempt::Held { expires_in };
        }
        if let Some(readers_left) = entry.readers_left(now) {
            // Readers hold it: mark a writer that waits, so that no new
            // reader joins (rule M3), unless another writer's mark stands;
            // and look again before the mark runs out.
            if request.waits
                && entry
                    .live_mark(now)
                    .is_none_or(|(marked, _)| marked == *owner)
            {
                entry.writer_waiting = Some((*owner, now + QUEUE_ENTRY_TTL));
            }
            if let Queue::Join { entry_ttl } = request.queue {
                entry.drop_expired_waiters(now);
                entry.join_queue(request, entry_ttl, now);
            }
            return Attempt::Held {
                expires_in: Some(readers_left.min(QUEUE_ENTRY_TTL / 3)),
            };
        }
        if let Some(expires_in) = entry.live_slots(now).map(|(_, h)| h.expires_at - now).min() {
            return Attempt::Held {
                expires_in: Some(expires_in),
            };
        }
        if request.queue.is_fair() {
            entry.drop_expired_waiters(now);
            let in_line = match request.queue {
                Queue::Join { .. } => entry.first_in_line(owner),
                _ => entry.queue.is_empty(),
            };
            if !in_line {
                if let Queue::Join { entry_ttl } = request.queue {
                    entry.join_queue(request, entry_ttl, now);
                }
                return Attempt::Held { expires_in: None };
            }
        }
        // A grant takes its owner out of the queue, whatever its mode: a
        // later release must not hand the key to an acquisition that is
        // over.
        entry.leave_queue(owner);
        if entry
            .live_mark(now)
            .is_some_and(|(marked, _)| marked == *owner)
        {
            entry.writer_waiting = None;
        }
        // The readers of the phase before have all gone.
        entry.readers.clear();
        entry.phase = None;
        // The token is drawn under the same mutex that sets the holder, so
        // token order is acquisition order.
        let token = self.next_token();
        entry.holder = Some(self.new_holder(request, token, now));
        entry.announce_change();
        Attempt::Acquired(Grant::new(token))
    }

    /// A shared attempt (rules M1 to M3, M5).
    pub(super) fn try_shared(
        &self,
        entry: &mut Entry,
        request: &AcquireRequest<'_>,
        now: Instant,
    ) -> Attempt {
        let (owner, ttl) = (request.owner, request.ttl);
        if let Some(holder) = entry.live_holder(now) {
            return Attempt::Held {
                expires_in: Some(holder.expires_at - now),
            };
        }
        if let Some(expires_in) = entry.live_slots(now).map(|(_, h)| h.expires_at - now).min() {
            return Attempt::Held {
                expires_in: Some(expires_in),
            };
        }
        let live_phase = entry.readers_left(now).is_some();
        if let Some(reader) = entry.readers.get_mut(owner).filter(|r| r.expires_at > now) {
            reader.expires_at = after(now, ttl);
            reader.identity = request.identity.map(str::to_owned);
            return Attempt::Acquired(Grant::new(reader.token));
        }
        // A waiting writer goes first: no reader joins past its mark.
        if let Some((_, mark_left)) = entry.live_mark(now) {
            return Attempt::Held {
                expires_in: Some(mark_left),
            };
        }
        let token = match entry.phase.filter(|_| live_phase) {
            Some(token) => token,
            None => {
                entry.readers.clear();
                let token = self.next_token();
                entry.phase = Some(token);
                token
            }
        };
        let reader = self.new_holder(request, token, now);
        entry.readers.insert(*owner, reader);
        entry.announce_change();
        Attempt::Acquired(Grant::new(token))
    }

    /// A permit attempt: the first free slot of `0..permits`, all tried
    /// at once (rules M1, M2, M5).
    pub(super) fn try_permit(
        &self,
        entry: &mut Entry,
        request: &AcquireRequest<'_>,
        permits: u32,
        now: Instant,
    ) -> Attempt {
        let (owner, ttl) = (request.owner, request.ttl);
        let other = entry
            .live_holder(now)
            .map(|h| h.expires_at - now)
            .or_else(|| entry.readers_left(now));
        if let Some(expires_in) = other {
            return Attempt::Held {
                expires_in: Some(expires_in),
            };
        }
        if let Some(slot) = entry.slot_of(owner, now)
            && let Some(Some(holder)) = entry.slots.get_mut(slot as usize)
        {
            holder.expires_at = after(now, ttl);
            holder.identity = request.identity.map(str::to_owned);
            return Attempt::Acquired(Grant::new(holder.token).in_slot(slot));
        }
        let free = (0..permits).find(|slot| {
            entry
                .slots
                .get(*slot as usize)
                .is_none_or(|h| h.as_ref().is_none_or(|h| h.expires_at <= now))
        });
        let Some(slot) = free else {
            let expires_in = entry
                .live_slots(now)
                .filter(|(slot, _)| *slot < permits)
                .map(|(_, h)| h.expires_at - now)
                .min();
            return Attempt::Held { expires_in };
        };
        let index = slot as usize;
        if entry.slots.len() <= index {
            entry.slots.resize_with(index + 1, || None);
        }
        let token = self.next_token();
        entry.slots[index] = Some(self.new_holder(request, token, now));
        entry.announce_change();
        Attempt::Acquired(Grant::new(token).in_slot(slot))
    }

    /// The holder `request` makes, with `token`.
    pub(super) fn new_holder(
        &self,
        request: &AcquireRequest<'_>,
        token: FencingToken,
        now: Instant,
    ) -> Holder {
        let label = self.inner.label.as_deref().or(request.label);
        Holder {
            owner: *request.owner,
            token,
            expires_at: after(now, request.ttl),
            identity: request.identity.map(str::to_owned),
            info: HolderInfo::this_process(label),
            since: now,
        }
    }

    /// An exclusive release: the holder's (handing over to a fair waiter),
    /// or else the owner's queue entry (F3) and writer-waiting mark (M3).
    pub(super) fn release_exclusive(
        &self,
        entry: &mut Entry,
        owner: &OwnerId,
        now: Instant,
    ) -> bool {
        let ours = entry
            .live_holder(now)
            .is_some_and(|holder| holder.owner == *owner);
        if ours {
            entry.holder = None;
            if !self.hand_over(entry, now) {
                entry.announce_release();
            }
        } else {
            entry.leave_queue(owner);
            if entry
                .writer_waiting
                .is_some_and(|(marked, _)| marked == *owner)
            {
                entry.writer_waiting = None;
                // Readers held back by the mark may go.
                entry.announce_release();
            }
        }
        ours
    }

    /// Hands the just-released key of `entry` to its first live fair
    /// waiter: expired entries, and waiters no longer listening (gone, or
    /// never registered), are skipped. `false` when nobody took it.
    pub(super) fn hand_over(&self, entry: &mut Entry, now: Instant) -> bool {
        while let Some(next) = entry.queue.pop_front() {
            let Some(sender) = entry.handoffs.remove(&next.owner) else {
                continue;
            };
            if next.expires_at <= now || sender.is_closed() {
                continue;
            }
            let token = self.next_token();
            let label = self.inner.label.as_deref().or(next.label.as_deref());
            entry.holder = Some(Holder {
                owner: next.owner,
                token,
                expires_at: after(now, next.ttl),
                identity: next.identity,
                info: HolderInfo::this_process(label),
                since: now,
            });
            if sender.send(Grant::new(token)).is_err() {
                // It stopped listening this instant: take the key back.
                entry.holder = None;
                continue;
            }
            entry.announce_change();
            return true;
        }
        false
    }
}

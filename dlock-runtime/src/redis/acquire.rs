//! Acquire attempts: running an acquire script (followed, when asked, by
//! the replicas' acknowledgement), the fair, shared and permit attempts,
//! and the reading of the scripts' answers. Its own file: each attempt
//! pairs a script's keys and arguments with the handling of its answer,
//! and they share the waiter mark and the `WAIT` that follows a grant.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use ::redis::{ErrorKind, RedisResult, Script, ServerErrorKind, Value};
use tokio::time::Instant;

use super::commands::Failure;
use super::keyspace::{self, Keyspace, PermitNames, SharedNames};
use super::redact::scrub;
use super::{
    BARGES, LISTED, RedisBackend, UNWAITED, WAITED_ON, WAITS, bytes, held_value, scripts, sentinel,
    ttl_millis,
};
use crate::backend::{
    Access, AcquireRequest, Attempt, Backend, Grant, Look, OwnerId, Queue, ReleaseRequest,
};
use crate::error::{LockError, Operation};
use crate::key::LockKey;
use crate::token::FencingToken;

/// The owners a backend queued with a `Join`, per key, with when their
/// entries die unless a `Join` refreshes them. A grant takes its owner out
/// of the queue whatever its mode (rule F1), but a plain attempt's script
/// never reads the queue: a `Barge` by an owner found here for its key
/// goes through the fair acquire script instead, whose grant drops the
/// owner's entry and line (see `scripts::FAIR_ACQUIRE_LUA`, `b`). The core
/// never queues and barges with one owner id (owner ids are per
/// acquisition), so its plain attempts find nobody here and cost the
/// server nothing more.
///
/// An owner is forgotten for a key only once the server answered a grant
/// or a release of it there: a call given up half-way may still have left
/// the entry, and a `Barge` through the fair script costs one look more,
/// never a stale line. It knows the owners this instance queued: an owner
/// queued through one instance and barging through another is served as
/// before this memory (its line stays until its entry dies).
#[derive(Default)]
pub(super) struct Queued(Mutex<Owners>);

#[derive(Default)]
struct Owners {
    /// Each owner's keys, with when its entry there dies.
    keys: HashMap<OwnerId, Vec<(Box<str>, Instant)>>,
    /// How many owners there may be before those whose entries all died
    /// are forgotten: twice the live ones at the last sweep, so a sweep
    /// costs each `Join` O(1) on average however many wait.
    sweep_at: usize,
}

/// The fewest owners a sweep waits for.
const QUEUED_SWEEP: usize = 1024;

impl Queued {
    fn owners(&self) -> std::sync::MutexGuard<'_, Owners> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `owner` is queued for `key`, or about to be, by an entry living
    /// `life` from now.
    fn joined(&self, key: &LockKey, owner: &OwnerId, life: Duration) {
        let now = Instant::now();
        // A life no clock can add (`Duration::MAX`): the entry outlives
        // any look.
        let dies = crate::backend::kit::after(now, life);
        let mut owners = self.owners();
        if owners.keys.len() >= owners.sweep_at.max(QUEUED_SWEEP) {
            owners
                .keys
                .retain(|_, keys| keys.iter().any(|(_, dies)| *dies > now));
            owners.sweep_at = 2 * owners.keys.len();
        }
        let keys = owners.keys.entry(*owner).or_default();
        // An owner's dead keys go as it joins another: its list never
        // outgrows its live entries.
        keys.retain(|(queued, until)| *until > now || **queued == *key.as_str());
        match keys
            .iter_mut()
            .find(|(queued, _)| **queued == *key.as_str())
        {
            Some((_, until)) => *until = dies,
            None => keys.push((key.as_str().into(), dies)),
        }
    }

    /// Whether `owner` may still have a live entry in `key`'s queue.
    fn may_wait(&self, key: &LockKey, owner: &OwnerId) -> bool {
        let owners = self.owners();
        owners.keys.get(owner).is_some_and(|keys| {
            keys.iter()
                .any(|(queued, dies)| **queued == *key.as_str() && *dies > Instant::now())
        })
    }

    /// The server answered a grant or a release of `key` to `owner`: it is
    /// not queued there any more.
    pub(super) fn done(&self, key: &LockKey, owner: &OwnerId) {
        let mut owners = self.owners();
        if let Some(keys) = owners.keys.get_mut(owner) {
            keys.retain(|(queued, _)| **queued != *key.as_str());
            if keys.is_empty() {
                owners.keys.remove(owner);
            }
        }
    }
}

impl RedisBackend {
    /// Whether a `Barge` by `owner` goes through the fair acquire script
    /// (see [`Queued`]).
    pub(super) fn barges_from_a_queue(&self, request: &AcquireRequest<'_>) -> bool {
        request.queue == Queue::Barge && self.inner.queued.may_wait(request.key, request.owner)
    }

    /// Runs an acquire `script` with `keys` and `args`: with
    /// [`RedisBuilder::replica_acks`](super::RedisBuilder::replica_acks),
    /// followed on the same connection, in one pipeline, by `WAIT` (so it
    /// counts the replicas that have this acquisition's write); a grant
    /// fewer replicas acknowledged is given back and the attempt is an
    /// error.
    pub(super) async fn attempt(
        &self,
        request: &AcquireRequest<'_>,
        fence: &str,
        script: &Script,
        keys: &[Vec<u8>],
        args: &[Vec<u8>],
    ) -> Result<Attempt, LockError> {
        let key = request.key;
        let Some((replicas, within)) = self.inner.replica_acks else {
            let mut call = script.prepare_invoke();
            for name in keys {
                call.key(name);
            }
            for arg in args {
                call.arg(arg);
            }
            let reply: Value = self.run(Operation::Acquire, key, &call).await?;
            return self.read_attempt_at(request, fence, &reply);
        };
        let mut pipe = ::redis::pipe();
        pipe.ignore_errors();
        pipe.cmd("EVALSHA")
            .arg(script.get_hash())
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        pipe.cmd("WAIT").arg(replicas).arg(ttl_millis(within));
        let pipe = &pipe;
        let behind_sentinels = self.inner.commands.is_sentinel();
        // Bounded: behind a paused primary each one ahead may take its
        // whole call limit, and a caller must not wait for all of them.
        let limit = self.call_limit();
        let Ok(gate) = tokio::time::timeout(limit, self.inner.acks_gate.lock()).await else {
            return Err(self.error(
                Operation::Acquire,
                key,
                format!(
                    "waited {limit:?} behind other acquisitions for the replicas' \
                     acknowledgements; nothing was sent"
                ),
            ));
        };
        let sent = self
            .inner
            .commands
            .send(self.call_limit(), |mut conn| async move {
                let mut answers: Vec<RedisResult<Value>> = pipe.query_async(&mut conn).await?;
                if answers.first().is_some_and(|answer| {
                    answer.as_ref().is_err_and(|err| {
                        err.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
                    })
                }) {
                    script.prepare_invoke().load_async(&mut conn).await?;
                    answers = pipe.query_async(&mut conn).await?;
                }
                // A replica's refusal is the connection's failure: the
                // primary is looked up again (behind sentinels).
                if behind_sentinels
                    && let Some(Err(err)) = answers.first()
                    && sentinel::is_not_primary(err)
                {
                    return Err(err.clone());
                }
                Ok(answers)
            })
            .await;
        drop(gate);
        let answers = match sent {
            Ok((answers, _)) => answers,
            Err(failure) => {
                // The script may have run and taken the key, its reply or
                // the WAIT's lost (a WAIT queued behind others' on the
                // shared connection can outlast the response timeout):
                // give it back (owner-checked, a no-op if it was not
                // taken) rather than leave it held for its ttl.
                let why = self.describe(&failure);
                self.give_back(request, key, None).await;
                return Err(self.error(
                    Operation::Acquire,
                    key,
                    format!("{why}; the lock, if it was taken, was given back"),
                ));
            }
        };
        let mut answers = answers.into_iter();
        let (Some(reply), Some(acked)) = (answers.next(), answers.next()) else {
            return Err(self.error(
                Operation::Acquire,
                key,
                "no answer to the acquisition or to WAIT in the pipeline's reply".into(),
            ));
        };
        let reply = reply.map_err(|err| {
            self.error(Operation::Acquire, key, self.describe(&Failure::Redis(err)))
        })?;
        let attempt = self.read_attempt_at(request, fence, &reply)?;
        let Attempt::Acquired(grant) = &attempt else {
            return Ok(attempt);
        };
        let slot = grant.slot;
        let acked = match acked {
            Ok(Value::Int(acked)) => Ok(acked),
            Ok(other) => Err(format!("unexpected reply {other:?} to WAIT")),
            Err(err) => Err(self.describe(&Failure::Redis(err))),
        };
        let shortfall = match acked {
            Ok(acked) if acked >= i64::from(replicas) => return Ok(attempt),
            Ok(acked) => format!(
                "only {acked} of the {replicas} replicas asked for acknowledged the acquisition \
                 within {within:?}; the lock was given back"
            ),
            Err(why) => format!(
                "the replicas' acknowledgement could not be had ({why}); the lock was given back"
            ),
        };
        self.give_back(request, key, slot).await;
        Err(self.error(Operation::Acquire, key, shortfall))
    }

    /// Gives back a grant too few replicas acknowledged, or one that may
    /// have been made unseen (owner-checked: a no-op when not held), on the
    /// side it was asked for and in its slot if known (rule M4: a permit
    /// release without a slot frees the owner's slot, whichever it is).
    async fn give_back(&self, request: &AcquireRequest<'_>, key: &LockKey, slot: Option<u32>) {
        let release = ReleaseRequest::new(key, request.owner).holding(request.access, slot);
        if let Err(err) = self.release(&release).await {
            tracing::warn!(
                key = %key,
                error = %err,
                "cannot give back a lock too few replicas acknowledged; it expires with its ttl"
            );
        }
    }

    /// What a script's refusal said, without the secrets of the backend's
    /// URLs.
    fn refusal_reason(&self, refusal: &Value) -> String {
        let reason = match refusal {
            Value::BulkString(text) => String::from_utf8_lossy(text).into_owned(),
            other => format!("{other:?}"),
        };
        scrub(&reason, &self.inner.secrets)
    }

    /// Says, once, that an attempt could not mark the holder's value, so
    /// releases will not wake this backend's waiters (they look again when
    /// the holder's ttl runs out, at most every 10 s).
    fn warn_unmarked(&self, key: &LockKey, refusal: &Value) {
        if self.inner.warned_unmarked.swap(true, Ordering::Relaxed) {
            return;
        }
        let reason = self.refusal_reason(refusal);
        tracing::warn!(
            key = %key,
            reason = %reason,
            "redis refused to mark a held lock as waited for (an ACL without +setrange?): \
             releases will not wake waiters, who look again only when the holder's ttl \
             runs out; see the least-privilege ACL in dlock's Redis docs"
        );
    }

    /// Says, once, that a fair waiter's refresh could not read its queue's
    /// stamp with `GETRANGE`: a waiter of a lost queue then finds out only
    /// through the rejoin mark, as before the stamp (see
    /// `scripts::FAIR_ACQUIRE_LUA`).
    fn warn_unstamped(&self, key: &LockKey, refusal: &Value) {
        if self.inner.warned_unstamped.swap(true, Ordering::Relaxed) {
            return;
        }
        let reason = self.refusal_reason(refusal);
        tracing::warn!(
            key = %key,
            reason = %reason,
            "redis refused a fair waiter's read of its queue's stamp (an ACL without \
             +getrange?): a waiter whose queue was deleted finds out through the rejoin \
             mark alone, which a second fault can take; see the least-privilege ACL in \
             dlock's Redis docs"
        );
    }

    /// Says, once, that a fair waiter's queue could not be kept as a list
    /// ([`RedisBuilder::list_queues`](super::RedisBuilder::list_queues)):
    /// the ACL refused to begin one, or refused to read one another
    /// replica began, or the queue's key is of another type. The queue is
    /// then kept as a string, as by a dlock before list queues.
    fn warn_unlisted(&self, key: &LockKey, refusal: &Value) {
        if self.inner.warned_unlisted.swap(true, Ordering::Relaxed) {
            return;
        }
        let reason = self.refusal_reason(refusal);
        tracing::warn!(
            key = %key,
            reason = %reason,
            "a fair queue could not be kept as a list (an ACL without the list commands, \
             or a key of another type at the queue's name): it is kept as a string, as by \
             a dlock before list queues, which costs the server more per handoff and, where \
             another replica keeps the queue as a list, loses the order between them; allow \
             +lpush +rpush +lpop +rpop +lindex +lpos +lrem for every replica's user, or turn \
             list_queues off on every replica"
        );
    }

    /// The waiter mark an attempt takes the key with: `+` when waiters of
    /// this process already wait for it (so its release wakes them), for a
    /// lease taken with an identity (a leader, watched by observers the
    /// store cannot see), or when every release is to be published.
    pub(super) fn mark(&self, request: &AcquireRequest<'_>, names: &Keyspace) -> u8 {
        self.mark_for(request, &names.released)
    }

    /// [`RedisBackend::mark`], for the key whose release channel is
    /// `released`.
    fn mark_for(&self, request: &AcquireRequest<'_>, released: &str) -> u8 {
        if self.inner.publish_every_release
            || request.identity.is_some()
            || self.inner.subscriber.has_waiters(released)
        {
            WAITED_ON
        } else {
            UNWAITED
        }
    }

    /// A fair attempt ([`Queue::Respect`], [`Queue::Join`]), or a
    /// [`Queue::Barge`] by an owner this backend queued (see [`Queued`]):
    /// the fair acquire script, which reads and keeps the key's queue in
    /// the same step (see `scripts::FAIR_ACQUIRE_LUA`). One round trip, as
    /// a plain attempt.
    pub(super) async fn try_acquire_fair(
        &self,
        request: &AcquireRequest<'_>,
    ) -> Result<Attempt, LockError> {
        let (key, owner, ttl) = (request.key, request.owner, request.ttl);
        if request.identity.is_some() && request.queue.is_fair() {
            return Err(LockError::InvalidOption {
                option: "fair",
                reason: "the redis backend does not queue an acquisition with an identity \
                         (a leader election's): its handoff could not record it"
                    .into(),
            });
        }
        let names = Keyspace::of(key);
        let entry_ttl = match request.queue {
            Queue::Join { entry_ttl } => {
                self.inner.queued.joined(key, owner, entry_ttl);
                ttl_millis(entry_ttl).to_string()
            }
            Queue::Respect => String::new(),
            Queue::Barge => BARGES.to_owned(),
        };
        // The entry's record becomes a handoff's holder info, read as one
        // line: a record never holds a newline (labels are checked when
        // set), but a request built by hand might.
        let record = request
            .holder_record(self.inner.label.as_deref())
            .replace(['\n', '\r'], "?");
        let (queue, entry) = keyspace::queue_and_entry_names(key, owner);
        let mut keys = vec![
            bytes(&names.lock),
            bytes(&names.fence),
            bytes(queue),
            bytes(entry),
        ];
        let mut args = vec![
            held_value(owner, self.mark(request, &names)).to_vec(),
            bytes(ttl_millis(ttl)),
            bytes(record),
            bytes(entry_ttl),
        ];
        args.push(if request.waits {
            bytes(WAITS)
        } else {
            Vec::new()
        });
        args.push(if self.inner.list_queues {
            bytes(LISTED)
        } else {
            Vec::new()
        });
        if let Some(identity) = request.identity {
            // Only a queued owner's `Barge` (see `Queued`): recorded as
            // `ACQUIRE_AS` records it.
            keys.push(bytes(keyspace::holder_name(key)));
            args.push(bytes(identity));
        }
        let attempt = self
            .attempt(request, &names.fence, &scripts::FAIR_ACQUIRE, &keys, &args)
            .await;
        match (&attempt, request.queue) {
            (Ok(Attempt::Acquired(_)), _) => self.inner.queued.done(key, owner),
            // The entry lives its whole life from the server's answer.
            (_, Queue::Join { entry_ttl }) => self.inner.queued.joined(key, owner, entry_ttl),
            _ => {}
        }
        attempt
    }

    /// A shared attempt (rules M1 to M3, M5): the shared acquire script,
    /// one round trip (see `scripts::SHARED_ACQUIRE_LUA`), followed by the
    /// replicas' acknowledgement when asked for, as an exclusive one.
    pub(super) async fn try_acquire_shared(
        &self,
        request: &AcquireRequest<'_>,
    ) -> Result<Attempt, LockError> {
        let names = SharedNames::of(request.key);
        let mark = self.mark_for(request, &names.released);
        let args = [
            request.owner.to_hex().to_vec(),
            bytes(ttl_millis(request.ttl)),
            vec![mark],
        ];
        let keys = [
            bytes(&names.lock),
            bytes(&names.fence),
            bytes(&names.readers),
            bytes(&names.writer),
            bytes(&names.phase),
        ];
        self.attempt(
            request,
            &names.fence,
            &scripts::SHARED_ACQUIRE,
            &keys,
            &args,
        )
        .await
    }

    /// A permit attempt (rules M1, M2, M5): the permit script finds the
    /// caller's slot, or the lowest free one of `0..permits`, in one round
    /// trip, at a cost that grows with the live holders, not with `permits`
    /// (see `scripts::PERMIT_ACQUIRE_LUA`).
    pub(super) async fn try_acquire_permit(
        &self,
        request: &AcquireRequest<'_>,
        permits: u32,
    ) -> Result<Attempt, LockError> {
        let names = PermitNames::of(request.key);
        if let Some(expires_in) = self.behind_own_waiters(request, &names.released) {
            return Ok(Attempt::Behind { expires_in });
        }
        let mark = self.mark_for(request, &names.released);
        let args = [
            request.owner.to_hex().to_vec(),
            bytes(ttl_millis(request.ttl)),
            vec![mark],
            bytes(permits),
        ];
        let keys = [bytes(&names.lock), bytes(&names.fence), bytes(&names.slots)];
        let sent = Instant::now();
        let answer = self
            .attempt(
                request,
                &names.fence,
                &scripts::PERMIT_ACQUIRE,
                &keys,
                &args,
            )
            .await;
        if let Ok(Attempt::Held {
            expires_in: Some(expires_in),
        }) = &answer
        {
            self.inner
                .subscriber
                .note_refusal(&names.released, sent + *expires_in);
        }
        answer
    }

    /// A permit attempt answered in process: a caller that waits, making
    /// its first attempt or the one right after it subscribed, queues
    /// behind this process's waiters of the key while they are queued, the
    /// server said every permit was taken a moment ago, and the earliest
    /// expiry it last told of is ahead. A release is
    /// announced to every process (the sentinel is marked once any attempt
    /// was refused) and wakes the longest waiter here, which asks the
    /// server; and the caller looks again at that expiry on its own, and
    /// asks the server soon in any case (the core's rule). So asking would
    /// only find the key full, or take a permit from a waiter that was
    /// here first. `None`: ask the server.
    fn behind_own_waiters(&self, request: &AcquireRequest<'_>, released: &str) -> Option<Duration> {
        let queued = match request.look {
            Look::First => true,
            Look::Subscribed { queued_behind } => queued_behind,
            _ => false,
        };
        if !(queued && request.waits && request.identity.is_none()) {
            return None;
        }
        self.inner.subscriber.queued_nap(released)
    }

    /// An acquire script's answer to `request`: the token when taken (and
    /// the slot, for a permit: `{token, slot, free}`), the holder's
    /// remaining ttl when held (with the refusal to mark it, if any).
    /// `fence` names the fence key in an error.
    fn read_attempt_at(
        &self,
        request: &AcquireRequest<'_>,
        fence: &str,
        reply: &Value,
    ) -> Result<Attempt, LockError> {
        let key = request.key;
        if let Access::Permits { permits } = request.access
            && let Value::Array(parts) = reply
            && let [Value::BulkString(token), Value::Int(slot), rest @ ..] = parts.as_slice()
        {
            if let [Value::Int(0)] = rest {
                let released = PermitNames::of(key).released;
                self.inner.subscriber.note_full(&released);
            }
            let token = std::str::from_utf8(token)
                .ok()
                .and_then(|token| token.parse::<u64>().ok())
                .filter(|token| *token > 0);
            let slot = u32::try_from(*slot).ok().filter(|slot| *slot < permits);
            return match (token, slot) {
                (Some(token), Some(slot)) => Ok(Attempt::Acquired(
                    Grant::new(FencingToken::new(token)).in_slot(slot),
                )),
                _ => Err(self.error(
                    Operation::Acquire,
                    key,
                    format!("unexpected reply {reply:?} from the permit script"),
                )),
            };
        }
        let token = match reply {
            Value::BulkString(text) => std::str::from_utf8(text)
                .ok()
                .and_then(|text| text.parse::<u64>().ok())
                .filter(|token| *token > 0),
            Value::Int(remaining) => return Ok(held(*remaining)),
            // Held, but the holder's value could not be marked: its release
            // will not be published, and waiters look again at its expiry.
            Value::Array(parts) => match parts.as_slice() {
                [Value::Int(remaining), refusal] => {
                    self.warn_unmarked(key, refusal);
                    return Ok(held(*remaining));
                }
                // Held; the queue could not be begun, or read, as a list.
                [Value::Int(remaining), refusal, Value::BulkString(kind)] if kind == b"list" => {
                    self.warn_unlisted(key, refusal);
                    return Ok(held(*remaining));
                }
                // Held; the refresh could not read the queue's stamp.
                [Value::Int(remaining), refusal, _] => {
                    self.warn_unstamped(key, refusal);
                    return Ok(held(*remaining));
                }
                _ => None,
            },
            _ => None,
        };
        match token {
            Some(token) => Ok(Attempt::Acquired(Grant::new(FencingToken::new(token)))),
            None => Err(self.error(
                Operation::Acquire,
                key,
                format!(
                    "unexpected reply {reply:?} from the acquire script (is `{fence}` a fencing counter?)"
                ),
            )),
        }
    }
}

/// The grant a release published on the key's handoff channel for this
/// waiter (after its owner id): `<token> <ms the lease lasts>`; `None` for
/// a message of another shape.
pub(super) fn read_handoff(message: &[u8]) -> Option<Grant> {
    let (token, valid_for) = std::str::from_utf8(message).ok()?.split_once(' ')?;
    let token = token.parse::<u64>().ok().filter(|token| *token > 0)?;
    let valid_for = Duration::from_millis(valid_for.parse().ok()?);
    Some(Grant::new(FencingToken::new(token)).valid_for(valid_for))
}

/// `Held`, with the remaining ttl in ms the acquire script answered
/// (negative: the key has no expiry, or is gone).
fn held(remaining: i64) -> Attempt {
    Attempt::Held {
        expires_in: u64::try_from(remaining).ok().map(Duration::from_millis),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> LockKey {
        LockKey::new(name).expect("key")
    }

    /// An owner queued for a key stays so until a grant or a release of
    /// that very key, and a `Join` with a life no clock can add is kept.
    #[test]
    fn an_owner_is_forgotten_for_a_key_only_by_that_keys_grant_or_release() {
        let queued = Queued::default();
        let owner = OwnerId::random().expect("owner");
        let (k, elsewhere) = (key("k"), key("elsewhere"));
        queued.joined(&k, &owner, Duration::from_secs(30));
        queued.joined(&elsewhere, &owner, Duration::MAX);
        assert!(
            queued.may_wait(&elsewhere, &owner),
            "a join for ever is kept"
        );
        queued.done(&elsewhere, &owner);
        assert!(queued.may_wait(&k, &owner), "still queued for k");
        assert!(!queued.may_wait(&elsewhere, &owner), "done elsewhere");
        queued.done(&k, &owner);
        assert!(!queued.may_wait(&k, &owner), "done for k");
        assert!(
            queued.owners().keys.is_empty(),
            "nothing kept for a done owner"
        );
    }

    /// Dead entries are swept, but not at every `Join`: the next sweep
    /// waits for twice the owners that lived through the last one, and
    /// never for fewer than `QUEUED_SWEEP`.
    #[test]
    fn dead_owners_are_swept_and_live_ones_kept() {
        let queued = Queued::default();
        let k = key("k");
        let live = OwnerId::random().expect("owner");
        queued.joined(&k, &live, Duration::from_secs(30));
        let dead = |n: usize| {
            for _ in 0..n {
                queued.joined(&k, &OwnerId::random().expect("owner"), Duration::ZERO);
            }
        };
        dead(QUEUED_SWEEP);
        assert!(
            queued.may_wait(&k, &live),
            "a live owner survives the sweep"
        );
        assert_eq!(queued.owners().keys.len(), 2, "the dead were swept");
        dead(10);
        assert_eq!(
            queued.owners().keys.len(),
            12,
            "no sweep below the threshold"
        );
    }

    /// An owner's dead keys go when it joins another, so one owner id
    /// joining many keys keeps only its live ones.
    #[test]
    fn an_owners_dead_keys_go_when_it_joins_another() {
        let queued = Queued::default();
        let owner = OwnerId::random().expect("owner");
        let live = key("live");
        queued.joined(&live, &owner, Duration::from_secs(30));
        for i in 0..100 {
            queued.joined(&key(&format!("dead-{i}")), &owner, Duration::ZERO);
        }
        let owners = queued.owners();
        assert_eq!(
            owners.keys[&owner].len(),
            2,
            "the live key and the last joined"
        );
    }
}

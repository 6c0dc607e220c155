//! The [`Backend`] operations of [`RedisBackend`]: each builds its script's
//! keys and arguments, sends it, and reads the answer. Its own file: the
//! trait's one impl block; the steps it shares with others (the attempts,
//! the renewal pipelines, the holder reads) are in sibling files.

use ::redis::{ErrorKind, RedisResult, ServerErrorKind, Value};
use async_trait::async_trait;
use futures_util::StreamExt as _;
use tokio::time::sleep;

use super::acquire::read_handoff;
use super::commands::Failure;
use super::inspect::read_holding;
use super::keyspace::{self, Keyspace, PermitNames, SharedNames};
use super::redact::scrub;
use super::renewal::{reload_renewals, renewal_calls, side_renewal, slot_arg};
use super::{
    DEGRADED_RECHECK, KIND, LIST_READS_IN_FLIGHT, RedisBackend, UNWAITED, WAITS, bytes, held_value,
    scripts, sentinel, ttl_millis,
};
use crate::backend::{
    Access, AcquireRequest, Attempt, Backend, ForceRelease, Handoff, Holding, OwnerId,
    ReleaseNotice, ReleaseOutcome, ReleaseRequest, Renewal,
};
use crate::error::{LockError, Operation};
use crate::key::LockKey;

#[async_trait]
impl Backend for RedisBackend {
    fn kind(&self) -> &'static str {
        KIND
    }

    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        match request.access {
            Access::Exclusive => {}
            _ if request.identity.is_some() => {
                return Err(LockError::InvalidOption {
                    option: request.access.option(),
                    reason: format!(
                        "the redis backend records an identity (a leader election's) for an \
                         exclusive lease only, not a {} one",
                        request.access
                    ),
                });
            }
            Access::Shared => return self.try_acquire_shared(request).await,
            Access::Permits { permits } => return self.try_acquire_permit(request, permits).await,
        }
        if request.queue.is_fair() || self.barges_from_a_queue(request) {
            return self.try_acquire_fair(request).await;
        }
        let (key, owner, ttl) = (request.key, request.owner, request.ttl);
        let names = Keyspace::of(key);
        let script = match request.identity {
            None => &*scripts::ACQUIRE,
            Some(_) => &*scripts::ACQUIRE_AS,
        };
        let mut keys = vec![bytes(&names.lock), bytes(&names.fence)];
        let mut args = vec![
            held_value(owner, self.mark(request, &names)).to_vec(),
            bytes(ttl_millis(ttl)),
            bytes(request.holder_record(self.inner.label.as_deref())),
        ];
        if let Some(identity) = request.identity {
            keys.push(bytes(keyspace::holder_name(key)));
            args.push(bytes(identity));
        }
        // Rule M3: only a caller that waits leaves a writer-waiting mark
        // behind readers.
        if request.waits {
            args.push(bytes(WAITS));
        }
        self.attempt(request, &names.fence, script, &keys, &args)
            .await
    }

    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        let (key, owner, ttl) = (renewal.key, renewal.owner, renewal.ttl);
        if renewal.access != Access::Exclusive {
            let script = side_renewal(renewal);
            let extended: i64 = self.run(Operation::Extend, key, &script).await?;
            return Ok(extended == 1);
        }
        let mut script = match renewal.recorded {
            None => scripts::EXTEND.prepare_invoke(),
            Some(_) => scripts::EXTEND_AS.prepare_invoke(),
        };
        script
            .key(keyspace::lock_name(key))
            .arg(&held_value(owner, UNWAITED)[..])
            .arg(ttl_millis(ttl));
        if let Some((identity, token)) = renewal.recorded {
            script
                .key(keyspace::holder_name(key))
                .arg(token.get())
                .arg(identity);
        }
        let extended: i64 = self.run(Operation::Extend, key, &script).await?;
        Ok(extended == 1)
    }

    /// One pipeline of owner-checked renewals: one round trip for the whole
    /// batch on a single server. A cluster spreads the keys over nodes, so
    /// there the renewals go out together on the multiplexed connection.
    async fn extend_many(&self, leases: &[Renewal<'_>]) -> Vec<Result<bool, LockError>> {
        if self.is_cluster() {
            let each = leases.iter().map(|renewal| self.extend(renewal));
            return futures_util::future::join_all(each).await;
        }
        if leases.is_empty() {
            return Vec::new();
        }
        let mut pipe = ::redis::pipe();
        pipe.ignore_errors();
        renewal_calls(&mut pipe, leases);
        let pipe = &pipe;
        let behind_sentinels = self.inner.commands.is_sentinel();
        let sent = self
            .inner
            .commands
            .send(self.call_limit(), |mut conn| async move {
                let mut answers: Vec<RedisResult<i64>> = pipe.query_async(&mut conn).await?;
                // A server that lost its script cache (a restart, SCRIPT
                // FLUSH; or one that never ran them, so a new server's
                // first renewal): load the scripts and send the batch
                // again, in one pipeline (renewing twice is harmless).
                let no_script = |answer: &RedisResult<i64>| {
                    answer.as_ref().is_err_and(|err| {
                        err.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
                    })
                };
                if answers.iter().any(no_script) {
                    answers = reload_renewals(leases).query_async(&mut conn).await?;
                }
                // A replica's refusal is the connection's failure: behind
                // sentinels the primary is looked up again and the batch
                // sent there (renewing twice is harmless).
                if behind_sentinels
                    && let Some(Err(err)) = answers
                        .iter()
                        .find(|answer| answer.as_ref().is_err_and(sentinel::is_not_primary))
                {
                    return Err(err.clone());
                }
                Ok(answers)
            })
            .await;
        let answers = match sent {
            Ok((answers, _)) => answers,
            Err(failure) => {
                let text = self.describe(&failure);
                return leases
                    .iter()
                    .map(|lease| Err(self.error(Operation::Extend, lease.key, text.clone())))
                    .collect();
            }
        };
        leases
            .iter()
            .enumerate()
            .map(|(i, lease)| match answers.get(i) {
                Some(Ok(extended)) => Ok(*extended == 1),
                Some(Err(err)) => Err(self.error(
                    Operation::Extend,
                    lease.key,
                    self.describe(&Failure::Redis(err.clone())),
                )),
                None => Err(self.error(
                    Operation::Extend,
                    lease.key,
                    "no answer in the pipeline's reply".into(),
                )),
            })
            .collect()
    }

    /// A "not the owner" answer to a retry after a broken connection is
    /// [`ReleaseOutcome::Unconfirmed`]: the first request may have released
    /// the key before its reply was lost.
    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
        let (key, owner) = (lease.key, lease.owner);
        let mut script = match lease.access {
            Access::Exclusive => scripts::RELEASE.prepare_invoke(),
            Access::Shared => scripts::SHARED_RELEASE.prepare_invoke(),
            Access::Permits { .. } => scripts::PERMIT_RELEASE.prepare_invoke(),
        };
        match lease.access {
            Access::Exclusive => {
                script
                    .key(keyspace::lock_name(key))
                    .arg(&held_value(owner, UNWAITED)[..]);
            }
            Access::Shared => {
                let names = SharedNames::of(key);
                script
                    .key(names.lock)
                    .key(names.readers)
                    .key(names.phase)
                    .arg(&owner.to_hex()[..]);
            }
            Access::Permits { .. } => {
                let names = PermitNames::of(key);
                script
                    .key(names.lock)
                    .key(names.slots)
                    .arg(&owner.to_hex()[..])
                    .arg(slot_arg(lease.slot));
            }
        }
        let (released, retried): (i64, bool) = self
            .run_noting_retry(Operation::Release, key, &script)
            .await?;
        if lease.access == Access::Exclusive {
            // Released, or out of the queue (rule F3).
            self.inner.queued.done(key, owner);
        }
        if released == 2
            && !self
                .inner
                .warned_unannounced
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                key = %key,
                "redis refused to announce a release (an ACL without +publish?): the key was \
                 let go, but waiters are not woken and find it free only at their next look; \
                 see the least-privilege ACL in dlock's Redis docs"
            );
        }
        Ok(match (released == 1 || released == 2, retried) {
            (true, _) => ReleaseOutcome::Released,
            (false, true) => ReleaseOutcome::Unconfirmed,
            (false, false) => ReleaseOutcome::NotOwner,
        })
    }

    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        let names = Keyspace::of(key);
        match self.inner.subscriber.subscribe(&names.released).await {
            Ok(notice) => Ok(notice),
            Err(err) => {
                // The commands may still work: wait by looking again soon
                // rather than failing the acquisition.
                tracing::warn!(
                    key = %key,
                    error = %scrub(&err.to_string(), &self.inner.secrets),
                    "redis pub/sub unavailable; the waiter polls until it is back"
                );
                Ok(ReleaseNotice::new(sleep(DEGRADED_RECHECK)).recheck_within(DEGRADED_RECHECK))
            }
        }
    }

    /// Fair waiters queue in a string beside the lock, and a release hands
    /// the key over in its own script (see the [module docs](super)).
    fn supports_fair(&self) -> bool {
        true
    }

    /// Readers share a hash beside the lock, permits a hash of slots, each
    /// attempt one script (see `scripts::SHARED_ACQUIRE_LUA` and
    /// `scripts::PERMIT_ACQUIRE_LUA`).
    fn supports_access(&self, access: Access) -> bool {
        match access {
            Access::Exclusive | Access::Shared => true,
            Access::Permits { permits } => permits > 0,
        }
    }

    /// True while a fair waiter of this process has a mailbox on the key's
    /// handoff channel and the server has confirmed the subscription on a
    /// connection not known to be broken: another waiter's
    /// `subscribe_handoff` then costs no round trip, and its first try
    /// could only find the queue taken.
    fn queued_here(&self, key: &LockKey) -> bool {
        self.inner
            .subscriber
            .has_mailboxes(&keyspace::handoff_channel(key))
    }

    /// Follows the key's handoff channel on the pub/sub connection that
    /// serves release notices (subscribed once per key while fair waiters
    /// of this process wait on it, confirmed before this returns), with a
    /// mailbox for `owner`. The notice resolves with the token and the
    /// lease's length a release published for `owner`; it subscribes again
    /// by itself when the connection breaks, and gives its mailbox (and,
    /// for the last waiter of the key, the subscription) back when
    /// dropped. Should pub/sub be unavailable, the
    /// notice is returned all the same and keeps trying to subscribe: the
    /// waiter's periodic attempt finds a key handed to it meanwhile its own
    /// (rule 3).
    async fn subscribe_handoff(
        &self,
        key: &LockKey,
        owner: &OwnerId,
    ) -> Result<Handoff, LockError> {
        let channel = keyspace::handoff_channel(key);
        let (wait, failure) = self
            .inner
            .subscriber
            .handoff(&channel, owner.to_hex(), read_handoff)
            .await;
        if let Some(err) = failure {
            tracing::warn!(
                key = %key,
                error = %scrub(&err.to_string(), &self.inner.secrets),
                "redis pub/sub unavailable; a fair waiter relies on its periodic attempts \
                 until it is back"
            );
        }
        Ok(Handoff::new(wait))
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let names = Keyspace::of(key);
        let mut script = scripts::FORCE_RELEASE.prepare_invoke();
        script.key(&names.lock).arg(&names.released);
        let deleted: i64 = self.run(Operation::Release, key, &script).await?;
        Ok(deleted == 1)
    }

    /// One script compares the holder's token, read as `holder` reads it,
    /// and breaks the lock (see [`Backend::force_release_holding`]). A key
    /// held as permits is refused with an error, nothing broken: its slots
    /// keep no token to tell the permit named from the others.
    async fn force_release_holding(
        &self,
        key: &LockKey,
        expected: &Holding,
    ) -> Result<ForceRelease, LockError> {
        let named = crate::backend::named_token(KIND, key, expected)?;
        let names = Keyspace::of(key);
        let mut script = scripts::FORCE_RELEASE_HOLDING.prepare_invoke();
        script
            .key(&names.lock)
            .key(&names.fence)
            .key(keyspace::holder_name(key))
            .arg(&names.released)
            .arg(named.get().to_string());
        let answer: i64 = self.run(Operation::Release, key, &script).await?;
        Ok(match answer {
            -2 => {
                return Err(self.error(
                    Operation::Release,
                    key,
                    "the key is held as permits, and the Redis backend keeps no token per \
                     permit, so the permit named cannot be told from the others; nothing was \
                     released (`force_release` breaks every permit of the key)"
                        .to_owned(),
                ));
            }
            1 => ForceRelease::Released,
            -1 => ForceRelease::NotHeld,
            _ => ForceRelease::HolderChanged,
        })
    }

    async fn holder(&self, key: &LockKey) -> Result<Option<Holding>, LockError> {
        let names = Keyspace::of(key);
        let mut script = scripts::HOLDER.prepare_invoke();
        script
            .key(&names.lock)
            .key(&names.fence)
            .key(keyspace::holder_name(key))
            .key(keyspace::info_name(key));
        let reply: Value = self.run(Operation::Inspect, key, &script).await?;
        read_holding(&reply).ok_or_else(|| {
            self.error(
                Operation::Inspect,
                key,
                format!("unexpected reply {reply:?} from the holder script"),
            )
        })
    }

    /// A `SCAN` of the whole keyspace (of every primary of a cluster) for
    /// the lock names under `prefix`, then one holder read per key found,
    /// all in flight together (up to `LIST_READS_IN_FLIGHT`); keys freed
    /// meanwhile are left out. See the [module docs](super).
    async fn held(&self, prefix: &str) -> Result<Vec<(String, Holding)>, LockError> {
        let mut keys: Vec<String> = self
            .scan(prefix, &keyspace::scan_pattern(prefix))
            .await?
            .iter()
            .filter_map(|name| keyspace::key_of_lock_name(name))
            .filter(|key| key.starts_with(prefix))
            .collect();
        keys.sort();
        keys.dedup();
        let reads = keys
            .into_iter()
            .filter_map(|key| LockKey::new(key).ok())
            .map(|key| async move {
                let holding = self.holder(&key).await?;
                Ok(holding.map(|holding| (key.as_str().to_owned(), holding)))
            });
        let read: Vec<Result<Option<(String, Holding)>, LockError>> =
            futures_util::stream::iter(reads)
                .buffered(LIST_READS_IN_FLIGHT)
                .collect()
                .await;
        read.into_iter().filter_map(Result::transpose).collect()
    }

    /// Releases of a lease taken with an identity are always published, and
    /// so are such acquisitions, on the channel waiters listen to. A watch
    /// hears every message, whoever else of this process waits on it.
    async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        let names = Keyspace::of(key);
        match self.inner.subscriber.watch(&names.released).await {
            Ok(notice) => Ok(notice),
            Err(err) => {
                tracing::warn!(
                    key = %key,
                    error = %scrub(&err.to_string(), &self.inner.secrets),
                    "redis pub/sub unavailable; the holder watch polls until it is back"
                );
                Ok(ReleaseNotice::new(sleep(DEGRADED_RECHECK)).recheck_within(DEGRADED_RECHECK))
            }
        }
    }
}

//! `EtcdBackend`: locks in an etcd cluster (v3 API), feature `etcd`.
//!
//! - **A lease per lock.** An acquisition grants an etcd lease for its ttl
//!   and takes the key in one transaction, only if it is absent (`create
//!   revision == 0`), writing the owner id, the holder record and the
//!   identity, all on that lease. The lease id is chosen by the client from
//!   the owner id and the ttl, so a retry of the same acquisition (rule 3)
//!   names the same lease and finds its own key, in the same transaction.
//!   A lock whose holder dies ends with its lease: etcd deletes the keys
//!   when the lease runs out.
//! - **The fencing token is the lock key's create revision**: etcd's
//!   revision rises with every write to the cluster and is part of the
//!   replicated log, so it keeps rising across a leader change, a member
//!   restart or the loss of a minority of members. The one way back is a
//!   disaster recovery: a cluster restored from a snapshot starts again
//!   at the snapshot's revision, below the tokens issued after it, and
//!   would issue them again; fence a resource anew (or raise its floor
//!   above the old cluster's last revision) after such a restore.
//! - **Renewal and release are owner-checked.** A renewal keeps the lease
//!   alive, then checks (in one read of every key of the batch) that the
//!   lock is still this owner's and on that lease; a renewal to another
//!   ttl moves the keys onto a new lease in one transaction compared on
//!   the owner and the old lease. A release deletes the keys in one
//!   transaction compared on the owner, then revokes the lease.
//!   A batch of renewals ([`Backend::extend_many`]) keeps its leases alive
//!   all at once, each with one request and answer on a short keep-alive
//!   stream of its own (the client crate offers no way to name several
//!   leases on one stream), then reads every key in one transaction (at
//!   most 64 renewals, 128 reads, a transaction: etcd's default
//!   `--max-txn-ops`). A renewal of a lease taken with an identity also
//!   writes the identity record again if it went missing.
//! - **Lease ttls are whole seconds**: etcd counts leases in seconds, so a
//!   lease is kept for its ttl rounded up to the next second, and at least
//!   the cluster's minimum lease ttl (1.5 × the election timeout, rounded up:
//!   2 s with etcd's defaults). The holder is told it lost the lease at its
//!   own ttl whatever the store does, so the key stays held (and
//!   exclusive) for at most that rounding after the holder stopped.
//! - **Waiting without a herd**: one etcd watch per waited-on key per
//!   backend, shared by the process's waiters; a delete of the lock key
//!   (a release, a lease that ran out, a broken lock) wakes one waiter of
//!   the process, which passes the wake-up on if it gives up. An attempt
//!   that finds the key held answers `Held { expires_in: None }`: etcd
//!   deletes an expired lease's key, and the watch sees that too.
//! - **Every call is bounded**: connecting by the connect timeout (an
//!   unreachable cluster is an error, never a hang), every request by the
//!   response timeout (a renewal's tries by the time its lease has left,
//!   see "A leader change" below). A release that gets no answer is sent
//!   again, up to three times in all; a retry that finds the key no longer
//!   the caller's answers [`ReleaseOutcome::Unconfirmed`]. A member that
//!   lost its leader refuses at once
//!   (`require_leader`), so a holder cut off with it fails its renewals
//!   and is told its lease is lost when the lease's validity ends.
//!
//! ## Keyspace
//!
//! For a lock key `K`:
//!
//! | name | holds |
//! | --- | --- |
//! | `dlock/lock/K` | the holder's owner id (32 hex digits), on its lease; its create revision is the token |
//! | `dlock/holder/K` | who took the lock: host, pid and label ([`crate::holder`]), on the same lease |
//! | `dlock/identity/K` | only for leases taken with an identity (leader election): the identity, on the same lease |
//!
//! All three are written in the transaction that takes the key and deleted
//! in the one that releases it. The key follows a fixed category prefix,
//! and no category's prefix is a prefix of another's, so a key (whatever it
//! holds, `/` included) cannot name another category's entry or another
//! key's: keys are stored as they are, without escaping, and
//! [`Backend::held`] is a range read over `dlock/lock/<prefix>`. A holder
//! record or identity is read only when it is on the lock's own lease, so
//! one left behind never names a later holder. etcd keeps no clock that
//! a client can read, so a holder record carries no time of acquisition
//! ([`HolderInfo::held_for`](crate::HolderInfo::held_for) is `None`).
//!
//! ## Endpoints
//!
//! `http://host:port`, one or more members of one cluster; requests are
//! balanced over the members that answer. Credentials for etcd's
//! authentication go in the user info, `http://user:password@host:2379`
//! (percent-encoded), the same on every endpoint; they are sent to etcd's
//! `Authenticate` call only (when connecting, and again whenever etcd
//! refuses the token it gave: a simple token ends after
//! `--auth-token-ttl` unused and with a restart of its member), and never
//! shown: `Debug` output and errors show the endpoints without them. A
//! password may be written without percent-encoding too: the user info
//! ends at the URL's last `@`. TLS (`https://`) is not supported yet
//! and refused.
//!
//! ## What the cluster's failures do
//!
//! - **A leader change** keeps every lock: leases and keys are replicated,
//!   and a new leader counts every lease's ttl again from when it took
//!   over (etcd keeps a lease's remaining time only on its leader, unless
//!   the cluster runs with `--experimental-enable-lease-checkpoint`), so
//!   none expires because renewals could not reach a leader meanwhile.
//!   A renewal's keep-alive and read go out once more, to a member the
//!   client picks anew, whenever a quarter of the time the lease has left
//!   ([`Renewal::time_left`], at most the response timeout) passes without
//!   an answer, and the first answer of any try counts: a request stuck on
//!   a leader whose host died (its connection open, nothing coming back)
//!   or on a member waiting for it never uses up the lease; a try that
//!   failed with its connection (the keep-alive timeout of the connection
//!   to that leader fails every request on it at once) is sent again at
//!   once while the lease has time left. A lease whose ttl is at least
//!   three times [`EtcdBackend::min_lease_ttl`] (6 s with etcd's defaults)
//!   is kept through the loss of the leader member, whenever it comes,
//!   with up to 64 leases renewed by one backend (measured on a 2-core
//!   machine); a shorter one may run out when the election takes longer
//!   than it has left. With more leases on one backend (128 lost a few),
//!   the retries of all their renewals may not all be answered in time at
//!   that ttl: give them a longer one.
//!   The other side of it: the key of a holder that died shortly before a
//!   leader change stays held for up to a whole ttl more than
//!   [`Backend::expiry_slack`] says (measured on etcd 3.4: a 10 s lease
//!   with 2 s left had 8 s left 2.5 s after the leader was killed).
//!   Tokens keep rising (the revision is in the log).
//! - **A lost member** (a follower, or the leader once a new one is
//!   elected) changes nothing while a quorum is left; clients of the
//!   backend move to the members that answer.
//! - **A partition**: the side with a quorum goes on. A holder that reaches
//!   only the minority side cannot renew (its member has no leader and
//!   refuses), is told its lease is lost when the lease's validity ends,
//!   and its lease runs out on the majority side, where another holder
//!   then takes the key with a higher token.
//!
//! Fair mode is not supported ([`Backend::supports_fair`] is `false`).

mod builder;
mod endpoints;
mod keyspace;
mod leases;
mod requests;
mod watch;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, DeleteOptions, Error as EtcdError, GetOptions, KeyValue,
    LeaseGrantOptions, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse,
};
use futures_util::StreamExt;
use futures_util::future::join_all;
use futures_util::stream::FuturesUnordered;
use tokio::time::{Instant, sleep, sleep_until, timeout};

use crate::backend::{
    AcquireRequest, Attempt, Backend, ForceRelease, Grant, Holding, ReleaseNotice, ReleaseOutcome,
    ReleaseRequest, Renewal,
};
use crate::error::{LockError, Operation};
use crate::holder::HolderInfo;
use crate::key::LockKey;
use crate::token::FencingToken;

pub use builder::EtcdBuilder;
use endpoints::scrub;
use keyspace::{Names, key_of_lock, key_of_record, lease_id, lease_seconds};
use watch::Watches;

const KIND: &str = "etcd";

/// How long connecting may take by default, the first read included.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one request may wait for its answer by default.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(3);
/// How soon a waiter looks again when its key's watch cannot be created
/// (the requests may still work): polling, as a last resort.
const DEGRADED_RECHECK: Duration = Duration::from_millis(500);
/// The most operations one transaction may hold on etcd's default
/// settings (`--max-txn-ops`): a renewal batch reads its keys in
/// transactions of at most this many.
const MAX_TXN_OPS: usize = 128;
/// Renewals per read transaction: each reads its lock key and, for a lease
/// taken with an identity, the identity record.
const RENEWALS_PER_TXN: usize = MAX_TXN_OPS / 2;
/// How late, at most, etcd's leader deletes an expired lease's keys: it
/// looks for expired leases every 500 ms and revokes them through one
/// round of consensus.
const EXPIRY_SWEEP: Duration = Duration::from_secs(1);
/// The longest a lease whose time left etcd reads as `seconds` can keep
/// its key: etcd cuts the time left down to whole seconds (1.9 s reads 1),
/// so it is rounded up, and its leader deletes the key up to
/// [`EXPIRY_SWEEP`] after the lease ran out. Shown as a holder's "expires
/// in" and sent as `Retry-After`, which must not send a client back
/// before the key can be free.
fn time_left(seconds: u64) -> Duration {
    Duration::from_secs(seconds.saturating_add(1)).saturating_add(EXPIRY_SWEEP)
}
/// How many times a release is sent before its failure is the answer.
const RELEASE_TRIES: usize = 3;
/// The pause after a release that got no answer, before sending it again.
const RELEASE_PAUSE: Duration = Duration::from_millis(50);

/// Locks in an etcd cluster.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_runtime::LockError> {
/// use std::time::Duration;
/// use dlock_runtime::{etcd::EtcdBackend, registry, LockOptions};
///
/// registry().register("etcd", EtcdBackend::connect(&["http://127.0.0.1:2379"]).await?);
/// let lease = LockOptions::new(Duration::from_secs(30))
///     .backend("etcd")
///     .wait(Duration::from_secs(5))
///     .acquire("nightly-report")
///     .await?;
/// // The token is the lock key's create revision in etcd.
/// println!("token {}", lease.token()); // send it with every write
/// lease.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    watches: Watches,
    /// The endpoints without credentials, for `Debug` and errors.
    shown: Vec<String>,
    /// Passwords to scrub from any error text.
    secrets: Vec<String>,
    response_timeout: Duration,
    /// The cluster's minimum lease ttl, learnt when connecting.
    min_lease_ttl: Duration,
    /// The label acquisitions record, over the process's.
    label: Option<String>,
}

impl EtcdBackend {
    /// Connects to the etcd cluster whose members are `endpoints` (see the
    /// [module docs](self) for their form), with the default timeouts.
    pub async fn connect(endpoints: &[&str]) -> Result<Self, LockError> {
        Self::builder(endpoints).connect().await
    }

    /// Settings for connecting to `endpoints`, to adjust before
    /// [`EtcdBuilder::connect`].
    pub fn builder(endpoints: &[&str]) -> EtcdBuilder {
        EtcdBuilder::new(endpoints)
    }

    /// How many lock keys this backend watches now (one watch per key
    /// with waiters or holder watches in this process), for tests of its
    /// upkeep.
    pub fn watched_keys(&self) -> usize {
        self.inner.watches.watched_keys()
    }

    /// The cluster's shortest lease: etcd keeps a lease at least this
    /// long (1.5 × its election timeout, rounded up to a second; 2 s with
    /// etcd's defaults), whatever ttl was asked for.
    pub fn min_lease_ttl(&self) -> Duration {
        self.inner.min_lease_ttl
    }
}

/// The key-value of the first answer of `responses` if it is a read that
/// found one.
fn first_kv(responses: &[TxnOpResponse], at: usize) -> Option<KeyValue> {
    match responses.get(at) {
        Some(TxnOpResponse::Get(get)) => get.kvs().first().cloned(),
        Some(TxnOpResponse::Delete(delete)) => delete.prev_kvs().first().cloned(),
        _ => None,
    }
}

/// A create revision as a token; revisions start at 1.
fn token_of(revision: i64) -> Option<FencingToken> {
    u64::try_from(revision)
        .ok()
        .filter(|r| *r > 0)
        .map(FencingToken::new)
}

#[async_trait]
impl Backend for EtcdBackend {
    fn kind(&self) -> &'static str {
        KIND
    }

    /// A lease lasts its ttl rounded up to a second, and at least the
    /// cluster's minimum: at most [`EtcdBackend::min_lease_ttl`] longer
    /// than asked, and the leader then revokes it on its next sweep of
    /// expired leases (every 500 ms), through one round of consensus.
    fn expiry_slack(&self) -> Duration {
        self.inner.min_lease_ttl + EXPIRY_SWEEP
    }

    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        let key = request.key.as_str();
        let names = Names::of(request.key);
        let seconds = lease_seconds(request.ttl);
        let lease = lease_id(request.owner, seconds);
        self.grant(Operation::Acquire, key, lease, seconds).await?;
        let owner = request.owner.to_hex();
        let record = request.holder_record(self.inner.label.as_deref());
        let writes = || Self::writes(&names, &owner, record.clone(), request.identity, lease);
        // One step: take the key if absent (rules 1 and 2); else, if it is
        // this owner's (a retry, rule 3), take it again on this lease;
        // else read who holds it.
        let retry = Txn::new()
            .when([Compare::value(
                names.lock.as_str(),
                CompareOp::Equal,
                owner.to_vec(),
            )])
            .and_then([vec![TxnOp::get(names.lock.as_str(), None)], writes()].concat())
            .or_else([TxnOp::get(names.lock.as_str(), None)]);
        let txn = Txn::new()
            .when([Compare::create_revision(
                names.lock.as_str(),
                CompareOp::Equal,
                0,
            )])
            .and_then(writes())
            .or_else([TxnOp::txn(retry)]);
        let answer = self.txn(Operation::Acquire, key, txn).await?;
        let unexpected = |what: &str| {
            self.error(
                Operation::Acquire,
                key,
                &format!("unexpected answer from etcd to the acquire transaction: {what}"),
            )
        };
        if answer.succeeded() {
            // The transaction's revision is the new key's create revision.
            let revision = answer.header().map_or(0, |h| h.revision());
            let token = token_of(revision).ok_or_else(|| unexpected("no revision"))?;
            return Ok(Attempt::Acquired(Grant::new(token)));
        }
        let inner = match answer.op_responses().into_iter().next() {
            Some(TxnOpResponse::Txn(inner)) => inner,
            _ => return Err(unexpected("no nested answer")),
        };
        let found = first_kv(&inner.op_responses(), 0);
        if inner.succeeded() {
            let kv = found.ok_or_else(|| unexpected("the retry read nothing"))?;
            let token =
                token_of(kv.create_revision()).ok_or_else(|| unexpected("no create revision"))?;
            if kv.lease() != lease {
                self.revoke(kv.lease()).await;
            }
            return Ok(Attempt::Acquired(Grant::new(token)));
        }
        // The lease granted for this attempt is left to the waiter's next
        // attempt (same owner, same lease) or to run out: revoking it here
        // would cost every losing attempt a round trip.
        // etcd deletes the key when the holder's lease runs out, and the
        // watch sees it: no need to ask the lease's ttl.
        Ok(Attempt::Held {
            expires_in: if found.is_some() {
                None
            } else {
                Some(Duration::ZERO)
            },
        })
    }

    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        self.extend_many(std::slice::from_ref(renewal))
            .await
            .pop()
            .unwrap_or_else(|| {
                Err(self.error(Operation::Extend, renewal.key.as_str(), "no answer"))
            })
    }

    async fn extend_many(&self, renewals: &[Renewal<'_>]) -> Vec<Result<bool, LockError>> {
        // Every batch at once, each lease's time left counted from now: a
        // batch sent after another had its answer would count it from later
        // than the caller did, and try on past the lease's validity.
        let started = Instant::now();
        join_all(
            renewals
                .chunks(RENEWALS_PER_TXN)
                .map(|batch| self.extend_batch(batch, started)),
        )
        .await
        .into_iter()
        .flatten()
        .collect()
    }

    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
        let key = lease.key.as_str();
        let names = Names::of(lease.key);
        let owner = lease.owner.to_hex();
        // Compare and delete in one step: a holder whose lease ran out
        // never deletes the key of whoever holds it now.
        let txn = Txn::new()
            .when([Compare::value(
                names.lock.as_str(),
                CompareOp::Equal,
                owner.to_vec(),
            )])
            .and_then(ending_deletes(&names));
        // A request without an answer (a timeout, a connection lost on the
        // way back) may have released the key: it is sent again (up to
        // [`RELEASE_TRIES`] in all; the first retry may still meet the
        // broken connection), and a retry that finds the key not ours
        // cannot tell whether an earlier try freed it or the lease had
        // ended before (`Unconfirmed`).
        let mut first_failure = None;
        let mut answer = None;
        for _ in 0..RELEASE_TRIES {
            match self.txn(Operation::Release, key, txn.clone()).await {
                Ok(done) => {
                    answer = Some(done);
                    break;
                }
                Err(err) => {
                    first_failure.get_or_insert(err);
                    sleep(RELEASE_PAUSE).await;
                }
            }
        }
        let retried = first_failure.is_some();
        let answer = match (answer, first_failure) {
            (Some(answer), _) => answer,
            (None, Some(err)) => return Err(err),
            (None, None) => return Err(self.error(Operation::Release, key, "no answer")),
        };
        if !answer.succeeded() {
            return Ok(if retried {
                ReleaseOutcome::Unconfirmed
            } else {
                ReleaseOutcome::NotOwner
            });
        }
        if let Some(kv) = first_kv(&answer.op_responses(), 0) {
            self.revoke(kv.lease()).await;
        }
        Ok(ReleaseOutcome::Released)
    }

    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        let names = Names::of(key);
        match self.inner.watches.release(&names.lock).await {
            Ok(notice) => Ok(notice),
            Err(text) => Ok(self.degraded(key, &text)),
        }
    }

    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        let names = Names::of(key);
        let txn = Txn::new().and_then(ending_deletes(&names));
        let answer = self.txn(Operation::Release, key.as_str(), txn).await?;
        let broken = first_kv(&answer.op_responses(), 0);
        if let Some(kv) = &broken {
            self.revoke(kv.lease()).await;
        }
        Ok(broken.is_some())
    }

    /// One transaction: the lock key's create revision (its token) compared
    /// with the token named, and the deletes of [`Backend::force_release`]
    /// only if they are equal; else a read of the lock key, which tells a
    /// changed holder from none.
    async fn force_release_holding(
        &self,
        key: &LockKey,
        expected: &Holding,
    ) -> Result<ForceRelease, LockError> {
        let named = crate::backend::named_token(KIND, key, expected)?;
        let revision = i64::try_from(named.get()).map_err(|_| {
            self.error(
                Operation::Release,
                key.as_str(),
                "the token named is no etcd revision; nothing was released",
            )
        })?;
        let names = Names::of(key);
        let txn = Txn::new()
            .when([Compare::create_revision(
                names.lock.as_str(),
                CompareOp::Equal,
                revision,
            )])
            .and_then(ending_deletes(&names))
            .or_else([TxnOp::get(names.lock.as_str(), None)]);
        let answer = self.txn(Operation::Release, key.as_str(), txn).await?;
        let found = first_kv(&answer.op_responses(), 0);
        if !answer.succeeded() {
            return Ok(match found {
                Some(_) => ForceRelease::HolderChanged,
                None => ForceRelease::NotHeld,
            });
        }
        match found {
            Some(kv) => {
                self.revoke(kv.lease()).await;
                Ok(ForceRelease::Released)
            }
            // Compared equal, so the key existed: a delete that found
            // nothing cannot be, but says nothing was broken.
            None => Ok(ForceRelease::NotHeld),
        }
    }

    async fn holder(&self, key: &LockKey) -> Result<Option<Holding>, LockError> {
        let names = Names::of(key);
        let txn = Txn::new().and_then([
            TxnOp::get(names.lock.as_str(), None),
            TxnOp::get(names.holder.as_str(), None),
            TxnOp::get(names.identity.as_str(), None),
        ]);
        let answer = self.txn(Operation::Inspect, key.as_str(), txn).await?;
        let responses = answer.op_responses();
        let Some(lock) = first_kv(&responses, 0) else {
            return Ok(None);
        };
        let on_lock_lease = |kv: Option<KeyValue>| {
            kv.filter(|kv| kv.lease() == lock.lease())
                .and_then(|kv| kv.value_str().ok().map(str::to_owned))
        };
        let record = on_lock_lease(first_kv(&responses, 1));
        let identity = on_lock_lease(first_kv(&responses, 2));
        let mut holding = Holding::new(token_of(lock.create_revision()), identity)
            .held_by(record.as_deref().and_then(HolderInfo::decode));
        let lease = lock.lease();
        let left = self
            .bounded(Operation::Inspect, key.as_str(), || {
                let mut leases = self.inner.client.lease_client();
                async move { leases.time_to_live(lease, None).await }
            })
            .await?;
        if let Ok(seconds) = u64::try_from(left.ttl()) {
            holding = holding.expiring_in(time_left(seconds));
        }
        Ok(Some(holding))
    }

    async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        let names = Names::of(key);
        match self.inner.watches.change(&names.lock).await {
            Ok(notice) => Ok(notice),
            Err(text) => Ok(self.degraded(key, &text)),
        }
    }

    async fn held(&self, prefix: &str) -> Result<Vec<(String, Holding)>, LockError> {
        let names = Names::of_prefix(prefix);
        let range = || Some(GetOptions::new().with_prefix());
        // One read of the three ranges: one revision, one state.
        let txn = Txn::new().and_then([
            TxnOp::get(names.lock.as_str(), range()),
            TxnOp::get(names.holder.as_str(), range()),
            TxnOp::get(names.identity.as_str(), range()),
        ]);
        let answer = self.txn(Operation::List, prefix, txn).await?;
        let responses = answer.op_responses();
        let kvs = |at: usize| match responses.get(at) {
            Some(TxnOpResponse::Get(get)) => get.kvs().to_vec(),
            _ => Vec::new(),
        };
        let mut records = std::collections::HashMap::new();
        for kv in kvs(1).into_iter().chain(kvs(2)) {
            if let (Some((key, is_identity)), Ok(value)) = (key_of_record(kv.key()), kv.value_str())
            {
                records.insert((key.to_owned(), is_identity, kv.lease()), value.to_owned());
            }
        }
        let mut held: Vec<(String, Holding)> = kvs(0)
            .into_iter()
            .filter_map(|lock| {
                let key = key_of_lock(lock.key())?.to_owned();
                if !key.starts_with(prefix) {
                    return None;
                }
                let record = records.get(&(key.clone(), false, lock.lease()));
                let identity = records.get(&(key.clone(), true, lock.lease())).cloned();
                let holding = Holding::new(token_of(lock.create_revision()), identity)
                    .held_by(record.and_then(|r| HolderInfo::decode(r)));
                Some((key, holding))
            })
            .collect();
        held.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(held)
    }
}

impl EtcdBackend {
    /// A notice for when the key's watch could not be created: the waiter
    /// looks again on its own.
    fn degraded(&self, key: &LockKey, reason: &str) -> ReleaseNotice {
        tracing::warn!(
            key = %key,
            reason = %scrub(reason, &self.inner.secrets),
            "could not watch an etcd lock key; its waiters poll until a watch works again"
        );
        ReleaseNotice::new(std::future::pending()).recheck_within(DEGRADED_RECHECK)
    }
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("endpoints", &self.inner.shown)
            .field("response_timeout", &self.inner.response_timeout)
            .field("label", &self.inner.label)
            .finish_non_exhaustive()
    }
}

/// The deletes that end a lease, in one transaction: the lock key (its
/// value read back, to tell what was broken), its holder record and its
/// identity.
fn ending_deletes(names: &Names) -> [TxnOp; 3] {
    [
        TxnOp::delete(
            names.lock.as_str(),
            Some(DeleteOptions::new().with_prev_key()),
        ),
        TxnOp::delete(names.holder.as_str(), None),
        TxnOp::delete(names.identity.as_str(), None),
    ]
}

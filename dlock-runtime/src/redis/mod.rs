//! `RedisBackend`: locks in Redis (a single server or a Redis Cluster).
//!
//! - **Acquire is one round trip**: a Lua script sets the lock key `NX PX`
//!   to a random 128-bit owner id and, only if that worked, draws the key's
//!   fencing token, returning it; when the key is held it returns the
//!   holder's remaining ttl, so a waiter knows when to look again even if
//!   the holder expires without a word.
//! - **Tokens survive data loss**: a token is `max(last token + 1, server
//!   time in µs)`, so a fencing counter lost with the data (a restart
//!   without persistence, a failover to a replica that missed writes)
//!   restarts above every token issued before instead of at 1. The one
//!   assumption left: the server's clock never moves backwards (and after a
//!   failover, the new primary's clock is not behind the old one's by more
//!   than the failover took).
//! - **Release and renewal are owner-checked** compare-and-act scripts; a
//!   release publishes on the key's channel when an attempt found the key
//!   held (the waiter mark, see [`protocol`]'s acquire script), so an
//!   uncontended cycle costs the server no `PUBLISH`.
//! - **Waiting without polling**: one pub/sub connection per backend, one
//!   subscription per waited-on key, confirmed before a waiter retries; a
//!   waiter also wakes when the holder's ttl runs out.
//! - **A silent link is replaced, not waited out**: a connection can go
//!   quiet without breaking (a NAT or load balancer that forgot it, a host
//!   that lost power), and the kernel gives up on it only after about 15
//!   minutes. A command without a reply within the response timeout makes
//!   the backend drop its connection and try once more on a new one
//!   (callers that time out together share one new connection); no
//!   acquisition attempt, renewal or release takes longer than the connect
//!   plus the response timeout. While
//!   waiters wait, the pub/sub connection gets a `PING` every second, and
//!   one that does not answer is replaced and its waiters look again;
//!   nothing is sent while nobody waits.
//!
//! ## Keyspace
//!
//! For a lock key `K`, with `T` = `K` with `%`, `{` and `}` percent-encoded:
//!
//! | name | type | holds |
//! | --- | --- | --- |
//! | `dlock:{T}:lock` | string with a `PX` expiry | the holder's owner id (32 hex digits) and a waiter mark (`-` or `+`) |
//! | `dlock:{T}:fence` | string (integer), no expiry | the last fencing token issued for `K` |
//! | `dlock:{T}:info` | string with the lock's `PX` expiry | who took the lock: the owner id, the server time of the acquisition in µs, and the holder's host, pid and label ([`crate::holder`]); written, renewed and deleted in the same scripts as the lock |
//! | `dlock:{T}:holder` | string, no expiry | only for leases taken with an identity (leader election): the owner id, the token and the identity |
//! | `dlock:{T}:released` | pub/sub channel | one message per release someone may wait for |
//! | `dlock:{T}:queue` | string with a `PX` no shorter than its longest-lived entry's | only while fair waiters queue: one owner id a line, in arrival order (see [Fair mode](#fair-mode)) |
//! | `dlock:{T}:waiter:<owner id>` | string with the entry's `PX` | one per queued fair waiter while its entry lives: the ttl it asked for and its holder record |
//! | `dlock:{T}:handoff` | pub/sub channel | one message per handoff to a fair waiter: its owner id, the token and how long that lease lasts |
//! | `dlock:{T}:readers` | hash with the read phase's `PX` | while two or more readers hold: owner id → expiry in server ms (see [Shared locks and permits](#shared-locks-and-permits)) |
//! | `dlock:{T}:phase` | string with the read phase's `PX` | the read phase's token, and while it has one reader, that reader's owner id (its expiry the key's `PX`) |
//! | `dlock:{T}:writer` | string, `PX` 3 s | a writer-waiting mark: the owner id of a writer that found readers |
//! | `dlock:{T}:slots` | hash with the permits' `PX` | while permits are held: slot → expiry in server ms and owner id |
//!
//! `{T}` is a Redis Cluster hash tag, so all the keys live in one slot and
//! the scripts are valid on a cluster. Fence keys are small and kept
//! forever; deleting one is safe (the next token restarts from the clock).
//! An info key or identity record is read only while the owner id it
//! starts with holds the lock, so one left behind (the lock deleted by
//! hand, or by an older dlock, which writes no info) never names a later
//! holder; a lock taken by an older dlock reads as held by an unknown
//! holder (`holder: None`).
//!
//! ## Fair mode
//!
//! [`LockOptions::fair`](crate::LockOptions::fair) is kept with a queue
//! beside the lock, in the same hash slot, so every step stays one script
//! on a cluster too:
//!
//! - **The queue** is a plain string, one owner id a line in arrival
//!   order; each waiter's entry lives in a small key of its own beside it
//!   (`…:waiter:<owner id>`: the ttl it asked for and its holder record),
//!   whose `PX` is the entry's life. Strings, so fair mode needs no
//!   command the least-privilege ACL below lacks; the queue's `PX` is
//!   never shorter than its longest-lived entry's, so an abandoned queue
//!   goes away. A waiter's refresh, every second, sets its own entry key
//!   again and leaves the queue alone, so waiting costs the server the
//!   same small step per waiter however many queue; the queue is read and
//!   written when someone joins, leaves or is handed the key (a walk from
//!   its front, over the dead entries it drops, to the first live one).
//! - **Attempts are one round trip.** A fair caller's first try takes the
//!   key only if it is free and nobody live is queued; a queued waiter's
//!   attempt (every second, to keep its entry alive) takes it only as the
//!   first live entry, and otherwise keeps its place or joins at the end,
//!   marking the holder's value `+` so its release looks at the queue. A
//!   fair attempt that finds the key free with someone else first (its
//!   holder's lease ran out) hands it to them rather than leave it idle.
//! - **A release hands over** in its own script: when the value is marked
//!   `+` and an entry is alive (by the server's clock), the key becomes
//!   that waiter's, with a token drawn as an acquisition draws it and its
//!   holder info written, and the token goes out, addressed to the
//!   waiter, on the key's handoff channel, which the waiter's process
//!   subscribed on its shared pub/sub connection before the waiter queued
//!   (once per key, however many of its waiters queue). The lease lasts the smaller of the ttl the waiter asked for
//!   and what was left of its entry's life (the grant says so,
//!   [`Grant::valid_for`]): Redis cannot see a waiter die, so a key
//!   handed to a killed waiter comes back when its entry would have died,
//!   within [`QUEUE_ENTRY_TTL`](crate::backend::QUEUE_ENTRY_TTL). The
//!   handoff is one message after the release script: about one round
//!   trip from the release's send to the waiter holding the key.
//! - **A waiter that gives up** sends an owner-checked release: it removes
//!   its entry (or, should the key have reached it meanwhile, hands it on).
//! - **Plain locks are unchanged**: a plain attempt never reads the queue,
//!   and an unmarked release (`-`, nobody waited) never looks at it
//!   either. During a rolling upgrade a release by an older dlock frees a
//!   key without handing it over; the first queued waiter then takes it at
//!   its next attempt, within a second.
//! - A fair acquisition with an identity (leader election) is refused
//!   ([`LockError::InvalidOption`]): a handoff could not record it.
//!
//! ## Shared locks and permits
//!
//! [`LockOptions::mode`](crate::LockOptions::mode) and
//! [`LockOptions::permits`](crate::LockOptions::permits) keep rules M1 to
//! M5 of [`Backend`], each attempt, renewal and release one script:
//!
//! - **A sentinel in the lock key.** While readers (or permits) hold, the
//!   lock key holds a value of a lock's shape that no owner id is (32
//!   zeros, or 31 zeros and `1`, and the waiter mark), with a `PX` as long
//!   as the longest-lived holder's. An exclusive attempt, of this dlock or
//!   an older one, just finds the key held; the holders sit beside it (a
//!   read phase's one reader in `…:phase` with the token, more readers in
//!   a hash `…:readers`, owner → expiry; permits in `…:slots`, slot →
//!   expiry and owner), expiries by the server's clock, dead entries
//!   pruned by the scripts, and read only while the sentinel stands, so a
//!   force release ends them all. A phase of one reader, the common case,
//!   writes no hash: its attempt makes the calls an exclusive one makes,
//!   its release one more (the phase key's expiry). That reader's lease
//!   lives as long as its phase key, as an exclusive holder's lives as
//!   long as its lock key: an operator who stretches the key's ttl
//!   stretches it; one who deletes the key or takes its ttl away
//!   (`PERSIST`) makes the phase lost (below); one who shortens it cuts
//!   nothing, since a second reader that joins records the first with the
//!   sentinel's expiry when that is later.
//! - **Tokens** are drawn as an exclusive acquisition draws them (the
//!   fence counter, floored at the server clock): a read phase's first
//!   reader draws one and keeps it in `…:phase` for the readers that join
//!   (a phase whose `…:phase` is lost refuses new readers and renewals,
//!   and ends with the sentinel's ttl);
//!   a permit draws one per grant. They keep rising across a lost counter.
//! - **Lost holders.** A sentinel that stands with no live holder beside
//!   it (the readers' or slots' hash deleted by an operator or evicted
//!   under `maxmemory`) stands for holders that may still believe they
//!   hold: new readers, and new permits, are refused until it expires
//!   with the longest-lived of them, and each of them is told it lost at
//!   its next renewal. A permit attempt walks the live slots, never the
//!   count: it costs the server the same for `permits(2)` as for
//!   `permits(u32::MAX)`.
//! - **Writers first.** An exclusive attempt that finds readers leaves a
//!   mark, `…:writer` (its owner id, `PX`
//!   [`QUEUE_ENTRY_TTL`](crate::backend::QUEUE_ENTRY_TTL)), refreshed by
//!   its retries (it answers at most a third of that); a shared attempt is
//!   refused while a mark stands. The mark goes when its owner takes the
//!   key, or gives up (its release), or by its ttl.
//! - **Wake-ups.** An attempt refused by readers or permits marks the
//!   sentinel `+`, as it marks an exclusive holder's value, and the last
//!   reader's release, or a permit's, then publishes on the release
//!   channel; a reader refused by a mark flags it, so the writer takes the
//!   key marked and its release publishes; removing a mark on give-up
//!   always does.
//! - **Permit waiters of one process queue in it.** A release publishes
//!   once, and wakes the longest-waiting waiter of each process, which
//!   asks the server. A caller that arrives behind waiters of its own
//!   process (its first attempt, and its look right after it subscribed
//!   while its notice is queued behind another's) within 100 ms of the
//!   server saying every permit is taken is answered in process,
//!   [`Attempt::Behind`], instead of asking: the server would only find
//!   the permits taken, or give one to the newcomer ahead of the waiter
//!   that was here first. So under contention a permit handoff is two
//!   round trips, the release and the woken waiter's attempt. The answer
//!   naps no longer than the permits' earliest expiry the server last told
//!   a refused attempt of this process (a crashed holder's permit frees by
//!   its ttl, which publishes nothing), and a caller that only ever got
//!   such answers asks the server within 200 ms, or at its deadline if
//!   that is sooner, so a permit freed with no announcement and no expiry
//!   (an operator's `HDEL` of its slot while other permits hold, a
//!   failover that lost writes) is found by the callers that arrive for
//!   it. (A waiter that asked, and was refused, looks again when its nap
//!   runs out, at most 10 s, as before.)
//! - **Renewals** of readers and permits go in the same pipeline as
//!   exclusive ones ([`Backend::extend_many`]).
//! - [`Backend::holder`] reads a read-held or permit-held key as held, by
//!   an unknown holder, with the key's last token.
//! - A fair writer queued behind readers is not handed the key by the last
//!   reader's release: it takes it at its next periodic attempt (within a
//!   second).
//!
//! ## Who holds what
//!
//! [`Backend::holder`] reads the lock, its token and its info in one
//! script, and times the hold by the server's clock (`TIME`).
//! [`Backend::held`] lists the held keys under a prefix: it `SCAN`s the
//! keyspace (every primary of a cluster) for the lock names whose tag
//! starts with the prefix's (`MATCH dlock:{<tag>*}:lock`, `COUNT 1000` a
//! step, the glob's `*?[]\` escaped), checks the prefix again on each
//! decoded name, reads each found key's holder (the reads go out together
//! on the multiplexed connection) and drops the keys freed meanwhile. It
//! costs a pass over the whole keyspace: it is for operators (the `dlock
//! list` inspector), not for a hot path. A backend labelled with
//! [`RedisBuilder::label`] records that label, over the process's.
//!
//! ## URLs
//!
//! `redis://[[user]:password@]host[:port][/db]`, and `rediss://…` for TLS
//! (rustls, trusting the system's root certificates, or the ones given to
//! [`RedisBuilder::tls_root_certificate`] for a private CA). A password alone is
//! `redis://:password@host`; an ACL user is `redis://user:password@host`; a
//! unix socket is `redis+unix:///path/redis.sock?user=app&pass=password&db=0`
//! (or `unix://…`). Passwords are never shown, wherever the URL carries
//! them: `Debug` output, errors and logs show it with the password replaced
//! by `***` (`redis://app:***@host`, `unix:///p?pass=***`), and a URL that
//! cannot be read is not shown at all.
//!
//! Behind Redis Sentinel:
//! `redis+sentinel://[[user]:password@]host[:port][,host[:port]…]/service[/db]`
//! (`rediss+sentinel://…` for TLS; a sentinel's port is 26379 unless
//! given). The user info is the data nodes' credentials; sentinels that
//! want a password of their own take [`RedisBackend::sentinel`] with
//! their own URLs. A sentinel URL that cannot be read is refused with
//! [`LockError::InvalidOption`], without being shown.
//!
//! TLS is never weakened behind your back: `rediss://…#insecure` (redis-rs's
//! switch that turns the certificate check off) is refused with
//! [`LockError::InvalidOption`] — without the check, a man in the middle
//! could hand one lock to two holders — and so is a mix of `rediss://` and
//! plain URLs in one backend. A server that does not speak TLS is an error,
//! never a plain-text fallback.
//!
//! ## Least-privilege ACL
//!
//! An ACL user needs only dlock's keys and channels and these commands, the
//! same on a single server and on a cluster (where ACL users are per node:
//! create it on every node):
//!
//! ```text
//! ~dlock:* &dlock:* +evalsha +script|load +set +setrange +get +incr +pexpire +pttl +del +publish +time +hgetall +hset +hdel +subscribe +unsubscribe +cluster|slots +ping
//! ```
//!
//! The scripts run with `EVALSHA` (loaded by `SCRIPT LOAD` when the server
//! lacks them) and call `SET`, `SETRANGE`, `GET`, `INCR`, `PEXPIRE`, `PTTL`, `DEL`,
//! `PUBLISH` and `TIME` (and `HGETALL`, `HSET`, `HDEL` over the readers'
//! and slots' hashes of shared locks and permits); waiters `SUBSCRIBE` and `UNSUBSCRIBE` on `dlock:*`
//! channels; `CLUSTER SLOTS` tells a cluster from a single server and maps
//! its slots, and the cluster client checks its node connections with
//! `PING`, as the backend checks its pub/sub connection while waiters wait. Add `+select` when the URL names a database other than 0,
//! and `+scan` for listing the held keys ([`Backend::held`], the `dlock
//! list` inspector; on a cluster it finds the primaries with `CLUSTER SLOTS`).
//! (redis-rs also names its connections with `CLIENT SETINFO` on Redis 7.2+
//! and ignores a refusal.)
//!
//! A cluster is detected on its own (it answers `CLUSTER SLOTS`; or name it
//! with [`RedisBuilder::cluster`]); give more seed nodes with
//! [`RedisBuilder::node`] so the backend can start (and keep its pub/sub
//! connection) while a seed is down.
//!
//! ## Redis Sentinel
//!
//! [`RedisBackend::sentinel`] takes the sentinels' URLs and the name they
//! monitor the primary under. The primary is the node the sentinels name
//! under the highest config epoch (`SENTINEL MASTER`, all asked at once)
//! that says it is a master (`ROLE`);
//! the command connection looks it up again when a command fails on a
//! broken connection or the node answers `READONLY`, and the pub/sub
//! connection whenever it is opened (a demoted primary's connections are
//! closed by the sentinels, which wakes the waiters to subscribe again).
//! Every 5 s the sentinels are also asked which node is the primary, and
//! the commands move there if they go elsewhere (a failover that left the
//! old primary running, which never refuses a write). Each look-up is
//! bounded by the connect timeout. The sentinels need
//! `SENTINEL master` (or `get-master-addr-by-name`, without the epoch
//! check) and the data nodes also `ROLE` (add
//! `+role` to the ACL above); with [`RedisBuilder::replica_acks`], `+wait`.
//!
//! Over 700 lines: the backend's operations each pair a script with the
//! handling of its answer and its errors; the scripts, the builder, the
//! subscriber and the key space have modules of their own. Splitting the
//! operations by mode is the next seam.

mod builder;
mod commands;
pub mod fence;
mod keyspace;
mod redact;
mod scripts;
mod sentinel;
mod subscriber;

/// The Lua the backend sends, word for word, for tools that must speak the
/// same protocol (the benchmark's raw redis-rs floor issues exactly these).
/// Not a stable API.
#[doc(hidden)]
pub mod protocol {
    pub use super::scripts::{ACQUIRE_LUA, EXTEND_LUA, RELEASE_LUA};
}

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ::redis::{
    ErrorKind, FromRedisValue, RedisResult, Script, ScriptInvocation, ServerErrorKind, ToRedisArgs,
    Value,
};
use async_trait::async_trait;
use futures_util::StreamExt as _;
use tokio::time::{Instant, sleep};

use crate::backend::{
    Access, AcquireRequest, Attempt, Backend, ForceRelease, Grant, Handoff, Holding, Look, OwnerId,
    Queue, ReleaseNotice, ReleaseOutcome, ReleaseRequest, Renewal,
};
use crate::error::{BoxError, LockError, Operation};
use crate::holder::HolderInfo;
use crate::key::LockKey;
use crate::token::FencingToken;

pub use builder::RedisBuilder;
use commands::{Commands, Failure};
use keyspace::{Keyspace, PermitNames, SharedNames};
use redact::scrub;
use subscriber::Subscriber;

const KIND: &str = "redis";

/// How long connecting may take by default, including the handshake
/// (AUTH, SELECT) and the cluster check.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one command may wait for its reply by default.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(3);
/// How soon a waiter looks again when the pub/sub connection cannot be
/// opened (the commands may still work): polling, as a last resort.
const DEGRADED_RECHECK: Duration = Duration::from_millis(500);
/// How many names one `SCAN` step of a listing looks at, on each node: a
/// listing never keeps a server busy for long at a time.
const SCAN_COUNT: usize = 1000;
/// How many holder reads a listing keeps in flight at once.
const LIST_READS_IN_FLIGHT: usize = 64;

/// Locks in Redis or a Redis Cluster.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_runtime::LockError> {
/// use std::time::Duration;
/// use dlock_runtime::{redis::RedisBackend, registry, LockOptions};
///
/// let url = std::env::var("DLOCK_REDIS_URL").unwrap_or("redis://127.0.0.1:6379".into());
/// registry().register("doc-redis", RedisBackend::connect(&url).await?);
/// let lease = LockOptions::new(Duration::from_secs(30))
///     .backend("doc-redis")
///     .wait(Duration::from_secs(5))
///     .acquire("doc:nightly-report")
///     .await?;
/// println!("token {}", lease.token()); // send it with every write
/// lease.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

struct Inner {
    commands: Commands,
    subscriber: Subscriber,
    /// The URLs with passwords hidden, for `Debug` and errors.
    shown: Vec<String>,
    /// Passwords to scrub from any error text.
    secrets: Vec<String>,
    connect_timeout: Duration,
    response_timeout: Duration,
    /// Whether the missing waiter mark was warned about (once a backend).
    warned_unmarked: AtomicBool,
    /// Take every key marked, so every release publishes
    /// ([`RedisBuilder::publish_every_release`]).
    publish_every_release: bool,
    /// The label acquisitions record, over the process's
    /// ([`RedisBuilder::label`]).
    label: Option<String>,
    /// Replicas that must acknowledge an acquisition, and how long they
    /// have ([`RedisBuilder::replica_acks`]).
    replica_acks: Option<(u32, Duration)>,
    /// Held by the one acquisition whose `WAIT` is on the shared
    /// connection: several queued there, the later ones outlast the
    /// response timeout, and a grant whose reply was given up on is made
    /// after the give-back sent on a new connection. Waiting here costs
    /// the server nothing, and is bounded by the caller's wait.
    acks_gate: tokio::sync::Mutex<()>,
    /// The primary's name, behind sentinels.
    sentinel_service: Option<String>,
}

impl RedisBackend {
    /// Connects to the Redis at `url` (see the [module docs](self) for the
    /// URL forms), with the default timeouts. A cluster is detected. A
    /// `redis+sentinel://…` URL connects through sentinels, as
    /// [`RedisBackend::sentinel`] does.
    pub async fn connect(url: &str) -> Result<Self, LockError> {
        Self::builder(url).connect().await
    }

    /// Settings for connecting to `url`, to adjust before
    /// [`RedisBuilder::connect`].
    pub fn builder(url: &str) -> RedisBuilder {
        RedisBuilder::new(url)
    }

    /// Settings for the primary that the Redis Sentinels at `sentinels`
    /// monitor under the name `service`, to adjust before
    /// [`RedisBuilder::connect`]. The backend asks the sentinels for the
    /// primary (`SENTINEL MASTER`, trusting the highest config epoch), checks with `ROLE`
    /// that the node is a master, and looks it up again whenever a
    /// connection to it fails or it answers that it is a replica
    /// (`READONLY`): commands and waiters follow a failover without a
    /// restart. The sentinels' URLs carry the sentinels' own credentials;
    /// the data nodes' go to [`RedisBuilder::data_node_auth`]. When every
    /// sentinel is down, connecting fails with [`LockError::Backend`]
    /// ("no sentinel answered") once the connect timeout has run out.
    ///
    /// ```no_run
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_runtime::LockError> {
    /// use std::time::Duration;
    /// use dlock_runtime::redis::RedisBackend;
    ///
    /// let sentinels = ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"];
    /// let backend = RedisBackend::sentinel(&sentinels, "mymaster")
    ///     .data_node_auth(Some("app"), "s3cret")
    ///     .replica_acks(1, Duration::from_millis(200))
    ///     .connect()
    ///     .await?;
    /// assert!(!format!("{backend:?}").contains("s3cret"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn sentinel(sentinels: &[&str], service: &str) -> RedisBuilder {
        RedisBuilder::sentinel(sentinels, service)
    }

    /// True when connected to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.inner.commands.is_cluster()
    }

    /// How many release channels the pub/sub connection follows right now
    /// (one per key with waiters in this process), for tests of its upkeep.
    pub fn subscribed_channels(&self) -> usize {
        self.inner.subscriber.channel_count()
    }

    /// The longest one call may take: a first try, and a second one on a
    /// connection that may have to be opened first.
    /// Behind sentinels, a look-up of the primary (bounded by the connect
    /// timeout) may come first.
    fn call_limit(&self) -> Duration {
        let connect = if self.inner.commands.is_sentinel() {
            self.inner.connect_timeout.saturating_mul(2)
        } else {
            self.inner.connect_timeout
        };
        connect.saturating_add(self.inner.response_timeout)
    }

    /// Runs an acquire `script` with `keys` and `args`: with
    /// [`RedisBuilder::replica_acks`], followed on the same connection, in
    /// one pipeline, by `WAIT` (so it counts the replicas that have this
    /// acquisition's write); a grant fewer replicas acknowledged is given
    /// back and the attempt is an error.
    async fn attempt(
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

    /// Runs a script, trying once more on a broken or silent connection (on
    /// a connection opened anew by then), all within [`Self::call_limit`].
    async fn run<T: FromRedisValue>(
        &self,
        operation: Operation,
        key: &LockKey,
        script: &ScriptInvocation<'_>,
    ) -> Result<T, LockError> {
        self.run_noting_retry(operation, key, script)
            .await
            .map(|(value, _)| value)
    }

    /// [`RedisBackend::run`], also telling whether the answer is a retry's:
    /// the first request may then have run on the server, its reply lost.
    async fn run_noting_retry<T: FromRedisValue>(
        &self,
        operation: Operation,
        key: &LockKey,
        script: &ScriptInvocation<'_>,
    ) -> Result<(T, bool), LockError> {
        self.inner
            .commands
            .send(self.call_limit(), |mut conn| async move {
                script.invoke_async(&mut conn).await
            })
            .await
            .map_err(|failure| self.error(operation, key, self.describe(&failure)))
    }

    /// What went wrong, in words for an error.
    fn describe(&self, failure: &Failure) -> String {
        let servers = self.inner.shown.join(", ");
        match failure {
            Failure::NoReply => format!("no reply from {servers} within {:?}", self.call_limit()),
            Failure::Redis(err) if err.is_timeout() => format!(
                "no answer from {servers} in time (connect timeout {:?}, response timeout {:?}); \
                 a new connection is opened",
                self.inner.connect_timeout, self.inner.response_timeout
            ),
            // The server's own words: redis-rs would put its name for the
            // error code in front.
            Failure::Redis(err)
                if err.kind() == ErrorKind::Server(ServerErrorKind::ResponseError) =>
            {
                err.detail().map_or_else(|| err.to_string(), str::to_owned)
            }
            Failure::Redis(err) => err.to_string(),
        }
    }

    /// Says, once, that an attempt could not mark the holder's value, so
    /// releases will not wake this backend's waiters (they look again when
    /// the holder's ttl runs out, at most every 10 s).
    fn warn_unmarked(&self, key: &LockKey, refusal: &Value) {
        if self.inner.warned_unmarked.swap(true, Ordering::Relaxed) {
            return;
        }
        let reason = match refusal {
            Value::BulkString(text) => String::from_utf8_lossy(text).into_owned(),
            other => format!("{other:?}"),
        };
        tracing::warn!(
            key = %key,
            reason = %scrub(&reason, &self.inner.secrets),
            "redis refused to mark a held lock as waited for (an ACL without +setrange?): \
             releases will not wake waiters, who look again only when the holder's ttl \
             runs out; see the least-privilege ACL in dlock's Redis docs"
        );
    }

    /// The waiter mark an attempt takes the key with: `+` when waiters of
    /// this process already wait for it (so its release wakes them), for a
    /// lease taken with an identity (a leader, watched by observers the
    /// store cannot see), or when every release is to be published.
    fn mark(&self, request: &AcquireRequest<'_>, names: &Keyspace) -> u8 {
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

    /// A fair attempt ([`Queue::Respect`], [`Queue::Join`]): the fair
    /// acquire script, which reads and keeps the key's queue in the same
    /// step (see `scripts::FAIR_ACQUIRE_LUA`). One round trip, as a plain
    /// attempt.
    async fn try_acquire_fair(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        let (key, owner, ttl) = (request.key, request.owner, request.ttl);
        if request.identity.is_some() {
            return Err(LockError::InvalidOption {
                option: "fair",
                reason: "the redis backend does not queue an acquisition with an identity \
                         (a leader election's): its handoff could not record it"
                    .into(),
            });
        }
        let names = Keyspace::of(key);
        let entry_ttl = match request.queue {
            Queue::Join { entry_ttl } => ttl_millis(entry_ttl).to_string(),
            _ => String::new(),
        };
        // The entry's record becomes a handoff's holder info, read as one
        // line: a record never holds a newline (labels are checked when
        // set), but a request built by hand might.
        let record = request
            .holder_record(self.inner.label.as_deref())
            .replace(['\n', '\r'], "?");
        let (queue, entry) = keyspace::queue_and_entry_names(key, owner);
        let keys = [
            bytes(&names.lock),
            bytes(&names.fence),
            bytes(&names.info),
            bytes(queue),
            bytes(entry),
        ];
        let mut args = vec![
            held_value(owner, self.mark(request, &names)).to_vec(),
            bytes(ttl_millis(ttl)),
            bytes(record),
            bytes(entry_ttl),
        ];
        if request.waits {
            args.push(bytes(WAITS));
        }
        self.attempt(request, &names.fence, &scripts::FAIR_ACQUIRE, &keys, &args)
            .await
    }

    /// A shared attempt (rules M1 to M3, M5): the shared acquire script,
    /// one round trip (see `scripts::SHARED_ACQUIRE_LUA`), followed by the
    /// replicas' acknowledgement when asked for, as an exclusive one.
    async fn try_acquire_shared(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
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
    async fn try_acquire_permit(
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

    fn error(&self, operation: Operation, key: &LockKey, text: String) -> LockError {
        self.error_at(operation, key.as_str(), text)
    }

    fn error_at(&self, operation: Operation, key: &str, text: String) -> LockError {
        let source: BoxError = scrub(&text, &self.inner.secrets).into();
        LockError::backend(KIND, operation, key, source)
    }

    /// The names matching `pattern` on the server, or on every primary of
    /// a cluster: `SCAN` steps of [`SCAN_COUNT`] until each node's cursor
    /// comes back to 0. A name may come twice (a key moved or rehashed
    /// during the scan); names that are not UTF-8 are not dlock's.
    async fn scan(&self, prefix: &str, pattern: &str) -> Result<Vec<String>, LockError> {
        let slots = if self.is_cluster() {
            self.primary_slots(prefix).await?
        } else {
            vec![0]
        };
        let mut names = Vec::new();
        for slot in slots {
            let mut cursor = 0_u64;
            loop {
                let mut scan = ::redis::cmd("SCAN");
                scan.arg(cursor)
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(SCAN_COUNT);
                let scan = &scan;
                let (reply, _) = self
                    .inner
                    .commands
                    .send(self.call_limit(), |mut conn| async move {
                        conn.query_at(scan, slot).await
                    })
                    .await
                    .map_err(|failure| {
                        self.error_at(Operation::List, prefix, self.describe(&failure))
                    })?;
                let (next, batch): (u64, Vec<Vec<u8>>) =
                    ::redis::from_redis_value(reply).map_err(|err| {
                        self.error_at(
                            Operation::List,
                            prefix,
                            format!("unexpected reply to SCAN: {err}"),
                        )
                    })?;
                names.extend(
                    batch
                        .into_iter()
                        .filter_map(|name| String::from_utf8(name).ok()),
                );
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(names)
    }

    /// A slot of each primary of the cluster, to send it a command without
    /// a key ([`commands::Connection::query_at`]).
    async fn primary_slots(&self, prefix: &str) -> Result<Vec<u16>, LockError> {
        let slots = ::redis::cmd("CLUSTER").arg("SLOTS").to_owned();
        let slots = &slots;
        let (reply, _): (Value, bool) = self
            .inner
            .commands
            .send(self.call_limit(), |mut conn| async move {
                slots.query_async(&mut conn).await
            })
            .await
            .map_err(|failure| self.error_at(Operation::List, prefix, self.describe(&failure)))?;
        primary_slots(&reply).ok_or_else(|| {
            self.error_at(
                Operation::List,
                prefix,
                format!("unexpected reply {reply:?} to CLUSTER SLOTS"),
            )
        })
    }
}

/// The first slot of each primary in a `CLUSTER SLOTS` reply (ranges of
/// `[first slot, last slot, [host, port, …], replicas…]`); `None` for a
/// reply of another shape.
fn primary_slots(reply: &Value) -> Option<Vec<u16>> {
    let Value::Array(ranges) = reply else {
        return None;
    };
    let mut primaries: Vec<(&[Value], u16)> = Vec::new();
    for range in ranges {
        let Value::Array(parts) = range else {
            return None;
        };
        let [Value::Int(first), _, Value::Array(primary), ..] = parts.as_slice() else {
            return None;
        };
        let address = primary.get(..2)?;
        if !primaries.iter().any(|(known, _)| *known == address) {
            primaries.push((address, u16::try_from(*first).ok()?));
        }
    }
    Some(primaries.into_iter().map(|(_, slot)| slot).collect())
}

/// The holder script's reply as a [`Holding`]; `None` for a reply of
/// another shape.
fn read_holding(reply: &Value) -> Option<Option<Holding>> {
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok().map(str::to_owned),
        Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    };
    let parts = match reply {
        Value::Nil => return Some(None),
        Value::Array(parts) => parts,
        _ => return None,
    };
    let [
        Value::Int(remaining),
        record,
        fence,
        info,
        Value::Int(held_for),
    ] = parts.as_slice()
    else {
        return None;
    };
    let (record, fence, info) = (text(record)?, text(fence)?, text(info)?);
    // `<owner id> <token> <identity>`, the identity last (it may hold spaces).
    let recorded = record.splitn(3, ' ').collect::<Vec<_>>();
    let (token, identity) = match recorded.as_slice() {
        [_, token, identity] => (token.parse().ok(), Some((*identity).to_owned())),
        _ => (fence.parse().ok(), None),
    };
    let token = token.filter(|token| *token > 0).map(FencingToken::new);
    // An identity is only told with its own token.
    let identity = identity.filter(|_| token.is_some());
    // `<host>\t<pid>\t<label>` and how long ago it was taken, when the
    // holder's acquisition recorded it (an older dlock's did not).
    let holder = HolderInfo::decode(&info).map(|holder| match u64::try_from(*held_for) {
        Ok(micros) => holder.held_for(Duration::from_micros(micros)),
        Err(_) => holder,
    });
    let holding = Holding::new(token, identity).held_by(holder);
    Some(Some(match u64::try_from(*remaining) {
        Ok(ms) => holding.expiring_in(Duration::from_millis(ms)),
        Err(_) => holding,
    }))
}

/// The grant a release published on the key's handoff channel for this
/// waiter (after its owner id): `<token> <ms the lease lasts>`; `None` for
/// a message of another shape.
fn read_handoff(message: &[u8]) -> Option<Grant> {
    let (token, valid_for) = std::str::from_utf8(message).ok()?.split_once(' ')?;
    let token = token.parse::<u64>().ok().filter(|token| *token > 0)?;
    let valid_for = Duration::from_millis(valid_for.parse().ok()?);
    Some(Grant::new(FencingToken::new(token)).valid_for(valid_for))
}

/// A permit slot as the permit scripts take it: its number, or empty for
/// the owner's slot, whichever.
fn slot_arg(slot: Option<u32>) -> String {
    slot.map(|slot| slot.to_string()).unwrap_or_default()
}

/// The script, keys and arguments of a shared or permit renewal (rule M4).
fn side_renewal_parts(renewal: &Renewal<'_>) -> (&'static Script, Vec<String>, Vec<String>) {
    let (owner, ttl) = (renewal.owner.to_hex(), ttl_millis(renewal.ttl).to_string());
    let owner = String::from_utf8_lossy(&owner).into_owned();
    match renewal.access {
        Access::Permits { .. } => {
            let names = PermitNames::of(renewal.key);
            (
                &scripts::PERMIT_EXTEND,
                vec![names.lock, names.slots],
                vec![owner, ttl, slot_arg(renewal.slot)],
            )
        }
        _ => {
            let names = SharedNames::of(renewal.key);
            (
                &scripts::SHARED_EXTEND,
                vec![names.lock, names.readers, names.phase],
                vec![owner, ttl],
            )
        }
    }
}

/// Appends one owner-checked renewal call per lease of `leases` to `pipe`,
/// each by its script's hash.
fn renewal_calls(pipe: &mut ::redis::Pipeline, leases: &[Renewal<'_>]) {
    for lease in leases {
        if lease.access != Access::Exclusive {
            let (script, keys, args) = side_renewal_parts(lease);
            let call = pipe.cmd("EVALSHA").arg(script.get_hash()).arg(keys.len());
            call.arg(keys).arg(args);
            continue;
        }
        let call = pipe.cmd("EVALSHA");
        let (lock, info) = keyspace::lock_and_info_names(lease.key);
        match lease.recorded {
            None => call
                .arg(scripts::EXTEND.get_hash())
                .arg(2)
                .arg(lock)
                .arg(info),
            Some(_) => call
                .arg(scripts::EXTEND_AS.get_hash())
                .arg(3)
                .arg(lock)
                .arg(info)
                .arg(keyspace::holder_name(lease.key)),
        };
        call.arg(&held_value(lease.owner, UNWAITED)[..])
            .arg(ttl_millis(lease.ttl));
        if let Some((identity, token)) = lease.recorded {
            call.arg(token.get()).arg(identity);
        }
    }
}

/// The pipeline that sends `leases`' renewals again to a server without
/// their scripts: every renewal script loaded, then the batch, in one round
/// trip. One load after the other (each a round trip) would queue, each,
/// behind an acquisition's `WAIT` on the shared connection when replica
/// acks are asked for: four of them outlasted a 1.5 s lease's first renewal.
fn reload_renewals(leases: &[Renewal<'_>]) -> ::redis::Pipeline {
    let mut reload = ::redis::pipe();
    reload.ignore_errors();
    for lua in [
        scripts::EXTEND_LUA,
        scripts::EXTEND_AS_LUA.as_str(),
        scripts::SHARED_EXTEND_LUA,
        scripts::PERMIT_EXTEND_LUA,
    ] {
        reload.cmd("SCRIPT").arg("LOAD").arg(lua).ignore();
    }
    renewal_calls(&mut reload, leases);
    reload
}

/// The invocation of a shared or permit renewal.
fn side_renewal(renewal: &Renewal<'_>) -> ScriptInvocation<'static> {
    let (script, keys, args) = side_renewal_parts(renewal);
    let mut invocation = script.prepare_invoke();
    for key in keys {
        invocation.key(key);
    }
    for arg in args {
        invocation.arg(arg);
    }
    invocation
}

/// `Held`, with the remaining ttl in ms the acquire script answered
/// (negative: the key has no expiry, or is gone).
fn held(remaining: i64) -> Attempt {
    Attempt::Held {
        expires_in: u64::try_from(remaining).ok().map(Duration::from_millis),
    }
}

/// How often a backend behind sentinels asks them whether the primary
/// moved ([`watch_primary`]).
const PRIMARY_CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// Behind sentinels: every [`PRIMARY_CHECK_INTERVAL`], asks them which
/// node is the primary and moves the commands there if they go elsewhere.
/// Ends with the backend (its last clone dropped).
async fn watch_primary(inner: std::sync::Weak<Inner>) {
    loop {
        sleep(PRIMARY_CHECK_INTERVAL).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        inner.commands.follow_if_moved().await;
    }
}

/// A script argument's bytes.
fn bytes(value: impl ToRedisArgs) -> Vec<u8> {
    value.to_redis_args().concat()
}

/// The exclusive acquire scripts' argument that says the caller waits,
/// so its attempt leaves a writer-waiting mark behind readers (rule M3).
const WAITS: &str = "w";

/// The mark of a held value nobody is known to wait for: its release
/// deletes the key without publishing.
const UNWAITED: u8 = b'-';
/// The mark of a held value someone may wait for: its release publishes.
const WAITED_ON: u8 = b'+';

/// What a lock key holds: the owner id's 32 hex digits and a waiter mark
/// (see the acquire script). Renewals and releases send it with
/// [`UNWAITED`]; the scripts match the owner id whichever mark it has now.
fn held_value(owner: &OwnerId, mark: u8) -> [u8; 33] {
    let mut value = [mark; 33];
    value[..32].copy_from_slice(&owner.to_hex());
    value
}

/// A ttl in whole milliseconds, rounded up and at least 1 (Redis refuses
/// `PX 0`). Never down: the holder counts its lease from the exact ttl, so
/// a server lease cut by a fraction of a millisecond would free the key
/// while the holder still trusts it.
fn ttl_millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_nanos().div_ceil(1_000_000))
        .unwrap_or(u64::MAX / 2)
        .clamp(1, u64::MAX / 2)
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("urls", &self.inner.shown)
            .field("cluster", &self.is_cluster())
            .field("sentinel_service", &self.inner.sentinel_service)
            .field("replica_acks", &self.inner.replica_acks)
            .field("connect_timeout", &self.inner.connect_timeout)
            .field("response_timeout", &self.inner.response_timeout)
            .finish()
    }
}

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
        if request.queue.is_fair() {
            return self.try_acquire_fair(request).await;
        }
        let (key, owner, ttl) = (request.key, request.owner, request.ttl);
        let names = Keyspace::of(key);
        let script = match request.identity {
            None => &*scripts::ACQUIRE,
            Some(_) => &*scripts::ACQUIRE_AS,
        };
        let mut keys = vec![bytes(&names.lock), bytes(&names.fence), bytes(&names.info)];
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
        let (lock, info) = keyspace::lock_and_info_names(key);
        script
            .key(lock)
            .key(info)
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
                let (lock, info) = keyspace::lock_and_info_names(key);
                script
                    .key(lock)
                    .key(info)
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
        Ok(match (released == 1, retried) {
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
    /// the key over in its own script (see the [module docs](self)).
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
        script
            .key(&names.lock)
            .key(&names.info)
            .arg(&names.released);
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
            .key(&names.info)
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
            .key(&names.info);
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
    /// meanwhile are left out. See the [module docs](self).
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

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(text: &str) -> Value {
        Value::BulkString(text.as_bytes().to_vec())
    }

    #[test]
    fn a_holder_reply_with_info_names_the_holder_and_how_long_it_held() {
        let me = HolderInfo::this_process(Some("billing"));
        let reply = Value::Array(vec![
            Value::Int(12_000),
            bulk(""),
            bulk("1700000000000042"),
            bulk(&me.encode()),
            Value::Int(2_500_000),
        ]);
        let holding = read_holding(&reply).expect("a holder reply").expect("held");
        assert_eq!(
            holding.token,
            Some(FencingToken::new(1_700_000_000_000_042))
        );
        assert_eq!(holding.expires_in, Some(Duration::from_secs(12)));
        assert_eq!(
            holding.holder,
            Some(me.held_for(Duration::from_millis(2_500)))
        );
    }

    #[test]
    fn a_holder_reply_without_info_or_with_a_damaged_one_names_nobody() {
        for info in ["", "2\tweb\t1\t", "garbage"] {
            let reply = Value::Array(vec![
                Value::Int(5),
                bulk(""),
                bulk("7"),
                bulk(info),
                Value::Int(-1),
            ]);
            let holding = read_holding(&reply).expect("a holder reply").expect("held");
            assert_eq!(holding.token, Some(FencingToken::new(7)), "{info:?}");
            assert_eq!(holding.holder, None, "{info:?}");
        }
        assert!(matches!(read_holding(&Value::Nil), Some(None)));
        // The shape before the info: not this script's answer.
        let short = Value::Array(vec![Value::Int(5), bulk(""), bulk("7")]);
        assert!(read_holding(&short).is_none());
    }

    #[test]
    fn cluster_slots_give_one_slot_a_primary() {
        let node =
            |port: i64, id: &str| Value::Array(vec![bulk("127.0.0.1"), Value::Int(port), bulk(id)]);
        let range = |first: i64, last: i64, primary: Value, replica: Value| {
            Value::Array(vec![Value::Int(first), Value::Int(last), primary, replica])
        };
        let reply = Value::Array(vec![
            range(0, 5460, node(7000, "a"), node(7003, "d")),
            range(5461, 10922, node(7001, "b"), node(7004, "e")),
            range(10923, 12000, node(7002, "c"), node(7005, "f")),
            // A second range of the first primary adds no node.
            range(12001, 16383, node(7000, "a"), node(7003, "d")),
        ]);
        assert_eq!(primary_slots(&reply), Some(vec![0, 5461, 10923]));
        assert_eq!(primary_slots(&Value::Int(1)), None);
    }
}

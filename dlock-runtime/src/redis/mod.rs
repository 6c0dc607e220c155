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
//! | `dlock:{T}:lock` | string with a `PX` expiry | the holder's owner id (32 hex digits), a waiter mark (`-` or `+`), its fencing token, the server time of the acquisition in µs, and the holder's host, pid and label ([`crate::holder`]); one key written by an acquisition and deleted by a release |
//! | `dlock:{T}:fence` | string (integer), no expiry | the last fencing token issued for `K` |
//! | `dlock:{T}:info` | string with the lock's `PX` expiry | only beside a lock of the previous protocol (a value of the owner id and the mark alone): who took it, written by a replica not yet upgraded |
//! | `dlock:{T}:holder` | string, no expiry | only for leases taken with an identity (leader election): the owner id, the token and the identity |
//! | `dlock:{T}:released` | pub/sub channel | one message per release someone may wait for |
//! | `dlock:{T}:queue` | string (or list) with a `PX` no shorter than its longest-lived entry's | only while fair waiters queue: one owner id a line, in arrival order, the first line ending in the queue's stamp (see [Fair mode](#fair-mode)); a list of the owner ids, the stamp last, when begun by a backend with [`RedisBuilder::list_queues`] |
//! | `dlock:{T}:waiter:<owner id>` | string with the entry's `PX` | one per queued fair waiter while its entry lives: the ttl it asked for, its holder record and the stamp of the queue it is in |
//! | `dlock:{T}:rejoin` | string with an entry's `PX` | set when a fair waiter found its line gone from a lost queue: while it stands, a waiter that cannot read the stamp (an ACL without `+getrange`) looks for its line and joins again without one |
//! | `dlock:{T}:handoff` | pub/sub channel | one message per handoff to a fair waiter: its owner id, the token and how long that lease lasts |
//! | `dlock:{T}:readers` | hash with the read phase's `PX` | while two or more readers hold: owner id → expiry in server ms (see [Shared locks and permits](#shared-locks-and-permits)) |
//! | `dlock:{T}:phase` | string with the read phase's `PX` | the read phase's token, and while it has one reader, that reader's owner id (its expiry the key's `PX`) |
//! | `dlock:{T}:writer` | string, `PX` 3 s | a writer-waiting mark: the owner id of a writer that found readers |
//! | `dlock:{T}:slots` | hash with the permits' `PX` | while permits are held: slot → expiry in server ms and owner id |
//!
//! `{T}` is a Redis Cluster hash tag, so all the keys live in one slot and
//! the scripts are valid on a cluster. Fence keys are small and kept
//! forever; deleting one is safe (the next token restarts from the clock).
//! A holder's token is read from its own value, so an operator who sets
//! the fence key back changes no holder's token. An info key or identity
//! record is read only while the owner id it starts with holds the lock,
//! so one left behind (the lock deleted by hand, or by an older dlock,
//! which writes no info) never names a later holder; a lock taken by an
//! older dlock reads as held by an unknown holder (`holder: None`).
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
//! - **A list queue**, with [`RedisBuilder::list_queues`]: the queue a
//!   backend begins is a Redis list of owner ids (its stamp last), which a
//!   handoff pops and a joining waiter pushes onto, where the string is
//!   read and written whole at each: the release that hands over costs
//!   the same however long the queue, and a handoff with 16 waiters about
//!   a fifth less of the server's time (see BENCHMARKS.md). Every script serves a queue of either kind, so
//!   backends with and without the option share keys; an earlier dlock
//!   reads a list as no queue (its waiters replace it with a string, and
//!   the list's waiters join that again within a second), so turn it on
//!   once none runs, with the list commands in the ACL (below). A queue
//!   the ACL does not let it begin as a list is begun as a string, with a
//!   warning.
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
//! ~dlock:* &dlock:* +evalsha +script|load +set +setrange +get +getrange +incr +pexpire +pttl +del +publish +time +hgetall +hset +hdel +subscribe +unsubscribe +cluster|slots +ping
//! ```
//!
//! The scripts run with `EVALSHA` (loaded by `SCRIPT LOAD` when the server
//! lacks them) and call `SET`, `SETRANGE`, `GET`, `GETRANGE` (a fair waiter's
//! refresh reads its queue's stamp), `INCR`, `PEXPIRE`, `PTTL`, `DEL`,
//! `PUBLISH` and `TIME` (and `HGETALL`, `HSET`, `HDEL` over the readers'
//! and slots' hashes of shared locks and permits); waiters `SUBSCRIBE` and `UNSUBSCRIBE` on `dlock:*`
//! channels; `CLUSTER SLOTS` tells a cluster from a single server and maps
//! its slots, and the cluster client checks its node connections with
//! `PING`, as the backend checks its pub/sub connection while waiters wait. Add
//! `+lpush +rpush +lpop +rpop +lindex +lpos +lrem` for fair queues kept as
//! lists ([`RedisBuilder::list_queues`]), for every replica's user once any
//! replica begins them: a user without them serves a list as an earlier
//! dlock does (a release frees the key without handing it over, a waiter
//! replaces the list with a string), and the server's `ACL LOG` shows each
//! refusal. Add `+select` when the URL names a database other than 0,
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
//! [`Attempt::Behind`]: crate::backend::Attempt::Behind
//! [`Backend`]: crate::backend::Backend
//! [`Backend::extend_many`]: crate::backend::Backend::extend_many
//! [`Backend::held`]: crate::backend::Backend::held
//! [`Backend::holder`]: crate::backend::Backend::holder
//! [`Grant::valid_for`]: crate::backend::Grant::valid_for

// Where the code lives: this file holds the backend's state and the small
// helpers every step shares. The `Backend` operations are in `operations`;
// the acquire attempts of each mode (and the replicas' acknowledgement) in
// `acquire`; the renewal pipelines in `renewal`; the holder reads and the
// listing scan in `inspect`; sending a call, its time limit and its
// errors' words in `calls`. The Lua is in `scripts`, the key names in
// `keyspace`, the connections in `commands`, `subscriber` and `sentinel`,
// the settings and connecting with them in `builder`, the resource-side
// check of tokens in `fence`.
mod acquire;
mod builder;
mod calls;
mod commands;
pub mod fence;
mod inspect;
mod keyspace;
mod operations;
mod redact;
mod renewal;
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
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use ::redis::ToRedisArgs;
use tokio::time::sleep;

use crate::backend::OwnerId;
use crate::error::LockError;

pub use builder::RedisBuilder;
use commands::Commands;
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
    /// Whether a fair refresh refused `GETRANGE` was warned about.
    warned_unstamped: AtomicBool,
    /// Whether a list queue refused by the ACL was warned about.
    warned_unlisted: AtomicBool,
    /// Whether a release whose announcement was refused was warned about.
    warned_unannounced: AtomicBool,
    /// Take every key marked, so every release publishes
    /// ([`RedisBuilder::publish_every_release`]).
    publish_every_release: bool,
    /// Begin fair queues as lists ([`RedisBuilder::list_queues`]).
    list_queues: bool,
    /// The owners this backend queued with a `Join` (see
    /// [`acquire::Queued`]).
    queued: acquire::Queued,
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

/// The fair acquire script's argument that says a queue it begins is a
/// list ([`RedisBuilder::list_queues`]).
const LISTED: &str = "l";

/// The fair acquire script's `ARGV[4]` for a `Barge` by an owner this
/// backend queued: taken as a plain attempt takes the key, its entry
/// dropped with a grant.
const BARGES: &str = "b";

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

//! One pub/sub connection per backend, shared by every waiter of every key.
//!
//! Each release channel is subscribed once, however many waiters wait on it
//! (counted per channel), and unsubscribed when its last waiter goes.
//! `subscribe` returns only after the server confirmed the subscription, so
//! a release published after it returns is always heard. A release wakes
//! ONE waiter of this process (the longest waiting): only one can take the
//! key, and waking them all would send one doomed attempt per waiter. A
//! woken waiter that goes away without trying passes the wake-up on. When
//! the connection breaks, every waiter is woken (to retry at once) and the
//! next subscription opens a new connection.
//!
//! A fair waiter's handoff notice ([`Subscriber::handoff`]) resolves with
//! a message, not with a wake-up: the key's handoff channel is subscribed
//! once however many fair waiters of the process wait on it, and each
//! message, which names the owner it hands the key to, goes to that
//! owner's mailbox alone. A notice cannot be woken to look again, so when
//! the connection breaks it subscribes again by itself, on a new
//! connection, for as long as it lives.
//!
//! A connection can also go silent without breaking (a NAT or load
//! balancer that forgot it, a peer that lost power): its socket stays open
//! and no release is heard on it, so waiters would sleep until the holder's
//! ttl or their own deadline on a key long free. While channels are
//! subscribed, the connection is therefore sent a `PING` every second; one
//! without a reply within the response timeout counts as broken. With
//! nothing subscribed nothing is sent.
//!
//! Behind Redis Sentinel the connection goes to the primary the sentinels
//! name, confirmed with `ROLE`, looked up anew for every connection; and
//! while channels are subscribed the sentinels are asked every few seconds
//! whether the primary is still that one. A primary demoted without its
//! clients' connections being closed would otherwise keep the
//! subscriptions: its connection is retired and the waiters look again.
//!
//! One connection's life (opening it, confirming subscriptions on it, its
//! health checks and its reader task, retiring it) is in `link`; this
//! file keeps the waiters' side. Both sides meet under the two locks of
//! `Shared`: `link` (the live connection), held across each
//! (un)subscribe and taken before `channels` (the waiters and their
//! confirmations), which is held only for a few steps and never across
//! an await.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use ::redis::{Client, RedisError, RedisResult};
use tokio::runtime::Handle;
use tokio::sync::{Notify, watch};
use tokio::time::{Instant, sleep, timeout};

use super::sentinel::Sentinels;
use crate::backend::ReleaseNotice;

mod link;

use link::Link;

/// How long after the server said every permit of a key is taken a caller
/// may still be answered in process, behind this process's waiters: a
/// permit freed without an announcement (an operator's `HDEL`, eviction,
/// a failover that lost writes) is then asked for by the next caller at
/// most this long after.
const FULL_FRESH: Duration = Duration::from_millis(100);
/// After a failed attempt to open a connection, subscriptions fail at once
/// for this long (their waiters poll) instead of each trying again in
/// turn.
const CONNECT_BACKOFF: Duration = Duration::from_millis(500);

/// The shared subscriber of one backend.
pub(crate) struct Subscriber {
    shared: Arc<Shared>,
}

struct Shared {
    /// Servers to open the pub/sub connection to, tried in order. On a
    /// cluster any node will do: `PUBLISH` reaches every node.
    nodes: Vec<Client>,
    /// Behind sentinels: the connection goes to the primary they name,
    /// looked up anew for every connection (after a failover, the old
    /// primary's connection breaks and the waiters subscribe again on the
    /// new primary's).
    sentinels: Option<Arc<Sentinels>>,
    connect_timeout: Duration,
    response_timeout: Duration,
    channels: Mutex<Channels>,
    /// The live connection. Locked across every (un)subscribe, so those
    /// reach the server in the order they were decided in.
    link: tokio::sync::Mutex<Option<Link>>,
    /// When and why opening a connection last failed.
    connect_failed: Mutex<Option<(Instant, RedisError)>>,
}

#[derive(Default)]
struct Channels {
    by_name: HashMap<String, Channel>,
    /// Bumped for every new connection.
    generation: u64,
    /// The connection whose health check task runs, if any: one runs
    /// exactly while channels are confirmed on it.
    checked: Option<u64>,
}

struct Channel {
    /// Waiters holding a notice for this channel.
    waiters: usize,
    /// The connection generation the server confirmed the subscription on.
    confirmed_in: Option<u64>,
    /// Bumped when the connection breaks: wakes every waiter.
    wake: watch::Sender<u64>,
    /// Bumped on every message: wakes every holder watch, which, unlike a
    /// waiter, cannot pass a wake-up on and must hear each one.
    heard: watch::Sender<u64>,
    /// The fair waiters' mailboxes, by owner id (32 hex digits): a message
    /// that starts with one (and a space) is put in its mailbox, the rest
    /// of it.
    mailboxes: HashMap<[u8; 32], Mailbox>,
    /// The waiters in the order they subscribed; a message wakes the first.
    queue: VecDeque<Arc<Ticket>>,
    /// The earliest expiry of the key's permits as the server last told a
    /// refused attempt of this process: how long a caller answered in
    /// process, behind the queue, naps at most.
    expiry: Option<Instant>,
    /// When the server last told an attempt of this process that every
    /// permit of the key is taken (a refusal, or a grant of the last free
    /// one): a caller is answered in process only shortly after.
    full_at: Option<Instant>,
}

/// Where a fair waiter's handoff message is put: the latest one
/// addressed to it, after its owner id.
type Mailbox = watch::Sender<Option<Arc<[u8]>>>;

/// One waiter's place in its channel's queue.
#[derive(Default)]
struct Ticket {
    notify: Notify,
    /// Taken off the queue by a message.
    woken: AtomicBool,
    /// The waiter's notice resolved (it goes on to try the key).
    heard: AtomicBool,
}

impl Channel {
    fn new() -> Self {
        Self {
            waiters: 0,
            confirmed_in: None,
            wake: watch::channel(0).0,
            heard: watch::channel(0).0,
            mailboxes: HashMap::new(),
            queue: VecDeque::new(),
            expiry: None,
            full_at: None,
        }
    }

    /// Wakes the longest-waiting waiter, if any.
    fn wake_one(&mut self) {
        if let Some(ticket) = self.queue.pop_front() {
            ticket.woken.store(true, Ordering::SeqCst);
            ticket.notify.notify_one();
        }
    }

    fn wake(&self) {
        self.wake.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// A waiter's registered interest in one channel.
struct Interest {
    shared: Arc<Shared>,
    channel: String,
    ticket: Arc<Ticket>,
    /// The owner whose mailbox to take away too (a handoff notice's).
    mailbox: Option<[u8; 32]>,
}

impl Drop for Interest {
    fn drop(&mut self) {
        let idle = {
            let mut channels = self.shared.channels();
            match channels.by_name.get_mut(&self.channel) {
                Some(channel) => {
                    if let Some(owner) = &self.mailbox {
                        channel.mailboxes.remove(owner);
                    }
                    let before = channel.queue.len();
                    channel.queue.retain(|t| !Arc::ptr_eq(t, &self.ticket));
                    // Woken but gone without trying: the wake-up is not lost.
                    if channel.queue.len() == before
                        && self.ticket.woken.load(Ordering::SeqCst)
                        && !self.ticket.heard.load(Ordering::SeqCst)
                    {
                        channel.wake_one();
                    }
                    channel.waiters = channel.waiters.saturating_sub(1);
                    channel.waiters == 0
                }
                None => false,
            }
        };
        // Without a runtime the subscription just stays: it costs a few
        // messages, never a missed wake-up.
        if idle && let Ok(runtime) = Handle::try_current() {
            let shared = Arc::clone(&self.shared);
            let channel = std::mem::take(&mut self.channel);
            runtime.spawn(async move { shared.unsubscribe_if_idle(&channel).await });
        }
    }
}

fn timed_out(what: &str, after: Duration) -> RedisError {
    RedisError::from(io::Error::new(
        io::ErrorKind::TimedOut,
        format!("{what} timed out after {after:?}"),
    ))
}

impl Subscriber {
    /// A subscriber that connects (lazily) to the first reachable of `nodes`.
    pub(crate) fn new(
        nodes: Vec<Client>,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Self {
        Self::with_sentinels(nodes, None, connect_timeout, response_timeout)
    }

    /// A subscriber that connects (lazily) to the primary `sentinels` name,
    /// or, without them, to the first reachable of `nodes`.
    pub(crate) fn with_sentinels(
        nodes: Vec<Client>,
        sentinels: Option<Arc<Sentinels>>,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                nodes,
                sentinels,
                connect_timeout,
                response_timeout,
                channels: Mutex::default(),
                link: tokio::sync::Mutex::new(None),
                connect_failed: Mutex::new(None),
            }),
        }
    }

    /// A notice that resolves on the next message on `channel` after this
    /// returns, if this waiter is the longest waiting of the process (or
    /// when the connection breaks). Returns once the server has confirmed
    /// the subscription.
    pub(crate) async fn subscribe(&self, channel: &str) -> RedisResult<ReleaseNotice> {
        self.register(channel, true).await
    }

    /// A notice that resolves on the next message on `channel` after this
    /// returns, whoever else waits (or when the connection breaks): for a
    /// holder watch, which must hear every change.
    pub(crate) async fn watch(&self, channel: &str) -> RedisResult<ReleaseNotice> {
        self.register(channel, false).await
    }

    /// A notice that resolves with the first message on `channel` after
    /// this returns that is addressed to `owner` (it starts with its 32 hex
    /// digits and a space) and that `read` accepts (given the rest): a fair
    /// waiter's handoff. When the connection breaks, or could not be
    /// opened to begin with, the notice subscribes again by itself (on a
    /// new connection, trying every [`CONNECT_BACKOFF`] at most) for as
    /// long as it lives; a message sent while it was not subscribed is
    /// lost. The error, if the first subscription failed (the notice is
    /// returned all the same, and keeps trying).
    pub(crate) async fn handoff<T: Send + 'static>(
        &self,
        channel: &str,
        owner: [u8; 32],
        read: impl Fn(&[u8]) -> Option<T> + Send + 'static,
    ) -> (impl Future<Output = T> + Send + 'static, Option<RedisError>) {
        let (mut interest, mut wake) = self.enroll(channel, None);
        let (mailbox, mut message) = watch::channel(None);
        if let Some(entry) = self.shared.channels().by_name.get_mut(channel) {
            entry.mailboxes.insert(owner, mailbox);
        }
        interest.mailbox = Some(owner);
        let limit = self.confirm_limit();
        let failure = match timeout(limit, self.shared.confirm(channel)).await {
            Ok(Ok(())) => None,
            Ok(Err(err)) => Some(err),
            Err(_) => Some(timed_out("subscribing", limit)),
        };
        let mut subscribed = failure.is_none();
        let shared = Arc::clone(&self.shared);
        let channel = channel.to_owned();
        let wait = async move {
            let _interest = interest;
            loop {
                if !subscribed {
                    match timeout(limit, shared.confirm(&channel)).await {
                        Ok(Ok(())) => subscribed = true,
                        _ => {
                            sleep(CONNECT_BACKOFF).await;
                            continue;
                        }
                    }
                }
                tokio::select! {
                    changed = message.changed() => {
                        if changed.is_err() {
                            // Its mailbox is gone: nothing will come.
                            return std::future::pending().await;
                        }
                        let latest = message.borrow_and_update().clone();
                        if let Some(value) = latest.as_deref().and_then(&read) {
                            return value;
                        }
                    }
                    changed = wake.changed() => {
                        if changed.is_err() {
                            return std::future::pending().await;
                        }
                        // The connection broke: subscribe again.
                        subscribed = false;
                    }
                }
            }
        };
        (wait, failure)
    }

    /// Whether a fair waiter has a mailbox on `channel` and the server
    /// confirmed the subscription on a connection not known to be broken
    /// (a break clears the confirmation): a [`Subscriber::handoff`] on it
    /// then costs no round trip.
    pub(crate) fn has_mailboxes(&self, channel: &str) -> bool {
        self.shared
            .channels()
            .by_name
            .get(channel)
            .is_some_and(|entry| entry.confirmed_in.is_some() && !entry.mailboxes.is_empty())
    }

    /// Registers a waiter on `channel` (queued for wake-ups with `ticket`,
    /// if given): its interest, which gives the registration back when
    /// dropped, and the receiver a broken connection wakes.
    fn enroll(
        &self,
        channel: &str,
        ticket: Option<&Arc<Ticket>>,
    ) -> (Interest, watch::Receiver<u64>) {
        let wake = {
            let mut channels = self.shared.channels();
            let entry = channels
                .by_name
                .entry(channel.to_owned())
                .or_insert_with(Channel::new);
            entry.waiters += 1;
            if let Some(ticket) = ticket {
                entry.queue.push_back(Arc::clone(ticket));
            }
            entry.wake.subscribe()
        };
        let interest = Interest {
            shared: Arc::clone(&self.shared),
            channel: channel.to_owned(),
            ticket: ticket.map_or_else(|| Arc::new(Ticket::default()), Arc::clone),
            mailbox: None,
        };
        (interest, wake)
    }

    /// How long a subscription may take, however long the connection takes
    /// to open or to answer, and however many waiters queue for it: the
    /// waiter then polls instead.
    fn confirm_limit(&self) -> Duration {
        // Behind sentinels: the look-up, then the primary's connection.
        let nodes = if self.shared.sentinels.is_some() {
            2
        } else {
            u32::try_from(self.shared.nodes.len()).unwrap_or(u32::MAX)
        };
        (self.shared.connect_timeout.saturating_mul(nodes))
            .saturating_add(self.shared.response_timeout)
    }

    async fn register(&self, channel: &str, queued: bool) -> RedisResult<ReleaseNotice> {
        let ticket = Arc::new(Ticket::default());
        let (interest, mut wake) = self.enroll(channel, queued.then_some(&ticket));
        let mut heard = self.shared.channels().by_name[channel].heard.subscribe();
        // From here on, dropping `interest` (on an error, or with the
        // notice) gives the registration back.
        let limit = self.confirm_limit();
        match timeout(limit, self.shared.confirm(channel)).await {
            Ok(confirmed) => confirmed?,
            Err(_) => return Err(timed_out("subscribing", limit)),
        }
        if !queued {
            return Ok(ReleaseNotice::new(async move {
                let _interest = interest;
                // A closed channel (the subscriber is gone) also ends the wait.
                tokio::select! {
                    _ = wake.changed() => {}
                    _ = heard.changed() => {}
                }
            }));
        }
        let place = Arc::downgrade(&ticket);
        let wait = async move {
            let _interest = interest;
            // A closed channel (the subscriber is gone) also ends the wait.
            tokio::select! {
                _ = wake.changed() => {}
                () = ticket.notify.notified() => {}
            }
            ticket.heard.store(true, Ordering::SeqCst);
        };
        // Heard, but given up before the attempt it led to was answered:
        // the next waiter of this process gets the wake-up instead.
        let shared = Arc::downgrade(&self.shared);
        let channel = channel.to_owned();
        let (queue_of, queue_name) = (shared.clone(), channel.clone());
        Ok(ReleaseNotice::passing_on(wait, move || {
            if let Some(shared) = shared.upgrade()
                && let Some(entry) = shared.channels().by_name.get_mut(&channel)
            {
                entry.wake_one();
            }
        })
        .queued_by(move || {
            // Queued, and not first: a waiter ahead is woken before it.
            let (Some(shared), Some(ticket)) = (queue_of.upgrade(), place.upgrade()) else {
                return false;
            };
            shared
                .channels()
                .by_name
                .get(&queue_name)
                .and_then(|entry| entry.queue.iter().position(|t| Arc::ptr_eq(t, &ticket)))
                .is_some_and(|place| place > 0)
        }))
    }

    /// How long a caller of this process may nap without asking the
    /// server, behind the waiters queued on `channel`: the time left until
    /// the permits' earliest expiry the server last told of, if waiters
    /// are queued on a confirmed subscription, that expiry is ahead, and
    /// the server said every permit was taken less than [`FULL_FRESH`]
    /// ago.
    pub(crate) fn queued_nap(&self, channel: &str) -> Option<Duration> {
        let channels = self.shared.channels();
        let entry = channels.by_name.get(channel)?;
        if entry.queue.is_empty() || entry.confirmed_in != Some(channels.generation) {
            return None;
        }
        let now = Instant::now();
        if entry.full_at? + FULL_FRESH <= now {
            return None;
        }
        let left = entry.expiry?.checked_duration_since(now)?;
        (!left.is_zero()).then_some(left)
    }

    /// The server refused a permit attempt on `channel`'s key: every
    /// permit is taken, the earliest to run out at `expiry`.
    pub(crate) fn note_refusal(&self, channel: &str, expiry: Instant) {
        if let Some(entry) = self.shared.channels().by_name.get_mut(channel) {
            entry.expiry = Some(expiry);
            entry.full_at = Some(Instant::now());
        }
    }

    /// The server granted a permit on `channel`'s key and found no other
    /// free: every permit is taken.
    pub(crate) fn note_full(&self, channel: &str) {
        if let Some(entry) = self.shared.channels().by_name.get_mut(channel) {
            entry.full_at = Some(Instant::now());
        }
    }

    /// Whether waiters of this process wait on `channel` now.
    pub(crate) fn has_waiters(&self, channel: &str) -> bool {
        self.shared
            .channels()
            .by_name
            .get(channel)
            .is_some_and(|entry| entry.waiters > 0)
    }

    /// How many channels are subscribed or waited on (for tests).
    pub(crate) fn channel_count(&self) -> usize {
        self.shared.channels().by_name.len()
    }
}

impl Shared {
    fn channels(&self) -> MutexGuard<'_, Channels> {
        self.channels.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

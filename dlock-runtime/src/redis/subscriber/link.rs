//! One pub/sub connection's life: opening it (to the first node that
//! answers, or to the primary the sentinels name), confirming each
//! subscription on it, its health checks and its reader task, and
//! retiring it, which wakes the waiters whose subscriptions went with it.
//! Its own file: the connection's side of the subscriber, apart from the
//! waiters' bookkeeping; the two meet under `Shared`'s locks.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

use ::redis::Value;
use ::redis::aio::{PubSubSink, PubSubStream};
use ::redis::{RedisError, RedisResult};
use futures_util::StreamExt as _;
use tokio::task::AbortHandle;
use tokio::time::{Instant, sleep, timeout};

use super::{CONNECT_BACKOFF, Shared, timed_out};

/// How often a connection with subscribed channels is checked.
const HEALTH_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// Behind sentinels, every this many health checks the sentinels are asked
/// whether the primary is still the one the connection is open to: one a
/// failover demoted without closing its clients' connections (the
/// sentinels close them when they can) must not keep serving the
/// subscriptions.
const PRIMARY_CHECK_EVERY: u32 = 5;

/// One pub/sub connection: the sink (un)subscribes, a reader task owns the
/// message stream.
pub(super) struct Link {
    sink: PubSubSink,
    generation: u64,
    broken: Arc<AtomicBool>,
    reader: AbortHandle,
    /// Behind sentinels: the primary it was opened to (`host:port`).
    primary: Option<String>,
}

impl Drop for Link {
    fn drop(&mut self) {
        // Dropping the stream (with the reader) closes the connection.
        self.reader.abort();
    }
}

impl Shared {
    /// Makes sure the server has confirmed `channel` on the live connection.
    /// A connection found broken on use is replaced once.
    pub(super) async fn confirm(self: &Arc<Self>, channel: &str) -> RedisResult<()> {
        let mut slot = self.link.lock().await;
        loop {
            let mut fresh = false;
            let link = match slot.take() {
                Some(link) if !link.broken.load(Ordering::SeqCst) => slot.insert(link),
                stale => {
                    if let Some(old) = stale {
                        self.retire(old);
                    }
                    fresh = true;
                    slot.insert(self.connect().await?)
                }
            };
            let generation = link.generation;
            let confirmed = self
                .channels()
                .by_name
                .get(channel)
                .is_some_and(|c| c.confirmed_in == Some(generation));
            if confirmed {
                return Ok(());
            }
            let outcome = match timeout(self.response_timeout, link.sink.subscribe(channel)).await {
                Ok(outcome) => outcome,
                Err(_) => Err(timed_out("SUBSCRIBE", self.response_timeout)),
            };
            let outcome = outcome.and_then(|()| {
                // Checked under the channels lock, which the reader takes
                // after marking the link broken: either the reader sees this
                // confirmation and wakes the waiter, or this sees the break.
                let mut channels = self.channels();
                if link.broken.load(Ordering::SeqCst) {
                    return Err(RedisError::from(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        "the pub/sub connection broke while subscribing",
                    )));
                }
                if let Some(entry) = channels.by_name.get_mut(channel) {
                    entry.confirmed_in = Some(generation);
                    if channels.checked != Some(generation) {
                        channels.checked = Some(generation);
                        tokio::spawn(check_health(
                            Arc::downgrade(self),
                            link.sink.clone(),
                            generation,
                            Arc::clone(&link.broken),
                            link.primary.clone(),
                        ));
                    }
                }
                Ok(())
            });
            match outcome {
                Ok(()) => return Ok(()),
                Err(err) => {
                    // The connection's state is unknown now: start afresh.
                    if let Some(old) = slot.take() {
                        self.retire(old);
                    }
                    if fresh {
                        return Err(err);
                    }
                }
            }
        }
    }

    /// Opens a pub/sub connection to the first node that answers, unless
    /// the last try failed only just now.
    async fn connect(self: &Arc<Self>) -> RedisResult<Link> {
        let recent_failure = || {
            let failed = self
                .connect_failed
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            failed
                .as_ref()
                .filter(|(at, _)| at.elapsed() < CONNECT_BACKOFF)
                .map(|(_, err)| err.clone())
        };
        if let Some(err) = recent_failure() {
            return Err(err);
        }
        let outcome = self.open().await;
        if let Err(err) = &outcome {
            *self
                .connect_failed
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some((Instant::now(), err.clone()));
        }
        outcome
    }

    /// Opens a pub/sub connection to the first node that answers, or to the
    /// primary the sentinels name.
    async fn open(self: &Arc<Self>) -> RedisResult<Link> {
        let mut last_error = None;
        let (primary, primary_address) = match &self.sentinels {
            Some(sentinels) => {
                let primary = sentinels.primary().await?;
                tracing::debug!(primary = %primary.address, "redis pub/sub follows the primary");
                (Some(primary.client), Some(primary.address))
            }
            None => (None, None),
        };
        let nodes = match &primary {
            Some(primary) => std::slice::from_ref(primary),
            None => self.nodes.as_slice(),
        };
        for node in nodes {
            let pubsub = match timeout(self.connect_timeout, node.get_async_pubsub()).await {
                Ok(Ok(pubsub)) => pubsub,
                Ok(Err(err)) => {
                    last_error = Some(err);
                    continue;
                }
                Err(_) => {
                    last_error = Some(timed_out(
                        "opening the pub/sub connection",
                        self.connect_timeout,
                    ));
                    continue;
                }
            };
            let (sink, stream) = pubsub.split();
            let generation = {
                let mut channels = self.channels();
                channels.generation += 1;
                channels.generation
            };
            let broken = Arc::new(AtomicBool::new(false));
            let reader = tokio::spawn(read(
                Arc::downgrade(self),
                stream,
                generation,
                Arc::clone(&broken),
            ))
            .abort_handle();
            tracing::debug!(generation, "redis pub/sub connection opened");
            return Ok(Link {
                sink,
                generation,
                broken,
                reader,
                primary: primary_address.clone(),
            });
        }
        Err(last_error.unwrap_or_else(|| {
            RedisError::from(io::Error::new(
                io::ErrorKind::NotFound,
                "no Redis node to open a pub/sub connection to",
            ))
        }))
    }

    /// Retires connection `generation` if it is still the live one: it did
    /// not answer a health check.
    async fn retire_silent(&self, generation: u64, broken: &AtomicBool) {
        // Waiters first: they need not wait for the link lock, which a
        // subscription on the silent connection may hold until it times out.
        broken.store(true, Ordering::SeqCst);
        self.wake_all(generation);
        let mut slot = self.link.lock().await;
        if slot
            .as_ref()
            .is_some_and(|link| link.generation == generation)
            && let Some(link) = slot.take()
        {
            self.retire(link);
        }
    }

    /// Closes `link` and wakes the waiters whose subscriptions went with it.
    fn retire(&self, link: Link) {
        link.broken.store(true, Ordering::SeqCst);
        let generation = link.generation;
        drop(link);
        self.wake_all(generation);
    }

    /// Wakes every waiter whose subscription was confirmed on connection
    /// `generation`, which is gone: they retry (and subscribe again).
    /// Waiters still subscribing confirm on the next connection instead.
    fn wake_all(&self, generation: u64) {
        let mut channels = self.channels();
        for channel in channels.by_name.values_mut() {
            if channel.confirmed_in == Some(generation) {
                channel.confirmed_in = None;
                channel.wake();
            }
        }
    }

    /// Unsubscribes `channel` if nobody waits on it any more.
    pub(super) async fn unsubscribe_if_idle(&self, channel: &str) {
        let mut slot = self.link.lock().await;
        // Decided under the link lock: a waiter that registers after this
        // sends its SUBSCRIBE after our UNSUBSCRIBE.
        let confirmed_in = {
            let mut channels = self.channels();
            match channels.by_name.get(channel) {
                Some(entry) if entry.waiters == 0 => {
                    let confirmed_in = entry.confirmed_in;
                    channels.by_name.remove(channel);
                    confirmed_in
                }
                _ => return,
            }
        };
        let Some(link) = slot.as_mut() else { return };
        if link.broken.load(Ordering::SeqCst) || confirmed_in != Some(link.generation) {
            return;
        }
        let outcome = timeout(self.response_timeout, link.sink.unsubscribe(channel)).await;
        if !matches!(outcome, Ok(Ok(())))
            && let Some(old) = slot.take()
        {
            self.retire(old);
        }
    }
}

/// The health check of connection `generation`: a `PING` every
/// [`HEALTH_CHECK_INTERVAL`] while channels are confirmed on it; one without
/// a reply within the response timeout retires the connection, which wakes
/// every waiter to subscribe again on a new one. Ends with the connection,
/// or when no channel is confirmed on it (a new confirmation starts another).
async fn check_health(
    shared: Weak<Shared>,
    mut sink: PubSubSink,
    generation: u64,
    broken: Arc<AtomicBool>,
    primary: Option<String>,
) {
    let mut checks: u32 = 0;
    loop {
        sleep(HEALTH_CHECK_INTERVAL).await;
        checks = checks.wrapping_add(1);
        if let Some(primary) = &primary
            && checks.is_multiple_of(PRIMARY_CHECK_EVERY)
            && moved_away(&shared, primary).await
        {
            if broken.load(Ordering::SeqCst) {
                return;
            }
            let Some(shared) = shared.upgrade() else {
                return;
            };
            tracing::warn!(
                generation,
                old = %primary,
                "the sentinels name another redis primary; the pub/sub connection follows it \
                 and every waiter looks again"
            );
            shared.retire_silent(generation, &broken).await;
            return;
        }
        if broken.load(Ordering::SeqCst) {
            return;
        }
        let response_timeout = {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let mut channels = shared.channels();
            let subscribed = channels
                .by_name
                .values()
                .any(|channel| channel.confirmed_in == Some(generation));
            if !subscribed {
                // Decided under the channels lock, where a confirmation
                // checks whether a health check runs.
                if channels.checked == Some(generation) {
                    channels.checked = None;
                }
                return;
            }
            shared.response_timeout
        };
        let answered = timeout(response_timeout, sink.ping::<Value>()).await;
        if matches!(answered, Ok(Ok(_))) {
            continue;
        }
        if broken.load(Ordering::SeqCst) {
            return;
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        tracing::warn!(
            generation,
            "redis pub/sub connection did not answer a PING within {response_timeout:?}; \
             replacing it and waking every waiter to retry"
        );
        shared.retire_silent(generation, &broken).await;
        return;
    }
}

/// Whether the sentinels name a primary other than `primary` now. A
/// look-up that fails says nothing: the connection's own health decides.
async fn moved_away(shared: &Weak<Shared>, primary: &str) -> bool {
    let Some(sentinels) = shared.upgrade().and_then(|shared| shared.sentinels.clone()) else {
        return false;
    };
    match sentinels.primary().await {
        Ok(found) => found.address != primary,
        Err(_) => false,
    }
}

/// The reader task of one connection: wakes the waiters of each channel a
/// message arrives on, and all waiters when the connection ends.
async fn read(
    shared: Weak<Shared>,
    mut stream: PubSubStream,
    generation: u64,
    broken: Arc<AtomicBool>,
) {
    while let Some(message) = stream.next().await {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let mut channels = shared.channels();
        if let Some(channel) = channels.by_name.get_mut(message.get_channel_name()) {
            channel.wake_one();
            channel.heard.send_modify(|n| *n = n.wrapping_add(1));
            if !channel.mailboxes.is_empty() {
                let payload = message.get_payload_bytes();
                if let (Some(owner), Some(b' ')) = (payload.get(..32), payload.get(32))
                    && let Ok(owner) = <[u8; 32]>::try_from(owner)
                    && let Some(mailbox) = channel.mailboxes.get(&owner)
                {
                    mailbox.send_replace(Some(payload[33..].into()));
                }
            }
        }
    }
    broken.store(true, Ordering::SeqCst);
    if let Some(shared) = shared.upgrade() {
        tracing::warn!(
            generation,
            "redis pub/sub connection lost; waking every waiter to retry"
        );
        shared.wake_all(generation);
    }
}

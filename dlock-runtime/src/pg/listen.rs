//! Hearing acquisitions announced: the listening connection behind
//! [`Backend::watch_holder`](crate::Backend::watch_holder) on a free key.
//!
//! An acquisition with an identity is announced with `NOTIFY` on the
//! schema's channel, the advisory key as payload, once its statement
//! committed (see the `announce` module: best effort, so a watch of a
//! free key also reads again on a slow timer). A backend opens one
//! connection that `LISTEN`s on that channel, the first time a watch of a
//! free key needs it, and wakes the watches of the advisory key each
//! notification names. A watch registers only on a
//! connection whose `LISTEN` the server has confirmed, so an acquisition
//! committed after the watch was made wakes it.
//!
//! The connection sends nothing of its own, so a network cut would go
//! unnoticed and its watches would sleep through acquisitions: it is
//! checked with a round trip every liveness interval. When it breaks,
//! every watch on it is woken (its reader reads again, and the next watch
//! opens another connection). It is closed once no watch was made on it
//! for [`IDLE_CLOSE`]. A connection that cannot be opened is tried again
//! only after [`OPEN_RETRY_PAUSE`]; until then watches are told to recheck
//! on a fast timer, as they were before acquisitions were announced.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::{Mutex as AsyncMutex, oneshot, watch};
use tokio::time::{Instant, sleep, timeout};
use tokio_postgres::{Client, Notification};

use super::connection::{Connector, Failure};
use super::sql;
use crate::backend::ReleaseNotice;

/// How long the listening connection stays open with no watch made on it:
/// a reader that watches again right after each wake-up must not reconnect
/// every time.
const IDLE_CLOSE: Duration = Duration::from_secs(30);
/// How long after a listening connection could not be opened the next
/// watch tries again (watches recheck on a timer meanwhile), so readers do
/// not each wait for a server that refuses connections.
const OPEN_RETRY_PAUSE: Duration = Duration::from_secs(10);

/// A backend's listening connection, opened on demand, and the watches it
/// wakes.
pub(super) struct Listener {
    shared: Arc<Shared>,
}

struct Shared {
    connector: Connector,
    /// The channel acquisitions are announced on, and its `LISTEN`.
    channel: String,
    listen_sql: String,
    /// How often the connection is checked.
    check_every: Duration,
    state: Mutex<State>,
    /// One connection is opened at a time.
    opening: AsyncMutex<()>,
}

#[derive(Default)]
struct State {
    link: Option<Link>,
    /// The number of the last connection opened.
    generation: u64,
    /// The watches, by advisory key: dropping the sender wakes them.
    watched: HashMap<i64, watch::Sender<()>>,
    /// When the last watch was made.
    last_watch: Option<Instant>,
    /// When opening a connection last failed, if it has failed since the
    /// last one opened (a warning was logged then).
    failed_at: Option<Instant>,
}

/// The connection listening now.
struct Link {
    generation: u64,
    /// Set as the connection ends, before its watches are woken.
    ended: Arc<AtomicBool>,
    /// Dropping it closes the connection.
    _close: oneshot::Sender<String>,
}

impl State {
    /// Forgets the connection, which closes it, and returns the watches
    /// made on it, which wake when dropped: a watch never outlives its
    /// connection, whose successor may have missed announcements.
    fn forget_link(&mut self) -> HashMap<i64, watch::Sender<()>> {
        self.link = None;
        std::mem::take(&mut self.watched)
    }
}

impl Link {
    fn is(&self, generation: u64) -> bool {
        self.generation == generation
    }
}

impl Listener {
    pub(super) fn new(connector: Connector, schema: &str, check_every: Duration) -> Self {
        let channel = sql::holders_channel(schema);
        Self {
            shared: Arc::new(Shared {
                connector,
                listen_sql: sql::LISTEN.replace("{channel}", &channel),
                channel,
                check_every,
                state: Mutex::default(),
                opening: AsyncMutex::new(()),
            }),
        }
    }

    /// The channel acquisitions are announced on.
    pub(super) fn channel(&self) -> &str {
        &self.shared.channel
    }

    /// A notice that resolves when an acquisition of `lock_id` (an
    /// advisory key) is announced, or when the listening connection breaks;
    /// `None` when no connection listens and none could be opened (the
    /// caller then rechecks on a timer). Opens the connection if none is
    /// open, and returns once the server confirmed its `LISTEN`.
    ///
    /// Cancel safe: dropped half-way, it leaves no watch, and a connection
    /// it was opening closes.
    pub(super) async fn watch(&self, lock_id: i64) -> Option<ReleaseNotice> {
        let shared = &self.shared;
        if let Some(notice) = shared.subscribe(lock_id) {
            return Some(notice);
        }
        if shared.open_paused() {
            return None;
        }
        let _opening = shared.opening.lock().await;
        // Another watch may have opened one, or failed to, meanwhile.
        if let Some(notice) = shared.subscribe(lock_id) {
            return Some(notice);
        }
        if shared.open_paused() {
            return None;
        }
        match shared.open().await {
            Ok(()) => shared.subscribe(lock_id),
            Err(err) => {
                shared.open_failed(&err);
                None
            }
        }
    }
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A watch of `lock_id` on the connection listening now, if there is one.
    fn subscribe(&self, lock_id: i64) -> Option<ReleaseNotice> {
        let mut state = self.state();
        if state
            .link
            .as_ref()
            .is_some_and(|link| link.ended.load(Ordering::Acquire))
        {
            // Ended, its end not yet reported: gone all the same.
            drop(state.forget_link());
            return None;
        }
        state.link.as_ref()?;
        state.last_watch = Some(Instant::now());
        let mut woken = state
            .watched
            .entry(lock_id)
            .or_insert_with(|| watch::channel(()).0)
            .subscribe();
        // Nothing is ever sent: the sender is dropped to wake every watch.
        Some(ReleaseNotice::new(async move {
            let _ = woken.changed().await;
        }))
    }

    fn open_paused(&self) -> bool {
        self.state()
            .failed_at
            .is_some_and(|at| at.elapsed() < OPEN_RETRY_PAUSE)
    }

    /// Opens a connection, as the lock sessions connect, `LISTEN`s on it,
    /// and makes it the one watches register on.
    async fn open(self: &Arc<Self>) -> Result<(), Failure> {
        let generation = {
            let mut state = self.state();
            state.generation += 1;
            state.generation
        };
        let ended = Arc::new(AtomicBool::new(false));
        let on_end = {
            let (shared, ended) = (Arc::downgrade(self), Arc::clone(&ended));
            move |why: String| {
                ended.store(true, Ordering::Release);
                if let Some(shared) = shared.upgrade() {
                    shared.broken(generation, &why);
                }
            }
        };
        let on_notification = {
            let shared = Arc::downgrade(self);
            Box::new(move |notification: Notification| {
                if let Some(shared) = shared.upgrade() {
                    shared.heard(&notification);
                }
            })
        };
        // Dropped (on failure, or if the caller gives up), it closes the
        // connection.
        let (close, closed) = oneshot::channel();
        let wait = self.connector.connect_timeout();
        let client = self
            .connector
            .open_listening(wait, closed, on_end, on_notification)
            .await?;
        let what = format!("cannot LISTEN on {}", self.channel);
        self.connector
            .within_connect_timeout(what, client.batch_execute(&self.listen_sql))
            .await?;
        let mut state = self.state();
        if ended.load(Ordering::Acquire) {
            return Err(Failure::msg(format!(
                "the connection listening on {} ended as it opened",
                self.channel
            )));
        }
        let checks = keep(Arc::downgrade(self), generation, client);
        if !self.connector.home().spawn(checks) {
            return Err(Failure::msg(
                "cannot listen: the runtime the backend runs on shut down",
            ));
        }
        // None is left (a watch forgets a link that ended); should one
        // be, its watches wake.
        let woken = state.forget_link();
        state.link = Some(Link {
            generation,
            ended,
            _close: close,
        });
        state.failed_at = None;
        drop(state);
        drop(woken);
        Ok(())
    }

    fn open_failed(&self, err: &Failure) {
        let first = self.state().failed_at.replace(Instant::now()).is_none();
        if first {
            tracing::warn!(
                channel = self.channel,
                error = %err,
                "cannot listen for acquisitions on PostgreSQL; watches of a free key's holder \
                 read it again on a timer until a listening connection opens (tried again every \
                 {OPEN_RETRY_PAUSE:?})"
            );
        } else {
            tracing::debug!(channel = self.channel, error = %err, "still cannot listen for acquisitions");
        }
    }

    /// Wakes the watches of the advisory key `notification` names.
    fn heard(&self, notification: &Notification) {
        if notification.channel() != self.channel {
            return;
        }
        let Ok(lock_id) = notification.payload().parse::<i64>() else {
            return;
        };
        let woken = self.state().watched.remove(&lock_id);
        drop(woken);
    }

    /// The connection `generation` ended or failed its check: forgets it,
    /// which closes it, and wakes every watch on it.
    fn broken(&self, generation: u64, why: &str) {
        let woken = {
            let mut state = self.state();
            if !state.link.as_ref().is_some_and(|link| link.is(generation)) {
                return;
            }
            state.forget_link()
        };
        drop(woken);
        tracing::debug!(
            channel = self.channel,
            why,
            "the PostgreSQL listening connection ended; its watches read again"
        );
    }
}

/// Keeps the connection `generation` while it is wanted: every check
/// interval, closes it if no watch was made on it for [`IDLE_CLOSE`], and
/// else checks it with a round trip, which must come back within the
/// interval. Holds the listener weakly, so a dropped backend closes it.
async fn keep(shared: Weak<Shared>, generation: u64, client: Client) {
    loop {
        let Some(every) = shared.upgrade().map(|shared| shared.check_every) else {
            return;
        };
        sleep(every).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        {
            let mut state = shared.state();
            if !state.link.as_ref().is_some_and(|link| link.is(generation)) {
                return;
            }
            state
                .watched
                .retain(|_, sender| sender.receiver_count() > 0);
            let idle = state.watched.is_empty()
                && state.last_watch.is_none_or(|at| at.elapsed() >= IDLE_CLOSE);
            if idle {
                // Dropping the link closes the connection.
                state.link = None;
                return;
            }
        }
        match timeout(every, client.check_connection()).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                shared.broken(generation, &format!("check failed: {err}"));
                return;
            }
            Err(_) => {
                shared.broken(
                    generation,
                    &format!("no answer to a check within {every:?} (half-open connection?)"),
                );
                return;
            }
        }
    }
}

//! Server-side waiting for keys held by other processes.
//!
//! A waiter does not poll: a *wait session* queues on the server for a
//! shared lock on the key ([`WAIT_FOR_RELEASE`](super::sql::WAIT_FOR_RELEASE)),
//! which PostgreSQL grants the instant the exclusive holder lets go — by an
//! explicit release, by its backend's ttl enforcement, by an administrator,
//! or because its connection died (a holder killed with SIGKILL announces
//! nothing, but its lock goes all the same). The statement drops the shared
//! lock at once and returns, and that wakes every waiter of this process for
//! that key: one probe a key, however many tasks wait on it.
//!
//! Each probe runs under `lock_timeout` and is simply sent again while
//! someone still waits, so an abandoned probe ends by itself and a wait
//! session is never stuck. A shared lock granted in the very instant the
//! timeout fires survives the failed statement (session-level locks do), so
//! after every timeout the session drops all its advisory locks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::time::{sleep, timeout};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, Statement};

use super::connection::{Connector, Failure};
use super::sql;
use crate::backend::ReleaseNotice;
use crate::key::LockKey;

/// How long one probe waits on the server before it is sent again.
pub(super) const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// How much longer than [`PROBE_TIMEOUT`] a probe may take before its
/// connection is taken for dead.
const PROBE_GRACE: Duration = Duration::from_secs(5);
/// How long to hold back a wake-up after a wait session could not be
/// opened, so waiters do not spin against a server that refuses connections.
const OPEN_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// The wait sessions of one backend and the keys they watch.
pub(super) struct Waits {
    shared: Arc<Shared>,
}

struct Shared {
    connector: Connector,
    probe_sql: String,
    key_seed: i64,
    max_sessions: usize,
    /// Watched keys: the generation of the probe and the sender whose drop
    /// wakes the waiters.
    watched: Mutex<HashMap<LockKey, (u64, watch::Sender<()>)>>,
    idle: Mutex<Vec<WaitSession>>,
    /// Wait sessions that exist or are being opened.
    open: AtomicUsize,
    generation: AtomicU64,
}

struct WaitSession {
    client: Client,
    probe: Statement,
    unlock_all: Statement,
    /// Dropping it closes the connection.
    _close: oneshot::Sender<String>,
}

impl Waits {
    pub(super) fn new(
        connector: Connector,
        quoted_schema: &str,
        key_seed: i64,
        max: usize,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                connector,
                probe_sql: sql::render(sql::WAIT_FOR_RELEASE, quoted_schema),
                key_seed,
                max_sessions: max,
                watched: Mutex::default(),
                idle: Mutex::default(),
                open: AtomicUsize::new(0),
                generation: AtomicU64::new(0),
            }),
        }
    }

    /// A notice that resolves when `key` is released on the server, or
    /// `None` when every wait session is busy (the caller then rechecks on
    /// a timer).
    pub(super) fn watch(&self, key: &LockKey) -> Option<ReleaseNotice> {
        let shared = &self.shared;
        let mut watched = shared.watched();
        if let Some((_, sender)) = watched.get(key) {
            return Some(notice(sender.subscribe()));
        }
        let idle = shared
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        if idle.is_none() {
            // Reserve room for one more session, if there is any.
            let reserved = shared
                .open
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |open| {
                    (open < shared.max_sessions).then_some(open + 1)
                })
                .is_ok();
            if !reserved {
                return None;
            }
        }
        let generation = shared.generation.fetch_add(1, Ordering::Relaxed);
        let (sender, receiver) = watch::channel(());
        watched.insert(key.clone(), (generation, sender));
        drop(watched);
        // At home, so the probe outlives a caller's runtime. Should it be
        // dropped (unstarted, or as its runtime shuts down), its guard
        // stops the watch and gives back its room for a session.
        let probing = Probing {
            shared: Arc::clone(shared),
            key: key.clone(),
            generation,
            session_counted: true,
        };
        shared.connector.home().spawn(probe(probing, idle));
        Some(notice(receiver))
    }
}

fn notice(mut receiver: watch::Receiver<()>) -> ReleaseNotice {
    // Nothing is ever sent: the sender is dropped to wake every receiver.
    ReleaseNotice::new(async move {
        let _ = receiver.changed().await;
    })
}

impl Shared {
    fn watched(&self) -> std::sync::MutexGuard<'_, HashMap<LockKey, (u64, watch::Sender<()>)>> {
        self.watched.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether anyone still waits on this probe.
    fn wanted(&self, key: &LockKey, generation: u64) -> bool {
        self.watched()
            .get(key)
            .is_some_and(|(g, sender)| *g == generation && sender.receiver_count() > 0)
    }

    /// Stops watching `key` and wakes its waiters (a later subscriber
    /// starts a new probe).
    fn finish(&self, key: &LockKey, generation: u64) {
        let mut watched = self.watched();
        if watched.get(key).is_some_and(|(g, _)| *g == generation) {
            watched.remove(key);
        }
    }

    async fn open_session(&self) -> Result<WaitSession, Failure> {
        let (close, closed) = oneshot::channel();
        // Each probe waits on the server for at most `PROBE_TIMEOUT`.
        let client = self.connector.open(PROBE_TIMEOUT, closed, |_| {}).await?;
        let setup = async {
            let probe = client.prepare(&self.probe_sql).await?;
            let unlock_all = client.prepare(sql::UNLOCK_ALL).await?;
            Ok::<_, tokio_postgres::Error>((probe, unlock_all))
        };
        let (probe, unlock_all) = setup
            .await
            .map_err(|e| Failure::new("cannot prepare a wait session", e))?;
        Ok(WaitSession {
            client,
            probe,
            unlock_all,
            _close: close,
        })
    }
}

/// A probe's place: while it exists the key is watched and the probe's
/// session (idle or being opened) counts against the limit. Dropped, it
/// ends both, which wakes the key's waiters (they retry, and a later one
/// starts a new probe).
struct Probing {
    shared: Arc<Shared>,
    key: LockKey,
    generation: u64,
    /// False once the probe's session went back to the idle list (or was
    /// never opened, its room given back already).
    session_counted: bool,
}

impl Drop for Probing {
    fn drop(&mut self) {
        self.shared.finish(&self.key, self.generation);
        if self.session_counted {
            self.shared.open.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Watches one key until it is released or nobody waits any more.
async fn probe(mut probing: Probing, idle: Option<WaitSession>) {
    let shared = Arc::clone(&probing.shared);
    let (key, generation) = (probing.key.clone(), probing.generation);
    let session = match idle {
        Some(session) => session,
        None => match shared.open_session().await {
            Ok(session) => session,
            Err(err) => {
                probing.session_counted = false;
                shared.open.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!(key = %key, error = %err, "cannot open a PostgreSQL wait session; waiters recheck on a timer");
                sleep(OPEN_RETRY_PAUSE).await;
                return;
            }
        },
    };
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&key.as_str(), &shared.key_seed];
    let healthy = loop {
        if !shared.wanted(&key, generation) {
            break true;
        }
        let waited = timeout(
            PROBE_TIMEOUT + PROBE_GRACE,
            session.client.query_one(&session.probe, &params),
        )
        .await;
        match waited {
            // Released (or never held): wake the waiters.
            Ok(Ok(_)) => break true,
            Ok(Err(err)) => {
                let timed_out = err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE);
                // A failed probe may still hold the shared lock it was
                // granted as the timeout fired: drop it before anything else.
                if session
                    .client
                    .query_one(&session.unlock_all, &[])
                    .await
                    .is_err()
                {
                    break false;
                }
                if !timed_out {
                    tracing::debug!(key = %key, error = %err, "wait probe failed; waking waiters to retry");
                    break true;
                }
            }
            // No answer at all: the connection is half-open.
            Err(_) => break false,
        }
    };
    if healthy && !session.client.is_closed() {
        probing.session_counted = false;
        shared
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(session);
    }
    // Dropping `probing` finishes the watch (and, if the session was not
    // kept, gives back its room).
    drop(probing);
}

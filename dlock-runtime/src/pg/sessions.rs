//! The lock sessions: the backend's slots of owned connections, opening
//! one (and setting it up) when a slot has none alive, and forgetting the
//! locks of one that ended.

use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use super::connection::Failure;
use super::fair_queue::FairTicket;
use super::session::{self, LockSession, SessionEnding};
use super::{Inner, KIND, hash, sql};
use crate::backend::LossGroup;
use crate::error::{LockError, Operation};
use tokio::sync::{Mutex as AsyncMutex, oneshot, watch};

/// One lock session's place. Taking the live session is a plain mutex and
/// a clone, with no await: every acquisition does it. Only opening a
/// session (the first, or after one died) waits, one opener at a time.
#[derive(Default)]
pub(super) struct SessionSlot {
    current: Mutex<Option<Arc<LockSession>>>,
    opening: AsyncMutex<()>,
}

impl SessionSlot {
    pub(super) fn current(&self) -> MutexGuard<'_, Option<Arc<LockSession>>> {
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The slot's session, if it is open and alive, and not retired.
    pub(super) fn live(&self) -> Option<Arc<LockSession>> {
        self.current()
            .as_ref()
            .filter(|session| !session.is_ended() && !session.is_retired())
            .map(Arc::clone)
    }
}

impl Inner {
    /// A live lock session, opening one in its slot if needed. Slots are
    /// used in turn; a dead session is replaced here.
    pub(super) async fn session(self: &Arc<Self>) -> Result<Arc<LockSession>, LockError> {
        let turn = self.next_slot.fetch_add(1, Ordering::Relaxed);
        let Some(slot) = self.slots.get(turn % self.slots.len().max(1)) else {
            return Err(LockError::backend(
                KIND,
                Operation::Connect,
                "",
                Failure::msg("no lock session slot"),
            ));
        };
        match slot.live() {
            Some(session) => Ok(session),
            // Boxed: opening a session is rare and its future is large;
            // every acquisition's future would otherwise carry its size.
            None => Box::pin(self.open_in(slot)).await,
        }
    }

    /// Opens a session in `slot`, unless another caller just did.
    pub(super) async fn open_in(
        self: &Arc<Self>,
        slot: &SessionSlot,
    ) -> Result<Arc<LockSession>, LockError> {
        // One opener per slot; whoever waited for it uses what it opened.
        let _opening = slot.opening.lock().await;
        if let Some(session) = slot.live() {
            return Ok(session);
        }
        let replaces_a_lost_one = slot.current().as_ref().is_some_and(|s| s.is_ended());
        let session = self
            .open_session()
            .await
            .map_err(|e| LockError::backend(KIND, Operation::Connect, "", e))?;
        if replaces_a_lost_one {
            // The server may have restarted or failed over, which empties
            // the unlogged table of key names: name each key again.
            self.names.forget_keys();
        }
        *slot.current() = Some(Arc::clone(&session));
        Ok(session)
    }

    pub(super) async fn open_session(self: &Arc<Self>) -> Result<Arc<LockSession>, Failure> {
        self.open_session_as(None).await
    }

    /// Opens a fair session (see the `fair` module), counted by `ticket`:
    /// a lock session in all but its settings ([`sql::FAIR_SESSION_SETUP`],
    /// [`sql::CLIENT_CONNECTION_CHECK`]) and its TCP keepalives, in no slot.
    pub(super) async fn open_fair_session(
        self: &Arc<Self>,
        ticket: FairTicket,
    ) -> Result<Arc<LockSession>, Failure> {
        self.open_session_as(Some(ticket)).await
    }

    async fn open_session_as(
        self: &Arc<Self>,
        fair: Option<FairTicket>,
    ) -> Result<Arc<LockSession>, Failure> {
        let connector = match fair {
            Some(_) => &self.fair_connector,
            None => &self.connector,
        };
        let id = self.next_session_id.fetch_add(1, Ordering::Relaxed);
        let (ended_tx, ended) = watch::channel(None);
        let (kill, killed) = oneshot::channel();
        let weak = Arc::downgrade(self);
        let loss = LossGroup::new();
        let pid_known = Arc::new(AtomicI32::new(0));
        let ending = SessionEnding::new(Arc::clone(&loss), Arc::clone(&pid_known));
        let mut client = connector
            .open(self.lock_timeout(), killed, move |why| {
                ended_tx.send_replace(Some(why.clone()));
                ending.end(&why);
                if let Some(inner) = weak.upgrade() {
                    inner.session_ended(id, &why);
                }
            })
            .await?;
        // Every session, not only the first: a DBA may have dropped or
        // altered the token sequence since. One catalog query when all is well.
        self.ensure_objects(&mut client).await?;
        let setup = async {
            let idle_ms = self
                .options
                .server_idle_timeout
                .map(|idle| idle.as_millis().to_string());
            let seed = self.options.key_seed;
            let row = client
                .query_one(sql::LOCK_SESSION_SETUP, &[&idle_ms, &hash::PROBE, &seed])
                .await?;
            let pid: i32 = row.try_get(0)?;
            let started: Option<SystemTime> = row.try_get(1)?;
            let hashes = (
                row.try_get::<_, i64>(3)? == hash::advisory_key(hash::PROBE, seed),
                row.try_get::<_, bool>(4)?,
            );
            if fair.is_some() {
                client.query_one(sql::FAIR_SESSION_SETUP, &[]).await?;
            }
            // Behind the release gate where a lease may be named by its
            // record (see `sql::UNLOCK_GATED`).
            let unlock_sql = if self.options.record_holders {
                sql::UNLOCK_GATED
            } else {
                sql::UNLOCK
            };
            // Pipelined: one round trip.
            let statements = tokio::try_join!(
                client.prepare(&self.try_lock_sql),
                client.prepare(self.quick.sql(false)),
                client.prepare(unlock_sql),
            )?;
            Ok::<_, tokio_postgres::Error>(((pid, started), statements, hashes))
        };
        let ((pid, started), statements, hashes) = setup
            .await
            .map_err(|e| Failure::new("cannot prepare a lock session", e))?;
        pid_known.store(pid, Ordering::Release);
        if fair.is_some() {
            let every = self.options.liveness_interval.as_millis().to_string();
            if let Err(err) = client
                .query_one(sql::CLIENT_CONNECTION_CHECK, &[&every])
                .await
            {
                tracing::debug!(
                    error = %err,
                    "the server does not check a fair session's connection while it waits: \
                     a fair waiter that dies leaves the queue when the key reaches it"
                );
            }
        }
        let session = Arc::new(LockSession::new(
            id,
            (pid, started),
            client,
            statements,
            ended,
            kill,
            loss,
        ));
        if let Some(ticket) = fair {
            session.make_fair(ticket);
        }
        session.claims.hashes_agree(hashes);
        self.home.spawn(session::check_liveness(
            Arc::downgrade(&session),
            self.options.liveness_interval,
        ));
        tracing::debug!(
            pid,
            target = self.connector.target(),
            "PostgreSQL lock session opened"
        );
        Ok(session)
    }

    /// A lock session ended: its locks are gone on the server, so this
    /// process forgets them (which wakes its waiters); its leases learn it
    /// through the session's loss group.
    pub(super) fn session_ended(&self, id: u64, why: &str) {
        let mut keys = self.keys();
        let before = keys.len();
        keys.retain(|_, entry| entry.holding().is_none_or(|h| h.session.id != id));
        let lost = before - keys.len();
        drop(keys);
        let lost = lost + self.session_ended_modes(id);
        if lost > 0 {
            tracing::warn!(
                leases = lost,
                reason = why,
                "PostgreSQL lock session ended; its leases are lost"
            );
        } else {
            tracing::debug!(reason = why, "PostgreSQL lock session ended");
        }
    }
}

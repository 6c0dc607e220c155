//! The readers of one key in this process share one hold of it on the
//! server (see the `modes` module docs): a reader joins it, asking the
//! server only whether a writer's mark stands, or takes the key's turn to
//! ask for one, and the last reader out drops it.
//!
//! Its own file: the one hold many readers share has its own life (its
//! members, its unlock the next reader waits for), apart from the book of
//! holds and the statements that take them.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Mutex as AsyncMutex, watch};

use super::Inner;
use super::mode_sql::ModeStatement;
use super::session::LockSession;
use crate::backend::{Access, Attempt, Grant, OwnerId, QUEUE_ENTRY_TTL};
use crate::error::{LockError, Operation};
use crate::key::LockKey;
use crate::token::FencingToken;

/// One shared hold of a key on a lock session, shared by this process's
/// readers of the key (see the module docs).
pub(super) struct ReadHold {
    pub(super) id: u64,
    pub(super) session: Arc<LockSession>,
    pub(super) token: FencingToken,
    /// Readers counted on it: their leases, and joins on their way.
    pub(super) members: usize,
    /// While its unlock is on its way: changes (its sender drops) once the
    /// unlock is done.
    pub(super) unlocking: Option<watch::Receiver<()>>,
}

/// What a shared attempt does, decided in process.
enum ReadStep {
    /// Joins this process's hold (counted on it already).
    Join {
        id: u64,
        session: Arc<LockSession>,
        token: FencingToken,
    },
    /// Waits for the unlock of this process's hold.
    AfterUnlock(watch::Receiver<()>),
    /// Asks the server.
    Start,
}

impl Inner {
    /// A shared attempt: joins this process's hold of the key, or, taking
    /// the key's turn, asks the server for one (see the module docs).
    pub(super) async fn shared_attempt(
        self: &Arc<Self>,
        key: &LockKey,
        owner: OwnerId,
        ttl: Duration,
        turn: &AsyncMutex<()>,
    ) -> Result<Attempt, LockError> {
        loop {
            if let ReadStep::Join { id, session, token } = self.read_step(key) {
                match self.join_read(key, owner, ttl, id, session, token).await? {
                    Some(attempt) => return Ok(attempt),
                    None => continue,
                }
            }
            let _turn = turn.lock().await;
            match self.read_step(key) {
                ReadStep::Start => {
                    return self.mode_on_server(key, owner, ttl, Access::Shared).await;
                }
                ReadStep::Join { id, .. } => {
                    // Another attempt took the hold while this one waited
                    // for the turn: joined above, on the next round.
                    self.leave_read(key, id).await;
                }
                ReadStep::AfterUnlock(mut unlocked) => {
                    let _ = unlocked.changed().await;
                }
            }
        }
    }

    /// What a shared attempt of `key` does now; a join is counted on the
    /// hold at once, so the hold cannot be dropped under it.
    fn read_step(&self, key: &LockKey) -> ReadStep {
        let mut keys = self.modes.keys();
        let Some(entry) = keys.get_mut(key) else {
            return ReadStep::Start;
        };
        match entry.read.as_mut() {
            Some(read) if read.session.is_ended() => {
                // Gone with its session on the server; the session's end
                // is being told to the leases on it.
                entry.read = None;
                ReadStep::Start
            }
            Some(ReadHold {
                unlocking: Some(unlocked),
                ..
            }) => ReadStep::AfterUnlock(unlocked.clone()),
            Some(read) => {
                read.members += 1;
                ReadStep::Join {
                    id: read.id,
                    session: Arc::clone(&read.session),
                    token: read.token,
                }
            }
            None => ReadStep::Start,
        }
    }

    /// A reader joins this process's hold `id` of `key` (counted on it by
    /// [`Inner::read_step`]), unless a writer's mark stands (rule M3: asked
    /// of the server, so a stream of this process's readers does not starve
    /// a writer elsewhere). `None` if the hold went with its session
    /// meanwhile: the attempt starts over.
    async fn join_read(
        self: &Arc<Self>,
        key: &LockKey,
        owner: OwnerId,
        ttl: Duration,
        id: u64,
        session: Arc<LockSession>,
        token: FencingToken,
    ) -> Result<Option<Attempt>, LockError> {
        match self.writer_marked(key).await {
            Ok(false) => {}
            Ok(true) => {
                self.leave_read(key, id).await;
                self.modes.poll(key);
                return Ok(Some(Attempt::Held {
                    expires_in: Some(QUEUE_ENTRY_TTL / 3),
                }));
            }
            Err(err) => {
                self.leave_read(key, id).await;
                return Err(err);
            }
        }
        {
            let mut keys = self.modes.keys();
            let Some(entry) = keys.get_mut(key) else {
                return Ok(None);
            };
            if entry.read.as_ref().is_none_or(|read| read.id != id) || session.is_ended() {
                return Ok(None);
            }
            self.book(entry, key, owner, ttl, &session, None, token);
        }
        Ok(Some(Attempt::Acquired(
            Grant::new(token).lost_with(session.loss_group()),
        )))
    }

    /// Whether a writer's mark on `key` stands
    /// ([`sql::MARKED`](super::sql::MARKED)).
    async fn writer_marked(self: &Arc<Self>, key: &LockKey) -> Result<bool, LockError> {
        let session = self.session().await?;
        let answer = async {
            let statement = session
                .mode_statement(ModeStatement::Marked, &self.modes.statements)
                .await?;
            session
                .query_one(statement, &[&key.as_str(), &self.options.key_seed])
                .await?
                .try_get::<_, bool>(0)
        }
        .await;
        match answer {
            Ok(marked) => Ok(marked),
            Err(err) => {
                // A join asks the server nothing else, so it makes what is
                // gone again itself: the next join finds it.
                if self.remake_if_missing(key, &err).await
                    && let Err(failure) = self.modes_ready(Operation::Acquire, key).await
                {
                    tracing::warn!(key = %key, error = %failure, "cannot make the phase table again");
                }
                Err(self.failed(
                    Operation::Acquire,
                    key,
                    "asking for a writer's mark failed",
                    err,
                ))
            }
        }
    }

    /// One reader leaves this process's hold `id` of `key`; the last one
    /// out drops it on the server, and the next reader waits for that.
    pub(super) async fn leave_read(&self, key: &LockKey, id: u64) {
        let (session, token, unlocked) = {
            let mut keys = self.modes.keys();
            let Some(read) = keys
                .get_mut(key)
                .and_then(|entry| entry.read.as_mut())
                .filter(|read| read.id == id && read.unlocking.is_none())
            else {
                return;
            };
            read.members = read.members.saturating_sub(1);
            if read.members > 0 {
                return;
            }
            let (unlocked, waiting) = watch::channel(());
            read.unlocking = Some(waiting);
            (Arc::clone(&read.session), read.token, unlocked)
        };
        let seed = self.options.key_seed;
        // The token as drawn: a positive int8.
        let token = token.get() as i64;
        let answer = async {
            let statement = session
                .mode_statement(ModeStatement::UnlockShared, &self.modes.statements)
                .await?;
            session
                .query(statement, &[&key.as_str(), &seed, &token])
                .await
        }
        .await;
        if let Err(err) = answer
            && !err.is_closed()
            && !session.is_ended()
        {
            // Whether the hold is gone is unknown: ending the session
            // drops it for sure (and tells the leases on it).
            tracing::warn!(key = %key, error = %err, "dropping a shared hold failed");
            session.end(format!("could not release `{key}`"));
        }
        let mut keys = self.modes.keys();
        if let Some(entry) = keys.get_mut(key) {
            if entry.read.as_ref().is_some_and(|read| read.id == id) {
                entry.read = None;
            }
            if entry.unused() {
                keys.remove(key);
            }
        }
        drop(unlocked);
    }
}

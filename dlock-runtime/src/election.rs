//! Leader election: one replica leads a named election for as long as it
//! lives, everyone can ask who leads, and a deposed leader is told at once
//! and fenced off.
//!
//! An election is a lock held for a term rather than for one call: the
//! leader's lease on the election's key, taken with an identity the
//! campaigner chose (a host and pid, a pod name) recorded beside the lock.
//! So leadership has everything a lease has: background renewal, the lost
//! signal, release on drop, and a fencing token, which rises with every
//! new term, to send with every write the leader makes.
//!
//! - [`Election::campaign`] waits (by notification, as a lock waiter does)
//!   until the caller is elected, and returns its [`Leadership`].
//! - [`Election::lead`] is the usual loop: campaign, run the leader's work
//!   with a [`Term`] (token and lost signal), stop the work the moment the
//!   term is lost, campaign again.
//! - [`Leadership::resign`] steps down; the next campaigner is elected at
//!   once, without waiting for the ttl.
//! - [`Election::leader`] says who leads now, and [`Election::observe`]
//!   follows every change ([`LeaderWatch::changed`]), woken by the backend
//!   where it can announce changes.
//!
//! A leader that was paused (a stopped process, a long garbage collection,
//! a frozen VM) past its ttl has lost: another was elected meanwhile. When
//! it resumes, its lease is over by its own clock before any write of its
//! own could tell it: [`Leadership::check`] and the lost signal say so, and
//! [`Election::lead`] drops the work. A write it still sends carries its
//! old token, which the [fence](crate::fence) helpers refuse once the new
//! leader has written.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), dlock_runtime::LockError> {
//! use std::{sync::Arc, time::Duration};
//! use dlock_runtime::{election::Election, memory::MemoryBackend, Backend};
//!
//! let store: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
//! let election = Election::new("scheduler", "web-1 (pid 4121)", Duration::from_secs(10))?
//!     .on(store.clone());
//! let leadership = election.campaign().await?;
//! let leader = election.leader().await?.expect("someone leads");
//! assert_eq!(leader.identity, "web-1 (pid 4121)");
//! assert_eq!(leader.token, leadership.token());
//! leadership.resign().await?;
//! assert_eq!(election.leader().await?, None);
//! # Ok(())
//! # }
//! ```

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, sleep, timeout};

use crate::backend::{Backend, Holding, MAX_IDENTITY_LEN};
use crate::error::LockError;
use crate::key::LockKey;
use crate::lease::{self, Lease, LostSignal};
use crate::options::{IntoLockKey, LockOptions, MAX_DURATION};
use crate::registry::{DEFAULT_BACKEND, registry};
use crate::token::FencingToken;

/// The longest a watch sleeps without reading the holder again, whatever
/// the backend says: a safety net should a notice ever be lost.
const MAX_NAP: Duration = Duration::from_secs(10);
/// Added to a leader's remaining lifetime before reading again, so the
/// read lands after its expiry rather than just before it.
const EXPIRY_SLACK: Duration = Duration::from_millis(2);
/// How soon a leader whose store could not be read looks again (and
/// renews its term again): the store may be back without the term.
const GUARD_RETRY: Duration = Duration::from_millis(100);
/// The first and the longest pause before reading again a key that is held
/// without a recorded leader (an acquisition still being recorded, or a
/// plain lock on the election's key).
const MIN_UNKNOWN_PAUSE: Duration = Duration::from_millis(5);
const MAX_UNKNOWN_PAUSE: Duration = Duration::from_secs(1);
/// How long [`Election::leader`] reads a key held without a recorded
/// leader before it answers that something other than a campaigner holds
/// the election's name.
pub const UNKNOWN_HOLDER_WAIT: Duration = Duration::from_secs(2);

/// A named election and the identity this process campaigns with.
///
/// Every replica makes one with the same name, ttl and backend and its own
/// identity. The ttl bounds how long a crashed leader that the store cannot
/// see die (Redis) keeps the election; a live leader renews every third of
/// it.
#[derive(Clone)]
pub struct Election {
    key: LockKey,
    identity: Arc<str>,
    ttl: Duration,
    backend: Cow<'static, str>,
    direct: Option<Arc<dyn Backend>>,
    rejoin: bool,
}

impl std::fmt::Debug for Election {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Election")
            .field("name", &self.key)
            .field("identity", &self.identity)
            .field("ttl", &self.ttl)
            .field(
                "backend",
                &self.direct.as_ref().map_or(&*self.backend, |b| b.kind()),
            )
            .finish()
    }
}

/// Who leads an election: the identity it campaigned with and the fencing
/// token of its term.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Leader {
    /// The identity the leader campaigned with.
    pub identity: String,
    /// The fencing token of its term: higher for every later term.
    pub token: FencingToken,
}

impl std::fmt::Display for Leader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (token {})", self.identity, self.token)
    }
}

impl Election {
    /// An election named `name` (a lock key), in which this process
    /// campaigns as `identity`, with terms of `ttl` renewed while the leader
    /// lives, on the backend registered as `"default"`.
    ///
    /// The identity must be 1 to 256 bytes without control characters: it
    /// is what [`Election::leader`] tells everyone.
    pub fn new(
        name: impl IntoLockKey,
        identity: impl Into<String>,
        ttl: Duration,
    ) -> Result<Self, LockError> {
        let key = name.into_lock_key()?;
        let identity: String = identity.into();
        let bad = |reason: String| {
            Err(LockError::InvalidOption {
                option: "identity",
                reason,
            })
        };
        if identity.is_empty() {
            return bad("must not be empty".into());
        }
        if identity.len() > MAX_IDENTITY_LEN {
            return bad(format!(
                "is {} bytes, more than the {MAX_IDENTITY_LEN}-byte maximum",
                identity.len()
            ));
        }
        if identity.chars().any(char::is_control) {
            return bad(format!("{identity:?} holds a control character"));
        }
        LockOptions::new(ttl).validate()?;
        Ok(Self {
            key,
            identity: identity.into(),
            ttl,
            backend: Cow::Borrowed(DEFAULT_BACKEND),
            direct: None,
            rejoin: true,
        })
    }

    /// Campaigns on the backend registered under `name`.
    pub fn backend(mut self, name: impl Into<Cow<'static, str>>) -> Self {
        self.backend = name.into();
        self.direct = None;
        self
    }

    /// Campaigns on a backend held directly rather than by name.
    pub fn on(mut self, backend: Arc<dyn Backend>) -> Self {
        self.direct = Some(backend);
        self
    }

    /// Whether [`Election::lead`] campaigns again after losing a term (on
    /// by default). Off, it returns the loss.
    pub fn rejoin(mut self, rejoin: bool) -> Self {
        self.rejoin = rejoin;
        self
    }

    /// The election's name.
    pub fn name(&self) -> &LockKey {
        &self.key
    }

    /// The identity this process campaigns with.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    fn store(&self) -> Result<Arc<dyn Backend>, LockError> {
        match &self.direct {
            Some(backend) => Ok(Arc::clone(backend)),
            None => registry().get(&self.backend),
        }
    }

    /// Waits until this process is elected, and returns its leadership.
    ///
    /// It waits as a lock waiter does: woken by the backend when the leader
    /// steps down or its session ends, and when its term runs out. A
    /// backend that fails meanwhile (a server restarting, a privilege the
    /// role lacks) is retried with backoff, each failure logged as a
    /// warning, so a campaign outlives an outage and picks up a fixed grant
    /// without a restart; it never gives up on its own. Cancel it (a
    /// `select!`, a timeout) to stop campaigning: nothing stays held.
    pub async fn campaign(&self) -> Result<Leadership, LockError> {
        let backend = self.store()?;
        let options = LockOptions::new(self.ttl).wait(MAX_DURATION);
        let mut terms = options.terms();
        terms.identity = Some(Arc::clone(&self.identity));
        loop {
            match lease::acquire(
                Arc::clone(&backend),
                self.key.clone(),
                terms.clone(),
                options.deadline(),
            )
            .await
            {
                Ok(lease) => {
                    tracing::info!(
                        election = %self.key,
                        identity = %self.identity,
                        token = %lease.token(),
                        "elected"
                    );
                    let watching = tokio::spawn(guard(
                        Arc::clone(&backend),
                        self.key.clone(),
                        lease.lost_signal(),
                    ));
                    return Ok(Leadership {
                        lease,
                        identity: Arc::clone(&self.identity),
                        _guard: Guard(watching.abort_handle()),
                    });
                }
                // Thirty days without a term: campaign on.
                Err(LockError::Timeout { .. }) => {}
                Err(err) => return Err(err),
            }
        }
    }

    /// Runs the leader's work for as long as this process leads: campaigns,
    /// runs `work` with the [`Term`], and if the term is lost first (its
    /// renewal refused, its session ended, its ttl run out), drops the work
    /// at once and campaigns again (unless [`Election::rejoin`] is off,
    /// when the loss is returned). Work that returns on a term already lost
    /// counts as that loss. When the work finishes on a live term, the
    /// leader resigns and its output is returned.
    ///
    /// Work that must finish a step after the loss is told rather than
    /// dropped: use [`Election::campaign`] and [`Leadership::lost`].
    pub async fn lead<F, Fut>(&self, work: F) -> Result<Fut::Output, LockError>
    where
        F: FnMut(Term) -> Fut,
        Fut: Future,
    {
        match self.lead_until(work, std::future::pending::<()>()).await? {
            Some(output) => Ok(output),
            None => unreachable!("a pending shutdown never resolves"),
        }
    }

    /// [`Election::lead`] until `shutdown` resolves: then a campaign stops,
    /// or a leader drops its work and resigns (awaited, so the next leader
    /// is elected at once rather than after the ttl), and `Ok(None)` is
    /// returned. For a process that leads until it is told to stop.
    pub async fn lead_until<F, Fut, S>(
        &self,
        mut work: F,
        shutdown: S,
    ) -> Result<Option<Fut::Output>, LockError>
    where
        F: FnMut(Term) -> Fut,
        Fut: Future,
        S: Future,
    {
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let leadership = tokio::select! {
                biased;
                _ = shutdown.as_mut() => return Ok(None),
                elected = self.campaign() => elected?,
            };
            let term = Term {
                token: leadership.token(),
                lost: leadership.lease.lost_signal(),
                identity: Arc::clone(&self.identity),
            };
            let outcome = tokio::select! {
                biased;
                _ = shutdown.as_mut() => {
                    // A term lost meanwhile has nothing left to resign.
                    return match leadership.resign().await {
                        Ok(()) | Err(LockError::LeaseLost { .. }) => Ok(None),
                        Err(err) => Err(err),
                    };
                }
                outcome = leadership.lease.run(work(term)) => outcome,
            };
            let lost = match outcome {
                Ok(output) => match leadership.check() {
                    Ok(()) => {
                        // The work is done: its output is not lost to a
                        // failed resignation, which the ttl (or the end
                        // of the session) completes.
                        if let Err(err) = leadership.resign().await {
                            tracing::warn!(
                                election = %self.key,
                                identity = %self.identity,
                                error = %err,
                                "resigning failed; the term ends with its ttl"
                            );
                        }
                        return Ok(Some(output));
                    }
                    Err(lost) => lost,
                },
                Err(lost @ LockError::LeaseLost { .. }) => lost,
                Err(err) => return Err(err),
            };
            tracing::warn!(
                election = %self.key,
                identity = %self.identity,
                error = %lost,
                "lost the leadership; the leader's work was stopped"
            );
            // The term is over: dropping it only ends the lease.
            drop(leadership);
            if !self.rejoin {
                return Err(lost);
            }
        }
    }

    /// Who leads now, or `None` while nobody does.
    ///
    /// A key held without a recorded leader (an election being recorded
    /// this very moment, or a plain lock on the election's name) is read
    /// again after a short pause until it has one or is free; still so
    /// after [`UNKNOWN_HOLDER_WAIT`], the answer is [`LockError::Held`]:
    /// something other than a campaigner holds the name.
    pub async fn leader(&self) -> Result<Option<Leader>, LockError> {
        let backend = self.store()?;
        let started = Instant::now();
        let mut pause = MIN_UNKNOWN_PAUSE;
        loop {
            match Reading::of(backend.holder(&self.key).await?) {
                Reading::Free => return Ok(None),
                Reading::Led(leader, _) => return Ok(Some(leader)),
                Reading::Unknown if started.elapsed() >= UNKNOWN_HOLDER_WAIT => {
                    return Err(LockError::Held {
                        key: self.key.to_string(),
                        holder: None,
                    });
                }
                Reading::Unknown => {
                    sleep(pause).await;
                    pause = (pause * 2).min(MAX_UNKNOWN_PAUSE);
                }
            }
        }
    }

    /// Follows who leads: [`LeaderWatch::changed`] returns the leader now,
    /// then each change after it.
    pub fn observe(&self) -> Result<LeaderWatch, LockError> {
        Ok(LeaderWatch {
            backend: self.store()?,
            key: self.key.clone(),
            last: None,
        })
    }
}

/// What one read of the election's key says.
enum Reading {
    Free,
    Led(Leader, Option<Duration>),
    /// Held, but without a recorded leader (yet).
    Unknown,
}

impl Reading {
    fn of(holding: Option<Holding>) -> Self {
        match holding {
            None => Reading::Free,
            Some(Holding {
                token: Some(token),
                identity: Some(identity),
                expires_in,
                ..
            }) => Reading::Led(Leader { identity, token }, expires_in),
            Some(_) => Reading::Unknown,
        }
    }
}

/// Watches the election while this process leads, until the term ends.
/// When a read shows another holder or none (a forced release, a server
/// that restarted without its data), or the store cannot be read, the term
/// is renewed at once rather than at its time: a term the store lost is
/// told now, not up to a renewal interval later, while campaigners
/// elsewhere may already be elected.
async fn guard(backend: Arc<dyn Backend>, key: LockKey, term: LostSignal) {
    let watch = async {
        loop {
            let read = async {
                let notice = backend.watch_holder(&key).await?;
                let holding = backend.holder(&key).await?;
                Ok::<_, LockError>((notice, holding))
            };
            match read.await {
                Ok((notice, holding)) => {
                    let token = holding.as_ref().map(|h| h.token);
                    // Free, or held with another token: not this term.
                    // (Held by someone unknown is left to the renewal.)
                    if token.is_none_or(|t| t.is_some_and(|t| t != term.token())) {
                        term.recheck();
                    }
                    let nap = [
                        holding
                            .and_then(|h| h.expires_in)
                            .map(|left| left + EXPIRY_SLACK),
                        notice.recheck(),
                    ]
                    .into_iter()
                    .flatten()
                    .fold(MAX_NAP, Duration::min);
                    let _ = timeout(nap, notice).await;
                }
                Err(_) => {
                    term.recheck();
                    sleep(GUARD_RETRY).await;
                }
            }
        }
    };
    // Biased, the end of the term first: once it has ended there is
    // nothing left to watch, and an unbiased `select!` would let a
    // wake-up of the watch that came with it (the release that ended the
    // term) run one more read of the store, by a draw of tokio's random
    // source.
    tokio::select! {
        biased;
        _ = term.lost() => {}
        () = watch => {}
    }
}

/// This process's term as leader: a lease on the election's key. Dropped
/// unresigned, it steps down in the background.
#[derive(Debug)]
pub struct Leadership {
    lease: Lease,
    identity: Arc<str>,
    /// The task that watches the election for this term.
    _guard: Guard,
}

/// Stops the [`guard`] task of a term when the term's leadership goes.
#[derive(Debug)]
struct Guard(tokio::task::AbortHandle);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Leadership {
    /// The fencing token of this term: send it with every write the leader
    /// makes, so a resource refuses the writes of a deposed leader.
    pub fn token(&self) -> FencingToken {
        self.lease.token()
    }

    /// The identity this process was elected with.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// True once the term is lost: stop acting as leader.
    pub fn is_lost(&self) -> bool {
        self.lease.is_lost()
    }

    /// `Ok(())` while this process leads, the [`LockError::LeaseLost`]
    /// that ended the term otherwise. Cheap: call it between steps.
    pub fn check(&self) -> Result<(), LockError> {
        self.lease.check()
    }

    /// Resolves, with the error that says why, when the term is lost.
    pub async fn lost(&self) -> LockError {
        self.lease.lost().await
    }

    /// A handle on the lost signal that can be moved into other tasks.
    pub fn lost_signal(&self) -> LostSignal {
        self.lease.lost_signal()
    }

    /// Runs `work` while this process leads; if the term is lost first,
    /// `work` is dropped and the loss returned.
    pub async fn run<F: Future>(&self, work: F) -> Result<F::Output, LockError> {
        self.lease.run(work).await
    }

    /// Steps down: the next campaigner is elected at once. Fails with
    /// [`LockError::LeaseLost`] if the term had been lost before.
    pub async fn resign(self) -> Result<(), LockError> {
        self.lease.release().await
    }
}

/// What the leader's work gets from [`Election::lead`]: the term's token,
/// its lost signal and the identity it was won with.
#[derive(Clone, Debug)]
pub struct Term {
    token: FencingToken,
    lost: LostSignal,
    identity: Arc<str>,
}

impl Term {
    /// The fencing token of this term.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// The identity this process was elected with.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// True once the term is lost. [`Election::lead`] also drops the work
    /// then; this is for steps that must not start late.
    pub fn is_lost(&self) -> bool {
        self.lost.is_lost()
    }

    /// `Ok(())` while the term lasts.
    pub fn check(&self) -> Result<(), LockError> {
        self.lost.check()
    }

    /// The term's lost signal, to move into tasks of the work.
    pub fn lost_signal(&self) -> LostSignal {
        self.lost.clone()
    }
}

/// Follows the leader of an election ([`Election::observe`]).
///
/// It reads the leader after every change the backend announces (every
/// backend announces a leader's resignation or loss; memory, Redis and
/// PostgreSQL announce a new leader too, file is read again every 50 ms
/// while nobody leads, and PostgreSQL every second, for a new leader that
/// was not announced, or every 50 ms when it cannot listen for the
/// announcements), and when the leader's term runs out. Changes
/// closer together than one read come as the last of them, as with any
/// watch: what [`LeaderWatch::changed`] returns is always the leader at
/// that moment, and tokens only rise from one leader to the next.
pub struct LeaderWatch {
    backend: Arc<dyn Backend>,
    key: LockKey,
    /// The last answer returned; `None` before the first.
    last: Option<Option<Leader>>,
}

impl std::fmt::Debug for LeaderWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderWatch")
            .field("election", &self.key)
            .field("last", &self.last)
            .finish()
    }
}

impl LeaderWatch {
    /// The leader now on the first call; after that, waits until the
    /// leader differs from the last answer and returns the new one (`None`:
    /// nobody leads). A backend failure is returned as it is; call again to
    /// go on watching.
    pub async fn changed(&mut self) -> Result<Option<Leader>, LockError> {
        let mut unknown_pause = MIN_UNKNOWN_PAUSE;
        loop {
            // Registered before the read: a change after it wakes the notice.
            let notice = self.backend.watch_holder(&self.key).await?;
            let expires_in = match Reading::of(self.backend.holder(&self.key).await?) {
                Reading::Free => {
                    if self.last.as_ref() != Some(&None) {
                        self.last = Some(None);
                        return Ok(None);
                    }
                    None
                }
                Reading::Led(leader, expires_in) => {
                    if self.last.as_ref().and_then(Option::as_ref) != Some(&leader) {
                        self.last = Some(Some(leader.clone()));
                        return Ok(Some(leader));
                    }
                    unknown_pause = MIN_UNKNOWN_PAUSE;
                    expires_in
                }
                Reading::Unknown => {
                    drop(notice);
                    sleep(unknown_pause).await;
                    unknown_pause = (unknown_pause * 2).min(MAX_UNKNOWN_PAUSE);
                    continue;
                }
            };
            let started = Instant::now();
            let nap = [expires_in.map(|left| left + EXPIRY_SLACK), notice.recheck()]
                .into_iter()
                .flatten()
                .fold(MAX_NAP, Duration::min);
            let _ = timeout(nap.saturating_sub(started.elapsed()), notice).await;
        }
    }
}

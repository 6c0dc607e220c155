//! Several keys at once: taken in one global order, released together.

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use tokio::time::Instant;

use super::{Lease, Terms, acquire};
use crate::backend::Backend;
use crate::error::LockError;
use crate::key::LockKey;
use crate::token::{FencingToken, FencingTokens};

/// Several held locks, taken in one global order. Lost as soon as any of
/// them is lost.
#[must_use = "the locks are released as soon as the set is dropped"]
#[derive(Debug)]
pub struct LeaseSet {
    /// In locking (sorted) order.
    leases: Vec<Lease>,
    /// For each key as written, its index in `leases`.
    written: Vec<usize>,
}

impl LeaseSet {
    /// The tokens, one per key in the order the keys were written.
    pub fn tokens(&self) -> FencingTokens {
        FencingTokens(
            self.written
                .iter()
                .map(|&i| self.leases[i].token())
                .collect(),
        )
    }

    /// The token of `key`, if it is in the set.
    pub fn token_of(&self, key: &LockKey) -> Option<FencingToken> {
        self.leases
            .iter()
            .find(|lease| lease.key() == key)
            .map(Lease::token)
    }

    /// The leases, in locking order.
    pub fn leases(&self) -> &[Lease] {
        &self.leases
    }

    /// True once any of the leases is lost.
    pub fn is_lost(&self) -> bool {
        self.leases.iter().any(Lease::is_lost)
    }

    /// `Ok(())` while every lease is held.
    pub fn check(&self) -> Result<(), LockError> {
        self.leases.iter().try_for_each(Lease::check)
    }

    /// Resolves when any lease is lost.
    pub async fn lost(&self) -> LockError {
        let mut waits: Vec<Pin<Box<dyn Future<Output = LockError> + Send + '_>>> = self
            .leases
            .iter()
            .map(|lease| {
                Box::pin(lease.lost()) as Pin<Box<dyn Future<Output = LockError> + Send + '_>>
            })
            .collect();
        poll_fn(|cx| {
            for wait in &mut waits {
                if let Poll::Ready(err) = wait.as_mut().poll(cx) {
                    return Poll::Ready(err);
                }
            }
            Poll::Pending
        })
        .await
    }

    /// Runs `work` while every lease is held; cancels it if one is lost.
    pub async fn run<F: Future>(&self, work: F) -> Result<F::Output, LockError> {
        tokio::select! {
            biased;
            err = self.lost() => Err(err),
            out = work => Ok(out),
        }
    }

    /// Releases every lock, in reverse locking order. All are released even
    /// if one fails; the first failure is returned.
    pub async fn release(self) -> Result<(), LockError> {
        let mut first_error = None;
        for lease in self.leases.into_iter().rev() {
            if let Err(err) = lease.release().await {
                first_error.get_or_insert(err);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// Acquires several keys in sorted order, releasing what it took if a
/// later key cannot be had.
pub(crate) async fn acquire_many(
    backend: Arc<dyn Backend>,
    keys: Vec<LockKey>,
    terms: Terms,
    deadline: Instant,
) -> Result<LeaseSet, LockError> {
    let mut order = keys.clone();
    order.sort();
    order.dedup();
    let mut leases: Vec<Lease> = Vec::with_capacity(order.len());
    for key in &order {
        match acquire(Arc::clone(&backend), key.clone(), terms.clone(), deadline).await {
            Ok(lease) => leases.push(lease),
            Err(err) => {
                for taken in leases.into_iter().rev() {
                    taken.release_unused().await;
                }
                return Err(err);
            }
        }
    }
    let written = keys
        .iter()
        .map(|key| order.binary_search(key).unwrap_or_default())
        .collect();
    Ok(LeaseSet { leases, written })
}

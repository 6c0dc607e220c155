//! The etcd lease under each lock: granted with the key, kept alive by
//! renewals (a batch of them at once, with one read of every key), moved
//! when a renewal changes the ttl, revoked with the release.

use super::*;

impl EtcdBackend {
    /// Keeps `lease` alive once: `false` if etcd does not know it (it ran
    /// out, or was revoked). For a renewal, with the time its lease has
    /// left from `started` (see [`EtcdBackend::renewing`]).
    async fn keep_alive(
        &self,
        operation: Operation,
        key: &str,
        lease: i64,
        time_left: Option<Duration>,
        started: Instant,
    ) -> Result<bool, LockError> {
        self.renewing(operation, key, time_left, started, || {
            let mut leases = self.inner.client.lease_client();
            async move {
                match leases.keep_alive(lease).await {
                    // The stream is dropped with its sender: one request,
                    // one answer.
                    Ok(_) => Ok(true),
                    Err(EtcdError::LeaseKeepAliveError(text)) if text.contains("not found") => {
                        Ok(false)
                    }
                    Err(err) => Err(err),
                }
            }
        })
        .await
    }

    /// Grants `lease` for `seconds`: `true` if it is new, `false` if it
    /// existed (a retry of the same acquisition) and was kept alive anew.
    pub(super) async fn grant(
        &self,
        operation: Operation,
        key: &str,
        lease: i64,
        seconds: i64,
    ) -> Result<bool, LockError> {
        for _ in 0..2 {
            let granted = self
                .bounded(operation, key, || {
                    let mut leases = self.inner.client.lease_client();
                    async move {
                        match leases
                            .grant(seconds, Some(LeaseGrantOptions::new().with_id(lease)))
                            .await
                        {
                            Ok(_) => Ok(true),
                            Err(EtcdError::GRpcStatus(status))
                                if status.message().contains("lease already exists") =>
                            {
                                Ok(false)
                            }
                            Err(err) => Err(err),
                        }
                    }
                })
                .await?;
            // An existing lease is this acquisition's own: counted anew
            // from now (rule 3), unless it ran out meanwhile.
            if granted
                || self
                    .keep_alive(operation, key, lease, None, Instant::now())
                    .await?
            {
                return Ok(granted);
            }
        }
        Err(self.error(
            operation,
            key,
            "the lease ran out again and again while it was being granted",
        ))
    }

    /// Revokes `lease`, whose keys are gone already or not the holder's;
    /// a failure is ignored (a lease left behind only runs out). Awaited,
    /// never left to run in the background: the same owner may name the
    /// same lease again at once (a multi-key acquisition backs off and
    /// retries with its owner id), and a revoke that came after that
    /// retry's grant would delete the key it just took.
    pub(super) async fn revoke(&self, lease: i64) {
        if lease == 0 {
            return;
        }
        let _ = self
            .bounded(Operation::Release, "", || {
                let mut leases = self.inner.client.lease_client();
                async move { leases.revoke(lease).await }
            })
            .await;
    }

    /// The writes that take (or retake) a key on `lease`: the lock, the
    /// holder record and the identity (or no identity).
    pub(super) fn writes(
        names: &Names,
        owner: &[u8; 32],
        record: String,
        identity: Option<&str>,
        lease: i64,
    ) -> Vec<TxnOp> {
        let on_lease = || Some(PutOptions::new().with_lease(lease));
        vec![
            TxnOp::put(names.lock.as_str(), owner.to_vec(), on_lease()),
            TxnOp::put(names.holder.as_str(), record, on_lease()),
            match identity {
                Some(identity) => TxnOp::put(names.identity.as_str(), identity, on_lease()),
                None => TxnOp::delete(names.identity.as_str(), None),
            },
        ]
    }

    /// Moves `renewal`'s keys from lease `old` onto a new lease for its
    /// ttl (etcd cannot change a lease's ttl): in one transaction compared
    /// on the owner and the old lease, so a lease that ended stays ended.
    async fn move_lease(&self, renewal: &Renewal<'_>, old: i64) -> Result<bool, LockError> {
        let key = renewal.key.as_str();
        let names = Names::of(renewal.key);
        let seconds = lease_seconds(renewal.ttl);
        let lease = lease_id(renewal.owner, seconds);
        self.grant(Operation::Extend, key, lease, seconds).await?;
        let owner = renewal.owner.to_hex();
        // The holder record and identity keep their values, moved with
        // `ignore_value`, which needs the key to exist.
        let keep = |name: &str| {
            TxnOp::txn(
                Txn::new()
                    .when([Compare::create_revision(name, CompareOp::Greater, 0)])
                    .and_then([TxnOp::put(
                        name,
                        Vec::new(),
                        Some(PutOptions::new().with_lease(lease).with_ignore_value()),
                    )]),
            )
        };
        let txn = Txn::new()
            .when([
                Compare::value(names.lock.as_str(), CompareOp::Equal, owner.to_vec()),
                Compare::lease(names.lock.as_str(), CompareOp::Equal, old),
            ])
            .and_then([
                TxnOp::put(
                    names.lock.as_str(),
                    owner.to_vec(),
                    Some(PutOptions::new().with_lease(lease)),
                ),
                keep(&names.holder),
                keep(&names.identity),
            ]);
        let moved = self.txn(Operation::Extend, key, txn).await?.succeeded();
        self.revoke(if moved { old } else { lease }).await;
        Ok(moved)
    }

    /// Writes `identity` again beside `renewal`'s lock, on its lease, if
    /// the lock is still the owner's on that lease: an operator who
    /// deleted the record hides a leader for one renewal at most. A
    /// failure is only logged: the renewal itself went through.
    async fn record_identity(&self, renewal: &Renewal<'_>, identity: &str, lease: i64) {
        let names = Names::of(renewal.key);
        let owner = renewal.owner.to_hex();
        let txn = Txn::new()
            .when([
                Compare::value(names.lock.as_str(), CompareOp::Equal, owner.to_vec()),
                Compare::lease(names.lock.as_str(), CompareOp::Equal, lease),
            ])
            .and_then([TxnOp::put(
                names.identity.as_str(),
                identity,
                Some(PutOptions::new().with_lease(lease)),
            )]);
        if let Err(err) = self.txn(Operation::Extend, renewal.key.as_str(), txn).await {
            tracing::debug!(key = %renewal.key, error = %err, "could not write a missing identity record again");
        }
    }

    /// One batch of at most [`RENEWALS_PER_TXN`] renewals, whose leases'
    /// time left counts from `started`.
    pub(super) async fn extend_batch(
        &self,
        renewals: &[Renewal<'_>],
        started: Instant,
    ) -> Vec<Result<bool, LockError>> {
        let leases: Vec<i64> = renewals
            .iter()
            .map(|r| lease_id(r.owner, lease_seconds(r.ttl)))
            .collect();
        // Each lease kept alive, all at once; then one read of every key.
        let alive = join_all(renewals.iter().zip(&leases).map(|(r, lease)| {
            self.keep_alive(
                Operation::Extend,
                r.key.as_str(),
                *lease,
                r.time_left,
                started,
            )
        }))
        .await;
        // The read serves every lease of the batch: tried for as long as
        // the one with the most time left has.
        let read_time_left = renewals
            .iter()
            .map(|r| r.time_left)
            .collect::<Option<Vec<Duration>>>()
            .and_then(|left| left.into_iter().max());
        // Every lock key, and the identity record of each lease taken
        // with one (rewritten below if it went missing).
        let mut reads = Vec::with_capacity(2 * renewals.len());
        let mut identity_at = Vec::with_capacity(renewals.len());
        for renewal in renewals {
            let names = Names::of(renewal.key);
            reads.push(TxnOp::get(names.lock, None));
            identity_at.push(renewal.recorded.map(|_| {
                reads.push(TxnOp::get(names.identity, None));
                reads.len() - 1
            }));
        }
        let lock_at: Vec<usize> = {
            let mut at = 0;
            identity_at
                .iter()
                .map(|identity| {
                    let here = at;
                    at += 1 + usize::from(identity.is_some());
                    here
                })
                .collect()
        };
        let reads = Txn::new().and_then(reads);
        let first = renewals.first().map_or("", |r| r.key.as_str());
        let read = match self
            .renewal_read(first, read_time_left, started, reads)
            .await
        {
            Ok(read) => read.op_responses(),
            Err(err) => {
                let text = err.to_string();
                return renewals
                    .iter()
                    .map(|r| Err(self.error(Operation::Extend, r.key.as_str(), &text)))
                    .collect();
            }
        };
        let mut answers = Vec::with_capacity(renewals.len());
        for (i, (renewal, alive)) in renewals.iter().zip(alive).enumerate() {
            let held = match read.get(lock_at[i]) {
                Some(TxnOpResponse::Get(get)) => get.kvs().first().cloned(),
                _ => {
                    answers.push(Err(self.error(
                        Operation::Extend,
                        renewal.key.as_str(),
                        "etcd's answer to the renewal's read lacks this key",
                    )));
                    continue;
                }
            };
            let owned = held
                .as_ref()
                .filter(|kv| kv.value() == renewal.owner.to_hex().as_slice());
            answers.push(match (alive, owned) {
                (Err(err), _) => Err(err),
                (Ok(alive), Some(kv)) if kv.lease() == leases[i] => {
                    if alive
                        && let Some((identity, _)) = renewal.recorded
                        && identity_at[i]
                            .and_then(|at| first_kv(&read, at))
                            .is_none_or(|kv| {
                                kv.lease() != leases[i] || kv.value() != identity.as_bytes()
                            })
                    {
                        self.record_identity(renewal, identity, leases[i]).await;
                    }
                    Ok(alive)
                }
                // Held on another lease of the same owner: the ttl changed.
                (Ok(_), Some(kv)) => self.move_lease(renewal, kv.lease()).await,
                (Ok(alive), None) => {
                    if alive {
                        self.revoke(leases[i]).await;
                    }
                    Ok(false)
                }
            });
        }
        answers
    }
}

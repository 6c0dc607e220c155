//! Requests to the cluster and the member failover they share: every
//! request bounded by the response timeout and sent again when it never
//! left, a renewal's requests joined by another try while no answer comes
//! (see "A leader change" in the module docs of `etcd`).

use super::*;

/// The pause before sending again a request that could not be sent (its
/// member is down): the client's balancer picks a member anew each time.
pub(super) const UNSENT_PAUSE: Duration = Duration::from_millis(20);
/// A renewal's request waits alone for an answer at most this share of the
/// time its lease has left before it is sent once more
/// ([`renewal_try_limit`]).
const RENEWAL_TRIES: u32 = 4;
/// The shortest wait for an answer to one try of a renewal's request
/// before another joins it.
const MIN_RENEWAL_TRY: Duration = Duration::from_millis(100);
/// gRPC's status code `UNAVAILABLE`.
const GRPC_UNAVAILABLE: i32 = 14;
/// gRPC's status code `CANCELLED`.
const GRPC_CANCELLED: i32 = 1;
/// The pause before a renewal's request that failed in transport (see
/// [`transport_failed`]) is sent again, to a member the client picks anew.
const FAILED_TRY_PAUSE: Duration = Duration::from_millis(50);

impl EtcdBackend {
    pub(super) fn error(&self, operation: Operation, key: &str, text: &str) -> LockError {
        LockError::backend(KIND, operation, key, scrub(text, &self.inner.secrets))
    }

    /// Runs one request within the response timeout, sending it again
    /// when it could not be sent at all (the member the client picked
    /// refuses connections: it is down). A request that was sent is never
    /// repeated here.
    pub(super) async fn bounded<T, F, Fut>(
        &self,
        operation: Operation,
        key: &str,
        request: F,
    ) -> Result<T, LockError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, EtcdError>>,
    {
        let limit = self.inner.response_timeout;
        match within(limit, request).await {
            Some(answer) => answer.map_err(|err| self.error(operation, key, &err.to_string())),
            None => Err(self.no_answer(operation, key, limit)),
        }
    }

    /// Runs one request of a renewal, which may be sent more than once (a
    /// keep-alive, a read), for a lease that stays valid for `time_left`
    /// from `started`. A try that has no answer within a share of the time
    /// left (see [`renewal_try_limit`]) is joined by another one at once,
    /// through the client's balancer, which picks a member anew; the first
    /// answer of any try is the answer. So an answer that never comes (a
    /// request stuck on a leader member whose host died, or on a member
    /// waiting for it) never uses up the time in which another try can
    /// still keep the lease, and a try that is only waiting for the new
    /// leader is not given up. A try that failed in transport (its
    /// connection broke or timed out its keep-alive, as one to a frozen
    /// member does, failing every request on it at once) is sent again
    /// soon after while the lease has time left; another failure ends the
    /// renewal only if no other try is still out. Without a `time_left`,
    /// one try, as [`EtcdBackend::bounded`].
    pub(super) async fn renewing<T, F, Fut>(
        &self,
        operation: Operation,
        key: &str,
        time_left: Option<Duration>,
        started: Instant,
        mut request: F,
    ) -> Result<T, LockError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, EtcdError>>,
    {
        let Some(time_left) = time_left else {
            return self.bounded(operation, key, request).await;
        };
        let deadline = crate::backend::kit::after(started, time_left);
        let mut tries = FuturesUnordered::new();
        let mut next_try = Instant::now();
        let mut failed = None;
        loop {
            let now = Instant::now();
            if now >= next_try && now < deadline {
                if !tries.is_empty() {
                    tracing::debug!(
                        key,
                        tries = tries.len(),
                        "no answer to a renewal's request yet; sending it once more"
                    );
                }
                tries.push(request());
                next_try = now + renewal_try_limit(deadline - now, self.inner.response_timeout);
            }
            tokio::select! {
                Some(answer) = tries.next() => match answer {
                    // Not sent (its member is down): another try soon.
                    Err(err) if never_sent(&err) => {
                        next_try = next_try.min(Instant::now() + UNSENT_PAUSE);
                    }
                    // Its connection broke: again, through the balancer,
                    // while the lease has time left.
                    Err(err) if transport_failed(&err) => {
                        next_try = next_try.min(Instant::now() + FAILED_TRY_PAUSE);
                        failed = Some(err);
                    }
                    // One try failed (its member went away, or lost its
                    // leader) while others may still be answered.
                    Err(err) if !tries.is_empty() => failed = Some(err),
                    answer => {
                        return answer.map_err(|err| self.error(operation, key, &err.to_string()));
                    }
                },
                () = sleep_until(next_try.min(deadline)) => {
                    if Instant::now() >= deadline {
                        return Err(match failed {
                            Some(err) => self.error(operation, key, &err.to_string()),
                            None => self.no_answer(operation, key, time_left),
                        });
                    }
                }
            }
        }
    }

    fn no_answer(&self, operation: Operation, key: &str, limit: Duration) -> LockError {
        self.error(
            operation,
            key,
            &format!(
                "no answer from {} within {limit:?}",
                self.inner.shown.join(", ")
            ),
        )
    }

    /// A read-only transaction of a renewal (see [`EtcdBackend::renewing`]).
    pub(super) async fn renewal_read(
        &self,
        key: &str,
        time_left: Option<Duration>,
        started: Instant,
        txn: Txn,
    ) -> Result<TxnResponse, LockError> {
        self.renewing(Operation::Extend, key, time_left, started, || {
            let mut kv = self.inner.client.kv_client();
            let txn = txn.clone();
            async move { kv.txn(txn).await }
        })
        .await
    }

    pub(super) async fn txn(
        &self,
        operation: Operation,
        key: &str,
        txn: Txn,
    ) -> Result<TxnResponse, LockError> {
        self.bounded(operation, key, || {
            let mut kv = self.inner.client.kv_client();
            let txn = txn.clone();
            async move { kv.txn(txn).await }
        })
        .await
    }
}

/// Runs `request` for up to `limit`, sending it again when it could not
/// be sent at all (see [`never_sent`]); `None` if no answer came in time.
async fn within<T, F, Fut>(limit: Duration, mut request: F) -> Option<Result<T, EtcdError>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, EtcdError>>,
{
    let tries = async {
        loop {
            match request().await {
                Err(err) if never_sent(&err) => sleep(UNSENT_PAUSE).await,
                answer => return answer,
            }
        }
    };
    timeout(limit, tries).await.ok()
}

/// How long one try of a renewal's request waits alone for its answer
/// before another joins it, with `left` until its lease's validity ends:
/// a quarter of that (so several more tries fit after one that got no
/// answer), at least [`MIN_RENEWAL_TRY`], at most the response timeout,
/// and never past the end.
fn renewal_try_limit(left: Duration, response_timeout: Duration) -> Duration {
    (left / RENEWAL_TRIES)
        .max(MIN_RENEWAL_TRY)
        .min(response_timeout)
        .min(left)
}

/// Whether a request failed before it left: the connection to the member
/// the client picked could not be opened (the member is down), so nothing
/// reached etcd and the request can go again, to another member.
pub(super) fn never_sent(err: &EtcdError) -> bool {
    match err {
        EtcdError::GRpcStatus(status) => {
            i32::from(status.code()) == GRPC_UNAVAILABLE
                && (status.message().contains("connect error")
                    || status.message().contains("Connection refused"))
        }
        _ => false,
    }
}

/// Whether a request failed in transport, not by etcd's refusal: its
/// connection broke or timed out its HTTP/2 keep-alive (a member whose
/// host died), or the request was cancelled with it. Keep-alives and
/// reads are safe to send again.
fn transport_failed(err: &EtcdError) -> bool {
    match err {
        EtcdError::GRpcStatus(status) => {
            let code = i32::from(status.code());
            code == GRPC_UNAVAILABLE || code == GRPC_CANCELLED
        }
        EtcdError::TransportError(_) => true,
        _ => false,
    }
}

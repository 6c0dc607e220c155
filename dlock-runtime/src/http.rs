//! [`LockError`] as an HTTP response, for locked axum handlers (feature `axum`).
//!
//! A handler annotated with `#[distributed_lock]` may return
//! `Result<T, LockError>`: axum turns the error into a response through
//! [`IntoResponse`], with the status a client can act on and, when waiting
//! helps, a `Retry-After` header. A 4xx body is the error's message as
//! plain text (the key, built from the request's own values); a 5xx body is
//! a fixed sentence, and the whole error goes to the log (`tracing`, at
//! `warn`): a backend's message names users, hosts and databases, which
//! are no business of an anonymous client.
//!
//! | error | status | `Retry-After` |
//! | --- | --- | --- |
//! | [`Held`](LockError::Held) | 409 Conflict | [`RETRY_AFTER`] |
//! | [`StaleToken`](LockError::StaleToken) | 409 Conflict | — |
//! | [`Timeout`](LockError::Timeout) | 503 Service Unavailable | [`RETRY_AFTER`] |
//! | [`LeaseLost`](LockError::LeaseLost), [`Backend`](LockError::Backend) | 503 Service Unavailable | — |
//! | [`InvalidKey`](LockError::InvalidKey) | 400 Bad Request | — |
//! | [`UnknownBackend`](LockError::UnknownBackend), [`InvalidOption`](LockError::InvalidOption), [`NoRuntime`](LockError::NoRuntime) | 500 Internal Server Error | — |
//!
//! Why, in the terms of RFC 9110:
//!
//! - **Held is 409 Conflict** (§15.5.10): "the request could not be completed
//!   due to a conflict with the current state of the target resource", sent
//!   "where the user might be able to resolve the conflict and resubmit" —
//!   another request is working on the same resource, and resubmitting later
//!   succeeds. 423 Locked is not used: it belongs to WebDAV (RFC 4918 §11.3),
//!   where it means a WebDAV lock the client can discover and hold itself
//!   with `LOCK`; a generic client knows 409 and nothing of 423. The lock is
//!   the server's own business, not a resource the client can lock.
//! - **A stale fencing token is 409 Conflict** too: a newer writer has
//!   already changed the resource; this write conflicts with its current
//!   state. Retrying the same request will not help, so no `Retry-After`.
//! - **A wait that timed out is 503 Service Unavailable** (§15.6.4): the
//!   server "is currently unable to handle the request due to a temporary
//!   overload", here contention it waited out and could not get through;
//!   `Retry-After` (§10.2.3) says when to try again. It is not 504 Gateway
//!   Timeout, which is about an upstream server of a gateway.
//! - **A lease lost mid-request and a backend that failed are 503** as well:
//!   temporary conditions of the server's dependencies that the client did
//!   not cause. No `Retry-After`, since nothing says when the backend is back.
//! - **An invalid key is 400 Bad Request** (§15.5.1): the key template is
//!   checked at compile time, so a key is refused at run time only for its
//!   values (too long, say, once escaped), and in a handler those come from
//!   the request. Bound them in the extractor to answer sooner.
//! - **An unknown backend, an invalid option, a lock outside a Tokio
//!   runtime are 500 Internal Server Error** (§15.6.1): the server's code or
//!   configuration is wrong, whatever the client sends; a 4xx would blame the
//!   client, and a 503 would promise that retrying helps.
//! - **A lease lost mid-request** may come after the handler's body did part
//!   of its work: clients and proxies that retry a 503 on their own should
//!   only do so for idempotent requests, as RFC 9110 §9.2.2 has it.
//!
//! `Retry-After` is whole seconds, rounded up. `LockError::Held` and
//! `LockError::Timeout` do not carry the holder's remaining ttl, so both
//! send [`RETRY_AFTER`], one second: a locked handler usually holds its key
//! for the length of one request, and an early retry costs one more 409
//! while a late one costs the client time. An application that knows its
//! holds are longer can write its own header from [`LockError::status`] and
//! its own delay.

use std::time::Duration;

use axum_core::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};

use crate::error::LockError;

/// The `Retry-After` sent with a held key or a wait that timed out: the
/// errors do not carry the holder's remaining ttl (see the module docs).
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

impl LockError {
    /// The HTTP status this error is answered with (see [`crate::http`]).
    pub fn status(&self) -> StatusCode {
        // Exhaustive on purpose: a new variant must choose its status here.
        match self {
            LockError::Held { .. } | LockError::StaleToken { .. } => StatusCode::CONFLICT,
            LockError::Timeout { .. } | LockError::LeaseLost { .. } | LockError::Backend { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            LockError::InvalidKey { .. } => StatusCode::BAD_REQUEST,
            LockError::UnknownBackend { .. }
            | LockError::InvalidOption { .. }
            | LockError::NoRuntime { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// How long a client should wait before it asks again, when waiting is
    /// what helps: a held key or a wait that timed out.
    pub fn retry_after(&self) -> Option<Duration> {
        self.is_contention().then_some(RETRY_AFTER)
    }
}

/// `Retry-After` as delay-seconds (RFC 9110 §10.2.3): whole seconds, rounded
/// up so a client never comes back before the delay, and at least one.
fn delay_seconds(delay: Duration) -> HeaderValue {
    let seconds = delay.as_secs() + u64::from(delay.subsec_nanos() > 0);
    HeaderValue::from(seconds.max(1))
}

impl IntoResponse for LockError {
    fn into_response(self) -> Response {
        let status = self.status();
        let retry_after = self.retry_after();
        let body = if status.is_server_error() {
            tracing::warn!(error = %self, status = status.as_u16(), "a locked request failed");
            match self {
                LockError::Timeout { .. } => "timed out waiting for a lock; try again\n",
                LockError::LeaseLost { .. } => "the lock was lost while the request ran\n",
                LockError::Backend { .. } => "the lock service is unavailable\n",
                _ => "internal server error\n",
            }
            .to_owned()
        } else {
            format!("{self}\n")
        };
        let mut response = (status, body).into_response();
        if let Some(delay) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, delay_seconds(delay));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(delay_seconds(Duration::from_secs(2)), "2");
        assert_eq!(delay_seconds(Duration::from_millis(2001)), "3");
        assert_eq!(delay_seconds(Duration::from_millis(1)), "1");
        assert_eq!(delay_seconds(Duration::ZERO), "1");
    }
}

//! [`LockError`] as an HTTP response, for locked axum handlers (feature `axum`).
//!
//! A handler annotated with `#[distributed_lock]` may return
//! `Result<T, LockError>`: axum turns the error into a response through
//! [`IntoResponse`], with the status a client can act on and, when waiting
//! helps, a `Retry-After` header.
//!
//! **What the body says**, one rule for every variant: a fixed plain-text
//! sentence chosen by the variant, in which a 4xx names the lock key that
//! the request's own values made (`Held`, `InvalidKey`, control characters
//! escaped) and a 5xx names nothing. Nothing else an error carries is ever
//! in a body: not a held key's holder (its host, pid and label describe
//! the fleet, which is no business of an anonymous client), not a stale
//! write's resource or tokens (the resource's name and another writer's
//! token are the server's internals), not a backend's message (it names
//! users, hosts and databases), not an option's or a key's reason. The
//! whole error goes to the log (`tracing`): a 4xx at `debug`, a 5xx at
//! `warn`.
//!
//! | error | status | `Retry-After` | body names |
//! | --- | --- | --- | --- |
//! | [`Held`](LockError::Held) | 409 Conflict | the holder's remaining ttl, else [`RETRY_AFTER`] | the key |
//! | [`StaleToken`](LockError::StaleToken) | 409 Conflict | — | nothing |
//! | [`Timeout`](LockError::Timeout) | 503 Service Unavailable | [`RETRY_AFTER`] | nothing |
//! | [`LeaseLost`](LockError::LeaseLost), [`Backend`](LockError::Backend) | 503 Service Unavailable | — | nothing |
//! | [`InvalidKey`](LockError::InvalidKey) | 400 Bad Request | — | the key |
//! | [`UnknownBackend`](LockError::UnknownBackend), [`InvalidOption`](LockError::InvalidOption), [`NoRuntime`](LockError::NoRuntime) | 500 Internal Server Error | — | nothing |
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
//! `Retry-After` is whole seconds, rounded up. For a held key it is the
//! holder's remaining ttl as the store read it just after the refusal
//! ([`Holding::expires_in`](crate::Holding::expires_in)): the time by which
//! the key is free even if the holder never lets go, unless it renews. A
//! holder usually releases sooner (a handler holds its key for one
//! request), so a client that can afford it may come back earlier; the
//! header promises only that waiting that long is not wasted on a lease
//! that cannot have ended. When the store could not tell (no holder
//! record, a timed-out wait), it is [`RETRY_AFTER`], one second. An
//! application that knows better can write its own header from
//! [`LockError::status`] and its own delay.

use std::time::Duration;

use axum_core::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};

use crate::error::LockError;

/// The `Retry-After` sent with a wait that timed out, and with a held key
/// whose holder's remaining ttl the store did not tell (see the module
/// docs).
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
    /// what helps: a held key (its holder's remaining ttl when known) or a
    /// wait that timed out.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            LockError::Held { holder, .. } => Some(
                holder
                    .as_ref()
                    .and_then(|holding| holding.expires_in)
                    .unwrap_or(RETRY_AFTER),
            ),
            LockError::Timeout { .. } => Some(RETRY_AFTER),
            _ => None,
        }
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
        if status.is_server_error() {
            tracing::warn!(error = %self, status = status.as_u16(), "a locked request failed");
        } else {
            tracing::debug!(error = %self, status = status.as_u16(), "a locked request was refused");
        }
        let mut response = (status, body(&self)).into_response();
        if let Some(delay) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, delay_seconds(delay));
        }
        response
    }
}

/// The response body for `error`, by one rule (see the module docs): a
/// fixed sentence chosen by the variant, in which a 4xx names the lock key
/// its request's values made and nothing else; a 5xx names nothing.
fn body(error: &LockError) -> String {
    // Exhaustive on purpose: a new variant must choose its sentence here,
    // and may show nothing of what it carries but a 4xx's key.
    match error {
        LockError::Held { key, .. } => {
            format!(
                "lock `{}` is held by another request; try again later\n",
                shown_key(key)
            )
        }
        LockError::InvalidKey { key, .. } => format!(
            "lock key `{}` cannot be used (empty, too long or with a NUL); change the request\n",
            shown_key(key)
        ),
        LockError::StaleToken { .. } => {
            "this write was refused: a newer writer has already changed what it writes to\n"
                .to_owned()
        }
        LockError::Timeout { .. } => "timed out waiting for a lock; try again\n".to_owned(),
        LockError::LeaseLost { .. } => "the lock was lost while the request ran\n".to_owned(),
        LockError::Backend { .. } => "the lock service is unavailable\n".to_owned(),
        LockError::UnknownBackend { .. }
        | LockError::InvalidOption { .. }
        | LockError::NoRuntime { .. } => "internal server error\n".to_owned(),
    }
}

/// A key as a body shows it: its control characters escaped, so a key
/// made from request values cannot add lines to the body.
fn shown_key(key: &str) -> String {
    key.escape_debug().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::FencingToken;

    #[test]
    fn a_held_key_retries_after_the_holders_remaining_ttl() {
        let holder = crate::HolderInfo::this_process(Some("billing"));
        let holding = crate::Holding::new(None, None)
            .expiring_in(Duration::from_millis(17_600))
            .held_by(Some(holder.clone()));
        let held = LockError::Held {
            key: "pay:7".into(),
            holder: Some(Box::new(holding)),
        };
        assert_eq!(held.retry_after(), Some(Duration::from_millis(17_600)));
        let response = held.into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[header::RETRY_AFTER], "18");
        let unknown = LockError::Held {
            key: "pay:7".into(),
            holder: None,
        };
        assert_eq!(unknown.retry_after(), Some(RETRY_AFTER));
    }

    /// Every variant, its key (if it has one) `key` and everything else it
    /// carries made from `detail` and `token`.
    fn every_variant(key: &str, detail: &str, token: u64) -> Vec<LockError> {
        use crate::error::{LostReason, Operation};
        let holder =
            crate::HolderInfo::decode(&format!("1\t{detail}-host\t{}\t{detail}", token % 100_000))
                .expect("a holder record");
        let errors = vec![
            LockError::Held {
                key: key.into(),
                holder: Some(Box::new(
                    crate::Holding::new(Some(FencingToken::new(token)), Some(detail.into()))
                        .expiring_in(Duration::from_secs(17))
                        .held_by(Some(holder)),
                )),
            },
            LockError::Timeout {
                key: key.into(),
                waited: Duration::from_millis(token),
            },
            LockError::LeaseLost {
                key: key.into(),
                token: FencingToken::new(token),
                reason: LostReason::Expired,
            },
            LockError::UnknownBackend {
                name: detail.into(),
                registered: detail.into(),
            },
            LockError::backend("pg", Operation::Acquire, key, detail.to_owned()),
            LockError::invalid_key(key, detail),
            LockError::InvalidOption {
                option: "ttl",
                reason: detail.into(),
            },
            LockError::NoRuntime { key: key.into() },
            LockError::StaleToken {
                resource: detail.into(),
                offered: FencingToken::new(token),
                highest: FencingToken::new(token + 1),
            },
        ];
        // Fails to compile when a variant is added: list it above too.
        let mut seen = [false; 9];
        for error in &errors {
            seen[match error {
                LockError::Held { .. } => 0,
                LockError::Timeout { .. } => 1,
                LockError::LeaseLost { .. } => 2,
                LockError::UnknownBackend { .. } => 3,
                LockError::Backend { .. } => 4,
                LockError::InvalidKey { .. } => 5,
                LockError::InvalidOption { .. } => 6,
                LockError::NoRuntime { .. } => 7,
                LockError::StaleToken { .. } => 8,
            }] = true;
        }
        assert!(seen.iter().all(|seen| *seen), "every variant is listed");
        errors
    }

    #[test]
    fn a_body_is_its_variants_fixed_sentence_naming_at_most_a_client_errors_key() {
        let key = "order:7";
        let first = every_variant(key, "pg:billing.invoices#row-42", 1_796_390_175_400_577);
        let second = every_variant(key, "web-3.internal", 4121);
        for (one, other) in first.iter().zip(&second) {
            let shown = body(one);
            // Nothing but the variant and the key decides the body.
            assert_eq!(shown, body(other), "{one}");
            for detail in [
                "pg:billing",
                "invoices",
                "row-42",
                "1796390175400577",
                "web-3",
            ] {
                assert!(!shown.contains(detail), "{one}: {detail:?} in {shown:?}");
            }
            let keyed = matches!(one, LockError::Held { .. } | LockError::InvalidKey { .. });
            // Only a client error names a key: a stale write has none.
            assert!(!keyed || one.status().is_client_error(), "{one}");
            assert_eq!(shown.contains(key), keyed, "{one}: {shown:?}");
            assert!(
                shown.ends_with('\n') && shown.lines().count() == 1,
                "{shown:?}"
            );
        }
        let odd = body(&LockError::invalid_key("a\nb", "has a line break"));
        assert_eq!(odd.lines().count(), 1, "{odd:?}");
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(delay_seconds(Duration::from_secs(2)), "2");
        assert_eq!(delay_seconds(Duration::from_millis(2001)), "3");
        assert_eq!(delay_seconds(Duration::from_millis(1)), "1");
        assert_eq!(delay_seconds(Duration::ZERO), "1");
    }
}

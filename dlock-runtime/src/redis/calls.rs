//! Sending one call to the server: how long it may take (a retry on a new
//! connection included), and its failures in words for an error, with
//! every password scrubbed. Its own file: every operation, acquisition
//! and listing goes through these few steps.

use std::time::Duration;

use ::redis::{ErrorKind, FromRedisValue, ScriptInvocation, ServerErrorKind};

use super::commands::Failure;
use super::redact::scrub;
use super::{KIND, RedisBackend};
use crate::error::{BoxError, LockError, Operation};
use crate::key::LockKey;

impl RedisBackend {
    /// The longest one call may take: a first try, and a second one on a
    /// connection that may have to be opened first.
    /// Behind sentinels, a look-up of the primary (bounded by the connect
    /// timeout) may come first.
    pub(super) fn call_limit(&self) -> Duration {
        let connect = if self.inner.commands.is_sentinel() {
            self.inner.connect_timeout.saturating_mul(2)
        } else {
            self.inner.connect_timeout
        };
        connect.saturating_add(self.inner.response_timeout)
    }

    /// Runs a script, trying once more on a broken or silent connection (on
    /// a connection opened anew by then), all within [`Self::call_limit`].
    pub(super) async fn run<T: FromRedisValue>(
        &self,
        operation: Operation,
        key: &LockKey,
        script: &ScriptInvocation<'_>,
    ) -> Result<T, LockError> {
        self.run_noting_retry(operation, key, script)
            .await
            .map(|(value, _)| value)
    }

    /// [`RedisBackend::run`], also telling whether the answer is a retry's:
    /// the first request may then have run on the server, its reply lost.
    pub(super) async fn run_noting_retry<T: FromRedisValue>(
        &self,
        operation: Operation,
        key: &LockKey,
        script: &ScriptInvocation<'_>,
    ) -> Result<(T, bool), LockError> {
        self.inner
            .commands
            .send(self.call_limit(), |mut conn| async move {
                script.invoke_async(&mut conn).await
            })
            .await
            .map_err(|failure| self.error(operation, key, self.describe(&failure)))
    }

    /// What went wrong, in words for an error.
    pub(super) fn describe(&self, failure: &Failure) -> String {
        let servers = self.inner.shown.join(", ");
        match failure {
            Failure::NoReply => format!("no reply from {servers} within {:?}", self.call_limit()),
            Failure::Redis(err) if err.is_timeout() => format!(
                "no answer from {servers} in time (connect timeout {:?}, response timeout {:?}); \
                 a new connection is opened",
                self.inner.connect_timeout, self.inner.response_timeout
            ),
            // The server's own words: redis-rs would put its name for the
            // error code in front.
            Failure::Redis(err)
                if err.kind() == ErrorKind::Server(ServerErrorKind::ResponseError) =>
            {
                err.detail().map_or_else(|| err.to_string(), str::to_owned)
            }
            Failure::Redis(err) => err.to_string(),
        }
    }

    pub(super) fn error(&self, operation: Operation, key: &LockKey, text: String) -> LockError {
        self.error_at(operation, key.as_str(), text)
    }

    pub(super) fn error_at(&self, operation: Operation, key: &str, text: String) -> LockError {
        let source: BoxError = scrub(&text, &self.inner.secrets).into();
        LockError::backend(KIND, operation, key, source)
    }
}

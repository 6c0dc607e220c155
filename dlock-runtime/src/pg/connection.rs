//! Connections the backend opens: connect with a timeout (TLS or not),
//! a driver task that reports how the connection ended, and the failure
//! every talk with PostgreSQL reports, never with the password.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::task::{Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::oneshot;
use tokio::time::timeout;
use tokio_postgres::config::Host;
use tokio_postgres::{AsyncMessage, CancelToken, Client, Config, Connection, Notification};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::home::{Home, NoRuntime};
use super::sql;
use crate::error::{LockError, Operation};
use crate::key::LockKey;

/// A failure talking to PostgreSQL, with what was being done. Its text never
/// holds the password: connection errors name `user@host:port/db` only.
#[derive(Debug)]
pub(super) struct Failure {
    what: String,
    source: Option<tokio_postgres::Error>,
}

impl Failure {
    pub(super) fn new(what: impl Into<String>, source: tokio_postgres::Error) -> Self {
        Self {
            what: what.into(),
            source: Some(source),
        }
    }

    pub(super) fn msg(what: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            source: None,
        }
    }

    /// The same failure, with what led to it said first.
    pub(super) fn context(self, before: impl std::fmt::Display) -> Self {
        Self {
            what: format!("{before}: {}", self.what),
            source: self.source,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(source) => match source.as_db_error() {
                // The server's own words read better than "db error: ERROR: …".
                Some(db) => write!(f, "{}: {}", self.what, db),
                None => {
                    // tokio-postgres keeps the telling part ("invalid peer
                    // certificate: UnknownIssuer") in its source chain.
                    write!(f, "{}: {source}", self.what)?;
                    let mut cause = std::error::Error::source(source);
                    while let Some(inner) = cause {
                        write!(f, ": {inner}")?;
                        cause = inner.source();
                    }
                    Ok(())
                }
            },
            None => f.write_str(&self.what),
        }
    }
}

impl std::error::Error for Failure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// What it takes to open one more connection.
#[derive(Clone)]
pub(super) struct Connector {
    config: Config,
    tls: MakeRustlsConnect,
    timeout: Duration,
    target: String,
    /// Where connections are opened and driven.
    home: Arc<Home>,
}

impl Connector {
    pub(super) fn new(
        config: Config,
        tls: MakeRustlsConnect,
        timeout: Duration,
        home: Arc<Home>,
    ) -> Self {
        let target = describe(&config);
        Self {
            config,
            tls,
            timeout,
            target,
            home,
        }
    }

    /// Where the backend's work runs.
    pub(super) fn home(&self) -> &Arc<Home> {
        &self.home
    }

    /// `user@host:port/dbname`, for messages: never the password.
    pub(super) fn target(&self) -> &str {
        &self.target
    }

    /// The connect timeout.
    pub(super) fn connect_timeout(&self) -> Duration {
        self.timeout
    }

    /// The same connector, whose connections have the kernel probe the
    /// server every `every` once they are quiet (TCP keepalives: idle
    /// `every`, then every `every`, given up after two probes without an
    /// answer), unless the connection string set keepalives of its own.
    /// For fair sessions, which send nothing while they wait in a key's
    /// queue, so no liveness check can run on them then: a server gone
    /// half-open ends the wait within about three times `every`, not the
    /// kernel's two hours.
    pub(super) fn keeping_alive(&self, every: Duration) -> Self {
        let mut connector = self.clone();
        let config = &mut connector.config;
        let untouched = config.get_keepalives()
            && config.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60)
            && config.get_keepalives_interval().is_none()
            && config.get_keepalives_retries().is_none();
        if untouched {
            let every = every.max(Duration::from_secs(1));
            config
                .keepalives_idle(every)
                .keepalives_interval(every)
                .keepalives_retries(2);
        }
        connector
    }

    /// Asks the server to cancel the statement running on the session of
    /// `token` (a connection of its own, which the server closes at once),
    /// within the connect timeout. The server says nothing of the outcome.
    pub(super) async fn cancel(&self, token: CancelToken) -> Result<(), Failure> {
        let what = format!("cannot send a cancel request to {}", self.target);
        self.within_connect_timeout(what, token.cancel_query(self.tls.clone()))
            .await
    }

    /// Awaits `step` for at most the connect timeout: its error, or its
    /// lack of an answer, is a failure of `what`.
    pub(super) async fn within_connect_timeout<T>(
        &self,
        what: String,
        step: impl Future<Output = Result<T, tokio_postgres::Error>>,
    ) -> Result<T, Failure> {
        match timeout(self.timeout, step).await {
            Ok(Ok(done)) => Ok(done),
            Ok(Err(err)) => Err(Failure::new(what, err)),
            Err(_) => Err(Failure::msg(format!(
                "{what}: no answer within the connect timeout of {:?}",
                self.timeout
            ))),
        }
    }

    /// Opens a connection and drives it in a task of its own. `on_end` gets
    /// why it ended; a message on `kill` (or dropping its sender) closes it.
    /// The whole connect, handshake and authentication included, is bounded
    /// by the connect timeout (tokio-postgres bounds only the TCP connect).
    /// The session's settings are dlock's (see `sql::SESSION_DEFAULTS`)
    /// before anything else is sent, with `lock_timeout` for its
    /// `lock_timeout`. Opened at home, whatever runtime asks: the
    /// connection's socket and its driver belong to the runtime that opens
    /// it.
    pub(super) async fn open(
        &self,
        lock_timeout: Duration,
        kill: oneshot::Receiver<String>,
        on_end: impl FnOnce(String) + Send + 'static,
    ) -> Result<Client, Failure> {
        self.open_with(lock_timeout, kill, on_end, None).await
    }

    /// [`open`](Self::open), for a connection that `LISTEN`s: its driver
    /// hands every notification the server sends to `on_notification`
    /// (called in the driver's task, so it must not block).
    pub(super) async fn open_listening(
        &self,
        lock_timeout: Duration,
        kill: oneshot::Receiver<String>,
        on_end: impl FnOnce(String) + Send + 'static,
        on_notification: OnNotification,
    ) -> Result<Client, Failure> {
        self.open_with(lock_timeout, kill, on_end, Some(on_notification))
            .await
    }

    async fn open_with(
        &self,
        lock_timeout: Duration,
        kill: oneshot::Receiver<String>,
        on_end: impl FnOnce(String) + Send + 'static,
        on_notification: Option<OnNotification>,
    ) -> Result<Client, Failure> {
        let connector = self.clone();
        self.home
            .run(async move {
                connector
                    .open_here(lock_timeout, kill, on_end, on_notification)
                    .await
            })
            .await
            .unwrap_or_else(|NoRuntime| {
                Err(Failure::msg(format!(
                    "cannot connect to {}: the runtime the backend runs on shut down, and no \
                     other runtime is there to take over",
                    self.target
                )))
            })
    }

    async fn open_here(
        &self,
        lock_timeout: Duration,
        kill: oneshot::Receiver<String>,
        on_end: impl FnOnce(String) + Send + 'static,
        on_notification: Option<OnNotification>,
    ) -> Result<Client, Failure> {
        let connecting = self.config.connect(self.tls.clone());
        let what = format!("cannot connect to {}", self.target);
        let (client, connection) = self.within_connect_timeout(what, connecting).await?;
        match on_notification {
            None => tokio::spawn(drive(connection, kill, on_end)),
            Some(forward) => tokio::spawn(drive(forwarding(connection, forward), kill, on_end)),
        };
        // First of all, before any statement that names a function.
        let lock_timeout_ms = lock_timeout.as_millis().max(1).to_string();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&lock_timeout_ms];
        let defaults = client.query_one(sql::SESSION_DEFAULTS, &params);
        let what = format!("cannot set up a session on {}", self.target);
        self.within_connect_timeout(what, defaults).await?;
        Ok(client)
    }
}

/// Runs a connection until the server or the network ends it, or until it
/// is told to stop; dropping the connection closes the socket, and the
/// server then drops every lock the session held. `on_end` is told why —
/// also when the runtime drops this task unfinished as it shuts down.
async fn drive<C, E>(connection: C, kill: oneshot::Receiver<String>, on_end: E)
where
    C: Future<Output = Result<(), tokio_postgres::Error>>,
    E: FnOnce(String),
{
    let mut on_end = OnEnd(Some(on_end));
    let reason = tokio::select! {
        ended = connection => match ended {
            Ok(()) => "the server closed the connection".to_owned(),
            Err(err) => match err.as_db_error() {
                Some(db) => db.to_string(),
                None => err.to_string(),
            },
        },
        why = kill => why.unwrap_or_else(|_| "the backend closed the session".to_owned()),
    };
    on_end.call(reason);
}

/// Where a listening connection's driver hands the notifications it gets.
pub(super) type OnNotification = Box<dyn FnMut(Notification) + Send + 'static>;

/// Drives `connection` as its own `Future` does, and hands each
/// notification to `forward` (that `Future` drops them).
async fn forwarding<S, T>(
    mut connection: Connection<S, T>,
    mut forward: OnNotification,
) -> Result<(), tokio_postgres::Error>
where
    S: AsyncRead + AsyncWrite + Unpin,
    T: AsyncRead + AsyncWrite + Unpin,
{
    std::future::poll_fn(move |cx| {
        loop {
            match ready!(connection.poll_message(cx)) {
                Some(Ok(AsyncMessage::Notification(notification))) => forward(notification),
                Some(Ok(AsyncMessage::Notice(notice))) => tracing::info!(
                    severity = notice.severity(),
                    "PostgreSQL notice on a listening connection: {}",
                    notice.message()
                ),
                Some(Ok(_)) => {}
                Some(Err(err)) => return Poll::Ready(Err(err)),
                None => return Poll::Ready(Ok(())),
            }
        }
    })
    .await
}

/// Calls its function once: with the given reason, or when dropped.
struct OnEnd<E: FnOnce(String)>(Option<E>);

impl<E: FnOnce(String)> OnEnd<E> {
    fn call(&mut self, why: String) {
        if let Some(on_end) = self.0.take() {
            on_end(why);
        }
    }
}

impl<E: FnOnce(String)> Drop for OnEnd<E> {
    fn drop(&mut self) {
        self.call("the runtime driving the connection shut down".to_owned());
    }
}

fn describe(config: &Config) -> String {
    let user = config.get_user().unwrap_or("(default user)");
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(host)) => host.clone(),
        Some(Host::Unix(path)) => path.display().to_string(),
        None => match config.get_hostaddrs().first() {
            Some(addr) => addr.to_string(),
            None => "localhost".to_owned(),
        },
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let db = config.get_dbname().unwrap_or(user);
    format!("{user}@{host}:{port}/{db}")
}

/// The error when no runtime is left to run the backend's work on.
pub(super) fn no_runtime(operation: Operation, key: &LockKey) -> LockError {
    LockError::backend(
        super::KIND,
        operation,
        key.as_str(),
        Failure::msg(
            "the runtime the PostgreSQL backend runs on shut down, and no other runtime is \
             there to take over",
        ),
    )
}

//! [`RedisBuilder`]: the connection settings of a [`RedisBackend`] and
//! connecting with them (URLs, TLS roots, timeouts, cluster detection).

use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::{ClusterClient, ClusterConfig};
use ::redis::{Client, ErrorKind, RedisConnectionInfo, RedisError, RedisResult, ServerErrorKind};
use tokio::time::{sleep, timeout};

use super::commands::Commands;
use super::redact::{redact_url, scrub, secrets_of};
use super::sentinel::Sentinels;
use super::subscriber::Subscriber;
use super::{DEFAULT_CONNECT_TIMEOUT, DEFAULT_RESPONSE_TIMEOUT, Inner, KIND, RedisBackend};
use crate::backend::kit::percent::decode_lossy;
use crate::backend::kit::userinfo::{self, URL_STANDARD};
use crate::error::{LockError, Operation};

mod sentinel_url;
mod tls;

use sentinel_url::SentinelUrl;
use tls::{check_tls, tls_certificates};

/// The first pause before connecting again when a server refused or
/// dropped the first connection (it may be starting); doubled each time, up
/// to [`MAX_CONNECT_PAUSE`], until the connect timeout ends the tries.
const FIRST_CONNECT_PAUSE: Duration = Duration::from_millis(50);
const MAX_CONNECT_PAUSE: Duration = Duration::from_secs(1);

/// Whether the topology is detected or given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Topology {
    Detect,
    Standalone,
    Cluster,
}

/// Connection settings for a [`RedisBackend`]; from
/// [`RedisBackend::builder`].
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_runtime::LockError> {
/// use std::time::Duration;
/// use dlock_runtime::redis::RedisBackend;
///
/// let url = std::env::var("DLOCK_REDIS_URL").unwrap_or("redis://127.0.0.1:6379".into());
/// let backend = RedisBackend::builder(&url)
///     .connect_timeout(Duration::from_secs(2))
///     .response_timeout(Duration::from_secs(1))
///     .connect()
///     .await?;
/// assert!(!format!("{backend:?}").contains("password"));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisBuilder {
    urls: Vec<String>,
    topology: Topology,
    connect_timeout: Duration,
    response_timeout: Duration,
    /// PEM root certificate(s) to trust for `rediss://` instead of the
    /// system's.
    tls_root: Option<Vec<u8>>,
    publish_every_release: bool,
    /// Begin fair queues as lists.
    list_queues: bool,
    /// The label acquisitions record, over the process's.
    label: Option<String>,
    /// Behind sentinels: the name of the primary they monitor (`urls` are
    /// then the sentinels').
    sentinel_service: Option<String>,
    /// The data nodes' user and password, behind sentinels.
    node_auth: Option<(Option<String>, String)>,
    /// How many replicas must acknowledge an acquisition, and within how
    /// long ([`RedisBuilder::replica_acks`]).
    replica_acks: Option<(u32, Duration)>,
    /// The data nodes' database, behind sentinels.
    node_db: i64,
    /// Why the URL given could not be read (a `redis+sentinel://` one),
    /// reported by `connect` without the URL, which may hold a password.
    unreadable: Option<String>,
}

impl fmt::Debug for RedisBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: Vec<String> = self.urls.iter().map(|url| redact_url(url)).collect();
        f.debug_struct("RedisBuilder")
            .field("urls", &shown)
            .field("topology", &self.topology)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("tls_root_certificate", &self.tls_root.is_some())
            .field("label", &self.label)
            .field("sentinel_service", &self.sentinel_service)
            .field("data_node_auth", &self.node_auth.is_some())
            .field("replica_acks", &self.replica_acks)
            .finish()
    }
}

impl RedisBuilder {
    /// Settings for `url` with the default timeouts; a cluster is detected.
    /// Settings for `url`; a `redis+sentinel://` URL names sentinels.
    pub(super) fn new(url: &str) -> Self {
        match SentinelUrl::read(url) {
            None => Self::plain(url),
            Some(Ok(read)) => {
                let sentinels: Vec<&str> = read.sentinels.iter().map(String::as_str).collect();
                let mut builder = Self::sentinel(&sentinels, &read.service);
                builder.node_auth = read.auth;
                builder.node_db = read.db;
                builder
            }
            Some(Err(reason)) => {
                let mut builder = Self::plain("");
                builder.unreadable = Some(reason);
                builder
            }
        }
    }

    fn plain(url: &str) -> Self {
        Self {
            urls: vec![url.to_owned()],
            topology: Topology::Detect,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            tls_root: None,
            publish_every_release: false,
            list_queues: false,
            label: None,
            sentinel_service: None,
            node_auth: None,
            replica_acks: None,
            node_db: 0,
            unreadable: None,
        }
    }

    /// Settings for the primary that the sentinels at `sentinels` monitor
    /// as `service`, with the default timeouts.
    pub(super) fn sentinel(sentinels: &[&str], service: &str) -> Self {
        let mut builder = Self::plain("");
        builder.urls = sentinels.iter().map(|url| (*url).to_owned()).collect();
        builder.topology = Topology::Standalone;
        builder.sentinel_service = Some(service.to_owned());
        builder
    }

    /// Behind sentinels ([`RedisBackend::sentinel`]): the user (`None` for
    /// the default user) and password to authenticate to the primary with.
    /// The sentinels' URLs carry the sentinels' own credentials, which may
    /// differ. The password is never shown (`Debug`, errors, logs). Ignored
    /// without sentinels, where the URL carries the credentials.
    pub fn data_node_auth(mut self, username: Option<&str>, password: &str) -> Self {
        self.node_auth = Some((username.map(str::to_owned), password.to_owned()));
        self
    }

    /// Asks for `replicas` replicas to acknowledge every acquisition within
    /// `within` (`WAIT replicas within`, on the connection that took the
    /// key, right after it). Should fewer acknowledge in time, the key is
    /// given back (owner-checked) and the attempt fails with
    /// [`LockError::Backend`] saying how many did: an acquisition is never
    /// reported taken without the acknowledgements asked for.
    ///
    /// What it promises: a lock taken was on `replicas` replicas too when
    /// the holder was told, so a failover to one of them keeps it (Redis
    /// Sentinel promotes the best-replicated replica it can reach). What it
    /// does not: `WAIT` makes Redis no strongly consistent store. Renewals
    /// and releases are not waited for, a failover to a replica that did
    /// not acknowledge still loses the lock, and the key handed to a fair
    /// waiter by another holder's release is not waited for either. The
    /// fencing token stays the safety net: it keeps rising across any
    /// failover. Cost: one more command per acquisition, and the shared
    /// connection's later commands queue behind the `WAIT` until the
    /// replicas answer (see BENCHMARKS.md for figures).
    ///
    /// `replicas` must be at least 1 and `within` greater than zero and
    /// shorter than the response timeout; not on a Redis Cluster.
    /// Otherwise [`RedisBuilder::connect`] fails with
    /// [`LockError::InvalidOption`].
    pub fn replica_acks(mut self, replicas: u32, within: Duration) -> Self {
        self.replica_acks = Some((replicas, within));
        self
    }

    /// Adds another node of the same deployment: a cluster seed, or a
    /// fallback for the pub/sub connection. Uses the same credentials form
    /// as the first URL.
    pub fn node(mut self, url: &str) -> Self {
        self.urls.push(url.to_owned());
        self
    }

    /// Treats the server as a Redis Cluster (`true`) or a single server
    /// (`false`) instead of asking it (`CLUSTER SLOTS`).
    pub fn cluster(mut self, cluster: bool) -> Self {
        self.topology = if cluster {
            Topology::Cluster
        } else {
            Topology::Standalone
        };
        self
    }

    /// How long connecting may take, handshake included (default 5 s). An
    /// unreachable server is an error after this long, never a hang.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long one command may wait for its reply (default 3 s), so a
    /// paused server cannot hold up a renewal or an acquisition forever.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Publishes every release, as dlock did before the waiter mark
    /// (default off). Turn it on for a rolling upgrade while replicas on
    /// an older dlock still run: their waiters do not mark the keys they
    /// wait for, so without it they are not woken by this backend's
    /// releases and look again only when the holder's ttl runs out (at
    /// most every 10 s). Costs the server a `PUBLISH` per release.
    pub fn publish_every_release(mut self, publish: bool) -> Self {
        self.publish_every_release = publish;
        self
    }

    /// Begins each key's queue of fair waiters as a Redis list (default
    /// off: a string, as earlier versions keep it). A handoff then pops
    /// the list's first entry and a waiter joins by a push, where the
    /// string queue is read and written whole at each, which costs the
    /// server time that grows with the queue (see *Fair mode* in the
    /// module docs, and BENCHMARKS.md). Every replica of this version
    /// serves a queue of either kind, whichever begun it; turn this on
    /// once no replica of an earlier dlock runs, and with an ACL that
    /// allows the list commands (`+lpush +rpush +lpop +rpop +lindex +lpos
    /// +lrem`): an earlier dlock reads a list as no queue, and its
    /// waiters replace it with a queue of their own. A queue this backend
    /// would begin as a list while the ACL refuses `RPOP` is begun as a
    /// string instead, and the first such refusal is logged as a warning.
    pub fn list_queues(mut self, list: bool) -> Self {
        self.list_queues = list;
        self
    }

    /// Trusts the PEM certificate(s) in `pem` for `rediss://` connections
    /// instead of the system's root certificates: for a server whose
    /// certificate comes from a private CA.
    pub fn tls_root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root = Some(pem.into());
        self
    }

    /// Records `label` as the application label of every acquisition
    /// through this backend (see [`crate::holder`]), over the process's
    /// ([`Registry::set_label`](crate::Registry::set_label)): for a backend
    /// one part of an application uses on its own. Checked when connecting:
    /// a label [`check_label`](crate::holder::check_label) refuses (empty,
    /// over [`MAX_LABEL_LEN`](crate::holder::MAX_LABEL_LEN) bytes, with a
    /// control character) makes [`RedisBuilder::connect`] fail with
    /// [`LockError::InvalidOption`], before anything is sent.
    pub fn label(mut self, label: &str) -> Self {
        self.label = Some(label.to_owned());
        self
    }

    /// Connects, detecting a cluster unless told.
    pub async fn connect(self) -> Result<RedisBackend, LockError> {
        let shown: Vec<String> = self.urls.iter().map(|url| redact_url(url)).collect();
        let secrets: Vec<String> = self.urls.iter().flat_map(|url| secrets_of(url)).collect();
        let fail = |what: String, err: Option<&RedisError>| {
            let text = match err {
                Some(err) => format!("{what}: {err}"),
                None => what,
            };
            LockError::backend(KIND, Operation::Connect, "", scrub(&text, &secrets))
        };
        self.check_settings()?;
        if let Some(service) = self.sentinel_service.clone() {
            return self.connect_sentinel(service).await;
        }
        let mut clients = Vec::with_capacity(self.urls.len());
        for (url, shown) in self.urls.iter().zip(&shown) {
            let client = match &self.tls_root {
                Some(pem) => Client::build_with_tls(url.as_str(), tls_certificates(pem)),
                None => Client::open(url.as_str()),
            };
            let client =
                client.map_err(|err| fail(format!("invalid Redis URL {shown}"), Some(&err)))?;
            clients.push(client);
        }
        let (Some(first), Some(first_shown)) = (clients.first(), shown.first()) else {
            return Err(fail("no Redis URL given".into(), None));
        };
        if check_tls(&clients, &shown)? {
            // rustls needs one process-wide crypto provider; keep any the
            // application installed already.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }

        // Why the last try to connect failed, for an error that says more
        // than "timed out" should the connect timeout end the tries.
        let cause: Mutex<Option<String>> = Mutex::new(None);
        let connecting = self.open_commands(first, first_shown, &shown, &cause, &fail);
        let commands = timeout(self.connect_timeout, connecting)
            .await
            .map_err(|_| {
                let all = shown.join(", ");
                let after = self.connect_timeout;
                let cause = cause.lock().unwrap_or_else(PoisonError::into_inner).take();
                fail(
                    match cause {
                        Some(cause) => format!("cannot connect to {all} within {after:?}: {cause}"),
                        None => format!("connecting to {all} timed out after {after:?}"),
                    },
                    None,
                )
            })??;
        let topology = if commands.is_cluster() {
            "cluster"
        } else {
            "standalone"
        };
        if self.replica_acks.is_some() && commands.is_cluster() {
            return Err(cluster_acks());
        }
        tracing::debug!(urls = ?shown, topology, "redis backend connected");
        Ok(RedisBackend {
            inner: Arc::new(Inner {
                commands,
                subscriber: Subscriber::new(clients, self.connect_timeout, self.response_timeout),
                shown,
                secrets,
                connect_timeout: self.connect_timeout,
                response_timeout: self.response_timeout,
                warned_unmarked: AtomicBool::new(false),
                warned_unstamped: AtomicBool::new(false),
                warned_unlisted: AtomicBool::new(false),
                warned_unannounced: AtomicBool::new(false),
                publish_every_release: self.publish_every_release,
                list_queues: self.list_queues,
                queued: Default::default(),
                label: self.label,
                replica_acks: self.replica_acks,
                acks_gate: tokio::sync::Mutex::new(()),
                sentinel_service: None,
            }),
        })
    }

    /// Refuses settings that cannot work, before anything is sent: a URL
    /// that could not be read or that redis-rs would misread, a zero
    /// timeout, a label [`check_label`](crate::holder::check_label)
    /// refuses, replica acknowledgements that cannot be had.
    fn check_settings(&self) -> Result<(), LockError> {
        if let Some(reason) = &self.unreadable {
            return Err(LockError::InvalidOption {
                option: "url",
                reason: reason.clone(),
            });
        }
        // redis-rs would read another URL than the one written.
        if self
            .urls
            .iter()
            .any(|url| userinfo::rewritten_by_url_standard(url))
        {
            return Err(LockError::InvalidOption {
                option: "url",
                reason: userinfo::REWRITTEN.to_owned(),
            });
        }
        // redis-rs would take part of such a URL's user info for its host,
        // port or path, and show it in its errors.
        if self
            .urls
            .iter()
            .any(|url| userinfo::misread_by(url, URL_STANDARD))
        {
            return Err(LockError::InvalidOption {
                option: "url",
                reason: userinfo::MISREAD.to_owned(),
            });
        }
        if self.connect_timeout.is_zero() || self.response_timeout.is_zero() {
            return Err(LockError::InvalidOption {
                option: "timeout",
                reason: "the connect and response timeouts must be greater than zero".into(),
            });
        }
        if let Some(label) = &self.label {
            crate::holder::check_label(label)?;
        }
        if let Some((replicas, within)) = self.replica_acks {
            if replicas == 0 || within.is_zero() || within >= self.response_timeout {
                return Err(LockError::InvalidOption {
                    option: "replica_acks",
                    reason: format!(
                        "replica_acks({replicas}, {within:?}) needs at least one replica and a \
                         wait greater than zero and shorter than the response timeout \
                         ({:?})",
                        self.response_timeout
                    ),
                });
            }
            if self.topology == Topology::Cluster {
                return Err(cluster_acks());
            }
        }
        Ok(())
    }

    /// Opens the command connection: to the `first` server, which tells
    /// whether it is part of a cluster unless the topology was given, or
    /// to the cluster. `cause` keeps why the last try failed.
    async fn open_commands(
        &self,
        first: &Client,
        first_shown: &str,
        shown: &[String],
        cause: &Mutex<Option<String>>,
        fail: &impl Fn(String, Option<&RedisError>) -> LockError,
    ) -> Result<Commands, LockError> {
        let mut topology = self.topology;
        let mut standalone = None;
        if topology != Topology::Cluster {
            // No tries again inside redis-rs: they would sleep through the
            // caller's time budget and hide why connecting failed. A call
            // that finds the connection broken opens a new one itself.
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(self.connect_timeout))
                .set_response_timeout(Some(self.response_timeout))
                .set_number_of_retries(0);
            let mut manager = open_standalone(first, &config, cause)
                .await
                .map_err(|err| fail(format!("cannot connect to {first_shown}"), Some(&err)))?;
            if topology == Topology::Detect {
                topology = detect(&mut manager)
                    .await
                    .map_err(|err| fail(format!("cannot query {first_shown}"), Some(&err)))?;
            }
            standalone = Some((first.clone(), config, manager));
        }
        let commands = match (topology, standalone) {
            (Topology::Cluster, _) => self.open_cluster(shown, fail).await?,
            (_, Some((client, config, manager))) => Commands::standalone(client, config, manager),
            (_, None) => return Err(fail("no connection was opened".into(), None)),
        };
        Ok(commands)
    }

    /// Opens the cluster connection, from every URL given as a seed.
    async fn open_cluster(
        &self,
        shown: &[String],
        fail: &impl Fn(String, Option<&RedisError>) -> LockError,
    ) -> Result<Commands, LockError> {
        let mut cluster = ClusterClient::builder(self.urls.iter().map(String::as_str))
            .connection_timeout(self.connect_timeout)
            .response_timeout(self.response_timeout)
            .retries(2);
        if let Some(pem) = &self.tls_root {
            cluster = cluster.certs(tls_certificates(pem));
        }
        let cluster = cluster
            .build()
            .map_err(|err| fail(format!("invalid cluster URLs {shown:?}"), Some(&err)))?;
        let config = ClusterConfig::new()
            .set_connection_timeout(self.connect_timeout)
            .set_response_timeout(self.response_timeout);
        let conn = cluster
            .get_async_connection_with_config(config.clone())
            .await
            .map_err(|err| {
                fail(
                    format!("cannot connect to the cluster at {shown:?}"),
                    Some(&err),
                )
            })?;
        Ok(Commands::cluster(cluster, config, conn))
    }

    /// Connects to the primary the sentinels monitor as `service`: the
    /// look-up is bounded by the connect timeout, connecting as a whole by
    /// the connect plus the response timeout.
    async fn connect_sentinel(self, service: String) -> Result<RedisBackend, LockError> {
        let shown: Vec<String> = self.urls.iter().map(|url| redact_url(url)).collect();
        let mut secrets: Vec<String> = self.urls.iter().flat_map(|url| secrets_of(url)).collect();
        if let Some((_, password)) = &self.node_auth
            && !password.is_empty()
        {
            secrets.push(password.clone());
        }
        let fail =
            |text: String| LockError::backend(KIND, Operation::Connect, "", scrub(&text, &secrets));
        if service.is_empty() {
            return Err(LockError::InvalidOption {
                option: "sentinel",
                reason: "the name of the primary the sentinels monitor is empty".into(),
            });
        }
        let mut clients = Vec::with_capacity(self.urls.len());
        for (url, shown) in self.urls.iter().zip(&shown) {
            let client = match &self.tls_root {
                Some(pem) => Client::build_with_tls(url.as_str(), tls_certificates(pem)),
                None => Client::open(url.as_str()),
            };
            let client =
                client.map_err(|err| fail(format!("invalid sentinel URL {shown}: {err}")))?;
            clients.push(client);
        }
        if clients.is_empty() {
            return Err(fail("no sentinel URL given".into()));
        }
        let tls = check_tls(&clients, &shown)?;
        if tls {
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let mut node = RedisConnectionInfo::default();
        if let Some((username, password)) = &self.node_auth {
            if let Some(username) = username {
                node = node.set_username(username);
            }
            node = node.set_password(password);
        }
        node = node.set_db(self.node_db);
        let sentinels = Arc::new(Sentinels::new(
            clients,
            shown.clone(),
            service.clone(),
            node,
            tls.then(|| self.tls_root.clone()),
            self.connect_timeout,
            self.response_timeout,
        ));
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.response_timeout))
            .set_number_of_retries(0);
        let cause: Mutex<Option<String>> = Mutex::new(None);
        let connecting = async {
            let primary = sentinels
                .primary()
                .await
                .map_err(|err| fail(err.to_string()))?;
            let manager = open_standalone(&primary.client, &config, &cause)
                .await
                .map_err(|err| {
                    fail(format!(
                        "cannot connect to the primary {} the sentinels name: {err}",
                        primary.address
                    ))
                })?;
            Ok::<_, LockError>((primary, manager))
        };
        let limit = self.connect_timeout.saturating_add(self.response_timeout);
        let (primary, manager) = timeout(limit, connecting).await.map_err(|_| {
            let cause = cause.lock().unwrap_or_else(PoisonError::into_inner).take();
            fail(format!(
                "connecting to the primary {service:?} through the sentinels {} timed out \
                 after {limit:?}{}",
                shown.join(", "),
                cause.map(|cause| format!(": {cause}")).unwrap_or_default()
            ))
        })??;
        tracing::debug!(
            sentinels = ?shown,
            service,
            primary = %primary.address,
            "redis backend connected through sentinels"
        );
        let commands = Commands::sentinel(Arc::clone(&sentinels), config, primary, manager);
        let inner = Arc::new(Inner {
            commands,
            subscriber: Subscriber::with_sentinels(
                Vec::new(),
                Some(sentinels),
                self.connect_timeout,
                self.response_timeout,
            ),
            shown,
            secrets,
            connect_timeout: self.connect_timeout,
            response_timeout: self.response_timeout,
            warned_unmarked: AtomicBool::new(false),
            warned_unstamped: AtomicBool::new(false),
            warned_unlisted: AtomicBool::new(false),
            warned_unannounced: AtomicBool::new(false),
            publish_every_release: self.publish_every_release,
            list_queues: self.list_queues,
            queued: Default::default(),
            label: self.label,
            replica_acks: self.replica_acks,
            acks_gate: tokio::sync::Mutex::new(()),
            sentinel_service: Some(service),
        });
        tokio::spawn(super::watch_primary(Arc::downgrade(&inner)));
        Ok(RedisBackend { inner })
    }
}

fn cluster_acks() -> LockError {
    LockError::InvalidOption {
        option: "replica_acks",
        reason: "replica acknowledgements are not offered on a Redis Cluster".into(),
    }
}

/// Opens the command connection to a single server. A refused or dropped
/// connection (a server still starting, a failover under way) is tried
/// again after a pause, until the caller's connect timeout ends the tries;
/// `cause` keeps the last such error for the message. Anything else (a
/// wrong password, a TLS failure) is an error at once.
async fn open_standalone(
    client: &Client,
    config: &ConnectionManagerConfig,
    cause: &Mutex<Option<String>>,
) -> RedisResult<ConnectionManager> {
    let mut pause = FIRST_CONNECT_PAUSE;
    loop {
        match client
            .get_connection_manager_with_config(config.clone())
            .await
        {
            Ok(manager) => return Ok(manager),
            Err(err) if err.is_connection_refusal() || err.is_connection_dropped() => {
                *cause.lock().unwrap_or_else(PoisonError::into_inner) = Some(err.to_string());
                sleep(pause).await;
                pause = (pause * 2).min(MAX_CONNECT_PAUSE);
            }
            Err(err) => return Err(err),
        }
    }
}

/// Asks a server whether it is part of a cluster, with the command the
/// cluster client itself needs (`CLUSTER SLOTS`), so a least-privilege ACL
/// user needs no further right (such as `INFO`) to be told apart. A server
/// that answers with an error is a single server: cluster support disabled,
/// a server or proxy without the command, or an ACL that refuses it (the
/// cluster client could not work under that ACL either).
async fn detect(conn: &mut ConnectionManager) -> RedisResult<Topology> {
    let slots: RedisResult<::redis::Value> =
        ::redis::cmd("CLUSTER").arg("SLOTS").query_async(conn).await;
    match slots {
        Ok(_) => Ok(Topology::Cluster),
        Err(err)
            if matches!(
                err.kind(),
                ErrorKind::Server(ServerErrorKind::ResponseError | ServerErrorKind::NoPerm)
            ) =>
        {
            Ok(Topology::Standalone)
        }
        Err(err) => Err(err),
    }
}

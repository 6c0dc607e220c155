//! [`EtcdBuilder`]: the connection settings of an [`EtcdBackend`] and
//! connecting with them.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions};
use tokio::time::{sleep, timeout};

use super::endpoints::{self, Endpoint, scrub, secrets_of};
use super::keyspace::ROOT;
use super::requests::{UNSENT_PAUSE, never_sent};
use super::watch::Watches;
use super::{DEFAULT_CONNECT_TIMEOUT, DEFAULT_RESPONSE_TIMEOUT, EtcdBackend, Inner, KIND};
use crate::error::{LockError, Operation};
use crate::holder::check_label;

/// How often an idle connection is pinged (HTTP/2 keep-alive), so a member
/// that went away silently is noticed and its watches are opened anew.
const PING_INTERVAL: Duration = Duration::from_secs(2);

/// Connection settings for an [`EtcdBackend`]; from
/// [`EtcdBackend::builder`].
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock_runtime::LockError> {
/// use std::time::Duration;
/// use dlock_runtime::etcd::EtcdBackend;
///
/// let backend = EtcdBackend::builder(&["http://10.0.0.5:2379", "http://10.0.0.6:2379"])
///     .connect_timeout(Duration::from_secs(2))
///     .response_timeout(Duration::from_secs(1))
///     .label("billing")
///     .connect()
///     .await?;
/// # let _ = backend;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct EtcdBuilder {
    endpoints: Vec<String>,
    connect_timeout: Duration,
    response_timeout: Duration,
    label: Option<String>,
}

impl EtcdBuilder {
    pub(super) fn new(endpoints: &[&str]) -> Self {
        Self {
            endpoints: endpoints.iter().map(|e| (*e).to_owned()).collect(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            label: None,
        }
    }

    /// How long connecting may take, the first request to the cluster
    /// included (default [`DEFAULT_CONNECT_TIMEOUT`]): an unreachable
    /// cluster is an error after that, never a hang.
    pub fn connect_timeout(mut self, limit: Duration) -> Self {
        self.connect_timeout = limit;
        self
    }

    /// How long one request may wait for its answer (default
    /// [`DEFAULT_RESPONSE_TIMEOUT`]).
    pub fn response_timeout(mut self, limit: Duration) -> Self {
        self.response_timeout = limit;
        self
    }

    /// The label acquisitions through this backend record, over the
    /// process's ([`crate::Registry::set_label`]).
    pub fn label(mut self, label: &str) -> Self {
        self.label = Some(label.to_owned());
        self
    }

    /// Connects, and checks that the cluster answers a read (which needs a
    /// leader) within the connect timeout.
    pub async fn connect(self) -> Result<EtcdBackend, LockError> {
        if let Some(label) = &self.label {
            check_label(label)?;
        }
        let urls: Vec<&str> = self.endpoints.iter().map(String::as_str).collect();
        let parsed = endpoints::parse_all(&urls)?;
        let secrets = secrets_of(&urls, &parsed);
        let shown: Vec<String> = parsed.iter().map(|e| e.address.clone()).collect();
        let options = self.options(&parsed);
        let connecting = Connecting {
            shown,
            secrets,
            limit: self.connect_timeout,
            refused: Mutex::new(None),
        };
        let client = connecting.client(&options).await?;
        connecting.first_read(&client).await?;
        let min_lease_ttl = connecting.min_lease_ttl(&client).await?;
        let watches = Watches::new(client.clone(), self.response_timeout);
        let Connecting { shown, secrets, .. } = connecting;
        Ok(EtcdBackend {
            inner: Arc::new(Inner {
                client,
                watches,
                shown,
                secrets,
                response_timeout: self.response_timeout,
                min_lease_ttl,
                label: self.label,
            }),
        })
    }

    /// The client's options: the timeouts, the keep-alive pings, and the
    /// credentials of the first endpoint, if any (the same on every one).
    fn options(&self, parsed: &[Endpoint]) -> ConnectOptions {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout)
            .with_timeout(self.response_timeout)
            // A member cut off from the leader refuses at once ("no
            // leader") instead of making requests and watches wait.
            .with_require_leader(true)
            .with_keep_alive(PING_INTERVAL, self.response_timeout)
            .with_keep_alive_while_idle(true);
        if let Some((user, password)) = &parsed[0].credentials {
            // etcd's auth tokens end: a simple token after
            // `--auth-token-ttl` unused (5 min by default) and with a
            // restart of its member, a JWT at its expiry. Without a new
            // one every call would fail from then on, a holder's renewals
            // included: the client authenticates again when etcd refuses
            // the token, and sends the request once more.
            options = options
                .with_user(user.clone(), password.clone())
                .with_auto_token_refresh(true);
        }
        options
    }
}

/// One connection under way, each of its steps within the connect
/// timeout: what its errors show, and the last refusal a member gave.
struct Connecting {
    /// The endpoints without credentials.
    shown: Vec<String>,
    /// Passwords to scrub from any error text.
    secrets: Vec<String>,
    /// The connect timeout.
    limit: Duration,
    /// The last refusal, to say why when time runs out.
    refused: Mutex<Option<String>>,
}

impl Connecting {
    fn failed(&self, text: String) -> LockError {
        LockError::backend(
            KIND,
            Operation::Connect,
            "",
            format!("{}: {}", self.shown.join(", "), scrub(&text, &self.secrets)),
        )
    }

    fn note(&self, err: &etcd_client::Error) {
        if let Ok(mut last) = self.refused.lock() {
            *last = Some(err.to_string());
        }
    }

    fn last_refusal(&self) -> Option<String> {
        self.refused.lock().ok().and_then(|mut last| last.take())
    }

    /// The client, connected with `options`.
    async fn client(&self, options: &ConnectOptions) -> Result<Client, LockError> {
        let limit = self.limit;
        // With credentials, connecting authenticates, through whichever
        // member the balancer picks: one that is down refuses, and another
        // may answer. Connected again while that is so, as requests are
        // sent again (see `EtcdBackend::bounded`).
        let connecting = async {
            loop {
                match Client::connect(&self.shown, Some(options.clone())).await {
                    Err(err) if never_sent(&err) => {
                        self.note(&err);
                        sleep(UNSENT_PAUSE).await;
                    }
                    answer => return answer,
                }
            }
        };
        match timeout(limit, connecting).await {
            Ok(Ok(client)) => Ok(client),
            Ok(Err(err)) => Err(self.failed(err.to_string())),
            Err(_) => {
                let last = self.last_refusal();
                Err(self.failed(match last {
                    Some(refusal) => {
                        format!("no connection within {limit:?}; the last member tried: {refusal}")
                    }
                    None => format!("no connection within {limit:?}"),
                }))
            }
        }
    }

    /// A first read, which needs a leader: the cluster answers.
    async fn first_read(&self, client: &Client) -> Result<(), LockError> {
        let limit = self.limit;
        // Sent again while the member picked is down: another one may
        // answer (see `EtcdBackend::bounded`).
        let read = async {
            loop {
                let mut probe = client.kv_client();
                let options = GetOptions::new().with_prefix().with_count_only();
                match probe.get(ROOT, Some(options)).await {
                    Err(err) if never_sent(&err) => {
                        self.note(&err);
                        sleep(UNSENT_PAUSE).await;
                    }
                    answer => return answer,
                }
            }
        };
        match timeout(limit, read).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(err)) => Err(self.failed(err.to_string())),
            Err(_) => {
                let last = self.last_refusal();
                Err(self.failed(match last {
                    Some(refusal) => format!(
                        "no member answered within {limit:?}; the last one tried: {refusal}"
                    ),
                    None => format!(
                        "the cluster did not answer a read within {limit:?} (unreachable, or without a leader)"
                    ),
                }))
            }
        }
    }

    /// The cluster's minimum lease ttl (1.5 × its election timeout,
    /// rounded up): etcd raises a shorter grant to it and says so.
    async fn min_lease_ttl(&self, client: &Client) -> Result<Duration, LockError> {
        let limit = self.limit;
        let mut leases = client.lease_client();
        let grant = async {
            loop {
                match leases.grant(1, None).await {
                    Err(err) if never_sent(&err) => {
                        self.note(&err);
                        sleep(UNSENT_PAUSE).await;
                    }
                    answer => return answer,
                }
            }
        };
        match timeout(limit, grant).await {
            Ok(Ok(granted)) => {
                let _ = timeout(limit, leases.revoke(granted.id())).await;
                Ok(Duration::from_secs(
                    u64::try_from(granted.ttl()).unwrap_or(1).max(1),
                ))
            }
            Ok(Err(err)) => Err(self.failed(err.to_string())),
            Err(_) => Err(self.failed(format!("no lease granted within {limit:?}"))),
        }
    }
}

impl fmt::Debug for EtcdBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: Vec<String> = self
            .endpoints
            .iter()
            .map(|url| {
                endpoints::parse(url).map_or_else(
                    |_| "<unreadable endpoint, not shown>".to_owned(),
                    |e| e.address,
                )
            })
            .collect();
        f.debug_struct("EtcdBuilder")
            .field("endpoints", &shown)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("label", &self.label)
            .finish()
    }
}

//! Finding the primary of a Redis Sentinel deployment.
//!
//! The sentinels are asked in turn (`SENTINEL get-master-addr-by-name`),
//! and the address one names is trusted only once the node itself says it
//! is a master (`ROLE`): during a failover a sentinel may still name the
//! old primary, and an old primary that came back may still be on its way
//! to being a replica. The whole search is bounded by the connect timeout,
//! so a deployment whose sentinels are all down is an error in that time,
//! never a hang.
//!
//! The command connection and the pub/sub connection both come here when
//! their connection fails or the node answers that it is not a primary
//! (`READONLY`), so the backend follows a failover without a restart.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, ConnectionInfo, IntoConnectionInfo as _,
    RedisConnectionInfo, RedisError, RedisResult, TlsCertificates, Value,
};
use tokio::time::{Instant, sleep, timeout};

/// The first pause between two rounds over the sentinels (a failover under
/// way: no sentinel names a primary that says it is one yet); doubled each
/// round up to [`MAX_ROUND_PAUSE`], within the connect timeout.
const FIRST_ROUND_PAUSE: Duration = Duration::from_millis(50);
const MAX_ROUND_PAUSE: Duration = Duration::from_millis(400);

/// The sentinels of one monitored primary, and how to connect to the data
/// nodes they name.
pub(super) struct Sentinels {
    sentinels: Vec<Client>,
    /// The sentinels' URLs with passwords hidden, for errors.
    shown: Vec<String>,
    /// The name the sentinels monitor the primary under.
    service: String,
    /// Credentials, database and protocol for the data nodes.
    node: RedisConnectionInfo,
    /// PEM roots for TLS to the data nodes, when the sentinels use TLS.
    tls: Option<Option<Vec<u8>>>,
    connect_timeout: Duration,
    response_timeout: Duration,
    /// The sentinel that answered last: asked first next time.
    last_good: AtomicUsize,
}

/// A primary found and confirmed: a client for it and its address.
pub(super) struct Primary {
    pub(super) client: Client,
    pub(super) address: String,
}

impl Sentinels {
    /// Sentinels reached with `sentinels` (their URLs' credentials are the
    /// sentinels', not the data nodes'); data nodes are opened with `node`,
    /// over TLS (trusting `tls`'s roots, or the system's) when given.
    pub(super) fn new(
        sentinels: Vec<Client>,
        shown: Vec<String>,
        service: String,
        node: RedisConnectionInfo,
        tls: Option<Option<Vec<u8>>>,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Self {
        Self {
            sentinels,
            shown,
            service,
            node,
            tls,
            connect_timeout,
            response_timeout,
            last_good: AtomicUsize::new(0),
        }
    }

    /// The name of the monitored primary.
    pub(super) fn service(&self) -> &str {
        &self.service
    }

    /// Finds the primary: asks the sentinels in turn, starting with the one
    /// that answered last, and confirms with `ROLE` that the node named is
    /// a master; rounds over all of them until the connect timeout ends
    /// the search. The error says whether any sentinel answered at all.
    pub(super) async fn primary(&self) -> RedisResult<Primary> {
        let deadline = Instant::now() + self.connect_timeout;
        let count = self.sentinels.len();
        let mut answered = false;
        let mut last: Option<String> = None;
        let mut pause = FIRST_ROUND_PAUSE;
        'rounds: loop {
            let start = self.last_good.load(Ordering::Relaxed);
            for step in 0..count {
                let index = (start + step) % count;
                let (Some(sentinel), Some(shown)) =
                    (self.sentinels.get(index), self.shown.get(index))
                else {
                    continue;
                };
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break 'rounds;
                }
                let named = match timeout(left, self.ask(sentinel)).await {
                    Ok(Ok(named)) => named,
                    Ok(Err(err)) => {
                        last = Some(format!("sentinel {shown}: {err}"));
                        continue;
                    }
                    Err(_) => {
                        last = Some(format!("sentinel {shown}: no answer in time"));
                        continue;
                    }
                };
                answered = true;
                let Some((host, port)) = named else {
                    last = Some(format!(
                        "sentinel {shown} monitors no primary named {:?}",
                        self.service
                    ));
                    continue;
                };
                let address = format!("{host}:{port}");
                let left = deadline.saturating_duration_since(Instant::now());
                let client = self.data_node(host, port)?;
                match timeout(left, self.is_master(&client)).await {
                    Ok(Ok(true)) => {
                        self.last_good.store(index, Ordering::Relaxed);
                        return Ok(Primary { client, address });
                    }
                    Ok(Ok(false)) => {
                        last = Some(format!(
                            "sentinel {shown} names {address}, which says it is not a master \
                             (a failover under way?)"
                        ));
                    }
                    Ok(Err(err)) => {
                        last = Some(format!(
                            "sentinel {shown} names {address}, which cannot be reached: {err}"
                        ));
                    }
                    Err(_) => {
                        last = Some(format!(
                            "sentinel {shown} names {address}, which did not answer in time"
                        ));
                    }
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            sleep(pause.min(left)).await;
            pause = (pause * 2).min(MAX_ROUND_PAUSE);
        }
        let all = self.shown.join(", ");
        let after = self.connect_timeout;
        let last = last.unwrap_or_else(|| "no sentinel was asked".to_owned());
        let text = if answered {
            format!(
                "no primary for {:?} found through the sentinels {all} within {after:?}; last: {last}",
                self.service
            )
        } else {
            format!("no sentinel answered within {after:?} (tried {all}); last: {last}")
        };
        Err(RedisError::from(io::Error::new(
            io::ErrorKind::NotConnected,
            text,
        )))
    }

    /// The primary's address (`host:port`) as the first sentinel that
    /// answers names it, unconfirmed; `None` when none answers within the
    /// connect timeout or it monitors no such primary. For the periodic
    /// check whether the primary moved.
    pub(super) async fn named(&self) -> Option<String> {
        let deadline = Instant::now() + self.connect_timeout;
        let start = self.last_good.load(Ordering::Relaxed);
        let count = self.sentinels.len();
        for step in 0..count {
            let sentinel = self.sentinels.get((start + step) % count)?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            if let Ok(Ok(named)) = timeout(left, self.ask(sentinel)).await {
                return named.map(|(host, port)| format!("{host}:{port}"));
            }
        }
        None
    }

    /// One connection for a short exchange, bounded by the timeouts.
    async fn open(&self, client: &Client) -> RedisResult<MultiplexedConnection> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.response_timeout));
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
    }

    /// The address `sentinel` names for the primary; `None` when it does
    /// not monitor one by that name.
    async fn ask(&self, sentinel: &Client) -> RedisResult<Option<(String, u16)>> {
        let mut conn = self.open(sentinel).await?;
        ::redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&self.service)
            .query_async(&mut conn)
            .await
    }

    /// Whether the node `client` opens says it is a master.
    async fn is_master(&self, client: &Client) -> RedisResult<bool> {
        let mut conn = self.open(client).await?;
        let role: Value = ::redis::cmd("ROLE").query_async(&mut conn).await?;
        Ok(role_is_master(&role))
    }

    /// A client for the data node at `host:port`, with the data nodes'
    /// credentials and database.
    fn data_node(&self, host: String, port: u16) -> RedisResult<Client> {
        let addr = match &self.tls {
            None => ConnectionAddr::Tcp(host, port),
            Some(_) => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: false,
                tls_params: None,
            },
        };
        let info: ConnectionInfo = addr
            .into_connection_info()?
            .set_redis_settings(self.node.clone());
        match &self.tls {
            Some(Some(pem)) => Client::build_with_tls(
                info,
                TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                },
            ),
            _ => Client::open(info),
        }
    }
}

/// Whether a `ROLE` reply is a master's (`["master", offset, replicas]`).
fn role_is_master(role: &Value) -> bool {
    let Value::Array(parts) = role else {
        return false;
    };
    match parts.first() {
        Some(Value::BulkString(name)) => name.as_slice() == b"master",
        Some(Value::SimpleString(name)) => name == "master",
        _ => false,
    }
}

/// Whether `err` says the node is no longer the primary: a write refused
/// by a replica (`READONLY`), as an old primary that came back as a
/// replica answers.
pub(super) fn is_not_primary(err: &RedisError) -> bool {
    err.code() == Some("READONLY")
        || err
            .detail()
            .is_some_and(|detail| detail.contains("READONLY"))
        || err.to_string().contains("READONLY")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_master_role_reply_is_a_master() {
        let bulk = |text: &str| Value::BulkString(text.as_bytes().to_vec());
        let master = Value::Array(vec![bulk("master"), Value::Int(10), Value::Array(vec![])]);
        let replica = Value::Array(vec![
            bulk("slave"),
            bulk("127.0.0.1"),
            Value::Int(6379),
            bulk("connected"),
            Value::Int(10),
        ]);
        assert!(role_is_master(&master));
        assert!(!role_is_master(&replica));
        assert!(!role_is_master(&Value::Nil));
        assert!(!role_is_master(&Value::Array(vec![])));
    }
}

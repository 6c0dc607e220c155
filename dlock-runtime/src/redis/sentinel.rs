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
use futures_util::StreamExt as _;
use futures_util::stream::FuturesUnordered;
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

    /// Finds the primary: asks every sentinel at once (`SENTINEL MASTER`)
    /// and trusts the address named under the highest config epoch — a
    /// sentinel that missed a failover (down, cut off, restarted from an
    /// older config) names the old primary under an older epoch, and that
    /// node, restarted, may say it is a master for a while. The address is
    /// confirmed with `ROLE`; rounds go on until the connect timeout ends
    /// the search. The error says whether any sentinel answered at all.
    pub(super) async fn primary(&self) -> RedisResult<Primary> {
        let deadline = Instant::now() + self.connect_timeout;
        let mut answered = false;
        // What the sentinels that answered said, over why others did not
        // (the last round may be cut short by the deadline).
        let mut last: Option<String> = None;
        let mut unheard: Option<String> = None;
        let mut pause = FIRST_ROUND_PAUSE;
        loop {
            let views = self.views(deadline).await;
            let heard = views.iter().filter(|(_, view)| view.is_ok()).count();
            let mut best: Option<(usize, String, u16, Option<u64>)> = None;
            for (index, view) in views {
                let shown = self.shown.get(index).map_or("?", String::as_str);
                match view {
                    Err(why) => unheard = Some(format!("sentinel {shown}: {why}")),
                    Ok(None) => {
                        answered = true;
                        last = Some(format!(
                            "sentinel {shown} monitors no primary named {:?}",
                            self.service
                        ));
                    }
                    Ok(Some((host, port, epoch))) => {
                        answered = true;
                        if best.as_ref().is_none_or(|(_, _, _, top)| epoch > *top) {
                            best = Some((index, host, port, epoch));
                        }
                    }
                }
            }
            // A minority's word is not taken: the sentinels that did not
            // answer may be the ones that saw a failover that the ones that
            // answered missed (down, cut off, or restarted from an older
            // config), and the old primary they name, restarted, says it is
            // a master until it is demoted.
            if heard < self.majority() {
                // Said only when the minority named one: a minority that
                // said it monitors no such primary keeps its own words.
                if best.is_some() {
                    last = Some(format!(
                        "only {heard} of the {} sentinels answered, and the primary a minority \
                         names is not trusted (it may be one a failover left behind)",
                        self.sentinels.len()
                    ));
                }
                best = None;
            }
            if let Some((index, host, port, _)) = best {
                let shown = self.shown.get(index).map_or("?", String::as_str);
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
        let last = last
            .or(unheard)
            .unwrap_or_else(|| "no sentinel was asked".to_owned());
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

    /// The primary's address (`host:port`) as the sentinels name it under
    /// the highest config epoch, unconfirmed; `None` when none answers
    /// within the connect timeout or none monitors such a primary. For the
    /// periodic check whether the primary moved.
    pub(super) async fn named(&self) -> Option<String> {
        let deadline = Instant::now() + self.connect_timeout;
        let views = self.views(deadline).await;
        // As in `primary`: a minority's word is not taken.
        if views.iter().filter(|(_, view)| view.is_ok()).count() < self.majority() {
            return None;
        }
        let mut best: Option<(String, u16, Option<u64>)> = None;
        for (_, view) in views {
            if let Ok(Some((host, port, epoch))) = view
                && best.as_ref().is_none_or(|(_, _, top)| epoch > *top)
            {
                best = Some((host, port, epoch));
            }
        }
        best.map(|(host, port, _)| format!("{host}:{port}"))
    }

    /// The sentinels' views, asked all at once, by index, the one that
    /// answered last first (so it wins a tie): the primary's host, port
    /// and config epoch, `None` for no such primary, or why it gave none
    /// by `deadline`. Returns once a majority of the sentinels answered
    /// (a paused one, which would hold every look-up for the response
    /// timeout, is not waited for then) or all have ended.
    async fn views(&self, deadline: Instant) -> Vec<(usize, Result<Option<Named>, String>)> {
        let count = self.sentinels.len();
        let start = self.last_good.load(Ordering::Relaxed);
        let mut asks: FuturesUnordered<_> = (0..count)
            .map(|step| {
                let index = (start + step) % count;
                async move {
                    let Some(sentinel) = self.sentinels.get(index) else {
                        return (step, index, Err("not configured".to_owned()));
                    };
                    let left = deadline.saturating_duration_since(Instant::now());
                    let view = match timeout(left, self.ask(sentinel)).await {
                        Ok(Ok(named)) => Ok(named),
                        Ok(Err(err)) => Err(err.to_string()),
                        Err(_) => Err("no answer in time".to_owned()),
                    };
                    (step, index, view)
                }
            })
            .collect();
        let majority = self.majority();
        let mut views = Vec::with_capacity(count);
        let mut answers = 0;
        while let Some(view) = asks.next().await {
            if view.2.is_ok() {
                answers += 1;
            }
            views.push(view);
            if answers >= majority {
                break;
            }
        }
        views.sort_by_key(|(step, _, _)| *step);
        views
            .into_iter()
            .map(|(_, index, view)| (index, view))
            .collect()
    }

    /// How many sentinels make a majority of those configured.
    fn majority(&self) -> usize {
        self.sentinels.len() / 2 + 1
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

    /// The address and config epoch `sentinel` names for the primary
    /// (`SENTINEL MASTER`); `None` when it does not monitor one by that
    /// name. A sentinel that refuses `SENTINEL MASTER` (an ACL that allows
    /// only `get-master-addr-by-name`) is asked that, its answer with no
    /// epoch, below any other's.
    async fn ask(&self, sentinel: &Client) -> RedisResult<Option<Named>> {
        let mut conn = self.open(sentinel).await?;
        let fields: RedisResult<Value> = ::redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(&self.service)
            .query_async(&mut conn)
            .await;
        match fields {
            Ok(fields) => Ok(master_fields(&fields)),
            Err(err) if is_no_such_master(&err) => Ok(None),
            Err(err) if err.code().is_some() => {
                let named: Option<(String, u16)> = ::redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(&self.service)
                    .query_async(&mut conn)
                    .await?;
                Ok(named.map(|(host, port)| (host, port, None)))
            }
            Err(err) => Err(err),
        }
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

/// A primary as a sentinel names it: host, port, config epoch (`None`
/// when the sentinel would not tell).
type Named = (String, u16, Option<u64>);

/// The `ip`, `port` and `config-epoch` of a `SENTINEL MASTER` reply (a
/// flat list of names and values, or a map over RESP3).
fn master_fields(reply: &Value) -> Option<Named> {
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(text) => Some(text.clone()),
        Value::Int(number) => Some(number.to_string()),
        _ => None,
    };
    let pairs: Vec<(String, String)> = match reply {
        Value::Array(items) => items
            .chunks(2)
            .filter_map(|pair| match pair {
                [name, value] => Some((text(name)?, text(value)?)),
                _ => None,
            })
            .collect(),
        Value::Map(items) => items
            .iter()
            .filter_map(|(name, value)| Some((text(name)?, text(value)?)))
            .collect(),
        _ => return None,
    };
    let field = |name: &str| {
        pairs
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
    };
    let host = field("ip")?;
    let port = field("port")?.parse().ok()?;
    let epoch = field("config-epoch").and_then(|epoch| epoch.parse().ok());
    Some((host, port, epoch))
}

/// Whether `err` is a sentinel's "no such master with that name".
fn is_no_such_master(err: &RedisError) -> bool {
    err.to_string()
        .to_ascii_lowercase()
        .contains("no such master")
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
    fn a_sentinel_master_reply_gives_the_address_and_the_config_epoch() {
        let bulk = |text: &str| Value::BulkString(text.as_bytes().to_vec());
        let reply = Value::Array(vec![
            bulk("name"),
            bulk("mymaster"),
            bulk("ip"),
            bulk("127.0.0.1"),
            bulk("port"),
            bulk("6380"),
            bulk("config-epoch"),
            bulk("3"),
        ]);
        assert_eq!(
            master_fields(&reply),
            Some(("127.0.0.1".to_owned(), 6380, Some(3)))
        );
        let map = Value::Map(vec![(bulk("ip"), bulk("h")), (bulk("port"), Value::Int(1))]);
        assert_eq!(master_fields(&map), Some(("h".to_owned(), 1, None)));
        assert_eq!(master_fields(&Value::Nil), None);
        // No epoch ranks below epoch 0.
        assert!(Some(0_u64) > None);
    }

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

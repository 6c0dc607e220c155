//! The command connection: one reconnecting connection to a single server,
//! or one cluster connection, shared by every call of a backend — and
//! replaced whole when a command gets no reply.
//!
//! redis-rs rebuilds a connection it sees break (reset, closed), but a
//! response timeout is no break to it: it goes on sending on a connection
//! that may have gone silent for good (a NAT or load balancer that forgot
//! it, a peer that lost power, a proxy that keeps the socket open). The
//! kernel gives up on such a socket after about 15 minutes, if ever; until
//! then every acquisition would fail and every lease be lost. So a command
//! without a reply within the response timeout retires the connection it
//! was sent on, and the call tries once more on a new one.
//!
//! Each connection has a generation, and only the first caller to report a
//! generation silent replaces it: callers that time out together open one
//! new connection, not one each. A new connection connects on first use,
//! so replacing one never makes a caller wait for the lock that guards it.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::{ClusterClient, ClusterConfig};
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use ::redis::{Client, Cmd, Pipeline, RedisError, RedisFuture, RedisResult, Value};
use tokio::time::timeout;

use super::sentinel::{Primary, Sentinels, is_not_primary};

/// The command connection of one backend.
pub(super) struct Commands {
    opener: Opener,
    current: Mutex<Link>,
    /// Held while the primary is looked up through the sentinels, so
    /// callers that fail together ask once.
    following: tokio::sync::Mutex<()>,
}

/// How to open a new connection of the same kind.
enum Opener {
    Standalone {
        client: Client,
        config: ConnectionManagerConfig,
    },
    Cluster {
        client: ClusterClient,
        config: ClusterConfig,
    },
    /// The primary the sentinels name, looked up again whenever the
    /// connection fails or the node says it is no longer the primary.
    Sentinel {
        sentinels: Arc<Sentinels>,
        config: ConnectionManagerConfig,
    },
}

/// The connection in use and its generation.
#[derive(Clone)]
struct Link {
    generation: u64,
    connection: Connection,
    /// The primary it was opened to, behind sentinels: a silent
    /// connection is replaced by one to the same node.
    primary: Option<Client>,
    /// That primary's address (`host:port`), to tell whether it moved.
    address: Option<String>,
}

/// A connection to send commands, scripts and pipelines on.
#[derive(Clone)]
pub(super) enum Connection {
    Standalone(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Standalone(conn) => conn.req_packed_command(cmd),
            Connection::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Standalone(conn) => conn.req_packed_commands(pipeline, offset, count),
            Connection::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Standalone(conn) => conn.get_db(),
            Connection::Cluster(conn) => conn.get_db(),
        }
    }
}

impl Connection {
    /// Sends `cmd` to the primary that serves `slot`, on a cluster: for a
    /// command without a key (`SCAN`), which the cluster client would send
    /// to any node. On a single server, to the server.
    pub(super) async fn query_at(&mut self, cmd: &Cmd, slot: u16) -> RedisResult<Value> {
        match self {
            Connection::Standalone(conn) => cmd.query_async(conn).await,
            Connection::Cluster(conn) => {
                let primary =
                    SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
                conn.route_command(cmd.clone(), RoutingInfo::SingleNode(primary))
                    .await
            }
        }
    }
}

/// Why a call got no answer.
pub(super) enum Failure {
    /// The server or the connection reported an error.
    Redis(RedisError),
    /// Nothing came back within the call's time limit.
    NoReply,
}

impl Commands {
    /// Commands to a single server over `manager`, opened by `client` with
    /// `config`.
    pub(super) fn standalone(
        client: Client,
        config: ConnectionManagerConfig,
        manager: ConnectionManager,
    ) -> Self {
        Self::new(
            Opener::Standalone { client, config },
            Connection::Standalone(manager),
        )
    }

    /// Commands to a cluster over `connection`, opened by `client` with
    /// `config`.
    pub(super) fn cluster(
        client: ClusterClient,
        config: ClusterConfig,
        connection: ClusterConnection,
    ) -> Self {
        Self::new(
            Opener::Cluster { client, config },
            Connection::Cluster(connection),
        )
    }

    /// Commands to the primary the sentinels named, `primary`, over
    /// `manager`, opened with `config`.
    pub(super) fn sentinel(
        sentinels: Arc<Sentinels>,
        config: ConnectionManagerConfig,
        primary: Primary,
        manager: ConnectionManager,
    ) -> Self {
        let mut commands = Self::new(
            Opener::Sentinel { sentinels, config },
            Connection::Standalone(manager),
        );
        let current = commands
            .current
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        current.primary = Some(primary.client);
        current.address = Some(primary.address);
        commands
    }

    /// Behind sentinels: asks them which node is the primary now, and
    /// moves the commands there if it is not the one they go to: a
    /// failover that left the old primary running, unreachable for the
    /// sentinels but not for this process, is followed without waiting
    /// for a refusal that may never come.
    pub(super) async fn follow_if_moved(&self) {
        let Opener::Sentinel { sentinels, .. } = &self.opener else {
            return;
        };
        let (generation, address) = {
            let current = self.current();
            (current.generation, current.address.clone())
        };
        let Some(named) = sentinels.named().await else {
            return;
        };
        if address.as_deref() == Some(named.as_str()) {
            return;
        }
        if let Err(err) = self.follow(generation).await {
            tracing::warn!(
                error = %err,
                named = %named,
                "the sentinels name another redis primary, which cannot be used yet"
            );
        }
    }

    fn new(opener: Opener, connection: Connection) -> Self {
        Self {
            opener,
            current: Mutex::new(Link {
                generation: 0,
                connection,
                primary: None,
                address: None,
            }),
            following: tokio::sync::Mutex::new(()),
        }
    }

    pub(super) fn is_cluster(&self) -> bool {
        matches!(self.opener, Opener::Cluster { .. })
    }

    pub(super) fn is_sentinel(&self) -> bool {
        matches!(self.opener, Opener::Sentinel { .. })
    }

    /// Looks the primary up through the sentinels and moves the commands
    /// to it, unless connection `failed` was replaced meanwhile (another
    /// caller followed already). Bounded by the connect timeout.
    async fn follow(&self, failed: u64) -> RedisResult<()> {
        let Opener::Sentinel { sentinels, config } = &self.opener else {
            return Ok(());
        };
        let _following = self.following.lock().await;
        if self.current().generation != failed {
            return Ok(());
        }
        let primary = sentinels.primary().await?;
        let manager =
            ConnectionManager::new_lazy_with_config(primary.client.clone(), config.clone())?;
        let mut current = self.current();
        if current.generation == failed {
            current.generation += 1;
            current.connection = Connection::Standalone(manager);
            current.primary = Some(primary.client);
            current.address = Some(primary.address.clone());
            tracing::info!(
                primary = %primary.address,
                service = sentinels.service(),
                generation = current.generation,
                "redis commands follow the primary the sentinels name"
            );
        }
        Ok(())
    }

    fn current(&self) -> MutexGuard<'_, Link> {
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn link(&self) -> Link {
        self.current().clone()
    }

    /// Replaces connection `silent` with a new one, unless that happened
    /// already. The old one closes once the calls still using it are done.
    fn retire(&self, silent: u64) {
        let mut current = self.current();
        if current.generation != silent {
            return;
        }
        let connection = match (&self.opener, &current.primary) {
            (Opener::Sentinel { config, .. }, Some(client))
            | (Opener::Standalone { config, .. }, Some(client)) => {
                match ConnectionManager::new_lazy_with_config(client.clone(), config.clone()) {
                    Ok(manager) => Connection::Standalone(manager),
                    Err(err) => {
                        tracing::warn!(error = %err, "cannot replace the silent redis connection");
                        return;
                    }
                }
            }
            (Opener::Sentinel { .. }, None) => return,
            (Opener::Standalone { client, config }, None) => {
                match ConnectionManager::new_lazy_with_config(client.clone(), config.clone()) {
                    Ok(manager) => Connection::Standalone(manager),
                    Err(err) => {
                        // Refused only for settings this backend never makes.
                        tracing::warn!(error = %err, "cannot replace the silent redis connection");
                        return;
                    }
                }
            }
            (Opener::Cluster { client, config }, _) => {
                Connection::Cluster(client.get_pending_async_connection_with_config(config.clone()))
            }
        };
        current.generation += 1;
        current.connection = connection;
        tracing::warn!(
            generation = current.generation,
            "a redis command got no reply; opening a new connection"
        );
    }

    /// Sends `request` on the connection, and once more after a connection
    /// error — on a new connection if the first got no reply — all within
    /// `limit`. Behind sentinels, a connection error or a node that says it
    /// is not the primary (`READONLY`) first looks the primary up again,
    /// and the second try goes to the one found. Also tells whether the
    /// answer is the second try's: the first may then have run on the
    /// server, its reply lost.
    pub(super) async fn send<T, F, Fut>(
        &self,
        limit: Duration,
        request: F,
    ) -> Result<(T, bool), Failure>
    where
        F: Fn(Connection) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let first = self.link();
        let generation = first.generation;
        let tries = async {
            let outcome = request(first.connection).await;
            self.note(&outcome, generation);
            match outcome {
                Err(err)
                    if is_connection_error(&err)
                        || (self.is_sentinel() && is_not_primary(&err)) =>
                {
                    // Boxed: the look-up is rare and large, and every
                    // call's future would otherwise carry its size.
                    if self.is_sentinel()
                        && let Err(lookup) = Box::pin(self.follow(generation)).await
                    {
                        // A node that refused as a replica is no place for
                        // the second try; a broken connection with no
                        // sentinel to ask is retried on the primary known
                        // (a blip on a primary that is still one must not
                        // fail every call while the sentinels are down).
                        if is_not_primary(&err) {
                            return Err(lookup);
                        }
                        tracing::warn!(
                            error = %lookup,
                            "cannot ask the sentinels for the redis primary; trying the known one again"
                        );
                    }
                    let second = self.link();
                    let outcome = request(second.connection).await;
                    self.note(&outcome, second.generation);
                    outcome.map(|value| (value, true))
                }
                outcome => outcome.map(|value| (value, false)),
            }
        };
        match timeout(limit, tries).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(err)) => Err(Failure::Redis(err)),
            Err(_) => {
                // redis-rs's own timeouts end a try before this; should
                // they not, the connection first tried is suspect. A new
                // one the second try was still opening is left alone.
                self.retire(generation);
                Err(Failure::NoReply)
            }
        }
    }

    /// Retires connection `generation` if `outcome` is a missing reply.
    fn note<T>(&self, outcome: &RedisResult<T>, generation: u64) {
        if outcome.as_ref().is_err_and(RedisError::is_timeout) {
            self.retire(generation);
        }
    }
}

/// Errors after which the command may not have reached the server, or its
/// reply may never come: worth one more try.
fn is_connection_error(err: &RedisError) -> bool {
    err.is_io_error() || err.is_connection_dropped() || err.is_connection_refusal()
}

//! Scenario 8: what replica acknowledgements cost. The uncontended cycle
//! of scenario 1 on a primary with one replica, both redis-servers the
//! benchmark starts for itself on free loopback ports (no persistence),
//! through dlock without and with `RedisBuilder::replica_acks(1, …)`.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use dlock::Backend;
use dlock::redis::RedisBackend;
use tokio::time::Instant;

use crate::Res;
use crate::cycle::{Row, dlock_row};

/// How long a replica has to acknowledge one acquisition. `WAIT` returns
/// as soon as the replica acknowledges, so this bounds only a failure: a
/// replica slowed by a loaded machine (the smoke run beside the test
/// suite) has time, and the figures are those of the acknowledgement.
/// Below the backend's response timeout (3 s), as `replica_acks` asks.
pub const ACK_WITHIN: Duration = Duration::from_secs(2);

/// A primary and its replica, stopped when dropped, with their directory.
pub struct Replicated {
    servers: Vec<Child>,
    /// The servers' working directory: a replica in sync stores the
    /// primary's snapshot there (`dump.rdb`), whatever `--save` says, so
    /// it must not be the directory the benchmark runs in.
    dir: std::path::PathBuf,
    /// The primary's URL.
    pub url: String,
}

fn free_port() -> Res<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn redis_server(port: u16, dir: &std::path::Path, extra: &[&str]) -> Res<Child> {
    Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .arg("--dir")
        .arg(dir)
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting redis-server (is it installed?): {e}").into())
}

impl Replicated {
    /// Starts both servers and waits until the replica is in sync.
    pub async fn start() -> Res<Self> {
        let (primary, replica) = (free_port()?, free_port()?);
        let dir =
            std::env::temp_dir().join(format!("dlock-bench-acks-{}-{primary}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let mut pair = Replicated {
            servers: Vec::new(),
            url: format!("redis://127.0.0.1:{primary}"),
            dir,
        };
        pair.servers.push(redis_server(primary, &pair.dir, &[])?);
        let replica_of = format!("127.0.0.1 {primary}");
        pair.servers.push(redis_server(
            replica,
            &pair.dir,
            &["--replicaof", &replica_of],
        )?);
        let replica_url = format!("redis://127.0.0.1:{replica}");
        let started = Instant::now();
        loop {
            if let Ok(client) = redis::Client::open(replica_url.as_str())
                && let Ok(mut conn) = client.get_multiplexed_async_connection().await
                && let Ok(info) = redis::cmd("INFO")
                    .arg("replication")
                    .query_async::<String>(&mut conn)
                    .await
                && info.contains("master_link_status:up")
            {
                return Ok(pair);
            }
            if started.elapsed() > Duration::from_secs(20) {
                return Err("the benchmark's replica never came in sync".into());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The two rows: dlock on the primary, and dlock waiting for the
    /// replica's acknowledgement of every acquisition.
    pub async fn rows(&self, run: &str) -> Res<Vec<Row>> {
        let plain: Arc<dyn Backend> = Arc::new(RedisBackend::connect(&self.url).await?);
        let acked: Arc<dyn Backend> = Arc::new(
            RedisBackend::builder(&self.url)
                .replica_acks(1, ACK_WITHIN)
                .connect()
                .await?,
        );
        Ok(vec![
            dlock_row("RedisBackend, primary + 1 replica", plain, run, "acks-off"),
            dlock_row(
                &format!(
                    "RedisBackend, primary + 1 replica, replica_acks(1, {} ms)",
                    ACK_WITHIN.as_millis()
                ),
                acked,
                run,
                "acks-on",
            ),
        ])
    }
}

impl Drop for Replicated {
    fn drop(&mut self) {
        for server in &mut self.servers {
            let _ = server.kill();
            let _ = server.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

//! Scenario 6: what one lock cycle costs the Redis server. Redis runs
//! commands on one thread, so a shared server's lock throughput is bounded
//! by the server time each cycle takes. Measured on a redis-server this
//! scenario starts for itself (nothing else talks to it), from the main
//! thread's own CPU time in `INFO cpu`, so the figure does not depend on how
//! the machine's cores are shared between the clients and the server.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock::{Backend, LockKey, LockOptions};
use redis::Script;
use redis::aio::MultiplexedConnection;

use crate::Res;
use crate::cycle::TTL;

/// Tasks cycling at once, each on a key of its own.
pub const TASKS: usize = 16;

/// The implementations measured, in report order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// dlock through its public API: `LockOptions::acquire_on` + `Lease::release`.
    Dlock,
    /// dlock's two scripts sent by hand.
    Floor,
    /// rslock: `SET NX PX` + its compare-and-delete script.
    Rslock,
    /// `SET NX PX` + `DEL`: no owner check, no token.
    Bare,
}

impl Protocol {
    pub const ALL: [Protocol; 4] = [
        Protocol::Dlock,
        Protocol::Floor,
        Protocol::Rslock,
        Protocol::Bare,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Protocol::Dlock => "dlock: LockOptions::acquire_on + Lease::release",
            Protocol::Floor => "floor: dlock's acquire + release scripts by hand",
            Protocol::Rslock => "rslock 0.10: SET NX PX + unlock script",
            Protocol::Bare => "bare SET NX PX + DEL (no owner check, no token)",
        }
    }
}

/// One command's line of `INFO commandstats` over a run.
#[derive(Clone, Debug)]
pub struct CommandCost {
    pub command: String,
    pub calls: u64,
    pub usec: u64,
}

/// What a run of cycles cost the server.
#[derive(Clone, Debug)]
pub struct Cost {
    pub protocol: Protocol,
    pub cycles: u64,
    /// Main-thread CPU (user + system), µs.
    pub cpu_us: f64,
    pub commands: Vec<CommandCost>,
    pub wall: Duration,
}

impl Cost {
    pub fn per_cycle(&self) -> f64 {
        self.cpu_us / self.cycles as f64
    }
}

/// A redis-server of the benchmark's own on a free loopback port, stopped
/// when dropped.
struct PrivateRedis {
    child: Child,
    url: String,
}

impl PrivateRedis {
    async fn start() -> Res<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting redis-server (is it installed?): {e}"))?;
        let server = PrivateRedis {
            child,
            url: format!("redis://127.0.0.1:{port}"),
        };
        let started = Instant::now();
        loop {
            if let Ok(mut conn) = server.connection().await
                && redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .is_ok()
            {
                return Ok(server);
            }
            if started.elapsed() > Duration::from_secs(10) {
                return Err(
                    format!("the private redis-server at {} never answered", server.url).into(),
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn connection(&self) -> Res<MultiplexedConnection> {
        Ok(redis::Client::open(self.url.as_str())?
            .get_multiplexed_async_connection()
            .await?)
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The server main thread's CPU time so far, in µs.
async fn main_thread_cpu_us(conn: &mut MultiplexedConnection) -> Res<f64> {
    let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await?;
    let field = |name: &str| -> Res<f64> {
        info.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .ok_or_else(|| format!("INFO cpu has no {name} (Redis 6.2 or newer reports it)"))?
            .trim()
            .parse::<f64>()
            .map_err(Into::into)
    };
    Ok((field("used_cpu_user_main_thread")? + field("used_cpu_sys_main_thread")?) * 1e6)
}

/// `INFO commandstats` as (command, calls, µs), busiest first.
async fn command_stats(conn: &mut MultiplexedConnection) -> Res<Vec<CommandCost>> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let mut costs: Vec<CommandCost> = info
        .lines()
        .filter_map(|line| {
            let (name, fields) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            let value = |key: &str| {
                fields
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
                    .and_then(|v| v.parse::<u64>().ok())
            };
            Some(CommandCost {
                command: name.to_owned(),
                calls: value("calls")?,
                usec: value("usec")?,
            })
        })
        // The measurement's own commands.
        .filter(|cost| !matches!(cost.command.as_str(), "info" | "config|resetstat"))
        .collect();
    costs.sort_by_key(|cost| std::cmp::Reverse(cost.usec));
    Ok(costs)
}

/// Runs `cycles` uncontended acquire + release cycles of each protocol on a
/// private redis-server and returns what each cost the server.
pub async fn measure(run: &str, cycles: u64) -> Res<Vec<Cost>> {
    let server = PrivateRedis::start().await?;
    let mut admin = server.connection().await?;
    let mut costs = Vec::new();
    for protocol in Protocol::ALL {
        let cycler = Cycler::new(protocol, &server.url, run).await?;
        // A warm-up: connections, script caches, the allocator.
        cycler.run(TASKS, 200.max(cycles / 20)).await?;
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut admin)
            .await?;
        let before = main_thread_cpu_us(&mut admin).await?;
        let started = Instant::now();
        let per_task = cycles.div_ceil(TASKS as u64);
        cycler.run(TASKS, per_task).await?;
        let wall = started.elapsed();
        let after = main_thread_cpu_us(&mut admin).await?;
        costs.push(Cost {
            protocol,
            cycles: per_task * TASKS as u64,
            cpu_us: after - before,
            commands: command_stats(&mut admin).await?,
            wall,
        });
    }
    Ok(costs)
}

/// One protocol, ready to cycle.
#[derive(Clone)]
enum Cycler {
    Dlock(Arc<dyn Backend>, String),
    Floor(MultiplexedConnection, Arc<Script>, Arc<Script>, String),
    Rslock(rslock::LockManager, String),
    Bare(MultiplexedConnection, String),
}

impl Cycler {
    async fn new(protocol: Protocol, url: &str, run: &str) -> Res<Self> {
        let conn = || async {
            Ok::<_, crate::BoxError>(
                redis::Client::open(url)?
                    .get_multiplexed_async_connection()
                    .await?,
            )
        };
        let tag = format!("bench:{run}:server");
        Ok(match protocol {
            Protocol::Dlock => Cycler::Dlock(
                Arc::new(dlock::redis::RedisBackend::connect(url).await?),
                tag,
            ),
            Protocol::Floor => Cycler::Floor(
                conn().await?,
                Arc::new(Script::new(dlock::redis::protocol::ACQUIRE_LUA)),
                Arc::new(Script::new(dlock::redis::protocol::RELEASE_LUA)),
                tag,
            ),
            Protocol::Rslock => Cycler::Rslock(rslock::LockManager::new(vec![url.to_owned()]), tag),
            Protocol::Bare => Cycler::Bare(conn().await?, tag),
        })
    }

    /// `tasks` tasks, each running `per_task` cycles on a key of its own.
    async fn run(&self, tasks: usize, per_task: u64) -> Res<()> {
        let handles: Vec<_> = (0..tasks)
            .map(|task| {
                let cycler = self.clone();
                tokio::spawn(async move {
                    for n in 0..per_task {
                        cycler.cycle(task, n).await?;
                    }
                    Ok::<_, crate::BoxError>(())
                })
            })
            .collect();
        for handle in handles {
            handle.await??;
        }
        Ok(())
    }

    async fn cycle(&self, task: usize, n: u64) -> Res<()> {
        let owner = crate::cycle::owner_hex(task, n);
        match self {
            Cycler::Dlock(backend, tag) => {
                let key = LockKey::new(format!("{tag}:dlock:{task}"))?;
                let lease = LockOptions::new(TTL)
                    .acquire_on(backend.clone(), &key)
                    .await?;
                lease.release().await?;
            }
            Cycler::Floor(conn, acquire, release, tag) => {
                let tag = format!("{tag}:floor:{task}");
                crate::cycle::floor_cycle(&mut conn.clone(), acquire, release, &tag, &owner)
                    .await?;
            }
            Cycler::Rslock(manager, tag) => {
                let key = format!("{tag}:rslock:{task}");
                let lock = manager
                    .lock(key.as_bytes(), TTL)
                    .await
                    .map_err(|e| format!("rslock: {e}"))?;
                manager.unlock(&lock).await;
            }
            Cycler::Bare(conn, tag) => {
                let key = format!("{tag}:bare:{task}");
                crate::cycle::bare_cycle(&mut conn.clone(), &key, &owner).await?;
            }
        }
        Ok(())
    }
}

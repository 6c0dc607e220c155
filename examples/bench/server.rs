//! Scenario 6: what one lock cycle costs the Redis server. Redis runs
//! commands on one thread, so a shared server's lock throughput is bounded
//! by the server time each cycle takes. Measured on a redis-server this
//! scenario starts for itself (nothing else talks to it), from the main
//! thread's own CPU time in `INFO cpu`, so the figure does not depend on how
//! the machine's cores are shared between the clients and the server.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock::{Backend, LockKey, LockMode, LockOptions};
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
    /// The same in shared mode (`LockOptions::mode(LockMode::Shared)`):
    /// each cycle a read phase of one reader.
    DlockShared,
    /// dlock's two scripts sent by hand.
    Floor,
    /// rslock: `SET NX PX` + its compare-and-delete script.
    Rslock,
    /// `SET NX PX` + `DEL`: no owner check, no token.
    Bare,
    /// dlock's protocol without the fencing token: `SET NX PX` in a script
    /// with dlock's arguments, and dlock's release script. What two
    /// scripts cost before any token is drawn.
    Tokenless,
}

/// The acquire script of [`Protocol::Tokenless`]: dlock's, token drawing
/// taken out.
const TOKENLESS_ACQUIRE_LUA: &str = r"
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('PTTL', KEYS[1])
end
return '0'
";

impl Protocol {
    pub const ALL: [Protocol; 6] = [
        Protocol::Dlock,
        Protocol::DlockShared,
        Protocol::Floor,
        Protocol::Tokenless,
        Protocol::Rslock,
        Protocol::Bare,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Protocol::Dlock => "dlock: LockOptions::acquire_on + Lease::release",
            Protocol::DlockShared => {
                "dlock, shared: LockOptions::mode(Shared).acquire_on + Lease::release"
            }
            Protocol::Floor => "floor: dlock's acquire + release scripts by hand",
            Protocol::Rslock => "rslock 0.10: SET NX PX + unlock script",
            Protocol::Bare => "bare SET NX PX + DEL (no owner check, no token)",
            Protocol::Tokenless => {
                "dlock's scripts without the token (SET NX PX in a script + dlock's release)"
            }
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

/// What the cycles of one implementation cost the server, over all rounds.
#[derive(Clone, Debug)]
pub struct Cost {
    pub protocol: Protocol,
    /// Cycles over all rounds.
    pub cycles: u64,
    /// Main-thread CPU (user + system) per cycle in each round, µs.
    pub rounds: Vec<f64>,
    /// `INFO commandstats`, summed over the rounds.
    pub commands: Vec<CommandCost>,
    pub wall: Duration,
}

impl Cost {
    /// The median round's server CPU per cycle, µs.
    pub fn per_cycle(&self) -> f64 {
        let mut rounds = self.rounds.clone();
        rounds.sort_by(f64::total_cmp);
        rounds.get(rounds.len() / 2).copied().unwrap_or(f64::NAN)
    }

    /// The lowest and highest round, µs per cycle.
    pub fn range(&self) -> (f64, f64) {
        let low = self.rounds.iter().copied().fold(f64::INFINITY, f64::min);
        let high = self
            .rounds
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        (low, high)
    }
}

/// A redis-server of the benchmark's own on a free loopback port, stopped
/// when dropped.
pub struct PrivateRedis {
    child: Child,
    /// Where it listens.
    pub url: String,
}

impl PrivateRedis {
    /// Starts one and waits until it answers.
    pub async fn start() -> Res<Self> {
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

    /// How many scripts (`EVALSHA`, `EVAL`) the server has run: each one
    /// round trip of an attempt, a release or a renewal, counted where they
    /// arrive, so an attempt a backend answers in process is not one.
    pub async fn script_calls(&self) -> Res<u64> {
        let mut conn = self.connection().await?;
        Ok(command_stats(&mut conn)
            .await?
            .iter()
            .filter(|cost| matches!(cost.command.as_str(), "evalsha" | "eval"))
            .map(|cost| cost.calls)
            .sum())
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

/// Runs `rounds` rounds of `cycles` uncontended acquire + release cycles of
/// each protocol on a private redis-server, the protocols interleaved (in
/// a rotated order each round, so none always runs first), and returns
/// what each cost the server.
pub async fn measure(run: &str, cycles: u64, rounds: usize) -> Res<Vec<Cost>> {
    let server = PrivateRedis::start().await?;
    let mut admin = server.connection().await?;
    let mut costs = Vec::new();
    let mut cyclers = Vec::new();
    for protocol in Protocol::ALL {
        let cycler = Cycler::new(protocol, &server.url, run).await?;
        // A warm-up: connections, script caches, the allocator.
        cycler.run(TASKS, 200.max(cycles / 20)).await?;
        cyclers.push(cycler);
        costs.push(Cost {
            protocol,
            cycles: 0,
            rounds: Vec::new(),
            commands: Vec::new(),
            wall: Duration::ZERO,
        });
    }
    let per_task = cycles.div_ceil(TASKS as u64);
    for round in 0..rounds {
        for i in 0..cyclers.len() {
            let which = (i + round) % cyclers.len();
            let _: () = redis::cmd("CONFIG")
                .arg("RESETSTAT")
                .query_async(&mut admin)
                .await?;
            let before = main_thread_cpu_us(&mut admin).await?;
            let started = Instant::now();
            cyclers[which].run(TASKS, per_task).await?;
            let wall = started.elapsed();
            let after = main_thread_cpu_us(&mut admin).await?;
            let cost = &mut costs[which];
            let done = per_task * TASKS as u64;
            cost.cycles += done;
            cost.rounds.push((after - before) / done as f64);
            cost.wall += wall;
            for command in command_stats(&mut admin).await? {
                match cost
                    .commands
                    .iter_mut()
                    .find(|c| c.command == command.command)
                {
                    Some(sum) => {
                        sum.calls += command.calls;
                        sum.usec += command.usec;
                    }
                    None => cost.commands.push(command),
                }
            }
        }
    }
    for cost in &mut costs {
        cost.commands.sort_by_key(|c| std::cmp::Reverse(c.usec));
    }
    Ok(costs)
}

/// One protocol, ready to cycle.
#[derive(Clone)]
enum Cycler {
    Dlock(Arc<dyn Backend>, LockMode, String),
    /// dlock's scripts, or the tokenless ones, by hand; the tag names which.
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
                LockMode::Exclusive,
                tag,
            ),
            Protocol::DlockShared => Cycler::Dlock(
                Arc::new(dlock::redis::RedisBackend::connect(url).await?),
                LockMode::Shared,
                format!("{tag}:shared"),
            ),
            Protocol::Floor => Cycler::Floor(
                conn().await?,
                Arc::new(Script::new(dlock::redis::protocol::ACQUIRE_LUA)),
                Arc::new(Script::new(dlock::redis::protocol::RELEASE_LUA)),
                tag,
            ),
            Protocol::Tokenless => Cycler::Floor(
                conn().await?,
                Arc::new(Script::new(TOKENLESS_ACQUIRE_LUA)),
                Arc::new(Script::new(dlock::redis::protocol::RELEASE_LUA)),
                format!("{tag}:tokenless"),
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
            Cycler::Dlock(backend, mode, tag) => {
                let key = LockKey::new(format!("{tag}:dlock:{task}"))?;
                let lease = LockOptions::new(TTL)
                    .mode(*mode)
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

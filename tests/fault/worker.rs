//! One worker process: until its deadline, take the run's lock through
//! `#[distributed_lock]` and read-modify-write the register under it (the
//! lock scenario, and the fair scenario with `fair = true`; the election
//! scenario's worker is `fault::election`), printing every step as
//! `EV <µs> <WHAT> <token> [detail]` on stdout:
//!
//! | what | when |
//! | --- | --- |
//! | `BEGIN` | the body starts: this worker now believes it holds the lock (fair scenario: `BEGIN t s`, the wait having begun at `s` µs; read-write scenario's readers: `BEGIN t shared`) |
//! | `READ v` / `RSTALE h` / `RERR` | the read, refused as stale, or failed |
//! | `SEND v` | the write of `v` is sent |
//! | `OK` / `STALE h` / `WERR` | the write was accepted, refused, or its answer lost |
//! | `LOST` | the lease's lost signal fired: belief ends |
//! | `END` | the body is over (or a `TAKE` lease released): belief ends |
//! | `TAKE` | an acquisition of an abandon round completed in time: held, released at once, the register untouched |
//! | `ABANDONED 0 n of m` | an abandon round is over: `n` of its `m` acquisitions were given up mid-flight |
//! | `TIMEOUT 0 s` | fair scenario: an acquisition that began at `s` µs waited its whole `wait` and timed out (the line's time is the end of the wait) |
//!
//! The permits scenario takes one of [`PERMITS`] permits of the key and
//! steps on its slot's resource; its lines name a lease `<token>@<slot>`
//! (tokens rise per slot). The read-write scenario's leases are half
//! writers (the lock scenario's `increment`) and half readers ([`touch`]:
//! `mode = "shared"`, two fenced reads and no write).
//!
//! `on_lost = "finish"`: a holder that was paused past its ttl carries on
//! and writes, as a real one would; only the fence can stop it.
//!
//! The fair scenario's lease is the lock scenario's ([`increment_fair`]:
//! the same body, `fair = true` and a longer wait, [`FAIR_WAIT`]), and its
//! abandon rounds queue as fair waiters too, so that giving up leaves the
//! queue mid-flight.
//!
//! Between leases a worker looks for an abandon order, a file the driver
//! writes into the run's scratch directory (see [`abandon_order`]): it then
//! makes one acquisition per listed moment and gives up on each at that
//! moment, as a caller whose own deadline ran out would.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use dlock::file::FileBackend;
use dlock::pg::fence::PgFence;
use dlock::pg::tokio_postgres::{self, NoTls};
use dlock::pg::{PgBackend, PgOptions};
use dlock::redis::RedisBackend;
use dlock::redis::fence::RedisFence;
use dlock::{
    FencingToken, LockError, LockKey, LockOptions, LostSignal, distributed_lock, registry,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::Mutex;
use tokio::time::timeout;

use super::now_us;
use super::rng::Rng;

/// The environment variable carrying a worker's configuration.
pub const WORKER_ENV: &str = "DLOCK_FAULT_WORKER";
/// The lock's ttl (the macro's `ttl`): the driver pauses past it.
pub const TTL: Duration = Duration::from_secs(1);
/// How long an acquisition waits for the held lock (the macro's `wait`).
const WAIT: Duration = Duration::from_secs(3);
/// How long a fair acquisition waits (the fair macro's `wait = "8s"`,
/// which must say the same): well past
/// the free time the checker allows a timed-out wait (`fault::check`, about
/// 1.5 s with no fault near, 6.5 s with a vanished waiter ahead), so that a
/// waiter left waiting while the key lay free shows.
pub const FAIR_WAIT: Duration = Duration::from_secs(8);
/// How long one register operation may take before its answer counts as
/// lost (the write's outcome is then settled by the checker).
const OP_TIMEOUT: Duration = Duration::from_millis(1500);

/// The permits scenario: how many holders the run's key admits
/// (`LockOptions::permits`), the bound the checker holds the accepted
/// writes to.
pub const PERMITS: u32 = 2;

/// The fenced resource of permit slot `slot` of the run: a slot's token
/// rises per slot, so each slot is fenced as a resource of its own.
pub fn slot_resource(run: &str, slot: u32) -> String {
    format!("{run}:pool:{slot}")
}

/// The PostgreSQL table of the register (one row per run).
pub const PG_REGISTER_TABLE: &str = "dlock_fault_register";

/// A worker's configuration, passed through [`WORKER_ENV`].
#[derive(Clone, Debug)]
pub struct Config {
    /// `lock`, `fair` or `election`.
    pub scenario: String,
    pub lock: String,
    pub lock_target: String,
    pub register: String,
    pub register_target: String,
    pub run: String,
    pub slot: usize,
    pub fenced: bool,
    /// Election scenario: a leader checks its term before each step and
    /// records when it learns of a loss (off: the negative run).
    pub heeds_term: bool,
    pub deadline_us: u64,
    pub seed: u64,
    /// PostgreSQL locks: the schema of the token sequence, the run's own.
    pub pg_schema: String,
    /// The run's scratch directory, where the driver leaves abandon orders.
    pub scratch: String,
    /// Which process of the run this is (the driver counts them from 0 as
    /// it starts and restarts them): with the seed, what its own choices
    /// are drawn from.
    pub process: usize,
}

impl Config {
    pub fn encode(&self) -> String {
        [
            self.scenario.clone(),
            self.lock.clone(),
            self.lock_target.clone(),
            self.register.clone(),
            self.register_target.clone(),
            self.run.clone(),
            self.slot.to_string(),
            u8::from(self.fenced).to_string(),
            u8::from(self.heeds_term).to_string(),
            self.deadline_us.to_string(),
            self.seed.to_string(),
            self.pg_schema.clone(),
            self.scratch.clone(),
            self.process.to_string(),
        ]
        .join("\u{1f}")
    }

    pub fn decode(text: &str) -> Option<Self> {
        let parts: Vec<&str> = text.split('\u{1f}').collect();
        let [
            scenario,
            lock,
            lock_target,
            register,
            register_target,
            run,
            slot,
            fenced,
            heeds_term,
            deadline,
            seed,
            pg_schema,
            scratch,
            process,
        ] = parts.as_slice()
        else {
            return None;
        };
        Some(Self {
            scenario: scenario.to_string(),
            lock: lock.to_string(),
            lock_target: lock_target.to_string(),
            register: register.to_string(),
            register_target: register_target.to_string(),
            run: run.to_string(),
            slot: slot.parse().ok()?,
            fenced: *fenced == "1",
            heeds_term: *heeds_term == "1",
            deadline_us: deadline.parse().ok()?,
            seed: seed.parse().ok()?,
            pg_schema: pg_schema.to_string(),
            scratch: scratch.to_string(),
            process: process.parse().ok()?,
        })
    }
}

/// The key `#[distributed_lock(key = "dlock-fault:{run}")]` builds, for
/// the driver and for acquisitions made without the macro.
pub fn lock_key(run: &str) -> LockKey {
    LockKey::builder()
        .lit("dlock-fault:")
        .value(&run)
        .finish()
        .expect("lock key")
}

/// Where the driver leaves an abandon order for the worker of `slot`.
pub fn abandon_order(scratch: &std::path::Path, slot: usize) -> std::path::PathBuf {
    scratch.join(format!("abandon-{slot}"))
}

/// Writes an abandon order: one acquisition per moment, given up on after
/// it. Written aside and renamed into place, so the worker never reads half
/// of one.
pub fn order_abandon(scratch: &std::path::Path, slot: usize, give_up_after: &[Duration]) {
    let text: Vec<String> = give_up_after
        .iter()
        .map(|d| d.as_micros().to_string())
        .collect();
    let order = abandon_order(scratch, slot);
    let aside = order.with_extension("new");
    std::fs::write(&aside, text.join(" ")).expect("write an abandon order");
    std::fs::rename(&aside, &order).expect("place an abandon order");
}

/// Takes this worker's abandon order, if the driver left one.
fn take_abandon_order(config: &Config) -> Option<Vec<Duration>> {
    let order = abandon_order(std::path::Path::new(&config.scratch), config.slot);
    let text = std::fs::read_to_string(&order).ok()?;
    let _ = std::fs::remove_file(&order);
    Some(
        text.split_whitespace()
            .filter_map(|us| us.parse().ok())
            .map(Duration::from_micros)
            .collect(),
    )
}

/// One abandon round: an acquisition of the run's lock per moment, each
/// given up on (its future dropped) when its moment comes. One that
/// completes first is released at once, without touching the register.
/// Fair: the acquisitions are the fair macro's (a fair waiter given up on
/// leaves the queue, or passes on a handoff that reached it meanwhile).
/// Permits: the acquisitions take a permit (a `TAKE` names its slot).
async fn abandon_round(run: &str, give_up_after: &[Duration], fair: bool, permits: bool) {
    let options = if fair {
        LockOptions::new(TTL).wait(FAIR_WAIT).fair(true)
    } else if permits {
        LockOptions::new(TTL).wait(WAIT).permits(PERMITS)
    } else {
        LockOptions::new(TTL).wait(WAIT)
    }
    .backend("fault");
    let key = lock_key(run);
    let mut abandoned = 0;
    for &moment in give_up_after {
        match timeout(moment, options.acquire(&key)).await {
            Err(_) => abandoned += 1,
            Ok(Ok(lease)) => {
                let token = match lease.slot() {
                    Some(slot) => format!("{}@{slot}", lease.token()),
                    None => lease.token().to_string(),
                };
                say(&format!("TAKE {token}"));
                let _ = lease.release().await;
                say(&format!("END {token}"));
            }
            Ok(Err(err)) if err.is_contention() => {}
            Ok(Err(err)) => say(&format!("LERR 0 {}", one_line(&err.to_string()))),
        }
    }
    say(&format!(
        "ABANDONED 0 {abandoned} of {}",
        give_up_after.len()
    ));
}

/// Prints one event line, `EV <µs> <line>`.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "EV {} {line}", now_us());
    let _ = out.flush();
}

/// The register as a worker sees it: fenced (the resource checks the
/// token) or, for the negative run, plain reads and writes.
#[allow(clippy::large_enum_variant)] // one per worker process
pub enum Register {
    Pg {
        conn: String,
        client: Mutex<Option<tokio_postgres::Client>>,
        resource: String,
        fence: PgFence,
        fenced: bool,
    },
    Redis {
        conn: ConnectionManager,
        resource: String,
        fence: RedisFence,
        fenced: bool,
    },
}

/// How a register operation ended.
pub enum Answer<T> {
    Done(T),
    Stale(FencingToken),
    Failed(String),
}

impl Register {
    pub async fn connect(config: &Config) -> Result<Self, String> {
        let resource = config.run.clone();
        match config.register.as_str() {
            "pg" => Ok(Register::Pg {
                conn: config.register_target.clone(),
                client: Mutex::new(None),
                resource,
                fence: PgFence::new(),
                fenced: config.fenced,
            }),
            "redis" => {
                let client = redis::Client::open(config.register_target.as_str())
                    .map_err(|e| e.to_string())?;
                let manager = ConnectionManager::new_with_config(
                    client,
                    ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(Duration::from_secs(1)))
                        .set_response_timeout(Some(OP_TIMEOUT)),
                )
                .await
                .map_err(|e| e.to_string())?;
                Ok(Register::Redis {
                    conn: manager,
                    resource,
                    fence: RedisFence::new(),
                    fenced: config.fenced,
                })
            }
            other => Err(format!("unknown register {other}")),
        }
    }

    /// The run's register: the resource every lease of the lock, fair,
    /// election and read-write scenarios reads and writes.
    pub fn resource(&self) -> &str {
        match self {
            Register::Pg { resource, .. } | Register::Redis { resource, .. } => resource,
        }
    }

    /// Reads the register (recording the token, when fenced).
    pub async fn read(&self, token: FencingToken) -> Answer<String> {
        self.read_on(self.resource(), token).await
    }

    /// Writes `value` (fenced by the token, when fenced).
    pub async fn write(&self, token: FencingToken, value: &str) -> Answer<()> {
        self.write_on(self.resource(), token, value).await
    }

    /// Reads the fenced resource `resource` (the permits scenario fences
    /// each slot as a resource of its own, `<run>:pool:<slot>`).
    pub async fn read_on(&self, resource: &str, token: FencingToken) -> Answer<String> {
        match self {
            Register::Redis {
                conn,
                fence,
                fenced,
                ..
            } => {
                let mut conn = conn.clone();
                let read = if *fenced {
                    fence.read(&mut conn, resource, token).await
                } else {
                    redis::cmd("HGET")
                        .arg(fence.key(resource))
                        .arg("value")
                        .query_async::<Option<Vec<u8>>>(&mut conn)
                        .await
                        .map_err(|e| {
                            LockError::backend("redis", dlock::error::Operation::Fence, "", e)
                        })
                };
                match read {
                    Ok(value) => Answer::Done(value.map_or_else(
                        || "0:0".to_owned(),
                        |v| String::from_utf8_lossy(&v).into_owned(),
                    )),
                    Err(LockError::StaleToken { highest, .. }) => Answer::Stale(highest),
                    Err(err) => Answer::Failed(err.to_string()),
                }
            }
            Register::Pg { .. } => {
                self.pg_transaction(resource, token, |tx, resource| {
                    Box::pin(async move {
                        let row = tx
                            .query_one(
                                &format!(
                                    "SELECT value FROM {PG_REGISTER_TABLE} WHERE resource = $1"
                                ),
                                &[&resource],
                            )
                            .await
                            .map_err(|e| e.to_string())?;
                        row.try_get::<_, String>(0).map_err(|e| e.to_string())
                    })
                })
                .await
            }
        }
    }

    /// Writes `value` to `resource` (fenced by the token, when fenced).
    pub async fn write_on(&self, resource: &str, token: FencingToken, value: &str) -> Answer<()> {
        match self {
            Register::Redis {
                conn,
                fence,
                fenced,
                ..
            } => {
                let mut conn = conn.clone();
                let written = if *fenced {
                    fence.write(&mut conn, resource, token, value).await
                } else {
                    redis::cmd("HSET")
                        .arg(fence.key(resource))
                        .arg("value")
                        .arg(value)
                        .query_async::<()>(&mut conn)
                        .await
                        .map_err(|e| {
                            LockError::backend("redis", dlock::error::Operation::Fence, "", e)
                        })
                };
                match written {
                    Ok(()) => Answer::Done(()),
                    Err(LockError::StaleToken { highest, .. }) => Answer::Stale(highest),
                    Err(err) => Answer::Failed(err.to_string()),
                }
            }
            Register::Pg { .. } => {
                let value = value.to_owned();
                self.pg_transaction(resource, token, move |tx, resource| {
                    Box::pin(async move {
                        tx.execute(
                            &format!(
                                "UPDATE {PG_REGISTER_TABLE} SET value = $2 WHERE resource = $1"
                            ),
                            &[&resource, &value],
                        )
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                    })
                })
                .await
            }
        }
    }

    /// One PostgreSQL transaction: the fence first (when fenced), then
    /// `body`, then COMMIT; all of it bounded by [`OP_TIMEOUT`]. A failed or
    /// timed-out transaction drops the connection (a new one is opened next
    /// time), so nothing half-done lingers on it.
    async fn pg_transaction<T>(
        &self,
        resource: &str,
        token: FencingToken,
        body: impl for<'a> FnOnce(
            &'a tokio_postgres::Transaction<'a>,
            &'a str,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<T, String>> + Send + 'a>,
        >,
    ) -> Answer<T> {
        let Register::Pg {
            conn,
            client,
            fence,
            fenced,
            ..
        } = self
        else {
            return Answer::Failed("not a PostgreSQL register".into());
        };
        let mut slot = client.lock().await;
        let attempt = timeout(OP_TIMEOUT, async {
            if slot.as_ref().is_none_or(tokio_postgres::Client::is_closed) {
                let (fresh, connection) = tokio_postgres::connect(conn, NoTls)
                    .await
                    .map_err(|e| Err(e.to_string()))?;
                tokio::spawn(connection);
                *slot = Some(fresh);
            }
            let Some(client) = slot.as_mut() else {
                return Err(Err("no connection".to_owned()));
            };
            let tx = client.transaction().await.map_err(|e| Err(e.to_string()))?;
            if *fenced {
                match fence.accept(&tx, resource, token).await {
                    Ok(()) => {}
                    Err(LockError::StaleToken { highest, .. }) => return Err(Ok(highest)),
                    Err(err) => return Err(Err(err.to_string())),
                }
            }
            let out = body(&tx, resource).await.map_err(Err)?;
            tx.commit().await.map_err(|e| Err(e.to_string()))?;
            Ok(out)
        })
        .await;
        match attempt {
            Ok(Ok(out)) => Answer::Done(out),
            // The transaction is dropped unfinished: rolled back.
            Ok(Err(Ok(highest))) => Answer::Stale(highest),
            Ok(Err(Err(err))) => {
                *slot = None;
                Answer::Failed(err)
            }
            Err(_) => {
                *slot = None;
                Answer::Failed("timed out".into())
            }
        }
    }
}

/// One lease: read, work (the moment the driver likes to pause or cut),
/// write `count + 1`.
#[distributed_lock(
    key = "dlock-fault:{run}",
    ttl = "1s",
    wait = "3s",
    backend = "fault",
    on_lost = "finish"
)]
async fn increment(
    run: String,
    register: Arc<Register>,
    work: Duration,
    token: FencingToken,
    lost: LostSignal,
) -> Result<(), LockError> {
    lease(&register, work, token, lost, None).await;
    Ok(())
}

/// [`increment`] taken in fair mode: waiters queue in arrival order and a
/// release hands the key to the first. The wait is [`FAIR_WAIT`].
#[distributed_lock(
    key = "dlock-fault:{run}",
    ttl = "1s",
    wait = "8s",
    fair = true,
    backend = "fault",
    on_lost = "finish"
)]
async fn increment_fair(
    run: String,
    register: Arc<Register>,
    work: Duration,
    waited_since_us: u64,
    token: FencingToken,
    lost: LostSignal,
) -> Result<(), LockError> {
    lease(&register, work, token, lost, Some(waited_since_us)).await;
    Ok(())
}

/// The body of both: `BEGIN` (with when the wait began, if given), the
/// step, `END`; `LOST` whenever the lost signal fires meanwhile.
async fn lease(
    register: &Register,
    work: Duration,
    token: FencingToken,
    lost: LostSignal,
    waited_since_us: Option<u64>,
) {
    let tag = token.to_string();
    match waited_since_us {
        Some(since) => say(&format!("BEGIN {tag} {since}")),
        None => say(&format!("BEGIN {tag}")),
    }
    let watcher = watch_lost(lost, tag.clone());
    lease_body(register, register.resource(), work, token, &tag).await;
    say(&format!("END {tag}"));
    watcher.abort();
}

/// Prints `LOST <tag>` when the lease's lost signal fires.
fn watch_lost(lost: LostSignal, tag: String) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        lost.lost().await;
        say(&format!("LOST {tag}"));
    })
}

/// One step on `resource`: read, work, write `count + 1`; every line
/// names the lease by `tag` (its token; permits: `<token>@<slot>`).
async fn lease_body(
    register: &Register,
    resource: &str,
    work: Duration,
    token: FencingToken,
    tag: &str,
) {
    let read = match register.read_on(resource, token).await {
        Answer::Done(value) => value,
        Answer::Stale(highest) => return say(&format!("RSTALE {tag} {highest}")),
        Answer::Failed(err) => return say(&format!("RERR {tag} {}", one_line(&err))),
    };
    say(&format!("READ {tag} {read}"));
    let count: u64 = read
        .split(':')
        .next()
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    tokio::time::sleep(work).await;
    let value = format!("{}:{token}", count + 1);
    say(&format!("SEND {tag} {value}"));
    match register.write_on(resource, token, &value).await {
        Answer::Done(()) => say(&format!("OK {tag}")),
        Answer::Stale(highest) => say(&format!("STALE {tag} {highest}")),
        Answer::Failed(err) => say(&format!("WERR {tag} {}", one_line(&err))),
    }
}

/// The read-write scenario's reader: `#[distributed_lock(mode =
/// "shared")]` on the run's key. It touches the register (a fenced read,
/// which records its token: the resource fences readers and writers with
/// one `>=` rule), works, and touches it again, the second touch being
/// the one a pause or a partition delays past the ttl.
#[distributed_lock(
    key = "dlock-fault:{run}",
    ttl = "1s",
    wait = "3s",
    mode = "shared",
    backend = "fault",
    on_lost = "finish"
)]
async fn touch(
    run: String,
    register: Arc<Register>,
    work: Duration,
    token: FencingToken,
    lost: LostSignal,
) -> Result<(), LockError> {
    let tag = token.to_string();
    say(&format!("BEGIN {tag} shared"));
    let watcher = watch_lost(lost, tag.clone());
    for pass in 0..2 {
        if pass == 1 {
            tokio::time::sleep(work).await;
        }
        match register.read(token).await {
            Answer::Done(value) => say(&format!("READ {tag} {value}")),
            Answer::Stale(highest) => {
                say(&format!("RSTALE {tag} {highest}"));
                break;
            }
            Answer::Failed(err) => {
                say(&format!("RERR {tag} {}", one_line(&err)));
                break;
            }
        }
    }
    say(&format!("END {tag}"));
    watcher.abort();
    Ok(())
}

/// The permits scenario's lease: one of [`PERMITS`] permits of the run's
/// key, taken through `LockOptions::permits` (the macro's `permits = 2`;
/// the macro binds no slot, and the body needs it), and one step on the
/// slot's own fenced resource ([`slot_resource`]). Lines name the lease
/// `<token>@<slot>`.
async fn permit(config: &Config, register: &Register, work: Duration) -> Result<(), LockError> {
    let lease = LockOptions::new(TTL)
        .wait(WAIT)
        .permits(PERMITS)
        .backend("fault")
        .acquire(lock_key(&config.run))
        .await?;
    let token = lease.token();
    // A permit lease always has a slot; `u32::MAX` would be a slot out of
    // range, which the checker reports.
    let slot = lease.slot().unwrap_or(u32::MAX);
    let tag = format!("{token}@{slot}");
    say(&format!("BEGIN {tag}"));
    let watcher = watch_lost(lease.lost_signal(), tag.clone());
    lease_body(
        register,
        &slot_resource(&config.run, slot),
        work,
        token,
        &tag,
    )
    .await;
    say(&format!("END {tag}"));
    watcher.abort();
    // A lost lease's release may fail: the slot is gone already.
    let _ = lease.release().await;
    Ok(())
}

pub fn one_line(text: &str) -> String {
    text.replace(['\n', '\r'], " ")
}

/// The worker's main loop; returns when the deadline has passed.
pub fn main(config: Config) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        // A restarted worker may come up while its server is down or its
        // link frozen: it keeps trying until the deadline.
        if !register_lock_backend(&config).await {
            return;
        }
        let register = loop {
            match Register::connect(&config).await {
                Ok(register) => break Arc::new(register),
                Err(err) if now_us() < config.deadline_us => {
                    say(&format!("RERR 0 {}", one_line(&err)));
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(_) => return,
            }
        };
        match config.scenario.as_str() {
            "election" => super::election::campaign(&config, register).await,
            _ => take_leases(&config, register).await,
        }
    });
}

/// Registers the run's lock backend as `"fault"`, retrying until the
/// deadline; false if the deadline came first.
async fn register_lock_backend(config: &Config) -> bool {
    loop {
        let registered = match config.lock.as_str() {
            "file" => FileBackend::open(&config.lock_target).map(|b| {
                registry().register("fault", b);
            }),
            "redis" => RedisBackend::builder(&config.lock_target)
                .connect_timeout(Duration::from_secs(1))
                .response_timeout(Duration::from_millis(500))
                .connect()
                .await
                .map(|b| {
                    registry().register("fault", b);
                }),
            "pg" => PgBackend::connect_with(
                &config.lock_target,
                PgOptions::new()
                    .schema(config.pg_schema.as_str())
                    .sessions(1)
                    .wait_sessions(1)
                    .connect_timeout(Duration::from_secs(2))
                    .liveness_interval(Duration::from_millis(500))
                    .server_idle_timeout(Some(Duration::from_millis(1500))),
            )
            .await
            .map(|b| {
                registry().register("fault", b);
            }),
            #[cfg(feature = "etcd")]
            "etcd" => dlock::etcd::EtcdBackend::builder(&[config.lock_target.as_str()])
                .connect_timeout(Duration::from_secs(1))
                .response_timeout(Duration::from_millis(500))
                .connect()
                .await
                .map(|b| {
                    registry().register("fault", b);
                }),
            other => panic!("unknown lock backend {other}"),
        };
        match registered {
            Ok(()) => return true,
            Err(_) if now_us() >= config.deadline_us => return false,
            Err(err) => {
                say(&format!("LERR 0 {}", one_line(&err.to_string())));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// The lock and fair scenarios: lease after lease until the deadline. A
/// fair acquisition that timed out prints `TIMEOUT` with the moment its
/// wait began.
async fn take_leases(config: &Config, register: Arc<Register>) {
    let fair = config.scenario == "fair";
    let permits = config.scenario == "permits";
    let mut rng = Rng::new(config.seed ^ (config.process as u64 + 1).wrapping_mul(0x9E37_79B9));
    while now_us() < config.deadline_us {
        if let Some(give_up_after) = take_abandon_order(config) {
            abandon_round(&config.run, &give_up_after, fair, permits).await;
        }
        let work = Duration::from_millis(rng.range(30, 90));
        let began_us = now_us();
        let taken = match config.scenario.as_str() {
            "fair" => increment_fair(config.run.clone(), register.clone(), work, began_us).await,
            "permits" => permit(config, &register, work).await,
            // Read-write: half the leases write, half read.
            "rw" if rng.chance(50) => touch(config.run.clone(), register.clone(), work).await,
            _ => increment(config.run.clone(), register.clone(), work).await,
        };
        match taken {
            Ok(()) => {}
            Err(LockError::Timeout { .. }) if fair => say(&format!("TIMEOUT 0 {began_us}")),
            Err(err) if err.is_contention() => {}
            Err(err) => {
                say(&format!("LERR 0 {}", one_line(&err.to_string())));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.range(0, 20))).await;
    }
}

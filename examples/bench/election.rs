//! Scenario 7: leader election failover. Three campaigner processes (this
//! program started again with `--campaigner`, each with a backend of its
//! own) lead one election with `Election::lead`; the benchmark makes the
//! leader resign, or kills it, and times how long until another one's
//! work starts. Instants are read from CLOCK_REALTIME (`SystemTime`), the
//! one clock every process of the host shares.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use dlock::election::Election;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::{Child, ChildStdin};
use tokio::sync::{Mutex, mpsc, watch};
use tokio::time::{Instant, sleep, timeout};

use crate::cross::{self, now_ns};
use crate::stats::Measured;
use crate::{Config, Res};

/// Campaigners kept running.
pub const CAMPAIGNERS: usize = 3;
/// The election's ttl: how long Redis, which cannot see a process die,
/// keeps a killed leader's term at most.
pub const TTL: Duration = Duration::from_secs(2);
/// Uncontended campaigns timed per backend, for context.
pub const SOLO_CAMPAIGNS: usize = 20;
/// Pause after a campaigner starts campaigning, so that it is waiting
/// (its first attempt refused, its wake-up registered) before the next
/// failover.
const SETTLE: Duration = Duration::from_millis(200);
/// The longest any one step may take before the benchmark gives up.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// What the failovers on one backend took.
#[derive(Debug, Default)]
pub struct Outcome {
    /// From just before the leader's `resign()` to the next leader's work.
    pub resigned: Measured,
    /// From just before the leader's SIGKILL to the next leader's work.
    pub killed: Measured,
    /// One uncontended `Election::campaign` on the same backend.
    pub campaign: Measured,
}

/// Writes one line for the benchmark and flushes it at once.
fn say(line: std::fmt::Arguments<'_>) -> Res<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(line)?;
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(())
}

/// The campaigner's side. Prints `campaigning NS` before each campaign,
/// `leading NS TOKEN` as its leader's work starts and `resigned NS`, with
/// the instant the work returned, once `lead` has resigned. Reads its
/// orders on stdin: `resign` (the leader's work returns) and `campaign`
/// (a campaigner that resigned campaigns again). Stops when stdin closes.
pub async fn campaigner(
    cfg: &Config,
    backend: &str,
    name: &str,
    dir: &Path,
    ttl: Duration,
) -> Res<()> {
    let backend = cross::connect(cfg, backend, dir).await?;
    let identity = format!("bench campaigner (pid {})", std::process::id());
    let election = Election::new(name, identity, ttl)?.on(backend);
    let (send, orders) = mpsc::unbounded_channel::<String>();
    let (stdin_closed, closed) = watch::channel(false);
    tokio::spawn(async move {
        let mut lines = BufReader::new(tokio::io::stdin()).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let _ = send.send(line);
        }
        let _ = stdin_closed.send(true);
    });
    let orders = Arc::new(Mutex::new(orders));
    loop {
        say(format_args!("campaigning {}", now_ns()))?;
        let mut closed = closed.clone();
        let stop = async move {
            let _ = closed.wait_for(|closed| *closed).await;
        };
        let led = election
            .lead_until(
                |term| {
                    let orders = Arc::clone(&orders);
                    async move {
                        say(format_args!("leading {} {}", now_ns(), term.token()))?;
                        // Leads until told to resign (or until stdin closes).
                        let told = orders.lock().await.recv().await.is_some();
                        // `lead` calls `resign()` right after the work returns.
                        Ok::<_, crate::BoxError>(told.then(now_ns))
                    }
                },
                stop,
            )
            .await?;
        match led.transpose()? {
            Some(Some(resigning)) => say(format_args!("resigned {resigning}"))?,
            // Stdin closed: the benchmark is over.
            _ => return Ok(()),
        }
        // Campaign again only when told, once another campaigner (already
        // waiting) has been elected.
        if orders.lock().await.recv().await.is_none() {
            return Ok(());
        }
    }
}

/// A line a campaigner printed.
#[derive(Clone, Copy, Debug)]
enum Said {
    Campaigning,
    Leading(u128),
    Resigned(u128),
}

impl Said {
    fn parse(line: &str) -> Option<Self> {
        let mut words = line.split_whitespace();
        let what = words.next()?;
        let at = words.next()?.parse().ok()?;
        match what {
            "campaigning" => Some(Said::Campaigning),
            "leading" => Some(Said::Leading(at)),
            "resigned" => Some(Said::Resigned(at)),
            _ => None,
        }
    }
}

/// One campaigner process, by the benchmark's number for it.
struct Campaigner {
    child: Child,
    orders: ChildStdin,
}

/// The campaigners of one election and what they said.
struct Campaign<'a> {
    cfg: &'a Config,
    backend: &'a str,
    name: String,
    dir: String,
    campaigners: HashMap<usize, Campaigner>,
    started: usize,
    said: mpsc::UnboundedSender<(usize, Said)>,
    heard: mpsc::UnboundedReceiver<(usize, Said)>,
    /// The campaigner leading last we heard, and since when.
    leader: Option<(usize, u128)>,
}

impl<'a> Campaign<'a> {
    fn new(cfg: &'a Config, backend: &'a str, dir: &Path) -> Self {
        let (said, heard) = mpsc::unbounded_channel();
        Campaign {
            cfg,
            backend,
            name: format!("bench:{}:election:{backend}", cfg.run),
            dir: dir.display().to_string(),
            campaigners: HashMap::new(),
            started: 0,
            said,
            heard,
            leader: None,
        }
    }

    /// Starts one more campaigner; returns its number.
    fn start(&mut self) -> Res<usize> {
        let id = self.started;
        self.started += 1;
        let ttl_ms = TTL.as_millis().to_string();
        let mut child = cross::spawn_self(
            self.cfg,
            &["--campaigner", self.backend, &self.name, &self.dir, &ttl_ms],
            Stdio::piped(),
        )?;
        let orders = child.stdin.take().ok_or("campaigner without stdin")?;
        let stdout = child.stdout.take().ok_or("campaigner without stdout")?;
        let said = self.said.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(what) = Said::parse(&line)
                    && said.send((id, what)).is_err()
                {
                    return;
                }
            }
        });
        self.campaigners.insert(id, Campaigner { child, orders });
        Ok(id)
    }

    /// The next line any campaigner prints.
    async fn hear(&mut self, awaited: &str) -> Res<(usize, Said)> {
        let heard = timeout(STEP_TIMEOUT, self.heard.recv()).await;
        let Ok(Some((id, what))) = heard else {
            return Err(format!(
                "election on {}: no {awaited} within {STEP_TIMEOUT:?}",
                self.backend
            )
            .into());
        };
        if let Said::Leading(at) = what {
            self.leader = Some((id, at));
        }
        Ok((id, what))
    }

    async fn order(&mut self, id: usize, order: &str) -> Res<()> {
        let campaigner = self
            .campaigners
            .get_mut(&id)
            .ok_or("order to a campaigner that is gone")?;
        campaigner.orders.write_all(order.as_bytes()).await?;
        campaigner.orders.write_all(b"\n").await?;
        campaigner.orders.flush().await?;
        Ok(())
    }

    async fn campaigning(&mut self, id: usize) -> Res<()> {
        while !matches!(self.hear("campaign").await?, (who, Said::Campaigning) if who == id) {}
        sleep(SETTLE).await;
        Ok(())
    }

    /// The instant another campaigner than `former` starts leading.
    async fn next_leader(&mut self, former: usize) -> Res<u128> {
        loop {
            if let (who, Said::Leading(at)) = self.hear("new leader").await?
                && who != former
            {
                return Ok(at);
            }
        }
    }

    fn leader(&self) -> Res<(usize, u128)> {
        self.leader
            .ok_or_else(|| format!("election on {}: nobody leads", self.backend).into())
    }

    /// The leader resigns: from just before its `resign()` to the next
    /// leader's work. It then campaigns again.
    async fn resign(&mut self) -> Res<Duration> {
        let (former, _) = self.leader()?;
        self.order(former, "resign").await?;
        // The two lines come through different pipes, in either order.
        let (mut resigned, mut next) = (None, None);
        let (resigned, next) = loop {
            match self.hear("resignation and new leader").await? {
                (who, Said::Resigned(at)) if who == former => resigned = Some(at),
                (who, Said::Leading(at)) if who != former => next = Some(at),
                _ => {}
            }
            if let (Some(resigned), Some(next)) = (resigned, next) {
                break (resigned, next);
            }
        };
        self.order(former, "campaign").await?;
        self.campaigning(former).await?;
        Ok(nanos(next.saturating_sub(resigned)))
    }

    /// The leader is killed (SIGKILL) at `phase` (0..1) of its renewal
    /// period: from just before the kill to the next leader's work. A new
    /// campaigner takes its place.
    async fn kill(&mut self, phase: f64) -> Res<Duration> {
        let (former, since) = self.leader()?;
        // Renewals go out every third of the ttl from the election on, so
        // the term a store that cannot see the death keeps depends on
        // when in that period the leader dies.
        let period = (TTL / 3).as_nanos();
        let earliest = now_ns() + SETTLE.as_nanos();
        let mut at = since + (period as f64 * phase) as u128;
        if at < earliest {
            at += (earliest - at).div_ceil(period) * period;
        }
        sleep(nanos(at.saturating_sub(now_ns()))).await;
        let mut campaigner = self
            .campaigners
            .remove(&former)
            .ok_or("the leader is gone")?;
        let killed = now_ns();
        campaigner.child.start_kill()?;
        let next = self.next_leader(former).await?;
        campaigner.child.wait().await?;
        let id = self.start()?;
        self.campaigning(id).await?;
        Ok(nanos(next.saturating_sub(killed)))
    }

    /// Closes every campaigner's stdin (the leader resigns, the others
    /// stop campaigning) and waits for them to exit.
    async fn finish(self) -> Res<()> {
        for (id, Campaigner { mut child, orders }) in self.campaigners {
            drop(orders);
            let status = timeout(STEP_TIMEOUT, child.wait()).await??;
            if !status.success() {
                return Err(format!("campaigner {id} on {} failed: {status}", self.backend).into());
            }
        }
        Ok(())
    }
}

fn nanos(ns: u128) -> Duration {
    Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
}

/// Times `resignations` resignations and `kills` kills of the leader of a
/// fresh election on `backend`, with [`CAMPAIGNERS`] campaigners.
pub async fn run(cfg: &Config, backend: &str, resignations: usize, kills: usize) -> Res<Outcome> {
    let dir = std::env::temp_dir().join(format!("dlock-bench-{}-election", cfg.run));
    std::fs::create_dir_all(&dir)?;
    let mut outcome = Outcome::default();

    // Context: what one uncontended campaign (an acquisition with an
    // identity) and resignation take on this backend, from this process.
    let store = cross::connect(cfg, backend, &dir).await?;
    let solo = Election::new(
        format!("bench:{}:election:{backend}:solo", cfg.run),
        format!("bench (pid {})", std::process::id()),
        TTL,
    )?
    .on(store);
    for _ in 0..SOLO_CAMPAIGNS {
        let started = Instant::now();
        let leadership = solo.campaign().await?;
        outcome.campaign.samples.push(started.elapsed());
        leadership.resign().await?;
    }

    let mut campaign = Campaign::new(cfg, backend, &dir);
    for _ in 0..CAMPAIGNERS {
        campaign.start()?;
    }
    for _ in 0..CAMPAIGNERS {
        while !matches!(campaign.hear("campaign").await?, (_, Said::Campaigning)) {}
    }
    while campaign.leader.is_none() {
        campaign.hear("first leader").await?;
    }
    sleep(SETTLE).await;
    for _ in 0..resignations {
        let took = campaign.resign().await?;
        outcome.resigned.samples.push(took);
    }
    for k in 0..kills {
        // Spread evenly over the renewal period.
        let phase = (k as f64 + 0.5) / kills as f64;
        let took = campaign.kill(phase).await?;
        outcome.killed.samples.push(took);
    }
    campaign.finish().await?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(outcome)
}

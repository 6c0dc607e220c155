//! Runs the scenarios in order, each into its section of the report.

use std::fmt::Write as _;
use std::sync::Arc;

use dlock::Backend;

use crate::document::Section;
use crate::plots::{self, Bar, Plot};
use crate::stamp::RunFacts;
use crate::stats::{Measured, show, show_rate};
use crate::{Config, Res, acks, cross, cycle, election, handoff, held, modes, overhead, server};

/// Concurrency levels of the uncontended cycle.
const CONCURRENCY: [usize; 2] = [1, 64];

/// Deletes the keys this run left in Redis (fence keys are kept forever
/// by design, so a benchmark must clean up after itself).
async fn clean_redis(cfg: &Config) -> Res<()> {
    let mut conn = redis::Client::open(cfg.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let pattern = format!("*bench:{}:*", cfg.run);
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            let _: i64 = redis::cmd("DEL").arg(&keys).query_async(&mut conn).await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// Scenario 1's chart of one backend: each row's cycles/s at each
/// concurrency (the median round, the lowest and highest beside it),
/// against the floor (the first row).
fn cycle_plot(backend: &str, rows: &[cycle::Row], results: &[Vec<Measured>]) -> Res<Plot> {
    let panels: Vec<(String, Vec<Bar>)> = CONCURRENCY
        .iter()
        .enumerate()
        .map(|(c, tasks)| {
            let floor = results[0][c].rate();
            let bars = rows
                .iter()
                .zip(results)
                .enumerate()
                .map(|(r, (row, per_tasks))| {
                    let m = &per_tasks[c];
                    Bar {
                        label: plots::short(&row.name).into(),
                        value: m.rate(),
                        range: (m.rates.len() > 1).then(|| {
                            let lowest = m.rates.iter().copied().fold(f64::INFINITY, f64::min);
                            (lowest, m.rates.iter().copied().fold(0.0, f64::max))
                        }),
                        note: format!("{} ({:.2} x floor)", show_rate(m.rate()), m.rate() / floor),
                        reference: r == 0,
                    }
                })
                .collect();
            (
                format!("{tasks} task{}", if *tasks == 1 { "" } else { "s" }),
                bars,
            )
        })
        .collect();
    plots::bars(
        &format!("cycle-{}.svg", backend.to_lowercase()),
        &format!("{backend}: uncontended cycles per second against the floor (grey)"),
        "cycles/s: median round, line from the lowest to the highest",
        &panels,
    )
}

/// Runs every scenario the config asks for and returns their sections, and
/// the facts of the run they are stamped with.
pub async fn run_all(cfg: &Config) -> Res<(RunFacts, Vec<Section>)> {
    let pings = if cfg.smoke { 200 } else { 2000 };
    let redis_rtt = handoff::redis_round_trip(cfg, pings).await?;
    let pg_rtt = handoff::pg_round_trip(cfg, pings).await?;
    let facts = RunFacts::gather(cfg, redis_rtt, pg_rtt).await;
    let mut sections = Vec::new();

    if cfg.wants("cycle") {
        let mut s = Section::begin("cycle", "1. Uncontended cycle");
        eprintln!("scenario 1: uncontended cycle");
        let _ = writeln!(
            s.body,
            "Each task acquires and releases a key of its own (ttl 30 s) in a loop: {} interleaved rounds of {:?} per row and concurrency, after a warm-up. Throughput is the median of the rounds; latency is one acquire + release.\n",
            cfg.rounds, cfg.round
        );
        let _ = writeln!(
            s.body,
            "| backend | implementation | tasks | cycles/s | median | p99 | throughput vs floor |\n| --- | --- | ---: | ---: | ---: | ---: | ---: |"
        );
        for (backend, rows) in [
            ("Redis", cycle::redis_rows(cfg).await?),
            ("PostgreSQL", cycle::pg_rows(cfg).await?),
        ] {
            let results = cycle::measure(&rows, &CONCURRENCY, cfg.rounds, cfg.round).await?;
            for (row, per_tasks) in rows.iter().zip(&results) {
                for (c, m) in per_tasks.iter().enumerate() {
                    let floor = results[0][c].rate();
                    let _ = writeln!(
                        s.body,
                        "| {backend} | {} | {} | {} | {} | {} | {:.2} |",
                        row.name,
                        CONCURRENCY[c],
                        show_rate(m.rate()),
                        show(m.median()),
                        show(m.p99()),
                        m.rate() / floor
                    );
                }
            }
            if backend == "PostgreSQL" {
                cycle::pg_against_pair(&mut s, &rows, &CONCURRENCY, &results);
            } else {
                let ratio = results[1][1].rate() / results[0][1].rate();
                s.target(
                    format!("{backend} uncontended cycle, 64 tasks: dlock >= 0.9 x floor"),
                    format!("{ratio:.2} x"),
                    ratio >= 0.9,
                );
            }
            s.plots.push(cycle_plot(backend, &rows, &results)?);
        }
        let _ = writeln!(s.body);
        clean_redis(cfg).await?;
        sections.push(s.end());
    }

    if cfg.wants("handoff") {
        let mut s = Section::begin("handoff", "2. Contended handoff");
        eprintln!("scenario 2: contended handoff");
        let key = |what: &str| format!("bench:{}:handoff:{what}", cfg.run);
        let redis: Arc<dyn Backend> =
            Arc::new(dlock::redis::RedisBackend::connect(&cfg.redis_url).await?);
        let listing: Arc<dyn Backend> = Arc::new(
            dlock::redis::RedisBackend::builder(&cfg.redis_url)
                .list_queues(true)
                .connect()
                .await?,
        );
        let pg: Arc<dyn Backend> = Arc::new(dlock::pg::PgBackend::connect(&cfg.pg_conn).await?);
        // The fair rows on each kind of queue, one at a time, with the
        // server's time in scripts per handoff of each.
        let mut fair_script_time = Vec::new();
        let mut fair_rows = Vec::new();
        for (row, backend, what) in [
            ("string queue (the default)", &redis, "dlock-fair"),
            ("list queue (`list_queues`)", &listing, "dlock-fair-list"),
        ] {
            let before = handoff::script_micros(cfg).await?;
            let o = handoff::dlock(
                backend.clone(),
                &key(what),
                cfg.handoff_time,
                true,
                handoff::Again::AtOnce,
            )
            .await?;
            let micros = handoff::script_micros(cfg).await?.saturating_sub(before);
            fair_script_time.push((row, micros as f64 / o.handoff.samples.len().max(1) as f64));
            fair_rows.push(o);
        }
        let (fair_list, fair_string) = (
            fair_rows.pop().expect("the list row"),
            fair_rows.pop().expect("the string row"),
        );
        let rows = [
            (
                "dlock RedisBackend (pub/sub wake-up)",
                handoff::dlock(
                    redis.clone(),
                    &key("dlock"),
                    cfg.handoff_time,
                    false,
                    handoff::Again::AtOnce,
                )
                .await?,
            ),
            (
                "dlock RedisBackend, fair, string queue (the default; handoff in the release)",
                fair_string,
            ),
            (
                "dlock RedisBackend, fair, list queue (RedisBuilder::list_queues; handoff in the release)",
                fair_list,
            ),
            (
                "dlock RedisBackend, fair, list queue, the releaser queues again only after the next holder took it",
                handoff::dlock(
                    listing,
                    &key("dlock-fair-apart"),
                    cfg.handoff_time,
                    true,
                    handoff::Again::AfterTheNextHolder,
                )
                .await?,
            ),
            (
                "rslock 0.10, default retry (3 tries, 0-200 ms apart)",
                handoff::rslock(cfg, &key("rslock"), cfg.handoff_time).await?,
            ),
            (
                "raw SET NX PX polling every 1 ms + DEL",
                handoff::set_nx_poll(cfg, &key("poll"), cfg.handoff_time).await?,
            ),
            (
                "dlock PgBackend (context; in-process wake-up)",
                handoff::dlock(
                    pg.clone(),
                    &key("pg"),
                    cfg.handoff_time,
                    false,
                    handoff::Again::AtOnce,
                )
                .await?,
            ),
            (
                "dlock PgBackend, fair (context; PostgreSQL's lock queue)",
                handoff::dlock(
                    pg,
                    &key("pg-fair"),
                    cfg.handoff_time,
                    true,
                    handoff::Again::AtOnce,
                )
                .await?,
            ),
        ];
        let redis_rows: Vec<(String, &[std::time::Duration])> = rows[..6]
            .iter()
            .map(|(name, o)| {
                let samples = o.handoff.samples.as_slice();
                (
                    format!("{} ({} handoffs)", plots::short(name), samples.len()),
                    samples,
                )
            })
            .collect();
        s.plots.push(plots::latency_cdf(
            "handoff.svg",
            "Redis contended handoff: from a release to the next holder's return",
            &redis_rows,
        )?);
        let rtt_after = handoff::redis_round_trip(cfg, pings).await?;
        let floor = handoff::redis_publish_floor(cfg, &key("floor"), pings).await?;
        let blpop = handoff::redis_blpop_floor(cfg, &key("blpop"), pings).await?;
        let _ = writeln!(
            s.body,
            "{} tasks of one process loop on ONE key: acquire (waiting), no work, release; {:?} per row. A *turn* is any acquisition; a *handoff* is one by a different task than the previous holder. Latency runs from the moment the holder starts its release to the moment the next holder's acquire returns. Redis round trip (PING on an idle connection, median): {} before, {} after; the target uses their mean.\n",
            handoff::TASKS,
            cfg.handoff_time,
            show(redis_rtt),
            show(rtt_after)
        );
        let _ = writeln!(
            s.body,
            "The floor of any handoff told by the server (idle server, median of {pings}): a script that only sets a key and publishes, from its send until the message, passed on by a reader task of a pub/sub connection, wakes another task: {} ({:.2} x the mean PING); the same script pushing to a list that the other task waits on with `BLPOP` on a connection of its own: {} ({:.2} x).\n",
            show(floor),
            floor.as_secs_f64() / ((redis_rtt + rtt_after) / 2).as_secs_f64(),
            show(blpop),
            blpop.as_secs_f64() / ((redis_rtt + rtt_after) / 2).as_secs_f64()
        );
        let _ = writeln!(
            s.body,
            "| implementation | turns/s | handoffs/s | tasks served | handoff median | handoff p99 | turn median | turn p99 |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        );
        for (name, o) in &rows {
            let _ = writeln!(
                s.body,
                "| {name} | {} | {} | {}/{} | {} | {} | {} | {} |",
                show_rate(o.turns_per_s),
                show_rate(o.handoffs_per_s),
                o.tasks_served,
                handoff::TASKS,
                show(o.handoff.median()),
                show(o.handoff.p99()),
                show(o.turn.median()),
                show(o.turn.p99())
            );
        }
        let _ = writeln!(
            s.body,
            "\nThe server's time in dlock's scripts per fair handoff (`INFO commandstats`, `evalsha`, over the row; with 16 tasks each handoff is the release that hands over and the releaser's attempt that queues again): {}. The targets below are measured on the list queue.\n",
            fair_script_time
                .iter()
                .map(|(row, micros)| format!("{row} {micros:.1} µs"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let rtt = (redis_rtt + rtt_after) / 2;
        let (dl, fair, apart, rs) = (&rows[0].1, &rows[2].1, &rows[3].1, &rows[4].1);
        let per_rtt = dl.handoff.median().as_secs_f64() / rtt.as_secs_f64();
        s.target(
            "Redis contended handoff: median <= 3 x round trip",
            format!(
                "{} = {per_rtt:.1} x {}",
                show(dl.handoff.median()),
                show(rtt)
            ),
            per_rtt <= 3.0,
        );
        let vs = dl.handoffs_per_s / rs.handoffs_per_s.max(1e-9);
        s.target(
            "Redis contended handoff: handoffs/s >= 10 x rslock",
            format!(
                "{} vs {} = {vs:.0} x",
                show_rate(dl.handoffs_per_s),
                show_rate(rs.handoffs_per_s)
            ),
            vs >= 10.0,
        );
        for (what, o) in [("", fair), (", releaser apart", apart)] {
            let per_floor = o.handoff.median().as_secs_f64() / floor.as_secs_f64();
            s.target(
                format!("Redis fair handoff{what}: median <= 1.4 x the floor"),
                format!(
                    "{} = {per_floor:.2} x {}",
                    show(o.handoff.median()),
                    show(floor)
                ),
                per_floor <= 1.4,
            );
        }
        let fair_vs = fair.handoffs_per_s / dl.handoffs_per_s.max(1e-9);
        s.target(
            "Redis fair handoff: handoffs/s >= 1.8 x non-fair",
            format!(
                "{} vs {} = {fair_vs:.2} x",
                show_rate(fair.handoffs_per_s),
                show_rate(dl.handoffs_per_s)
            ),
            fair_vs >= 1.8,
        );
        let turns = fair.turn.samples.len();
        let repeats = fair.repeats_once_all_served;
        s.target(
            "Redis fair handoff: every turn is a handoff once every task held the key",
            format!(
                "{} of {turns} turns ({} taken again at the start, before every task had queued)",
                turns - repeats,
                turns - fair.handoff.samples.len() - repeats
            ),
            repeats == 0,
        );
        clean_redis(cfg).await?;
        sections.push(s.end());
    }

    if cfg.wants("macro") {
        let mut s = Section::begin("macro", "3. Macro overhead");
        eprintln!("scenario 3: macro overhead");
        let (annotated, programmatic, ratio) =
            overhead::measure(cfg.macro_blocks, cfg.macro_calls).await?;
        let _ = writeln!(
            s.body,
            "One task calls a `#[distributed_lock(key = \"bench:macro:{{n}}\", ttl = \"30s\", backend = ...)]` fn, and the same lock written with `LockKey::builder()` + `LockOptions::acquire` + `Lease::release`, on the memory backend (no I/O). {} pairs of back-to-back blocks of {} calls each (which side goes first alternates); the ratio is the median over the pairs of annotated / programmatic time per call, so drift in the machine's load cancels within a pair.\n",
            cfg.macro_blocks, cfg.macro_calls
        );
        let _ = writeln!(
            s.body,
            "| variant | calls/s | median | p99 |\n| --- | ---: | ---: | ---: |"
        );
        for (name, m) in [
            ("annotated fn", &annotated),
            ("programmatic API", &programmatic),
        ] {
            let _ = writeln!(
                s.body,
                "| {name} | {} | {} | {} |",
                show_rate(m.rate()),
                show(m.median()),
                show(m.p99())
            );
        }
        let _ = writeln!(
            s.body,
            "\nannotated / programmatic time per call: **{ratio:.3}**\n"
        );
        s.target(
            "Macro overhead: annotated / programmatic <= 1.05",
            format!("{ratio:.3}"),
            ratio <= 1.05,
        );
        let recording = overhead::instrumentation(cfg.macro_blocks, cfg.macro_calls)?;
        let cycle = 1.0 / programmatic.rate().max(1e-9);
        let _ = writeln!(
            s.body,
            "Both sides above record the lease's metrics (`dlock_acquisitions_total`, `dlock_wait_seconds`, `dlock_leases_held` up and down, `dlock_hold_seconds`) and open, fill and close its `dlock.hold` span; this program installs no metrics recorder and no tracing subscriber, as a user who wants neither would not. What that adds to a cycle, timed alone ({} blocks of {} cycles of the calls the lease makes: the backend kind's metric keys looked up, the facade's recorder check per value, the disabled span, and the one clock read the acquisition adds; the release reuses a clock read it makes anyway, so a whole cycle makes two clock reads fewer than before it recorded anything):\n\n| what | time per cycle | share of a programmatic cycle ({:.2} µs) |\n| --- | ---: | ---: |\n| metrics + span, no recorder or subscriber installed | {:.1} ns | {:.2} % |\n",
            cfg.macro_blocks,
            cfg.macro_calls,
            cycle * 1e6,
            recording.as_secs_f64() * 1e9,
            recording.as_secs_f64() / cycle * 100.0
        );
        sections.push(s.end());
    }

    if cfg.wants("held") {
        let mut s = Section::begin("held", "4. Many held leases");
        eprintln!(
            "scenario 4: {} held leases for {:?}",
            cfg.held_leases, cfg.held_window
        );
        let _ = writeln!(
            s.body,
            "{} leases (ttl {:?}, so each is renewed every {:?}) held at once for {:?} on one backend instance. Round trips are renewal requests the core sent to the backend, counted by a wrapper around it (for PostgreSQL every request is one round trip on a lock session). CPU is the process's user + system time (getrusage) over the window's wall time; memory is counted twice: the live heap bytes the process holds at the end of the window over what it held before taking the leases (a counting global allocator, on only for this scenario), and the peak RSS growth, which adds allocator arenas, fragmentation and transient buffers; both divided by the leases.\n",
            cfg.held_leases,
            held::TTL,
            held::TTL / 3,
            cfg.held_window
        );
        let _ = writeln!(
            s.body,
            "| backend | leases | renewal round trips/s | lease renewals/s | CPU (% of one core) | heap per lease | RSS growth per lease | lost | time to take them |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        );
        for name in ["redis", "pg"] {
            let backend = cross::connect(cfg, name, std::path::Path::new("/")).await?;
            let h = held::hold(
                backend,
                &format!("bench:{}:held:{name}", cfg.run),
                cfg.held_leases,
                cfg.held_window,
            )
            .await?;
            let _ = writeln!(
                s.body,
                "| {name} | {} | {:.1} | {:.0} | {:.2} % | {:.0} B | {:.0} B | {} | {:.1} s |",
                h.leases,
                h.round_trips_per_s,
                h.renewals_per_s,
                h.cpu_share * 100.0,
                h.heap_per_lease,
                h.bytes_per_lease,
                h.lost,
                h.acquire_time.as_secs_f64()
            );
            s.target(
                format!(
                    "{name}: {} held leases, renewal < 10% of one core",
                    h.leases
                ),
                format!("{:.2} %", h.cpu_share * 100.0),
                h.cpu_share < 0.10,
            );
            s.target(
                format!(
                    "{name}: {} held leases, < 2 KiB client memory per lease",
                    h.leases
                ),
                format!(
                    "{:.0} B live heap ({:.0} B RSS growth)",
                    h.heap_per_lease, h.bytes_per_lease
                ),
                h.heap_per_lease < 2048.0,
            );
        }
        let _ = writeln!(s.body);
        clean_redis(cfg).await?;
        sections.push(s.end());
    }

    if cfg.wants("cross") {
        let mut s = Section::begin("cross", "5. Cross-process");
        eprintln!("scenario 5: cross-process");
        let _ = writeln!(
            s.body,
            "{} processes (this program started again with `--child`, each with a backend of its own) loop acquire (waiting) / release on ONE key for {:?}. Times are taken on the host's wall clock, shared by the processes. A handoff is an acquisition by another process than the previous holder; overlaps count intervals that began before the previous one's release started (mutual exclusion broken).\n",
            cross::PROCESSES,
            cfg.cross_time
        );
        let _ = writeln!(
            s.body,
            "| backend | acquisitions/s | cross-process handoffs/s | handoff median | handoff p99 | acquisitions per process | overlaps |\n| --- | ---: | ---: | ---: | ---: | --- | ---: |"
        );
        for (name, fair) in [
            ("file", false),
            ("file", true),
            ("redis", false),
            ("redis", true),
            ("pg", false),
            ("pg", true),
        ] {
            let o = cross::run(cfg, name, cfg.cross_time, fair).await?;
            let per: Vec<String> = o.per_process.iter().map(usize::to_string).collect();
            let name = if fair {
                format!("{name}, fair")
            } else {
                name.to_owned()
            };
            let _ = writeln!(
                s.body,
                "| {name} | {} | {} | {} | {} | {} | {} |",
                show_rate(o.turns_per_s),
                show_rate(o.handoffs_per_s),
                show(o.handoff.median()),
                show(o.handoff.p99()),
                per.join(" / "),
                o.overlaps
            );
        }
        let _ = writeln!(s.body);
        clean_redis(cfg).await?;
        sections.push(s.end());
    }

    if cfg.wants("server") {
        let mut s = Section::begin("server", "6. Redis server CPU per lock cycle");
        eprintln!("scenario 6: Redis server CPU per cycle");
        let costs = server::measure(&cfg.run, cfg.server_cycles, cfg.server_rounds).await?;
        let _ = writeln!(
            s.body,
            "Redis runs commands on one thread, so a shared server's lock throughput is bounded by the server time a cycle takes. A redis-server the benchmark starts for itself (no persistence, nothing else connected) serves {} rounds of {} uncontended acquire + release cycles of each implementation from {} tasks, each on a key of its own, after a warm-up; the implementations take turns within each round. CPU is the server main thread's own user + system time (`INFO cpu`: `used_cpu_user_main_thread` + `used_cpu_sys_main_thread`), network I/O included; it does not depend on how the machine's cores are shared between client and server. The figure is the median round's, with the lowest and highest beside it. The breakdown is `INFO commandstats` over the same cycles (reset before each): a command a script calls counts on its own line *and* inside the script's time.\n",
            cfg.server_rounds,
            costs
                .first()
                .map_or(0, |c| c.cycles / cfg.server_rounds.max(1) as u64),
            server::TASKS
        );
        let _ = writeln!(
            s.body,
            "| implementation | server CPU per cycle (median) | lowest – highest round | vs rslock | cycles/s (wall) |\n| --- | ---: | ---: | ---: | ---: |"
        );
        let rslock = costs
            .iter()
            .find(|c| c.protocol == server::Protocol::Rslock)
            .map(server::Cost::per_cycle);
        for cost in &costs {
            let _ = writeln!(
                s.body,
                "| {} | {:.1} µs | {:.1} – {:.1} µs | {} | {:.0} |",
                cost.protocol.label(),
                cost.per_cycle(),
                cost.range().0,
                cost.range().1,
                rslock.map_or("?".into(), |r| format!("{:.2} x", cost.per_cycle() / r)),
                cost.cycles as f64 / cost.wall.as_secs_f64()
            );
        }
        let _ = writeln!(
            s.body,
            "\n| implementation | command | calls per cycle | µs per call | µs per cycle |\n| --- | --- | ---: | ---: | ---: |"
        );
        for cost in &costs {
            for command in &cost.commands {
                let _ = writeln!(
                    s.body,
                    "| {} | `{}` | {:.2} | {:.2} | {:.2} |",
                    cost.protocol.label(),
                    command.command,
                    command.calls as f64 / cost.cycles as f64,
                    command.usec as f64 / command.calls.max(1) as f64,
                    command.usec as f64 / cost.cycles as f64
                );
            }
        }
        let _ = writeln!(s.body);
        if let (Some(dlock), Some(rslock)) = (
            costs.iter().find(|c| c.protocol == server::Protocol::Dlock),
            rslock,
        ) {
            let ratio = dlock.per_cycle() / rslock;
            s.target(
                "Redis server CPU per dlock cycle <= 1.4 x rslock's",
                format!(
                    "{ratio:.2} x ({:.1} µs vs {rslock:.1} µs)",
                    dlock.per_cycle()
                ),
                ratio <= 1.4,
            );
        }
        let bars = costs
            .iter()
            .map(|cost| Bar {
                label: plots::short(cost.protocol.label()).into(),
                value: cost.per_cycle(),
                range: (cost.rounds.len() > 1).then(|| cost.range()),
                note: format!(
                    "{:.1} µs{}",
                    cost.per_cycle(),
                    rslock.map_or(String::new(), |r| format!(
                        " ({:.2} x rslock)",
                        cost.per_cycle() / r
                    ))
                ),
                reference: cost.protocol == server::Protocol::Rslock,
            })
            .collect();
        s.plots.push(plots::bars(
            "server.svg",
            "Redis server CPU per lock cycle against rslock's (grey)",
            "server main thread CPU per cycle, µs: median round, line from the lowest to the highest",
            &[(
                format!(
                    "{} tasks, {} round{}",
                    server::TASKS,
                    cfg.server_rounds,
                    if cfg.server_rounds == 1 { "" } else { "s" }
                ),
                bars,
            )],
        )?);
        sections.push(s.end());
    }

    if cfg.wants("election") {
        let mut s = Section::begin("election", "7. Leader election failover");
        eprintln!("scenario 7: leader election failover");
        let _ = writeln!(
            s.body,
            "{} campaigner processes (this program started again with `--campaigner`, each with a backend of its own) lead a fresh election per backend with `Election::lead` (ttl {:?}, so the leader renews every {:.0} ms); each prints the instant its leader's work starts. *Resignation* ({} per backend): the leader is told on its stdin to end its work, which notes the instant it returns, just before `lead` calls `resign()`; it campaigns again only once another process leads, so the next leader is always one of the two that were waiting. *Kill* ({} per backend): the benchmark notes the instant just before it sends the leader SIGKILL, the kills spread evenly over the leader's renewal period, then starts a new campaigner so that three campaign again. A figure runs from that instant to the instant the next leader's work starts, both read from CLOCK_REALTIME (`SystemTime`), which the processes of one host share. *Round trip* is the median Redis PING / PostgreSQL prepared `SELECT 1` above (the file backend has no server); *one campaign* is the median of {} uncontended `Election::campaign` calls on the same backend from one process, for context.\n",
            election::CAMPAIGNERS,
            election::TTL,
            (election::TTL / 3).as_secs_f64() * 1e3,
            cfg.election_resignations,
            cfg.election_kills,
            election::SOLO_CAMPAIGNS
        );
        let _ = writeln!(
            s.body,
            "| backend | event | failovers | median | p90 | max | round trip | one campaign | bounded by |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
        );
        for name in ["file", "redis", "pg"] {
            let o = election::run(cfg, name, cfg.election_resignations, cfg.election_kills).await?;
            let (round_trip, resign_bound, kill_bound) = match name {
                "file" => (
                    "—".to_owned(),
                    "release (state rewritten, alive file unlocked) + the waiter's wake-up + one campaign",
                    "the OS drops the dead process's alive-file lock at once + wake-up + one campaign",
                ),
                "redis" => (
                    show(redis_rtt),
                    "release (publishes to the waiters) + pub/sub wake-up + one campaign",
                    "the ttl left since the last renewal (2/3 ttl to ttl: 1.33–2 s) + one campaign",
                ),
                _ => (
                    show(pg_rtt),
                    "unlock + the waiter's server-side probe granted + one campaign",
                    "the server ends the dead client's session (its socket closed) + probe granted + one campaign",
                ),
            };
            for (event, m, bound) in [
                ("resignation", &o.resigned, resign_bound),
                ("kill (SIGKILL)", &o.killed, kill_bound),
            ] {
                let _ = writeln!(
                    s.body,
                    "| {name} | {event} | {} | {} | {} | {} | {round_trip} | {} | {bound} |",
                    m.samples.len(),
                    show(m.median()),
                    show(m.quantile(0.9)),
                    show(m.quantile(1.0)),
                    show(o.campaign.median())
                );
            }
        }
        let _ = writeln!(s.body);
        clean_redis(cfg).await?;
        sections.push(s.end());
    }

    if cfg.wants("acks") {
        let mut s = Section::begin("acks", "8. Replica acknowledgements");
        eprintln!("scenario 8: replica acknowledgements");
        let pair = acks::Replicated::start().await?;
        let rows = pair.rows(&cfg.run).await?;
        let results = cycle::measure(&rows, &CONCURRENCY, cfg.rounds, cfg.round).await?;
        let _ = writeln!(
            s.body,
            "The uncontended cycle of scenario 1 (ttl 30 s, a key per task, {} interleaved rounds of {:?}) on a primary with one replica (`--replicaof`), both started by the benchmark on free loopback ports with no persistence: dlock as usual, and dlock with `RedisBuilder::replica_acks(1, {:?})`, which sends `WAIT 1 {}` after every acquisition, in one pipeline with the acquire script.\n",
            cfg.rounds,
            cfg.round,
            acks::ACK_WITHIN,
            acks::ACK_WITHIN.as_millis()
        );
        let _ = writeln!(
            s.body,
            "| implementation | tasks | cycles/s | median | p99 | throughput vs without acks |\n| --- | ---: | ---: | ---: | ---: | ---: |"
        );
        for (row, per_tasks) in rows.iter().zip(&results) {
            for (c, m) in per_tasks.iter().enumerate() {
                let without = results[0][c].rate();
                let _ = writeln!(
                    s.body,
                    "| {} | {} | {} | {} | {} | {:.2} |",
                    row.name,
                    CONCURRENCY[c],
                    show_rate(m.rate()),
                    show(m.median()),
                    show(m.p99()),
                    m.rate() / without
                );
            }
        }
        let _ = writeln!(s.body);
        drop(pair);
        sections.push(s.end());
    }

    if cfg.wants("modes") {
        let mut s = Section::begin("modes", "9. Read-write locks and permits");
        eprintln!("scenario 9: read-write locks and permits");
        // One entry per backend; one that does not keep shared locks and
        // permits yet (`supports_access`) is named and skipped, so a
        // backend that gains them is measured with no change here.
        let backends: [(&str, Arc<dyn Backend>); 2] = [
            (
                "PostgreSQL",
                Arc::new(dlock::pg::PgBackend::connect(&cfg.pg_conn).await?),
            ),
            (
                "Redis",
                Arc::new(dlock::redis::RedisBackend::connect(&cfg.redis_url).await?),
            ),
        ];
        let _ = writeln!(
            s.body,
            "**Shared against exclusive cycle.** As scenario 1 (each task acquires and releases a key of its own, ttl 30 s, {} interleaved rounds of {:?} per row and concurrency, after a warm-up; throughput is the median of the rounds), once with `LockMode::Exclusive` and once with `LockMode::Shared`, on one backend instance. *cost vs exclusive* is the exclusive row's cycles/s over this row's (dlock's rows against dlock's exclusive, the hand-written against the hand-written exclusive pair): what a cycle costs, 1.00 = the same. The target is judged on the *paired* line under each backend's rows: each round's exclusive and shared rows run back to back, so their ratio round by round cancels what the machine's other load does over a run, and its median is steadier than the ratio of the two medians. Autovacuum is off on the benchmark's server, so dlock's two tables are vacuumed before the PostgreSQL rows (each run leaves its upserts' dead row versions behind).\n",
            modes::rounds(cfg.rounds),
            cfg.round
        );
        let _ = writeln!(
            s.body,
            "| backend | implementation | tasks | cycles/s | median | p99 | cost vs exclusive |\n| --- | --- | ---: | ---: | ---: | ---: | ---: |"
        );
        let mut permit_rows = Vec::new();
        let mut skipped = Vec::new();
        for (name, backend) in backends {
            let permits = dlock::backend::Access::Permits {
                permits: modes::PERMITS,
            };
            if !backend.supports_access(dlock::backend::Access::Shared)
                || !backend.supports_access(permits)
            {
                skipped.push(name);
                continue;
            }
            let kind = format!("{}Backend", if name == "Redis" { "Redis" } else { "Pg" });
            let mut rows = modes::cycle_rows(&kind, backend.clone(), &cfg.run);
            if name == "PostgreSQL" {
                rows.extend(modes::pg_hand_rows(cfg).await?);
                modes::vacuum_pg(cfg).await?;
            }
            let results =
                cycle::measure(&rows, &CONCURRENCY, modes::rounds(cfg.rounds), cfg.round).await?;
            for (r, (row, per_tasks)) in rows.iter().zip(&results).enumerate() {
                for (c, m) in per_tasks.iter().enumerate() {
                    let exclusive = results[r - r % 2][c].rate();
                    let _ = writeln!(
                        s.body,
                        "| {name} | {} | {} | {} | {} | {} | {:.2} |",
                        row.name,
                        CONCURRENCY[c],
                        show_rate(m.rate()),
                        show(m.median()),
                        show(m.p99()),
                        exclusive / m.rate()
                    );
                }
            }
            let (cost, lowest, highest) = modes::paired_cost(&results[0][1], &results[1][1]);
            let _ = writeln!(
                s.body,
                "| {name} | *paired, 64 tasks: round by round, the exclusive row's cycles/s over the shared row's of the same round; median (lowest – highest)* | 64 | | | | {cost:.2} ({lowest:.2} – {highest:.2}) |"
            );
            s.target(
                format!("{name} shared cycle, 64 tasks: <= 1.2 x an exclusive cycle"),
                format!(
                    "{cost:.2} x, paired over {} rounds ({lowest:.2} – {highest:.2}; {} vs {} cycles/s, the rounds' medians)",
                    results[0][1].rates.len(),
                    show_rate(results[1][1].rate()),
                    show_rate(results[0][1].rate())
                ),
                cost <= 1.2,
            );
            let key = format!("bench:{}:permits:{name}", cfg.run);
            let o = if name == "Redis" {
                // On a server of its own, whose script count is the round
                // trips as they reached it.
                let private = server::PrivateRedis::start().await?;
                let on: Arc<dyn Backend> =
                    Arc::new(dlock::redis::RedisBackend::connect(&private.url).await?);
                let before = private.script_calls().await?;
                let mut o = modes::permits(on, &key, cfg.handoff_time).await?;
                o.server_round_trips = Some(private.script_calls().await? - before);
                o
            } else {
                modes::permits(backend, &key, cfg.handoff_time).await?
            };
            let round_trips = o.server_round_trips.unwrap_or(o.round_trips);
            let per_handoff = round_trips as f64 / o.handoffs.max(1) as f64;
            s.target(
                format!(
                    "{name} permits ({} of them, {} tasks): <= 3 round trips per handoff",
                    modes::PERMITS,
                    modes::TASKS
                ),
                format!(
                    "{per_handoff:.1} ({round_trips} round trips{}, {} handoffs)",
                    if o.server_round_trips.is_some() {
                        " counted by the server"
                    } else {
                        ""
                    },
                    o.handoffs
                ),
                per_handoff <= 3.0,
            );
            permit_rows.push((name, o));
        }
        if !skipped.is_empty() {
            let _ = writeln!(
                s.body,
                "\nNot measured: {} (refuses shared locks and permits in this build, `Backend::supports_access`).",
                skipped.join(", ")
            );
        }
        let _ = writeln!(
            s.body,
            "\n**Contended permits.** {} tasks of one process loop on ONE key with `permits({})`: acquire (waiting), no work, release; {:?} per backend. A *turn* is any acquisition; a *handoff* is one of a slot (`Lease::slot`) whose previous holder was another task. The backend is wrapped in a counter of the calls dlock makes on it: *round trips* are attempts (`try_acquire`) the backend did not answer in process, releases and renewals, each one statement or script on the server (*in process*: the refusals a Redis backend answers without asking, behind a waiter of its own process); subscriptions (a waiter asking to be told of a release) are counted apart, since on PostgreSQL they are answered in process. The Redis row runs on a redis-server of the benchmark's own, whose count of scripts run is its *server round trips*: what reached the server, whatever a backend answers in process.\n",
            modes::TASKS,
            modes::PERMITS,
            cfg.handoff_time
        );
        let _ = writeln!(
            s.body,
            "| backend | turns/s | handoffs/s | tasks served | attempts (refused; in process) | releases | renewals | subscriptions | other calls | calls per handoff | server round trips per handoff |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        );
        for (name, o) in &permit_rows {
            let _ = writeln!(
                s.body,
                "| {name} | {} | {} | {}/{} | {} ({}; {}) | {} | {} | {} | {} | {:.2} | {:.2} |",
                show_rate(o.turns_per_s),
                show_rate(o.handoffs_per_s),
                o.tasks_served,
                modes::TASKS,
                o.attempts,
                o.refused,
                o.behind,
                o.releases,
                o.renewals,
                o.subscribes,
                o.other,
                o.round_trips as f64 / o.handoffs.max(1) as f64,
                o.server_round_trips.unwrap_or(o.round_trips) as f64 / o.handoffs.max(1) as f64
            );
        }
        let _ = writeln!(s.body);
        clean_redis(cfg).await?;
        sections.push(s.end());
    }

    Ok((facts, sections))
}

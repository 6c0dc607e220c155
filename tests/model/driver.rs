//! A backend's model run from its seed: the operations drawn, sent and
//! checked, the line every run prints, and on a violation the shortest
//! sequence that still shows it, printed as a regression test to paste.

use std::io::Write as _;
use std::time::{Duration, Instant};

use crate::ops::{Generator, Op};
use crate::run::{Run, Store};

/// Operations per backend per run unless `DLOCK_MODEL_OPS` says more (or
/// fewer).
const DEFAULT_OPS: usize = 2_000;
/// How often an operation is an operator's fault, in percent.
const FAULT_PERCENT: u64 = 8;
/// How long one operation (a fault included) may take: every call
/// returns, whatever the store went through.
const OP_DEADLINE: Duration = Duration::from_secs(20);
/// How long the shrinker may replay before it prints what it has.
const SHRINK_BUDGET: Duration = Duration::from_secs(120);

/// How many operations a run sends: `DLOCK_MODEL_OPS`, or 2,000.
pub fn op_count() -> usize {
    match std::env::var("DLOCK_MODEL_OPS") {
        Ok(n) => n
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("DLOCK_MODEL_OPS must be a whole number, not {n:?}")),
        Err(_) => DEFAULT_OPS,
    }
}

/// The operations seed `seed` draws for `store`.
pub fn draw(store: &dyn Store, seed: u64, count: usize) -> Vec<Op> {
    let can = store.abilities();
    let percent = if can.fault_percent == 0 {
        FAULT_PERCENT
    } else {
        can.fault_percent
    };
    let mut generator = Generator::new(seed, can, store.backends().len());
    (0..count).map(|_| generator.next(percent)).collect()
}

/// Sends `ops` on fresh keys; the index and text of the first violation.
pub async fn replay_ops(store: &dyn Store, ops: &[Op]) -> (Run, Option<(usize, String)>) {
    let mut run = Run::new(store.backends());
    run.handoff_needs_mark = store.abilities().handoff_needs_mark;
    run.model.members_hidden = store.abilities().members_hidden;
    run.force_ends_sessions = store.abilities().force_ends_sessions;
    let trace = std::env::var_os("DLOCK_MODEL_TRACE").is_some();
    for (i, op) in ops.iter().enumerate() {
        if trace {
            eprintln!("model: {i}: {op:?}");
        }
        let sent = Instant::now();
        let answered = tokio::time::timeout(OP_DEADLINE, run.step(store, op)).await;
        if trace {
            eprintln!("model:     took {:?}", sent.elapsed());
        }
        if trace {
            for (k, key) in run.model.keys.iter().enumerate() {
                eprintln!("model:     key {k}: {:?} queue {:?}", key.hold, key.queue);
            }
        }
        let violation = match answered {
            Ok(Ok(())) => continue,
            Ok(Err(violation)) => violation,
            Err(_) => format!("no answer within {OP_DEADLINE:?}"),
        };
        run.clean().await;
        return (run, Some((i, violation)));
    }
    run.clean().await;
    (run, None)
}

/// Runs seed `seed` on `store`: prints `model: <store>: <N> operations,
/// <F> faults, <V> violations`, and on a violation shrinks it, prints the
/// regression test and panics.
pub async fn check(store: &dyn Store, test: &str, seed: u64) {
    let ops = draw(store, seed, op_count());
    let began = Instant::now();
    let (run, violation) = replay_ops(store, &ops).await;
    let sent = violation.as_ref().map_or(ops.len(), |(i, _)| i + 1);
    let faults = ops[..sent].iter().filter(|op| op.is_fault()).count();
    // Written to stderr itself, not through the test harness's capture:
    // the suite's log shows the line of a green run too.
    let _ = writeln!(
        std::io::stderr(),
        "model: {}: {sent} operations, {faults} faults, {} violations ({:.1} s, seed {seed})",
        store.name(),
        usize::from(violation.is_some()),
        began.elapsed().as_secs_f64()
    );
    drop(run);
    let Some((at, first)) = violation else {
        return;
    };
    eprintln!(
        "model: {}: operation {at} ({:?}): {first}",
        store.name(),
        ops[at]
    );
    let shrunk = shrink(store, ops[..=at].to_vec()).await;
    let (_, again) = replay_ops(store, &shrunk).await;
    let text = again.map_or_else(|| first.clone(), |(_, v)| v);
    eprintln!(
        "model: {}: shrunk to {} operations: {text}\n\
         model: paste this regression test into tests/model.rs:\n\n{}",
        store.name(),
        shrunk.len(),
        regression(store.name(), test, seed, &shrunk)
    );
    panic!("model: {}: seed {seed}: {first}", store.name());
}

/// Delta debugging (ddmin) over the operation list: drops chunks, then
/// single operations, as long as the rest still shows a violation.
async fn shrink(store: &dyn Store, mut ops: Vec<Op>) -> Vec<Op> {
    let began = Instant::now();
    let mut chunks = 2;
    while ops.len() >= 2 && began.elapsed() < SHRINK_BUDGET {
        let size = ops.len().div_ceil(chunks);
        let mut reduced = false;
        for start in (0..ops.len()).step_by(size) {
            let rest: Vec<Op> = ops[..start]
                .iter()
                .chain(&ops[(start + size).min(ops.len())..])
                .copied()
                .collect();
            if let (_, Some((at, _))) = replay_ops(store, &rest).await {
                ops = rest[..=at].to_vec();
                chunks = (chunks - 1).max(2);
                reduced = true;
                break;
            }
        }
        if !reduced {
            if chunks >= ops.len() {
                break;
            }
            chunks = (chunks * 2).min(ops.len());
        }
    }
    ops
}

/// The regression test for `ops`, as Rust to paste into `tests/model.rs`.
fn regression(store: &str, test: &str, seed: u64, ops: &[Op]) -> String {
    let mut text = format!(
        "/// Found by `{test}`, seed {seed}, shrunk to {} operations.\n\
         #[test]\n\
         fn {store}_replays_seed_{seed}_without_a_violation() {{\n    \
         replay(Kind::{}, &[\n",
        ops.len(),
        kind_name(store)
    );
    for op in ops {
        text.push_str(&format!("        {},\n", op.to_rust()));
    }
    text.push_str("    ]);\n}\n");
    text
}

fn kind_name(store: &str) -> String {
    store
        .split('_')
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_uppercase().chain(chars).collect()
            })
        })
        .collect()
}

//! `FileBackend`, one file per aspect: the conformance suite and what the
//! backend promises across real OS processes on one host (`lock`), fair
//! mode's queue across processes (`fair`), who holds a lock as other
//! processes read it (`holder`) and shared locks whose holder stops or
//! whose files go missing (`modes`).
//!
//! Tests that spawn child processes re-run this binary with the
//! `child_process_entry` of their own module (`support::child_command`).

#[path = "../support/mod.rs"]
mod support;

mod fair;
mod holder;
mod lock;
mod modes;

use std::path::{Path, PathBuf};
use std::time::Duration;

/// A directory of its own for a test (under cargo's scratch directory).
fn fresh_dir() -> PathBuf {
    let id = dlock::backend::OwnerId::random().expect("random");
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("dlock-file-{id}"))
}

/// A directory as the text a backend URL or a child's argument takes.
fn path(dir: &Path) -> &str {
    dir.to_str().expect("a UTF-8 path")
}

/// How many waiters the queue file of `key` (a plain name) lists: a
/// header line, then one line per waiter.
fn queued(dir: &Path, key: &str) -> usize {
    std::fs::read_to_string(dir.join(format!("{key}.queue")))
        .map_or(0, |text| text.lines().skip(1).count())
}

/// Waits until the queue of `key` lists `waiters` entries.
async fn until_queued(dir: &Path, key: &str, waiters: usize) {
    support::within(10, "the waiter joins the queue", async {
        while queued(dir, key) < waiters {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
}

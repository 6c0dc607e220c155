//! Helpers the integration test binaries share.

#![allow(dead_code)]

use std::future::Future;
use std::process::Command;
use std::time::Duration;

use tokio::time::timeout;

/// Fails the test if `fut` has not finished within `secs` (a hang guard,
/// not a timing assertion).
pub async fn within<F: Future>(secs: u64, what: &str, fut: F) -> F::Output {
    match timeout(Duration::from_secs(secs), fut).await {
        Ok(out) => out,
        Err(_) => panic!("{what} did not finish within {secs}s"),
    }
}

/// A command that re-runs this test binary as a child process playing
/// `role`: it runs only the `#[ignore]`d `child_process_entry` test, which
/// reads the role and its arguments from `env_var`. The caller sets stdio.
pub fn child_command(env_var: &str, role: &str, args: &[&str]) -> Command {
    let exe = std::env::current_exe().expect("test binary path");
    let mut command = Command::new(exe);
    command
        .args([
            "child_process_entry",
            "--exact",
            "--ignored",
            "--nocapture",
            "--quiet",
        ])
        .env(env_var, format!("{role}\u{1f}{}", args.join("\u{1f}")));
    command
}

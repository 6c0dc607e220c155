//! What `scripts/test` (the README's test command) does on a machine whose
//! Rust is too old for the crate: it stops at once and says what to do.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fresh_dir(label: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("dlock-{label}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Writes an executable shell script `name` into `dir`.
fn fake_tool(dir: &Path, name: &str, body: &str) {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write tool");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

#[test]
fn an_older_rust_stops_the_test_command_at_once_naming_both_versions_and_rustup() {
    let bin = fresh_dir("old-rust");
    let called = bin.join("cargo-was-run");
    // A Debian-packaged toolchain of the kind that cannot build edition 2024.
    fake_tool(&bin, "rustc", "echo 'rustc 1.63.0 (4b91a6ea7 2022-08-08)'");
    fake_tool(
        &bin,
        "cargo",
        &format!(
            "[ \"$1\" = --version ] && echo 'cargo 1.63.0' && exit 0\ntouch '{}'\nexit 101",
            called.display()
        ),
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/test");
    let out = Command::new("bash")
        .arg(&script)
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("HOME", &bin)
        .output()
        .expect("run scripts/test");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let needed = env!("CARGO_PKG_RUST_VERSION");
    assert!(!out.status.success(), "it must fail: {stderr}");
    assert!(
        stderr.contains("1.63.0") && stderr.contains(needed) && stderr.contains("rustup"),
        "the message must name the Rust found ({}), the Rust needed ({needed}) and rustup:\n{stderr}",
        "1.63.0"
    );
    assert!(
        !called.exists(),
        "nothing may be built with the old toolchain:\n{stderr}"
    );
    let _ = std::fs::remove_dir_all(&bin);
}

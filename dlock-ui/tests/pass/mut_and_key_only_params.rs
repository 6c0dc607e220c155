#![deny(warnings)]

use dlock::{LockError, distributed_lock};

// `tenant` is used only in the key, `count` only in the body, `mut` kept.
#[distributed_lock(key = "count:{tenant}", ttl = "30s")]
async fn count(
    tenant: &str,
    mut count: u32,
    mut log: Vec<String>,
) -> Result<(u32, usize), LockError> {
    count += 1;
    log.push("counted".to_owned());
    Ok((count, log.len()))
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        assert_eq!(count("t", 1, Vec::new()).await.expect("free key"), (2, 1));
    });
}

#![deny(warnings)]

use dlock::{LockError, distributed_lock, memory::MemoryBackend, registry};

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
    let _alone = super::alone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        registry().register("default", MemoryBackend::new());
        assert_eq!(count("t", 1, Vec::new()).await.expect("free key"), (2, 1));
    });
}

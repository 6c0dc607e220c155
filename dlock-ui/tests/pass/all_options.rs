#![deny(warnings)]

use dlock::{FencingToken, LockError, distributed_lock, memory::MemoryBackend, registry};

#[distributed_lock(
    key = "all:{id}",
    ttl = "1m 30s",
    wait = "250ms",
    renew = false,
    min_hold = "1s",
    backend = "pass-all-options.mem:1",
    on_lost = "finish",
    crate = "::dlock"
)]
async fn everything(id: u32, token: FencingToken) -> Result<u64, LockError> {
    Ok(token.get() + u64::from(id))
}

#[distributed_lock(
    key = "all:{id}",
    ttl = "30s",
    wait = "0s",
    on_lost = "abort",
    renew = true
)]
async fn defaults_spelled_out(id: u32) -> Result<u32, LockError> {
    Ok(id)
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        registry().register("pass-all-options.mem:1", MemoryBackend::new());
        assert!(everything(1).await.expect("free key") > 1);
        assert_eq!(defaults_spelled_out(2).await.expect("free key"), 2);
    });
}

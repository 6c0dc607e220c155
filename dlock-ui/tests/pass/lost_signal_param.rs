#![deny(warnings)]

use dlock::{
    FencingToken, LockError, LostSignal, distributed_lock, memory::MemoryBackend, registry,
};

#[distributed_lock(key = "batch:{id}", ttl = "30s", on_lost = "finish")]
async fn batch(id: u32, lost: LostSignal, token: FencingToken) -> Result<u32, LockError> {
    // Between steps of long work, stop if the lease is gone.
    lost.check()?;
    assert_eq!(lost.token(), token);
    Ok(id)
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
        assert_eq!(batch(4).await.expect("free key"), 4);
    });
}

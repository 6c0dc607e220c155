#![deny(warnings)]

use dlock::{FencingToken, LockError, distributed_lock, memory::MemoryBackend, registry};

#[distributed_lock(key = "config:{id}", ttl = "30s", mode = "shared")]
async fn read(id: u64, token: FencingToken) -> Result<FencingToken, LockError> {
    let _ = id;
    Ok(token)
}

#[distributed_lock(key = "config:{id}", ttl = "30s", mode = "exclusive")]
async fn write(id: u64, token: FencingToken) -> Result<FencingToken, LockError> {
    let _ = id;
    Ok(token)
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
        let read_token = read(1).await.expect("free key");
        let write_token = write(1).await.expect("released");
        assert!(write_token > read_token);
        assert!(read(1).await.expect("released") > write_token);
    });
}

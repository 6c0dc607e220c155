#![deny(warnings)]

use dlock::{LockError, distributed_lock, memory::MemoryBackend, registry};

struct Wrapper((u32, &'static str));

#[distributed_lock(key = "pair:{pair.0}:{pair.1}:{w.0.1}", ttl = "30s")]
async fn pair(pair: (u32, String), w: Wrapper) -> Result<String, LockError> {
    Ok(format!("{}-{}-{}", pair.0, pair.1, (w.0).0))
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
        let out = pair((1, "x".to_owned()), Wrapper((2, "y")))
            .await
            .expect("free key");
        assert_eq!(out, "1-x-2");
    });
}

#![deny(warnings)]

use dlock::{LockError, distributed_lock, memory::MemoryBackend, registry};

#[distributed_lock(key = "report:{day}", ttl = "30s")]
async fn report(day: u32) -> Result<String, LockError> {
    Ok(format!("report for day {day}"))
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
        assert_eq!(report(7).await.expect("free key"), "report for day 7");
    });
}

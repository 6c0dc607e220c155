#![deny(warnings)]

mod infra {
    pub mod locking {
        pub use dlock;
    }
}

use infra::locking::dlock::{FencingToken, LockError, distributed_lock};

#[distributed_lock(key = "reexport:{id}", ttl = "30s", crate = "infra::locking::dlock")]
async fn through_reexport(id: u32, token: FencingToken) -> Result<u64, LockError> {
    Ok(token.get() + u64::from(id))
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        infra::locking::dlock::registry().register("default", dlock::memory::MemoryBackend::new());
        assert!(through_reexport(1).await.expect("free key") > 1);
    });
}

#![deny(warnings)]

use dlock::{FencingToken, LockError, LostSignal, distributed_lock};

#[distributed_lock(key = "batch:{id}", ttl = "30s", on_lost = "finish")]
async fn batch(id: u32, lost: LostSignal, token: FencingToken) -> Result<u32, LockError> {
    // Between steps of long work, stop if the lease is gone.
    lost.check()?;
    assert_eq!(lost.token(), token);
    Ok(id)
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        assert_eq!(batch(4).await.expect("free key"), 4);
    });
}

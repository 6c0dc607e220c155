#![deny(warnings)]

use dlock::{LockError, distributed_lock};

/// Still locks: the token is optional.
#[distributed_lock(key = "cleanup", ttl = "1m")]
async fn cleanup() -> Result<(), LockError> {
    Ok(())
}

#[test]
fn compiles_without_warnings_and_runs() {
    let _alone = super::alone();
    let _future = cleanup();
}

#![deny(warnings)]

use dlock::{LockError, distributed_lock};

/// Still locks: the token is optional.
#[distributed_lock(key = "cleanup", ttl = "1m")]
async fn cleanup() -> Result<(), LockError> {
    Ok(())
}

fn main() {
    let _future = cleanup();
}

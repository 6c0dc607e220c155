#![deny(warnings)]

use dlock::{LockError, distributed_lock};

mod jobs {
    use dlock::{LockError, distributed_lock};

    /// Visible outside the module: the visibility is kept.
    #[distributed_lock(key = "vis", ttl = "30s")]
    pub(crate) async fn visible() -> Result<(), LockError> {
        Ok(())
    }
}

/// A documented, never-called function: `#[allow(dead_code)]` is kept, or
/// `deny(warnings)` would fail this file.
#[allow(dead_code)]
#[distributed_lock(key = "doc", ttl = "30s")]
async fn unused() -> Result<(), LockError> {
    Ok(())
}

/// `#[must_use]` is kept on the function.
#[must_use = "the result says whether the lock was had"]
#[distributed_lock(key = "must-use", ttl = "30s")]
async fn must_use() -> Result<u8, LockError> {
    #![allow(clippy::needless_return)]
    return Ok(1);
}

#[distributed_lock(key = "param-attrs:{id}", ttl = "30s")]
async fn param_attrs(
    #[allow(unused_variables)] id: u32,
    #[allow(unused_variables)] token: dlock::FencingToken,
) -> Result<(), LockError> {
    Ok(())
}

#[test]
fn compiles_without_warnings_and_runs() {
    let _alone = super::alone();
    drop(jobs::visible());
    drop(must_use());
    drop(param_attrs(1));
}

// One mistake, one message: the bad `ttl` is reported, and the call below,
// written as callers write it (without the token), gets no second error.

use dlock::{FencingToken, LockError, LostSignal, distributed_lock};

#[distributed_lock(key = "export:{tenant}", ttl = "30 parsecs")]
async fn export(tenant: u64, lost: LostSignal, token: FencingToken) -> Result<u64, LockError> {
    lost.check()?;
    Ok(tenant + token.get())
}

fn main() {
    let _ = export(42);
}

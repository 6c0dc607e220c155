use dlock::{FencingToken, LockError, distributed_lock};

#[distributed_lock(key = "export:{tenant}", ttl = "30s")]
pub async fn export(
    tenant: u64,
    token: FencingToken,
    again: FencingToken,
) -> Result<u64, LockError> {
    Ok(tenant + token.get() + again.get())
}

fn main() {}

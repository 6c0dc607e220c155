use dlock::{FencingToken, LockError, distributed_lock};

#[distributed_lock(key = "export:{tenant}:{token}", ttl = "30s")]
pub async fn export(tenant: u64, token: FencingToken) -> Result<u64, LockError> {
    Ok(tenant + token.get())
}

fn main() {}

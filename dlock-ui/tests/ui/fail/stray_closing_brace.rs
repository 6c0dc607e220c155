use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "export:tenant}", ttl = "30s")]
pub async fn export(tenant: u64) -> Result<u64, LockError> {
    Ok(tenant)
}

fn main() {}

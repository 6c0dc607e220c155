use dlock::{LockError, distributed_lock};

pub struct Tenant(pub u64);

#[distributed_lock(key = "export:{tenant}", ttl = "30s")]
pub async fn export(tenant: Tenant) -> Result<u64, LockError> {
    Ok(tenant.0)
}

fn main() {}

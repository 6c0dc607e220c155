use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "export:{tenent}:{region}", ttl = "30s")]
pub async fn export(tenant: u64, region: &str) -> Result<String, LockError> {
    Ok(format!("{tenant}@{region}"))
}

fn main() {}

use dlock::distributed_lock;

#[derive(Debug)]
pub struct AppError;

#[distributed_lock(key = "export:{tenant}", ttl = "30s")]
pub async fn export(tenant: u64) -> Result<u64, AppError> {
    Ok(tenant)
}

fn main() {}

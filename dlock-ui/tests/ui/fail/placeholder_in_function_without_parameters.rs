use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "export:{tenant}", ttl = "30s")]
pub async fn export() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

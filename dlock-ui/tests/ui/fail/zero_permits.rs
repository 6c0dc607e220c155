use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "uploads", ttl = "30s", permits = 0)]
pub async fn upload() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "uploads", ttl = "30s", wait = "10s", fair = true, permits = 4)]
pub async fn upload() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

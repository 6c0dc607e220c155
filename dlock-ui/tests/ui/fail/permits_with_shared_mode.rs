use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "uploads", ttl = "30s", mode = "shared", permits = 4)]
pub async fn upload() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

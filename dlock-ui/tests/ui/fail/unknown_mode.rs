use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "config", ttl = "30s", mode = "read")]
pub async fn read_config() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

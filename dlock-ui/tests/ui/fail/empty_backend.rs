use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "report", ttl = "30s", backend = "")]
pub async fn report() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "report", ttl = "30s", min_hold = "0s")]
pub async fn report() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "payouts", ttl = "30s", wait = "10s", fair = "yes")]
pub async fn payouts() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

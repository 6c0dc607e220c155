use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "payouts", ttl = "30s", fair = true)]
pub async fn payouts() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

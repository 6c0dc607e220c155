use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "report", ttl = "30s", min_hold = "1m")]
pub async fn report() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "report", ttl = "5ms")]
pub async fn report() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

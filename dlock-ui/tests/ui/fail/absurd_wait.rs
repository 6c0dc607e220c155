use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "report", ttl = "30s", wait = "1year")]
pub async fn report() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "report", ttl = "0s")]
pub async fn report() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

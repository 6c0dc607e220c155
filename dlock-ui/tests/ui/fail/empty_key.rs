use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "", ttl = "30s")]
pub async fn report() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

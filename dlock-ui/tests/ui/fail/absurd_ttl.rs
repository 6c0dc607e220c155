use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "report", ttl = "365days")]
pub async fn report() -> Result<(), LockError> {
    Ok(())
}

fn main() {}

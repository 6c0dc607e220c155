use dlock::{LockError, distributed_lock};

#[distributed_lock(ttl = "30s")]
pub async fn report(day: u32) -> Result<u32, LockError> {
    Ok(day)
}

fn main() {}

use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "account:{from}", keys = ["account:{from}", "account:{to}"], ttl = "30s")]
pub async fn transfer(from: u64, to: u64) -> Result<(), LockError> {
    let _ = (from, to);
    Ok(())
}

fn main() {}

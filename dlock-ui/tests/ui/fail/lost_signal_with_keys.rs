use dlock::{LockError, LostSignal, distributed_lock};

#[distributed_lock(keys = ["account:{from}", "account:{to}"], ttl = "30s")]
pub async fn transfer(from: u64, to: u64, lost: LostSignal) -> Result<u64, LockError> {
    lost.check()?;
    Ok(from + to)
}

fn main() {}

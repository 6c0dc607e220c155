use dlock::{LockError, distributed_lock};

#[distributed_lock(keys = ["pool:{a}", "pool:{b}"], ttl = "30s", permits = 4)]
pub async fn take_two(a: u64, b: u64) -> Result<u64, LockError> {
    Ok(a + b)
}

fn main() {}

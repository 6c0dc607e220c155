use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "cell:{x}", ttl = "30s")]
pub async fn paint((x, y): (u32, u32)) -> Result<u32, LockError> {
    Ok(x + y)
}

fn main() {}

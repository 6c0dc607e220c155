use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "cell:{row}{col}", ttl = "30s")]
pub async fn paint(row: u32, col: u32) -> Result<u32, LockError> {
    Ok(row * col)
}

fn main() {}

use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "account:{self.id}", ttl = "30s")]
pub async fn close(id: u64) -> Result<u64, LockError> {
    Ok(id)
}

fn main() {}

// A name bound twice among the parameters is rustc's error, reported once:
// the attribute adds no message of its own about the key that names it (the
// warning after it is rustc's too, the same without the attribute).

use dlock::{LockError, distributed_lock};

pub struct Path<T>(pub T);

#[distributed_lock(key = "order:{id}", ttl = "30s")]
pub async fn pay(id: u64, Path(id): Path<u64>) -> Result<u64, LockError> {
    Ok(id)
}

fn main() {}

// `{order}` names nothing: the message lists the parameters and the
// bindings inside parameter patterns a placeholder could name.

use dlock::{LockError, distributed_lock};

pub struct Path<T>(pub T);

#[distributed_lock(key = "order:{order}", ttl = "30s")]
pub async fn pay(tenant: u64, Path(id): Path<u64>, (a, b): (u32, u32)) -> Result<u64, LockError> {
    Ok(tenant + id + u64::from(a + b))
}

fn main() {}

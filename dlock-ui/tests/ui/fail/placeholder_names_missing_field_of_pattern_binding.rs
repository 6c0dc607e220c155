// rustc finds that `body` has no field `custmer`; the error points at the
// key, where the placeholder is.

use dlock::{LockError, distributed_lock};

pub struct Json<T>(pub T);

pub struct Order {
    pub customer: String,
}

#[distributed_lock(key = "order:{body.custmer}", ttl = "30s")]
pub async fn pay(Json(body): Json<Order>) -> Result<String, LockError> {
    Ok(body.customer)
}

fn main() {}

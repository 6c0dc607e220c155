use dlock::{FencingToken, LockError, distributed_lock};

#[distributed_lock(keys = ["account:{from}", "account:{to}"], ttl = "30s")]
pub async fn transfer(from: u64, to: u64, token: FencingToken) -> Result<u64, LockError> {
    Ok(from + to + token.get())
}

fn main() {}

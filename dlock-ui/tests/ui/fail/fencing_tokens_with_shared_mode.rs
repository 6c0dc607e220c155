use dlock::{FencingTokens, LockError, distributed_lock};

#[distributed_lock(keys = ["account:{from}", "account:{to}"], ttl = "30s", mode = "shared")]
pub async fn audit(from: u64, to: u64, tokens: FencingTokens) -> Result<usize, LockError> {
    Ok(tokens.len() + (from + to) as usize)
}

fn main() {}

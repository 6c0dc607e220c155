use dlock::{FencingTokens, LockError, distributed_lock};

#[distributed_lock(key = "export:{tenant}", ttl = "30s")]
pub async fn export(tenant: u64, tokens: FencingTokens) -> Result<u64, LockError> {
    Ok(tenant + tokens.len() as u64)
}

fn main() {}

#![deny(warnings)]

use dlock::{FencingTokens, LockError, distributed_lock};

#[distributed_lock(keys = ["account:{from}", "account:{to}"], ttl = "30s")]
async fn transfer(from: u64, to: u64, tokens: FencingTokens) -> Result<usize, LockError> {
    assert_ne!(from, to);
    Ok(tokens.len())
}

#[distributed_lock(keys = ["only:{id}",], ttl = "30s")]
async fn one_of_many(id: u64) -> Result<u64, LockError> {
    Ok(id)
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        assert_eq!(transfer(1, 2).await.expect("free keys"), 2);
        assert_eq!(transfer(2, 1).await.expect("released"), 2);
        assert_eq!(one_of_many(3).await.expect("free key"), 3);
    });
}

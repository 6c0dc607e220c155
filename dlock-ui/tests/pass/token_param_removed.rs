#![deny(warnings)]

use dlock::{FencingToken, LockError, distributed_lock};

#[distributed_lock(key = "export:{tenant}", ttl = "30s")]
async fn export(tenant: u64, token: FencingToken) -> Result<(u64, FencingToken), LockError> {
    Ok((tenant, token))
}

// The token may sit anywhere in the list, under any pattern.
#[distributed_lock(key = "import:{tenant}", ttl = "30s")]
async fn import(_token: FencingToken, tenant: u64) -> Result<u64, LockError> {
    Ok(tenant)
}

#[distributed_lock(key = "sync:{tenant}", ttl = "30s")]
async fn sync(tenant: u64, mut token: dlock::FencingToken) -> Result<u64, LockError> {
    token = FencingToken::new(token.get() + tenant);
    Ok(token.get())
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        // Callers never pass the token.
        let (tenant, first) = export(42).await.expect("free key");
        assert_eq!(tenant, 42);
        let (_, second) = export(42).await.expect("released after the first call");
        assert!(second > first);
        assert_eq!(import(1).await.expect("free key"), 1);
        assert!(sync(1).await.expect("free key") > 1);
    });
}

#![deny(warnings)]

use dlock::{Lease, LockError, distributed_lock};

#[distributed_lock(key = "uploads", ttl = "30s", permits = 4)]
async fn upload(n: u64) -> Result<u64, LockError> {
    Ok(n)
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        let (a, b) = tokio::join!(upload(1), upload(2));
        assert_eq!(a.expect("a permit") + b.expect("a permit"), 3);
        let _: Option<fn(&Lease) -> Option<u32>> = Some(Lease::slot);
    });
}

#![deny(warnings)]

use std::fmt::Display;

use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "opaque:{id}", ttl = "30s")]
async fn opaque(id: u32) -> Result<impl Display, LockError> {
    if id == 0 {
        return Err(LockError::InvalidOption {
            option: "id",
            reason: "zero".into(),
        });
    }
    Ok(id * 2)
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        assert_eq!(opaque(2).await.expect("free key").to_string(), "4");
        assert!(opaque(0).await.is_err());
    });
}

#![deny(warnings)]

use dlock::{FencingToken, LockError, distributed_lock};

#[distributed_lock(key = "config:{id}", ttl = "30s", mode = "shared")]
async fn read(id: u64, token: FencingToken) -> Result<FencingToken, LockError> {
    let _ = id;
    Ok(token)
}

#[distributed_lock(key = "config:{id}", ttl = "30s", mode = "exclusive")]
async fn write(id: u64, token: FencingToken) -> Result<FencingToken, LockError> {
    let _ = id;
    Ok(token)
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        let read_token = read(1).await.expect("free key");
        let write_token = write(1).await.expect("released");
        assert!(write_token > read_token);
        assert!(read(1).await.expect("released") > write_token);
    });
}

#![deny(warnings)]

use dlock::{LockError, distributed_lock};

type Res<T> = Result<T, LockError>;

#[distributed_lock(key = "alias:{id}", ttl = "30s")]
async fn aliased(id: u32) -> Res<u32> {
    Ok(id)
}

mod app {
    pub type Result<T, E = dlock::LockError> = std::result::Result<T, E>;
}

#[distributed_lock(key = "alias:{id}:app", ttl = "30s")]
async fn app_aliased(id: u32) -> app::Result<u32> {
    Ok(id)
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        assert_eq!(aliased(1).await.expect("free key"), 1);
        assert_eq!(app_aliased(2).await.expect("free key"), 2);
    });
}

#![deny(warnings)]

use dlock::{FencingToken, LockError, distributed_lock};

struct Service {
    name: String,
}

#[distributed_lock(key = "send:{id}", ttl = "30s")]
async fn work(id: u64, token: FencingToken) -> Result<u64, LockError> {
    tokio::task::yield_now().await;
    Ok(id + token.get())
}

impl Service {
    #[distributed_lock(key = "send:{self.name}", ttl = "30s", on_lost = "finish")]
    async fn work(&self, token: FencingToken) -> Result<u64, LockError> {
        tokio::task::yield_now().await;
        Ok(token.get())
    }
}

#[distributed_lock(keys = ["send:{a}", "send:{b}"], ttl = "30s")]
async fn many(a: u64, b: u64) -> Result<u64, LockError> {
    tokio::task::yield_now().await;
    Ok(a + b)
}

fn assert_send<T: Send>(_: T) {}

#[test]
fn compiles_without_warnings_and_runs() {
    let _alone = super::alone();
    assert_send(work(1));
    let service = Service {
        name: "s".to_owned(),
    };
    assert_send(service.work());
    assert_send(many(1, 2));
}

#![deny(warnings)]

use std::future::Future;

use dlock::{FencingToken, LockError, distributed_lock};

trait Job {
    async fn run(&self, shard: u32) -> Result<u64, LockError>;
}

trait SendJob {
    fn run(&self, shard: u32) -> impl Future<Output = Result<u64, LockError>> + Send;
}

struct Nightly {
    name: &'static str,
}

impl Job for Nightly {
    #[distributed_lock(key = "job:{self.name}:{shard}", ttl = "5m")]
    async fn run(&self, shard: u32, token: FencingToken) -> Result<u64, LockError> {
        Ok(token.get() + u64::from(shard))
    }
}

impl SendJob for Nightly {
    #[distributed_lock(key = "job:{self.name}:{shard}", ttl = "5m")]
    async fn run(&self, shard: u32, token: FencingToken) -> Result<u64, LockError> {
        Ok(token.get() + u64::from(shard))
    }
}

fn assert_send<T: Send>(value: T) -> T {
    value
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        let job = Nightly { name: "nightly" };
        assert!(Job::run(&job, 1).await.expect("free key") > 1);
        assert!(assert_send(SendJob::run(&job, 2)).await.expect("free key") > 2);
    });
}

// async-trait has rewritten the declaration's return type by the time the
// attribute sees it: the error points at what the user wrote.

use async_trait::async_trait;
use dlock::{FencingToken, LockError, distributed_lock};

#[async_trait]
pub trait Job {
    #[distributed_lock(key = "job:{shard}", ttl = "30s")]
    async fn run(&self, shard: u32, token: FencingToken) -> Result<u64, LockError>;
}

fn main() {}

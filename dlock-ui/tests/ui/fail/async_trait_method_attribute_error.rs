// A misuse on a method of an `#[async_trait]` impl is reported once: not as a
// missing `async` (async-trait has removed it), and without a mismatch
// against the trait's signature, which has no token.

use async_trait::async_trait;
use dlock::{FencingToken, LockError, distributed_lock};

#[async_trait]
trait Job {
    async fn run(&self, shard: u32) -> Result<u64, LockError>;
}

struct Nightly;

#[async_trait]
impl Job for Nightly {
    #[distributed_lock(key = "job:{shards}", ttl = "30s")]
    async fn run(&self, shard: u32, token: FencingToken) -> Result<u64, LockError> {
        Ok(token.get() + u64::from(shard))
    }
}

fn main() {}

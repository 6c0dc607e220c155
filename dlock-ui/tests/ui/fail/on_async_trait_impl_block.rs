// The order that cannot work: on the impl block (above or below
// `#[async_trait]`) the attribute cannot tell which methods to lock. The
// error says where it goes; the methods it would lock lose their token, so
// they get no second error for not matching the trait.

use async_trait::async_trait;
use dlock::{FencingToken, LockError, distributed_lock};

#[async_trait]
trait Job {
    async fn run(&self, shard: u32) -> Result<u64, LockError>;
}

struct Nightly;

#[distributed_lock(key = "job:{shard}", ttl = "30s")]
#[async_trait]
impl Job for Nightly {
    async fn run(&self, shard: u32, token: FencingToken) -> Result<u64, LockError> {
        Ok(token.get() + u64::from(shard))
    }
}

fn main() {}

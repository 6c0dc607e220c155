// The same message as on an `async fn`, on the return type as written
// (not the boxed future async-trait wrote in its place).

use async_trait::async_trait;
use dlock::{FencingToken, distributed_lock};

#[async_trait]
trait Job {
    async fn run(&self, shard: u32) -> u64;
}

struct Nightly;

#[async_trait]
impl Job for Nightly {
    #[distributed_lock(key = "job:{shard}", ttl = "30s")]
    async fn run(&self, shard: u32, token: FencingToken) -> u64 {
        token.get() + u64::from(shard)
    }
}

fn main() {}

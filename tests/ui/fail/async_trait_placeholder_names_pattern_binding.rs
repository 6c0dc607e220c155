// The same message as on an `async fn`, although async-trait has replaced
// the pattern `(a, b)` in the signature by a parameter of its own.

use async_trait::async_trait;
use dlock::{LockError, distributed_lock};

#[async_trait]
trait Job {
    async fn run(&self, pair: (u32, u32)) -> Result<u64, LockError>;
}

struct Nightly;

#[async_trait]
impl Job for Nightly {
    #[distributed_lock(key = "job:{a}", ttl = "30s")]
    async fn run(&self, (a, b): (u32, u32)) -> Result<u64, LockError> {
        Ok(u64::from(a + b))
    }
}

fn main() {}

// The same message as on an `async fn`, although async-trait has replaced
// the patterns `(a, b)` and `_` in the signature by parameters of its own:
// the message shows the patterns as written, and not async-trait's names.

use async_trait::async_trait;
use dlock::{LockError, distributed_lock};

#[async_trait]
trait Job {
    async fn run(&self, pair: (u32, u32), skipped: u32) -> Result<u64, LockError>;
}

struct Nightly;

#[async_trait]
impl Job for Nightly {
    #[distributed_lock(key = "job:{c}", ttl = "30s")]
    async fn run(&self, (a, b): (u32, u32), _: u32) -> Result<u64, LockError> {
        Ok(u64::from(a + b))
    }
}

fn main() {}

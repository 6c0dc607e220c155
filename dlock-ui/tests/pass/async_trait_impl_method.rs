#![deny(warnings)]

// `#[async_trait]` on the impl expands first; `#[distributed_lock]` then sees
// the method async-trait wrote (a plain `fn` returning `Box::pin(async move
// { ... })`) and locks inside that future.

use async_trait::async_trait;
use dlock::{FencingToken, LockError, LostSignal, distributed_lock};

#[derive(Debug)]
enum JobError {
    // Carried to the caller, never read here.
    Lock(#[allow(dead_code)] LockError),
}

impl From<LockError> for JobError {
    fn from(err: LockError) -> Self {
        JobError::Lock(err)
    }
}

type JobResult<T> = Result<T, JobError>;

#[async_trait]
trait Job: Send + Sync {
    async fn run(&self, shard: u32, (a, b): (u32, u32)) -> JobResult<u64>;
    async fn watch(&mut self, shard: u32) -> Result<u64, LockError>;
    async fn consume(self: Box<Self>, mut shard: u32) -> Result<u32, LockError>;
}

#[async_trait(?Send)]
trait LocalJob {
    async fn run(&self, shard: u32) -> Result<u64, LockError>;
    async fn tag<T: std::fmt::Display>(&self, label: T) -> Result<String, LockError>;
}

struct Nightly {
    name: &'static str,
    runs: u32,
}

#[async_trait]
impl Job for Nightly {
    #[distributed_lock(key = "job:{self.name}:{shard}", ttl = "5m")]
    async fn run(&self, shard: u32, (a, b): (u32, u32), token: FencingToken) -> JobResult<u64> {
        let checked: u64 = Ok::<_, LockError>(token.get())?;
        Ok(checked + u64::from(shard + a + b))
    }

    #[distributed_lock(key = "watch:{self.name}:{shard}", ttl = "5m", on_lost = "finish")]
    async fn watch(
        &mut self,
        shard: u32,
        lost: LostSignal,
        _: FencingToken,
    ) -> Result<u64, LockError> {
        lost.check()?;
        self.runs += 1;
        Ok(u64::from(shard + self.runs))
    }

    #[distributed_lock(key = "consume:{self.name}:{shard}", ttl = "5m")]
    async fn consume(
        self: Box<Self>,
        mut shard: u32,
        mut token: FencingToken,
    ) -> Result<u32, LockError> {
        // `mut` patterns stay usable in the body, also on the token.
        shard += 1;
        token = token.max(token);
        assert!(token.get() > 0);
        Ok(shard + self.runs)
    }
}

#[async_trait(?Send)]
impl LocalJob for Nightly {
    #[distributed_lock(key = "local:{self.name}:{shard}", ttl = "5m")]
    async fn run(&self, shard: u32, token: FencingToken) -> Result<u64, LockError> {
        Ok(token.get() + u64::from(shard))
    }

    #[distributed_lock(key = "tag:{label}", ttl = "5m")]
    async fn tag<T: std::fmt::Display>(
        &self,
        label: T,
        token: FencingToken,
    ) -> Result<String, LockError> {
        Ok(format!("{label}:{}", token.get()))
    }
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        let mut job: Box<dyn Job> = Box::new(Nightly {
            name: "nightly",
            runs: 0,
        });
        assert!(job.run(1, (2, 3)).await.expect("free key") > 6);
        assert_eq!(job.watch(1).await.expect("free key"), 2);
        assert_eq!(job.consume(1).await.expect("free key"), 3);
        let local = Nightly {
            name: "nightly",
            runs: 0,
        };
        assert!(LocalJob::run(&local, 1).await.expect("free key") > 1);
        assert!(local.tag("x").await.expect("free key").starts_with("x:"));
    });
}

#![deny(warnings)]

// async-trait moves a parameter pattern such as `(a, b)` out of the
// signature and destructures it inside the future it boxes; the lock
// destructures the ones its key reads first, as an `async fn` would, and
// the body still gets its bindings (by move, `mut` kept).

use async_trait::async_trait;
use dlock::{FencingToken, LockError, distributed_lock};

pub struct Path<T>(pub T);
pub struct Json<T>(pub T);

pub struct Order {
    pub customer: String,
    pub lines: Vec<String>,
}

#[async_trait]
trait Job: Send + Sync {
    async fn run(&self, pair: (u32, u32), skipped: u32) -> Result<u64, LockError>;
    async fn pay(&self, id: Path<u64>, body: Json<Order>) -> Result<Order, LockError>;
    async fn peek(&self, pair: &(u32, u32), whole: (u8, u8)) -> Result<u32, LockError>;

    // A default method, rewritten by the `#[async_trait]` on the trait.
    #[distributed_lock(key = "audit:{id}", ttl = "30s")]
    async fn audit(&self, Path(id): Path<u64>, token: FencingToken) -> Result<u64, LockError> {
        Ok(id + token.get())
    }
}

struct Nightly {
    name: &'static str,
}

#[async_trait]
impl Job for Nightly {
    #[distributed_lock(key = "job:{self.name}:{a}", ttl = "30s")]
    async fn run(&self, (mut a, b): (u32, u32), _: u32) -> Result<u64, LockError> {
        a += 1;
        Ok(u64::from(a + b))
    }

    #[distributed_lock(key = "pay:{id}:{body.customer}", ttl = "30s")]
    async fn pay(&self, Path(id): Path<u64>, Json(body): Json<Order>) -> Result<Order, LockError> {
        assert_eq!(id, 1);
        Ok(body)
    }

    // A pattern on a reference stays in the signature; `@` binds the whole.
    #[distributed_lock(key = "peek:{x}:{whole.1}:{c}", ttl = "30s")]
    async fn peek(&self, &(x, y): &(u32, u32), whole @ (c, _): (u8, u8)) -> Result<u32, LockError> {
        Ok(x + y + u32::from(c) + u32::from(whole.1))
    }
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        let job: Box<dyn Job> = Box::new(Nightly { name: "nightly" });
        assert_eq!(job.run((1, 2), 0).await.expect("free key"), 4);
        let order = Order {
            customer: "ann".to_owned(),
            lines: vec!["tea".to_owned()],
        };
        let paid = job.pay(Path(1), Json(order)).await.expect("free key");
        assert_eq!((paid.customer.as_str(), paid.lines.len()), ("ann", 1));
        assert_eq!(job.peek(&(1, 2), (3, 4)).await.expect("free key"), 10);
        assert!(job.audit(Path(5)).await.expect("free key") > 5);
    });
}

#![deny(warnings)]

// `#[async_trait]` on the trait expands first, so `#[distributed_lock]` on a
// default method sees the method async-trait wrote; the token leaves the
// trait's signature, and implementors neither declare nor pass it.

use async_trait::async_trait;
use dlock::{FencingToken, LockError, distributed_lock};

#[async_trait]
trait Export: Sync {
    fn region(&self) -> &str;

    #[distributed_lock(key = "export:{tenant}", ttl = "5m")]
    async fn export(&self, tenant: u64, token: FencingToken) -> Result<u64, LockError> {
        Ok(tenant + token.get() + self.region().len() as u64)
    }
}

struct Eu;

#[async_trait]
impl Export for Eu {
    fn region(&self) -> &str {
        "eu"
    }
}

struct Us;

// An implementor may override the locked default with a locked method.
#[async_trait]
impl Export for Us {
    fn region(&self) -> &str {
        "us"
    }

    // `tenant` is only read by the key: no "unused variable" warning, as for
    // an `async fn` (async-trait moves each parameter into the future).
    #[distributed_lock(key = "export:us:{tenant}", ttl = "5m")]
    async fn export(&self, tenant: u64, token: FencingToken) -> Result<u64, LockError> {
        Ok(token.get())
    }
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        let eu: &dyn Export = &Eu;
        assert!(eu.export(7).await.expect("free key") > 9);
        let us: &dyn Export = &Us;
        assert!(us.export(7).await.expect("free key") > 0);
    });
}

#![deny(warnings)]

use dlock::{LockError, distributed_lock};

struct Wrapper((u32, &'static str));

#[distributed_lock(key = "pair:{pair.0}:{pair.1}:{w.0.1}", ttl = "30s")]
async fn pair(pair: (u32, String), w: Wrapper) -> Result<String, LockError> {
    Ok(format!("{}-{}-{}", pair.0, pair.1, (w.0).0))
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        let out = pair((1, "x".to_owned()), Wrapper((2, "y")))
            .await
            .expect("free key");
        assert_eq!(out, "1-x-2");
    });
}

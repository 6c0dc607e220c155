#![deny(warnings)]

use std::fmt::Display;

use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "greet:{who}", ttl = "30s")]
async fn greet(
    who: impl Display + Send,
    rest: impl IntoIterator<Item = u32>,
) -> Result<String, LockError> {
    Ok(format!("hello {who} {}", rest.into_iter().sum::<u32>()))
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        assert_eq!(greet("ann", [1, 2]).await.expect("free key"), "hello ann 3");
    });
}

#![deny(warnings)]

use std::fmt::Display;

use dlock::{LockError, distributed_lock, memory::MemoryBackend, registry};

#[distributed_lock(key = "greet:{who}", ttl = "30s")]
async fn greet(
    who: impl Display + Send,
    rest: impl IntoIterator<Item = u32>,
) -> Result<String, LockError> {
    Ok(format!("hello {who} {}", rest.into_iter().sum::<u32>()))
}

#[test]
fn compiles_without_warnings_and_runs() {
    let _alone = super::alone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        registry().register("default", MemoryBackend::new());
        assert_eq!(greet("ann", [1, 2]).await.expect("free key"), "hello ann 3");
    });
}

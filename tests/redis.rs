//! The conformance suite on `RedisBackend` against the Redis at
//! `DLOCK_REDIS_URL` (default `redis://127.0.0.1:6379`).

mod conformance;

use std::sync::Arc;

use dlock::Backend;
use dlock::redis::RedisBackend;

fn redis_url() -> String {
    std::env::var("DLOCK_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

async fn backend() -> Arc<dyn Backend> {
    Arc::new(
        RedisBackend::connect(&redis_url())
            .await
            .expect("the Redis at DLOCK_REDIS_URL (or 127.0.0.1:6379) must be running"),
    )
}

conformance::suite!(backend);

//! A tiny axum service whose handlers lock per order with
//! `#[distributed_lock]`, on the in-memory backend.
//!
//! ```text
//! cargo run --example axum_service --features axum
//! curl -X POST 127.0.0.1:3000/orders/7/pay &    # 200 after 300 ms
//! curl -i -X POST 127.0.0.1:3000/orders/7/pay   # 409, Retry-After: 1
//! ```
//!
//! The handlers return `Result<String, LockError>`: with the `axum` feature
//! `LockError` is a response (409 for a held order, 503 for a backend that
//! failed; see `dlock::http`), so a handler needs no mapping of its own.

use std::time::Duration;

use axum::Router;
use axum::extract::Path;
use axum::routing::post;
use dlock::{FencingToken, LockError, distributed_lock, memory::MemoryBackend, registry};

/// Pays an order: one payment per order at a time, across every replica
/// that shares the backend. A second request while the first runs gets 409.
#[distributed_lock(key = "order:{id}", ttl = "30s")]
async fn pay(Path(id): Path<u64>, token: FencingToken) -> Result<String, LockError> {
    // The payment provider's call; a real one sends `token` with its write.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(format!("order {id} paid under fencing token {token}\n"))
}

/// Ships an order, waiting up to a second for a payment still running
/// (503 with `Retry-After` when it does not end in time).
#[distributed_lock(key = "order:{id}", ttl = "30s", wait = "1s")]
async fn ship(Path(id): Path<u64>) -> Result<String, LockError> {
    Ok(format!("order {id} shipped\n"))
}

/// The service's routes. The backend must be registered as `default`.
pub fn app() -> Router {
    Router::new()
        .route("/orders/{id}/pay", post(pay))
        .route("/orders/{id}/ship", post(ship))
}

#[allow(dead_code)] // tests/axum_http.rs includes this file for `app`
#[tokio::main]
async fn main() -> std::io::Result<()> {
    registry().register("default", MemoryBackend::new());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app()).await
}

//! Locked axum handlers over real HTTP: the router of
//! `examples/axum_service.rs` (and two handlers of the tests' own on one key) on a
//! loopback port, asked by a client that writes HTTP/1.1 on a `TcpStream`
//! and reads the reply with httparse.
//!
//! The backend is the in-memory one, registered once as `default`; each test
//! locks keys of its own, so the tests can share the process.

use std::net::SocketAddr;
use std::sync::Once;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use dlock::{FencingToken, LockError, distributed_lock, memory::MemoryBackend, registry};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[path = "../examples/axum_service.rs"]
mod service;

/// Holds its key far longer than any test waits, so only a release on
/// cancellation can free it in time. It waits for the key: the test's probes
/// (`quick`) may hold it for a moment when it arrives.
#[distributed_lock(key = "slow:{id}", ttl = "30s", wait = "5s")]
async fn slow(Path(id): Path<u64>) -> Result<String, LockError> {
    tokio::time::sleep(Duration::from_secs(20)).await;
    Ok(format!("slow {id} done\n"))
}

/// The same key as [`slow`], answered at once: 200 as soon as it is free.
#[distributed_lock(key = "slow:{id}", ttl = "30s")]
async fn quick(Path(id): Path<u64>) -> Result<String, LockError> {
    Ok(format!("quick {id} done\n"))
}

/// Lets [`pay_held`] finish: a permit per handler to let go.
static PAY_HELD_GO: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);

/// The example's `pay` (the same key and ttl), but it holds its key until
/// the test lets it go, not for a fixed 300 ms: a request that arrives late
/// on a loaded machine still finds the key held.
#[distributed_lock(key = "order:{id}", ttl = "30s")]
async fn pay_held(Path(id): Path<u64>, token: FencingToken) -> Result<String, LockError> {
    PAY_HELD_GO.acquire().await.expect("never closed").forget();
    Ok(format!("order {id} paid under fencing token {token}\n"))
}

/// The example's routes plus `/slow/{id}`, `/quick/{id}` and
/// `/orders/{id}/pay-held`, on 127.0.0.1:0.
async fn serve() -> SocketAddr {
    static BACKEND: Once = Once::new();
    BACKEND.call_once(|| {
        registry().register("default", MemoryBackend::new());
    });
    let app: Router = service::app()
        .route("/slow/{id}", post(slow))
        .route("/quick/{id}", post(quick))
        .route("/orders/{id}/pay-held", post(pay_held));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// The ttl of the example's `pay` handler.
const PAY_TTL_SECS: u64 = 30;

#[derive(Debug)]
struct Reply {
    status: u16,
    retry_after: Option<String>,
    body: String,
}

fn request_bytes(path: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .into_bytes()
}

/// One POST on a connection of its own, read to the server's close.
async fn post_to(addr: SocketAddr, path: &str) -> Reply {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(&request_bytes(path)).await.expect("send");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read reply");
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut parsed = httparse::Response::new(&mut headers);
    let head_len = match parsed.parse(&raw).expect("an HTTP/1.1 reply") {
        httparse::Status::Complete(len) => len,
        httparse::Status::Partial => panic!("reply cut short: {raw:?}"),
    };
    let retry_after = parsed
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("retry-after"))
        .map(|h| String::from_utf8_lossy(h.value).into_owned());
    Reply {
        status: parsed.code.expect("a status code"),
        retry_after,
        body: String::from_utf8_lossy(&raw[head_len..]).into_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_for_one_key_get_one_200_and_409s_with_retry_after() {
    let addr = serve().await;
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..20 {
        requests.spawn(post_to(addr, "/orders/1/pay-held"));
    }
    // The one that takes `order:1` holds it until the other 19 have their
    // replies; a second holder would wait too, so 19 never arrive.
    let mut replies = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), async {
        while replies.len() < 19 {
            replies.push(
                requests
                    .join_next()
                    .await
                    .expect("a request")
                    .expect("request task"),
            );
        }
    })
    .await;
    PAY_HELD_GO.add_permits(20);
    while let Some(reply) = requests.join_next().await {
        replies.push(reply.expect("request task"));
    }
    let ok: Vec<_> = replies.iter().filter(|r| r.status == 200).collect();
    assert_eq!(ok.len(), 1, "exactly one request pays: {replies:#?}");
    assert!(ok[0].body.starts_with("order 1 paid"), "{:?}", ok[0].body);
    for held in replies.iter().filter(|r| r.status != 200) {
        assert_eq!(held.status, 409, "a held key is 409 Conflict: {held:?}");
        let retry_after: u64 = held
            .retry_after
            .as_deref()
            .and_then(|secs| secs.parse().ok())
            .unwrap_or_else(|| panic!("a 409 without a Retry-After: {held:?}"));
        assert!(
            (1..=PAY_TTL_SECS).contains(&retry_after),
            "Retry-After is the holder's remaining ttl: {held:?}"
        );
        assert_eq!(
            held.body,
            "lock `order:1` is held by another request; try again later\n"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn different_keys_proceed_in_parallel() {
    let addr = serve().await;
    let started = Instant::now();
    let requests: Vec<_> = (100..120)
        .map(|id| tokio::spawn(async move { post_to(addr, &format!("/orders/{id}/pay")).await }))
        .collect();
    for request in requests {
        let reply = request.await.expect("request task");
        assert_eq!(reply.status, 200, "{reply:?}");
    }
    // Each holds its key for 300 ms: one after another would take 6 s.
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "20 keys took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_disconnects_releases_its_handlers_lock() {
    let addr = serve().await;
    let mut first = TcpStream::connect(addr).await.expect("connect");
    first
        .write_all(&request_bytes("/slow/1"))
        .await
        .expect("send");
    // Once the handler holds `slow:1`, a request for the key is refused.
    let held = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let reply = post_to(addr, "/quick/1").await;
            if reply.status == 409 {
                return reply;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the slow handler never took its lock");
    // `slow` holds its key with a 30 s ttl, renewed every 10 s: the time
    // left is over 20 s whenever it is read, so a Retry-After of the
    // holder's remaining ttl is well above the 1 s sent when unknown.
    let retry_after: u64 = held
        .retry_after
        .as_deref()
        .and_then(|secs| secs.parse().ok())
        .unwrap_or_else(|| panic!("a 409 without a Retry-After: {held:?}"));
    assert!(
        (20..=30).contains(&retry_after),
        "Retry-After is the slow holder's remaining ttl: {held:?}"
    );
    let me = dlock::HolderInfo::this_process(None);
    assert!(
        !held.body.contains(&me.host) && !held.body.contains(&me.pid.to_string()),
        "a 409 body tells a client nothing of the holder's host or pid: {held:?}"
    );

    // Closing the connection makes hyper drop the handler's future, and with
    // it the lease, which releases the key: well before the handler's 20 s.
    drop(first);
    let closed = Instant::now();
    let freed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let reply = post_to(addr, "/quick/1").await;
            match reply.status {
                200 => return,
                409 => tokio::time::sleep(Duration::from_millis(10)).await,
                _ => panic!("unexpected reply {reply:?}"),
            }
        }
    })
    .await;
    assert!(
        freed.is_ok(),
        "`slow:1` still held {:?} after its client closed the connection",
        closed.elapsed()
    );
}

/// The status of every error a handler can return, as `dlock::http` documents.
#[test]
fn each_error_gets_its_documented_status_and_retry_after() {
    use dlock::error::{LostReason, Operation};
    let cases = [
        (
            LockError::Held {
                key: "k".into(),
                holder: None,
            },
            409,
            Some("1"),
        ),
        (
            LockError::Timeout {
                key: "k".into(),
                waited: Duration::from_millis(1500),
            },
            503,
            Some("1"),
        ),
        (
            LockError::LeaseLost {
                key: "k".into(),
                token: FencingToken::new(7),
                reason: LostReason::Expired,
            },
            503,
            None,
        ),
        (
            LockError::backend("redis", Operation::Acquire, "k", "connection refused"),
            503,
            None,
        ),
        (
            LockError::StaleToken {
                resource: "r".into(),
                offered: FencingToken::new(1),
                highest: FencingToken::new(2),
            },
            409,
            None,
        ),
        (
            LockError::UnknownBackend {
                name: "pg".into(),
                registered: "none".into(),
            },
            500,
            None,
        ),
        (LockError::invalid_key("", "empty"), 400, None),
        (
            LockError::InvalidOption {
                option: "ttl",
                reason: "zero".into(),
            },
            500,
            None,
        ),
        (LockError::NoRuntime { key: "k".into() }, 500, None),
    ];
    for (error, status, retry_after) in cases {
        let message = error.to_string();
        let response = error.into_response();
        assert_eq!(
            response.status(),
            StatusCode::from_u16(status).unwrap(),
            "{message}"
        );
        assert_eq!(
            response
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap()),
            retry_after,
            "{message}"
        );
    }
}

/// A failed backend's message names its user, host and database: a 5xx
/// body is a fixed sentence and tells an anonymous client none of it,
/// while a 4xx body says which key it was about.
#[tokio::test]
async fn a_server_error_body_tells_the_client_nothing_of_the_backend() {
    use dlock::error::Operation;
    let detail = "cannot connect to billing_admin@10.255.255.1:6543/payments";
    for error in [
        LockError::backend("pg", Operation::Connect, "order:7", detail),
        LockError::UnknownBackend {
            name: "pg".into(),
            registered: "billing-primary, billing-replica".into(),
        },
    ] {
        let body = axum::body::to_bytes(error.into_response().into_body(), 4096)
            .await
            .expect("body");
        let body = String::from_utf8(body.to_vec()).expect("text");
        for secret in [
            "billing_admin",
            "10.255.255.1",
            "payments",
            "billing-primary",
        ] {
            assert!(!body.contains(secret), "{secret:?} in the body {body:?}");
        }
    }
    // A held key's 409 names the key, and nothing of the holder's fleet.
    let holder = dlock::HolderInfo::decode("1\tweb-3.internal\t4121\tbilling-team")
        .expect("a holder record");
    let held = LockError::Held {
        key: "order:7".into(),
        holder: Some(Box::new(
            dlock::Holding::new(None, Some("leader-9".into()))
                .expiring_in(Duration::from_secs(17))
                .held_by(Some(holder)),
        )),
    };
    let body = axum::body::to_bytes(held.into_response().into_body(), 4096)
        .await
        .expect("body");
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("order:7"), "{body:?}");
    for secret in ["web-3.internal", "4121", "billing-team", "leader-9"] {
        assert!(!body.contains(secret), "{secret:?} in the body {body:?}");
    }
}

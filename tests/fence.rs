//! The resource-side checks of `dlock::fence` against real servers (Redis at
//! 127.0.0.1:6379 or `DLOCK_REDIS_URL`, PostgreSQL at 127.0.0.1:5432 or
//! `DLOCK_PG_URL`): stale tokens are refused with an error naming the
//! resource and both tokens, equal tokens are accepted, concurrent fenced
//! transactions lose no update, and a token from any backend fences any
//! resource — the article's timeline with real leases.

mod support;

use std::sync::Arc;
use std::time::Duration;
#[cfg(feature = "pg")]
use support::within;

use dlock::backend::OwnerId;
use dlock::fence::FencedCell;
use dlock::memory::MemoryBackend;
#[cfg(all(feature = "redis", feature = "pg"))]
use dlock::pg::PgBackend;
#[cfg(feature = "pg")]
use dlock::pg::fence::PgFence;
#[cfg(feature = "pg")]
use dlock::pg::tokio_postgres::{self, NoTls};
#[cfg(all(feature = "redis", feature = "pg"))]
use dlock::redis::RedisBackend;
#[cfg(feature = "redis")]
use dlock::redis::fence::RedisFence;
use dlock::{Backend, FencingToken, LockError, LockOptions};

#[cfg(feature = "pg")]
fn pg_conn() -> String {
    std::env::var("DLOCK_PG_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".to_owned())
}

#[cfg(feature = "redis")]
fn redis_url() -> String {
    std::env::var("DLOCK_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A resource name no other test (or earlier run) uses.
fn fresh(label: &str) -> String {
    format!(
        "dlock-test:{label}:{}",
        OwnerId::random().expect("random bytes")
    )
}

#[cfg(feature = "pg")]
async fn pg_client() -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&pg_conn(), NoTls)
        .await
        .expect("PostgreSQL at 127.0.0.1:5432 or DLOCK_PG_URL");
    tokio::spawn(connection);
    client
}

#[cfg(feature = "redis")]
async fn redis_conn() -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis_url())
        .expect("Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("Redis at 127.0.0.1:6379 or DLOCK_REDIS_URL")
}

#[cfg(any(feature = "redis", feature = "pg"))]
fn token(value: u64) -> FencingToken {
    FencingToken::new(value)
}

#[cfg(any(feature = "redis", feature = "pg"))]
fn assert_stale(
    result: Result<impl std::fmt::Debug, LockError>,
    resource: &str,
    offered: u64,
    highest: u64,
) {
    match result {
        Err(err @ LockError::StaleToken { .. }) => {
            let text = err.to_string();
            let LockError::StaleToken {
                resource: named,
                offered: o,
                highest: h,
            } = err
            else {
                unreachable!()
            };
            assert_eq!(
                (named.as_str(), o.get(), h.get()),
                (resource, offered, highest)
            );
            for part in [resource, &offered.to_string(), &highest.to_string()] {
                assert!(text.contains(part), "{text:?} must name {part}");
            }
        }
        other => panic!("expected a stale-token error, got {other:?}"),
    }
}

// ---------------------------------------------------------------- PostgreSQL

#[cfg(feature = "pg")]
async fn pg_fence(client: &tokio_postgres::Client) -> PgFence {
    let fence = PgFence::new();
    fence
        .create_table(client)
        .await
        .expect("create fence table");
    fence
}

#[cfg(feature = "pg")]
#[tokio::test]
async fn pg_fence_refuses_a_lower_token_naming_resource_offered_and_highest() {
    let mut client = pg_client().await;
    let fence = pg_fence(&client).await;
    let resource = fresh("pg-stale");
    let tx = client.transaction().await.expect("begin");
    fence
        .accept(&tx, &resource, token(8))
        .await
        .expect("first token");
    tx.commit().await.expect("commit");

    let tx = client.transaction().await.expect("begin");
    assert_stale(
        fence.accept(&tx, &resource, token(7)).await,
        &resource,
        7,
        8,
    );
    tx.rollback().await.expect("rollback");

    // The same token again (a holder writing twice) and a higher one pass.
    for t in [8, 9] {
        let tx = client.transaction().await.expect("begin");
        fence
            .accept(&tx, &resource, token(t))
            .await
            .expect("not stale");
        tx.commit().await.expect("commit");
    }
    assert_eq!(
        fence.highest(&client, &resource).await.expect("highest"),
        Some(token(9))
    );
}

#[cfg(feature = "pg")]
#[tokio::test]
async fn pg_fence_recorded_token_rolls_back_with_the_callers_transaction() {
    let mut client = pg_client().await;
    let fence = pg_fence(&client).await;
    let resource = fresh("pg-rollback");
    let tx = client.transaction().await.expect("begin");
    fence
        .accept(&tx, &resource, token(5))
        .await
        .expect("accept");
    tx.rollback().await.expect("rollback");
    assert_eq!(
        fence.highest(&client, &resource).await.expect("highest"),
        None
    );
}

#[cfg(feature = "pg")]
#[tokio::test]
async fn pg_fence_rejects_bad_names_and_tokens_beyond_bigint_without_panicking() {
    let mut client = pg_client().await;
    let tx = client.transaction().await.expect("begin");
    let err = PgFence::new()
        .accept(&tx, "", token(1))
        .await
        .expect_err("empty");
    assert!(
        matches!(
            err,
            LockError::InvalidOption {
                option: "resource",
                ..
            }
        ),
        "{err}"
    );
    let err = PgFence::new()
        .schema("Robert'); DROP TABLE x;--")
        .accept(&tx, "r", token(1))
        .await
        .expect_err("bad schema");
    assert!(
        matches!(
            err,
            LockError::InvalidOption {
                option: "schema",
                ..
            }
        ),
        "{err}"
    );
    let err = PgFence::new()
        .accept(&tx, &fresh("pg-huge"), token(u64::MAX))
        .await
        .expect_err("beyond bigint");
    assert!(err.to_string().contains("bigint"), "{err}");
    tx.rollback().await.expect("rollback");
}

#[cfg(feature = "pg")]
#[tokio::test]
async fn pg_fence_missing_table_is_a_clear_error() {
    let mut client = pg_client().await;
    let tx = client.transaction().await.expect("begin");
    let err = PgFence::new()
        .schema("dlock_no_such_schema")
        .accept(&tx, &fresh("pg-missing"), token(1))
        .await
        .expect_err("no table");
    assert!(err.to_string().contains("create_table"), "{err}");
}

/// Eight writers, each with its own connection and its own token, race to
/// increment one row in fenced READ COMMITTED transactions (fence first,
/// then read, then write). Each commits or is refused as stale; the counter
/// must equal the number of commits, and the committed tokens, in commit
/// order, must rise.
#[cfg(feature = "pg")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_fence_concurrent_writers_with_different_tokens_lose_no_update_under_read_committed() {
    let setup = pg_client().await;
    let fence = pg_fence(&setup).await;
    let resource = fresh("pg-race");
    setup
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS dlock_fence_test_counter \
             (resource text PRIMARY KEY, value bigint NOT NULL, tokens bigint[] NOT NULL)",
        )
        .await
        .expect("counter table");
    setup
        .execute(
            "INSERT INTO dlock_fence_test_counter VALUES ($1, 0, '{}')",
            &[&resource],
        )
        .await
        .expect("counter row");
    let mut tokens: Vec<u64> = (1..=8).map(|i| 100 + i * 3 % 8).collect();
    tokens.sort_unstable();
    tokens.dedup();
    let barrier = Arc::new(tokio::sync::Barrier::new(tokens.len()));
    let writers: Vec<_> = tokens
        .iter()
        .map(|&t| {
            let (fence, resource, barrier) = (fence.clone(), resource.clone(), barrier.clone());
            tokio::spawn(async move {
                let mut client = pg_client().await;
                barrier.wait().await;
                let tx = client.transaction().await.expect("begin");
                if let Err(err) = fence.accept(&tx, &resource, token(t)).await {
                    assert!(matches!(err, LockError::StaleToken { .. }), "{err}");
                    tx.rollback().await.expect("rollback");
                    return false;
                }
                let value: i64 = tx
                    .query_one(
                        "SELECT value FROM dlock_fence_test_counter WHERE resource = $1",
                        &[&resource],
                    )
                    .await
                    .expect("read")
                    .get(0);
                tokio::time::sleep(Duration::from_millis(20)).await;
                tx.execute(
                    "UPDATE dlock_fence_test_counter SET value = $2, tokens = tokens || $3::bigint \
                     WHERE resource = $1",
                    &[&resource, &(value + 1), &(t as i64)],
                )
                .await
                .expect("write");
                tx.commit().await.expect("commit");
                true
            })
        })
        .collect();
    let mut commits = 0;
    for writer in writers {
        if within(30, "a fenced writer", writer).await.expect("task") {
            commits += 1;
        }
    }
    let row = setup
        .query_one(
            "SELECT value, tokens FROM dlock_fence_test_counter WHERE resource = $1",
            &[&resource],
        )
        .await
        .expect("final row");
    let (value, committed): (i64, Vec<i64>) = (row.get(0), row.get(1));
    assert!(commits >= 1);
    assert_eq!(value, commits as i64, "an update was lost: {committed:?}");
    assert!(
        committed.windows(2).all(|w| w[1] > w[0]),
        "committed tokens must rise in commit order: {committed:?}"
    );
    setup
        .execute(
            "DELETE FROM dlock_fence_test_counter WHERE resource = $1",
            &[&resource],
        )
        .await
        .expect("tidy");
}

// --------------------------------------------------------------------- Redis

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_fence_refuses_a_lower_token_and_keeps_the_newer_value() {
    let mut conn = redis_conn().await;
    let fence = RedisFence::new();
    let resource = fresh("redis-stale");
    fence
        .write(&mut conn, &resource, token(8), "new")
        .await
        .expect("holder");
    assert_stale(
        fence.write(&mut conn, &resource, token(7), "old").await,
        &resource,
        7,
        8,
    );
    assert_stale(
        fence.read(&mut conn, &resource, token(7)).await,
        &resource,
        7,
        8,
    );
    // The same token writes again; the value is the newer holder's.
    fence
        .write(&mut conn, &resource, token(8), "newer")
        .await
        .expect("same token");
    let value = fence
        .read(&mut conn, &resource, token(8))
        .await
        .expect("read");
    assert_eq!(value.as_deref(), Some(&b"newer"[..]));
    assert_eq!(
        fence.highest(&mut conn, &resource).await.expect("highest"),
        Some(token(8))
    );
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_fence_read_records_the_token_so_an_older_holder_cannot_write_after_it() {
    let mut conn = redis_conn().await;
    let fence = RedisFence::new();
    let resource = fresh("redis-read");
    assert_eq!(
        fence
            .read(&mut conn, &resource, token(7))
            .await
            .expect("empty"),
        None
    );
    // A newer holder reads; the older one's write, computed from its own
    // earlier read, must now be refused.
    fence
        .read(&mut conn, &resource, token(8))
        .await
        .expect("newer read");
    assert_stale(
        fence.write(&mut conn, &resource, token(7), "1").await,
        &resource,
        7,
        8,
    );
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_fence_compares_tokens_above_two_to_the_53_exactly() {
    let mut conn = redis_conn().await;
    let fence = RedisFence::new();
    let resource = fresh("redis-big");
    let high = (1u64 << 53) + 1; // a Lua double would round it down
    fence
        .write(&mut conn, &resource, token(high), "a")
        .await
        .expect("high");
    assert_stale(
        fence
            .write(&mut conn, &resource, token(high - 1), "b")
            .await,
        &resource,
        high - 1,
        high,
    );
    fence
        .write(&mut conn, &resource, token(u64::MAX), "c")
        .await
        .expect("max");
    assert_stale(
        fence
            .write(&mut conn, &resource, token(u64::MAX - 1), "d")
            .await,
        &resource,
        u64::MAX - 1,
        u64::MAX,
    );
    // Shorter decimals are smaller, whatever their first digit.
    let other = fresh("redis-digits");
    fence
        .write(&mut conn, &other, token(10), "x")
        .await
        .expect("10");
    assert_stale(
        fence.write(&mut conn, &other, token(9), "y").await,
        &other,
        9,
        10,
    );
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_fence_foreign_data_under_its_key_is_an_error_not_a_reset() {
    let mut conn = redis_conn().await;
    let fence = RedisFence::new();
    let resource = fresh("redis-foreign");
    let _: () = redis::cmd("HSET")
        .arg(fence.key(&resource))
        .arg("token")
        .arg("not-a-number")
        .query_async(&mut conn)
        .await
        .expect("plant");
    let err = fence
        .write(&mut conn, &resource, token(1), "v")
        .await
        .expect_err("foreign");
    assert!(err.to_string().contains("not a number"), "{err}");
    let string_key = fresh("redis-string");
    let _: () = redis::cmd("SET")
        .arg(fence.key(&string_key))
        .arg("plain")
        .query_async(&mut conn)
        .await
        .expect("plant");
    let err = fence
        .write(&mut conn, &string_key, token(1), "v")
        .await
        .expect_err("wrong type");
    assert!(matches!(err, LockError::Backend { .. }), "{err}");
    let err = fence
        .write(&mut conn, "", token(1), "v")
        .await
        .expect_err("empty name");
    assert!(
        matches!(
            err,
            LockError::InvalidOption {
                option: "resource",
                ..
            }
        ),
        "{err}"
    );
}

// ------------------------------------------------- the article's timeline

/// A holder whose lease ran out (it never renewed: a pause, as far as the
/// lock can tell) and the next holder both write; only the next holder's
/// write lands. Run with a lock on every backend against every resource.
async fn timeline(
    backend: Arc<dyn Backend>,
    write: impl AsyncFnMut(FencingToken, &str) -> Result<(), LockError>,
) {
    let mut write = write;
    let key = fresh("timeline");
    let paused = LockOptions::new(Duration::from_millis(300))
        .renew(false)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("A acquires");
    let next = LockOptions::new(Duration::from_secs(10))
        .wait(Duration::from_secs(10))
        .acquire_on(backend, &key)
        .await
        .expect("B acquires once A's ttl ran out");
    assert!(next.token() > paused.token());
    write(next.token(), "B").await.expect("B writes");
    // A resumes, still holding its old token, and writes.
    let stale = write(paused.token(), "A").await;
    assert!(
        matches!(stale, Err(LockError::StaleToken { .. })),
        "{stale:?}"
    );
    next.release().await.expect("release");
    drop(paused);
}

#[cfg(all(feature = "redis", feature = "pg"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_lock_fences_a_postgresql_table() {
    let backend: Arc<dyn Backend> =
        Arc::new(RedisBackend::connect(&redis_url()).await.expect("redis"));
    let mut client = pg_client().await;
    let fence = pg_fence(&client).await;
    let resource = fresh("redis-into-pg");
    timeline(backend, async |t, _who| {
        let tx = client.transaction().await.expect("begin");
        match fence.accept(&tx, &resource, t).await {
            Ok(()) => tx
                .commit()
                .await
                .map_err(|e| LockError::backend("pg", dlock::error::Operation::Fence, "", e)),
            Err(err) => Err(err),
        }
    })
    .await;
}

#[cfg(all(feature = "redis", feature = "pg"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgresql_lock_fences_a_redis_value() {
    let backend: Arc<dyn Backend> = Arc::new(PgBackend::connect(&pg_conn()).await.expect("pg"));
    let mut conn = redis_conn().await;
    let fence = RedisFence::new();
    let resource = fresh("pg-into-redis");
    timeline(backend, async |t, who| {
        fence.write(&mut conn, &resource, t, who).await
    })
    .await;
    let value = fence
        .read(&mut conn, &resource, token(u64::MAX))
        .await
        .expect("read");
    assert_eq!(value.as_deref(), Some(&b"B"[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_lock_fences_a_memory_cell() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let cell = FencedCell::new("report", String::new());
    timeline(backend, async |t, who| {
        cell.write(t, |v| *v = who.to_owned())
    })
    .await;
    assert_eq!(cell.read().0, "B");
}

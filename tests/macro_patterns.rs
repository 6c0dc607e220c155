//! Key placeholders that name bindings inside parameter patterns
//! (`Path(id): Path<u64>` → `{id}`), on the in-memory backend: such a key
//! is the very key the same values give as plain parameters, escaped the
//! same way, built before the body runs, and the body still gets its
//! bindings as the pattern bound them.
//!
//! Every test registers its own backend under its own name, so tests can
//! run in parallel in one process.

use std::time::Duration;

use dlock::{
    FencingToken, LockError, LockOptions, distributed_lock, memory::MemoryBackend, registry,
};

/// An extractor as axum writes it: a tuple struct around the value.
struct Path<T>(T);
struct Json<T>(T);

/// Not `Copy`, not `Clone`: the body must get the value itself.
#[derive(Debug, PartialEq)]
struct Order {
    customer: String,
    lines: Vec<String>,
}

struct Cell<'a> {
    x: &'a str,
    y: &'a str,
}

fn register(name: &str) {
    registry().register(name, MemoryBackend::new());
}

/// Whether `key` can be had on `backend` right now (and gives it back).
async fn is_free(backend: &'static str, key: &str) -> bool {
    match LockOptions::new(Duration::from_secs(30))
        .backend(backend)
        .acquire(key)
        .await
    {
        Ok(lease) => {
            lease.release().await.expect("release");
            true
        }
        Err(LockError::Held { .. }) => false,
        Err(other) => panic!("unexpected error: {other}"),
    }
}

/// The key `cell:{x}:{y}` as plain parameters give it.
#[distributed_lock(key = "cell:{x}:{y}", ttl = "30s", backend = "patterns-same")]
async fn plain(x: &str, y: &str) -> Result<(), LockError> {
    Ok(())
}

/// Holding the key a pattern gives, calls `plain` with the same values:
/// its result says whether the two keys are one.
#[distributed_lock(key = "cell:{x}:{y}", ttl = "30s", backend = "patterns-same")]
async fn from_tuple((x, y): (&str, &str)) -> Result<Result<(), LockError>, LockError> {
    Ok(plain(x, y).await)
}

#[distributed_lock(key = "cell:{x}:{why}", ttl = "30s", backend = "patterns-same")]
async fn from_struct(
    Path(Cell { x, y: why }): Path<Cell<'_>>,
) -> Result<Result<(), LockError>, LockError> {
    Ok(plain(x, why).await)
}

#[tokio::test]
async fn a_key_from_pattern_bindings_is_the_key_plain_parameters_give() {
    register("patterns-same");
    // Values that need escaping: the keys must agree on that too.
    let (x, y) = ("1:2", "a b");
    let expected = "cell:1%3A2:a%20b";
    for inner in [
        from_tuple((x, y)).await.expect("free key"),
        from_struct(Path(Cell { x, y })).await.expect("free key"),
    ] {
        assert!(
            matches!(&inner, Err(LockError::Held { key, .. }) if key == expected),
            "{inner:?}"
        );
    }
    assert!(is_free("patterns-same", expected).await, "not released");
}

#[distributed_lock(key = "pair:{a}:{b}", ttl = "30s", backend = "patterns-escape")]
async fn inner_pair(Path((a, b)): Path<(&str, &str)>) -> Result<(), LockError> {
    Ok(())
}

/// Holding the key of `(a, b)`, locks the key of `other` too.
#[distributed_lock(key = "pair:{a}:{b}", ttl = "30s", backend = "patterns-escape")]
async fn outer_pair(
    (a, b): (&str, &str),
    other: (&str, &str),
) -> Result<Result<(), LockError>, LockError> {
    Ok(inner_pair(Path(other)).await)
}

#[tokio::test]
async fn pattern_bindings_are_escaped_so_different_values_never_share_a_key() {
    register("patterns-escape");
    // ("1:2", "3") and ("1", "2:3") would both give `pair:1:2:3` unescaped:
    // each is held while the other is taken.
    for (first, second) in [(("1:2", "3"), ("1", "2:3")), (("1", "2:3"), ("1:2", "3"))] {
        let inner = outer_pair(first, second).await.expect("free key");
        inner.expect("the other values' key is not the one held");
    }
    // The same values do share the key, escaped.
    let inner = outer_pair(("1:2", "3"), ("1:2", "3"))
        .await
        .expect("free key");
    assert!(
        matches!(&inner, Err(LockError::Held { key, .. }) if key == "pair:1%3A2:3"),
        "{inner:?}"
    );
}

/// The body gets the non-`Copy` binding itself, and may change a `mut`
/// one: the key was built from the values as passed, before the body ran.
#[distributed_lock(
    key = "order:{id}:{body.customer}",
    ttl = "30s",
    backend = "patterns-move"
)]
async fn pay(
    (mut id, _): (u64, u64),
    Json(mut body): Json<Order>,
) -> Result<(Order, bool), LockError> {
    id += 1;
    body.customer.push_str("-changed");
    // Still held under the key of the values as passed.
    let held = !is_free("patterns-move", "order:7:ann").await;
    assert_eq!(id, 8);
    Ok((body, held))
}

#[tokio::test]
async fn the_key_borrows_a_binding_before_the_body_takes_it() {
    register("patterns-move");
    let order = Order {
        customer: "ann".to_owned(),
        lines: vec!["tea".to_owned()],
    };
    let (body, held) = pay((7, 0), Json(order)).await.expect("free key");
    assert!(held, "the key was not `order:7:ann` while the body ran");
    assert_eq!(
        body,
        Order {
            customer: "ann-changed".to_owned(),
            lines: vec!["tea".to_owned()],
        }
    );
    assert!(
        is_free("patterns-move", "order:7:ann").await,
        "not released"
    );
}

struct Shop {
    name: &'static str,
}

impl Shop {
    #[distributed_lock(
        key = "shop:{self.name}:{id}",
        ttl = "30s",
        backend = "patterns-methods"
    )]
    async fn order(
        &self,
        Path(id): Path<u64>,
        token: FencingToken,
    ) -> Result<FencingToken, LockError> {
        assert!(!is_free("patterns-methods", &format!("shop:{}:{id}", self.name)).await);
        Ok(token)
    }
}

#[async_trait::async_trait]
trait Checkout: Send + Sync {
    async fn checkout(&self, id: Path<u64>, body: Json<Order>) -> Result<Order, LockError>;
}

#[async_trait::async_trait]
impl Checkout for Shop {
    #[distributed_lock(
        key = "checkout:{self.name}:{id}:{body.customer}",
        ttl = "30s",
        backend = "patterns-methods"
    )]
    async fn checkout(
        &self,
        Path(id): Path<u64>,
        Json(body): Json<Order>,
    ) -> Result<Order, LockError> {
        let key = format!("checkout:{}:{id}:{}", self.name, body.customer);
        assert!(
            !is_free("patterns-methods", &key).await,
            "{key} is not held"
        );
        Ok(body)
    }
}

#[tokio::test]
async fn methods_and_async_trait_methods_lock_the_key_their_bindings_give() {
    register("patterns-methods");
    let shop = Shop { name: "corner" };
    let held = LockOptions::new(Duration::from_secs(30))
        .backend("patterns-methods")
        .acquire("shop:corner:3")
        .await
        .expect("free key");
    let refused = shop.order(Path(3)).await;
    assert!(
        matches!(&refused, Err(LockError::Held { key, .. }) if key == "shop:corner:3"),
        "{refused:?}"
    );
    held.release().await.expect("release");
    shop.order(Path(3)).await.expect("free key");

    let checkout: &dyn Checkout = &shop;
    let order = || Order {
        customer: "bob".to_owned(),
        lines: Vec::new(),
    };
    let held = LockOptions::new(Duration::from_secs(30))
        .backend("patterns-methods")
        .acquire("checkout:corner:4:bob")
        .await
        .expect("free key");
    let refused = checkout.checkout(Path(4), Json(order())).await;
    assert!(
        matches!(&refused, Err(LockError::Held { key, .. }) if key == "checkout:corner:4:bob"),
        "{refused:?}"
    );
    held.release().await.expect("release");
    assert_eq!(
        checkout
            .checkout(Path(4), Json(order()))
            .await
            .expect("free key"),
        order()
    );
}

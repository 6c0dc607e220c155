#![deny(warnings)]

// Placeholders name bindings inside parameter patterns, as axum handlers
// destructure their extractors: `Path(id): Path<u64>` → `{id}`. The
// bindings are the function's own: a non-`Copy` one (`body`) is still
// moved into the body, and the key only borrows it first.

use dlock::{FencingToken, LockError, distributed_lock};

pub struct Path<T>(pub T);
pub struct Json<T>(pub T);
/// A value a caller passes (an extractor), whatever it wraps.
pub struct Extension<T>(pub T);

pub struct Order {
    pub customer: String,
    pub lines: Vec<String>,
}

pub struct Point {
    pub x: i32,
    pub y: i32,
}

pub struct Region {
    pub name: String,
    pub corner: Point,
}

#[distributed_lock(key = "order:{id}:{body.customer}", ttl = "30s")]
async fn pay(Path(id): Path<u64>, Json(body): Json<Order>) -> Result<(u64, Order), LockError> {
    Ok((id, body))
}

#[distributed_lock(key = "cell:{x}:{why}", ttl = "30s")]
async fn paint((a, b): (u32, u32), Point { x, y: why }: Point) -> Result<i64, LockError> {
    Ok(i64::from(a + b) + i64::from(x + why))
}

// Nested, `ref` and `mut` bindings, `@` bindings.
#[distributed_lock(key = "region:{name}:{x}:{pair.1}:{first}", ttl = "30s")]
async fn nested(
    Region {
        ref name,
        corner: Point { x, .. },
    }: Region,
    (mut count, _): (u32, u32),
    pair @ (first, _): (u8, u8),
) -> Result<String, LockError> {
    count += 1;
    Ok(format!("{name}:{x}:{count}:{}:{first}", pair.1))
}

// A `FencingToken` inside a pattern is the caller's (an extractor's), not
// the lock's: only a parameter whose whole type is `FencingToken` is
// provided by the lock. The key may name it like any other value.
#[distributed_lock(key = "fenced:{tenant}:{outer}", ttl = "30s")]
async fn fenced(
    (tenant, Extension(outer)): (u64, Extension<FencingToken>),
    token: FencingToken,
) -> Result<(FencingToken, FencingToken), LockError> {
    assert_eq!(tenant, 7);
    Ok((outer, token))
}

struct Shop {
    name: &'static str,
}

impl Shop {
    #[distributed_lock(key = "shop:{self.name}:{id}", ttl = "30s")]
    async fn order(&self, Path(id): Path<u64>) -> Result<u64, LockError> {
        Ok(id + self.name.len() as u64)
    }
}

trait Checkout {
    async fn checkout(&self, body: Json<Order>) -> Result<usize, LockError>;
}

impl Checkout for Shop {
    #[distributed_lock(key = "checkout:{self.name}:{order.customer}", ttl = "30s")]
    async fn checkout(&self, Json(order): Json<Order>) -> Result<usize, LockError> {
        Ok(order.lines.len())
    }
}

// Private fields, read by a placeholder from inside their module.
mod billing {
    use dlock::{LockError, distributed_lock};

    pub struct Invoice {
        number: u32,
        pair: (u8, u8),
    }

    impl Invoice {
        pub fn new(number: u32) -> Self {
            Invoice {
                number,
                pair: (1, 2),
            }
        }
    }

    pub struct Wrapped(pub Invoice);

    #[distributed_lock(key = "invoice:{invoice.number}:{invoice.pair.1}", ttl = "30s")]
    pub async fn settle(Wrapped(invoice): Wrapped) -> Result<u32, LockError> {
        Ok(invoice.number + u32::from(invoice.pair.0))
    }
}

fn order(customer: &str) -> Order {
    Order {
        customer: customer.to_owned(),
        lines: vec!["tea".to_owned()],
    }
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        let (id, body) = pay(Path(1), Json(order("ann"))).await.expect("free key");
        assert_eq!(
            (id, body.customer.as_str(), body.lines.len()),
            (1, "ann", 1)
        );
        assert_eq!(
            paint((1, 2), Point { x: 3, y: 4 }).await.expect("free key"),
            10
        );
        let region = Region {
            name: "eu".to_owned(),
            corner: Point { x: 5, y: 6 },
        };
        assert_eq!(
            nested(region, (1, 0), (8, 9)).await.expect("free key"),
            "eu:5:2:9:8"
        );
        let outer = FencingToken::new(3);
        let (passed, own) = fenced((7, Extension(outer))).await.expect("free key");
        assert_eq!(passed, outer);
        assert!(own.get() > 0);
        assert_eq!(
            billing::settle(billing::Wrapped(billing::Invoice::new(4)))
                .await
                .expect("free key"),
            5
        );
        let shop = Shop { name: "corner" };
        assert_eq!(shop.order(Path(1)).await.expect("free key"), 7);
        assert_eq!(
            shop.checkout(Json(order("bob"))).await.expect("free key"),
            1
        );
    });
}

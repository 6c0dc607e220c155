#![deny(warnings)]

use dlock::{LockError, distributed_lock};

struct Point {
    x: i32,
    y: i32,
}

#[distributed_lock(key = "grid:{id}", ttl = "30s")]
async fn place(id: u32, (a, b): (u32, u32), Point { x, y }: Point) -> Result<i64, LockError> {
    Ok(i64::from(id + a + b) + i64::from(x + y))
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        assert_eq!(
            place(1, (2, 3), Point { x: 4, y: 5 })
                .await
                .expect("free key"),
            15
        );
    });
}

// `..` binds nothing: `y` is not a name here, although `Point` has a field `y`.

use dlock::{LockError, distributed_lock};

pub struct Point {
    pub x: i32,
    pub y: i32,
}

#[distributed_lock(key = "cell:{x}:{y}", ttl = "30s")]
pub async fn paint(Point { x, .. }: Point) -> Result<i32, LockError> {
    Ok(x)
}

fn main() {}

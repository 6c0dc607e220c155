#![deny(warnings)]

use std::fmt::{Debug, Display};

use dlock::{FencingToken, LockError, distributed_lock};

#[distributed_lock(key = "item:{id}", ttl = "30s")]
async fn describe<'a, T, const N: usize>(
    id: &'a T,
    extra: [u8; N],
    token: FencingToken,
) -> Result<String, LockError>
where
    T: Display + Debug + Sync + ?Sized,
{
    Ok(format!("{id:?}/{}/{}", extra.len(), token.get() > 0))
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        let text = describe("a:b", [1, 2]).await.expect("free key");
        assert_eq!(text, "\"a:b\"/2/true");
    });
}

#![deny(warnings)]

use dlock::{LockError, distributed_lock};

struct User {
    id: u64,
}

struct Request {
    user: User,
    path: String,
}

#[distributed_lock(key = "req:{req.user.id}:{req.path}", ttl = "30s")]
async fn handle(req: Request) -> Result<String, LockError> {
    Ok(req.path)
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        let req = Request {
            user: User { id: 7 },
            path: "/a b".to_owned(),
        };
        assert_eq!(handle(req).await.expect("free key"), "/a b");
    });
}

#![deny(warnings)]

use dlock::{LockError, distributed_lock, memory::MemoryBackend, registry};

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
    let _alone = super::alone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        registry().register("default", MemoryBackend::new());
        let req = Request {
            user: User { id: 7 },
            path: "/a b".to_owned(),
        };
        assert_eq!(handle(req).await.expect("free key"), "/a b");
    });
}

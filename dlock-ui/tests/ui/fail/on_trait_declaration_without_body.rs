use dlock::{LockError, distributed_lock};

pub trait Job {
    #[distributed_lock(key = "job", ttl = "30s")]
    async fn run(&self) -> Result<(), LockError>;
}

fn main() {}

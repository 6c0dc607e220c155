use dlock::{LockError, distributed_lock};

pub struct Request {
    pub tenant: u64,
}

#[distributed_lock(key = "export:{req.}", ttl = "30s")]
pub async fn export(req: Request) -> Result<u64, LockError> {
    Ok(req.tenant)
}

fn main() {}

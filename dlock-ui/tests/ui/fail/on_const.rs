use dlock::distributed_lock;

#[distributed_lock(key = "report", ttl = "30s")]
pub const LIMIT: u32 = 3;

fn main() {}

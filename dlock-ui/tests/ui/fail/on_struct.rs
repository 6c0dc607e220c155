use dlock::distributed_lock;

#[distributed_lock(key = "report", ttl = "30s")]
pub struct Report {
    pub day: u32,
}

fn main() {}

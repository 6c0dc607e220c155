use dlock::distributed_lock;

#[distributed_lock(key = "count:{id}", ttl = "30s")]
async fn count(id: u32) -> u32 {
    id
}

fn main() {
    let _ = count(1);
}

use dlock::distributed_lock;

#[distributed_lock(key = "export:{tenant}", ttl = "30s")]
pub async fn export(tenant: u64) {
    println!("{tenant}");
}

fn main() {}

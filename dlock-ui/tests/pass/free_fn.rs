#![deny(warnings)]

use dlock::{LockError, distributed_lock};

#[distributed_lock(key = "report:{day}", ttl = "30s")]
async fn report(day: u32) -> Result<String, LockError> {
    Ok(format!("report for day {day}"))
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        assert_eq!(report(7).await.expect("free key"), "report for day 7");
    });
}

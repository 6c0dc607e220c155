#![deny(warnings)]

use std::fmt;

use dlock::{FencingToken, LockError, distributed_lock};

#[derive(Debug)]
enum AppError {
    Lock(LockError),
    Parse(std::num::ParseIntError),
    Negative,
}

impl From<LockError> for AppError {
    fn from(err: LockError) -> Self {
        AppError::Lock(err)
    }
}

impl From<std::num::ParseIntError> for AppError {
    fn from(err: std::num::ParseIntError) -> Self {
        AppError::Parse(err)
    }
}

impl fmt::Display for AppError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AppError::Lock(err) => write!(f, "lock: {err}"),
            AppError::Parse(err) => write!(f, "parse: {err}"),
            AppError::Negative => f.write_str("negative"),
        }
    }
}

#[distributed_lock(key = "parse:{input}", ttl = "30s")]
async fn parse(input: &str, token: FencingToken) -> Result<(i64, FencingToken), AppError> {
    let value: i64 = input.parse()?;
    if value < 0 {
        return Err(AppError::Negative);
    }
    Ok((value, token))
}

#[distributed_lock(key = "parse:{input}", ttl = "30s")]
async fn parse_boxed(input: String) -> Result<i64, Box<dyn std::error::Error + Send + Sync>> {
    Ok(input.parse()?)
}

#[test]
fn compiles_without_warnings_and_runs() {
    super::run(async {
        assert_eq!(parse("12").await.expect("parses").0, 12);
        assert!(matches!(parse("x").await, Err(AppError::Parse(_))));
        assert!(matches!(parse("-1").await, Err(AppError::Negative)));
        assert!(parse("12").await.is_ok(), "released after an early return");
        assert_eq!(parse_boxed("5".to_owned()).await.expect("parses"), 5);
    });
}

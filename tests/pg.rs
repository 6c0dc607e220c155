//! The conformance suite on `PgBackend` against a real PostgreSQL
//! (127.0.0.1:5432, or `DLOCK_PG_URL`).

mod conformance;

use std::sync::Arc;

use dlock::Backend;
use dlock::pg::PgBackend;

fn conn() -> String {
    std::env::var("DLOCK_PG_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".to_owned())
}

async fn backend() -> Arc<dyn Backend> {
    Arc::new(PgBackend::connect(&conn()).await.expect("PostgreSQL at DLOCK_PG_URL"))
}

conformance::suite!(backend);

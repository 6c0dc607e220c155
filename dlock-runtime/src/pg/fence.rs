//! Fencing a PostgreSQL resource inside the caller's own transaction.
//!
//! A table `<schema>.dlock_fence (resource text PRIMARY KEY, token bigint)`
//! keeps the highest token each resource has accepted.
//! [`PgFence::accept`] raises it to the offered token in the caller's
//! transaction, or fails with [`LockError::StaleToken`] when a higher token
//! was accepted already; the caller then rolls back, and none of its writes
//! land. Because the check takes the resource's row lock until the caller
//! commits, fenced transactions on one resource serialize: a concurrent
//! writer waits for the row and then sees the committed token (READ
//! COMMITTED re-reads the row it waited for), so no update is lost.

use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, Transaction};

use super::quote_schema;
use super::sql::render;
use crate::error::{LockError, Operation};
use crate::fence::check_resource;
use crate::token::FencingToken;

const KIND: &str = "pg";
const DEFAULT_SCHEMA: &str = "dlock";

/// Raises a resource's highest accepted token to `$2` if `$2` is at least
/// the stored one, and returns it; returns no row if the stored token is
/// higher. One statement, so the comparison and the update cannot be split
/// by another writer: `ON CONFLICT DO UPDATE` locks the existing row (even
/// when its `WHERE` is false) and, under READ COMMITTED, compares against
/// the newest committed version after waiting for a concurrent writer. The
/// row lock is then held until the caller's transaction ends, which is what
/// serializes fenced writers of one resource.
///
/// It runs in the caller's transaction, under the caller's `search_path`,
/// so nothing in it is looked up there: the types are `pg_catalog`'s and the
/// comparison is `OPERATOR(pg_catalog.<=)` — a `<=` on `bigint` that a role
/// with CREATE on a schema ahead of `pg_catalog` defined could otherwise
/// wave a stale token through (see `pg/sql/mod.rs`).
const ACCEPT: &str = "\
INSERT INTO {schema}.dlock_fence AS f (resource, token)
VALUES ($1::pg_catalog.text, $2::pg_catalog.int8)
ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token
WHERE f.token OPERATOR(pg_catalog.<=) EXCLUDED.token
RETURNING f.token";

/// The highest accepted token of a resource. After a refused [`ACCEPT`] the
/// caller's transaction holds the row lock, so the value read is the one
/// that refused it.
const HIGHEST: &str = "SELECT f.token FROM {schema}.dlock_fence AS f \
WHERE f.resource OPERATOR(pg_catalog.=) $1::pg_catalog.text";

/// Creates the table (and schema) if missing: `fence.sql`.
const CREATE: &str = include_str!("fence.sql");

/// The resource-side check for data in PostgreSQL: call [`PgFence::accept`]
/// first thing in the transaction that writes (and in one that reads for a
/// read-modify-write), with the lease's token.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use dlock_runtime::pg::fence::PgFence;
/// use dlock_runtime::pg::tokio_postgres::{self, NoTls};
/// use dlock_runtime::{FencingToken, LockError};
///
/// let conn = std::env::var("DLOCK_PG_URL")
///     .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=test".into());
/// let (mut client, connection) = tokio_postgres::connect(&conn, NoTls).await?;
/// tokio::spawn(connection);
/// let fence = PgFence::new();
/// fence.create_table(&client).await?; // once, or by a DBA
/// let resource = format!("doc:invoice:{}", std::process::id());
///
/// // The current holder writes under token 8 ...
/// let tx = client.transaction().await?;
/// fence.accept(&tx, &resource, FencingToken::new(8)).await?;
/// // tx.execute("UPDATE invoices SET ... WHERE id = 42", &[]).await?;
/// tx.commit().await?;
///
/// // ... so a holder paused past its ttl, still on token 7, is refused,
/// // and its transaction rolls back with everything it wrote.
/// let tx = client.transaction().await?;
/// let stale = fence.accept(&tx, &resource, FencingToken::new(7)).await;
/// assert!(matches!(stale, Err(LockError::StaleToken { .. })));
/// tx.rollback().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct PgFence {
    schema: String,
}

impl Default for PgFence {
    fn default() -> Self {
        Self::new()
    }
}

impl PgFence {
    /// The table `dlock.dlock_fence` (the schema the lock backend uses too).
    pub fn new() -> Self {
        Self {
            schema: DEFAULT_SCHEMA.to_owned(),
        }
    }

    /// The schema of the `dlock_fence` table: lowercase letters, digits and
    /// `_`, not starting with a digit, at most 63 bytes.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Creates the schema and the `dlock_fence` table if they are missing.
    /// Safe to call from several processes at once. A DBA can instead run
    /// the same file (for the schema `dlock`; see docs/postgres.md), then
    /// grant its use:
    ///
    /// ```sql
    #[doc = include_str!("fence.sql")]
    /// GRANT USAGE ON SCHEMA dlock TO app_role;
    /// GRANT SELECT, INSERT, UPDATE ON dlock.dlock_fence TO app_role;
    /// ```
    pub async fn create_table(&self, client: &Client) -> Result<(), LockError> {
        let sql = render(CREATE, &quote_schema(&self.schema)?);
        client
            .batch_execute(&sql)
            .await
            .map_err(|e| pg_error("", "cannot create the fence table", e))
    }

    /// Accepts `token` for `resource` in the caller's transaction: records it
    /// as the highest token `resource` has accepted if it is at least the
    /// highest so far, and keeps the resource's fence row locked until `tx`
    /// ends. Returns [`LockError::StaleToken`] (naming the resource, the
    /// offered and the highest token) if a higher token was accepted
    /// already: roll `tx` back then; nothing it wrote may land.
    ///
    /// Call it before reading the data the write depends on: the row lock
    /// makes every other fenced transaction on `resource` wait until this
    /// one ends. Under REPEATABLE READ or SERIALIZABLE a concurrent fenced
    /// writer makes this fail with a serialization error instead of waiting
    /// (retry the transaction, as with any such error).
    pub async fn accept(
        &self,
        tx: &Transaction<'_>,
        resource: &str,
        token: FencingToken,
    ) -> Result<(), LockError> {
        check_resource(resource)?;
        let schema = quote_schema(&self.schema)?;
        let offered = i64::try_from(token.get()).map_err(|_| {
            LockError::backend(
                KIND,
                Operation::Fence,
                resource,
                format!("fencing token {token} does not fit a PostgreSQL bigint"),
            )
        })?;
        let accepted = tx
            .query_opt(&render(ACCEPT, &schema), &[&resource, &offered])
            .await
            .map_err(|e| pg_error(resource, "cannot check the fencing token", e))?;
        if accepted.is_some() {
            return Ok(());
        }
        let row = tx
            .query_one(&render(HIGHEST, &schema), &[&resource])
            .await
            .map_err(|e| pg_error(resource, "cannot read the highest token", e))?;
        let highest: i64 = row
            .try_get(0)
            .map_err(|e| pg_error(resource, "unexpected answer", e))?;
        Err(LockError::StaleToken {
            resource: resource.to_owned(),
            offered: token,
            highest: FencingToken::new(u64::try_from(highest).unwrap_or(0)),
        })
    }

    /// The highest token `resource` has accepted, if any (committed ones,
    /// or this session's own in an open transaction).
    pub async fn highest(
        &self,
        client: &Client,
        resource: &str,
    ) -> Result<Option<FencingToken>, LockError> {
        check_resource(resource)?;
        let schema = quote_schema(&self.schema)?;
        let row = client
            .query_opt(&render(HIGHEST, &schema), &[&resource])
            .await
            .map_err(|e| pg_error(resource, "cannot read the highest token", e))?;
        row.map(|row| row.try_get::<_, i64>(0))
            .transpose()
            .map(|token| token.map(|t| FencingToken::new(u64::try_from(t).unwrap_or(0))))
            .map_err(|e| pg_error(resource, "unexpected answer", e))
    }
}

/// A client error, with a hint when the table is missing; the client's
/// error stays the source.
fn pg_error(resource: &str, what: &str, err: tokio_postgres::Error) -> LockError {
    let what = if err.code() == Some(&SqlState::UNDEFINED_TABLE) {
        format!(
            "{what}: the fence table does not exist; call PgFence::create_table once \
             (or have a DBA create it)"
        )
    } else {
        what.to_owned()
    };
    LockError::backend(
        KIND,
        Operation::Fence,
        resource,
        Failure { what, source: err },
    )
}

/// What failed, and the client's error as the source.
#[derive(Debug)]
struct Failure {
    what: String,
    source: tokio_postgres::Error,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The server's own message says more than the client's summary.
        match self.source.as_db_error() {
            Some(db) => write!(f, "{}: {}", self.what, db.message()),
            None => write!(f, "{}: {}", self.what, self.source),
        }
    }
}

impl std::error::Error for Failure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

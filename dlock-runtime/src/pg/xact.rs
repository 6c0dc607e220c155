//! Transaction-scoped locks: `pg_advisory_xact_lock` inside the caller's
//! own transaction, for applications that reach PostgreSQL through
//! PgBouncer in *transaction* pooling, where a session lock would stay on a
//! server connection that the next transaction of some other client gets.

use std::time::Duration;

use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{SimpleQueryMessage, Transaction};

use super::connection::Failure;
use super::sequence::{DRAW_LOCK, NOT_TAKEN};
use super::{DEFAULT_SCHEMA, KIND, quote_schema, sql};
use crate::error::{LockError, Operation};
use crate::options::{IntoLockKey, MAX_DURATION};
use crate::token::FencingToken;

/// The longest `lock_timeout` PostgreSQL accepts (`INT_MAX` milliseconds,
/// about 24 days 20 hours), and so the longest [`TransactionLock::wait`].
pub const MAX_LOCK_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

/// Takes a lock for the rest of the caller's transaction: released by its
/// COMMIT or ROLLBACK, never before, never by dlock. Works through PgBouncer
/// in transaction pooling, because everything happens inside one
/// transaction on one server connection; uses unnamed statements only.
///
/// There is no lease, no renewal and no lost signal: the lock lives exactly
/// as long as the transaction, so keep the transaction short and do the
/// protected work inside it. The key maps to the same advisory key as
/// [`PgBackend`](super::PgBackend) locks with the same key seed (the
/// schema plays no part in it), so both kinds exclude each other; with the
/// same schema too, the fencing token is drawn by the same rule from the
/// same sequence — `nextval`, or the server clock in µs plus the token
/// lead once the clock is past it, see the [module docs](super#fencing-tokens) — so the tokens of a
/// key rise across both, and keep rising when the sequence is dropped and
/// recreated or set back. The sequence is not transactional: a token handed
/// out is never handed out again, even if the transaction rolls back. The
/// lock is taken in a savepoint, and the token drawn inside it in a
/// savepoint of its own that the same message rolls back, so the draw
/// lock every draw takes is never held by your transaction, and a draw
/// that fails gives the lock back (four round trips without a wait: the
/// savepoint, the lock, the draw, the release). With UPDATE on the
/// sequence (see the module docs) the draw `setval`s it when the clock is
/// past it (once per token lead, or nearly always without one); that gives
/// the transaction a transaction id and a WAL record: a read-only
/// transaction becomes a writing one, whose commit waits for its WAL
/// flush as your `synchronous_commit` says (dlock leaves that setting of
/// your transaction alone). Should that draw fail, or your code stop
/// waiting before it answered, the savepoint is rolled back with the lock:
/// the error says the lock was not taken, and your transaction goes on.
/// Once the token is drawn, the savepoint is released, a last round trip:
/// code that stops waiting during that one leaves the lock to your
/// transaction (until it ends), without its token. A transaction-level
/// lock cannot be let go alone, so nothing can take it back then.
///
/// The token sequence must exist: [`PgBackend::connect`](super::PgBackend::connect)
/// creates it and checks its settings (a DBA may pre-create it instead).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use dlock_runtime::pg::{PgBackend, TransactionLock, tokio_postgres};
///
/// let conn = std::env::var("DLOCK_PG_URL")
///     .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=test".into());
/// // Creates the schema objects once (or a DBA pre-creates them).
/// let _backend = PgBackend::connect(&conn).await?;
///
/// let (mut client, connection) = tokio_postgres::connect(&conn, tokio_postgres::NoTls).await?;
/// tokio::spawn(connection);
/// let mut tx = client.transaction().await?;
/// let token = TransactionLock::new()
///     .wait(Duration::from_secs(5))
///     .acquire(&mut tx, "invoice:42")
///     .await?;
/// // ... writes that carry `token`, in the same transaction ...
/// tx.commit().await?; // releases the lock
/// # let _ = token;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct TransactionLock {
    schema: String,
    key_seed: i64,
    wait: Duration,
}

impl Default for TransactionLock {
    fn default() -> Self {
        Self::new()
    }
}

impl TransactionLock {
    /// No waiting, schema `dlock`, key seed 0 (the [`PgBackend`](super::PgBackend)
    /// defaults).
    pub fn new() -> Self {
        Self {
            schema: DEFAULT_SCHEMA.to_owned(),
            key_seed: 0,
            wait: Duration::ZERO,
        }
    }

    /// The schema holding `dlock_token_seq` (as [`PgOptions::schema`](super::PgOptions::schema)):
    /// every client that locks the same keys with the same key seed must
    /// use the same schema, or the tokens of a key come from two sequences.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The seed of the key hash (as [`PgOptions::key_seed`](super::PgOptions::key_seed)).
    pub fn key_seed(mut self, seed: i64) -> Self {
        self.key_seed = seed;
        self
    }

    /// How long to wait for a held key (server-side, under `lock_timeout`)
    /// before failing with [`LockError::Timeout`]. Zero (the default)
    /// fails at once with [`LockError::Held`]. At most
    /// [`MAX_LOCK_TIMEOUT`], PostgreSQL's own limit for `lock_timeout`: a
    /// longer wait is refused before anything is sent.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Locks `key` until `tx` ends and returns the fencing token.
    ///
    /// Waiting runs in a savepoint: should the lock be granted in the very
    /// instant `lock_timeout` fires, the failed statement's savepoint is
    /// rolled back, which drops that lock, and the caller's transaction
    /// stays usable either way. `lock_timeout` is put back afterwards.
    pub async fn acquire(
        &self,
        tx: &mut Transaction<'_>,
        key: impl IntoLockKey,
    ) -> Result<FencingToken, LockError> {
        let key = key.into_lock_key()?;
        super::refuse_own_lock_name(&key)?;
        let quoted = quote_schema(&self.schema)?;
        if self.wait > MAX_DURATION {
            return Err(LockError::InvalidOption {
                option: "wait",
                reason: format!("{:?} is above the 30-day maximum", self.wait),
            });
        }
        if self.wait > MAX_LOCK_TIMEOUT {
            return Err(LockError::InvalidOption {
                option: "wait",
                reason: format!(
                    "{:?} is above PostgreSQL's largest lock_timeout ({MAX_LOCK_TIMEOUT:?}), \
                     under which a transaction lock waits",
                    self.wait
                ),
            });
        }
        let fail = |what: &str, e: tokio_postgres::Error| {
            LockError::backend(
                KIND,
                Operation::Acquire,
                key.as_str(),
                Failure::new(what, e),
            )
        };
        let params: [(&(dyn ToSql + Sync), Type); 2] =
            [(&key.as_str(), Type::TEXT), (&self.key_seed, Type::INT8)];
        let started = tokio::time::Instant::now();
        let mut savepoint = tx
            .savepoint("dlock_lock")
            .await
            .map_err(|e| fail("cannot open a savepoint to lock in", e))?;
        let locked = if self.wait.is_zero() {
            savepoint
                .query_typed_one(&sql::render(sql::XACT_TRY_LOCK, &quoted), &params)
                .await
                .and_then(|row| row.try_get::<_, bool>(0))
        } else {
            let timeout_ms = self.wait.as_millis().max(1).to_string();
            let swapped = savepoint
                .query_typed_one(sql::XACT_SWAP_LOCK_TIMEOUT, &[(&timeout_ms, Type::TEXT)])
                .await
                .map_err(|e| fail("cannot set lock_timeout", e))?;
            let previous: String = swapped
                .try_get(0)
                .map_err(|e| fail("unexpected answer to setting lock_timeout", e))?;
            let locked = savepoint
                .query_typed_one(&sql::render(sql::XACT_LOCK, &quoted), &params)
                .await;
            match locked {
                Ok(_) => savepoint
                    .query_typed_one(sql::SET_LOCAL_LOCK_TIMEOUT, &[(&previous, Type::TEXT)])
                    .await
                    .map(|_| true),
                Err(err) => Err(err),
            }
        };
        // Drawn inside the savepoint of the lock, so a failed draw (or a
        // caller who stops waiting) rolls the lock back with it.
        let outcome = match locked {
            Ok(true) => draw_in_savepoint(&mut savepoint, &quoted, key.as_str()).await,
            Ok(false) => Err(LockError::Held {
                key: key.to_string(),
                holder: None,
            }),
            Err(err) if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                Err(LockError::Timeout {
                    key: key.to_string(),
                    waited: started.elapsed(),
                })
            }
            Err(err) => Err(fail(&lock_failed(&err, &quoted), err)),
        };
        match outcome {
            Ok(token) => savepoint
                .commit()
                .await
                .map(|()| token)
                .map_err(|e| fail("cannot release the savepoint", e)),
            Err(err) => {
                savepoint
                    .rollback()
                    .await
                    .map_err(|e| fail("cannot roll back the savepoint", e))?;
                // `rollback` leaves the savepoint open: one level of the
                // caller's transaction per failed attempt otherwise.
                tx.batch_execute("RELEASE SAVEPOINT dlock_lock")
                    .await
                    .map_err(|e| fail("cannot release the savepoint", e))?;
                Err(err)
            }
        }
    }
}

/// The draw of a transaction lock, in a savepoint of its own that gives
/// the draw lock back at once (see [`sql::DRAW_IN_SAVEPOINT`]), inside
/// the savepoint of the lock, which the caller rolls back should the draw
/// fail: the lock is not taken then.
async fn draw_in_savepoint(
    tx: &mut Transaction<'_>,
    quoted_schema: &str,
    key: &str,
) -> Result<FencingToken, LockError> {
    let fail = |what: String, e: tokio_postgres::Error| {
        LockError::backend(KIND, Operation::Acquire, key, Failure::new(&what, e))
    };
    let answer = tx
        .simple_query(&sql::render(sql::DRAW_IN_SAVEPOINT, quoted_schema))
        .await;
    let messages = match answer {
        Ok(messages) => messages,
        Err(err) => {
            let what = if err.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
                format!(
                    "transaction lock failed: the token sequence {quoted_schema}.dlock_token_seq \
                     (an ALTER SEQUENCE or a DROP left open?) or {DRAW_LOCK} was locked by \
                     another transaction for over 1 s; {NOT_TAKEN}"
                )
            } else {
                lock_failed(&err, quoted_schema)
            };
            return Err(fail(what, err));
        }
    };
    let token = messages.iter().find_map(|message| match message {
        SimpleQueryMessage::Row(row) => row.get(0).map(str::parse::<i64>),
        _ => None,
    });
    match token {
        Some(Ok(token)) => to_token(token, key),
        _ => Err(LockError::backend(
            KIND,
            Operation::Acquire,
            key,
            Failure::msg("the token draw answered no token".to_owned()),
        )),
    }
}

/// What to say when a lock statement failed: with the fix when the token
/// sequence is missing (which aborts the caller's transaction; it is not
/// recreated there, where the caller's ROLLBACK would undo it). The
/// savepoint of the lock is rolled back: every message says it was not
/// taken.
fn lock_failed(err: &tokio_postgres::Error, quoted_schema: &str) -> String {
    let what = if let Some(unfit) = sql::refused_sequence(err) {
        super::sequence::refusal(unfit, quoted_schema)
    } else if sql::sequence_missing(err) {
        format!(
            "the token sequence {s}.dlock_token_seq is missing; PgBackend::connect with this \
             schema recreates it, or have a DBA run: {ddl}; {NOT_TAKEN}",
            s = quoted_schema,
            ddl = sql::objects_ddl_for_dba(quoted_schema),
        )
    } else if let Some(what) = super::sequence::failure(err, quoted_schema) {
        what
    } else if sql::dropped_while_running(err) {
        format!(
            "the token sequence {quoted_schema}.dlock_token_seq (or another of dlock's objects) \
             was dropped while the lock statement ran; {NOT_TAKEN}; try again"
        )
    } else {
        NOT_TAKEN.to_owned()
    };
    format!("transaction lock failed: {what}")
}

pub(super) fn to_token(token: i64, key: &str) -> Result<FencingToken, LockError> {
    u64::try_from(token).map(FencingToken::new).map_err(|_| {
        LockError::backend(
            KIND,
            Operation::Acquire,
            key,
            Failure::msg(format!(
                "the token sequence returned {token}, not a positive number"
            )),
        )
    })
}

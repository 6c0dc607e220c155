//! A rolling upgrade from the protocol where every plain lease recorded
//! its holder in `dlock_holders` (`TRY_LOCK_RECORDING`, let go with
//! `UNLOCK_GATED`, the record left for a batch delete) to this one, where
//! a plain lease writes nothing: its token rides in marks beside its lock,
//! and its session and key are named once. Replicas of both share a
//! schema for a while: they exclude each other, tokens keep rising across
//! both, and a reader of either never names a holder wrongly.

use crate::pg_support::{ScratchSchema, random_id, shared_client, shared_conn};

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dlock::pg::PgBackend;
use dlock::pg::tokio_postgres::{Client, NoTls};
use dlock::{Backend, HolderInfo, LockKey, LockOptions};

/// The previous protocol's lock and unlock statements, word for word
/// (`{schema}` stands for the quoted schema).
const TRY_LOCK_RECORDING: &str = include_str!("recorded/try_lock_recording.sql");
const UNLOCK_GATED: &str = include_str!("recorded/unlock_gated.sql");

/// A replica on the previous protocol, speaking it by hand on a session of
/// its own.
struct Older {
    client: Client,
    started: SystemTime,
    schema: String,
    record: String,
}

impl Older {
    async fn new(schema: &ScratchSchema) -> Self {
        let (client, connection) = dlock::pg::tokio_postgres::connect(&shared_conn(), NoTls)
            .await
            .expect("connect");
        tokio::spawn(connection);
        let started = client
            .query_one(
                "SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()",
                &[],
            )
            .await
            .expect("session start")
            .get(0);
        Self {
            client,
            started,
            schema: schema.name.clone(),
            record: HolderInfo::this_process(Some("older")).encode(),
        }
    }

    /// Tries `key`: its token, or `None` when it is held.
    async fn try_lock(&self, key: &LockKey) -> Option<i64> {
        let statement = TRY_LOCK_RECORDING.replace("{schema}", &self.schema);
        let row = self
            .client
            .query_one(
                &statement,
                &[
                    &key.as_str(),
                    &0_i64,
                    &None::<&str>,
                    &self.started,
                    &self.record.as_str(),
                    &None::<bool>,
                ],
            )
            .await
            .expect("the older lock statement");
        row.get(1)
    }

    async fn unlock(&self, key: &LockKey) {
        let h: i64 = self
            .client
            .query_one("SELECT hashtextextended($1::text, 0)", &[&key.as_str()])
            .await
            .expect("hash")
            .get(0);
        let statement = UNLOCK_GATED.replace("{schema}", &self.schema);
        let unlocked: bool = self
            .client
            .query_one(&statement, &[&h])
            .await
            .expect("the older unlock")
            .get(0);
        assert!(unlocked, "the older replica held `{key}`");
    }
}

/// The schema and token sequence as an older dlock made them: a sequence
/// without a token lead, which a new replica leaves so (docs/postgres.md).
async fn made_by_an_older_dlock(schema: &ScratchSchema, admin: &Client) {
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA {s}; CREATE SEQUENCE {s}.dlock_token_seq AS bigint",
            s = schema.name
        ))
        .await
        .expect("the older dlock's objects");
}

async fn connect(schema: &ScratchSchema) -> Arc<dyn Backend> {
    Arc::new(
        PgBackend::connect_with(&shared_conn(), schema.options())
            .await
            .expect("connect"),
    )
}

/// Old and new replicas take one key in turn: each is refused while the
/// other holds it, every token is above the last, and a new reader reads
/// the older replica's holder from its record and the new one's from its
/// marks, never the older replica's record left behind for the new lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_and_new_replicas_exclude_each_other_and_tokens_keep_rising_across_both() {
    let schema = ScratchSchema::new("upgrade");
    let admin = shared_client().await;
    made_by_an_older_dlock(&schema, &admin).await;
    let new = connect(&schema).await;
    let reader = connect(&schema).await;
    let prefix = format!("dlock-test:upgrade:{}:", random_id());
    let key = LockKey::new(format!("{prefix}k")).expect("key");
    let options = LockOptions::new(Duration::from_secs(30));
    // The new replica makes the tables, as the first one upgraded does.
    options
        .acquire_on(Arc::clone(&new), &key)
        .await
        .expect("free")
        .release()
        .await
        .expect("release");
    let older = Older::new(&schema).await;
    let mut last = 0_i64;
    for round in 0..3 {
        let old_token = older.try_lock(&key).await.expect("free for the older one");
        assert!(old_token > last, "round {round}: {old_token} after {last}");
        last = old_token;
        let refused = options.acquire_on(Arc::clone(&new), &key).await;
        assert!(
            refused.is_err(),
            "round {round}: the new replica took a held key"
        );
        let seen = reader.holder(&key).await.expect("read").expect("held");
        assert_eq!(seen.token.map(|t| t.get() as i64), Some(old_token));
        let info = seen.holder.expect("the older replica's record");
        assert_eq!(info.label.as_deref(), Some("older"));
        let listed = reader.held(&prefix).await.expect("list");
        assert_eq!(listed.len(), 1, "{listed:?}");
        older.unlock(&key).await;
        let left: i64 = admin
            .query_one(
                &format!(
                    "SELECT count(*) FROM {}.dlock_holders WHERE key = $1",
                    schema.name
                ),
                &[&key.as_str()],
            )
            .await
            .expect("count")
            .get(0);
        assert_eq!(
            left, 1,
            "round {round}: the older replica leaves its record"
        );

        let lease = options
            .acquire_on(Arc::clone(&new), &key)
            .await
            .expect("free for the new one");
        let new_token = lease.token().get() as i64;
        assert!(new_token > last, "round {round}: {new_token} after {last}");
        last = new_token;
        assert_eq!(older.try_lock(&key).await, None, "round {round}: held");
        let seen = reader.holder(&key).await.expect("read").expect("held");
        assert_eq!(
            seen.token,
            Some(lease.token()),
            "round {round}: the new lease's own token, never the record left behind"
        );
        let listed = reader.held(&prefix).await.expect("list");
        assert_eq!(
            listed
                .iter()
                .map(|(k, h)| (k.as_str(), h.token))
                .collect::<Vec<_>>(),
            vec![(key.as_str(), Some(lease.token()))]
        );
        lease.release().await.expect("release");
    }
}

/// An older dlock writes the sequence without the draw lock, so its
/// `setval` of a clock reading may land after a new replica's draw. On the
/// sequence an older dlock made, which a new replica leaves without a
/// token lead, such a late write lowers no key's next token, whichever
/// replica draws it: the next draw finds the sequence behind the clock and
/// hands out the clock, past the last token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_dlocks_sequence_gets_no_lead_and_a_late_older_write_lowers_no_token() {
    let schema = ScratchSchema::new("upgrade");
    let admin = shared_client().await;
    made_by_an_older_dlock(&schema, &admin).await;
    let seq = format!("{}.dlock_token_seq", schema.name);
    // Where the older dlock's draws left its sequence: at the clock.
    admin
        .batch_execute(&format!(
            "SELECT setval('{seq}', (EXTRACT(epoch FROM clock_timestamp()) * 1000000)::int8)"
        ))
        .await
        .expect("the older dlock's draws");
    let new = connect(&schema).await;
    let lead = super::token_lead::lead_comment(&admin, &schema.name).await;
    assert_eq!(lead, None, "a new replica added a token lead");
    let older = Older::new(&schema).await;
    let key = LockKey::new(format!("dlock-test:upgrade:{}:late", random_id())).expect("key");
    let options = LockOptions::new(Duration::from_secs(30));
    // A `setval` of the older replica's clock reading of 5 ms ago.
    let late_write = format!(
        "SELECT setval('{seq}', (EXTRACT(epoch FROM clock_timestamp()) * 1000000)::int8 - 5000)"
    );
    let mut last = 0_i64;
    for round in 0..3 {
        let lease = options
            .acquire_on(Arc::clone(&new), &key)
            .await
            .expect("free for the new one");
        let new_token = lease.token().get() as i64;
        lease.release().await.expect("release");
        assert!(new_token > last, "round {round}: {new_token} after {last}");
        admin
            .batch_execute(&late_write)
            .await
            .expect("the older replica's late write");
        let old_token = older.try_lock(&key).await.expect("free for the older one");
        older.unlock(&key).await;
        assert!(
            old_token > new_token,
            "round {round}: the older replica's {old_token} after {new_token}"
        );
        admin
            .batch_execute(&late_write)
            .await
            .expect("the older replica's late write");
        last = old_token;
    }
    let lease = options
        .acquire_on(Arc::clone(&new), &key)
        .await
        .expect("free for the new one");
    assert!(lease.token().get() as i64 > last);
    lease.release().await.expect("release");
}

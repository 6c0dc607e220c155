//! Plain leases named rather than recorded: no row written per lock, the
//! token read from the lock table, and the tables of names (who each lock
//! session is, which key each advisory key stands for) against what a DBA
//! does to them: rows that name a dead session, tables emptied, dropped or
//! locked while locks are taken.

use crate::pg_support::{ScratchSchema, shared_client, shared_conn};
use crate::support::within;

use std::sync::Arc;
use std::time::Duration;

use dlock::backend::OwnerId;
use dlock::pg::tokio_postgres::Client;
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, HolderInfo, Lease, LockKey, LockOptions};

fn fresh_key(prefix: &str, label: &str) -> LockKey {
    let id = OwnerId::random().expect("random bytes");
    LockKey::new(format!("{prefix}{label}:{id}")).expect("valid key")
}

fn prefix() -> String {
    let id = OwnerId::random().expect("random bytes");
    format!("dlock-test:names:{id}:")
}

async fn connect(options: PgOptions) -> Arc<dyn Backend> {
    Arc::new(
        PgBackend::connect_with(&shared_conn(), options)
            .await
            .expect("connect"),
    )
}

async fn take(backend: &Arc<dyn Backend>, key: &LockKey) -> Lease {
    LockOptions::new(Duration::from_secs(30))
        .acquire_on(Arc::clone(backend), key)
        .await
        .expect("free")
}

async fn count(admin: &Client, sql: &str) -> i64 {
    admin.query_one(sql, &[]).await.expect("count").get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_lock_writes_no_row_and_its_token_is_read_from_the_lock_table() {
    let schema = ScratchSchema::new("names");
    let admin = shared_client().await;
    let holder = connect(schema.options()).await;
    let reader = connect(schema.options()).await;
    let prefix = prefix();
    let key = fresh_key(&prefix, "plain");
    let lease = take(&holder, &key).await;
    let s = &schema.name;
    assert_eq!(
        count(&admin, &format!("SELECT count(*) FROM {s}.dlock_holders")).await,
        0
    );
    let marks = count(
        &admin,
        &format!(
            "SELECT count(*) FROM pg_locks AS m, pg_locks AS l \
             WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.mode = 'ExclusiveLock' \
               AND (l.classid::int8 << 32) | l.objid::int8 = hashtextextended('{key}', 0) \
               AND m.pid = l.pid AND m.locktype = 'advisory' AND m.objsubid = 2 \
               AND m.mode = 'ShareLock'"
        ),
    )
    .await;
    assert_eq!(marks, 2, "two token marks beside the lock");
    let seen = reader.holder(&key).await.expect("read").expect("held");
    assert_eq!(seen.token, Some(lease.token()));
    let me = HolderInfo::this_process(None);
    let info = seen.holder.expect("named");
    assert_eq!((info.host.as_str(), info.pid), (me.host.as_str(), me.pid));
    let listed = reader.held(&prefix).await.expect("list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].1.token, Some(lease.token()));
    lease.release().await.expect("release");
    assert_eq!(
        count(
            &admin,
            &format!(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 \
                 AND pid IN (SELECT pid FROM {s}.dlock_sessions)"
            )
        )
        .await,
        0,
        "the marks go with the lock"
    );
    assert_eq!(reader.holder(&key).await.expect("read"), None);
    assert!(reader.held(&prefix).await.expect("list").is_empty());
}

/// A row of `dlock_sessions` whose start is not the holding session's (a
/// dead session's, whose pid the server gave to a later one) names nobody:
/// the holder reads with its token and no host or pid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_sessions_name_never_names_a_later_session_with_its_pid() {
    let schema = ScratchSchema::new("names");
    let admin = shared_client().await;
    let holder = connect(schema.options()).await;
    let reader = connect(schema.options()).await;
    let prefix = prefix();
    let key = fresh_key(&prefix, "dead");
    let lease = take(&holder, &key).await;
    admin
        .batch_execute(&format!(
            "UPDATE {}.dlock_sessions SET session_start = session_start - interval '1 hour', \
             holder = '1' || chr(9) || 'elsewhere' || chr(9) || '7' || chr(9)",
            schema.name
        ))
        .await
        .expect("age the names");
    let seen = reader.holder(&key).await.expect("read").expect("held");
    assert_eq!(
        seen.token,
        Some(lease.token()),
        "the token is the lock table's"
    );
    assert_eq!(seen.holder, None, "a dead session's name is nobody's");
    let listed = reader.held(&prefix).await.expect("list");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].1.holder, None);
    lease.release().await.expect("release");
}

/// A DBA empties the tables of names while a lock is held: the lock, its
/// token and its release are untouched, the holder's name and the key's
/// listing are gone until a new key is locked, which names its session
/// and itself again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emptied_tables_of_names_cost_no_lock_and_a_new_key_names_the_session_again() {
    let schema = ScratchSchema::new("names");
    let admin = shared_client().await;
    let holder = connect(schema.options().sessions(1)).await;
    let reader = connect(schema.options()).await;
    let prefix = prefix();
    let first = fresh_key(&prefix, "a");
    let lease = take(&holder, &first).await;
    admin
        .batch_execute(&format!(
            "TRUNCATE {s}.dlock_sessions, {s}.dlock_keys",
            s = schema.name
        ))
        .await
        .expect("truncate");
    let seen = reader.holder(&first).await.expect("read").expect("held");
    assert_eq!(
        (seen.token, seen.holder.is_none()),
        (Some(lease.token()), true)
    );
    assert!(reader.held(&prefix).await.expect("list").is_empty());
    let second = fresh_key(&prefix, "b");
    let other = take(&holder, &second).await;
    let seen = reader.holder(&first).await.expect("read").expect("held");
    assert!(seen.holder.is_some(), "the session is named again");
    let listed: Vec<String> = reader
        .held(&prefix)
        .await
        .expect("list")
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    assert_eq!(listed, vec![second.as_str().to_owned()]);
    lease.release().await.expect("release");
    other.release().await.expect("release");
}

/// A DBA drops the tables of names while locks are held and taken: no
/// lock fails or is lost, and the tables are made again by the next
/// acquisitions, which name their keys in them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_tables_of_names_cost_no_lock_and_are_made_again() {
    let schema = ScratchSchema::new("names");
    let admin = shared_client().await;
    let holder = connect(schema.options()).await;
    let reader = connect(schema.options()).await;
    let prefix = prefix();
    let held = take(&holder, &fresh_key(&prefix, "held")).await;
    admin
        .batch_execute(&format!(
            "DROP TABLE {s}.dlock_sessions, {s}.dlock_keys",
            s = schema.name
        ))
        .await
        .expect("drop");
    let mut later = Vec::new();
    for label in ["b", "c", "d"] {
        let key = fresh_key(&prefix, label);
        later.push((take(&holder, &key).await, key));
    }
    for table in ["dlock_sessions", "dlock_keys"] {
        assert!(schema.has_relation(&admin, table).await, "{table} is back");
    }
    let (last, last_key) = later.last().expect("a lease");
    let listed = reader.held(&prefix).await.expect("list");
    assert!(
        listed
            .iter()
            .any(|(key, h)| key == last_key.as_str() && h.token == Some(last.token())),
        "{listed:?}"
    );
    assert!(held.check().is_ok(), "{:?}", held.check());
    held.release().await.expect("release");
    for (lease, _) in later {
        lease.release().await.expect("release");
    }
}

/// A DBA holds the tables of names locked (a `LOCK TABLE` left open):
/// acquisitions of new keys go on, each held up by the naming's short
/// wait at most, and their locks and tokens are whole; the names are
/// written again once the DBA lets go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dba_lock_on_the_tables_of_names_costs_no_lock() {
    let schema = ScratchSchema::new("names");
    let mut admin = shared_client().await;
    let holder = connect(schema.options()).await;
    let reader = connect(schema.options()).await;
    let prefix = prefix();
    take(&holder, &fresh_key(&prefix, "setup"))
        .await
        .release()
        .await
        .expect("release");
    let tx = admin.transaction().await.expect("begin");
    tx.batch_execute(&format!(
        "LOCK TABLE {s}.dlock_sessions, {s}.dlock_keys IN ACCESS EXCLUSIVE MODE",
        s = schema.name
    ))
    .await
    .expect("lock");
    let mut leases = Vec::new();
    for label in ["b", "c", "d"] {
        let key = fresh_key(&prefix, label);
        let lease = within(
            30,
            "an acquisition beside a DBA's lock",
            take(&holder, &key),
        )
        .await;
        leases.push((lease, key));
    }
    tx.commit().await.expect("commit");
    for (lease, key) in &leases {
        let seen = reader.holder(key).await.expect("read").expect("held");
        assert_eq!(seen.token, Some(lease.token()), "{key}");
    }
    for (lease, _) in leases {
        lease.release().await.expect("release");
    }
}

/// How many leases of a backend carry token marks at once (the backend's
/// `names::MAX_MARKED`).
const MAX_MARKED: usize = 512;

/// Past the leases a backend marks at once, a plain lease records itself
/// in `dlock_holders` (one lock-table entry, where a marked lease takes
/// three): readers read its token and holder all the same, and once a
/// marked lease is let go, the next lease is marked again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_marked_leases_a_plain_lease_records_itself_and_is_read_all_the_same() {
    let schema = ScratchSchema::new("names");
    let admin = shared_client().await;
    let holder = connect(schema.options()).await;
    let reader = connect(schema.options()).await;
    let prefix = prefix();
    let mut leases = Vec::with_capacity(MAX_MARKED + 2);
    for i in 0..MAX_MARKED {
        let key = fresh_key(&prefix, &format!("m{i}"));
        leases.push(take(&holder, &key).await);
    }
    let rows = format!(
        "SELECT count(*) FROM {}.dlock_holders WHERE starts_with(key, '{prefix}')",
        schema.name
    );
    assert_eq!(count(&admin, &rows).await, 0, "{MAX_MARKED} marked leases");
    let past = fresh_key(&prefix, "past");
    let recorded = take(&holder, &past).await;
    assert_eq!(count(&admin, &rows).await, 1, "the next one records itself");
    let seen = reader.holder(&past).await.expect("read").expect("held");
    assert_eq!(seen.token, Some(recorded.token()));
    assert!(seen.holder.is_some(), "{seen:?}");
    let listed = reader.held(&prefix).await.expect("list");
    assert_eq!(listed.len(), MAX_MARKED + 1);
    leases
        .pop()
        .expect("a lease")
        .release()
        .await
        .expect("release");
    let again = fresh_key(&prefix, "again");
    let marked = take(&holder, &again).await;
    assert_eq!(count(&admin, &rows).await, 1, "marked again: no new row");
    let seen = reader.holder(&again).await.expect("read").expect("held");
    assert_eq!(seen.token, Some(marked.token()));
    recorded.release().await.expect("release");
    marked.release().await.expect("release");
    for lease in leases {
        lease.release().await.expect("release");
    }
}

/// A key taken past the marked leases records itself on the session; taken
/// again once a marked lease was let go, it records itself again there
/// (the earlier record could otherwise be read for it), and is read with
/// its own token: a backend of one session keeps one connection, however
/// often keys go past the marked leases and back. It retired the session
/// for each such key instead, which its other leases kept open: one
/// connection more per cycle, up to the server's limit. On a server of the
/// test's own, whose connections are all the test's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_past_the_marked_leases_and_back_opens_no_connection() {
    let server = crate::pg_support::OwnServer::start();
    let conn = server.conn(crate::pg_support::PASSWORD, "sslmode=disable");
    let admin = crate::pg_support::client_of(&conn).await;
    let holder: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&conn, PgOptions::new().sessions(1))
            .await
            .expect("connect"),
    );
    let prefix = prefix();
    let mut leases = std::collections::VecDeque::with_capacity(MAX_MARKED);
    for i in 0..MAX_MARKED {
        leases.push_back(take(&holder, &fresh_key(&prefix, &format!("m{i}"))).await);
    }
    let connections = "SELECT count(*) FROM pg_stat_activity \
                       WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()";
    let mut counted = Vec::new();
    for cycle in 0..4 {
        let key = fresh_key(&prefix, &format!("past{cycle}"));
        take(&holder, &key).await.release().await.expect("release");
        let freed = leases.pop_front().expect("a marked lease");
        freed.release().await.expect("release");
        let again = take(&holder, &key).await;
        let seen = holder.holder(&key).await.expect("read").expect("held");
        assert_eq!(seen.token, Some(again.token()), "cycle {cycle}");
        again.release().await.expect("release");
        leases.push_back(take(&holder, &fresh_key(&prefix, &format!("r{cycle}"))).await);
        counted.push(count(&admin, connections).await);
    }
    assert!(
        counted.iter().all(|&n| n == counted[0]),
        "connections after each cycle: {counted:?}"
    );
    for lease in leases {
        lease.release().await.expect("release");
    }
}

/// Names of keys that nobody locked for long are swept: a backend's first
/// naming (and one every 10 minutes after) deletes the names stamped over
/// 20 minutes ago whose advisory key nobody holds, so a service that locks
/// a key per request does not grow `dlock_keys` for ever. A name whose
/// key is held stays, however old.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_of_keys_nobody_locked_for_long_are_swept_and_held_ones_stay() {
    let schema = ScratchSchema::new("names");
    let admin = shared_client().await;
    let first = connect(schema.options()).await;
    let prefix = prefix();
    let mut kept = None;
    for i in 0..20 {
        let lease = take(&first, &fresh_key(&prefix, &format!("k{i}"))).await;
        if i == 0 {
            kept = Some(lease);
        } else {
            lease.release().await.expect("release");
        }
    }
    let kept = kept.expect("a lease");
    let names = format!(
        "SELECT count(*) FROM {}.dlock_keys WHERE starts_with(key, '{prefix}')",
        schema.name
    );
    assert_eq!(count(&admin, &names).await, 20);
    admin
        .batch_execute(&format!(
            "UPDATE {}.dlock_keys SET named_at = now() - interval '1 day'",
            schema.name
        ))
        .await
        .expect("age the names");
    // Another backend's first naming sweeps.
    let second = connect(schema.options()).await;
    let fresh = take(&second, &fresh_key(&prefix, "fresh")).await;
    assert_eq!(
        count(&admin, &names).await,
        2,
        "the held key's name and the fresh one stay"
    );
    let listed = second.held(&prefix).await.expect("list");
    assert_eq!(listed.len(), 2, "{listed:?}");
    kept.release().await.expect("release");
    fresh.release().await.expect("release");
}

/// A lease whose holder cannot be named (a DBA holds `dlock_sessions`
/// locked), on a session that named another holder for an earlier lease,
/// records itself instead: a reader names it with its own label, never
/// with the earlier lease's, which is all the session's names hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_holder_cannot_be_named_never_reads_with_an_earlier_label() {
    use dlock::backend::{AcquireRequest, Attempt, ReleaseRequest};
    let schema = ScratchSchema::new("names_label");
    let holder = PgBackend::connect_with(&shared_conn(), schema.options().sessions(1))
        .await
        .expect("connect");
    let reader = connect(schema.options()).await;
    let prefix = prefix();
    let (first, second) = (fresh_key(&prefix, "a"), fresh_key(&prefix, "b"));
    let owner = OwnerId::random().expect("owner");
    let take = async |key: &LockKey, label: &str| {
        let request =
            AcquireRequest::new(key, &owner, Duration::from_secs(60)).with_label(Some(label));
        match holder.try_acquire(&request).await.expect("acquire") {
            Attempt::Acquired(grant) => grant.token,
            held => panic!("a free key: {held:?}"),
        }
    };
    take(&first, "job-a").await;
    let seen = reader.holder(&first).await.expect("read").expect("held");
    let label = seen.holder.and_then(|h| h.label);
    assert_eq!(label.as_deref(), Some("job-a"));
    holder
        .release(&ReleaseRequest::new(&first, &owner))
        .await
        .expect("release");

    let mut dba = crate::pg_support::client_of(&shared_conn()).await;
    let tx = dba.transaction().await.expect("begin");
    tx.batch_execute(&format!(
        "LOCK TABLE {}.dlock_sessions IN EXCLUSIVE MODE",
        schema.name
    ))
    .await
    .expect("lock the table");
    let token = take(&second, "job-b").await;
    let seen = reader.holder(&second).await.expect("read").expect("held");
    tx.rollback().await.expect("rollback");
    assert_eq!(seen.token, Some(token));
    let label = seen.holder.and_then(|h| h.label);
    assert_ne!(
        label.as_deref(),
        Some("job-a"),
        "read with the earlier lease's label"
    );
    holder
        .release(&ReleaseRequest::new(&second, &owner))
        .await
        .expect("release");
}

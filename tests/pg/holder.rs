//! Who holds a key on `PgBackend` (`Backend::holder`, `watch_holder`),
//! against the shared PostgreSQL (127.0.0.1:5432, or `DLOCK_PG_URL`): the
//! identity and token an acquisition records, read by other instances; a
//! holder session that dies; leases that follow one another on one
//! session never read with an earlier one's identity; the table of records
//! made only by identity acquisitions, and the error a role that may not
//! create it gets; records a DBA truncated, changed or dropped written
//! again by the next renewal, and a release a revoked DELETE fails;
//! acquisitions announced to watches of a free key, and those not
//! announced (an older dlock, a lock of notifying commits held elsewhere)
//! read by their recheck. Each test works in a schema of its own, dropped
//! at the end (the one that needs a server setting, on a server of its
//! own).

use crate::pg_support;
use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use dlock::backend::{
    Access, AcquireRequest, Attempt, Holding, OwnerId, ReleaseNotice, ReleaseOutcome,
    ReleaseRequest, Renewal,
};
use dlock::election::{Election, Leader, Leadership};
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, FencingToken, LockError, LockKey, LockOptions};
use pg_support::{
    OwnServer, PASSWORD, ScratchSchema, colliding_keys, freed_on_the_server,
    key_colliding_with_a_permit, random_id, shared_client, shared_conn,
};
use support::within;
use tokio::time::Instant;

fn fresh_key(label: &str) -> LockKey {
    LockKey::new(format!("dlock-test:{label}:{}", random_id())).expect("valid key")
}

async fn connect(options: PgOptions) -> PgBackend {
    PgBackend::connect_with(&shared_conn(), options)
        .await
        .expect("PostgreSQL at 127.0.0.1:5432 or DLOCK_PG_URL")
}

/// Two instances on `schema`, as two processes would have.
async fn two_instances(schema: &ScratchSchema) -> (PgBackend, PgBackend) {
    (
        connect(schema.options()).await,
        connect(schema.options()).await,
    )
}

/// Takes `key` for `owner`, recording `identity` if there is one; the token.
async fn take(
    backend: &PgBackend,
    key: &LockKey,
    owner: &OwnerId,
    identity: Option<&str>,
) -> Result<FencingToken, LockError> {
    let request = AcquireRequest::new(key, owner, Duration::from_secs(30)).with_identity(identity);
    match backend.try_acquire(&request).await? {
        Attempt::Acquired(grant) => Ok(grant.token),
        held => panic!("`{key}` should be free: {held:?}"),
    }
}

async fn give_back(backend: &PgBackend, key: &LockKey, owner: &OwnerId) {
    let outcome = backend
        .release(&ReleaseRequest::new(key, owner))
        .await
        .expect("release");
    assert_eq!(outcome, ReleaseOutcome::Released);
}

/// The server process id of the session holding `key`.
async fn holding_pid(admin: &dlock::pg::tokio_postgres::Client, key: &LockKey) -> i32 {
    admin
        .query_one(
            "SELECT l.pid FROM pg_locks AS l, (SELECT hashtextextended($1::text, 0) AS h) AS k \
             WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock' \
               AND l.classid::int8 = ((k.h >> 32) & 4294967295) \
               AND l.objid::int8 = (k.h & 4294967295) AND l.objsubid = 1",
            &[&key.as_str()],
        )
        .await
        .expect("the key is held")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_acquisition_shows_its_token_and_identity_to_every_reader_until_released() {
    let schema = ScratchSchema::new("holder");
    let (holder, reader) = two_instances(&schema).await;
    let key = fresh_key("identity");
    assert_eq!(
        reader.holder(&key).await.expect("read"),
        None,
        "free at first"
    );

    let owner = OwnerId::random().expect("owner");
    let token = take(&holder, &key, &owner, Some("node-a:4711"))
        .await
        .expect("free");

    let seen = reader.holder(&key).await.expect("read").expect("held");
    assert_eq!(
        (seen.token, seen.identity.as_deref()),
        (Some(token), Some("node-a:4711")),
        "another instance reads the recorded token and identity"
    );
    assert_eq!(seen.expires_in, None, "another process cannot see the ttl");
    let own = holder.holder(&key).await.expect("read").expect("held");
    assert_eq!(
        (own.token, own.identity.as_deref()),
        (Some(token), Some("node-a:4711"))
    );
    let left = own
        .expires_in
        .expect("the holding process knows its deadline");
    assert!(
        left <= Duration::from_secs(30) && left > Duration::from_secs(20),
        "{left:?}"
    );

    give_back(&holder, &key, &owner).await;
    assert_eq!(reader.holder(&key).await.expect("read"), None, "free again");
    assert_eq!(holder.holder(&key).await.expect("read"), None, "free again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_holder_session_leaves_no_holder_and_its_record_is_never_read_again() {
    let schema = ScratchSchema::new("holder");
    let (holder, reader) = two_instances(&schema).await;
    let admin = shared_client().await;
    let key = fresh_key("terminated");
    let owner = OwnerId::random().expect("owner");
    take(&holder, &key, &owner, Some("doomed"))
        .await
        .expect("free");
    let pid = holding_pid(&admin, &key).await;

    admin
        .query_one("SELECT pg_terminate_backend($1, 5000)", &[&pid])
        .await
        .expect("terminate");
    assert_eq!(
        reader.holder(&key).await.expect("read"),
        None,
        "the lock went with its session"
    );
    let stale: i64 = admin
        .query_one(
            &format!(
                "SELECT count(*) FROM {}.dlock_holders WHERE pid = $1",
                schema.name
            ),
            &[&pid],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(stale, 1, "the dead session's record stays behind");

    // The next holder took the key without an identity: nobody reads it
    // with the dead session's.
    let next = OwnerId::random().expect("owner");
    let token = take(&reader, &key, &next, None).await.expect("free");
    let seen = holder.holder(&key).await.expect("read").expect("held");
    assert_eq!(
        (seen.token, seen.identity),
        (Some(token), None),
        "held by its own record, without the dead session's identity"
    );
    let own = reader.holder(&key).await.expect("read").expect("held");
    assert_eq!((own.token, own.identity), (Some(token), None));
    give_back(&reader, &key, &next).await;
}

/// One lease as granted: its token and identity, and when it may have held
/// the key (from the start of its acquisition to the end of its release).
struct Granted {
    token: FencingToken,
    identity: Option<String>,
    from: Instant,
    until: Option<Instant>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_that_follow_one_another_on_one_session_are_never_read_with_an_earlier_ones_identity()
 {
    let schema = ScratchSchema::new("holder");
    // One session: every lease of the holder runs on it, each right after
    // the one before.
    let holder = connect(schema.options().sessions(1)).await;
    let reader = connect(schema.options()).await;
    let key = fresh_key("one-session");
    let mut granted: Vec<Granted> = Vec::new();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));

    // Readers: every answer, with when it was asked and answered.
    let readers: Vec<_> = [reader, holder.clone()]
        .into_iter()
        .map(|backend| {
            let (key, done) = (key.clone(), Arc::clone(&done));
            tokio::spawn(async move {
                let mut seen = Vec::new();
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let asked = Instant::now();
                    let holding = backend.holder(&key).await.expect("read");
                    seen.push((asked, holding, Instant::now()));
                }
                seen
            })
        })
        .collect();

    for round in 0..50 {
        // Every third lease records nothing: a lease without an identity
        // right after one with, on the same session, must not be read with it.
        let identity = (round % 3 != 2).then(|| format!("candidate-{round}"));
        let owner = OwnerId::random().expect("owner");
        let from = Instant::now();
        let token = take(&holder, &key, &owner, identity.as_deref())
            .await
            .expect("free");
        granted.push(Granted {
            token,
            identity,
            from,
            until: None,
        });
        tokio::time::sleep(Duration::from_millis(2)).await;
        give_back(&holder, &key, &owner).await;
        granted.last_mut().expect("just pushed").until = Some(Instant::now());
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);

    let mut named = 0;
    for reader in readers {
        for (asked, holding, answered) in reader.await.expect("reader") {
            let Some(holding) = holding else { continue };
            if holding.identity.is_none() && holding.token.is_none() {
                continue;
            }
            // A token or an identity belongs to one lease, which held the
            // key at some moment while the question was out.
            let lease = granted
                .iter()
                .find(|g| Some(g.token) == holding.token)
                .unwrap_or_else(|| panic!("read a token never granted: {holding:?}"));
            assert_eq!(
                lease.identity, holding.identity,
                "token {} read with another lease's identity",
                lease.token
            );
            assert!(
                lease.from <= answered && lease.until.is_none_or(|until| asked <= until),
                "lease {} (`{:?}`) read after it ended or before it began",
                lease.token,
                lease.identity
            );
            named += usize::from(holding.identity.is_some());
        }
    }
    assert!(named > 0, "the readers saw some identity at all");
}

/// A plain lease names its holder (its session and its key, once each)
/// and writes no record: another process reads its token from the lock
/// table and its host and pid from the session's name, and nothing is
/// left to delete once it is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_locks_name_their_holder_and_create_the_tables() {
    let schema = ScratchSchema::new("holder");
    let admin = shared_client().await;
    let (holder, reader) = two_instances(&schema).await;
    assert!(
        !schema.has_relation(&admin, "dlock_holders").await,
        "connecting creates no table"
    );
    let key = fresh_key("plain");
    let lease = LockOptions::new(Duration::from_secs(30))
        .acquire_on(Arc::new(holder.clone()), &key)
        .await
        .expect("free");
    for table in ["dlock_holders", "dlock_sessions", "dlock_keys"] {
        assert!(schema.has_relation(&admin, table).await, "{table}");
    }
    let seen = reader.holder(&key).await.expect("read").expect("held");
    assert_eq!((seen.token, seen.identity), (Some(lease.token()), None));
    let me = dlock::HolderInfo::this_process(None);
    let info = seen.holder.expect("the holder recorded");
    assert_eq!((&info.host, info.pid), (&me.host, me.pid));
    let own = holder.holder(&key).await.expect("read").expect("held");
    assert_eq!((own.token, own.identity), (Some(lease.token()), None));
    assert_eq!(own.holder.map(|h| h.pid), Some(me.pid), "its own, too");
    assert!(
        info.held_for
            .is_some_and(|held| held < Duration::from_secs(30)),
        "{info:?}"
    );
    assert_eq!(rows_under(&admin, &schema, "dlock-test:plain:").await, 0);
    lease.release().await.expect("release");
    assert_eq!(reader.holder(&key).await.expect("read"), None);
    // The key's name stays, and is read only while the key is held.
    assert_eq!(rows_under(&admin, &schema, "dlock-test:plain:").await, 0);
    assert_eq!(names_under(&admin, &schema, key.as_str()).await, 1);
    assert!(
        holder
            .held("dlock-test:plain:")
            .await
            .expect("list")
            .is_empty()
    );
}

/// Makes `schema` one where the tables of names cannot be made (a view
/// holds the name `dlock_keys`), as for a role that may not create them:
/// its leases without an identity record their holder with every
/// acquisition, the older way, which the tests of those records exercise.
async fn without_names(admin: &dlock::pg::tokio_postgres::Client, schema: &ScratchSchema) {
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS {s}; \
             CREATE VIEW {s}.dlock_keys AS SELECT NULL::int8 AS lock_id, NULL::text AS key \
             WHERE false",
            s = schema.name
        ))
        .await
        .expect("a view in the way of the tables of names");
}

/// How many names of keys under `prefix` the table of names holds.
async fn names_under(
    admin: &dlock::pg::tokio_postgres::Client,
    schema: &ScratchSchema,
    prefix: &str,
) -> i64 {
    admin
        .query_one(
            &format!(
                "SELECT count(*) FROM {}.dlock_keys WHERE starts_with(key, $1)",
                schema.name
            ),
            &[&prefix],
        )
        .await
        .expect("count")
        .get(0)
}

/// How many rows of the table of holder records name a key under `prefix`.
async fn rows_under(
    admin: &dlock::pg::tokio_postgres::Client,
    schema: &ScratchSchema,
    prefix: &str,
) -> i64 {
    admin
        .query_one(
            &format!(
                "SELECT count(*) FROM {}.dlock_holders WHERE starts_with(key, $1)",
                schema.name
            ),
            &[&prefix],
        )
        .await
        .expect("count")
        .get(0)
}

/// How long a session's oldest released record waits for its batch (the
/// session's `RELEASED_WAIT`): a release past that deletes the batch
/// however few records it holds.
const RELEASED_WAIT: Duration = Duration::from_secs(1);

/// One try at the batch count of [`released_records_are_deleted_in_batches`]
/// on a fresh session, under a fresh prefix: 64 keys taken first (each
/// recording its holder), then released: the first, the next 62 at once
/// (their statements pipelined on the session), the 64th. The record counts
/// after the first, the 63rd and the 64th release, then after the same
/// key taken and released three times; `None` if the releases of a batch
/// spanned [`RELEASED_WAIT`] (that batch may have gone by its age, not its
/// count), to try again.
async fn released_batch_counts(
    schema: &ScratchSchema,
    admin: &dlock::pg::tokio_postgres::Client,
) -> Option<(String, [i64; 4], PgBackend)> {
    let holder = connect(schema.options().sessions(1)).await;
    let prefix = format!("dlock-test:batch:{}:", random_id());
    let owner = OwnerId::random().expect("owner");
    let mut keys = Vec::new();
    for i in 0..64 {
        let key = LockKey::new(format!("{prefix}{i}")).expect("key");
        take(&holder, &key, &owner, None).await.expect("free");
        keys.push(key);
    }
    // From before the first release (which starts the batch's clock) to
    // after the last one (which reads it): never shorter than the age the
    // session saw.
    let batch_began = Instant::now();
    give_back(&holder, &keys[0], &owner).await;
    let after_first = rows_under(admin, schema, &prefix).await;
    futures_util::future::join_all(
        keys[1..63]
            .iter()
            .map(|key| give_back(&holder, key, &owner)),
    )
    .await;
    let after_63 = rows_under(admin, schema, &prefix).await;
    give_back(&holder, &keys[63], &owner).await;
    if batch_began.elapsed() >= RELEASED_WAIT {
        return None;
    }
    let after_64 = rows_under(admin, schema, &prefix).await;

    // The same key taken again and released overwrites its own record.
    let again = LockKey::new(format!("{prefix}again")).expect("key");
    take(&holder, &again, &owner, None).await.expect("free");
    let batch_began = Instant::now();
    give_back(&holder, &again, &owner).await;
    for _ in 0..2 {
        take(&holder, &again, &owner, None).await.expect("free");
        give_back(&holder, &again, &owner).await;
    }
    if batch_began.elapsed() >= RELEASED_WAIT {
        return None;
    }
    let after_again = rows_under(admin, schema, &prefix).await;
    Some((
        prefix,
        [after_first, after_63, after_64, after_again],
        holder,
    ))
}

/// A plain lease that records its holder (where the tables of names cannot
/// be made) leaves its record at its release, and its session deletes
/// the records it left in batches: after 64 releases none is left, and a
/// release a second after the last batch deletes what came since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_records_are_deleted_in_batches() {
    let schema = ScratchSchema::new("holder");
    let admin = shared_client().await;
    without_names(&admin, &schema).await;
    let mut tries = 0;
    let (prefix, left, holder) = loop {
        tries += 1;
        if let Some(counts) = released_batch_counts(&schema, &admin).await {
            break counts;
        }
        assert!(
            tries < 10,
            "every batch of releases took over {RELEASED_WAIT:?}"
        );
    };
    let owner = OwnerId::random().expect("owner");
    assert_eq!(
        left[0], 64,
        "the first release left its record, beside 63 held"
    );
    assert_eq!(left[1], 64, "63 releases left theirs, beside one held");
    assert_eq!(left[2], 0, "the 64th release deleted them all");
    assert_eq!(left[3], 1, "a key released thrice left one record");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let last = LockKey::new(format!("{prefix}last")).expect("key");
    take(&holder, &last, &owner, None).await.expect("free");
    give_back(&holder, &last, &owner).await;
    assert_eq!(
        rows_under(&admin, &schema, &prefix).await,
        0,
        "a release a second after the first record left deletes them"
    );
}

/// A record left by a released lease is never read for a later holder:
/// not while the key is free, not for the same session taking it again
/// (its new record replaces it), not for another instance's lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_left_behind_is_never_read_for_a_later_holder() {
    let schema = ScratchSchema::new("holder");
    let admin = shared_client().await;
    without_names(&admin, &schema).await;
    let holder = connect(schema.options().sessions(1)).await;
    let other = connect(schema.options().sessions(1)).await;
    let reader = connect(schema.options()).await;
    let key = fresh_key("left");
    let owner = OwnerId::random().expect("owner");
    let first = take(&holder, &key, &owner, None).await.expect("free");
    give_back(&holder, &key, &owner).await;
    assert_eq!(rows_under(&admin, &schema, key.as_str()).await, 1, "left");
    assert_eq!(reader.holder(&key).await.expect("read"), None);
    assert!(reader.held(key.as_str()).await.expect("list").is_empty());

    // Another instance takes the key without a record: held, by whom
    // unknown, never by the record left.
    let unrecorded = connect(schema.options().record_holders(false)).await;
    let third = OwnerId::random().expect("owner");
    take(&unrecorded, &key, &third, None).await.expect("free");
    assert_eq!(
        reader.holder(&key).await.expect("read"),
        Some(Holding::new(None, None))
    );
    give_back(&unrecorded, &key, &third).await;

    // Another instance takes it with a record.
    let theirs = take(&other, &key, &owner, None).await.expect("free");
    assert!(theirs > first);
    let seen = reader.holder(&key).await.expect("read").expect("held");
    assert_eq!(seen.token, Some(theirs));
    give_back(&other, &key, &owner).await;

    // The first session takes it again, many times: every read names the
    // lease holding it then.
    for _ in 0..20 {
        let token = take(&holder, &key, &owner, None).await.expect("free");
        let seen = reader.holder(&key).await.expect("read").expect("held");
        assert_eq!(seen.token, Some(token));
        let listed = reader.held(key.as_str()).await.expect("list");
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].1.token, Some(token));
        give_back(&holder, &key, &owner).await;
        assert_eq!(reader.holder(&key).await.expect("read"), None);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_holder_records_off_plain_locks_record_nothing_and_are_not_listed() {
    let schema = ScratchSchema::new("holder");
    let admin = shared_client().await;
    let holder = connect(schema.options().record_holders(false)).await;
    let reader = connect(schema.options()).await;
    let key = fresh_key("unrecorded");
    let lease = LockOptions::new(Duration::from_secs(30))
        .acquire_on(Arc::new(holder.clone()), &key)
        .await
        .expect("free");
    assert_eq!(
        reader.holder(&key).await.expect("read"),
        Some(Holding::new(None, None)),
        "held, by whom unknown"
    );
    assert_eq!(reader.held(key.as_str()).await.expect("list"), Vec::new());
    assert!(!schema.has_relation(&admin, "dlock_holders").await);
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_may_not_create_the_table_gets_an_error_naming_the_privilege_and_the_fix() {
    let mut schema = ScratchSchema::new("holder");
    let admin = shared_client().await;
    let role_conn = schema.role_without_create(&admin).await;
    let backend = PgBackend::connect_with(&role_conn, schema.options())
        .await
        .expect("the role connects");
    let key = fresh_key("no-create");
    let owner = OwnerId::random().expect("owner");
    // Plain locks need no table: they lock, and record nothing, so
    // another instance reads their holder as unknown and lists nothing.
    let reader = connect(schema.options()).await;
    take(&backend, &key, &owner, None).await.expect("free");
    assert!(!schema.has_relation(&admin, "dlock_holders").await);
    assert_eq!(
        reader.holder(&key).await.expect("read"),
        Some(Holding::new(None, None)),
        "held, by whom unknown"
    );
    assert_eq!(reader.held(key.as_str()).await.expect("list"), Vec::new());
    let other = OwnerId::random().expect("owner");
    let refused = backend
        .try_acquire(&AcquireRequest::new(&key, &other, Duration::from_secs(30)))
        .await
        .expect("attempt");
    assert!(matches!(refused, Attempt::Held { .. }), "{refused:?}");
    give_back(&backend, &key, &owner).await;
    let second = fresh_key("no-create");
    take(&backend, &second, &owner, None)
        .await
        .expect("and so does the next one");
    give_back(&backend, &second, &owner).await;

    let err = take(&backend, &key, &owner, Some("node-a"))
        .await
        .expect_err("the role may not create the table");
    let text = err.to_string();
    eprintln!("{text}");
    assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
    let table = format!("\"{}\".dlock_holders", schema.name);
    assert!(
        text.contains(&format!("may not create the table {table}")),
        "{text}"
    );
    assert!(text.contains("CREATE on schema"), "{text}");
    assert!(
        text.contains("CREATE UNLOGGED TABLE IF NOT EXISTS"),
        "{text}"
    );
    assert!(
        text.contains(&format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {table}")),
        "{text}"
    );
    assert!(
        reader_sees_free(&backend, &key).await,
        "the key was not taken"
    );

    // A table without the columns of the holder record: plain locks
    // still work on it, and reading their holder answers "held, by
    // someone unknown" rather than failing on the columns the table lacks.
    let role = schema.role.clone().expect("role");
    admin
        .batch_execute(&format!(
            "CREATE UNLOGGED TABLE {table} (lock_id int8 PRIMARY KEY, key text NOT NULL, \
             token int8 NOT NULL, pid int4 NOT NULL, session_start timestamptz NOT NULL, \
             identity text NOT NULL); GRANT SELECT, INSERT, UPDATE ON {table} TO {role};"
        ))
        .await
        .expect("the DBA creates the table");
    let plain_key = fresh_key("old-shape-plain");
    let plain_owner = OwnerId::random().expect("random");
    take(&backend, &plain_key, &plain_owner, None)
        .await
        .expect("a plain lock on a table without the holder columns");
    let holding = backend
        .holder(&plain_key)
        .await
        .expect("the holder of a plain lock on a table without the holder columns")
        .expect("held");
    assert_eq!(holding.holder, None, "{holding:?}");
    give_back(&backend, &plain_key, &plain_owner).await;

    // With them, a table the role may read but not write is refused with
    // what it lacks.
    admin
        .batch_execute(&format!(
            "ALTER TABLE {table} ADD COLUMN holder text, ADD COLUMN holder_token int8, \
             ADD COLUMN since timestamptz, ALTER COLUMN identity DROP NOT NULL"
        ))
        .await
        .expect("the DBA adds the columns");
    let text = take(&backend, &key, &owner, Some("node-a"))
        .await
        .expect_err("the role may not delete records")
        .to_string();
    assert!(text.contains(&format!("lacks DELETE on {table}")), "{text}");

    // Once the DBA granted what the error named, identities are recorded.
    admin
        .batch_execute(&format!("GRANT DELETE ON {table} TO {role};"))
        .await
        .expect("grant");
    let token = take(&backend, &key, &owner, Some("node-a"))
        .await
        .expect("free");
    let seen = connect(schema.options())
        .await
        .holder(&key)
        .await
        .expect("read")
        .expect("held");
    assert_eq!(
        (seen.token, seen.identity.as_deref()),
        (Some(token), Some("node-a"))
    );
    let own = backend.holder(&key).await.expect("read").expect("held");
    assert_eq!(
        (own.token, own.identity.as_deref()),
        (Some(token), Some("node-a"))
    );
    give_back(&backend, &key, &owner).await;
}

async fn reader_sees_free(backend: &PgBackend, key: &LockKey) -> bool {
    backend.holder(key).await.expect("read").is_none()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_sharing_the_advisory_key_of_a_recorded_one_is_never_read_with_its_identity() {
    let schema = ScratchSchema::new("holder");
    let admin = shared_client().await;
    let (a, b) = colliding_keys(&format!(":{}", random_id()));
    let (a, b) = (LockKey::new(a).expect("key"), LockKey::new(b).expect("key"));
    let hashes: (i64, i64) = {
        let row = admin
            .query_one(
                "SELECT hashtextextended($1::text, 0), hashtextextended($2::text, 0)",
                &[&a.as_str(), &b.as_str()],
            )
            .await
            .expect("hash");
        (row.get(0), row.get(1))
    };
    assert_eq!(hashes.0, hashes.1, "the keys collide");
    // One session, so the second attempt runs where the first holds the
    // advisory key, and PostgreSQL's re-entrant lock says yes to it.
    let holder = connect(schema.options().sessions(1)).await;
    let reader = connect(schema.options()).await;
    let owner = OwnerId::random().expect("owner");
    let token = take(&holder, &a, &owner, Some("owner-of-a"))
        .await
        .expect("free");
    let other = OwnerId::random().expect("owner");
    let attempt = holder
        .try_acquire(
            &AcquireRequest::new(&b, &other, Duration::from_secs(30)).with_identity(Some("b")),
        )
        .await
        .expect("attempt");
    assert!(matches!(attempt, Attempt::Held { .. }), "{attempt:?}");

    let seen = reader.holder(&a).await.expect("read").expect("held");
    assert_eq!(
        (seen.token, seen.identity.as_deref()),
        (Some(token), Some("owner-of-a"))
    );
    assert_eq!(
        reader.holder(&b).await.expect("read"),
        Some(Holding::new(None, None)),
        "held (by the other key), by whom unknown"
    );
    give_back(&holder, &a, &owner).await;
    assert_eq!(reader.holder(&a).await.expect("read"), None);
    assert_eq!(reader.holder(&b).await.expect("read"), None);
}

/// The same collision for plain leases, once the session has seen the
/// second key's advisory key: the backend then tells the lock statement in
/// process that the session holds it already, and nothing is recorded
/// over the holder's record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_colliding_plain_lease_known_in_process_records_nothing() {
    let schema = ScratchSchema::new("holder");
    let admin = shared_client().await;
    without_names(&admin, &schema).await;
    let (a, b) = colliding_keys(&format!(":{}", random_id()));
    let (a, b) = (LockKey::new(a).expect("key"), LockKey::new(b).expect("key"));
    let holder = connect(schema.options().sessions(1)).await;
    let reader = connect(schema.options()).await;
    let owner = OwnerId::random().expect("owner");
    // The session learns `b`'s advisory key.
    take(&holder, &b, &owner, None).await.expect("free");
    give_back(&holder, &b, &owner).await;
    let token = take(&holder, &a, &owner, None).await.expect("free");
    for _ in 0..3 {
        let other = OwnerId::random().expect("owner");
        let attempt = holder
            .try_acquire(&AcquireRequest::new(&b, &other, Duration::from_secs(30)))
            .await
            .expect("attempt");
        assert!(matches!(attempt, Attempt::Held { .. }), "{attempt:?}");
    }
    let seen = reader.holder(&a).await.expect("read").expect("held");
    assert_eq!(seen.token, Some(token));
    assert!(seen.holder.is_some(), "the holder's own record");
    let keys: Vec<String> = admin
        .query(
            &format!(
                "SELECT key FROM {}.dlock_holders WHERE key IN ($1, $2)",
                schema.name
            ),
            &[&a.as_str(), &b.as_str()],
        )
        .await
        .expect("rows")
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(keys, vec![a.as_str().to_owned()], "one row, the holder's");
    give_back(&holder, &a, &owner).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watching_a_free_key_rechecks_only_every_second_and_watching_a_held_one_wakes_on_its_release()
 {
    let schema = ScratchSchema::new("holder");
    let (holder, watcher) = two_instances(&schema).await;
    let admin = shared_client().await;
    let key = fresh_key("watch");

    let free = watcher.watch_holder(&key).await.expect("watch");
    assert_eq!(
        free.recheck(),
        Some(Duration::from_secs(1)),
        "acquisitions are announced: a slow recheck, only for those that were not"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(200), free)
            .await
            .is_err(),
        "nothing happened to the key"
    );

    let owner = OwnerId::random().expect("owner");
    take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect("free");
    let held = watcher.watch_holder(&key).await.expect("watch");
    assert_eq!(held.recheck(), None, "a release is announced");
    let released_at = Instant::now();
    let releasing = {
        let (holder, key) = (holder.clone(), key.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            give_back(&holder, &key, &owner).await;
        })
    };
    within(5, "the notice of the release", held).await;
    assert!(released_at.elapsed() >= Duration::from_millis(100));
    releasing.await.expect("release");
    assert_eq!(watcher.holder(&key).await.expect("read"), None);

    // A holder whose session is ended announces nothing; the server's
    // wait probe hears it all the same.
    let owner = OwnerId::random().expect("owner");
    take(&holder, &key, &owner, Some("node-b"))
        .await
        .expect("free");
    let held = watcher.watch_holder(&key).await.expect("watch");
    let own = holder.watch_holder(&key).await.expect("watch");
    assert_eq!(own.recheck(), None);
    let pid = holding_pid(&admin, &key).await;
    admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .expect("terminate");
    within(5, "the notice of the ended session", held).await;
    within(5, "the holding process's notice", own).await;
    assert_eq!(watcher.holder(&key).await.expect("read"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_on_a_free_key_wakes_when_another_instance_takes_it_with_an_identity() {
    let schema = ScratchSchema::new("holder");
    let (holder, watcher) = two_instances(&schema).await;
    let (key, other_key) = (fresh_key("announced"), fresh_key("announced-other"));

    let mut notice = watcher.watch_holder(&key).await.expect("watch");
    assert_eq!(
        notice.recheck(),
        Some(Duration::from_secs(1)),
        "an acquisition is announced: the reader need not poll"
    );
    // Another key's acquisition is announced too, but not to this watch.
    let other = OwnerId::random().expect("owner");
    take(&holder, &other_key, &other, Some("node-b"))
        .await
        .expect("free");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut notice)
            .await
            .is_err(),
        "nothing happened to the watched key"
    );

    let owner = OwnerId::random().expect("owner");
    let token = take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect("free");
    // The notice itself resolves only on the announcement (its recheck is
    // the reader's timer, not part of it).
    within(3, "the announced acquisition", notice).await;
    let seen = watcher.holder(&key).await.expect("read").expect("held");
    assert_eq!(
        (seen.token, seen.identity.as_deref()),
        (Some(token), Some("node-a")),
        "woken once the record can be read"
    );
    give_back(&holder, &key, &owner).await;
    give_back(&holder, &other_key, &other).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_listening_connection_wakes_its_watches_and_the_next_watch_listens_again() {
    let schema = ScratchSchema::new("holder");
    let holder = connect(schema.options()).await;
    // A name of its own, to find its listening connection by.
    let name = format!("dlock-watcher-{}", random_id());
    let conn = shared_conn();
    let conn = if conn.contains("://") {
        let glue = if conn.contains('?') { '&' } else { '?' };
        format!("{conn}{glue}application_name={name}")
    } else {
        format!("{conn} application_name={name}")
    };
    let watcher = PgBackend::connect_with(&conn, schema.options())
        .await
        .expect("connect");
    let admin = shared_client().await;
    let key = fresh_key("relisten");

    let notice = watcher.watch_holder(&key).await.expect("watch");
    assert_eq!(notice.recheck(), Some(Duration::from_secs(1)));
    let sessions = watcher.session_pids().await;
    let ended: i64 = admin
        .query_one(
            "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity \
             WHERE application_name = $1 AND pid <> ALL($2)",
            &[&name, &sessions],
        )
        .await
        .expect("terminate")
        .get(0);
    assert_eq!(ended, 1, "one listening connection");
    within(3, "the watch on the broken connection", notice).await;

    let notice = watcher.watch_holder(&key).await.expect("watch");
    assert_eq!(
        notice.recheck(),
        Some(Duration::from_secs(1)),
        "listening again"
    );
    let owner = OwnerId::random().expect("owner");
    take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect("free");
    within(3, "the announced acquisition", notice).await;
    give_back(&holder, &key, &owner).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_on_a_free_key_rechecks_when_no_listening_connection_can_be_opened() {
    let mut schema = ScratchSchema::new("holder");
    let admin = shared_client().await;
    let role_conn = schema.role_without_create(&admin).await;
    let role = schema.role.clone().expect("a role");
    // Room for the one lock session, none for a listening connection.
    admin
        .batch_execute(&format!("ALTER ROLE {role} CONNECTION LIMIT 1"))
        .await
        .expect("limit");
    let watcher = PgBackend::connect_with(&role_conn, schema.options().sessions(1))
        .await
        .expect("the role connects");
    let key = fresh_key("unheard");

    let notice = watcher.watch_holder(&key).await.expect("watch");
    assert_eq!(
        notice.recheck(),
        Some(Duration::from_millis(50)),
        "read again on a timer"
    );
    // Well below the 10 s pause before the next try to open one.
    let again = within(
        5,
        "a watch while opening pauses",
        watcher.watch_holder(&key),
    )
    .await
    .expect("watch");
    assert_eq!(again.recheck(), Some(Duration::from_millis(50)));
}

/// A backend that counts the reads of who holds a key and passes every
/// call to the PostgreSQL backend.
struct CountingReads {
    inner: PgBackend,
    holder_reads: AtomicUsize,
}

#[async_trait]
impl Backend for CountingReads {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        self.inner.try_acquire(request).await
    }
    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        self.inner.extend(renewal).await
    }
    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
        self.inner.release(lease).await
    }
    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        self.inner.subscribe(key).await
    }
    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        self.inner.force_release(key).await
    }
    async fn holder(&self, key: &LockKey) -> Result<Option<Holding>, LockError> {
        self.holder_reads.fetch_add(1, Ordering::SeqCst);
        self.inner.holder(key).await
    }
    async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        self.inner.watch_holder(key).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_of_a_vacant_election_does_not_poll_and_hears_the_new_leader() {
    let schema = ScratchSchema::new("holder");
    let (holder, reader) = two_instances(&schema).await;
    let key = fresh_key("vacant");
    let counting = Arc::new(CountingReads {
        inner: reader,
        holder_reads: AtomicUsize::new(0),
    });
    let mut watch = Election::new(key.clone(), "observer", Duration::from_secs(3))
        .expect("election")
        .on(Arc::clone(&counting) as Arc<dyn Backend>)
        .observe()
        .expect("observe");
    assert_eq!(watch.changed().await.expect("read"), None, "vacant");

    let before = counting.holder_reads.load(Ordering::SeqCst);
    let next = tokio::spawn(async move { watch.changed().await });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let reads = counting.holder_reads.load(Ordering::SeqCst) - before;
    // A read a second is the safety net for acquisitions not announced;
    // polling every 50 ms would read about 40 times.
    assert!(
        reads <= 5,
        "{reads} reads of the holder in 2 s of vacancy: the observer polls"
    );

    let leadership = elected(&holder, &key, "node-a").await;
    // Well below the 10 s an observer naps without a notice.
    let leader = within(8, "the observer hearing the new leader", next)
        .await
        .expect("the observer task")
        .expect("read")
        .expect("a leader");
    assert_eq!(
        leader,
        Leader {
            identity: "node-a".to_owned(),
            token: leadership.token(),
        }
    );
    leadership.resign().await.expect("resign");
}

/// An acquisition that was not announced (by a dlock that predates
/// announcements, during a rolling upgrade: its lock and record as that
/// version wrote them, with no `NOTIFY`) reaches an observer of the vacant
/// election by the watch's recheck, within about a second, not at the
/// end of the observer's 10 s nap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquisition_that_was_not_announced_reaches_an_observer_within_the_recheck() {
    let schema = ScratchSchema::new("holder");
    let (holder, reader) = two_instances(&schema).await;
    // The table of records, as any acquisition with an identity makes it.
    let (warm, owner) = (
        fresh_key("unannounced-warm"),
        OwnerId::random().expect("owner"),
    );
    take(&holder, &warm, &owner, Some("warm"))
        .await
        .expect("free");
    give_back(&holder, &warm, &owner).await;
    let key = fresh_key("unannounced");
    let mut watch = observer(&reader, &key).observe().expect("observe");
    assert_eq!(watch.changed().await.expect("read"), None, "vacant");
    let next = tokio::spawn(async move { watch.changed().await });
    tokio::time::sleep(Duration::from_millis(200)).await;

    let older = shared_client().await;
    let advisory_key = holder.advisory_key(&key).await.expect("advisory key");
    older
        .execute(
            &format!(
                "INSERT INTO {s}.dlock_holders (lock_id, key, token, pid, session_start, identity) \
                 SELECT $1::int8, $2::text, 4242, pg_backend_pid(), \
                        (SELECT backend_start FROM pg_stat_get_activity(pg_backend_pid())), \
                        'older-node' \
                 WHERE pg_try_advisory_lock($1::int8)",
                s = schema.name
            ),
            &[&advisory_key, &key.as_str()],
        )
        .await
        .expect("the older dlock takes the key");
    let leader = within(5, "the observer reading the unannounced leader", next)
        .await
        .expect("the observer task")
        .expect("read")
        .expect("a leader");
    assert_eq!(
        leader,
        Leader {
            identity: "older-node".to_owned(),
            token: FencingToken::new(4242),
        }
    );
}

/// Another application's `NOTIFY` whose commit waits for a synchronous
/// standby that is down holds PostgreSQL's one lock of notifying commits
/// for as long. Elections are won all the same (an acquisition announces
/// itself apart, and only tries), an observer of the vacant election
/// reads the new leader by its recheck, and failed announcements hold up
/// the session little: those of a burst of elections go together, so a
/// lock behind them waits for one or two, not one each. A server of its
/// own: the standby setting is the cluster's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn elections_are_won_and_observed_while_another_apps_notify_waits_for_a_standby() {
    let server = OwnServer::start();
    let conn = server.conn(PASSWORD, "");
    let client = || async {
        let (client, connection) =
            dlock::pg::tokio_postgres::connect(&conn, dlock::pg::tokio_postgres::NoTls)
                .await
                .expect("connect");
        tokio::spawn(connection);
        client
    };
    let admin = client().await;
    // One session: the elections and the plain lock below share it.
    let holder = PgBackend::connect_with(&conn, PgOptions::new().sessions(1))
        .await
        .expect("connect");
    let reader = PgBackend::connect_with(&conn, PgOptions::new())
        .await
        .expect("connect");
    // The table of records, made while commits need no standby.
    let (warm, owner) = (fresh_key("standby-warm"), OwnerId::random().expect("owner"));
    take(&holder, &warm, &owner, Some("warm"))
        .await
        .expect("free");
    give_back(&holder, &warm, &owner).await;
    admin
        .batch_execute("CREATE TABLE app_events (x int4)")
        .await
        .expect("the application's table");
    let key = fresh_key("standby");
    let mut watch = observer(&reader, &key).observe().expect("observe");
    assert_eq!(watch.changed().await.expect("read"), None, "vacant");
    let next = tokio::spawn(async move { watch.changed().await });

    admin
        .batch_execute("ALTER SYSTEM SET synchronous_standby_names = 'ghost'")
        .await
        .expect("a standby that never comes");
    admin
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .expect("reload");
    let app = client().await;
    within(5, "the setting reaching the application", async {
        loop {
            let names: String = app
                .query_one("SHOW synchronous_standby_names", &[])
                .await
                .expect("show")
                .get(0);
            if names == "ghost" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    // A durable commit (synchronous_commit on, the default) that notifies:
    // it waits for the standby, holding the lock of notifying commits.
    let stuck = tokio::spawn(async move {
        app.batch_execute("BEGIN; INSERT INTO app_events VALUES (1); NOTIFY app_events; COMMIT")
            .await
    });
    within(
        5,
        "the application's commit waiting for the standby",
        async {
            loop {
                let waiting: i64 = admin
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
                        &[],
                    )
                    .await
                    .expect("activity")
                    .get(0);
                if waiting > 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        },
    )
    .await;

    let leadership = within(5, "the campaign", elected(&holder, &key, "node-a")).await;
    let leader = within(5, "the observer reading the new leader", next)
        .await
        .expect("the observer task")
        .expect("read")
        .expect("a leader");
    assert_eq!(
        leader,
        Leader {
            identity: "node-a".to_owned(),
            token: leadership.token(),
        }
    );

    let mut burst = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let holder = holder.clone();
        burst.spawn(async move {
            let (key, owner) = (
                fresh_key("standby-burst"),
                OwnerId::random().expect("owner"),
            );
            take(&holder, &key, &owner, Some("node-b"))
                .await
                .expect("an election in the burst");
        });
    }
    burst.join_all().await;
    let plain = fresh_key("standby-plain");
    let started = Instant::now();
    take(&holder, &plain, &owner, None).await.expect("free");
    let waited = started.elapsed();
    // Each failed announcement waits 100 ms: fifty in a row would be 5 s.
    assert!(
        waited < Duration::from_millis(4000),
        "a plain lock behind the burst's announcements took {waited:?}"
    );
    assert!(!stuck.is_finished(), "the standby never came");
    leadership.resign().await.expect("resign");
}

/// The holder `reader` reads for `key`, once it is `want`: polled for up
/// to 10 s (a renewal every second writes a lost record again).
async fn read_again_within_10s(reader: &PgBackend, key: &LockKey, want: &Holding) {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let seen = reader.holder(key).await.expect("read");
        if seen.as_ref().map(token_and_identity).as_ref() == Some(want) {
            return;
        }
        assert!(
            Instant::now() < until,
            "still {seen:?} 10 s on, instead of {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A leader elected through the core (which renews every second) on
/// `holder`, read from `reader`.
async fn elected(holder: &PgBackend, key: &LockKey, identity: &str) -> Leadership {
    Election::new(key.clone(), identity, Duration::from_secs(3))
        .expect("election")
        .on(Arc::new(holder.clone()))
        .campaign()
        .await
        .expect("elected")
}

/// A leader elected on `key` through `holder` as `identity`, and the
/// holding `reader` must read for it, checked once.
async fn elected_and_read(
    holder: &PgBackend,
    reader: &PgBackend,
    key: &LockKey,
    identity: &str,
) -> (Leadership, Holding) {
    let leadership = elected(holder, key, identity).await;
    let want = Holding::new(Some(leadership.token()), Some(identity.to_owned()));
    let seen = reader.holder(key).await.expect("read");
    assert_eq!(seen.as_ref().map(token_and_identity), Some(want.clone()));
    (leadership, want)
}

/// A holding as far as its token and identity go (not its holder record,
/// whose time held moves on, nor its time left).
fn token_and_identity(holding: &Holding) -> Holding {
    Holding::new(holding.token, holding.identity.clone())
}

fn observer(reader: &PgBackend, key: &LockKey) -> Election {
    Election::new(key.clone(), "observer", Duration::from_secs(3))
        .expect("election")
        .on(Arc::new(reader.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_holders_table_is_written_again_by_the_next_renewal() {
    let schema = ScratchSchema::new("holder");
    let admin = shared_client().await;
    let (holder, reader) = two_instances(&schema).await;
    let key = fresh_key("truncated");
    let leadership = elected(&holder, &key, "node-a:4711").await;
    let leader = Leader {
        identity: "node-a:4711".into(),
        token: leadership.token(),
    };
    assert_eq!(
        observer(&reader, &key).leader().await.expect("read"),
        Some(leader.clone())
    );

    admin
        .batch_execute(&format!("TRUNCATE {}.dlock_holders", schema.name))
        .await
        .expect("the DBA truncates the table");
    let want = Holding::new(Some(leader.token), Some(leader.identity.clone()));
    read_again_within_10s(&reader, &key, &want).await;
    assert_eq!(
        observer(&reader, &key).leader().await.expect("read"),
        Some(leader.clone()),
        "observers see the leader again"
    );

    // A row deleted, or changed to name someone else, is written again too.
    admin
        .batch_execute(&format!(
            "UPDATE {}.dlock_holders SET identity = 'impostor', token = token + 1",
            schema.name
        ))
        .await
        .expect("the DBA rewrites the row");
    read_again_within_10s(&reader, &key, &want).await;
    assert!(!leadership.is_lost(), "the term went on throughout");
    leadership.resign().await.expect("resign");
    assert_eq!(reader.holder(&key).await.expect("read"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_holders_table_is_created_again_and_written_by_the_renewals() {
    let schema = ScratchSchema::new("holder");
    let admin = shared_client().await;
    let (holder, reader) = two_instances(&schema).await;
    let key = fresh_key("dropped");
    let (leadership, want) = elected_and_read(&holder, &reader, &key, "node-a").await;

    admin
        .batch_execute(&format!("DROP TABLE {}.dlock_holders", schema.name))
        .await
        .expect("the DBA drops the table");
    read_again_within_10s(&reader, &key, &want).await;
    assert!(schema.has_relation(&admin, "dlock_holders").await);
    assert!(!leadership.is_lost(), "no renewal failed for the record");

    // The next election on the same backend records as before, and the
    // resignation deletes the record with the recreated table's statements.
    let other = fresh_key("dropped-next");
    let next = elected(&holder, &other, "node-b").await;
    assert_eq!(
        observer(&reader, &other).leader().await.expect("read"),
        Some(Leader {
            identity: "node-b".into(),
            token: next.token()
        })
    );
    next.resign().await.expect("resign");
    leadership.resign().await.expect("resign");
    assert_eq!(reader.holder(&key).await.expect("read"), None);
    let left: i64 = admin
        .query_one(
            &format!("SELECT count(*) FROM {}.dlock_holders", schema.name),
            &[],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(left, 0, "every resignation deleted its record");
}

/// A resignation whose record's delete a revoked DELETE refuses names the
/// GRANT to run and ends no other election on the session; so too on a
/// connection that logs parameters on error
/// (`log_parameter_max_length_on_error`), whose refusal's context lists
/// them and is no trigger's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resignation_without_delete_names_the_grant_and_the_other_elections_live_on() {
    for logged in [false, true] {
        let mut schema = ScratchSchema::new("holder");
        let admin = shared_client().await;
        let role_conn = schema.role_without_create(&admin).await;
        let role = schema.role.clone().expect("role");
        let table = format!("\"{}\".dlock_holders", schema.name);
        admin
            .batch_execute(&format!(
                "CREATE UNLOGGED TABLE {table} (lock_id int8 PRIMARY KEY, key text NOT NULL, \
                 token int8 NOT NULL, pid int4 NOT NULL, session_start timestamptz NOT NULL, \
                 identity text, holder text, holder_token int8, since timestamptz); \
                 GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role};"
            ))
            .await
            .expect("the DBA creates the table");
        // Logging parameters on error gives the refusal a context that lists
        // them, which is no trigger's.
        let role_conn = match logged {
            true => format!("{role_conn} options='-c log_parameter_max_length_on_error=-1'"),
            false => role_conn,
        };
        // One session: both elections are held on it.
        let holder = PgBackend::connect_with(&role_conn, schema.options().sessions(1))
            .await
            .expect("the role connects");
        let reader = connect(schema.options()).await;
        let (first, second) = (fresh_key("resign-first"), fresh_key("resign-second"));
        let resigning = elected(&holder, &first, "node-a").await;
        let staying = elected(&holder, &second, "node-a").await;

        admin
            .batch_execute(&format!("REVOKE DELETE ON {table} FROM {role};"))
            .await
            .expect("the DBA revokes DELETE");
        let err = resigning
            .resign()
            .await
            .expect_err("the record cannot be deleted");
        let text = err.to_string();
        eprintln!("{text}");
        assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
        assert!(text.contains(&format!("lacks DELETE on {table}")), "{text}");
        assert!(
            text.contains(&format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role};"
            )),
            "{text}"
        );
        assert_eq!(
            reader.holder(&first).await.expect("read"),
            None,
            "the lock was dropped all the same"
        );

        // The other election on the same session lives on, renewed and read.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!staying.is_lost(), "{:?}", staying.check());
        assert_eq!(
            observer(&reader, &second).leader().await.expect("read"),
            Some(Leader {
                identity: "node-a".into(),
                token: staying.token()
            })
        );

        // The record left behind is never read: the key taken again without
        // an identity reads as held by someone unknown, not by "node-a".
        let owner = OwnerId::random().expect("owner");
        take(&holder, &first, &owner, None).await.expect("free");
        assert_eq!(
            reader.holder(&first).await.expect("read"),
            Some(Holding::new(None, None))
        );
        give_back(&holder, &first, &owner).await;

        // Until the grant is made, identity acquisitions are refused with it.
        let text = take(&holder, &first, &owner, Some("node-a"))
            .await
            .expect_err("the role may not delete records")
            .to_string();
        assert!(text.contains(&format!("lacks DELETE on {table}")), "{text}");
        admin
            .batch_execute(&format!("GRANT DELETE ON {table} TO {role};"))
            .await
            .expect("grant");
        staying.resign().await.expect("resign");
    }
}

/// A DBA holds a lock on the table of identity records that every write
/// waits for (an ALTER TABLE, a VACUUM FULL, a TRUNCATE: ACCESS EXCLUSIVE)
/// for 4 s. The leader's session and advisory lock live throughout, so its
/// term must too, although its record cannot be checked meanwhile; and
/// other leases on the same session are served as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dba_lock_on_the_holders_table_does_not_depose_a_leader() {
    let schema = ScratchSchema::new("holder");
    // One session: the leader and the plain locks below share it.
    let backend = Arc::new(connect(schema.options().sessions(1)).await);
    let key = fresh_key("dba-lock");
    // A ttl of 3 s: a plain acquisition that finds the table locked waits
    // the session's lock_timeout (1 s) once before it locks without a
    // record, and the leader's renewals on the same session queue behind
    // it; 1.5 s left a loaded machine no room for a renewal between.
    let leadership = Election::new(key.clone(), "node-a", Duration::from_secs(3))
        .expect("election")
        .on(backend.clone())
        .campaign()
        .await
        .expect("elected");

    let dba = shared_client().await;
    dba.batch_execute(&format!(
        "BEGIN; LOCK TABLE {}.dlock_holders IN ACCESS EXCLUSIVE MODE",
        schema.name
    ))
    .await
    .expect("the DBA locks the table");
    let locked_until = Instant::now() + Duration::from_secs(4);
    let mut plain = 0;
    while Instant::now() < locked_until {
        let other = fresh_key("dba-lock-plain");
        // A hang guard, not a bound: the first acquisition waits the
        // lock_timeout for the table, then undoes what its statement may
        // have taken (two round trips) and locks without a record, and
        // each of these statements may queue behind one of the leader's
        // renewals on the session, which waits the lock_timeout as well.
        within(15, "a plain acquire and release on the session", async {
            LockOptions::new(Duration::from_secs(10))
                .acquire_on(backend.clone(), other.as_str())
                .await
                .expect("plain lock")
                .release()
                .await
                .expect("release");
        })
        .await;
        plain += 1;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    dba.batch_execute("ROLLBACK")
        .await
        .expect("the DBA lets go");

    assert!(plain > 0);
    assert!(
        !leadership.is_lost(),
        "the term ended though its lock lived: {:?}",
        leadership.check()
    );
    // And its record is there for other instances to read.
    let reader = connect(schema.options()).await;
    let want = Holding::new(Some(leadership.token()), Some("node-a".to_owned()));
    read_again_within_10s(&reader, &key, &want).await;
    leadership.resign().await.expect("resign");
}

/// A DBA's TRUNCATE of the table of identity records, in a transaction
/// that goes on for 1.5 s: every renewal meanwhile waits for the table in
/// vain, and the first one after the commit writes the record again, so
/// the leader reads as unknown for about one renewal interval (1 s) after
/// the commit, not for a pause of 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_truncate_hides_the_leader_for_about_one_renewal_interval_after_it_commits() {
    let schema = ScratchSchema::new("holder");
    let admin = shared_client().await;
    let (holder, reader) = two_instances(&schema).await;
    let key = fresh_key("slow-truncate");
    let (leadership, want) = elected_and_read(&holder, &reader, &key, "node-a").await;

    admin
        .batch_execute(&format!(
            "BEGIN; TRUNCATE {}.dlock_holders; SELECT pg_sleep(1.5); COMMIT",
            schema.name
        ))
        .await
        .expect("the DBA truncates the table, slowly");
    let committed = Instant::now();
    loop {
        let seen = reader.holder(&key).await.expect("read");
        if seen.as_ref().map(token_and_identity).as_ref() == Some(&want) {
            break;
        }
        assert!(
            committed.elapsed() < Duration::from_secs(5),
            "still {seen:?} 5 s after the truncation committed (a renewal a second)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!leadership.is_lost(), "the term went on throughout");
    leadership.resign().await.expect("resign");
}

/// An acquisition with an identity that waits too long for a lock says
/// what it waited for: the key's record, which another transaction holds
/// (a SELECT … FOR UPDATE left open), or else what it may be, without
/// blaming the sequence and the table alone. The key is not left taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_acquisition_that_waits_too_long_for_a_lock_says_what_it_waited_for() {
    let schema = ScratchSchema::new("holder");
    // A statement waits at most half the liveness interval for a lock.
    let holder = connect(schema.options().liveness_interval(Duration::from_secs(1))).await;
    let reader = connect(schema.options()).await;
    let owner = OwnerId::random().expect("owner");
    let key = fresh_key("record-locked");
    // The record a session that died left behind.
    take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect("free");
    give_back(&holder, &key, &owner).await;
    let advisory_key = holder.advisory_key(&key).await.expect("advisory key");
    let dba = shared_client().await;
    dba.execute(
        &format!(
            "INSERT INTO {}.dlock_holders VALUES ($1, $2, 1, 0, now(), 'gone')",
            schema.name
        ),
        &[&advisory_key, &key.as_str()],
    )
    .await
    .expect("a record left behind");

    dba.batch_execute(&format!(
        "BEGIN; SELECT FROM {}.dlock_holders WHERE lock_id = {advisory_key} FOR UPDATE",
        schema.name
    ))
    .await
    .expect("the DBA locks the record");
    let text = take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect_err("the record is locked")
        .to_string();
    eprintln!("{text}");
    assert!(
        text.contains(&format!("the identity record of `{key}`")),
        "{text}"
    );
    dba.batch_execute("ROLLBACK").await.expect("rollback");
    assert_eq!(reader.holder(&key).await.expect("read"), None, "not taken");

    dba.batch_execute(&format!(
        "BEGIN; LOCK TABLE {}.dlock_holders IN ACCESS EXCLUSIVE MODE",
        schema.name
    ))
    .await
    .expect("the DBA locks the table");
    let text = take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect_err("the table is locked")
        .to_string();
    eprintln!("{text}");
    assert!(
        text.contains("or another lock the statement needed"),
        "{text}"
    );
    dba.batch_execute("ROLLBACK").await.expect("rollback");
    assert_eq!(reader.holder(&key).await.expect("read"), None, "not taken");

    take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect("free once the DBA let go");
    give_back(&holder, &key, &owner).await;
}

/// A record written again after a truncation carries the key and the
/// identity as they were, whatever characters they hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_written_again_keeps_its_key_and_identity_as_they_were() {
    let schema = ScratchSchema::new("holder");
    let admin = shared_client().await;
    let (holder, reader) = two_instances(&schema).await;
    let key = fresh_key("quote'\"\\ ünï 🦀 $1 {rows}");
    let identity = "node 'ä'; \\x00 -- \"🦀\"";
    let (leadership, want) = elected_and_read(&holder, &reader, &key, identity).await;

    admin
        .batch_execute(&format!("TRUNCATE {}.dlock_holders", schema.name))
        .await
        .expect("the DBA truncates the table");
    read_again_within_10s(&reader, &key, &want).await;
    let written: String = admin
        .query_one(
            &format!("SELECT key FROM {}.dlock_holders", schema.name),
            &[],
        )
        .await
        .expect("the record")
        .get(0);
    assert_eq!(written, key.as_str());
    leadership.resign().await.expect("resign");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backends_label_wins_over_the_processes_and_a_bad_one_fails_the_connect() {
    let schema = ScratchSchema::new("holder");
    let labelled = connect(schema.options().label("billing")).await;
    let (plain, reader) = two_instances(&schema).await;
    for (backend, want) in [(&labelled, "billing"), (&plain, "from-the-process")] {
        let key = fresh_key("label");
        let owner = OwnerId::random().expect("owner");
        let request = AcquireRequest::new(&key, &owner, Duration::from_secs(30))
            .with_label(Some("from-the-process"));
        let Attempt::Acquired(grant) = backend.try_acquire(&request).await.expect("attempt") else {
            panic!("`{key}` must be free");
        };
        let seen = reader.holder(&key).await.expect("read").expect("held");
        assert_eq!(seen.token, Some(grant.token));
        let info = seen.holder.expect("recorded");
        assert_eq!(info.label.as_deref(), Some(want));
        let held_for = info.held_for.expect("the server's time of acquisition");
        assert!(held_for < Duration::from_secs(30), "{held_for:?}");
        give_back(backend, &key, &owner).await;
    }

    for bad in ["", "tab\there", &"x".repeat(65)] {
        let err = PgBackend::connect_with(&shared_conn(), schema.options().label(bad))
            .await
            .expect_err("a bad label is refused");
        assert!(
            matches!(
                err,
                LockError::InvalidOption {
                    option: "label",
                    ..
                }
            ),
            "{bad:?}: {err:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_takes_like_wildcards_and_backslashes_in_the_prefix_as_data() {
    let schema = ScratchSchema::new("holder");
    let (holder, reader) = two_instances(&schema).await;
    let base = format!("dlock-test:like:{}", random_id());
    let prefix = format!("{base}:50%_off\\:");
    let under = [format!("{prefix}b"), format!("{prefix}a%")];
    let lookalikes = [
        format!("{base}:50xyoff\\:a"),
        format!("{base}:50%_off\\x"),
        format!("{base}:50%_off\\"),
        format!("{base}:50%Xoff\\:a"),
    ];
    let options = LockOptions::new(Duration::from_secs(30));
    let mut leases = Vec::new();
    for name in under.iter().chain(&lookalikes) {
        let key = LockKey::new(name.clone()).expect("valid key");
        leases.push(
            options
                .acquire_on(Arc::new(holder.clone()), key)
                .await
                .expect("free"),
        );
    }
    let listed: Vec<String> = reader
        .held(&prefix)
        .await
        .expect("list")
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    let mut want = under.to_vec();
    want.sort();
    assert_eq!(listed, want);
    assert_eq!(
        reader.held(&format!("{base}:")).await.expect("list").len(),
        under.len() + lookalikes.len(),
        "a plain prefix lists them all"
    );
    for lease in leases {
        lease.release().await.expect("release");
    }
}

/// A leader that resigns while a DBA holds the table of records locked
/// past the session's lock_timeout drops its lock without its record (the
/// session deletes it later), and the session lives on: a plain lease on
/// it is not lost. The release used to end the session on the lock
/// timeout, which lost every other lease on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_while_a_dba_locks_the_table_ends_no_session() {
    let schema = ScratchSchema::new("holder");
    let backend = Arc::new(connect(schema.options().sessions(1)).await);
    let plain = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), fresh_key("dba-release-plain").as_str())
        .await
        .expect("plain lock");
    let key = fresh_key("dba-release");
    let owner = OwnerId::random().expect("random");
    take(&backend, &key, &owner, Some("node-a"))
        .await
        .expect("an identity lease");

    let dba = shared_client().await;
    dba.batch_execute(&format!(
        "BEGIN; LOCK TABLE {}.dlock_holders IN ACCESS EXCLUSIVE MODE",
        schema.name
    ))
    .await
    .expect("the DBA locks the table");
    let outcome = within(10, "the release under the DBA's lock", async {
        backend.release(&ReleaseRequest::new(&key, &owner)).await
    })
    .await;
    dba.batch_execute("ROLLBACK")
        .await
        .expect("the DBA lets go");

    assert_eq!(outcome.expect("release"), ReleaseOutcome::Released);
    assert!(
        freed_on_the_server(&dba, &key).await,
        "the identity lease's lock was dropped"
    );
    assert!(
        !plain.is_lost(),
        "a plain lease on the same session was lost: {:?}",
        plain.check()
    );
    let reader = connect(schema.options()).await;
    assert_eq!(
        reader.holder(&key).await.expect("holder"),
        None,
        "the record left behind names nobody"
    );
    plain.release().await.expect("release");
}

/// A recording lock statement that fails on its way (here, on the key's
/// record, which a DBA holds `FOR UPDATE` past `lock_timeout`) leaves its
/// session holding nothing: it takes the session lock as its last step. A
/// session that kept the lock until the backend undid it would, meanwhile,
/// hold the key under the record of a lease it had released (its own, not
/// yet deleted), which `show` would name and a force release naming that
/// released lease would end the session for, with every lease on it. The
/// same statement, let through, leaves the lock held by the session.
#[tokio::test]
async fn a_recording_lock_statement_that_fails_on_a_locked_record_leaves_its_session_holding_nothing()
 {
    let schema = ScratchSchema::new("undo");
    let key = fresh_key("failed-statement");
    // The backend creates the schema's objects (the table of records with
    // the first lease that has an identity).
    let backend = connect(schema.options()).await;
    let owner = OwnerId::random().expect("owner");
    take(&backend, &key, &owner, Some("node-a"))
        .await
        .expect("free");
    give_back(&backend, &key, &owner).await;
    let statement = dlock::pg::protocol::TRY_LOCK_RECORDING
        .replace("{schema}", &format!("\"{}\"", schema.name));
    let session = shared_client().await;
    session
        .batch_execute("SET lock_timeout = '200ms'")
        .await
        .expect("set lock_timeout");
    let started: std::time::SystemTime = session
        .query_one(
            "SELECT backend_start FROM pg_stat_get_activity(pg_backend_pid())",
            &[],
        )
        .await
        .expect("session start")
        .get(0);
    let advisory_locks = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
                          AND objsubid = 1 AND pid = pg_backend_pid()";
    let lock = || async {
        let params: [&(dyn dlock::pg::tokio_postgres::types::ToSql + Sync); 6] = [
            &key.as_str(),
            &0_i64,
            &None::<&str>,
            &started,
            &"holder",
            &false,
        ];
        session.query_one(statement.as_str(), &params).await
    };

    // An earlier lease's record of the key, as its session leaves it.
    let dba = shared_client().await;
    dba.execute(
        &format!(
            "INSERT INTO {}.dlock_holders (lock_id, key, token, pid, session_start) \
             VALUES (hashtextextended($1, 0), $1, 1, pg_backend_pid(), now())",
            schema.name
        ),
        &[&key.as_str()],
    )
    .await
    .expect("a record left behind");
    dba.batch_execute(&format!(
        "BEGIN; SELECT FROM {}.dlock_holders WHERE key = '{key}' FOR UPDATE",
        schema.name
    ))
    .await
    .expect("the DBA locks the record");
    let err = lock().await.expect_err("the record is locked");
    assert_eq!(
        err.code(),
        Some(&dlock::pg::tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE),
        "{err}"
    );
    let held: i64 = session
        .query_one(advisory_locks, &[])
        .await
        .expect("read pg_locks")
        .get(0);
    assert_eq!(
        held, 0,
        "the failed statement left its session holding the key"
    );

    dba.batch_execute("ROLLBACK").await.expect("rollback");
    let token: Option<i64> = lock().await.expect("the record is free").get(1);
    assert!(token.is_some(), "the key is free");
    let held: i64 = session
        .query_one(advisory_locks, &[])
        .await
        .expect("read pg_locks")
        .get(0);
    assert_eq!(held, 1, "the statement that went through holds the key");
}

/// Whether any session holds `key`'s advisory lock, by the lock table.
async fn held_on_the_server(admin: &dlock::pg::tokio_postgres::Client, key: &LockKey) -> bool {
    admin
        .query_one(
            "SELECT EXISTS (SELECT FROM pg_locks AS l, \
                            (SELECT hashtextextended($1::text, 0) AS h) AS k \
             WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock' \
               AND l.classid::int8 = ((k.h >> 32) & 4294967295) \
               AND l.objid::int8 = (k.h & 4294967295) AND l.objsubid = 1)",
            &[&key.as_str()],
        )
        .await
        .expect("read pg_locks")
        .get(0)
}

/// Whether `key`'s advisory lock is held by no session, or by none within
/// 5 s: a failed lock statement's transaction lock goes with the failed
/// transaction, after the server sent the error (see
/// `pg_support::freed_on_the_server`).
async fn released_on_the_server(admin: &dlock::pg::tokio_postgres::Client, key: &LockKey) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while held_on_the_server(admin, key).await {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// What a DBA hangs on the table of holder records, each of it run after
/// the lock statement's last step (the session lock) or keeping its write
/// from being done.
#[derive(Clone, Copy, Debug)]
enum Trigger {
    /// An `AFTER` row trigger that raises this error code.
    Raises(&'static str),
    /// A constraint trigger that raises at commit.
    RaisesAtCommit,
    /// An `AFTER` row trigger that writes to a table that is not there
    /// (42P01, the code of dlock's own objects gone).
    WritesToAMissingTable,
    /// A `BEFORE UPDATE` trigger that skips the update: no error, no write.
    SkipsUpdates,
    /// A `BEFORE` trigger that skips every insert, update and delete.
    SkipsWrites,
    /// A trigger that raises on delete, `AFTER` it (and the unlock beside
    /// it) or `BEFORE`.
    RaisesOnDelete { after: bool },
    /// A rule that does nothing instead of a delete, which the server
    /// refuses for a `DELETE … RETURNING`.
    RuleKeepsDeletes,
    /// A `BEFORE UPDATE` trigger that keeps the row as it was
    /// (`RETURN OLD`): no error, and the old row returned.
    KeepsOldRows,
    /// A `BEFORE` trigger that blanks the time of every row written.
    BlanksSince,
    /// A `BEFORE INSERT` trigger that moves each new row to another
    /// `lock_id` (a DBA "fixing" the ids).
    MovesRows,
    /// A `BEFORE UPDATE` trigger that keeps a row's identity and holder as
    /// they were.
    KeepsIdentity,
}

impl Trigger {
    async fn add(self, admin: &dlock::pg::tokio_postgres::Client, schema: &str) {
        let (trigger, body) = match self {
            Trigger::Raises(code) => (
                "TRIGGER audit AFTER INSERT OR UPDATE".to_owned(),
                format!("RAISE EXCEPTION 'audit table unavailable' USING ERRCODE = '{code}';"),
            ),
            Trigger::RaisesAtCommit => (
                "CONSTRAINT TRIGGER audit AFTER INSERT OR UPDATE".to_owned(),
                "RAISE EXCEPTION 'audit table unavailable';".to_owned(),
            ),
            Trigger::WritesToAMissingTable => (
                "TRIGGER audit AFTER INSERT OR UPDATE".to_owned(),
                format!("INSERT INTO {schema}.audit_log VALUES (NEW.key); RETURN NULL;"),
            ),
            Trigger::SkipsUpdates => (
                "TRIGGER audit BEFORE UPDATE".to_owned(),
                "RETURN NULL;".to_owned(),
            ),
            Trigger::SkipsWrites => (
                "TRIGGER audit BEFORE INSERT OR UPDATE OR DELETE".to_owned(),
                "RETURN NULL;".to_owned(),
            ),
            Trigger::KeepsOldRows => (
                "TRIGGER audit BEFORE UPDATE".to_owned(),
                "RETURN OLD;".to_owned(),
            ),
            Trigger::BlanksSince => (
                "TRIGGER audit BEFORE INSERT OR UPDATE".to_owned(),
                "NEW.since := NULL; RETURN NEW;".to_owned(),
            ),
            Trigger::MovesRows => (
                "TRIGGER audit BEFORE INSERT".to_owned(),
                "NEW.lock_id := NEW.lock_id # 1; RETURN NEW;".to_owned(),
            ),
            Trigger::KeepsIdentity => (
                "TRIGGER audit BEFORE UPDATE".to_owned(),
                "NEW.identity := COALESCE(OLD.identity, NEW.identity); \
                 NEW.holder := COALESCE(OLD.holder, NEW.holder); RETURN NEW;"
                    .to_owned(),
            ),
            Trigger::RaisesOnDelete { after } => (
                format!(
                    "TRIGGER audit {} DELETE",
                    if after { "AFTER" } else { "BEFORE" }
                ),
                "RAISE EXCEPTION 'audit table unavailable';".to_owned(),
            ),
            Trigger::RuleKeepsDeletes => {
                admin
                    .batch_execute(&format!(
                        "CREATE RULE keep AS ON DELETE TO {schema}.dlock_holders DO INSTEAD NOTHING"
                    ))
                    .await
                    .expect("the DBA adds a rule");
                return;
            }
        };
        let deferred = if matches!(self, Trigger::RaisesAtCommit) {
            "DEFERRABLE INITIALLY DEFERRED"
        } else {
            ""
        };
        admin
            .batch_execute(&format!(
                "CREATE FUNCTION {schema}.audit() RETURNS trigger LANGUAGE plpgsql AS \
                 $$BEGIN {body} END$$; \
                 CREATE {trigger} ON {schema}.dlock_holders {deferred} \
                 FOR EACH ROW EXECUTE FUNCTION {schema}.audit()"
            ))
            .await
            .expect("the DBA adds a trigger");
    }
}

/// A backend of one session (`sessions(1)`) on `schema`, holding a
/// bystander lease with an identity: whatever happens to a key the test
/// tries there must not cost the session, so the bystander lives on.
async fn one_session_with_a_bystander(options: PgOptions) -> (PgBackend, (LockKey, OwnerId)) {
    let holder = connect(options.sessions(1)).await;
    let bystander = (fresh_key("bystander"), OwnerId::random().expect("owner"));
    take(&holder, &bystander.0, &bystander.1, Some("bystander"))
        .await
        .expect("free");
    (holder, bystander)
}

/// Asserts every one of `leases` on `holder` still renews.
async fn assert_renew(holder: &PgBackend, leases: &[(&LockKey, &OwnerId)], case: &str) {
    for (key, owner) in leases {
        let renewed = holder
            .extend(&Renewal::new(key, owner, Duration::from_secs(30)))
            .await;
        assert!(
            matches!(renewed, Ok(true)),
            "{case}: the lease of {key} on the session: {renewed:?}"
        );
    }
}

/// A lock statement that a DBA's trigger fails after its last step (an
/// `AFTER` trigger, a deferred constraint trigger at commit: both run
/// after the session lock was taken), or whose record it skips, leaves
/// the key free: the backend unlocks what the statement took, whatever
/// the error says (a trigger's lock timeout is no draw's, its missing
/// table is no missing dlock object). A lease without an identity, which
/// then takes the key without its record, gets it, and lets it go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_statement_failed_by_a_trigger_after_its_last_step_leaves_the_key_free() {
    for trigger in [
        Trigger::Raises("P0001"),
        Trigger::RaisesAtCommit,
        Trigger::Raises("55P03"),
        Trigger::WritesToAMissingTable,
        Trigger::SkipsUpdates,
    ] {
        let schema = ScratchSchema::new("trigger");
        let admin = shared_client().await;
        without_names(&admin, &schema).await;
        let (holder, other) = two_instances(&schema).await;
        let key = fresh_key("trigger");
        let owner = OwnerId::random().expect("owner");
        // A record of the key, for the trigger that skips updates to skip.
        take(&holder, &key, &owner, None).await.expect("free");
        give_back(&holder, &key, &owner).await;
        trigger.add(&admin, &schema.name).await;

        let err = take(&holder, &key, &owner, Some("node-a"))
            .await
            .expect_err("the trigger fails the statement");
        assert!(
            released_on_the_server(&admin, &key).await,
            "{trigger:?}: the failed statement ({err}) left the key held"
        );
        take(&holder, &key, &owner, None)
            .await
            .expect("a lease without an identity takes the key without its record");
        give_back(&holder, &key, &owner).await;
        assert!(
            released_on_the_server(&admin, &key).await,
            "{trigger:?}: released, yet the key is held"
        );
        let other_owner = OwnerId::random().expect("owner");
        take(&other, &key, &other_owner, None)
            .await
            .expect("free for another process");
        give_back(&other, &key, &other_owner).await;
    }
}

/// The case a DBA's trigger made of the force release: a session that let
/// go of a lease (its record waits for the batch delete) tries the key
/// again, and the trigger fails the statement after its last step, or
/// skips its record. The key is never read with the released lease's
/// record, a force release naming that lease ends nothing, and the other
/// lease on the session lives on; so too once a lease without an identity
/// has taken the key without its record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_failed_by_a_trigger_is_never_read_or_force_released_as_the_released_lease() {
    for trigger in [
        Trigger::Raises("P0001"),
        Trigger::WritesToAMissingTable,
        Trigger::SkipsUpdates,
    ] {
        let schema = ScratchSchema::new("trigger");
        let admin = shared_client().await;
        without_names(&admin, &schema).await;
        let (holder, bystander) = one_session_with_a_bystander(schema.options()).await;
        let operator = connect(schema.options()).await;
        let (key, owner) = (fresh_key("shown"), OwnerId::random().expect("owner"));
        let released = take(&holder, &key, &owner, None).await.expect("free");
        give_back(&holder, &key, &owner).await;
        trigger.add(&admin, &schema.name).await;
        take(&holder, &key, &owner, Some("node-a"))
            .await
            .expect_err("the trigger fails the statement");
        let shown = operator.holder(&key).await.expect("read");
        assert_eq!(shown, None, "{trigger:?}: the key is read as held");
        let plain = take(&holder, &key, &owner, None)
            .await
            .expect("taken without its record");
        let shown = operator.holder(&key).await.expect("read");
        assert!(
            shown.as_ref().and_then(|h| h.token) != Some(released),
            "{trigger:?}: the lease {plain:?} is read with the released lease's record: {shown:?}"
        );

        let forced = operator
            .force_release_holding(&key, &Holding::new(Some(released), None))
            .await;
        assert!(
            !matches!(forced, Ok(dlock::backend::ForceRelease::Released)),
            "{trigger:?}: a force release naming the released lease answered {forced:?}"
        );
        let case = format!("{trigger:?}");
        assert_renew(
            &holder,
            &[(&bystander.0, &bystander.1), (&key, &owner)],
            &case,
        )
        .await;
        give_back(&holder, &key, &owner).await;
    }
}

/// A DBA's trigger that keeps the old row of a key (`RETURN OLD`), moves
/// a new row to another `lock_id`, or blanks the time of a row written,
/// never has a lease read with another lease's record: a lock statement
/// counts its record written only when the row holds what it wrote. A lease with an identity is
/// read with its own token or refused; one without is read with its own
/// or as unknown; a force release naming the released lease ends nothing,
/// and every lease of the session lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_that_keeps_old_rows_or_blanks_their_time_never_shows_another_leases_record() {
    for trigger in [
        Trigger::KeepsOldRows,
        Trigger::BlanksSince,
        Trigger::MovesRows,
    ] {
        let schema = ScratchSchema::new("trigger");
        let admin = shared_client().await;
        without_names(&admin, &schema).await;
        let (holder, bystander) = one_session_with_a_bystander(schema.options()).await;
        let operator = connect(schema.options()).await;
        let (key, owner) = (fresh_key("kept-row"), OwnerId::random().expect("owner"));
        let released = take(&holder, &key, &owner, None).await.expect("free");
        give_back(&holder, &key, &owner).await;
        trigger.add(&admin, &schema.name).await;

        let shown_as = |shown: Option<Holding>| shown.and_then(|h| h.token);
        if let Ok(taken) = take(&holder, &key, &owner, Some("node-a")).await {
            let shown = shown_as(operator.holder(&key).await.expect("read"));
            assert_eq!(
                shown,
                Some(taken),
                "{trigger:?}: the lease with an identity"
            );
            give_back(&holder, &key, &owner).await;
        }
        let plain = take(&holder, &key, &owner, None)
            .await
            .expect("a lease without an identity is taken");
        let shown = shown_as(operator.holder(&key).await.expect("read"));
        assert!(
            shown.is_none() || shown == Some(plain),
            "{trigger:?}: the lease {plain} is read with another lease's record: {shown:?} \
             (the released one was {released})"
        );
        let forced = operator
            .force_release_holding(&key, &Holding::new(Some(released), None))
            .await;
        assert!(
            !matches!(forced, Ok(dlock::backend::ForceRelease::Released)),
            "{trigger:?}: a force release naming the released lease answered {forced:?}"
        );
        let case = format!("{trigger:?}");
        let leases = [(&bystander.0, &bystander.1), (&key, &owner)];
        assert_renew(&holder, &leases, &case).await;
        give_back(&holder, &key, &owner).await;
    }
}

/// A DBA's trigger that keeps a record's identity as it was never has a
/// new holder read with a dead one's identity: a holder whose session died
/// left its record, the next holder's write keeps the old identity, and
/// the lock statement, finding its record not as it wrote it, refuses the
/// lease with an identity rather than have it read as the dead holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trigger_that_keeps_an_old_identity_never_shows_it_for_a_new_holder() {
    let schema = ScratchSchema::new("trigger");
    let admin = shared_client().await;
    let (dead, next) = two_instances(&schema).await;
    let reader = connect(schema.options()).await;
    let key = fresh_key("kept-identity");
    take(
        &dead,
        &key,
        &OwnerId::random().expect("owner"),
        Some("node-a"),
    )
    .await
    .expect("free");
    let pid: i32 = admin
        .query_one(
            "SELECT l.pid FROM pg_locks AS l, \
                    (SELECT hashtextextended($1::text, 0) AS h) AS k \
             WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock' \
               AND l.classid::int8 = ((k.h >> 32) & 4294967295) \
               AND l.objid::int8 = (k.h & 4294967295) AND l.objsubid = 1",
            &[&key.as_str()],
        )
        .await
        .expect("the holder's session")
        .get(0);
    admin
        .execute("SELECT pg_terminate_backend($1, 5000)", &[&pid])
        .await
        .expect("its session ends");
    Trigger::KeepsIdentity.add(&admin, &schema.name).await;

    let taken = take(
        &next,
        &key,
        &OwnerId::random().expect("owner"),
        Some("node-b"),
    )
    .await;
    let shown = reader.holder(&key).await.expect("read");
    assert!(
        shown.as_ref().and_then(|h| h.identity.as_deref()) != Some("node-a"),
        "the new holder ({taken:?}) is read as the dead one: {shown:?}"
    );
}

/// A recording lock statement that fails after its last step, sent right
/// behind a plain lock statement of a key with the same 64-bit hash on the
/// same session, never leaves the hash held once its leases are gone: the
/// backend cannot tell which of the two holds it took, so it ends the
/// session rather than keep a hold nobody owns.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_recording_lock_behind_a_colliding_plain_one_leaves_nothing_held() {
    let schema = ScratchSchema::new("trigger");
    // Leases without an identity go plain, those with one record.
    let backend = connect(schema.options().sessions(1).record_holders(false)).await;
    let admin = shared_client().await;
    let (a, b) = colliding_keys(&format!(":{}", random_id()));
    let (a, b) = (
        LockKey::new(a).expect("a key"),
        LockKey::new(b).expect("a key"),
    );
    // The session learns b's advisory key, so it tells the statement
    // whether it holds it.
    let owner = OwnerId::random().expect("owner");
    take(&backend, &b, &owner, Some("ok")).await.expect("free");
    give_back(&backend, &b, &owner).await;
    admin
        .batch_execute(&format!(
            "CREATE FUNCTION {s}.validate() RETURNS trigger LANGUAGE plpgsql AS \
             $$BEGIN IF NEW.identity = 'refused' THEN RAISE EXCEPTION 'identity refused'; \
             END IF; RETURN NULL; END$$; \
             CREATE TRIGGER validate AFTER INSERT OR UPDATE ON {s}.dlock_holders \
             FOR EACH ROW EXECUTE FUNCTION {s}.validate()",
            s = schema.name
        ))
        .await
        .expect("the DBA adds a trigger");
    for round in 0..5 {
        let (plain_owner, owner) = (
            OwnerId::random().expect("owner"),
            OwnerId::random().expect("owner"),
        );
        let plain = {
            let (backend, a) = (backend.clone(), a.clone());
            tokio::spawn(async move {
                backend
                    .try_acquire(&AcquireRequest::new(
                        &a,
                        &plain_owner,
                        Duration::from_secs(30),
                    ))
                    .await
            })
        };
        tokio::task::yield_now().await;
        let refused = backend
            .try_acquire(
                &AcquireRequest::new(&b, &owner, Duration::from_secs(30))
                    .with_identity(Some("refused")),
            )
            .await;
        // Refused by the trigger, or held by the plain lease.
        assert!(
            !matches!(refused, Ok(Attempt::Acquired(_))),
            "round {round}: {refused:?}"
        );
        if let Ok(Attempt::Acquired(_)) = plain.await.expect("task") {
            // Released, or lost with its session: either way let go.
            let _ = backend
                .release(&ReleaseRequest::new(&a, &plain_owner))
                .await;
        }
        // A release of the plain lease may still be on its way.
        assert!(
            released_on_the_server(&admin, &a).await,
            "round {round}: the hash stays held with no lease of it left"
        );
    }
}

/// A lock statement that fails without saying whether it took the lock
/// (it waited past the session's `lock_timeout` for a DBA's lock on the
/// table of records) never drops the fresh hold of a plain lock statement
/// of a colliding key sent behind it on the same session, whose caller has
/// not read the answer yet: that lease, once told held, holds the key on
/// the server, or is told it is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_lock_never_drops_the_unclaimed_hold_of_a_colliding_statement_behind_it() {
    failed_lock_ahead_of_a_colliding_statement(true).await;
}

/// As above, for a colliding key the session has never taken: whether two
/// keys collide is known before either statement is sent, however many
/// other keys the session took in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_lock_never_drops_the_hold_of_a_colliding_key_new_to_the_session() {
    failed_lock_ahead_of_a_colliding_statement(false).await;
}

/// A lock statement of `b`, failing past the session's `lock_timeout` at a
/// point its error does not name, with a plain statement of `a` (a key of
/// the same advisory key, taken on the session before if `a_seen`) sent
/// behind it.
async fn failed_lock_ahead_of_a_colliding_statement(a_seen: bool) {
    let schema = ScratchSchema::new("collide");
    // A lock_timeout of 5 s: the statement ahead waits that long.
    let options = schema.options().sessions(1).record_holders(false);
    let options = options.server_idle_timeout(None);
    let backend = connect(options.liveness_interval(Duration::from_secs(10))).await;
    let (a, b) = colliding_keys(&format!(":{}", random_id()));
    let (a, b) = (
        LockKey::new(a).expect("a key"),
        LockKey::new(b).expect("a key"),
    );
    // b's lease, with an identity, makes the table of records.
    let earlier = [(&a, None), (&b, Some("node-b"))];
    for (key, identity) in earlier.into_iter().filter(|(key, _)| a_seen || *key == &b) {
        let owner = OwnerId::random().expect("owner");
        take(&backend, key, &owner, identity).await.expect("free");
        give_back(&backend, key, &owner).await;
    }
    let dba = lock_the_table_of_records(&schema).await;
    let recording = spawn_recording(&backend, &b);
    let admin = shared_client().await;
    wait_for_the_table_lock(&admin, &schema, &recording).await;
    let plain_owner = OwnerId::random().expect("owner");
    let request = AcquireRequest::new(&a, &plain_owner, Duration::from_secs(30));
    let mut plain = std::pin::pin!(backend.try_acquire(&request));
    // Sent behind the waiting statement, then not read until that one
    // failed and was undone.
    tokio::select! {
        answer = &mut plain => panic!("answered before the statement ahead of it: {answer:?}"),
        () = tokio::time::sleep(Duration::from_millis(300)) => {}
    }
    let refused = recording.await.expect("task");
    assert!(
        !matches!(refused, Ok(Attempt::Acquired(_))),
        "the table was locked: {refused:?}"
    );
    dba.batch_execute("ROLLBACK").await.expect("rollback");
    if let Ok(Attempt::Acquired(grant)) = plain.await {
        // Not held, then its session ended, and the lease hears so.
        if !held_on_the_server(&admin, &a).await {
            let loss = grant.loss.expect("a lease lost with its session");
            let what = format!("`{a}` is told held and is not held on the server: its loss");
            within(10, &what, async {
                while !loss.is_ended() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await;
        }
        let _ = backend
            .release(&ReleaseRequest::new(&a, &plain_owner))
            .await;
    }
}

/// A failed lock statement's undo never drops the hold of a permit on the
/// same session whose slot has the statement's advisory key: the permit
/// holds its slot on the server, or its lease is told it is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_lock_never_drops_a_permit_whose_slot_has_its_advisory_key() {
    let schema = ScratchSchema::new("collide");
    // A lock_timeout of 5 s: the failing statement waits that long.
    let options = schema.options().sessions(1).record_holders(false);
    let options = options.server_idle_timeout(None);
    let backend = connect(options.liveness_interval(Duration::from_secs(10))).await;
    let (x, k) = key_colliding_with_a_permit(&format!(":{}", random_id()));
    let x = LockKey::new(x).expect("a key");
    let slot = LockKey::new(format!("dlock-permit:0:{k}")).expect("a key");
    let k = LockKey::new(k).expect("a key");
    let admin = shared_client().await;
    let same: bool = admin
        .query_one(
            "SELECT hashtextextended($1::text, 0) = hashtextextended($2::text, 0)",
            &[&x.as_str(), &slot.as_str()],
        )
        .await
        .expect("hash")
        .get(0);
    assert!(same, "`{x}` and `{slot}` collide");
    // x's lease, with an identity, makes the table of records.
    let owner = OwnerId::random().expect("owner");
    take(&backend, &x, &owner, Some("node-x"))
        .await
        .expect("free");
    give_back(&backend, &x, &owner).await;
    let permit_owner = OwnerId::random().expect("owner");
    let request = AcquireRequest::new(&k, &permit_owner, Duration::from_secs(30))
        .with_access(Access::Permits { permits: 1 });
    let Attempt::Acquired(permit) = backend.try_acquire(&request).await.expect("a permit") else {
        panic!("`{k}` should be free");
    };
    assert!(held_on_the_server(&admin, &slot).await, "the permit's slot");
    let dba = lock_the_table_of_records(&schema).await;
    let request =
        AcquireRequest::new(&x, &owner, Duration::from_secs(30)).with_identity(Some("node-x"));
    let refused = backend.try_acquire(&request).await;
    assert!(
        !matches!(refused, Ok(Attempt::Acquired(_))),
        "the table was locked: {refused:?}"
    );
    dba.batch_execute("ROLLBACK").await.expect("rollback");
    if !held_on_the_server(&admin, &slot).await {
        let loss = permit.loss.expect("a permit lost with its session");
        within(
            10,
            "the permit's slot is not held on the server: its loss",
            async {
                while !loss.is_ended() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        )
        .await;
    }
    let release =
        ReleaseRequest::new(&k, &permit_owner).holding(Access::Permits { permits: 1 }, Some(0));
    let _ = backend.release(&release).await;
}

/// On a database whose encoding is not UTF-8, a key's advisory key is the
/// server's, never the one dlock would compute from the key's UTF-8 bytes:
/// `é-…` is free while `Ã©-…`, whose LATIN1 bytes are the UTF-8 bytes of
/// `é-…`, is held on the same session.
#[tokio::test]
async fn on_a_latin1_database_keys_map_to_the_servers_advisory_keys() {
    on_a_latin1_database(|backend| async move {
        let id = random_id();
        let held = LockKey::new(format!("Ã©-{id}")).expect("a key");
        let other = LockKey::new(format!("é-{id}")).expect("a key");
        let (first, second) = (
            OwnerId::random().expect("owner"),
            OwnerId::random().expect("owner"),
        );
        take(&backend, &held, &first, None).await.expect("free");
        take(&backend, &other, &second, None)
            .await
            .expect("another advisory key on the server");
        give_back(&backend, &other, &second).await;
        give_back(&backend, &held, &first).await;
    })
    .await;
}

/// On a database whose encoding lacks a character of a key, an attempt of
/// that key (exclusive, shared or a permit) fails with the server's error
/// and takes nothing, and the session it was sent on lives on with every
/// other lease on it.
#[tokio::test]
async fn a_key_the_servers_encoding_lacks_fails_alone_and_keeps_the_session() {
    on_a_latin1_database(|backend| async move {
        let id = random_id();
        let bystander = LockKey::new(format!("bystander-{id}")).expect("a key");
        let owner = OwnerId::random().expect("owner");
        let request = AcquireRequest::new(&bystander, &owner, Duration::from_secs(60));
        let Attempt::Acquired(grant) = backend.try_acquire(&request).await.expect("free") else {
            panic!("`{bystander}` should be free");
        };
        let loss = grant.loss.expect("a lease lost with its session");
        let lacking = LockKey::new(format!("键-{id}")).expect("a key");
        for access in [
            Access::Exclusive,
            Access::Shared,
            Access::Permits { permits: 2 },
        ] {
            let owner = OwnerId::random().expect("owner");
            let request =
                AcquireRequest::new(&lacking, &owner, Duration::from_secs(60)).with_access(access);
            let answer = backend.try_acquire(&request).await;
            assert!(
                matches!(answer, Err(LockError::Backend { .. })),
                "{access:?}: {answer:?}"
            );
            assert!(
                !loss.is_ended(),
                "{access:?}: the bystander's session ended"
            );
        }
        give_back(&backend, &bystander, &owner).await;
    })
    .await;
}

/// On a LATIN1 database a permit of a key outside ASCII, whose slots'
/// advisory keys only the server knows, still counts its slot on its
/// session: a colliding key is held while the permit is, and the permit is
/// held while a lease of the colliding key is.
#[tokio::test]
async fn on_a_latin1_database_a_permit_outside_ascii_and_a_colliding_key_exclude_each_other() {
    on_a_latin1_database(|backend| async move {
        // Collide with an ASCII suffix, then end both in one character
        // that is one byte in LATIN1: the server's hashes still agree.
        let (x, k) = key_colliding_with_a_permit(&format!(":{}Z", random_id()));
        let outside = |key: &str| LockKey::new(format!("{}é", &key[..key.len() - 1])).expect("key");
        let (x, k) = (outside(&x), outside(&k));
        let (lease, permit_owner) = (
            OwnerId::random().expect("owner"),
            OwnerId::random().expect("owner"),
        );
        let one = Access::Permits { permits: 1 };
        let permit =
            AcquireRequest::new(&k, &permit_owner, Duration::from_secs(30)).with_access(one);
        take(&backend, &x, &lease, None).await.expect("free");
        let answer = backend.try_acquire(&permit).await;
        assert!(
            matches!(answer, Ok(Attempt::Held { .. })),
            "beside `{x}`: {answer:?}"
        );
        give_back(&backend, &x, &lease).await;
        let answer = backend.try_acquire(&permit).await;
        assert!(matches!(answer, Ok(Attempt::Acquired(_))), "{answer:?}");
        let request = AcquireRequest::new(&x, &lease, Duration::from_secs(30));
        let answer = backend.try_acquire(&request).await;
        assert!(
            matches!(answer, Ok(Attempt::Held { .. })),
            "beside the permit: {answer:?}"
        );
        let release = ReleaseRequest::new(&k, &permit_owner).holding(one, Some(0));
        backend.release(&release).await.expect("release the permit");
    })
    .await;
}

/// A permit and a key colliding with its slot, attempted at once on one
/// session without holder records (nothing reads `pg_locks` for them), are
/// never both granted: whichever claims the advisory key first keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_and_a_colliding_key_raced_on_one_session_are_never_both_granted() {
    let schema = ScratchSchema::new("collide");
    let backend = Arc::new(connect(schema.options().sessions(1).record_holders(false)).await);
    let one = Access::Permits { permits: 1 };
    for round in 0..200 {
        let (x, k) = key_colliding_with_a_permit(&format!(":{}", random_id()));
        let (x, k) = (
            LockKey::new(x).expect("a key"),
            LockKey::new(k).expect("a key"),
        );
        let (permit_owner, lease) = (
            OwnerId::random().expect("owner"),
            OwnerId::random().expect("owner"),
        );
        let permit = {
            let (backend, k) = (Arc::clone(&backend), k.clone());
            tokio::spawn(async move {
                let request = AcquireRequest::new(&k, &permit_owner, Duration::from_secs(30))
                    .with_access(one);
                backend.try_acquire(&request).await
            })
        };
        tokio::task::yield_now().await;
        let plain = {
            let (backend, x) = (Arc::clone(&backend), x.clone());
            tokio::spawn(async move {
                backend
                    .try_acquire(&AcquireRequest::new(&x, &lease, Duration::from_secs(30)))
                    .await
            })
        };
        let permit = matches!(permit.await.expect("task"), Ok(Attempt::Acquired(_)));
        let plain = matches!(plain.await.expect("task"), Ok(Attempt::Acquired(_)));
        assert!(!(permit && plain), "round {round}: both granted");
        if permit {
            let release = ReleaseRequest::new(&k, &permit_owner).holding(one, Some(0));
            backend.release(&release).await.expect("release the permit");
        }
        if plain {
            give_back(&backend, &x, &lease).await;
        }
    }
}

/// Runs `test` with a backend of one lock session on a new LATIN1
/// database of the shared server, dropped afterwards.
async fn on_a_latin1_database<F, T>(test: F)
where
    F: FnOnce(PgBackend) -> T + Send + 'static,
    T: std::future::Future<Output = ()> + Send,
{
    let admin = shared_client().await;
    let db = format!("dlock_latin1_{}", random_id());
    admin
        .batch_execute(&format!(
            "CREATE DATABASE {db} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' \
             TEMPLATE template0"
        ))
        .await
        .expect("create a LATIN1 database");
    let conn = pg_support::conn_to(&db);
    let outcome = tokio::spawn(async move {
        let backend = PgBackend::connect_with(&conn, PgOptions::new().sessions(1))
            .await
            .expect("connect to the LATIN1 database");
        test(backend).await;
    })
    .await;
    admin
        .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .await
        .expect("drop the database");
    if let Err(err) = outcome {
        std::panic::resume_unwind(err.into_panic());
    }
}

/// A key with the advisory key of a permit slot held on the same session is
/// held there, as it is for another process, with or without holder
/// records: never granted beside the permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_colliding_with_a_permit_held_on_its_session_is_held() {
    let schema = ScratchSchema::new("collide");
    for record in [true, false] {
        let backend = connect(schema.options().sessions(1).record_holders(record)).await;
        let (x, k) = key_colliding_with_a_permit(&format!(":{}", random_id()));
        let (x, k) = (
            LockKey::new(x).expect("a key"),
            LockKey::new(k).expect("a key"),
        );
        // The table of records, made.
        let (warm, owner) = (fresh_key("warm"), OwnerId::random().expect("owner"));
        take(&backend, &warm, &owner, Some("warm"))
            .await
            .expect("free");
        give_back(&backend, &warm, &owner).await;
        let permit = Access::Permits { permits: 1 };
        let request = AcquireRequest::new(&k, &owner, Duration::from_secs(30)).with_access(permit);
        let Attempt::Acquired(_grant) = backend.try_acquire(&request).await.expect("a permit")
        else {
            panic!("`{k}` should be free");
        };
        for identity in [Some("node-x"), None] {
            let other = OwnerId::random().expect("owner");
            let request =
                AcquireRequest::new(&x, &other, Duration::from_secs(30)).with_identity(identity);
            let answer = backend.try_acquire(&request).await;
            assert!(
                matches!(answer, Ok(Attempt::Held { .. })),
                "records {record}, identity {identity:?}: {answer:?}"
            );
        }
        let release = ReleaseRequest::new(&k, &owner).holding(permit, Some(0));
        backend.release(&release).await.expect("release the permit");
    }
}

/// A permit never takes a slot whose advisory key a lease holds on the
/// same session (the server would grant it again, re-entrant): it takes
/// another slot, or is held when there is none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_never_takes_a_slot_whose_advisory_key_a_lease_holds_on_its_session() {
    let schema = ScratchSchema::new("collide");
    let backend = connect(schema.options().sessions(1)).await;
    let (x, k) = key_colliding_with_a_permit(&format!(":{}", random_id()));
    let (x, k) = (
        LockKey::new(x).expect("a key"),
        LockKey::new(k).expect("a key"),
    );
    let owner = OwnerId::random().expect("owner");
    take(&backend, &x, &owner, None).await.expect("free");
    let one = Access::Permits { permits: 1 };
    let request = AcquireRequest::new(&k, &owner, Duration::from_secs(30)).with_access(one);
    let answer = backend.try_acquire(&request).await;
    assert!(matches!(answer, Ok(Attempt::Held { .. })), "{answer:?}");
    let two = Access::Permits { permits: 2 };
    let request = AcquireRequest::new(&k, &owner, Duration::from_secs(30)).with_access(two);
    let Ok(Attempt::Acquired(grant)) = backend.try_acquire(&request).await else {
        panic!("`{k}` has a free slot");
    };
    assert_eq!(grant.slot, Some(1), "slot 0 has the advisory key of `{x}`");
    let release = ReleaseRequest::new(&k, &owner).holding(two, Some(1));
    backend.release(&release).await.expect("release the permit");
    give_back(&backend, &x, &owner).await;
}

/// A failed lock statement's undo keeps the session, and every lease on it,
/// while a permit statement of another key, none of whose slots has its
/// advisory key, waits for its answer on the same session.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_undo_keeps_the_session_while_a_permit_of_another_key_is_in_flight() {
    let schema = ScratchSchema::new("collide");
    // A lock_timeout of 5 s: the failing statement waits that long.
    let options = schema.options().sessions(1).record_holders(false);
    let options = options.server_idle_timeout(None);
    let backend = connect(options.liveness_interval(Duration::from_secs(10))).await;
    let permit = Access::Permits { permits: 3 };
    // The table of records made, the permit statement prepared.
    let (warm, owner) = (fresh_key("warm"), OwnerId::random().expect("owner"));
    take(&backend, &warm, &owner, Some("warm"))
        .await
        .expect("free");
    give_back(&backend, &warm, &owner).await;
    let p = fresh_key("permit");
    let request = AcquireRequest::new(&p, &owner, Duration::from_secs(30)).with_access(permit);
    assert!(matches!(
        backend.try_acquire(&request).await,
        Ok(Attempt::Acquired(_))
    ));
    let release = ReleaseRequest::new(&p, &owner).holding(permit, Some(0));
    backend.release(&release).await.expect("release the permit");
    let (bystander, bystander_owner) = (fresh_key("bystander"), OwnerId::random().expect("owner"));
    let request = AcquireRequest::new(&bystander, &bystander_owner, Duration::from_secs(60));
    let Attempt::Acquired(grant) = backend.try_acquire(&request).await.expect("free") else {
        panic!("`{bystander}` should be free");
    };
    let loss = grant.loss.expect("a lease lost with its session");
    let dba = lock_the_table_of_records(&schema).await;
    let b = fresh_key("b");
    let recording = spawn_recording(&backend, &b);
    let admin = shared_client().await;
    wait_for_the_table_lock(&admin, &schema, &recording).await;
    let permit_owner = OwnerId::random().expect("owner");
    let request =
        AcquireRequest::new(&p, &permit_owner, Duration::from_secs(30)).with_access(permit);
    let mut permit_attempt = std::pin::pin!(backend.try_acquire(&request));
    // Sent behind the waiting statement, then not read until that one
    // failed and was undone.
    tokio::select! {
        answer = &mut permit_attempt => panic!("answered before the statement ahead of it: {answer:?}"),
        () = tokio::time::sleep(Duration::from_millis(300)) => {}
    }
    let refused = recording.await.expect("task");
    assert!(
        !matches!(refused, Ok(Attempt::Acquired(_))),
        "the table was locked: {refused:?}"
    );
    dba.batch_execute("ROLLBACK").await.expect("rollback");
    let answer = permit_attempt.await;
    assert!(matches!(answer, Ok(Attempt::Acquired(_))), "{answer:?}");
    assert!(!loss.is_ended(), "the bystander's session ended");
    give_back(&backend, &bystander, &bystander_owner).await;
}

/// A permit of a free key is granted while a failed lock statement's undo
/// of an unrelated advisory key waits on the same session (for the key's
/// release gate, which another session holds): it queues behind the
/// undo, never answered held for a key nobody holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_free_permit_is_granted_while_an_undo_of_another_key_waits() {
    let schema = ScratchSchema::new("collide");
    let options = schema.options().sessions(1).server_idle_timeout(None);
    let backend = connect(options.liveness_interval(Duration::from_secs(10))).await;
    let admin = shared_client().await;
    let (warm, owner) = (fresh_key("warm"), OwnerId::random().expect("owner"));
    take(&backend, &warm, &owner, Some("warm"))
        .await
        .expect("free");
    give_back(&backend, &warm, &owner).await;
    // The functions of permits made, their statement prepared: the attempt
    // below sends nothing else.
    let p = fresh_key("permit");
    let permit = Access::Permits { permits: 3 };
    let request = AcquireRequest::new(&p, &owner, Duration::from_secs(30)).with_access(permit);
    assert!(matches!(
        backend.try_acquire(&request).await,
        Ok(Attempt::Acquired(_))
    ));
    let release = ReleaseRequest::new(&p, &owner).holding(permit, Some(0));
    backend.release(&release).await.expect("release the permit");
    let b = fresh_key("b");
    let gate = shared_client().await;
    gate.query_one(
        "SELECT pg_advisory_lock((~(h >> 32))::int4, (~((h << 32) >> 32))::int4) \
         FROM (SELECT hashtextextended($1::text, 0) AS h) AS k",
        &[&b.as_str()],
    )
    .await
    .expect("take the key's release gate");
    let dba = lock_the_table_of_records(&schema).await;
    let recording = spawn_recording(&backend, &b);
    // The statement fails after the session's lock_timeout; its undo's
    // unlock then waits for the gate, as long again.
    within(30, "the undo waits for the gate", async {
        while !admin
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' \
                 AND NOT granted AND objsubid = 2)",
                &[],
            )
            .await
            .expect("read pg_locks")
            .get::<_, bool>(0)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let permit_owner = OwnerId::random().expect("owner");
    let request =
        AcquireRequest::new(&p, &permit_owner, Duration::from_secs(30)).with_access(permit);
    let answer = backend.try_acquire(&request).await;
    assert!(matches!(answer, Ok(Attempt::Acquired(_))), "{answer:?}");
    let release = ReleaseRequest::new(&p, &permit_owner).holding(permit, Some(0));
    backend.release(&release).await.expect("release the permit");
    let _ = recording.await.expect("task");
    dba.batch_execute("ROLLBACK").await.expect("rollback");
}

/// Spawns an acquisition of `key` with an identity (its lock statement
/// records the holder) on `backend`.
fn spawn_recording(
    backend: &PgBackend,
    key: &LockKey,
) -> tokio::task::JoinHandle<Result<Attempt, LockError>> {
    let (backend, key) = (backend.clone(), key.clone());
    tokio::spawn(async move {
        let owner = OwnerId::random().expect("owner");
        let request = AcquireRequest::new(&key, &owner, Duration::from_secs(30))
            .with_identity(Some("node-b"));
        backend.try_acquire(&request).await
    })
}

/// Waits until `recording`'s statement waits for the table of records a
/// DBA locked (or it is over already, on a machine slow enough to spend
/// the lock timeout here).
async fn wait_for_the_table_lock<T>(
    admin: &dlock::pg::tokio_postgres::Client,
    schema: &ScratchSchema,
    recording: &tokio::task::JoinHandle<T>,
) {
    let waiting = format!(
        "SELECT EXISTS (SELECT FROM pg_locks WHERE NOT granted \
         AND relation = '{}.dlock_holders'::regclass)",
        schema.name
    );
    within(30, "the recording statement waits", async {
        while !recording.is_finished()
            && !admin
                .query_one(&waiting, &[])
                .await
                .expect("read pg_locks")
                .get::<_, bool>(0)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// A client that has locked `schema`'s table of holder records in an open
/// transaction, as a DBA's `LOCK TABLE` would.
async fn lock_the_table_of_records(schema: &ScratchSchema) -> dlock::pg::tokio_postgres::Client {
    let dba = shared_client().await;
    dba.batch_execute(&format!("BEGIN; LOCK TABLE {}.dlock_holders", schema.name))
        .await
        .expect("the DBA locks the table");
    dba
}

/// A lock statement whose commit waits for a lock past the session's
/// `lock_timeout` after its last step (a DBA's deferred unique constraint
/// checked against a row another transaction writes: no function named in
/// the error) leaves the key free, whether the lease has an identity (it
/// fails) or not (it is taken without its record, and its release frees
/// the key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_whose_commit_waits_past_the_lock_timeout_leaves_the_key_free() {
    let schema = ScratchSchema::new("trigger");
    let (holder, bystander) = one_session_with_a_bystander(schema.options()).await;
    let admin = shared_client().await;
    let blocker = shared_client().await;
    admin
        .batch_execute(&format!(
            "ALTER TABLE {}.dlock_holders ADD CONSTRAINT one_row_per_key UNIQUE (key) \
             DEFERRABLE INITIALLY DEFERRED",
            schema.name
        ))
        .await
        .expect("the DBA adds a deferred constraint");
    for identity in [Some("node-a"), None] {
        let (key, owner) = (fresh_key("commit-wait"), OwnerId::random().expect("owner"));
        // Another transaction writes a row of the key and stays open: the
        // commit's check of the constraint waits for it.
        blocker
            .batch_execute(&format!(
                "BEGIN; INSERT INTO {}.dlock_holders (lock_id, key, token, pid, session_start) \
                 VALUES (-42, '{key}', 1, 1, now())",
                schema.name
            ))
            .await
            .expect("the other transaction");
        let taken = take(&holder, &key, &owner, identity).await;
        blocker.batch_execute("ROLLBACK").await.expect("rollback");
        match (identity, &taken) {
            (Some(_), Err(_)) => {}
            (None, Ok(_)) => give_back(&holder, &key, &owner).await,
            _ => panic!("{identity:?}: the acquisition answered {taken:?}"),
        }
        assert!(
            released_on_the_server(&admin, &key).await,
            "{identity:?}: the key is held after {taken:?}"
        );
    }
    assert_renew(&holder, &[(&bystander.0, &bystander.1)], "commit wait").await;
}

/// A failed lock statement's undo lets go of the key without its release
/// gate when another session holds the gate (any client can take that
/// pair of numbers), as a release does, rather than end the session and
/// every lease on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_undo_of_a_failed_lock_behind_a_gate_held_elsewhere_keeps_the_session() {
    let schema = ScratchSchema::new("trigger");
    let (holder, bystander) =
        one_session_with_a_bystander(schema.options().liveness_interval(Duration::from_secs(1)))
            .await;
    let admin = shared_client().await;
    let (key, owner) = (fresh_key("gated-undo"), OwnerId::random().expect("owner"));
    Trigger::Raises("P0001").add(&admin, &schema.name).await;
    let gate = shared_client().await;
    gate.query_one(
        "SELECT pg_advisory_lock((~(h >> 32))::int4, (~((h << 32) >> 32))::int4) \
         FROM (SELECT hashtextextended($1::text, 0) AS h) AS k",
        &[&key.as_str()],
    )
    .await
    .expect("take the key's release gate");
    take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect_err("the trigger fails the statement");
    assert!(
        released_on_the_server(&admin, &key).await,
        "the failed statement left the key held"
    );
    assert_renew(&holder, &[(&bystander.0, &bystander.1)], "gated undo").await;
    drop(gate);
}

/// A lock statement whose answer the backend cannot read (a DBA changed
/// the type of a column of the table of records) fails a lease with an
/// identity, and what it took goes back: the key is free. A lease without
/// one is taken without its record, as when the table is unusable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_statement_whose_answer_cannot_be_read_gives_back_what_it_took() {
    let schema = ScratchSchema::new("answer");
    let (holder, other) = two_instances(&schema).await;
    let admin = shared_client().await;
    let key = fresh_key("unreadable");
    let owner = OwnerId::random().expect("owner");
    take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect("free");
    give_back(&holder, &key, &owner).await;
    admin
        .batch_execute(&format!(
            "ALTER TABLE {}.dlock_holders ALTER COLUMN since TYPE text",
            schema.name
        ))
        .await
        .expect("the DBA changes a column's type");

    let err = take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect_err("the answer cannot be read");
    assert!(err.to_string().contains("unexpected answer"), "{err}");
    assert!(
        released_on_the_server(&admin, &key).await,
        "the failed acquisition ({err}) left the key held"
    );
    let other_owner = OwnerId::random().expect("owner");
    take(&other, &key, &other_owner, None)
        .await
        .expect("free for another process, taken without its record");
    give_back(&other, &key, &other_owner).await;
}

/// A lock statement whose answer cannot be read may have written its
/// record, and a delete a DBA's trigger refuses keeps it: the session that
/// wrote it takes no lease of the key without a record, so a lease
/// without an identity goes on another session, and a force release
/// naming the token of the record left ends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_left_by_an_unreadable_answer_is_never_read_for_a_later_lease() {
    let schema = ScratchSchema::new("answer");
    let operator = connect(schema.options()).await;
    let admin = shared_client().await;
    let key = fresh_key("unreadable-left");
    let owner = OwnerId::random().expect("owner");
    take(&operator, &key, &owner, Some("node-a"))
        .await
        .expect("free");
    give_back(&operator, &key, &owner).await;
    admin
        .batch_execute(&format!(
            "ALTER TABLE {}.dlock_holders ALTER COLUMN since TYPE text",
            schema.name
        ))
        .await
        .expect("the DBA changes a column's type");
    Trigger::RaisesOnDelete { after: false }
        .add(&admin, &schema.name)
        .await;
    // A session that prepares its statements after the change.
    let holder = connect(schema.options().sessions(1)).await;

    let err = take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect_err("the answer cannot be read");
    assert!(err.to_string().contains("unexpected answer"), "{err}");
    let taken = take(&holder, &key, &owner, None)
        .await
        .expect("taken without its record");
    let left: i64 = admin
        .query_one(
            &format!(
                "SELECT token FROM {}.dlock_holders WHERE key = $1",
                schema.name
            ),
            &[&key.as_str()],
        )
        .await
        .expect("the record the unreadable answers left")
        .get(0);
    let left = FencingToken::new(u64::try_from(left).expect("a token is positive"));
    assert_ne!(left, taken, "the record left is an unreadable lease's");
    let forced = operator
        .force_release_holding(&key, &Holding::new(Some(left), None))
        .await;
    assert!(
        !matches!(forced, Ok(dlock::backend::ForceRelease::Released)),
        "a force release naming the record left answered {forced:?}"
    );
    assert_renew(&holder, &[(&key, &owner)], "unreadable answer").await;
}

/// A release whose record's delete a DBA's trigger skips without an error
/// leaves the record naming the session: the session then takes no lease
/// without a record (another session takes it), so the key is never read
/// with the released lease's record, a force release naming that lease
/// ends nothing, and the other lease on the session lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_whose_delete_a_trigger_skips_is_never_read_for_a_later_lease() {
    let schema = ScratchSchema::new("trigger");
    let (holder, bystander) = one_session_with_a_bystander(schema.options()).await;
    let operator = connect(schema.options()).await;
    let admin = shared_client().await;
    let (key, owner) = (
        fresh_key("skipped-delete"),
        OwnerId::random().expect("owner"),
    );
    let released = take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect("free");
    Trigger::SkipsWrites.add(&admin, &schema.name).await;
    give_back(&holder, &key, &owner).await;
    assert!(released_on_the_server(&admin, &key).await, "released");
    take(&holder, &key, &owner, None)
        .await
        .expect("taken without its record");

    let shown = operator.holder(&key).await.expect("read");
    assert!(
        shown.as_ref().and_then(|h| h.token) != Some(released),
        "the key is read with the released lease's record: {shown:?}"
    );
    let forced = operator
        .force_release_holding(&key, &Holding::new(Some(released), None))
        .await;
    assert!(
        !matches!(forced, Ok(dlock::backend::ForceRelease::Released)),
        "a force release naming the released lease answered {forced:?}"
    );
    let leases = [(&bystander.0, &bystander.1), (&key, &owner)];
    assert_renew(&holder, &leases, "skipped delete").await;
    give_back(&holder, &key, &owner).await;
}

/// A server that writes its messages in German (an operator's
/// `lc_messages`) tells a DBA's trigger by the error's context alike: a
/// lock statement its trigger fails after the lock (with a code the draw
/// itself raises) leaves the key free, and a release whose record's delete
/// it refuses lets go of the key and ends no session. The backend told a
/// trigger by the English words of the context, and otherwise kept the
/// key (taken to be refused before the lock) or ended the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_server_speaking_german_a_trigger_is_told_by_its_context() {
    let server = pg_support::OwnServer::start_speaking("de", "Division durch Null");
    let conn = server.conn(pg_support::PASSWORD, "sslmode=disable");
    let admin = pg_support::client_of(&conn).await;
    let schema = "dlock_german";
    let holder = PgBackend::connect_with(&conn, PgOptions::new().schema(schema).sessions(1))
        .await
        .expect("connect");
    let bystander = (fresh_key("bystander"), OwnerId::random().expect("owner"));
    take(&holder, &bystander.0, &bystander.1, Some("bystander"))
        .await
        .expect("free");
    let (key, owner) = (fresh_key("german"), OwnerId::random().expect("owner"));

    // The sequence's MAXVALUE code, raised by a trigger after the lock.
    Trigger::Raises("2200H").add(&admin, schema).await;
    let err = take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect_err("the trigger fails the statement");
    assert!(
        released_on_the_server(&admin, &key).await,
        "the failed statement ({err}) left the key held"
    );
    assert!(
        !err.to_string().contains("MAXVALUE"),
        "the trigger's code read as the sequence's: {err}"
    );
    admin
        .batch_execute(&format!("DROP FUNCTION {schema}.audit() CASCADE"))
        .await
        .expect("drop the trigger");

    take(&holder, &key, &owner, Some("node-a"))
        .await
        .expect("free");
    Trigger::RaisesOnDelete { after: true }
        .add(&admin, schema)
        .await;
    let released = holder.release(&ReleaseRequest::new(&key, &owner)).await;
    assert!(
        matches!(released, Ok(ReleaseOutcome::Released)),
        "{released:?}"
    );
    assert!(
        released_on_the_server(&admin, &key).await,
        "released, yet the key is held"
    );
    assert_renew(&holder, &[(&bystander.0, &bystander.1)], "german").await;
}

/// A release of a lease with an identity whose record's delete a DBA's
/// trigger fails (after the unlock ran, or before) or a rule refuses
/// still lets go of the key and ends no session: the other lease on it
/// lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_record_delete_a_trigger_or_rule_refuses_frees_the_key_and_keeps_the_session()
 {
    for trigger in [
        Trigger::RaisesOnDelete { after: true },
        Trigger::RaisesOnDelete { after: false },
        Trigger::RuleKeepsDeletes,
    ] {
        let schema = ScratchSchema::new("trigger");
        let (holder, bystander) = one_session_with_a_bystander(schema.options()).await;
        let admin = shared_client().await;
        let (key, owner) = (
            fresh_key("refused-delete"),
            OwnerId::random().expect("owner"),
        );
        trigger.add(&admin, &schema.name).await;
        take(&holder, &key, &owner, Some("node-a"))
            .await
            .expect("free");
        let released = holder.release(&ReleaseRequest::new(&key, &owner)).await;
        assert!(
            matches!(released, Ok(ReleaseOutcome::Released)),
            "{trigger:?}: {released:?}"
        );
        assert!(
            released_on_the_server(&admin, &key).await,
            "{trigger:?}: released, yet the key is held"
        );
        let case = format!("{trigger:?}");
        assert_renew(&holder, &[(&bystander.0, &bystander.1)], &case).await;
    }
}

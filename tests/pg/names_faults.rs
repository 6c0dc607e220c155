//! Leases without an identity named rather than recorded (their token in
//! two shared `(int4, int4)` token marks beside the key's lock, their
//! session in `dlock_sessions`, their key in `dlock_keys`), against what
//! readers, force releases and acquisitions promise: a token shown is the
//! holder's, a force release ends only the lease it names, `held` lists
//! only held keys, the holder is named, and a DBA's hand on the tables of
//! names holds no acquisition up past its first. Each test works in a
//! schema of its own on the shared PostgreSQL (127.0.0.1:5432, or
//! `DLOCK_PG_URL`).

use crate::pg_support;

use std::time::Duration;

use dlock::backend::{AcquireRequest, Attempt, OwnerId, ReleaseRequest};
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, FencingToken, LockKey};
use tokio::time::Instant;

use crate::marks::{Markless, connect, mark_classes, take};
use pg_support::{ScratchSchema, random_id, shared_client};

async fn give_back(backend: &PgBackend, key: &LockKey, owner: &OwnerId) {
    backend
        .release(&ReleaseRequest::new(key, owner))
        .await
        .expect("release");
}

/// A random key seed, printed, so that the keys of a test are its own.
fn random_seed() -> i64 {
    let seed = i64::from_str_radix(&random_id()[..12], 16).expect("hex");
    println!("key seed {seed}");
    seed
}

/// Two keys under `prefix` whose advisory keys (with `seed`) differ but
/// whose token marks share one `classid`: the first mark of `one` and the
/// second mark of `two`. A birthday search over 32 bits, on the server.
async fn keys_with_crossed_marks(
    admin: &dlock::pg::tokio_postgres::Client,
    prefix: &str,
    seed: i64,
) -> ((LockKey, i64), (LockKey, i64)) {
    let rows = admin
        .query(
            "SELECT i, hashtextextended($1::text || i, $2) FROM generate_series(1, 250000) AS i",
            &[&prefix, &seed],
        )
        .await
        .expect("hash the keys");
    let hashes: Vec<(i32, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let by_second: std::collections::HashMap<i64, (i32, i64)> = hashes
        .iter()
        .map(|&(i, h)| (mark_classes(h).1, (i, h)))
        .collect();
    let (i1, h1, i2, h2) = hashes
        .iter()
        .find_map(|&(i, h)| {
            let (a, b) = mark_classes(h);
            let &(j, g) = by_second.get(&a)?;
            let (ga, gb) = mark_classes(g);
            (g != h && b != ga && a != b && ga != gb).then_some((i, h, j, g))
        })
        .expect("250,000 keys have a pair with crossed marks");
    let one = LockKey::new(format!("{prefix}{i1}")).expect("key");
    let two = LockKey::new(format!("{prefix}{i2}")).expect("key");
    println!("crossed marks: `{one}` and `{two}`");
    ((one, h1), (two, h2))
}

/// The set-up of the crossed-marks tests: a holder (one session) holds
/// `two`, whose second token mark has the `classid` of `one`'s first, and
/// takes `one` without its marks (see [`Markless::take`]).
async fn crossed_marks(label: &str) -> Markless {
    let seed = random_seed();
    let admin = shared_client().await;
    let prefix = format!("dlock-test:{label}:{}:", random_id());
    let ((one, h1), (two, h2)) = keys_with_crossed_marks(&admin, &prefix, seed).await;
    assert_eq!(mark_classes(h1).0, mark_classes(h2).1);
    Markless::take(ScratchSchema::new(label), seed, (one, h1), &[two]).await
}

/// A reader shows the token of the lease holding the key, or none: never
/// one put together from another lease's mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_never_shows_a_token_made_of_another_leases_mark() {
    let crossed = crossed_marks("rn_read").await;
    crossed.assert_read_token_is_the_leases_or_none().await;
}

/// A force release naming a token that no lease holds ends no lease, even
/// the token a reader showed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_release_naming_a_token_no_lease_holds_ends_no_lease() {
    let crossed = crossed_marks("rn_force").await;
    crossed
        .assert_force_release_of_another_token_ends_no_lease()
        .await;
}

/// A DBA who locks the table of key names (`LOCK TABLE … ACCESS EXCLUSIVE`
/// in a transaction left open) costs the acquisitions of a key at most one
/// wait for that lock: the next ones do not wait the lock timeout again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dba_lock_on_the_table_of_key_names_holds_up_at_most_one_acquisition() {
    let schema = ScratchSchema::new("rn_locked");
    // A lock session's statements wait 3 s (half of the liveness interval)
    // for a lock: an acquisition that is only slow, on a busy machine,
    // stays well below that.
    let holder = connect(
        schema
            .options()
            .sessions(1)
            .liveness_interval(Duration::from_secs(6)),
    )
    .await;
    let warm = LockKey::new(format!("dlock-test:rn-locked:{}:warm", random_id())).expect("key");
    let owner = OwnerId::random().expect("owner");
    take(&holder, &warm, &owner).await;
    give_back(&holder, &warm, &owner).await;
    assert!(
        schema
            .has_relation(&shared_client().await, "dlock_keys")
            .await,
        "the tables of names were made"
    );

    let mut dba = shared_client().await;
    let tx = dba.transaction().await.expect("begin");
    tx.batch_execute(&format!(
        "LOCK TABLE {}.dlock_keys IN ACCESS EXCLUSIVE MODE",
        schema.name
    ))
    .await
    .expect("lock the table");

    let key = LockKey::new(format!("dlock-test:rn-locked:{}:key", random_id())).expect("key");
    let mut took = Vec::new();
    for _ in 0..4 {
        let started = Instant::now();
        take(&holder, &key, &owner).await;
        took.push(started.elapsed());
        give_back(&holder, &key, &owner).await;
    }
    tx.rollback().await.expect("end the DBA's transaction");
    let waited = took
        .iter()
        .skip(1)
        .filter(|t| **t >= Duration::from_millis(2500))
        .count();
    assert_eq!(
        waited, 0,
        "acquisitions of one free key after the first each waited about the lock timeout \
         for the DBA's lock on dlock_keys: {took:?}"
    );
}

/// The same, for the table of session names (`dlock_sessions`): a lease
/// taken by a session that has not named itself yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dba_lock_on_the_table_of_session_names_holds_up_at_most_one_acquisition() {
    let schema = ScratchSchema::new("rn_slocked");
    let options = schema.options().liveness_interval(Duration::from_secs(6));
    let first = connect(options.clone()).await;
    let warm = LockKey::new(format!("dlock-test:rn-slocked:{}:warm", random_id())).expect("key");
    let owner = OwnerId::random().expect("owner");
    take(&first, &warm, &owner).await;
    give_back(&first, &warm, &owner).await;

    let mut dba = shared_client().await;
    let tx = dba.transaction().await.expect("begin");
    tx.batch_execute(&format!(
        "LOCK TABLE {}.dlock_sessions IN ACCESS EXCLUSIVE MODE",
        schema.name
    ))
    .await
    .expect("lock the table");

    // A new process: its sessions have named nobody yet.
    let holder = connect(options.sessions(1)).await;
    let key = LockKey::new(format!("dlock-test:rn-slocked:{}:key", random_id())).expect("key");
    take(&holder, &key, &owner).await;
    give_back(&holder, &key, &owner).await;
    let mut took = Vec::new();
    for _ in 0..3 {
        let started = Instant::now();
        take(&holder, &key, &owner).await;
        took.push(started.elapsed());
        give_back(&holder, &key, &owner).await;
    }
    tx.rollback().await.expect("end the DBA's transaction");
    assert!(
        took.iter().all(|t| *t < Duration::from_millis(2500)),
        "acquisitions of a named key by a session not yet named each waited about the lock \
         timeout for the DBA's lock on dlock_sessions: {took:?}"
    );
}

/// A lease taken after a DBA emptied `dlock_sessions` still names its
/// holder's host and pid to readers, as a lease taken after a DBA emptied
/// the table of holder records did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_taken_after_the_session_names_were_truncated_names_its_holder() {
    let schema = ScratchSchema::new("rn_trunc");
    let holder = connect(schema.options().sessions(1)).await;
    let reader = connect(schema.options()).await;
    let owner = OwnerId::random().expect("owner");
    let first = LockKey::new(format!("dlock-test:rn-trunc:{}:first", random_id())).expect("key");
    take(&holder, &first, &owner).await;
    let seen = reader.holder(&first).await.expect("read").expect("held");
    assert_eq!(
        seen.holder.as_ref().map(|h| h.pid),
        Some(std::process::id()),
        "named before the TRUNCATE: {seen:?}"
    );
    give_back(&holder, &first, &owner).await;

    shared_client()
        .await
        .batch_execute(&format!("TRUNCATE {}.dlock_sessions", schema.name))
        .await
        .expect("truncate");

    let next = LockKey::new(format!("dlock-test:rn-trunc:{}:next", random_id())).expect("key");
    take(&holder, &next, &owner).await;
    let seen = reader.holder(&next).await.expect("read").expect("held");
    assert_eq!(
        seen.holder.as_ref().map(|h| h.pid),
        Some(std::process::id()),
        "a lease taken after the TRUNCATE is read without its holder: {seen:?}"
    );
    give_back(&holder, &next, &owner).await;
}

/// The advisory locks the session `pid` holds on `client`'s server: its
/// exclusive `bigint` ones (the keys) and its shared `(int4, int4)` ones
/// (the token marks).
async fn locks_of(client: &dlock::pg::tokio_postgres::Client, pid: i32) -> (i64, i64) {
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE mode = 'ExclusiveLock' AND objsubid = 1),
                    count(*) FILTER (WHERE mode = 'ShareLock' AND objsubid = 2)
             FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = $1",
            &[&pid],
        )
        .await
        .expect("pg_locks");
    (row.get(0), row.get(1))
}

/// The advisory locks of every session on `client`'s server (keys, token
/// marks), once a session ended meanwhile has let go of its own: read
/// until two reads 200 ms apart agree.
async fn settled_locks(client: &dlock::pg::tokio_postgres::Client) -> (i64, i64) {
    let read = || async {
        let row = client
            .query_one(
                "SELECT count(*) FILTER (WHERE mode = 'ExclusiveLock' AND objsubid = 1),
                        count(*) FILTER (WHERE mode = 'ShareLock' AND objsubid = 2)
                 FROM pg_locks WHERE locktype = 'advisory' AND granted",
                &[],
            )
            .await
            .expect("pg_locks");
        (row.get::<_, i64>(0), row.get::<_, i64>(1))
    };
    let mut last = read().await;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = read().await;
        if now == last {
            break;
        }
        last = now;
    }
    last
}

/// A server of the test's own (kept alive by the first value), its
/// connection string, a backend on it with one lock session, and an
/// admin connection.
async fn own_server_backend() -> (
    pg_support::OwnServer,
    String,
    PgBackend,
    dlock::pg::tokio_postgres::Client,
) {
    use pg_support::{OwnServer, PASSWORD};
    let server = OwnServer::start();
    let conn = server.conn(PASSWORD, "sslmode=disable");
    let holder = PgBackend::connect_with(&conn, PgOptions::new().sessions(1))
        .await
        .expect("connect");
    let (admin, connection) =
        dlock::pg::tokio_postgres::connect(&conn, dlock::pg::tokio_postgres::NoTls)
            .await
            .expect("admin");
    tokio::spawn(connection);
    (server, conn, holder, admin)
}

/// A server whose lock table is full (default `max_locks_per_transaction`;
/// a marked lease takes three entries of it) refuses the next acquisition with an
/// error, and the leases held live on: neither lost with their session
/// nor silently without their marks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_lock_table_refuses_an_acquisition_and_loses_no_lease_held() {
    let (_server, _, holder, admin) = own_server_backend().await;
    let owner = OwnerId::random().expect("owner");
    let mut held = Vec::new();
    let mut refused = None;
    for i in 0..10_000 {
        let key = LockKey::new(format!("dlock-test:rn-full:{i}")).expect("key");
        let request = AcquireRequest::new(&key, &owner, Duration::from_secs(600));
        match holder.try_acquire(&request).await {
            Ok(Attempt::Acquired(_)) => held.push(key),
            other => {
                refused = Some(format!("{other:?}"));
                break;
            }
        }
    }
    println!("{} leases held, then: {refused:?}", held.len());
    // Every session's: only the holder locks keys on this server.
    let (keys, marks) = settled_locks(&admin).await;
    println!("{keys} keys and {marks} marks held on the server");
    let settings = admin
        .query_one(
            "SELECT current_setting('max_locks_per_transaction'), current_setting('max_connections')",
            &[],
        )
        .await
        .expect("settings");
    println!(
        "max_locks_per_transaction {}, max_connections {}",
        settings.get::<_, String>(0),
        settings.get::<_, String>(1)
    );
    let lost = held.len() as i64 - keys;
    assert!(
        refused.as_deref().is_none_or(|r| r.starts_with("Err")),
        "an acquisition past the lock table's end answered {refused:?}"
    );
    assert_eq!(
        lost,
        0,
        "{} leases were held when an acquisition was refused ({refused:?}); {keys} are held now",
        held.len()
    );
    // A backend marks at most 512 leases at once (`names::MAX_MARKED`);
    // the others record themselves.
    assert!(
        marks >= 2 * keys.min(512) - 4,
        "{keys} leases held with {marks} token marks"
    );
}

/// A server of the test's own whose lock table another client filled up,
/// beside 1,000 leases of one backend on one session: the server (kept
/// alive), the backend, an admin connection, the owner of the leases,
/// their keys, the session's pid and the filler's connection.
async fn a_full_lock_table(
    label: &str,
) -> (
    pg_support::OwnServer,
    PgBackend,
    dlock::pg::tokio_postgres::Client,
    OwnerId,
    Vec<LockKey>,
    i32,
    dlock::pg::tokio_postgres::Client,
) {
    let (server, conn, holder, admin) = own_server_backend().await;
    let owner = OwnerId::random().expect("owner");
    let mut held = Vec::new();
    for i in 0..1_000 {
        let key = LockKey::new(format!("dlock-test:rn-full-{label}:{i}")).expect("key");
        take(&holder, &key, &owner).await;
        held.push(key);
    }
    let pid: i32 = admin
        .query_one(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ExclusiveLock'
               AND objsubid = 1 AND granted GROUP BY pid ORDER BY count(*) DESC LIMIT 1",
            &[],
        )
        .await
        .expect("the holder's session")
        .get(0);
    // Another client's session locks take the rest of the lock table.
    let (filler, connection) =
        dlock::pg::tokio_postgres::connect(&conn, dlock::pg::tokio_postgres::NoTls)
            .await
            .expect("filler");
    tokio::spawn(connection);
    filler
        .batch_execute(
            "DO $$
             BEGIN
               FOR i IN 1..100000 LOOP
                 BEGIN
                   PERFORM pg_advisory_lock(7777, i);
                 EXCEPTION WHEN out_of_memory THEN
                   PERFORM set_config('filler.took', i::text, false);
                   RETURN;
                 END;
               END LOOP;
             END $$",
        )
        .await
        .expect("fill the lock table");
    let filled: String = filler
        .query_one("SELECT current_setting('filler.took', true)", &[])
        .await
        .expect("filled")
        .get::<_, Option<String>>(0)
        .unwrap_or_default();
    println!("the other client took {filled} locks");
    let (keys, _) = locks_of(&admin, pid).await;
    assert_eq!(keys, 1_000, "all held before the release");
    (server, holder, admin, owner, held, pid, filler)
}

/// A release on a server whose lock table is full (three entries a named
/// lease, and another client's locks took the rest) lets go of its own
/// lease only: the other leases of its session live on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_on_a_full_lock_table_loses_no_other_lease() {
    let (_server, holder, admin, owner, held, pid, filler) = a_full_lock_table("release").await;

    let released = holder.release(&ReleaseRequest::new(&held[0], &owner)).await;
    println!("release: {released:?}");
    let (keys, marks) = locks_of(&admin, pid).await;
    drop(filler);
    assert_eq!(
        keys, 999,
        "a release on a full lock table answered {released:?}, and left {keys} of the other \
         999 leases held ({marks} marks)"
    );
}

/// An acquisition refused because the server's lock table is full (three
/// entries a named lease, and another client's locks took the rest) costs
/// the leases already held on its session nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquisition_refused_by_a_full_lock_table_loses_no_lease_held() {
    let (_server, holder, admin, owner, _held, pid, filler) = a_full_lock_table("refused").await;

    // A few attempts: which step of the lock statement meets the full
    // table varies from one to the next.
    let mut answered = Vec::new();
    let mut keys = 1_000;
    let mut marks = 0;
    for i in 0..5 {
        let refused = LockKey::new(format!("dlock-test:rn-full-refused:next-{i}")).expect("key");
        let request = AcquireRequest::new(&refused, &owner, Duration::from_secs(600));
        let answer = holder.try_acquire(&request).await;
        println!("acquisition: {answer:?}");
        answered.push(format!("{answer:?}"));
        (keys, marks) = locks_of(&admin, pid).await;
        if keys < 1_000 {
            break;
        }
    }
    drop(filler);
    assert_eq!(
        keys, 1_000,
        "an acquisition on a full lock table answered {answered:?}, and left {keys} of the \
         1,000 leases held ({marks} marks)"
    );
}

/// A lease without an identity is read from its marks and the tables of
/// names alone: a DBA who drops `dlock_holders` (which such leases no
/// longer write) leaves its token and its holder readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_lease_is_read_with_its_token_and_holder_after_the_table_of_records_was_dropped() {
    let schema = ScratchSchema::new("rn_drop");
    let holder = connect(schema.options().sessions(1)).await;
    let reader = connect(schema.options()).await;
    let owner = OwnerId::random().expect("owner");
    let first = LockKey::new(format!("dlock-test:rn-drop:{}:first", random_id())).expect("key");
    take(&holder, &first, &owner).await;
    give_back(&holder, &first, &owner).await;

    shared_client()
        .await
        .batch_execute(&format!("DROP TABLE {}.dlock_holders", schema.name))
        .await
        .expect("drop the table of records");

    let key = LockKey::new(format!("dlock-test:rn-drop:{}:key", random_id())).expect("key");
    let token = take(&holder, &key, &owner).await;
    let seen = reader.holder(&key).await.expect("read").expect("held");
    assert_eq!(
        (seen.token, seen.holder.as_ref().map(|h| h.pid)),
        (Some(token), Some(std::process::id())),
        "a named lease read after dlock_holders was dropped: {seen:?}"
    );
    give_back(&holder, &key, &owner).await;
}

/// `held` lists the keys held by leases without an identity from the
/// tables of names: a DBA who drops `dlock_holders` hides none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_lists_named_leases_after_the_table_of_records_was_dropped() {
    let schema = ScratchSchema::new("rn_dropl");
    let holder = connect(schema.options().sessions(1)).await;
    let reader = connect(schema.options()).await;
    let owner = OwnerId::random().expect("owner");
    let prefix = format!("dlock-test:rn-dropl:{}:", random_id());
    let key = LockKey::new(format!("{prefix}key")).expect("key");
    let token = take(&holder, &key, &owner).await;
    let listed = reader.held(&prefix).await.expect("list");
    assert_eq!(listed.len(), 1, "listed before the DROP: {listed:?}");

    shared_client()
        .await
        .batch_execute(&format!("DROP TABLE {}.dlock_holders", schema.name))
        .await
        .expect("drop the table of records");

    let listed: Vec<(String, Option<FencingToken>)> = reader
        .held(&prefix)
        .await
        .expect("list")
        .into_iter()
        .map(|(key, holding)| (key, holding.token))
        .collect();
    assert_eq!(
        listed,
        vec![(key.as_str().to_owned(), Some(token))],
        "the named lease listed after dlock_holders was dropped"
    );
    give_back(&holder, &key, &owner).await;
}

/// A crash of the server empties `dlock_keys` (unlogged): once the backend
/// is back on a new session, a key it had named before is named again at
/// its next lock, so `held` lists it. It was not named again for up to
/// ten minutes (the process took the key for named), and `held` and
/// `dlock list` missed it meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_crash_a_key_named_before_is_named_again_and_listed() {
    let (server, conn, holder, _admin) = own_server_backend().await;
    let owner = OwnerId::random().expect("owner");
    let prefix = format!("dlock-test:rn-crash:{owner}:");
    let key = LockKey::new(format!("{prefix}k")).expect("key");
    let request = AcquireRequest::new(&key, &owner, Duration::from_secs(60));
    let take = async || loop {
        // The first attempt after the crash may meet the lost session.
        match holder.try_acquire(&request).await {
            Ok(Attempt::Acquired(_)) => break,
            Ok(other) => panic!("a free key: {other:?}"),
            Err(err) => println!("retrying after: {err}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    take().await;
    let listed = holder.held(&prefix).await.expect("list");
    assert_eq!(listed.len(), 1, "named before the crash: {listed:?}");
    holder
        .release(&ReleaseRequest::new(&key, &owner))
        .await
        .expect("release");

    let stopped = server.pg_ctl_stop("immediate");
    assert!(stopped.status.success(), "{stopped:?}");
    server.pg_ctl_start();
    take().await;
    let reader = PgBackend::connect(&conn).await.expect("a reader");
    let listed = reader.held(&prefix).await.expect("list");
    if listed.len() != 1 {
        let seen = what_the_server_holds(&conn, &server.dir.join("log")).await;
        let read = holder.holder(&key).await;
        panic!("held after the crash, listed: {listed:?}; the holder reads {read:?}; {seen}");
    }
    holder
        .release(&ReleaseRequest::new(&key, &owner))
        .await
        .expect("release");
}

/// The server's side of a test that found a key missing from `held`: the
/// names it keeps, the sessions it knows, every advisory lock (with the
/// holder's pid), read on a connection of its own, and the errors its log
/// holds, for the failure message.
async fn what_the_server_holds(conn: &str, log: &std::path::Path) -> String {
    let (admin, connection) =
        match dlock::pg::tokio_postgres::connect(conn, dlock::pg::tokio_postgres::NoTls).await {
            Ok(pair) => pair,
            Err(err) => return format!("(no connection to look: {err})"),
        };
    tokio::spawn(connection);
    let mut seen = String::new();
    for (what, query) in [
        (
            "dlock_keys",
            "SELECT lock_id::text, key, named_at::text FROM dlock.dlock_keys",
        ),
        (
            "dlock_sessions",
            "SELECT pid::text, session_start::text, holder FROM dlock.dlock_sessions",
        ),
        (
            "advisory locks",
            "SELECT pid::text, classid::text, objid::text, objsubid::text, mode \
             FROM pg_catalog.pg_locks WHERE locktype = 'advisory'",
        ),
    ] {
        let rows = match admin.query(query, &[]).await {
            Ok(rows) => rows
                .iter()
                .map(|row| {
                    (0..row.len())
                        .map(|i| row.get::<_, String>(i))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect::<Vec<_>>()
                .join("; "),
            Err(err) => format!("error: {err}"),
        };
        seen.push_str(&format!("{what}: [{rows}] "));
    }
    let log = std::fs::read_to_string(log).unwrap_or_default();
    let errors: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("ERROR") || line.contains("STATEMENT"))
        .collect();
    seen.push_str(&format!("server log errors: {errors:?}"));
    seen
}

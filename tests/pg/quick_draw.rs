//! The quick draw: while the token sequence leads the clock, a lock takes
//! its token in one statement that holds only what a token from the
//! sequence needs; when the sequence is behind (or refused), the lock is
//! taken without a token and the full draw follows in a statement of its
//! own, the marks of a named lease with it; a backend whose draws leave the
//! sequence behind (no lead) sends the one-statement lock instead. Which
//! statement took a lock is read from `pg_stat_activity` (the last one its
//! session sent). Each test works in a schema of its own on the shared
//! server.

use crate::pg_support::{ScratchSchema, shared_client, shared_conn};
use crate::token_lead::{fresh_key, seq, server_clock, set_just_behind, set_lead};

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::tokio_postgres::Client;
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, Lease, LockOptions};

/// A backend of one lock session on `schema` (holder named, or not), with
/// no liveness ping that could be the session's last statement.
async fn connect(schema: &str, named: bool) -> PgBackend {
    PgBackend::connect_with(
        &shared_conn(),
        PgOptions::new()
            .schema(schema)
            .sessions(1)
            .record_holders(named)
            .liveness_interval(Duration::from_secs(60))
            .server_idle_timeout(Some(Duration::from_secs(180))),
    )
    .await
    .expect("connect")
}

/// Which of dlock's lock statements the backend's lock session sent last
/// (`pg_stat_activity` shows the first 1024 bytes of its text).
async fn last_lock_statement(admin: &Client, backend: &PgBackend) -> &'static str {
    let pid = backend.session_pids().await[0];
    let text: String = admin
        .query_one("SELECT query FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await
        .expect("pg_stat_activity")
        .get(0);
    if text.starts_with("-- dlock: lock, quick draw")
        || text.starts_with("-- dlock: named lock, quick draw")
    {
        "quick"
    } else if text.starts_with("-- dlock: draw for a") {
        "draw after the lock"
    } else if text.contains("pg_catalog.pg_try_advisory_lock(k.h)") {
        "one statement"
    } else {
        panic!("not a lock statement: {text}")
    }
}

/// Takes a fresh key and keeps it.
async fn take(backend: &PgBackend) -> Lease {
    let shared: Arc<dyn Backend> = Arc::new(backend.clone());
    LockOptions::new(Duration::from_secs(30))
        .acquire_on(shared, &fresh_key("quick"))
        .await
        .expect("free")
}

/// For a named lease: its token is the one readers find in its marks.
async fn marks_carry(backend: &PgBackend, lease: &Lease, named: bool) {
    if named {
        let seen = backend
            .holder(lease.key())
            .await
            .expect("read")
            .expect("held");
        assert_eq!(seen.token, Some(lease.token()), "the marks carry the token");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_takes_its_token_from_a_leading_sequence_in_one_quick_statement() {
    for named in [true, false] {
        let scratch = ScratchSchema::new("quick");
        let admin = shared_client().await;
        let backend = connect(&scratch.name, named).await;
        take(&backend).await.release().await.expect("release");
        // An hour ahead of the clock (within the day the draw allows):
        // every draw now takes `nextval`.
        let ahead = server_clock(&admin).await + 3_600_000_000;
        admin
            .execute(
                &format!("SELECT setval('{}', {ahead})", seq(&scratch.name)),
                &[],
            )
            .await
            .expect("setval");
        for _ in 0..3 {
            let lease = take(&backend).await;
            assert_eq!(last_lock_statement(&admin, &backend).await, "quick");
            let token = lease.token().get() as i64;
            assert!(
                (ahead + 1..=ahead + 10).contains(&token),
                "the token is nextval's: {token} after {ahead}"
            );
            marks_carry(&backend, &lease, named).await;
            lease.release().await.expect("release");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_behind_the_clock_is_drawn_after_the_lock_with_the_lead_and_the_marks() {
    for named in [true, false] {
        let scratch = ScratchSchema::new("quick");
        let admin = shared_client().await;
        let backend = connect(&scratch.name, named).await;
        take(&backend).await.release().await.expect("release");
        let mut last = 0;
        for _ in 0..3 {
            set_just_behind(&admin, &scratch.name).await;
            let before = server_clock(&admin).await;
            let lease = take(&backend).await;
            let after = server_clock(&admin).await;
            assert_eq!(
                last_lock_statement(&admin, &backend).await,
                "draw after the lock"
            );
            let token = lease.token().get() as i64;
            assert!(
                (before + 10_000..=after + 10_000).contains(&token) && token > last,
                "a draw that writes hands out the clock plus the lead: {token} against a \
                 clock of {before}..={after}, after {last}"
            );
            last = token;
            marks_carry(&backend, &lease, named).await;
            lease.release().await.expect("release");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_lead_the_backend_sends_the_one_statement_lock_after_its_first_draw() {
    for named in [true, false] {
        let scratch = ScratchSchema::new("quick");
        let admin = shared_client().await;
        let backend = connect(&scratch.name, named).await;
        // Its objects made (with the lead), before the lead goes.
        let first = take(&backend).await;
        first.release().await.expect("release");
        set_lead(&admin, &scratch.name, None).await;
        set_just_behind(&admin, &scratch.name).await;
        let lease = take(&backend).await;
        assert_eq!(
            last_lock_statement(&admin, &backend).await,
            "draw after the lock"
        );
        let mut last = lease.token().get() as i64;
        lease.release().await.expect("release");
        for _ in 0..3 {
            set_just_behind(&admin, &scratch.name).await;
            let before = server_clock(&admin).await;
            let lease = take(&backend).await;
            let after = server_clock(&admin).await;
            assert_eq!(last_lock_statement(&admin, &backend).await, "one statement");
            let token = lease.token().get() as i64;
            assert!(
                (before..=after).contains(&token) && token > last,
                "without a lead the token is the clock at the draw: {token} not in \
                 {before}..={after}, or not after {last}"
            );
            last = token;
            marks_carry(&backend, &lease, named).await;
            lease.release().await.expect("release");
        }
    }
}

/// A sequence dropped after the quick statement took the lock and before
/// the draw that follows it: the draw fails as the one statement would
/// have before its lock, but this lock was taken. It is undone, the
/// sequence made again, and the key taken anew: once released, it is
/// free (a second hold on the session would keep it locked, nobody's).
/// The pause is held by a proxy just before the draw's Bind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_dropped_between_the_lock_and_its_draw_leaves_no_lock_behind() {
    use dlock::pg::tokio_postgres::Config;
    let config: Config = shared_conn()
        .parse()
        .expect("a PostgreSQL connection string");
    let port = config.get_ports().first().copied().unwrap_or(5432);
    for named in [true, false] {
        let scratch = ScratchSchema::new("quick");
        let admin = shared_client().await;
        let proxy = crate::support::proxy::Proxy::bind_pg(format!("127.0.0.1:{port}")).await;
        let through = format!(
            "host=127.0.0.1 port={} user={} dbname={} sslmode=disable",
            proxy.port,
            config.get_user().unwrap_or("postgres"),
            config.get_dbname().unwrap_or("test"),
        );
        let backend = PgBackend::connect_with(
            &through,
            PgOptions::new()
                .schema(&scratch.name)
                .sessions(1)
                .record_holders(named),
        )
        .await
        .expect("connect through the proxy");
        // Its objects made and its statements prepared.
        let first = take(&backend).await;
        let before = first.token();
        first.release().await.expect("release");
        set_just_behind(&admin, &scratch.name).await;
        let key = fresh_key("dropped-between");
        let acquiring = tokio::spawn({
            let (backend, key) = (backend.clone(), key.clone());
            async move {
                LockOptions::new(Duration::from_secs(30))
                    .acquire_on(Arc::new(backend) as Arc<dyn Backend>, &key)
                    .await
            }
        });
        crate::support::within(
            10,
            "the draw after the lock",
            proxy.pause_before("-- dlock: draw for a"),
        )
        .await;
        admin
            .batch_execute(&format!("DROP SEQUENCE {}", seq(&scratch.name)))
            .await
            .expect("drop the sequence");
        proxy.go();
        let lease = acquiring
            .await
            .expect("the acquisition")
            .expect("taken, the sequence made again");
        assert!(lease.token() > before, "tokens rise across the drop");
        lease.release().await.expect("release");
        assert!(
            crate::pg_support::freed_on_the_server(&admin, &key).await,
            "the released key is free (named: {named})"
        );
    }
}

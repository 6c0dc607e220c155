//! The quick lock statement (`protocol::TRY_LOCK_QUICK`,
//! `TRY_LOCK_NAMED_QUICK`): sent while the backend's last full lock
//! statement said the token sequence leads the clock, it takes the token
//! from `nextval` in one round trip; when it finds the sequence behind or
//! unfit it gives its lock back in the same statement and the full one
//! follows. A backend that locks less often than the lead sends the full
//! statement alone. Each test runs in a schema of its own, through a proxy
//! that counts the statements the backend executes (Bind messages), and
//! reads which one a lock session sent last from `pg_stat_activity`.

use crate::pg_support::{ScratchSchema, shared_client, shared_conn};
use crate::support::proxy::Proxy;
use crate::token_lead::{fresh_key, seq, set_just_behind};

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::tokio_postgres::{Client, Config};
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, Lease, LockError, LockOptions};

/// A backend of one lock session on `schema` through a counting proxy
/// (holder named, or not), with no liveness ping of its own to count.
async fn connect(schema: &str, named: bool) -> (PgBackend, Proxy) {
    let config: Config = shared_conn().parse().expect("a connection string");
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let proxy = Proxy::bind_pg(format!("127.0.0.1:{port}")).await;
    let through = format!(
        "host=127.0.0.1 port={} user={} dbname={} sslmode=disable",
        proxy.port,
        config.get_user().unwrap_or("postgres"),
        config.get_dbname().unwrap_or("test"),
    );
    let backend = PgBackend::connect_with(
        &through,
        PgOptions::new()
            .schema(schema)
            .sessions(1)
            .record_holders(named)
            .liveness_interval(Duration::from_secs(60))
            .server_idle_timeout(Some(Duration::from_secs(180))),
    )
    .await
    .expect("PostgreSQL through the proxy");
    (backend, proxy)
}

/// The server clock, in microseconds since 1970: what a draw reads.
async fn server_clock(client: &Client) -> i64 {
    client
        .query_one(
            "SELECT (EXTRACT(epoch FROM clock_timestamp()) * 1000000)::int8",
            &[],
        )
        .await
        .expect("clock")
        .get(0)
}

/// Sets the sequence an hour ahead of the clock (within the day the draw
/// allows); returns where.
async fn set_hour_ahead(admin: &Client, schema: &str) -> i64 {
    let ahead = server_clock(admin).await + 3_600_000_000;
    admin
        .execute(&format!("SELECT setval('{}', {ahead})", seq(schema)), &[])
        .await
        .expect("setval");
    ahead
}

/// Waits past the lead of the last draw that wrote (10 ms on a sequence
/// dlock creates), so the backend's next lock is a full statement again:
/// a slower machine only waits longer.
async fn past_the_lead() {
    tokio::time::sleep(Duration::from_millis(30)).await;
}

/// Which lock statement the backend's lock session on `schema` sent last
/// (`pg_stat_activity` shows the first 1024 bytes of its text).
async fn last_statement(admin: &Client, backend: &PgBackend, schema: &str) -> &'static str {
    use dlock::pg::protocol::{TRY_LOCK, TRY_LOCK_NAMED, TRY_LOCK_NAMED_QUICK, TRY_LOCK_QUICK};
    let pid = backend.session_pids().await[0];
    let text: String = admin
        .query_one("SELECT query FROM pg_stat_activity WHERE pid = $1", &[&pid])
        .await
        .expect("pg_stat_activity")
        .get(0);
    let sent = |statement: &str| {
        let statement = statement.replace("{schema}", &format!("\"{schema}\""));
        statement.get(..text.len()) == Some(text.as_str())
    };
    match () {
        () if sent(TRY_LOCK_QUICK) || sent(TRY_LOCK_NAMED_QUICK) => "quick",
        () if sent(TRY_LOCK) || sent(TRY_LOCK_NAMED) => "full",
        () => panic!("not a lock statement: {text}"),
    }
}

/// Takes a fresh key and keeps it; also returns how many statements the
/// backend executed for it.
async fn take(backend: &PgBackend, proxy: &Proxy) -> Result<(Lease, usize), LockError> {
    let shared: Arc<dyn Backend> = Arc::new(backend.clone());
    let before = proxy.pg_sent(b'B');
    let lease = LockOptions::new(Duration::from_secs(30))
        .acquire_on(shared, &fresh_key("quick"))
        .await?;
    Ok((lease, proxy.pg_sent(b'B') - before))
}

/// Releases `lease`, then checks that another session can take its key:
/// no lock statement left it held behind the lease.
async fn release_and_check_free(admin: &Client, lease: Lease) {
    let key = lease.key().as_str().to_owned();
    lease.release().await.expect("release");
    let free: bool = admin
        .query_one(
            "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
            &[&key],
        )
        .await
        .expect("try")
        .get(0);
    assert!(free, "the key is free once its lease let go: {key}");
    admin
        .execute(
            "SELECT pg_advisory_unlock(hashtextextended($1, 0))",
            &[&key],
        )
        .await
        .expect("unlock");
}

/// For a named lease: readers find its token in its marks.
async fn marks_carry(backend: &PgBackend, lease: &Lease, named: bool) {
    if named {
        let seen = backend.holder(lease.key()).await.expect("read");
        let seen = seen.expect("held");
        assert_eq!(seen.token, Some(lease.token()), "the marks carry the token");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_takes_its_token_from_a_leading_sequence_in_one_quick_statement() {
    for named in [true, false] {
        let scratch = ScratchSchema::new("quick");
        let admin = shared_client().await;
        let (backend, proxy) = connect(&scratch.name, named).await;
        let (first, _) = take(&backend, &proxy).await.expect("free");
        first.release().await.expect("release");
        past_the_lead().await;
        let ahead = set_hour_ahead(&admin, &scratch.name).await;
        // The full statement reads the sequence an hour ahead...
        let (lease, sent) = take(&backend, &proxy).await.expect("free");
        assert_eq!(
            (last_statement(&admin, &backend, &scratch.name).await, sent),
            ("full", 1)
        );
        let mut last = lease.token().get() as i64;
        assert_eq!(last, ahead + 1, "the token is nextval's");
        release_and_check_free(&admin, lease).await;
        // ...so the quick one serves the hour after it.
        for _ in 0..3 {
            let (lease, sent) = take(&backend, &proxy).await.expect("free");
            assert_eq!(
                (last_statement(&admin, &backend, &scratch.name).await, sent),
                ("quick", 1)
            );
            let token = lease.token().get() as i64;
            assert_eq!(token, last + 1, "the token is nextval's");
            last = token;
            marks_carry(&backend, &lease, named).await;
            release_and_check_free(&admin, lease).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quick_lock_that_finds_the_sequence_behind_gives_the_lock_back_and_the_full_one_draws() {
    for named in [true, false] {
        let scratch = ScratchSchema::new("quick");
        let admin = shared_client().await;
        let (backend, proxy) = connect(&scratch.name, named).await;
        take(&backend, &proxy)
            .await
            .expect("free")
            .0
            .release()
            .await
            .expect("release");
        for _ in 0..3 {
            past_the_lead().await;
            set_hour_ahead(&admin, &scratch.name).await;
            let (lease, sent) = take(&backend, &proxy).await.expect("free");
            assert_eq!(
                (last_statement(&admin, &backend, &scratch.name).await, sent),
                ("full", 1)
            );
            release_and_check_free(&admin, lease).await;
            // Set back behind the clock (as a restore would), while the
            // backend believes it an hour ahead.
            set_just_behind(&admin, &scratch.name).await;
            let before = server_clock(&admin).await;
            let (lease, sent) = take(&backend, &proxy).await.expect("free");
            let after = server_clock(&admin).await;
            assert_eq!(
                (last_statement(&admin, &backend, &scratch.name).await, sent),
                ("full", 2)
            );
            let token = lease.token().get() as i64;
            assert!(
                (before + 10_000..=after + 10_000).contains(&token),
                "a draw that writes hands out the clock plus the lead: {token} against a \
                 clock of {before}..={after}"
            );
            marks_carry(&backend, &lease, named).await;
            release_and_check_free(&admin, lease).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quick_lock_that_finds_the_sequence_unfit_leaves_the_refusal_to_the_full_one() {
    for named in [true, false] {
        let scratch = ScratchSchema::new("quick");
        let admin = shared_client().await;
        let (backend, proxy) = connect(&scratch.name, named).await;
        take(&backend, &proxy)
            .await
            .expect("free")
            .0
            .release()
            .await
            .expect("release");
        past_the_lead().await;
        set_hour_ahead(&admin, &scratch.name).await;
        take(&backend, &proxy)
            .await
            .expect("free")
            .0
            .release()
            .await
            .expect("release");
        let sequence = seq(&scratch.name);
        admin
            .batch_execute(&format!("ALTER SEQUENCE {sequence} CACHE 10"))
            .await
            .expect("alter");
        let before = proxy.pg_sent(b'B');
        let key = fresh_key("quick-unfit");
        let shared: Arc<dyn Backend> = Arc::new(backend.clone());
        let refused = LockOptions::new(Duration::from_secs(30))
            .acquire_on(shared, &key)
            .await
            .expect_err("an unfit sequence is refused");
        assert!(
            refused.to_string().contains("CACHE"),
            "the full statement's refusal names the setting: {refused}"
        );
        assert!(
            proxy.pg_sent(b'B') - before >= 2,
            "the quick one, then the full one"
        );
        let free: bool = admin
            .query_one(
                "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
                &[&key.as_str()],
            )
            .await
            .expect("try")
            .get(0);
        assert!(free, "nothing is left held by the refused attempt");
        admin
            .batch_execute(&format!(
                "SELECT pg_advisory_unlock_all(); ALTER SEQUENCE {sequence} CACHE 1"
            ))
            .await
            .expect("restore");
        let (lease, _) = take(&backend, &proxy).await.expect("fit again");
        marks_carry(&backend, &lease, named).await;
        release_and_check_free(&admin, lease).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_locking_less_often_than_the_lead_sends_one_statement_per_lock() {
    for named in [true, false] {
        let scratch = ScratchSchema::new("quick");
        let admin = shared_client().await;
        let (backend, proxy) = connect(&scratch.name, named).await;
        take(&backend, &proxy)
            .await
            .expect("free")
            .0
            .release()
            .await
            .expect("release");
        for _ in 0..3 {
            past_the_lead().await;
            let (lease, sent) = take(&backend, &proxy).await.expect("free");
            assert_eq!(
                (last_statement(&admin, &backend, &scratch.name).await, sent),
                ("full", 1)
            );
            release_and_check_free(&admin, lease).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quick_lock_on_a_dropped_sequence_has_it_restored_and_leaves_nothing_held() {
    for named in [true, false] {
        let scratch = ScratchSchema::new("quick");
        let admin = shared_client().await;
        let (backend, proxy) = connect(&scratch.name, named).await;
        take(&backend, &proxy)
            .await
            .expect("free")
            .0
            .release()
            .await
            .expect("release");
        past_the_lead().await;
        set_hour_ahead(&admin, &scratch.name).await;
        take(&backend, &proxy)
            .await
            .expect("free")
            .0
            .release()
            .await
            .expect("release");
        admin
            .batch_execute(&format!("DROP SEQUENCE {}", seq(&scratch.name)))
            .await
            .expect("drop");
        // The quick statement fails on the missing sequence after taking
        // the lock; the backend undoes it, creates the sequence again and
        // takes the key (the new sequence behind the clock: the quick one
        // gives back, the full one draws).
        let before = server_clock(&admin).await;
        let (lease, _) = take(&backend, &proxy).await.expect("restored");
        let after = server_clock(&admin).await;
        let token = lease.token().get() as i64;
        assert!(
            (before + 10_000..=after + 10_000).contains(&token),
            "a lost sequence hands out the clock plus the lead: {token} against a clock of \
             {before}..={after}"
        );
        marks_carry(&backend, &lease, named).await;
        release_and_check_free(&admin, lease).await;
    }
}

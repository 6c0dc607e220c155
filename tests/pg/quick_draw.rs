//! The quick lock statement (`protocol::TRY_LOCK_QUICK`,
//! `TRY_LOCK_NAMED_QUICK`): sent while the backend's last full lock
//! statement said the token sequence leads the clock, it takes the token
//! from `nextval` in one round trip; when it finds the sequence behind or
//! unfit it gives its lock back in the same statement and the full one
//! follows. A backend that locks less often than the lead sends the full
//! statement alone. Each test runs in a schema of its own, through a proxy
//! that counts the statements the backend executes (Bind messages), and
//! reads which one a lock session sent last from `pg_stat_activity`; each
//! runs for a named lease and for a plain one.

use crate::pg_support::{
    ScratchSchema, free_on_the_server, freed_on_the_server, shared_client, shared_conn,
};
use crate::support::proxy::Proxy;
use crate::token_lead::{fresh_key, seq, server_clock, set_just_behind};

use std::sync::Arc;
use std::time::Duration;

use dlock::pg::tokio_postgres::{Client, Config};
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, Lease, LockError, LockKey, LockOptions};

/// A backend of one lock session in a schema of its own, through a
/// counting proxy, and a connection of the test's.
struct Fixture {
    scratch: ScratchSchema,
    admin: Client,
    backend: PgBackend,
    proxy: Proxy,
    named: bool,
}

impl Fixture {
    /// With the schema's objects made by a first lock (holder named, or
    /// not), and no liveness ping of the backend's own to count.
    async fn new(named: bool) -> Self {
        let scratch = ScratchSchema::new("quick");
        let (backend, proxy) = Self::connect(&scratch.name, named).await;
        let fixture = Self {
            scratch,
            admin: shared_client().await,
            backend,
            proxy,
            named,
        };
        fixture.cycle().await;
        fixture
    }

    /// A backend of one lock session on `schema`, through a proxy of its
    /// own.
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

    /// Takes a fresh key and keeps it; also returns how many statements
    /// the backend executed for it.
    async fn take(&self) -> Result<(Lease, usize), LockError> {
        let shared: Arc<dyn Backend> = Arc::new(self.backend.clone());
        let before = self.proxy.pg_sent(b'B');
        let lease = LockOptions::new(Duration::from_secs(30))
            .acquire_on(shared, &fresh_key("quick"))
            .await?;
        Ok((lease, self.proxy.pg_sent(b'B') - before))
    }

    /// Takes a fresh key and lets it go.
    async fn cycle(&self) {
        let (lease, _) = self.take().await.expect("free");
        lease.release().await.expect("release");
    }

    /// Waits past the lead of the last draw that wrote (10 ms on a
    /// sequence dlock creates), so the next lock is a full statement
    /// again: a slower machine only waits longer.
    async fn past_the_lead(&self) {
        tokio::time::sleep(Duration::from_millis(30)).await;
    }

    /// Sets the sequence an hour ahead of the clock (within the day the
    /// draw allows); returns where.
    async fn set_hour_ahead(&self) -> i64 {
        let ahead = server_clock(&self.admin).await + 3_600_000_000;
        self.admin
            .execute(&format!("SELECT setval('{}', {ahead})", self.seq()), &[])
            .await
            .expect("setval");
        ahead
    }

    /// Has the backend's next locks send the quick statement for an
    /// hour: a full one reads the sequence an hour ahead.
    async fn make_quick_due(&self) {
        self.past_the_lead().await;
        self.set_hour_ahead().await;
        self.cycle().await;
    }

    fn seq(&self) -> String {
        seq(&self.scratch.name)
    }

    /// Which lock statement the backend's lock session sent last
    /// (`pg_stat_activity` shows the first 1024 bytes of its text).
    async fn last_statement(&self) -> &'static str {
        use dlock::pg::protocol::{TRY_LOCK, TRY_LOCK_NAMED, TRY_LOCK_NAMED_QUICK, TRY_LOCK_QUICK};
        let pid = self.backend.session_pids().await[0];
        let text: String = self
            .admin
            .query_one("SELECT query FROM pg_stat_activity WHERE pid = $1", &[&pid])
            .await
            .expect("pg_stat_activity")
            .get(0);
        let schema = format!("\"{}\"", self.scratch.name);
        let sent = |statement: &str| {
            let statement = statement.replace("{schema}", &schema);
            statement.get(..text.len()) == Some(text.as_str())
        };
        match () {
            () if sent(TRY_LOCK_QUICK) || sent(TRY_LOCK_NAMED_QUICK) => "quick",
            () if sent(TRY_LOCK) || sent(TRY_LOCK_NAMED) => "full",
            () => panic!("not a lock statement: {text}"),
        }
    }

    /// For a named lease, that readers find its token in its marks; then
    /// releases it, and checks that no lock statement left its key held
    /// behind it.
    async fn check_and_release(&self, lease: Lease) {
        if self.named {
            let seen = self.backend.holder(lease.key()).await.expect("read");
            let seen = seen.expect("held");
            assert_eq!(seen.token, Some(lease.token()), "the marks carry the token");
        }
        let key = lease.key().clone();
        lease.release().await.expect("release");
        assert!(
            free_on_the_server(&self.admin, &key).await,
            "the key is free once its lease let go: {key}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_takes_its_token_from_a_leading_sequence_in_one_quick_statement() {
    for named in [true, false] {
        let at = Fixture::new(named).await;
        at.past_the_lead().await;
        let ahead = at.set_hour_ahead().await;
        // The full statement reads the sequence an hour ahead...
        let (lease, sent) = at.take().await.expect("free");
        assert_eq!((at.last_statement().await, sent), ("full", 1));
        let mut last = lease.token().get() as i64;
        assert_eq!(last, ahead + 1, "the token is nextval's");
        at.check_and_release(lease).await;
        // ...so the quick one serves the hour after it.
        for _ in 0..3 {
            let (lease, sent) = at.take().await.expect("free");
            assert_eq!((at.last_statement().await, sent), ("quick", 1));
            let token = lease.token().get() as i64;
            assert_eq!(token, last + 1, "the token is nextval's");
            last = token;
            at.check_and_release(lease).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quick_lock_that_finds_the_sequence_behind_gives_the_lock_back_and_the_full_one_draws() {
    for named in [true, false] {
        let at = Fixture::new(named).await;
        for _ in 0..3 {
            at.make_quick_due().await;
            // Set back behind the clock (as a restore would), while the
            // backend believes it an hour ahead.
            set_just_behind(&at.admin, &at.scratch.name).await;
            let before = server_clock(&at.admin).await;
            let (lease, sent) = at.take().await.expect("free");
            let after = server_clock(&at.admin).await;
            assert_eq!((at.last_statement().await, sent), ("full", 2));
            let token = lease.token().get() as i64;
            assert!(
                (before + 10_000..=after + 10_000).contains(&token),
                "a draw that writes hands out the clock plus the lead: {token} against a \
                 clock of {before}..={after}"
            );
            at.check_and_release(lease).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quick_lock_that_finds_the_sequence_unfit_leaves_the_refusal_to_the_full_one() {
    for named in [true, false] {
        let at = Fixture::new(named).await;
        // Opened, and its statements prepared by a first lock, before the
        // ALTER (which a session that opens refuses) and before the lead
        // the quick statement is due for (so it sends the full one).
        let (other, other_proxy) = Fixture::connect(&at.scratch.name, named).await;
        LockOptions::new(Duration::from_secs(30))
            .acquire_on(Arc::new(other.clone()), &fresh_key("quick"))
            .await
            .expect("free")
            .release()
            .await
            .expect("release");
        at.make_quick_due().await;
        let sequence = at.seq();
        at.admin
            .batch_execute(&format!("ALTER SEQUENCE {sequence} CACHE 10"))
            .await
            .expect("alter");
        // A backend of its own sends the full statement alone, and the
        // one whose quick statement was due sends that one more.
        let mut sent = Vec::new();
        for (backend, proxy) in [(&at.backend, &at.proxy), (&other, &other_proxy)] {
            let before = proxy.pg_sent(b'B');
            let key = fresh_key("quick-unfit");
            let refused = LockOptions::new(Duration::from_secs(30))
                .acquire_on(Arc::new(backend.clone()), &key)
                .await
                .expect_err("an unfit sequence is refused");
            assert!(
                refused.to_string().contains("CACHE"),
                "the full statement's refusal names the setting: {refused}"
            );
            sent.push(proxy.pg_sent(b'B') - before);
            assert!(
                freed_on_the_server(&at.admin, &key).await,
                "nothing is left held by the refused attempt"
            );
        }
        assert_eq!(
            sent[0],
            sent[1] + 1,
            "the quick one gave back, the full one refused"
        );
        at.admin
            .batch_execute(&format!("ALTER SEQUENCE {sequence} CACHE 1"))
            .await
            .expect("restore");
        let (lease, _) = at.take().await.expect("fit again");
        at.check_and_release(lease).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_locking_less_often_than_the_lead_sends_one_statement_per_lock() {
    for named in [true, false] {
        let at = Fixture::new(named).await;
        for _ in 0..3 {
            at.past_the_lead().await;
            let (lease, sent) = at.take().await.expect("free");
            assert_eq!((at.last_statement().await, sent), ("full", 1));
            at.check_and_release(lease).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quick_lock_on_a_dropped_sequence_has_it_restored_and_leaves_nothing_held() {
    for named in [true, false] {
        let at = Fixture::new(named).await;
        at.make_quick_due().await;
        at.admin
            .batch_execute(&format!("DROP SEQUENCE {}", at.seq()))
            .await
            .expect("drop");
        // The quick statement fails on the missing sequence after taking
        // the lock; the backend undoes it, creates the sequence again and
        // takes the key (the new sequence behind the clock: the quick one
        // gives back, the full one draws).
        let before = server_clock(&at.admin).await;
        let (lease, _) = at.take().await.expect("restored");
        let after = server_clock(&at.admin).await;
        let token = lease.token().get() as i64;
        assert!(
            (before + 10_000..=after + 10_000).contains(&token),
            "a lost sequence hands out the clock plus the lead: {token} against a clock of \
             {before}..={after}"
        );
        at.check_and_release(lease).await;
    }
}

/// What an acquisition of a fresh key came to: its token, or its error's
/// text without the key and without numbers (sequence values, clocks).
async fn outcome(backend: &PgBackend) -> (Result<i64, String>, LockKey) {
    let key = fresh_key("quick-op");
    let taken = tokio::time::timeout(
        Duration::from_secs(20),
        LockOptions::new(Duration::from_secs(30)).acquire_on(Arc::new(backend.clone()), &key),
    )
    .await
    .expect("an acquisition answers: no hang");
    let outcome = match taken {
        Ok(lease) => {
            let token = lease.token().get() as i64;
            lease.release().await.expect("release");
            Ok(token)
        }
        Err(err) => Err(err
            .to_string()
            .replace(key.as_str(), "<key>")
            .replace(|c: char| c.is_ascii_digit(), "")),
    };
    (outcome, key)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dba_operation_on_the_sequence_is_answered_alike_with_the_quick_statement_due_or_not() {
    let day_ahead = "(EXTRACT(epoch FROM clock_timestamp()) * 1000000)::int8 + 90000000000";
    let operations = [
        "SELECT setval('{seq}', (EXTRACT(epoch FROM clock_timestamp()) * 1000000)::int8 + 1800000000)",
        "SELECT setval('{seq}', (EXTRACT(epoch FROM clock_timestamp()) * 1000000)::int8 - 1000000)",
        &format!("SELECT setval('{{seq}}', {day_ahead})"),
        "ALTER SEQUENCE {seq} INCREMENT -1 MINVALUE 1",
        "ALTER SEQUENCE {seq} CACHE 10",
        "ALTER SEQUENCE {seq} CYCLE",
        "DROP SEQUENCE {seq}",
        "DROP SEQUENCE {seq}; CREATE SEQUENCE {seq}",
        "ALTER SEQUENCE {seq} RENAME TO dlock_token_seq_old",
        "COMMENT ON SEQUENCE {seq} IS NULL",
    ];
    for operation in operations {
        for named in [true, false] {
            let at = Fixture::new(named).await;
            // Connected before the operation, which a session that opens
            // may refuse; it has drawn nothing, so it sends the full one.
            let (full, _proxy) = Fixture::connect(&at.scratch.name, named).await;
            at.make_quick_due().await;
            let sql = operation.replace("{seq}", &at.seq());
            at.admin.batch_execute(&sql).await.expect("the operation");
            let (quick_due, quick_key) = outcome(&at.backend).await;
            let (full_only, full_key) = outcome(&full).await;
            let seen = format!("{sql} (named: {named}): {quick_due:?} against {full_only:?}");
            assert_eq!(quick_due.is_ok(), full_only.is_ok(), "{seen}");
            if let (Err(quick), Err(full)) = (&quick_due, &full_only) {
                assert_eq!(quick, full, "the same refusal: {seen}");
            }
            // A failed attempt's transaction lets go an instant after
            // its error: `freed_on_the_server` waits for that.
            assert!(
                freed_on_the_server(&at.admin, &quick_key).await,
                "nothing held: {seen}"
            );
            assert!(
                freed_on_the_server(&at.admin, &full_key).await,
                "nothing held: {seen}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_session_prepares_its_quick_statement_with_the_full_one() {
    for named in [true, false] {
        let at = Fixture::new(named).await;
        at.make_quick_due().await;
        let parsed = at.proxy.pg_sent(b'P');
        let (lease, sent) = at.take().await.expect("free");
        assert_eq!((at.last_statement().await, sent), ("quick", 1));
        assert_eq!(
            at.proxy.pg_sent(b'P'),
            parsed,
            "the session's first quick statement was parsed beside the full one"
        );
        at.check_and_release(lease).await;
    }
}

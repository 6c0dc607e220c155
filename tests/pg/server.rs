//! `PgBackend` against bad input and its own PostgreSQL instances: wrong
//! password, both connection-string forms, TLS, a server restart, a restore
//! from an older copy, a failover to a streaming replica, an unreachable
//! host, missing privileges.
//!
//! Tests that need a server configured differently from the shared one
//! (password authentication, TLS, a restart) run their own
//! (`pg_support::OwnServer`).

use crate::pg_support;
use crate::support;

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;
use support::within;

use dlock::backend::OwnerId;
use dlock::pg::fence::PgFence;
use dlock::pg::tokio_postgres::{self, NoTls};
use dlock::pg::{PgBackend, PgOptions, TlsVerification, TransactionLock};
use dlock::{Backend, LockError, LockKey, LockOptions, LostReason};
use pg_support::{OwnServer, PASSWORD, PASSWORD_IN_URL, shared_conn};
use tokio::time::Instant;

/// A fresh key no other test (or earlier run) uses.
fn fresh_key(label: &str) -> LockKey {
    let id = OwnerId::random().expect("random bytes");
    LockKey::new(format!("dlock-test:{label}:{id}")).expect("valid key")
}

fn assert_no_password(text: &str) {
    for secret in [PASSWORD, PASSWORD_IN_URL, "s3cret"] {
        assert!(!text.contains(secret), "the password leaked: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_is_a_clear_error_that_never_shows_the_password() {
    let server = OwnServer::start();
    let wrong = format!(
        "postgresql://postgres:{PASSWORD_IN_URL}x@127.0.0.1:{}/postgres",
        server.port
    );
    let err = PgBackend::connect(&wrong)
        .await
        .expect_err("wrong password");
    let text = err.to_string();
    eprintln!("{text}");
    assert!(text.contains("password authentication failed"), "{text}");
    assert!(
        text.contains(&format!("postgres@127.0.0.1:{}", server.port)),
        "{text}"
    );
    assert_no_password(&text);
    assert_no_password(&format!("{err:?}"));
    let backend = PgBackend::connect(&server.conn(PASSWORD, ""))
        .await
        .expect("the right password works");
    assert_no_password(&format!("{backend:?}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_value_and_url_connection_strings_both_lock() {
    let server = OwnServer::start();
    let url = format!(
        "postgresql://postgres:{PASSWORD_IN_URL}@127.0.0.1:{}/postgres",
        server.port
    );
    for conn in [server.conn(PASSWORD, ""), url] {
        let backend: Arc<dyn Backend> = Arc::new(PgBackend::connect(&conn).await.expect("connect"));
        let lease = LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend, fresh_key("conn-forms"))
            .await
            .expect("free");
        lease.release().await.expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_encrypts_and_a_configured_root_certificate_is_verified() {
    let server = OwnServer::start();
    let conn = server.conn(PASSWORD, "sslmode=require");
    // libpq's `require`: encrypted, certificate not checked.
    let backend = PgBackend::connect(&conn).await.expect("TLS connect");
    let key = fresh_key("tls");
    let lease = LockOptions::new(Duration::from_secs(10))
        .acquire_on(Arc::new(backend.clone()), &key)
        .await
        .expect("free");
    let pids = backend.session_pids().await;
    let (client, connection) =
        tokio_postgres::connect(&server.conn(PASSWORD, "sslmode=disable"), NoTls)
            .await
            .expect("plain admin connection");
    tokio::spawn(connection);
    let encrypted: bool = client
        .query_one(
            "SELECT bool_and(ssl) FROM pg_stat_ssl WHERE pid = ANY($1)",
            &[&pids],
        )
        .await
        .expect("pg_stat_ssl")
        .get(0);
    assert!(encrypted, "the lock sessions use TLS");
    lease.release().await.expect("release");

    // The test CA verifies it, host name included; the public root store
    // does not.
    let verified = PgBackend::connect_with(
        &conn,
        PgOptions::new().tls(TlsVerification::RootCertificate(server.dir.join("ca.crt"))),
    )
    .await;
    assert!(verified.is_ok(), "{:?}", verified.err());
    let unverified =
        PgBackend::connect_with(&conn, PgOptions::new().tls(TlsVerification::PublicRoots))
            .await
            .expect_err("a self-signed certificate is not publicly trusted");
    eprintln!("{unverified}");
    assert!(
        unverified
            .to_string()
            .to_lowercase()
            .contains("certificate"),
        "{unverified}"
    );
    let missing = PgBackend::connect_with(
        &conn,
        PgOptions::new().tls(TlsVerification::RootCertificate(
            server.dir.join("missing.pem"),
        )),
    )
    .await
    .expect_err("a missing root certificate file");
    assert!(missing.to_string().contains("missing.pem"), "{missing}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_marks_every_lease_lost_and_tokens_keep_rising() {
    let server = OwnServer::start();
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&server.conn(PASSWORD, ""), PgOptions::new().sessions(2))
            .await
            .expect("connect"),
    );
    let mut leases = Vec::new();
    for _ in 0..4 {
        leases.push(
            LockOptions::new(Duration::from_secs(60))
                .acquire_on(backend.clone(), fresh_key("restart"))
                .await
                .expect("free"),
        );
    }
    let highest = leases.iter().map(|l| l.token()).max().expect("tokens");
    let stopped = server.pg_ctl_stop("fast");
    assert!(stopped.status.success(), "{stopped:?}");
    for lease in &leases {
        let lost = within(10, "the lost signal", lease.lost()).await;
        assert!(
            matches!(
                lost,
                LockError::LeaseLost {
                    reason: LostReason::SessionEnded(_),
                    ..
                }
            ),
            "{lost}"
        );
    }
    server.pg_ctl_start();
    let after = acquire_once_back(&backend, &fresh_key("restart")).await;
    assert!(
        after.token() > highest,
        "tokens keep rising across a restart"
    );
    after.release().await.expect("release");
}

/// A lease on `key` once the backend has found its way back to a
/// restarted server (its first attempts meet ended sessions or a server
/// still starting).
async fn acquire_once_back(backend: &Arc<dyn Backend>, key: &LockKey) -> dlock::Lease {
    let started = Instant::now();
    loop {
        match LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend.clone(), key)
            .await
        {
            Ok(lease) => return lease,
            Err(err) if started.elapsed() < Duration::from_secs(10) => {
                eprintln!("not yet: {err}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => panic!("the backend never recovered: {err}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_rising_after_the_database_is_restored_from_an_older_copy() {
    // A point-in-time restore, or a failover to a replica that missed the
    // latest WAL: the token sequence comes back as it was before the last
    // holders drew theirs, and the backend's sessions reconnect to it.
    let server = OwnServer::start();
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&server.conn(PASSWORD, ""), PgOptions::new().sessions(2))
            .await
            .expect("connect"),
    );
    let key = fresh_key("restore");
    let before = acquire_once_back(&backend, &key).await;
    let mut highest = before.token();
    before.release().await.expect("release");

    let stopped = server.pg_ctl_stop("fast");
    assert!(stopped.status.success(), "{stopped:?}");
    let backup = server.back_up();
    server.pg_ctl_start();
    for _ in 0..4 {
        let lease = acquire_once_back(&backend, &key).await;
        assert!(lease.token() > highest);
        highest = lease.token();
        lease.release().await.expect("release");
    }

    let stopped = server.pg_ctl_stop("fast");
    assert!(stopped.status.success(), "{stopped:?}");
    server.restore(&backup);
    server.pg_ctl_start();
    for round in 0..4 {
        let lease = acquire_once_back(&backend, &key).await;
        assert!(
            lease.token() > highest,
            "holder {round} after the restore got {}, not above {highest}",
            lease.token()
        );
        highest = lease.token();
        lease.release().await.expect("release");
    }
}

/// A connection string naming both servers, as an application names a
/// primary and its standby: the read-write one is used, whichever it is.
/// Neither server is ever paused (a stopped one refuses at once), so the
/// connect timeout is only for a machine slowed by other work: a password
/// exchange can take seconds then.
fn both(primary: &OwnServer, standby: &OwnServer) -> String {
    format!(
        "host=127.0.0.1,127.0.0.1 port={},{} user=postgres dbname=postgres password='{}' \
         target_session_attrs=read-write connect_timeout=15",
        primary.port,
        standby.port,
        PASSWORD.replace('\'', "\\'"),
    )
}

/// The last value of the token sequence on `server`, read directly.
async fn token_counter(server: &OwnServer) -> i64 {
    let (client, connection) = tokio_postgres::connect(&server.conn(PASSWORD, ""), NoTls)
        .await
        .expect("connect to the server");
    tokio::spawn(connection);
    client
        .query_one("SELECT last_value FROM dlock.dlock_token_seq", &[])
        .await
        .expect("read the token sequence")
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_to_a_replica_that_missed_the_last_tokens_new_tokens_still_exceed_them() {
    let primary = OwnServer::start();
    // The schema and the sequence exist before the replica copies them.
    let key = fresh_key("failover");
    {
        let backend: Arc<dyn Backend> = Arc::new(
            PgBackend::connect_with(&primary.conn(PASSWORD, ""), PgOptions::new().sessions(1))
                .await
                .expect("connect"),
        );
        acquire_once_back(&backend, &key)
            .await
            .release()
            .await
            .expect("release");
    }
    let standby = primary.start_replica();
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&both(&primary, &standby), PgOptions::new().sessions(2))
            .await
            .expect("connect to the pair"),
    );
    let mut highest = 0;
    for _ in 0..3 {
        let lease = acquire_once_back(&backend, &key).await;
        highest = highest.max(lease.token().get());
        lease.release().await.expect("release");
    }
    // The standby stops receiving; the primary goes on handing out tokens
    // it will never see (more than the 32 values a sequence logs ahead,
    // so a bare sequence would come back below them), then dies.
    let stopped = standby.pg_ctl_stop("fast");
    assert!(stopped.status.success(), "{stopped:?}");
    for _ in 0..40 {
        let lease = acquire_once_back(&backend, &key).await;
        highest = highest.max(lease.token().get());
        lease.release().await.expect("release");
    }
    let stopped = primary.pg_ctl_stop("immediate");
    assert!(stopped.status.success(), "{stopped:?}");
    standby.pg_ctl_start();
    standby.promote();
    let counter = token_counter(&standby).await;
    assert!(
        (counter as u64) < highest,
        "the promoted replica must have missed the last tokens for this to test anything \
         (its counter {counter}, the highest token {highest})"
    );
    for round in 0..3 {
        let lease = acquire_once_back(&backend, &key).await;
        assert!(
            lease.token().get() > highest,
            "holder {round} after the failover got {}, not above {highest}",
            lease.token()
        );
        highest = lease.token().get();
        lease.release().await.expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_session_died_in_a_failover_is_told_and_the_new_primary_grants_the_key() {
    let primary = OwnServer::start();
    let standby = primary.start_replica();
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&both(&primary, &standby), PgOptions::new().sessions(2))
            .await
            .expect("connect to the pair"),
    );
    let key = fresh_key("failover-holder");
    let held = acquire_once_back(&backend, &key).await;
    let before = held.token();
    let stopped = primary.pg_ctl_stop("immediate");
    assert!(stopped.status.success(), "{stopped:?}");
    standby.promote();
    let lost = within(30, "the lost signal", held.lost()).await;
    assert!(
        matches!(
            lost,
            LockError::LeaseLost {
                reason: LostReason::SessionEnded(_) | LostReason::Unreachable(_),
                ..
            }
        ),
        "{lost}"
    );
    let after = acquire_once_back(&backend, &key).await;
    assert!(
        after.token() > before,
        "tokens keep rising across the failover"
    );
    after.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_host_fails_within_the_connect_timeout() {
    // Nothing listens: refused at once.
    let closed = support::RefusedPort::new();
    let refused = format!(
        "host=127.0.0.1 port={} user=postgres dbname=test",
        closed.port
    );
    let started = Instant::now();
    let err = within(5, "connect to a closed port", PgBackend::connect(&refused))
        .await
        .expect_err("nothing listens there");
    assert!(err.to_string().contains("cannot connect"), "{err}");
    eprintln!("refused after {:?}", started.elapsed());

    // Accepts and never answers: only the connect timeout ends it.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = silent.local_addr().expect("addr").port();
    let hold = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            open.push(socket);
        }
    });
    let conn = format!("host=127.0.0.1 port={port} user=postgres dbname=test");
    let started = Instant::now();
    let err = within(
        5,
        "connect to a silent server",
        PgBackend::connect_with(
            &conn,
            PgOptions::new().connect_timeout(Duration::from_millis(500)),
        ),
    )
    .await
    .expect_err("a silent server");
    eprintln!("silent server gave up after {:?}", started.elapsed());
    eprintln!("{err}");
    assert!(err.to_string().contains("connect timeout"), "{err}");
    hold.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_privileges_are_a_clear_error_naming_what_to_create_and_grant() {
    let (admin, connection) = tokio_postgres::connect(&shared_conn(), NoTls)
        .await
        .expect("admin connection");
    tokio::spawn(connection);
    let id = OwnerId::random().expect("random").to_string();
    let role = format!("dlock_nopriv_{}", &id[..12]);
    let schema = format!("dlock_priv_{}", &id[..12]);
    admin
        .batch_execute(&format!("CREATE ROLE {role} LOGIN"))
        .await
        .expect("create role");
    let config: tokio_postgres::Config = shared_conn().parse().expect("config");
    let conn = format!(
        "host=127.0.0.1 port={} user={role} dbname={}",
        config.get_ports().first().copied().unwrap_or(5432),
        config.get_dbname().unwrap_or("test"),
    );
    let _cleanup = DropOnExit(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE; DROP ROLE IF EXISTS {role};"
    ));
    {
        // Nothing exists and the role may not create it.
        let err = PgBackend::connect_with(&conn, PgOptions::new().schema(&schema))
            .await
            .expect_err("no CREATE privilege");
        let text = err.to_string();
        eprintln!("{text}");
        assert!(text.contains("may not create"), "{text}");
        assert!(
            text.contains(&format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\"")),
            "{text}"
        );
        assert!(text.contains("CREATE SEQUENCE IF NOT EXISTS"), "{text}");
        assert!(
            text.contains(&format!("GRANT USAGE ON SCHEMA \"{schema}\" TO {role}")),
            "{text}"
        );

        // A DBA created the objects but granted nothing.
        admin
            .batch_execute(&format!(
                "CREATE SCHEMA {schema}; CREATE SEQUENCE {schema}.dlock_token_seq AS bigint;"
            ))
            .await
            .expect("pre-create");
        let err = PgBackend::connect_with(&conn, PgOptions::new().schema(&schema))
            .await
            .expect_err("no USAGE privilege");
        assert!(err.to_string().contains("lacks privileges"), "{err}");

        // With the grants the error named, it works.
        admin
            .batch_execute(&format!(
                "GRANT USAGE ON SCHEMA {schema} TO {role}; \
                 GRANT USAGE ON SEQUENCE {schema}.dlock_token_seq TO {role};"
            ))
            .await
            .expect("grant");
        let backend: Arc<dyn Backend> = Arc::new(
            PgBackend::connect_with(&conn, PgOptions::new().schema(&schema))
                .await
                .expect("usable with the grants"),
        );
        let lease = LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend, fresh_key("least-privilege"))
            .await
            .expect("free");
        lease.release().await.expect("release");
    }
}

/// Runs SQL on the shared server when dropped, even if the test panicked.
struct DropOnExit(String);

impl Drop for DropOnExit {
    fn drop(&mut self) {
        let sql = std::mem::take(&mut self.0);
        // A runtime of its own on a thread of its own: this may run while
        // the test's runtime is unwinding.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async move {
                let (client, connection) =
                    tokio_postgres::connect(&shared_conn(), NoTls).await.ok()?;
                tokio::spawn(connection);
                client.batch_execute(&sql).await.ok()
            })
        })
        .join();
    }
}

#[tokio::test]
async fn bad_options_and_connection_strings_are_errors_that_do_not_echo_secrets() {
    let err = PgBackend::connect("postgresql://u:s3cret@127.0.0.1:notaport/db")
        .await
        .expect_err("bad port");
    assert!(
        err.to_string()
            .contains("invalid PostgreSQL connection string"),
        "{err}"
    );
    assert_no_password(&err.to_string());
    let err = PgBackend::connect("host=127.0.0.1 password=s3cret bogus=1")
        .await
        .expect_err("unknown option");
    assert_no_password(&err.to_string());
    for (options, name) in [
        (PgOptions::new().schema("Robert'); DROP"), "schema"),
        (PgOptions::new().sessions(0), "sessions"),
        (
            PgOptions::new()
                .liveness_interval(Duration::from_secs(5))
                .server_idle_timeout(Some(Duration::from_secs(6))),
            "server_idle_timeout",
        ),
    ] {
        let err = PgBackend::connect_with(&shared_conn(), options)
            .await
            .expect_err("bad option");
        assert!(
            matches!(err, LockError::InvalidOption { option, .. } if option == name),
            "{err}"
        );
    }
}

/// The PostgreSQL SSLRequest: length 8, code 80877103.
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

/// A man in the middle on loopback that strips TLS, as anyone on the
/// network path can: it answers the client's SSLRequest with `N` ("this
/// server does not do TLS") and relays whatever the client sends next, in
/// plain text, to the real server. It counts what it saw.
struct TlsStripper {
    port: u16,
    /// Connections accepted from clients.
    accepted: Arc<AtomicUsize>,
    /// Connections whose handling has ended.
    finished: Arc<AtomicUsize>,
    /// Plain-text sessions relayed to the real server.
    relayed: Arc<AtomicUsize>,
    accept: tokio::task::AbortHandle,
}

impl TlsStripper {
    /// Listens on a free loopback port, relaying to the shared server.
    async fn start() -> Self {
        let config: tokio_postgres::Config = shared_conn().parse().expect("shared config");
        let upstream = (
            "127.0.0.1",
            config.get_ports().first().copied().unwrap_or(5432),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let finished = Arc::new(AtomicUsize::new(0));
        let relayed = Arc::new(AtomicUsize::new(0));
        let accept = tokio::spawn({
            let (accepted, finished, relayed) =
                (accepted.clone(), finished.clone(), relayed.clone());
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    accepted.fetch_add(1, SeqCst);
                    let (finished, relayed) = (finished.clone(), relayed.clone());
                    tokio::spawn(async move {
                        strip_tls(client, upstream, &relayed).await;
                        finished.fetch_add(1, SeqCst);
                    });
                }
            }
        })
        .abort_handle();
        Self {
            port,
            accepted,
            finished,
            relayed,
            accept,
        }
    }

    /// A key-value connection string to the shared server through the proxy.
    fn conn(&self, extra: &str) -> String {
        let config: tokio_postgres::Config = shared_conn().parse().expect("shared config");
        format!(
            "host=127.0.0.1 port={} user={} dbname={} {extra}",
            self.port,
            config.get_user().unwrap_or("postgres"),
            config.get_dbname().unwrap_or("test"),
        )
    }

    /// How many plain-text sessions reached the real server, once every
    /// accepted connection has been dealt with.
    async fn relayed_once_settled(&self) -> usize {
        within(10, "the proxy finishing its connections", async {
            while self.finished.load(SeqCst) < self.accepted.load(SeqCst) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        self.relayed.load(SeqCst)
    }
}

impl Drop for TlsStripper {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn strip_tls(
    mut client: tokio::net::TcpStream,
    upstream: (&str, u16),
    relayed: &AtomicUsize,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut first = [0u8; 8];
    if client.read_exact(&mut first).await.is_err() {
        return;
    }
    let mut pending = Vec::new();
    if first == SSL_REQUEST {
        if client.write_all(b"N").await.is_err() {
            return;
        }
    } else {
        pending.extend_from_slice(&first);
    }
    if pending.is_empty() {
        // What a downgraded client sends next: its startup message, in the clear.
        let mut buf = vec![0u8; 4096];
        match client.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => pending.extend_from_slice(&buf[..n]),
        }
    }
    let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else {
        return;
    };
    relayed.fetch_add(1, SeqCst);
    if server.write_all(&pending).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_check_requires_tls_so_a_tls_stripping_proxy_gets_no_session() {
    let certs = support::ScratchDir::new("dlock-strip");
    support::make_test_certificates(&certs);
    for (verification, sslmode) in [
        (TlsVerification::PublicRoots, ""),
        (TlsVerification::PublicRoots, "sslmode=prefer"),
        (TlsVerification::RootCertificate(certs.join("ca.crt")), ""),
        (
            TlsVerification::RootCertificate(certs.join("ca.crt")),
            "sslmode=require",
        ),
    ] {
        let proxy = TlsStripper::start().await;
        let asked = format!("{verification:?} {sslmode}");
        let err = within(
            15,
            "connecting through the TLS-stripping proxy",
            PgBackend::connect_with(&proxy.conn(sslmode), PgOptions::new().tls(verification)),
        )
        .await
        .expect_err("a server that declines TLS must be refused when a certificate check is asked");
        eprintln!("{asked}: {err}");
        assert!(matches!(err, LockError::Backend { .. }), "{asked}: {err:?}");
        assert!(
            err.to_string().contains("does not support TLS"),
            "{asked}: the error must say the server declined TLS: {err}"
        );
        assert_eq!(
            proxy.relayed_once_settled().await,
            0,
            "{asked}: no plain-text session may be opened"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_check_beside_sslmode_disable_is_refused_before_connecting() {
    let proxy = TlsStripper::start().await;
    let err = PgBackend::connect_with(
        &proxy.conn("sslmode=disable"),
        PgOptions::new().tls(TlsVerification::PublicRoots),
    )
    .await
    .expect_err("sslmode=disable contradicts a certificate check");
    eprintln!("{err}");
    assert!(
        matches!(err, LockError::InvalidOption { option: "tls", .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("sslmode=disable"), "{err}");
    assert_eq!(proxy.accepted.load(SeqCst), 0, "nothing may be sent");
}

/// libpq's documented behaviour, which dlock keeps for `EncryptOnly`: under
/// `sslmode=prefer` a man in the middle that declines TLS gets the session
/// in plain text. (Under `require` declining fails, but a man in the middle
/// can present a certificate of its own instead: only a check stops it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypt_only_under_sslmode_prefer_is_downgraded_to_plain_text_by_a_tls_stripping_proxy() {
    let proxy = TlsStripper::start().await;
    let backend = within(
        15,
        "connecting through the TLS-stripping proxy",
        PgBackend::connect(&proxy.conn("")),
    )
    .await
    .expect("EncryptOnly + prefer accepts a server that declines TLS");
    assert_eq!(
        proxy.relayed.load(SeqCst),
        1,
        "the session went through in plain text"
    );
    let pids = backend.session_pids().await;
    let (client, connection) = tokio_postgres::connect(&shared_conn(), NoTls)
        .await
        .expect("admin connection");
    tokio::spawn(connection);
    let encrypted: Option<bool> = client
        .query_one(
            "SELECT bool_or(ssl) FROM pg_stat_ssl WHERE pid = ANY($1)",
            &[&pids],
        )
        .await
        .expect("pg_stat_ssl")
        .get(0);
    assert_eq!(encrypted, Some(false), "the lock session is in plain text");

    let refused = PgBackend::connect(&proxy.conn("sslmode=require"))
        .await
        .expect_err("require refuses a server that declines TLS");
    assert!(
        refused.to_string().contains("does not support TLS"),
        "{refused}"
    );
}

/// Connects a plain client (as an application or a DBA would) and drives it.
async fn plain_client(conn: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(conn, NoTls)
        .await
        .expect("plain connection");
    tokio::spawn(connection);
    client
}

/// What a role with CREATE on `public` (every role before PostgreSQL 15,
/// and every database upgraded from one) can put in the lock role's way:
/// functions named like the ones dlock calls — with dlock's argument types
/// and with `text` ones, which an untyped literal prefers — and a `<=`
/// operator on `bigint`. Each logs that it ran, as whom, and lies: a
/// token of its choosing, a lock that is not taken, a stale write that
/// passes. The lock role's `search_path` puts `public` first, as a DBA's
/// `ALTER ROLE … SET search_path` can. None of it may run in a statement
/// dlock sends — on its own sessions, in the caller's `TransactionLock`
/// transaction, or in `PgFence::accept`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn functions_and_operators_shadowed_on_the_search_path_never_run_in_locks_tokens_or_fences() {
    let server = OwnServer::start();
    let admin_conn = server.conn(PASSWORD, "");
    let admin = plain_client(&admin_conn).await;
    admin
        .batch_execute(
            "CREATE ROLE app LOGIN PASSWORD 'app-pw';
             CREATE ROLE mallory LOGIN PASSWORD 'mallory-pw';
             GRANT CREATE ON SCHEMA public TO PUBLIC;
             ALTER ROLE app SET search_path = public, pg_catalog;
             CREATE SCHEMA dlock;
             CREATE SEQUENCE dlock.dlock_token_seq AS bigint;
             GRANT USAGE ON SCHEMA dlock TO app;
             GRANT USAGE, UPDATE ON SEQUENCE dlock.dlock_token_seq TO app;
             CREATE TABLE dlock.dlock_fence (resource text PRIMARY KEY, token bigint NOT NULL);
             GRANT SELECT, INSERT, UPDATE ON dlock.dlock_fence TO app;
             CREATE TABLE public.loot (who text, what text);
             GRANT INSERT ON public.loot TO PUBLIC;",
        )
        .await
        .expect("roles and objects");
    let mallory = plain_client(&format!(
        "host=127.0.0.1 port={} user=mallory password=mallory-pw dbname=postgres",
        server.port
    ))
    .await;
    mallory
        .batch_execute(
            "CREATE FUNCTION public.ran(what text) RETURNS boolean LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ INSERT INTO public.loot VALUES (current_user, what); SELECT true $$;
             CREATE FUNCTION public.nextval(text) RETURNS bigint LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ SELECT 9000000000000000000 FROM (SELECT public.ran('nextval(text)')) AS r $$;
             CREATE FUNCTION public.nextval(regclass) RETURNS bigint LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ SELECT 9000000000000000000 FROM (SELECT public.ran('nextval(regclass)')) AS r $$;
             CREATE FUNCTION public.setval(regclass, bigint) RETURNS bigint LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ SELECT 9000000000000000000 FROM (SELECT public.ran('setval')) AS r $$;
             CREATE FUNCTION public.clock_timestamp() RETURNS timestamptz LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ SELECT timestamptz '2000-01-01' FROM (SELECT public.ran('clock_timestamp')) AS r $$;
             CREATE FUNCTION public.hashtextextended(text, bigint) RETURNS bigint LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ SELECT 42::bigint FROM (SELECT public.ran('hashtextextended')) AS r $$;
             CREATE FUNCTION public.pg_try_advisory_lock(bigint) RETURNS boolean LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ SELECT public.ran('pg_try_advisory_lock') $$;
             CREATE FUNCTION public.pg_try_advisory_xact_lock(bigint) RETURNS boolean LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ SELECT public.ran('pg_try_advisory_xact_lock') $$;
             CREATE FUNCTION public.pg_advisory_xact_lock(bigint) RETURNS void LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ SELECT FROM (SELECT public.ran('pg_advisory_xact_lock')) AS r $$;
             CREATE FUNCTION public.pg_advisory_unlock(bigint) RETURNS boolean LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ SELECT public.ran('pg_advisory_unlock') $$;
             CREATE FUNCTION public.pg_backend_pid() RETURNS integer LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ SELECT 1 FROM (SELECT public.ran('pg_backend_pid')) AS r $$;
             CREATE FUNCTION public.current_setting(text) RETURNS text LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ SELECT '0' FROM (SELECT public.ran('current_setting')) AS r $$;
             CREATE FUNCTION public.set_config(text, text, boolean) RETURNS text LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ SELECT $2 FROM (SELECT public.ran('set_config')) AS r $$;
             CREATE FUNCTION public.always(bigint, bigint) RETURNS boolean LANGUAGE sql
               SET search_path = pg_catalog AS
               $$ SELECT public.ran('operator <=') $$;
             CREATE OPERATOR public.<= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = public.always);",
        )
        .await
        .expect("mallory's functions and operator");

    let app_conn = format!(
        "host=127.0.0.1 port={} user=app password=app-pw dbname=postgres",
        server.port
    );
    let backend: Arc<dyn Backend> = Arc::new(
        PgBackend::connect(&app_conn)
            .await
            .expect("the lock role connects"),
    );
    let other: Arc<dyn Backend> = Arc::new(
        PgBackend::connect(&admin_conn)
            .await
            .expect("another process connects"),
    );
    let key = fresh_key("search-path");
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros() as u64;

    // PgBackend: the lock is really taken, and tokens are the clock's.
    let first = LockOptions::new(Duration::from_secs(30))
        .acquire_on(Arc::clone(&backend), &key)
        .await
        .expect("free");
    let meanwhile = LockOptions::new(Duration::from_secs(30))
        .acquire_on(Arc::clone(&other), &key)
        .await;
    assert!(
        matches!(meanwhile, Err(LockError::Held { .. })),
        "another process took the key while it was held: {meanwhile:?}"
    );
    let first_token = first.token();
    first.release().await.expect("release");
    let second = LockOptions::new(Duration::from_secs(30))
        .acquire_on(Arc::clone(&backend), &key)
        .await
        .expect("free again");
    let second_token = second.token();
    second.release().await.expect("release");
    assert!(
        second_token > first_token,
        "{first_token} -> {second_token}"
    );
    for token in [first_token, second_token] {
        assert!(
            token.get().abs_diff(now_us) < 3_600_000_000,
            "token {token} is not the server clock in µs (about {now_us})"
        );
    }

    // TransactionLock in the lock role's own transaction (its search_path).
    let mut app = plain_client(&app_conn).await;
    let admin_tx_conn = plain_client(&admin_conn).await;
    let mut xact_tokens = Vec::new();
    // Without a wait, and with one (which swaps lock_timeout around a
    // waiting lock statement).
    for wait in [Duration::ZERO, Duration::from_secs(1)] {
        let mut tx = app.transaction().await.expect("begin");
        let token = TransactionLock::new()
            .wait(wait)
            .acquire(&mut tx, key.as_str())
            .await
            .expect("transaction lock");
        let taken_elsewhere: bool = admin_tx_conn
            .query_one(
                "SELECT pg_try_advisory_lock(hashtextextended($1::text, 0))",
                &[&key.as_str()],
            )
            .await
            .expect("try elsewhere")
            .get(0);
        assert!(
            !taken_elsewhere,
            "the transaction lock was not taken on the server"
        );
        tx.commit().await.expect("commit");
        xact_tokens.push(token);
    }
    assert!(
        xact_tokens[0] > second_token && xact_tokens[1] > xact_tokens[0],
        "{second_token} -> {xact_tokens:?}"
    );

    // PgFence in the lock role's transaction: a stale token is refused.
    let fence = PgFence::new();
    let tx = app.transaction().await.expect("begin");
    fence
        .accept(&tx, "search-path:resource", second_token)
        .await
        .expect("the current holder writes");
    tx.commit().await.expect("commit");
    let tx = app.transaction().await.expect("begin");
    let stale = fence.accept(&tx, "search-path:resource", first_token).await;
    tx.rollback().await.expect("rollback");
    assert!(
        matches!(stale, Err(LockError::StaleToken { .. })),
        "a stale write was accepted: {stale:?}"
    );

    let ran: Vec<String> = admin
        .query(
            "SELECT what || ' x' || count(*) FROM public.loot WHERE who = 'app' GROUP BY what",
            &[],
        )
        .await
        .expect("loot")
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert!(
        ran.is_empty(),
        "mallory's code ran as the lock role: {ran:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_statements_move_the_sequence_without_waiting_for_a_wal_flush() {
    // Nearly every lock statement `setval`s the token sequence (the clock
    // has moved on since the last one), which writes WAL and takes a
    // transaction id; its commit must not wait for that WAL to be written
    // out, or every lock would cost a disk flush. Counted on a server of
    // the test's own: WAL records written by the lock sessions, and the
    // times WAL was written out, which a synchronous commit does once per
    // transaction.
    let server = OwnServer::start();
    let admin = plain_client(&server.conn(PASSWORD, "")).await;
    let backend = PgBackend::connect(&server.conn(PASSWORD, ""))
        .await
        .expect("connect");
    let shared: Arc<dyn Backend> = Arc::new(backend.clone());
    let pids = backend.session_pids().await;
    // The WAL writer writes out pending asynchronous commits every
    // wal_writer_delay (200 ms by default), so its writes grow with the
    // test's wall time on a slow machine: 10 s (the most allowed) leaves it
    // a write or two, while commits that wait write once each.
    admin
        .batch_execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
        .await
        .expect("a slow WAL writer");
    admin
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .expect("reload");
    within(10, "the server to read its settings again", async {
        loop {
            let delay: String = admin
                .query_one("SHOW wal_writer_delay", &[])
                .await
                .expect("wal_writer_delay")
                .get(0);
            if delay == "10s" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    admin
        .query_one("SELECT pg_stat_reset_shared('wal')", &[])
        .await
        .expect("reset the WAL statistics");
    const LOCKS: i64 = 300;
    for i in 0..LOCKS {
        let lease = LockOptions::new(Duration::from_secs(30))
            .acquire_on(Arc::clone(&shared), fresh_key(&format!("wal-{i}")))
            .await
            .expect("free");
        lease.release().await.expect("release");
    }
    // A server process reports its WAL statistics when it exits: end the
    // lock sessions, and wait until they are gone.
    drop(shared);
    drop(backend);
    within(10, "the lock sessions to end", async {
        loop {
            let left: i64 = admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)",
                    &[&pids],
                )
                .await
                .expect("pg_stat_activity")
                .get(0);
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    admin
        .batch_execute("SELECT pg_stat_clear_snapshot()")
        .await
        .expect("fresh statistics");
    let row = admin
        .query_one("SELECT wal_records, wal_write FROM pg_stat_wal", &[])
        .await
        .expect("pg_stat_wal");
    let (records, writes): (i64, i64) = (row.get(0), row.get(1));
    eprintln!("{LOCKS} locks: {records} WAL records, WAL written out {writes} times");
    assert!(
        records >= LOCKS,
        "the lock statements moved the sequence (a WAL record each): {records} records"
    );
    assert!(
        writes < LOCKS / 4,
        "{LOCKS} locks wrote WAL out {writes} times: their commits waited for it"
    );
}

/// A force release by a role that may end other sessions
/// (`pg_signal_backend`) but not see their start (`pg_read_all_stats`),
/// naming a lease with a record (one taken with an identity): the start is
/// what tells the record's session from a later one with its pid, so the
/// force release ends nothing and says what the role lacks, rather than
/// that the holder changed. A plain lease's token is in the lock table
/// itself, which tells its session apart without the start: naming it
/// ends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_release_by_a_role_that_cannot_see_the_holders_session_says_so_and_ends_nothing() {
    let (admin, connection) = tokio_postgres::connect(&shared_conn(), NoTls)
        .await
        .expect("admin connection");
    tokio::spawn(connection);
    let id = OwnerId::random().expect("random").to_string();
    let (holder_role, operator_role) = (
        format!("dlock_h_{}", &id[..12]),
        format!("dlock_o_{}", &id[..12]),
    );
    let schema = format!("dlock_sig_{}", &id[..12]);
    let _cleanup = DropOnExit(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE; DROP ROLE IF EXISTS {holder_role}; \
         DROP ROLE IF EXISTS {operator_role};"
    ));
    admin
        .batch_execute(&format!(
            "CREATE ROLE {holder_role} LOGIN; CREATE ROLE {operator_role} LOGIN; \
             GRANT pg_signal_backend TO {operator_role}; \
             CREATE SCHEMA {schema} AUTHORIZATION {holder_role};"
        ))
        .await
        .expect("roles and schema");
    let config: tokio_postgres::Config = shared_conn().parse().expect("config");
    let as_role = |role: &str| {
        format!(
            "host=127.0.0.1 port={} user={role} dbname={}",
            config.get_ports().first().copied().unwrap_or(5432),
            config.get_dbname().unwrap_or("test"),
        )
    };
    let holder: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&as_role(&holder_role), PgOptions::new().schema(&schema))
            .await
            .expect("the holder's role owns the schema"),
    );
    let key = dlock_runtime::conformance::fresh_key("forced-hidden-start");
    let owner = OwnerId::random().expect("owner");
    let request = dlock::backend::AcquireRequest::new(&key, &owner, Duration::from_secs(30))
        .with_identity(Some("node-a"));
    let Ok(dlock::backend::Attempt::Acquired(grant)) = holder.try_acquire(&request).await else {
        panic!("`{key}` must be free");
    };
    let plain_key = dlock_runtime::conformance::fresh_key("forced-hidden-start-plain");
    let plain = LockOptions::new(Duration::from_secs(30))
        .acquire_on(holder.clone(), plain_key.clone())
        .await
        .expect("free");
    admin
        .batch_execute(&format!(
            "GRANT USAGE ON SCHEMA {schema} TO {operator_role}; \
             GRANT ALL ON ALL SEQUENCES IN SCHEMA {schema} TO {operator_role}; \
             GRANT ALL ON ALL TABLES IN SCHEMA {schema} TO {operator_role};"
        ))
        .await
        .expect("grants");
    let operator: Arc<dyn Backend> = Arc::new(
        PgBackend::connect_with(&as_role(&operator_role), PgOptions::new().schema(&schema))
            .await
            .expect("the operator's role"),
    );
    let answer = operator
        .force_release_holding(&key, &dlock::backend::Holding::new(Some(grant.token), None))
        .await;
    let text = match &answer {
        Err(err) => err.to_string(),
        Ok(other) => {
            panic!("a force release that cannot tell the session apart answered {other:?}")
        }
    };
    assert!(text.contains("pg_read_all_stats"), "{text}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(plain.check().is_ok(), "nothing may be ended: {text}");
    let shown = operator
        .holder(&plain_key)
        .await
        .expect("read")
        .expect("held");
    assert_eq!(shown.token, Some(plain.token()), "read from the lock table");
    let answer = operator.force_release_holding(&plain_key, &shown).await;
    assert_eq!(
        answer.expect("ends it"),
        dlock::backend::ForceRelease::Released
    );
    drop((operator, holder, plain));
}

//! `PgBackend` against bad input and its own PostgreSQL instances: wrong
//! password, both connection-string forms, TLS, a server restart, a restore
//! from an older copy, an unreachable host, missing privileges.
//!
//! Tests that need a server configured differently from the shared one
//! (password authentication, TLS, a restart) run their own: `initdb` and
//! `pg_ctl` from the PostgreSQL installation, as user `postgres` when run as
//! root (PostgreSQL refuses root), on a free loopback port, removed again by
//! a drop guard.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;
use support::within;

use dlock::backend::OwnerId;
use dlock::pg::tokio_postgres::{self, NoTls};
use dlock::pg::{PgBackend, PgOptions, TlsVerification};
use dlock::{Backend, LockError, LockKey, LockOptions, LostReason};
use tokio::time::Instant;

const PASSWORD: &str = "s3cret pass'word";
/// The password as it appears in a URL.
const PASSWORD_IN_URL: &str = "s3cret%20pass%27word";

fn shared_conn() -> String {
    std::env::var("DLOCK_PG_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".to_owned())
}

/// A fresh key no other test (or earlier run) uses.
fn fresh_key(label: &str) -> LockKey {
    let id = OwnerId::random().expect("random bytes");
    LockKey::new(format!("dlock-test:{label}:{id}")).expect("valid key")
}

/// A PostgreSQL instance of the test's own, with password authentication
/// and TLS (self-signed certificate for 127.0.0.1), stopped and removed on
/// drop.
struct OwnServer {
    dir: PathBuf,
    port: u16,
    bin: PathBuf,
}

impl OwnServer {
    fn start() -> Self {
        let bin = pg_bin_dir();
        let id = OwnerId::random().expect("random");
        // Under /tmp: the `postgres` user must be able to reach it.
        let dir = std::env::temp_dir().join(format!("dlock-pg-{id}"));
        std::fs::create_dir_all(&dir).expect("server dir");
        let server = Self {
            dir,
            port: free_port(),
            bin,
        };
        let pwfile = server.dir.join("pw");
        std::fs::write(&pwfile, PASSWORD).expect("pwfile");
        let cert = server.dir.join("server.crt");
        let key = server.dir.join("server.key");
        support::make_test_certificates(&server.dir);
        if is_root() {
            run(Command::new("chown").args(["-R", "postgres:postgres", path(&server.dir)]));
        }
        run(server.as_postgres("initdb").args([
            "-D",
            path(&server.data()),
            "-U",
            "postgres",
            "--pwfile",
            path(&pwfile),
            "--auth=scram-sha-256",
            "-E",
            "UTF8",
            "--no-sync",
        ]));
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("key mode");
        let settings = format!(
            "\nlisten_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n\
             fsync = off\nssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\nmax_connections = 40\n",
            server.port,
            server.dir.display(),
            cert.display(),
            key.display(),
        );
        let conf = server.data().join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).expect("postgresql.conf");
        text.push_str(&settings);
        std::fs::write(&conf, text).expect("write postgresql.conf");
        server.pg_ctl_start();
        server
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn as_postgres(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        if is_root() {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(program);
            command
        } else {
            Command::new(program)
        }
    }

    fn pg_ctl_start(&self) {
        let log = self.dir.join("log");
        run(self.as_postgres("pg_ctl").args([
            "-D",
            path(&self.data()),
            "-l",
            path(&log),
            "-w",
            "-t",
            "30",
            "start",
        ]));
    }

    fn pg_ctl_stop(&self, mode: &str) -> Output {
        self.as_postgres("pg_ctl")
            .args(["-D", path(&self.data()), "-m", mode, "-w", "stop"])
            .output()
            .expect("pg_ctl stop")
    }

    /// Copies the data directory of the stopped server aside, as a backup.
    fn back_up(&self) -> PathBuf {
        let copy = self.dir.join("backup");
        run(Command::new("cp").args(["-a", path(&self.data()), path(&copy)]));
        copy
    }

    /// Puts a backup made by [`OwnServer::back_up`] back in place of the
    /// stopped server's data directory.
    fn restore(&self, backup: &Path) {
        std::fs::remove_dir_all(self.data()).expect("remove the data directory");
        run(Command::new("cp").args(["-a", path(backup), path(&self.data())]));
    }

    /// A key-value connection string for this server.
    fn conn(&self, password: &str, extra: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres password='{}' {extra}",
            self.port,
            password.replace('\\', "\\\\").replace('\'', "\\'")
        )
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = self.pg_ctl_stop("immediate");
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn run(command: &mut Command) {
    let out = command.output().expect("run helper program");
    assert!(
        out.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The newest `/usr/lib/postgresql/<version>/bin`, or the `PATH`.
fn pg_bin_dir() -> PathBuf {
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| {
            let version: u32 = e.file_name().to_str()?.parse().ok()?;
            Some((version, e.path().join("bin")))
        })
        .filter(|(_, bin)| bin.join("initdb").exists())
        .max_by_key(|(version, _)| *version);
    newest.map(|(_, bin)| bin).unwrap_or_default()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_host_fails_within_the_connect_timeout() {
    // Nothing listens: refused at once.
    let refused = format!(
        "host=127.0.0.1 port={} user=postgres dbname=test",
        free_port()
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

//! No credential is ever printed. For every URL form of both backends, a
//! password of its own must appear nowhere in what dlock shows: `Debug` of
//! builders, options, backends and errors, `Display`, every error's whole
//! `source()` chain, and everything traced in the process (dlock's events
//! and its client libraries' `log` records), captured at TRACE.
//!
//! The servers are the tests' own (password authentication on): a Redis
//! server on TCP, TLS and a unix socket, a Redis Cluster, a PostgreSQL
//! instance. Users and roles are created with `redis-cli` and `psql`, child
//! processes, so the test's own set-up never reaches the captured traces.

mod pg_support;
mod redis_support;
mod support;

use std::error::Error as StdError;
use std::io;
use std::process::Command;
use std::sync::{Arc, Mutex, Once, PoisonError};
use std::time::Duration;

use dlock::backend::OwnerId;
use dlock::pg::{PgBackend, PgOptions};
use dlock::redis::RedisBackend;
use dlock::{Backend, LockKey, LockOptions};
use redis_support::RedisServer;
use support::within;

/// Everything traced in this process so far.
static TRACED: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct TraceBuffer;

impl io::Write for TraceBuffer {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        TRACED
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Sends every tracing event and `log` record of the process, at every
/// level, to [`TRACED`].
fn capture_traces() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        tracing_subscriber::fmt()
            .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
            .with_ansi(false)
            .with_writer(|| TraceBuffer)
            .try_init()
            .expect("the only subscriber and logger of this test binary");
    });
}

fn traced() -> String {
    String::from_utf8_lossy(&TRACED.lock().unwrap_or_else(PoisonError::into_inner)).into_owned()
}

/// Everything an error shows: its `Display` and `Debug`, and those of each
/// error down its `source()` chain.
fn shown_error(err: &(dyn StdError + 'static)) -> String {
    let mut text = format!("{err}\n{err:?}\n");
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(&format!("{cause}\n{cause:?}\n"));
        source = cause.source();
    }
    text
}

/// Fails if any of `secrets` is in `shown` or in anything traced so far.
fn assert_hidden(case: &str, secrets: &[&str], shown: &str) {
    let traced = traced();
    for secret in secrets {
        assert!(
            !shown.contains(secret),
            "{case}: `{secret}` was shown:\n{shown}"
        );
        let lines: Vec<&str> = traced.lines().filter(|l| l.contains(secret)).collect();
        assert!(
            lines.is_empty(),
            "{case}: `{secret}` was traced:\n{}",
            lines.join("\n")
        );
    }
}

fn fresh_key(label: &str) -> LockKey {
    let id = OwnerId::random().expect("random");
    LockKey::new(format!("dlock-test:{label}:{id}")).expect("key")
}

/// Takes a key, has a second acquirer wait for it (so the backend opens
/// whatever it waits with) and hands over: everything a backend prints in
/// normal work gets a chance to be printed.
async fn lock_and_hand_over(backend: Arc<dyn Backend>, label: &str) {
    let key = fresh_key(label);
    let holder = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let waiter = support::spawn_waiter(backend.clone(), &key, 10, 10);
    tokio::time::sleep(Duration::from_millis(100)).await;
    holder.release().await.expect("release");
    within(15, "the waiter", waiter)
        .await
        .expect("task")
        .expect("acquired")
        .release()
        .await
        .expect("release");
}

/// A loopback port that refuses connections for the rest of the run (one
/// found free and let go could be taken by another test's server).
fn closed_port() -> u16 {
    support::refused_port()
}

// ---------------------------------------------------------------- Redis

/// One Redis URL form: the URL and the texts that must never be shown
/// (the password as written and as sent).
struct RedisCase {
    label: &'static str,
    url: String,
    secrets: Vec<&'static str>,
}

impl RedisCase {
    fn new(label: &'static str, url: String, secrets: &[&'static str]) -> Self {
        Self {
            label,
            url,
            secrets: secrets.to_vec(),
        }
    }

    fn builder(&self) -> dlock::redis::RedisBuilder {
        RedisBackend::builder(&self.url)
            .connect_timeout(Duration::from_secs(2))
            .response_timeout(Duration::from_secs(1))
    }
}

/// Runs `redis-cli` with the admin password against `port`.
fn redis_admin(port: u16, admin: &str, args: &[&str]) -> String {
    redis_support::cli(
        &[
            "-p",
            &port.to_string(),
            "--user",
            "admin",
            "--pass",
            admin,
            "--no-auth-warning",
        ],
        args,
    )
}

/// Creates ACL `user` with `password` and every right.
fn add_redis_user(port: u16, admin: &str, user: &str, password: &str) {
    let out = redis_admin(
        port,
        admin,
        &[
            "ACL",
            "SETUSER",
            user,
            "on",
            &format!(">{password}"),
            "~*",
            "&*",
            "+@all",
        ],
    );
    assert_eq!(out, "OK", "ACL SETUSER {user}");
}

/// A Redis server on TCP and a unix socket (`redis.sock` in its
/// directory), with an `admin` user for the test and `default_passwords`
/// on the default user (one per case that logs in as it).
fn redis_server_with_users(default_passwords: &[&str]) -> RedisServer {
    let server = RedisServer::start(&[
        "--unixsocket",
        "{dir}/redis.sock",
        "--unixsocketperm",
        "700",
    ]);
    let admin = [
        "ACL",
        "SETUSER",
        "admin",
        "on",
        ">redis-admin-pass",
        "~*",
        "&*",
        "+@all",
    ];
    let out = redis_support::cli(&["-p", &server.port.to_string()], &admin);
    assert_eq!(out, "OK", "admin user");
    let passwords: Vec<String> = default_passwords.iter().map(|p| format!(">{p}")).collect();
    let mut default = vec!["ACL", "SETUSER", "default", "resetpass"];
    default.extend(passwords.iter().map(String::as_str));
    assert_eq!(redis_admin(server.port, "redis-admin-pass", &default), "OK");
    server
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_redis_url_form_shows_or_traces_its_password() {
    capture_traces();
    let server = redis_server_with_users(&["redis-default-pw-Kf3", "redis-unix-default-pw-Hx9"]);
    let (port, admin) = (server.port, "redis-admin-pass");
    add_redis_user(port, admin, "app", "redis-acl-pw-Vn8");
    add_redis_user(port, admin, "app2", "redis/enc@pw:-Qz5");
    add_redis_user(port, admin, "app3", "redis-unix-pw-Jw2");
    add_redis_user(port, admin, "app4", "unix&enc=pw+-Lm4");
    let socket = server.dir().join("redis.sock");
    let socket = socket.display();

    let working = [
        RedisCase::new(
            "redis://:password@",
            format!("redis://:redis-default-pw-Kf3@127.0.0.1:{port}"),
            &["redis-default-pw-Kf3"],
        ),
        RedisCase::new(
            "redis://user:password@",
            format!("redis://app:redis-acl-pw-Vn8@127.0.0.1:{port}/0"),
            &["redis-acl-pw-Vn8"],
        ),
        RedisCase::new(
            "a percent-encoded password",
            format!("redis://app2:redis%2Fenc%40pw%3A-Qz5@127.0.0.1:{port}"),
            &["redis%2Fenc%40pw%3A-Qz5", "redis/enc@pw:-Qz5"],
        ),
        RedisCase::new(
            "redis+unix://…?pass=…&user=…",
            format!("redis+unix://{socket}?pass=redis-unix-pw-Jw2&user=app3"),
            &["redis-unix-pw-Jw2"],
        ),
        RedisCase::new(
            "unix://…?pass=…",
            format!("unix://{socket}?pass=redis-unix-default-pw-Hx9"),
            &["redis-unix-default-pw-Hx9"],
        ),
        RedisCase::new(
            "unix://…?user=…&pass=<percent-encoded>",
            format!("unix://{socket}?user=app4&pass=unix%26enc%3Dpw%2B-Lm4"),
            &["unix%26enc%3Dpw%2B-Lm4", "unix&enc=pw+-Lm4"],
        ),
    ];
    let mut backends = Vec::new();
    for case in &working {
        let builder = case.builder();
        let mut shown = format!("{builder:?}\n");
        let backend = within(15, case.label, builder.connect())
            .await
            .unwrap_or_else(|err| panic!("{}: {}", case.label, shown_error(&err)));
        shown.push_str(&format!("{backend:?}\n"));
        let backend: Arc<dyn Backend> = Arc::new(backend);
        lock_and_hand_over(backend.clone(), "redis-secrets").await;
        assert_hidden(case.label, &case.secrets, &shown);
        backends.push(backend);
    }

    let refused = [
        RedisCase::new(
            "redis://:wrong@",
            format!("redis://:redis-wrong-pw-Tb1@127.0.0.1:{port}"),
            &["redis-wrong-pw-Tb1"],
        ),
        RedisCase::new(
            "redis://user:wrong@",
            format!("redis://app:redis-wrong-acl-pw-Rc6@127.0.0.1:{port}"),
            &["redis-wrong-acl-pw-Rc6"],
        ),
        RedisCase::new(
            "redis+unix://…?pass=wrong",
            format!("redis+unix://{socket}?pass=redis-wrong-unix-pw-Ye7&user=app3"),
            &["redis-wrong-unix-pw-Ye7"],
        ),
        RedisCase::new(
            "unix://…?pass=wrong",
            format!("unix://{socket}?pass=redis-wrong-unix-pw2-Gp2"),
            &["redis-wrong-unix-pw2-Gp2"],
        ),
        RedisCase::new(
            "redis://:password@ an unreachable host",
            format!(
                "redis://:redis-unreachable-pw-Nd5@127.0.0.1:{}",
                closed_port()
            ),
            &["redis-unreachable-pw-Nd5"],
        ),
        RedisCase::new(
            "unix://…?pass=… a missing socket",
            format!("unix://{socket}.missing?pass=redis-nosock-pw-Wq3"),
            &["redis-nosock-pw-Wq3"],
        ),
        RedisCase::new(
            "an invalid URL",
            format!("redis://:redis-invalid-pw-Ja6@127.0.0.1:{port}/notadb"),
            &["redis-invalid-pw-Ja6"],
        ),
    ];
    for case in &refused {
        let builder = case.builder();
        let shown = format!("{builder:?}\n");
        let err = within(15, case.label, builder.connect())
            .await
            .expect_err(case.label);
        assert_hidden(case.label, &case.secrets, &(shown + &shown_error(&err)));
    }

    // What the backends print once their server is gone: a lease lost,
    // an acquisition that fails.
    let mut leases = Vec::new();
    for backend in &backends {
        leases.push(
            LockOptions::new(Duration::from_millis(1500))
                .acquire_on(backend.clone(), fresh_key("redis-secrets-lost"))
                .await
                .expect("free"),
        );
    }
    drop(server);
    for ((case, backend), lease) in working.iter().zip(&backends).zip(&leases) {
        let lost = within(20, "the lost signal", lease.lost()).await;
        let failed = within(
            20,
            "acquiring from a dead server",
            LockOptions::new(Duration::from_secs(10))
                .acquire_on(backend.clone(), fresh_key("dead")),
        )
        .await
        .expect_err("the server is gone");
        let shown = shown_error(&lost) + &shown_error(&failed);
        assert_hidden(case.label, &case.secrets, &shown);
    }
    assert!(
        traced().contains("redis backend connected"),
        "the trace capture must see dlock's events"
    );
}

#[tokio::test]
async fn a_redis_password_query_parameter_is_hidden_in_any_case() {
    capture_traces();
    let port = closed_port();
    let cases = [
        RedisCase::new(
            "?PASSWORD=",
            format!("redis://127.0.0.1:{port}/0?PASSWORD=redis-upper-pw-Ee5"),
            &["redis-upper-pw-Ee5"],
        ),
        RedisCase::new(
            "?Pass=",
            format!("redis://127.0.0.1:{port}/0?Pass=redis-mixed-pw-Ff6"),
            &["redis-mixed-pw-Ff6"],
        ),
        RedisCase::new(
            "unix://…?PASS=",
            "unix:///nonexistent/redis.sock?PASS=redis-unix-upper-pw-Pp7".to_owned(),
            &["redis-unix-upper-pw-Pp7"],
        ),
        RedisCase::new(
            "redis+unix://…?user=…&PassWord=",
            "redis+unix:///nonexistent/redis.sock?user=app&PassWord=unix%26pw-Qq8".to_owned(),
            &["unix%26pw-Qq8", "unix&pw-Qq8"],
        ),
    ];
    for case in &cases {
        let builder = case.builder().connect_timeout(Duration::from_millis(300));
        let shown = format!("{builder:?}\n");
        let err = within(15, case.label, builder.connect())
            .await
            .expect_err(case.label);
        assert_hidden(case.label, &case.secrets, &(shown + &shown_error(&err)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_rediss_url_shows_or_traces_its_password() {
    capture_traces();
    let certs = redis_support::fresh_dir("secrets-tls");
    support::make_test_certificates(&certs);
    let cert = |name: &str| certs.join(name).to_string_lossy().into_owned();
    let server = RedisServer::start(&[
        "--port",
        "0",
        "--tls-port",
        "{port}",
        "--tls-cert-file",
        &cert("server.crt"),
        "--tls-key-file",
        &cert("server.key"),
        "--tls-ca-cert-file",
        &cert("ca.crt"),
        "--tls-auth-clients",
        "no",
        "--requirepass",
        "rediss-pw-Mb2",
    ]);
    let ca = std::fs::read(cert("ca.crt")).expect("ca.crt");
    let url = format!("rediss://:rediss-pw-Mb2@127.0.0.1:{}", server.port);
    let builder = RedisBackend::builder(&url).tls_root_certificate(ca.clone());
    let mut shown = format!("{builder:?}\n");
    let backend = builder.connect().await.expect("TLS with the private CA");
    shown.push_str(&format!("{backend:?}\n"));
    lock_and_hand_over(Arc::new(backend), "rediss-secrets").await;
    assert_hidden("rediss://:password@", &["rediss-pw-Mb2"], &shown);

    // An untrusted certificate, a wrong password.
    let untrusted = RedisBackend::builder(&url)
        .connect_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect_err("untrusted certificate");
    assert_hidden(
        "rediss:// untrusted",
        &["rediss-pw-Mb2"],
        &shown_error(&untrusted),
    );
    let wrong = format!("rediss://:rediss-wrong-pw-Px1@127.0.0.1:{}", server.port);
    let err = RedisBackend::builder(&wrong)
        .tls_root_certificate(ca)
        .connect()
        .await
        .expect_err("wrong password");
    assert_hidden(
        "rediss:// wrong password",
        &["rediss-wrong-pw-Px1"],
        &shown_error(&err),
    );
    let _ = std::fs::remove_dir_all(&certs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_cluster_seed_url_shows_or_traces_its_password() {
    capture_traces();
    // On this thread: the nodes live as long as it does.
    let nodes = redis_support::start_cluster();
    for node in &nodes {
        let out = node.cli(&[
            "ACL",
            "SETUSER",
            "seeder",
            "on",
            ">cluster-seed-pw-Bx4",
            "~*",
            "&*",
            "+@all",
        ]);
        assert_eq!(out, "OK");
    }
    let seeds = |password: &str| -> Vec<String> {
        nodes
            .iter()
            .map(|node| format!("redis://seeder:{password}@{}", node.address()))
            .collect()
    };
    let builder = |urls: &[String]| {
        urls[1..].iter().fold(
            RedisBackend::builder(&urls[0])
                .connect_timeout(Duration::from_secs(2))
                .response_timeout(Duration::from_secs(1)),
            |builder, url| builder.node(url),
        )
    };

    let working = builder(&seeds("cluster-seed-pw-Bx4"));
    let mut shown = format!("{working:?}\n");
    let backend = within(20, "connecting to the cluster", working.connect())
        .await
        .expect("the seeds connect");
    assert!(backend.is_cluster());
    shown.push_str(&format!("{backend:?}\n"));
    lock_and_hand_over(Arc::new(backend), "cluster-secrets").await;
    assert_hidden("cluster seeds", &["cluster-seed-pw-Bx4"], &shown);

    for (label, named, password) in [
        (
            "cluster seeds, wrong password",
            false,
            "cluster-wrong-pw-Dq8",
        ),
        (
            "cluster seeds, wrong password, cluster(true)",
            true,
            "cluster-wrong-pw-Sv3",
        ),
    ] {
        let refused = builder(&seeds(password));
        let refused = if named {
            refused.cluster(true)
        } else {
            refused
        };
        let err = within(20, label, refused.connect()).await.expect_err(label);
        assert_hidden(label, &[password], &shown_error(&err));
    }
    let unreachable: Vec<String> = (0..2)
        .map(|_| {
            format!(
                "redis://seeder:cluster-gone-pw-Ur5@127.0.0.1:{}",
                closed_port()
            )
        })
        .collect();
    let err = within(
        20,
        "unreachable seeds",
        builder(&unreachable).cluster(true).connect(),
    )
    .await
    .expect_err("nothing listens");
    assert_hidden(
        "unreachable cluster seeds",
        &["cluster-gone-pw-Ur5"],
        &shown_error(&err),
    );
}

// ----------------------------------------------------------- PostgreSQL

/// Runs `sql` on `server` as its superuser through `psql`, a child
/// process, so the statement (which may carry a password) is never traced
/// here.
fn psql(server: &pg_support::OwnServer, sql: &str) {
    let psql = pg_support::pg_bin_dir().join("psql");
    let psql = if psql.exists() { psql } else { "psql".into() };
    let out = Command::new(psql)
        .env("PGPASSWORD", pg_support::PASSWORD)
        .args([
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
        ])
        .args(["-p", &server.port.to_string(), "-d", "postgres", "-c", sql])
        .output()
        .expect("psql");
    assert!(
        out.status.success(),
        "psql failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One PostgreSQL connection-string form, for role `role` of password
/// `password` (as the form writes it: `{pw}` stands for it).
struct PgCase {
    label: &'static str,
    /// `{port}`, `{user}` and `{pw}` are filled in.
    template: &'static str,
    /// The password as written in the string.
    written: &'static str,
    /// The password itself.
    password: &'static str,
}

const PG_CASES: [PgCase; 6] = [
    PgCase {
        label: "postgresql://user:password@",
        template: "postgresql://{user}:{pw}@127.0.0.1:{port}/postgres",
        written: "pg-url-pw-Ha5",
        password: "pg-url-pw-Ha5",
    },
    PgCase {
        label: "postgres://user:password@",
        template: "postgres://{user}:{pw}@127.0.0.1:{port}/postgres?sslmode=require",
        written: "pg-short-url-pw-Wc2",
        password: "pg-short-url-pw-Wc2",
    },
    PgCase {
        label: "a percent-encoded password",
        template: "postgresql://{user}:{pw}@127.0.0.1:{port}/postgres",
        written: "pg%20enc%40pw-Ro9",
        password: "pg enc@pw-Ro9",
    },
    PgCase {
        label: "?password= in the URL query",
        template: "postgresql://{user}@127.0.0.1:{port}/postgres?password={pw}",
        written: "pg-query-pw-Tu6",
        password: "pg-query-pw-Tu6",
    },
    PgCase {
        label: "key-value password=",
        template: "host=127.0.0.1 port={port} user={user} dbname=postgres password={pw}",
        written: "pg-kv-pw-Ez4",
        password: "pg-kv-pw-Ez4",
    },
    PgCase {
        label: "key-value password='quoted with spaces'",
        template: "host=127.0.0.1 port={port} user={user} dbname=postgres password='{pw}'",
        written: "pg quoted pw-Yl1",
        password: "pg quoted pw-Yl1",
    },
];

impl PgCase {
    fn conn(&self, port: u16, user: &str, written: &str) -> String {
        self.template
            .replace("{port}", &port.to_string())
            .replace("{user}", user)
            .replace("{pw}", written)
    }

    fn secrets(&self) -> Vec<&'static str> {
        vec![self.written, self.password]
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_postgres_connection_string_form_shows_or_traces_its_password() {
    capture_traces();
    let server = pg_support::OwnServer::start();
    for (i, case) in PG_CASES.iter().enumerate() {
        psql(
            &server,
            &format!(
                "CREATE ROLE secrets_{i} LOGIN SUPERUSER PASSWORD '{}'",
                case.password
            ),
        );
    }
    let options = PgOptions::new().connect_timeout(Duration::from_secs(3));

    let mut backends = Vec::new();
    for (i, case) in PG_CASES.iter().enumerate() {
        let conn = case.conn(server.port, &format!("secrets_{i}"), case.written);
        let mut shown = format!("{options:?}\n");
        let backend = within(
            15,
            case.label,
            PgBackend::connect_with(&conn, options.clone()),
        )
        .await
        .unwrap_or_else(|err| panic!("{}: {}", case.label, shown_error(&err)));
        shown.push_str(&format!("{backend:?}\n"));
        let backend: Arc<dyn Backend> = Arc::new(backend);
        lock_and_hand_over(backend.clone(), "pg-secrets").await;
        assert_hidden(case.label, &case.secrets(), &shown);
        backends.push(backend);
    }

    // A refused login (the right role, a wrong password) and an
    // unreachable host, in every form.
    for (i, case) in PG_CASES.iter().enumerate() {
        let wrong_written = format!("{}-wrong", case.written);
        let wrong = format!("{}-wrong", case.password);
        let conn = case.conn(server.port, &format!("secrets_{i}"), &wrong_written);
        let err = within(
            15,
            case.label,
            PgBackend::connect_with(&conn, options.clone()),
        )
        .await
        .expect_err("a wrong password");
        assert!(
            err.to_string().contains("password authentication failed"),
            "{}: {err}",
            case.label
        );
        let secrets = [wrong_written.as_str(), wrong.as_str()];
        assert_hidden(case.label, &secrets, &shown_error(&err));

        let gone_written = format!("{}-gone", case.written);
        let gone = format!("{}-gone", case.password);
        let conn = case.conn(closed_port(), &format!("secrets_{i}"), &gone_written);
        let err = within(
            15,
            case.label,
            PgBackend::connect_with(&conn, options.clone()),
        )
        .await
        .expect_err("nothing listens");
        let secrets = [gone_written.as_str(), gone.as_str()];
        assert_hidden(case.label, &secrets, &shown_error(&err));
    }

    // What the backends print once their server is gone.
    let mut leases = Vec::new();
    for backend in &backends {
        leases.push(
            LockOptions::new(Duration::from_secs(30))
                .acquire_on(backend.clone(), fresh_key("pg-secrets-lost"))
                .await
                .expect("free"),
        );
    }
    let stopped = server.pg_ctl_stop("immediate");
    assert!(stopped.status.success(), "{stopped:?}");
    for ((case, backend), lease) in PG_CASES.iter().zip(&backends).zip(&leases) {
        let lost = within(20, "the lost signal", lease.lost()).await;
        let failed = within(
            20,
            "acquiring from a stopped server",
            LockOptions::new(Duration::from_secs(10))
                .acquire_on(backend.clone(), fresh_key("dead")),
        )
        .await
        .expect_err("the server is gone");
        let shown = shown_error(&lost) + &shown_error(&failed);
        assert_hidden(case.label, &case.secrets(), &shown);
    }
    let traced = traced();
    assert!(
        traced.contains("PostgreSQL lock session opened"),
        "the trace capture must see dlock's events"
    );
    assert!(
        traced.contains("tokio_postgres"),
        "the trace capture must see the client library's log records"
    );
}

#[tokio::test]
async fn a_malformed_postgres_connection_string_names_the_bad_option_never_the_password() {
    capture_traces();
    // (string, what the error must name, the password's parts)
    let named = [
        (
            "host=127.0.0.1 port=1 user=u password=Sec-Pg1 sslmode=bogus",
            "`sslmode`",
            &["Sec-Pg1"][..],
        ),
        (
            "host=127.0.0.1 port=1 user=u passwd=Sec-Pg2",
            "an unknown option",
            &["Sec-Pg2"][..],
        ),
        (
            "postgresql://u:Sec-Pg3@127.0.0.1:1/db?sslmode=bogus",
            "`sslmode`",
            &["Sec-Pg3"][..],
        ),
        (
            "host=127.0.0.1 port=1 user=u password=Sec-Pg4 connect_timeout=x",
            "`connect_timeout`",
            &["Sec-Pg4"][..],
        ),
        (
            "postgresql://u:Sec-Pg5@127.0.0.1:1/db?connect_timeout=soon",
            "`connect_timeout`",
            &["Sec-Pg5"][..],
        ),
        (
            "postgresql://u:Sec-Pg6@127.0.0.1:1/db?target_session_attrs=bogus",
            "`target_session_attrs`",
            &["Sec-Pg6"][..],
        ),
        (
            "password=Sec-Pg7 host=127.0.0.1 port=1 user=u hostaddr=notanip",
            "`hostaddr`",
            &["Sec-Pg7"][..],
        ),
        (
            "postgresql://u:Sec-Pg8@127.0.0.1:1/db?bogus_option=1",
            "an unknown option",
            &["Sec-Pg8"][..],
        ),
    ];
    for (conn, option, secrets) in named {
        let options = PgOptions::new().connect_timeout(Duration::from_secs(2));
        let err = within(15, conn, PgBackend::connect_with(conn, options))
            .await
            .expect_err("a malformed connection string");
        let shown = shown_error(&err);
        assert!(
            err.to_string().contains(option),
            "{conn}: the error must name {option}: {shown}"
        );
        assert_hidden(conn, secrets, &shown);
    }
    // A password written so that part of it passes for an option (an
    // unquoted space, an unencoded `&`, under a `password` key plain or
    // percent-encoded): the parser names that part as an unknown option,
    // whose name must not be shown.
    for (conn, secrets) in [
        (
            "host=127.0.0.1 port=1 user=u password=Sec-Pg9 Tail9x=1",
            &["Sec-Pg9", "Tail9x"][..],
        ),
        (
            "postgresql://u@127.0.0.1:1/db?password=Sec-Pg10&Tail10y=1",
            &["Sec-Pg10", "Tail10y"][..],
        ),
        (
            "postgresql://u@127.0.0.1:1/db?p%61ssword=Sec-Pg11&Tail11z=1",
            &["Sec-Pg11", "Tail11z"][..],
        ),
        (
            "postgresql://u@127.0.0.1:1/db?password=Sec-Pg12&T%61il12w=1",
            &["Sec-Pg12", "Tail12w", "T%61il12w"][..],
        ),
    ] {
        let options = PgOptions::new().connect_timeout(Duration::from_secs(2));
        let err = within(15, conn, PgBackend::connect_with(conn, options))
            .await
            .expect_err("a malformed connection string");
        let shown = shown_error(&err);
        assert!(
            err.to_string()
                .contains("invalid PostgreSQL connection string"),
            "{conn}: {shown}"
        );
        assert_hidden(conn, secrets, &shown);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unencoded_at_sign_in_a_postgres_url_password_is_refused_without_showing_it() {
    capture_traces();
    // The URL parser splits the user info at the first `@`, so the rest of
    // the password would pass for the host name.
    for conn in [
        "postgresql://postgres:pg-at@tail-Qx7@127.0.0.1:5432/test",
        "postgres://postgres:pg-at@tail-Qx7@db.invalid/test?sslmode=require",
    ] {
        let err = within(15, "connect", PgBackend::connect(conn))
            .await
            .expect_err("an unencoded `@` in the password must be refused");
        let shown = format!("{}\n{err:?}", shown_error(&err));
        assert!(
            shown.contains("%40"),
            "the error must say how to fix it: {shown}"
        );
        assert_hidden(
            "an unencoded @ in the password",
            &["pg-at@tail-Qx7", "tail-Qx7", "pg-at"],
            &shown,
        );
    }
    assert_hidden(
        "an unencoded @ in the password",
        &["tail-Qx7", "pg-at"],
        &traced(),
    );
}

#[tokio::test]
async fn an_at_sign_after_the_host_of_a_postgres_url_is_refused_without_showing_it() {
    capture_traces();
    // The URL parser splits the user info at the first `@` of the whole
    // string, wherever it is: with the password in the query (or an `@` in
    // the path), everything before that `@` — host, path, query, the start
    // of the password — would pass for the user name, and the rest for the
    // host.
    for (conn, secrets) in [
        (
            "postgresql://localhost/test?user=postgres&password=Qry-pw-Z7@k9secret",
            &["Qry-pw-Z7", "k9secret"][..],
        ),
        (
            "postgres://127.0.0.1:5432/test?password=Qp2-Mw8@tail-Vb4&user=postgres",
            &["Qp2-Mw8", "tail-Vb4"][..],
        ),
        (
            "postgresql://127.0.0.1?password=Pq7-Rt4@tail-Wz9",
            &["Pq7-Rt4", "tail-Wz9"][..],
        ),
        (
            "postgresql://127.0.0.1/te@st?password=Pt6-Hr3",
            &["Pt6-Hr3"][..],
        ),
    ] {
        let options = PgOptions::new().connect_timeout(Duration::from_secs(2));
        let err = within(15, "connect", PgBackend::connect_with(conn, options))
            .await
            .expect_err("an `@` after the host must be refused");
        let shown = format!("{}\n{err:?}", shown_error(&err));
        assert!(
            shown.contains("%40"),
            "the error must say how to fix it: {shown}"
        );
        assert_hidden("an @ after the host of a URL", secrets, &shown);
    }
    // An `@` ending the user info is the last one: another, even where the
    // parser would read the URL right, makes the text before it user info
    // that may hold a password, so it is refused. Written as %40 it is fine.
    let ambiguous = "postgresql://postgres@127.0.0.1:1/test?application_name=a@b&connect_timeout=1";
    let err = within(15, "connect", PgBackend::connect(ambiguous))
        .await
        .expect_err("an `@` in the query must be refused");
    assert!(err.to_string().contains("%40"), "{err}");
    let fine = "postgresql://postgres@127.0.0.1:1/test?application_name=a%40b&connect_timeout=1";
    let err = within(15, "connect", PgBackend::connect(fine))
        .await
        .expect_err("nothing listens on port 1");
    assert!(
        !err.to_string().contains("%40"),
        "a well-formed URL was refused: {err}"
    );
}

// ------------------------------------------------------------ URL forms

/// Passwords written without percent-encoding, each holding a character a
/// URL parser may read as the end of the user info, the host or the port
/// (`/`, `?`, `#`, `@`, `:`), and what must never be shown of each: every
/// part between those characters. The first is digits before a `/`, which
/// a parser that ends the authority at the first `/` reads as a port.
const UNENCODED_PASSWORDS: [(&str, &[&str]); 6] = [
    ("4817/Summer-Kx!", &["4817", "Summer-Kx"]),
    ("Sl1/Sl2", &["Sl1", "Sl2"]),
    ("Qm3?Qm4=Qm5", &["Qm3", "Qm4", "Qm5"]),
    ("Hs6#Hs7", &["Hs6", "Hs7"]),
    ("At8@At9", &["At8", "At9"]),
    ("Cn0:Cn1", &["Cn0", "Cn1"]),
];

/// The URL forms a password goes into: `{pw}` stands for it, `{port}` for
/// a port nothing listens on. A `cluster` form is two seeds of one
/// builder, told it is a cluster.
const UNENCODED_FORMS: [(&str, &str); 9] = [
    ("redis://", "redis://app:{pw}@127.0.0.1:{port}"),
    (
        "redis:// with a database",
        "redis://app:{pw}@127.0.0.1:{port}/1",
    ),
    ("rediss://", "rediss://app:{pw}@127.0.0.1:{port}"),
    (
        "redis+sentinel://",
        "redis+sentinel://app:{pw}@127.0.0.1:{port}/mymaster",
    ),
    (
        "redis+sentinel:// without a service",
        "redis+sentinel://app:{pw}@127.0.0.1:{port}",
    ),
    (
        "redis+sentinel:// with only a database",
        "redis+sentinel://app:{pw}@127.0.0.1:{port}/1",
    ),
    (
        "rediss+sentinel:// with a database",
        "rediss+sentinel://:{pw}@127.0.0.1:{port}/mymaster/1",
    ),
    ("cluster seeds", "redis://app:{pw}@127.0.0.1:{port}"),
    (
        "postgresql://",
        "postgresql://app:{pw}@127.0.0.1:{port}/test",
    ),
];

/// Everything connecting with `url` shows (the builder's or options'
/// `Debug`, the error's whole chain), for the form named `form`.
async fn shown_connecting(form: &str, url: &str) -> String {
    let timeout = Duration::from_millis(300);
    if form.starts_with("postgresql") {
        let options = PgOptions::new().connect_timeout(timeout);
        let err = PgBackend::connect_with(url, options)
            .await
            .expect_err("nothing listens");
        return shown_error(&err);
    }
    let mut builder = RedisBackend::builder(url)
        .connect_timeout(timeout)
        .response_timeout(timeout);
    if form.starts_with("cluster") {
        let other = url.replace(
            &format!(":{}", url.rsplit(':').next().unwrap_or_default()),
            &format!(":{}", closed_port()),
        );
        builder = builder.node(&other).cluster(true);
    }
    let mut shown = format!("{builder:?}\n");
    let err = builder.connect().await.expect_err("nothing listens");
    shown.push_str(&shown_error(&err));
    shown
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_part_of_an_unencoded_password_is_shown_in_any_url_form() {
    capture_traces();
    let mut attempts = Vec::new();
    for (form, template) in UNENCODED_FORMS {
        for (password, parts) in UNENCODED_PASSWORDS {
            let url = template
                .replace("{pw}", password)
                .replace("{port}", &closed_port().to_string());
            attempts.push(async move {
                let shown = within(15, form, shown_connecting(form, &url)).await;
                (
                    format!("{form} with the password {password:?}"),
                    parts,
                    shown,
                )
            });
        }
    }
    for (case, parts, shown) in futures_util::future::join_all(attempts).await {
        assert_hidden(&case, parts, &shown);
    }
}

/// A Redis URL written with leading or trailing spaces or control
/// characters: the client's URL parser strips them, so the user info is
/// read as written there, and a password holding a `?`, `#` or `/` must
/// never be read (and shown) as a host, a port or a query. Nor may a tab
/// or line break inside the URL, which the URL parser removes, change how
/// it is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_url_with_leading_spaces_or_control_characters_shows_no_password() {
    capture_traces();
    let port = closed_port();
    let cases: Vec<(String, &[&str])> = vec![
        (
            format!(" redis://app:4817?Lq2@127.0.0.1:{port}"),
            &["4817", "Lq2"],
        ),
        (
            format!(" redis://app:4817#Lf2@127.0.0.1:{port}"),
            &["4817", "Lf2"],
        ),
        (
            format!("\tredis://app:4817?Lt2@127.0.0.1:{port}"),
            &["4817", "Lt2"],
        ),
        (
            format!("\u{1}redis://app:4817?Lc2@127.0.0.1:{port}"),
            &["4817", "Lc2"],
        ),
        (
            format!(" rediss://app:4817?Ls2@127.0.0.1:{port}"),
            &["4817", "Ls2"],
        ),
        (
            format!(" redis://4817?Lu2@127.0.0.1:{port}"),
            &["4817", "Lu2"],
        ),
        (
            format!(" redis://app:4817/0?Lv2@127.0.0.1:{port} "),
            &["4817", "Lv2"],
        ),
        (
            format!("re\tdis://app:4817?Lw2@127.0.0.1:{port}"),
            &["4817", "Lw2"],
        ),
        (
            format!("\nredis+sentinel://app:Ss1/Ss2@127.0.0.1:{port}/mymaster"),
            &["Ss1", "Ss2"],
        ),
    ];
    for (url, secrets) in &cases {
        let case = format!("{url:?}");
        let shown = within(15, &case, shown_connecting("redis", url)).await;
        assert_hidden(&case, secrets, &shown);
    }
}

/// A password in a Redis URL's query, written with an unencoded `#` or
/// `&` or with a percent-encoded parameter name: no part of the query is
/// shown, so no tail of the password is either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_tail_of_a_redis_query_password_is_shown() {
    capture_traces();
    let port = closed_port();
    let cases: Vec<(String, &[&str])> = vec![
        (
            "unix:///nonexistent/r.sock?pass=Ux1#Ux2&user=app".to_owned(),
            &["Ux1", "Ux2"],
        ),
        (
            "redis+unix:///nonexistent/r.sock?pass=Uy1&Uy2&user=app".to_owned(),
            &["Uy1", "Uy2"],
        ),
        (
            format!("redis://127.0.0.1:{port}/0?password=Qx1#Qx2"),
            &["Qx1", "Qx2"],
        ),
        (
            format!("redis://127.0.0.1:{port}/0?password=Qy1&Qy2"),
            &["Qy1", "Qy2"],
        ),
        (
            format!("redis://127.0.0.1:{port}/0?pass%77ord=Qo1#Qo2"),
            &["Qo1", "Qo2"],
        ),
        (
            format!("redis://127.0.0.1:{port}/0?pass%77ord=Qw1"),
            &["Qw1"],
        ),
        (
            format!("redis://[::1]:{port}/0?password=Qi1#Qi2"),
            &["Qi1", "Qi2"],
        ),
        (
            format!("redis://[::1]:{port}/0?db=1&PASS=Qj1&Qj2"),
            &["Qj1", "Qj2"],
        ),
    ];
    for (url, secrets) in &cases {
        let case = format!("{url:?}");
        let shown = within(15, &case, shown_connecting("redis", url)).await;
        assert_hidden(&case, secrets, &shown);
    }
}

/// An etcd endpoint whose text before `://` is no scheme (it holds the
/// user and the start of a password): the error shows nothing of it.
#[cfg(feature = "etcd")]
#[tokio::test]
async fn an_etcd_endpoint_without_a_scheme_is_refused_without_showing_it() {
    for (url, secrets) in [
        ("root:Ee1://Ee2@127.0.0.1:2379", &["root", "Ee1", "Ee2"][..]),
        (
            "root:Ef1:/Ef2@x://127.0.0.1:2379",
            &["root", "Ef1", "Ef2"][..],
        ),
        (" http://root:Eh1/Eh2@127.0.0.1:1", &["Eh1", "Eh2"][..]),
    ] {
        let builder =
            dlock::etcd::EtcdBackend::builder(&[url]).connect_timeout(Duration::from_millis(300));
        let shown = format!("{builder:?}\n");
        let err = within(15, url, builder.connect())
            .await
            .expect_err("no scheme");
        assert_hidden(url, secrets, &(shown + &shown_error(&err)));
    }
}

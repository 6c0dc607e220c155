//! What the Redis backend promises when its server restarts, dies, or wants
//! a password: each test starts its own `redis-server` on a free loopback
//! port (no persistence) and kills it at the end.

use crate::redis_support;
use crate::support;

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use support::within;

use dlock::backend::OwnerId;
use dlock::redis::RedisBackend;
use dlock::{Backend, LockError, LockKey, LockOptions, LostReason};
use redis_support::RedisServer;
use tokio::time::sleep;

fn fresh_key(label: &str) -> LockKey {
    let id = OwnerId::random().expect("random");
    LockKey::new(format!("dlock-test:{label}:{id}")).expect("key")
}

async fn connect(url: &str) -> Arc<dyn Backend> {
    Arc::new(
        RedisBackend::builder(url)
            .connect_timeout(Duration::from_secs(2))
            .response_timeout(Duration::from_secs(1))
            .connect()
            .await
            .expect("connect to the test's own server"),
    )
}

async fn take_token(backend: &Arc<dyn Backend>, key: &LockKey) -> u64 {
    let lease = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), key)
        .await
        .expect("free key");
    let token = lease.token().get();
    lease.release().await.expect("release");
    token
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_keep_rising_across_a_server_restart_that_lost_the_data() {
    let mut server = RedisServer::start(&[]);
    let backend = connect(&server.url()).await;
    let key = fresh_key("restart");
    let mut tokens = Vec::new();
    for _ in 0..5 {
        tokens.push(take_token(&backend, &key).await);
    }
    let fence = format!("dlock:{{{key}}}:fence");
    assert_eq!(server.cli(&["EXISTS", &fence]), "1");

    server.restart();
    assert_eq!(
        server.cli(&["EXISTS", &fence]),
        "0",
        "the restart must have lost the fencing counter"
    );
    // The same backend, not rebuilt: it reconnects by itself.
    let after = within(
        20,
        "acquiring after the restart",
        take_token(&backend, &key),
    )
    .await;
    let before = tokens.iter().copied().max().unwrap_or_default();
    assert!(
        after > before,
        "the token after the restart ({after}) must exceed every token before it ({tokens:?})"
    );
    tokens.push(after);
    tokens.push(take_token(&backend, &key).await);
    assert!(tokens.windows(2).all(|w| w[1] > w[0]), "{tokens:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lease_is_lost_when_the_server_dies_and_locking_works_again_after_it_returns() {
    let mut server = RedisServer::start(&[]);
    let backend = connect(&server.url()).await;
    let key = fresh_key("connection-loss");
    let lease = LockOptions::new(Duration::from_millis(1500))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let token = lease.token();

    server.kill();
    let lost = within(15, "the lost signal", lease.lost()).await;
    assert!(
        matches!(
            lost,
            LockError::LeaseLost {
                reason: LostReason::Unreachable(_) | LostReason::Expired,
                ..
            }
        ),
        "unexpected: {lost}"
    );
    assert!(lease.check().is_err());

    server.restart();
    // The first attempt after the server is back succeeds on the same
    // backend: a broken connection is rebuilt and the command retried.
    let again = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("acquisition works again once the server is back");
    assert!(again.token() > token);
    again.release().await.expect("release");
    drop(lease);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_woken_by_releases_again_after_the_pubsub_connection_broke() {
    let mut server = RedisServer::start(&[]);
    let redis = RedisBackend::builder(&server.url())
        .connect_timeout(Duration::from_secs(2))
        .response_timeout(Duration::from_secs(1))
        .connect()
        .await
        .expect("connect");
    let backend: Arc<dyn Backend> = Arc::new(redis.clone());
    let key = fresh_key("pubsub-break");

    // A waiter opens the pub/sub connection...
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let waiter = support::spawn_waiter(backend.clone(), &key, 30, 2);
    sleep(Duration::from_millis(300)).await;
    holder.release().await.expect("release");
    within(10, "the first waiter", waiter)
        .await
        .expect("task")
        .expect("acquired")
        .release()
        .await
        .expect("release");

    // ...which the restart breaks.
    server.restart();
    let holder = within(20, "acquiring after the restart", async {
        LockOptions::new(Duration::from_secs(30))
            .acquire_on(backend.clone(), &key)
            .await
    })
    .await
    .expect("free after the restart");
    let counting = crate::support::CountingBackend::new(backend.clone());
    let waiter = support::spawn_waiter(counting.clone(), &key, 30, 20);
    // Long enough for a polling waiter to try many more times.
    sleep(Duration::from_millis(2500)).await;
    holder.release().await.expect("release");
    let lease = within(15, "the second waiter", waiter)
        .await
        .expect("task")
        .expect("woken by the release");
    let attempts = counting.attempts();
    assert!(
        attempts <= 3,
        "the waiter tried {attempts} times: it polled instead of being woken by pub/sub"
    );
    lease.release().await.expect("release");
    // Once nobody waits, the channel is unsubscribed again.
    within(10, "unsubscribing", async {
        while redis.subscribed_channels() > 0 {
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_a_clear_error_that_never_shows_the_password() {
    let server = RedisServer::start(&["--requirepass", "right-secret-1"]);
    let url = format!("redis://:wrong-secret-2@127.0.0.1:{}", server.port);
    // With the default connect timeout, and one too short for tries again.
    for builder in [
        RedisBackend::builder(&url),
        RedisBackend::builder(&url).connect_timeout(Duration::from_millis(500)),
    ] {
        let err = within(20, "connecting with a wrong password", builder.connect())
            .await
            .expect_err("a wrong password must be refused");
        let text = format!("{err} / {err:?}");
        assert!(matches!(err, LockError::Backend { .. }), "{text}");
        assert!(
            !text.contains("wrong-secret-2"),
            "the password leaked: {text}"
        );
        assert!(
            (text.to_lowercase().contains("auth") || text.contains("WRONGPASS"))
                && !text.contains("timed out"),
            "the error should say authentication failed: {text}"
        );
    }

    let url = format!("redis://:right-secret-1@127.0.0.1:{}", server.port);
    let backend = RedisBackend::connect(&url)
        .await
        .expect("the right password");
    let shown = format!("{backend:?}");
    assert!(!shown.contains("right-secret-1"), "{shown}");
    assert!(shown.contains(":***@127.0.0.1"), "{shown}");
    let backend: Arc<dyn Backend> = Arc::new(backend);
    take_token(&backend, &fresh_key("password")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_least_privilege_acl_user_can_lock_wait_renew_and_release() {
    let server = RedisServer::start(&[]);
    let target = ["-p".to_owned(), server.port.to_string()];
    let target: Vec<&str> = target.iter().map(String::as_str).collect();
    // Only dlock's keys and channels, only the commands it needs: the
    // very rules the docs give, the same as on a cluster.
    redis_support::create_least_privilege_user(&target, "locker", "locker-pass-3");
    redis_support::reset_acl_log(&target);
    let refused = || {
        redis_support::refused_commands(&target)
            .into_iter()
            .filter(|command| !redis_support::HARMLESS_REFUSALS.contains(&command.as_str()))
            .collect::<Vec<_>>()
    };
    let url = format!("redis://locker:locker-pass-3@127.0.0.1:{}", server.port);
    let redis = RedisBackend::connect(&url)
        .await
        .unwrap_or_else(|err| panic!("{err}; refused: {:?}", refused()));
    assert!(!redis.is_cluster(), "a single server must be detected");
    if let Err(err) = redis_support::every_operation(&redis, 3).await {
        panic!("{err}; refused: {:?}", refused());
    }
    let backend: Arc<dyn Backend> = Arc::new(redis);
    let key = fresh_key("acl");
    let first = take_token(&backend, &key).await;
    let holder = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    assert!(holder.token().get() > first);
    let waiter = support::spawn_waiter(backend.clone(), &key, 10, 10);
    sleep(Duration::from_millis(200)).await;
    holder.release().await.expect("release");
    within(15, "the waiter", waiter)
        .await
        .expect("task")
        .expect("acquired")
        .release()
        .await
        .expect("release");
    // Permits: a grant, a refused attempt that marks the sentinel, and a
    // release that wakes the waiter.
    let key = fresh_key("acl-permit");
    let one = LockOptions::new(Duration::from_secs(10)).permits(1);
    let permit = one
        .clone()
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let waiter = tokio::spawn({
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            one.wait(Duration::from_secs(10))
                .acquire_on(backend, &key)
                .await
        }
    });
    sleep(Duration::from_millis(200)).await;
    permit.release().await.expect("release");
    within(15, "the permit waiter", waiter)
        .await
        .expect("task")
        .expect("acquired")
        .release()
        .await
        .expect("release");
    assert_eq!(refused(), Vec::<String>::new(), "commands the ACL refused");

    // The docs' note: a database other than 0 takes `+select` too.
    let created = redis_support::cli(&target, &["ACL", "SETUSER", "locker", "+select"]);
    assert_eq!(created, "OK");
    let url = format!("redis://locker:locker-pass-3@127.0.0.1:{}/3", server.port);
    let redis = RedisBackend::connect(&url)
        .await
        .unwrap_or_else(|err| panic!("{err}; refused: {:?}", refused()));
    if let Err(err) = redis_support::every_operation(&redis, 1).await {
        panic!("{err}; refused: {:?}", refused());
    }
    assert_eq!(refused(), Vec::<String>::new(), "commands the ACL refused");
}

/// A private CA and a server certificate for 127.0.0.1, made with the
/// `openssl` command; the directory is removed on drop.
struct Certificates {
    dir: std::path::PathBuf,
}

impl Certificates {
    fn make() -> Self {
        let dir = redis_support::fresh_dir("tls");
        support::make_test_certificates(&dir);
        Self { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_string_lossy().into_owned()
    }
}

impl Drop for Certificates {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_locks_with_a_trusted_private_ca_and_refuses_an_untrusted_certificate() {
    let certs = Certificates::make();
    let server = RedisServer::start(&[
        "--port",
        "0",
        "--tls-port",
        "{port}",
        "--tls-cert-file",
        &certs.path("server.crt"),
        "--tls-key-file",
        &certs.path("server.key"),
        "--tls-ca-cert-file",
        &certs.path("ca.crt"),
        "--tls-auth-clients",
        "no",
        "--requirepass",
        "tls-pass-4",
    ]);
    let url = format!("rediss://:tls-pass-4@127.0.0.1:{}", server.port);

    // The system's roots do not include the private CA.
    let refused = RedisBackend::builder(&url)
        .connect_timeout(Duration::from_secs(2))
        .connect();
    let err = within(15, "connecting to an untrusted server", refused)
        .await
        .expect_err("an untrusted certificate must be refused");
    assert!(!err.to_string().contains("tls-pass-4"), "{err}");

    let ca = std::fs::read(certs.path("ca.crt")).expect("ca.crt");
    let redis = RedisBackend::builder(&url)
        .tls_root_certificate(ca)
        .connect()
        .await
        .expect("TLS with the private CA");
    assert!(format!("{redis:?}").contains("rediss://:***@127.0.0.1"));
    let backend: Arc<dyn Backend> = Arc::new(redis);
    let key = fresh_key("tls");
    let holder = LockOptions::new(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    // Waiting works over TLS too (pub/sub on its own TLS connection).
    let waiter = support::spawn_waiter(backend.clone(), &key, 10, 10);
    sleep(Duration::from_millis(200)).await;
    let token = holder.token();
    holder.release().await.expect("release");
    let next = within(15, "the waiter", waiter)
        .await
        .expect("task")
        .expect("acquired");
    assert!(next.token() > token);
    next.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquisition_abandoned_while_the_server_stalls_leaves_the_key_free() {
    let server = RedisServer::start(&["--enable-debug-command", "yes"]);
    let backend = connect(&server.url()).await;
    let key = fresh_key("stalled");
    // Once, so the server knows the acquire script: the attempt below then
    // is one EVALSHA that runs as soon as the server wakes.
    take_token(&backend, &fresh_key("warm-up")).await;
    // Stall the whole server for 4 s from a connection of its own, and see
    // that it is stalled: a PING on a fresh connection gets no answer within
    // a second, twice in a row (a slow answer from a loaded machine is not a
    // stall); the attempt below then still meets the stall with 2 s to spare.
    let port = server
        .url()
        .rsplit(':')
        .next()
        .unwrap_or_default()
        .to_owned();
    let stall = std::thread::spawn(move || {
        redis_support::cli(&["-p", &port], &["DEBUG", "SLEEP", "4"]);
    });
    let address = server.address();
    within(15, "the server to stall", async {
        let mut silent = 0;
        while silent < 2 {
            if answers_ping(&address).await {
                silent = 0;
                sleep(Duration::from_millis(10)).await;
            } else {
                silent += 1;
            }
        }
    })
    .await;
    // The caller gives up while its attempt waits in the stalled server,
    // which runs it once it wakes up.
    let abandoned = tokio::time::timeout(
        Duration::from_millis(200),
        LockOptions::new(Duration::from_secs(60)).acquire_on(backend.clone(), &key),
    )
    .await;
    assert!(
        abandoned.is_err(),
        "the stalled server cannot have answered"
    );
    stall.join().expect("DEBUG SLEEP");
    let next = LockOptions::new(Duration::from_secs(60))
        .wait(Duration::from_secs(10))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("an abandoned acquisition must not keep the key for its 60s ttl");
    next.release().await.expect("release");
}

/// True if a fresh connection to `address` answers PING within a second.
async fn answers_ping(address: &str) -> bool {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let attempt = async {
        let mut conn = tokio::net::TcpStream::connect(address).await.ok()?;
        conn.write_all(b"PING\r\n").await.ok()?;
        let mut buf = [0u8; 16];
        conn.read(&mut buf).await.ok()
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(1), attempt).await,
        Ok(Some(n)) if n > 0
    )
}

/// A man in the middle on loopback that speaks plain text where the client
/// expects TLS: it relays every connection, unencrypted, to `upstream` (a
/// real Redis), and records the first byte each client sent.
struct PlainTextRelay {
    port: u16,
    first_bytes: Arc<Mutex<Vec<u8>>>,
    accept: tokio::task::AbortHandle,
}

impl PlainTextRelay {
    async fn start(upstream: u16) -> Self {
        use tokio::io::AsyncReadExt as _;
        use tokio::io::AsyncWriteExt as _;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let first_bytes: Arc<Mutex<Vec<u8>>> = Arc::default();
        let accept = tokio::spawn({
            let first_bytes = first_bytes.clone();
            async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    let first_bytes = first_bytes.clone();
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 4096];
                        let n = match client.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        first_bytes
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push(buf[0]);
                        let Ok(mut server) =
                            tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                        else {
                            return;
                        };
                        if server.write_all(&buf[..n]).await.is_ok() {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    });
                }
            }
        })
        .abort_handle();
        Self {
            port,
            first_bytes,
            accept,
        }
    }

    fn first_bytes(&self) -> Vec<u8> {
        self.first_bytes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Drop for PlainTextRelay {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// A TLS record of type handshake: how a TLS client's first bytes begin.
const TLS_HANDSHAKE: u8 = 0x16;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_cannot_be_downgraded_to_plain_text_by_a_relay() {
    let server = RedisServer::start(&["--requirepass", "relay-pass-5"]);
    let relay = PlainTextRelay::start(server.port).await;
    let url = format!("rediss://:relay-pass-5@127.0.0.1:{}", relay.port);
    let err = within(
        15,
        "connecting through the plain-text relay",
        RedisBackend::builder(&url)
            .connect_timeout(Duration::from_secs(2))
            .connect(),
    )
    .await
    .expect_err("a server that does not speak TLS must be refused");
    eprintln!("{err}");
    assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
    assert!(!err.to_string().contains("relay-pass-5"), "{err}");
    let first = relay.first_bytes();
    assert!(!first.is_empty(), "the client must have tried the relay");
    assert!(
        first.iter().all(|&b| b == TLS_HANDSHAKE),
        "every connection must open with a TLS handshake, never a plain command: {first:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_insecure_is_refused_before_connecting() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    for url in [
        format!("rediss://:insecure-pass-6@127.0.0.1:{port}#insecure"),
        format!("rediss://127.0.0.1:{port}/0#insecure"),
    ] {
        let err = RedisBackend::builder(&url)
            .connect_timeout(Duration::from_secs(2))
            .connect()
            .await
            .expect_err("#insecure must be refused");
        eprintln!("{err}");
        assert!(
            matches!(err, LockError::InvalidOption { option: "url", .. }),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("#insecure") && text.contains("tls_root_certificate"),
            "the error must name the fragment and the safe alternative: {text}"
        );
        assert!(!text.contains("insecure-pass-6"), "{text}");
    }
    assert!(
        listener.accept().is_err(),
        "nothing may be sent to the server"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_plain_text_urls_are_not_mixed_in_one_backend() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    for (first, second) in [
        (
            format!("rediss://127.0.0.1:{port}"),
            format!("redis://127.0.0.1:{port}"),
        ),
        (
            format!("redis://127.0.0.1:{port}"),
            format!("rediss://127.0.0.1:{port}"),
        ),
    ] {
        let err = RedisBackend::builder(&first)
            .node(&second)
            .connect_timeout(Duration::from_secs(2))
            .connect()
            .await
            .expect_err("TLS and plain text mixed");
        eprintln!("{err}");
        assert!(
            matches!(err, LockError::InvalidOption { option: "url", .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("plain text"), "{err}");
    }
    assert!(
        listener.accept().is_err(),
        "nothing may be sent to either node"
    );
}

#[test]
fn the_docs_give_the_least_privilege_acl_line_the_tests_use() {
    for (doc, text) in [
        ("docs/redis.md", include_str!("../../docs/redis.md")),
        (
            "dlock-runtime/src/redis/mod.rs",
            include_str!("../../dlock-runtime/src/redis/mod.rs"),
        ),
    ] {
        assert!(
            text.lines()
                .any(|line| line.trim_start_matches("//!").trim()
                    == redis_support::LEAST_PRIVILEGE_ACL),
            "{doc} must give, on a line of its own, the ACL rules the tests use:\n{}",
            redis_support::LEAST_PRIVILEGE_ACL
        );
    }
}

// ---------------------------------------------------------------------------
// Links that go silent: the socket stays open, nothing comes back (a NAT or
// load balancer that forgot the connection, a peer that lost power). The
// kernel gives up on such a socket only after about 15 minutes, and never
// while a proxy keeps it alive.

/// A backend that reaches `server` through a fresh proxy, with timeouts
/// short enough that silence is noticed soon, and long enough that a
/// healthy reply from a loaded machine is not taken for silence (a lease
/// that must survive the silence has a ttl of three of them or more).
async fn behind_proxy(server: &RedisServer) -> (support::proxy::Proxy, RedisBackend) {
    let proxy = support::proxy::Proxy::bind(server.address()).await;
    let redis = RedisBackend::builder(&format!("redis://127.0.0.1:{}", proxy.port))
        .connect_timeout(Duration::from_secs(1))
        .response_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect("connect through the proxy");
    (proxy, redis)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_connection_gone_silent_is_replaced_once_and_leases_keep_renewing() {
    let server = RedisServer::start(&[]);
    let (proxy, redis) = behind_proxy(&server).await;
    let backend: Arc<dyn Backend> = Arc::new(redis);
    take_token(&backend, &fresh_key("silent-warm-up")).await;
    // Held across the silence: its renewals meet the silent connection.
    let held = LockOptions::new(Duration::from_secs(12))
        .acquire_on(backend.clone(), fresh_key("silent-held"))
        .await
        .expect("free");
    let opened = proxy.connections();

    proxy.silence();
    // Twenty callers at once meet the silent connection, and each must get
    // its key on a new one, long before the kernel would give up.
    let callers: Vec<_> = (0..20)
        .map(|i| support::spawn_waiter(backend.clone(), &fresh_key(&format!("silent-{i}")), 30, 10))
        .collect();
    within(
        20,
        "locking again after the connection went silent",
        async {
            for caller in callers {
                caller
                    .await
                    .expect("task")
                    .expect("a new connection must replace the silent one")
                    .release()
                    .await
                    .expect("release");
            }
        },
    )
    .await;
    let new_connections = proxy.connections() - opened;
    assert!(
        (1..=3).contains(&new_connections),
        "twenty callers on one silent connection must share one new connection, not open \
         one each: {new_connections} new connections"
    );

    // Leases taken on the new connection renew, and so did the one held
    // across the silence.
    let lease = LockOptions::new(Duration::from_secs(3))
        .acquire_on(backend.clone(), fresh_key("silent-after"))
        .await
        .expect("free");
    sleep(Duration::from_secs(4)).await;
    for (which, lease) in [("taken after the silence", lease), ("held across it", held)] {
        assert!(
            lease.check().is_ok(),
            "the lease {which} was lost: {:?}",
            lease.check()
        );
        lease.release().await.expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_pubsub_connection_went_silent_gets_the_key_once_it_is_released() {
    let server = RedisServer::start(&[]);
    let (proxy, redis) = behind_proxy(&server).await;
    let waiters: Arc<dyn Backend> = Arc::new(redis.clone());
    let holders = connect(&server.url()).await;
    let key = fresh_key("silent-pubsub");
    let channel = format!("dlock:{{{key}}}:released");
    let holder = LockOptions::new(Duration::from_secs(60))
        .acquire_on(holders.clone(), &key)
        .await
        .expect("free");
    let commands = proxy.connections();
    // Waits less long than a waiter that is never woken naps between two
    // looks at a key held for 60 s.
    let waiter = support::spawn_waiter(waiters.clone(), &key, 30, 8);
    within(10, "the waiter to subscribe", async {
        while server.cli(&["PUBSUB", "NUMSUB", &channel]) != format!("{channel}\n1") {
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await;

    // Only the pub/sub connection goes silent: the release is never heard
    // on it, while the commands still work.
    proxy.silence_since(commands);
    holder.release().await.expect("release");
    let lease = within(20, "the waiter", waiter)
        .await
        .expect("task")
        .expect("the waiter must get the released key before its wait runs out");
    lease.release().await.expect("release");

    // Once nobody waits, nothing is sent to check the pub/sub connection.
    within(10, "unsubscribing", async {
        while redis.subscribed_channels() > 0 {
            sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let pings = || {
        let stats = server.cli(&["INFO", "commandstats"]);
        stats
            .lines()
            .find_map(|line| line.strip_prefix("cmdstat_ping:calls="))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |calls| calls.parse::<u64>().expect("a PING count"))
    };
    // The health check decides to PING under the channels lock while a
    // channel is still confirmed, and sends it after (redis/subscriber.rs
    // `check_health`): one PING decided just before the last channel went
    // may reach the server after the count above read 0, and none after
    // it. So the count is settled once two reads a health interval (1 s)
    // apart agree, and may have grown by that one PING meanwhile.
    const HEALTH_INTERVAL: Duration = Duration::from_secs(1);
    let first = pings();
    let mut before = first;
    loop {
        sleep(HEALTH_INTERVAL + Duration::from_millis(500)).await;
        let now = pings();
        assert!(
            now <= first + 1,
            "PINGs went on after nobody waited: {first}, then {now}"
        );
        if now == before {
            break;
        }
        before = now;
    }
    sleep(Duration::from_secs(3)).await;
    assert_eq!(pings(), before, "PINGs were sent while nobody waited");
}

/// A server of the test's own with a user whose rules are the
/// least-privilege ACL without `rule` (as the previous release's), and a
/// backend connected as that user.
async fn backend_without_rule(
    rule: &str,
    user: &str,
    password: &str,
) -> (RedisServer, Arc<dyn Backend>) {
    let server = RedisServer::start(&[]);
    let target = ["-p".to_owned(), server.port.to_string()];
    let target: Vec<&str> = target.iter().map(String::as_str).collect();
    redis_support::create_user(
        &target,
        user,
        password,
        redis_support::LEAST_PRIVILEGE_ACL
            .split_whitespace()
            .filter(|kept| *kept != rule),
    );
    let url = format!("redis://{user}:{password}@127.0.0.1:{}", server.port);
    let backend: Arc<dyn Backend> = Arc::new(RedisBackend::connect(&url).await.expect("connect"));
    (server, backend)
}

#[tokio::test(flavor = "current_thread")]
async fn an_acl_without_setrange_still_answers_held_and_says_waiters_will_not_be_woken() {
    // The previous release's least-privilege rules lack `+setrange`: an
    // attempt that finds the key held cannot mark the holder, which must
    // still read "held" (never a backend error) and be said once, loudly.
    let (logs, _guard) = support::Logs::capture();
    let (_server, backend) = backend_without_rule("+setrange", "older", "older-pass-5").await;
    let key = fresh_key("acl-no-setrange");
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    for _ in 0..3 {
        let refused = LockOptions::new(Duration::from_secs(30))
            .acquire_on(backend.clone(), &key)
            .await
            .expect_err("held");
        assert!(
            matches!(refused, LockError::Held { .. }),
            "a refused mark must still read as held: {refused}"
        );
    }
    holder.release().await.expect("release");
    let text = logs.text();
    assert_eq!(
        text.matches("releases will not wake waiters").count(),
        1,
        "said once per backend, not per attempt:\n{text}"
    );
    assert!(
        text.contains("+setrange") && !text.contains("older-pass-5"),
        "{text}"
    );
}

/// A fair waiter's task: takes `key`, lets it go, and answers its token,
/// or what failed.
fn fair_waiter(
    backend: Arc<dyn Backend>,
    key: &LockKey,
    fair: &LockOptions,
) -> tokio::task::JoinHandle<Result<dlock::FencingToken, String>> {
    let (key, fair) = (key.clone(), fair.clone());
    tokio::spawn(async move {
        let lease = fair
            .acquire_on(backend, &key)
            .await
            .map_err(|e| e.to_string())?;
        let token = lease.token();
        lease.release().await.map_err(|e| e.to_string())?;
        Ok(token)
    })
}

/// Asserts every waiter was served after the holder (`first`), in the
/// order they queued, with rising tokens.
async fn assert_served_in_order(
    first: dlock::FencingToken,
    waiters: Vec<tokio::task::JoinHandle<Result<dlock::FencingToken, String>>>,
    case: &str,
) {
    let mut tokens = vec![first];
    for waiter in waiters {
        tokens.push(waiter.await.expect("task").expect("every waiter is served"));
    }
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "{case}: served in arrival order with rising tokens: {tokens:?}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn an_acl_without_getrange_still_serves_fair_waiters_in_order_and_says_so_once() {
    // The previous release's least-privilege rules lack `+getrange`: a
    // fair waiter's refresh cannot read its queue's stamp, and must still
    // queue, be served in order, and be said once.
    let (logs, _guard) = support::Logs::capture();
    let (_server, backend) =
        backend_without_rule("+getrange", "stampless", "stampless-pass-6").await;
    let key = fresh_key("acl-no-getrange");
    let fair = LockOptions::new(Duration::from_secs(30))
        .wait(Duration::from_secs(20))
        .fair(true);
    let holder = fair.acquire_on(backend.clone(), &key).await.expect("free");
    let mut waiters = Vec::new();
    for _ in 0..2 {
        waiters.push(fair_waiter(backend.clone(), &key, &fair));
        // Past a refresh (a third of the entry's life): the next waiter
        // arrives after it.
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }
    let first = holder.token();
    holder.release().await.expect("release");
    assert_served_in_order(first, waiters, "no +getrange").await;
    let text = logs.text();
    assert_eq!(
        text.matches("read of its queue's stamp").count(),
        1,
        "said once per backend, not per refresh:\n{text}"
    );
    assert!(
        text.contains("+getrange") && !text.contains("stampless-pass-6"),
        "{text}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn an_acl_without_setrange_still_serves_fair_waiters_in_order() {
    // Without `+setrange` no attempt can mark the holder, so a release
    // hands nothing over and the waiters find the key free at their next
    // look: the first live waiter must then take it (with others queued
    // behind it) without an error, and the next one after its release.
    let (logs, _guard) = support::Logs::capture();
    let (server, backend) =
        backend_without_rule("+setrange", "unmarking", "unmarking-pass-7").await;
    let key = fresh_key("acl-no-setrange-fair");
    let fair = LockOptions::new(Duration::from_secs(30))
        .wait(Duration::from_secs(20))
        .fair(true);
    let holder = fair.acquire_on(backend.clone(), &key).await.expect("free");
    let mut waiters = Vec::new();
    let url = format!(
        "redis://unmarking:unmarking-pass-7@127.0.0.1:{}",
        server.port
    );
    for _ in 0..3 {
        // Each waiter a process of its own: only the server can wake it.
        let backend: Arc<dyn Backend> =
            Arc::new(RedisBackend::connect(&url).await.expect("connect"));
        waiters.push(fair_waiter(backend, &key, &fair));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let first = holder.token();
    holder.release().await.expect("release");
    assert_served_in_order(first, waiters, "no +setrange").await;
    let text = logs.text();
    assert!(
        !text.contains("failed"),
        "no attempt may fail on the refused mark:\n{text}"
    );
    assert!(
        text.contains("+setrange") && !text.contains("unmarking-pass-7"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_without_setrange_still_grants_permits_and_shared_locks_to_waiters() {
    // A caller whose process has waiters queued for the key takes it
    // marked at once; without `+setrange` that mark is refused, and the
    // grant must still stand, exactly once, with no error.
    let (logs, _guard) = support::Logs::capture();
    let (_server, backend) =
        backend_without_rule("+setrange", "unflagged", "unflagged-pass-8").await;
    for (name, options) in [
        (
            "permit",
            LockOptions::new(Duration::from_secs(30)).permits(1),
        ),
        (
            "shared",
            LockOptions::new(Duration::from_secs(30)).mode(dlock::LockMode::Shared),
        ),
    ] {
        let key = fresh_key(&format!("acl-no-setrange-{name}"));
        let writer = LockOptions::new(Duration::from_secs(30)).wait(Duration::from_secs(20));
        let options = options.wait(Duration::from_secs(20));
        let inside = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for task in 0..4 {
            let (backend, key, inside) = (backend.clone(), key.clone(), inside.clone());
            // Shared: half the tasks write, so readers wait behind writers.
            // A holder alone counts 1000 (a writer, the single permit), a
            // reader 1: none may find a holder alone beside it.
            let (options, weight) = match (name, task % 2) {
                ("shared", 0) => (writer.clone(), 1000),
                ("shared", _) => (options.clone(), 1),
                _ => (options.clone(), 1000),
            };
            tasks.push(tokio::spawn(async move {
                use std::sync::atomic::Ordering::SeqCst;
                for _ in 0..5 {
                    let lease = options
                        .acquire_on(backend.clone(), &key)
                        .await
                        .map_err(|err| err.to_string())?;
                    let others = inside.fetch_add(weight, SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    inside.fetch_sub(weight, SeqCst);
                    lease.release().await.map_err(|err| err.to_string())?;
                    if others >= 1000 || (weight == 1000 && others != 0) {
                        return Err(format!("{name}: held beside others ({others})"));
                    }
                }
                Ok::<_, String>(())
            }));
        }
        for task in tasks {
            task.await
                .expect("task")
                .expect("every acquisition is granted");
        }
    }
    let text = logs.text();
    assert!(
        !text.contains("failed"),
        "no attempt may fail on the refused mark:\n{text}"
    );
}

/// Stops a server process (SIGSTOP: a hung or swapped-out server, or a
/// partition that drops packets) until dropped (SIGCONT).
struct Stopped(u32);

impl Stopped {
    fn new(pid: u32) -> Self {
        let status = std::process::Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .expect("kill -STOP");
        assert!(status.success(), "kill -STOP {pid}");
        Self(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-CONT", &self.0.to_string()])
            .status();
    }
}

/// A caller that waits returns by its deadline when the server stops
/// answering, fair or not (give or take the least a call is given), not
/// after the backend's own response timeout, and names the store that did
/// not answer rather than a held key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_caller_returns_by_its_deadline_when_the_server_stops_answering() {
    let server = RedisServer::start(&[]);
    let url = server.url();
    // A reply timeout far longer than the wait below: by design a waiting
    // caller returns by its wait plus the least a call is given (0.5 s,
    // lease/acquire.rs `LEAST_PER_CALL`), 1.5 s here, whatever the
    // backend's own timeouts. One that waits for the backend instead
    // returns after 10 s, far past the bound below, so the bound can leave
    // a loaded machine room without letting that bug through.
    const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
    let make = || async {
        Arc::new(
            RedisBackend::builder(&url)
                .response_timeout(RESPONSE_TIMEOUT)
                .connect()
                .await
                .expect("connect"),
        ) as Arc<dyn Backend>
    };
    let key = fresh_key("stopped");
    let holder = LockOptions::new(Duration::from_secs(60))
        .acquire_on(make().await, &key)
        .await
        .expect("free");
    let (plain, fair) = (make().await, make().await);
    let stopped = Stopped::new(server.pid().expect("running"));
    let wait = Duration::from_secs(1);
    let call = |backend: Arc<dyn Backend>, fair: bool| {
        let key = key.clone();
        async move {
            let started = std::time::Instant::now();
            let taken = LockOptions::new(Duration::from_secs(30))
                .wait(wait)
                .fair(fair)
                .acquire_on(backend, &key)
                .await;
            (started.elapsed(), taken)
        }
    };
    let (plain, fair) = tokio::join!(call(plain, false), call(fair, true));
    drop(stopped);
    for (name, (took, taken)) in [("plain", plain), ("fair", fair)] {
        assert!(
            took < wait + Duration::from_secs(5) && took < RESPONSE_TIMEOUT,
            "a {name} caller with a wait of {wait:?} returned after {took:?}"
        );
        match taken {
            Err(LockError::Backend { .. }) => {}
            other => panic!("a {name} caller must name the silent store, got {other:?}"),
        }
    }
    drop(holder);
}

/// A server that lost its script cache (`SCRIPT FLUSH`, as after a
/// restart) under held leases of every kind: the next renewal batch gets
/// `NOSCRIPT`, loads the renewal scripts and renews in the same call, and
/// no lease is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_go_on_after_the_server_loses_its_script_cache() {
    let server = RedisServer::start(&[]);
    let backend = connect(&server.url()).await;
    // Long enough that a loaded machine's stall does not outlast it; every
    // lease is still checked past a whole ttl after each flush.
    let ttl = Duration::from_secs(3);
    let exclusive = LockOptions::new(ttl)
        .acquire_on(backend.clone(), &fresh_key("flush-exclusive"))
        .await
        .expect("free");
    let shared = LockOptions::new(ttl)
        .mode(dlock::LockMode::Shared)
        .acquire_on(backend.clone(), &fresh_key("flush-shared"))
        .await
        .expect("free");
    let permit = LockOptions::new(ttl)
        .permits(2)
        .acquire_on(backend.clone(), &fresh_key("flush-permit"))
        .await
        .expect("free");
    for _ in 0..2 {
        assert_eq!(server.cli(&["SCRIPT", "FLUSH"]), "OK");
        // Several renewal intervals, past the ttl.
        sleep(ttl + Duration::from_millis(300)).await;
        exclusive.check().expect("the exclusive lease was renewed");
        shared.check().expect("the shared lease was renewed");
        permit.check().expect("the permit was renewed");
    }
    exclusive.release().await.expect("release");
    shared.release().await.expect("release");
    permit.release().await.expect("release");
}

/// A backend on `server` as a user with the least-privilege ACL and the
/// list queues' seven commands, beginning list queues if `list`.
async fn backend_with_list_rules(server: &RedisServer, list: bool) -> Arc<dyn Backend> {
    let target = ["-p".to_owned(), server.port.to_string()];
    let target: Vec<&str> = target.iter().map(String::as_str).collect();
    redis_support::create_user(
        &target,
        "lister",
        "lister-pass-9",
        redis_support::LEAST_PRIVILEGE_ACL
            .split_whitespace()
            .chain("+lpush +rpush +lpop +rpop +lindex +lpos +lrem".split_whitespace()),
    );
    let url = format!("redis://lister:lister-pass-9@127.0.0.1:{}", server.port);
    Arc::new(
        RedisBackend::builder(&url)
            .list_queues(list)
            .connect()
            .await
            .expect("connect"),
    )
}

/// The token in a lock key's value (`<owner><mark> <token> …`), if held.
fn token_in(server: &RedisServer, key: &str) -> Option<u64> {
    let value = server.cli(&["GET", &format!("dlock:{{{key}}}:lock")]);
    value.split(' ').nth(1)?.parse().ok()
}

/// A fair holder's release after an operator took a command from the ACL
/// that the release calls once it has written (`PUBLISH`, announcing; the
/// list queue's `LINDEX`, reading the next line after its pop) still frees
/// the key or hands it on, and says so: it must never fail after its
/// write, leaving the key held by its released owner for the rest of its
/// ttl, with the queue's first line popped. Every waiter is then served,
/// and a backend whose release went unannounced says so once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_release_refused_a_command_after_its_write_still_lets_the_key_go() {
    let (logs, _guard) = support::Logs::capture();
    for (rule, list) in [("-lindex", true), ("-publish", true), ("-publish", false)] {
        let server = RedisServer::start(&[]);
        let backend = backend_with_list_rules(&server, list).await;
        let key = fresh_key("refused-after-write");
        let fair = LockOptions::new(Duration::from_secs(30))
            .wait(Duration::from_secs(20))
            .fair(true);
        let holder = fair.acquire_on(backend.clone(), &key).await.expect("free");
        let mut waiters = Vec::new();
        for _ in 0..2 {
            waiters.push(fair_waiter(backend.clone(), &key, &fair));
            sleep(Duration::from_millis(300)).await;
        }
        sleep(Duration::from_millis(300)).await;
        server.cli(&["ACL", "SETUSER", "lister", rule]);
        let held = holder.token();
        let released = holder.release().await;
        assert!(released.is_ok(), "{rule}, list {list}: {released:?}");
        assert_ne!(
            token_in(&server, key.as_str()),
            Some(held.get()),
            "{rule}, list {list}: the released lease still holds the key"
        );
        assert_served_in_order(held, waiters, &format!("{rule}, list {list}")).await;
    }
    // Each -publish backend says so once: its release was not announced.
    let text = logs.text();
    assert_eq!(
        text.matches("refused to announce a release").count(),
        2,
        "{text}"
    );
}

/// A full server (`noeviction`, as docs/redis.md asks) refuses new
/// acquisitions, never a release: a fair release whose handoff the full
/// server refuses, behind a dead waiter's line that it would drop from
/// the queue, still frees the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_server_refuses_no_fair_release() {
    use dlock::backend::{AcquireRequest, Queue};
    let server = RedisServer::start(&["--maxmemory-policy", "noeviction"]);
    let backend: Arc<dyn Backend> =
        Arc::new(RedisBackend::connect(&server.url()).await.expect("connect"));
    let key = fresh_key("full-server");
    let fair = LockOptions::new(Duration::from_secs(30))
        .wait(Duration::from_secs(20))
        .fair(true);
    let holder = fair.acquire_on(backend.clone(), &key).await.expect("free");
    // A waiter that queues and dies: its entry lives 300 ms.
    let dead = OwnerId::random().expect("owner");
    backend
        .try_acquire(
            &AcquireRequest::new(&key, &dead, Duration::from_secs(30))
                .with_queue(Queue::Join {
                    entry_ttl: Duration::from_millis(300),
                })
                .with_waits(true),
        )
        .await
        .expect("the dead waiter queues");
    let waiter = {
        let (backend, key, fair) = (backend.clone(), key.clone(), fair.clone());
        tokio::spawn(async move { fair.acquire_on(backend, &key).await.map(|l| l.token()) })
    };
    sleep(Duration::from_millis(600)).await;
    server.cli(&["CONFIG", "SET", "maxmemory", "1"]);
    let held = holder.token();
    let released = holder.release().await;
    server.cli(&["CONFIG", "SET", "maxmemory", "0"]);
    assert!(released.is_ok(), "{released:?}");
    assert_ne!(
        token_in(&server, key.as_str()),
        Some(held.get()),
        "the released lease still holds the key"
    );
    let next = waiter
        .await
        .expect("task")
        .expect("the live waiter is served");
    assert!(next > held);
}

/// A campaign whose announcement the ACL refuses (no `+publish`) still
/// wins, or holds nothing: the identity acquisition must not fail after
/// it took the key, which left a leader nobody was, for a whole ttl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_campaign_refused_its_announcement_wins_and_resigns() {
    let server = RedisServer::start(&[]);
    let backend = backend_with_list_rules(&server, false).await;
    server.cli(&["ACL", "SETUSER", "lister", "-publish"]);
    let key = fresh_key("unannounced");
    let election = dlock::election::Election::new(key.as_str(), "node-a", Duration::from_secs(20))
        .expect("an election")
        .on(backend.clone());
    let leader = tokio::time::timeout(Duration::from_secs(10), election.campaign())
        .await
        .expect("the campaign ends")
        .expect("the campaign wins");
    leader.resign().await.expect("resign");
    assert_eq!(token_in(&server, key.as_str()), None, "the key is free");
}

/// A permit attempt on a free key whose slot the ACL refuses to write (no
/// `+hset`) fails before it takes the key, so nothing stays held for its
/// ttl: once the rule is back, the key is free at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_refused_its_slot_takes_no_key() {
    let server = RedisServer::start(&[]);
    let backend = backend_with_list_rules(&server, false).await;
    let key = fresh_key("slotless");
    let permit = LockOptions::new(Duration::from_secs(30)).permits(2);
    server.cli(&["ACL", "SETUSER", "lister", "-hset"]);
    let refused = permit.acquire_on(backend.clone(), &key).await;
    assert!(refused.is_err(), "{:?}", refused.map(|lease| lease.token()));
    assert_eq!(
        server.cli(&["EXISTS", &format!("dlock:{{{key}}}:lock")]),
        "0",
        "the refused attempt left the key held"
    );
    server.cli(&["ACL", "SETUSER", "lister", "+hset"]);
    let lease = permit
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    lease.release().await.expect("release");
}

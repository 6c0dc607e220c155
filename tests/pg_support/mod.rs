//! PostgreSQL instances a test starts for itself: password authentication
//! (scram-sha-256) and TLS, on a free loopback port, run as user `postgres`
//! when the tests run as root (PostgreSQL refuses root), stopped and removed
//! again by a drop guard.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dlock::backend::OwnerId;

/// The password of the `postgres` user of every [`OwnServer`].
pub const PASSWORD: &str = "s3cret pass'word";
/// The password as it appears in a URL.
pub const PASSWORD_IN_URL: &str = "s3cret%20pass%27word";

/// Whether another session can take `key` (default key seed) on the
/// server `client` talks to; gives it back at once.
pub async fn free_on_the_server(
    client: &dlock::pg::tokio_postgres::Client,
    key: &dlock::LockKey,
) -> bool {
    client
        .query_one(
            "SELECT CASE WHEN pg_try_advisory_lock(h) THEN pg_advisory_unlock(h) ELSE false END \
             FROM (SELECT hashtextextended($1::text, 0) AS h) AS k",
            &[&key.as_str()],
        )
        .await
        .expect("try the key")
        .get(0)
}

/// Whether `key`'s advisory lock is free, or is freed within 5 s. A lock
/// statement that failed took the key's lock for its transaction at least,
/// and the server lets go of a failed transaction's locks after it sent
/// the error, so a check made at once may find that lock still there: a
/// lock left behind for good stays past the 5 s.
pub async fn freed_on_the_server(
    client: &dlock::pg::tokio_postgres::Client,
    key: &dlock::LockKey,
) -> bool {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        if free_on_the_server(client, key).await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The shared server (trust authentication), from `DLOCK_PG_URL`.
pub fn shared_conn() -> String {
    std::env::var("DLOCK_PG_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 port=5432 user=postgres dbname=test".to_owned())
}

/// The shared server's connection string, for its database `db`.
pub fn conn_to(db: &str) -> String {
    use dlock::pg::tokio_postgres::config::Host;
    let config: dlock::pg::tokio_postgres::Config = shared_conn().parse().expect("DLOCK_PG_URL");
    let mut conn = format!("dbname={db}");
    if let Some(Host::Tcp(host)) = config.get_hosts().first() {
        conn.push_str(&format!(" host={host}"));
    }
    if let Some(port) = config.get_ports().first() {
        conn.push_str(&format!(" port={port}"));
    }
    if let Some(user) = config.get_user() {
        conn.push_str(&format!(" user={user}"));
    }
    if let Some(password) = config.get_password() {
        let password = String::from_utf8_lossy(password)
            .replace('\\', "\\\\")
            .replace('\'', "\\'");
        conn.push_str(&format!(" password='{password}'"));
    }
    conn
}

/// A plain client of the shared server, as a DBA or an application uses.
pub async fn shared_client() -> dlock::pg::tokio_postgres::Client {
    client_of(&shared_conn()).await
}

/// A plain client of `conn` (a role's connection string, say), driven by
/// a task of its own.
pub async fn client_of(conn: &str) -> dlock::pg::tokio_postgres::Client {
    let (client, connection) =
        dlock::pg::tokio_postgres::connect(conn, dlock::pg::tokio_postgres::NoTls)
            .await
            .expect("PostgreSQL at 127.0.0.1:5432 or DLOCK_PG_URL");
    tokio::spawn(connection);
    client
}

/// Twelve random hex digits, for names of a test's own.
pub fn random_id() -> String {
    OwnerId::random().expect("random bytes").to_string()[..12].to_owned()
}

/// A schema of the test's own on the shared server (and, if asked for, a
/// login role), dropped with everything in it when the test ends, even if
/// it panicked: tests in schemas of their own run in parallel and see only
/// their own objects.
pub struct ScratchSchema {
    pub name: String,
    pub role: Option<String>,
}

impl ScratchSchema {
    pub fn new(label: &str) -> Self {
        Self {
            name: format!("dlock_{label}_{}", random_id()),
            role: None,
        }
    }

    /// Backend options that use this schema.
    pub fn options(&self) -> dlock::pg::PgOptions {
        dlock::pg::PgOptions::new().schema(&self.name)
    }

    /// Whether `{schema}.{relation}` exists.
    pub async fn has_relation(
        &self,
        client: &dlock::pg::tokio_postgres::Client,
        relation: &str,
    ) -> bool {
        client
            .query_one(
                "SELECT to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL",
                &[&self.name, &relation],
            )
            .await
            .expect("look up the relation")
            .get(0)
    }

    /// Creates the schema and its token sequence as the DBA would, and a
    /// login role that may use them (USAGE on the schema, USAGE and UPDATE
    /// on the sequence) but create nothing in the schema; returns a
    /// connection string for that role.
    pub async fn role_without_create(
        &mut self,
        admin: &dlock::pg::tokio_postgres::Client,
    ) -> String {
        self.role_with_sequence_grants(admin, "USAGE, UPDATE").await
    }

    /// As [`role_without_create`](Self::role_without_create), with USAGE
    /// alone on the sequence: a role whose tokens rest on the clock.
    pub async fn role_with_usage_only(
        &mut self,
        admin: &dlock::pg::tokio_postgres::Client,
    ) -> String {
        self.role_with_sequence_grants(admin, "USAGE").await
    }

    /// As [`role_without_create`](Self::role_without_create), with
    /// `grants` on the sequence.
    pub async fn role_with_sequence_grants(
        &mut self,
        admin: &dlock::pg::tokio_postgres::Client,
        grants: &str,
    ) -> String {
        let role = format!("dlock_role_{}", random_id());
        admin
            .batch_execute(&format!(
                "CREATE ROLE {role} LOGIN; \
                 CREATE SCHEMA {s}; CREATE SEQUENCE {s}.dlock_token_seq AS bigint; \
                 GRANT USAGE ON SCHEMA {s} TO {role}; \
                 GRANT {grants} ON SEQUENCE {s}.dlock_token_seq TO {role};",
                s = self.name
            ))
            .await
            .expect("role and objects");
        self.role = Some(role.clone());
        let config: dlock::pg::tokio_postgres::Config = shared_conn().parse().expect("config");
        format!(
            "host=127.0.0.1 port={} user={role} dbname={}",
            config.get_ports().first().copied().unwrap_or(5432),
            config.get_dbname().unwrap_or("test"),
        )
    }
}

impl Drop for ScratchSchema {
    fn drop(&mut self) {
        // Bounded: a test that failed while a transaction of its own still
        // holds a lock on the schema's objects (its runtime, and so that
        // connection, outlive this drop) must fail, not hang the suite; the
        // schema is then left behind, and said so.
        let mut sql = format!(
            "SET lock_timeout = '10s'; DROP SCHEMA IF EXISTS {} CASCADE;",
            self.name
        );
        if let Some(role) = &self.role {
            sql.push_str(&format!(" DROP ROLE IF EXISTS {role};"));
        }
        // A runtime of its own on a thread of its own: this may run while
        // the test's runtime is unwinding.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async move {
                let (client, connection) = dlock::pg::tokio_postgres::connect(
                    &shared_conn(),
                    dlock::pg::tokio_postgres::NoTls,
                )
                .await
                .ok()?;
                tokio::spawn(connection);
                if let Err(err) = client.batch_execute(&sql).await {
                    eprintln!("could not drop the test's schema: {err}");
                }
                Some(())
            })
        })
        .join();
    }
}

/// A PostgreSQL instance of the test's own, with password authentication
/// and TLS (self-signed certificate for 127.0.0.1), stopped and removed on
/// drop.
pub struct OwnServer {
    pub dir: PathBuf,
    pub port: u16,
    bin: PathBuf,
}

impl OwnServer {
    pub fn start() -> Self {
        let bin = pg_bin_dir();
        let id = OwnerId::random().expect("random");
        // Under /tmp: the `postgres` user must be able to reach it.
        let dir = std::env::temp_dir().join(format!("dlock-pg-{id}"));
        std::fs::create_dir_all(&dir).expect("server dir");
        let mut server = Self {
            dir,
            port: free_port(),
            bin,
        };
        let pwfile = server.dir.join("pw");
        std::fs::write(&pwfile, PASSWORD).expect("pwfile");
        let cert = server.dir.join("server.crt");
        let key = server.dir.join("server.key");
        crate::support::make_test_certificates(&server.dir);
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
            "\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             fsync = off\nssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\nmax_connections = 40\n",
            server.dir.display(),
            cert.display(),
            key.display(),
        );
        let conf = server.data().join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).expect("postgresql.conf");
        text.push_str(&settings);
        std::fs::write(&conf, text).expect("write postgresql.conf");
        server.start_on_a_free_port();
        server
    }

    /// [`start`](Self::start), with the server's messages in `language`
    /// (gettext's `LANGUAGE`, `lc_messages` C.UTF-8), as a non-English
    /// server writes them; panics if the server does not speak it (its
    /// translations missing), so no test passes on English by mistake.
    pub fn start_speaking(language: &str, division_by_zero: &str) -> Self {
        let server = Self::start();
        let stopped = server.pg_ctl_stop("fast");
        assert!(stopped.status.success(), "pg_ctl stop: {stopped:?}");
        let conf = server.data().join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).expect("postgresql.conf");
        text.push_str("\nlc_messages = 'C.UTF-8'\n");
        std::fs::write(&conf, text).expect("write postgresql.conf");
        run(server.pg_ctl_start_command().env("LANGUAGE", language));
        let psql = server
            .as_postgres("psql")
            .args(["-h", "127.0.0.1", "-p", &server.port.to_string()])
            .args(["-U", "postgres", "-d", "postgres", "-c", "SELECT 1/0"])
            .env("PGPASSWORD", PASSWORD)
            .output()
            .expect("psql");
        let said = String::from_utf8_lossy(&psql.stderr);
        assert!(
            said.contains(division_by_zero),
            "the server does not speak {language} (are its translations installed?): {said}"
        );
        server
    }

    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub fn as_postgres(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        if is_root() {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(program);
            command
        } else {
            Command::new(program)
        }
    }

    pub fn pg_ctl_start(&self) {
        run(&mut self.pg_ctl_start_command());
    }

    fn pg_ctl_start_command(&self) -> Command {
        let log = self.dir.join("log");
        let mut command = self.as_postgres("pg_ctl");
        command.args([
            "-D",
            path(&self.data()),
            "-l",
            path(&log),
            "-w",
            "-t",
            "30",
            "start",
        ]);
        command
    }

    /// Starts the server for the first time, on `self.port` (written to
    /// its settings), or on a fresh port if another process took that one
    /// between its pick and the server's bind.
    fn start_on_a_free_port(&mut self) {
        let conf = self.data().join("postgresql.conf");
        let log = self.dir.join("log");
        for tries in 1.. {
            // The last `port` line of the settings wins.
            let mut text = std::fs::read_to_string(&conf).expect("postgresql.conf");
            text.push_str(&format!("\nport = {}\n", self.port));
            std::fs::write(&conf, text).expect("write postgresql.conf");
            let logged = std::fs::metadata(&log).map_or(0, |m| m.len());
            let out = self
                .pg_ctl_start_command()
                .output()
                .expect("run pg_ctl start");
            if out.status.success() {
                return;
            }
            let log_text = std::fs::read(&log).unwrap_or_default();
            let since = usize::try_from(logged).unwrap_or(0).min(log_text.len());
            let log_text = String::from_utf8_lossy(&log_text[since..]);
            assert!(
                log_text.contains("Address already in use") && tries < 5,
                "pg_ctl start failed: {}{}{log_text}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            self.port = free_port();
        }
    }

    pub fn pg_ctl_stop(&self, mode: &str) -> Output {
        self.as_postgres("pg_ctl")
            .args(["-D", path(&self.data()), "-m", mode, "-w", "stop"])
            .output()
            .expect("pg_ctl stop")
    }

    /// Copies the data directory of the stopped server aside, as a backup.
    pub fn back_up(&self) -> PathBuf {
        let copy = self.dir.join("backup");
        run(Command::new("cp").args(["-a", path(&self.data()), path(&copy)]));
        copy
    }

    /// Puts a backup made by [`OwnServer::back_up`] back in place of the
    /// stopped server's data directory.
    pub fn restore(&self, backup: &Path) {
        std::fs::remove_dir_all(self.data()).expect("remove the data directory");
        run(Command::new("cp").args(["-a", path(backup), path(&self.data())]));
    }

    /// A streaming replica of this (running) server, on a port of its
    /// own: a base backup with `-R` (standby mode, replicating from this
    /// server), started. It keeps this server's settings, password and
    /// certificate; stopped and removed on drop like any `OwnServer`.
    pub fn start_replica(&self) -> OwnServer {
        let id = OwnerId::random().expect("random");
        let dir = std::env::temp_dir().join(format!("dlock-pg-replica-{id}"));
        std::fs::create_dir_all(&dir).expect("replica dir");
        if is_root() {
            run(Command::new("chown").args(["-R", "postgres:postgres", path(&dir)]));
        }
        let mut replica = OwnServer {
            dir,
            port: free_port(),
            bin: self.bin.clone(),
        };
        run(self
            .as_postgres("pg_basebackup")
            .env("PGPASSWORD", PASSWORD)
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .args([
                "-D",
                path(&replica.data()),
                "-R",
                "-X",
                "stream",
                "--no-sync",
            ]));
        let conf = replica.data().join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).expect("postgresql.conf");
        text.push_str(&format!(
            "\nunix_socket_directories = '{}'\nhot_standby = on\n",
            replica.dir.display(),
        ));
        std::fs::write(&conf, text).expect("write postgresql.conf");
        replica.start_on_a_free_port();
        replica
    }

    /// Promotes this standby to a primary, waiting until it accepts
    /// writes.
    pub fn promote(&self) {
        run(self.as_postgres("pg_ctl").args([
            "-D",
            path(&self.data()),
            "-w",
            "-t",
            "30",
            "promote",
        ]));
    }

    /// A key-value connection string for this server.
    pub fn conn(&self, password: &str, extra: &str) -> String {
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

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

pub fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

pub fn run(command: &mut Command) {
    let out = command.output().expect("run helper program");
    assert!(
        out.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The newest `/usr/lib/postgresql/<version>/bin`, or the `PATH`.
pub fn pg_bin_dir() -> PathBuf {
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

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Two different lock keys, both ending in `suffix`, with the same advisory
/// key `hashtextextended(key, 0)`. That hash (PostgreSQL's
/// `hash_bytes_extended`, Bob Jenkins' lookup3) absorbs 12 bytes at a time
/// by adding them to its state and mixing: two different first blocks give
/// two states, and second blocks that differ by exactly the difference of
/// those states make the states equal again, so whatever follows hashes
/// alike. The second blocks must be printable, which not every difference
/// allows: first blocks are tried until one does. The caller should check
/// the collision on the server.
pub fn colliding_keys(suffix: &str) -> (String, String) {
    colliding_pair(b"dlock-B", &[], suffix)
}

/// A lock key `x` and a permit key `k`, both ending in `suffix`, such that
/// `x` has the advisory key of `k`'s permit slot 0
/// (`hashtextextended('dlock-permit:0:' || k, 0)`), found as
/// [`colliding_keys`] finds its pair; returned as `(x, k)`.
pub fn key_colliding_with_a_permit(suffix: &str) -> (String, String) {
    let (x, slot) = colliding_pair(b"dlock-permit", b":0:", suffix);
    (x, slot["dlock-permit:0:".len()..].to_owned())
}

/// Two keys of 24 bytes and `suffix` with one advisory key: the first
/// starts with `dlock-A` and a counter, the second with `second_head`
/// (padded with the counter to 12 bytes) and then `fixed` (at most 3
/// bytes) and one free byte.
fn colliding_pair(second_head: &[u8], fixed: &[u8], suffix: &str) -> (String, String) {
    let len = (24 + suffix.len()) as u32;
    for attempt in 0u32.. {
        let mut firsts = [
            format!("dlock-A{attempt:05}").into_bytes(),
            second_head.to_vec(),
        ];
        let pad = format!("{attempt:012}");
        firsts[1].extend_from_slice(&pad.as_bytes()[second_head.len()..]);
        let [x, y] = firsts.clone().map(|first| first_state(&first, len));
        // The second key's first word: `fixed`, then printable bytes; the
        // first key's is what makes the states equal, if printable.
        let first_words = (0x21u8..=0x7e).find_map(|free| {
            let mut word = [free; 4];
            word[..fixed.len()].copy_from_slice(fixed);
            let b = u32::from_le_bytes(word);
            let a = y[0].wrapping_add(b).wrapping_sub(x[0]);
            printable(a).then_some((a, b))
        });
        let Some(first_words) = first_words else {
            continue;
        };
        let rest: Option<Vec<(u32, u32)>> = (1..3)
            .map(|word| printable_pair(x[word].wrapping_sub(y[word])))
            .collect();
        let Some(rest) = rest else {
            continue;
        };
        let key = |i: usize| {
            let mut bytes = firsts[i].clone();
            for pair in std::iter::once(first_words).chain(rest.iter().copied()) {
                let word = if i == 0 { pair.0 } else { pair.1 };
                bytes.extend_from_slice(&word.to_le_bytes());
            }
            bytes.extend_from_slice(suffix.as_bytes());
            String::from_utf8(bytes).expect("printable ASCII")
        };
        return (key(0), key(1));
    }
    unreachable!("some first blocks allow printable second blocks")
}

/// lookup3's state after its first 12-byte block, for a key of `len`
/// bytes and seed 0.
fn first_state(first: &[u8], len: u32) -> [u32; 3] {
    let init = 0x9e37_79b9_u32.wrapping_add(len).wrapping_add(3_923_095);
    let mut state = [init; 3];
    for (word, chunk) in state.iter_mut().zip(first.chunks(4)) {
        let bytes: [u8; 4] = chunk.try_into().expect("4 bytes");
        *word = word.wrapping_add(u32::from_le_bytes(bytes));
    }
    mix(&mut state);
    state
}

/// Whether the four bytes of `w` are printable ASCII (`!` to `~`).
fn printable(w: u32) -> bool {
    w.to_le_bytes().iter().all(|b| (0x21..=0x7e).contains(b))
}

/// lookup3's `mix`, as PostgreSQL's `hashfn.c` has it.
fn mix(s: &mut [u32; 3]) {
    let [mut a, mut b, mut c] = *s;
    a = a.wrapping_sub(c);
    a ^= c.rotate_left(4);
    c = c.wrapping_add(b);
    b = b.wrapping_sub(a);
    b ^= a.rotate_left(6);
    a = a.wrapping_add(c);
    c = c.wrapping_sub(b);
    c ^= b.rotate_left(8);
    b = b.wrapping_add(a);
    a = a.wrapping_sub(c);
    a ^= c.rotate_left(16);
    c = c.wrapping_add(b);
    b = b.wrapping_sub(a);
    b ^= a.rotate_left(19);
    a = a.wrapping_add(c);
    c = c.wrapping_sub(b);
    c ^= b.rotate_left(4);
    b = b.wrapping_add(a);
    *s = [a, b, c];
}

/// Two words of printable ASCII (`!` to `~`, little-endian) whose sums
/// with the state words they are added to are equal (`b - a == delta`),
/// if a search finds them.
fn printable_pair(delta: u32) -> Option<(u32, u32)> {
    let mut candidate = 0x2121_2121_u32;
    for _ in 0..200_000 {
        let b = candidate.wrapping_add(delta);
        if printable(candidate) && printable(b) {
            return Some((candidate, b));
        }
        candidate = candidate
            .wrapping_mul(1_664_525)
            .wrapping_add(1_013_904_223);
    }
    None
}

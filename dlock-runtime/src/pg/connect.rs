//! How a [`PgBackend`] comes to be: the connection string checked (never
//! shown, as it may hold a password), the TLS and timeouts settled, every
//! statement's schema filled in and the first lock session opened; and the
//! backend's inspection methods.
//!
//! Its own file because it runs once per backend, apart from the lock
//! paths that [`Inner`] serves.

use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};

use tokio::sync::Mutex as AsyncMutex;
use tokio_postgres::Config;

use super::connection::{Connector, Failure};
use super::deadlines::Deadlines;
use super::home::Home;
use super::listen::Listener;
use super::options::{PgOptions, misplaced_at_sign, parse_error_reason};
use super::sessions::SessionSlot;
use super::wait::Waits;
use super::{
    Inner, KIND, PgBackend, WarningPace, announce, fair_queue, holders_rewrite, holders_table,
    modes, names, sql, tls,
};
use crate::error::{LockError, Operation};
use crate::key::LockKey;

impl PgBackend {
    /// Connects with default [`PgOptions`]. `conn` is a tokio-postgres
    /// connection string, key-value (`host=127.0.0.1 user=app dbname=app
    /// sslmode=require`) or URL (`postgresql://app:secret@db:5432/app`).
    ///
    /// Opens the first lock session (so a wrong password or an unreachable
    /// host is an error here, within the connect timeout), creates the
    /// schema objects if they are missing, and refuses a token sequence
    /// that cannot give rising tokens (see the [module docs](super#fencing-tokens)).
    pub async fn connect(conn: &str) -> Result<Self, LockError> {
        Self::connect_with(conn, PgOptions::new()).await
    }

    /// Connects with the given options; see [`PgBackend::connect`].
    pub async fn connect_with(conn: &str, options: PgOptions) -> Result<Self, LockError> {
        let quoted_schema = options.validate()?;
        let connect_error =
            |what: String| LockError::backend(KIND, Operation::Connect, "", Failure::msg(what));
        if misplaced_at_sign(conn) {
            return Err(connect_error(
                "the connection URL has an `@` that does not end its user info (one after the \
                 host, in the path or the query, or a second one before the host): write every \
                 `@` in the user name, the password and the query as %40, and `/`, `?` and `#` \
                 in the user name and the password as %2F, %3F and %23 (the URL is not shown: \
                 it may hold a password)"
                    .to_owned(),
            ));
        }
        // Only the parser's reason is shown, and only when it cannot hold
        // part of the password; the string itself never is.
        let mut config = Config::from_str(conn).map_err(|e| {
            connect_error(match parse_error_reason(&e) {
                Some(reason) => format!("invalid PostgreSQL connection string: {reason}"),
                None => "invalid PostgreSQL connection string (the parser's reason is not shown: \
                         it may hold part of the password)"
                    .to_owned(),
            })
        })?;
        // An `@` left unencoded in a URL's user or password makes the
        // parser take the rest of it for the host name, which every error
        // and `Debug` would then show.
        if config.get_hosts().iter().any(
            |host| matches!(host, tokio_postgres::config::Host::Tcp(name) if name.contains('@')),
        ) {
            return Err(connect_error(
                "the connection URL has an unencoded `@` in its user name or password: \
                 write it as %40 (the host is not shown: it would hold part of the password)"
                    .to_owned(),
            ));
        }
        tls::require_when_verifying(&mut config, &options.tls).map_err(|reason| {
            LockError::InvalidOption {
                option: "tls",
                reason,
            }
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(options.connect_timeout);
        }
        if config.get_application_name().is_none() {
            config.application_name("dlock");
        }
        let connect_timeout = config
            .get_connect_timeout()
            .copied()
            .unwrap_or(options.connect_timeout);
        let tls = tls::connector(&options.tls).map_err(connect_error)?;
        let home = Arc::new(Home::here().ok_or_else(|| {
            connect_error("PgBackend::connect must be called on a Tokio runtime".to_owned())
        })?);
        let connector = Connector::new(config, tls, connect_timeout, Arc::clone(&home));
        let waits = Waits::new(
            connector.clone(),
            &quoted_schema,
            options.key_seed,
            options.wait_sessions,
        );
        let listener = Listener::new(
            connector.clone(),
            &options.schema,
            options.liveness_interval,
        );
        let inner = Arc::new(Inner {
            try_lock_sql: sql::render(sql::TRY_LOCK, &quoted_schema),
            modes: modes::Modes::new(&quoted_schema),
            quick: super::quick::QuickDraw::new(&quoted_schema),
            terminate_sql: sql::render(sql::TERMINATE_HOLDERS, &quoted_schema),
            force_release_named_sql: sql::render(sql::FORCE_RELEASE_NAMED, &quoted_schema),
            fair_lock_sql: sql::render(sql::FAIR_LOCK, &quoted_schema),
            fair_lock_marked_sql: sql::render(sql::FAIR_LOCK_MARKED, &quoted_schema),
            fair_record_sql: sql::render(sql::FAIR_RECORD, &quoted_schema),
            try_lock_recording_sql: sql::render(sql::TRY_LOCK_RECORDING, &quoted_schema),
            unlock_recorded_sql: sql::render(sql::UNLOCK_RECORDED, &quoted_schema),
            delete_released_sql: sql::render(sql::DELETE_RELEASED, &quoted_schema),
            rewrite_records_sql: sql::render(sql::REWRITE_RECORDS, &quoted_schema),
            holder_session_sql: sql::render(sql::HOLDER_SESSION, &quoted_schema),
            holder_record_sql: sql::render(sql::HOLDER_RECORD, &quoted_schema),
            held_sql: sql::render(sql::HELD, &quoted_schema),
            name_lease_sql: sql::render(sql::NAME_LEASE, &quoted_schema),
            try_lock_named_sql: sql::render(sql::TRY_LOCK_NAMED, &quoted_schema),
            unlock_named_sql: sql::render(sql::UNLOCK_NAMED, &quoted_schema),
            session_holders_sql: sql::render(sql::SESSION_HOLDERS, &quoted_schema),
            held_named_sql: sql::render(sql::HELD_NAMED, &quoted_schema),
            names: names::Names::default(),
            holders_table: AsyncMutex::new(false),
            holders_state: holders_table::TableState::default(),
            holders_recreated: Mutex::new(None),
            slots: (0..options.sessions)
                .map(|_| SessionSlot::default())
                .collect(),
            next_slot: AtomicUsize::new(0),
            next_session_id: AtomicU64::new(0),
            restoring: AsyncMutex::new(None),
            restorations: AtomicU64::new(0),
            keys: Mutex::default(),
            deadlines: Arc::new(Deadlines::new(Arc::clone(&home))),
            waits,
            fair: fair_queue::Fair::new(options.fair_sessions),
            listener,
            announce_warnings: WarningPace::new(announce::WARN_EVERY),
            rewrite_lock_warnings: WarningPace::new(holders_rewrite::REWRITE_LOCK_WARN_EVERY),
            warned_other_schemas: AtomicBool::new(false),
            home,
            fair_connector: connector.keeping_alive(options.liveness_interval),
            connector,
            options,
            quoted_schema,
        });
        inner.session().await?;
        Ok(Self { inner })
    }

    /// The advisory key `key` maps to (`hashtextextended(key, seed)`,
    /// asked of the server), to find the lock in `pg_locks`: a `bigint`
    /// advisory key shows there as `classid` (high 32 bits), `objid` (low
    /// 32 bits) and `objsubid = 1`.
    pub async fn advisory_key(&self, key: &LockKey) -> Result<i64, LockError> {
        let session = self.inner.session().await?;
        let row = session
            .query_one(
                sql::ADVISORY_KEY,
                &[&key.as_str(), &self.inner.options.key_seed],
            )
            .await
            .map_err(|e| {
                self.inner
                    .failed(Operation::Acquire, key, "cannot hash the key", e)
            })?;
        row.try_get(0).map_err(|e| {
            self.inner
                .failed(Operation::Acquire, key, "unexpected answer", e)
        })
    }

    /// The server process ids of the sessions (of any client, this backend
    /// included unless the question runs on the holding session itself)
    /// that hold `key`, for inspection: `pg_stat_activity` tells more.
    pub async fn holder_pids(&self, key: &LockKey) -> Result<Vec<i32>, LockError> {
        let session = self.inner.session().await?;
        let rows = session
            .query(sql::HOLDERS, &[&key.as_str(), &self.inner.options.key_seed])
            .await
            .map_err(|e| {
                self.inner
                    .failed(Operation::Acquire, key, "cannot list holders", e)
            })?;
        rows.iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()
            .map_err(|e| {
                self.inner
                    .failed(Operation::Acquire, key, "unexpected answer", e)
            })
    }

    /// The server process ids of this backend's open lock sessions.
    pub async fn session_pids(&self) -> Vec<i32> {
        let mut pids = Vec::new();
        for slot in &self.inner.slots {
            if let Some(session) = slot.live() {
                pids.push(session.pid);
            }
        }
        pids
    }
}

impl std::fmt::Debug for PgBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgBackend")
            .field("target", &self.inner.connector.target())
            .field("schema", &self.inner.quoted_schema)
            .field("sessions", &self.inner.options.sessions)
            .finish_non_exhaustive()
    }
}

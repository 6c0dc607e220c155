//! What the tests of a lease whose token marks a foreign lock refused
//! share (`names_faults`, `names_marks`): the marks' `classid`s, and the
//! set-up of such a lease beside marked leases of the same session, with
//! what a reader and a force release must then promise.

use std::time::Duration;

use dlock::backend::{AcquireRequest, Attempt, ForceRelease, Holding, OwnerId};
use dlock::pg::tokio_postgres::Client;
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, FencingToken, LockKey};

use crate::pg_support::{ScratchSchema, shared_client, shared_conn};

/// The two constants the token marks' `classid`s are XORed with.
const TOKN: i64 = 0x544f_4b4e;
const TOKM: i64 = 0x544f_4b4d;

pub async fn connect(options: PgOptions) -> PgBackend {
    PgBackend::connect_with(&shared_conn(), options)
        .await
        .expect("PostgreSQL at 127.0.0.1:5432 or DLOCK_PG_URL")
}

pub async fn take(backend: &PgBackend, key: &LockKey, owner: &OwnerId) -> FencingToken {
    let request = AcquireRequest::new(key, owner, Duration::from_secs(60));
    match backend.try_acquire(&request).await.expect("acquire") {
        Attempt::Acquired(grant) => grant.token,
        held => panic!("`{key}` should be free: {held:?}"),
    }
}

/// The `classid` of a key's first and second token mark, as unsigned
/// 32-bit numbers (see `token_marks!` in the backend).
pub fn mark_classes(h: i64) -> (i64, i64) {
    (
        ((h >> 32) ^ TOKN) & 0xffff_ffff,
        (((h << 32) >> 32) ^ TOKM) & 0xffff_ffff,
    )
}

/// An unsigned 32-bit number as the `int4` it stands for.
pub fn as_int4(n: i64) -> i32 {
    (n as u32) as i32
}

/// A lease of `one` taken without its token marks by a session that holds
/// other keys with theirs. Fields drop in order: the sessions before the
/// other client and the schema.
pub struct Markless {
    _holder: PgBackend,
    pub reader: PgBackend,
    pub one: LockKey,
    pub token: FencingToken,
    _other: Client,
    _schema: ScratchSchema,
}

impl Markless {
    /// A holder (one session) holds the keys `beside` with their token
    /// marks; another client holds the first mark of `one` (advisory key
    /// `h1`) for the current clock exclusively (an application's own
    /// `(int4, int4)` advisory lock on the same two numbers), so the
    /// holder's lock statement of `one` is refused that mark; then the
    /// holder takes `one`.
    pub async fn take(
        schema: ScratchSchema,
        seed: i64,
        (one, h1): (LockKey, i64),
        beside: &[LockKey],
    ) -> Self {
        let options = schema.options().key_seed(seed);
        let holder = connect(options.clone().sessions(1)).await;
        let reader = connect(options).await;

        // Tokens drawn from here on come from the sequence, set by a DBA
        // ahead of the clock (by less than the hour, where the draw allows
        // a day) to a value whose low half is a small positive int4: so a
        // token read from another lease's mark in place of `one`'s is a
        // valid one. (Without it the same holds whenever the clock's own
        // low half is below 2^31, half of every 72 minutes; above, the
        // reader fails.)
        shared_client()
            .await
            .query_one(
                &format!(
                    "SELECT setval('{}.dlock_token_seq',
                               (((extract(epoch FROM clock_timestamp()) * 1000000)::int8 >> 32) + 1)
                               << 32 | 4096)",
                    schema.name
                ),
                &[],
            )
            .await
            .expect("setval");
        for key in beside {
            let token = take(&holder, key, &OwnerId::random().expect("owner")).await;
            println!("`{key}` held with token {token}");
        }

        // Another client holds exclusively the pair of numbers of `one`'s
        // first mark for any token drawn in the next hour.
        let other = shared_client().await;
        let class = as_int4(mark_classes(h1).0);
        other
            .query_one(
                "SELECT pg_advisory_lock($1::int4, (c >> 32)::int4),
                    pg_advisory_lock($1::int4, ((c >> 32) + 1)::int4)
             FROM (SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8 AS c) AS t",
                &[&class],
            )
            .await
            .expect("the application's own lock");

        let token = take(&holder, &one, &OwnerId::random().expect("owner")).await;
        println!("`{one}` held with token {token}");
        Self {
            _holder: holder,
            reader,
            one,
            token,
            _other: other,
            _schema: schema,
        }
    }

    /// A reader, and a list of held keys, show the token of the lease
    /// holding `one`, or none.
    pub async fn assert_read_token_is_the_leases_or_none(&self) {
        let seen = self.reader.holder(&self.one).await.expect("read");
        let seen = seen.expect("held");
        assert!(
            seen.token.is_none() || seen.token == Some(self.token),
            "`{}` is held with token {}, and read with token {:?}",
            self.one,
            self.token,
            seen.token
        );
        let listed = self.reader.held(self.one.as_str()).await.expect("list");
        for (key, holding) in &listed {
            assert!(
                holding.token.is_none() || holding.token == Some(self.token),
                "`{key}` is held with token {}, and listed with token {:?}",
                self.token,
                holding.token
            );
        }
    }

    /// A force release naming the token a reader shows, if it is not the
    /// lease's, or else one above the lease's, ends no lease.
    pub async fn assert_force_release_of_another_token_ends_no_lease(&self) {
        let seen = self.reader.holder(&self.one).await.expect("read");
        let named = match seen.expect("held").token {
            Some(token) if token != self.token => token,
            _ => FencingToken::new(self.token.get() + 1),
        };
        let forced = self
            .reader
            .force_release_holding(&self.one, &Holding::new(Some(named), None))
            .await;
        assert!(
            !matches!(forced, Ok(ForceRelease::Released)),
            "a force release naming token {named} ended the lease holding `{}` with token {}: \
             {forced:?}",
            self.one,
            self.token
        );
    }
}

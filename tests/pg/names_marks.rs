//! Leases without an identity named rather than recorded, against what
//! readers and force releases promise when a lease of a session carries
//! no token marks (both-or-none: a foreign lock refused one of them)
//! while other leases of the same session carry marks whose `classid`s
//! are its own: a token shown is the holder's or none, and a force
//! release ends only the lease whose token it names. Each test works in
//! a schema of its own on the shared PostgreSQL (127.0.0.1:5432, or
//! `DLOCK_PG_URL`).

use crate::pg_support;

use std::time::Duration;

use dlock::backend::{AcquireRequest, Attempt, ForceRelease, Holding, OwnerId};
use dlock::pg::{PgBackend, PgOptions};
use dlock::{Backend, FencingToken, LockKey};
use pg_support::{ScratchSchema, shared_client, shared_conn};

/// The two constants the token marks' `classid`s are XORed with.
const TOKN: i64 = 0x544f_4b4e;
const TOKM: i64 = 0x544f_4b4d;

/// The key seed of the three keys below.
const SEED: i64 = 20_261_205;

/// Keys in threes whose advisory keys (with [`SEED`]) differ, found by a
/// search over four million keys of this prefix: the second token mark
/// of the second has the `classid` of the first's first mark, and a token
/// mark of the third the `classid` of the first's second mark. The set-up
/// checks it. One three per test, as advisory locks are the database's.
const READ_KEYS: [&str; 3] = [
    "dlock-test:review-marks:1629418",
    "dlock-test:review-marks:2002180",
    "dlock-test:review-marks:1030266",
];
const FORCE_KEYS: [&str; 3] = [
    "dlock-test:review-marks:3294742",
    "dlock-test:review-marks:3052307",
    "dlock-test:review-marks:1825302",
];

async fn connect(options: PgOptions) -> PgBackend {
    PgBackend::connect_with(&shared_conn(), options)
        .await
        .expect("PostgreSQL at 127.0.0.1:5432 or DLOCK_PG_URL")
}

async fn take(backend: &PgBackend, key: &LockKey, owner: &OwnerId) -> FencingToken {
    let request = AcquireRequest::new(key, owner, Duration::from_secs(60));
    match backend.try_acquire(&request).await.expect("acquire") {
        Attempt::Acquired(grant) => grant.token,
        held => panic!("`{key}` should be free: {held:?}"),
    }
}

/// The `classid` of a key's first and second token mark, as unsigned
/// 32-bit numbers.
fn mark_classes(h: i64) -> (i64, i64) {
    (
        ((h >> 32) ^ TOKN) & 0xffff_ffff,
        (((h << 32) >> 32) ^ TOKM) & 0xffff_ffff,
    )
}

/// An unsigned 32-bit number as the `int4` it stands for.
fn as_int4(n: i64) -> i32 {
    (n as u32) as i32
}

/// One session holds `two` and `three` with their token marks; another
/// client holds exclusively the pair of numbers of `one`'s first mark
/// (an application's own `(int4, int4)` advisory lock), so the session's
/// lock statement of `one` takes neither mark; then it takes `one`.
struct Markless {
    _schema: ScratchSchema,
    holder: PgBackend,
    reader: PgBackend,
    one: LockKey,
    token: FencingToken,
    _other: dlock::pg::tokio_postgres::Client,
}

async fn markless_beside_marks(label: &str, keys: [&str; 3]) -> Markless {
    let schema = ScratchSchema::new(label);
    println!("key seed {SEED}");
    let options = schema.options().key_seed(SEED);
    let holder = connect(options.clone().sessions(1)).await;
    let reader = connect(options).await;
    let admin = shared_client().await;
    let mut h = [0_i64; 3];
    for (at, key) in keys.iter().enumerate() {
        h[at] = admin
            .query_one("SELECT hashtextextended($1::text, $2)", &[key, &SEED])
            .await
            .expect("hash")
            .get::<_, i64>(0);
    }
    let [h1, h2, h3] = h;
    assert!(h1 != h2 && h1 != h3 && h2 != h3, "three advisory keys");
    let (c1, c2, c3) = (mark_classes(h1), mark_classes(h2), mark_classes(h3));
    assert!(c1.0 != c1.1 && c1.0 == c2.1, "{c1:?} {c2:?}");
    assert!(c1.1 == c3.0 || c1.1 == c3.1, "{c1:?} {c3:?}");
    let [one, two, three] = keys.map(|key| LockKey::new(key).expect("key"));

    // Tokens drawn from here on come from the sequence, set by a DBA ahead
    // of the clock (by less than the hour, where the draw allows a day) to
    // a value whose low half is a small positive int4, as in
    // `names_faults`.
    admin
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
    for key in [&two, &three] {
        let owner = OwnerId::random().expect("owner");
        let token = take(&holder, key, &owner).await;
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

    let owner_one = OwnerId::random().expect("owner");
    let token = take(&holder, &one, &owner_one).await;
    println!("`{one}` held with token {token}");
    Markless {
        _schema: schema,
        holder,
        reader,
        one,
        token,
        _other: other,
    }
}

/// A reader shows the token of the lease holding the key, or none: never
/// one put together from two other leases' marks of the same session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_never_shows_a_token_made_of_two_other_leases_marks() {
    let markless = markless_beside_marks("rv_read", READ_KEYS).await;
    let seen = markless
        .reader
        .holder(&markless.one)
        .await
        .expect("read")
        .expect("held");
    let listed = markless
        .reader
        .held(markless.one.as_str())
        .await
        .expect("list");
    assert!(
        seen.token.is_none() || seen.token == Some(markless.token),
        "`{}` is held with token {}, and read with token {:?}",
        markless.one,
        markless.token,
        seen.token
    );
    for (key, holding) in &listed {
        assert!(
            holding.token.is_none() || holding.token == Some(markless.token),
            "`{key}` is held with token {}, and listed with token {:?}",
            markless.token,
            holding.token
        );
    }
    drop(markless.holder);
}

/// A force release naming a token that no lease holds ends no lease, even
/// the token a reader showed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_release_naming_a_token_no_lease_holds_ends_no_lease_beside_marked_leases() {
    let markless = markless_beside_marks("rv_force", FORCE_KEYS).await;
    let seen = markless
        .reader
        .holder(&markless.one)
        .await
        .expect("read")
        .expect("held");
    let named = match seen.token {
        Some(token) if token != markless.token => token,
        _ => FencingToken::new(markless.token.get() + 1),
    };
    let forced = markless
        .reader
        .force_release_holding(&markless.one, &Holding::new(Some(named), None))
        .await;
    assert!(
        !matches!(forced, Ok(ForceRelease::Released)),
        "a force release naming token {named} ended the lease holding `{}` with token {}: \
         {forced:?}",
        markless.one,
        markless.token
    );
    drop(markless.holder);
}

//! Leases without an identity named rather than recorded, against what
//! readers and force releases promise when a lease of a session carries
//! no token marks (both-or-none: a foreign lock refused one of them)
//! while other leases of the same session carry marks whose `classid`s
//! are its own: a token shown is the holder's or none, and a force
//! release ends only the lease whose token it names. Each test works in
//! a schema of its own on the shared PostgreSQL (127.0.0.1:5432, or
//! `DLOCK_PG_URL`).

use dlock::backend::OwnerId;
use dlock::{Backend, LockKey};

use crate::marks::{Markless, as_int4, connect, mark_classes, take};
use crate::pg_support::{ScratchSchema, random_id, shared_client};

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

/// `one` taken without its token marks while the same session holds `two`
/// and `three` with theirs (see [`Markless::take`]), after the set-up
/// checked the keys' marks.
async fn markless_beside_marks(label: &str, keys: [&str; 3]) -> Markless {
    println!("key seed {SEED}");
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
    Markless::take(ScratchSchema::new(label), SEED, (one, h1), &[two, three]).await
}

/// A reader shows the token of the lease holding the key, or none: never
/// one put together from two other leases' marks of the same session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_never_shows_a_token_made_of_two_other_leases_marks() {
    let markless = markless_beside_marks("rv_read", READ_KEYS).await;
    markless.assert_read_token_is_the_leases_or_none().await;
}

/// A force release naming a token that no lease holds ends no lease, even
/// the token a reader showed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_release_naming_a_token_no_lease_holds_ends_no_lease_beside_marked_leases() {
    let markless = markless_beside_marks("rv_force", FORCE_KEYS).await;
    markless
        .assert_force_release_of_another_token_ends_no_lease()
        .await;
}

/// A lease whose first token mark was taken and whose second a foreign
/// lock refused drops the first again (the last branch of the named lock
/// statement's `CASE`): no mark of the key is left on the server, so no
/// half of it can pose as another lease's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_refused_its_second_mark_leaves_no_first_mark() {
    let schema = ScratchSchema::new("rv_second");
    let backend = connect(schema.options().sessions(1)).await;
    let key = LockKey::new(format!("dlock-test:second-mark:{}", random_id())).expect("key");
    let admin = shared_client().await;
    let h: i64 = admin
        .query_one("SELECT hashtextextended($1::text, 0)", &[&key.as_str()])
        .await
        .expect("hash")
        .get(0);
    // The sequence set by a DBA an hour ahead of the clock (the draw allows
    // a day), so the next token is the sequence's next value: known here.
    let next: i64 = admin
        .query_one(
            &format!(
                "SELECT setval('{}.dlock_token_seq',
                               (extract(epoch FROM clock_timestamp()) * 1000000)::int8 + 3600000000) + 1",
                schema.name
            ),
            &[],
        )
        .await
        .expect("setval")
        .get(0);
    let (first, second) = mark_classes(h);
    // Another client holds exclusively the pair of numbers of the second
    // mark for that token.
    admin
        .query_one(
            "SELECT pg_advisory_lock($1::int4, $2::int4)",
            &[&as_int4(second), &as_int4(next & 0xffff_ffff)],
        )
        .await
        .expect("the application's own lock");

    let token = take(&backend, &key, &OwnerId::random().expect("owner")).await;
    println!("`{key}` held with token {token} (the refused draw was {next})");
    let left: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_locks
             WHERE locktype = 'advisory' AND objsubid = 2 AND mode = 'ShareLock'
               AND classid::int8 = $1",
            &[&first],
        )
        .await
        .expect("read pg_locks")
        .get(0);
    assert_eq!(left, 0, "the first mark of `{key}` was left held");
    assert_eq!(
        backend
            .holder(&key)
            .await
            .expect("read")
            .and_then(|h| h.token),
        Some(token),
        "the lease reads with its own token"
    );
}

/// Under the default key seed this key's advisory key has the low half
/// 0x303d2a3a, so its second token mark's `classid` is 0x303d2a3a XOR
/// `TOKM` = 0x64726177: the draw lock's.
const DRAW_LOCK_KEY: &str = "A^EZfp/+AN=";

/// A key whose token mark would have the draw lock's numbers (its
/// `classid`, and a token whose low half is the sequence's oid, which a
/// DBA's `setval` arranges here) takes no marks: its lease records itself
/// and reads with its token, and every other acquisition of the schema,
/// a new backend's full draw and a transaction lock included, goes on
/// while it is held. Before, the mark held the draw lock shared for the
/// lease's life and every full draw of the schema failed after 1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_whose_token_mark_would_be_the_draw_lock_stops_no_draw() {
    use dlock::backend::{AcquireRequest, Attempt, ReleaseRequest};
    use dlock::pg::{PgBackend, TransactionLock};
    use std::time::Duration;

    let schema = ScratchSchema::new("mark_draw_lock");
    let conn = crate::pg_support::shared_conn();
    let holder = PgBackend::connect_with(&conn, schema.options().sessions(1))
        .await
        .expect("connect");
    let admin = shared_client().await;
    let seq = format!("{}.dlock_token_seq", schema.name);
    let oid: i64 = admin
        .query_one(&format!("SELECT '{seq}'::regclass::oid::int8"), &[])
        .await
        .expect("the sequence's oid")
        .get(0);
    let key = LockKey::new(DRAW_LOCK_KEY).expect("a key");
    let owner = OwnerId::random().expect("owner");
    // The sequence set ahead of the clock (by less than the 72 minutes
    // its low half takes to come round; a draw allows a day) so that the
    // next token's low half is the oid.
    let target: i64 = admin
        .query_one(
            &format!(
                "SELECT setval('{seq}', ((((extract(epoch FROM clock_timestamp()) \
                 * 1000000)::int8 >> 32) + 1) << 32 | $1::int8) - 1) + 1"
            ),
            &[&oid],
        )
        .await
        .expect("setval")
        .get(0);
    let request = AcquireRequest::new(&key, &owner, Duration::from_secs(120));
    let token = match holder.try_acquire(&request).await.expect("acquire") {
        Attempt::Acquired(grant) => grant.token.get(),
        held => panic!("a free key: {held:?}"),
    };
    // The first draw is the target; a lease that gave its lock back to
    // take it again with a record drew once more.
    assert!(
        token == target as u64 || token == target as u64 + 1,
        "the set-up's draw: {token}, not {target} (low half {oid}) or the next"
    );
    let read = holder.holder(&key).await.expect("read the holder");
    assert_eq!(
        read.and_then(|holding| holding.token).map(|t| t.get()),
        Some(token),
        "the lease reads with its own token"
    );

    let other = PgBackend::connect_with(&conn, schema.options())
        .await
        .expect("connect another backend");
    let unrelated = LockKey::new(format!("unrelated-{}", random_id())).expect("a key");
    let other_owner = OwnerId::random().expect("owner");
    let full = other
        .try_acquire(&AcquireRequest::new(
            &unrelated,
            &other_owner,
            Duration::from_secs(30),
        ))
        .await;
    let mut app = crate::pg_support::client_of(&conn).await;
    let mut tx = app.transaction().await.expect("begin");
    let xact = TransactionLock::new()
        .schema(&schema.name)
        .acquire(&mut tx, &format!("unrelated-xact-{}", random_id()))
        .await;
    tx.rollback().await.expect("rollback");
    holder
        .release(&ReleaseRequest::new(&key, &owner))
        .await
        .expect("release");
    assert!(
        matches!(full, Ok(Attempt::Acquired(_))),
        "a full draw beside the lease: {full:?}"
    );
    assert!(
        xact.is_ok(),
        "a transaction lock beside the lease: {xact:?}"
    );
    other
        .release(&ReleaseRequest::new(&unrelated, &other_owner))
        .await
        .expect("release");
}

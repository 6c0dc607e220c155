//! A rolling upgrade from the protocol whose holder record lived in a key
//! of its own (`dlock:{T}:info`, beside a lock value of the owner id and
//! the waiter mark alone) to this one, which carries the record and the
//! token in the lock's value. Replicas of both share keys for a while:
//! they exclude each other, read each other's holders (never naming a
//! holder wrongly), and a fair handoff between them gives the waiter a
//! value its own renewal and release understand.

use crate::redis_support;

use redis_support::{lock_name, shared_backend as backend, shared_cli as cli, shared_url};

use std::sync::Arc;
use std::time::Duration;

use dlock::backend::{AcquireRequest, Attempt, OwnerId, QUEUE_ENTRY_TTL, Queue, ReleaseRequest};
use dlock::redis::RedisBackend;
use dlock::{Backend, HolderInfo, LockKey, LockOptions};
use redis::aio::MultiplexedConnection;
use redis::{Script, Value};

/// The previous protocol's scripts, word for word.
const ACQUIRE: &str = include_str!("recorded/acquire.lua");
const EXTEND: &str = include_str!("recorded/extend.lua");
const RELEASE: &str = include_str!("recorded/release.lua");
const HOLDER: &str = include_str!("recorded/holder.lua");
const FAIR_ACQUIRE: &str = include_str!("recorded/fair_acquire.lua");

/// A replica on the previous protocol, speaking it by hand.
pub(crate) struct Recorded {
    conn: MultiplexedConnection,
    /// The owner id's 32 hex digits.
    owner: String,
    record: String,
}

impl Recorded {
    pub(crate) async fn new(owner: char) -> Self {
        let conn = redis::Client::open(shared_url())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
        Self {
            conn,
            owner: std::iter::repeat_n(owner, 32).collect(),
            record: HolderInfo::this_process(Some("previous")).encode(),
        }
    }

    fn value(&self) -> String {
        format!("{}-", self.owner)
    }

    /// The token when taken; `None` when held.
    pub(crate) async fn acquire(&mut self, key: &LockKey) -> Option<u64> {
        let reply: Value = Script::new(ACQUIRE)
            .key(lock_name(key))
            .key(format!("dlock:{{{key}}}:fence"))
            .key(format!("dlock:{{{key}}}:info"))
            .arg(self.value())
            .arg(60_000)
            .arg(&self.record)
            .invoke_async(&mut self.conn)
            .await
            .expect("the previous acquire script");
        token_of(reply)
    }

    /// A fair waiter's attempt (`Queue::Join`, an entry living 3 s).
    async fn join(&mut self, key: &LockKey) -> Option<u64> {
        let reply: Value = Script::new(FAIR_ACQUIRE)
            .key(lock_name(key))
            .key(format!("dlock:{{{key}}}:fence"))
            .key(format!("dlock:{{{key}}}:info"))
            .key(format!("dlock:{{{key}}}:queue"))
            .key(format!("dlock:{{{key}}}:waiter:{}", self.owner))
            .arg(self.value())
            .arg(60_000)
            .arg(&self.record)
            .arg(3_000)
            .arg("w")
            .invoke_async(&mut self.conn)
            .await
            .expect("the previous fair acquire script");
        token_of(reply)
    }

    async fn extend(&mut self, key: &LockKey) -> i64 {
        Script::new(EXTEND)
            .key(lock_name(key))
            .key(format!("dlock:{{{key}}}:info"))
            .arg(self.value())
            .arg(60_000)
            .invoke_async(&mut self.conn)
            .await
            .expect("the previous extend script")
    }

    pub(crate) async fn release(&mut self, key: &LockKey) -> i64 {
        Script::new(RELEASE)
            .key(lock_name(key))
            .key(format!("dlock:{{{key}}}:info"))
            .arg(self.value())
            .invoke_async(&mut self.conn)
            .await
            .expect("the previous release script")
    }

    /// The previous holder read: `None` when free, else the token and the
    /// holder record it names (empty when it names none).
    async fn holder(&mut self, key: &LockKey) -> Option<(String, String)> {
        let reply: Value = Script::new(HOLDER)
            .key(lock_name(key))
            .key(format!("dlock:{{{key}}}:fence"))
            .key(format!("dlock:{{{key}}}:holder"))
            .key(format!("dlock:{{{key}}}:info"))
            .invoke_async(&mut self.conn)
            .await
            .expect("the previous holder script");
        let Value::Array(parts) = reply else {
            assert_eq!(reply, Value::Nil, "a holder reply");
            return None;
        };
        let text = |value: &Value| match value {
            Value::BulkString(bytes) => String::from_utf8(bytes.clone()).expect("text"),
            other => panic!("not text: {other:?}"),
        };
        Some((text(&parts[2]), text(&parts[3])))
    }
}

fn token_of(reply: Value) -> Option<u64> {
    match reply {
        Value::BulkString(token) => Some(
            String::from_utf8(token)
                .expect("text")
                .parse()
                .expect("a token"),
        ),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_previous_holder_is_read_by_new_replicas_excludes_them_and_wakes_their_waiters() {
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("upgrade-recorded-holder");
    let mut previous = Recorded::new('a').await;
    let token = previous.acquire(&key).await.expect("free");

    let holding = backend.holder(&key).await.expect("holder").expect("held");
    assert_eq!(holding.token.map(|t| t.get()), Some(token));
    let named = holding
        .holder
        .expect("the previous holder's record is read");
    assert_eq!(named.label.as_deref(), Some("previous"));
    assert!(
        LockOptions::new(Duration::from_secs(10))
            .acquire_on(backend.clone(), &key)
            .await
            .is_err(),
        "a new replica took a key a previous one holds"
    );
    let waiter = tokio::spawn({
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            LockOptions::new(Duration::from_secs(10))
                .wait(Duration::from_secs(5))
                .acquire_on(backend, &key)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(previous.extend(&key).await, 1, "the previous renewal");
    assert_eq!(previous.release(&key).await, 1, "the previous release");
    let lease = waiter
        .await
        .expect("task")
        .expect("the new waiter is woken by the previous release");
    assert!(lease.token().get() > token);
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_holder_excludes_previous_replicas_which_read_it_as_held_naming_nobody() {
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("upgrade-recorded-new");
    let mut previous = Recorded::new('b').await;
    let lease = LockOptions::new(Duration::from_secs(60))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    assert_eq!(
        previous.acquire(&key).await,
        None,
        "a previous replica took it"
    );
    assert_eq!(previous.extend(&key).await, 0);
    assert_eq!(
        previous.release(&key).await,
        0,
        "a previous replica freed it"
    );
    assert_eq!(
        previous.holder(&key).await,
        Some((String::new(), String::new())),
        "held, by a holder the previous protocol cannot name"
    );
    let holding = backend.holder(&key).await.expect("holder").expect("held");
    assert_eq!(holding.token, Some(lease.token()));
    assert_eq!(
        holding.holder.map(|h| h.pid),
        Some(std::process::id()),
        "a new replica reads the record in the value"
    );
    let first = lease.token().get();
    lease.release().await.expect("release");
    assert_eq!(cli(&["EXISTS", &lock_name(&key)]), "0");

    let token = previous.acquire(&key).await.expect("free again");
    assert!(
        token > first,
        "previous token {token} after new token {first}"
    );
    assert_eq!(previous.release(&key).await, 1);
}

/// With every release published (the rolling-upgrade switch), a new
/// holder's release hands the key to a previous replica's fair waiter in
/// that protocol's shape, which its renewal and release keep; and that
/// replica's release hands it on to a new waiter, which keeps it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_handoffs_across_the_upgrade_give_each_waiter_a_value_it_keeps() {
    let backend: Arc<dyn Backend> = Arc::new(
        RedisBackend::builder(&shared_url())
            .publish_every_release(true)
            .connect()
            .await
            .expect("connect"),
    );
    let key = dlock_runtime::conformance::fresh_key("upgrade-recorded-fair");
    let mut previous = Recorded::new('c').await;
    let fair = LockOptions::new(Duration::from_secs(60)).fair(true);
    let first = fair.acquire_on(backend.clone(), &key).await.expect("free");
    assert_eq!(previous.join(&key).await, None, "queued behind the holder");
    let first_token = first.token().get();
    first.release().await.expect("release");

    // Handed over in the previous shape: its value and its info key.
    assert_eq!(
        cli(&["GET", &lock_name(&key)]),
        format!("{}+", previous.owner)
    );
    let (token, record) = previous.holder(&key).await.expect("handed over");
    assert!(token.parse::<u64>().expect("a token") > first_token);
    assert!(record.ends_with("\tprevious"), "{record:?}");
    assert_eq!(previous.extend(&key).await, 1, "its renewal keeps it");
    let holding = backend.holder(&key).await.expect("holder").expect("held");
    assert_eq!(holding.token.map(|t| t.get().to_string()), Some(token));
    assert_eq!(
        holding.holder.and_then(|h| h.label).as_deref(),
        Some("previous")
    );

    // A lease of 1 s: only its renewals keep it past that.
    let waiter = tokio::spawn({
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            LockOptions::new(Duration::from_secs(1))
                .fair(true)
                .wait(Duration::from_secs(10))
                .acquire_on(backend, &key)
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(previous.release(&key).await, 1, "handed on");
    let lease = waiter
        .await
        .expect("task")
        .expect("the new waiter is handed the key");
    let handed = lease.token();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!lease.is_lost(), "its renewals keep the handed value");
    let holding = backend.holder(&key).await.expect("holder").expect("held");
    assert_eq!(holding.token, Some(handed));
    lease.release().await.expect("its release");
    assert_eq!(
        cli(&["EXISTS", &lock_name(&key), &format!("dlock:{{{key}}}:info")]),
        "0",
        "the release deletes the value and its info key"
    );
}

/// The owner id that holds `key` now, from the lock's value.
fn holder_of(key: &LockKey) -> String {
    cli(&["GET", &lock_name(key)]).chars().take(32).collect()
}

/// The owner ids queued for `key`, in order.
fn queued(key: &LockKey) -> Vec<String> {
    cli(&["GET", &format!("dlock:{{{key}}}:queue")])
        .lines()
        .filter_map(|line| line.split(' ').next())
        .filter(|owner| !owner.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A new replica's fair attempt as a queued waiter (`Queue::Join`).
async fn join_new(backend: &Arc<dyn Backend>, key: &LockKey, owner: OwnerId) -> Attempt {
    backend
        .try_acquire(
            &AcquireRequest::new(key, &owner, Duration::from_secs(60))
                .with_queue(Queue::Join {
                    entry_ttl: QUEUE_ENTRY_TTL,
                })
                .with_waits(true),
        )
        .await
        .expect("join")
}

async fn release_new(backend: &Arc<dyn Backend>, key: &LockKey, owner: OwnerId) {
    backend
        .release(&ReleaseRequest::new(key, &owner))
        .await
        .expect("release");
}

/// The token of `key`'s holder, as a new replica reads it.
async fn token_now(backend: &Arc<dyn Backend>, key: &LockKey) -> u64 {
    let holding = backend.holder(key).await.expect("holder").expect("held");
    holding.token.expect("a token").get()
}

/// One queue holds waiters of both protocols: each release, of either,
/// hands the key to the first waiter in arrival order, tokens rise, and a
/// new waiter whose queue lost its stamp to a previous replica's rewrite
/// keeps its place rather than joining again at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_of_both_protocols_is_served_in_arrival_order_with_rising_tokens() {
    let backend = backend().await;
    let key = dlock_runtime::conformance::fresh_key("upgrade-recorded-mixed-queue");
    let mut previous = Recorded::new('d').await;
    let [holder, a, c, d, e] = std::array::from_fn(|_| OwnerId::random().expect("id"));
    let taken = backend
        .try_acquire(&AcquireRequest::new(&key, &holder, Duration::from_secs(60)))
        .await
        .expect("acquire");
    assert!(matches!(taken, Attempt::Acquired(_)), "{taken:?}");
    let mut tokens = vec![token_now(&backend, &key).await];
    assert!(matches!(
        join_new(&backend, &key, a).await,
        Attempt::Held { .. }
    ));
    assert_eq!(previous.join(&key).await, None, "queued behind the holder");
    for owner in [c, d] {
        assert!(matches!(
            join_new(&backend, &key, owner).await,
            Attempt::Held { .. }
        ));
    }
    let arrived = vec![
        a.to_string(),
        previous.owner.clone(),
        c.to_string(),
        d.to_string(),
    ];
    assert_eq!(queued(&key), arrived);

    release_new(&backend, &key, holder).await;
    assert_eq!(holder_of(&key), a.to_string());
    tokens.push(token_now(&backend, &key).await);
    // Refreshes keep every place.
    assert!(matches!(
        join_new(&backend, &key, d).await,
        Attempt::Held { .. }
    ));
    assert_eq!(previous.join(&key).await, None);
    assert_eq!(queued(&key), arrived[1..]);

    release_new(&backend, &key, a).await;
    assert_eq!(
        holder_of(&key),
        previous.owner,
        "the previous waiter is next"
    );
    tokens.push(token_now(&backend, &key).await);

    // The previous release hands on and rewrites the queue without its
    // stamp; a new waiter that joins then stamps it anew.
    assert_eq!(previous.release(&key).await, 1, "handed on");
    assert_eq!(holder_of(&key), c.to_string());
    let holding = backend.holder(&key).await.expect("holder").expect("held");
    assert_eq!(
        holding.holder.map(|h| h.pid),
        Some(std::process::id()),
        "the record a previous replica handed over is read"
    );
    tokens.push(holding.token.expect("a token").get());
    assert!(matches!(
        join_new(&backend, &key, e).await,
        Attempt::Held { .. }
    ));
    assert!(matches!(
        join_new(&backend, &key, d).await,
        Attempt::Held { .. }
    ));
    assert_eq!(
        queued(&key),
        vec![d.to_string(), e.to_string()],
        "the waiter queued before the stamp changed keeps its place"
    );

    release_new(&backend, &key, c).await;
    assert_eq!(holder_of(&key), d.to_string());
    tokens.push(token_now(&backend, &key).await);
    release_new(&backend, &key, d).await;
    assert_eq!(holder_of(&key), e.to_string());
    tokens.push(token_now(&backend, &key).await);
    release_new(&backend, &key, e).await;
    assert_eq!(cli(&["EXISTS", &lock_name(&key)]), "0");
    assert!(
        tokens.windows(2).all(|pair| pair[0] < pair[1]),
        "tokens rise: {tokens:?}"
    );
}

//! Fair mode on Redis, beyond the conformance suite's fair properties
//! (which `lock` and `cluster` run): the queue as
//! the server keeps it, a fair waiter killed while queued, the lease and
//! token a handoff gives, a release by a replica on the dlock before fair
//! mode, a handoff notice that lives through a broken pub/sub
//! connection, waiters kept alive without their queue being rewritten, and
//! a caller behind a waiter of its own process queueing without a try.

use crate::redis_support;
use crate::support;

use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock::backend::{
    AcquireRequest, Attempt, OwnerId, QUEUE_ENTRY_TTL, Queue, ReleaseOutcome, ReleaseRequest,
};
use dlock::redis::RedisBackend;
use dlock::{Backend, LockKey, LockOptions};
use redis::aio::MultiplexedConnection;
use redis_support::{RedisServer, shared_backend as backend};
use support::within;

/// The environment variable that turns this test binary into a child
/// process playing one role (see `child_process_entry`).
const CHILD_ROLE: &str = "DLOCK_REDIS_FAIR_TEST_CHILD";

fn queue_name(key: &LockKey) -> String {
    format!("dlock:{{{key}}}:queue")
}

/// The owner ids queued for `key`, in the order the queue keeps them.
pub(crate) async fn queued(conn: &mut MultiplexedConnection, key: &LockKey) -> Vec<String> {
    let text: Option<String> = redis::cmd("GET")
        .arg(queue_name(key))
        .query_async(conn)
        .await
        .expect("GET queue");
    text.unwrap_or_default()
        .lines()
        .map(|line| line.split(' ').next().unwrap_or_default().to_owned())
        .collect()
}

/// Waits until `count` owners are queued for `key`; their ids.
async fn until_queued(
    conn: &mut MultiplexedConnection,
    key: &LockKey,
    count: usize,
) -> Vec<String> {
    within(20, "the waiters queue", async {
        loop {
            let owners = queued(conn, key).await;
            if owners.len() >= count {
                return owners;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
}

async fn pttl(conn: &mut MultiplexedConnection, name: &str) -> i64 {
    redis::cmd("PTTL")
        .arg(name)
        .query_async(conn)
        .await
        .expect("PTTL")
}

fn join(entry_ttl: Duration) -> Queue {
    Queue::Join { entry_ttl }
}

/// The child side: joins the queue of a key through the core and waits
/// (until the parent kills it). Ignored in normal runs; the tests start it
/// as `<test binary> <module>::child_process_entry --exact --ignored` with a role.
#[test]
#[ignore = "runs only as a child process of the cross-process tests"]
fn child_process_entry() {
    let Some((runtime, parts)) = support::child_role(CHILD_ROLE) else {
        return;
    };
    runtime.block_on(async move {
        let backend = backend().await;
        match parts[0].as_str() {
            "queue" => {
                let taken = LockOptions::new(Duration::from_secs(60))
                    .wait(Duration::from_secs(60))
                    .fair(true)
                    .acquire_on(backend, parts[1].as_str())
                    .await;
                println!("ended {}", taken.is_ok());
            }
            other => panic!("unknown child role {other}"),
        }
    });
}

/// A task that waits (fairly, up to 30 s) for `key`, releases it at once
/// and returns the token it held.
fn spawn_fair_waiter(
    backend: Arc<dyn Backend>,
    key: LockKey,
) -> tokio::task::JoinHandle<dlock::FencingToken> {
    tokio::spawn(async move {
        let lease = LockOptions::new(Duration::from_secs(30))
            .wait(Duration::from_secs(30))
            .fair(true)
            .acquire_on(backend, &key)
            .await
            .expect("a fair waiter is served");
        let token = lease.token();
        lease.release().await.expect("release");
        token
    })
}

/// Kills the child (SIGKILL) when dropped, so a failed test leaves no
/// process queued.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_waiters_of_several_tasks_queue_in_arrival_order_and_are_served_so() {
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-fair-fifo");
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let served = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    let mut arrived = Vec::new();
    for index in 0..6 {
        let (backend, waited, served) = (backend.clone(), key.clone(), Arc::clone(&served));
        tasks.push(tokio::spawn(async move {
            let lease = LockOptions::new(Duration::from_secs(30))
                .wait(Duration::from_secs(30))
                .fair(true)
                .acquire_on(backend, &waited)
                .await
                .expect("a fair waiter is served");
            served.lock().expect("served").push((index, lease.token()));
            lease.release().await.expect("release");
        }));
        // The next one starts once this one holds its place.
        arrived = until_queued(&mut conn, &key, index + 1).await;
    }
    let distinct: std::collections::HashSet<&String> = arrived.iter().collect();
    assert_eq!(distinct.len(), 6, "one entry per waiter: {arrived:?}");
    let first = holder.token();
    holder.release().await.expect("release");
    for task in tasks {
        within(20, "the fair waiters", task).await.expect("task");
    }
    let served = served.lock().expect("served").clone();
    let order: Vec<usize> = served.iter().map(|(index, _)| *index).collect();
    assert_eq!(order, (0..6).collect::<Vec<_>>(), "served in arrival order");
    let mut previous = first;
    for (index, token) in served {
        assert!(token > previous, "waiter {index}: {token} after {previous}");
        previous = token;
    }
    assert!(
        queued(&mut conn, &key).await.is_empty(),
        "the queue is gone once everyone was served"
    );
}

/// A fair caller that finds a waiter of its own process queued on the key
/// goes straight to the queue: its first try could only lose, and on a
/// busy key it would cost the server a script on every turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_caller_behind_a_waiter_of_its_process_queues_without_a_first_try() {
    let counting = dlock_runtime::conformance::CountingBackend::new(backend().await);
    let backend: Arc<dyn Backend> = counting.clone();
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-fair-no-first-try");
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let first = spawn_fair_waiter(backend.clone(), key.clone());
    until_queued(&mut conn, &key, 1).await;
    assert_eq!(counting.first_tries(), 1, "the first waiter tried first");
    let second = spawn_fair_waiter(backend.clone(), key.clone());
    until_queued(&mut conn, &key, 2).await;
    assert_eq!(
        counting.first_tries(),
        1,
        "the second waiter, behind the first, queued without a try"
    );
    holder.release().await.expect("release");
    let first = within(20, "the first waiter", first).await.expect("task");
    let second = within(20, "the second waiter", second).await.expect("task");
    assert!(
        second > first,
        "served in arrival order: {first} then {second}"
    );
    // Nobody of this process waits any more: a fair caller tries first again.
    LockOptions::new(Duration::from_secs(30))
        .wait(Duration::from_secs(30))
        .fair(true)
        .acquire_on(backend, &key)
        .await
        .expect("free")
        .release()
        .await
        .expect("release");
    assert_eq!(counting.first_tries(), 2, "a lone fair caller tries first");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_waiter_killed_while_queued_holds_up_the_next_for_its_entry_life_at_most() {
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-fair-killed");
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let mut child = Killed(support::spawn_child(
        module_path!(),
        CHILD_ROLE,
        "queue",
        &[key.as_str()],
    ));
    let child_pid = child.0.id();
    let dead = until_queued(&mut conn, &key, 1).await[0].clone();
    let next = {
        let (backend, key) = (backend.clone(), key.clone());
        tokio::spawn(async move {
            LockOptions::new(Duration::from_secs(30))
                .wait(Duration::from_secs(30))
                .fair(true)
                .acquire_on(backend, &key)
                .await
        })
    };
    let owners = until_queued(&mut conn, &key, 2).await;
    assert_eq!(owners[0], dead, "the child queued first");
    child.0.kill().expect("SIGKILL the queued child");
    child.0.wait().expect("the child is gone");
    let released_at = Instant::now();
    holder.release().await.expect("release");
    // The child's entry was still alive: the release handed it the key,
    // for what was left of its entry's life, not for the 60 s it asked.
    let holding = backend
        .holder(&key)
        .await
        .expect("holder")
        .expect("the key was handed to the dead waiter");
    let info = holding.holder.expect("the handoff wrote the holder record");
    assert_eq!(info.pid, child_pid, "the dead waiter holds the key");
    let left = holding.expires_in.expect("a ttl");
    assert!(
        left <= QUEUE_ENTRY_TTL,
        "a handoff to a waiter the store cannot see die lasts its entry's life at most, \
         not {left:?}"
    );
    let lease = within(20, "the waiter behind the dead one", next)
        .await
        .expect("task")
        .expect("the next waiter is served");
    let waited = released_at.elapsed();
    // The entry's life, then the waiter's next attempt (a third of that),
    // with as much again to spare; a handoff for the 60 s asked would fail.
    let bound = (QUEUE_ENTRY_TTL + QUEUE_ENTRY_TTL / 3) * 2;
    assert!(
        waited < bound,
        "the waiter behind a killed one waited {waited:?} (bound {bound:?})"
    );
    lease.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_lasts_the_smaller_of_the_ttl_and_the_entry_life_left_with_a_rising_token() {
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let ttl = Duration::from_secs(30);
    // The entries live, and the handed lease lasts, long enough that a
    // loaded machine's stall between the join and the release, or between
    // the handoff and the look at the lock's PX, does not outlast them.
    for (waiter_ttl, entry_ttl, pause) in [
        // The entry's life left is shorter: the lease lasts that.
        (ttl, Duration::from_secs(6), Duration::from_millis(500)),
        // The ttl asked for is shorter: the lease lasts the ttl.
        (
            Duration::from_secs(3),
            Duration::from_secs(8),
            Duration::ZERO,
        ),
    ] {
        let key = dlock_runtime::conformance::fresh_key("redis-fair-px");
        let (holder, waiter) = (
            OwnerId::random().expect("id"),
            OwnerId::random().expect("id"),
        );
        let held = match backend
            .try_acquire(&AcquireRequest::new(&key, &holder, ttl))
            .await
            .expect("acquire")
        {
            Attempt::Acquired(grant) => grant.token,
            other => panic!("free key: {other:?}"),
        };
        let notice = backend
            .subscribe_handoff(&key, &waiter)
            .await
            .expect("handoff notice");
        let joined = Instant::now();
        let answer = backend
            .try_acquire(
                &AcquireRequest::new(&key, &waiter, waiter_ttl).with_queue(join(entry_ttl)),
            )
            .await
            .expect("join");
        assert!(matches!(answer, Attempt::Held { .. }), "{answer:?}");
        tokio::time::sleep(pause).await;
        assert_eq!(
            backend
                .release(&ReleaseRequest::new(&key, &holder))
                .await
                .expect("release"),
            ReleaseOutcome::Released
        );
        let grant = within(10, "the handoff", notice).await;
        let since_join = joined.elapsed();
        assert!(grant.token > held, "{} after {held}", grant.token);
        let valid_for = grant.valid_for.expect("a handoff says how long it lasts");
        // What was left of the entry's life at the release, by the
        // server's clock: at most its life less the pause, at least its
        // life less all the time since the join was sent. The server
        // counts whole milliseconds at the join and at the release, so
        // the life left may read up to 1 ms short of the client's span.
        let most = waiter_ttl.min(entry_ttl.saturating_sub(pause) + Duration::from_millis(5));
        let least = waiter_ttl.min(entry_ttl.saturating_sub(since_join + Duration::from_millis(1)));
        assert!(
            least <= valid_for && valid_for <= most,
            "a lease of {valid_for:?}, not within {least:?}..={most:?}: the ttl asked was \
             {waiter_ttl:?}, the entry lived {entry_ttl:?} from {pause:?} before the release"
        );
        let left = pttl(&mut conn, &format!("dlock:{{{key}}}:lock")).await;
        assert!(
            left > 0 && u128::try_from(left).expect("positive") <= valid_for.as_millis(),
            "the lock's PX {left} ms is within the {valid_for:?} told"
        );
        let value: String = redis::cmd("GET")
            .arg(format!("dlock:{{{key}}}:lock"))
            .query_async(&mut conn)
            .await
            .expect("GET");
        assert!(
            value.starts_with(&format!("{waiter}+ {} ", grant.token)),
            "the waiter holds it, marked, with its token: {value:?}"
        );
        let holding = backend.holder(&key).await.expect("holder").expect("held");
        assert_eq!(
            holding.token,
            Some(grant.token),
            "the holder reads the handed token"
        );
        assert_eq!(
            holding.holder.map(|info| info.pid),
            Some(std::process::id()),
            "the handoff wrote the waiter's holder record"
        );
        // The handed-over lease is the waiter's: renewed, and released.
        assert!(
            backend
                .extend(&dlock::backend::Renewal::new(&key, &waiter, ttl))
                .await
                .expect("extend")
        );
        assert_eq!(
            backend
                .release(&ReleaseRequest::new(&key, &waiter))
                .await
                .expect("release"),
            ReleaseOutcome::Released
        );
    }
}

/// Queues `waiter` (subscribed to its handoff first) behind `holder`, and
/// releases `holder`'s lease: the waiter's handoff notice.
async fn queue_and_release(
    backend: &Arc<dyn Backend>,
    key: &LockKey,
    holder: OwnerId,
    waiter: OwnerId,
) -> dlock::backend::Handoff {
    let notice = backend
        .subscribe_handoff(key, &waiter)
        .await
        .expect("notice");
    let answer = backend
        .try_acquire(
            &AcquireRequest::new(key, &waiter, Duration::from_secs(30))
                .with_queue(join(QUEUE_ENTRY_TTL)),
        )
        .await
        .expect("join");
    assert!(matches!(answer, Attempt::Held { .. }), "{answer:?}");
    assert_eq!(
        backend
            .release(&ReleaseRequest::new(key, &holder))
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    notice
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_token_is_drawn_as_an_acquisitions_and_a_stuck_counter_fails_only_the_waiter() {
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let ttl = Duration::from_secs(30);
    let key = dlock_runtime::conformance::fresh_key("redis-fair-token");
    let fence = format!("dlock:{{{key}}}:fence");
    let entry = join(QUEUE_ENTRY_TTL);
    let take = |owner: OwnerId| {
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            backend
                .try_acquire(&AcquireRequest::new(&key, &owner, ttl).with_queue(entry))
                .await
        }
    };
    let first = OwnerId::random().expect("id");
    assert!(matches!(take(first).await, Ok(Attempt::Acquired(_))));
    // A counter far above the clock: the handoff draws with INCR, as an
    // acquisition would, never falling back to the clock below it.
    let seeded: u64 = 4_000_000_000_000_000;
    let _: () = redis::cmd("SET")
        .arg(&fence)
        .arg(seeded)
        .query_async(&mut conn)
        .await
        .expect("SET fence");
    let second = OwnerId::random().expect("id");
    let grant = within(
        10,
        "the handoff",
        queue_and_release(&backend, &key, first, second).await,
    )
    .await;
    assert_eq!(grant.token.get(), seeded + 1, "INCR above the clock");
    // A counter that cannot rise: the release still frees the key (and
    // says so), and the waiter's own attempt meets the error.
    let _: () = redis::cmd("SET")
        .arg(&fence)
        .arg(i64::MAX)
        .query_async(&mut conn)
        .await
        .expect("SET fence");
    let third = OwnerId::random().expect("id");
    let notice = queue_and_release(&backend, &key, second, third).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), notice)
            .await
            .is_err(),
        "no handoff without a token"
    );
    assert!(
        backend.holder(&key).await.expect("holder").is_none(),
        "the key is free"
    );
    // Another fair caller finds it free with `third` first in line: it
    // tries to hand the key over, cannot draw, and leaves it free.
    let other = OwnerId::random().expect("id");
    let answer = backend
        .try_acquire(&AcquireRequest::new(&key, &other, ttl).with_queue(Queue::Respect))
        .await
        .expect("respect");
    assert!(
        matches!(answer, Attempt::Held { expires_in: None }),
        "{answer:?}"
    );
    assert!(
        backend.holder(&key).await.expect("holder").is_none(),
        "a handoff without a token leaves the key free"
    );
    let refused = take(third).await.expect_err("the counter cannot rise");
    assert!(refused.to_string().contains("cannot rise"), "{refused}");
    let _: () = redis::cmd("DEL")
        .arg(&fence)
        .query_async(&mut conn)
        .await
        .expect("DEL fence");
    // The counter gone (lost with the data): the clock is the floor again.
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_micros();
    match take(third).await.expect("acquire") {
        Attempt::Acquired(grant) => assert!(
            u128::from(grant.token.get()) + 1_000_000 >= before,
            "the token {} is floored at the clock {before}",
            grant.token
        ),
        other => panic!("{other:?}"),
    }
    backend
        .release(&ReleaseRequest::new(&key, &third))
        .await
        .expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_is_not_listed_as_a_held_key_and_a_leaving_waiter_takes_its_entry_along() {
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-fair-listed");
    let ttl = Duration::from_secs(30);
    let (holder, waiter) = (
        OwnerId::random().expect("id"),
        OwnerId::random().expect("id"),
    );
    backend
        .try_acquire(&AcquireRequest::new(&key, &holder, ttl))
        .await
        .expect("acquire");
    let answer = backend
        .try_acquire(&AcquireRequest::new(&key, &waiter, ttl).with_queue(join(QUEUE_ENTRY_TTL)))
        .await
        .expect("join");
    assert!(matches!(answer, Attempt::Held { .. }), "{answer:?}");
    assert_eq!(queued(&mut conn, &key).await, vec![waiter.to_string()]);
    let left = pttl(&mut conn, &queue_name(&key)).await;
    assert!(
        left > 0 && u128::try_from(left).expect("positive") <= QUEUE_ENTRY_TTL.as_millis(),
        "the queue dies with its last entry: PX {left}"
    );
    let listed = backend.held(key.as_str()).await.expect("held");
    let names: Vec<&str> = listed.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names, vec![key.as_str()], "only the lock is listed");
    // A waiter that gives up leaves through a release it is refused (F3).
    assert_eq!(
        backend
            .release(&ReleaseRequest::new(&key, &waiter))
            .await
            .expect("release"),
        ReleaseOutcome::NotOwner
    );
    assert!(
        queued(&mut conn, &key).await.is_empty(),
        "the entry is gone"
    );
    backend
        .release(&ReleaseRequest::new(&key, &holder))
        .await
        .expect("release");
}

/// The release script of the dlock before fair mode, word for word: it
/// deletes a marked key and publishes, and never looks at a queue.
const RELEASE_BEFORE_FAIR: &str = r"
local held = redis.pcall('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 1
end
if type(held) == 'string' and #held == #ARGV[1]
    and string.sub(held, 1, -2) == string.sub(ARGV[1], 1, -2) then
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('PUBLISH', string.sub(KEYS[1], 1, -5) .. 'released', 'released')
  return 1
end
return 0
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_by_a_replica_before_fair_mode_lets_the_first_fair_waiter_take_the_key_soon() {
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-fair-upgrade");
    let holder = OwnerId::random().expect("id");
    // What that dlock's acquisition writes: the owner id and its mark.
    let _: () = redis::cmd("SET")
        .arg(format!("dlock:{{{key}}}:lock"))
        .arg(format!("{holder}-"))
        .arg("PX")
        .arg(30_000)
        .query_async(&mut conn)
        .await
        .expect("SET");
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let (backend, key) = (backend.clone(), key.clone());
            tokio::spawn(async move {
                let lease = LockOptions::new(Duration::from_secs(30))
                    .wait(Duration::from_secs(30))
                    .fair(true)
                    .acquire_on(backend, &key)
                    .await
                    .expect("served");
                let (at, token) = (Instant::now(), lease.token());
                lease.release().await.expect("release");
                (at, token)
            })
        })
        .collect();
    until_queued(&mut conn, &key, 2).await;
    let released: i64 = redis::Script::new(RELEASE_BEFORE_FAIR)
        .key(format!("dlock:{{{key}}}:lock"))
        .key(format!("dlock:{{{key}}}:info"))
        .arg(format!("{holder}-"))
        .invoke_async(&mut conn)
        .await
        .expect("the release before fair mode");
    assert_eq!(released, 1);
    let released_at = Instant::now();
    let mut served = Vec::new();
    for waiter in waiters {
        served.push(within(20, "the fair waiters", waiter).await.expect("task"));
    }
    served.sort();
    let first = served[0].0 - released_at;
    assert!(
        first < QUEUE_ENTRY_TTL,
        "the first waiter took the key {first:?} after a release that handed nothing over"
    );
    assert!(served[1].1 > served[0].1, "tokens rise: {served:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_notice_subscribes_again_after_its_connection_breaks_and_unsubscribes_when_done()
{
    let server = RedisServer::start(&[]);
    let backend: Arc<dyn Backend> = Arc::new(
        RedisBackend::connect(&server.url())
            .await
            .expect("the test server"),
    );
    let key = dlock_runtime::conformance::fresh_key("redis-fair-reconnect");
    let ttl = Duration::from_secs(30);
    let (holder, waiter) = (
        OwnerId::random().expect("id"),
        OwnerId::random().expect("id"),
    );
    backend
        .try_acquire(&AcquireRequest::new(&key, &holder, ttl))
        .await
        .expect("acquire");
    let notice = backend
        .subscribe_handoff(&key, &waiter)
        .await
        .expect("handoff notice");
    let answer = backend
        .try_acquire(&AcquireRequest::new(&key, &waiter, ttl).with_queue(join(QUEUE_ENTRY_TTL)))
        .await
        .expect("join");
    assert!(matches!(answer, Attempt::Held { .. }), "{answer:?}");
    let channel = format!("dlock:{{{key}}}:handoff");
    let subscribers = |server: &RedisServer| {
        server
            .cli(&["PUBSUB", "NUMSUB", &channel])
            .lines()
            .nth(1)
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(subscribers(&server), "1", "subscribed before the attempt");
    let notice = tokio::spawn(notice);
    let killed = server.cli(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    assert_eq!(killed, "1", "the backend's pub/sub connection was cut");
    within(20, "the notice subscribes again", async {
        while subscribers(&server) != "1" {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(
        backend
            .release(&ReleaseRequest::new(&key, &holder))
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    let grant = within(10, "the handoff on the new connection", notice)
        .await
        .expect("task");
    let holding = backend.holder(&key).await.expect("holder").expect("held");
    assert_eq!(holding.token, Some(grant.token));
    // The notice is gone with its grant, and the key's last fair waiter
    // with it: the channel is given back.
    within(10, "the handoff channel is unsubscribed", async {
        while subscribers(&server) != "0" {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_mode_needs_no_command_beyond_the_least_privilege_acl() {
    let server = RedisServer::start(&[]);
    let port = server.port.to_string();
    let target = ["-p", port.as_str()];
    // The very rules the docs give for plain locks: fair mode adds none.
    redis_support::create_least_privilege_user(&target, "fair", "fair-pass-1");
    redis_support::reset_acl_log(&target);
    let refused = || {
        redis_support::refused_commands(&target)
            .into_iter()
            .filter(|command| !redis_support::HARMLESS_REFUSALS.contains(&command.as_str()))
            .collect::<Vec<_>>()
    };
    let url = format!("redis://fair:fair-pass-1@127.0.0.1:{}", server.port);
    let backend: Arc<dyn Backend> = Arc::new(
        RedisBackend::connect(&url)
            .await
            .unwrap_or_else(|err| panic!("{err}; refused: {:?}", refused())),
    );
    let key = dlock_runtime::conformance::fresh_key("redis-fair-acl");
    let holder = LockOptions::new(Duration::from_secs(30))
        .wait(Duration::from_secs(10))
        .fair(true)
        .acquire_on(backend.clone(), &key)
        .await
        .unwrap_or_else(|err| panic!("{err}; refused: {:?}", refused()));
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let (backend, key) = (backend.clone(), key.clone());
            tokio::spawn(async move {
                let lease = LockOptions::new(Duration::from_secs(30))
                    .wait(Duration::from_secs(10))
                    .fair(true)
                    .acquire_on(backend, &key)
                    .await?;
                lease.release().await
            })
        })
        .collect();
    // Both queue (their attempts mark the holder and write the queue).
    let queue = format!("dlock:{{{key}}}:queue");
    within(10, "the waiters queue", async {
        while server.cli(&["GET", &queue]).lines().count() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // A waiter that gives up leaves the queue through a release.
    let gone = OwnerId::random().expect("id");
    backend
        .try_acquire(
            &AcquireRequest::new(&key, &gone, Duration::from_secs(30))
                .with_queue(join(QUEUE_ENTRY_TTL)),
        )
        .await
        .unwrap_or_else(|err| panic!("{err}; refused: {:?}", refused()));
    backend
        .release(&ReleaseRequest::new(&key, &gone))
        .await
        .unwrap_or_else(|err| panic!("{err}; refused: {:?}", refused()));
    holder.release().await.expect("release");
    for waiter in waiters {
        within(15, "the fair waiters", waiter)
            .await
            .expect("task")
            .unwrap_or_else(|err| panic!("{err}; refused: {:?}", refused()));
    }
    assert_eq!(refused(), Vec::<String>::new(), "commands the ACL refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_that_expired_joins_again_at_the_end_and_the_queue_outlives_every_live_entry() {
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-fair-expiry");
    let ttl = Duration::from_secs(30);
    let holder = OwnerId::random().expect("id");
    backend
        .try_acquire(&AcquireRequest::new(&key, &holder, ttl))
        .await
        .expect("acquire");
    let queue_as = |owner: OwnerId, entry_ttl: Duration| {
        let (backend, key) = (backend.clone(), key.clone());
        async move {
            let answer = backend
                .try_acquire(&AcquireRequest::new(&key, &owner, ttl).with_queue(join(entry_ttl)))
                .await
                .expect("join");
            assert!(matches!(answer, Attempt::Held { .. }), "{answer:?}");
        }
    };
    let short = Duration::from_millis(300);
    let (a, b, c) = (
        OwnerId::random().expect("id"),
        OwnerId::random().expect("id"),
        OwnerId::random().expect("id"),
    );
    queue_as(a, short).await;
    queue_as(b, QUEUE_ENTRY_TTL).await;
    // A short entry joining last must not shorten the queue's life below
    // the longer entry ahead of it.
    queue_as(c, short).await;
    let left = pttl(&mut conn, &queue_name(&key)).await;
    assert!(
        left > i64::try_from(short.as_millis()).expect("ms"),
        "the queue lives as long as its longest-lived entry, not {left} ms"
    );
    tokio::time::sleep(short + Duration::from_millis(100)).await;
    // `a`'s entry expired: its next attempt joins at the end, behind `b`;
    // `b`'s refresh keeps its place.
    queue_as(a, QUEUE_ENTRY_TTL).await;
    queue_as(b, QUEUE_ENTRY_TTL).await;
    let order = queued(&mut conn, &key).await;
    let (a, b, c) = (a.to_string(), b.to_string(), c.to_string());
    // `c` expired too, behind `b`: it stays until it comes first.
    assert_eq!(
        order,
        vec![b.clone(), c, a.clone()],
        "an expired entry lost its place, and joined again at the end"
    );
    // The release hands the key to `b`, the first live entry.
    assert_eq!(
        backend
            .release(&ReleaseRequest::new(&key, &holder))
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    let value: String = redis::cmd("GET")
        .arg(format!("dlock:{{{key}}}:lock"))
        .query_async(&mut conn)
        .await
        .expect("GET");
    assert!(
        value.starts_with(&format!("{b}+ ")),
        "the first live entry holds the key: {value:?}"
    );
    // `b`'s release skips the expired `c`, behind it until now, for `a`.
    let b: OwnerId = OwnerId::parse_hex(&b).expect("owner id");
    assert_eq!(
        backend
            .release(&ReleaseRequest::new(&key, &b))
            .await
            .expect("release"),
        ReleaseOutcome::Released
    );
    let value: String = redis::cmd("GET")
        .arg(format!("dlock:{{{key}}}:lock"))
        .query_async(&mut conn)
        .await
        .expect("GET");
    assert!(
        value.starts_with(&format!("{a}+ ")),
        "the next live entry holds the key: {value:?}"
    );
    assert!(
        queued(&mut conn, &key).await.is_empty(),
        "the expired entry was dropped as it came first"
    );
    let a: OwnerId = OwnerId::parse_hex(&a).expect("owner id");
    backend
        .release(&ReleaseRequest::new(&key, &a))
        .await
        .expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_waiters_stay_alive_past_their_entry_life_without_the_queue_being_rewritten() {
    const WAITERS: usize = 40;
    let backend = backend().await;
    let mut conn = redis_support::shared_conn().await;
    let key = dlock_runtime::conformance::fresh_key("redis-fair-refresh");
    let holder = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let mut tasks = Vec::new();
    for _ in 0..WAITERS {
        tasks.push(spawn_fair_waiter(backend.clone(), key.clone()));
    }
    let owners = until_queued(&mut conn, &key, WAITERS).await;
    let read_queue = |mut conn: MultiplexedConnection| {
        let name = queue_name(&key);
        async move {
            let text: Vec<u8> = redis::cmd("GET")
                .arg(name)
                .query_async(&mut conn)
                .await
                .expect("GET queue");
            text
        }
    };
    let before = read_queue(conn.clone()).await;
    // Longer than an entry lives: every waiter refreshed its entry (one
    // attempt a second), or it would be dead by now.
    tokio::time::sleep(QUEUE_ENTRY_TTL + Duration::from_millis(500)).await;
    let after = read_queue(conn.clone()).await;
    assert_eq!(
        String::from_utf8_lossy(&after),
        String::from_utf8_lossy(&before),
        "refreshing an entry rewrote the queue"
    );
    for owner in &owners {
        let alive = pttl(&mut conn, &format!("dlock:{{{key}}}:waiter:{owner}")).await;
        assert!(alive > 0, "{owner}'s entry is alive: PTTL {alive}");
    }
    // Every entry is still live, so every waiter is served through handoffs.
    let mut previous = holder.token();
    holder.release().await.expect("release");
    let mut tokens = Vec::new();
    for task in tasks {
        tokens.push(within(20, "the fair waiters", task).await.expect("task"));
    }
    tokens.sort();
    for token in tokens {
        assert!(token > previous, "{token} after {previous}");
        previous = token;
    }
}

//! Leader election when operations happen to the store: a Redis server
//! that restarts without its data, a holder record an operator deleted, a
//! campaigner of the observer's own process that hears the same news, a
//! resignation that fails after the leader's work is done, and what the
//! election's watching costs the server when pub/sub is refused or flaps.
//!
//! The bounds below are an order of magnitude above what each fix needs
//! and below what the fault would take without it (a renewal interval of
//! 20 s, a watch's 10 s safety nap, a term that never ends).

mod redis_support;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dlock::backend::{
    AcquireRequest, Attempt, Holding, ReleaseNotice, ReleaseOutcome, ReleaseRequest, Renewal,
};
use dlock::election::Election;
use dlock::memory::MemoryBackend;
use dlock::redis::RedisBackend;
use dlock::{Backend, LockError, LockKey, LockOptions};
use redis_support::{RedisServer, create_user};
use tokio::time::{Instant, sleep, timeout};

/// A long ttl: its renewal interval (20 s) is what the old leader would
/// wait for to hear of its loss without the election's watch.
const LONG_TTL: Duration = Duration::from_secs(60);

async fn redis(server: &RedisServer) -> Arc<dyn Backend> {
    Arc::new(RedisBackend::connect(&server.url()).await.expect("redis"))
}

/// Redis restarts without persistence while a leader leads and another
/// process campaigns: the campaigner is elected with a higher token, and
/// the old leader is told of its loss within seconds, not at its next
/// renewal 20 s on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_is_told_soon_after_redis_restarts_without_its_data() {
    let mut server = RedisServer::start(&[]);
    let (here, there) = (redis(&server).await, redis(&server).await);
    let name = "election-restart";
    let old = Election::new(name, "old", LONG_TTL)
        .expect("election")
        .on(here);
    let old_term = old.campaign().await.expect("elected");
    let rival = Election::new(name, "new", LONG_TTL)
        .expect("election")
        .on(there);
    let campaign = tokio::spawn(async move { rival.campaign().await });
    sleep(Duration::from_millis(300)).await;
    server.restart();
    let restarted = Instant::now();
    let lost = timeout(Duration::from_secs(10), old_term.lost()).await;
    assert!(
        lost.is_ok(),
        "the old leader still believed it led 10 s after the restart"
    );
    let new_term = timeout(Duration::from_secs(20), campaign)
        .await
        .expect("the campaigner is elected")
        .expect("task")
        .expect("campaign");
    assert!(new_term.token() > old_term.token(), "tokens rise across it");
    eprintln!(
        "old leader told {:?} after the restart",
        restarted.elapsed()
    );
    new_term.resign().await.expect("resign");
}

/// One process observes an election and also campaigns in it twice, on
/// one backend; the leader (another process) resigns. Every message on
/// the key's channel reaches the observer, whoever else of the process
/// waits: it reports the new leader at once, not after its safety nap.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_observer_hears_a_new_leader_that_campaigners_of_its_process_also_waited_for() {
    let server = RedisServer::start(&[]);
    let (here, there) = (redis(&server).await, redis(&server).await);
    let name = "election-shared-news";
    let election = |identity: &str, on: &Arc<dyn Backend>| {
        Election::new(name, identity, LONG_TTL)
            .expect("election")
            .on(on.clone())
    };
    let old_term = election("old", &there).campaign().await.expect("elected");
    let mut campaigns = Vec::new();
    for identity in ["first", "second"] {
        let election = election(identity, &here);
        campaigns.push(tokio::spawn(async move {
            let term = election.campaign().await.expect("campaign");
            sleep(Duration::from_secs(60)).await;
            drop(term);
        }));
        sleep(Duration::from_millis(100)).await;
    }
    let mut watch = election("observer", &here).observe().expect("observe");
    let first = watch.changed().await.expect("watch").expect("a leader");
    assert_eq!(first.identity, "old");
    // The observer waits (its notice registered) before the resignation.
    let next = tokio::spawn(async move {
        loop {
            if let Some(leader) = watch.changed().await.expect("watch") {
                return leader;
            }
        }
    });
    sleep(Duration::from_millis(300)).await;
    old_term.resign().await.expect("resign");
    let next = timeout(Duration::from_secs(5), next)
        .await
        .expect("the observer heard the new leader within 5 s")
        .expect("task");
    assert!(next.identity == "first" || next.identity == "second");
    assert!(next.token > first.token);
    for campaign in campaigns {
        campaign.abort();
    }
}

/// An operator deletes the holder record while a leader leads: its next
/// renewal writes it again, so readers see the leader again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deleted_holder_record_is_written_again_by_the_next_renewal() {
    let server = RedisServer::start(&[]);
    let name = "election-record";
    let election = Election::new(name, "the leader", Duration::from_secs(3))
        .expect("election")
        .on(redis(&server).await);
    let term = election.campaign().await.expect("elected");
    assert_eq!(
        election
            .leader()
            .await
            .expect("leader")
            .expect("leads")
            .identity,
        "the leader"
    );
    assert_eq!(
        server.cli(&["DEL", &format!("dlock:{{{name}}}:holder")]),
        "1"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(leader)) = election.leader().await {
            assert_eq!(
                (leader.identity.as_str(), leader.token),
                ("the leader", term.token())
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the record was not written again within 10 s (renewal every 1 s)"
        );
        sleep(Duration::from_millis(100)).await;
    }
    term.check().expect("still leading");
    term.resign().await.expect("resign");
}

/// A memory backend whose releases fail.
struct ReleaseFails(MemoryBackend);

#[async_trait]
impl Backend for ReleaseFails {
    fn kind(&self) -> &'static str {
        "release-fails"
    }
    async fn try_acquire(&self, request: &AcquireRequest<'_>) -> Result<Attempt, LockError> {
        self.0.try_acquire(request).await
    }
    async fn extend(&self, renewal: &Renewal<'_>) -> Result<bool, LockError> {
        self.0.extend(renewal).await
    }
    async fn release(&self, lease: &ReleaseRequest<'_>) -> Result<ReleaseOutcome, LockError> {
        Err(LockError::backend(
            "release-fails",
            dlock::error::Operation::Release,
            lease.key.as_str(),
            "permission denied",
        ))
    }
    async fn subscribe(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        self.0.subscribe(key).await
    }
    async fn force_release(&self, key: &LockKey) -> Result<bool, LockError> {
        self.0.force_release(key).await
    }
    async fn holder(&self, key: &LockKey) -> Result<Option<Holding>, LockError> {
        self.0.holder(key).await
    }
    async fn watch_holder(&self, key: &LockKey) -> Result<ReleaseNotice, LockError> {
        self.0.watch_holder(key).await
    }
}

/// The leader's work finished, and then the resignation failed: the work's
/// output is returned (the term ends with its ttl), not lost to the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lead_returns_the_work_output_when_the_resignation_fails() {
    let store: Arc<dyn Backend> = Arc::new(ReleaseFails(MemoryBackend::new()));
    let election = Election::new("election-resign-fails", "leader", Duration::from_secs(1))
        .expect("election")
        .on(store);
    let output = timeout(
        Duration::from_secs(10),
        election.lead(|term| async move { term.token() }),
    )
    .await
    .expect("lead returned");
    assert!(output.is_ok(), "the finished work's output: {output:?}");
}

/// How many scripts the server has run (`EVALSHA`), from `INFO commandstats`.
fn scripts_run(server: &RedisServer) -> u64 {
    server
        .cli(&["INFO", "commandstats"])
        .lines()
        .find(|line| line.starts_with("cmdstat_evalsha:"))
        .and_then(|line| line.split("calls=").nth(1))
        .and_then(|rest| rest.split(',').next())
        .and_then(|calls| calls.parse().ok())
        .unwrap_or(0)
}

/// 300 plain locks (ttl 60 s, so renewed every 20 s), one leader and one
/// observer on one backend.
async fn busy_process(backend: &Arc<dyn Backend>, name: &str) -> Vec<dlock::Lease> {
    let mut leases = Vec::new();
    for i in 0..300 {
        leases.push(
            LockOptions::new(LONG_TTL)
                .acquire_on(backend.clone(), format!("{name}-plain-{i}"))
                .await
                .expect("plain lock"),
        );
    }
    leases
}

/// A Redis user without SUBSCRIBE (the least-privilege ACL minus pub/sub:
/// waiters and watches poll): a leader's guard and an observer polling
/// cost a few scripts a poll, never a renewal of every lease of the
/// process.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn polling_watches_without_subscribe_do_not_renew_every_lease() {
    let server = RedisServer::start(&[]);
    let target = ["-p", &server.port.to_string()];
    let rules: Vec<&str> = redis_support::LEAST_PRIVILEGE_ACL
        .split_whitespace()
        .filter(|rule| !rule.contains("subscribe"))
        .collect();
    create_user(&target, "nosub", "pw", rules);
    let url = format!("redis://nosub:pw@127.0.0.1:{}", server.port);
    let backend: Arc<dyn Backend> = Arc::new(RedisBackend::connect(&url).await.expect("redis"));
    let _leases = busy_process(&backend, "nosub").await;
    let election = Election::new("election-nosub", "leader", LONG_TTL)
        .expect("election")
        .on(backend.clone());
    let term = election.campaign().await.expect("elected");
    let mut watch = election.observe().expect("observe");
    let observer = tokio::spawn(async move {
        loop {
            if watch.changed().await.is_err() {
                sleep(Duration::from_millis(100)).await;
            }
        }
    });
    sleep(Duration::from_millis(500)).await;
    let before = scripts_run(&server);
    sleep(Duration::from_secs(5)).await;
    let scripts = scripts_run(&server) - before;
    observer.abort();
    term.resign().await.expect("resign");
    // 300 leases due every 20 s: ~75 renewals in 5 s, plus the polls'
    // holder reads (two watches, one read each per 500 ms poll).
    assert!(
        scripts < 500,
        "{scripts} scripts in 5 s: the polls renewed every lease of the process"
    );
}

/// A pub/sub link cut every 200 ms (a flapping proxy, a server killing
/// pub/sub clients over their output buffer): the leader rechecks its own
/// term, and the process's 300 plain locks keep their renewal schedule.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flapping_pubsub_link_does_not_renew_every_lease_on_each_break() {
    let server = RedisServer::start(&[]);
    let backend = redis(&server).await;
    let _leases = busy_process(&backend, "flap").await;
    let election = Election::new("election-flap", "leader", LONG_TTL)
        .expect("election")
        .on(backend.clone());
    let term = election.campaign().await.expect("elected");
    sleep(Duration::from_millis(500)).await;
    let before = scripts_run(&server);
    for _ in 0..25 {
        server.cli(&["CLIENT", "KILL", "TYPE", "pubsub"]);
        sleep(Duration::from_millis(200)).await;
    }
    let scripts = scripts_run(&server) - before;
    term.check().expect("the leader still leads");
    term.resign().await.expect("resign");
    assert!(
        scripts < 2000,
        "{scripts} scripts in 5 s for 300 leases due every 20 s: each break renewed them all"
    );
}

//! Faults on a real three-member etcd cluster, one cluster per test (and
//! one test at a time: three clusters of three members at once would
//! starve each other's heartbeats on a small machine): the leader killed
//! while a lock is held, the leader's host dying again and again under a
//! lock and an election leader at the shortest ttl kept through a leader
//! change, a follower killed, and a holder cut off from the cluster, by
//! its member freezing or by its own link going silent.

mod etcd_support;
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock::election::Election;
use dlock::etcd::EtcdBackend;
use dlock::{LockError, LockKey, LockOptions};
use etcd_support::{Cluster, random_word};
use support::proxy::Proxy;
use support::{until_lost, within};

/// One cluster test at a time (a Tokio mutex: held across awaits, and
/// not poisoned by a test that failed).
async fn one_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static CLUSTERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    CLUSTERS.lock().await
}

fn fresh_key(label: &str) -> LockKey {
    LockKey::new(format!("etcd-cluster-test/{label}/{}", random_word())).expect("a key")
}

async fn connect(endpoints: &[String]) -> Arc<EtcdBackend> {
    let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
    Arc::new(
        EtcdBackend::builder(&endpoints)
            .response_timeout(Duration::from_secs(1))
            .connect()
            .await
            .expect("the cluster answers"),
    )
}

/// Takes `key` on `backend`, trying again on backend errors (an election
/// under way) for up to 20 s; `Held` is an answer, not a retry.
async fn take(backend: &Arc<EtcdBackend>, key: &LockKey, ttl: Duration) -> dlock::Lease {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match LockOptions::new(ttl)
            .acquire_on(backend.clone(), key.clone())
            .await
        {
            Ok(lease) => return lease,
            Err(err @ LockError::Held { .. }) => panic!("{key} must be free: {err}"),
            Err(err) => {
                assert!(Instant::now() < deadline, "{key} could not be taken: {err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Watches, from a thread of its own, how long the members other than
/// the `frozen` leader take to name a new leader (polled with etcdctl
/// every 20 ms, so a little late at worst): the time a renewal can get no
/// answer whatever the client does. `None` if they had not within
/// `limit`. The tests below promise a lease kept through an election
/// that ends in time; on a machine so loaded that the election itself
/// outlasts the lease's slack, a loss proves nothing about dlock, and the
/// run is made again.
fn watch_election(
    cluster: &Cluster,
    frozen: usize,
    limit: Duration,
) -> std::thread::JoinHandle<Option<Duration>> {
    let started = Instant::now();
    let old = etcd_support::etcdctl(
        &cluster.members[frozen].endpoint(),
        &["endpoint", "status", "-w", "json"],
    )
    .and_then(|status| etcd_support::json_number(&status, "member_id"));
    let live: Vec<String> = (0..cluster.members.len())
        .filter(|i| *i != frozen)
        .map(|i| cluster.members[i].endpoint())
        .collect();
    std::thread::spawn(move || {
        while started.elapsed() < limit {
            for endpoint in &live {
                let status = etcd_support::etcdctl(endpoint, &["endpoint", "status", "-w", "json"]);
                let leader = status.and_then(|s| etcd_support::json_number(&s, "leader"));
                if let Some(leader) = leader
                    && leader != 0
                    && Some(leader) != old
                {
                    return Some(started.elapsed());
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    })
}

/// Whether a lease lost while the cluster elected a leader in
/// `elected` (from [`watch_election`]) is a failure of dlock: only if the
/// election took at most `slack`.
fn elected_in_time(elected: Option<Duration>, slack: Duration, lost: &str) -> bool {
    match elected {
        Some(took) if took <= slack => true,
        other => {
            eprintln!(
                "the cluster took {other:?} to elect a new leader, more than the {slack:?} \
                 the lease had to spare, and {lost}: nothing shown, run again"
            );
            false
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_keeps_a_held_lock_exclusive_and_tokens_rising() {
    let _one = one_at_a_time().await;
    let mut cluster = Cluster::start(3);
    let holder_side = connect(&cluster.endpoints()).await;
    let other_side = connect(&cluster.endpoints()).await;
    let key = fresh_key("leader");
    let held = take(&holder_side, &key, Duration::from_secs(4)).await;
    let leader = cluster.leader().await;
    cluster.members[leader].kill();
    // Through the election and after it: never a second holder.
    let watch_until = Instant::now() + Duration::from_secs(6);
    let mut answered_held = 0;
    while Instant::now() < watch_until {
        match LockOptions::new(Duration::from_secs(4))
            .acquire_on(other_side.clone(), key.clone())
            .await
        {
            Ok(lease) => panic!(
                "a second holder got {key} (token {}) while {} held it",
                lease.token(),
                held.token()
            ),
            Err(LockError::Held { .. }) => answered_held += 1,
            // No leader yet: the election is under way.
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        answered_held > 0,
        "the surviving members never answered while the lock was held"
    );
    assert!(
        held.check().is_ok(),
        "the holder's lease must survive the leader change (renewed through it)"
    );
    let first = held.token();
    held.release().await.expect("release");
    let mut last = first;
    for round in 0..3 {
        let lease = take(&other_side, &key, Duration::from_secs(4)).await;
        assert!(
            lease.token() > last,
            "round {round}: token {} after {last}",
            lease.token()
        );
        last = lease.token();
        lease.release().await.expect("release");
    }
}

/// A lock and an election leader with the shortest ttl the backend keeps
/// through a leader change (three times the cluster's minimum lease ttl:
/// 3 s on the test cluster), on a backend with the default timeouts,
/// through three deaths of the leader member. The leader dies as a host
/// that loses power does: it stops answering, and its connections stay
/// open with nothing coming back (SIGSTOP), so a request that went to it
/// waits until its caller gives up; it is killed and started again once
/// the round is over. The lock's renewals fall due every third of its ttl,
/// and each death comes at another moment before the next one (early,
/// midway, late in the interval), so renewals go out while the dead leader
/// is still taken for alive, during the election and after it. The
/// property is that neither holder is told it lost, through each death and
/// a whole ttl after it, when the surviving members elect a leader within a
/// third of the ttl (a run whose election took longer is made again, see
/// [`watch_election`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_and_an_election_leader_at_the_shortest_supported_ttl_survive_the_leader_members_death()
 {
    let _one = one_at_a_time().await;
    for _ in 0..3 {
        if a_lock_and_a_leader_through_three_deaths().await {
            return;
        }
    }
    panic!(
        "three runs in a row, the cluster took longer to elect a leader than a lease could wait"
    );
}

/// One run of the test above: false if a holder was told it lost while
/// the election took longer than the lease could wait (nothing shown).
async fn a_lock_and_a_leader_through_three_deaths() -> bool {
    let mut cluster = Cluster::start(3);
    let endpoints = cluster.endpoints();
    let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
    let backend = Arc::new(
        EtcdBackend::connect(&endpoints)
            .await
            .expect("the cluster answers"),
    );
    let ttl = backend.min_lease_ttl() * 3;
    let key = fresh_key("leader-kills");
    let held = take(&backend, &key, ttl).await;
    let taken = Instant::now();
    let election = Election::new(fresh_key("leader-kills-election"), "survivor", ttl)
        .expect("a valid election")
        .on(backend.clone());
    let leadership = within(20, "the only candidate to be elected", election.campaign())
        .await
        .expect("elected");
    let interval = ttl / 3;
    for (round, before_renewal) in [0.15, 0.45, 0.75].into_iter().enumerate() {
        let leader = cluster.leader().await;
        // The next moment `before_renewal` of an interval before one of the
        // lock's renewals, at least 50 ms from now.
        let mut dies_at = taken + interval.mul_f64(1.0 - before_renewal);
        while dies_at < Instant::now() + Duration::from_millis(50) {
            dies_at += interval;
        }
        tokio::time::sleep_until(dies_at.into()).await;
        cluster.members[leader].freeze();
        let elected = watch_election(&cluster, leader, ttl);
        let watch_until = Instant::now() + ttl;
        let mut lost = None;
        while Instant::now() < watch_until && lost.is_none() {
            if let Err(err) = held.check() {
                lost = Some(format!(
                    "round {round}: the lock's holder was told it lost {key}: {err}"
                ));
            } else if let Err(err) = leadership.check() {
                lost = Some(format!(
                    "round {round}: the elected leader was told it lost: {err}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let elected = tokio::task::block_in_place(|| elected.join().expect("the election watch"));
        if let Some(lost) = lost {
            // Renewals fall due every third of the ttl: an election within
            // a third of it leaves each a whole third to spare.
            assert!(!elected_in_time(elected, interval, &lost), "{lost}");
            cluster.members[leader].kill();
            return false;
        }
        // Back as a follower for the next round.
        cluster.members[leader].kill();
        cluster.members[leader].launch();
        tokio::task::block_in_place(|| cluster.wait_healthy(leader));
    }
    assert!(held.check().is_ok(), "the lock's holder lost its lease");
    assert!(leadership.check().is_ok(), "the leader lost its term");
    leadership.resign().await.expect("resign");
    held.release().await.expect("release");
    true
}

/// Twenty leases on one backend at the shortest supported ttl (three times
/// [`EtcdBackend::min_lease_ttl`]) through a freeze of the leader member's
/// process (its host dead: connections stay open, nothing comes back):
/// none of the holders is told it lost, for two ttls after the freeze. The
/// renewals' requests that were riding the connection to the frozen member
/// all fail together when its keep-alive times out; each is sent again, to
/// a live member, while its lease has time left. As above, when the
/// election ends within a third of the ttl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_leases_on_one_backend_at_the_shortest_supported_ttl_survive_a_leader_members_freeze()
 {
    let _one = one_at_a_time().await;
    for _ in 0..3 {
        if twenty_leases_through_a_freeze().await {
            return;
        }
    }
    panic!(
        "three runs in a row, the cluster took longer to elect a leader than a lease could wait"
    );
}

/// One run of the test above: false if a holder lost its lease while the
/// election took longer than the lease could wait (nothing shown).
async fn twenty_leases_through_a_freeze() -> bool {
    let mut cluster = Cluster::start(3);
    let endpoints = cluster.endpoints();
    let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
    let backend = Arc::new(
        EtcdBackend::connect(&endpoints)
            .await
            .expect("the cluster answers"),
    );
    let ttl = backend.min_lease_ttl() * 3;
    let mut held = Vec::new();
    for i in 0..20 {
        let key = fresh_key(&format!("many-{i}"));
        held.push((take(&backend, &key, ttl).await, key));
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    let leader = cluster.leader().await;
    cluster.members[leader].freeze();
    let election = watch_election(&cluster, leader, ttl * 2);
    let watch_until = Instant::now() + ttl * 2;
    let mut lost = None;
    while Instant::now() < watch_until && lost.is_none() {
        for (lease, key) in &held {
            if let Err(err) = lease.check() {
                lost = Some(format!("the holder of {key} was told it lost: {err}"));
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elected = tokio::task::block_in_place(|| election.join().expect("the election watch"));
    cluster.members[leader].kill();
    for (lease, _) in held {
        let _ = lease.release().await;
    }
    match lost {
        None => true,
        // The leases' renewals fall due every third of the ttl: an
        // election within a third of it leaves each a whole third to spare.
        Some(lost) => {
            assert!(!elected_in_time(elected, ttl / 3, &lost), "{lost}");
            false
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_follower_lets_locking_go_on() {
    let _one = one_at_a_time().await;
    let mut cluster = Cluster::start(3);
    // Knows every member, the dead one too.
    let backend = connect(&cluster.endpoints()).await;
    let leader = cluster.leader().await;
    let follower = (leader + 1) % 3;
    cluster.members[follower].kill();
    let key = fresh_key("follower");
    let mut last = None;
    for round in 0..5 {
        let lease = within(30, "an acquisition with a follower down", async {
            take(&backend, &key, Duration::from_secs(3)).await
        })
        .await;
        if let Some(last) = last {
            assert!(lease.token() > last, "round {round}: tokens must rise");
        }
        last = Some(lease.token());
        // Not free for anyone else meanwhile.
        let contender = LockOptions::new(Duration::from_secs(3))
            .acquire_on(backend.clone(), key.clone())
            .await;
        assert!(
            matches!(contender, Err(LockError::Held { .. })),
            "{contender:?}"
        );
        lease.release().await.expect("release");
    }
}

/// The holder reaches the cluster only through member `through` (a
/// follower), which is then frozen: its lease is lost and it is told so,
/// and a client of the other members takes the key with a higher token
/// once the lease has ended there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_only_member_is_cut_off_is_told_it_lost_and_another_takes_the_key_higher() {
    let _one = one_at_a_time().await;
    let cluster = Cluster::start(3);
    let leader = cluster.leader().await;
    let through = (leader + 1) % 3;
    let holder_side = connect(&[cluster.members[through].endpoint()]).await;
    let others: Vec<String> = (0..3)
        .filter(|i| *i != through)
        .map(|i| cluster.members[i].endpoint())
        .collect();
    let other_side = connect(&others).await;
    let key = fresh_key("cut-off-member");
    let held = take(&holder_side, &key, Duration::from_secs(2)).await;
    cluster.members[through].freeze();
    let lost = until_lost(&held, "the cut-off holder to be told it lost the lock").await;
    assert!(matches!(lost, LockError::LeaseLost { .. }), "{lost:?}");
    let next = within(30, "the key to be free once the lease ended", async {
        LockOptions::new(Duration::from_secs(5))
            .wait(Duration::from_secs(25))
            .acquire_on(other_side.clone(), key.clone())
            .await
    })
    .await
    .expect("another holder takes the key after the lease ended");
    assert!(next.token() > held.token());
    cluster.members[through].resume();
    assert!(matches!(
        held.release().await,
        Err(LockError::LeaseLost { .. })
    ));
    assert!(
        next.check().is_ok(),
        "the old holder's release must not touch the new lease"
    );
    next.release().await.expect("release");
}

/// The holder's own link to the cluster goes silent (a proxy that
/// forwards nothing more but keeps its sockets open): told lost, and the
/// key passes to another client with a higher token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_link_goes_silent_is_told_it_lost_and_another_takes_the_key_higher() {
    let _one = one_at_a_time().await;
    let cluster = Cluster::start(3);
    let proxy = Proxy::bind(format!("127.0.0.1:{}", cluster.members[0].client_port)).await;
    let holder_side = connect(&[format!("http://127.0.0.1:{}", proxy.port)]).await;
    let other_side = connect(&cluster.endpoints()).await;
    let key = fresh_key("silent-link");
    let held = take(&holder_side, &key, Duration::from_secs(2)).await;
    proxy.freeze();
    let lost = until_lost(&held, "the holder behind a silent link to be told it lost").await;
    assert!(matches!(lost, LockError::LeaseLost { .. }), "{lost:?}");
    let next = LockOptions::new(Duration::from_secs(5))
        .wait(Duration::from_secs(25))
        .acquire_on(other_side.clone(), key.clone())
        .await
        .expect("another holder takes the key after the lease ended");
    assert!(next.token() > held.token());
    next.release().await.expect("release");
}

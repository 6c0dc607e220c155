//! Leader election across real processes on every backend that spans
//! processes (file, Redis, PostgreSQL), and in one process on memory.
//!
//! Each campaigner is a child process (this test binary re-run) that leads
//! with `Election::lead`: as leader it writes its identity to a fenced
//! Redis resource with its term's token every 20 ms, checking its term
//! before each write, and prints what happens. The parent follows the
//! election with `Election::observe` and kills, stops, or asks the leader
//! to resign.

mod pg_support;
mod redis_support;
mod support;

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::PathBuf;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dlock::backend::OwnerId;
use dlock::election::{Election, Leader, LeaderWatch};
use dlock::file::FileBackend;
use dlock::memory::MemoryBackend;
use dlock::pg::{PgBackend, PgOptions};
use dlock::redis::RedisBackend;
use dlock::redis::fence::RedisFence;
use dlock::{Backend, LockError};
use tokio::time::{Instant, sleep, timeout};

/// The environment variable that turns this test binary into a campaigner.
const CHILD_ROLE: &str = "DLOCK_ELECTION_TEST_CHILD";
/// The terms' ttl: a leader killed on Redis is replaced within it.
const TTL: Duration = Duration::from_secs(2);

/// Connects to the store a spec names: `file:DIR`, `redis:URL`, `pg:CONN`
/// or `pg-idle:CONN`. On `pg` sessions keep the default liveness and idle
/// settings: a killed leader's session ends with its connection. On
/// `pg-idle` the server ends a session after 4 s of silence, so a stopped
/// leader loses its session soon, while a live one (pinged every second,
/// each ping given a second) may stall 3 s before it is taken for frozen.
async fn connect(spec: &str) -> Arc<dyn Backend> {
    let (kind, target) = spec.split_once(':').expect("KIND:TARGET");
    match kind {
        "file" => Arc::new(FileBackend::open(target).expect("lock directory")),
        "redis" => Arc::new(RedisBackend::connect(target).await.expect("redis")),
        "pg" => Arc::new(
            PgBackend::connect_with(target, PgOptions::new())
                .await
                .expect("postgres"),
        ),
        "pg-idle" => Arc::new(
            PgBackend::connect_with(
                target,
                PgOptions::new()
                    .liveness_interval(Duration::from_secs(1))
                    .server_idle_timeout(Some(Duration::from_secs(4))),
            )
            .await
            .expect("postgres"),
        ),
        other => panic!("unknown store {other}"),
    }
}

/// The child side: `campaign STORE ELECTION IDENTITY RESOURCE`. Leads with
/// `Election::lead`, printing `elected TOKEN`, `wrote TOKEN` for each
/// accepted fenced write, `lost TOKEN` when its term's lost signal fires,
/// then `late-write TOKEN accepted|refused` for one write sent with the
/// lost term's token (a write already on its way when the loss came). A
/// line `resign` on stdin makes the work end, which resigns.
#[test]
#[ignore = "runs only as a child process of the election tests"]
fn child_process_entry() {
    let Some((runtime, parts)) = support::child_role(CHILD_ROLE) else {
        return;
    };
    runtime.block_on(async move {
        let [role, store, name, identity, resource] = parts.as_slice() else {
            panic!("expected: campaign STORE ELECTION IDENTITY RESOURCE");
        };
        assert_eq!(role, "campaign");
        let backend = connect(store).await;
        let election = Election::new(name.as_str(), identity.as_str(), TTL)
            .expect("election")
            .on(backend);
        let resign = Arc::new(tokio::sync::Notify::new());
        {
            let resign = resign.clone();
            std::thread::spawn(move || {
                for line in std::io::stdin().lines().map_while(Result::ok) {
                    if line == "resign" {
                        resign.notify_one();
                    }
                }
            });
        }
        let client = redis::Client::open(redis_support::shared_url()).expect("redis url");
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("redis connection");
        let fence = RedisFence::new();
        let outcome = election
            .lead(|term| {
                let (mut conn, fence, resign) = (conn.clone(), fence.clone(), resign.clone());
                let (resource, identity) = (resource.clone(), identity.clone());
                async move {
                    let token = term.token();
                    println!("elected {token}");
                    let signal = term.lost_signal();
                    let (mut late_conn, late_fence, late_resource) =
                        (conn.clone(), fence.clone(), resource.clone());
                    tokio::spawn(async move {
                        signal.lost().await;
                        println!("lost {token}");
                        let late = late_fence
                            .write(&mut late_conn, &late_resource, token, "late")
                            .await;
                        let verdict = match late {
                            Ok(()) => "accepted",
                            Err(LockError::StaleToken { .. }) => "refused",
                            Err(other) => panic!("late write: {other}"),
                        };
                        println!("late-write {token} {verdict}");
                    });
                    loop {
                        tokio::select! {
                            () = resign.notified() => return,
                            () = sleep(Duration::from_millis(20)) => {}
                        }
                        if term.check().is_err() {
                            // Never write on a term known lost: `lead`
                            // counts the return as the loss.
                            return;
                        }
                        match fence
                            .write(&mut conn, &resource, token, identity.as_str())
                            .await
                        {
                            Ok(()) => println!("wrote {token}"),
                            Err(LockError::StaleToken { .. }) => println!("refused {token}"),
                            Err(other) => panic!("fenced write: {other}"),
                        }
                    }
                }
            })
            .await;
        match outcome {
            Ok(()) => println!("resigned"),
            Err(err) => panic!("lead: {err}"),
        }
        // Let the parent see the resignation, then leave.
        sleep(Duration::from_millis(200)).await;
    });
}

/// What one campaigner process printed, with when the parent read it.
#[derive(Default)]
struct Printed {
    lines: Vec<(Instant, String)>,
}

/// A campaigner child and what it prints.
struct Campaigner {
    identity: String,
    child: Child,
    printed: Arc<Mutex<Printed>>,
}

impl Campaigner {
    fn start(store: &str, election: &str, identity: &str, resource: &str) -> Self {
        let mut child = support::spawn_child(
            module_path!(),
            CHILD_ROLE,
            "campaign",
            &[store, election, identity, resource],
        );
        let stdout = child.stdout.take().expect("piped stdout");
        let printed = Arc::new(Mutex::new(Printed::default()));
        {
            let printed = printed.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    printed.lock().unwrap().lines.push((Instant::now(), line));
                }
            });
        }
        Self {
            identity: identity.to_owned(),
            child,
            printed,
        }
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid")
    }

    fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill")
            .args([signal, &self.pid().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal} {}", self.pid());
    }

    fn resign(&mut self) {
        let stdin = self.child.stdin.as_mut().expect("piped stdin");
        writeln!(stdin, "resign").expect("write to the leader");
    }

    /// The lines printed so far that start with `word`, with the rest of
    /// the line and when the parent read them.
    fn printed(&self, word: &str) -> Vec<(Instant, String)> {
        let prefix = format!("{word} ");
        self.printed
            .lock()
            .unwrap()
            .lines
            .iter()
            .filter_map(|(at, line)| {
                let rest = if *line == word {
                    Some("")
                } else {
                    line.strip_prefix(&prefix)
                };
                rest.map(|rest| (*at, rest.to_owned()))
            })
            .collect()
    }

    /// Waits up to `within` for a line `word REST` and returns REST.
    async fn wait_for(&self, word: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            if let Some((_, rest)) = self.printed(word).into_iter().next() {
                return rest;
            }
            if Instant::now() >= deadline {
                let printed = self.printed.lock().unwrap();
                let mut last: Vec<&str> = printed.lines.iter().map(|(_, l)| l.as_str()).collect();
                last.dedup();
                panic!(
                    "{} printed no `{word}` line within {within:?}; it printed {:?}",
                    self.identity,
                    &last[last.len().saturating_sub(8)..]
                );
            }
            sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Campaigner {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The leaders an observer saw, in order.
type Seen = Arc<Mutex<Vec<(Instant, Option<Leader>)>>>;

/// Follows the election in a task of its own, recording every change.
fn follow(mut watch: LeaderWatch) -> (Seen, tokio::task::JoinHandle<()>) {
    let seen: Seen = Arc::default();
    let task = {
        let seen = seen.clone();
        tokio::spawn(async move {
            loop {
                match watch.changed().await {
                    Ok(leader) => seen.lock().unwrap().push((Instant::now(), leader)),
                    Err(err) => eprintln!("observer: {err} (watching on)"),
                }
            }
        })
    };
    (seen, task)
}

/// Waits up to `within` for the observer to report a leader other than
/// `previous` (any leader if `None`), and returns it.
async fn next_leader(seen: &Seen, previous: Option<&Leader>, within: Duration) -> Leader {
    let deadline = Instant::now() + within;
    loop {
        let last = seen.lock().unwrap().last().and_then(|(_, l)| l.clone());
        if let Some(leader) = last
            && Some(&leader) != previous
        {
            return leader;
        }
        assert!(
            Instant::now() < deadline,
            "no new leader after {previous:?} within {within:?}"
        );
        sleep(Duration::from_millis(10)).await;
    }
}

/// Every change the observer saw: leaders' tokens rise strictly, and a
/// leader is only ever followed by nobody or by a leader with a higher
/// token.
fn assert_observed_in_order(seen: &Seen) {
    let seen = seen.lock().unwrap();
    let leaders: Vec<&Leader> = seen.iter().filter_map(|(_, l)| l.as_ref()).collect();
    for pair in leaders.windows(2) {
        assert!(
            pair[1].token > pair[0].token,
            "observers saw {} after {}",
            pair[1],
            pair[0]
        );
    }
}

fn fresh_name(label: &str) -> String {
    format!(
        "dlock-test:election:{label}:{}",
        OwnerId::random().expect("random")
    )
}

fn file_store() -> String {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "dlock-election-{}",
        OwnerId::random().expect("random")
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    format!("file:{}", dir.display())
}

fn redis_store() -> String {
    format!("redis:{}", redis_support::shared_url())
}

fn pg_store() -> String {
    format!("pg:{}", pg_support::shared_conn())
}

/// PostgreSQL with sessions the server ends after a few seconds of silence.
fn pg_idle_store() -> String {
    format!("pg-idle:{}", pg_support::shared_conn())
}

/// Three campaigners: exactly one leads at a time as observers see it; the
/// leader killed with SIGKILL is replaced, a resigning leader is replaced,
/// and observers see every change in order with rising tokens.
async fn three_campaigners_hand_over_on_kill_and_resignation(store: String) {
    let name = fresh_name("handover");
    let resource = fresh_name("resource");
    let observer = Election::new(name.as_str(), "observer", TTL)
        .expect("election")
        .on(connect(&store).await);
    let (seen, follower) = follow(observer.observe().expect("observe"));
    let mut campaigners: Vec<Campaigner> = (0..3)
        .map(|i| {
            Campaigner::start(
                &store,
                &name,
                &format!("replica-{i} of {store:.5}"),
                &resource,
            )
        })
        .collect();
    // Kill leaders one after another, then make the last resign.
    let mut previous: Option<Leader> = None;
    for round in 0..2 {
        let leader = next_leader(&seen, previous.as_ref(), TTL * 10).await;
        let index = campaigners
            .iter()
            .position(|c| c.identity == leader.identity)
            .expect("the leader is one of the campaigners");
        let elected = campaigners[index]
            .wait_for("elected", Duration::from_secs(10))
            .await;
        assert_eq!(
            elected,
            leader.token.to_string(),
            "round {round}: observed token"
        );
        assert_eq!(
            observer.leader().await.expect("leader").as_ref(),
            Some(&leader)
        );
        campaigners[index].signal("-KILL");
        let _ = campaigners[index].child.wait();
        campaigners.remove(index);
        previous = Some(leader);
    }
    let leader = next_leader(&seen, previous.as_ref(), TTL * 10).await;
    let index = campaigners
        .iter()
        .position(|c| c.identity == leader.identity)
        .expect("the leader is the last campaigner");
    campaigners[index].resign();
    campaigners[index]
        .wait_for("resigned", Duration::from_secs(10))
        .await;
    // Resigned: nobody else campaigns, so nobody leads.
    let deadline = Instant::now() + Duration::from_secs(10);
    while observer.leader().await.expect("leader").is_some() {
        assert!(
            Instant::now() < deadline,
            "the resignation freed the election"
        );
        sleep(Duration::from_millis(10)).await;
    }
    follower.abort();
    assert_observed_in_order(&seen);
    let leaders = seen
        .lock()
        .unwrap()
        .iter()
        .filter_map(|(_, l)| l.clone())
        .count();
    assert_eq!(
        leaders,
        3,
        "three terms, each seen once: {:?}",
        seen.lock().unwrap()
    );
}

/// A leader stopped with SIGSTOP past its ttl is replaced; resumed, it is
/// told it lost by its lost signal, before and without a write of its
/// own getting through, and a write it still sends with its old token is
/// refused by the fence.
async fn a_stopped_leader_resumes_deposed_and_its_writes_are_refused(store: String) {
    let name = fresh_name("paused");
    let resource = fresh_name("resource");
    let observer = Election::new(name.as_str(), "observer", TTL)
        .expect("election")
        .on(connect(&store).await);
    let (seen, follower) = follow(observer.observe().expect("observe"));
    let campaigners: Vec<Campaigner> = (0..2)
        .map(|i| Campaigner::start(&store, &name, &format!("replica-{i}"), &resource))
        .collect();
    let first = next_leader(&seen, None, TTL * 10).await;
    let (paused, other) = if campaigners[0].identity == first.identity {
        (&campaigners[0], &campaigners[1])
    } else {
        (&campaigners[1], &campaigners[0])
    };
    paused.wait_for("wrote", Duration::from_secs(10)).await;
    paused.signal("-STOP");
    let stopped_at = Instant::now();
    let second = next_leader(&seen, Some(&first), TTL * 10).await;
    assert_eq!(
        second.identity, other.identity,
        "the other campaigner leads"
    );
    assert!(second.token > first.token);
    other.wait_for("wrote", Duration::from_secs(10)).await;
    let resumed_at = Instant::now();
    paused.signal("-CONT");
    let lost = paused.wait_for("lost", Duration::from_secs(10)).await;
    assert_eq!(
        lost,
        first.token.to_string(),
        "the deposed leader's lost signal"
    );
    let late = paused.wait_for("late-write", Duration::from_secs(10)).await;
    assert_eq!(
        late,
        format!("{} refused", first.token),
        "the fence must refuse a deposed leader's write"
    );
    // No write of the old term got through after the pause: the resumed
    // leader learned of its loss without a write of its own. One line may
    // come after the resume for a write accepted before the stop (stopped
    // between the fence's answer and its print): any write sent after the
    // resume is refused, as the new leader had written.
    let old = first.token.to_string();
    let after_resume: Vec<_> = paused
        .printed("wrote")
        .into_iter()
        .filter(|(at, token)| *at >= resumed_at && *token == old)
        .collect();
    assert!(
        after_resume.len() <= 1,
        "the deposed leader wrote after it resumed: {after_resume:?}"
    );
    assert!(stopped_at < resumed_at);
    follower.abort();
    assert_observed_in_order(&seen);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn file_three_campaigners_hand_over_on_kill_and_resignation() {
    three_campaigners_hand_over_on_kill_and_resignation(file_store()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_three_campaigners_hand_over_on_kill_and_resignation() {
    three_campaigners_hand_over_on_kill_and_resignation(redis_store()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_three_campaigners_hand_over_on_kill_and_resignation() {
    three_campaigners_hand_over_on_kill_and_resignation(pg_store()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn file_a_stopped_leader_resumes_deposed_and_its_writes_are_refused() {
    a_stopped_leader_resumes_deposed_and_its_writes_are_refused(file_store()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_a_stopped_leader_resumes_deposed_and_its_writes_are_refused() {
    a_stopped_leader_resumes_deposed_and_its_writes_are_refused(redis_store()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_a_stopped_leader_resumes_deposed_and_its_writes_are_refused() {
    a_stopped_leader_resumes_deposed_and_its_writes_are_refused(pg_idle_store()).await;
}

/// In one process on memory: three campaigning tasks, one leads at a time;
/// a resignation hands over at once, and `lead` campaigns again after a
/// loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_campaigners_take_turns_and_lead_rejoins_after_a_loss() {
    let store: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let name = fresh_name("memory");
    let election = |identity: &str| {
        Election::new(name.as_str(), identity, TTL)
            .expect("election")
            .on(store.clone())
    };
    let observer = election("observer");
    let (seen, follower) = follow(observer.observe().expect("observe"));
    let leading = Arc::new(Mutex::new(HashMap::<String, u32>::new()));
    let mut tasks = Vec::new();
    for i in 0..3 {
        let (election, leading) = (election(&format!("task-{i}")), leading.clone());
        tasks.push(tokio::spawn(async move {
            let identity = election.identity().to_owned();
            election
                .lead(|term| {
                    let (leading, identity) = (leading.clone(), identity.clone());
                    async move {
                        let others = {
                            let mut leading = leading.lock().unwrap();
                            *leading.entry(identity.clone()).or_default() += 1;
                            leading.values().sum::<u32>() - 1
                        };
                        assert_eq!(others, 0, "{identity} leads beside another leader");
                        sleep(Duration::from_millis(30)).await;
                        *leading.lock().unwrap().get_mut(&identity).unwrap() -= 1;
                        term.token()
                    }
                })
                .await
                .expect("lead")
        }));
    }
    let mut tokens = Vec::new();
    for task in tasks {
        tokens.push(task.await.expect("task"));
    }
    tokens.sort();
    tokens.dedup();
    assert_eq!(tokens.len(), 3, "three terms with three tokens");

    // A term taken away (force release) stops the work; `lead` campaigns
    // again and is elected anew with a higher token.
    let rejoiner = election("rejoiner");
    let terms = Arc::new(Mutex::new(Vec::new()));
    let lead = {
        let terms = terms.clone();
        tokio::spawn(async move {
            rejoiner
                .lead(|term| {
                    let terms = terms.clone();
                    async move {
                        let round = {
                            let mut terms = terms.lock().unwrap();
                            terms.push(term.token());
                            terms.len()
                        };
                        if round == 1 {
                            // The first term only ends by being taken away.
                            std::future::pending::<()>().await;
                        }
                    }
                })
                .await
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let first = loop {
        let last = seen.lock().unwrap().last().and_then(|(_, l)| l.clone());
        if let Some(leader) = last.filter(|l| l.identity == "rejoiner") {
            break leader;
        }
        assert!(Instant::now() < deadline, "the rejoiner is elected");
        sleep(Duration::from_millis(5)).await;
    };
    assert!(
        store
            .force_release(observer.name())
            .await
            .expect("force release")
    );
    timeout(Duration::from_secs(10), lead)
        .await
        .expect("lead campaigned again and finished")
        .expect("task")
        .expect("lead");
    let terms = terms.lock().unwrap().clone();
    assert_eq!(terms.len(), 2, "two terms: {terms:?}");
    assert_eq!(terms[0], first.token);
    assert!(terms[1] > terms[0], "the second term's token rises");
    follower.abort();
    assert_observed_in_order(&seen);
}

/// Work that returns once it sees its term lost makes `lead` campaign
/// again (not resign a lost term); `lead_until` resigns at shutdown, so
/// the next campaigner is elected at once, not after the ttl.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn memory_work_returning_on_a_lost_term_rejoins_and_shutdown_resigns() {
    let store: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let name = fresh_name("memory-until");
    let election = |identity: &str| {
        Election::new(name.as_str(), identity, Duration::from_secs(3))
            .expect("election")
            .on(store.clone())
    };
    let observer = election("observer");
    let terms = Arc::new(Mutex::new(Vec::new()));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let leader = {
        let (election, terms) = (election("leader"), terms.clone());
        tokio::spawn(async move {
            election
                .lead_until(
                    |term| {
                        let terms = terms.clone();
                        async move {
                            terms.lock().unwrap().push(term.token());
                            // Polls its term and returns once it is lost.
                            while term.check().is_ok() {
                                sleep(Duration::from_millis(5)).await;
                            }
                            "returned on a lost term"
                        }
                    },
                    stopped,
                )
                .await
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while terms.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "elected");
        sleep(Duration::from_millis(5)).await;
    }
    assert!(
        store
            .force_release(observer.name())
            .await
            .expect("force release")
    );
    // Memory tells a holder of a forced release at its next renewal.
    let deadline = Instant::now() + Duration::from_secs(10);
    while terms.lock().unwrap().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "lead campaigned again after the loss"
        );
        sleep(Duration::from_millis(5)).await;
    }
    let terms = terms.lock().unwrap().clone();
    assert!(terms[1] > terms[0], "the new term's token rises: {terms:?}");
    // A rival waits; at shutdown the leader resigns before `lead_until`
    // returns, and the rival is elected.
    let rival = {
        let election = election("rival");
        tokio::spawn(async move { election.campaign().await })
    };
    sleep(Duration::from_millis(50)).await;
    stop.send(()).expect("the leader listens");
    let outcome = timeout(Duration::from_secs(5), leader)
        .await
        .expect("lead_until returned at shutdown")
        .expect("task")
        .expect("lead_until");
    assert_eq!(outcome, None, "shut down, no output");
    let now = observer.leader().await.expect("leader");
    assert_ne!(
        now.map(|l| l.identity).as_deref(),
        Some("leader"),
        "the leader resigned before lead_until returned"
    );
    let rival = timeout(Duration::from_secs(5), rival)
        .await
        .expect("the rival is elected at once")
        .expect("task")
        .expect("campaign");
    assert!(rival.token() > terms[1]);
    let leader = observer
        .leader()
        .await
        .expect("leader")
        .expect("someone leads");
    assert_eq!(
        (leader.identity.as_str(), leader.token),
        ("rival", rival.token())
    );
    rival.resign().await.expect("resign");
}

/// Identities are checked before anything is sent.
#[test]
fn bad_identities_are_refused_with_the_reason() {
    for (identity, reason) in [
        (String::new(), "must not be empty"),
        ("x".repeat(257), "more than the 256-byte maximum"),
        ("web\n3".to_owned(), "control character"),
    ] {
        match Election::new("jobs", identity.clone(), TTL) {
            Err(LockError::InvalidOption {
                option,
                reason: why,
            }) => {
                assert_eq!(option, "identity");
                assert!(why.contains(reason), "{identity:?}: {why}");
            }
            other => panic!("{identity:?} must be refused: {other:?}"),
        }
    }
    assert!(Election::new("jobs", "x".repeat(256), TTL).is_ok());
}

/// A plain lock on the election's name is not a leader: `leader()` says
/// the name is held (after a short wait) instead of hanging or answering
/// nobody, and an observer reports the leader once a campaigner leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plain_lock_on_the_election_name_reads_as_held_not_as_a_leader() {
    let store: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let name = fresh_name("plain");
    let election = Election::new(name.as_str(), "campaigner", TTL)
        .expect("election")
        .on(store.clone());
    let plain = dlock::LockOptions::new(TTL)
        .acquire_on(store.clone(), name.as_str())
        .await
        .expect("plain lock");
    match timeout(Duration::from_secs(10), election.leader()).await {
        Ok(Err(LockError::Held { key, .. })) => assert_eq!(key, name),
        other => panic!("a plain lock must read as held: {other:?}"),
    }
    let mut watch = election.observe().expect("observe");
    let campaign = {
        let election = election.clone();
        tokio::spawn(async move { election.campaign().await })
    };
    plain.release().await.expect("release");
    let mut seen = None;
    while seen.is_none() {
        seen = timeout(Duration::from_secs(10), watch.changed())
            .await
            .expect("a change")
            .expect("watch");
    }
    let leadership = campaign.await.expect("task").expect("campaign");
    let leader = seen.expect("a leader");
    assert_eq!(
        (leader.identity.as_str(), leader.token),
        ("campaigner", leadership.token())
    );
    leadership.resign().await.expect("resign");
}

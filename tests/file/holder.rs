//! Who holds a file lock, read across real OS processes on one host: the
//! holder record a child process writes, state files an earlier dlock
//! version wrote, and a lock directory that holds other files too.

use crate::support;
use crate::{fresh_dir, path};

use std::fs::File;
use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dlock::backend::OwnerId;
use dlock::error::Operation;
use dlock::file::FileBackend;
use dlock::{Backend, HolderInfo, LockError, LockKey, LockOptions, registry};

fn key(name: &str) -> LockKey {
    LockKey::new(name).expect("valid key")
}

/// The environment variable that turns this test binary into a child
/// process playing one role (see `child_process_entry`).
const CHILD_ROLE: &str = "DLOCK_FILE_HOLDER_TEST_CHILD";

/// The child side. Ignored in normal runs; the tests below start it as
/// `<test binary> <module>::child_process_entry --exact --ignored` with a role.
#[test]
#[ignore = "runs only as a child process of the cross-process tests"]
fn child_process_entry() {
    let Some((runtime, parts)) = support::child_role(CHILD_ROLE) else {
        return;
    };
    runtime.block_on(async move {
        match parts[0].as_str() {
            // `hold DIR KEY PROCESS_LABEL BACKEND_LABEL` (`-` for none):
            // take the key with a long ttl through the lease API, print
            // `held <token>` and hang on to it until killed.
            "hold" => {
                let label = |arg: &str| (arg != "-").then(|| arg.to_owned());
                registry()
                    .set_label(label(&parts[3]).as_deref())
                    .expect("process label");
                let mut backend = FileBackend::open(&parts[1]).expect("dir");
                if let Some(label) = label(&parts[4]) {
                    backend = backend.with_label(&label).expect("backend label");
                }
                let lease = LockOptions::new(Duration::from_secs(120))
                    .acquire_on(Arc::new(backend), parts[2].as_str())
                    .await
                    .expect("acquire");
                println!("held {}", lease.token());
                tokio::time::sleep(Duration::from_secs(600)).await;
                drop(lease);
            }
            other => panic!("unknown child role {other}"),
        }
    });
}

/// A child process holding a key; killed when dropped, so a failed
/// assertion leaves no holder behind.
struct HoldingChild {
    child: Child,
    token: u64,
}

impl HoldingChild {
    fn spawn(dir: &Path, key: &str, process_label: &str, backend_label: &str) -> Self {
        let mut child = support::spawn_child(
            module_path!(),
            CHILD_ROLE,
            "hold",
            &[path(dir), key, process_label, backend_label],
        );
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let token = lines
            .by_ref()
            .map_while(Result::ok)
            .find_map(|line| line.strip_prefix("held ").and_then(|t| t.parse().ok()));
        // Its further output is drained so it never writes into a closed pipe.
        std::thread::spawn(move || lines.for_each(drop));
        let mut holding = Self { child, token: 0 };
        holding.token = token.expect("the child reports its token");
        holding
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for HoldingChild {
    fn drop(&mut self) {
        self.kill();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_in_another_process_is_read_back_with_its_host_pid_and_label() {
    let dir = fresh_dir();
    let prefix = format!("jobs:{}:", OwnerId::random().expect("random"));
    let (labelled, unlabelled) = (format!("{prefix}backend"), format!("{prefix}process"));
    // The backend's own label wins over the process's; without one, the
    // process's is recorded.
    let mut children = [
        HoldingChild::spawn(&dir, &labelled, "process-label", "backend-label"),
        HoldingChild::spawn(&dir, &unlabelled, "process-label", "-"),
    ];
    let reader: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let host = HolderInfo::this_process(None).host;
    let expected = [
        (labelled.clone(), children[0].pid(), "backend-label"),
        (unlabelled.clone(), children[1].pid(), "process-label"),
    ];
    for ((name, pid, label), child) in expected.iter().zip(&children) {
        assert_ne!(*pid, std::process::id());
        let holding = reader
            .holder(&key(name))
            .await
            .expect("holder")
            .unwrap_or_else(|| panic!("`{name}` is held by the child"));
        assert_eq!(holding.token.map(|t| t.get()), Some(child.token));
        let holder = holding.holder.expect("the child recorded its holder");
        assert_eq!(
            (holder.host.as_str(), holder.pid, holder.label.as_deref()),
            (host.as_str(), *pid, Some(*label)),
            "`{name}`"
        );
        assert!(holder.held_for.is_some(), "the time of acquisition is kept");
    }

    let listed = reader.held(&prefix).await.expect("held");
    let seen: Vec<_> = listed
        .into_iter()
        .map(|(key, holding)| {
            let holder = holding.holder.map(|h| (h.host, h.pid, h.label));
            (key, holding.token.map(|t| t.get()), holder)
        })
        .collect();
    let want: Vec<_> = expected
        .iter()
        .zip(&children)
        .map(|((name, pid, label), child)| {
            let holder = (host.clone(), *pid, Some((*label).to_owned()));
            (name.clone(), Some(child.token), Some(holder))
        })
        .collect();
    assert_eq!(seen, want, "held lists both children's keys, sorted");

    // A caller refused the key is told which process holds it. The holder
    // is read after the refusal within a bound of its own: a read a stall
    // pushed past it costs one refusal its holder. Of a few refusals, one
    // must name it.
    let mut tries = 0;
    let err = loop {
        tries += 1;
        let refused = LockOptions::new(Duration::from_secs(10))
            .acquire_on(reader.clone(), labelled.as_str())
            .await;
        match refused {
            Err(LockError::Held { holder: None, .. }) if tries < 5 => {}
            Err(err @ LockError::Held { .. }) => break err,
            refused => panic!(
                "the child holds `{labelled}`: {:?}",
                refused.map(|l| l.token())
            ),
        }
    };
    assert!(
        err.to_string().contains(&format!(
            "{host} (pid {}, label \"backend-label\")",
            children[0].pid()
        )),
        "{err}"
    );

    // A holder that dies holds nothing: not read, not listed.
    children[0].kill();
    assert_eq!(reader.holder(&key(&labelled)).await.expect("holder"), None);
    let after: Vec<String> = reader
        .held(&prefix)
        .await
        .expect("held")
        .into_iter()
        .map(|(key, _)| key)
        .collect();
    assert_eq!(after, [unlabelled]);
    children[1].kill();
    let _ = std::fs::remove_dir_all(&dir);
}

fn now_us() -> u64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("a clock after 1970");
    u64::try_from(since_epoch.as_micros()).expect("microseconds fit")
}

#[tokio::test]
async fn state_files_an_earlier_version_wrote_still_read_with_no_holder() {
    let dir = fresh_dir();
    std::fs::create_dir_all(&dir).expect("dir");
    let expires = now_us() + 60_000_000;
    let (first_owner, second_owner) = (
        OwnerId::random().expect("random"),
        OwnerId::random().expect("random"),
    );
    // Byte for byte as the earlier versions wrote them: the first with
    // nothing after the key, the next with the owner's identity field.
    let states = [
        (
            "old-first",
            format!(
                "dlock-file-state v1\ncounter 41\nowner {first_owner}\nexpires_us {expires}\nkey old-first"
            ),
        ),
        (
            "old-identity",
            format!(
                "dlock-file-state v1\ncounter 52\nowner {second_owner}\nexpires_us {expires}\nkey old-identity\n\0identity {second_owner} leader%201"
            ),
        ),
        (
            "old-released",
            "dlock-file-state v1\ncounter 63\nowner -\nexpires_us 0\nkey old-released".to_owned(),
        ),
    ];
    for (name, text) in &states {
        std::fs::write(dir.join(format!("{name}.state")), text).expect("write a state");
    }
    // The first holder's process is alive: it holds its alive file locked.
    let alive = File::create(dir.join(format!("old-first.{first_owner}.alive"))).expect("alive");
    alive.lock().expect("lock the alive file");

    let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let first = backend
        .holder(&key("old-first"))
        .await
        .expect("an earlier version's state reads")
        .expect("held");
    assert_eq!(
        (first.token.map(|t| t.get()), first.identity, first.holder),
        (Some(41), None, None)
    );
    assert!(first.expires_in.is_some());
    let second = backend
        .holder(&key("old-identity"))
        .await
        .expect("an earlier version's state reads")
        .expect("held");
    assert_eq!(
        (
            second.token.map(|t| t.get()),
            second.identity.as_deref(),
            second.holder
        ),
        (Some(52), Some("leader 1"), None)
    );
    let listed: Vec<(String, Option<u64>, bool)> = backend
        .held("old-")
        .await
        .expect("held")
        .into_iter()
        .map(|(key, h)| (key, h.token.map(|t| t.get()), h.holder.is_some()))
        .collect();
    assert_eq!(
        listed,
        [
            ("old-first".to_owned(), Some(41), false),
            ("old-identity".to_owned(), Some(52), false)
        ]
    );

    // The earlier holder's process dies: its key is free, and this version
    // takes it with the next token, recording itself. "Free" is read again
    // for a while: a child another test of this binary forks at that
    // moment holds the alive file's descriptor, and with it the lock,
    // until its exec closes it.
    drop(alive);
    support::within(10, "the dead holder's key reads free", async {
        loop {
            match backend.holder(&key("old-first")).await.expect("holder") {
                None => break,
                Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await;
    for (name, token) in [("old-first", 42), ("old-released", 64)] {
        let lease = LockOptions::new(Duration::from_secs(30))
            .acquire_on(backend.clone(), name)
            .await
            .expect("free");
        assert_eq!(lease.token().get(), token, "`{name}` continues its counter");
        let holder = backend
            .holder(&key(name))
            .await
            .expect("holder")
            .and_then(|holding| holding.holder)
            .expect("this version records its holder");
        assert_eq!(holder.pid, std::process::id());
        lease.release().await.expect("release");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn held_skips_files_that_are_not_state_files_and_leaves_them_alone() {
    let dir = fresh_dir();
    let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    let lease = LockOptions::new(Duration::from_secs(30))
        .acquire_on(backend.clone(), "real")
        .await
        .expect("free");
    let real = std::fs::read(dir.join("real.state")).expect("the key's state");
    let foreign: [(&str, &[u8]); 7] = [
        ("notes.txt", b"not a lock"),
        ("garbage.state", b"not a state file"),
        ("empty.state", b""),
        ("binary.state", &[0xff, 0xfe, 0x00, 0x01]),
        // A held key's state under a name that is not its key's (a copy
        // made by hand): it says nothing of the holder of `copy`.
        ("copy.state", &real),
        ("real.state.bak", &real),
        ("real.state.tmp", &real),
    ];
    for (name, bytes) in foreign {
        std::fs::write(dir.join(name), bytes).expect("write a foreign file");
    }
    std::fs::create_dir(dir.join("a-dir.state")).expect("a directory");

    let listed = backend
        .held("")
        .await
        .expect("foreign files are skipped, not an error");
    let keys: Vec<&str> = listed.iter().map(|(key, _)| key.as_str()).collect();
    assert_eq!(keys, ["real"]);
    let holder = listed[0].1.holder.as_ref().expect("recorded");
    assert_eq!(holder.pid, std::process::id());
    for (name, bytes) in foreign {
        assert_eq!(
            std::fs::read(dir.join(name)).expect("still there"),
            bytes,
            "`{name}` is left as it was"
        );
    }
    assert!(dir.join("a-dir.state").is_dir());

    lease.release().await.expect("release");
    assert_eq!(backend.held("").await.expect("held"), Vec::new());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn held_in_a_directory_that_cannot_be_read_is_an_error() {
    let dir = fresh_dir();
    let backend: Arc<dyn Backend> = Arc::new(FileBackend::open(&dir).expect("dir"));
    std::fs::remove_dir_all(&dir).expect("remove the lock directory");
    let listed = backend.held("").await;
    let Err(err @ LockError::Backend { .. }) = listed else {
        panic!("an unreadable directory is no empty list: {listed:?}");
    };
    assert!(
        matches!(
            err,
            LockError::Backend {
                operation: Operation::List,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains(path(&dir)), "{err}");
}

//! The stores of one host: the memory backend (its clones are the
//! processes: one store, and no operator can reach it) and the file
//! backend (instances on one directory, whose files an operator removes).

use std::sync::Arc;

use async_trait::async_trait;
use dlock::Backend;
use dlock::file::FileBackend;
use dlock::memory::MemoryBackend;

use crate::ops::{Abilities, Op, Part};
use crate::run::{Run, Store};
use crate::support::ScratchDir;

/// Three clones of one `MemoryBackend`.
pub struct Memory {
    backends: Vec<Arc<dyn Backend>>,
}

impl Memory {
    pub fn open() -> Self {
        let backend = MemoryBackend::new();
        Self {
            backends: (0..3)
                .map(|_| Arc::new(backend.clone()) as Arc<dyn Backend>)
                .collect(),
        }
    }
}

#[async_trait]
impl Store for Memory {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn abilities(&self) -> Abilities {
        Abilities::every_mode()
    }

    fn backends(&self) -> Vec<Arc<dyn Backend>> {
        self.backends.clone()
    }

    async fn fault(&self, op: &Op, _run: &mut Run) -> Result<(), String> {
        Err(format!("the memory store has no fault {op:?}"))
    }
}

/// Three `FileBackend`s on one directory, as three processes of a host.
pub struct Files {
    dir: ScratchDir,
    backends: Vec<Arc<dyn Backend>>,
}

impl Files {
    pub fn open() -> Self {
        let dir = ScratchDir::new("model-file");
        let backends = (0..3)
            .map(|_| {
                Arc::new(FileBackend::open(&*dir).expect("a lock directory")) as Arc<dyn Backend>
            })
            .collect();
        Self { dir, backends }
    }

    /// The files of `run`'s key `k` whose names end with `suffix`.
    fn files_of(&self, run: &Run, k: usize, suffix: &str) -> Vec<std::path::PathBuf> {
        let name = encode(run.keys[k].as_str());
        let Ok(entries) = std::fs::read_dir(&*self.dir) else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .filter(|path| {
                path.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{name}.")) && n.ends_with(suffix))
            })
            .collect()
    }
}

/// The file backend's name of a key: every byte outside `[A-Za-z0-9_-]`
/// percent-encoded (the run's keys are short).
fn encode(key: &str) -> String {
    key.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[async_trait]
impl Store for Files {
    fn name(&self) -> &'static str {
        "file"
    }

    fn abilities(&self) -> Abilities {
        Abilities {
            deletes: vec![Part::Lock, Part::Info],
            ..Abilities::every_mode()
        }
    }

    fn backends(&self) -> Vec<Arc<dyn Backend>> {
        self.backends.clone()
    }

    /// A temp-dir cleaner removes a key's files: its `.lock` file (only
    /// ever locked for a step), or (`Part::Info`) its holders' `.alive`
    /// files, which prove nothing missing: the key stays held. (A queued
    /// waiter's file is left: one missing makes a release skip the waiter,
    /// as one that stopped listening, which the model does not follow.)
    async fn fault(&self, op: &Op, run: &mut Run) -> Result<(), String> {
        let Op::Delete { k, part } = *op else {
            return Err(format!("the file store has no fault {op:?}"));
        };
        let suffix = if part == Part::Lock {
            ".lock"
        } else {
            ".alive"
        };
        // Not a queued waiter's alive file: a release skips a waiter whose
        // file it cannot find, as one that stopped listening.
        let waiters: Vec<String> = run.model.keys[k]
            .queue
            .iter()
            .map(|o| run.owner_id(*o).to_string())
            .collect();
        for path in self.files_of(run, k, suffix) {
            let name = path.to_string_lossy();
            if !waiters.iter().any(|w| name.contains(w.as_str())) {
                let _ = std::fs::remove_file(&path);
            }
        }
        Ok(())
    }
}

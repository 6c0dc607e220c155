//! `EtcdBackend`, one file per aspect: the conformance suite on a shared
//! three-member cluster this binary starts once, and what the backend
//! promises beyond it (`lock`); faults on clusters of a test's own
//! (`cluster`); members of a test's own against credentials and operators
//! (`server`). `solo` starts such single members.
//!
//! Every member runs on free loopback ports and is killed with its test
//! (or, the shared cluster, with the binary).

#[path = "../etcd_support/mod.rs"]
mod etcd_support;
#[path = "../support/mod.rs"]
mod support;

mod cluster;
mod lock;
mod server;
mod solo;

/// A key of its own for a test (random, under `etcd-test/`).
fn fresh_key(label: &str) -> dlock::LockKey {
    dlock::LockKey::new(format!("etcd-test/{label}/{}", etcd_support::random_word()))
        .expect("a key")
}

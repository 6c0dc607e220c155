//! `MemoryBackend`: the conformance suite and what only an in-process
//! backend can show (`lock`).

#[path = "../support/mod.rs"]
mod support;

mod lock;

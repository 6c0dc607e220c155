//! `FileBackend`, one file per aspect: the conformance suite and what the
//! backend promises across real OS processes on one host (`lock`), fair
//! mode's queue across processes (`fair`), who holds a lock as other
//! processes read it (`holder`) and shared locks whose holder stops or
//! whose files go missing (`modes`).
//!
//! Tests that spawn child processes re-run this binary with the
//! `child_process_entry` of their own module (`support::child_command`).

#[path = "../support/mod.rs"]
mod support;

mod fair;
mod holder;
mod lock;
mod modes;

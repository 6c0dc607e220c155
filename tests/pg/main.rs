//! `PgBackend`, one file per aspect, against the shared PostgreSQL
//! (127.0.0.1:5432, or `DLOCK_PG_URL`) and servers some tests start for
//! themselves: the conformance suite and what advisory locks on owned
//! sessions show (`lock`), fair mode on the server's own lock queue
//! (`fair`), shared locks and permits against operators and callers
//! (`modes`) and a DBA's trigger failing their commit (`mode_triggers`),
//! who holds a key (`holder`), how plain leases name it
//! (`names`) and what that promises against collisions, full lock tables
//! and DBAs (`names_faults`) and beside marked leases of one session
//! (`names_marks`, with `marks`, what both share), bad input and servers of a test's own
//! (`server`), fencing tokens when the token sequence is tampered with
//! (`tokens`), changed by a DBA under running statements (`dba_sequence`), or made unlogged by a DBA (`unlogged`), drawn under the
//! draw lock by roles with some of the sequence's privileges
//! (`draw_roles`) or beside a writer caught between its two calls
//! (`draw_race`), and older replicas
//! beside new ones in a rolling upgrade (`upgrade`).
//!
//! Tests that spawn child processes re-run this binary with the
//! `child_process_entry` of their own module (`support::child_command`).

#[path = "../pg_support/mod.rs"]
mod pg_support;
#[path = "../support/mod.rs"]
mod support;

mod dba_sequence;
mod draw_race;
mod draw_roles;
mod fair;
mod holder;
mod lock;
mod marks;
mod mode_triggers;
mod modes;
mod names;
mod names_faults;
mod names_marks;
mod quick_draw;
mod quick_turn;
mod server;
mod token_lead;
mod token_lead_faults;
mod tokens;
mod unlogged;
mod upgrade;

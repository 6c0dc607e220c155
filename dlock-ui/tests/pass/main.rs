//! What `#[distributed_lock]` must accept: each case here is a module of
//! its own, under `#![deny(warnings)]`, and its test runs what the macro
//! made. The misuses it must refuse, each with its spanned error, are the
//! trybuild cases of `tests/ui.rs`.
//!
//! The cases are plain tests rather than trybuild's `pass` cases: trybuild
//! builds and links each of those as a crate of its own, which was most of
//! the time trybuild took, while here they compile once, with the rest of
//! the workspace's tests. The clippy matrix of `scripts/test` builds them
//! against dlock without its default features, as a user's crate would.

use std::future::Future;
use std::sync::{Mutex, MutexGuard, PoisonError};

mod all_options;
mod async_trait_default_method;
mod async_trait_impl_method;
mod async_trait_placeholder_names_pattern_binding;
mod attributes_and_docs_kept;
mod crate_path_reexport;
mod custom_error_with_question_mark;
mod free_fn;
mod future_is_send;
mod generics_where_clause;
mod impl_trait_args;
mod impl_trait_in_return;
mod keys_with_fencing_tokens;
mod lost_signal_param;
mod methods_with_self;
mod mut_and_key_only_params;
mod nested_field_placeholders;
mod no_token_param;
mod pattern_args;
mod permits;
mod placeholder_names_pattern_binding;
mod shared_mode;
mod token_param_removed;
mod trait_impl_method;
mod tuple_index_placeholder;
mod type_alias_return;

/// Taken by each case for its whole run: the cases register their
/// backends in the one process-wide registry, most of them as "default",
/// so they run one after another.
fn alone() -> MutexGuard<'static, ()> {
    static ALONE: Mutex<()> = Mutex::new(());
    ALONE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs a case's body alone (see [`alone`]) on a current-thread runtime,
/// with a fresh memory backend registered as "default".
fn run(body: impl Future<Output = ()>) {
    let _alone = alone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    rt.block_on(async {
        dlock::registry().register("default", dlock::memory::MemoryBackend::new());
        body.await
    });
}

//! Nothing to use: this package holds the compile-time tests of
//! `#[distributed_lock]` (`tests/ui.rs`, with trybuild), apart from the
//! `dlock` package so that they build only what their cases need.

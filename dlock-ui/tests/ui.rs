//! Compile-time behaviour of `#[distributed_lock]`: what must be rejected,
//! with the message in the `.stderr` next to each case. What must compile
//! and run is `tests/pass/`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/fail/*.rs");
}

//! The error collector: checks that do not depend on each other each report
//! what they find, and the user sees every mistake at once (one message a
//! mistake, each spanned on its own token) instead of fixing them one
//! compile at a time.

use proc_macro2::Span;
use syn::Error;

/// Errors gathered from independent checks, reported together.
#[derive(Default)]
pub struct Errors(Option<Error>);

impl Errors {
    pub fn push(&mut self, err: Error) {
        match &mut self.0 {
            Some(first) => first.combine(err),
            None => self.0 = Some(err),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }

    /// The gathered errors, for a caller that found it cannot go on; if
    /// nothing was reported, that is a bug here, and it says so.
    pub fn into_error(self) -> Error {
        self.0.unwrap_or_else(|| {
            Error::new(
                Span::call_site(),
                "`#[distributed_lock]` could not expand this function (a bug in dlock-macros: please report it)",
            )
        })
    }
}

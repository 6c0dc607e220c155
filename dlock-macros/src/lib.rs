//! The `#[distributed_lock]` attribute of dlock.
use proc_macro::TokenStream;

/// Placeholder until the macro lands.
#[proc_macro_attribute]
pub fn distributed_lock(_args: TokenStream, item: TokenStream) -> TokenStream {
    item
}

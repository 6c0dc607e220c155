//! The `#[distributed_lock]` attribute of [dlock](https://docs.rs/dlock).
//!
//! Use it through the `dlock` crate (`dlock::distributed_lock`); this crate
//! only parses, checks and generates code. Everything that runs lives in
//! `dlock-runtime`, reached through `dlock::__private`.
//!
//! One concern a file; each uses only those listed before it:
//!
//! - `errors.rs`: the collector that reports independent mistakes together.
//! - `args.rs`: parses the attribute's `name = value` options (syntax only).
//! - `async_trait.rs`: recognises a method `#[async_trait]` already rewrote.
//! - `params.rs`: the function's parameters: the ones the lock provides and
//!   the names key placeholders may read (parameters, and bindings inside
//!   parameter patterns).
//! - `template.rs`: the key-template language, resolved against `params`.
//! - `valid.rs`: checks the options against the function, into a `Lock`.
//! - `expand.rs`: writes the locked function (or the item plus its errors).

use proc_macro::TokenStream;

mod args;
mod async_trait;
mod errors;
mod expand;
mod params;
mod template;
mod valid;

/// Runs an `async fn` under a distributed lock: at most one caller at a time,
/// across every process sharing the backend, runs the body for a given key.
///
/// ```ignore
/// use dlock::{distributed_lock, FencingToken};
///
/// #[distributed_lock(key = "export:{tenant}", ttl = "30s", backend = "pg")]
/// async fn export(tenant: u64, token: FencingToken) -> Result<Report, AppError> {
///     // runs on at most one replica at a time for this tenant;
///     // `token` goes with every write to the protected resource
/// }
///
/// // callers do not pass the token:
/// let report = export(42).await?;
/// ```
///
/// (The example is not compiled here, in the macro crate; the `dlock` crate's
/// documentation has the same example as a running doctest.)
///
/// # Options
///
/// | option | default | meaning |
/// |---|---|---|
/// | `key = "..."` | required (or `keys`) | The lock key template: literal text and `{param}` placeholders (see below). |
/// | `keys = ["...", ...]` | — | Several keys locked together, in one global order (no deadlock between callers naming them in different orders). Instead of `key`. |
/// | `ttl = "30s"` | required | How long a lease lives unless renewed (humantime syntax, checked at compile time; 10ms to 30 days). |
/// | `wait = "5s"` | no wait | How long to wait for a held key. Without it the call fails at once with `LockError::Held`; after waiting, with `LockError::Timeout`. |
/// | `renew = true` | `true` | Whether the lease is renewed in the background while the body runs (every third of the ttl). Off, the lease is lost when the ttl runs out. |
/// | `fair = true` | `false` | Fair mode: waiters queue in arrival order and a release hands the key straight to the first (`LockOptions::fair`). Needs a `wait`. |
/// | `min_hold = "10s"` | none | Keep the key held at least this long after acquisition, even if the body ends sooner (ShedLock's `lockAtLeastFor`). At most the ttl. |
/// | `backend = "pg"` | `"default"` | The name the backend was registered under in `dlock::registry()`. |
/// | `on_lost = "abort"` | `"abort"` | What happens when the lease is lost while the body runs: `"abort"` cancels the body and returns `LockError::LeaseLost`; `"finish"` lets it finish and returns its result. |
/// | `crate = "path"` | `::dlock` | Where generated code finds dlock, for crates that re-export it. |
///
/// # Key templates
///
/// Every `{...}` names a parameter of the function (or `self` in a method)
/// or a binding inside a parameter's pattern, optionally followed by field
/// or tuple-index accesses: `{tenant}`, `{req.user.id}`, `{pair.0}`,
/// `{self.id}`; with `Path(id): Path<u64>` and `Json(body): Json<Order>`,
/// `{id}` and `{body.customer}`. Values are formatted with `Display` and
/// escaped, so `a:{x}:{y}` cannot give the same key for different `(x, y)`.
/// Two placeholders need a separator such as `:` between them. Literal text
/// is ASCII letters, digits and punctuation other than `{ } " ' \ %` and
/// backtick.
///
/// Bindings inside patterns (tuples, tuple structs, structs, nested, `ref`,
/// `mut`, `name @ ...`) are read as the function's own destructuring bound
/// them, before the body runs: the key borrows them, and the body then gets
/// them as it would without the attribute (a non-`Copy` binding is still
/// moved into it). `_` and `..` bind nothing a key could name.
///
/// # The function
///
/// - It must be an `async fn` returning `Result<T, E>` (or an alias of it)
///   with `E: From<dlock::LockError>`: a lock that cannot be had is an `Err`.
/// - A parameter of type `FencingToken` is removed from the signature and
///   bound to the lease's token inside the body (only a parameter whose
///   whole type is `FencingToken`: one inside another type, such as
///   `Extension(token): Extension<FencingToken>`, is the caller's, an
///   extractor's, and a key may name it like any value); with `keys`, take
///   `FencingTokens` instead (one token per key, in the order written). A
///   `LostSignal` parameter (single key) is bound to the lease's lost signal.
///   Callers pass neither.
/// - Attributes, visibility, generics, where-clauses and receivers are kept
///   as written; only the body is replaced. Free functions, inherent and
///   trait-impl methods, generics, `impl Trait` arguments and pattern
///   arguments all work.
/// - With `#[async_trait]`, put it on the method, inside the `#[async_trait]`
///   impl (or on a default method inside the `#[async_trait]` trait), not on
///   the block: async-trait expands the block first, and the lock is then
///   taken inside the future it boxes, exactly as for an `async fn`.
/// - The key is built before the body runs; the lock is released when the
///   body ends, also on early return, `?`, panic or cancellation.
#[proc_macro_attribute]
pub fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::distributed_lock(args.into(), item.into()).into()
}

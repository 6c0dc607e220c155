//! Checks: the function's shape, the key templates, the durations, and how
//! the options fit together. Everything here turns parsed input into a
//! [`Lock`] the expansion can trust, or into errors spanned on what the user
//! must change. The key-template language (`template.rs`), the parameters
//! (`params.rs`) and the error collector (`errors.rs`) have files of their
//! own; this file decides what to check and in which order.

use std::time::Duration;

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote};
use syn::{Error, Ident, Item, ItemFn, LitStr, ReturnType, Signature, TraitItemFn, Type};

use crate::args::{Args, Opt};
use crate::async_trait::{self, Boxed};
use crate::errors::Errors;
use crate::params::{Binding, Params};
use crate::template::{self, Template};

/// The shortest ttl: below it renewal could not keep a lease alive.
const MIN_TTL: Duration = Duration::from_millis(10);
/// The longest ttl, wait or minimum hold (30 days, as the runtime's
/// `MAX_DURATION`): longer values are almost certainly unit mistakes.
const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// A checked `#[distributed_lock]`: everything the expansion needs.
pub struct Lock {
    /// The path of the `dlock` crate (`::dlock` unless `crate = "..."`).
    pub krate: syn::Path,
    /// One template for `key`, one per entry for `keys`.
    pub keys: Vec<Template>,
    /// Whether `keys = [...]` was used (a lease set, even with one entry).
    pub many: bool,
    pub ttl: Duration,
    pub wait: Option<Duration>,
    pub renew: Option<bool>,
    pub fair: bool,
    /// `mode = "shared"`.
    pub shared: bool,
    /// `permits = n`.
    pub permits: Option<u32>,
    pub min_hold: Option<Duration>,
    pub backend: Option<LitStr>,
    pub on_lost: OnLost,
    /// Parameters removed from the signature and bound inside the body.
    pub bindings: Vec<Binding>,
    /// The declared return type.
    pub ret: Box<Type>,
}

#[derive(Clone, Copy)]
pub enum OnLost {
    Abort,
    Finish,
}

/// The annotated function.
pub struct Function {
    pub item: ItemFn,
    /// Set when async-trait has already turned the `async fn` into a `fn`
    /// returning a boxed future: the lock is taken inside that future.
    pub boxed: Option<Boxed>,
}

/// Parses the annotated item, which must be a function with a body.
pub fn function(item: TokenStream) -> syn::Result<Function> {
    let fn_error = match syn::parse2::<ItemFn>(item.clone()) {
        Ok(func) => {
            let (item, boxed) = async_trait::split(func);
            return Ok(Function { item, boxed });
        }
        Err(err) => err,
    };
    if let Ok(decl) = syn::parse2::<TraitItemFn>(item.clone()) {
        if decl.default.is_none() {
            let msg = "`#[distributed_lock]` needs a function body: put it on the `async fn` in the `impl` block, not on the trait's declaration";
            // async-trait's return type carries the span of `#[async_trait]`,
            // so the span stops before it, at what the user wrote.
            return Err(if async_trait::is_boxed_future(&decl.sig.output) {
                Error::new_spanned(sig_head(&decl.sig), msg)
            } else {
                Error::new_spanned(&decl.sig, msg)
            });
        }
        return Err(fn_error);
    }
    match syn::parse2::<Item>(item) {
        Ok(other) => Err(not_a_function(&other)),
        Err(_) => Err(fn_error),
    }
}

fn not_a_function(item: &Item) -> Error {
    // Spanned on the keyword and name: the part a reader recognises.
    let (what, tokens) = match item {
        Item::Const(i) => ("a const", head(&i.const_token, &i.ident)),
        Item::Static(i) => ("a static", head(&i.static_token, &i.ident)),
        Item::Struct(i) => ("a struct", head(&i.struct_token, &i.ident)),
        Item::Enum(i) => ("an enum", head(&i.enum_token, &i.ident)),
        Item::Union(i) => ("a union", head(&i.union_token, &i.ident)),
        Item::Trait(i) => {
            return Error::new_spanned(
                head(&i.trait_token, &i.ident),
                "`#[distributed_lock]` goes on an `async fn`, not on a trait: put it on each method to lock, a default method in the trait or the method in each impl (also under `#[async_trait]`)",
            );
        }
        Item::Impl(i) => {
            let (generics, _, _) = i.generics.split_for_impl();
            let (bang, path, for_token) = match &i.trait_ {
                Some((bang, path, for_token)) => (bang, Some(path), Some(for_token)),
                None => (&None, None, None),
            };
            let (impl_token, self_ty) = (&i.impl_token, &i.self_ty);
            // Spanned on the head (`impl Job for Nightly`), as for other items.
            return Error::new_spanned(
                quote!(#impl_token #generics #bang #path #for_token #self_ty),
                "`#[distributed_lock]` goes on an `async fn`, not on an impl block: put it on each method to lock, inside the block (also under `#[async_trait]`)",
            );
        }
        Item::Type(i) => ("a type alias", head(&i.type_token, &i.ident)),
        Item::Mod(i) => ("a module", head(&i.mod_token, &i.ident)),
        Item::Use(i) => ("a use declaration", i.use_token.to_token_stream()),
        other => ("this item", other.to_token_stream()),
    };
    Error::new_spanned(
        tokens,
        format!(
            "`#[distributed_lock]` goes on an `async fn`, not on {what}: it locks each call of the function"
        ),
    )
}

fn head(keyword: &impl ToTokens, name: &Ident) -> TokenStream {
    quote!(#keyword #name)
}

/// Checks the arguments against the function; `args` is `Err` when they did
/// not even parse, in which case the function's shape is still checked.
pub fn check(args: syn::Result<Args>, func: &Function) -> syn::Result<Lock> {
    let mut errors = Errors::default();
    let args = args.map_err(|err| errors.push(err)).ok();
    let many = args.as_ref().map(|args| args.keys.is_some());

    let sig = &func.item.sig;
    let ret = check_shape(func, &mut errors);
    let moved = func
        .boxed
        .as_ref()
        .map(|boxed| async_trait::moved_patterns(&boxed.future))
        .unwrap_or_default();
    let params = Params::new(sig, &moved, many, &mut errors);

    let Some(args) = args else {
        return Err(errors.into_error());
    };

    let keys = check_keys(&args, &params, &mut errors);
    let ttl = match &args.ttl {
        Some(ttl) => check_ttl(&ttl.value, &mut errors),
        None => {
            errors.push(Error::new(
                Span::call_site(),
                "missing `ttl`: add how long a lease lives unless renewed, e.g. `ttl = \"30s\"`",
            ));
            None
        }
    };
    let wait = args.wait.as_ref().map(|wait| {
        let wait = duration(&wait.value, "wait", &mut errors)?;
        not_absurd(wait, &args.wait, "wait", &mut errors)
    });
    let min_hold = args
        .min_hold
        .as_ref()
        .map(|min_hold| check_min_hold(&min_hold.value, ttl, &mut errors));
    let backend = args.backend.as_ref().map(|backend| {
        check_backend(&backend.value, &mut errors);
        backend.value.clone()
    });
    let fair = args.fair.as_ref().is_some_and(|fair| fair.value.value);
    if let Some(fair_opt) = args.fair.as_ref().filter(|_| fair)
        && wait
            .as_ref()
            .is_none_or(|wait| wait.is_some_and(|wait| wait.is_zero()))
    {
        errors.push(Error::new(
            fair_opt.name,
            "`fair = true` needs a `wait`: a caller that does not wait never queues, so fairness would do nothing; add e.g. `wait = \"10s\"`",
        ));
    }
    let (shared, permits) = check_access(&args, &mut errors);
    if let Some(fair_opt) = args.fair.as_ref().filter(|_| fair)
        && (shared || permits.is_some())
    {
        errors.push(Error::new(
            fair_opt.name,
            "`fair = true` queues exclusive waiters only: not with `mode = \"shared\"` nor `permits`",
        ));
    }
    let on_lost = check_on_lost(&args, &mut errors);
    let krate = check_crate(&args, &mut errors);

    match (keys, ttl, ret, on_lost, krate) {
        (Some(keys), Some(ttl), Some(ret), Some(on_lost), Some(krate)) if errors.is_empty() => {
            Ok(Lock {
                krate,
                keys,
                many: args.keys.is_some(),
                ttl,
                wait: wait.flatten(),
                renew: args.renew.as_ref().map(|renew| renew.value.value),
                fair,
                shared,
                permits,
                min_hold: min_hold.flatten(),
                backend,
                on_lost,
                bindings: params.bindings,
                ret,
            })
        }
        _ => Err(errors.into_error()),
    }
}

/// The function's shape: an `async fn` (or one async-trait boxed), and the
/// type it returns, which it must declare.
fn check_shape(func: &Function, errors: &mut Errors) -> Option<Box<Type>> {
    let sig = &func.item.sig;
    if sig.asyncness.is_none() && func.boxed.is_none() {
        errors.push(Error::new_spanned(
            sig.fn_token,
            "`#[distributed_lock]` requires an `async fn`: add `async` (taking the lock awaits the backend)",
        ));
    }
    match (&func.boxed, &sig.output) {
        // What the `async fn` returned before async-trait boxed it.
        (Some(boxed), _) => Some(boxed.output.clone()),
        (None, ReturnType::Type(_, ty)) => Some(ty.clone()),
        (None, ReturnType::Default) => {
            errors.push(Error::new_spanned(
                sig_head(sig),
                "a `#[distributed_lock]` function must return `Result<T, E>` with `E: From<dlock::LockError>`: a lock that cannot be had is returned as an `Err`",
            ));
            None
        }
    }
}

/// `on_lost`: what the expansion does when the lease is lost under the
/// body (`abort` unless given).
fn check_on_lost(args: &Args, errors: &mut Errors) -> Option<OnLost> {
    match &args.on_lost {
        None => Some(OnLost::Abort),
        Some(on_lost) => match on_lost.value.value().as_str() {
            "abort" => Some(OnLost::Abort),
            "finish" => Some(OnLost::Finish),
            _ => {
                errors.push(Error::new(
                    on_lost.value.span(),
                    "`on_lost` must be \"abort\" (cancel the body and return the `LeaseLost` error, the default) or \"finish\" (let the body finish and return its result)",
                ));
                None
            }
        },
    }
}

/// `crate`: the path generated code reaches dlock under (`::dlock` unless
/// given).
fn check_crate(args: &Args, errors: &mut Errors) -> Option<syn::Path> {
    match &args.krate {
        None => Some(syn::parse_quote!(::dlock)),
        Some(krate) => match krate.value.parse::<syn::Path>() {
            Ok(path) => Some(path),
            Err(_) => {
                errors.push(Error::new(
                    krate.value.span(),
                    format!(
                        "bad `crate` path {:?}: expected the path dlock is reachable under, like \"my_reexport::dlock\"",
                        krate.value.value()
                    ),
                ));
                None
            }
        },
    }
}

/// `mode` and `permits`: whether the lock is shared, and how many permits.
/// A valid `mode = "exclusive"` is the default and changes nothing.
fn check_access(args: &Args, errors: &mut Errors) -> (bool, Option<u32>) {
    let shared = match &args.mode {
        None => false,
        Some(mode) => match mode.value.value().as_str() {
            "exclusive" => false,
            "shared" => true,
            other => {
                errors.push(Error::new(
                    mode.value.span(),
                    format!(
                        "unknown mode {other:?}: the modes are \"exclusive\" (alone, the default: the write side of a read-write lock) and \"shared\" (beside other shared holders: the read side); for at most N holders write `permits = N`"
                    ),
                ));
                false
            }
        },
    };
    let permits = args.permits.as_ref().and_then(|permits| {
        match permits.value.base10_parse::<u32>() {
            Ok(0) => {
                errors.push(Error::new(
                    permits.value.span(),
                    "`permits = 0` lets nobody hold the key: give at least 1 (`permits = 1` is an exclusive lock with a slot)",
                ));
                None
            }
            Ok(n) => Some(n),
            Err(_) => {
                errors.push(Error::new(
                    permits.value.span(),
                    format!("`permits` must be a whole number from 1 to {}", u32::MAX),
                ));
                None
            }
        }
    });
    if let (Some(permits_opt), Some(mode)) = (&args.permits, &args.mode)
        && shared
    {
        let mut err = Error::new(
            permits_opt.name,
            "`permits` cannot be shared: a permit is a numbered slot, not a side of a read-write lock; drop `mode = \"shared\"` for at most N holders, or `permits` for a read lock",
        );
        err.combine(Error::new(mode.name, "`mode = \"shared\"` is set here"));
        errors.push(err);
    }
    if args.keys.is_some() {
        for (name, what) in [
            (
                args.mode.as_ref().filter(|_| shared).map(|m| m.name),
                "`mode = \"shared\"`",
            ),
            (args.permits.as_ref().map(|p| p.name), "`permits`"),
        ] {
            if let Some(name) = name {
                errors.push(Error::new(
                    name,
                    format!(
                        "{what} takes one `key`: with `keys = [...]` every key is locked exclusively (a `FencingTokens` holds one writer's token per key)"
                    ),
                ));
            }
        }
    }
    (shared, permits)
}

/// `async fn name(...)`: where a missing return type goes.
fn sig_head(sig: &Signature) -> TokenStream {
    let Signature {
        constness,
        asyncness,
        unsafety,
        abi,
        fn_token,
        ident,
        generics,
        paren_token,
        inputs,
        ..
    } = sig;
    let mut head = quote!(#constness #asyncness #unsafety #abi #fn_token #ident #generics);
    paren_token.surround(&mut head, |tokens| inputs.to_tokens(tokens));
    head
}

fn check_keys(args: &Args, params: &Params, errors: &mut Errors) -> Option<Vec<Template>> {
    let literals: Vec<&LitStr> = match (&args.key, &args.keys) {
        (Some(_), Some(keys)) => {
            errors.push(Error::new(
                keys.name,
                "`key` and `keys` cannot be used together: write one key as `key = \"...\"`, several as `keys = [\"...\", \"...\"]`",
            ));
            return None;
        }
        (Some(key), None) => vec![&key.value],
        (None, Some(keys)) => {
            if keys.value.templates.is_empty() {
                errors.push(Error::new_spanned(
                    &keys.value.list,
                    "`keys` needs at least one key template, e.g. `keys = [\"account:{from}\", \"account:{to}\"]`",
                ));
                return None;
            }
            keys.value.templates.iter().collect()
        }
        (None, None) => {
            errors.push(Error::new(
                Span::call_site(),
                "missing `key`: name what is locked, e.g. `key = \"export:{tenant}\"` (or several with `keys = [...]`)",
            ));
            return None;
        }
    };
    let mut templates = Vec::with_capacity(literals.len());
    let mut failed = false;
    for literal in literals {
        match template::parse(literal, params) {
            Ok(template) => templates.push(template),
            Err(err) => {
                failed = true;
                errors.push(err);
            }
        }
    }
    (!failed).then_some(templates)
}

/// Parses a duration string with humantime.
fn duration(literal: &LitStr, option: &str, errors: &mut Errors) -> Option<Duration> {
    let text = literal.value();
    match humantime::parse_duration(&text) {
        Ok(duration) => Some(duration),
        Err(err) => {
            errors.push(Error::new(
                literal.span(),
                format!(
                    "`{option}`: {text:?} is not a duration ({err}); write it like \"30s\", \"500ms\" or \"1h 30m\""
                ),
            ));
            None
        }
    }
}

fn not_absurd(
    value: Duration,
    option: &Option<Opt<LitStr>>,
    name: &str,
    errors: &mut Errors,
) -> Option<Duration> {
    if value <= MAX_DURATION {
        return Some(value);
    }
    if let Some(option) = option {
        errors.push(Error::new(
            option.value.span(),
            format!(
                "`{name} = {:?}` is absurd: the maximum is 30 days (a unit mistake?)",
                option.value.value()
            ),
        ));
    }
    None
}

fn check_ttl(literal: &LitStr, errors: &mut Errors) -> Option<Duration> {
    let ttl = duration(literal, "ttl", errors)?;
    let problem = if ttl.is_zero() {
        "`ttl` must be greater than zero: it is how long a lease lives unless renewed".to_owned()
    } else if ttl < MIN_TTL {
        format!(
            "`ttl = {:?}` is below the 10ms minimum: the lease would run out before it could be renewed",
            literal.value()
        )
    } else if ttl > MAX_DURATION {
        format!(
            "`ttl = {:?}` is absurd: the maximum is 30 days (a unit mistake?)",
            literal.value()
        )
    } else {
        return Some(ttl);
    };
    errors.push(Error::new(literal.span(), problem));
    None
}

/// `None` inside when invalid (already reported).
fn check_min_hold(
    literal: &LitStr,
    ttl: Option<Duration>,
    errors: &mut Errors,
) -> Option<Duration> {
    let min_hold = duration(literal, "min_hold", errors)?;
    let problem = if min_hold.is_zero() {
        "`min_hold = \"0s\"` keeps the key no longer than the body runs, which is what happens without it: remove it instead".to_owned()
    } else if min_hold > MAX_DURATION {
        format!(
            "`min_hold = {:?}` is absurd: the maximum is 30 days (a unit mistake?)",
            literal.value()
        )
    } else if let Some(ttl) = ttl.filter(|ttl| min_hold > *ttl) {
        format!(
            "`min_hold` ({}) is longer than `ttl` ({}): a lease cannot be kept past its ttl",
            humantime::format_duration(min_hold),
            humantime::format_duration(ttl)
        )
    } else {
        return Some(min_hold);
    };
    errors.push(Error::new(literal.span(), problem));
    None
}

fn check_backend(literal: &LitStr, errors: &mut Errors) {
    let name = literal.value();
    let problem = if name.is_empty() {
        "`backend` must not be empty: omit it to use the backend registered as \"default\""
            .to_owned()
    } else if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':')))
    {
        format!(
            "bad character {c:?} in backend name {name:?}: use ASCII letters, digits, `-`, `_`, `.` and `:`"
        )
    } else {
        return;
    };
    errors.push(Error::new(literal.span(), problem));
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use dlock_runtime::LockOptions;

    use super::{MAX_DURATION, MIN_TTL};

    /// What the macro lets through must run, and what it refuses must be
    /// refused by the runtime too: the limits are copies of the runtime's.
    #[test]
    fn duration_limits_match_the_runtime() {
        let accepted = |ttl: Duration| LockOptions::new(ttl).validate().is_ok();
        assert_eq!(MAX_DURATION, dlock_runtime::MAX_DURATION);
        assert!(accepted(MIN_TTL) && accepted(MAX_DURATION));
        assert!(!accepted(MIN_TTL - Duration::from_nanos(1)));
        assert!(!accepted(MAX_DURATION + Duration::from_nanos(1)));
    }
}

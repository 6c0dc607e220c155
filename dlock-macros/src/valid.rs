//! Checks: the function's shape, the key templates, the durations, and how
//! the options fit together. Everything here turns parsed input into a
//! [`Lock`] the expansion can trust, or into errors spanned on what the user
//! must change.

use std::time::Duration;

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::{
    Error, FnArg, Ident, Index, Item, ItemFn, LitStr, Member, Pat, PatType, ReturnType, Signature,
    TraitItemFn, Type,
};

use crate::args::{Args, Opt};
use crate::async_trait::{self, Boxed};

/// The shortest ttl: below it renewal could not keep a lease alive.
const MIN_TTL: Duration = Duration::from_millis(10);
/// The longest ttl, wait or minimum hold (30 days, as the runtime's
/// `MAX_DURATION`): longer values are almost certainly unit mistakes.
const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 60 * 60);
/// The longest key the runtime accepts, in bytes (the runtime's `MAX_KEY_LEN`).
const MAX_KEY_LEN: usize = 1024;

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

    pub fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }

    fn into_error(self) -> Error {
        self.0.unwrap_or_else(|| {
            Error::new(
                Span::call_site(),
                "`#[distributed_lock]` could not expand this function (a bug in dlock-macros: please report it)",
            )
        })
    }
}

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

/// A parameter the lock provides rather than the caller.
pub struct Binding {
    /// Its position among the signature's inputs.
    pub index: usize,
    pub attrs: Vec<syn::Attribute>,
    pub kind: Special,
    pub pat: Box<Pat>,
    pub ty: Box<Type>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Special {
    /// `FencingToken`: the lease's token.
    Token,
    /// `FencingTokens`: one token per key of a lease set.
    Tokens,
    /// `LostSignal`: the lease's lost signal.
    LostSignal,
}

impl Special {
    fn of(ty: &Type) -> Option<Special> {
        match ty {
            Type::Path(path) if path.qself.is_none() => {
                match path.path.segments.last()?.ident.to_string().as_str() {
                    "FencingToken" => Some(Special::Token),
                    "FencingTokens" => Some(Special::Tokens),
                    "LostSignal" => Some(Special::LostSignal),
                    _ => None,
                }
            }
            Type::Group(group) => Special::of(&group.elem),
            Type::Paren(paren) => Special::of(&paren.elem),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Special::Token => "FencingToken",
            Special::Tokens => "FencingTokens",
            Special::LostSignal => "LostSignal",
        }
    }
}

/// Removes the parameters the lock provides (by their type, as a successful
/// expansion would) from `sig`, and returns them.
pub fn take_lock_provided(sig: &mut Signature) -> Vec<PatType> {
    let mut provided = Vec::new();
    sig.inputs = std::mem::take(&mut sig.inputs)
        .into_iter()
        .filter_map(|input| match input {
            FnArg::Typed(typed) if Special::of(&typed.ty).is_some() => {
                provided.push(typed);
                None
            }
            other => Some(other),
        })
        .collect();
    provided
}

/// A key template split into literal text and values to interpolate.
pub struct Template {
    pub parts: Vec<Part>,
    /// The parameters (other than `self`) its placeholders read.
    pub params: Vec<String>,
}

pub enum Part {
    Lit(String),
    /// A reference such as `&tenant`, `&req.user.id` or `&self.id`.
    Value(TokenStream),
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
    if sig.asyncness.is_none() && func.boxed.is_none() {
        errors.push(Error::new_spanned(
            sig.fn_token,
            "`#[distributed_lock]` requires an `async fn`: add `async` (taking the lock awaits the backend)",
        ));
    }
    let ret = match (&func.boxed, &sig.output) {
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
    };
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
    let on_lost = match &args.on_lost {
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
    };
    let krate = match &args.krate {
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
    };

    match (keys, ttl, ret, on_lost, krate) {
        (Some(keys), Some(ttl), Some(ret), Some(on_lost), Some(krate)) if errors.0.is_none() => {
            Ok(Lock {
                krate,
                keys,
                many: args.keys.is_some(),
                ttl,
                wait: wait.flatten(),
                renew: args.renew.as_ref().map(|renew| renew.value.value),
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

/// What the parameters offer to key templates, and the lock-provided ones.
struct Params {
    fn_name: Ident,
    receiver: bool,
    /// Parameters bound to a plain identifier: what placeholders may name.
    named: Vec<Ident>,
    /// Names bound inside pattern parameters, with the pattern.
    in_patterns: Vec<(Ident, String)>,
    bindings: Vec<Binding>,
}

impl Params {
    /// `moved`: the patterns async-trait moved out of the signature, by the
    /// name it gave their parameters instead.
    fn new(
        sig: &Signature,
        moved: &[(Ident, Pat)],
        many: Option<bool>,
        errors: &mut Errors,
    ) -> Self {
        let mut params = Params {
            fn_name: sig.ident.clone(),
            receiver: false,
            named: Vec::new(),
            in_patterns: Vec::new(),
            bindings: Vec::new(),
        };
        for (index, input) in sig.inputs.iter().enumerate() {
            let typed = match input {
                FnArg::Receiver(_) => {
                    params.receiver = true;
                    continue;
                }
                FnArg::Typed(typed) => typed,
            };
            if let Some(kind) = Special::of(&typed.ty) {
                params.special(kind, typed, many, errors);
                params.bindings.push(Binding {
                    index,
                    attrs: typed.attrs.clone(),
                    kind,
                    pat: typed.pat.clone(),
                    ty: typed.ty.clone(),
                });
                continue;
            }
            let pat = match &*typed.pat {
                Pat::Ident(ident) => moved
                    .iter()
                    .find(|(name, _)| *name == ident.ident)
                    .map_or(&*typed.pat, |(_, pat)| pat),
                pat => pat,
            };
            match pat {
                Pat::Ident(ident) if ident.subpat.is_none() => {
                    params.named.push(ident.ident.clone());
                }
                pat => {
                    let shown = pat.to_token_stream().to_string();
                    let mut names = Vec::new();
                    bound_names(pat, &mut names);
                    params
                        .in_patterns
                        .extend(names.into_iter().map(|name| (name, shown.clone())));
                }
            }
        }
        params
    }

    /// Checks a lock-provided parameter against the ones before it and
    /// against `key`/`keys`.
    fn special(
        &self,
        kind: Special,
        typed: &syn::PatType,
        many: Option<bool>,
        errors: &mut Errors,
    ) {
        let name = kind.name();
        if self.bindings.iter().any(|b| b.kind == kind) {
            errors.push(Error::new_spanned(
                typed,
                format!("a second `{name}` parameter: the lock provides only one, remove this one"),
            ));
            return;
        }
        let wrong = match (kind, many) {
            (Special::Token, Some(true)) => {
                "with `keys = [...]` there is one token per key: take `tokens: dlock::FencingTokens` instead"
            }
            (Special::Tokens, Some(false)) => {
                "with a single `key` there is one token: take `token: dlock::FencingToken` instead"
            }
            (Special::LostSignal, Some(true)) => {
                "a `LostSignal` parameter needs a single `key`; with `keys = [...]` the body is cancelled when any lease is lost (`on_lost = \"abort\"`)"
            }
            _ => return,
        };
        errors.push(Error::new_spanned(&typed.ty, wrong));
    }

    /// The names a placeholder could use, for error messages.
    fn usable(&self) -> String {
        let mut names: Vec<String> = Vec::new();
        if self.receiver {
            names.push("`self`".to_owned());
        }
        names.extend(self.named.iter().map(|name| format!("`{name}`")));
        names.join(", ")
    }
}

/// Every name a pattern binds.
fn bound_names(pat: &Pat, names: &mut Vec<Ident>) {
    match pat {
        Pat::Ident(ident) => {
            names.push(ident.ident.clone());
            if let Some((_, sub)) = &ident.subpat {
                bound_names(sub, names);
            }
        }
        Pat::Tuple(tuple) => tuple.elems.iter().for_each(|p| bound_names(p, names)),
        Pat::TupleStruct(tuple) => tuple.elems.iter().for_each(|p| bound_names(p, names)),
        Pat::Struct(s) => s.fields.iter().for_each(|f| bound_names(&f.pat, names)),
        Pat::Slice(slice) => slice.elems.iter().for_each(|p| bound_names(p, names)),
        Pat::Or(or) => or.cases.iter().for_each(|p| bound_names(p, names)),
        Pat::Reference(r) => bound_names(&r.pat, names),
        Pat::Paren(p) => bound_names(&p.pat, names),
        Pat::Type(t) => bound_names(&t.pat, names),
        _ => {}
    }
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
        match template(literal, params) {
            Ok(template) => templates.push(template),
            Err(err) => {
                failed = true;
                errors.push(err);
            }
        }
    }
    (!failed).then_some(templates)
}

/// What a key template looks like before its placeholders are resolved.
enum Raw {
    Lit(String),
    Placeholder(Placeholder),
}

/// `{root.member.member}` as written.
struct Placeholder {
    text: String,
    root: String,
    members: Vec<Member>,
}

/// Parses, validates and resolves one key template.
fn template(literal: &LitStr, params: &Params) -> syn::Result<Template> {
    let span = literal.span();
    let raw = split_template(&literal.value()).map_err(|msg| Error::new(span, msg))?;
    let mut errors = Errors::default();
    let mut parts = Vec::with_capacity(raw.len());
    let mut read = Vec::new();
    for part in raw {
        match part {
            Raw::Lit(text) => parts.push(Part::Lit(text)),
            Raw::Placeholder(placeholder) => match resolve(&placeholder, params, span) {
                Ok(value) => {
                    parts.push(Part::Value(value));
                    if placeholder.root != "self" {
                        read.push(placeholder.root);
                    }
                }
                Err(msg) => errors.push(Error::new(span, msg)),
            },
        }
    }
    errors.finish()?;
    Ok(Template {
        parts,
        params: read,
    })
}

/// Whether `c` may appear in a key template's literal text.
fn allowed_in_literal(c: char) -> bool {
    c.is_ascii_graphic() && !matches!(c, '{' | '}' | '"' | '\'' | '\\' | '%' | '`')
}

/// Whether `c` is percent-encoded when it appears in an interpolated value:
/// the runtime's `dlock_runtime::key::is_escaped_in_values`, which this crate
/// cannot depend on. A separator between two placeholders needs one.
fn is_escaped_in_values(c: char) -> bool {
    if c.is_ascii() {
        !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    } else {
        c.is_whitespace() || c.is_control()
    }
}

fn split_template(text: &str) -> Result<Vec<Raw>, String> {
    if text.is_empty() {
        return Err(
            "empty key template: name what is locked, e.g. `key = \"export:{tenant}\"`".to_owned(),
        );
    }
    let mut parts = Vec::new();
    let mut literal = String::new();
    // Positions are 1-based character counts, as a reader counts them.
    let mut chars = text.chars().zip(1..);
    while let Some((c, position)) = chars.next() {
        match c {
            '{' => {
                let mut inner = String::new();
                let mut closed = false;
                for (c, _) in chars.by_ref() {
                    if c == '}' {
                        closed = true;
                        break;
                    }
                    inner.push(c);
                }
                if !closed {
                    return Err(format!(
                        "unclosed `{{` at position {position} of the key template: close the placeholder with `}}`"
                    ));
                }
                if inner.starts_with('{') {
                    return Err(format!(
                        "`{{{{` at position {position} of the key template: `{{{{` is not an escape, and literal braces are not allowed in keys"
                    ));
                }
                if inner.is_empty() {
                    return Err(format!(
                        "empty placeholder `{{}}` at position {position} of the key template: name a parameter, e.g. `{{tenant}}`"
                    ));
                }
                if !literal.is_empty() {
                    parts.push(Raw::Lit(std::mem::take(&mut literal)));
                }
                parts.push(Raw::Placeholder(placeholder(&inner)?));
            }
            '}' => {
                return Err(format!(
                    "unmatched `}}` at position {position} of the key template: `}}` only closes a placeholder, and literal braces are not allowed in keys"
                ));
            }
            c if allowed_in_literal(c) => literal.push(c),
            c => {
                return Err(format!(
                    "bad character {c:?} (U+{:04X}) at position {position} of the key template: literal text may only contain ASCII letters, digits and punctuation other than {{ }} \" ' \\ % `",
                    c as u32
                ));
            }
        }
    }
    if !literal.is_empty() {
        parts.push(Raw::Lit(literal));
    }
    check_separators(&parts)?;
    let literal_len: usize = parts
        .iter()
        .map(|part| match part {
            Raw::Lit(text) => text.len(),
            Raw::Placeholder(_) => 0,
        })
        .sum();
    if literal_len > MAX_KEY_LEN {
        return Err(format!(
            "the key template's literal text alone is {literal_len} bytes; a lock key is at most {MAX_KEY_LEN} bytes"
        ));
    }
    Ok(parts)
}

/// Two placeholders need a separator the runtime escapes in values, or
/// `{a}{b}` would give the same key for ("1", "23") and ("12", "3").
fn check_separators(parts: &[Raw]) -> Result<(), String> {
    let mut previous: Option<&Placeholder> = None;
    let mut between = "";
    for part in parts {
        match part {
            Raw::Lit(text) => {
                if text.chars().any(is_escaped_in_values) {
                    previous = None;
                }
                between = text;
            }
            Raw::Placeholder(placeholder) => {
                if let Some(before) = previous {
                    let mut msg = format!(
                        "placeholders `{{{}}}` and `{{{}}}` need a separator such as ':' between them, or keys for different values could collide",
                        before.text, placeholder.text
                    );
                    if !between.is_empty() {
                        msg.push_str(&format!(
                            " (`{between}` is no separator: letters, digits, `-`, `_` and `.` can appear in values)"
                        ));
                    }
                    return Err(msg);
                }
                previous = Some(placeholder);
                between = "";
            }
        }
    }
    Ok(())
}

/// Parses `root.member.member` (members are identifiers or tuple indices).
fn placeholder(inner: &str) -> Result<Placeholder, String> {
    let malformed = || {
        format!(
            "malformed placeholder `{{{inner}}}`: expected a parameter name, optionally followed by `.field` or `.0` accesses, like `{{req.user.id}}`"
        )
    };
    let mut segments = inner.split('.');
    let root = segments.next().unwrap_or_default();
    if root != "self" && !is_ident(root) {
        return Err(malformed());
    }
    let mut members = Vec::new();
    for member in segments {
        let member = if is_tuple_index(member) {
            member.parse().ok().map(|index| {
                Member::Unnamed(Index {
                    index,
                    span: Span::call_site(),
                })
            })
        } else if is_ident(member) {
            syn::parse_str::<Ident>(member).ok().map(Member::Named)
        } else {
            None
        };
        members.push(member.ok_or_else(malformed)?);
    }
    Ok(Placeholder {
        text: inner.to_owned(),
        root: root.to_owned(),
        members,
    })
}

fn is_ident(text: &str) -> bool {
    !text.is_empty()
        && !text.chars().any(char::is_whitespace)
        && syn::parse_str::<Ident>(text).is_ok()
}

fn is_tuple_index(text: &str) -> bool {
    !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'))
}

/// Resolves a placeholder against the parameters into the expression that
/// reads its value.
fn resolve(placeholder: &Placeholder, params: &Params, span: Span) -> Result<TokenStream, String> {
    let Placeholder {
        text,
        root,
        members,
        ..
    } = placeholder;
    let fn_name = &params.fn_name;
    let root_tokens = if root == "self" {
        if !params.receiver {
            return Err(format!(
                "`{{{text}}}` uses `self`, but `{fn_name}` has no `self` parameter: name one of its parameters instead"
            ));
        }
        Ident::new("self", span).into_token_stream()
    } else {
        let Some(param) = params.named.iter().find(|name| *name == root) else {
            return Err(unknown_root(placeholder, params));
        };
        let mut param = param.clone();
        param.set_span(span);
        param.into_token_stream()
    };
    let members = members.iter().map(|member| match member {
        Member::Named(ident) => {
            let mut ident = ident.clone();
            ident.set_span(span);
            Member::Named(ident)
        }
        Member::Unnamed(index) => Member::Unnamed(Index {
            index: index.index,
            span,
        }),
    });
    // The `&` too: a value that is not `Display` is then reported on the key.
    Ok(quote_spanned!(span=> &#root_tokens #(.#members)*))
}

fn unknown_root(placeholder: &Placeholder, params: &Params) -> String {
    let Placeholder { text, root, .. } = placeholder;
    let fn_name = &params.fn_name;
    if let Some(binding) = params.bindings.iter().find(|b| match &*b.pat {
        Pat::Ident(ident) => ident.ident == root,
        _ => false,
    }) {
        return format!(
            "`{{{text}}}` names the `{}` parameter, which the lock provides once it is held: it cannot be part of the key",
            binding.kind.name()
        );
    }
    if let Some((_, pattern)) = params.in_patterns.iter().find(|(name, _)| name == root) {
        return format!(
            "`{{{text}}}` names `{root}`, a binding inside the pattern `{pattern}`; a placeholder must name an identifier parameter: bind the whole value to a name (`name: Type`) and write `{{name.field}}`"
        );
    }
    let usable = params.usable();
    if usable.is_empty() {
        format!("`{{{text}}}` names no parameter of `{fn_name}`: this function has no parameters")
    } else {
        format!("`{{{text}}}` names no parameter of `{fn_name}`; parameters: {usable}")
    }
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
    use super::*;

    fn parts(text: &str) -> Result<Vec<String>, String> {
        split_template(text).map(|parts| {
            parts
                .into_iter()
                .map(|part| match part {
                    Raw::Lit(text) => text,
                    Raw::Placeholder(p) => format!("<{}>", p.text),
                })
                .collect()
        })
    }

    #[test]
    fn templates_split_into_literals_and_placeholders() {
        assert_eq!(
            parts("export:{tenant}:{req.user.id}:{pair.0}"),
            Ok(vec![
                "export:".to_owned(),
                "<tenant>".to_owned(),
                ":".to_owned(),
                "<req.user.id>".to_owned(),
                ":".to_owned(),
                "<pair.0>".to_owned(),
            ])
        );
    }

    #[test]
    fn bad_templates_are_rejected() {
        for bad in [
            "", "a{", "a}", "{}", "{a b}", "{1x}", "{a.}", "{a.01}", "{{a}}", "a b", "é", "a%",
            "{a}{b}", "{a}x{b}",
        ] {
            assert!(parts(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(parts("{a}-{b}").is_err(), "`-` is kept in values");
        assert!(parts("{a}/{b}").is_ok());
    }

    #[test]
    fn separators_match_the_runtime() {
        for c in (0u8..=127).map(char::from) {
            let expected = !(c.is_ascii_alphanumeric() || "-_.".contains(c));
            assert_eq!(is_escaped_in_values(c), expected, "{c:?}");
        }
    }
}

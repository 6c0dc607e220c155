//! The function's parameters as the lock sees them: the ones it provides
//! itself (`FencingToken`, `FencingTokens`, `LostSignal`), removed from the
//! signature and bound inside the body, and the ones key placeholders may
//! name.

use quote::ToTokens;
use syn::{Error, FnArg, Ident, Pat, PatType, Signature, Type};

use crate::errors::Errors;

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

    pub fn name(self) -> &'static str {
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

/// What the parameters offer to key templates, and the lock-provided ones.
pub struct Params {
    pub fn_name: Ident,
    pub receiver: bool,
    /// Parameters bound to a plain identifier: what placeholders may name.
    pub named: Vec<Ident>,
    /// Names bound inside pattern parameters, with the pattern.
    pub in_patterns: Vec<(Ident, String)>,
    pub bindings: Vec<Binding>,
}

impl Params {
    /// `moved`: the patterns async-trait moved out of the signature, by the
    /// name it gave their parameters instead.
    pub fn new(
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
    pub fn usable(&self) -> String {
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

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

/// A parameter the caller passes, bound by a pattern other than a plain
/// identifier (`Path(id): Path<u64>`, `(a, b): (u32, u32)`, `_: u32`).
pub struct Destructured {
    /// The pattern as the user wrote it (also when async-trait moved it out
    /// of the signature).
    pub pat: Pat,
    /// The names it binds, in order: what placeholders may name.
    pub names: Vec<Ident>,
}

/// What the parameters offer to key templates, and the lock-provided ones.
pub struct Params {
    pub fn_name: Ident,
    pub receiver: bool,
    /// Parameters bound to a plain identifier: what placeholders may name.
    pub named: Vec<Ident>,
    /// Parameters bound by other patterns: placeholders may name what they
    /// bind. The body's own destructuring has bound these names before the
    /// key is built, as it binds `named` ones.
    pub destructured: Vec<Destructured>,
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
            destructured: Vec::new(),
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
                pat => params.destructured.push(Destructured {
                    pat: pat.clone(),
                    names: bound_names(pat),
                }),
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

    /// A parameter or a binding inside a parameter's pattern called `name`.
    pub fn find(&self, name: &str) -> Option<&Ident> {
        self.named
            .iter()
            .chain(self.destructured.iter().flat_map(|d| &d.names))
            .find(|ident| *ident == name)
    }

    /// The lock-provided parameter whose pattern binds `name`.
    pub fn provided(&self, name: &str) -> Option<&Binding> {
        self.bindings
            .iter()
            .find(|binding| bound_names(&binding.pat).iter().any(|ident| ident == name))
    }

    /// The parameters a placeholder could name, for error messages.
    pub fn usable(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        if self.receiver {
            names.push("`self`".to_owned());
        }
        names.extend(self.named.iter().map(|name| format!("`{name}`")));
        names
    }

    /// The bindings inside parameter patterns a placeholder could name,
    /// with their pattern, for error messages: "`x`, `why` (in `Point { x, y: why }`)".
    pub fn usable_in_patterns(&self) -> Vec<String> {
        self.destructured
            .iter()
            .filter(|d| !d.names.is_empty())
            .map(|d| {
                let names: Vec<String> = d.names.iter().map(|name| format!("`{name}`")).collect();
                format!("{} (in `{}`)", names.join(", "), shown(&d.pat))
            })
            .collect()
    }

    /// Why `name` is not bound although a pattern mentions it: a struct
    /// pattern field `name: why`, `name: _` or `name: Inner { .. }`.
    pub fn near_miss(&self, name: &str) -> Option<NearMiss> {
        self.destructured
            .iter()
            .find_map(|d| field_near_miss(&d.pat, &d.pat, name))
    }

    /// Whether a parameter pattern has a `_` or `..`, which bind nothing.
    pub fn has_wildcards(&self) -> bool {
        self.destructured.iter().any(|d| has_wildcards(&d.pat))
    }
}

/// A struct-pattern field named like a placeholder, that binds another name
/// or none.
pub enum NearMiss {
    /// `y: why`: the field is bound as `why`.
    Renamed { pattern: String, bound: Ident },
    /// `y: Inner { z }`: the field is destructured further.
    Nested {
        pattern: String,
        field_pat: String,
        names: Vec<Ident>,
    },
    /// `y: _`: the field binds nothing.
    Unbound { pattern: String, field_pat: String },
}

fn field_near_miss(pat: &Pat, top: &Pat, name: &str) -> Option<NearMiss> {
    let inner = |p: &Pat| field_near_miss(p, top, name);
    match pat {
        Pat::Struct(s) => s.fields.iter().find_map(|field| {
            let named = matches!(&field.member, syn::Member::Named(member) if member == name);
            if !named || field.colon_token.is_none() {
                return inner(&field.pat);
            }
            let pattern = shown(top);
            Some(match &*field.pat {
                Pat::Ident(ident) => NearMiss::Renamed {
                    pattern,
                    bound: ident.ident.clone(),
                },
                other => {
                    let names = bound_names(other);
                    let field_pat = shown(other);
                    if names.is_empty() {
                        NearMiss::Unbound { pattern, field_pat }
                    } else {
                        NearMiss::Nested {
                            pattern,
                            field_pat,
                            names,
                        }
                    }
                }
            })
        }),
        Pat::Ident(ident) => ident.subpat.as_ref().and_then(|(_, sub)| inner(sub)),
        Pat::Tuple(tuple) => tuple.elems.iter().find_map(inner),
        Pat::TupleStruct(tuple) => tuple.elems.iter().find_map(inner),
        Pat::Slice(slice) => slice.elems.iter().find_map(inner),
        Pat::Or(or) => or.cases.iter().find_map(inner),
        Pat::Reference(r) => inner(&r.pat),
        Pat::Paren(p) => inner(&p.pat),
        Pat::Type(t) => inner(&t.pat),
        _ => None,
    }
}

fn has_wildcards(pat: &Pat) -> bool {
    match pat {
        Pat::Wild(_) | Pat::Rest(_) => true,
        Pat::Ident(ident) => ident
            .subpat
            .as_ref()
            .is_some_and(|(_, sub)| has_wildcards(sub)),
        Pat::Tuple(tuple) => tuple.elems.iter().any(has_wildcards),
        Pat::TupleStruct(tuple) => tuple.elems.iter().any(has_wildcards),
        Pat::Struct(s) => s.rest.is_some() || s.fields.iter().any(|f| has_wildcards(&f.pat)),
        Pat::Slice(slice) => slice.elems.iter().any(has_wildcards),
        Pat::Or(or) => or.cases.iter().any(has_wildcards),
        Pat::Reference(r) => has_wildcards(&r.pat),
        Pat::Paren(p) => has_wildcards(&p.pat),
        Pat::Type(t) => has_wildcards(&t.pat),
        _ => false,
    }
}

/// A pattern as the user would write it, for messages: tokens printed
/// with rustfmt's spacing around `:`, `,`, `&` and brackets.
fn shown(pat: &Pat) -> String {
    let mut text = pat.to_token_stream().to_string();
    for (spaced, tight) in [
        (" :: ", "::"),
        (" :", ":"),
        (" ,", ","),
        ("( ", "("),
        (" )", ")"),
        ("[ ", "["),
        (" ]", "]"),
        ("& ", "&"),
    ] {
        text = text.replace(spaced, tight);
    }
    // `Path (id)` → `Path(id)`, but `x @ (a, b)` stays.
    let mut tight = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        let after_name = tight.ends_with(|c: char| c.is_alphanumeric() || c == '_');
        if c == ' ' && after_name && chars.peek() == Some(&'(') {
            continue;
        }
        tight.push(c);
    }
    tight
}

/// Whether `pat` binds any of `names`.
pub fn binds_any(pat: &Pat, names: &[&str]) -> bool {
    bound_names(pat)
        .iter()
        .any(|ident| names.iter().any(|name| ident == name))
}

/// Every name a pattern binds, in order.
pub fn bound_names(pat: &Pat) -> Vec<Ident> {
    let mut names = Vec::new();
    collect_bound_names(pat, &mut names);
    names
}

fn collect_bound_names(pat: &Pat, names: &mut Vec<Ident>) {
    let mut walk = |p: &Pat| collect_bound_names(p, names);
    match pat {
        Pat::Ident(ident) => {
            names.push(ident.ident.clone());
            if let Some((_, sub)) = &ident.subpat {
                collect_bound_names(sub, names);
            }
        }
        Pat::Tuple(tuple) => tuple.elems.iter().for_each(walk),
        Pat::TupleStruct(tuple) => tuple.elems.iter().for_each(walk),
        Pat::Struct(s) => s.fields.iter().for_each(|f| walk(&f.pat)),
        Pat::Slice(slice) => slice.elems.iter().for_each(walk),
        // Every case of an or-pattern binds the same names.
        Pat::Or(or) => {
            if let Some(first) = or.cases.first() {
                walk(first);
            }
        }
        Pat::Reference(r) => walk(&r.pat),
        Pat::Paren(p) => walk(&p.pat),
        Pat::Type(t) => walk(&t.pat),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use syn::parse::Parser as _;
    use syn::{Pat, parse_quote};

    use super::*;

    fn pat(tokens: proc_macro2::TokenStream) -> Pat {
        Pat::parse_multi.parse2(tokens).expect("a pattern")
    }

    fn names(pat: &Pat) -> Vec<String> {
        bound_names(pat).iter().map(Ident::to_string).collect()
    }

    #[test]
    fn patterns_bind_their_names_and_not_their_fields_or_wildcards() {
        let nested = pat(quote::quote!(Region {
            ref name,
            corner: Point { x, y: mut why, .. },
            tag: _,
        }));
        assert_eq!(names(&nested), ["name", "x", "why"]);
        assert_eq!(
            names(&pat(quote::quote!(whole @ (a, _, ..)))),
            ["whole", "a"]
        );
        assert_eq!(names(&pat(quote::quote!(Ok(n) | Err(n)))), ["n"]);
        assert!(has_wildcards(&nested));
        assert!(!has_wildcards(&pat(quote::quote!(Path((a, b))))));
    }

    #[test]
    fn a_field_bound_under_another_name_or_none_is_a_near_miss() {
        let sig: Signature = parse_quote! {
            fn f(Outer { inner: Point { x, y: why, z: _, w: Pair(a, b) }, .. }: Outer)
        };
        let params = Params::new(&sig, &[], None, &mut Errors::default());
        assert!(
            matches!(params.near_miss("y"), Some(NearMiss::Renamed { bound, .. }) if bound == "why")
        );
        assert!(
            matches!(params.near_miss("z"), Some(NearMiss::Unbound { field_pat, .. }) if field_pat == "_")
        );
        assert!(
            matches!(params.near_miss("w"), Some(NearMiss::Nested { names, .. }) if names.len() == 2)
        );
        assert!(params.near_miss("x").is_none());
        assert!(params.find("why").is_some() && params.find("y").is_none());
    }

    #[test]
    fn patterns_are_shown_as_written() {
        let shown = |tokens| shown(&pat(tokens));
        assert_eq!(
            shown(quote::quote!(Point { x, y: why })),
            "Point { x, y: why }"
        );
        assert_eq!(shown(quote::quote!(&(a, [b, ..]))), "&(a, [b, ..])");
        assert_eq!(shown(quote::quote!(ext::Path(id))), "ext::Path(id)");
    }
}

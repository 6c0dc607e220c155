//! Parsing of the attribute's arguments: `name = value` pairs, syntax only.
//!
//! Values are kept as literals with their spans; what they mean and whether
//! they fit together is checked in `valid.rs`.

use proc_macro2::Span;
use syn::ext::IdentExt as _;
use syn::parse::{Parse, ParseStream};
use syn::{Error, Expr, ExprArray, Ident, Lit, LitBool, LitInt, LitStr, Token};

use crate::errors::Errors;

mod kw {
    syn::custom_keyword!(key);
    syn::custom_keyword!(keys);
    syn::custom_keyword!(ttl);
    syn::custom_keyword!(wait);
    syn::custom_keyword!(renew);
    syn::custom_keyword!(fair);
    syn::custom_keyword!(min_hold);
    syn::custom_keyword!(backend);
    syn::custom_keyword!(on_lost);
    syn::custom_keyword!(mode);
    syn::custom_keyword!(permits);
}

/// The option names, as listed in error messages.
const KNOWN: &str = "`key`, `keys`, `ttl`, `wait`, `renew`, `fair`, `mode`, `permits`, `min_hold`, `backend`, `on_lost`, `crate`";

/// An option's value together with the span of its name.
pub struct Opt<T> {
    pub name: Span,
    pub value: T,
}

/// `keys = ["a:{x}", "b:{y}"]`.
pub struct KeyList {
    /// The whole `[...]`, for errors about the list itself.
    pub list: ExprArray,
    pub templates: Vec<LitStr>,
}

/// Everything written inside `#[distributed_lock(...)]`.
#[derive(Default)]
pub struct Args {
    pub key: Option<Opt<LitStr>>,
    pub keys: Option<Opt<KeyList>>,
    pub ttl: Option<Opt<LitStr>>,
    pub wait: Option<Opt<LitStr>>,
    pub renew: Option<Opt<LitBool>>,
    pub fair: Option<Opt<LitBool>>,
    pub mode: Option<Opt<LitStr>>,
    pub permits: Option<Opt<LitInt>>,
    pub min_hold: Option<Opt<LitStr>>,
    pub backend: Option<Opt<LitStr>>,
    pub on_lost: Option<Opt<LitStr>>,
    pub krate: Option<Opt<LitStr>>,
}

#[derive(Clone, Copy)]
enum Name {
    Key,
    Keys,
    Ttl,
    Wait,
    Renew,
    Fair,
    Mode,
    Permits,
    MinHold,
    Backend,
    OnLost,
    Crate,
}

impl Name {
    fn as_str(self) -> &'static str {
        match self {
            Name::Key => "key",
            Name::Keys => "keys",
            Name::Ttl => "ttl",
            Name::Wait => "wait",
            Name::Renew => "renew",
            Name::Fair => "fair",
            Name::Mode => "mode",
            Name::Permits => "permits",
            Name::MinHold => "min_hold",
            Name::Backend => "backend",
            Name::OnLost => "on_lost",
            Name::Crate => "crate",
        }
    }

    /// Parses an option name; `Ok(None)` for an identifier that is no option
    /// (reported, and its value skipped, so later options are still checked).
    fn parse(input: ParseStream, errors: &mut Errors) -> syn::Result<Option<(Name, Span)>> {
        let lookup = [
            (input.peek(kw::key), Name::Key),
            (input.peek(kw::keys), Name::Keys),
            (input.peek(kw::ttl), Name::Ttl),
            (input.peek(kw::wait), Name::Wait),
            (input.peek(kw::renew), Name::Renew),
            (input.peek(kw::fair), Name::Fair),
            (input.peek(kw::mode), Name::Mode),
            (input.peek(kw::permits), Name::Permits),
            (input.peek(kw::min_hold), Name::MinHold),
            (input.peek(kw::backend), Name::Backend),
            (input.peek(kw::on_lost), Name::OnLost),
            (input.peek(Token![crate]), Name::Crate),
        ];
        if let Some((_, name)) = lookup.into_iter().find(|(found, _)| *found) {
            let span = match name {
                Name::Key => input.parse::<kw::key>()?.span,
                Name::Keys => input.parse::<kw::keys>()?.span,
                Name::Ttl => input.parse::<kw::ttl>()?.span,
                Name::Wait => input.parse::<kw::wait>()?.span,
                Name::Renew => input.parse::<kw::renew>()?.span,
                Name::Fair => input.parse::<kw::fair>()?.span,
                Name::Mode => input.parse::<kw::mode>()?.span,
                Name::Permits => input.parse::<kw::permits>()?.span,
                Name::MinHold => input.parse::<kw::min_hold>()?.span,
                Name::Backend => input.parse::<kw::backend>()?.span,
                Name::OnLost => input.parse::<kw::on_lost>()?.span,
                Name::Crate => input.parse::<Token![crate]>()?.span,
            };
            return Ok(Some((name, span)));
        }
        if input.peek(Ident::peek_any) {
            let unknown = input.call(Ident::parse_any)?;
            errors.push(Error::new(
                unknown.span(),
                format!("unknown option `{unknown}`; the options are {KNOWN}"),
            ));
            return Ok(None);
        }
        Err(input.error(format!(
            "expected an option such as `key = \"...\"` or `ttl = \"30s\"`; the options are {KNOWN}"
        )))
    }
}

impl Parse for Args {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let mut args = Args::default();
        let mut errors = Errors::default();
        while !input.is_empty() {
            let name = Name::parse(input, &mut errors)?;
            input.parse::<Token![=]>()?;
            let value: Expr = input.parse()?;
            if let Some((name, span)) = name {
                args.set(name, span, value, &mut errors);
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        errors.finish()?;
        Ok(args)
    }
}

impl Args {
    fn set(&mut self, name: Name, span: Span, value: Expr, errors: &mut Errors) {
        let duration = "expected a duration string like \"30s\"";
        let parsed = match name {
            Name::Key => {
                let what = match value {
                    Expr::Array(_) => {
                        "expected one key template string; for several keys write `keys = [\"a:{x}\", \"b:{y}\"]`"
                    }
                    _ => "expected a key template string like \"export:{tenant}\"",
                };
                string(&value, what).map(|v| store(&mut self.key, span, v))
            }
            Name::Keys => key_list(value).map(|v| store(&mut self.keys, span, v)),
            Name::Ttl => string(&value, duration).map(|v| store(&mut self.ttl, span, v)),
            Name::Wait => string(&value, duration).map(|v| store(&mut self.wait, span, v)),
            Name::MinHold => string(&value, duration).map(|v| store(&mut self.min_hold, span, v)),
            Name::Renew => boolean(&value).map(|v| store(&mut self.renew, span, v)),
            Name::Fair => boolean(&value).map(|v| store(&mut self.fair, span, v)),
            Name::Mode => string(&value, "expected \"exclusive\" or \"shared\"")
                .map(|v| store(&mut self.mode, span, v)),
            Name::Permits => integer(&value).map(|v| store(&mut self.permits, span, v)),
            Name::Backend => string(&value, "expected a backend name string like \"pg\"")
                .map(|v| store(&mut self.backend, span, v)),
            Name::OnLost => string(&value, "expected \"abort\" or \"finish\"")
                .map(|v| store(&mut self.on_lost, span, v)),
            Name::Crate => string(&value, "expected a path string like \"my_reexport::dlock\"")
                .map(|v| store(&mut self.krate, span, v)),
        };
        match parsed {
            Ok(true) => {}
            Ok(false) => errors.push(Error::new(
                span,
                format!(
                    "duplicate option `{}`: it is already set earlier in this attribute",
                    name.as_str()
                ),
            )),
            Err(err) => errors.push(err),
        }
    }
}

/// Stores a value; false if the option was given before (the first is kept).
fn store<T>(slot: &mut Option<Opt<T>>, name: Span, value: T) -> bool {
    if slot.is_some() {
        return false;
    }
    *slot = Some(Opt { name, value });
    true
}

fn string(value: &Expr, expected: &str) -> syn::Result<LitStr> {
    match value {
        Expr::Lit(lit) => match &lit.lit {
            Lit::Str(s) => Ok(s.clone()),
            other => Err(Error::new(other.span(), expected)),
        },
        other => Err(Error::new_spanned(other, expected)),
    }
}

fn boolean(value: &Expr) -> syn::Result<LitBool> {
    match value {
        Expr::Lit(lit) => match &lit.lit {
            Lit::Bool(b) => Ok(b.clone()),
            other => Err(Error::new(other.span(), "expected `true` or `false`")),
        },
        other => Err(Error::new_spanned(other, "expected `true` or `false`")),
    }
}

fn integer(value: &Expr) -> syn::Result<LitInt> {
    let expected = "expected a whole number of permits like `4`";
    match value {
        Expr::Lit(lit) => match &lit.lit {
            Lit::Int(n) => Ok(n.clone()),
            other => Err(Error::new(other.span(), expected)),
        },
        other => Err(Error::new_spanned(other, expected)),
    }
}

fn key_list(value: Expr) -> syn::Result<KeyList> {
    let Expr::Array(list) = value else {
        return Err(Error::new_spanned(
            value,
            "expected a list of key templates like [\"a:{x}\", \"b:{y}\"]",
        ));
    };
    let mut errors = Errors::default();
    let mut templates = Vec::with_capacity(list.elems.len());
    for elem in &list.elems {
        match string(
            elem,
            "expected a key template string like \"export:{tenant}\"",
        ) {
            Ok(template) => templates.push(template),
            Err(err) => errors.push(err),
        }
    }
    errors.finish()?;
    Ok(KeyList { list, templates })
}

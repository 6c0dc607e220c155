//! The key-template language: `"literal:{param}:{param.field}:{self.field}"`.
//!
//! A template is split into literal text and placeholders, checked (allowed
//! characters, a separator between two placeholders, the length of its
//! literal text), and each placeholder is resolved against the function's
//! parameters into the expression that reads its value.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote_spanned};
use syn::{Error, Ident, Index, LitStr, Member};

use crate::errors::Errors;
use crate::params::{NearMiss, Params};

/// The longest key the runtime accepts, in bytes (the runtime's `MAX_KEY_LEN`).
const MAX_KEY_LEN: usize = 1024;

/// A key template split into literal text and values to interpolate.
pub struct Template {
    pub parts: Vec<Part>,
    /// The names its placeholders read, other than `self`: parameters and
    /// bindings inside parameter patterns.
    pub params: Vec<String>,
}

pub enum Part {
    Lit(String),
    /// A reference such as `&tenant`, `&req.user.id` or `&self.id`.
    Value(TokenStream),
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
pub fn parse(literal: &LitStr, params: &Params) -> syn::Result<Template> {
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

/// Whether `c` may appear in a key template's literal text: the runtime's
/// `dlock_runtime::key::is_allowed_in_literals`, which `KeyBuilder::lit`
/// applies, copied like `is_escaped_in_values` below (a unit test holds
/// the two together).
fn allowed_in_literal(c: char) -> bool {
    c.is_ascii_graphic() && !matches!(c, '{' | '}' | '"' | '\'' | '\\' | '%' | '`')
}

/// Whether `c` is percent-encoded when it appears in an interpolated value:
/// the runtime's `dlock_runtime::key::is_escaped_in_values`, copied because
/// expansion cannot call the runtime (a unit test holds the two together).
/// A separator between two placeholders needs one.
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
        // A binding inside a parameter's pattern is read like a parameter:
        // the function's own destructuring has bound it before the key is
        // built (by move or by reference, as the pattern says), and the
        // key only borrows it.
        let Some(param) = params.find(root) else {
            return Err(unknown_root(placeholder, params));
        };
        let mut param = param.clone();
        param.set_span(span);
        param.into_token_stream()
    };
    // Located on the key, so a missing field is reported there; resolved at
    // the macro's mixed site, which field access ignores, so that rustc does
    // not offer to replace the whole key literal by a field's name.
    let member_span = span.resolved_at(Span::mixed_site());
    let members = members.iter().map(|member| match member {
        Member::Named(ident) => {
            let mut ident = ident.clone();
            ident.set_span(member_span);
            Member::Named(ident)
        }
        Member::Unnamed(index) => Member::Unnamed(Index {
            index: index.index,
            span: member_span,
        }),
    });
    // The `&` too: a value that is not `Display` is then reported on the key.
    Ok(quote_spanned!(span=> &#root_tokens #(.#members)*))
}

fn unknown_root(placeholder: &Placeholder, params: &Params) -> String {
    let Placeholder { text, root, .. } = placeholder;
    let fn_name = &params.fn_name;
    if let Some(binding) = params.provided(root) {
        return format!(
            "`{{{text}}}` names the `{}` parameter, which the lock provides once it is held: it cannot be part of the key",
            binding.kind.name()
        );
    }
    let rest = &text[root.len()..];
    match params.near_miss(root) {
        Some(NearMiss::Renamed { pattern, bound }) => {
            return format!(
                "`{{{text}}}`: the field `{root}` is bound as `{bound}` in the pattern `{pattern}`: write `{{{bound}{rest}}}`"
            );
        }
        Some(NearMiss::Nested {
            pattern,
            field_pat,
            names,
        }) => {
            let names: Vec<String> = names.iter().map(|name| format!("`{name}`")).collect();
            return format!(
                "`{{{text}}}`: the field `{root}` is destructured by `{field_pat}` in the pattern `{pattern}` and binds no `{root}`: name one of its bindings ({}) or bind the field whole",
                names.join(", ")
            );
        }
        Some(NearMiss::Unbound { pattern, field_pat }) => {
            return format!(
                "`{{{text}}}`: the field `{root}` is matched by `{field_pat}` in the pattern `{pattern}`, which binds nothing: write `{root}` instead of `{root}: {field_pat}` to bind it"
            );
        }
        None => {}
    }
    let usable = params.usable();
    let in_patterns = params.usable_in_patterns();
    let mut msg = match (usable.is_empty(), in_patterns.is_empty()) {
        (true, true) if params.destructured.is_empty() => {
            return format!(
                "`{{{text}}}` names no parameter of `{fn_name}`: this function has no parameters"
            );
        }
        (true, true) => {
            format!("`{{{text}}}` names no parameter of `{fn_name}`: its parameters bind no names")
        }
        (false, true) => format!(
            "`{{{text}}}` names no parameter of `{fn_name}`; parameters: {}",
            usable.join(", ")
        ),
        (true, false) => format!(
            "`{{{text}}}` names no parameter of `{fn_name}` and no binding in its parameters' patterns; bindings: {}",
            in_patterns.join(", ")
        ),
        (false, false) => format!(
            "`{{{text}}}` names no parameter of `{fn_name}` and no binding in its parameters' patterns; parameters: {}; bindings: {}",
            usable.join(", "),
            in_patterns.join(", ")
        ),
    };
    if params.has_wildcards() {
        msg.push_str(
            "; `_` and `..` bind nothing: to use a value in the key, name it in the pattern",
        );
    }
    msg
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
        for c in (0..=u32::from(char::MAX)).filter_map(char::from_u32) {
            assert_eq!(
                is_escaped_in_values(c),
                dlock_runtime::key::is_escaped_in_values(c),
                "{c:?}"
            );
        }
    }

    #[test]
    fn literal_characters_match_the_runtime() {
        for c in (0..=u32::from(char::MAX)).filter_map(char::from_u32) {
            assert_eq!(
                allowed_in_literal(c),
                dlock_runtime::key::is_allowed_in_literals(c),
                "{c:?}"
            );
        }
    }

    #[test]
    fn key_length_limit_matches_the_runtime() {
        assert_eq!(MAX_KEY_LEN, dlock_runtime::MAX_KEY_LEN);
    }
}

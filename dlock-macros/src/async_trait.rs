//! Methods async-trait has already rewritten.
//!
//! `#[async_trait]` goes on the `impl` (or trait) block, so it expands
//! before the `#[distributed_lock]` on one of its methods: this attribute
//! then sees, instead of an `async fn`,
//!
//! ```text
//! fn run<'life0, 'async_trait>(&'life0 self, shard: u32, token: FencingToken)
//!     -> Pin<Box<dyn Future<Output = Result<u64, LockError>> + Send + 'async_trait>>
//! { Box::pin(async move { let __self = self; let shard = shard; ... }) }
//! ```
//!
//! The lock is then taken inside that future, as it would be inside the
//! `async fn`. (async-trait before 0.1.44 wrote an inner `async fn` called
//! through `Box::pin(inner(...))` instead; that shape is not recognised and
//! gets the "add `async`" error.)

use syn::{
    Expr, ExprAsync, ExprCall, GenericArgument, Ident, ItemFn, Local, Pat, PathArguments,
    ReturnType, Stmt, Type,
};

/// The future a rewritten method returns, taken out of its body.
pub struct Boxed {
    /// `R` of `Pin<Box<dyn Future<Output = R> + ...>>`: the return type as
    /// the user declared it.
    pub output: Box<Type>,
    /// The `Box::pin` being called.
    pub pin: Box<Expr>,
    pub paren: syn::token::Paren,
    /// `async move { ... }`: the original body.
    pub future: ExprAsync,
}

/// Splits a function whose body ends in `Box::pin(async move { ... })` and
/// whose return type is a pinned, boxed `dyn Future` into the function
/// (without that last expression) and the future; any other function comes
/// back whole.
pub fn split(mut func: ItemFn) -> (ItemFn, Option<Boxed>) {
    if func.sig.asyncness.is_some() {
        return (func, None);
    }
    let output = match &func.sig.output {
        ReturnType::Type(_, ty) => future_output(ty).cloned(),
        ReturnType::Default => None,
    };
    let Some(output) = output else {
        return (func, None);
    };
    match func.block.stmts.pop() {
        Some(Stmt::Expr(Expr::Call(call), None)) if boxes_an_async_move_block(&call) => {
            let ExprCall {
                func: pin,
                paren_token,
                args,
                ..
            } = call;
            let Some(Expr::Async(future)) = args.into_iter().next() else {
                unreachable!("`boxes_an_async_move_block` checked the argument");
            };
            let boxed = Boxed {
                output: Box::new(output),
                pin,
                paren: paren_token,
                future,
            };
            (func, Some(boxed))
        }
        last => {
            func.block.stmts.extend(last);
            (func, None)
        }
    }
}

/// `Box::pin(async move { ... })`.
fn boxes_an_async_move_block(call: &ExprCall) -> bool {
    is_box_pin(&call.func)
        && call.args.len() == 1
        && matches!(&call.args[0], Expr::Async(future) if future.capture.is_some())
}

/// The patterns async-trait moved from the signature into the future: it
/// writes a parameter `(a, b): (u32, u32)` as `__arg1: (u32, u32)`, and
/// `let (a, b) = { let __arg1 = __arg1; __arg1 };` in the future (a `_`
/// parameter as `__arg1` and `let __arg1 = __arg1;`). Returns
/// `(__arg1, (a, b))` (or `(__arg1, _)`) for each.
pub fn moved_patterns(future: &ExprAsync) -> Vec<(Ident, Pat)> {
    future
        .block
        .stmts
        .iter()
        .filter_map(|stmt| {
            let Stmt::Local(local) = stmt else {
                return None;
            };
            if let Some((name, pat)) = destructuring(local) {
                return Some((name.clone(), pat.clone()));
            }
            let name = rebound(local)?;
            is_positional(name).then(|| {
                let wild = Pat::Wild(syn::PatWild {
                    attrs: Vec::new(),
                    underscore_token: syn::Token![_](name.span()),
                });
                (name.clone(), wild)
            })
        })
        .collect()
}

/// Takes out of the future the statements that destructure a moved
/// pattern for which `wanted` holds, to run them before the key is built:
/// an `async fn` binds its parameter patterns before its body runs, and so
/// does the lock then.
pub fn take_destructurings(future: &mut ExprAsync, wanted: impl Fn(&Pat) -> bool) -> Vec<Stmt> {
    let (taken, kept): (Vec<Stmt>, Vec<Stmt>) = std::mem::take(&mut future.block.stmts)
        .into_iter()
        .partition(|stmt| match stmt {
            Stmt::Local(local) => destructuring(local).is_some_and(|(_, pat)| wanted(pat)),
            _ => false,
        });
    future.block.stmts = kept;
    taken
}

/// `(__arg1, PAT)` for `let PAT = { let __arg1 = __arg1; __arg1 };`.
fn destructuring(local: &Local) -> Option<(&Ident, &Pat)> {
    let Expr::Block(init) = &*local.init.as_ref()?.expr else {
        return None;
    };
    let [Stmt::Local(rebind), Stmt::Expr(Expr::Path(value), None)] = &init.block.stmts[..] else {
        return None;
    };
    let name = rebound(rebind)?;
    (value.path.get_ident() == Some(name)).then_some((name, &local.pat))
}

/// `__arg1`: the name async-trait gives a parameter it moved the pattern
/// of. (Its hygiene keeps it from the user's names, which a user could
/// only clash with by writing this very name.)
fn is_positional(name: &Ident) -> bool {
    name.to_string()
        .strip_prefix("__arg")
        .is_some_and(|index| !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()))
}

/// Marks async-trait's `let tenant = tenant;` as allowed to go unused when
/// the key reads `tenant`: the key reads the parameter before that `let`,
/// so a body that does not use `tenant` itself would get an "unused
/// variable" warning a plain `async fn` does not get.
pub fn allow_unused_rebindings(future: &mut ExprAsync, read_by_key: &[&str]) {
    for stmt in &mut future.block.stmts {
        if let Stmt::Local(local) = stmt
            && rebound(local).is_some_and(|name| read_by_key.iter().any(|read| name == read))
        {
            local
                .attrs
                .push(syn::parse_quote!(#[allow(unused_variables)]));
        }
    }
}

/// `x` in `let x = x;` or `let mut x = x;`.
fn rebound(local: &Local) -> Option<&Ident> {
    let Pat::Ident(pat) = &local.pat else {
        return None;
    };
    let init = local.init.as_ref()?;
    match &*init.expr {
        Expr::Path(value) if init.diverge.is_none() && value.path.is_ident(&pat.ident) => {
            Some(&pat.ident)
        }
        _ => None,
    }
}

/// Whether a return type is the pinned, boxed future async-trait writes.
pub fn is_boxed_future(output: &ReturnType) -> bool {
    matches!(output, ReturnType::Type(_, ty) if future_output(ty).is_some())
}

/// `R` in `Pin<Box<dyn Future<Output = R> + ...>>`, paths written in full
/// or not.
fn future_output(ty: &Type) -> Option<&Type> {
    let boxed = only_type_argument(ty, "Pin")?;
    let Type::TraitObject(object) = peel(only_type_argument(boxed, "Box")?) else {
        return None;
    };
    object.bounds.iter().find_map(|bound| {
        let syn::TypeParamBound::Trait(bound) = bound else {
            return None;
        };
        let future = bound.path.segments.last()?;
        if future.ident != "Future" {
            return None;
        }
        let PathArguments::AngleBracketed(args) = &future.arguments else {
            return None;
        };
        args.args.iter().find_map(|arg| match arg {
            GenericArgument::AssocType(assoc) if assoc.ident == "Output" => Some(&assoc.ty),
            _ => None,
        })
    })
}

/// `T` in `Name<T>`.
fn only_type_argument<'a>(ty: &'a Type, name: &str) -> Option<&'a Type> {
    let Type::Path(path) = peel(ty) else {
        return None;
    };
    if path.qself.is_some() {
        return None;
    }
    let segment = path.path.segments.last()?;
    if segment.ident != name {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &segment.arguments else {
        return None;
    };
    match args.args.iter().collect::<Vec<_>>().as_slice() {
        [GenericArgument::Type(inner)] => Some(inner),
        _ => None,
    }
}

/// A type without the invisible or parenthesised groups around it.
fn peel(ty: &Type) -> &Type {
    match ty {
        Type::Group(group) => peel(&group.elem),
        Type::Paren(paren) => peel(&paren.elem),
        other => other,
    }
}

/// `Box::pin`, `::std::boxed::Box::pin` and the like.
fn is_box_pin(func: &Expr) -> bool {
    let Expr::Path(path) = func else {
        return false;
    };
    let segments: Vec<_> = path.path.segments.iter().map(|s| &s.ident).collect();
    matches!(segments.as_slice(), [.., boxed, pin] if *boxed == "Box" && *pin == "pin")
}

#[cfg(test)]
mod tests {
    use quote::quote;
    use syn::{ExprAsync, Pat};

    use super::*;

    /// The future async-trait writes for `(&self, (a, b): (u32, u32), _: u32, c: u32)`.
    fn future() -> ExprAsync {
        syn::parse2(quote! {
            async move {
                let __self = self;
                let (a, b) = {
                    let __arg1 = __arg1;
                    __arg1
                };
                let __arg2 = __arg2;
                let c = c;
                let __ret: u32 = { a + b + c };
                __ret
            }
        })
        .expect("a future")
    }

    #[test]
    fn moved_patterns_are_found_with_wildcards() {
        let moved = moved_patterns(&future());
        let moved: Vec<(String, bool)> = moved
            .iter()
            .map(|(name, pat)| (name.to_string(), matches!(pat, Pat::Wild(_))))
            .collect();
        assert_eq!(
            moved,
            [("__arg1".to_owned(), false), ("__arg2".to_owned(), true)]
        );
    }

    #[test]
    fn only_the_wanted_destructurings_are_taken() {
        let mut future = future();
        let before = future.block.stmts.len();
        assert!(take_destructurings(&mut future, |_| false).is_empty());
        let taken = take_destructurings(&mut future, |_| true);
        assert_eq!(taken.len(), 1);
        assert_eq!(future.block.stmts.len(), before - 1);
    }
}

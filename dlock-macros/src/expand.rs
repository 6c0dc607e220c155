//! Code generation: the function as written, with its body wrapped in
//! acquire / run / release and the lock-provided parameters bound inside.

use std::time::Duration;

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned as _;
use syn::{AttrStyle, Attribute, ExprAsync, Ident, ImplItem, ItemFn, ItemImpl, Stmt, Type};

use crate::async_trait::{self, Boxed};
use crate::params::{self, Binding, Special};
use crate::template::{Part, Template};
use crate::valid::{self, Function, Lock, OnLost};

/// The attribute's whole job: the expanded function, or, on any error, the
/// function as callers will see it plus the errors (so one mistake gives one
/// message and the IDE still sees the function).
pub fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    let func = match valid::function(item.clone()) {
        Ok(func) => func,
        Err(err) => return with_error(item, err),
    };
    let args = syn::parse2(args);
    match valid::check(args, &func) {
        Ok(lock) => expand(func, &lock),
        Err(err) => with_error(item, err),
    }
}

fn with_error(item: TokenStream, err: syn::Error) -> TokenStream {
    let err = err.into_compile_error();
    let item = without_lock_provided(item);
    quote!(#item #err)
}

/// The item as written, except that the parameters the lock would provide
/// are gone from its signature, as in a successful expansion: call sites
/// that leave them out (as they should) then get no second error about the
/// number of arguments.
fn without_lock_provided(item: TokenStream) -> TokenStream {
    if let Ok(mut func) = syn::parse2::<ItemFn>(item.clone()) {
        if unlock(&mut func.sig, &mut func.block) {
            return func.into_token_stream();
        }
        return item;
    }
    // Misplaced on an impl block, the attribute was meant for its methods:
    // the ones it could lock lose those parameters too, or each would get a
    // second error for not matching the trait.
    if let Ok(mut block) = syn::parse2::<ItemImpl>(item.clone()) {
        let mut changed = false;
        for member in &mut block.items {
            if let ImplItem::Fn(method) = member
                && (method.sig.asyncness.is_some()
                    || async_trait::is_boxed_future(&method.sig.output))
            {
                changed |= unlock(&mut method.sig, &mut method.block);
            }
        }
        if changed {
            return block.into_token_stream();
        }
    }
    item
}

/// Removes the lock-provided parameters from `sig` and binds them at the
/// top of `block` to a value from a function that never returns (it never
/// runs: the crate does not compile). A diverging expression in the body
/// itself would make the rest of it unreachable, and its parameters
/// "unused". Returns whether there were any.
fn unlock(sig: &mut syn::Signature, block: &mut syn::Block) -> bool {
    let provided = params::take_lock_provided(sig);
    if provided.is_empty() {
        return false;
    }
    let never = local("__dlock_never");
    let bindings = provided.into_iter().map(|typed| {
        let syn::PatType { attrs, pat, ty, .. } = typed;
        syn::parse_quote! {
            #(#attrs)*
            let #pat: #ty = {
                fn #never<T>() -> T {
                    ::core::unreachable!()
                }
                #never()
            };
        }
    });
    block.stmts.splice(0..0, bindings);
    true
}

/// Names the expansion introduces; mixed-site hygiene keeps them invisible
/// to the body.
fn local(name: &str) -> Ident {
    Ident::new(name, Span::mixed_site())
}

fn expand(func: Function, lock: &Lock) -> TokenStream {
    let Function {
        item:
            ItemFn {
                attrs,
                vis,
                mut sig,
                block,
            },
        mut boxed,
    } = func;
    // async-trait moved the parameter patterns into the future it boxes;
    // those the key reads are destructured before the key is built, as an
    // `async fn` destructures them before its body runs.
    let destructure = match &mut boxed {
        None => Vec::new(),
        Some(boxed) => {
            let read_by_key: Vec<&str> = lock
                .keys
                .iter()
                .flat_map(|key| key.params.iter().map(String::as_str))
                .collect();
            async_trait::allow_unused_rebindings(&mut boxed.future, &read_by_key);
            async_trait::take_destructurings(&mut boxed.future, |pat| {
                params::binds_any(pat, &read_by_key)
            })
        }
    };
    let (inner_attrs, outer_attrs): (Vec<Attribute>, Vec<Attribute>) = attrs
        .into_iter()
        .partition(|attr| matches!(attr.style, AttrStyle::Inner(_)));

    // Callers do not pass what the lock provides.
    sig.inputs = sig
        .inputs
        .into_iter()
        .enumerate()
        .filter(|(index, _)| !lock.bindings.iter().any(|b| b.index == *index))
        .map(|(_, input)| input)
        .collect();
    // The body to run under the lock: the function's, or, for a method
    // async-trait rewrote, that of the future it boxes (the lock is then
    // taken when the future is first polled, as for an `async fn`).
    let (before, stmts) = match &boxed {
        None => (&[][..], &block.stmts),
        Some(boxed) => (&block.stmts[..], &boxed.future.block.stmts),
    };
    let locked = locked(lock, &destructure, stmts, boxed.is_some());
    let body = match boxed {
        None => locked,
        Some(Boxed {
            pin, paren, future, ..
        }) => {
            let ExprAsync {
                attrs,
                async_token,
                capture,
                ..
            } = future;
            let mut call = pin.into_token_stream();
            paren.surround(&mut call, |args| {
                args.extend(quote!(#(#attrs)* #async_token #capture { #locked }));
            });
            call
        }
    };
    quote! {
        #(#outer_attrs)*
        #vis #sig {
            #(#inner_attrs)*
            #(#before)*
            #body
        }
    }
}

/// The locked body: the key built, the backend looked up, the lease
/// acquired, the lock-provided parameters bound, and `stmts` run under the
/// lease. `boxed` for the future of a method async-trait rewrote.
fn locked(lock: &Lock, destructure: &[Stmt], stmts: &[Stmt], boxed: bool) -> TokenStream {
    let krate = &lock.krate;
    let private = quote!(#krate::__private);
    let key = local("__dlock_key");
    let options = local("__dlock_options");
    let lease = local("__dlock_lease");
    let held = local("__dlock_held");
    let err = local("__dlock_err");

    let ret = &lock.ret;
    let ret_span = ret.span();
    // On the return type's (first token's) span: if it cannot carry a
    // `LockError`, `LockResult`'s `on_unimplemented` message points there.
    // `Self` is inferred from the return position (a type mentioning `impl`
    // could not be named here), and `run` below requires the same bound at
    // the same span, which rustc then reports once.
    let lock_failed = call(
        quote!(#private::LockResult::from_lock_error),
        err.to_token_stream(),
        ret_span,
    );
    let (key_value, acquire, run) = key_value(&private, lock, &key, &err, &lock_failed);
    // The name is known here, so each call site remembers its backend and
    // looks the name up again only after the registry changed.
    let backend = local("__dlock_backend");
    let slot = local("__DLOCK_BACKEND");
    let backend_name = match &lock.backend {
        Some(name) => quote!(#name),
        None => quote!(#private::DEFAULT_BACKEND),
    };

    let options_expr = options_expr(&private, lock);
    let bindings = provided_bindings(lock, &lease);
    let pin_output = pin_output(ret);
    let run_call = run_call(&private, &run, &lease, lock, &pin_output, stmts);

    // A boxed future's output is otherwise inferred; pinned to the declared
    // type, a return type that cannot carry a `LockError` is reported once,
    // on that type, as for an `async fn`.
    let outer_output = if boxed {
        pin_output.clone()
    } else {
        TokenStream::new()
    };
    quote! {
        #outer_output
        #(#destructure)*
        // Built before the body takes the parameters.
        let #key = #key_value;
        let #options = #options_expr;
        let #backend = {
            static #slot: #private::BackendSlot = #private::BackendSlot::new(#backend_name);
            match #slot.get() {
                ::core::result::Result::Ok(#held) => #held,
                ::core::result::Result::Err(#err) => return #lock_failed,
            }
        };
        let #lease = match #options.#acquire(#backend, #key).await {
            ::core::result::Result::Ok(#held) => #held,
            ::core::result::Result::Err(#err) => return #lock_failed,
        };
        #(#bindings)*
        #run_call
    }
}

/// The key (or the array of keys) to acquire, and the names of the
/// acquire and run calls for one key or for many.
fn key_value(
    private: &TokenStream,
    lock: &Lock,
    key: &Ident,
    err: &Ident,
    lock_failed: &TokenStream,
) -> (TokenStream, TokenStream, TokenStream) {
    // Each key is checked here, so the acquisition gets plain `LockKey`s:
    // a `Result` carried into `acquire` would make its future larger.
    let keys: Vec<TokenStream> = lock
        .keys
        .iter()
        .map(|k| {
            let built = key_expr(private, k);
            quote! {
                match #built {
                    ::core::result::Result::Ok(#key) => #key,
                    ::core::result::Result::Err(#err) => return #lock_failed,
                }
            }
        })
        .collect();
    if lock.many {
        (
            quote!([#(#keys),*]),
            quote!(acquire_many_on),
            quote!(run_many),
        )
    } else {
        let key = keys.into_iter().next().unwrap_or_default();
        (key, quote!(acquire_on), quote!(run))
    }
}

/// A `let` for each parameter the lock provides, bound from the lease.
fn provided_bindings(lock: &Lock, lease: &Ident) -> Vec<TokenStream> {
    lock.bindings
        .iter()
        .map(|binding| {
            // The parameter's own attributes (e.g. `#[allow(unused)]`) go on its `let`.
            let Binding {
                attrs,
                kind,
                pat,
                ty,
                ..
            } = binding;
            let value = match kind {
                Special::Token => quote!(#lease.token()),
                Special::Tokens => quote!(#lease.tokens()),
                Special::LostSignal => quote!(#lease.lost_signal()),
            };
            quote!(#(#attrs)* let #pat: #ty = #value;)
        })
        .collect()
}

/// Pins the async block's output to the declared return type `ret` so that
/// `?` and `return` in the body infer as in the function itself
/// (async-trait's trick). A type mentioning `impl` cannot be named in an
/// expression: nothing then.
fn pin_output(ret: &Type) -> TokenStream {
    if mentions_impl(ret.to_token_stream()) {
        TokenStream::new()
    } else {
        let ret_value = local("__dlock_ret");
        quote! {
            if let ::core::option::Option::Some(#ret_value) = ::core::option::Option::None::<#ret> {
                #[allow(unreachable_code)]
                return #ret_value;
            }
        }
    }
}

/// `run(lease, on_lost, async move { body }).await`: the body under the
/// lease.
fn run_call(
    private: &TokenStream,
    run: &TokenStream,
    lease: &Ident,
    lock: &Lock,
    pin_output: &TokenStream,
    stmts: &[Stmt],
) -> TokenStream {
    let on_lost = match lock.on_lost {
        OnLost::Abort => quote!(#private::OnLost::Abort),
        OnLost::Finish => quote!(#private::OnLost::Finish),
    };
    let ret_span = lock.ret.span();
    // Also on the return type: `run` requires the same trait, and rustc
    // reports a failed bound once per span, so a bad return type gives one
    // error, not a second one pointing at the attribute.
    let run_call = call(
        quote!(#private::#run),
        quote! {
            #lease, #on_lost, async move {
                #pin_output
                #(#stmts)*
            }
        },
        ret_span,
    );
    quote_spanned!(ret_span=> #run_call.await)
}

/// `KeyBuilder::new().lit("export:").value(&tenant).finish()`.
fn key_expr(private: &TokenStream, template: &Template) -> TokenStream {
    let parts = template.parts.iter().map(|part| match part {
        Part::Lit(text) => quote!(.lit(#text)),
        Part::Value(value) => quote!(.value(#value)),
    });
    quote!(#private::KeyBuilder::new() #(#parts)* .finish())
}

/// `LockOptions::new(ttl)` and a setter for each option given.
fn options_expr(private: &TokenStream, lock: &Lock) -> TokenStream {
    let ttl = duration(private, lock.ttl);
    let mut setters = Vec::new();
    if let Some(backend) = &lock.backend {
        setters.push(quote!(.backend(#backend)));
    }
    if let Some(wait) = lock.wait {
        let wait = duration(private, wait);
        setters.push(quote!(.wait(#wait)));
    }
    if let Some(renew) = lock.renew {
        setters.push(quote!(.renew(#renew)));
    }
    if lock.fair {
        setters.push(quote!(.fair(true)));
    }
    if lock.shared {
        setters.push(quote!(.mode(#private::LockMode::Shared)));
    }
    if let Some(permits) = lock.permits {
        setters.push(quote!(.permits(#permits)));
    }
    if let Some(min_hold) = lock.min_hold {
        let min_hold = duration(private, min_hold);
        setters.push(quote!(.min_hold(#min_hold)));
    }
    quote!(#private::LockOptions::new(#ttl) #(#setters)*)
}

fn duration(private: &TokenStream, duration: Duration) -> TokenStream {
    let secs = duration.as_secs();
    let nanos = duration.subsec_nanos();
    quote!(#private::Duration::new(#secs, #nanos))
}

/// Whether a type mentions `impl Trait` anywhere.
fn mentions_impl(tokens: TokenStream) -> bool {
    tokens.into_iter().any(|token| match token {
        TokenTree::Ident(ident) => ident == "impl",
        TokenTree::Group(group) => mentions_impl(group.stream()),
        _ => false,
    })
}

/// `path(args)`, the call (not the arguments) spanned on `span`.
fn call(path: TokenStream, args: TokenStream, span: Span) -> TokenStream {
    let mut args = proc_macro2::Group::new(proc_macro2::Delimiter::Parenthesis, args);
    args.set_span(span);
    let mut call = respan(path, span);
    call.extend([TokenTree::Group(args)]);
    call
}

/// `tokens` with every span set to `span`.
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut token| {
            if let TokenTree::Group(group) = &token {
                let mut inner =
                    proc_macro2::Group::new(group.delimiter(), respan(group.stream(), span));
                inner.set_span(span);
                token = TokenTree::Group(inner);
            } else {
                token.set_span(span);
            }
            token
        })
        .collect()
}

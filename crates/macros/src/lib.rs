//! `#[tool]`: turns a plain `async fn`, or a struct's method, into a typed
//! markov tool.
//!
//! ```
//! use markov_core::tool::{Tool, ToolContext};
//! use markov_macros::tool;
//!
//! /// Adds two integers.
//! #[tool]
//! async fn add(
//!     /// The first summand.
//!     a: i64,
//!     /// The second summand.
//!     b: i64,
//! ) -> i64 {
//!     a + b
//! }
//!
//! assert_eq!(<Add as Tool>::NAME, "add");
//! assert_eq!(Add.description(), "Adds two integers.");
//! ```
//!
//! The function stays as it is. Beside it the attribute writes:
//!
//! - `AddArgs`, a struct with one public field per parameter, deriving
//!   `Deserialize` and `JsonSchema` (so the model is offered its schema); a
//!   parameter's doc comment is its property's `description` in the schema;
//! - `Add`, a unit struct (the function's name in UpperCamelCase) whose
//!   `Tool` implementation calls the function: the tool's name is the
//!   function's name, its description the doc comment.
//!
//! # Tools with dependencies
//!
//! A tool that needs something of the application (a database pool, an
//! HTTP client, the signed-in tenant) is a struct that owns it: put
//! `#[tool]` on an `impl` block of the struct holding one `async fn` that
//! takes `&self`. The struct itself becomes the tool, its fields are the
//! tool's dependencies, and they are given when the agent is built, so a
//! missing one is a compile error rather than a failure when the tool
//! runs:
//!
//! ```
//! use std::collections::HashMap;
//! use markov_core::tool::{DynTool, Erased, Tool};
//! use markov_macros::tool;
//!
//! /// The shop's orders (a database pool in a real application).
//! struct Orders {
//!     statuses: HashMap<u64, String>,
//! }
//!
//! #[tool]
//! impl Orders {
//!     /// Looks up the status of an order.
//!     pub async fn order_status(
//!         &self,
//!         /// The order's number, as printed on the receipt.
//!         order: u64,
//!     ) -> String {
//!         self.statuses.get(&order).cloned().unwrap_or_else(|| "unknown".into())
//!     }
//! }
//!
//! let orders = Orders { statuses: HashMap::from([(7, "shipped".into())]) };
//! assert_eq!(<Orders as Tool>::NAME, "order_status");
//! let erased = Erased::new(orders).unwrap();
//! let schema = &erased.definition().input_schema;
//! assert_eq!(
//!     schema["properties"]["order"]["description"],
//!     "The order's number, as printed on the receipt."
//! );
//! ```
//!
//! The tool's name is the method's, its description the method's doc
//! comment, and its public arguments struct is named after the struct
//! (`OrdersArgs`). Other methods of the struct go in another `impl` block.
//!
//! # Context, results and options
//!
//! A first parameter (after `&self`) of type `&ToolContext<'_>` receives
//! the call's context (the node's state, the history, the call's
//! idempotency key). A function returning `Result<T, E>` fails with `E`;
//! any other return type cannot fail. Options, in any combination:
//!
//! - `#[tool(name = "other_name")]`: the name the model calls it by;
//! - `#[tool(description = "...")]`: instead of the doc comment;
//! - `#[tool(terminal)]`: a successful output is the machine's response for
//!   the turn (the run ends with it, and the model is not called again);
//! - `#[tool(needs_approval)]`: every call waits for the application's
//!   approval (the machine pauses its run until the application decides);
//! - `#[tool(at_most_once)]` / `#[tool(at_least_once)]`: the tool's
//!   `Delivery` contract, what a resumed conversation does with a call
//!   interrupted before its result was recorded: never run it again
//!   (answer it `INTERRUPTED`), or run it again with the same idempotency
//!   key. Unset, a tool that needs approval is at most once, any other at
//!   least once.
//!
//! The generated code names `markov_core`, or `markov::core` in a crate that
//! depends on the `markov` facade instead. `markov-core`'s `macros` feature
//! re-exports this attribute as `markov_core::tool`, so a crate of tools
//! needs that one dependency.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{format_ident, quote};
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{
    Attribute, Expr, ExprLit, FnArg, GenericArgument, ImplItem, Item, ItemFn, ItemImpl, Lit, Meta,
    Pat, PathArguments, ReturnType, Signature, Token, Type, parse_macro_input,
};

/// Options of the attribute.
#[derive(Default)]
struct Options {
    name: Option<String>,
    description: Option<String>,
    needs_approval: bool,
    terminal: bool,
    /// `Some(true)`: `at_most_once`; `Some(false)`: `at_least_once`.
    at_most_once: Option<bool>,
}

const EXPECTED_OPTIONS: &str = "expected `name = \"...\"`, `description = \"...\"`, `terminal`, `needs_approval`, `at_most_once` or `at_least_once`";

impl Parse for Options {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut options = Options::default();
        for meta in Punctuated::<Meta, Token![,]>::parse_terminated(input)? {
            if let Meta::Path(path) = &meta {
                if path.is_ident("needs_approval") {
                    options.needs_approval = true;
                    continue;
                }
                if path.is_ident("terminal") {
                    options.terminal = true;
                    continue;
                }
                for (word, at_most_once) in [("at_most_once", true), ("at_least_once", false)] {
                    if !path.is_ident(word) {
                        continue;
                    }
                    if options.at_most_once.is_some_and(|set| set != at_most_once) {
                        return Err(syn::Error::new_spanned(
                            path,
                            "`at_most_once` and `at_least_once` exclude each other",
                        ));
                    }
                    options.at_most_once = Some(at_most_once);
                }
                if path.is_ident("at_most_once") || path.is_ident("at_least_once") {
                    continue;
                }
            }
            let Meta::NameValue(nv) = &meta else {
                return Err(syn::Error::new_spanned(meta, EXPECTED_OPTIONS));
            };
            let Expr::Lit(ExprLit {
                lit: Lit::Str(value),
                ..
            }) = &nv.value
            else {
                return Err(syn::Error::new_spanned(&nv.value, "expected a string"));
            };
            if nv.path.is_ident("name") {
                options.name = Some(value.value());
            } else if nv.path.is_ident("description") {
                options.description = Some(value.value());
            } else {
                return Err(syn::Error::new_spanned(
                    &nv.path,
                    format!("unknown option: {EXPECTED_OPTIONS}"),
                ));
            }
        }
        Ok(options)
    }
}

/// Turns an `async fn`, or an `impl` block's one `async fn(&self, ..)`,
/// into a tool; see the crate documentation.
#[proc_macro_attribute]
pub fn tool(attr: TokenStream, item: TokenStream) -> TokenStream {
    let options = parse_macro_input!(attr as Options);
    let item = parse_macro_input!(item as Item);
    let expanded = match item {
        Item::Fn(function) => expand_fn(options, function),
        Item::Impl(block) => expand_impl(options, block),
        other => Err(syn::Error::new_spanned(
            other,
            "#[tool] goes on an `async fn`, or on an `impl` block with one `async fn(&self, ..)`",
        )),
    };
    expanded
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

/// The path of markov-core in the calling crate.
fn core_path() -> TokenStream2 {
    use proc_macro_crate::{FoundCrate, crate_name};
    match (crate_name("markov-core"), crate_name("markov")) {
        // markov-core names itself `markov_core` (`extern crate self`), which
        // also works in its doc tests, where `crate` would be the test.
        (Ok(FoundCrate::Itself), _) => quote!(::markov_core),
        (Ok(FoundCrate::Name(name)), _) => {
            let name = format_ident!("{name}");
            quote!(::#name)
        }
        (Err(_), Ok(FoundCrate::Name(name))) => {
            let name = format_ident!("{name}");
            quote!(::#name::core)
        }
        _ => quote!(::markov_core),
    }
}

fn upper_camel(snake: &str) -> String {
    snake
        .split('_')
        .filter(|part| !part.is_empty())
        .map(|part| {
            let mut chars = part.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_uppercase().chain(chars).collect()
            })
        })
        .collect()
}

/// Whether `ty` is `&ToolContext<..>`.
fn is_context(ty: &Type) -> bool {
    let Type::Reference(reference) = ty else {
        return false;
    };
    let Type::Path(path) = &*reference.elem else {
        return false;
    };
    path.path
        .segments
        .last()
        .is_some_and(|s| s.ident == "ToolContext")
}

/// `T` and `E` of a `Result<T, E>` return type.
fn result_types(ty: &Type) -> Option<(Type, Type)> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    if last.ident != "Result" {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    let mut types = args.args.iter().filter_map(|a| match a {
        GenericArgument::Type(t) => Some(t.clone()),
        _ => None,
    });
    Some((types.next()?, types.next()?))
}

fn doc_text(attrs: &[Attribute]) -> String {
    let lines: Vec<String> = attrs
        .iter()
        .filter(|a| a.path().is_ident("doc"))
        .filter_map(|a| match &a.meta {
            Meta::NameValue(nv) => match &nv.value {
                Expr::Lit(ExprLit {
                    lit: Lit::Str(s), ..
                }) => Some(s.value().trim().to_owned()),
                _ => None,
            },
            _ => None,
        })
        .collect();
    lines.join("\n").trim().to_owned()
}

/// What the tool's `call` needs of the function's signature.
struct Parameters {
    /// Whether the first parameter (after any `self`) is the context.
    takes_context: bool,
    /// The fields of the arguments struct, each with its parameter's docs.
    fields: Vec<TokenStream2>,
    /// The parameters' names, in order.
    names: Vec<syn::Ident>,
}

/// Reads the parameters of `sig` and moves their doc comments off it (the
/// compiler accepts no doc comment on a parameter): they document the
/// arguments struct's fields instead, which the schema shows the model.
fn take_parameters(sig: &mut Signature, method: bool) -> syn::Result<Parameters> {
    let mut parameters = Parameters {
        takes_context: false,
        fields: Vec::new(),
        names: Vec::new(),
    };
    let mut first = true;
    for input in sig.inputs.iter_mut() {
        let arg = match input {
            FnArg::Receiver(receiver) => {
                let by_shared_ref = receiver.reference.is_some()
                    && receiver.mutability.is_none()
                    && receiver.colon_token.is_none();
                if !method || !by_shared_ref {
                    let message = if method {
                        "a #[tool] method takes `&self`"
                    } else {
                        "#[tool] functions take no `self`; put #[tool] on the `impl` block"
                    };
                    return Err(syn::Error::new_spanned(receiver, message));
                }
                continue;
            }
            FnArg::Typed(arg) => arg,
        };
        let (docs, others): (Vec<Attribute>, Vec<Attribute>) = std::mem::take(&mut arg.attrs)
            .into_iter()
            .partition(|a| a.path().is_ident("doc"));
        arg.attrs = others;
        if first && is_context(&arg.ty) {
            first = false;
            parameters.takes_context = true;
            continue;
        }
        first = false;
        let Pat::Ident(pat) = &*arg.pat else {
            return Err(syn::Error::new_spanned(
                &arg.pat,
                "#[tool] parameters must be plain names",
            ));
        };
        let name = &pat.ident;
        let ty = &arg.ty;
        parameters.fields.push(quote!(#(#docs)* pub #name: #ty));
        parameters.names.push(name.clone());
    }
    Ok(parameters)
}

/// The checks every tool function passes, method or not.
fn check_signature(sig: &Signature) -> syn::Result<()> {
    if sig.asyncness.is_none() {
        return Err(syn::Error::new_spanned(
            sig.fn_token,
            "#[tool] needs an `async fn`",
        ));
    }
    if !sig.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(
            &sig.generics,
            "#[tool] functions cannot be generic",
        ));
    }
    Ok(())
}

/// Everything the generated items are made of.
struct ToolParts<'a> {
    core: TokenStream2,
    options: Options,
    /// The type that implements `Tool`.
    tool_type: TokenStream2,
    args_name: syn::Ident,
    args_vis: TokenStream2,
    /// The function, for names and docs.
    sig: &'a Signature,
    fn_attrs: &'a [Attribute],
    parameters: Parameters,
    /// The call of the function, `args` and `cx` in scope, without `.await`.
    invoke: TokenStream2,
}

fn tool_items(parts: ToolParts<'_>) -> TokenStream2 {
    let ToolParts {
        core,
        options,
        tool_type,
        args_name,
        args_vis,
        sig,
        fn_attrs,
        parameters,
        invoke,
    } = parts;
    let tool_name = options.name.unwrap_or_else(|| sig.ident.to_string());
    let description = options.description.unwrap_or_else(|| doc_text(fn_attrs));
    let needs_approval = options.needs_approval;
    let terminal = options.terminal;
    let delivery = match options.at_most_once {
        Some(true) => quote!(::std::option::Option::Some(#core::tool::Delivery::AtMostOnce)),
        Some(false) => quote!(::std::option::Option::Some(#core::tool::Delivery::AtLeastOnce)),
        None => quote!(::std::option::Option::None),
    };
    let fields = &parameters.fields;

    let invoke = quote!(#invoke.await);
    let (output, error, call) = match &sig.output {
        ReturnType::Type(_, ty) => match result_types(ty) {
            Some((ok, err)) => (quote!(#ok), quote!(#err), invoke),
            None => (
                quote!(#ty),
                quote!(::std::convert::Infallible),
                quote!(::std::result::Result::Ok(#invoke)),
            ),
        },
        ReturnType::Default => (
            quote!(()),
            quote!(::std::convert::Infallible),
            quote!(::std::result::Result::Ok(#invoke)),
        ),
    };
    let serde_path = format!("{core}::__private::serde").replace(' ', "");
    let schemars_path = format!("{core}::__private::schemars").replace(' ', "");
    let serde_path = syn::LitStr::new(&serde_path, Span::call_site());
    let schemars_path = syn::LitStr::new(&schemars_path, Span::call_site());
    let args_doc = format!("The arguments of the `{tool_name}` tool.");
    let cx_name = if parameters.takes_context {
        quote!(cx)
    } else {
        quote!(_cx)
    };
    let args_name_in_call = if parameters.names.is_empty() {
        quote!(_args)
    } else {
        quote!(args)
    };

    quote! {
        // Documented for rustdoc only: the schema derive would make the
        // text the schema's description, which tells the model nothing the
        // tool's own description does not. Likewise a parameter without a
        // doc comment has no description: a made-up one would only cost
        // the model tokens.
        #[cfg_attr(doc, doc = #args_doc)]
        #[allow(missing_docs, unreachable_pub, private_interfaces)]
        #[derive(::std::fmt::Debug, #core::__private::serde::Deserialize, #core::__private::schemars::JsonSchema)]
        #[serde(crate = #serde_path)]
        #[schemars(crate = #schemars_path)]
        #args_vis struct #args_name {
            #(#fields),*
        }

        #[#core::async_trait]
        impl #core::tool::Tool for #tool_type {
            const NAME: &'static str = #tool_name;
            const TERMINAL: bool = #terminal;
            const NEEDS_APPROVAL: bool = #needs_approval;
            const DELIVERY: ::std::option::Option<#core::tool::Delivery> = #delivery;
            type Args = #args_name;
            type Output = #output;
            type Error = #error;

            fn description(&self) -> ::std::string::String {
                ::std::string::String::from(#description)
            }

            async fn call(
                &self,
                #args_name_in_call: #args_name,
                #cx_name: &#core::tool::ToolContext<'_>,
            ) -> ::std::result::Result<#output, #error> {
                #call
            }
        }
    }
}

/// The arguments of the call: `cx` if the function takes it, then each field.
fn call_arguments(parameters: &Parameters) -> TokenStream2 {
    let names = &parameters.names;
    let fields = quote!(#(args.#names),*);
    match (parameters.takes_context, names.is_empty()) {
        (true, true) => quote!(cx),
        (true, false) => quote!(cx, #fields),
        (false, _) => fields,
    }
}

fn expand_fn(options: Options, mut function: ItemFn) -> syn::Result<TokenStream2> {
    check_signature(&function.sig)?;
    let parameters = take_parameters(&mut function.sig, false)?;
    let core = core_path();
    let fn_name = &function.sig.ident;
    let struct_name = format_ident!("{}", upper_camel(&fn_name.to_string()));
    let args_name = format_ident!("{}Args", struct_name);
    let tool_name = options.name.clone().unwrap_or_else(|| fn_name.to_string());
    let struct_doc = format!("The `{tool_name}` tool (see [`{fn_name}`]).");
    let vis = &function.vis;
    let arguments = call_arguments(&parameters);
    let items = tool_items(ToolParts {
        core,
        options,
        tool_type: quote!(#struct_name),
        args_name,
        args_vis: quote!(#vis),
        sig: &function.sig,
        fn_attrs: &function.attrs,
        parameters,
        invoke: quote!(#fn_name(#arguments)),
    });
    Ok(quote! {
        #function

        #[doc = #struct_doc]
        #[derive(::std::fmt::Debug, ::std::clone::Clone, ::std::marker::Copy, ::std::default::Default)]
        #vis struct #struct_name;

        #items
    })
}

fn expand_impl(options: Options, mut block: ItemImpl) -> syn::Result<TokenStream2> {
    if let Some((_, path, _)) = &block.trait_ {
        return Err(syn::Error::new_spanned(
            path,
            "#[tool] goes on an inherent `impl` block, not a trait implementation",
        ));
    }
    if !block.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(
            &block.generics,
            "#[tool] cannot implement a tool for a generic type",
        ));
    }
    let Type::Path(self_path) = &*block.self_ty else {
        return Err(syn::Error::new_spanned(
            &block.self_ty,
            "#[tool] needs an `impl` block of a named struct",
        ));
    };
    let Some(type_name) = self_path.path.segments.last().map(|s| s.ident.clone()) else {
        return Err(syn::Error::new_spanned(self_path, "expected a type name"));
    };
    let self_ty = block.self_ty.clone();
    let mut methods = block.items.iter_mut().filter_map(|item| match item {
        ImplItem::Fn(method) => Some(method),
        _ => None,
    });
    let (Some(method), None) = (methods.next(), methods.next()) else {
        return Err(syn::Error::new(
            Span::call_site(),
            "#[tool] on an `impl` block needs exactly one method, the tool's `async fn(&self, ..)`; \
             put other methods in another `impl` block",
        ));
    };
    check_signature(&method.sig)?;
    let parameters = take_parameters(&mut method.sig, true)?;
    if !matches!(method.sig.inputs.first(), Some(FnArg::Receiver(_))) {
        return Err(syn::Error::new_spanned(
            &method.sig,
            "a #[tool] method takes `&self`",
        ));
    }
    let method = method.clone();
    let core = core_path();
    let method_name = &method.sig.ident;
    let arguments = call_arguments(&parameters);
    let items = tool_items(ToolParts {
        core,
        options,
        tool_type: quote!(#self_ty),
        args_name: format_ident!("{}Args", type_name),
        // As public as any struct can be: the type it implements `Tool`
        // for may be public, whatever the method's visibility.
        args_vis: quote!(pub),
        sig: &method.sig,
        fn_attrs: &method.attrs,
        parameters,
        invoke: quote!(self.#method_name(#arguments)),
    });
    Ok(quote! {
        #block

        #items
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_of(attr: TokenStream2, item: TokenStream2) -> String {
        let options: Options = syn::parse2(attr).expect("options");
        let expanded = match syn::parse2::<Item>(item).expect("an item") {
            Item::Fn(function) => expand_fn(options, function),
            Item::Impl(block) => expand_impl(options, block),
            _ => panic!("not a fn or an impl"),
        };
        match expanded {
            Ok(tokens) => panic!("expanded: {tokens}"),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn a_method_must_be_the_blocks_only_one_and_take_a_shared_self() {
        let two = error_of(
            quote!(),
            quote!(impl Db { async fn a(&self) {} fn new() -> Self { Db } }),
        );
        assert!(two.contains("exactly one method"), "{two}");
        let by_mut = error_of(quote!(), quote!(impl Db { async fn a(&mut self) {} }));
        assert!(by_mut.contains("takes `&self`"), "{by_mut}");
        let no_self = error_of(quote!(), quote!(impl Db { async fn a(x: u8) {} }));
        assert!(no_self.contains("takes `&self`"), "{no_self}");
        let for_trait = error_of(quote!(), quote!(impl Clone for Db { async fn a(&self) {} }));
        assert!(for_trait.contains("inherent"), "{for_trait}");
        let not_async = error_of(quote!(), quote!(impl Db { fn a(&self) {} }));
        assert!(not_async.contains("async fn"), "{not_async}");
    }

    #[test]
    fn a_function_takes_no_self_and_options_are_checked() {
        let with_self = error_of(
            quote!(),
            quote!(
                async fn a(&self) {}
            ),
        );
        assert!(with_self.contains("on the `impl` block"), "{with_self}");
        let unknown = syn::parse2::<Options>(quote!(finish))
            .err()
            .map(|e| e.to_string());
        assert!(unknown.is_some_and(|e| e.contains("`terminal`")));
        let options: Options =
            syn::parse2(quote!(terminal, needs_approval, name = "n")).expect("options");
        assert!(options.terminal && options.needs_approval);
        assert_eq!(options.name.as_deref(), Some("n"));
        assert_eq!(options.at_most_once, None, "unset unless written");
        let once: Options = syn::parse2(quote!(at_most_once)).expect("options");
        assert_eq!(once.at_most_once, Some(true));
        let again: Options = syn::parse2(quote!(needs_approval, at_least_once)).expect("options");
        assert_eq!(again.at_most_once, Some(false));
        let both = syn::parse2::<Options>(quote!(at_most_once, at_least_once))
            .err()
            .map(|e| e.to_string());
        assert!(
            both.is_some_and(|e| e.contains("exclude each other")),
            "contradicting options are an error"
        );
    }
}

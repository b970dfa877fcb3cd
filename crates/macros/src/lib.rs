//! `#[tool]`: turns a plain `async fn` into a typed markov tool.
//!
//! ```
//! use markov_core::tool::{Tool, ToolContext};
//! use markov_macros::tool;
//!
//! /// Adds two integers.
//! #[tool]
//! async fn add(a: i64, b: i64) -> i64 {
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
//!   `Deserialize` and `JsonSchema` (so the model is offered its schema);
//! - `Add`, a unit struct (the function's name in UpperCamelCase) whose
//!   `Tool` implementation calls the function: the tool's name is the
//!   function's name, its description the doc comment.
//!
//! A first parameter of type `&ToolContext<'_>` receives the call's
//! context (state, history, the application's deps). A function returning
//! `Result<T, E>` fails with `E`; any other return type cannot fail. Options:
//! `#[tool(name = "other_name")]`, `#[tool(description = "...")]`, and
//! `#[tool(needs_approval)]`: every call waits for the application's
//! approval (the machine pauses its run until the application decides).
//!
//! The generated code names `markov_core`, or `markov::core` in a crate that
//! depends on the `markov` facade instead.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{format_ident, quote};
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{
    Expr, ExprLit, FnArg, GenericArgument, ItemFn, Lit, Meta, Pat, PathArguments, ReturnType,
    Token, Type, parse_macro_input,
};

/// Options of the attribute.
#[derive(Default)]
struct Options {
    name: Option<String>,
    description: Option<String>,
    needs_approval: bool,
}

impl Parse for Options {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut options = Options::default();
        for meta in Punctuated::<Meta, Token![,]>::parse_terminated(input)? {
            if let Meta::Path(path) = &meta
                && path.is_ident("needs_approval")
            {
                options.needs_approval = true;
                continue;
            }
            let Meta::NameValue(nv) = &meta else {
                return Err(syn::Error::new_spanned(
                    meta,
                    "expected `name = \"...\"`, `description = \"...\"` or `needs_approval`",
                ));
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
                    "unknown option: expected `name`, `description` or `needs_approval`",
                ));
            }
        }
        Ok(options)
    }
}

/// Turns an `async fn` into a tool; see the crate documentation.
#[proc_macro_attribute]
pub fn tool(attr: TokenStream, item: TokenStream) -> TokenStream {
    let options = parse_macro_input!(attr as Options);
    let function = parse_macro_input!(item as ItemFn);
    expand(options, function)
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

/// The path of markov-core in the calling crate.
fn core_path() -> TokenStream2 {
    use proc_macro_crate::{FoundCrate, crate_name};
    match (crate_name("markov-core"), crate_name("markov")) {
        (Ok(FoundCrate::Itself), _) => quote!(crate),
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

fn doc_text(function: &ItemFn) -> String {
    let lines: Vec<String> = function
        .attrs
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

fn expand(options: Options, function: ItemFn) -> syn::Result<TokenStream2> {
    let sig = &function.sig;
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
    let core = core_path();
    let vis = &function.vis;
    let fn_name = &sig.ident;
    let tool_name = options.name.unwrap_or_else(|| fn_name.to_string());
    let struct_name = format_ident!("{}", upper_camel(&fn_name.to_string()));
    let args_name = format_ident!("{}Args", struct_name);
    let description = options.description.unwrap_or_else(|| doc_text(&function));
    let needs_approval = options.needs_approval;

    let mut takes_context = false;
    let mut fields = Vec::new();
    let mut names = Vec::new();
    for (index, input) in sig.inputs.iter().enumerate() {
        let FnArg::Typed(arg) = input else {
            return Err(syn::Error::new_spanned(
                input,
                "#[tool] functions take no `self`",
            ));
        };
        if index == 0 && is_context(&arg.ty) {
            takes_context = true;
            continue;
        }
        let Pat::Ident(pat) = &*arg.pat else {
            return Err(syn::Error::new_spanned(
                &arg.pat,
                "#[tool] parameters must be plain names",
            ));
        };
        let name = &pat.ident;
        let ty = &arg.ty;
        fields.push(quote!(pub #name: #ty));
        names.push(name.clone());
    }

    let (output, error, call) = {
        let args = quote!(#(args.#names),*);
        let invoke = if takes_context {
            if names.is_empty() {
                quote!(#fn_name(cx).await)
            } else {
                quote!(#fn_name(cx, #args).await)
            }
        } else {
            quote!(#fn_name(#args).await)
        };
        match &sig.output {
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
        }
    };
    let serde_path = format!("{core}::__private::serde").replace(' ', "");
    let schemars_path = format!("{core}::__private::schemars").replace(' ', "");
    let serde_path = syn::LitStr::new(&serde_path, Span::call_site());
    let schemars_path = syn::LitStr::new(&schemars_path, Span::call_site());
    let args_doc = format!("The arguments of the `{tool_name}` tool.");
    let struct_doc = format!("The `{tool_name}` tool (see [`{fn_name}`]).");
    let cx_name = if takes_context {
        quote!(cx)
    } else {
        quote!(_cx)
    };

    Ok(quote! {
        #function

        #[doc = #args_doc]
        #[derive(::std::fmt::Debug, #core::__private::serde::Deserialize, #core::__private::schemars::JsonSchema)]
        #[serde(crate = #serde_path)]
        #[schemars(crate = #schemars_path)]
        #vis struct #args_name {
            #(#fields),*
        }

        #[doc = #struct_doc]
        #[derive(::std::fmt::Debug, ::std::clone::Clone, ::std::marker::Copy, ::std::default::Default)]
        #vis struct #struct_name;

        impl #core::tool::Tool for #struct_name {
            const NAME: &'static str = #tool_name;
            const NEEDS_APPROVAL: bool = #needs_approval;
            type Args = #args_name;
            type Output = #output;
            type Error = #error;

            fn description(&self) -> ::std::string::String {
                ::std::string::String::from(#description)
            }

            async fn call(
                &self,
                args: #args_name,
                #cx_name: &#core::tool::ToolContext<'_>,
            ) -> ::std::result::Result<#output, #error> {
                #call
            }
        }
    })
}

//! `#[derive(Module)]` for Voltaic (re-exported as `voltaic::nn::Module`).
//!
//! The derive visits every field of a struct, in declaration order, under its
//! field name (tuple fields under their index), so a model's tensors get the
//! dotted names of PyTorch's `state_dict`: `encoder.layer.0.attention.weight`.
//! Every field must itself be a `Module`: a `Parameter`, a layer, a `Vec`,
//! `Option`, `Box` or array of modules, or a plain value (numbers, `bool`,
//! `String`, `DType`, `Device`, ...) which holds no tensors. A bare `Tensor`
//! field is a compile error: wrap it in `Parameter::new` (trained) or
//! `Parameter::buffer` (saved, not trained), or mark it `#[module(skip)]`.
//!
//! Field attributes: `#[module(skip)]` leaves a field out; `#[module(rename
//! = "name")]` visits it under another name (e.g. a checkpoint's spelling).

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{parse_macro_input, Data, DeriveInput, Fields, LitStr};

/// Implements `voltaic::nn::Module` by visiting every field (see the crate docs).
#[proc_macro_derive(Module, attributes(module))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    match expand(&input) {
        Ok(t) => t.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

/// What a field's `#[module(...)]` attributes ask for.
struct FieldOpts {
    skip: bool,
    rename: Option<String>,
}

fn field_opts(field: &syn::Field) -> syn::Result<FieldOpts> {
    let mut opts = FieldOpts { skip: false, rename: None };
    for attr in field.attrs.iter().filter(|a| a.path().is_ident("module")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("skip") {
                opts.skip = true;
                Ok(())
            } else if meta.path.is_ident("rename") {
                opts.rename = Some(meta.value()?.parse::<LitStr>()?.value());
                Ok(())
            } else {
                Err(meta.error("expected `skip` or `rename = \"name\"` in #[module(...)]"))
            }
        })?;
    }
    Ok(opts)
}

fn expand(input: &DeriveInput) -> syn::Result<Tokens> {
    let Data::Struct(data) = &input.data else {
        return Err(syn::Error::new(input.ident.span(), "#[derive(Module)] supports structs; implement `voltaic::nn::Module` by hand for enums and unions"));
    };
    let mut visits = Vec::new();
    let mut trainings = Vec::new();
    let mut bounds = Vec::new();
    let members: Vec<(syn::Member, &syn::Field)> = match &data.fields {
        Fields::Named(f) => f.named.iter().map(|f| (syn::Member::Named(f.ident.clone().expect("named field")), f)).collect(),
        Fields::Unnamed(f) => f.unnamed.iter().enumerate().map(|(i, f)| (syn::Member::Unnamed(i.into()), f)).collect(),
        Fields::Unit => vec![],
    };
    for (member, field) in members {
        let opts = field_opts(field)?;
        if opts.skip {
            continue;
        }
        let name = opts.rename.unwrap_or_else(|| match &member {
            syn::Member::Named(id) => id.to_string().trim_start_matches("r#").to_string(),
            syn::Member::Unnamed(i) => i.index.to_string(),
        });
        let ty = &field.ty;
        // Spanned at the field's type, so a field that is not a module is
        // reported there (with the trait's hint), not at the derive.
        visits.push(quote_spanned! {ty.span()=>
            <#ty as ::voltaic::nn::Module>::visit_tensors(&self.#member, &::voltaic::nn::join_name(prefix, #name), f);
        });
        trainings.push(quote_spanned! {ty.span()=>
            <#ty as ::voltaic::nn::Module>::set_training(&self.#member, training);
        });
        bounds.push(quote! { #ty: ::voltaic::nn::Module });
    }
    let ident = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    // Generic structs need each field's type bounded; plain ones are checked per field.
    let where_tokens = if input.generics.type_params().next().is_some() {
        let existing = where_clause.map(|w| {
            let p = &w.predicates;
            quote! { #p, }
        });
        quote! { where #existing #(#bounds,)* }
    } else {
        quote! { #where_clause }
    };
    Ok(quote! {
        impl #impl_generics ::voltaic::nn::Module for #ident #ty_generics #where_tokens {
            #[allow(unused_variables)]
            fn visit_tensors(&self, prefix: &str, f: &mut dyn FnMut(::std::string::String, &::voltaic::nn::Parameter)) {
                #(#visits)*
            }
            #[allow(unused_variables)]
            fn set_training(&self, training: bool) {
                #(#trainings)*
            }
        }
    })
}

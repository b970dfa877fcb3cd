//! The API as an OpenAPI document, from the routes themselves: each
//! documented route is declared once, with its handler's annotation, so
//! the document and the router cannot drift.

use std::sync::OnceLock;

use utoipa::OpenApi;
use utoipa::openapi::security::{ApiKey, ApiKeyValue, Http, HttpAuthScheme, SecurityScheme};

use crate::api;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "markov-server",
        description = "markov's agents over HTTP: sessions, streamed runs, approvals. \
            Every route but `/healthz` and `/auth/session` takes a credential: \
            `Authorization: Bearer` with an API key or a token, or the sign-in cookie \
            (whose unsafe requests carry the page's `Origin`). Errors are JSON \
            `{\"error\": ...}`; a run's events are server-sent events, each a `RunEvent`."
    ),
    components(schemas(api::DecisionBody))
)]
struct Document;

/// The document.
pub(crate) fn openapi() -> utoipa::openapi::OpenApi {
    let (_, mut public) = api::public_routes().split_for_parts();
    // No credential: an empty list of requirements, not the global one.
    for item in public.paths.paths.values_mut() {
        for operation in operations(item) {
            operation.security = Some(Vec::new());
        }
    }
    let (_, protected) = api::protected_routes().split_for_parts();
    let mut document = Document::openapi();
    document.merge(public);
    document.merge(protected);
    let components = document.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
    );
    components.add_security_scheme(
        "cookie",
        SecurityScheme::ApiKey(ApiKey::Cookie(ApiKeyValue::with_description(
            crate::guard::COOKIE,
            "The browser's sign-in (`POST /auth/session`)",
        ))),
    );
    use utoipa::openapi::security::SecurityRequirement;
    document.security = Some(vec![
        SecurityRequirement::new("bearer", Vec::<String>::new()),
        SecurityRequirement::new("cookie", Vec::<String>::new()),
    ]);
    document
}

/// The operations of a path.
fn operations(
    item: &mut utoipa::openapi::PathItem,
) -> impl Iterator<Item = &mut utoipa::openapi::path::Operation> {
    [
        item.get.as_mut(),
        item.put.as_mut(),
        item.post.as_mut(),
        item.delete.as_mut(),
        item.options.as_mut(),
        item.head.as_mut(),
        item.patch.as_mut(),
        item.trace.as_mut(),
    ]
    .into_iter()
    .flatten()
}

/// The document, as JSON (made once).
pub(crate) fn document() -> String {
    static JSON: OnceLock<String> = OnceLock::new();
    JSON.get_or_init(|| {
        openapi()
            .to_pretty_json()
            .unwrap_or_else(|e| format!("{{\"error\": \"the document does not serialize: {e}\"}}"))
    })
    .clone()
}

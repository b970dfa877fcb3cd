//! The API as an OpenAPI document, from the handlers' own annotations.

use utoipa::OpenApi;

use crate::api;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "markov-server",
        description = "markov's agents over HTTP: sessions, streamed runs, approvals."
    ),
    paths(
        api::health,
        api::sign_in,
        api::sign_out,
        api::me,
        api::agents,
        api::create_default,
        api::list_all,
        api::create_for,
        api::list_for,
        api::show,
        api::message,
        api::events,
        api::cancel,
        api::approvals,
        api::decide,
        api::command,
        api::openapi,
        api::metrics,
    ),
    components(schemas(api::SignIn, api::UserText, api::DecisionBody, api::CommandRequest)),
    modifiers(&Security)
)]
struct Document;

/// Every route but the public ones takes a bearer credential.
struct Security;

impl utoipa::Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
        openapi.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new(
            "bearer",
            Vec::<String>::new(),
        )]);
    }
}

/// The document, as JSON.
pub(crate) fn document() -> String {
    Document::openapi()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"the document does not serialize: {e}\"}}"))
}

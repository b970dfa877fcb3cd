//! The Gemini API client (`generateContent` / `streamGenerateContent`).
//!
//! [`Gemini`] implements [`Model`](markov_core::model::Model) over
//! `POST {base}/v1beta/models/{model}:generateContent` and, streamed,
//! `:streamGenerateContent?alt=sse`; the key goes in the `x-goog-api-key`
//! header, never in the URL. How markov's types map to the API:
//!
//! - **System prompt** → `systemInstruction` (left out when empty).
//! - **Messages** → `contents` (`user` / `model`, consecutive contents of
//!   one role merged): text, images (`inlineData`), files and outputs as
//!   text; a tool result → a `functionResponse` part (the call's id, its
//!   function's name found in the history, `{"content": ..}` or, for an
//!   error, `{"error": ..}`) before the rest of its message; a call → a
//!   `functionCall` part (`id` when the model gave one); a `system`
//!   message with text → a user text part starting with
//!   `[System instruction] ` (the API has no mid-conversation system role);
//!   `command` and `instance` are skipped.
//! - **Thinking**: `thinkingConfig` (`thinkingBudget`: the budget, or -1
//!   for adaptive; `includeThoughts`); thought summaries come back as
//!   thinking items, and every thought signature is kept in the history
//!   and sent back on the part it came with (see the module `wire`).
//! - **Tools** → one `functionDeclarations` list, each tool's parameters
//!   converted to Gemini's schema dialect ([`SchemaError`] names what it
//!   cannot express; [`Model::check_tools`](markov_core::model::Model::check_tools) tells when an agent is built,
//!   [`check_tools`] without a client). **Tool choice**
//!   → `functionCallingConfig.mode` `AUTO`, `ANY` or `NONE`; a named tool
//!   → `ANY` with `allowedFunctionNames: [name]`.
//! - **Structured output** → `responseMimeType: application/json` and
//!   `responseSchema` (converted) on a call without tools; next to tools,
//!   the output tool (Gemini refuses a response schema beside function
//!   declarations; see [the crate docs](crate#structured-output-with-tools)).
//! - **Answer**: `finishReason` `STOP` → end_turn or tool_use, `MAX_TOKENS`
//!   → max_tokens, the safety reasons → content_filter, a malformed call →
//!   an invalid-response error. Usage: `promptTokenCount` less the cached
//!   tokens; thoughts count as output.
//!
//! **Token counts** ([`Model::count_tokens`](markov_core::model::Model::count_tokens)) → `POST
//! {base}/v1beta/models/{model}:countTokens` with the call's body as
//! `generateContentRequest` (naming `models/{model}`), so the system
//! instruction and the tools are counted; the answer's `totalTokens`.
//!
//! Gemini has no compaction or context editing of its own: a context
//! policy (`ContextPolicy` in `markov-charter`) is how a long
//! conversation stays within its window.
//!
//! Every request encodes the whole conversation: a function response
//! names its function, found by a lookup over the history, so the
//! request-body cache of the other clients does not apply.

mod schema;
mod stream;
mod wire;

use std::borrow::Cow;
use std::fmt;

use markov_core::{
    ModelError, ModelRequest, ModelResponse, StreamEvent, ToolDefinition, Unsupported,
};
use reqwest::Url;

pub use schema::SchemaError;

use crate::client::{Client, ClientBuilder, Parts, Purpose, Vendor, not_offered};
use crate::error::ConfigError;
use crate::output::StructuredOutput;
use crate::transport::endpoint;

/// Google's address.
pub const DEFAULT_BASE_URL: &str = "https://generativelanguage.googleapis.com";

/// The model used when neither the client nor the request names one.
pub const DEFAULT_MODEL: &str = "gemini-2.5-flash";

/// The environment variable holding the API key.
pub const API_KEY_ENV: &str = "GEMINI_API_KEY";

/// The environment variable holding another address (a proxy, a local
/// server that speaks the API).
pub const BASE_URL_ENV: &str = "GEMINI_BASE_URL";

/// Checks, at build time, that Gemini can be offered `tools`: each one's
/// parameters convert to its schema dialect (a request offering one that
/// does not is refused before it is sent, with the same error).
///
/// ```
/// use markov_core::ToolDefinition;
/// use serde_json::json;
///
/// let map = ToolDefinition::new(
///     "tag",
///     "Tags things.",
///     json!({"type": "object", "properties": {"tags": {"type": "object", "additionalProperties": {"type": "string"}}}}),
/// )
/// .unwrap();
/// let error = markov_providers::gemini::check_tools(&[map]).unwrap_err();
/// assert_eq!(error.path, "#/properties/tags/additionalProperties");
/// ```
///
/// # Errors
/// The first [`SchemaError`], naming the tool and the place in its schema.
pub fn check_tools(tools: &[ToolDefinition]) -> Result<(), SchemaError> {
    wire::check_tools(tools)
}

/// Renders tool definitions in this API's format
/// (`[{"functionDeclarations": [...]}]`).
///
/// # Errors
/// A [`SchemaError`] for a tool whose parameters Gemini cannot express.
pub fn tool_schemas(tools: &[ToolDefinition]) -> Result<serde_json::Value, SchemaError> {
    wire::tool_schemas(tools)
}

/// The Gemini API's part of a client: see [`Gemini`].
#[derive(Clone)]
pub struct GeminiVendor {
    /// `{base}/v1beta/models`, under which each model's methods are.
    models: Url,
    schema_with_tools: bool,
}

impl fmt::Debug for GeminiVendor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GeminiVendor")
            .field("schema_with_tools", &self.schema_with_tools)
            .finish_non_exhaustive()
    }
}

/// A client of the Gemini API.
///
/// Built by [`Gemini::builder`] or [`Gemini::from_env`]; cheap to clone.
/// Its `Debug` output never shows the API key. The setters and methods
/// every client has are [`Client`]'s and [`ClientBuilder`]'s; its
/// `request_body` is the same for a streamed call.
pub type Gemini = Client<GeminiVendor>;

/// Configures a [`Gemini`] client.
pub type GeminiBuilder = ClientBuilder<GeminiVendor>;

impl GeminiVendor {
    /// The URL of `model`'s `method` (`?alt=sse` when `stream`).
    fn method_url(&self, model: &str, method: &str, stream: bool) -> Url {
        let model = model.strip_prefix("models/").unwrap_or(model);
        let mut url = self.models.clone();
        if let Ok(mut segments) = url.path_segments_mut() {
            segments.push(&format!("{model}:{method}"));
        }
        if stream {
            url.set_query(Some("alt=sse"));
        }
        url
    }
}

impl Vendor for GeminiVendor {
    type Options = ();
    type Decoder = stream::Decoder;
    const NAME: &'static str = "Gemini";
    const PROVIDER: &'static str = "gcp.gemini";
    const DEFAULT_BASE_URL: &'static str = DEFAULT_BASE_URL;
    const DEFAULT_MODEL: &'static str = DEFAULT_MODEL;
    const API_KEY_ENV: &'static str = API_KEY_ENV;
    const BASE_URL_ENV: &'static str = BASE_URL_ENV;
    const HOST: &'static str = "generativelanguage.googleapis.com";
    const KEY_HEADER: (&'static str, &'static str) = ("x-goog-api-key", "");
    const MODELS_PATH: &'static str = "v1beta/models";
    const ASKS_SERVED_FACTS: bool = false;

    /// Gemini's schema field beside tools is refused on most models:
    /// [`StructuredOutput::Auto`] is the output tool here.
    fn build(parts: Parts<'_, ()>) -> Result<Self, ConfigError> {
        Ok(GeminiVendor {
            models: endpoint(parts.base, "v1beta/models"),
            schema_with_tools: parts.structured_output == StructuredOutput::SchemaField,
        })
    }

    fn schema_with_tools(&self) -> bool {
        self.schema_with_tools
    }

    fn call_url(&self, model: &str, stream: bool) -> Cow<'_, Url> {
        let method = if stream {
            "streamGenerateContent"
        } else {
            "generateContent"
        };
        Cow::Owned(self.method_url(model, method, stream))
    }

    /// `countTokens`, free of charge at Google.
    fn count_url(&self, _request: &ModelRequest<'_>, model: &str) -> Option<Url> {
        Some(self.method_url(model, "countTokens", false))
    }

    fn encode(
        &self,
        request: &ModelRequest<'_>,
        model: &str,
        purpose: Purpose,
        _cached: bool,
    ) -> Result<Vec<u8>, ModelError> {
        match purpose {
            Purpose::Call { .. } => wire::encode(request, self.schema_with_tools),
            Purpose::Count => wire::encode_count(request, model, self.schema_with_tools),
            Purpose::Compact => Err(not_offered(Self::NAME, purpose)),
        }
    }

    fn decode(&self, body: &[u8]) -> Result<ModelResponse, ModelError> {
        stream::decode(body)
    }

    fn decode_count(&self, body: &str) -> Result<u64, ModelError> {
        wire::decode_count(body)
    }

    fn served_model(listed: String) -> String {
        listed
            .strip_prefix("models/")
            .map(str::to_owned)
            .unwrap_or(listed)
    }

    /// Refuses a tool whose parameters, or an output type whose schema,
    /// Gemini's schema dialect cannot express (see [`SchemaError`]): a
    /// request offering it would be refused before it is sent.
    fn check_tools(
        &self,
        tools: &[ToolDefinition],
        output_schema: Option<&serde_json::Value>,
    ) -> Result<(), Unsupported> {
        for tool in tools {
            wire::check_tools(std::slice::from_ref(tool))
                .map_err(|error| Unsupported::tool(tool.name.clone(), error.to_string()))?;
        }
        match output_schema {
            Some(schema) => wire::check_output(schema)
                .map_err(|error| Unsupported::output_type(error.to_string())),
            None => Ok(()),
        }
    }
}

impl Gemini {
    /// The exact body this client sends to count `request`'s input tokens
    /// (`countTokens`): the call's body as `generateContentRequest`.
    ///
    /// # Errors
    /// As [`Client::request_body`].
    pub fn count_body(&self, request: &ModelRequest<'_>) -> Result<Vec<u8>, ModelError> {
        self.body(request, Purpose::Count)
    }
}

/// Decodes a recorded `streamGenerateContent?alt=sse` body with the
/// client's own decoder: the [`StreamEvent`]s a streamed call would have
/// yielded, ending with [`StreamEvent::Done`].
///
/// # Errors
/// What a streamed call would fail with.
pub fn replay_stream(body: &[u8]) -> Result<Vec<StreamEvent>, ModelError> {
    crate::client::replay::<GeminiVendor>(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_the_model_and_never_the_key() {
        let keyed = |name: &str| (name == API_KEY_ENV).then(|| "AIza-secret".into());
        let client = GeminiBuilder::from_env_with(&keyed)
            .unwrap()
            .build()
            .unwrap();
        assert_eq!(
            client.vendor.call_url("gemini-2.5-pro", false).as_str(),
            "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-pro:generateContent"
        );
        assert_eq!(
            client
                .vendor
                .call_url("models/gemini-2.5-pro", true)
                .as_str(),
            "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"
        );
        assert!(!format!("{client:?}").contains("AIza-secret"));
        assert!(client.is_vendor());
        assert!(matches!(
            Gemini::builder().build(),
            Err(ConfigError::MissingApiKey)
        ));
    }
}

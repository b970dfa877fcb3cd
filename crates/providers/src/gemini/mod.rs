//! The Gemini API client (`generateContent` / `streamGenerateContent`).
//!
//! [`Gemini`] implements [`Model`] over
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
//!   cannot express; [`Model::check_tools`] tells when an agent is built,
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
//! **Token counts** ([`Model::count_tokens`]) → `POST
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

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use markov_core::model::InputTokenCount;
use markov_core::{
    Model, ModelError, ModelRequest, ModelResponse, StreamEvent, ToolDefinition, Unsupported,
};
use reqwest::Url;
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderValue};
use tracing::Instrument;

pub use schema::SchemaError;

use crate::error::ConfigError;
use crate::limits::Limits;
use crate::output::{Plan, StructuredOutput};
use crate::sse::{log_done, sse_stream};
use crate::transport::{
    self, ApiKey, Transport, TransportConfig, check_status, endpoint, transport_error,
};

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

/// A client of the Gemini API.
///
/// Built by [`Gemini::builder`] or [`Gemini::from_env`]; cheap to clone.
/// Its `Debug` output never shows the API key.
#[derive(Clone)]
pub struct Gemini {
    transport: Transport,
    base: Url,
    model: String,
    schema_with_tools: bool,
}

impl fmt::Debug for Gemini {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gemini")
            .field("base", &transport::redact_url(self.base.as_str()))
            .field("model", &self.model)
            .field("api_key", &"<redacted>")
            .finish_non_exhaustive()
    }
}

/// Configures a [`Gemini`] client.
#[derive(Clone)]
pub struct GeminiBuilder {
    api_key: Option<ApiKey>,
    base_url: String,
    base_url_var: Option<&'static str>,
    model: String,
    structured_output: StructuredOutput,
    transport: TransportConfig,
}

impl fmt::Debug for GeminiBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GeminiBuilder")
            .field("api_key", &self.api_key)
            .field("base_url", &transport::redact_url(&self.base_url))
            .field("model", &self.model)
            .field("structured_output", &self.structured_output)
            .field("transport", &self.transport)
            .finish()
    }
}

impl Default for GeminiBuilder {
    fn default() -> Self {
        GeminiBuilder {
            api_key: None,
            base_url: DEFAULT_BASE_URL.to_owned(),
            base_url_var: None,
            model: DEFAULT_MODEL.to_owned(),
            structured_output: StructuredOutput::default(),
            transport: TransportConfig::DEFAULT,
        }
    }
}

impl GeminiBuilder {
    /// A builder from `GEMINI_API_KEY` and `GEMINI_BASE_URL`; the key is
    /// required unless a base URL is set.
    ///
    /// # Errors
    /// [`ConfigError::MissingEnv`] naming `GEMINI_API_KEY` when neither
    /// variable is set.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_env_with(&transport::process_env)
    }

    fn from_env_with(env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let key = transport::env_var(env, API_KEY_ENV);
        let base = transport::env_var(env, BASE_URL_ENV);
        if key.is_none() && base.is_none() {
            return Err(ConfigError::MissingEnv { var: API_KEY_ENV });
        }
        let mut builder = Self::default();
        if let Some(key) = key {
            builder = builder.api_key(key);
        }
        if let Some(base) = base {
            builder = builder.base_url(base);
            builder.base_url_var = Some(BASE_URL_ENV);
        }
        Ok(builder)
    }

    /// Sets the API key (sent as `x-goog-api-key`).
    #[must_use]
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(ApiKey::new(key));
        self
    }

    /// Sets the base URL (default [`DEFAULT_BASE_URL`]); requests go to
    /// `{base}/v1beta/models/{model}:generateContent`, so the base URL has
    /// no `/v1beta`.
    #[must_use]
    pub fn base_url(mut self, url: impl Into<String>) -> Self {
        self.base_url = url.into();
        self.base_url_var = None;
        self
    }

    /// Sets the model used when a request's settings name none (default
    /// [`DEFAULT_MODEL`]).
    #[must_use]
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }

    /// Sets how a structured answer is asked for on a call that also
    /// offers tools (default [`StructuredOutput::Auto`], which for Gemini
    /// is the output tool: the API refuses a response schema beside
    /// function declarations on most models).
    #[must_use]
    pub fn structured_output(mut self, mode: StructuredOutput) -> Self {
        self.structured_output = mode;
        self
    }

    /// Sets how many times a failed call is retried (default 2).
    #[must_use]
    pub fn max_retries(mut self, retries: u32) -> Self {
        self.transport.max_retries = retries;
        self
    }

    /// Sets the exponential backoff between retries (defaults 500 ms and 8 s).
    #[must_use]
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.transport.initial_backoff = initial;
        self.transport.max_backoff = max.max(initial);
        self
    }

    /// Sets the client's outgoing limits (default none); see [`Limits`].
    #[must_use]
    pub fn limits(mut self, limits: Limits) -> Self {
        self.transport.limits = limits;
        self
    }

    /// Sets the timeout of one attempt (default 10 minutes).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.transport.timeout = timeout;
        self
    }

    /// Bounds a whole call, streamed or not, retries included (default 10
    /// minutes).
    #[must_use]
    pub fn stream_deadline(mut self, deadline: Duration) -> Self {
        self.transport.deadline = deadline;
        self
    }

    /// The largest server-sent event accepted, in bytes (default 16 MiB,
    /// at least 1).
    #[must_use]
    pub fn max_event_bytes(mut self, bytes: usize) -> Self {
        self.transport.max_event_bytes = bytes.max(1);
        self
    }

    /// Builds the client.
    ///
    /// # Errors
    /// [`ConfigError::MissingApiKey`] without a key for Google's address,
    /// [`ConfigError::InvalidBaseUrl`], [`ConfigError::InvalidApiKey`] or
    /// [`ConfigError::HttpClient`].
    pub fn build(self) -> Result<Gemini, ConfigError> {
        let base = transport::parse_base_url(&self.base_url, self.base_url_var)?;
        let mut headers = HeaderMap::new();
        match &self.api_key {
            Some(key) => {
                headers.insert("x-goog-api-key", key.header("")?);
            }
            None if base.host_str() == Some("generativelanguage.googleapis.com") => {
                return Err(ConfigError::MissingApiKey);
            }
            None => {}
        }
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Ok(Gemini {
            transport: Transport::new(self.transport, &base, headers)?,
            schema_with_tools: self.structured_output == StructuredOutput::SchemaField,
            base,
            model: self.model,
        })
    }
}

impl Gemini {
    /// A builder with the defaults and no key.
    pub fn builder() -> GeminiBuilder {
        GeminiBuilder::default()
    }

    /// A client from `GEMINI_API_KEY` and `GEMINI_BASE_URL`.
    ///
    /// # Errors
    /// As [`GeminiBuilder::from_env`] and [`GeminiBuilder::build`].
    pub fn from_env() -> Result<Self, ConfigError> {
        GeminiBuilder::from_env()?.build()
    }

    /// The URL a call of the default model goes to, redacted.
    pub fn endpoint(&self) -> String {
        transport::redact_url(self.url(&self.model, false).as_str())
    }

    /// The model used when a request names none.
    pub fn default_model(&self) -> &str {
        &self.model
    }

    /// Whether the client talks to Google's own service.
    pub fn is_vendor(&self) -> bool {
        self.base.host_str() == Some("generativelanguage.googleapis.com")
    }

    /// The client with another default model.
    #[must_use]
    pub fn with_default_model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }

    /// The names of the models the server serves (`GET {base}/v1beta/models`,
    /// `models/` left off).
    ///
    /// # Errors
    /// Any error of the call (not retried).
    pub async fn served_models(&self) -> Result<Vec<String>, ModelError> {
        let models = self
            .transport
            .list_models(endpoint(&self.base, "v1beta/models"))
            .await?;
        Ok(models
            .into_iter()
            .map(|m| m.strip_prefix("models/").map(str::to_owned).unwrap_or(m))
            .collect())
    }

    fn model_for<'a>(&'a self, request: &ModelRequest<'a>) -> &'a str {
        request.settings().model.as_deref().unwrap_or(&self.model)
    }

    /// The URL of a call of `model`.
    fn url(&self, model: &str, stream: bool) -> Url {
        let method = if stream {
            "streamGenerateContent"
        } else {
            "generateContent"
        };
        self.method_url(model, method, stream)
    }

    /// The URL of `model`'s `method` (`?alt=sse` when `stream`).
    fn method_url(&self, model: &str, method: &str, stream: bool) -> Url {
        let model = model.strip_prefix("models/").unwrap_or(model);
        let mut url = endpoint(&self.base, "v1beta/models");
        if let Ok(mut segments) = url.path_segments_mut() {
            segments.push(&format!("{model}:{method}"));
        }
        if stream {
            url.set_query(Some("alt=sse"));
        }
        url
    }

    /// The exact body this client sends for `request`.
    ///
    /// # Errors
    /// A request that cannot be sent: no content, a provider built-in
    /// tool, a schema Gemini cannot express.
    pub fn request_body(&self, request: &ModelRequest<'_>) -> Result<Vec<u8>, ModelError> {
        wire::encode(request, self.schema_with_tools)
    }

    /// The exact body this client sends to count `request`'s input tokens
    /// (`countTokens`): the call's body as `generateContentRequest`.
    ///
    /// # Errors
    /// As [`Self::request_body`].
    pub fn count_body(&self, request: &ModelRequest<'_>) -> Result<Vec<u8>, ModelError> {
        wire::encode_count(request, self.model_for(request), self.schema_with_tools)
    }

    async fn post(&self, url: &Url, body: Bytes) -> Result<reqwest::Response, ModelError> {
        let response = self
            .transport
            .client()
            .post(url.clone())
            .body(body)
            .send()
            .await
            .map_err(|e| transport_error(e, self.transport.timeout()))?;
        check_status(response).await
    }
}

/// Decodes a recorded `streamGenerateContent?alt=sse` body with the
/// client's own decoder: the [`StreamEvent`]s a streamed call would have
/// yielded, ending with [`StreamEvent::Done`].
///
/// # Errors
/// What a streamed call would fail with.
pub fn replay_stream(body: &[u8]) -> Result<Vec<StreamEvent>, ModelError> {
    crate::sse::decode_body(
        stream::Decoder::default(),
        body,
        TransportConfig::DEFAULT.max_event_bytes,
    )
}

fn call_span(model: &str) -> tracing::Span {
    tracing::info_span!(
        "provider_request",
        gen_ai.provider.name = "gcp.gemini",
        gen_ai.request.model = model,
        attempt = tracing::field::Empty
    )
}

#[async_trait]
impl Model for Gemini {
    fn provider_name(&self) -> &str {
        "gcp.gemini"
    }

    fn model_name(&self) -> Option<&str> {
        Some(&self.model)
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

    /// Asks `countTokens` (free of charge at Google), under the client's
    /// limits, timeout and retries.
    async fn count_tokens(&self, request: ModelRequest<'_>) -> Result<InputTokenCount, ModelError> {
        let model = self.model_for(&request);
        let span = tracing::info_span!(
            "count_tokens",
            gen_ai.provider.name = "gcp.gemini",
            gen_ai.request.model = model,
            attempt = tracing::field::Empty
        );
        let body = Bytes::from(self.count_body(&request)?);
        let url = self.method_url(model, "countTokens", false);
        let call = async {
            let answer = self
                .transport
                .count(&span, || self.post(&url, body.clone()))
                .await?;
            let tokens = wire::decode_count(&answer)?;
            tracing::debug!(input_tokens = tokens, "counted");
            Ok(InputTokenCount::Counted(tokens))
        };
        call.instrument(span.clone()).await
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let model = self.model_for(&request);
        let span = call_span(model);
        let plan = Plan::of(&request, self.schema_with_tools);
        let body = Bytes::from(self.request_body(&request)?);
        let url = self.url(model, false);
        let call = async {
            let _place = self
                .transport
                .enter(body.len(), request.settings().max_tokens)
                .await?;
            let bytes = self
                .transport
                .with_retries_by_deadline(&span, || async {
                    let response = self.post(&url, body.clone()).await?;
                    response
                        .bytes()
                        .await
                        .map_err(|e| transport_error(e, self.transport.timeout()))
                })
                .await?;
            let answer = stream::decode(&bytes)?;
            crate::convert::check_forced_call(
                !request.tools().is_empty() || plan.tool().is_some(),
                plan.tool_choice(&request),
                &answer,
                || transport::redact_url(url.as_str()),
            )?;
            let response = plan.finish(answer);
            log_done(&response);
            Ok(response)
        };
        call.instrument(span.clone()).await
    }

    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        if Plan::of(&request, self.schema_with_tools).tool().is_some() {
            return crate::output::replayed(self, request);
        }
        let model = self.model_for(&request);
        let span = call_span(model);
        let body = match self.request_body(&request) {
            Ok(body) => Bytes::from(body),
            Err(error) => return futures::stream::once(async { Err(error) }).boxed(),
        };
        let url = self.url(model, true);
        let body_len = body.len();
        let endpoint_url = url.clone();
        let endpoint = move || transport::redact_url(endpoint_url.as_str());
        let connect_span = span.clone();
        let connect = async move {
            self.transport
                .with_retries(&connect_span, || self.post(&url, body.clone()))
                .await
        };
        let stream = sse_stream(
            span,
            *self.transport.config(),
            connect,
            stream::Decoder::default(),
        );
        let stream = self
            .transport
            .limited(body_len, request.settings().max_tokens, stream);
        crate::convert::checked_stream(
            stream,
            !request.tools().is_empty(),
            request.tool_choice(),
            endpoint,
        )
    }
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
            client.url("gemini-2.5-pro", false).as_str(),
            "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-pro:generateContent"
        );
        assert_eq!(
            client.url("models/gemini-2.5-pro", true).as_str(),
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

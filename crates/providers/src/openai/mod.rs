//! The OpenAI Chat Completions client, for OpenAI and every server that
//! speaks the same API (vLLM, Ollama, llama.cpp's server, LM Studio).
//!
//! [`OpenAi`] implements [`Model`] over `POST {base}/chat/completions`, with
//! and without streaming. The API has no token counting endpoint:
//! [`Model::count_tokens`] answers `InputTokenCount::NotOffered` (a
//! context policy then estimates). How markov's types map to the API:
//!
//! - **System prompt** → a first `system` message (left out when empty).
//! - **Messages**: `user` → `user`; an `ephemeral` → the `user` messages
//!   of `Message::ephemeral_view` (one per camera frame, after its
//!   preamble); `assistant` →
//!   `assistant` with `tool_calls` (`arguments` is the input's JSON text);
//!   each tool result → a `tool` message (`tool_call_id`, `content`) placed
//!   before the rest of its user message's content; a `system` message with
//!   text → a `system` message; `command` and `instance` are skipped.
//!   `is_error` has no field in this API and is not sent.
//! - **Items**: text (empty text dropped), image (a `data:` URL in an
//!   `image_url` part, `detail` kept), file (a `[file: ..] <url>` text),
//!   output (pretty JSON text); thinking is not sent back. A user message of
//!   one text is sent as a plain string, otherwise as parts; assistant texts
//!   are joined by newlines.
//! - **Tools** → `{"type":"function","function":{name, description, parameters}}`,
//!   with `strict: true` under [`SchemaStrictness::Strict`]. **Tool choice**
//!   → `auto`, `required`, `none` or the named function;
//!   `parallel_tool_calls: false` when parallel calls are off. Both are sent
//!   only when tools are offered.
//! - **Settings**: `max_completion_tokens` (or `max_tokens`, see
//!   [`MaxTokensField`]), `temperature` when set. Thinking settings are
//!   ignored: Chat Completions has no thinking budget.
//! - **Structured output** → `response_format: {"type":"json_schema",
//!   "json_schema":{"name":"output","schema":..,"strict":..}}`.
//! - **Streaming** sends `stream_options: {"include_usage": true}`.
//! - **Answer**: `reasoning_content` (vLLM, DeepSeek, llama.cpp) → thinking
//!   without signature; content → text; a refusal → text with stop reason
//!   `refusal`; tool calls → tool_use items, their arguments parsed from
//!   their JSON text (malformed text is wrapped, see the crate docs).
//!   `finish_reason` `stop`, `tool_calls`, `length` and `content_filter` map
//!   to end_turn, tool_use, max_tokens and content_filter; `stop` with tool
//!   calls (as some servers send) is tool_use. Usage: `input_tokens` is
//!   `prompt_tokens` less the cached tokens, which are
//!   `cache_read_input_tokens`.

mod stream;
mod wire;

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use markov_core::{Model, ModelError, ModelRequest, ModelResponse, StreamEvent};
use reqwest::Url;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderValue};
use tracing::Instrument;

use crate::body::BodyCache;
use crate::error::ConfigError;
use crate::limits::Limits;
use crate::output::{Plan, StructuredOutput};
use crate::sse::{log_done, sse_stream};
use crate::transport::{
    self, ApiKey, Transport, TransportConfig, check_status, endpoint, transport_error,
};

/// Renders tool definitions in this API's tool format, `[{"type":"function","function":{"name","description","parameters"}}]`,
/// e.g. for a tool registry's `definitions()` used outside a machine.
pub fn tool_schemas(tools: &[markov_core::ToolDefinition]) -> serde_json::Value {
    wire::tool_schemas(tools)
}

/// OpenAI's address.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

/// The model used when neither the client nor the request names one.
pub const DEFAULT_MODEL: &str = "gpt-4.1";

/// The environment variable holding the API key.
pub const API_KEY_ENV: &str = "OPENAI_API_KEY";

/// The environment variable holding the base URL.
pub const BASE_URL_ENV: &str = "OPENAI_BASE_URL";

/// Which field carries the token limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MaxTokensField {
    /// `max_completion_tokens`, as OpenAI wants it now (required by its
    /// reasoning models).
    #[default]
    MaxCompletionTokens,
    /// `max_tokens`, for older servers that know only the deprecated field.
    MaxTokens,
}

/// Whether schemas are sent as strict (OpenAI's structured outputs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SchemaStrictness {
    /// No `strict` on tools, `strict: false` on the output schema: any JSON
    /// Schema is accepted.
    #[default]
    Lenient,
    /// `strict: true` on tools and on the output schema. The server then
    /// requires every property to be listed in `required` and
    /// `additionalProperties: false`.
    Strict,
}

/// A client of the Chat Completions API.
///
/// Built by [`OpenAi::builder`] or [`OpenAi::from_env`]; cheap to clone (the
/// connection pool is shared). Its `Debug` output never shows the API key.
#[derive(Clone)]
pub struct OpenAi {
    transport: Transport,
    url: Url,
    /// `{base}/models`, the list of the models the server serves.
    models_url: Url,
    /// llama.cpp's `{server}/props`, which reports its context.
    props_url: Url,
    model: String,
    shape: wire::Shape,
    body_cache: BodyCache,
}

impl fmt::Debug for OpenAi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAi")
            .field("url", &crate::transport::redact_url(self.url.as_str()))
            .field("model", &self.model)
            .field("max_tokens_field", &self.shape.max_tokens_field)
            .field("strictness", &self.shape.strictness)
            .field("api_key", &"<redacted>")
            .finish_non_exhaustive()
    }
}

/// Configures an [`OpenAi`] client.
#[derive(Clone)]
pub struct OpenAiBuilder {
    api_key: Option<ApiKey>,
    base_url: String,
    /// The environment variable `base_url` came from, for errors.
    base_url_var: Option<&'static str>,
    model: String,
    max_tokens_field: MaxTokensField,
    strictness: SchemaStrictness,
    structured_output: StructuredOutput,
    transport: TransportConfig,
    body_cache_bytes: usize,
}

impl fmt::Debug for OpenAiBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiBuilder")
            .field("api_key", &self.api_key)
            .field("base_url", &crate::transport::redact_url(&self.base_url))
            .field("model", &self.model)
            .field("max_tokens_field", &self.max_tokens_field)
            .field("strictness", &self.strictness)
            .field("structured_output", &self.structured_output)
            .field("transport", &self.transport)
            .field("body_cache_bytes", &self.body_cache_bytes)
            .finish()
    }
}

impl Default for OpenAiBuilder {
    fn default() -> Self {
        OpenAiBuilder {
            api_key: None,
            base_url: DEFAULT_BASE_URL.to_owned(),
            base_url_var: None,
            model: DEFAULT_MODEL.to_owned(),
            max_tokens_field: MaxTokensField::default(),
            strictness: SchemaStrictness::default(),
            structured_output: StructuredOutput::default(),
            transport: TransportConfig::DEFAULT,
            body_cache_bytes: crate::body::DEFAULT_BODY_CACHE_BYTES,
        }
    }
}

impl OpenAiBuilder {
    /// Sets how many bytes of encoded messages the client keeps between
    /// calls, over all the histories it serves (default 64 MiB; 0 keeps
    /// none). A request that names its history (a machine's do) then
    /// encodes only the messages added since the last call; the least
    /// recently used histories are dropped first.
    #[must_use]
    pub fn body_cache_bytes(mut self, bytes: usize) -> Self {
        self.body_cache_bytes = bytes;
        self
    }

    /// A builder from `OPENAI_API_KEY` and `OPENAI_BASE_URL`. The key is
    /// required unless a base URL is set (local servers usually need none).
    ///
    /// # Errors
    /// [`ConfigError::MissingEnv`] naming `OPENAI_API_KEY` when neither
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

    /// Sets the API key (sent as `Authorization: Bearer <key>`).
    #[must_use]
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(ApiKey::new(key));
        self
    }

    /// Sets the base URL (default [`DEFAULT_BASE_URL`]); requests go to
    /// `{base}/chat/completions`, so the base URL **includes** `/v1`: e.g.
    /// `http://localhost:8080/v1` for llama.cpp's server,
    /// `http://localhost:8000/v1` for vLLM, `http://localhost:11434/v1` for
    /// Ollama. A `404` from a base URL without `/v1` says so.
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

    /// Sets which field carries the token limit.
    #[must_use]
    pub fn max_tokens_field(mut self, field: MaxTokensField) -> Self {
        self.max_tokens_field = field;
        self
    }

    /// Sets whether tool and output schemas are sent as strict.
    #[must_use]
    pub fn schema_strictness(mut self, strictness: SchemaStrictness) -> Self {
        self.strictness = strictness;
        self
    }

    /// Sets how a structured answer is asked for on a call that also
    /// offers tools (default [`StructuredOutput::Auto`]: `response_format`
    /// at `api.openai.com`, the output tool elsewhere, since llama.cpp's
    /// server and vLLM make tool calls impossible under `response_format`).
    /// See [the crate docs](crate#structured-output-with-tools).
    #[must_use]
    pub fn structured_output(mut self, mode: StructuredOutput) -> Self {
        self.structured_output = mode;
        self
    }

    /// Sets how many times a failed call is retried (default 2). Only
    /// retryable failures are retried: 408, 409, 429, 5xx, timeouts and
    /// connection failures.
    #[must_use]
    pub fn max_retries(mut self, retries: u32) -> Self {
        self.transport.max_retries = retries;
        self
    }

    /// Sets the exponential backoff between retries: `initial` before the
    /// first, doubling up to `max`, each wait jittered into the upper half of
    /// its step (defaults 500 ms and 8 s). A `retry-after` or
    /// `retry-after-ms` from the server takes precedence; one above 60 s
    /// ends the retries.
    #[must_use]
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.transport.initial_backoff = initial;
        self.transport.max_backoff = max.max(initial);
        self
    }

    /// Sets the client's outgoing limits (default none): a bound on the
    /// calls in flight, requests and tokens per minute, and the longest a
    /// call waits for its place; see [`Limits`]. Shared by the client's
    /// clones.
    #[must_use]
    pub fn limits(mut self, limits: Limits) -> Self {
        self.transport.limits = limits;
        self
    }

    /// Sets the timeout of one attempt (default 10 minutes): the whole
    /// exchange of a complete call; the wait for the response head, and any
    /// pause between chunks, of a streamed one.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.transport.timeout = timeout;
        self
    }

    /// Bounds a whole call, streamed or not (default 10 minutes): every
    /// attempt, the waits between retries and, for a stream, every event up
    /// to the final one. A server that keeps a stream alive with pings or
    /// keep-alive comments and never answers, or that answers each attempt
    /// of `complete` slowly with a retryable error, or not at all, ends the
    /// call with `ModelError::Timeout(deadline)`. [`timeout`](Self::timeout)
    /// still bounds each attempt and each pause between chunks; dropping the
    /// stream or the future still cancels the call.
    #[must_use]
    pub fn stream_deadline(mut self, deadline: Duration) -> Self {
        self.transport.deadline = deadline;
        self
    }

    /// The largest server-sent event accepted, in bytes (default 16 MiB): the
    /// most the event parser holds of one event (its data and the line in
    /// progress). A larger one ends the stream with
    /// `ModelError::InvalidResponse` ("a server-sent event exceeded … bytes").
    /// Parsing is linear in the event's size however it is split into
    /// chunks. At least 1.
    #[must_use]
    pub fn max_event_bytes(mut self, bytes: usize) -> Self {
        self.transport.max_event_bytes = bytes.max(1);
        self
    }

    /// Builds the client.
    ///
    /// # Errors
    /// [`ConfigError::MissingApiKey`] without a key for OpenAI's own address
    /// (other servers may need none), [`ConfigError::InvalidBaseUrl`],
    /// [`ConfigError::InvalidApiKey`], or [`ConfigError::HttpClient`] when
    /// TLS cannot be set up.
    pub fn build(self) -> Result<OpenAi, ConfigError> {
        let base = transport::parse_base_url(&self.base_url, self.base_url_var)?;
        let mut headers = HeaderMap::new();
        match &self.api_key {
            Some(key) => {
                headers.insert(AUTHORIZATION, key.header("Bearer ")?);
            }
            None if base.host_str() == Some("api.openai.com") => {
                return Err(ConfigError::MissingApiKey);
            }
            None => {}
        }
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Ok(OpenAi {
            transport: Transport::new(self.transport, &base, headers)?,
            url: endpoint(&base, "chat/completions"),
            models_url: endpoint(&base, "models"),
            props_url: crate::transport::props_endpoint(&base),
            model: self.model,
            shape: wire::Shape {
                max_tokens_field: self.max_tokens_field,
                strictness: self.strictness,
                schema_with_tools: self
                    .structured_output
                    .schema_with_tools(base.host_str() == Some("api.openai.com")),
            },
            body_cache: BodyCache::new(self.body_cache_bytes),
        })
    }
}

impl OpenAi {
    /// A builder with the defaults and no key.
    pub fn builder() -> OpenAiBuilder {
        OpenAiBuilder::default()
    }

    /// A client from `OPENAI_API_KEY` and `OPENAI_BASE_URL`; see
    /// [`OpenAiBuilder::from_env`].
    ///
    /// # Errors
    /// [`ConfigError::MissingEnv`] when neither variable is set, or any error
    /// of [`OpenAiBuilder::build`].
    pub fn from_env() -> Result<Self, ConfigError> {
        OpenAiBuilder::from_env()?.build()
    }

    /// The URL calls are sent to (`{base}/chat/completions`), with any
    /// password or query in it redacted, as errors and `Debug` output show
    /// it.
    pub fn endpoint(&self) -> String {
        crate::transport::redact_url(self.url.as_str())
    }

    /// The model used when a request names none.
    pub fn default_model(&self) -> &str {
        &self.model
    }

    /// Whether the client talks to OpenAI's own service (not a local
    /// server or a proxy).
    pub fn is_vendor(&self) -> bool {
        self.url.host_str() == Some("api.openai.com")
    }

    /// The client with another default model (the pool is shared).
    #[must_use]
    pub fn with_default_model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }

    /// The ids of the models the server serves (`GET {base}/models`), in
    /// its order.
    ///
    /// # Errors
    /// Any error of the call, as for a model call (not retried).
    pub async fn served_models(&self) -> Result<Vec<String>, ModelError> {
        self.transport.list_models(self.models_url.clone()).await
    }

    /// What the server says of itself ([`crate::ServedFacts`]): the
    /// context window it runs the default model with (vLLM's model list,
    /// `max_model_len`; llama.cpp's `GET /props`, `n_ctx`) and whether its
    /// chat template handles tools (llama.cpp). Nothing for a server that
    /// does not say (the vendor's API, Ollama). Each request is one
    /// attempt, bounded by the timeout (at most 5 s).
    ///
    /// # Errors
    /// The error of the last request when no request was answered.
    pub async fn served_facts(&self) -> Result<crate::ServedFacts, ModelError> {
        self.transport
            .served_facts(self.models_url.clone(), self.props_url.clone(), &self.model)
            .await
    }

    fn model_for<'a>(&'a self, request: &ModelRequest<'a>) -> &'a str {
        request.settings().model.as_deref().unwrap_or(&self.model)
    }

    /// The exact body this client sends for `request` (`stream`: asking for
    /// a streamed answer), with the history's earlier messages taken from
    /// the client's cache when the request names its history. For looking
    /// at what goes over the wire, and for benchmarks.
    ///
    /// ```
    /// use markov_core::{Message, ModelRequest, ModelSettings};
    /// use markov_providers::OpenAi;
    ///
    /// let client = OpenAi::builder().base_url("http://127.0.0.1:1").build().unwrap();
    /// let history = [Message::user("hi")];
    /// let settings = ModelSettings::default();
    /// let body = client.request_body(&ModelRequest::new("", &history, &settings), false).unwrap();
    /// assert!(body.starts_with(br#"{"model":"#));
    /// ```
    pub fn request_body(
        &self,
        request: &ModelRequest<'_>,
        stream: bool,
    ) -> Result<Vec<u8>, ModelError> {
        let model = self.model_for(request);
        let body = wire::encode(request, model, self.shape, stream, Some(&self.body_cache))?;
        // Debug and test builds check every cached body against the body
        // encoded afresh: every test of the workspace checks the cache.
        #[cfg(debug_assertions)]
        if let Err(mismatch) = crate::body::check_cached(
            &body,
            &wire::encode_plain(request, model, self.shape, stream)?,
        ) {
            panic!("{mismatch}");
        }
        Ok(body)
    }

    /// The same bytes as [`Self::request_body`], every message encoded
    /// afresh (`serde_json::to_vec` of the whole request): the reference the
    /// cached form is checked against.
    pub fn request_body_uncached(
        &self,
        request: &ModelRequest<'_>,
        stream: bool,
    ) -> Result<Vec<u8>, ModelError> {
        let model = self.model_for(request);
        wire::encode_plain(request, model, self.shape, stream)
    }

    async fn post(&self, body: Bytes) -> Result<reqwest::Response, ModelError> {
        let response = self
            .transport
            .client()
            .post(self.url.clone())
            .body(body)
            .send()
            .await
            .map_err(|e| transport_error(e, self.transport.timeout()))?;
        check_status(response)
            .await
            .map_err(|error| transport::hint_v1(error, &self.url, "chat/completions"))
    }
}

/// Decodes a recorded Chat Completions event stream (the bytes of a
/// streamed response's body) with the client's own decoder: the
/// [`StreamEvent`]s a streamed call would have yielded, ending with
/// [`StreamEvent::Done`]. For tests that replay recorded streams, and for
/// benchmarks.
///
/// ```
/// use markov_core::{Item, StreamEvent};
///
/// let body = concat!(
///     "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n",
///     "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
///     "data: [DONE]\n\n",
/// );
/// let events = markov_providers::openai::replay_stream(body.as_bytes()).unwrap();
/// let Some(StreamEvent::Done(response)) = events.last() else { panic!() };
/// assert_eq!(response.content, vec![Item::text("Hi")]);
/// ```
///
/// # Errors
/// What a streamed call would fail with: an error chunk, a malformed chunk.
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
        gen_ai.provider.name = "openai",
        gen_ai.request.model = model,
        attempt = tracing::field::Empty
    )
}

#[async_trait]
impl Model for OpenAi {
    fn provider_name(&self) -> &str {
        "openai"
    }

    fn model_name(&self) -> Option<&str> {
        Some(&self.model)
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let model = self.model_for(&request);
        let span = call_span(model);
        let plan = Plan::of(&request, self.shape.schema_with_tools);
        let body = Bytes::from(self.request_body(&request, false)?);
        let call = async {
            let _place = self
                .transport
                .enter(body.len(), request.settings().max_tokens)
                .await?;
            let bytes = self
                .transport
                .with_retries_by_deadline(&span, || async {
                    let response = self.post(body.clone()).await?;
                    response
                        .bytes()
                        .await
                        .map_err(|e| transport_error(e, self.transport.timeout()))
                })
                .await?;
            let answer = wire::decode(&bytes)?;
            crate::convert::check_forced_call(
                !request.tools().is_empty() || plan.tool().is_some(),
                plan.tool_choice(&request),
                &answer,
                || self.endpoint(),
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
        if Plan::of(&request, self.shape.schema_with_tools)
            .tool()
            .is_some()
        {
            // The answer is the output tool's call, turned into text once
            // whole: streamed, its deltas would show a call that is not one.
            return crate::output::replayed(self, request);
        }
        let model = self.model_for(&request);
        let span = call_span(model);
        let body = match self.request_body(&request, true) {
            Ok(body) => Bytes::from(body),
            Err(error) => return futures::stream::once(async { Err(error) }).boxed(),
        };
        let body_len = body.len();
        let endpoint = move || self.endpoint();
        let connect_span = span.clone();
        let connect = async move {
            self.transport
                .with_retries(&connect_span, || self.post(body.clone()))
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
    fn from_env_wants_a_key_or_a_base_url() {
        let empty = |_: &str| None;
        assert!(matches!(
            OpenAiBuilder::from_env_with(&empty),
            Err(ConfigError::MissingEnv {
                var: "OPENAI_API_KEY"
            })
        ));
        let local = |name: &str| (name == BASE_URL_ENV).then(|| "http://127.0.0.1:8080/v1".into());
        let client = OpenAiBuilder::from_env_with(&local)
            .unwrap()
            .build()
            .unwrap();
        assert_eq!(
            client.url.as_str(),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        let keyed = |name: &str| (name == API_KEY_ENV).then(|| "sk-proj-secret".into());
        let builder = OpenAiBuilder::from_env_with(&keyed).unwrap();
        assert!(!format!("{builder:?}").contains("sk-proj-secret"));
        let client = builder.build().unwrap();
        assert!(!format!("{client:?}").contains("sk-proj-secret"));
        assert_eq!(
            client.url.as_str(),
            "https://api.openai.com/v1/chat/completions"
        );
    }

    #[test]
    fn openai_itself_needs_a_key() {
        assert!(matches!(
            OpenAi::builder().build(),
            Err(ConfigError::MissingApiKey)
        ));
    }
}

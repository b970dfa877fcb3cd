//! The OpenAI Responses API client (`POST {base}/responses`), for OpenAI
//! and the servers that speak it too (vLLM, llama.cpp's server).
//!
//! [`Responses`] implements [`Model`] with and without streaming. How
//! markov's types map to the API:
//!
//! - **System prompt** → `instructions` (left out when empty).
//! - **Messages** → `input` items: `user` → a `user` message (a plain
//!   string for one text, else `input_text` / `input_image` parts);
//!   tool results → `function_call_output` items (`call_id`, `output`)
//!   before the rest of their message; `assistant` → its items in order:
//!   reasoning (a thinking item this client made, see below) → a
//!   `reasoning` item with its id, summary and encrypted content; text → an
//!   `assistant` message; a call → a `function_call` item (`arguments` is
//!   the input's JSON text); a `system` message with text → a `system`
//!   message; `ephemeral` → the user messages of `Message::ephemeral_view`;
//!   `command` and `instance` are skipped. `is_error` has no field here.
//! - **Tools** → `{"type":"function", name, description, parameters,
//!   strict}`, `strict` always sent (the API makes tools strict unless told
//!   otherwise; [`SchemaStrictness`]). **Tool choice** → `auto`,
//!   `required`, `none` or `{"type":"function","name"}`;
//!   `parallel_tool_calls: false` when parallel calls are off.
//! - **Settings**: `max_output_tokens`, `temperature` when set; thinking →
//!   `reasoning: {effort, summary: "auto"}` (a budget up to 2 048 tokens is
//!   `low`, above 16 384 `high`, else `medium`).
//! - **`store: false`** by default (markov keeps the history), with
//!   `include: ["reasoning.encrypted_content"]` at OpenAI (or with thinking
//!   on): each reasoning item comes back encrypted, is kept in the history
//!   as a thinking item (its summary as the text, `<id>|<encrypted>` as the
//!   signature) and is handed back with the calls it led to on the next
//!   step, as reasoning models require.
//! - **Structured output** → `text: {"format": {"type": "json_schema",
//!   "name": "output", schema, strict}}`, or the output tool next to tools
//!   away from OpenAI (see [the crate docs](crate#structured-output-with-tools)).
//! - **Prompt cache key** → `prompt_cache_key`, by default `markov-<id>`
//!   of the request's history ([`PromptCacheKey`]), so the calls of one
//!   conversation reach the same cache.
//! - **Answer**: `output` items in order: `reasoning` → thinking (with the
//!   signature above), `message` → text (a refusal → text with stop reason
//!   `refusal`), `function_call` → a tool call (`call_id`, arguments
//!   parsed from their JSON text). Status `incomplete` for
//!   `max_output_tokens` / `content_filter` → max_tokens / content_filter.
//!   Usage: `input_tokens` less the cached tokens, which are
//!   `cache_read_input_tokens`.
//! - **Token counts** ([`Model::count_tokens`]) → `POST
//!   {base}/responses/input_tokens` with the call's body less
//!   `max_output_tokens`, `temperature`, `store`, `include`,
//!   `prompt_cache_key` and `stream`; the answer's `input_tokens`.
//!
//! - **Compaction** ([`Model::compact`]) → `POST {base}/responses/compact`
//!   with `model`, `instructions` and `input` as a call writes them; the
//!   answer's `output` items (the user messages kept, one `compaction`
//!   item of encrypted content) are kept as the server wrote them, byte
//!   for byte, never read, under the vendor tag of
//!   [`Model::native_summaries`]: `openai.responses` at OpenAI,
//!   `openai.responses@<host:port>` elsewhere (another server's items are
//!   encrypted by that server). A context policy built with
//!   `Summarize::native` appends them to the history as a summary
//!   message and its view shows them first; a request sends them as
//!   input items, verbatim, in place of the messages they stand for, and
//!   only when their tag is this client's. Every other client skips
//!   them, as it skips every summary message.
//!
//! The server-side compaction of a call (`context_management: [{"type":
//! "compaction", "compact_threshold"}]` on a create request) is not used:
//! its items come back inside the answer, in place of input that markov's
//! append-only history still holds, and with `store: false` it could only
//! be sent again by rewriting that history; the standalone endpoint fits
//! the summary a context policy appends.

mod stream;
mod wire;

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use markov_core::message::NativeItems;
use markov_core::model::{Compacted, Compaction, InputTokenCount};
use markov_core::{Model, ModelError, ModelRequest, ModelResponse, StreamEvent};
use reqwest::Url;
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderValue};
use tracing::Instrument;

use crate::body::BodyCache;
use crate::error::ConfigError;
use crate::limits::Limits;
use crate::openai::SchemaStrictness;
use crate::output::{Plan, StructuredOutput};
use crate::sse::{log_done, sse_stream};
use crate::transport::{
    self, ApiKey, Transport, TransportConfig, check_status, endpoint, transport_error,
};

/// OpenAI's address.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

/// The model used when neither the client nor the request names one.
pub const DEFAULT_MODEL: &str = "gpt-4.1";

/// The environment variable holding the API key.
pub const API_KEY_ENV: &str = "OPENAI_API_KEY";

/// The environment variable holding the base URL.
pub const BASE_URL_ENV: &str = "OPENAI_BASE_URL";

/// Which `prompt_cache_key` a request carries.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PromptCacheKey {
    /// `markov-<id>` of the request's history, so the calls of one
    /// conversation share a cache; none for a request that names no
    /// history. The default.
    #[default]
    PerHistory,
    /// This key on every request (one agent's conversations sharing their
    /// long common prefix).
    Fixed(String),
    /// No key.
    Off,
}

impl PromptCacheKey {
    fn for_request(&self, request: &ModelRequest<'_>) -> Option<String> {
        match self {
            PromptCacheKey::PerHistory => request
                .history_id()
                .map(|id| format!("markov-{}", id.get())),
            PromptCacheKey::Fixed(key) => Some(key.clone()),
            PromptCacheKey::Off => None,
        }
    }
}

/// A client of the Responses API.
///
/// Built by [`Responses::builder`] or [`Responses::from_env`]; cheap to
/// clone (the connection pool is shared). Its `Debug` output never shows
/// the API key.
#[derive(Clone)]
pub struct Responses {
    transport: Transport,
    url: Url,
    /// `{base}/responses/input_tokens`.
    count_url: Url,
    /// `{base}/responses/compact`.
    compact_url: Url,
    models_url: Url,
    /// llama.cpp's `{server}/props`, which reports its context.
    props_url: Url,
    model: String,
    shape: wire::Shape,
    body_cache: BodyCache,
}

impl fmt::Debug for Responses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Responses")
            .field("url", &transport::redact_url(self.url.as_str()))
            .field("model", &self.model)
            .field("shape", &self.shape)
            .field("api_key", &"<redacted>")
            .finish_non_exhaustive()
    }
}

/// Configures a [`Responses`] client.
#[derive(Clone)]
pub struct ResponsesBuilder {
    api_key: Option<ApiKey>,
    base_url: String,
    base_url_var: Option<&'static str>,
    model: String,
    strictness: SchemaStrictness,
    structured_output: StructuredOutput,
    store: bool,
    cache_key: PromptCacheKey,
    transport: TransportConfig,
    body_cache_bytes: usize,
}

impl fmt::Debug for ResponsesBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponsesBuilder")
            .field("api_key", &self.api_key)
            .field("base_url", &transport::redact_url(&self.base_url))
            .field("model", &self.model)
            .field("strictness", &self.strictness)
            .field("structured_output", &self.structured_output)
            .field("store", &self.store)
            .field("cache_key", &self.cache_key)
            .field("transport", &self.transport)
            .finish_non_exhaustive()
    }
}

impl Default for ResponsesBuilder {
    fn default() -> Self {
        ResponsesBuilder {
            api_key: None,
            base_url: DEFAULT_BASE_URL.to_owned(),
            base_url_var: None,
            model: DEFAULT_MODEL.to_owned(),
            strictness: SchemaStrictness::default(),
            structured_output: StructuredOutput::default(),
            store: false,
            cache_key: PromptCacheKey::default(),
            transport: TransportConfig::DEFAULT,
            body_cache_bytes: crate::body::DEFAULT_BODY_CACHE_BYTES,
        }
    }
}

impl ResponsesBuilder {
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
    /// `{base}/responses`, so the base URL **includes** `/v1`, as for
    /// Chat Completions: e.g. `http://localhost:8000/v1` for vLLM.
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

    /// Sets whether tool and output schemas are sent as strict (default
    /// lenient: `strict: false`).
    #[must_use]
    pub fn schema_strictness(mut self, strictness: SchemaStrictness) -> Self {
        self.strictness = strictness;
        self
    }

    /// Sets how a structured answer is asked for on a call that also
    /// offers tools (default [`StructuredOutput::Auto`]: `text.format` at
    /// `api.openai.com`, the output tool elsewhere).
    #[must_use]
    pub fn structured_output(mut self, mode: StructuredOutput) -> Self {
        self.structured_output = mode;
        self
    }

    /// Sets `store` (default `false`: markov keeps the history, and the
    /// server keeps nothing; reasoning comes back encrypted instead).
    #[must_use]
    pub fn store(mut self, store: bool) -> Self {
        self.store = store;
        self
    }

    /// Sets the `prompt_cache_key` of each request (default
    /// [`PromptCacheKey::PerHistory`]).
    #[must_use]
    pub fn prompt_cache_key(mut self, key: PromptCacheKey) -> Self {
        self.cache_key = key;
        self
    }

    /// Sets how many times a failed call is retried (default 2); see
    /// [`OpenAiBuilder::max_retries`](crate::OpenAiBuilder::max_retries).
    #[must_use]
    pub fn max_retries(mut self, retries: u32) -> Self {
        self.transport.max_retries = retries;
        self
    }

    /// Sets the exponential backoff between retries (defaults 500 ms and
    /// 8 s); see [`OpenAiBuilder::backoff`](crate::OpenAiBuilder::backoff).
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

    /// Sets the timeout of one attempt (default 10 minutes).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.transport.timeout = timeout;
        self
    }

    /// Bounds a whole call, streamed or not, retries included (default 10
    /// minutes); see
    /// [`OpenAiBuilder::stream_deadline`](crate::OpenAiBuilder::stream_deadline).
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

    /// Sets how many bytes of encoded input items the client keeps between
    /// calls (default 64 MiB; 0 keeps none).
    #[must_use]
    pub fn body_cache_bytes(mut self, bytes: usize) -> Self {
        self.body_cache_bytes = bytes;
        self
    }

    /// Builds the client.
    ///
    /// # Errors
    /// [`ConfigError::MissingApiKey`] without a key for OpenAI's own
    /// address, [`ConfigError::InvalidBaseUrl`] (naming the variable it came
    /// from), [`ConfigError::InvalidApiKey`], or [`ConfigError::HttpClient`].
    pub fn build(self) -> Result<Responses, ConfigError> {
        let base = transport::parse_base_url(&self.base_url, self.base_url_var)?;
        let vendor = base.host_str() == Some("api.openai.com");
        let mut headers = HeaderMap::new();
        match &self.api_key {
            Some(key) => {
                headers.insert(AUTHORIZATION, key.header("Bearer ")?);
            }
            None if vendor => return Err(ConfigError::MissingApiKey),
            None => {}
        }
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let host = match (base.host_str(), base.port()) {
            (Some(host), Some(port)) => format!("{host}:{port}"),
            (host, _) => host.unwrap_or_default().to_owned(),
        };
        Ok(Responses {
            transport: Transport::new(self.transport, &base, headers)?,
            url: endpoint(&base, "responses"),
            count_url: endpoint(&base, "responses/input_tokens"),
            compact_url: endpoint(&base, "responses/compact"),
            models_url: endpoint(&base, "models"),
            props_url: crate::transport::props_endpoint(&base),
            model: self.model,
            shape: wire::Shape {
                strictness: self.strictness,
                schema_with_tools: self.structured_output.schema_with_tools(vendor),
                store: self.store,
                include_reasoning: vendor,
                cache_key: self.cache_key,
                native: wire::native_tag(&host, vendor),
            },
            body_cache: BodyCache::new(self.body_cache_bytes),
        })
    }
}

impl Responses {
    /// A builder with the defaults and no key.
    pub fn builder() -> ResponsesBuilder {
        ResponsesBuilder::default()
    }

    /// A client from `OPENAI_API_KEY` and `OPENAI_BASE_URL`.
    ///
    /// # Errors
    /// As [`ResponsesBuilder::from_env`] and [`ResponsesBuilder::build`].
    pub fn from_env() -> Result<Self, ConfigError> {
        ResponsesBuilder::from_env()?.build()
    }

    /// The URL calls are sent to (`{base}/responses`), redacted.
    pub fn endpoint(&self) -> String {
        transport::redact_url(self.url.as_str())
    }

    /// The model used when a request names none.
    pub fn default_model(&self) -> &str {
        &self.model
    }

    /// Whether the client talks to OpenAI's own service.
    pub fn is_vendor(&self) -> bool {
        self.url.host_str() == Some("api.openai.com")
    }

    /// The client with another default model (the pool is shared).
    #[must_use]
    pub fn with_default_model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }

    /// The ids of the models the server serves (`GET {base}/models`).
    ///
    /// # Errors
    /// Any error of the call (not retried).
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

    /// The exact body this client sends for `request`, the history's
    /// earlier items taken from the client's cache when the request names
    /// its history.
    ///
    /// ```
    /// use markov_core::{Message, ModelRequest, ModelSettings};
    /// use markov_providers::Responses;
    ///
    /// let client = Responses::builder().base_url("http://127.0.0.1:1/v1").build().unwrap();
    /// let history = [Message::user("hi")];
    /// let settings = ModelSettings::default();
    /// let body = client.request_body(&ModelRequest::new("", &history, &settings), false).unwrap();
    /// assert!(body.starts_with(br#"{"model":"#));
    /// ```
    ///
    /// # Errors
    /// A request that cannot be sent (no input, provider built-in tools).
    pub fn request_body(
        &self,
        request: &ModelRequest<'_>,
        stream: bool,
    ) -> Result<Vec<u8>, ModelError> {
        self.body(request, wire::Purpose::Call { stream })
    }

    /// The exact body this client sends to count `request`'s input tokens
    /// (`/responses/input_tokens`): the call's body without the fields the
    /// endpoint does not take, its items taken from the same cache.
    ///
    /// # Errors
    /// As [`Self::request_body`].
    pub fn count_body(&self, request: &ModelRequest<'_>) -> Result<Vec<u8>, ModelError> {
        self.body(request, wire::Purpose::Count)
    }

    /// The exact body this client sends to compact `request`'s messages
    /// (`/responses/compact`): its model, instructions and input items as
    /// a call writes them, nothing else.
    ///
    /// ```
    /// use markov_core::{Message, ModelRequest, ModelSettings};
    /// use markov_providers::Responses;
    ///
    /// let client = Responses::builder().base_url("http://127.0.0.1:1/v1").build().unwrap();
    /// let history = [Message::user("hi")];
    /// let settings = ModelSettings::default();
    /// let body = client.compact_body(&ModelRequest::new("Be brief.", &history, &settings)).unwrap();
    /// assert_eq!(
    ///     String::from_utf8(body).unwrap(),
    ///     r#"{"model":"gpt-4.1","instructions":"Be brief.","input":[{"type":"message","role":"user","content":"hi"}]}"#
    /// );
    /// ```
    ///
    /// # Errors
    /// As [`Self::request_body`].
    pub fn compact_body(&self, request: &ModelRequest<'_>) -> Result<Vec<u8>, ModelError> {
        self.body(request, wire::Purpose::Compact)
    }

    fn body(
        &self,
        request: &ModelRequest<'_>,
        purpose: wire::Purpose,
    ) -> Result<Vec<u8>, ModelError> {
        let model = self.model_for(request);
        let body = wire::encode(request, model, &self.shape, purpose, Some(&self.body_cache))?;
        #[cfg(debug_assertions)]
        if let Err(mismatch) = crate::body::check_cached(
            &body,
            &wire::encode_plain(request, model, &self.shape, purpose)?,
        ) {
            panic!("{mismatch}");
        }
        Ok(body)
    }

    /// The same bytes as [`Self::request_body`], every item encoded afresh.
    ///
    /// # Errors
    /// As [`Self::request_body`].
    pub fn request_body_uncached(
        &self,
        request: &ModelRequest<'_>,
        stream: bool,
    ) -> Result<Vec<u8>, ModelError> {
        wire::encode_plain(
            request,
            self.model_for(request),
            &self.shape,
            wire::Purpose::Call { stream },
        )
    }

    async fn post(&self, body: Bytes) -> Result<reqwest::Response, ModelError> {
        self.post_to(&self.url, "responses", body).await
    }

    /// Posts `body` to `url`, `{base}/{path}`.
    async fn post_to(
        &self,
        url: &Url,
        path: &str,
        body: Bytes,
    ) -> Result<reqwest::Response, ModelError> {
        let response = self
            .transport
            .client()
            .post(url.clone())
            .body(body)
            .send()
            .await
            .map_err(|e| transport_error(e, self.transport.timeout()))?;
        check_status(response)
            .await
            .map_err(|error| transport::hint_v1(error, url, path))
    }
}

/// Decodes a recorded Responses event stream with the client's own
/// decoder: the [`StreamEvent`]s a streamed call would have yielded,
/// ending with [`StreamEvent::Done`].
///
/// # Errors
/// What a streamed call would fail with: an `error` or `response.failed`
/// event, a malformed event, a body that ends before `response.completed`.
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
impl Model for Responses {
    fn provider_name(&self) -> &str {
        "openai"
    }

    fn model_name(&self) -> Option<&str> {
        Some(&self.model)
    }

    /// Asks `/responses/input_tokens`, under the client's limits, timeout
    /// and retries. A server that does not offer the endpoint (vLLM,
    /// llama.cpp's) answers `404`, an error like any other: the caller
    /// estimates instead.
    async fn count_tokens(&self, request: ModelRequest<'_>) -> Result<InputTokenCount, ModelError> {
        let span = tracing::info_span!(
            "count_tokens",
            gen_ai.provider.name = "openai",
            gen_ai.request.model = self.model_for(&request),
            attempt = tracing::field::Empty
        );
        let body = Bytes::from(self.count_body(&request)?);
        let call = async {
            let answer = self
                .transport
                .count(&span, || {
                    self.post_to(&self.count_url, "responses/input_tokens", body.clone())
                })
                .await?;
            let tokens = wire::decode_count(&answer)?;
            tracing::debug!(input_tokens = tokens, "counted");
            Ok(InputTokenCount::Counted(tokens))
        };
        call.instrument(span.clone()).await
    }

    /// `openai.responses` at OpenAI, `openai.responses@<host:port>` at
    /// any other server: the items a server compacts to are encrypted by
    /// it, and are sent back to the same server only.
    fn native_summaries(&self) -> Option<&str> {
        Some(&self.shape.native)
    }

    /// Asks `/responses/compact`, under the client's limits, timeout,
    /// retries and deadline, as a call is made. A server without the
    /// endpoint (vLLM, llama.cpp's) answers `404`, an error like any
    /// other: the context policy backs off as from a failed summarizer.
    async fn compact(&self, request: ModelRequest<'_>) -> Result<Compaction, ModelError> {
        let model = self.model_for(&request);
        let span = tracing::info_span!(
            "compact",
            gen_ai.provider.name = "openai",
            gen_ai.request.model = model,
            attempt = tracing::field::Empty
        );
        let body = Bytes::from(self.compact_body(&request)?);
        let call = async {
            let _place = self
                .transport
                .enter(body.len(), request.settings().max_tokens)
                .await?;
            let bytes = self
                .transport
                .with_retries_by_deadline(&span, || async {
                    let response = self
                        .post_to(&self.compact_url, "responses/compact", body.clone())
                        .await?;
                    response
                        .bytes()
                        .await
                        .map_err(|e| transport_error(e, self.transport.timeout()))
                })
                .await?;
            let text = std::str::from_utf8(&bytes).map_err(|e| {
                ModelError::InvalidResponse(format!("the compaction is not UTF-8: {e}"))
            })?;
            let (items, usage) = wire::decode_compaction(text)?;
            tracing::debug!(items = items.len(), "compacted");
            Ok(Compaction::Compacted(Compacted::new(
                NativeItems::new(self.shape.native.clone(), items),
                usage,
            )))
        };
        call.instrument(span.clone()).await
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
            let answer = cut_at_limit(wire::decode(&bytes)?, request.settings().max_tokens);
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
            return crate::output::replayed(self, request);
        }
        let span = call_span(self.model_for(&request));
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
        let max_tokens = request.settings().max_tokens;
        let stream = self
            .transport
            .limited(body_len, max_tokens, stream)
            .map(move |event| match event {
                Ok(StreamEvent::Done(answer)) => {
                    Ok(StreamEvent::Done(cut_at_limit(answer, max_tokens)))
                }
                other => other,
            })
            .boxed();
        crate::convert::checked_stream(
            stream,
            !request.tools().is_empty(),
            request.tool_choice(),
            endpoint,
        )
    }
}

/// `answer`, read as cut by the token limit when its server reported it
/// whole although it spent every output token it was allowed
/// (`max_tokens`): llama.cpp's server answers `completed` for an answer
/// its `max_output_tokens` cut (it never says `incomplete`), and the loop
/// would take a cut text for a whole one, or a forced call cut before it
/// began for a server that ignores its tools. A call the answer holds is
/// left as it is: its arguments are checked where the loop runs it.
fn cut_at_limit(mut answer: ModelResponse, max_tokens: u32) -> ModelResponse {
    if answer.stop_reason == markov_core::StopReason::EndTurn
        && max_tokens > 0
        && answer.usage.output_tokens >= u64::from(max_tokens)
    {
        tracing::debug!(
            max_tokens,
            "an answer reported whole spent every output token: read as cut by the limit"
        );
        answer.stop_reason = markov_core::StopReason::MaxTokens;
    }
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_env_reads_the_openai_variables_and_hides_the_key() {
        let local = |name: &str| (name == BASE_URL_ENV).then(|| "http://127.0.0.1:8000/v1".into());
        let client = ResponsesBuilder::from_env_with(&local)
            .unwrap()
            .build()
            .unwrap();
        assert_eq!(client.url.as_str(), "http://127.0.0.1:8000/v1/responses");
        assert!(!client.is_vendor());
        let keyed = |name: &str| (name == API_KEY_ENV).then(|| "sk-proj-secret".into());
        let client = ResponsesBuilder::from_env_with(&keyed)
            .unwrap()
            .build()
            .unwrap();
        assert!(!format!("{client:?}").contains("sk-proj-secret"));
        assert!(client.is_vendor());
        assert!(matches!(
            Responses::builder().build(),
            Err(ConfigError::MissingApiKey)
        ));
    }
}

//! The Anthropic Messages API client.
//!
//! [`Anthropic`] implements [`Model`] over `POST {base}/v1/messages`, with
//! and without streaming. How markov's types map to the API:
//!
//! - **System prompt** → `system: [{"type":"text","text":..}]`; with
//!   [`PromptCaching::Conversation`] (the default) it, the last tool and
//!   the last block of the last message carry
//!   `cache_control: {"type":"ephemeral"}` (the last message's moves with
//!   the conversation: the request cache never holds it, as the last wire
//!   message is always encoded afresh).
//! - **Messages**: `user` and `assistant` are sent; an `ephemeral` as the
//!   silent user messages of `Message::ephemeral_view` (a camera-frame
//!   preamble before each image); a `system` message as a user text block starting with
//!   `[System instruction] ` (the API has no mid-conversation system role),
//!   or skipped if it has no text; `command` and `instance` are skipped.
//!   Consecutive messages of one role are merged, and tool results go first
//!   in their user message.
//! - **Items**: text (empty text dropped), image (base64 source), file (a
//!   `[file: ..] <url>` text line), tool_use, tool_result (`is_error` only
//!   when known), output (pretty JSON text), thinking (sent back with its
//!   signature in assistant messages; unsigned thinking is dropped),
//!   command and resume (dropped). A message left with no block is skipped.
//! - **Tool choice** → `auto`, `any`, `tool` with name, or `none`, with
//!   `disable_parallel_tool_use: true` when parallel calls are off. Sent
//!   only when tools are offered.
//! - **Thinking** → `{"type":"enabled","budget_tokens":N}` or
//!   `{"type":"adaptive"}`; `temperature` is sent only when set and thinking
//!   is off. A forced tool choice with a fixed thinking budget is refused
//!   before sending ([`ModelError::InvalidRequest`]), as the API would.
//! - **Structured output** → `output_format: {"type":"json_schema","schema":..}`
//!   with the `anthropic-beta: structured-outputs-2025-11-13` header.
//! - **Context editing** ([`ClearToolUses`], off by default) →
//!   `context_management: {"edits": [{"type": "clear_tool_uses_20250919",
//!   ..}]}` with the `anthropic-beta: context-management-2025-06-27`
//!   header, on every request of the client; the edits the API applied
//!   are recorded in the trace.
//! - **Token counts** ([`Model::count_tokens`]) → `POST
//!   {base}/v1/messages/count_tokens` with the call's body less
//!   `max_tokens`, `temperature` and `stream`; `{"input_tokens": N}`.
//! - **Answer**: text, tool_use and thinking (with signature) blocks become
//!   items; redacted thinking is dropped; any other block becomes a text item
//!   holding its JSON. `stop_reason` maps one to one onto [`StopReason`];
//!   usage includes cache reads and writes.
//!
//! [`StopReason`]: markov_core::StopReason

mod stream;
mod wire;

use std::fmt;
use std::time::Duration;

use crate::body::BodyCache;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use markov_core::model::InputTokenCount;
use markov_core::{Model, ModelError, ModelRequest, ModelResponse, StreamEvent};
use reqwest::Url;
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderValue};
use tracing::Instrument;

use crate::error::ConfigError;
use crate::limits::Limits;
use crate::output::{Plan, StructuredOutput};
use crate::sse::{log_done, sse_stream};
use crate::transport::{
    self, ApiKey, Transport, TransportConfig, check_status, endpoint, transport_error,
};

/// Renders tool definitions in this API's tool format, `[{"name", "description", "input_schema"}]`,
/// e.g. for a tool registry's `definitions()` used outside a machine.
pub fn tool_schemas(tools: &[markov_core::ToolDefinition]) -> serde_json::Value {
    wire::tool_schemas(tools)
}

/// The API's default address.
pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";

/// The model used when neither the client nor the request names one.
pub const DEFAULT_MODEL: &str = "claude-sonnet-4-5";

/// The API version this client speaks (`anthropic-version` header).
pub const API_VERSION: &str = "2023-06-01";

/// The beta that enables structured output (`anthropic-beta` header).
pub const STRUCTURED_OUTPUTS_BETA: &str = "structured-outputs-2025-11-13";

/// The beta that enables context editing (`anthropic-beta` header).
pub const CONTEXT_MANAGEMENT_BETA: &str = "context-management-2025-06-27";

/// The environment variable holding the API key.
pub const API_KEY_ENV: &str = "ANTHROPIC_API_KEY";

/// The environment variable holding another address (a local server that
/// speaks the Messages API, such as llama.cpp's).
pub const BASE_URL_ENV: &str = "ANTHROPIC_BASE_URL";

/// Where prompt-caching breakpoints go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PromptCaching {
    /// No `cache_control` anywhere.
    Off,
    /// `cache_control: {"type":"ephemeral"}` on the system prompt and on the
    /// last tool, so both are cached across the calls of a run.
    SystemAndTools,
    /// Those two and a third on the last block of the last message, moved
    /// to the new last message on every call: each call reads the
    /// conversation so far from the cache and writes what it adds (the
    /// cache hits are the answer's
    /// [`Usage::cache_read_input_tokens`](markov_core::Usage)). Three of
    /// the API's four breakpoints; a last block that cannot carry one (a
    /// thinking block) leaves the message without.
    #[default]
    Conversation,
}

/// Anthropic's context editing of tool uses (`clear_tool_uses_20250919`),
/// set with [`AnthropicBuilder::clear_tool_uses`]: once a request passes
/// its trigger, the API replaces the oldest tool results (and, if asked,
/// the calls' inputs) with a placeholder before the model reads it,
/// keeping the most recent tool uses.
///
/// The edit happens on Anthropic's side, on every request of the client:
/// markov's history, its context view and the request body stay as they
/// are (`context_management` is a field beside the messages, so the
/// client's cache of encoded messages keeps serving), and the edits the
/// API applied are recorded in the trace. It complements a context policy
/// (`ContextPolicy` in `markov-charter`), which decides what is sent; it
/// does not replace one: the conversation still grows on the wire, and a
/// request past the context window is still refused. Clearing changes the
/// prompt's prefix, so Anthropic's prompt cache is written again after
/// each clearing; [`clear_at_least`](Self::clear_at_least) makes each one
/// worth it.
///
/// Unset options take the API's defaults (a trigger of 100 000 input
/// tokens, the last 3 tool uses kept).
///
/// ```
/// use markov_providers::anthropic::{Anthropic, ClearToolUses};
///
/// let editing = ClearToolUses::new()
///     .trigger_input_tokens(30_000)
///     .keep_tool_uses(3)
///     .clear_at_least(5_000)
///     .exclude_tools(["memory"]);
/// let client = Anthropic::builder()
///     .base_url("http://127.0.0.1:1")
///     .clear_tool_uses(editing)
///     .build()
///     .unwrap();
/// # let _ = client;
///
/// // Nonsense is refused when the client is built.
/// let never = ClearToolUses::new().trigger_input_tokens(1_000).clear_at_least(5_000);
/// assert!(Anthropic::builder().base_url("http://127.0.0.1:1").clear_tool_uses(never).build().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClearToolUses {
    trigger: Option<Trigger>,
    keep_tool_uses: Option<u32>,
    clear_at_least: Option<u32>,
    exclude_tools: Vec<String>,
    clear_tool_inputs: bool,
}

/// When context editing starts clearing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trigger {
    InputTokens(u32),
    ToolUses(u32),
}

impl ClearToolUses {
    /// Context editing with the API's defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Clears once a request holds more than `tokens` input tokens.
    #[must_use]
    pub fn trigger_input_tokens(mut self, tokens: u32) -> Self {
        self.trigger = Some(Trigger::InputTokens(tokens));
        self
    }

    /// Clears once a request holds more than `uses` tool uses.
    #[must_use]
    pub fn trigger_tool_uses(mut self, uses: u32) -> Self {
        self.trigger = Some(Trigger::ToolUses(uses));
        self
    }

    /// Keeps the last `uses` tool uses (calls with their results) whole.
    #[must_use]
    pub fn keep_tool_uses(mut self, uses: u32) -> Self {
        self.keep_tool_uses = Some(uses);
        self
    }

    /// Clears only when at least `tokens` input tokens can be cleared, so
    /// that each clearing, which invalidates the prompt cache past it,
    /// saves more than the cache write costs.
    #[must_use]
    pub fn clear_at_least(mut self, tokens: u32) -> Self {
        self.clear_at_least = Some(tokens);
        self
    }

    /// Never clears the uses of these tools (a memory tool, say).
    #[must_use]
    pub fn exclude_tools<I, S>(mut self, tools: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.exclude_tools = tools.into_iter().map(Into::into).collect();
        self
    }

    /// Clears the calls' inputs too, not only their results.
    #[must_use]
    pub fn clear_tool_inputs(mut self, clear: bool) -> Self {
        self.clear_tool_inputs = clear;
        self
    }

    /// The option checked, as the `context_management` field.
    fn to_field(&self) -> Result<serde_json::Value, ConfigError> {
        use serde_json::{Map, Value, json};
        let refused = |reason: String| ConfigError::InvalidOption {
            option: "clear_tool_uses",
            reason,
        };
        let mut edit = Map::new();
        edit.insert("type".into(), json!("clear_tool_uses_20250919"));
        match self.trigger {
            Some(Trigger::InputTokens(0) | Trigger::ToolUses(0)) => {
                return Err(refused(
                    "a trigger of 0 would clear on every request".into(),
                ));
            }
            Some(Trigger::InputTokens(tokens)) => {
                edit.insert(
                    "trigger".into(),
                    json!({"type": "input_tokens", "value": tokens}),
                );
            }
            Some(Trigger::ToolUses(uses)) => {
                edit.insert(
                    "trigger".into(),
                    json!({"type": "tool_uses", "value": uses}),
                );
            }
            None => {}
        }
        if let Some(uses) = self.keep_tool_uses {
            edit.insert("keep".into(), json!({"type": "tool_uses", "value": uses}));
        }
        match (self.clear_at_least, self.trigger) {
            (Some(0), _) => {
                return Err(refused("clear_at_least of 0 tokens: leave it unset".into()));
            }
            (Some(least), Some(Trigger::InputTokens(trigger))) if least >= trigger => {
                return Err(refused(format!(
                    "clear_at_least ({least} tokens) is not below the trigger ({trigger} tokens): nothing could ever be cleared"
                )));
            }
            (Some(least), _) => {
                edit.insert(
                    "clear_at_least".into(),
                    json!({"type": "input_tokens", "value": least}),
                );
            }
            (None, _) => {}
        }
        if let Some(empty) = self.exclude_tools.iter().find(|t| t.trim().is_empty()) {
            return Err(refused(format!("an excluded tool has no name ({empty:?})")));
        }
        if !self.exclude_tools.is_empty() {
            edit.insert("exclude_tools".into(), json!(self.exclude_tools));
        }
        if self.clear_tool_inputs {
            edit.insert("clear_tool_inputs".into(), json!(true));
        }
        Ok(json!({"edits": [Value::Object(edit)]}))
    }
}

/// A client of the Anthropic Messages API.
///
/// Built by [`Anthropic::builder`] or [`Anthropic::from_env`]; cheap to
/// clone (the connection pool is shared). Its `Debug` output never shows the
/// API key.
#[derive(Clone)]
pub struct Anthropic {
    transport: Transport,
    url: Url,
    /// `{base}/v1/messages/count_tokens`.
    count_url: Url,
    /// `{base}/v1/models`, the list of the models the server serves.
    models_url: Url,
    /// llama.cpp's `{server}/props`, which reports its context.
    props_url: Url,
    model: String,
    shape: wire::Shape,
    body_cache: BodyCache,
}

impl fmt::Debug for Anthropic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Anthropic")
            .field("url", &crate::transport::redact_url(self.url.as_str()))
            .field("model", &self.model)
            .field("caching", &self.shape.caching)
            .field("context_management", &self.shape.context_management)
            .field("api_key", &"<redacted>")
            .finish_non_exhaustive()
    }
}

/// Configures an [`Anthropic`] client. Every setting but the key has a default.
#[derive(Clone)]
pub struct AnthropicBuilder {
    api_key: Option<ApiKey>,
    base_url: String,
    /// The environment variable `base_url` came from, for errors.
    base_url_var: Option<&'static str>,
    model: String,
    caching: PromptCaching,
    structured_output: StructuredOutput,
    clear_tool_uses: Option<ClearToolUses>,
    transport: TransportConfig,
    body_cache_bytes: usize,
}

impl fmt::Debug for AnthropicBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnthropicBuilder")
            .field("api_key", &self.api_key)
            .field("base_url", &crate::transport::redact_url(&self.base_url))
            .field("model", &self.model)
            .field("caching", &self.caching)
            .field("structured_output", &self.structured_output)
            .field("clear_tool_uses", &self.clear_tool_uses)
            .field("transport", &self.transport)
            .field("body_cache_bytes", &self.body_cache_bytes)
            .finish()
    }
}

impl Default for AnthropicBuilder {
    fn default() -> Self {
        AnthropicBuilder {
            api_key: None,
            base_url: DEFAULT_BASE_URL.to_owned(),
            base_url_var: None,
            model: DEFAULT_MODEL.to_owned(),
            caching: PromptCaching::default(),
            structured_output: StructuredOutput::default(),
            clear_tool_uses: None,
            transport: TransportConfig::DEFAULT,
            body_cache_bytes: crate::body::DEFAULT_BODY_CACHE_BYTES,
        }
    }
}

impl AnthropicBuilder {
    /// A builder from `ANTHROPIC_API_KEY` and `ANTHROPIC_BASE_URL`. The
    /// key may be left out for another address (a local server may need
    /// none).
    ///
    /// # Errors
    /// [`ConfigError::MissingEnv`] naming `ANTHROPIC_API_KEY` when neither
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

    /// Sets the API key (sent as `x-api-key`).
    #[must_use]
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(ApiKey::new(key));
        self
    }

    /// Sets the base URL (default [`DEFAULT_BASE_URL`]); requests go to
    /// `{base}/v1/messages`, so the base URL has **no** `/v1`: e.g.
    /// `http://localhost:8080` for llama.cpp's server (a base URL ending in
    /// `/v1` is refused by [`build`](Self::build), naming the fix).
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

    /// Sets where prompt-caching breakpoints go.
    #[must_use]
    pub fn prompt_caching(mut self, caching: PromptCaching) -> Self {
        self.caching = caching;
        self
    }

    /// Sets how a structured answer is asked for on a call that also
    /// offers tools (default [`StructuredOutput::Auto`]: `output_format` at
    /// `api.anthropic.com`, the output tool at any other address, such as
    /// llama.cpp's server, which makes tool calls impossible under a
    /// schema). See [the crate docs](crate#structured-output-with-tools).
    #[must_use]
    pub fn structured_output(mut self, mode: StructuredOutput) -> Self {
        self.structured_output = mode;
        self
    }

    /// Has the API clear old tool uses from every request (Anthropic's
    /// context editing, a beta; see [`ClearToolUses`]). Off by default.
    ///
    /// The history, the context views and the request cache are
    /// unchanged by it. OpenAI's Responses API has a compaction of its own
    /// instead, which a context policy uses with `Summarize::native`
    /// (`Model::compact`; its items are never sent to Anthropic), and
    /// Gemini none; see docs/guide/context-and-cost.md.
    #[must_use]
    pub fn clear_tool_uses(mut self, editing: ClearToolUses) -> Self {
        self.clear_tool_uses = Some(editing);
        self
    }

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

    /// Sets how many times a failed call is retried (default 2). Only
    /// retryable failures are retried: 408, 409, 429, 5xx, `overloaded_error`,
    /// timeouts and connection failures.
    #[must_use]
    pub fn max_retries(mut self, retries: u32) -> Self {
        self.transport.max_retries = retries;
        self
    }

    /// Sets the exponential backoff between retries: `initial` before the
    /// first, doubling up to `max`, each wait jittered into the upper half of
    /// its step (defaults 500 ms and 8 s). A `retry-after` from the provider
    /// takes precedence; one above 60 s ends the retries.
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
    /// [`ConfigError::MissingApiKey`] without a key for Anthropic's own
    /// address (another server may need none), [`ConfigError::InvalidBaseUrl`],
    /// [`ConfigError::InvalidApiKey`], [`ConfigError::InvalidOption`] for
    /// context editing that could never clear anything (a zero trigger or
    /// `clear_at_least`, `clear_at_least` not below an input-token trigger,
    /// an excluded tool without a name), or [`ConfigError::HttpClient`]
    /// when TLS cannot be set up (no system root certificates for an https
    /// URL).
    pub fn build(self) -> Result<Anthropic, ConfigError> {
        let context_management = self
            .clear_tool_uses
            .as_ref()
            .map(ClearToolUses::to_field)
            .transpose()?;
        let base = transport::parse_base_url(&self.base_url, self.base_url_var)?;
        if base.path().trim_end_matches('/').ends_with("/v1") {
            let mut without = base.clone();
            let path = base.path().trim_end_matches('/');
            without.set_path(&path[..path.len() - 3]);
            return Err(ConfigError::InvalidBaseUrl {
                url: crate::transport::redact_url(base.as_str()),
                var: self.base_url_var,
                reason: format!(
                    "the anthropic client adds /v1/messages itself: leave /v1 out (\"{}\")",
                    crate::transport::redact_url(without.as_str()).trim_end_matches('/')
                ),
            });
        }
        let mut headers = HeaderMap::new();
        match &self.api_key {
            Some(key) => {
                headers.insert("x-api-key", key.header("")?);
            }
            None if base.host_str() == Some("api.anthropic.com") => {
                return Err(ConfigError::MissingApiKey);
            }
            None => {}
        }
        headers.insert("anthropic-version", HeaderValue::from_static(API_VERSION));
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Ok(Anthropic {
            transport: Transport::new(self.transport, &base, headers)?,
            url: endpoint(&base, "v1/messages"),
            count_url: endpoint(&base, "v1/messages/count_tokens"),
            models_url: endpoint(&base, "v1/models"),
            props_url: crate::transport::props_endpoint(&base),
            model: self.model,
            shape: wire::Shape {
                caching: self.caching,
                schema_with_tools: self
                    .structured_output
                    .schema_with_tools(base.host_str() == Some("api.anthropic.com")),
                context_management,
            },
            body_cache: BodyCache::new(self.body_cache_bytes),
        })
    }
}

impl Anthropic {
    /// A builder with the defaults and no key.
    pub fn builder() -> AnthropicBuilder {
        AnthropicBuilder::default()
    }

    /// A client from `ANTHROPIC_API_KEY` and `ANTHROPIC_BASE_URL`; see
    /// [`AnthropicBuilder::from_env`].
    ///
    /// # Errors
    /// [`ConfigError::MissingEnv`] when neither variable is set, or any error
    /// of [`AnthropicBuilder::build`].
    pub fn from_env() -> Result<Self, ConfigError> {
        AnthropicBuilder::from_env()?.build()
    }

    /// The URL calls are sent to (`{base}/v1/messages`), with any password
    /// or query in it redacted, as errors and `Debug` output show it.
    pub fn endpoint(&self) -> String {
        crate::transport::redact_url(self.url.as_str())
    }

    /// The model used when a request names none.
    pub fn default_model(&self) -> &str {
        &self.model
    }

    /// Whether the client talks to Anthropic's own service (not a local
    /// server or a proxy).
    pub fn is_vendor(&self) -> bool {
        self.url.host_str() == Some("api.anthropic.com")
    }

    /// The client with another default model (the pool is shared).
    #[must_use]
    pub fn with_default_model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }

    /// The ids of the models the server serves (`GET {base}/v1/models`,
    /// which llama.cpp's server answers too), in its order.
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
    /// use markov_providers::Anthropic;
    ///
    /// let client = Anthropic::builder().base_url("http://127.0.0.1:1").build().unwrap();
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
        self.body(request, wire::Purpose::Call { stream })
    }

    /// The exact body this client sends to count `request`'s input tokens
    /// (`/v1/messages/count_tokens`): the call's body without
    /// `max_tokens`, `temperature` and `stream`, its messages taken from
    /// the same cache.
    ///
    /// # Errors
    /// As [`Self::request_body`].
    pub fn count_body(&self, request: &ModelRequest<'_>) -> Result<Vec<u8>, ModelError> {
        self.body(request, wire::Purpose::Count)
    }

    fn body(
        &self,
        request: &ModelRequest<'_>,
        purpose: wire::Purpose,
    ) -> Result<Vec<u8>, ModelError> {
        let model = self.model_for(request);
        let body = wire::encode(request, model, &self.shape, purpose, Some(&self.body_cache))?;
        // Debug and test builds check every cached body against the body
        // encoded afresh: every test of the workspace checks the cache.
        #[cfg(debug_assertions)]
        if let Err(mismatch) = crate::body::check_cached(
            &body,
            &wire::encode_plain(request, model, &self.shape, purpose)?,
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
        wire::encode_plain(request, model, &self.shape, wire::Purpose::Call { stream })
    }

    /// Posts `body` to `url` with the betas it needs: structured output
    /// when `structured`, context editing when the client edits context.
    async fn post_to(
        &self,
        url: &Url,
        body: Bytes,
        structured: bool,
    ) -> Result<reqwest::Response, ModelError> {
        let mut builder = self.transport.client().post(url.clone()).body(body);
        let betas: Vec<&str> = [
            structured.then_some(STRUCTURED_OUTPUTS_BETA),
            self.shape
                .context_management
                .is_some()
                .then_some(CONTEXT_MANAGEMENT_BETA),
        ]
        .into_iter()
        .flatten()
        .collect();
        if !betas.is_empty() {
            builder = builder.header("anthropic-beta", betas.join(","));
        }
        let response = builder
            .send()
            .await
            .map_err(|e| transport_error(e, self.transport.timeout()))?;
        check_status(response).await
    }

    async fn post(&self, body: Bytes, structured: bool) -> Result<reqwest::Response, ModelError> {
        self.post_to(&self.url, body, structured).await
    }
}

/// Decodes a recorded Messages API event stream (the bytes of a streamed
/// response's body) with the client's own decoder: the [`StreamEvent`]s a
/// streamed call would have yielded, ending with
/// [`StreamEvent::Done`]. For tests that replay recorded streams, and for
/// benchmarks.
///
/// ```
/// use markov_core::{Item, StreamEvent};
///
/// let body = concat!(
///     "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3}}}\n\n",
///     "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
///     "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n",
///     "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
/// );
/// let events = markov_providers::anthropic::replay_stream(body.as_bytes()).unwrap();
/// let Some(StreamEvent::Done(response)) = events.last() else { panic!() };
/// assert_eq!(response.content, vec![Item::text("Hi")]);
/// ```
///
/// # Errors
/// What a streamed call would fail with: an `error` event, a malformed
/// event, a body that ends before `message_stop`.
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
        gen_ai.provider.name = "anthropic",
        gen_ai.request.model = model,
        attempt = tracing::field::Empty
    )
}

fn count_span(model: &str) -> tracing::Span {
    tracing::info_span!(
        "count_tokens",
        gen_ai.provider.name = "anthropic",
        gen_ai.request.model = model,
        attempt = tracing::field::Empty
    )
}

#[async_trait]
impl Model for Anthropic {
    fn provider_name(&self) -> &str {
        "anthropic"
    }

    fn model_name(&self) -> Option<&str> {
        Some(&self.model)
    }

    /// Asks `/v1/messages/count_tokens` (not billed by Anthropic), under
    /// the client's limits, timeout and retries. A request that offers
    /// server tools is [`InputTokenCount::NotOffered`]: the endpoint
    /// refuses them.
    async fn count_tokens(&self, request: ModelRequest<'_>) -> Result<InputTokenCount, ModelError> {
        if !request.provider_tools().is_empty() {
            return Ok(InputTokenCount::NotOffered);
        }
        let span = count_span(self.model_for(&request));
        let body = Bytes::from(self.count_body(&request)?);
        let structured = Plan::of(&request, self.shape.schema_with_tools)
            .schema_field()
            .is_some();
        let call = async {
            let answer = self
                .transport
                .count(&span, || {
                    self.post_to(&self.count_url, body.clone(), structured)
                })
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
        let body = Bytes::from(self.request_body(&request, false)?);
        let plan = Plan::of(&request, self.shape.schema_with_tools);
        let structured = plan.schema_field().is_some();
        let call = async {
            let _place = self
                .transport
                .enter(body.len(), request.settings().max_tokens)
                .await?;
            let bytes = self
                .transport
                .with_retries_by_deadline(&span, || async {
                    let response = self.post(body.clone(), structured).await?;
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
        let plan = Plan::of(&request, self.shape.schema_with_tools);
        if plan.tool().is_some() {
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
        let structured = plan.schema_field().is_some();
        let body_len = body.len();
        let endpoint = move || self.endpoint();
        let connect_span = span.clone();
        let connect = async move {
            self.transport
                .with_retries(&connect_span, || self.post(body.clone(), structured))
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

    /// `from_env` with `ANTHROPIC_BASE_URL` alone (through a lookup, so the
    /// test leaves the process environment alone) talks to that server,
    /// without a key.
    #[tokio::test]
    async fn from_env_reads_the_base_url_and_a_local_server_needs_no_key() {
        use markov_core::{Item, Message, ModelSettings};
        use markov_testkit::http::{FakeServer, Reply, anthropic};

        let server = FakeServer::start().await;
        server.reply(Reply::json(
            200,
            anthropic::text("hello from a local server"),
        ));
        let base = server.base_url();
        let local = |name: &str| (name == BASE_URL_ENV).then(|| base.clone());
        let model = AnthropicBuilder::from_env_with(&local)
            .and_then(AnthropicBuilder::build)
            .unwrap();
        assert_eq!(model.endpoint(), format!("{base}/v1/messages"));
        let history = [Message::user("hi")];
        let settings = ModelSettings::default();
        let answer = model
            .complete(ModelRequest::new("", &history, &settings))
            .await
            .unwrap();
        assert_eq!(
            answer.content,
            vec![Item::text("hello from a local server")]
        );
        let sent = server.single();
        assert_eq!(sent.path, "/v1/messages");
        assert_eq!(sent.header("x-api-key"), None);
    }

    #[test]
    fn from_env_requires_the_key() {
        let empty = |_: &str| None;
        assert!(matches!(
            AnthropicBuilder::from_env_with(&empty),
            Err(ConfigError::MissingEnv {
                var: "ANTHROPIC_API_KEY"
            })
        ));
        let blank = |_: &str| Some("  ".to_owned());
        assert!(AnthropicBuilder::from_env_with(&blank).is_err());
        let set = |name: &str| (name == API_KEY_ENV).then(|| "sk-ant-secret".to_owned());
        let builder = AnthropicBuilder::from_env_with(&set).unwrap();
        assert!(!format!("{builder:?}").contains("sk-ant-secret"));
        let client = builder.build().unwrap();
        assert!(!format!("{client:?}").contains("sk-ant-secret"));
    }
}

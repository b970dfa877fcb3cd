//! One client for every vendor: [`Client`] holds the plumbing the four
//! APIs share (the builder's settings, the transport with its retries,
//! limits, timeouts and TLS, the `complete`/`stream`/`count_tokens`
//! skeleton, the spans), and a [`Vendor`] holds only what differs: its
//! names and environment variables, its headers, how a request is encoded
//! and an answer decoded, its stream's event decoder, and its own hooks
//! (Anthropic's context-editing betas, Gemini's schema check, the Responses
//! API's compaction and token-limit reading).
//!
//! The user-facing names are aliases: `Anthropic` is
//! `Client<AnthropicVendor>`, `AnthropicBuilder` is
//! `ClientBuilder<AnthropicVendor>`, and so on. A setter only one vendor
//! takes lives in an `impl ClientBuilder<ThatVendor>` block of the vendor's
//! module. `docs/guide/adding-a-vendor.md` says what a new vendor takes.

// `Vendor` is crate-private on purpose: a vendor is added in this crate
// (its wire types never leave it), so the bound on the public client
// names a trait outside users cannot implement.
#![allow(private_bounds)]

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use markov_core::model::{Compaction, InputTokenCount};
use markov_core::{
    Model, ModelError, ModelRequest, ModelResponse, StreamEvent, ToolDefinition, Unsupported,
};
use reqwest::Url;
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderValue};
use tracing::Instrument;

use crate::error::ConfigError;
use crate::limits::Limits;
use crate::output::{Plan, StructuredOutput};
use crate::sse::{SseDecoder, log_done, sse_stream};
use crate::transport::{
    self, ApiKey, Transport, TransportConfig, check_status, redact_url, transport_error,
};

/// What a request body is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// A model call, streamed or not.
    Call {
        /// Whether the answer is streamed.
        stream: bool,
    },
    /// A token count (only for a vendor whose [`Vendor::count_url`] names
    /// one).
    Count,
    /// A native compaction (the Responses API only).
    Compact,
}

/// The error of a vendor asked for a body it has no endpoint for.
pub(crate) fn not_offered(vendor: &str, purpose: Purpose) -> ModelError {
    ModelError::InvalidRequest(format!("the {vendor} client has no {purpose:?} request"))
}

/// What the builder hands a vendor to build its part of a client from.
pub(crate) struct Parts<'a, O> {
    /// The base URL, parsed and checked.
    pub(crate) base: &'a Url,
    /// The environment variable the base URL came from, for errors.
    pub(crate) base_var: Option<&'static str>,
    /// Whether the base URL is the vendor's own service.
    pub(crate) at_vendor: bool,
    /// The vendor's own options.
    pub(crate) options: O,
    /// How a structured answer is asked for beside tools.
    pub(crate) structured_output: StructuredOutput,
    /// The body cache's size, for a vendor that keeps encoded messages.
    pub(crate) body_cache_bytes: usize,
}

/// What one vendor's API is: everything [`Client`] does not share.
///
/// Every method with a default is a hook only some vendors need.
pub(crate) trait Vendor: fmt::Debug + Clone + Send + Sync + Sized + 'static {
    /// The builder options only this vendor takes (`()` for none).
    type Options: fmt::Debug + Clone + Default + Send + Sync;
    /// The decoder of a streamed answer's events.
    type Decoder: SseDecoder + Default + 'static;

    /// The client's name in `Debug` output (`"Anthropic"`).
    const NAME: &'static str;
    /// `Model::provider_name` and the spans' `gen_ai.provider.name`.
    const PROVIDER: &'static str;
    /// The vendor's own address.
    const DEFAULT_BASE_URL: &'static str;
    /// The model used when neither the client nor the request names one.
    const DEFAULT_MODEL: &'static str;
    /// The environment variable holding the API key.
    const API_KEY_ENV: &'static str;
    /// The environment variable holding another address.
    const BASE_URL_ENV: &'static str;
    /// The host of the vendor's own service, where a key is required.
    const HOST: &'static str;
    /// The header the key is sent in, and what precedes the key in it.
    const KEY_HEADER: (&'static str, &'static str);
    /// The path of the model list under the base URL.
    const MODELS_PATH: &'static str;
    /// Whether [`Client::served_facts`] asks the server (llama.cpp's
    /// `/props`, vLLM's model list): a local server may speak this API.
    const ASKS_SERVED_FACTS: bool = true;
    /// Whether requests reuse encoded messages, so that debug builds
    /// check the cached body against a fresh one.
    #[cfg_attr(not(any(debug_assertions, test)), allow(dead_code))]
    const CACHES_BODIES: bool = false;

    /// Headers sent on every request besides the key and content type.
    fn fixed_headers(headers: &mut HeaderMap) {
        let _ = headers;
    }

    /// The vendor's part of a client, its options checked.
    ///
    /// # Errors
    /// An option or base URL this vendor refuses.
    fn build(parts: Parts<'_, Self::Options>) -> Result<Self, ConfigError>;

    /// Whether the schema field is sent next to tools (see
    /// [`crate::output`]).
    fn schema_with_tools(&self) -> bool;

    /// Where a call of `model` goes.
    fn call_url(&self, model: &str, stream: bool) -> Cow<'_, Url>;

    /// Where a token count of `request` goes; `None` when the API offers
    /// none for it (`count_tokens` then answers `NotOffered`).
    fn count_url(&self, request: &ModelRequest<'_>, model: &str) -> Option<Url> {
        let _ = (request, model);
        None
    }

    /// The body for `request`, from the body cache when `cached`.
    ///
    /// # Errors
    /// A request this API cannot carry.
    fn encode(
        &self,
        request: &ModelRequest<'_>,
        model: &str,
        purpose: Purpose,
        cached: bool,
    ) -> Result<Vec<u8>, ModelError>;

    /// A whole (not streamed) answer.
    ///
    /// # Errors
    /// An answer that cannot be read.
    fn decode(&self, body: &[u8]) -> Result<ModelResponse, ModelError>;

    /// A token count's answer (only asked where [`Self::count_url`] names
    /// an endpoint).
    ///
    /// # Errors
    /// An answer that cannot be read.
    fn decode_count(&self, body: &str) -> Result<u64, ModelError> {
        let _ = body;
        Err(not_offered(Self::NAME, Purpose::Count))
    }

    /// Adds what one request needs besides its body (Anthropic's betas),
    /// as `needs` says.
    fn prepare(&self, request: reqwest::RequestBuilder, needs: Needs) -> reqwest::RequestBuilder {
        let _ = needs;
        request
    }

    /// An error from `url`, with the vendor's hint where it has one.
    fn on_error(&self, error: ModelError, url: &Url) -> ModelError {
        let _ = url;
        error
    }

    /// Whether [`Self::finish`] may change an answer: without it a stream
    /// is not mapped at all.
    const FINISHES: bool = false;

    /// The answer as the vendor reads it, under the request's token limit.
    fn finish(&self, answer: ModelResponse, max_tokens: u32) -> ModelResponse {
        let _ = max_tokens;
        answer
    }

    /// A model's own name as the model list gives it.
    fn served_model(listed: String) -> String {
        listed
    }

    /// See [`Model::check_tools`].
    ///
    /// # Errors
    /// A tool or output type this API cannot express.
    fn check_tools(
        &self,
        tools: &[ToolDefinition],
        output_schema: Option<&serde_json::Value>,
    ) -> Result<(), Unsupported> {
        let _ = (tools, output_schema);
        Ok(())
    }

    /// See [`Model::native_summaries`].
    fn native_summaries(&self) -> Option<&str> {
        None
    }

    /// See [`Model::native_tool_search`].
    fn native_tool_search(&self) -> bool {
        false
    }

    /// See [`Model::compact`].
    fn compact<'a>(
        client: &'a Client<Self>,
        request: ModelRequest<'a>,
    ) -> BoxFuture<'a, Result<Compaction, ModelError>> {
        let _ = (client, request);
        Box::pin(async { Ok(Compaction::NotOffered) })
    }
}

/// A vendor whose client keeps encoded messages between calls, so that its
/// builder takes [`ClientBuilder::body_cache_bytes`].
pub(crate) trait CachesBodies: Vendor {}

/// A model client of one vendor's API: [`crate::Anthropic`],
/// [`crate::OpenAi`], [`crate::Responses`] or [`crate::Gemini`], each an
/// alias of this type.
///
/// Built by `builder()` or `from_env()`; cheap to clone (the connection
/// pool, the limits and the body cache are shared). Its `Debug` output
/// never shows the API key.
#[derive(Clone)]
pub struct Client<V: Vendor> {
    pub(crate) transport: Transport,
    pub(crate) base: Url,
    pub(crate) model: String,
    pub(crate) vendor: V,
}

impl<V: Vendor> fmt::Debug for Client<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(V::NAME)
            .field("url", &self.endpoint())
            .field("model", &self.model)
            .field("vendor", &self.vendor)
            .field("api_key", &"<redacted>")
            .finish_non_exhaustive()
    }
}

/// Configures a [`Client`]: [`crate::AnthropicBuilder`],
/// [`crate::OpenAiBuilder`], [`crate::ResponsesBuilder`] or
/// [`crate::GeminiBuilder`]. Every setting but the key has a default; the
/// setters here are every vendor's, each vendor's module adds its own.
#[derive(Clone)]
pub struct ClientBuilder<V: Vendor> {
    api_key: Option<ApiKey>,
    base_url: String,
    /// The environment variable `base_url` came from, for errors.
    base_url_var: Option<&'static str>,
    model: String,
    structured_output: StructuredOutput,
    transport: TransportConfig,
    body_cache_bytes: usize,
    pub(crate) options: V::Options,
}

impl<V: Vendor> fmt::Debug for ClientBuilder<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(&format!("{}Builder", V::NAME))
            .field("api_key", &self.api_key)
            .field("base_url", &redact_url(&self.base_url))
            .field("model", &self.model)
            .field("structured_output", &self.structured_output)
            .field("options", &self.options)
            .field("transport", &self.transport)
            .field("body_cache_bytes", &self.body_cache_bytes)
            .finish()
    }
}

impl<V: Vendor> Default for ClientBuilder<V> {
    fn default() -> Self {
        ClientBuilder {
            api_key: None,
            base_url: V::DEFAULT_BASE_URL.to_owned(),
            base_url_var: None,
            model: V::DEFAULT_MODEL.to_owned(),
            structured_output: StructuredOutput::default(),
            transport: TransportConfig::DEFAULT,
            body_cache_bytes: crate::body::DEFAULT_BODY_CACHE_BYTES,
            options: V::Options::default(),
        }
    }
}

impl<V: Vendor> ClientBuilder<V> {
    /// A builder from the vendor's key and base URL variables
    /// (`ANTHROPIC_API_KEY` and `ANTHROPIC_BASE_URL`, `OPENAI_API_KEY` and
    /// `OPENAI_BASE_URL` for both OpenAI clients, `GEMINI_API_KEY` and
    /// `GEMINI_BASE_URL`). The key may be left out for another address (a
    /// local server may need none).
    ///
    /// # Errors
    /// [`ConfigError::MissingEnv`] naming the key's variable when neither
    /// variable is set.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_env_with(&transport::process_env)
    }

    /// [`Self::from_env`] through a lookup, so that tests leave the process
    /// environment alone.
    pub(crate) fn from_env_with(env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let key = transport::env_var(env, V::API_KEY_ENV);
        let base = transport::env_var(env, V::BASE_URL_ENV);
        if key.is_none() && base.is_none() {
            return Err(ConfigError::MissingEnv {
                var: V::API_KEY_ENV,
            });
        }
        let mut builder = Self::default();
        if let Some(key) = key {
            builder = builder.api_key(key);
        }
        if let Some(base) = base {
            builder = builder.base_url(base);
            builder.base_url_var = Some(V::BASE_URL_ENV);
        }
        Ok(builder)
    }

    /// Sets the API key (sent as `x-api-key` to Anthropic,
    /// `Authorization: Bearer <key>` to OpenAI, `x-goog-api-key` to
    /// Gemini).
    #[must_use]
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.api_key = Some(ApiKey::new(key));
        self
    }

    /// Sets the base URL (default the vendor's `DEFAULT_BASE_URL`). The
    /// OpenAI clients' base URL **includes** `/v1` (requests go to
    /// `{base}/chat/completions` or `{base}/responses`: e.g.
    /// `http://localhost:8080/v1` for llama.cpp's server,
    /// `http://localhost:8000/v1` for vLLM, `http://localhost:11434/v1` for
    /// Ollama; a `404` from a base URL without `/v1` says so). Anthropic's
    /// has **no** `/v1` (requests go to `{base}/v1/messages`, e.g.
    /// `http://localhost:8080`; one ending in `/v1` is refused by
    /// [`build`](Self::build), naming the fix), nor has Gemini's `/v1beta`
    /// (`{base}/v1beta/models/{model}:generateContent`).
    #[must_use]
    pub fn base_url(mut self, url: impl Into<String>) -> Self {
        self.base_url = url.into();
        self.base_url_var = None;
        self
    }

    /// Sets the model used when a request's settings name none (default the
    /// vendor's `DEFAULT_MODEL`).
    #[must_use]
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }

    /// Sets how a structured answer is asked for on a call that also
    /// offers tools (default [`StructuredOutput::Auto`]: the vendor's
    /// schema field — `output_format`, `response_format`, `text.format` —
    /// at the vendor's own address, the output tool elsewhere, since
    /// llama.cpp's server and vLLM make tool calls impossible under a
    /// schema; for Gemini, whose API refuses a response schema beside
    /// function declarations on most models, always the output tool). See
    /// [the crate docs](crate#structured-output-with-tools).
    #[must_use]
    pub fn structured_output(mut self, mode: StructuredOutput) -> Self {
        self.structured_output = mode;
        self
    }

    /// Sets how many times a failed call is retried (default 2). Only
    /// retryable failures are retried: 408, 409, 429, 5xx, overload,
    /// timeouts and connection failures.
    #[must_use]
    pub fn max_retries(mut self, retries: u32) -> Self {
        self.transport.max_retries = retries;
        self
    }

    /// Sets the exponential backoff between retries: `initial` before the
    /// first, doubling up to `max`, each wait jittered into the upper half of
    /// its step (defaults 500 ms and 8 s). A `retry-after` (or
    /// `retry-after-ms`) from the server takes precedence; one above 60 s
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
    /// [`ConfigError::MissingApiKey`] without a key for the vendor's own
    /// address (another server may need none), [`ConfigError::InvalidBaseUrl`]
    /// (naming the variable it came from), [`ConfigError::InvalidApiKey`],
    /// [`ConfigError::InvalidOption`] for a vendor option that could never
    /// work (see the vendor's setters), or [`ConfigError::HttpClient`] when
    /// TLS cannot be set up (no system root certificates for an https URL).
    pub fn build(self) -> Result<Client<V>, ConfigError> {
        let base = transport::parse_base_url(&self.base_url, self.base_url_var)?;
        let at_vendor = base.host_str() == Some(V::HOST);
        let vendor = V::build(Parts {
            base: &base,
            base_var: self.base_url_var,
            at_vendor,
            options: self.options,
            structured_output: self.structured_output,
            body_cache_bytes: self.body_cache_bytes,
        })?;
        let mut headers = HeaderMap::new();
        match &self.api_key {
            Some(key) => {
                let (name, prefix) = V::KEY_HEADER;
                headers.insert(name, key.header(prefix)?);
            }
            None if at_vendor => return Err(ConfigError::MissingApiKey),
            None => {}
        }
        V::fixed_headers(&mut headers);
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Ok(Client {
            transport: Transport::new(self.transport, &base, headers)?,
            base,
            model: self.model,
            vendor,
        })
    }
}

impl<V: CachesBodies> ClientBuilder<V> {
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
}

impl<V: Vendor> Client<V> {
    /// A builder with the defaults and no key.
    pub fn builder() -> ClientBuilder<V> {
        ClientBuilder::default()
    }

    /// A client from the vendor's key and base URL variables; see
    /// [`ClientBuilder::from_env`].
    ///
    /// # Errors
    /// [`ConfigError::MissingEnv`] when neither variable is set, or any error
    /// of [`ClientBuilder::build`].
    pub fn from_env() -> Result<Self, ConfigError> {
        ClientBuilder::<V>::from_env()?.build()
    }

    /// The URL a call of the default model is sent to (for example
    /// `{base}/v1/messages`), with any password or query in it redacted, as
    /// errors and `Debug` output show it.
    pub fn endpoint(&self) -> String {
        redact_url(self.vendor.call_url(&self.model, false).as_str())
    }

    /// The model used when a request names none.
    pub fn default_model(&self) -> &str {
        &self.model
    }

    /// Whether the client talks to the vendor's own service (not a local
    /// server or a proxy).
    pub fn is_vendor(&self) -> bool {
        self.base.host_str() == Some(V::HOST)
    }

    /// The client with another default model (the pool is shared).
    #[must_use]
    pub fn with_default_model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }

    /// The ids of the models the server serves (`GET {base}/v1/models` for
    /// Anthropic, which llama.cpp's server answers too, `{base}/models` for
    /// OpenAI, `{base}/v1beta/models` for Gemini, `models/` left off), in
    /// its order.
    ///
    /// # Errors
    /// Any error of the call, as for a model call (not retried).
    pub async fn served_models(&self) -> Result<Vec<String>, ModelError> {
        let url = transport::endpoint(&self.base, V::MODELS_PATH);
        let models = self.transport.list_models(url).await?;
        Ok(models.into_iter().map(V::served_model).collect())
    }

    /// What the server says of itself ([`crate::ServedFacts`]): the
    /// context window it runs the default model with (vLLM's model list,
    /// `max_model_len`; llama.cpp's `GET /props`, `n_ctx`) and whether its
    /// chat template handles tools (llama.cpp). Nothing for a server that
    /// does not say (the vendor's API, Ollama), and nothing asked of
    /// Gemini's. Each request is one attempt, bounded by the timeout (at
    /// most 5 s).
    ///
    /// # Errors
    /// The error of the last request when no request was answered.
    pub async fn served_facts(&self) -> Result<crate::ServedFacts, ModelError> {
        if !V::ASKS_SERVED_FACTS {
            return Ok(crate::ServedFacts::default());
        }
        let models = transport::endpoint(&self.base, V::MODELS_PATH);
        let props = transport::props_endpoint(&self.base);
        self.transport
            .served_facts(models, props, &self.model)
            .await
    }

    /// The exact body this client sends for `request` (`stream`: asking for
    /// a streamed answer), with the history's earlier messages taken from
    /// the client's cache when the request names its history (all but
    /// Gemini's keep one). For looking at what goes over the wire, and for
    /// benchmarks.
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
    ///
    /// # Errors
    /// A request this API cannot carry (no content, a provider built-in
    /// tool it does not offer, a schema it cannot express).
    pub fn request_body(
        &self,
        request: &ModelRequest<'_>,
        stream: bool,
    ) -> Result<Vec<u8>, ModelError> {
        self.body(request, Purpose::Call { stream })
    }

    /// The same bytes as [`Self::request_body`], every message encoded
    /// afresh (`serde_json::to_vec` of the whole request): the reference the
    /// cached form is checked against.
    ///
    /// # Errors
    /// As [`Self::request_body`].
    pub fn request_body_uncached(
        &self,
        request: &ModelRequest<'_>,
        stream: bool,
    ) -> Result<Vec<u8>, ModelError> {
        let model = self.model_for(request);
        self.vendor
            .encode(request, model, Purpose::Call { stream }, false)
    }

    pub(crate) fn model_for<'a>(&'a self, request: &ModelRequest<'a>) -> &'a str {
        request.settings().model.as_deref().unwrap_or(&self.model)
    }

    /// The body for `purpose`, checked in debug and test builds against the
    /// body encoded afresh where the vendor caches: every test of the
    /// workspace checks the cache.
    pub(crate) fn body(
        &self,
        request: &ModelRequest<'_>,
        purpose: Purpose,
    ) -> Result<Vec<u8>, ModelError> {
        let model = self.model_for(request);
        let body = self.vendor.encode(request, model, purpose, true)?;
        // Compiled out of release builds: the check is there to catch a
        // stale cache in the workspace's tests, not to cost users a second
        // encoding.
        #[cfg(any(debug_assertions, test))]
        if V::CACHES_BODIES
            && let Err(mismatch) = crate::body::check_cached(
                &body,
                &self.vendor.encode(request, model, purpose, false)?,
            )
        {
            panic!("{mismatch}");
        }
        Ok(body)
    }

    /// Posts `body` to `url` (with what the vendor adds to a request) and
    /// checks the answer's status.
    async fn post(
        &self,
        url: &Url,
        body: Bytes,
        needs: Needs,
    ) -> Result<reqwest::Response, ModelError> {
        let request = self
            .vendor
            .prepare(self.transport.client().post(url.clone()).body(body), needs);
        let response = request
            .send()
            .await
            .map_err(|e| transport_error(e, self.transport.timeout()))?;
        check_status(response)
            .await
            .map_err(|error| self.vendor.on_error(error, url))
    }

    /// One whole exchange: `body` posted to `url` under the client's
    /// limits (a place for the call's estimated tokens), retries, timeout
    /// and deadline; the answer's bytes.
    pub(crate) async fn exchange(
        &self,
        span: &tracing::Span,
        url: &Url,
        body: Bytes,
        needs: Needs,
        max_tokens: u32,
    ) -> Result<Bytes, ModelError> {
        let _place = self.transport.enter(body.len(), max_tokens).await?;
        self.transport
            .with_retries_by_deadline(span, || async {
                let response = self.post(url, body.clone(), needs).await?;
                response
                    .bytes()
                    .await
                    .map_err(|e| transport_error(e, self.transport.timeout()))
            })
            .await
    }

    /// The span of one of the client's requests (`provider_request`,
    /// `count_tokens`, `compact`).
    pub(crate) fn span(name: &'static str, model: &str) -> tracing::Span {
        match name {
            "count_tokens" => tracing::info_span!(
                "count_tokens",
                gen_ai.provider.name = V::PROVIDER,
                gen_ai.request.model = model,
                attempt = tracing::field::Empty
            ),
            "compact" => tracing::info_span!(
                "compact",
                gen_ai.provider.name = V::PROVIDER,
                gen_ai.request.model = model,
                attempt = tracing::field::Empty
            ),
            _ => tracing::info_span!(
                "provider_request",
                gen_ai.provider.name = V::PROVIDER,
                gen_ai.request.model = model,
                attempt = tracing::field::Empty
            ),
        }
    }
}

/// Decodes a recorded event stream (the bytes of a streamed response's
/// body) with `V`'s own decoder, under the default event size cap.
pub(crate) fn replay<V: Vendor>(body: &[u8]) -> Result<Vec<StreamEvent>, ModelError> {
    crate::sse::decode_body(
        V::Decoder::default(),
        body,
        TransportConfig::DEFAULT.max_event_bytes,
    )
}

/// What one request needs of the vendor besides its body.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Needs {
    /// The body carries the structured-output schema field.
    pub(crate) structured: bool,
    /// Some offered tools are deferred, for the provider's tool search.
    pub(crate) deferred_tools: bool,
}

impl Needs {
    /// The needs of `request`, whose body carries the schema field when
    /// `structured`.
    pub(crate) fn of(request: &ModelRequest<'_>, structured: bool) -> Self {
        Needs {
            structured,
            deferred_tools: !request.deferred_tools().is_empty(),
        }
    }
}

#[async_trait::async_trait]
impl<V: Vendor> Model for Client<V> {
    fn provider_name(&self) -> &str {
        V::PROVIDER
    }

    fn model_name(&self) -> Option<&str> {
        Some(&self.model)
    }

    fn check_tools(
        &self,
        tools: &[ToolDefinition],
        output_schema: Option<&serde_json::Value>,
    ) -> Result<(), Unsupported> {
        self.vendor.check_tools(tools, output_schema)
    }

    /// Asks the vendor's token count endpoint (Anthropic's
    /// `/v1/messages/count_tokens`, Gemini's `countTokens`, the Responses
    /// API's `/responses/input_tokens`) under the client's limits, timeout
    /// and retries; `NotOffered` where the API has none (Chat Completions)
    /// or refuses the request (Anthropic's, for server tools). A server
    /// that does not offer the endpoint answers an error like any other:
    /// the caller estimates instead.
    async fn count_tokens(&self, request: ModelRequest<'_>) -> Result<InputTokenCount, ModelError> {
        let model = self.model_for(&request);
        let Some(url) = self.vendor.count_url(&request, model) else {
            return Ok(InputTokenCount::NotOffered);
        };
        let span = Self::span("count_tokens", model);
        let body = Bytes::from(self.body(&request, Purpose::Count)?);
        let needs = Needs::of(
            &request,
            Plan::of(&request, self.vendor.schema_with_tools())
                .schema_field()
                .is_some(),
        );
        let call = async {
            let answer = self
                .transport
                .count(&span, || self.post(&url, body.clone(), needs))
                .await?;
            let tokens = self.vendor.decode_count(&answer)?;
            tracing::debug!(input_tokens = tokens, "counted");
            Ok(InputTokenCount::Counted(tokens))
        };
        call.instrument(span.clone()).await
    }

    fn native_summaries(&self) -> Option<&str> {
        self.vendor.native_summaries()
    }

    fn native_tool_search(&self) -> bool {
        self.vendor.native_tool_search()
    }

    async fn compact(&self, request: ModelRequest<'_>) -> Result<Compaction, ModelError> {
        V::compact(self, request).await
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let model = self.model_for(&request);
        let span = Self::span("provider_request", model);
        let plan = Plan::of(&request, self.vendor.schema_with_tools());
        let body = Bytes::from(self.request_body(&request, false)?);
        let url = self.vendor.call_url(model, false);
        let needs = Needs::of(&request, plan.schema_field().is_some());
        let max_tokens = request.settings().max_tokens;
        let call = async {
            let bytes = self.exchange(&span, &url, body, needs, max_tokens).await?;
            let answer = self.vendor.finish(self.vendor.decode(&bytes)?, max_tokens);
            crate::convert::check_forced_call(
                !request.tools().is_empty() || plan.tool().is_some(),
                plan.tool_choice(&request),
                &answer,
                || redact_url(url.as_str()),
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
        let plan = Plan::of(&request, self.vendor.schema_with_tools());
        if plan.tool().is_some() {
            // The answer is the output tool's call, turned into text once
            // whole: streamed, its deltas would show a call that is not one.
            return crate::output::replayed(self, request);
        }
        let model = self.model_for(&request);
        let span = Self::span("provider_request", model);
        let body = match self.request_body(&request, true) {
            Ok(body) => Bytes::from(body),
            Err(error) => return futures::stream::once(async { Err(error) }).boxed(),
        };
        let url = self.vendor.call_url(model, true).into_owned();
        let needs = Needs::of(&request, plan.schema_field().is_some());
        let body_len = body.len();
        let max_tokens = request.settings().max_tokens;
        let named = url.clone();
        let endpoint = move || redact_url(named.as_str());
        let connect_span = span.clone();
        let connect = async move {
            self.transport
                .with_retries(&connect_span, || self.post(&url, body.clone(), needs))
                .await
        };
        let stream = sse_stream(
            span,
            *self.transport.config(),
            connect,
            V::Decoder::default(),
        );
        let mut stream = self.transport.limited(body_len, max_tokens, stream);
        if V::FINISHES {
            stream = stream
                .map(move |event| match event {
                    Ok(StreamEvent::Done(answer)) => {
                        Ok(StreamEvent::Done(self.vendor.finish(answer, max_tokens)))
                    }
                    other => other,
                })
                .boxed();
        }
        crate::convert::checked_stream(
            stream,
            !request.tools().is_empty(),
            request.tool_choice(),
            endpoint,
        )
    }
}

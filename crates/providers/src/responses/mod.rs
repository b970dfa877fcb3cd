//! The OpenAI Responses API client (`POST {base}/responses`), for OpenAI
//! and the servers that speak it too (vLLM, llama.cpp's server).
//!
//! [`Responses`] implements [`Model`](markov_core::model::Model) with and without streaming. How
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
//! - **Token counts** ([`Model::count_tokens`](markov_core::model::Model::count_tokens)) → `POST
//!   {base}/responses/input_tokens` with the call's body less
//!   `max_output_tokens`, `temperature`, `store`, `include`,
//!   `prompt_cache_key` and `stream`; the answer's `input_tokens`.
//!
//! - **Compaction** ([`Model::compact`](markov_core::model::Model::compact)) → `POST {base}/responses/compact`
//!   with `model`, `instructions` and `input` as a call writes them; the
//!   answer's `output` items (the user messages kept, one `compaction`
//!   item of encrypted content) are kept as the server wrote them, byte
//!   for byte, never read, under the vendor tag of
//!   [`Model::native_summaries`](markov_core::model::Model::native_summaries): `openai.responses` at OpenAI,
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

use std::borrow::Cow;
use std::fmt;

use bytes::Bytes;
use futures::future::BoxFuture;
use markov_core::message::NativeItems;
use markov_core::model::{Compacted, Compaction};
use markov_core::{ModelError, ModelRequest, ModelResponse, StreamEvent};
use reqwest::Url;
use tracing::Instrument;

use crate::body::BodyCache;
use crate::client::{CachesBodies, Client, ClientBuilder, Parts, Purpose, Vendor};
use crate::error::ConfigError;
use crate::openai::SchemaStrictness;
use crate::transport::{self, endpoint};

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

/// The Responses API's part of a client: see [`Responses`].
#[derive(Clone)]
pub struct ResponsesVendor {
    /// `{base}/responses`.
    url: Url,
    /// `{base}/responses/input_tokens`.
    count_url: Url,
    /// `{base}/responses/compact`.
    compact_url: Url,
    /// The base URL, for the `/v1` hint of a `404`.
    base: Url,
    shape: wire::Shape,
    body_cache: BodyCache,
}

impl fmt::Debug for ResponsesVendor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponsesVendor")
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

/// The options only the Responses client takes.
#[derive(Debug, Clone, Default)]
pub(crate) struct ResponsesOptions {
    strictness: SchemaStrictness,
    store: bool,
    cache_key: PromptCacheKey,
}

/// A client of the Responses API.
///
/// Built by [`Responses::builder`] or [`Responses::from_env`]; cheap to
/// clone (the connection pool is shared). Its `Debug` output never shows
/// the API key. The setters and methods every client has are [`Client`]'s
/// and [`ClientBuilder`]'s.
pub type Responses = Client<ResponsesVendor>;

/// Configures a [`Responses`] client.
pub type ResponsesBuilder = ClientBuilder<ResponsesVendor>;

impl Vendor for ResponsesVendor {
    type Options = ResponsesOptions;
    type Decoder = stream::Decoder;
    const NAME: &'static str = "Responses";
    const PROVIDER: &'static str = "openai";
    const DEFAULT_BASE_URL: &'static str = DEFAULT_BASE_URL;
    const DEFAULT_MODEL: &'static str = DEFAULT_MODEL;
    const API_KEY_ENV: &'static str = API_KEY_ENV;
    const BASE_URL_ENV: &'static str = BASE_URL_ENV;
    const HOST: &'static str = "api.openai.com";
    const KEY_HEADER: (&'static str, &'static str) = ("authorization", "Bearer ");
    const MODELS_PATH: &'static str = "models";
    const CACHES_BODIES: bool = true;
    const FINISHES: bool = true;

    fn build(parts: Parts<'_, ResponsesOptions>) -> Result<Self, ConfigError> {
        let base = parts.base;
        let host = match (base.host_str(), base.port()) {
            (Some(host), Some(port)) => format!("{host}:{port}"),
            (host, _) => host.unwrap_or_default().to_owned(),
        };
        Ok(ResponsesVendor {
            url: endpoint(base, "responses"),
            count_url: endpoint(base, "responses/input_tokens"),
            compact_url: endpoint(base, "responses/compact"),
            base: base.clone(),
            shape: wire::Shape {
                strictness: parts.options.strictness,
                schema_with_tools: parts.structured_output.schema_with_tools(parts.at_vendor),
                store: parts.options.store,
                include_reasoning: parts.at_vendor,
                cache_key: parts.options.cache_key,
                native: wire::native_tag(&host, parts.at_vendor),
            },
            body_cache: BodyCache::new(parts.body_cache_bytes),
        })
    }

    fn schema_with_tools(&self) -> bool {
        self.shape.schema_with_tools
    }

    fn call_url(&self, _model: &str, _stream: bool) -> Cow<'_, Url> {
        Cow::Borrowed(&self.url)
    }

    /// A server that does not offer `/responses/input_tokens` (vLLM,
    /// llama.cpp's) answers `404`, an error like any other: the caller
    /// estimates instead.
    fn count_url(&self, _request: &ModelRequest<'_>, _model: &str) -> Option<Url> {
        Some(self.count_url.clone())
    }

    fn encode(
        &self,
        request: &ModelRequest<'_>,
        model: &str,
        purpose: Purpose,
        cached: bool,
    ) -> Result<Vec<u8>, ModelError> {
        let purpose = match purpose {
            Purpose::Call { stream } => wire::Purpose::Call { stream },
            Purpose::Count => wire::Purpose::Count,
            Purpose::Compact => wire::Purpose::Compact,
        };
        if cached {
            wire::encode(request, model, &self.shape, purpose, Some(&self.body_cache))
        } else {
            wire::encode_plain(request, model, &self.shape, purpose)
        }
    }

    fn decode(&self, body: &[u8]) -> Result<ModelResponse, ModelError> {
        wire::decode(body)
    }

    fn decode_count(&self, body: &str) -> Result<u64, ModelError> {
        wire::decode_count(body)
    }

    fn on_error(&self, error: ModelError, _url: &Url) -> ModelError {
        transport::hint_v1(error, &self.base)
    }

    fn finish(&self, answer: ModelResponse, max_tokens: u32) -> ModelResponse {
        cut_at_limit(answer, max_tokens)
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
    fn compact<'a>(
        client: &'a Responses,
        request: ModelRequest<'a>,
    ) -> BoxFuture<'a, Result<Compaction, ModelError>> {
        Box::pin(async move {
            let span = Responses::span("compact", client.model_for(&request));
            let body = Bytes::from(client.compact_body(&request)?);
            let call = async {
                let url = &client.vendor.compact_url;
                let bytes = client
                    .exchange(
                        &span,
                        url,
                        body,
                        crate::client::Needs::default(),
                        request.settings().max_tokens,
                    )
                    .await?;
                let text = std::str::from_utf8(&bytes).map_err(|e| {
                    ModelError::InvalidResponse(format!("the compaction is not UTF-8: {e}"))
                })?;
                let (items, usage) = wire::decode_compaction(text)?;
                tracing::debug!(items = items.len(), "compacted");
                Ok(Compaction::Compacted(Compacted::new(
                    NativeItems::new(client.vendor.shape.native.clone(), items),
                    usage,
                )))
            };
            call.instrument(span.clone()).await
        })
    }
}

impl CachesBodies for ResponsesVendor {}

impl ResponsesBuilder {
    /// Sets whether tool and output schemas are sent as strict (default
    /// lenient: `strict: false`).
    #[must_use]
    pub fn schema_strictness(mut self, strictness: SchemaStrictness) -> Self {
        self.options.strictness = strictness;
        self
    }

    /// Sets `store` (default `false`: markov keeps the history, and the
    /// server keeps nothing; reasoning comes back encrypted instead).
    #[must_use]
    pub fn store(mut self, store: bool) -> Self {
        self.options.store = store;
        self
    }

    /// Sets the `prompt_cache_key` of each request (default
    /// [`PromptCacheKey::PerHistory`]).
    #[must_use]
    pub fn prompt_cache_key(mut self, key: PromptCacheKey) -> Self {
        self.options.cache_key = key;
        self
    }
}

impl Responses {
    /// The exact body this client sends to count `request`'s input tokens
    /// (`/responses/input_tokens`): the call's body without the fields the
    /// endpoint does not take, its items taken from the same cache.
    ///
    /// # Errors
    /// As [`Client::request_body`].
    pub fn count_body(&self, request: &ModelRequest<'_>) -> Result<Vec<u8>, ModelError> {
        self.body(request, Purpose::Count)
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
    /// As [`Client::request_body`].
    pub fn compact_body(&self, request: &ModelRequest<'_>) -> Result<Vec<u8>, ModelError> {
        self.body(request, Purpose::Compact)
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
    crate::client::replay::<ResponsesVendor>(body)
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
        assert_eq!(client.endpoint(), "http://127.0.0.1:8000/v1/responses");
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

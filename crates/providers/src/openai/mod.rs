//! The OpenAI Chat Completions client, for OpenAI and every server that
//! speaks the same API (vLLM, Ollama, llama.cpp's server, LM Studio).
//!
//! [`OpenAi`] implements [`Model`](markov_core::model::Model) over `POST {base}/chat/completions`, with
//! and without streaming. The API has no token counting endpoint:
//! [`Model::count_tokens`](markov_core::model::Model::count_tokens) answers `InputTokenCount::NotOffered` (a
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

use std::borrow::Cow;
use std::fmt;

use markov_core::{ModelError, ModelRequest, ModelResponse, StreamEvent};
use reqwest::Url;

use crate::body::BodyCache;
use crate::client::{CachesBodies, Client, ClientBuilder, Parts, Purpose, Vendor, not_offered};
use crate::error::ConfigError;
use crate::transport::{self, endpoint};

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

/// The Chat Completions API's part of a client: see [`OpenAi`].
#[derive(Clone)]
pub struct OpenAiVendor {
    /// `{base}/chat/completions`.
    url: Url,
    /// The base URL, for the `/v1` hint of a `404`.
    base: Url,
    shape: wire::Shape,
    body_cache: BodyCache,
}

impl fmt::Debug for OpenAiVendor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiVendor")
            .field("max_tokens_field", &self.shape.max_tokens_field)
            .field("strictness", &self.shape.strictness)
            .finish_non_exhaustive()
    }
}

/// The options only the Chat Completions client takes.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct OpenAiOptions {
    max_tokens_field: MaxTokensField,
    strictness: SchemaStrictness,
}

/// A client of the Chat Completions API.
///
/// Built by [`OpenAi::builder`] or [`OpenAi::from_env`]; cheap to clone (the
/// connection pool is shared). Its `Debug` output never shows the API key.
/// The setters and methods every client has are [`Client`]'s and
/// [`ClientBuilder`]'s.
pub type OpenAi = Client<OpenAiVendor>;

/// Configures an [`OpenAi`] client.
pub type OpenAiBuilder = ClientBuilder<OpenAiVendor>;

impl Vendor for OpenAiVendor {
    type Options = OpenAiOptions;
    type Decoder = stream::Decoder;
    const NAME: &'static str = "OpenAi";
    const PROVIDER: &'static str = "openai";
    const DEFAULT_BASE_URL: &'static str = DEFAULT_BASE_URL;
    const DEFAULT_MODEL: &'static str = DEFAULT_MODEL;
    const API_KEY_ENV: &'static str = API_KEY_ENV;
    const BASE_URL_ENV: &'static str = BASE_URL_ENV;
    const HOST: &'static str = "api.openai.com";
    const KEY_HEADER: (&'static str, &'static str) = ("authorization", "Bearer ");
    const MODELS_PATH: &'static str = "models";
    const CACHES_BODIES: bool = true;

    fn build(parts: Parts<'_, OpenAiOptions>) -> Result<Self, ConfigError> {
        Ok(OpenAiVendor {
            url: endpoint(parts.base, "chat/completions"),
            base: parts.base.clone(),
            shape: wire::Shape {
                max_tokens_field: parts.options.max_tokens_field,
                strictness: parts.options.strictness,
                schema_with_tools: parts.structured_output.schema_with_tools(parts.at_vendor),
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

    fn encode(
        &self,
        request: &ModelRequest<'_>,
        model: &str,
        purpose: Purpose,
        cached: bool,
    ) -> Result<Vec<u8>, ModelError> {
        let Purpose::Call { stream } = purpose else {
            return Err(not_offered(Self::NAME, purpose));
        };
        if cached {
            wire::encode(request, model, self.shape, stream, Some(&self.body_cache))
        } else {
            wire::encode_plain(request, model, self.shape, stream)
        }
    }

    fn decode(&self, body: &[u8]) -> Result<ModelResponse, ModelError> {
        wire::decode(body)
    }

    fn on_error(&self, error: ModelError, _url: &Url) -> ModelError {
        transport::hint_v1(error, &self.base)
    }
}

impl CachesBodies for OpenAiVendor {}

impl OpenAiBuilder {
    /// Sets which field carries the token limit.
    #[must_use]
    pub fn max_tokens_field(mut self, field: MaxTokensField) -> Self {
        self.options.max_tokens_field = field;
        self
    }

    /// Sets whether tool and output schemas are sent as strict.
    #[must_use]
    pub fn schema_strictness(mut self, strictness: SchemaStrictness) -> Self {
        self.options.strictness = strictness;
        self
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
    crate::client::replay::<OpenAiVendor>(body)
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
            client.endpoint(),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        let keyed = |name: &str| (name == API_KEY_ENV).then(|| "sk-proj-secret".into());
        let builder = OpenAiBuilder::from_env_with(&keyed).unwrap();
        assert!(!format!("{builder:?}").contains("sk-proj-secret"));
        let client = builder.build().unwrap();
        assert!(!format!("{client:?}").contains("sk-proj-secret"));
        assert_eq!(
            client.endpoint(),
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

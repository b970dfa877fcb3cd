//! The Anthropic Messages API client.
//!
//! [`Anthropic`] implements [`Model`](markov_core::model::Model) over `POST {base}/v1/messages`, with
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
//! - **Token counts** ([`Model::count_tokens`](markov_core::model::Model::count_tokens)) → `POST
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

use std::borrow::Cow;
use std::fmt;

use markov_core::{ModelError, ModelRequest, ModelResponse, StreamEvent};
use reqwest::Url;
use reqwest::header::{HeaderMap, HeaderValue};

use crate::body::{BodyCache, FrameCache};
use crate::client::{
    CachesBodies, Client, ClientBuilder, Needs, Parts, Purpose, Vendor, not_offered,
};
use crate::error::ConfigError;
use crate::transport::{endpoint, redact_url};

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

/// The beta that enables the tool search tool and deferred tools
/// (`anthropic-beta` header).
pub const TOOL_SEARCH_BETA: &str = "advanced-tool-use-2025-11-20";

/// The type of the API's tool search tool that a request with deferred
/// tools is sent with (the BM25 variant: the model searches with words).
pub const TOOL_SEARCH_TOOL_TYPE: &str = "tool_search_tool_bm25_20251119";

/// The name of that tool, which its `server_tool_use` blocks carry.
pub const TOOL_SEARCH_TOOL_NAME: &str = "tool_search_tool_bm25";

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

/// The Messages API's part of a client: see [`Anthropic`].
#[derive(Clone)]
pub struct AnthropicVendor {
    /// `{base}/v1/messages`.
    url: Url,
    /// `{base}/v1/messages/count_tokens`.
    count_url: Url,
    shape: wire::Shape,
    body_cache: BodyCache,
    frames: FrameCache<wire::Purpose>,
}

impl fmt::Debug for AnthropicVendor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnthropicVendor")
            .field("caching", &self.shape.caching)
            .field("context_management", &self.shape.context_management)
            .finish_non_exhaustive()
    }
}

/// The options only the Anthropic client takes.
#[derive(Debug, Clone, Default)]
pub(crate) struct AnthropicOptions {
    caching: PromptCaching,
    clear_tool_uses: Option<ClearToolUses>,
}

/// A client of the Anthropic Messages API.
///
/// Built by [`Anthropic::builder`] or [`Anthropic::from_env`]; cheap to
/// clone (the connection pool is shared). Its `Debug` output never shows the
/// API key. The setters and methods every client has are
/// [`Client`]'s and [`ClientBuilder`]'s.
pub type Anthropic = Client<AnthropicVendor>;

/// Configures an [`Anthropic`] client. Every setting but the key has a default.
pub type AnthropicBuilder = ClientBuilder<AnthropicVendor>;

impl Vendor for AnthropicVendor {
    type Options = AnthropicOptions;
    type Decoder = stream::Decoder;
    const NAME: &'static str = "Anthropic";
    const PROVIDER: &'static str = "anthropic";
    const DEFAULT_BASE_URL: &'static str = DEFAULT_BASE_URL;
    const DEFAULT_MODEL: &'static str = DEFAULT_MODEL;
    const API_KEY_ENV: &'static str = API_KEY_ENV;
    const BASE_URL_ENV: &'static str = BASE_URL_ENV;
    const HOST: &'static str = "api.anthropic.com";
    const KEY_HEADER: (&'static str, &'static str) = ("x-api-key", "");
    const MODELS_PATH: &'static str = "v1/models";
    const CACHES_BODIES: bool = true;

    fn fixed_headers(headers: &mut HeaderMap) {
        headers.insert("anthropic-version", HeaderValue::from_static(API_VERSION));
    }

    fn build(parts: Parts<'_, AnthropicOptions>) -> Result<Self, ConfigError> {
        let context_management = parts
            .options
            .clear_tool_uses
            .as_ref()
            .map(ClearToolUses::to_field)
            .transpose()?;
        let base = parts.base;
        if base.path().trim_end_matches('/').ends_with("/v1") {
            let mut without = base.clone();
            let path = base.path().trim_end_matches('/');
            without.set_path(&path[..path.len() - 3]);
            return Err(ConfigError::InvalidBaseUrl {
                url: redact_url(base.as_str()),
                var: parts.base_var,
                reason: format!(
                    "the anthropic client adds /v1/messages itself: leave /v1 out (\"{}\")",
                    redact_url(without.as_str()).trim_end_matches('/')
                ),
            });
        }
        Ok(AnthropicVendor {
            url: endpoint(base, "v1/messages"),
            count_url: endpoint(base, "v1/messages/count_tokens"),
            shape: wire::Shape {
                caching: parts.options.caching,
                schema_with_tools: parts.structured_output.schema_with_tools(parts.at_vendor),
                context_management,
            },
            body_cache: BodyCache::new(parts.body_cache_bytes),
            frames: FrameCache::default(),
        })
    }

    fn schema_with_tools(&self) -> bool {
        self.shape.schema_with_tools
    }

    /// The Messages API's tool search tool: deferred tools are sent with
    /// `defer_loading`, and the model finds them itself.
    fn native_tool_search(&self) -> bool {
        true
    }

    fn call_url(&self, _model: &str, _stream: bool) -> Cow<'_, Url> {
        Cow::Borrowed(&self.url)
    }

    /// The count endpoint refuses server tools: such a request is not
    /// counted.
    fn count_url(&self, request: &ModelRequest<'_>, _model: &str) -> Option<Url> {
        request
            .provider_tools()
            .is_empty()
            .then(|| self.count_url.clone())
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
            Purpose::Compact => return Err(not_offered(Self::NAME, purpose)),
        };
        if cached {
            wire::encode(
                request,
                model,
                &self.shape,
                purpose,
                Some(&self.body_cache),
                &self.frames,
            )
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

    /// The betas a request needs: structured output when its body carries
    /// the schema, tool search when it defers tools, context editing when
    /// the client edits context.
    fn prepare(&self, request: reqwest::RequestBuilder, needs: Needs) -> reqwest::RequestBuilder {
        let betas: Vec<&str> = [
            needs.structured.then_some(STRUCTURED_OUTPUTS_BETA),
            needs.deferred_tools.then_some(TOOL_SEARCH_BETA),
            self.shape
                .context_management
                .is_some()
                .then_some(CONTEXT_MANAGEMENT_BETA),
        ]
        .into_iter()
        .flatten()
        .collect();
        if betas.is_empty() {
            request
        } else {
            request.header("anthropic-beta", betas.join(","))
        }
    }
}

impl CachesBodies for AnthropicVendor {}

impl AnthropicBuilder {
    /// Sets where prompt-caching breakpoints go.
    #[must_use]
    pub fn prompt_caching(mut self, caching: PromptCaching) -> Self {
        self.options.caching = caching;
        self
    }

    /// Has the API clear old tool uses from every request (Anthropic's
    /// context editing, a beta; see [`ClearToolUses`]). Off by default.
    /// [`build`](ClientBuilder::build) refuses editing that could never
    /// clear anything (a zero trigger or `clear_at_least`,
    /// `clear_at_least` not below an input-token trigger, an excluded tool
    /// without a name) with [`ConfigError::InvalidOption`].
    ///
    /// The history, the context views and the request cache are
    /// unchanged by it. OpenAI's Responses API has a compaction of its own
    /// instead, which a context policy uses with `Summarize::native`
    /// (`Model::compact`; its items are never sent to Anthropic), and
    /// Gemini none; see docs/guide/context-and-cost.md.
    #[must_use]
    pub fn clear_tool_uses(mut self, editing: ClearToolUses) -> Self {
        self.options.clear_tool_uses = Some(editing);
        self
    }
}

impl Anthropic {
    /// The exact body this client sends to count `request`'s input tokens
    /// (`/v1/messages/count_tokens`): the call's body without
    /// `max_tokens`, `temperature` and `stream`, its messages taken from
    /// the same cache.
    ///
    /// # Errors
    /// As [`Client::request_body`].
    pub fn count_body(&self, request: &ModelRequest<'_>) -> Result<Vec<u8>, ModelError> {
        self.body(request, Purpose::Count)
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
    crate::client::replay::<AnthropicVendor>(body)
}

#[cfg(test)]
mod tests {
    use markov_core::Model;

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

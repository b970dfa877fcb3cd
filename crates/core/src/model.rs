//! The [`Model`] trait every model client implements, and its request and
//! response types.
//!
//! A request borrows the conversation (`&[Message]`) from the machine's
//! history instead of copying it, so the framework's cost per step does not
//! grow with the conversation. Providers encode straight from the slice: they
//! send `user`, `assistant` and text-bearing `system` messages, render every
//! `ephemeral` one as the silent user messages of
//! [`Message::ephemeral_view`] (camera frames with their preamble), and skip
//! `command` and `instance` records.
//!
//! A simple client implements [`Model::complete`] only; [`Model::stream`] has a
//! default built on it.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::{self, BoxStream, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::ToolCallId;
use crate::message::{Item, Message};
use crate::tool::{ProviderTool, ToolDefinition, ToolName};

/// Which tools the model may or must call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", content = "name", rename_all = "snake_case")]
pub enum ToolChoice {
    /// The model decides.
    Auto,
    /// The model must call some tool.
    Any,
    /// The model may not call tools.
    None,
    /// The model must call this tool.
    Tool(ToolName),
}

impl ToolChoice {
    /// Whether this choice forces a tool call.
    pub fn forces_tool_use(&self) -> bool {
        matches!(self, ToolChoice::Any | ToolChoice::Tool(_))
    }
}

/// How the model may think before answering.
///
/// Anthropic refuses a forced tool choice (`any` or a named tool) and an
/// explicit temperature when a fixed thinking budget is set; see
/// [`Thinking::allows`] for the rule as data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Thinking {
    /// Extended thinking with a fixed budget of tokens.
    Enabled {
        /// The thinking budget.
        budget_tokens: u32,
    },
    /// The model decides its own budget.
    Adaptive,
}

/// What a thinking mode permits alongside it: the provider constraint as data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinkingAllowance {
    /// Whether tool choice may force tool use (`any` or a named tool).
    pub forced_tool_choice: bool,
    /// Whether an explicit temperature may be sent.
    pub temperature: bool,
}

impl Thinking {
    /// The default allowance of this mode, as the Anthropic Messages API documents it:
    /// a fixed budget forbids forced tool use and an explicit temperature; adaptive
    /// thinking is reported to accept forced tool use. A provider capability table
    /// may override these per model.
    pub fn allows(&self) -> ThinkingAllowance {
        match self {
            Thinking::Enabled { .. } => ThinkingAllowance {
                forced_tool_choice: false,
                temperature: false,
            },
            Thinking::Adaptive => ThinkingAllowance {
                forced_tool_choice: true,
                temperature: false,
            },
        }
    }
}

/// Settings of one model call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSettings {
    /// The model name; `None` lets the client pick its default.
    pub model: Option<String>,
    /// The maximum number of tokens to generate.
    pub max_tokens: u32,
    /// Sampling temperature; left out of the request when unset.
    pub temperature: Option<f32>,
    /// Extended thinking, if enabled.
    pub thinking: Option<Thinking>,
    /// Whether the model may call several tools in one response.
    pub parallel_tool_calls: bool,
}

impl Default for ModelSettings {
    fn default() -> Self {
        ModelSettings {
            model: None,
            max_tokens: 4096,
            temperature: None,
            thinking: None,
            parallel_tool_calls: true,
        }
    }
}

/// What a model takes and gives: its context window and the most tokens
/// one answer may have, in tokens (see [`ModelLimits::of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ModelLimits {
    /// The context window: prompt and answer together.
    pub context_window: u32,
    /// The most tokens one answer may have.
    pub max_output_tokens: u32,
}

/// The answer tokens asked for by default of a model [`ModelLimits::of`]
/// does not know (a local server's, say): well below the smallest context
/// window such servers are run with (llama.cpp's is often 4 096 tokens,
/// and an answer that fills the window leaves no room for the next
/// question).
pub const UNKNOWN_MODEL_MAX_TOKENS: u32 = 2_048;

/// The most answer tokens asked for by default of a known model, however
/// many it may write: a longer answer is rarely wanted, and a provider may
/// refuse a long call that does not stream.
pub const KNOWN_MODEL_MAX_TOKENS: u32 = 8_192;

impl ModelLimits {
    /// The limits of a known model, by the start of its name (a dated
    /// version such as `claude-3-5-haiku-20241022` is its family's; a
    /// routing prefix such as `models/` or `anthropic/` is ignored):
    /// Anthropic's Claude, OpenAI's GPT and o-series, Google's Gemini, as
    /// their vendors document them. `None` for any other model.
    ///
    /// ```
    /// use markov_core::model::ModelLimits;
    ///
    /// let claude = ModelLimits::of("claude-3-5-haiku-20241022").unwrap();
    /// assert_eq!(claude.context_window, 200_000);
    /// assert!(ModelLimits::of("qwen2.5-7b-instruct").is_none());
    /// ```
    pub fn of(model: &str) -> Option<ModelLimits> {
        // Longest prefixes first where one starts another.
        const TABLE: &[(&str, u32, u32)] = &[
            ("claude-opus-4", 200_000, 32_000),
            ("claude-sonnet-4", 200_000, 64_000),
            ("claude-haiku-4", 200_000, 64_000),
            ("claude-3-7-sonnet", 200_000, 64_000),
            ("claude-3-5-sonnet", 200_000, 8_192),
            ("claude-3-5-haiku", 200_000, 8_192),
            ("claude-3-haiku", 200_000, 4_096),
            ("claude-3-opus", 200_000, 4_096),
            ("gpt-5", 400_000, 128_000),
            ("gpt-4.1", 1_047_576, 32_768),
            ("gpt-4o", 128_000, 16_384),
            ("gpt-4-turbo", 128_000, 4_096),
            ("gpt-3.5-turbo", 16_385, 4_096),
            ("o4-mini", 200_000, 100_000),
            ("o3", 200_000, 100_000),
            ("o1", 200_000, 100_000),
            ("gemini-2.5", 1_048_576, 65_536),
            ("gemini-2.0", 1_048_576, 8_192),
            ("gemini-1.5", 1_048_576, 8_192),
        ];
        let name = model.rsplit('/').next().unwrap_or(model);
        TABLE
            .iter()
            .find(|(prefix, _, _)| name.starts_with(prefix))
            .map(|&(_, context_window, max_output_tokens)| ModelLimits {
                context_window,
                max_output_tokens,
            })
    }

    /// The answer tokens to ask of `model` when the application sets none:
    /// a known model's most, up to [`KNOWN_MODEL_MAX_TOKENS`]; else
    /// [`UNKNOWN_MODEL_MAX_TOKENS`].
    ///
    /// ```
    /// use markov_core::model::{ModelLimits, UNKNOWN_MODEL_MAX_TOKENS};
    ///
    /// assert_eq!(ModelLimits::default_max_tokens(Some("claude-3-haiku-20240307")), 4_096);
    /// assert_eq!(ModelLimits::default_max_tokens(Some("gpt-4o-mini")), 8_192);
    /// assert_eq!(ModelLimits::default_max_tokens(None), UNKNOWN_MODEL_MAX_TOKENS);
    /// ```
    pub fn default_max_tokens(model: Option<&str>) -> u32 {
        model
            .and_then(ModelLimits::of)
            .map_or(UNKNOWN_MODEL_MAX_TOKENS, |limits| {
                limits.max_output_tokens.min(KNOWN_MODEL_MAX_TOKENS)
            })
    }

    /// The answer tokens to ask of `model` served with a context window of
    /// `context_window` tokens (as a local server reports it): a quarter
    /// of the window, so that one answer never fills it and the next
    /// question still fits, and never more than a known model's most (up
    /// to [`KNOWN_MODEL_MAX_TOKENS`]), nor less than one token.
    ///
    /// ```
    /// use markov_core::model::ModelLimits;
    ///
    /// assert_eq!(ModelLimits::max_tokens_within(4_096, Some("qwen2.5-7b")), 1_024);
    /// assert_eq!(ModelLimits::max_tokens_within(131_072, None), 8_192);
    /// assert_eq!(ModelLimits::max_tokens_within(200_000, Some("claude-3-haiku")), 4_096);
    /// ```
    pub fn max_tokens_within(context_window: u32, model: Option<&str>) -> u32 {
        let cap = model
            .and_then(ModelLimits::of)
            .map_or(KNOWN_MODEL_MAX_TOKENS, |limits| {
                limits.max_output_tokens.min(KNOWN_MODEL_MAX_TOKENS)
            });
        (context_window / 4).min(cap).max(1)
    }
}

/// One model call. Everything is borrowed from the caller.
///
/// Built with [`ModelRequest::new`] and the setters, which leave the rest at
/// its default (no tools, [`ToolChoice::Auto`], no output schema):
///
/// ```
/// use markov_core::{Message, ModelRequest, ModelSettings, ToolChoice};
///
/// let history = [Message::user("What is 2 + 3?")];
/// let settings = ModelSettings::default();
/// let request = ModelRequest::new("You are terse.", &history, &settings)
///     .with_tool_choice(&ToolChoice::None);
/// assert!(request.tools().is_empty());
/// assert_eq!(request.tool_choice(), &ToolChoice::None);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct ModelRequest<'a> {
    system: &'a str,
    messages: &'a [Message],
    tools: &'a [ToolDefinition],
    provider_tools: &'a [ProviderTool],
    tool_choice: &'a ToolChoice,
    settings: &'a ModelSettings,
    output_schema: Option<&'a Value>,
    deferred_tools: &'a [ToolName],
    // Private, with `messages`: the only way to send other messages is
    // `with_messages`, which drops the id, so a client never sends the
    // cached bytes of a history for messages that are not that history.
    history_id: Option<HistoryId>,
}

/// The identity of one append-only history, as the requests sent over it
/// carry it (see [`ModelRequest::history_id`]).
///
/// The promise that comes with it: every request carrying one id sends a
/// history that starts with the whole history of the previous such request,
/// unchanged: messages are only ever appended. A machine keeps this promise
/// for its own history (a new id for every machine, a restored one
/// included), and a provider client relies on it to encode each message once
/// instead of once per call. Ids are unique within the process.
///
/// ```
/// use markov_core::model::HistoryId;
///
/// assert_ne!(HistoryId::fresh(), HistoryId::fresh());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HistoryId(u64);

impl HistoryId {
    /// An id no other history of this process has.
    pub fn fresh() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        HistoryId(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
    }

    /// The id as a number (for logs).
    pub fn get(self) -> u64 {
        self.0
    }
}

/// The tool choice of a request that sets none.
static AUTO: ToolChoice = ToolChoice::Auto;

impl<'a> ModelRequest<'a> {
    /// A request with a system prompt, the conversation and the settings;
    /// no tools, [`ToolChoice::Auto`], no output schema.
    pub fn new(system: &'a str, messages: &'a [Message], settings: &'a ModelSettings) -> Self {
        ModelRequest {
            system,
            messages,
            tools: &[],
            provider_tools: &[],
            tool_choice: &AUTO,
            settings,
            output_schema: None,
            deferred_tools: &[],
            history_id: None,
        }
    }

    /// Offers `tools`.
    #[must_use]
    pub fn with_tools(mut self, tools: &'a [ToolDefinition]) -> Self {
        self.tools = tools;
        self
    }

    /// Marks the offered tools named in `names` deferred: a provider
    /// that searches tools itself ([`Model::native_tool_search`]) sends
    /// them for loading on demand, with its tool search tool, so the model
    /// is not shown their schemas until it finds them. A model without one
    /// is never sent such a request.
    #[must_use]
    pub fn with_deferred_tools(mut self, names: &'a [ToolName]) -> Self {
        self.deferred_tools = names;
        self
    }

    /// The offered tools marked deferred (see
    /// [`with_deferred_tools`](Self::with_deferred_tools)).
    pub fn deferred_tools(&self) -> &'a [ToolName] {
        self.deferred_tools
    }

    /// Whether the offered tool `name` is deferred.
    pub fn is_deferred(&self, name: &str) -> bool {
        self.deferred_tools.iter().any(|n| n.as_str() == name)
    }

    /// Offers provider built-in tools.
    #[must_use]
    pub fn with_provider_tools(mut self, tools: &'a [ProviderTool]) -> Self {
        self.provider_tools = tools;
        self
    }

    /// Sets the tool choice.
    #[must_use]
    pub fn with_tool_choice(mut self, choice: &'a ToolChoice) -> Self {
        self.tool_choice = choice;
        self
    }

    /// Asks for an answer following `schema` (or none).
    #[must_use]
    pub fn with_output_schema(mut self, schema: Option<&'a Value>) -> Self {
        self.output_schema = schema;
        self
    }

    /// Sends `messages` instead (a wrapper that rewrites the conversation).
    /// The rewritten list is not the history [`Self::history_id`] named, so
    /// the id is dropped; set it again only for a list that keeps the
    /// promise of [`HistoryId`].
    #[must_use]
    pub fn with_messages(mut self, messages: &'a [Message]) -> Self {
        self.messages = messages;
        self.history_id = None;
        self
    }

    /// Says that `messages` is the current content of the append-only
    /// history `id` (see [`HistoryId`]).
    #[must_use]
    pub fn with_history_id(mut self, id: HistoryId) -> Self {
        self.history_id = Some(id);
        self
    }

    /// The system prompt.
    pub fn system(&self) -> &'a str {
        self.system
    }

    /// The conversation, borrowed from the history.
    pub fn messages(&self) -> &'a [Message] {
        self.messages
    }

    /// The tools offered, which the loop runs.
    pub fn tools(&self) -> &'a [ToolDefinition] {
        self.tools
    }

    /// Provider built-in tools offered, which the provider runs itself (see
    /// [`ProviderTool`]); empty for most requests. A client whose provider
    /// has no such tools refuses a request that offers any with
    /// [`ModelError::InvalidRequest`].
    pub fn provider_tools(&self) -> &'a [ProviderTool] {
        self.provider_tools
    }

    /// Which tools the model may or must call.
    pub fn tool_choice(&self) -> &'a ToolChoice {
        self.tool_choice
    }

    /// The settings.
    pub fn settings(&self) -> &'a ModelSettings {
        self.settings
    }

    /// A JSON Schema the answer must follow (structured output), if any.
    pub fn output_schema(&self) -> Option<&'a Value> {
        self.output_schema
    }

    /// The identity of the append-only history the messages are taken
    /// from, if the caller vouches for one (see [`HistoryId`]): a client
    /// may then keep the encoded form of the messages it has sent and
    /// encode only the new ones. `None` (the default, and after
    /// [`Self::with_messages`]) makes every request stand alone.
    pub fn history_id(&self) -> Option<HistoryId> {
        self.history_id
    }

    /// Sends `system` instead.
    #[must_use]
    pub fn with_system(mut self, system: &'a str) -> Self {
        self.system = system;
        self
    }

    /// Uses `settings` instead.
    #[must_use]
    pub fn with_settings(mut self, settings: &'a ModelSettings) -> Self {
        self.settings = settings;
        self
    }
}

/// Why the model stopped.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum StopReason {
    /// The model finished its answer.
    EndTurn,
    /// The model wants tools run.
    ToolUse,
    /// The token limit cut the answer.
    MaxTokens,
    /// A stop sequence matched.
    StopSequence,
    /// The provider paused a long turn; the caller may continue it.
    PauseTurn,
    /// The model refused.
    Refusal,
    /// A content filter stopped the answer.
    ContentFilter,
}

pub use crate::usage::Usage;

/// A model's answer.
///
/// Built with [`ModelResponse::new`] and the setters, which leave the rest
/// at its default (no token counts, no model name):
///
/// ```
/// use markov_core::message::Item;
/// use markov_core::model::{ModelResponse, StopReason, Usage};
///
/// let response = ModelResponse::new(vec![Item::text("5")], StopReason::EndTurn)
///     .with_model("gpt-4.1-2025-04-14");
/// assert_eq!(response.model.as_deref(), Some("gpt-4.1-2025-04-14"));
/// assert_eq!(response.usage, Usage::default());
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ModelResponse {
    /// Content items: text, tool_use, thinking, and the calls and results of
    /// provider built-in tools the provider ran during the answer.
    pub content: Vec<Item>,
    /// Why it stopped.
    pub stop_reason: StopReason,
    /// Token counts.
    pub usage: Usage,
    /// The model that answered, as the provider named it in its answer
    /// (Anthropic's and OpenAI's `model`, Gemini's `modelVersion`): often
    /// a dated version of the name asked for, or another model altogether
    /// when a fallback answered. `None` when the provider named none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl ModelResponse {
    /// An answer of `content` that stopped for `stop_reason`, with no token
    /// counts and no model name.
    pub fn new(content: Vec<Item>, stop_reason: StopReason) -> Self {
        ModelResponse {
            content,
            stop_reason,
            usage: Usage::default(),
            model: None,
        }
    }

    /// Sets the token counts.
    #[must_use]
    pub fn with_usage(mut self, usage: Usage) -> Self {
        self.usage = usage;
        self
    }

    /// Names the model that answered.
    #[must_use]
    pub fn with_model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// The tool calls the caller must run, in order. Calls of provider
    /// built-in tools ([`Item::ProviderToolUse`]) are not among them: the
    /// provider already answered them (see [`Self::provider_tool_calls`]).
    pub fn tool_calls(&self) -> impl Iterator<Item = (&ToolCallId, &str, &Value)> {
        self.content.iter().filter_map(|i| match i {
            Item::ToolUse { id, name, input } => Some((id, name.as_str(), input)),
            _ => None,
        })
    }

    /// Whether the answer requests at least one tool call the caller must run.
    pub fn has_tool_calls(&self) -> bool {
        self.tool_calls().next().is_some()
    }

    /// The provider built-in tool calls the provider ran during the answer, in order.
    pub fn provider_tool_calls(&self) -> impl Iterator<Item = (&ToolCallId, &str, &Value)> {
        self.content.iter().filter_map(|i| match i {
            Item::ProviderToolUse { id, name, input } => Some((id, name.as_str(), input)),
            _ => None,
        })
    }
}

/// One event of a streamed answer.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum StreamEvent {
    /// Text was added to the content item at `index`.
    TextDelta {
        /// The content index.
        index: usize,
        /// The new text.
        text: String,
    },
    /// Thinking text was added to the content item at `index`.
    ThinkingDelta {
        /// The content index.
        index: usize,
        /// The new text.
        thinking: String,
    },
    /// A tool call started at `index`.
    ToolCallStart {
        /// The content index.
        index: usize,
        /// The call id.
        id: ToolCallId,
        /// The tool name.
        name: String,
    },
    /// More argument JSON for the tool call at `index` (a fragment, not valid JSON alone).
    ToolCallDelta {
        /// The content index.
        index: usize,
        /// The fragment.
        partial_json: String,
    },
    /// The complete answer; always the last event of a successful stream.
    Done(ModelResponse),
}

/// A failed model call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The provider answered with an error status.
    #[error("provider error {status}: {message}")]
    Http {
        /// The HTTP status.
        status: u16,
        /// The provider's own message.
        message: String,
        /// How long the provider asked us to wait, if it said.
        retry_after: Option<Duration>,
    },
    /// The provider answered with a redirect, which clients do not follow:
    /// following one could send the API key to another address. The base
    /// URL should name where the provider answers.
    #[error(
        "provider redirected ({status}) to {}; redirects are not followed, so that credentials never reach another address: set the base URL to the provider's own address",
        .location.as_deref().unwrap_or("no address")
    )]
    Redirect {
        /// The HTTP status (`3xx`).
        status: u16,
        /// Where the provider pointed (`Location`, made absolute, with any
        /// password or query redacted), if it said.
        location: Option<String>,
    },
    /// The provider is overloaded (e.g. Anthropic's `overloaded_error`, also mid-stream).
    #[error("provider overloaded: {0}")]
    Overloaded(String),
    /// The request took too long.
    #[error("model request timed out after {0:?}")]
    Timeout(Duration),
    /// The connection failed.
    #[error("connection failed: {0}")]
    Connection(String),
    /// The provider's answer could not be understood.
    #[error("invalid model response: {0}")]
    InvalidResponse(String),
    /// The request was refused before it was sent (configuration, a broken script).
    #[error("invalid model request: {0}")]
    InvalidRequest(String),
    /// The request does not fit the model's context window: the history,
    /// the system prompt, the tools and the tokens asked for the answer
    /// are more than the model takes (Anthropic's `prompt is too long`,
    /// OpenAI's `context_length_exceeded`, llama.cpp's
    /// `exceed_context_size_error`, Gemini's input token limit). The same
    /// request fails again: a context policy's compaction, or a shorter
    /// conversation, is what helps.
    #[error("the request does not fit the model's context window: {0}")]
    ContextLength(String),
}

impl ModelError {
    /// Whether trying the same request again may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            ModelError::Http { status, .. } => {
                matches!(status, 408 | 409 | 429) || (500..600).contains(status)
            }
            ModelError::Overloaded(_) | ModelError::Timeout(_) | ModelError::Connection(_) => true,
            ModelError::Redirect { .. }
            | ModelError::InvalidResponse(_)
            | ModelError::InvalidRequest(_)
            | ModelError::ContextLength(_) => false,
        }
    }
}

/// What a model cannot be offered, found before any call by
/// [`Model::check_tools`]: a tool, or the output type, whose schema the
/// provider cannot express.
///
/// ```
/// use markov_core::ToolName;
/// use markov_core::model::Unsupported;
///
/// let tag = ToolName::new("tag").unwrap();
/// let refused = Unsupported::tool(tag, "maps cannot be expressed");
/// assert_eq!(refused.tool.as_ref().map(|t| t.as_str()), Some("tag"));
/// assert_eq!(refused.to_string(), "maps cannot be expressed");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason}")]
#[non_exhaustive]
pub struct Unsupported {
    /// The tool refused; `None` when it is the output type.
    pub tool: Option<ToolName>,
    /// Why, as the provider client words it (what it cannot express, and
    /// where in the schema).
    pub reason: String,
}

impl Unsupported {
    /// The tool `name` cannot be offered, because of `reason`.
    pub fn tool(name: ToolName, reason: impl Into<String>) -> Self {
        Unsupported {
            tool: Some(name),
            reason: reason.into(),
        }
    }

    /// The output type cannot be asked for, because of `reason`.
    pub fn output_type(reason: impl Into<String>) -> Self {
        Unsupported {
            tool: None,
            reason: reason.into(),
        }
    }
}

/// What [`Model::count_tokens`] answers: the provider's count of a
/// request's input tokens, or that this model offers none.
///
/// ```
/// use markov_core::model::InputTokenCount;
///
/// assert_eq!(InputTokenCount::Counted(1_234).tokens(), Some(1_234));
/// assert_eq!(InputTokenCount::NotOffered.tokens(), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum InputTokenCount {
    /// The provider counted the request's input (system prompt, tools and
    /// messages, as it would be sent) at this many tokens.
    Counted(u64),
    /// This model cannot count the request: its API has no token counting
    /// endpoint (OpenAI's Chat Completions, a scripted model), or the
    /// endpoint refuses what the request holds (Anthropic's refuses
    /// server tools). A caller falls back to an estimate
    /// ([`crate::tokens`]).
    NotOffered,
}

impl InputTokenCount {
    /// The count, if the model gave one.
    pub fn tokens(self) -> Option<u64> {
        match self {
            InputTokenCount::Counted(tokens) => Some(tokens),
            InputTokenCount::NotOffered => None,
        }
    }
}

/// What [`Model::compact`] answers: the vendor's compaction of a
/// request's messages, or that this model offers none.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Compaction {
    /// The vendor compacted the messages into these items.
    Compacted(Compacted),
    /// This model has no compaction of its own (every client but OpenAI's
    /// Responses API, a scripted model): a context policy summarizes with
    /// a summarizer model instead.
    NotOffered,
}

/// A vendor's compaction of a request's messages (see [`Model::compact`]).
///
/// ```
/// use markov_core::message::NativeItems;
/// use markov_core::model::{Compacted, Usage};
///
/// let items = NativeItems::new("openai.responses", vec![r#"{"type":"compaction"}"#.into()]);
/// let compacted = Compacted::new(items, Usage::default());
/// assert_eq!(compacted.native.vendor, "openai.responses");
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Compacted {
    /// The opaque items that stand for the messages, tagged with the
    /// vendor that reads them.
    pub native: crate::message::NativeItems,
    /// What the call used, as the vendor reported it.
    pub usage: Usage,
}

impl Compacted {
    /// The compaction `native`, which used `usage`.
    pub fn new(native: crate::message::NativeItems, usage: Usage) -> Self {
        Compacted { native, usage }
    }
}

/// A model client.
///
/// `request.messages()` is the machine's history as recorded, ephemerals
/// included (the loop never copies it per step). A client must render each
/// `ephemeral` message as [`Message::ephemeral_view`] describes — silent user
/// messages, one per camera frame with its preamble — for example from the
/// borrowed [`Message::ephemeral_parts`], and must not send `command` or
/// `instance` records.
///
/// ```
/// use async_trait::async_trait;
/// use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StopReason};
/// use markov_core::message::Item;
///
/// /// Always says hello.
/// #[derive(Debug)]
/// struct Hello;
///
/// #[async_trait]
/// impl Model for Hello {
///     async fn complete(&self, _req: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
///         Ok(ModelResponse::new(vec![Item::text("hello")], StopReason::EndTurn))
///     }
/// }
/// ```
#[async_trait]
pub trait Model: Send + Sync + fmt::Debug {
    /// Makes one call and returns the whole answer.
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError>;

    /// The provider, as OpenTelemetry's `gen_ai.provider.name` spells it
    /// (`"anthropic"`, `"openai"`, ...); traces show it on every model call.
    fn provider_name(&self) -> &str {
        "unknown"
    }

    /// The model this client calls when a request names none (its
    /// configured model), if it has one: what a call is priced and
    /// limited by when neither the answer nor the request names a model.
    /// The default is `None`; a client with a model of its own answers it.
    fn model_name(&self) -> Option<&str> {
        None
    }

    /// The answer tokens to ask for when the application sets none, for a
    /// call with `settings`: [`ModelLimits::default_max_tokens`] of the
    /// model the call goes to (`settings.model`, else
    /// [`Self::model_name`]).
    fn default_max_tokens(&self, settings: &ModelSettings) -> u32 {
        ModelLimits::default_max_tokens(settings.model.as_deref().or(self.model_name()))
    }

    /// What `thinking` permits alongside it for `settings.model`: the client's
    /// capability table. The default is [`Thinking::allows`], the documented
    /// Anthropic rule; a client whose models differ overrides it.
    fn thinking_allowance(
        &self,
        settings: &ModelSettings,
        thinking: Thinking,
    ) -> ThinkingAllowance {
        let _ = settings;
        thinking.allows()
    }

    /// Checks, before any call, that this model can be offered `tools`
    /// and asked for answers following `output_schema`: a client whose
    /// provider cannot express some schema says which and why, so that an
    /// agent fails when it is built rather than at its first call. An
    /// agent's builder calls it with each node's tools (the built-in ones
    /// included) and output type. The default accepts everything; a
    /// wrapper forwards it to the models it wraps.
    ///
    /// # Errors
    /// The first tool (or the output type) the provider cannot be offered.
    fn check_tools(
        &self,
        tools: &[ToolDefinition],
        output_schema: Option<&Value>,
    ) -> Result<(), Unsupported> {
        let _ = (tools, output_schema);
        Ok(())
    }

    /// Counts the input tokens `request` would be sent with (its system
    /// prompt, tools and messages), exactly as the provider counts them,
    /// without making the call: Anthropic's `/v1/messages/count_tokens`,
    /// Gemini's `countTokens`, OpenAI's `/v1/responses/input_tokens`. The
    /// default is [`InputTokenCount::NotOffered`]; a wrapper forwards it
    /// to the model it wraps.
    ///
    /// Neither Anthropic nor Gemini bills a count, so callers do not
    /// account it as usage; it is a request to the provider all the same
    /// (rate limits, latency), made only when an estimate is not enough
    /// (see `ContextPolicyBuilder::token_count` in `markov-charter`).
    ///
    /// # Errors
    /// A failed count, classified as a failed call is
    /// ([`ModelError::is_retryable`]).
    async fn count_tokens(&self, request: ModelRequest<'_>) -> Result<InputTokenCount, ModelError> {
        let _ = request;
        Ok(InputTokenCount::NotOffered)
    }

    /// The vendor tag of the native summaries this model makes with
    /// [`Self::compact`] and reads in a request's messages (`Some("openai.responses")`
    /// for OpenAI's Responses API at OpenAI), if any. A context view shows
    /// a native summary to a model only when this names its vendor, so no
    /// client ever receives another's items. The default is `None`; a
    /// wrapper forwards it (a list of models answers the tag all of them
    /// share, else `None`).
    fn native_summaries(&self) -> Option<&str> {
        None
    }

    /// Whether the provider searches tools itself: a request's deferred
    /// tools ([`ModelRequest::deferred_tools`]) are then sent for loading
    /// on demand beside the provider's tool search tool (Anthropic's), and
    /// an agent with deferred tools offers them so instead of its own
    /// `search_tools`. The default is `false`; a wrapper forwards it.
    fn native_tool_search(&self) -> bool {
        false
    }

    /// Compacts `request`'s messages with the vendor's own compaction,
    /// without making a call for an answer: OpenAI's
    /// `/v1/responses/compact`. The items it answers stand for the
    /// messages in later requests to a model whose
    /// [`Self::native_summaries`] names their vendor; a context policy
    /// built with `Summarize::native` (in `markov-charter`) appends them to
    /// the history as a summary message. The default is
    /// [`Compaction::NotOffered`]; a wrapper forwards it to the model it
    /// wraps.
    ///
    /// Unlike a count, a compaction is billed: callers admit it under
    /// their usage limits before it is made and count
    /// [`Compacted::usage`].
    ///
    /// # Errors
    /// A failed call, classified as any failed call is
    /// ([`ModelError::is_retryable`]).
    async fn compact(&self, request: ModelRequest<'_>) -> Result<Compaction, ModelError> {
        let _ = request;
        Ok(Compaction::NotOffered)
    }

    /// Makes one call and streams the answer. The default makes a
    /// non-streaming call and replays it as events.
    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        replay_stream(self.complete(request))
    }
}

/// A model that wraps another: what it changes, with everything else
/// passed through by construction.
///
/// Every method of [`Model`] has a twin here whose default forwards to
/// [`Self::inner`], and every `ModelLayer` is a [`Model`] through one
/// blanket impl. A wrapper implements `ModelLayer`, names its inner model
/// and overrides only the methods it changes; a method added to [`Model`]
/// later is added here with a forwarding default and reaches the inner
/// model of every wrapper without touching any of them. Implement
/// [`Model`] directly only for a client that answers itself.
///
/// `Box<M>` is a layer that changes nothing (and `Arc<M>` a model that
/// forwards every method). With both traits in scope, a method call on a
/// layer (a `Box` included) is ambiguous: import `ModelLayer` only where a
/// layer is implemented, and inside one call `Model::complete(&layer, ..)`
/// on a layer or a `Box`.
///
/// ```
/// use async_trait::async_trait;
/// use markov_core::model::{
///     Model, ModelError, ModelLayer, ModelRequest, ModelResponse, ModelSettings,
/// };
///
/// /// Sends every request with a temperature of zero.
/// #[derive(Debug)]
/// struct Cold<M>(M);
///
/// #[async_trait]
/// impl<M: Model> ModelLayer for Cold<M> {
///     type Inner = M;
///
///     fn inner(&self) -> &M {
///         &self.0
///     }
///
///     async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
///         let settings = ModelSettings { temperature: Some(0.0), ..request.settings().clone() };
///         self.0.complete(request.with_settings(&settings)).await
///     }
///     // `stream`, `count_tokens`, `compact` ... reach the inner model as
///     // they are; a real layer would change `stream` too.
/// }
/// ```
#[async_trait]
pub trait ModelLayer: Send + Sync + fmt::Debug {
    /// The wrapped model.
    type Inner: Model + ?Sized;

    /// The wrapped model, which every method not overridden reaches.
    fn inner(&self) -> &Self::Inner;

    /// [`Model::complete`]; forwards by default.
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        self.inner().complete(request).await
    }

    /// [`Model::provider_name`]; forwards by default.
    fn provider_name(&self) -> &str {
        self.inner().provider_name()
    }

    /// [`Model::model_name`]; forwards by default.
    fn model_name(&self) -> Option<&str> {
        self.inner().model_name()
    }

    /// [`Model::default_max_tokens`]; forwards by default.
    fn default_max_tokens(&self, settings: &ModelSettings) -> u32 {
        self.inner().default_max_tokens(settings)
    }

    /// [`Model::thinking_allowance`]; forwards by default.
    fn thinking_allowance(
        &self,
        settings: &ModelSettings,
        thinking: Thinking,
    ) -> ThinkingAllowance {
        self.inner().thinking_allowance(settings, thinking)
    }

    /// [`Model::check_tools`]; forwards by default.
    ///
    /// # Errors
    /// As the inner model's.
    fn check_tools(
        &self,
        tools: &[ToolDefinition],
        output_schema: Option<&Value>,
    ) -> Result<(), Unsupported> {
        self.inner().check_tools(tools, output_schema)
    }

    /// [`Model::count_tokens`]; forwards by default.
    ///
    /// # Errors
    /// As the inner model's.
    async fn count_tokens(&self, request: ModelRequest<'_>) -> Result<InputTokenCount, ModelError> {
        self.inner().count_tokens(request).await
    }

    /// [`Model::native_summaries`]; forwards by default.
    fn native_summaries(&self) -> Option<&str> {
        self.inner().native_summaries()
    }

    /// [`Model::native_tool_search`]; forwards by default.
    fn native_tool_search(&self) -> bool {
        self.inner().native_tool_search()
    }

    /// [`Model::compact`]; forwards by default.
    ///
    /// # Errors
    /// As the inner model's.
    async fn compact(&self, request: ModelRequest<'_>) -> Result<Compaction, ModelError> {
        self.inner().compact(request).await
    }

    /// [`Model::stream`]; forwards by default.
    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        self.inner().stream(request)
    }
}

/// Every layer is a model: each method is the layer's (which forwards
/// unless the layer changes it).
#[async_trait]
impl<L: ModelLayer> Model for L {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        ModelLayer::complete(self, request).await
    }

    fn provider_name(&self) -> &str {
        ModelLayer::provider_name(self)
    }

    fn model_name(&self) -> Option<&str> {
        ModelLayer::model_name(self)
    }

    fn default_max_tokens(&self, settings: &ModelSettings) -> u32 {
        ModelLayer::default_max_tokens(self, settings)
    }

    fn thinking_allowance(
        &self,
        settings: &ModelSettings,
        thinking: Thinking,
    ) -> ThinkingAllowance {
        ModelLayer::thinking_allowance(self, settings, thinking)
    }

    fn check_tools(
        &self,
        tools: &[ToolDefinition],
        output_schema: Option<&Value>,
    ) -> Result<(), Unsupported> {
        ModelLayer::check_tools(self, tools, output_schema)
    }

    async fn count_tokens(&self, request: ModelRequest<'_>) -> Result<InputTokenCount, ModelError> {
        ModelLayer::count_tokens(self, request).await
    }

    fn native_summaries(&self) -> Option<&str> {
        ModelLayer::native_summaries(self)
    }

    fn native_tool_search(&self) -> bool {
        ModelLayer::native_tool_search(self)
    }

    async fn compact(&self, request: ModelRequest<'_>) -> Result<Compaction, ModelError> {
        ModelLayer::compact(self, request).await
    }

    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        ModelLayer::stream(self, request)
    }
}

/// A shared model is a model: every method forwards. (Written out rather
/// than a [`ModelLayer`], so that a layer holding an `Arc<dyn Model>` calls
/// its methods unambiguously: inside a layer's impl both traits are in
/// scope. A method added to [`Model`] is forwarded here, in
/// [`ModelLayer`] and in its blanket impl, all in this file, which a test
/// of this file checks.)
#[async_trait]
impl<M: Model + ?Sized> Model for std::sync::Arc<M> {
    // The inner model's future as it is: an `async fn` here would box it a
    // second time on every call.
    fn complete<'life0, 'life1, 'async_trait>(
        &'life0 self,
        request: ModelRequest<'life1>,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<ModelResponse, ModelError>>
                + Send
                + 'async_trait,
        >,
    >
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        (**self).complete(request)
    }

    fn provider_name(&self) -> &str {
        (**self).provider_name()
    }

    fn model_name(&self) -> Option<&str> {
        (**self).model_name()
    }

    fn default_max_tokens(&self, settings: &ModelSettings) -> u32 {
        (**self).default_max_tokens(settings)
    }

    fn thinking_allowance(
        &self,
        settings: &ModelSettings,
        thinking: Thinking,
    ) -> ThinkingAllowance {
        (**self).thinking_allowance(settings, thinking)
    }

    fn check_tools(
        &self,
        tools: &[ToolDefinition],
        output_schema: Option<&Value>,
    ) -> Result<(), Unsupported> {
        (**self).check_tools(tools, output_schema)
    }

    async fn count_tokens(&self, request: ModelRequest<'_>) -> Result<InputTokenCount, ModelError> {
        (**self).count_tokens(request).await
    }

    fn native_summaries(&self) -> Option<&str> {
        (**self).native_summaries()
    }

    fn native_tool_search(&self) -> bool {
        (**self).native_tool_search()
    }

    async fn compact(&self, request: ModelRequest<'_>) -> Result<Compaction, ModelError> {
        (**self).compact(request).await
    }

    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        (**self).stream(request)
    }
}

/// A boxed model is a model: a layer that changes nothing (a direct impl
/// would overlap the blanket one, `Box` being fundamental).
impl<M: Model + ?Sized> ModelLayer for Box<M> {
    type Inner = M;

    fn inner(&self) -> &M {
        self
    }
}

/// The answer of one non-streaming call (`answer`, a future of it) as a
/// stream: the events [`replay_events`] makes of it, or its error alone.
/// What a model that cannot stream answers a `stream` call with.
pub fn replay_stream<'a>(
    answer: impl Future<Output = Result<ModelResponse, ModelError>> + Send + 'a,
) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
    stream::once(answer)
        .flat_map(|result| match result {
            Ok(response) => stream::iter(replay_events(response).into_iter().map(Ok)).boxed(),
            Err(e) => stream::once(async move { Err(e) }).boxed(),
        })
        .boxed()
}

/// The events a stream of `response` would have produced, ending with `Done`.
pub fn replay_events(response: ModelResponse) -> Vec<StreamEvent> {
    let mut events = Vec::with_capacity(response.content.len() * 2 + 1);
    for (index, item) in response.content.iter().enumerate() {
        match item {
            Item::Text { text } => events.push(StreamEvent::TextDelta {
                index,
                text: text.clone(),
            }),
            Item::Thinking { thinking, .. } => events.push(StreamEvent::ThinkingDelta {
                index,
                thinking: thinking.clone(),
            }),
            Item::ToolUse { id, name, input } => {
                events.push(StreamEvent::ToolCallStart {
                    index,
                    id: id.clone(),
                    name: name.clone(),
                });
                events.push(StreamEvent::ToolCallDelta {
                    index,
                    partial_json: input.to_string(),
                });
            }
            _ => {}
        }
    }
    events.push(StreamEvent::Done(response));
    events
}

/// Collects a stream into its final response: the `Done` event's, or an error
/// if the stream ended without one.
pub async fn collect_stream(
    mut events: BoxStream<'_, Result<StreamEvent, ModelError>>,
) -> Result<ModelResponse, ModelError> {
    while let Some(event) = events.next().await {
        if let StreamEvent::Done(response) = event? {
            return Ok(response);
        }
    }
    Err(ModelError::InvalidResponse(
        "the stream ended without a final message".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(Debug)]
    struct Fixed(ModelResponse);

    #[async_trait]
    impl Model for Fixed {
        async fn complete(&self, _r: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
            Ok(self.0.clone())
        }
    }

    #[tokio::test]
    async fn default_stream_replays_the_response() {
        let response = ModelResponse::new(
            vec![
                Item::text("hi"),
                Item::tool_use("c1", "add", json!({"a":1})),
            ],
            StopReason::ToolUse,
        );
        let model = Fixed(response.clone());
        let settings = ModelSettings::default();
        let request = ModelRequest::new("", &[], &settings);
        let events: Vec<_> = model.stream(request).collect().await;
        assert_eq!(events.len(), 4);
        assert!(matches!(
            events[0],
            Ok(StreamEvent::TextDelta { index: 0, .. })
        ));
        assert!(matches!(
            events[2],
            Ok(StreamEvent::ToolCallDelta { index: 1, .. })
        ));
        let back = collect_stream(model.stream(request)).await.unwrap();
        assert_eq!(back, response);
    }

    #[test]
    fn retryability_follows_the_status() {
        let http = |status| ModelError::Http {
            status,
            message: String::new(),
            retry_after: None,
        };
        assert!(http(429).is_retryable());
        assert!(http(503).is_retryable());
        assert!(!http(400).is_retryable());
        assert!(!http(401).is_retryable());
        assert!(ModelError::Overloaded("x".into()).is_retryable());
        assert!(!ModelError::InvalidRequest("x".into()).is_retryable());
        assert!(!ModelError::ContextLength("x".into()).is_retryable());
    }

    /// Counts a request's messages, one token each.
    #[derive(Debug)]
    struct Counting;

    #[async_trait]
    impl Model for Counting {
        async fn complete(&self, _r: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
            Err(ModelError::InvalidRequest("not called".into()))
        }

        async fn count_tokens(&self, r: ModelRequest<'_>) -> Result<InputTokenCount, ModelError> {
            Ok(InputTokenCount::Counted(r.messages().len() as u64))
        }
    }

    #[tokio::test]
    async fn counting_is_not_offered_by_default_and_forwarded_by_wrappers() {
        let settings = ModelSettings::default();
        let history = [Message::user("a"), Message::user("b")];
        let request = ModelRequest::new("", &history, &settings);
        let plain = Fixed(ModelResponse::new(Vec::new(), StopReason::EndTurn));
        assert_eq!(
            plain.count_tokens(request).await,
            Ok(InputTokenCount::NotOffered)
        );
        let shared: std::sync::Arc<dyn Model> = std::sync::Arc::new(Counting);
        assert_eq!(
            shared.count_tokens(request).await,
            Ok(InputTokenCount::Counted(2))
        );
        let boxed: Box<dyn Model> = Box::new(shared);
        assert_eq!(
            Model::count_tokens(&boxed, request).await,
            Ok(InputTokenCount::Counted(2))
        );
    }

    /// Compacts every request into one item.
    #[derive(Debug)]
    struct Compacting;

    #[async_trait]
    impl Model for Compacting {
        async fn complete(&self, _r: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
            Err(ModelError::InvalidRequest("not called".into()))
        }

        fn native_summaries(&self) -> Option<&str> {
            Some("test.vendor")
        }

        async fn compact(&self, r: ModelRequest<'_>) -> Result<Compaction, ModelError> {
            let items = vec![format!("{{\"n\":{}}}", r.messages().len())];
            Ok(Compaction::Compacted(Compacted::new(
                crate::message::NativeItems::new("test.vendor", items),
                Usage::default(),
            )))
        }
    }

    #[tokio::test]
    async fn compaction_is_not_offered_by_default_and_forwarded_by_wrappers() {
        let settings = ModelSettings::default();
        let history = [Message::user("a"), Message::user("b")];
        let request = ModelRequest::new("", &history, &settings);
        let plain = Fixed(ModelResponse::new(Vec::new(), StopReason::EndTurn));
        assert_eq!(plain.compact(request).await, Ok(Compaction::NotOffered));
        assert_eq!(plain.native_summaries(), None);
        let shared: std::sync::Arc<dyn Model> = std::sync::Arc::new(Compacting);
        let boxed: Box<dyn Model> = Box::new(std::sync::Arc::clone(&shared));
        for model in [&*shared, &*boxed] {
            assert_eq!(model.native_summaries(), Some("test.vendor"));
            let Ok(Compaction::Compacted(compacted)) = model.compact(request).await else {
                panic!("forwarded");
            };
            assert_eq!(compacted.native.items, vec![r#"{"n":2}"#.to_owned()]);
        }
    }

    /// A layer that changes the answer only.
    #[derive(Debug)]
    struct Loud<M>(M);

    #[async_trait]
    impl<M: Model> ModelLayer for Loud<M> {
        type Inner = M;

        fn inner(&self) -> &M {
            &self.0
        }

        async fn complete(&self, r: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
            let mut answer = self.0.complete(r).await?;
            answer.model = Some("LOUD".into());
            Ok(answer)
        }
    }

    /// Answers every method with something of its own, and notes which
    /// methods were reached.
    #[derive(Debug, Default)]
    struct Probe {
        reached: std::sync::Mutex<std::collections::BTreeSet<&'static str>>,
    }

    impl Probe {
        fn reach(&self, method: &'static str) {
            self.reached.lock().unwrap().insert(method);
        }
    }

    #[async_trait]
    impl Model for Probe {
        async fn complete(&self, _r: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
            self.reach("complete");
            Ok(ModelResponse::new(
                vec![Item::text("probe")],
                StopReason::EndTurn,
            ))
        }
        fn provider_name(&self) -> &str {
            self.reach("provider_name");
            "probe"
        }
        fn model_name(&self) -> Option<&str> {
            self.reach("model_name");
            Some("probe-1")
        }
        fn default_max_tokens(&self, _s: &ModelSettings) -> u32 {
            self.reach("default_max_tokens");
            7
        }
        fn thinking_allowance(&self, _s: &ModelSettings, _t: Thinking) -> ThinkingAllowance {
            self.reach("thinking_allowance");
            ThinkingAllowance {
                forced_tool_choice: true,
                temperature: true,
            }
        }
        fn check_tools(
            &self,
            _t: &[ToolDefinition],
            _o: Option<&Value>,
        ) -> Result<(), Unsupported> {
            self.reach("check_tools");
            Err(Unsupported::output_type("probe"))
        }
        async fn count_tokens(&self, _r: ModelRequest<'_>) -> Result<InputTokenCount, ModelError> {
            self.reach("count_tokens");
            Ok(InputTokenCount::Counted(11))
        }
        fn native_summaries(&self) -> Option<&str> {
            self.reach("native_summaries");
            Some("probe.vendor")
        }
        fn native_tool_search(&self) -> bool {
            self.reach("native_tool_search");
            true
        }
        async fn compact(&self, _r: ModelRequest<'_>) -> Result<Compaction, ModelError> {
            self.reach("compact");
            Err(ModelError::InvalidRequest("probe compacts".into()))
        }
        fn stream<'a>(
            &'a self,
            _r: ModelRequest<'a>,
        ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
            self.reach("stream");
            stream::once(async { Err(ModelError::InvalidRequest("probe streams".into())) }).boxed()
        }
    }

    /// The methods the item of this file whose first line is `header`
    /// declares (a trait or an impl), as rustfmt lays them out: a `fn`
    /// line one indent in.
    fn methods_in(header: &str) -> std::collections::BTreeSet<&'static str> {
        let source: &'static str = include_str!("model.rs");
        let (_, body) = source
            .split_once(&format!("\n{header}\n"))
            .unwrap_or_else(|| panic!("no line {header:?} in model.rs"));
        let body = &body[..body.find("\n}\n").expect("the item ends")];
        body.lines()
            .filter_map(|line| {
                let line = line.strip_prefix("    ")?;
                let rest = line
                    .strip_prefix("async fn ")
                    .or_else(|| line.strip_prefix("fn "))?;
                Some(&rest[..rest.find(['(', '<'])?])
            })
            .collect()
    }

    /// Every method of [`Model`], as this file declares them.
    fn model_methods() -> std::collections::BTreeSet<&'static str> {
        methods_in("pub trait Model: Send + Sync + fmt::Debug {")
    }

    #[test]
    fn every_model_method_has_a_forwarding_twin_and_both_blanket_impls_pass_it_on() {
        let model = model_methods();
        assert!(
            model.contains("complete") && model.contains("stream") && model.len() >= 10,
            "{model:?}"
        );
        let mut layer = model.clone();
        layer.insert("inner");
        assert_eq!(
            methods_in("pub trait ModelLayer: Send + Sync + fmt::Debug {"),
            layer,
            "ModelLayer has a twin of each method of Model"
        );
        assert_eq!(
            methods_in("impl<L: ModelLayer> Model for L {"),
            model,
            "every layer's Model impl"
        );
        assert_eq!(
            methods_in("impl<M: Model + ?Sized> Model for std::sync::Arc<M> {"),
            model,
            "Arc's Model impl"
        );
    }

    /// Calls every method of `model` (a wrapper of `probe`), checks that
    /// each answers as the probe does, and that each reached it: every
    /// method [`Model`] declares, so that a method added to the trait
    /// fails here until the probe answers it and a wrapper passes it on.
    async fn reaches_the_probe(model: &dyn Model, probe: &Probe) {
        let settings = ModelSettings::default();
        let request = ModelRequest::new("", &[], &settings);
        let answer = model.complete(request).await.unwrap();
        assert_eq!(answer.content, vec![Item::text("probe")]);
        assert_eq!(model.provider_name(), "probe");
        assert_eq!(model.model_name(), Some("probe-1"));
        assert_eq!(model.default_max_tokens(&settings), 7);
        assert!(
            model
                .thinking_allowance(&settings, Thinking::Adaptive)
                .temperature
        );
        assert!(model.check_tools(&[], None).is_err());
        assert_eq!(
            model.count_tokens(request).await,
            Ok(InputTokenCount::Counted(11))
        );
        assert_eq!(model.native_summaries(), Some("probe.vendor"));
        assert!(model.native_tool_search());
        assert_eq!(
            model.compact(request).await,
            Err(ModelError::InvalidRequest("probe compacts".into()))
        );
        let streamed: Vec<_> = model.stream(request).collect().await;
        assert_eq!(
            streamed,
            vec![Err(ModelError::InvalidRequest("probe streams".into()))]
        );
        assert_eq!(*probe.reached.lock().unwrap(), model_methods());
    }

    #[tokio::test]
    async fn a_layer_changes_what_it_overrides_and_forwards_every_other_method() {
        let settings = ModelSettings::default();
        let request = ModelRequest::new("", &[], &settings);
        let loud = Loud(Probe::default());
        let answer = Model::complete(&loud, request).await.unwrap();
        assert_eq!(answer.model.as_deref(), Some("LOUD"));
        let loud = Loud(Probe::default());
        reaches_the_probe(&loud, &loud.0).await;
        let shared = std::sync::Arc::new(Probe::default());
        reaches_the_probe(&shared, &shared).await;
        let boxed = Box::new(Probe::default());
        reaches_the_probe(&boxed, &boxed).await;
        let layered = std::sync::Arc::new(Loud(Probe::default()));
        let boxed: Box<dyn Model> = Box::new(std::sync::Arc::clone(&layered));
        reaches_the_probe(&boxed, &layered.0).await;
    }

    #[test]
    fn fixed_thinking_budget_forbids_forced_tools() {
        let t = Thinking::Enabled {
            budget_tokens: 1024,
        };
        assert!(!t.allows().forced_tool_choice);
        assert!(!t.allows().temperature);
        assert!(Thinking::Adaptive.allows().forced_tool_choice);
    }
}

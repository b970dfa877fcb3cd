//! The Messages API's JSON, private to this module, and the hand-written
//! conversions from and to markov's types. Request types borrow from the
//! [`ModelRequest`]; response types are owned.
//!
//! Server tools (provider built-ins): a [`ProviderTool`] is sent in `tools` as
//! its vendor object `{type, name, ...config}`, after the client tools (the
//! prompt-cache breakpoint stays on the last client tool). A `server_tool_use`
//! block becomes an [`Item::ProviderToolUse`] and any other block whose type
//! ends in `_tool_result` (`web_search_tool_result`,
//! `code_execution_tool_result`, ...; not the client `tool_result`) an
//! [`Item::ProviderToolResult`]; both are sent back in assistant messages as
//! the same blocks.

use std::borrow::Cow;

use markov_core::message::{EphemeralPart, camera_frame_text};
use markov_core::model::Thinking;
use markov_core::tool::ProviderTool;
use markov_core::{
    Item, Message, ModelError, ModelRequest, ModelResponse, Role, StopReason, ToolChoice, Usage,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::PromptCaching;
use crate::body::{self, BodyCache, FrameBytes, FrameCache, Rendered};
use crate::convert::{self, Content, SYSTEM_PREFIX};
use crate::output::{self, Plan};

/// The whole request as one value: what [`encode_plain`] writes with
/// `serde_json::to_vec`. Flattened, its fields are [`Head`]'s and
/// [`Tail`]'s, in that order around the messages.
#[derive(Serialize)]
struct Request<'a> {
    #[serde(flatten)]
    head: Head<'a>,
    messages: Vec<WireMessage<'a>>,
    #[serde(flatten)]
    tail: Tail<'a>,
}

#[derive(Serialize, Clone, Copy)]
struct CacheControl {
    #[serde(rename = "type")]
    kind: &'static str,
}

const EPHEMERAL: CacheControl = CacheControl { kind: "ephemeral" };

#[derive(Serialize)]
struct SystemBlock<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_control: Option<CacheControl>,
}

struct WireMessage<'a> {
    role: &'static str,
    content: Vec<Block<'a>>,
    /// The index (in the rendered run) of the first history message in it.
    start: usize,
    /// Whether its last block carries the conversation's cache breakpoint
    /// (only ever the request's last message, which the request cache
    /// never holds: the breakpoint moves without touching cached bytes).
    breakpoint: bool,
}

impl Serialize for WireMessage<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut message = serializer.serialize_struct("WireMessage", 2)?;
        message.serialize_field("role", self.role)?;
        message.serialize_field(
            "content",
            &Blocks {
                blocks: &self.content,
                breakpoint: self.breakpoint,
            },
        )?;
        message.end()
    }
}

/// A message's blocks, the last one with the cache breakpoint if asked.
struct Blocks<'b, 'a> {
    blocks: &'b [Block<'a>],
    breakpoint: bool,
}

impl Serialize for Blocks<'_, '_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = serializer.serialize_seq(Some(self.blocks.len()))?;
        let last = self.blocks.len().checked_sub(1);
        for (i, block) in self.blocks.iter().enumerate() {
            if self.breakpoint && Some(i) == last && block.takes_cache_control() {
                seq.serialize_element(&WithBreakpoint {
                    block,
                    cache_control: EPHEMERAL,
                })?;
            } else {
                seq.serialize_element(block)?;
            }
        }
        seq.end()
    }
}

/// A block with `cache_control` after its own fields.
#[derive(Serialize)]
struct WithBreakpoint<'b, 'a> {
    #[serde(flatten)]
    block: &'b Block<'a>,
    cache_control: CacheControl,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block<'a> {
    Text {
        text: Cow<'a, str>,
    },
    Image {
        source: ImageSource<'a>,
    },
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: &'a Value,
    },
    ToolResult {
        tool_use_id: &'a str,
        content: ToolResultContent<'a>,
        #[serde(skip_serializing_if = "Option::is_none")]
        is_error: Option<bool>,
    },
    Thinking {
        thinking: &'a str,
        signature: &'a str,
    },
    ServerToolUse {
        id: &'a str,
        name: &'a str,
        input: &'a Value,
    },
    /// A server tool's result; its `type` is the stored vendor block type.
    #[serde(untagged)]
    ServerToolResult(ServerToolResult<'a>),
}

impl Block<'_> {
    /// Whether the API accepts `cache_control` on this block (thinking
    /// blocks and server tool blocks take none).
    fn takes_cache_control(&self) -> bool {
        matches!(
            self,
            Block::Text { .. }
                | Block::Image { .. }
                | Block::ToolUse { .. }
                | Block::ToolResult { .. }
        )
    }
}

/// A tool result's `content`: its text, or, when the tool returned
/// images, a list of a text block (if there is text) and image blocks.
#[derive(Serialize)]
#[serde(untagged)]
enum ToolResultContent<'a> {
    Text(&'a str),
    Blocks(Vec<Block<'a>>),
}

#[derive(Serialize)]
struct ServerToolResult<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    tool_use_id: &'a str,
    content: &'a Value,
}

/// One entry of `tools`: a client tool, or a server tool's vendor object.
#[derive(Serialize)]
#[serde(untagged)]
enum WireTool<'a> {
    Client(Tool<'a>),
    Server(Value),
}

/// A server tool as the API takes it: `{type, name, ...config}`.
fn server_tool(tool: &ProviderTool) -> WireTool<'_> {
    WireTool::Server(tool.to_json())
}

#[derive(Serialize)]
struct ImageSource<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    media_type: &'a str,
    data: &'a str,
}

#[derive(Serialize)]
struct Tool<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    description: &'a str,
    input_schema: &'a Value,
    /// Loaded only once the API's tool search finds it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    defer_loading: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_control: Option<CacheControl>,
}

/// The API's tool search tool (BM25 over the deferred tools), sent after
/// the client tools when some are deferred.
fn tool_search_tool() -> WireTool<'static> {
    WireTool::Server(serde_json::json!({
        "type": super::TOOL_SEARCH_TOOL_TYPE,
        "name": super::TOOL_SEARCH_TOOL_NAME,
    }))
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireToolChoice<'a> {
    Auto {
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        disable_parallel_tool_use: bool,
    },
    Any {
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        disable_parallel_tool_use: bool,
    },
    Tool {
        name: &'a str,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        disable_parallel_tool_use: bool,
    },
    None,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireThinking {
    Enabled { budget_tokens: u32 },
    Adaptive,
}

#[derive(Serialize)]
struct OutputFormat<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    schema: &'a Value,
}

/// The fields before `messages`.
#[derive(Serialize)]
struct Head<'a> {
    model: &'a str,
    /// Left out of a token count, which takes none.
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    system: Vec<SystemBlock<'a>>,
}

/// The fields after `messages`.
#[derive(Serialize)]
struct Tail<'a> {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<WireTool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<WireToolChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    thinking: Option<WireThinking>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    output_format: Option<OutputFormat<'a>>,
    /// The client's context editing, the same on every request (the
    /// messages are encoded as they would be without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    context_management: Option<&'a Value>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    stream: bool,
}

/// How the client shapes every request, beyond the request itself.
#[derive(Debug, Clone)]
pub(super) struct Shape {
    pub(super) caching: PromptCaching,
    /// Whether `output_format` is sent next to tools (see [`crate::output`]).
    pub(super) schema_with_tools: bool,
    /// The `context_management` field, if the client edits context.
    pub(super) context_management: Option<Value>,
}

/// What a body is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Purpose {
    /// A model call, streamed or not.
    Call {
        /// Whether the answer is streamed.
        stream: bool,
    },
    /// A token count (`/v1/messages/count_tokens`): the call's body
    /// without `max_tokens`, `temperature` and `stream`, which the
    /// endpoint does not take.
    Count,
}

const NO_MESSAGES: &str = "no message to send: the conversation has no user or assistant content";

/// The request body of one call, with the history's final messages taken
/// from `cache` when the request names its history, and its frame from
/// `frames` when an equal request was encoded before (see [`crate::body`]).
pub(super) fn encode(
    request: &ModelRequest<'_>,
    model: &str,
    shape: &Shape,
    purpose: Purpose,
    cache: Option<&BodyCache>,
    frames: &FrameCache<Purpose>,
) -> Result<Vec<u8>, ModelError> {
    body::build(
        request,
        cache,
        || {
            frames.get_or_build(request, model, purpose, || {
                let (head, tail) = frame(request, model, shape, purpose)?;
                FrameBytes::new(&head, Vec::new(), 0, &tail)
            })
        },
        |run| render(run, shape.caching),
        NO_MESSAGES,
    )
}

/// The request body as `serde_json::to_vec` of the whole request writes it,
/// every message encoded afresh: the reference [`encode`] must equal.
pub(super) fn encode_plain(
    request: &ModelRequest<'_>,
    model: &str,
    shape: &Shape,
    purpose: Purpose,
) -> Result<Vec<u8>, ModelError> {
    let (head, tail) = frame(request, model, shape, purpose)?;
    let mut messages = messages(request.messages());
    if messages.is_empty() {
        return Err(ModelError::InvalidRequest(NO_MESSAGES.into()));
    }
    if let Some(last) = messages.last_mut() {
        last.breakpoint = shape.caching == PromptCaching::Conversation;
    }
    let body = Request {
        head,
        messages,
        tail,
    };
    serde_json::to_vec(&body)
        .map_err(|e| ModelError::InvalidRequest(format!("cannot encode the request: {e}")))
}

/// A run of history messages as wire messages: all but the last are final
/// (the next history message may still merge into the last). The last is
/// the request's last message: with [`PromptCaching::Conversation`] it
/// carries the cache breakpoint, and it is never cached.
fn render(run: &[Message], caching: PromptCaching) -> Result<Rendered, ModelError> {
    let mut wire = messages(run);
    let mut open = wire.pop();
    if let Some(last) = open.as_mut() {
        last.breakpoint = caching == PromptCaching::Conversation;
    }
    let closed = body::write_each(&wire, |m, out| body::write_json(out, m))?;
    let consumed = open.as_ref().map_or(run.len(), |m| m.start);
    let open = match open {
        Some(message) => {
            let mut json = Vec::new();
            body::write_json(&mut json, &message)?;
            Some(json)
        }
        None => None,
    };
    Ok(Rendered {
        closed,
        closed_count: wire.len(),
        consumed,
        open,
    })
}

/// Everything of a request but its messages, checked.
fn frame<'a>(
    request: &ModelRequest<'a>,
    model: &'a str,
    shape: &'a Shape,
    purpose: Purpose,
) -> Result<(Head<'a>, Tail<'a>), ModelError> {
    let settings = request.settings();
    let plan = Plan::of(request, shape.schema_with_tools);
    let call = matches!(purpose, Purpose::Call { .. });
    let cache = match shape.caching {
        PromptCaching::SystemAndTools | PromptCaching::Conversation => Some(EPHEMERAL),
        PromptCaching::Off => None,
    };
    let thinking = match settings.thinking {
        None => None,
        Some(Thinking::Enabled { budget_tokens }) => Some(WireThinking::Enabled { budget_tokens }),
        Some(Thinking::Adaptive) => Some(WireThinking::Adaptive),
        Some(other) => {
            return Err(ModelError::InvalidRequest(format!(
                "thinking mode {other:?} is not supported by the anthropic client"
            )));
        }
    };
    if let Some(mode) = settings.thinking
        && request.tool_choice().forces_tool_use()
        && !mode.allows().forced_tool_choice
        && !request.tools().is_empty()
    {
        return Err(ModelError::InvalidRequest(
            "anthropic does not allow forcing tool use while thinking has a fixed budget".into(),
        ));
    }
    let system = if request.system().is_empty() {
        Vec::new()
    } else {
        vec![SystemBlock {
            kind: "text",
            text: request.system(),
            cache_control: cache,
        }]
    };
    // The breakpoint goes on the last tool the prompt holds: a deferred
    // one is loaded only when found.
    let last_tool = request
        .tools()
        .iter()
        .rposition(|t| !request.is_deferred(t.name.as_str()));
    let deferred = !request.deferred_tools().is_empty();
    let tools = request
        .tools()
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            WireTool::Client(Tool {
                name: tool.name.as_str(),
                description: &tool.description,
                input_schema: &tool.input_schema,
                defer_loading: deferred && request.is_deferred(tool.name.as_str()),
                cache_control: if Some(i) == last_tool { cache } else { None },
            })
        })
        .chain(deferred.then(tool_search_tool))
        .chain(plan.tool().map(|(name, schema)| {
            WireTool::Client(Tool {
                name,
                description: output::DESCRIPTION,
                input_schema: schema,
                defer_loading: false,
                cache_control: None,
            })
        }))
        .chain(request.provider_tools().iter().map(server_tool))
        .collect::<Vec<_>>();
    let disable_parallel_tool_use = !settings.parallel_tool_calls;
    let tool_choice = (!tools.is_empty()).then(|| match plan.tool_choice(request) {
        ToolChoice::Auto => WireToolChoice::Auto {
            disable_parallel_tool_use,
        },
        ToolChoice::Any => WireToolChoice::Any {
            disable_parallel_tool_use,
        },
        ToolChoice::Tool(name) => WireToolChoice::Tool {
            name: name.as_str(),
            disable_parallel_tool_use,
        },
        ToolChoice::None => WireToolChoice::None,
    });
    Ok((
        Head {
            model,
            max_tokens: call.then_some(settings.max_tokens),
            system,
        },
        Tail {
            tools,
            tool_choice,
            thinking,
            temperature: settings
                .temperature
                .filter(|_| call && settings.thinking.is_none()),
            output_format: plan.schema_field().map(|schema| OutputFormat {
                kind: "json_schema",
                schema,
            }),
            context_management: shape.context_management.as_ref(),
            stream: purpose == Purpose::Call { stream: true },
        },
    ))
}

/// The conversation in the API's shape: `command` and `instance` records
/// skipped, each `ephemeral` as the silent user messages of its
/// [`Message::ephemeral_view`] (borrowed, through its parts), a `system`
/// message as a marked user text block, consecutive messages of one role
/// merged, and tool results first in their user message.
fn messages(history: &[Message]) -> Vec<WireMessage<'_>> {
    let mut out: Vec<WireMessage<'_>> = Vec::new();
    for (at, message) in history.iter().enumerate() {
        let mut push = |role, blocks| push(&mut out, at, role, blocks);
        match message.role {
            Role::User => push("user", blocks(convert::content(message), false)),
            Role::Assistant => push("assistant", blocks(convert::content(message), true)),
            Role::Ephemeral => {
                for part in message.ephemeral_parts() {
                    push("user", ephemeral_blocks(part));
                }
            }
            Role::System => {
                if let Some(text) = convert::system_text(message) {
                    let text = Cow::Owned(format!("{SYSTEM_PREFIX}{text}"));
                    push("user", vec![Block::Text { text }]);
                }
            }
            Role::Command | Role::Instance | Role::Summary => {}
        }
    }
    for message in out.iter_mut().filter(|m| m.role == "user") {
        let content = std::mem::take(&mut message.content);
        let (mut results, rest): (Vec<_>, Vec<_>) = content
            .into_iter()
            .partition(|b| matches!(b, Block::ToolResult { .. }));
        results.extend(rest);
        message.content = results;
    }
    out
}

/// Appends `blocks` (of history message `at`) as a message of `role`,
/// merged into the last one when it has the same role; nothing when there
/// are no blocks.
fn push<'a>(out: &mut Vec<WireMessage<'a>>, at: usize, role: &'static str, blocks: Vec<Block<'a>>) {
    if blocks.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(last) if last.role == role => last.content.extend(blocks),
        _ => out.push(WireMessage {
            role,
            content: blocks,
            start: at,
            breakpoint: false,
        }),
    }
}

/// The blocks of one silent user message of an ephemeral's view.
fn ephemeral_blocks(part: EphemeralPart<'_>) -> Vec<Block<'_>> {
    match part {
        EphemeralPart::Text(text) => blocks(Content::Text(text), false),
        EphemeralPart::Items(items) => blocks(Content::Items(items), false),
        EphemeralPart::CameraFrame { frames, image } => std::iter::once(Block::Text {
            text: Cow::Owned(camera_frame_text(frames)),
        })
        .chain(block(image, false))
        .collect(),
        _ => Vec::new(),
    }
}

fn blocks(content: Content<'_>, assistant: bool) -> Vec<Block<'_>> {
    match content {
        Content::Text("") => Vec::new(),
        Content::Text(text) => vec![Block::Text {
            text: Cow::Borrowed(text),
        }],
        Content::Items(items) => items
            .iter()
            .filter_map(|item| block(item, assistant))
            .collect(),
    }
}

fn block(item: &Item, assistant: bool) -> Option<Block<'_>> {
    Some(match item {
        Item::Text { text } if text.is_empty() => return None,
        Item::Text { text } => Block::Text {
            text: Cow::Borrowed(text),
        },
        Item::Image {
            mime_type, data, ..
        } => Block::Image {
            source: ImageSource {
                kind: "base64",
                media_type: mime_type,
                data,
            },
        },
        Item::File {
            url,
            media_type,
            filename,
            ..
        } => Block::Text {
            text: Cow::Owned(convert::file_reference(
                url,
                media_type,
                filename.as_deref(),
            )),
        },
        Item::ToolUse { id, name, input } => Block::ToolUse {
            id: id.as_str(),
            name,
            input,
        },
        Item::ToolResult {
            tool_use_id,
            content,
            is_error,
            images,
        } => Block::ToolResult {
            tool_use_id: tool_use_id.as_str(),
            content: if images.is_empty() {
                ToolResultContent::Text(content)
            } else {
                // The API refuses an empty text block: an image-only
                // result is its images.
                let text = (!content.is_empty()).then_some(Block::Text {
                    text: Cow::Borrowed(content),
                });
                ToolResultContent::Blocks(
                    text.into_iter()
                        .chain(images.iter().map(|image| Block::Image {
                            source: ImageSource {
                                kind: "base64",
                                media_type: &image.mime_type,
                                data: &image.data,
                            },
                        }))
                        .collect(),
                )
            },
            is_error: *is_error,
        },
        // The API checks thinking blocks by their signature; unsigned
        // thinking, and thinking another provider signed (OpenAI's
        // Responses and Gemini mark theirs with a `|`, which Anthropic's
        // base64 signatures never hold), cannot be sent back.
        Item::Thinking {
            thinking,
            signature: Some(signature),
        } if assistant && !signature.contains('|') => Block::Thinking {
            thinking,
            signature,
        },
        Item::Output { data } => Block::Text {
            text: Cow::Owned(convert::output_text(data)),
        },
        // Server tool blocks belong to the assistant turn that produced them.
        Item::ProviderToolUse { id, name, input } if assistant => Block::ServerToolUse {
            id: id.as_str(),
            name,
            input,
        },
        Item::ProviderToolResult {
            tool_use_id,
            kind,
            content,
        } if assistant => Block::ServerToolResult(ServerToolResult {
            kind,
            tool_use_id: tool_use_id.as_str(),
            content,
        }),
        _ => return None,
    })
}

/// A complete (non-streamed) answer.
#[derive(Deserialize)]
struct Response {
    content: Vec<Value>,
    #[serde(default)]
    stop_reason: Option<String>,
    #[serde(default)]
    usage: WireUsage,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    context_management: Option<AppliedEdits>,
}

/// What context editing did to a request, as an answer (or a stream's
/// `message_delta`) reports it.
#[derive(Deserialize, Debug, Default, PartialEq, Eq)]
pub(super) struct AppliedEdits {
    #[serde(default)]
    applied_edits: Vec<AppliedEdit>,
}

/// One edit the API applied before the model read the request.
#[derive(Deserialize, Debug, PartialEq, Eq)]
struct AppliedEdit {
    #[serde(default, rename = "type")]
    kind: String,
    #[serde(default)]
    cleared_tool_uses: u64,
    #[serde(default)]
    cleared_input_tokens: u64,
}

impl AppliedEdits {
    /// Records each edit in the trace (an event of the call's span): the
    /// history is never changed, so this is the only record of what the
    /// model did not see.
    pub(super) fn record(&self) {
        for edit in &self.applied_edits {
            tracing::info!(
                edit = %edit.kind,
                cleared_tool_uses = edit.cleared_tool_uses,
                cleared_input_tokens = edit.cleared_input_tokens,
                "the provider's context editing cleared part of the request"
            );
        }
    }
}

/// A token count's answer: `{"input_tokens": N}` (with context editing,
/// the count after the edits).
#[derive(Deserialize)]
struct CountAnswer {
    input_tokens: u64,
}

/// The input tokens of a count's answer.
pub(super) fn decode_count(body: &str) -> Result<u64, ModelError> {
    serde_json::from_str::<CountAnswer>(body)
        .map(|answer| answer.input_tokens)
        .map_err(|e| ModelError::InvalidResponse(format!("cannot parse the token count: {e}")))
}

/// Token counts, as `message_start`, `message_delta` and complete answers carry them.
#[derive(Deserialize, Default)]
pub(super) struct WireUsage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

impl WireUsage {
    /// Overwrites the counts this usage states (later events are cumulative).
    pub(super) fn apply_to(&self, usage: &mut Usage) {
        let fields = [
            (self.input_tokens, &mut usage.input_tokens),
            (self.output_tokens, &mut usage.output_tokens),
            (
                self.cache_creation_input_tokens,
                &mut usage.cache_creation_input_tokens,
            ),
            (
                self.cache_read_input_tokens,
                &mut usage.cache_read_input_tokens,
            ),
        ];
        for (value, slot) in fields {
            if let Some(value) = value {
                *slot = value;
            }
        }
    }
}

/// The content blocks this client understands.
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(super) enum KnownBlock {
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        #[serde(default)]
        input: Value,
    },
    Thinking {
        thinking: String,
        #[serde(default)]
        signature: Option<String>,
    },
    RedactedThinking {},
    ServerToolUse {
        id: String,
        name: String,
        #[serde(default)]
        input: Value,
    },
}

/// How one content block is kept.
pub(super) enum Converted {
    Known(KnownBlock),
    /// A server tool's result block (`web_search_tool_result`, ...).
    ServerToolResult {
        kind: String,
        tool_use_id: String,
        content: Value,
    },
    /// A block of a type this client does not know, kept as its JSON text.
    Unknown(Value),
}

/// Whether a block type is a server tool's result: ends in `_tool_result`
/// and is not the client `tool_result`.
fn is_server_tool_result(kind: &str) -> bool {
    kind != "tool_result" && kind.ends_with("_tool_result")
}

pub(super) fn classify(block: Value) -> Result<Converted, ModelError> {
    let kind = block.get("type").and_then(Value::as_str);
    if let Some(kind) = kind
        && is_server_tool_result(kind)
    {
        return server_tool_result(block);
    }
    let known = matches!(
        kind,
        Some("text" | "tool_use" | "thinking" | "redacted_thinking" | "server_tool_use")
    );
    if !known {
        return Ok(Converted::Unknown(block));
    }
    serde_json::from_value(block)
        .map(Converted::Known)
        .map_err(|e| ModelError::InvalidResponse(format!("malformed content block: {e}")))
}

fn server_tool_result(block: Value) -> Result<Converted, ModelError> {
    let Value::Object(mut block) = block else {
        return Err(ModelError::InvalidResponse(
            "malformed server tool result block: not an object".into(),
        ));
    };
    let field = |block: &mut serde_json::Map<String, Value>, key: &str| match block.remove(key) {
        Some(Value::String(s)) => Ok(s),
        _ => Err(ModelError::InvalidResponse(format!(
            "malformed server tool result block: no string `{key}`"
        ))),
    };
    let kind = field(&mut block, "type")?;
    let tool_use_id = field(&mut block, "tool_use_id")?;
    let content = block.remove("content").unwrap_or(Value::Null);
    Ok(Converted::ServerToolResult {
        kind,
        tool_use_id,
        content,
    })
}

/// Tool input as the API gives it: an object, `{}` when absent.
pub(super) fn tool_input(input: Value) -> Value {
    if input.is_null() {
        Value::Object(serde_json::Map::new())
    } else {
        input
    }
}

/// A block as an item. Redacted thinking is dropped (markov has no item
/// for it); unknown blocks become text holding their JSON.
pub(super) fn item(block: Converted) -> Option<Item> {
    match block {
        Converted::Known(KnownBlock::Text { text }) => Some(Item::Text { text }),
        Converted::Known(KnownBlock::ToolUse { id, name, input }) => {
            Some(Item::tool_use(id, name, tool_input(input)))
        }
        Converted::Known(KnownBlock::Thinking {
            thinking,
            signature,
        }) => Some(Item::Thinking {
            thinking,
            signature,
        }),
        Converted::Known(KnownBlock::RedactedThinking {}) => {
            tracing::debug!("dropping a redacted thinking block");
            None
        }
        Converted::Known(KnownBlock::ServerToolUse { id, name, input }) => {
            Some(Item::provider_tool_use(id, name, tool_input(input)))
        }
        Converted::ServerToolResult {
            kind,
            tool_use_id,
            content,
        } => Some(Item::provider_tool_result(tool_use_id, kind, content)),
        Converted::Unknown(block) => Some(Item::text(block.to_string())),
    }
}

/// Maps `stop_reason`. An unknown or missing reason is `end_turn`, or
/// `tool_use` when the answer calls tools.
pub(super) fn stop_reason(reason: Option<&str>, has_tool_calls: bool) -> StopReason {
    match reason {
        Some("end_turn") => StopReason::EndTurn,
        Some("tool_use") => StopReason::ToolUse,
        Some("max_tokens" | "model_context_window_exceeded") => StopReason::MaxTokens,
        Some("stop_sequence") => StopReason::StopSequence,
        Some("pause_turn") => StopReason::PauseTurn,
        Some("refusal") => StopReason::Refusal,
        other => {
            if let Some(other) = other {
                tracing::warn!(stop_reason = other, "unknown stop reason");
            }
            convert::implied_stop_reason(has_tool_calls)
        }
    }
}

/// A complete answer from its body.
pub(super) fn decode(body: &[u8]) -> Result<ModelResponse, ModelError> {
    let response: Response = serde_json::from_slice(body)
        .map_err(|e| ModelError::InvalidResponse(format!("cannot parse the answer: {e}")))?;
    if let Some(edits) = &response.context_management {
        edits.record();
    }
    let mut content = Vec::with_capacity(response.content.len());
    for block in response.content {
        if let Some(item) = item(classify(block)?) {
            content.push(item);
        }
    }
    let has_tool_calls = content.iter().any(|i| matches!(i, Item::ToolUse { .. }));
    let mut usage = Usage::default();
    response.usage.apply_to(&mut usage);
    let mut answer = ModelResponse::new(
        content,
        stop_reason(response.stop_reason.as_deref(), has_tool_calls),
    )
    .with_usage(usage);
    answer.model = convert::model_name(response.model);
    Ok(answer)
}

/// The tool list in the Messages API's format (no cache control).
pub(super) fn tool_schemas(tools: &[markov_core::ToolDefinition]) -> Value {
    let tools: Vec<Tool<'_>> = tools
        .iter()
        .map(|tool| Tool {
            name: tool.name.as_str(),
            description: &tool.description,
            input_schema: &tool.input_schema,
            defer_loading: false,
            cache_control: None,
        })
        .collect();
    serde_json::to_value(tools).unwrap_or(Value::Null)
}

//! The Chat Completions JSON, private to this module, and the hand-written
//! conversions from and to markov's types. Request types borrow from the
//! [`ModelRequest`]; response types are owned.
//!
//! Chat Completions has no provider built-in tools: a request offering any
//! ([`ModelRequest::provider_tools`]) is refused before it is sent, and the
//! provider tool items of another provider's answers in the history are not
//! sent (the API has no block for them).

use std::borrow::Cow;

use markov_core::message::{EphemeralPart, camera_frame_text};
use markov_core::{
    Item, Message, ModelError, ModelRequest, ModelResponse, Role, StopReason, ToolChoice, Usage,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{MaxTokensField, SchemaStrictness};
use crate::body::{self, BodyCache, FrameBytes, Rendered};
use crate::convert::{self, Content};
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

#[derive(Serialize)]
#[serde(tag = "role", rename_all = "lowercase")]
enum WireMessage<'a> {
    System {
        content: Cow<'a, str>,
    },
    User {
        content: UserContent<'a>,
    },
    Assistant {
        #[serde(skip_serializing_if = "Option::is_none")]
        content: Option<String>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ToolCall<'a>>,
    },
    Tool {
        tool_call_id: &'a str,
        content: Cow<'a, str>,
    },
}

#[derive(Serialize)]
#[serde(untagged)]
enum UserContent<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Part<'a> {
    Text { text: Cow<'a, str> },
    ImageUrl { image_url: ImageUrl<'a> },
}

#[derive(Serialize)]
struct ImageUrl<'a> {
    url: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<&'a str>,
}

#[derive(Serialize)]
struct ToolCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: FunctionCall<'a>,
}

#[derive(Serialize)]
struct FunctionCall<'a> {
    name: &'a str,
    arguments: String,
}

#[derive(Serialize)]
struct Tool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: Function<'a>,
}

#[derive(Serialize)]
struct Function<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    description: &'a str,
    parameters: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    strict: Option<bool>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum WireToolChoice<'a> {
    Mode(&'static str),
    Named {
        #[serde(rename = "type")]
        kind: &'static str,
        function: NamedFunction<'a>,
    },
}

#[derive(Serialize)]
struct NamedFunction<'a> {
    name: &'a str,
}

#[derive(Serialize)]
struct ResponseFormat<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    json_schema: JsonSchema<'a>,
}

#[derive(Serialize)]
struct JsonSchema<'a> {
    name: &'static str,
    schema: &'a Value,
    strict: bool,
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

/// The name given to a structured-output schema.
const OUTPUT_SCHEMA_NAME: &str = "output";

/// How the client shapes a request, beyond the request itself.
#[derive(Clone, Copy)]
pub(super) struct Shape {
    pub(super) max_tokens_field: MaxTokensField,
    pub(super) strictness: SchemaStrictness,
    /// Whether `response_format` is sent next to tools (see
    /// [`crate::output`]).
    pub(super) schema_with_tools: bool,
}

/// The fields before `messages`.
#[derive(Serialize)]
struct Head<'a> {
    model: &'a str,
}

/// The fields after `messages`.
#[derive(Serialize)]
struct Tail<'a> {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Tool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<WireToolChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_completion_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_format: Option<ResponseFormat<'a>>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<StreamOptions>,
}

const NO_MESSAGES: &str = "no message to send: the conversation and the system prompt are empty";

/// The request body of one call, with the history's messages taken from
/// `cache` when the request names its history (see [`crate::body`]).
pub(super) fn encode(
    request: &ModelRequest<'_>,
    model: &str,
    shape: Shape,
    stream: bool,
    cache: Option<&BodyCache>,
) -> Result<Vec<u8>, ModelError> {
    body::build(
        request,
        cache,
        || {
            let tail = tail(request, shape, stream)?;
            let mut lead = Vec::new();
            if !request.system().is_empty() {
                body::push_json(
                    &mut lead,
                    &WireMessage::System {
                        content: Cow::Borrowed(request.system()),
                    },
                )?;
            }
            let lead_count = usize::from(!request.system().is_empty());
            FrameBytes::new(&Head { model }, lead, lead_count, &tail)
        },
        render,
        NO_MESSAGES,
    )
}

/// The request body as `serde_json::to_vec` of the whole request writes it,
/// every message encoded afresh: the reference [`encode`] must equal.
pub(super) fn encode_plain(
    request: &ModelRequest<'_>,
    model: &str,
    shape: Shape,
    stream: bool,
) -> Result<Vec<u8>, ModelError> {
    let tail = tail(request, shape, stream)?;
    let mut messages = Vec::new();
    if !request.system().is_empty() {
        messages.push(WireMessage::System {
            content: Cow::Borrowed(request.system()),
        });
    }
    for message in request.messages() {
        push_message(message, &mut messages);
    }
    if messages.is_empty() {
        return Err(ModelError::InvalidRequest(NO_MESSAGES.into()));
    }
    let body = Request {
        head: Head { model },
        messages,
        tail,
    };
    serde_json::to_vec(&body)
        .map_err(|e| ModelError::InvalidRequest(format!("cannot encode the request: {e}")))
}

/// A run of history messages as wire messages, all final: Chat Completions
/// messages are never merged.
fn render(run: &[Message]) -> Result<Rendered, ModelError> {
    let mut wire = Vec::new();
    for message in run {
        push_message(message, &mut wire);
    }
    let closed = body::write_each(&wire, |m, out| body::write_json(out, m))?;
    Ok(Rendered {
        closed,
        closed_count: wire.len(),
        consumed: run.len(),
        open: None,
    })
}

/// Everything of a request after its messages, checked.
fn tail<'a>(
    request: &ModelRequest<'a>,
    shape: Shape,
    stream: bool,
) -> Result<Tail<'a>, ModelError> {
    if let Some(tool) = request.provider_tools().first() {
        return Err(ModelError::InvalidRequest(format!(
            "the openai client cannot offer provider built-in tool {:?} (type {:?}): Chat Completions has no provider-run tools",
            tool.name.as_str(),
            tool.kind
        )));
    }
    let settings = request.settings();
    let strict = shape.strictness == SchemaStrictness::Strict;
    let plan = Plan::of(request, shape.schema_with_tools);
    let tools: Vec<Tool<'_>> = request
        .tools()
        .iter()
        .map(|tool| Tool {
            kind: "function",
            function: Function {
                name: tool.name.as_str(),
                description: &tool.description,
                parameters: &tool.input_schema,
                strict: strict.then_some(true),
            },
        })
        .chain(plan.tool().map(|(name, schema)| Tool {
            kind: "function",
            function: Function {
                name,
                description: output::DESCRIPTION,
                parameters: schema,
                strict: strict.then_some(true),
            },
        }))
        .collect();
    let has_tools = !tools.is_empty();
    let tool_choice = has_tools.then(|| match plan.tool_choice(request) {
        ToolChoice::Auto => WireToolChoice::Mode("auto"),
        ToolChoice::Any => WireToolChoice::Mode("required"),
        ToolChoice::None => WireToolChoice::Mode("none"),
        ToolChoice::Tool(name) => WireToolChoice::Named {
            kind: "function",
            function: NamedFunction {
                name: name.as_str(),
            },
        },
    });
    let (max_completion_tokens, max_tokens) = match shape.max_tokens_field {
        MaxTokensField::MaxCompletionTokens => (Some(settings.max_tokens), None),
        MaxTokensField::MaxTokens => (None, Some(settings.max_tokens)),
    };
    Ok(Tail {
        tools,
        tool_choice,
        // Sent only to turn parallel calls off: `true` is every server's
        // default, and some reject the field on models without tools.
        parallel_tool_calls: (has_tools && !settings.parallel_tool_calls).then_some(false),
        max_completion_tokens,
        max_tokens,
        temperature: settings.temperature,
        response_format: plan.schema_field().map(|schema| ResponseFormat {
            kind: "json_schema",
            json_schema: JsonSchema {
                name: OUTPUT_SCHEMA_NAME,
                schema,
                strict,
            },
        }),
        stream,
        stream_options: stream.then_some(StreamOptions {
            include_usage: true,
        }),
    })
}

/// Appends one stored message in the API's shape.
fn push_message<'a>(message: &'a Message, out: &mut Vec<WireMessage<'a>>) {
    match message.role {
        Role::User => push_user(convert::content(message), out),
        Role::Ephemeral => {
            for part in message.ephemeral_parts() {
                push_ephemeral(part, out);
            }
        }
        Role::Assistant => push_assistant(message, out),
        Role::System => {
            if let Some(text) = convert::system_text(message) {
                out.push(WireMessage::System {
                    content: Cow::Owned(text),
                });
            }
        }
        Role::Command | Role::Instance | Role::Summary => {}
    }
}

/// One silent user message of an ephemeral's [`Message::ephemeral_view`],
/// borrowed from the history (only the camera preamble is owned).
fn push_ephemeral<'a>(part: EphemeralPart<'a>, out: &mut Vec<WireMessage<'a>>) {
    match part {
        EphemeralPart::Text(text) => push_user(Content::Text(text), out),
        EphemeralPart::Items(items) => push_user(Content::Items(items), out),
        EphemeralPart::CameraFrame { frames, image } => {
            let mut parts = vec![Part::Text {
                text: Cow::Owned(camera_frame_text(frames)),
            }];
            parts.extend(image_part(image));
            out.push(WireMessage::User {
                content: UserContent::Parts(parts),
            });
        }
        _ => {}
    }
}

/// An image item as an inline `data:` URL part.
fn image_part(item: &Item) -> Option<Part<'_>> {
    match item {
        Item::Image {
            mime_type,
            data,
            detail,
        } => Some(Part::ImageUrl {
            image_url: ImageUrl {
                url: format!("data:{mime_type};base64,{data}"),
                detail: detail.as_deref(),
            },
        }),
        _ => None,
    }
}

/// Tool results become `tool` messages, ahead of the rest of the user's content.
fn push_user<'a>(content: Content<'a>, out: &mut Vec<WireMessage<'a>>) {
    let items = match content {
        Content::Text("") => return,
        Content::Text(text) => {
            out.push(WireMessage::User {
                content: UserContent::Text(Cow::Borrowed(text)),
            });
            return;
        }
        Content::Items(items) => items,
    };
    let mut parts = Vec::new();
    for item in items {
        match item {
            // A tool message is text only: an image the tool returned is
            // its note.
            Item::ToolResult {
                tool_use_id,
                content,
                images,
                ..
            } => out.push(WireMessage::Tool {
                tool_call_id: tool_use_id.as_str(),
                content: convert::tool_result_text("openai", content, images),
            }),
            Item::Image { .. } => parts.extend(image_part(item)),
            other => {
                if let Some(text) = convert::item_text(other) {
                    parts.push(Part::Text { text });
                }
            }
        }
    }
    let content = match parts.len() {
        0 => return,
        1 => match parts.pop() {
            Some(Part::Text { text }) => UserContent::Text(text),
            Some(part) => UserContent::Parts(vec![part]),
            None => return,
        },
        _ => UserContent::Parts(parts),
    };
    out.push(WireMessage::User { content });
}

/// Text items (and files and outputs, as text) joined by newlines; tool
/// calls with their input as a JSON string. Thinking is not sent back.
fn push_assistant<'a>(message: &'a Message, out: &mut Vec<WireMessage<'a>>) {
    let items = match convert::content(message) {
        Content::Text("") => return,
        Content::Text(text) => {
            out.push(WireMessage::Assistant {
                content: Some(text.to_owned()),
                tool_calls: Vec::new(),
            });
            return;
        }
        Content::Items(items) => items,
    };
    let mut texts = Vec::new();
    let mut tool_calls = Vec::new();
    for item in items {
        match item {
            Item::ToolUse { id, name, input } => tool_calls.push(ToolCall {
                id: id.as_str(),
                kind: "function",
                function: FunctionCall {
                    name,
                    arguments: input.to_string(),
                },
            }),
            other => texts.extend(convert::item_text(other)),
        }
    }
    if texts.is_empty() && tool_calls.is_empty() {
        return;
    }
    out.push(WireMessage::Assistant {
        content: (!texts.is_empty()).then(|| texts.join("\n")),
        tool_calls,
    });
}

/// The text an item shows as, if any: text (unless empty), a file
/// reference, or an output's pretty JSON.
#[derive(Deserialize)]
struct Response {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    model: Option<String>,
}

#[derive(Deserialize)]
struct Choice {
    message: ResponseMessage,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct ResponseMessage {
    #[serde(default)]
    content: Option<String>,
    /// Reasoning text, as vLLM, DeepSeek and llama.cpp's server send it.
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<ResponseToolCall>>,
}

#[derive(Deserialize)]
struct ResponseToolCall {
    #[serde(default)]
    id: Option<String>,
    function: ResponseFunction,
}

#[derive(Deserialize)]
struct ResponseFunction {
    name: String,
    #[serde(default)]
    arguments: Value,
}

/// Token counts. `prompt_tokens` includes cached tokens; markov counts them
/// apart. `completion_tokens` includes the reasoning tokens.
#[derive(Deserialize, Clone, Copy)]
pub(super) struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
    #[serde(default)]
    completion_tokens_details: Option<CompletionDetails>,
}

#[derive(Deserialize, Clone, Copy)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// Of the completion tokens, the reasoning ones (which they include).
#[derive(Deserialize, Clone, Copy)]
struct CompletionDetails {
    #[serde(default)]
    reasoning_tokens: Option<u64>,
}

impl WireUsage {
    pub(super) fn usage(self) -> Usage {
        let cached = self
            .prompt_tokens_details
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0);
        Usage {
            input_tokens: self.prompt_tokens.saturating_sub(cached),
            output_tokens: self.completion_tokens,
            cache_read_input_tokens: cached,
            reasoning_tokens: self
                .completion_tokens_details
                .and_then(|d| d.reasoning_tokens)
                .unwrap_or(0),
            ..Usage::default()
        }
    }
}

/// Arguments as servers send them: a JSON string (parsed; malformed text is
/// wrapped as the crate documents), or, from a few servers, an object.
fn arguments(value: Value) -> Value {
    match value {
        Value::String(text) => convert::parse_tool_arguments(&text),
        Value::Null => convert::parse_tool_arguments(""),
        other => other,
    }
}

/// A call id for servers that send none. Random, so that ids stay unique
/// across responses (a positional `call_0` would repeat in every response and
/// make idempotency keys collide).
pub(super) fn fallback_call_id(index: usize) -> String {
    convert::fallback_call_id(index)
}

/// Maps `finish_reason`. A server that says `stop` (or nothing) while
/// calling tools, as some OpenAI-compatible servers do, gets `tool_use`.
pub(super) fn stop_reason(reason: Option<&str>, has_tool_calls: bool, refused: bool) -> StopReason {
    if refused {
        return StopReason::Refusal;
    }
    match reason {
        Some("tool_calls" | "function_call") => StopReason::ToolUse,
        Some("length") => StopReason::MaxTokens,
        Some("content_filter") => StopReason::ContentFilter,
        Some("stop") | None => convert::implied_stop_reason(has_tool_calls),
        Some(other) => {
            tracing::warn!(finish_reason = other, "unknown finish reason");
            convert::implied_stop_reason(has_tool_calls)
        }
    }
}

/// A complete answer from its body: reasoning, then text (or the refusal),
/// then tool calls.
pub(super) fn decode(body: &[u8]) -> Result<ModelResponse, ModelError> {
    let response: Response = serde_json::from_slice(body)
        .map_err(|e| ModelError::InvalidResponse(format!("cannot parse the answer: {e}")))?;
    let choice = response
        .choices
        .into_iter()
        .next()
        .ok_or_else(|| ModelError::InvalidResponse("the answer has no choices".into()))?;
    let message = choice.message;
    let mut content = Vec::new();
    if let Some(thinking) = message.reasoning_content.filter(|t| !t.is_empty()) {
        content.push(Item::Thinking {
            thinking,
            signature: None,
        });
    }
    if let Some(text) = message.content.filter(|t| !t.is_empty()) {
        content.push(Item::Text { text });
    }
    let refused = match message.refusal.filter(|t| !t.is_empty()) {
        Some(text) => {
            content.push(Item::Text { text });
            true
        }
        None => false,
    };
    let calls = message.tool_calls.unwrap_or_default();
    let has_tool_calls = !calls.is_empty();
    for (index, call) in calls.into_iter().enumerate() {
        let id = call
            .id
            .filter(|id| !id.is_empty())
            .unwrap_or_else(|| fallback_call_id(index));
        content.push(Item::tool_use(
            id,
            call.function.name,
            arguments(call.function.arguments),
        ));
    }
    let mut answer = ModelResponse::new(
        content,
        stop_reason(choice.finish_reason.as_deref(), has_tool_calls, refused),
    )
    .with_usage(response.usage.map(WireUsage::usage).unwrap_or_default());
    answer.model = convert::model_name(response.model);
    Ok(answer)
}

/// The tool list in the Chat Completions format (not strict).
pub(super) fn tool_schemas(tools: &[markov_core::ToolDefinition]) -> Value {
    let tools: Vec<Tool<'_>> = tools
        .iter()
        .map(|tool| Tool {
            kind: "function",
            function: Function {
                name: tool.name.as_str(),
                description: &tool.description,
                parameters: &tool.input_schema,
                strict: None,
            },
        })
        .collect();
    serde_json::to_value(tools).unwrap_or(Value::Null)
}

#[cfg(test)]
mod fallback_id_tests {
    use super::fallback_call_id;

    #[test]
    fn fallback_ids_differ_across_responses() {
        assert_ne!(fallback_call_id(0), fallback_call_id(0));
        assert!(fallback_call_id(3).ends_with("_3"));
    }
}

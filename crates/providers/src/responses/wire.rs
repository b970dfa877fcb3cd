//! The Responses API JSON, private to this module, and the hand-written
//! conversions from and to markov's types. Request types borrow from the
//! [`ModelRequest`]; response types are owned.
//!
//! A reasoning item is kept in the history as a thinking item whose
//! signature is `<item id>|<encrypted content>` ([`reasoning_signature`]),
//! so that the next request (with `store: false`, nothing is kept on the
//! server) hands the reasoning back right before the calls it led to, as
//! reasoning models require.

use std::borrow::Cow;

use markov_core::message::{EphemeralPart, camera_frame_text};
use markov_core::{
    Item, Message, ModelError, ModelRequest, ModelResponse, Role, StopReason, Thinking, ToolChoice,
    Usage,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::body::{self, BodyCache, FrameBytes, Rendered};
use crate::convert::{self, Content};
use crate::openai::SchemaStrictness;
use crate::output::{self, Plan};

/// What marks a thinking item's signature as a Responses reasoning item's.
const SIGNATURE_SEPARATOR: char = '|';

/// A reasoning item's id and encrypted content as a thinking signature.
pub(super) fn reasoning_signature(id: &str, encrypted: Option<&str>) -> String {
    format!("{id}{SIGNATURE_SEPARATOR}{}", encrypted.unwrap_or_default())
}

/// The id and encrypted content of a Responses reasoning item, from a
/// thinking signature made by [`reasoning_signature`]; `None` for another
/// provider's signature.
fn parse_signature(signature: &str) -> Option<(&str, Option<&str>)> {
    let (id, encrypted) = signature.split_once(SIGNATURE_SEPARATOR)?;
    id.starts_with("rs")
        .then_some((id, (!encrypted.is_empty()).then_some(encrypted)))
}

/// The whole request as one value: what [`encode_plain`] writes with
/// `serde_json::to_vec`.
#[derive(Serialize)]
struct Request<'a, T> {
    #[serde(flatten)]
    head: Head<'a>,
    input: Vec<InputItem<'a>>,
    #[serde(flatten)]
    tail: T,
}

/// The fields before `input`.
#[derive(Serialize)]
struct Head<'a> {
    model: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    instructions: &'a str,
}

/// One input item.
#[derive(Serialize)]
#[serde(untagged)]
enum InputItem<'a> {
    /// A message, its type always named: OpenAI reads a message without
    /// one, but llama.cpp's server refuses an assistant message that does
    /// not say `"type": "message"` ("Cannot determine type of 'item'").
    Message {
        #[serde(rename = "type")]
        kind: &'static str,
        role: &'static str,
        content: MessageContent<'a>,
    },
    Call {
        #[serde(rename = "type")]
        kind: &'static str,
        call_id: &'a str,
        name: &'a str,
        arguments: String,
    },
    Output {
        #[serde(rename = "type")]
        kind: &'static str,
        call_id: &'a str,
        output: OutputContent<'a>,
    },
    Reasoning {
        #[serde(rename = "type")]
        kind: &'static str,
        id: &'a str,
        summary: Vec<SummaryText<'a>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        encrypted_content: Option<&'a str>,
    },
    /// An item of a native compaction, written exactly as the server
    /// wrote it.
    Native(&'a RawValue),
}

#[derive(Serialize)]
struct SummaryText<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

#[derive(Serialize)]
#[serde(untagged)]
enum MessageContent<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Part<'a> {
    InputText {
        text: Cow<'a, str>,
    },
    InputImage {
        image_url: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        detail: Option<&'a str>,
    },
}

/// A function call's output: its text, or, when the tool returned
/// images, a list of a text part (if there is text) and image parts.
#[derive(Serialize)]
#[serde(untagged)]
enum OutputContent<'a> {
    Text(&'a str),
    Parts(Vec<Part<'a>>),
}

#[derive(Serialize)]
struct Tool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    name: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    description: &'a str,
    parameters: &'a Value,
    /// Always sent: the Responses API makes function tools strict unless
    /// told otherwise, and a strict schema must list every property as
    /// required.
    strict: bool,
}

#[derive(Serialize)]
#[serde(untagged)]
enum WireToolChoice<'a> {
    Mode(&'static str),
    Named {
        #[serde(rename = "type")]
        kind: &'static str,
        name: &'a str,
    },
}

#[derive(Serialize)]
struct TextConfig<'a> {
    format: Format<'a>,
}

#[derive(Serialize)]
struct Format<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    name: &'static str,
    schema: &'a Value,
    strict: bool,
}

#[derive(Serialize)]
struct Reasoning {
    effort: &'static str,
    summary: &'static str,
}

/// The fields after `input`.
#[derive(Serialize)]
struct Tail<'a> {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Tool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<WireToolChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    /// Left out of a token count, as are `temperature`, `store`,
    /// `include`, `prompt_cache_key` and `stream`: the endpoint takes
    /// none of them.
    #[serde(skip_serializing_if = "Option::is_none")]
    max_output_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning: Option<Reasoning>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<TextConfig<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    store: Option<bool>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    include: Vec<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_cache_key: Option<String>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    stream: bool,
}

/// How the client shapes a request, beyond the request itself.
#[derive(Clone, Debug)]
pub(super) struct Shape {
    pub(super) strictness: SchemaStrictness,
    pub(super) schema_with_tools: bool,
    /// `store` (false by default: markov keeps the history).
    pub(super) store: bool,
    /// Whether encrypted reasoning is asked for (`include`), so that it
    /// can be handed back with `store: false`.
    pub(super) include_reasoning: bool,
    /// The prompt cache key.
    pub(super) cache_key: super::PromptCacheKey,
    /// The vendor tag of the native summaries this client makes and reads
    /// (see [`native_tag`]).
    pub(super) native: String,
}

/// The vendor tag of the compaction items of the server at `host`: OpenAI's
/// own are `openai.responses`; another server's carry its address, since
/// its items are encrypted by that server and mean nothing to another.
pub(super) fn native_tag(host: &str, vendor: bool) -> String {
    if vendor {
        NATIVE_TAG.to_owned()
    } else {
        format!("{NATIVE_TAG}@{host}")
    }
}

/// The vendor tag of OpenAI's compaction items.
pub(super) const NATIVE_TAG: &str = "openai.responses";

/// What a body is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Purpose {
    /// A model call, streamed or not.
    Call {
        /// Whether the answer is streamed.
        stream: bool,
    },
    /// A token count (`/responses/input_tokens`).
    Count,
    /// A compaction (`/responses/compact`): the model, the instructions
    /// and the input, nothing else.
    Compact,
}

const NO_INPUT: &str = "no input to send: the conversation and the instructions are empty";

/// The name given to a structured-output schema.
const OUTPUT_SCHEMA_NAME: &str = "output";

/// The request body of one call, with the history's items taken from
/// `cache` when the request names its history (see [`crate::body`]).
pub(super) fn encode(
    request: &ModelRequest<'_>,
    model: &str,
    shape: &Shape,
    purpose: Purpose,
    cache: Option<&BodyCache>,
) -> Result<Vec<u8>, ModelError> {
    body::build(
        request,
        cache,
        || {
            let head = Head {
                model,
                instructions: request.system(),
            };
            let frame = match purpose {
                Purpose::Compact => FrameBytes::new(&head, Vec::new(), 0, &Empty {})?,
                _ => FrameBytes::new(&head, Vec::new(), 0, &tail(request, shape, purpose)?)?,
            };
            Ok(frame.named("input"))
        },
        |run| render(run, &shape.native),
        NO_INPUT,
    )
}

/// The request body as `serde_json::to_vec` of the whole request writes it,
/// every item encoded afresh: the reference [`encode`] must equal.
pub(super) fn encode_plain(
    request: &ModelRequest<'_>,
    model: &str,
    shape: &Shape,
    purpose: Purpose,
) -> Result<Vec<u8>, ModelError> {
    let mut input = Vec::new();
    for message in request.messages() {
        push_message(message, &shape.native, &mut input);
    }
    if input.is_empty() {
        return Err(ModelError::InvalidRequest(NO_INPUT.into()));
    }
    let head = Head {
        model,
        instructions: request.system(),
    };
    let written = if purpose == Purpose::Compact {
        serde_json::to_vec(&Request {
            head,
            input,
            tail: Empty {},
        })
    } else {
        serde_json::to_vec(&Request {
            head,
            input,
            tail: tail(request, shape, purpose)?,
        })
    };
    written.map_err(|e| ModelError::InvalidRequest(format!("cannot encode the request: {e}")))
}

/// No fields: what follows `input` in a compaction's body.
#[derive(Serialize)]
struct Empty {}

/// A run of history messages as input items, all final: items never merge.
fn render(run: &[Message], native: &str) -> Result<Rendered, ModelError> {
    let mut wire = Vec::new();
    for message in run {
        push_message(message, native, &mut wire);
    }
    let closed = body::write_each(&wire, |m, out| body::write_json(out, m))?;
    Ok(Rendered {
        closed,
        closed_count: wire.len(),
        consumed: run.len(),
        open: None,
    })
}

/// Everything of a request after its input, checked.
fn tail<'a>(
    request: &ModelRequest<'a>,
    shape: &Shape,
    purpose: Purpose,
) -> Result<Tail<'a>, ModelError> {
    let call = matches!(purpose, Purpose::Call { .. });
    if let Some(tool) = request.provider_tools().first() {
        return Err(ModelError::InvalidRequest(format!(
            "the responses client cannot offer provider built-in tool {:?} (type {:?})",
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
            name: tool.name.as_str(),
            description: &tool.description,
            parameters: &tool.input_schema,
            strict,
        })
        .chain(plan.tool().map(|(name, schema)| Tool {
            kind: "function",
            name,
            description: output::DESCRIPTION,
            parameters: schema,
            strict,
        }))
        .collect();
    let has_tools = !tools.is_empty();
    let tool_choice = has_tools.then(|| match plan.tool_choice(request) {
        ToolChoice::Auto => WireToolChoice::Mode("auto"),
        ToolChoice::Any => WireToolChoice::Mode("required"),
        ToolChoice::None => WireToolChoice::Mode("none"),
        ToolChoice::Tool(name) => WireToolChoice::Named {
            kind: "function",
            name: name.as_str(),
        },
    });
    let reasoning = settings.thinking.map(|thinking| Reasoning {
        effort: match thinking {
            Thinking::Enabled { budget_tokens } if budget_tokens <= 2048 => "low",
            Thinking::Enabled { budget_tokens } if budget_tokens > 16_384 => "high",
            _ => "medium",
        },
        summary: "auto",
    });
    let include_reasoning =
        call && !shape.store && (shape.include_reasoning || reasoning.is_some());
    Ok(Tail {
        tools,
        tool_choice,
        parallel_tool_calls: (has_tools && !settings.parallel_tool_calls).then_some(false),
        max_output_tokens: call.then_some(settings.max_tokens),
        temperature: settings.temperature.filter(|_| call),
        reasoning,
        text: plan.schema_field().map(|schema| TextConfig {
            format: Format {
                kind: "json_schema",
                name: OUTPUT_SCHEMA_NAME,
                schema,
                strict,
            },
        }),
        store: call.then_some(shape.store),
        include: if include_reasoning {
            vec!["reasoning.encrypted_content"]
        } else {
            Vec::new()
        },
        prompt_cache_key: shape.cache_key.for_request(request).filter(|_| call),
        stream: purpose == Purpose::Call { stream: true },
    })
}

/// Appends one stored message as input items; `native` is the vendor tag
/// of the native summaries this client sends.
fn push_message<'a>(message: &'a Message, native: &str, out: &mut Vec<InputItem<'a>>) {
    match message.role {
        Role::User => push_user(convert::content(message), out),
        Role::Ephemeral => {
            for part in message.ephemeral_parts() {
                match part {
                    EphemeralPart::Text(text) => push_user(Content::Text(text), out),
                    EphemeralPart::Items(items) => push_user(Content::Items(items), out),
                    EphemeralPart::CameraFrame { frames, image } => {
                        let mut parts = vec![Part::InputText {
                            text: Cow::Owned(camera_frame_text(frames)),
                        }];
                        parts.extend(image_part(image));
                        out.push(InputItem::Message {
                            kind: "message",
                            role: "user",
                            content: MessageContent::Parts(parts),
                        });
                    }
                    _ => {}
                }
            }
        }
        Role::Assistant => push_assistant(message, out),
        Role::System => {
            if let Some(text) = convert::system_text(message) {
                out.push(InputItem::Message {
                    kind: "message",
                    role: "system",
                    content: MessageContent::Text(Cow::Owned(text)),
                });
            }
        }
        // A summary message of the history is never sent (the messages it
        // stands for are); a context view's native summary is sent as its
        // items, verbatim, when they are this client's vendor's.
        Role::Summary => push_native(message, native, out),
        Role::Command | Role::Instance => {}
    }
}

/// The items of a context view's native summary ([`Item::Native`]) of
/// vendor `native`, each as the server wrote it. Items of another vendor
/// are never sent, and an item that is not one JSON object (a stored
/// session changed by hand) is left out with a warning rather than sent
/// broken: the server would refuse the whole request.
fn push_native<'a>(message: &'a Message, native: &str, out: &mut Vec<InputItem<'a>>) {
    for item in message.item_list() {
        let Item::Native { vendor, items } = item else {
            continue;
        };
        if vendor != native {
            continue;
        }
        for text in items {
            match serde_json::from_str::<&RawValue>(text) {
                Ok(raw) if raw.get().starts_with('{') => out.push(InputItem::Native(raw)),
                _ => tracing::warn!(
                    bytes = text.len(),
                    "a native compaction item that is not a JSON object is left out"
                ),
            }
        }
    }
}

fn image_part(item: &Item) -> Option<Part<'_>> {
    match item {
        Item::Image {
            mime_type,
            data,
            detail,
        } => Some(Part::InputImage {
            image_url: format!("data:{mime_type};base64,{data}"),
            detail: detail.as_deref(),
        }),
        _ => None,
    }
}

/// Tool results become `function_call_output` items, ahead of the rest of
/// the user's content.
fn push_user<'a>(content: Content<'a>, out: &mut Vec<InputItem<'a>>) {
    let items = match content {
        Content::Text("") => return,
        Content::Text(text) => {
            out.push(InputItem::Message {
                kind: "message",
                role: "user",
                content: MessageContent::Text(Cow::Borrowed(text)),
            });
            return;
        }
        Content::Items(items) => items,
    };
    let mut parts = Vec::new();
    for item in items {
        match item {
            Item::ToolResult {
                tool_use_id,
                content,
                images,
                ..
            } => out.push(InputItem::Output {
                kind: "function_call_output",
                call_id: tool_use_id.as_str(),
                output: if images.is_empty() {
                    OutputContent::Text(content)
                } else {
                    let text = (!content.is_empty()).then_some(Part::InputText {
                        text: Cow::Borrowed(content.as_str()),
                    });
                    OutputContent::Parts(
                        text.into_iter()
                            .chain(images.iter().map(|image| Part::InputImage {
                                image_url: image.data_url(),
                                detail: None,
                            }))
                            .collect(),
                    )
                },
            }),
            Item::Image { .. } => parts.extend(image_part(item)),
            other => {
                if let Some(text) = convert::item_text(other) {
                    parts.push(Part::InputText { text });
                }
            }
        }
    }
    let content = match parts.len() {
        0 => return,
        1 => match parts.pop() {
            Some(Part::InputText { text }) => MessageContent::Text(text),
            Some(part) => MessageContent::Parts(vec![part]),
            None => return,
        },
        _ => MessageContent::Parts(parts),
    };
    out.push(InputItem::Message {
        kind: "message",
        role: "user",
        content,
    });
}

/// An assistant message as items in its own order: its reasoning items
/// (thinking with a Responses signature), its text as an assistant
/// message, its calls as `function_call` items.
fn push_assistant<'a>(message: &'a Message, out: &mut Vec<InputItem<'a>>) {
    let items = match convert::content(message) {
        Content::Text("") => return,
        Content::Text(text) => {
            out.push(InputItem::Message {
                kind: "message",
                role: "assistant",
                content: MessageContent::Text(Cow::Borrowed(text)),
            });
            return;
        }
        Content::Items(items) => items,
    };
    let mut texts: Vec<Cow<'a, str>> = Vec::new();
    let flush = |texts: &mut Vec<Cow<'a, str>>, out: &mut Vec<InputItem<'a>>| {
        if !texts.is_empty() {
            out.push(InputItem::Message {
                kind: "message",
                role: "assistant",
                content: MessageContent::Text(Cow::Owned(texts.join("\n"))),
            });
            texts.clear();
        }
    };
    for item in items {
        match item {
            Item::Thinking {
                thinking,
                signature: Some(signature),
            } => {
                if let Some((id, encrypted)) = parse_signature(signature) {
                    flush(&mut texts, out);
                    out.push(InputItem::Reasoning {
                        kind: "reasoning",
                        id,
                        summary: if thinking.is_empty() {
                            Vec::new()
                        } else {
                            vec![SummaryText {
                                kind: "summary_text",
                                text: thinking,
                            }]
                        },
                        encrypted_content: encrypted,
                    });
                }
            }
            Item::ToolUse { id, name, input } => {
                flush(&mut texts, out);
                out.push(InputItem::Call {
                    kind: "function_call",
                    call_id: id.as_str(),
                    name,
                    arguments: input.to_string(),
                });
            }
            other => texts.extend(convert::item_text(other)),
        }
    }
    flush(&mut texts, out);
}

/// A response object, as a complete call returns it and as
/// `response.completed` carries it.
#[derive(Deserialize, Default)]
pub(super) struct WireResponse {
    #[serde(default)]
    pub(super) status: Option<String>,
    #[serde(default)]
    pub(super) output: Vec<OutputItem>,
    #[serde(default)]
    pub(super) usage: Option<WireUsage>,
    #[serde(default)]
    pub(super) incomplete_details: Option<IncompleteDetails>,
    #[serde(default)]
    pub(super) error: Option<Value>,
    #[serde(default)]
    pub(super) model: Option<String>,
}

#[derive(Deserialize, Default)]
pub(super) struct IncompleteDetails {
    #[serde(default)]
    pub(super) reason: Option<String>,
}

/// One output item. Fields of the types not read are skipped.
#[derive(Deserialize, Clone, Default)]
pub(super) struct OutputItem {
    #[serde(rename = "type", default)]
    pub(super) kind: String,
    #[serde(default)]
    pub(super) id: Option<String>,
    #[serde(default)]
    pub(super) content: Option<Vec<ContentPart>>,
    #[serde(default)]
    pub(super) call_id: Option<String>,
    #[serde(default)]
    pub(super) name: Option<String>,
    #[serde(default)]
    pub(super) arguments: Option<String>,
    #[serde(default)]
    pub(super) summary: Option<Vec<Summary>>,
    #[serde(default)]
    pub(super) encrypted_content: Option<String>,
}

#[derive(Deserialize, Clone)]
pub(super) struct ContentPart {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
}

#[derive(Deserialize, Clone)]
pub(super) struct Summary {
    #[serde(default)]
    text: String,
}

/// Token counts; `input_tokens` includes cached tokens, which markov
/// counts apart.
#[derive(Deserialize, Clone, Copy)]
pub(super) struct WireUsage {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
    #[serde(default)]
    input_tokens_details: Option<Details>,
    #[serde(default)]
    output_tokens_details: Option<OutputDetails>,
}

/// Of the output tokens, the reasoning ones (which they include).
#[derive(Deserialize, Clone, Copy)]
struct OutputDetails {
    #[serde(default)]
    reasoning_tokens: Option<u64>,
}

#[derive(Deserialize, Clone, Copy)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

impl WireUsage {
    pub(super) fn usage(self) -> Usage {
        let cached = self
            .input_tokens_details
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0);
        Usage {
            input_tokens: self.input_tokens.saturating_sub(cached),
            output_tokens: self.output_tokens,
            cache_read_input_tokens: cached,
            reasoning_tokens: self
                .output_tokens_details
                .and_then(|d| d.reasoning_tokens)
                .unwrap_or(0),
            ..Usage::default()
        }
    }
}

/// What one output item contributes to the answer: at most one item, and
/// whether it is a refusal.
pub(super) fn item_of(output: OutputItem, position: usize) -> (Option<Item>, bool) {
    match output.kind.as_str() {
        "message" => {
            let mut text = String::new();
            let mut refused = false;
            for part in output.content.unwrap_or_default() {
                match part.kind.as_str() {
                    "refusal" => {
                        refused = true;
                        text.push_str(&part.refusal.unwrap_or_default());
                    }
                    _ => text.push_str(&part.text.unwrap_or_default()),
                }
            }
            ((!text.is_empty()).then_some(Item::Text { text }), refused)
        }
        "function_call" => {
            let id = output
                .call_id
                .filter(|id| !id.is_empty())
                .unwrap_or_else(|| convert::fallback_call_id(position));
            let arguments = convert::parse_tool_arguments(&output.arguments.unwrap_or_default());
            (
                Some(Item::tool_use(
                    id,
                    output.name.unwrap_or_default(),
                    arguments,
                )),
                false,
            )
        }
        "reasoning" => {
            let thinking: Vec<String> = output
                .summary
                .unwrap_or_default()
                .into_iter()
                .map(|s| s.text)
                .collect();
            let thinking = thinking.join("\n\n");
            // A reasoning item without an id cannot be handed back: only
            // its summary is kept.
            let signature = output
                .id
                .as_deref()
                .map(|id| reasoning_signature(id, output.encrypted_content.as_deref()));
            let item = (signature.is_some() || !thinking.is_empty()).then_some(Item::Thinking {
                thinking,
                signature,
            });
            (item, false)
        }
        other => {
            tracing::debug!(kind = other, "output item of an unknown type skipped");
            (None, false)
        }
    }
}

/// The stop reason of a finished response.
pub(super) fn stop_reason(
    status: Option<&str>,
    incomplete: Option<&str>,
    has_tool_calls: bool,
    refused: bool,
) -> StopReason {
    if refused {
        return StopReason::Refusal;
    }
    match (status, incomplete) {
        (Some("incomplete"), Some("max_output_tokens")) => StopReason::MaxTokens,
        (Some("incomplete"), Some("content_filter")) => StopReason::ContentFilter,
        _ => convert::implied_stop_reason(has_tool_calls),
    }
}

/// The answer of a response object.
pub(super) fn response_of(mut response: WireResponse) -> Result<ModelResponse, ModelError> {
    if let Some(error) = response.error.as_ref().filter(|e| !e.is_null()) {
        return Err(error_of(error));
    }
    if response.status.as_deref() == Some("failed") {
        return Err(ModelError::InvalidResponse("the response failed".into()));
    }
    let mut content = Vec::new();
    let mut refused = false;
    for (position, output) in std::mem::take(&mut response.output).into_iter().enumerate() {
        let (item, refusal) = item_of(output, position);
        refused |= refusal;
        content.extend(item);
    }
    Ok(answer(content, refused, response))
}

/// The answer of `content` (read from `response`'s output or from a
/// stream's items): its stop reason, usage and model from `response`.
pub(super) fn answer(content: Vec<Item>, refused: bool, response: WireResponse) -> ModelResponse {
    let has_tool_calls = content.iter().any(|i| matches!(i, Item::ToolUse { .. }));
    let reason = stop_reason(
        response.status.as_deref(),
        response
            .incomplete_details
            .as_ref()
            .and_then(|d| d.reason.as_deref()),
        has_tool_calls,
        refused,
    );
    let mut answer = ModelResponse::new(content, reason)
        .with_usage(response.usage.map(WireUsage::usage).unwrap_or_default());
    answer.model = convert::model_name(response.model);
    answer
}

/// An error object (`{"code", "message"}`) of a failed response or an
/// `error` event: overload, rate limits and server errors are retryable.
pub(super) fn error_of(error: &Value) -> ModelError {
    let code = error
        .get("code")
        .or_else(|| error.get("type"))
        .and_then(Value::as_str)
        .unwrap_or_default();
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| error.to_string());
    match code {
        "server_is_overloaded" | "overloaded_error" | "slow_down" => {
            ModelError::Overloaded(message)
        }
        "context_length_exceeded" => ModelError::ContextLength(message),
        "rate_limit_exceeded" => ModelError::Http {
            status: 429,
            message,
            retry_after: None,
        },
        "server_error" | "" => ModelError::Http {
            status: 500,
            message,
            retry_after: None,
        },
        _ => ModelError::Http {
            status: 400,
            message: format!("{code}: {message}"),
            retry_after: None,
        },
    }
}

/// A complete answer from its body.
/// A count's answer: `{"object": "response.input_tokens", "input_tokens": N}`.
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

/// A compaction's answer: `{"object": "response.compaction", "output":
/// [...], "usage": {...}}`; the output items are kept as the server wrote
/// them.
#[derive(Deserialize)]
struct CompactAnswer<'a> {
    #[serde(borrow)]
    output: Vec<&'a RawValue>,
    #[serde(default)]
    usage: Option<WireUsage>,
}

/// The items (each its JSON text, unchanged) and usage of a compaction's
/// answer.
pub(super) fn decode_compaction(body: &str) -> Result<(Vec<String>, Usage), ModelError> {
    let answer: CompactAnswer<'_> = serde_json::from_str(body)
        .map_err(|e| ModelError::InvalidResponse(format!("cannot parse the compaction: {e}")))?;
    let items = answer
        .output
        .iter()
        .map(|raw| raw.get().to_owned())
        .collect();
    Ok((
        items,
        answer.usage.map(WireUsage::usage).unwrap_or_default(),
    ))
}

pub(super) fn decode(body: &[u8]) -> Result<ModelResponse, ModelError> {
    let response: WireResponse = serde_json::from_slice(body)
        .map_err(|e| ModelError::InvalidResponse(format!("cannot parse the answer: {e}")))?;
    response_of(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_signatures_round_trip_and_others_are_not_read() {
        let signature = reasoning_signature("rs_1", Some("gAAA=="));
        assert_eq!(parse_signature(&signature), Some(("rs_1", Some("gAAA=="))));
        assert_eq!(
            parse_signature(&reasoning_signature("rs_2", None)),
            Some(("rs_2", None))
        );
        // An Anthropic signature is base64 without a separator.
        assert_eq!(parse_signature("EqQBCkgIARABGAIiQL"), None);
    }

    fn shape(native: &str) -> Shape {
        Shape {
            strictness: SchemaStrictness::default(),
            schema_with_tools: false,
            store: false,
            include_reasoning: false,
            cache_key: super::super::PromptCacheKey::Off,
            native: native.to_owned(),
        }
    }

    #[test]
    fn compaction_items_are_kept_and_sent_byte_for_byte_to_their_vendor_only() {
        // Keys out of order, white space, a number written as the server
        // wrote it: none of it is changed.
        let answer = r#"{"id":"resp_1","object":"response.compaction","output":[ {"type":"message","role":"user","content":"hi"},{"encrypted_content":"gA==" , "type":"compaction","id":"cmp_1","n":1.50}],"usage":{"input_tokens":120,"input_tokens_details":{"cached_tokens":20},"output_tokens":30,"output_tokens_details":{"reasoning_tokens":8},"total_tokens":150}}"#;
        let (items, usage) = decode_compaction(answer).unwrap();
        assert_eq!(
            items,
            [
                r#"{"type":"message","role":"user","content":"hi"}"#,
                r#"{"encrypted_content":"gA==" , "type":"compaction","id":"cmp_1","n":1.50}"#
            ]
        );
        assert_eq!(
            (usage.input_tokens, usage.cache_read_input_tokens),
            (100, 20)
        );
        assert_eq!((usage.output_tokens, usage.reasoning_tokens), (30, 8));

        let native = markov_core::message::NativeItems::new(NATIVE_TAG, items.clone());
        let history = vec![
            Message::user("earlier"),
            // The history's own summary message is never sent: the
            // messages it stands for are.
            Message::native_summary(native.clone(), 0, 1),
        ];
        let shown = Message::from(markov_core::message::MessageData {
            role: Role::Summary,
            items: markov_core::Items::List(vec![Item::Native {
                vendor: NATIVE_TAG.into(),
                items: items.clone(),
            }]),
            metadata: None,
        });
        let view = vec![shown, Message::user("next")];
        let settings = markov_core::ModelSettings::default();
        let encode = |messages: &[Message], tag: &str| {
            let request = ModelRequest::new("", messages, &settings);
            let body = encode_plain(&request, "m", &shape(tag), Purpose::Compact).unwrap();
            String::from_utf8(body).unwrap()
        };
        assert_eq!(
            encode(&history, NATIVE_TAG),
            r#"{"model":"m","input":[{"type":"message","role":"user","content":"earlier"}]}"#
        );
        assert_eq!(
            encode(&view, NATIVE_TAG),
            format!(
                r#"{{"model":"m","input":[{},{},{{"type":"message","role":"user","content":"next"}}]}}"#,
                items[0], items[1]
            )
        );
        // Another server's client never sends them.
        assert_eq!(
            encode(&view, "openai.responses@127.0.0.1:8000"),
            r#"{"model":"m","input":[{"type":"message","role":"user","content":"next"}]}"#
        );
        // An item that is not a JSON object is left out, not sent broken.
        let broken = vec![Message::from(markov_core::message::MessageData {
            role: Role::Summary,
            items: markov_core::Items::List(vec![Item::Native {
                vendor: NATIVE_TAG.into(),
                items: vec!["{\"type\":".into(), "[1]".into(), items[1].clone()],
            }]),
            metadata: None,
        })];
        assert_eq!(
            encode(&broken, NATIVE_TAG),
            format!(r#"{{"model":"m","input":[{}]}}"#, items[1])
        );
        // The tags.
        assert_eq!(native_tag("api.openai.com", true), "openai.responses");
        assert_eq!(
            native_tag("127.0.0.1:8000", false),
            "openai.responses@127.0.0.1:8000"
        );
    }

    #[test]
    fn failed_responses_and_error_codes_are_typed() {
        assert!(matches!(
            error_of(&serde_json::json!({"code": "server_is_overloaded", "message": "busy"})),
            ModelError::Overloaded(_)
        ));
        assert!(
            error_of(&serde_json::json!({"code": "rate_limit_exceeded", "message": "x"}))
                .is_retryable()
        );
        assert!(
            !error_of(&serde_json::json!({"code": "invalid_prompt", "message": "x"}))
                .is_retryable()
        );
    }
}

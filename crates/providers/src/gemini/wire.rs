//! The Gemini API JSON, private to this module, and the hand-written
//! conversions from and to markov's types.
//!
//! Thought signatures ride in the history as thinking items: a part the
//! model signed is followed by a thinking item with no text whose
//! signature is `gemini|<signature>`, and is sent back with the signature
//! on that part; a signature the model sent on an empty part of its own is
//! `gemini|part|<signature>`; a thought summary is a thinking item with its
//! text (and its signature, if any).

use std::borrow::Cow;
use std::collections::HashMap;

use markov_core::message::{EphemeralPart, camera_frame_text};
use markov_core::{
    Item, Message, ModelError, ModelRequest, Role, Thinking, ToolChoice, ToolDefinition,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::schema::{self, SchemaError};
use crate::convert::{self, Content};
use crate::output::{self, Plan};

/// What starts the signature of a thinking item that carries a Gemini
/// thought signature for the part before it.
pub(super) const ATTACHED: &str = "gemini|";
/// What starts the signature of a thinking item that stands for an empty
/// part carrying only a thought signature.
pub(super) const STANDALONE: &str = "gemini|part|";

/// What starts the ids this client makes for calls that came without one;
/// they are not sent back (the model never saw them).
const MADE_ID: &str = "gcall_";

/// A call id for a call that came without one: random, so ids stay unique
/// across answers.
pub(super) fn made_call_id(index: usize) -> String {
    format!(
        "{MADE_ID}{:012x}_{index}",
        crate::transport::random_u64() & 0xffff_ffff_ffff
    )
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Request<'a> {
    contents: Vec<WireContent<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system_instruction: Option<WireContent<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Tools>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_config: Option<ToolConfig<'a>>,
    generation_config: GenerationConfig,
}

#[derive(Serialize)]
struct WireContent<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    parts: Vec<Part<'a>>,
}

#[derive(Serialize, Default)]
#[serde(rename_all = "camelCase")]
struct Part<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    thought: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    thought_signature: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    inline_data: Option<InlineData<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    function_call: Option<FunctionCall<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    function_response: Option<FunctionResponse<'a>>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct InlineData<'a> {
    mime_type: &'a str,
    data: &'a str,
}

#[derive(Serialize)]
struct FunctionCall<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    name: &'a str,
    args: &'a Value,
}

#[derive(Serialize)]
struct FunctionResponse<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    name: &'a str,
    response: Value,
    /// The images the tool returned, as the response's own media parts.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    parts: Vec<FunctionResponsePart<'a>>,
}

/// One media part of a function response.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct FunctionResponsePart<'a> {
    inline_data: InlineData<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Tools {
    function_declarations: Vec<Declaration>,
}

#[derive(Serialize)]
struct Declaration {
    name: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    description: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<Value>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ToolConfig<'a> {
    function_calling_config: FunctionCallingConfig<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct FunctionCallingConfig<'a> {
    mode: &'static str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    allowed_function_names: Vec<&'a str>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct GenerationConfig {
    max_output_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_mime_type: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_schema: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    thinking_config: Option<ThinkingConfig>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ThinkingConfig {
    thinking_budget: i64,
    include_thoughts: bool,
}

/// A declaration of `tool`, its parameters in the Gemini dialect (left
/// out for a tool without parameters, which the API wants so).
fn declaration(
    name: &str,
    description: &str,
    parameters: &Value,
) -> Result<Declaration, SchemaError> {
    let converted = schema::convert(parameters, &format!("tool {name:?}"))?;
    let empty = converted.get("type").and_then(Value::as_str) == Some("OBJECT")
        && converted
            .get("properties")
            .and_then(Value::as_object)
            .is_none_or(|p| p.is_empty());
    Ok(Declaration {
        name: name.to_owned(),
        description: description.to_owned(),
        parameters: (!empty).then_some(converted),
    })
}

/// Checks that Gemini can be offered `tools`: each one's parameters
/// convert to its schema dialect.
///
/// # Errors
/// The first [`SchemaError`], naming the tool and the place in its schema.
pub(super) fn check_tools(tools: &[ToolDefinition]) -> Result<(), SchemaError> {
    for tool in tools {
        declaration(tool.name.as_str(), &tool.description, &tool.input_schema)?;
    }
    Ok(())
}

/// Checks that Gemini can be asked for answers following `schema` (an
/// output type): sent as the response schema or as the output tool's
/// parameters, it is converted the same way.
///
/// # Errors
/// The [`SchemaError`] naming the output type and the place in its schema.
pub(super) fn check_output(schema: &Value) -> Result<(), SchemaError> {
    schema::convert(schema, OUTPUT_TYPE).map(drop)
}

/// How errors name the output type's schema.
const OUTPUT_TYPE: &str = "the output type";

const NO_CONTENTS: &str = "no content to send: the conversation has no user or assistant content";

/// The request body of one call.
pub(super) fn encode(
    request: &ModelRequest<'_>,
    schema_with_tools: bool,
) -> Result<Vec<u8>, ModelError> {
    let body = wire_request(request, schema_with_tools)?;
    serde_json::to_vec(&body)
        .map_err(|e| ModelError::InvalidRequest(format!("cannot encode the request: {e}")))
}

/// The body of a token count of `request` for `model` (`countTokens`):
/// the call's body as `generateContentRequest`, which names its model,
/// so the system instruction and the tools are counted too.
pub(super) fn encode_count(
    request: &ModelRequest<'_>,
    model: &str,
    schema_with_tools: bool,
) -> Result<Vec<u8>, ModelError> {
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Count<'a> {
        generate_content_request: Named<'a>,
    }
    #[derive(Serialize)]
    struct Named<'a> {
        model: String,
        #[serde(flatten)]
        request: Request<'a>,
    }
    let model = model.strip_prefix("models/").unwrap_or(model);
    let body = Count {
        generate_content_request: Named {
            model: format!("models/{model}"),
            request: wire_request(request, schema_with_tools)?,
        },
    };
    serde_json::to_vec(&body)
        .map_err(|e| ModelError::InvalidRequest(format!("cannot encode the request: {e}")))
}

/// A count's answer: `{"totalTokens": N, ..}`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct CountAnswer {
    total_tokens: u64,
}

/// The input tokens of a count's answer.
pub(super) fn decode_count(body: &str) -> Result<u64, ModelError> {
    serde_json::from_str::<CountAnswer>(body)
        .map(|answer| answer.total_tokens)
        .map_err(|e| ModelError::InvalidResponse(format!("cannot parse the token count: {e}")))
}

/// The request of one call, checked.
fn wire_request<'a>(
    request: &ModelRequest<'a>,
    schema_with_tools: bool,
) -> Result<Request<'a>, ModelError> {
    if let Some(tool) = request.provider_tools().first() {
        return Err(ModelError::InvalidRequest(format!(
            "the gemini client cannot offer provider built-in tool {:?} (type {:?})",
            tool.name.as_str(),
            tool.kind
        )));
    }
    let refused = |error: SchemaError| ModelError::InvalidRequest(error.to_string());
    let plan = Plan::of(request, schema_with_tools);
    let mut declarations = Vec::with_capacity(request.tools().len() + 1);
    for tool in request.tools() {
        declarations.push(
            declaration(tool.name.as_str(), &tool.description, &tool.input_schema)
                .map_err(refused)?,
        );
    }
    if let Some((name, schema)) = plan.tool() {
        declarations.push(declaration(name, output::DESCRIPTION, schema).map_err(refused)?);
    }
    let tool_config = (!declarations.is_empty()).then(|| {
        let (mode, allowed) = match plan.tool_choice(request) {
            ToolChoice::Auto => ("AUTO", Vec::new()),
            ToolChoice::Any => ("ANY", Vec::new()),
            ToolChoice::None => ("NONE", Vec::new()),
            ToolChoice::Tool(name) => ("ANY", vec![name.as_str()]),
        };
        ToolConfig {
            function_calling_config: FunctionCallingConfig {
                mode,
                allowed_function_names: allowed,
            },
        }
    });
    let settings = request.settings();
    let response_schema = match plan.schema_field() {
        Some(schema) => Some(schema::convert(schema, OUTPUT_TYPE).map_err(refused)?),
        None => None,
    };
    let thinking_config = settings.thinking.map(|thinking| ThinkingConfig {
        thinking_budget: match thinking {
            Thinking::Enabled { budget_tokens } => i64::from(budget_tokens),
            // The model decides its budget.
            _ => -1,
        },
        include_thoughts: true,
    });
    let contents = contents(request.messages());
    if contents.is_empty() {
        return Err(ModelError::InvalidRequest(NO_CONTENTS.into()));
    }
    let body = Request {
        contents,
        system_instruction: (!request.system().is_empty()).then(|| WireContent {
            role: None,
            parts: vec![Part {
                text: Some(Cow::Borrowed(request.system())),
                ..Part::default()
            }],
        }),
        tools: if declarations.is_empty() {
            Vec::new()
        } else {
            vec![Tools {
                function_declarations: declarations,
            }]
        },
        tool_config,
        generation_config: GenerationConfig {
            max_output_tokens: settings.max_tokens,
            temperature: settings.temperature,
            response_mime_type: response_schema.as_ref().map(|_| "application/json"),
            response_schema,
            thinking_config,
        },
    };
    Ok(body)
}

/// Appends `parts` as a content of `role`, to the last content when it has
/// that role.
fn push<'a>(role: &'static str, parts: Vec<Part<'a>>, out: &mut Vec<WireContent<'a>>) {
    if parts.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(last) if last.role == Some(role) => last.parts.extend(parts),
        _ => out.push(WireContent {
            role: Some(role),
            parts,
        }),
    }
}

/// The conversation as contents, consecutive ones of one role merged. A
/// function response names its function, found by the call's id in the
/// history (a whole-history lookup, which is why this client keeps no
/// cache of encoded messages).
fn contents(history: &[Message]) -> Vec<WireContent<'_>> {
    let names: HashMap<&str, &str> = history
        .iter()
        .filter(|m| m.role == Role::Assistant)
        .flat_map(|m| m.item_list())
        .filter_map(|item| match item {
            Item::ToolUse { id, name, .. } => Some((id.as_str(), name.as_str())),
            _ => None,
        })
        .collect();
    let mut out: Vec<WireContent<'_>> = Vec::new();
    for message in history {
        match message.role {
            Role::User => push(
                "user",
                user_parts(convert::content(message), &names),
                &mut out,
            ),
            Role::Ephemeral => {
                for part in message.ephemeral_parts() {
                    let parts = match part {
                        EphemeralPart::Text(text) => user_parts(Content::Text(text), &names),
                        EphemeralPart::Items(items) => user_parts(Content::Items(items), &names),
                        EphemeralPart::CameraFrame { frames, image } => {
                            let mut parts = vec![text_part(Cow::Owned(camera_frame_text(frames)))];
                            parts.extend(image_part(image));
                            parts
                        }
                        _ => Vec::new(),
                    };
                    push("user", parts, &mut out);
                }
            }
            Role::Assistant => push("model", model_parts(message), &mut out),
            Role::System => {
                if let Some(text) = convert::system_text(message) {
                    let text = format!("{}{text}", convert::SYSTEM_PREFIX);
                    push("user", vec![text_part(Cow::Owned(text))], &mut out);
                }
            }
            Role::Command | Role::Instance | Role::Summary => {}
        }
    }
    out
}

fn text_part(text: Cow<'_, str>) -> Part<'_> {
    Part {
        text: Some(text),
        ..Part::default()
    }
}

fn image_part(item: &Item) -> Option<Part<'_>> {
    match item {
        Item::Image {
            mime_type, data, ..
        } => Some(Part {
            inline_data: Some(InlineData { mime_type, data }),
            ..Part::default()
        }),
        _ => None,
    }
}

/// A user message's parts: function responses first, then the rest.
fn user_parts<'a>(content: Content<'a>, names: &HashMap<&str, &'a str>) -> Vec<Part<'a>> {
    let items = match content {
        Content::Text("") => return Vec::new(),
        Content::Text(text) => return vec![text_part(Cow::Borrowed(text))],
        Content::Items(items) => items,
    };
    let mut responses = Vec::new();
    let mut rest = Vec::new();
    for item in items {
        match item {
            Item::ToolResult {
                tool_use_id,
                content,
                is_error,
                images,
            } => {
                let id = tool_use_id.as_str();
                let response = if *is_error == Some(true) {
                    json!({"error": content})
                } else {
                    json!({"content": content})
                };
                responses.push(Part {
                    function_response: Some(FunctionResponse {
                        id: (!id.starts_with(MADE_ID)).then_some(id),
                        name: names.get(id).copied().unwrap_or("unknown_function"),
                        response,
                        parts: images
                            .iter()
                            .map(|image| FunctionResponsePart {
                                inline_data: InlineData {
                                    mime_type: &image.mime_type,
                                    data: &image.data,
                                },
                            })
                            .collect(),
                    }),
                    ..Part::default()
                });
            }
            Item::Image { .. } => rest.extend(image_part(item)),
            other => rest.extend(convert::item_text(other).map(text_part)),
        }
    }
    responses.extend(rest);
    responses
}

/// An assistant message's parts in order, thought signatures back on the
/// parts they came with.
fn model_parts(message: &Message) -> Vec<Part<'_>> {
    let items = match convert::content(message) {
        Content::Text("") => return Vec::new(),
        Content::Text(text) => return vec![text_part(Cow::Borrowed(text))],
        Content::Items(items) => items,
    };
    let mut parts: Vec<Part<'_>> = Vec::new();
    for item in items {
        match item {
            Item::Thinking {
                thinking,
                signature,
            } => {
                let signature = signature.as_deref();
                if let Some(standalone) = signature.and_then(|s| s.strip_prefix(STANDALONE)) {
                    parts.push(Part {
                        text: Some(Cow::Borrowed("")),
                        thought_signature: Some(standalone),
                        ..Part::default()
                    });
                    continue;
                }
                let Some(signed) = signature.and_then(|s| s.strip_prefix(ATTACHED)) else {
                    // Another provider's thinking means nothing here.
                    continue;
                };
                if !thinking.is_empty() {
                    parts.push(Part {
                        text: Some(Cow::Borrowed(thinking)),
                        thought: Some(true),
                        thought_signature: Some(signed),
                        ..Part::default()
                    });
                } else {
                    match parts.last_mut() {
                        Some(last) if last.thought_signature.is_none() => {
                            last.thought_signature = Some(signed);
                        }
                        _ => parts.push(Part {
                            text: Some(Cow::Borrowed("")),
                            thought_signature: Some(signed),
                            ..Part::default()
                        }),
                    }
                }
            }
            Item::ToolUse { id, name, input } => parts.push(Part {
                function_call: Some(FunctionCall {
                    id: (!id.as_str().starts_with(MADE_ID)).then_some(id.as_str()),
                    name,
                    args: input,
                }),
                ..Part::default()
            }),
            other => parts.extend(convert::item_text(other).map(text_part)),
        }
    }
    parts
}

/// One chunk of an answer, or a whole answer: `GenerateContentResponse`.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub(super) struct WireResponse {
    #[serde(default)]
    pub(super) candidates: Vec<Candidate>,
    #[serde(default)]
    pub(super) usage_metadata: Option<UsageMetadata>,
    #[serde(default)]
    pub(super) prompt_feedback: Option<PromptFeedback>,
    #[serde(default)]
    pub(super) error: Option<Value>,
    #[serde(default)]
    pub(super) model_version: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub(super) struct Candidate {
    #[serde(default)]
    pub(super) content: Option<CandidateContent>,
    #[serde(default)]
    pub(super) finish_reason: Option<String>,
}

#[derive(Deserialize, Default)]
pub(super) struct CandidateContent {
    #[serde(default)]
    pub(super) parts: Vec<ResponsePart>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub(super) struct ResponsePart {
    #[serde(default)]
    pub(super) text: Option<String>,
    #[serde(default)]
    pub(super) thought: Option<bool>,
    #[serde(default)]
    pub(super) thought_signature: Option<String>,
    #[serde(default)]
    pub(super) function_call: Option<ResponseCall>,
}

#[derive(Deserialize, Default)]
pub(super) struct ResponseCall {
    #[serde(default)]
    pub(super) id: Option<String>,
    #[serde(default)]
    pub(super) name: String,
    #[serde(default)]
    pub(super) args: Option<Value>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub(super) struct PromptFeedback {
    #[serde(default)]
    pub(super) block_reason: Option<String>,
}

/// Token counts: `promptTokenCount` includes the cached tokens, which
/// markov counts apart; thoughts are output.
#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "camelCase")]
pub(super) struct UsageMetadata {
    #[serde(default)]
    prompt_token_count: u64,
    #[serde(default)]
    candidates_token_count: u64,
    #[serde(default)]
    thoughts_token_count: u64,
    #[serde(default)]
    cached_content_token_count: u64,
}

impl UsageMetadata {
    pub(super) fn usage(self) -> markov_core::Usage {
        markov_core::Usage {
            input_tokens: self
                .prompt_token_count
                .saturating_sub(self.cached_content_token_count),
            output_tokens: self
                .candidates_token_count
                .saturating_add(self.thoughts_token_count),
            cache_read_input_tokens: self.cached_content_token_count,
            reasoning_tokens: self.thoughts_token_count,
            ..markov_core::Usage::default()
        }
    }
}

/// An error object in a body or a stream chunk
/// (`{"code", "message", "status"}`).
pub(super) fn error_of(error: &Value) -> ModelError {
    let status = error
        .get("code")
        .and_then(Value::as_u64)
        .and_then(|c| u16::try_from(c).ok())
        .unwrap_or(500);
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| error.to_string());
    if crate::transport::is_context_length(status, &message, "") {
        return ModelError::ContextLength(message);
    }
    ModelError::Http {
        status,
        message,
        retry_after: None,
    }
}

/// The tool list in the Gemini format, e.g. for a registry's definitions.
///
/// # Errors
/// A [`SchemaError`] for a tool whose parameters the dialect cannot express.
pub(super) fn tool_schemas(tools: &[ToolDefinition]) -> Result<Value, SchemaError> {
    let declarations = tools
        .iter()
        .map(|t| declaration(t.name.as_str(), &t.description, &t.input_schema))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(serde_json::to_value(vec![Tools {
        function_declarations: declarations,
    }])
    .unwrap_or(Value::Null))
}

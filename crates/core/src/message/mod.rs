//! The conversation data model and its JSON wire form.
//!
//! A [`Message`] is `{ "role", "items", "metadata"? }`, exactly as upstream
//! markov-machines stores it, so that serialized histories are readable by both:
//!
//! ```json
//! {"role":"assistant","items":[{"type":"tool_use","id":"t1","name":"add","input":{"a":1}}]}
//! {"role":"user","items":[{"type":"tool_result","tool_use_id":"t1","content":"3","is_error":false}]}
//! ```
//!
//! Keys are camelCase except the provider-born `tool_use_id` and `is_error`.
//! `items` is a plain string, a list of [`Item`]s, or, for `role: "instance"`
//! only, one [`InstancePayload`] object. Deserialization checks that the role
//! and the shape of `items` agree, so a malformed history is an error, not a
//! message that later confuses the loop.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::{InstanceId, MessageId, ToolCallId};

mod de;

/// The deepest nesting of tool arguments a history may hold: objects and
/// arrays, counted from the arguments object itself (`{}` is 1 deep,
/// `{"a": [1]}` is 2).
///
/// serde_json reads at most 128 levels, and a stored message, a history
/// and a machine snapshot add their own levels around the arguments: with
/// arguments at most this deep, whatever is written reads back. Executors
/// refuse deeper arguments as invalid input before any tool sees them, and
/// record them as `{}` ([`tool::check_tool_arguments`] refuses them too).
///
/// [`tool::check_tool_arguments`]: crate::tool::check_tool_arguments
pub const MAX_ARGUMENT_DEPTH: usize = 64;

/// Whether `value` nests objects and arrays more than `limit` levels deep
/// (a scalar is 0 deep, `{}` and `[]` 1). Walks the value without
/// recursion, so no input, however deep, can exhaust the stack, and stops
/// at the first level past the limit.
pub fn nesting_exceeds(value: &Value, limit: usize) -> bool {
    // Most arguments nest two levels at most: those are answered without
    // allocating (a call's arguments are checked a few times per step).
    if let Some(depth) = shallow_depth(value) {
        return depth > limit;
    }
    // Each entry is a value and how many containers hold it.
    let mut pending: Vec<(&Value, usize)> = vec![(value, 0)];
    while let Some((value, outside)) = pending.pop() {
        let depth = outside + 1;
        match value {
            Value::Array(items) => {
                if depth > limit {
                    return true;
                }
                pending.extend(items.iter().map(|v| (v, depth)));
            }
            Value::Object(map) => {
                if depth > limit {
                    return true;
                }
                pending.extend(map.values().map(|v| (v, depth)));
            }
            _ => {}
        }
    }
    false
}

/// The nesting of `value` when it is at most 2 deep, else `None`.
fn shallow_depth(value: &Value) -> Option<usize> {
    // The depth of a container whose children are all scalars.
    let flat = |value: &Value| match value {
        Value::Array(items) => items.iter().all(is_scalar).then_some(1),
        Value::Object(map) => map.values().all(is_scalar).then_some(1),
        _ => Some(0),
    };
    let deepest = |children: &mut dyn Iterator<Item = &Value>| {
        let mut deepest = 0;
        for child in children {
            deepest = deepest.max(flat(child)?);
        }
        Some(deepest)
    };
    match value {
        Value::Array(items) => deepest(&mut items.iter()).map(|d| d + 1),
        Value::Object(map) => deepest(&mut map.values()).map(|d| d + 1),
        _ => Some(0),
    }
}

fn is_scalar(value: &Value) -> bool {
    !matches!(value, Value::Array(_) | Value::Object(_))
}

/// Who a message is from, and therefore what happens to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// User input, tool results and cede content. Sent to the model.
    User,
    /// Model output and user-facing tool replies. Sent to the model.
    Assistant,
    /// Control messages: `resume` items, and markov's own words injected
    /// mid-conversation (a reminder, a typed run's follow-up, a resume
    /// notice), which providers render as they can. Never the user's words.
    System,
    /// The record of a command invocation. Never sent to the model.
    Command,
    /// Transient context (e.g. camera frames), shown to the model as silent user input.
    Ephemeral,
    /// An instance-tree mutation; `items` is one [`InstancePayload`]. Never sent to the model.
    Instance,
    /// A summary of earlier messages, made by a context policy's
    /// summarizer: `items` holds one [`Item::Summary`] that names the
    /// messages it stands for. Never sent as it is: a context view shows
    /// it, as user text, in place of those messages, and a request over the
    /// whole history skips it (the messages it summarizes are there).
    Summary,
}

/// One content item of a message, discriminated by `type`.
///
/// Written by its derived `Serialize`; read by a `Deserialize` of its own
/// (in `de.rs`) that takes the same shapes without buffering.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Item {
    /// Plain text.
    Text {
        /// The text.
        text: String,
    },
    /// An inline image.
    Image {
        /// The media type, typically `image/jpeg` or `image/png`.
        #[serde(rename = "mimeType")]
        mime_type: String,
        /// Base64 data without a `data:` prefix.
        data: String,
        /// Rendering detail hint (`auto`, `low`, `high`); providers may ignore it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
    /// A file reference.
    File {
        /// Where the file can be fetched.
        url: String,
        /// The file's media type.
        #[serde(rename = "mediaType")]
        media_type: String,
        /// The file's name, if known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        filename: Option<String>,
        /// The file's size in bytes, if known.
        #[serde(rename = "byteSize", default, skip_serializing_if = "Option::is_none")]
        byte_size: Option<u64>,
        /// An application storage id, if any.
        #[serde(rename = "storageId", default, skip_serializing_if = "Option::is_none")]
        storage_id: Option<String>,
    },
    /// A tool call requested by the model.
    ToolUse {
        /// The call id the result must echo.
        id: ToolCallId,
        /// The tool's name, as the model wrote it (it may name no tool).
        name: String,
        /// The arguments, any JSON.
        input: Value,
    },
    /// The result of one tool call.
    ToolResult {
        /// The id of the call this answers.
        tool_use_id: ToolCallId,
        /// The text the model sees.
        content: String,
        /// Written only when known: `false` on success for node tools, `true` on every error.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        is_error: Option<bool>,
        /// Images the tool returned beside its text, in order. A provider
        /// that takes images in a tool result sends them there; one that
        /// does not sends a note with each image's type and size instead,
        /// never its data. Absent when there are none (and in every result
        /// stored before tool results could carry images).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        images: Vec<ImageData>,
    },
    /// A call to a provider built-in tool ([`ProviderTool`](crate::tool::ProviderTool)),
    /// which the provider ran itself (Anthropic: a `server_tool_use` block).
    ///
    /// Kept in the history so it is sent back to the provider unchanged; the
    /// loop never runs it and never writes a `tool_result` for it. Its answer
    /// is the [`Item::ProviderToolResult`] with the same id, in the same
    /// assistant message.
    ProviderToolUse {
        /// The provider's call id (Anthropic: `srvtoolu_...`).
        id: ToolCallId,
        /// The provider tool's name, e.g. `web_search`.
        name: String,
        /// The arguments the model gave, any JSON.
        input: Value,
    },
    /// The provider's own result of an [`Item::ProviderToolUse`] (Anthropic:
    /// a `web_search_tool_result`, `code_execution_tool_result`, ... block).
    ProviderToolResult {
        /// The id of the call this answers.
        tool_use_id: ToolCallId,
        /// The vendor's block type, e.g. `web_search_tool_result`.
        kind: String,
        /// The vendor's result content, unchanged.
        content: Value,
    },
    /// Model reasoning.
    Thinking {
        /// The reasoning text.
        thinking: String,
        /// The provider's signature, sent back unchanged when thinking is used with tools.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signature: Option<String>,
    },
    /// An application message (structured output, non-text tool replies).
    Output {
        /// Any JSON the application defines.
        data: Value,
    },
    /// The record of a command invocation.
    Command {
        /// The command's name.
        name: String,
        /// Its input.
        input: Value,
        /// The targeted instance, if any.
        #[serde(
            rename = "instanceId",
            default,
            skip_serializing_if = "Option::is_none"
        )]
        instance_id: Option<InstanceId>,
        /// The invoking client, if any.
        #[serde(rename = "clientId", default, skip_serializing_if = "Option::is_none")]
        client_id: Option<String>,
    },
    /// What a summary message ([`Role::Summary`]) says, and which history
    /// messages it stands for: those at positions `start..end` of the
    /// history it was appended to (the history is append-only, so the
    /// positions never move).
    Summary {
        /// The summary's text, as the summarizer wrote it; empty for a
        /// vendor's own compaction (`native`), which writes none.
        text: String,
        /// The position of the first message it stands for.
        start: u64,
        /// The position after the last message it stands for.
        end: u64,
        /// The vendor's own compaction of those messages
        /// ([`Model::compact`](crate::Model::compact)), if it made this
        /// summary; absent in summaries written by a summarizer model and
        /// in those stored before native compaction existed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        native: Option<NativeItems>,
    },
    /// A vendor's compaction items as a context view shows them, in place
    /// of the history messages a native summary stands for. Never in a
    /// history (the summary message keeps them in [`Item::Summary`]'s
    /// `native`): only a view holds it, in a [`Role::Summary`] message of
    /// its own, which the client of that vendor sends as its items,
    /// verbatim, and every other client skips, as it skips every summary
    /// message.
    Native {
        /// The vendor tag ([`NativeItems::vendor`]).
        vendor: String,
        /// The opaque items, each the JSON text the vendor wrote.
        items: Vec<String>,
    },
    /// A request to resume a suspended instance.
    Resume {
        /// The suspended instance.
        #[serde(rename = "instanceId")]
        instance_id: InstanceId,
        /// The id it was suspended with.
        #[serde(rename = "suspendId")]
        suspend_id: String,
    },
}

impl Item {
    /// A text item.
    pub fn text(text: impl Into<String>) -> Self {
        Item::Text { text: text.into() }
    }

    /// A tool call item.
    pub fn tool_use(id: impl Into<ToolCallId>, name: impl Into<String>, input: Value) -> Self {
        Item::ToolUse {
            id: id.into(),
            name: name.into(),
            input,
        }
    }

    /// A provider built-in tool call item.
    pub fn provider_tool_use(
        id: impl Into<ToolCallId>,
        name: impl Into<String>,
        input: Value,
    ) -> Self {
        Item::ProviderToolUse {
            id: id.into(),
            name: name.into(),
            input,
        }
    }

    /// A provider built-in tool result item of vendor block type `kind`.
    pub fn provider_tool_result(
        tool_use_id: impl Into<ToolCallId>,
        kind: impl Into<String>,
        content: Value,
    ) -> Self {
        Item::ProviderToolResult {
            tool_use_id: tool_use_id.into(),
            kind: kind.into(),
            content,
        }
    }

    /// A tool result item. `is_error` is `None` when the outcome is not stated.
    pub fn tool_result(
        tool_use_id: impl Into<ToolCallId>,
        content: impl Into<String>,
        is_error: Option<bool>,
    ) -> Self {
        Item::tool_result_with_images(tool_use_id, content, is_error, Vec::new())
    }

    /// A tool result item with the images the tool returned beside its text.
    pub fn tool_result_with_images(
        tool_use_id: impl Into<ToolCallId>,
        content: impl Into<String>,
        is_error: Option<bool>,
        images: Vec<ImageData>,
    ) -> Self {
        Item::ToolResult {
            tool_use_id: tool_use_id.into(),
            content: content.into(),
            is_error,
            images,
        }
    }
}

/// An image a tool returned: its media type and its data, in base64.
///
/// Kept in the tool result's [`Item::ToolResult`] `images`; written as
/// `{"mimeType": "image/png", "data": "iVBOR…"}`.
///
/// ```
/// use markov_core::message::ImageData;
///
/// let image = ImageData::new("image/png", "aGVsbG8=");
/// assert_eq!(image.byte_len(), 5);
/// assert_eq!(image.note(), "[image image/png, 5 bytes]");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ImageData {
    /// The media type, typically `image/png` or `image/jpeg`.
    #[serde(rename = "mimeType")]
    pub mime_type: String,
    /// The image, base64 without a `data:` prefix.
    pub data: String,
}

impl ImageData {
    /// The image of media type `mime_type` whose base64 data is `data`.
    pub fn new(mime_type: impl Into<String>, data: impl Into<String>) -> Self {
        ImageData {
            mime_type: mime_type.into(),
            data: data.into(),
        }
    }

    /// The image's size in bytes, once decoded (counted from the base64
    /// text, without decoding it).
    pub fn byte_len(&self) -> usize {
        base64_decoded_len(&self.data)
    }

    /// The one-line note that stands for the image where it cannot go:
    /// `[image image/png, 5 bytes]`, its type and size, never its data.
    pub fn note(&self) -> String {
        format!("[image {}, {} bytes]", self.mime_type, self.byte_len())
    }

    /// The image as a `data:` URL (`data:image/png;base64,…`).
    pub fn data_url(&self) -> String {
        format!("data:{};base64,{}", self.mime_type, self.data)
    }
}

/// The size of base64 `data` once decoded, counted from its length and
/// padding.
pub fn base64_decoded_len(data: &str) -> usize {
    let data = data.trim_end();
    let padding = data.bytes().rev().take_while(|&b| b == b'=').count();
    (data.len() / 4 * 3 + [0, 0, 1, 2][data.len() % 4]).saturating_sub(padding)
}

/// A vendor's own compaction of earlier history
/// ([`Model::compact`](crate::Model::compact)): opaque items that a later
/// request to the same vendor sends, verbatim, in place of the messages
/// they stand for.
///
/// markov never reads or changes them: each is kept as the JSON text the
/// vendor wrote (key order and number forms included), and only a client
/// whose [`Model::native_summaries`](crate::Model::native_summaries) names
/// `vendor` sends them.
///
/// ```
/// use markov_core::message::NativeItems;
///
/// let native = NativeItems::new("openai.responses", vec![r#"{"type":"compaction","id":"cmp_1"}"#.into()]);
/// assert_eq!(native.vendor, "openai.responses");
/// assert_eq!(native.items.len(), 1);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct NativeItems {
    /// Which client reads them, as its
    /// [`Model::native_summaries`](crate::Model::native_summaries) names
    /// it (`openai.responses` for OpenAI's Responses API).
    pub vendor: String,
    /// The items, each one JSON value as the vendor wrote it.
    pub items: Vec<String>,
}

impl NativeItems {
    /// The items `items` of `vendor`.
    pub fn new(vendor: impl Into<String>, items: Vec<String>) -> Self {
        NativeItems {
            vendor: vendor.into(),
            items,
        }
    }
}

/// The `items` of a message: a plain string, a list of items, or one instance payload.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Items {
    /// A plain string.
    Text(String),
    /// A list of items.
    List(Vec<Item>),
    /// The payload of an `instance` message.
    Instance(Box<InstancePayload>),
}

/// An instance-tree mutation, discriminated by `kind`.
///
/// Node payloads are stored in their serialized form (a `{"ref": ...}` or an
/// inline serial node), as JSON, because this crate knows nothing of nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind")]
#[non_exhaustive]
pub enum InstancePayload {
    /// Shallow-merge `patch` into an instance's state.
    #[serde(rename = "state")]
    State {
        /// The instance.
        #[serde(rename = "instanceId")]
        instance_id: InstanceId,
        /// The patch.
        patch: Value,
    },
    /// Shallow-merge `patch` into a pack's state.
    #[serde(rename = "packState")]
    PackState {
        /// The pack.
        #[serde(rename = "packName")]
        pack_name: String,
        /// The patch.
        patch: Value,
    },
    /// Replace an instance's node and state, dropping its children.
    #[serde(rename = "transition")]
    Transition {
        /// The instance.
        #[serde(rename = "instanceId")]
        instance_id: InstanceId,
        /// The new node, serialized.
        node: Value,
        /// The new state, if given.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        state: Option<Value>,
    },
    /// Append child instances.
    #[serde(rename = "spawn")]
    Spawn {
        /// The parent.
        #[serde(rename = "parentInstanceId")]
        parent_instance_id: InstanceId,
        /// The new children.
        children: Vec<SpawnedChild>,
    },
    /// Remove an instance; its content goes to the parent.
    #[serde(rename = "cede")]
    Cede {
        /// The instance.
        #[serde(rename = "instanceId")]
        instance_id: InstanceId,
        /// What it hands back, if anything: a string or a list of messages.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        content: Option<Value>,
    },
    /// Mark an instance suspended.
    #[serde(rename = "suspend")]
    Suspend {
        /// The instance.
        #[serde(rename = "instanceId")]
        instance_id: InstanceId,
        /// Why and since when.
        #[serde(rename = "suspendInfo")]
        suspend_info: Value,
    },
}

/// A child created by a spawn payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpawnedChild {
    /// The child's node, serialized.
    pub node: Value,
    /// The child's state, if given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<Value>,
}

/// Where a message came from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    /// The instance that produced it.
    #[serde(
        rename = "instanceId",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub instance_id: Option<InstanceId>,
    /// Whether that instance was the primary (non-worker) leaf.
    #[serde(rename = "isPrimary", default, skip_serializing_if = "Option::is_none")]
    pub is_primary: Option<bool>,
    /// Set by applications for messages from outside; carried, never interpreted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external: Option<bool>,
}

/// The state of a streamed message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StreamState {
    /// Still receiving deltas.
    Streaming,
    /// Final.
    Complete,
    /// Failed mid-stream.
    Error,
}

/// Streaming progress of a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamInfo {
    /// Where the stream is.
    pub state: StreamState,
    /// A counter incremented on every update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
}

/// Optional message metadata.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    /// Where the message came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<Source>,
    /// Stable id across streaming updates; enqueueing the same id replaces in place.
    #[serde(rename = "messageId", default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<MessageId>,
    /// Streaming progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamInfo>,
    /// A user message that is recorded and sent later, but does not trigger inference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub silent: Option<bool>,
    /// Collapse key for ephemerals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub singleton: Option<String>,
    /// How many ephemerals a singleton collapsed (set by the runtime).
    #[serde(
        rename = "singletonFrameCount",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub singleton_frame_count: Option<u64>,
}

impl Metadata {
    /// Metadata holding only a source.
    pub fn with_source(source: Source) -> Self {
        Metadata {
            source: Some(source),
            ..Metadata::default()
        }
    }
}

/// One message of a conversation or of a machine's history: a shared,
/// immutable [`MessageData`] (its role, items and metadata, read through
/// `Deref`).
///
/// A clone shares the message rather than copying it, so the same message
/// held by the machine's history, a step, a context view and a store costs
/// one allocation, however many hold it. [`Message::make_mut`] changes one
/// holder's message, copying it first when others share it. Build one with
/// its constructors ([`Message::user`], [`Message::assistant_items`] …) or
/// from its parts, `MessageData { .. }.into()`.
///
/// Written as its data; read by a `Deserialize` of its own (in `de.rs`)
/// that checks that the role and the items agree.
#[derive(Clone)]
pub struct Message(std::sync::Arc<MessageData>);

/// What a [`Message`] holds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MessageData {
    /// Who it is from.
    pub role: Role,
    /// Its content.
    pub items: Items,
    /// Optional metadata; absent when empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Metadata>,
}

impl std::ops::Deref for Message {
    type Target = MessageData;

    fn deref(&self) -> &MessageData {
        &self.0
    }
}

impl From<MessageData> for Message {
    fn from(data: MessageData) -> Self {
        Message(std::sync::Arc::new(data))
    }
}

impl PartialEq for Message {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Message")
            .field("role", &self.role)
            .field("items", &self.items)
            .field("metadata", &self.metadata)
            .finish()
    }
}

impl Serialize for Message {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

/// A message whose role and items do not agree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a message with role {role:?} cannot hold {found}")]
pub struct MessageShapeError {
    role: Role,
    found: &'static str,
}

impl MessageShapeError {
    /// `Err` when a message of `role` cannot hold `items`.
    fn check(role: Role, items: &Items) -> Result<(), Self> {
        let is_instance_role = role == Role::Instance;
        let is_payload = matches!(items, Items::Instance(_));
        if is_instance_role == is_payload {
            return Ok(());
        }
        let found = if is_payload {
            "an instance payload"
        } else {
            "a string or an item list"
        };
        Err(MessageShapeError { role, found })
    }
}

impl Message {
    fn new(role: Role, items: Vec<Item>) -> Self {
        MessageData {
            role,
            items: Items::List(items),
            metadata: None,
        }
        .into()
    }

    /// This message's data to change in place: copied first when another
    /// holder shares it, so no other holder sees the change.
    pub fn make_mut(&mut self) -> &mut MessageData {
        std::sync::Arc::make_mut(&mut self.0)
    }

    /// The message's data, copied only when another holder shares it.
    pub fn into_data(self) -> MessageData {
        std::sync::Arc::unwrap_or_clone(self.0)
    }

    /// A user message with one text item.
    pub fn user(text: impl Into<String>) -> Self {
        Self::new(Role::User, vec![Item::text(text)])
    }

    /// A user message with the given items.
    pub fn user_items(items: Vec<Item>) -> Self {
        Self::new(Role::User, items)
    }

    /// An assistant message with one text item.
    pub fn assistant(text: impl Into<String>) -> Self {
        Self::new(Role::Assistant, vec![Item::text(text)])
    }

    /// An assistant message with the given items.
    pub fn assistant_items(items: Vec<Item>) -> Self {
        Self::new(Role::Assistant, items)
    }

    /// A system message with one text item (an instruction injected mid-conversation).
    pub fn system(text: impl Into<String>) -> Self {
        Self::new(Role::System, vec![Item::text(text)])
    }

    /// A summary message ([`Role::Summary`]) of the history messages at
    /// positions `start..end`.
    pub fn summary(text: impl Into<String>, start: u64, end: u64) -> Self {
        Self::new(
            Role::Summary,
            vec![Item::Summary {
                text: text.into(),
                start,
                end,
                native: None,
            }],
        )
    }

    /// A summary message ([`Role::Summary`]) of the history messages at
    /// positions `start..end` made by the vendor's own compaction: no
    /// text, the vendor's items.
    pub fn native_summary(native: NativeItems, start: u64, end: u64) -> Self {
        Self::new(
            Role::Summary,
            vec![Item::Summary {
                text: String::new(),
                start,
                end,
                native: Some(native),
            }],
        )
    }

    /// The text and covered positions (`start..end`) of a summary message;
    /// `None` for any other message.
    pub fn as_summary(&self) -> Option<(&str, std::ops::Range<u64>)> {
        self.as_summary_item().map(|(text, range, _)| (text, range))
    }

    /// The text, covered positions (`start..end`) and the vendor's items
    /// (for a native summary) of a summary message; `None` for any other
    /// message.
    pub fn as_summary_item(&self) -> Option<(&str, std::ops::Range<u64>, Option<&NativeItems>)> {
        if self.role != Role::Summary {
            return None;
        }
        self.item_list().iter().find_map(|i| match i {
            Item::Summary {
                text,
                start,
                end,
                native,
            } => Some((text.as_str(), *start..*end, native.as_ref())),
            _ => None,
        })
    }

    /// An instance message carrying one tree mutation.
    pub fn instance(payload: InstancePayload) -> Self {
        MessageData {
            role: Role::Instance,
            items: Items::Instance(Box::new(payload)),
            metadata: None,
        }
        .into()
    }

    /// Sets the metadata (builder style).
    #[must_use]
    pub fn with_metadata(mut self, metadata: Metadata) -> Self {
        self.make_mut().metadata = Some(metadata);
        self
    }

    /// The items as a slice: empty for plain-string and instance messages.
    pub fn item_list(&self) -> &[Item] {
        match &self.items {
            Items::List(items) => items,
            Items::Text(_) | Items::Instance(_) => &[],
        }
    }

    /// The concatenated text: a string's content, or every `text` item without separator.
    /// Instance messages have no text.
    pub fn text(&self) -> String {
        match &self.items {
            Items::Text(s) => s.clone(),
            Items::List(items) => items
                .iter()
                .filter_map(|i| match i {
                    Item::Text { text } => Some(text.as_str()),
                    _ => None,
                })
                .collect(),
            Items::Instance(_) => String::new(),
        }
    }

    /// The tool calls this message requests, in order.
    pub fn tool_uses(&self) -> impl Iterator<Item = (&ToolCallId, &str, &Value)> {
        self.item_list().iter().filter_map(|i| match i {
            Item::ToolUse { id, name, input } => Some((id, name.as_str(), input)),
            _ => None,
        })
    }

    /// Whether this is a user message marked `silent`.
    pub fn is_silent(&self) -> bool {
        self.metadata
            .as_ref()
            .and_then(|m| m.silent)
            .unwrap_or(false)
    }

    /// How an `ephemeral` message is shown to a model, without copying it:
    /// the parts of [`Message::ephemeral_view`]. A string is one part; an
    /// item list holding images is one camera-frame part per image (its
    /// other items are dropped); any other list is one part with the same
    /// items. A message of another role has no parts.
    pub fn ephemeral_parts(&self) -> Vec<EphemeralPart<'_>> {
        if self.role != Role::Ephemeral {
            return Vec::new();
        }
        match &self.items {
            Items::Text(text) => vec![EphemeralPart::Text(text)],
            Items::List(items) => {
                let frames = self
                    .metadata
                    .as_ref()
                    .and_then(|m| m.singleton_frame_count)
                    .unwrap_or(1);
                let images: Vec<EphemeralPart<'_>> = items
                    .iter()
                    .filter(|i| matches!(i, Item::Image { .. }))
                    .map(|image| EphemeralPart::CameraFrame { frames, image })
                    .collect();
                if images.is_empty() {
                    vec![EphemeralPart::Items(items)]
                } else {
                    images
                }
            }
            Items::Instance(_) => Vec::new(),
        }
    }

    /// How an `ephemeral` message is shown to a model: silent user
    /// messages whose metadata is exactly `{silent: true}` (the ephemeral's
    /// own metadata is dropped).
    ///
    /// - string items → one message with that string;
    /// - items holding images → one message per image, with the items
    ///   `[text(camera_frame_text(n)), image]`, where `n` is the ephemeral's
    ///   `singletonFrameCount` or 1; the other items are dropped;
    /// - any other list → one message with the same items.
    ///
    /// Any other message is returned unchanged, as the only element. Model
    /// clients that encode from borrowed history use
    /// [`Message::ephemeral_parts`] instead, which copies nothing.
    ///
    /// ```
    /// use markov_core::message::{Item, Message, MessageData, Metadata, Role, Items};
    ///
    /// let frame = Item::Image { mime_type: "image/jpeg".into(), data: "AAA".into(), detail: None };
    /// let ephemeral: Message = MessageData {
    ///     role: Role::Ephemeral,
    ///     items: Items::List(vec![Item::text("ignored"), frame.clone()]),
    ///     metadata: Some(Metadata { singleton_frame_count: Some(2), ..Metadata::default() }),
    /// }
    /// .into();
    /// let view = ephemeral.ephemeral_view();
    /// assert_eq!(view.len(), 1);
    /// assert_eq!(view[0].role, Role::User);
    /// assert!(view[0].is_silent());
    /// assert!(view[0].text().ends_with("Frames since last turn: 2."));
    /// assert_eq!(view[0].item_list()[1], frame);
    /// ```
    pub fn ephemeral_view(&self) -> Vec<Message> {
        if self.role != Role::Ephemeral {
            return vec![self.clone()];
        }
        self.ephemeral_parts()
            .iter()
            .map(EphemeralPart::to_message)
            .collect()
    }

    /// The source instance recorded in the metadata, if any.
    pub fn source_instance(&self) -> Option<&InstanceId> {
        self.metadata
            .as_ref()
            .and_then(|m| m.source.as_ref())
            .and_then(|s| s.instance_id.as_ref())
    }
}

/// The text shown before each camera frame of an ephemeral:
/// `[Camera frame] This is a snapshot from the user's live camera (not an
/// uploaded file). Frames since last turn: <frames>.`
pub fn camera_frame_text(frames: u64) -> String {
    format!(
        "[Camera frame] This is a snapshot from the user's live camera (not an uploaded file). Frames since last turn: {frames}."
    )
}

/// One silent user message of an ephemeral's model view, borrowed from the
/// ephemeral (see [`Message::ephemeral_parts`]).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum EphemeralPart<'a> {
    /// A message holding this string.
    Text(&'a str),
    /// A message holding these items, unchanged.
    Items(&'a [Item]),
    /// A message holding the [`camera_frame_text`] of `frames`, then `image`.
    CameraFrame {
        /// The `singletonFrameCount` of the ephemeral, or 1.
        frames: u64,
        /// The image item.
        image: &'a Item,
    },
}

impl EphemeralPart<'_> {
    /// The silent user message this part stands for; its metadata is exactly
    /// `{silent: true}`.
    pub fn to_message(&self) -> Message {
        let items = match *self {
            EphemeralPart::Text(text) => Items::Text(text.to_owned()),
            EphemeralPart::Items(items) => Items::List(items.to_vec()),
            EphemeralPart::CameraFrame { frames, image } => {
                Items::List(vec![Item::text(camera_frame_text(frames)), image.clone()])
            }
        };
        MessageData {
            role: Role::User,
            items,
            metadata: Some(Metadata {
                silent: Some(true),
                ..Metadata::default()
            }),
        }
        .into()
    }
}

/// One message of every shape (every item kind, every metadata field,
/// escapes, an instance payload), for the round-trip test.
#[cfg(test)]
fn every_shape() -> Vec<Message> {
    use serde_json::json;
    let mut streamed = Message::assistant("partial");
    streamed.make_mut().metadata = Some(Metadata {
        source: Some(Source {
            instance_id: Some("i1".into()),
            is_primary: Some(true),
            external: Some(false),
        }),
        message_id: Some("m1".into()),
        stream: Some(StreamInfo {
            state: StreamState::Streaming,
            seq: Some(3),
        }),
        silent: Some(true),
        singleton: Some("cam".into()),
        singleton_frame_count: Some(2),
    });
    let mut common = Message::user("now");
    common.make_mut().metadata = Some(Metadata {
        source: Some(Source {
            instance_id: Some("i\"1".into()),
            is_primary: None,
            external: Some(true),
        }),
        message_id: Some("m2".into()),
        stream: None,
        silent: Some(false),
        singleton: Some("s".into()),
        singleton_frame_count: None,
    });
    vec![
        Message::user("plain"),
        Message::user_items(vec![Item::text("a\u{1}b\u{7f}é\"\\\n\t/😀")]),
        Message::assistant_items(vec![
            Item::Thinking {
                thinking: "hm".into(),
                signature: None,
            },
            Item::Thinking {
                thinking: "ho".into(),
                signature: Some("sig".into()),
            },
            Item::tool_use("t1", "add", json!({"a": [1, "x\"y"], "b": {"c": null}})),
        ]),
        Message::user_items(vec![
            Item::tool_result("t1", "3", Some(true)),
            Item::tool_result("t2", "", None),
        ]),
        Message::instance(InstancePayload::State {
            instance_id: "i1".into(),
            patch: json!({"n": 1}),
        }),
        Message::assistant_items(vec![Item::Output { data: json!(null) }]),
        Message::assistant_items(vec![]),
        streamed,
        common,
        Message::system("").with_metadata(Metadata::default()),
        Message::summary("they spoke of \"sums\"", 0, 7),
        Message::native_summary(
            NativeItems::new(
                "openai.responses",
                vec![r#"{"type":"compaction","id":"cmp_1","encrypted_content":"gA=="}"#.into()],
            ),
            7,
            12,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_clone_shares_the_message_and_a_change_copies_it_first() {
        let history = [Message::user("hello")];
        let mut step = history[0].clone();
        // Shared: the clone is the same message, not a copy of it.
        assert!(std::sync::Arc::ptr_eq(&history[0].0, &step.0));
        step.make_mut().metadata = Some(Metadata {
            silent: Some(true),
            ..Metadata::default()
        });
        // The change went to a copy: the history's message is as it was.
        assert!(!std::sync::Arc::ptr_eq(&history[0].0, &step.0));
        assert_eq!(history[0].metadata, None);
        assert!(step.is_silent());
        assert_ne!(history[0], step);
        // A message no one else holds is changed in place.
        let before = std::sync::Arc::as_ptr(&step.0);
        step.make_mut().role = Role::Assistant;
        assert_eq!(std::sync::Arc::as_ptr(&step.0), before);
        // Equality is by content, and the wire form is the data's.
        let copy: Message = MessageData::clone(&step).into();
        assert_eq!(copy, step);
        assert_eq!(
            serde_json::to_value(&copy).unwrap(),
            serde_json::to_value(&*step).unwrap()
        );
        assert_eq!(copy.into_data(), MessageData::clone(&step));
    }

    /// `depth` objects, one inside the other, built without recursion.
    fn nested(depth: usize) -> Value {
        // `json!` would serialize the inner value again at every level.
        let mut value = Value::Object(serde_json::Map::new());
        for _ in 1..depth {
            let mut outer = serde_json::Map::new();
            outer.insert("a".to_owned(), value);
            value = Value::Object(outer);
        }
        value
    }

    #[test]
    fn nesting_is_counted_without_recursion() {
        assert!(!nesting_exceeds(&json!(1), 0));
        assert!(nesting_exceeds(&json!({}), 0));
        assert!(!nesting_exceeds(&json!({"a": [1, {"b": []}]}), 4));
        assert!(nesting_exceeds(&json!({"a": [1, {"b": []}]}), 3));
        assert!(!nesting_exceeds(
            &nested(MAX_ARGUMENT_DEPTH),
            MAX_ARGUMENT_DEPTH
        ));
        assert!(nesting_exceeds(
            &nested(MAX_ARGUMENT_DEPTH + 1),
            MAX_ARGUMENT_DEPTH
        ));
        // Shallow values (answered without the walk) at and around their depth.
        for (value, depth) in [
            (json!("s"), 0),
            (json!({}), 1),
            (json!([1, "two", null]), 1),
            (json!({"a": 2, "b": 3}), 1),
            (json!({"a": [1], "b": 3}), 2),
            (json!([[], {}]), 2),
            (json!({"a": {"b": {}}}), 3),
            (json!([1, [2, [3]]]), 3),
        ] {
            assert!(!nesting_exceeds(&value, depth), "{value} is {depth} deep");
            if depth > 0 {
                assert!(
                    nesting_exceeds(&value, depth - 1),
                    "{value} is {depth} deep"
                );
            }
        }
        // Far deeper than any recursion could go on a test thread's stack.
        let deep = nested(100_000);
        assert!(nesting_exceeds(&deep, MAX_ARGUMENT_DEPTH));
        // Dropping a value recurses: take it apart level by level instead.
        let mut deep = deep;
        while let Value::Object(mut map) = deep {
            deep = map.remove("a").unwrap_or(Value::Null);
        }
    }

    #[test]
    fn a_message_with_arguments_at_the_limit_reads_back() {
        let message = Message::assistant_items(vec![Item::tool_use(
            "t1",
            "add",
            nested(MAX_ARGUMENT_DEPTH),
        )]);
        let text = serde_json::to_string(&message).expect("writes");
        assert_eq!(
            serde_json::from_str::<Message>(&text).expect("reads"),
            message
        );
        let history = serde_json::to_string(&[&message]).expect("writes");
        assert_eq!(
            serde_json::from_str::<Vec<Message>>(&history).expect("reads"),
            vec![message]
        );
    }

    #[test]
    fn every_shape_round_trips() {
        let messages = super::every_shape();
        let text = serde_json::to_string(&messages).expect("writes");
        assert_eq!(
            serde_json::from_str::<Vec<Message>>(&text).expect("reads"),
            messages
        );
    }

    #[test]
    fn summaries_stored_before_native_compaction_still_read() {
        // The form every summary had before `native` existed.
        let old =
            r#"{"role":"summary","items":[{"type":"summary","text":"earlier","start":0,"end":7}]}"#;
        let message: Message = serde_json::from_str(old).expect("an old summary reads");
        assert_eq!(message, Message::summary("earlier", 0, 7));
        assert_eq!(message.as_summary_item(), Some(("earlier", 0..7, None)));
        // And a text summary is still written that way.
        assert_eq!(serde_json::to_string(&message).unwrap(), old);
        // A native one keeps its items as the vendor wrote them.
        let items =
            vec![r#"{"type":"compaction","id":"cmp_1","encrypted_content":"gA=="}"#.to_owned()];
        let native =
            Message::native_summary(NativeItems::new("openai.responses", items.clone()), 0, 7);
        let text = serde_json::to_string(&native).unwrap();
        let back: Message = serde_json::from_str(&text).unwrap();
        let (summary, range, kept) = back.as_summary_item().expect("a summary");
        assert_eq!((summary, range), ("", 0..7));
        assert_eq!(
            kept.map(|n| (n.vendor.as_str(), n.items.clone())),
            Some(("openai.responses", items))
        );
        let from_value: Message =
            serde_json::from_value(serde_json::to_value(&native).unwrap()).unwrap();
        assert_eq!(from_value, native);
    }

    #[test]
    fn wire_form_matches_upstream_shapes() {
        let m = Message::assistant_items(vec![Item::tool_use("t1", "add", json!({"a": 1}))]);
        assert_eq!(
            serde_json::to_value(&m).unwrap(),
            json!({"role":"assistant","items":[{"type":"tool_use","id":"t1","name":"add","input":{"a":1}}]})
        );
        let r = Message::user_items(vec![Item::tool_result("t1", "3", Some(false))]);
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            json!({"role":"user","items":[{"type":"tool_result","tool_use_id":"t1","content":"3","is_error":false}]})
        );
        let img = Item::Image {
            mime_type: "image/png".into(),
            data: "AAA".into(),
            detail: None,
        };
        assert_eq!(
            serde_json::to_value(&img).unwrap(),
            json!({"type":"image","mimeType":"image/png","data":"AAA"})
        );
    }

    #[test]
    fn provider_tool_items_round_trip() {
        let m = Message::assistant_items(vec![
            Item::provider_tool_use("srvtoolu_1", "web_search", json!({"query": "rust"})),
            Item::provider_tool_result(
                "srvtoolu_1",
                "web_search_tool_result",
                json!([{"type": "web_search_result", "url": "https://rust-lang.org"}]),
            ),
        ]);
        let v = serde_json::to_value(&m).unwrap();
        assert_eq!(
            v,
            json!({"role":"assistant","items":[
                {"type":"provider_tool_use","id":"srvtoolu_1","name":"web_search","input":{"query":"rust"}},
                {"type":"provider_tool_result","tool_use_id":"srvtoolu_1","kind":"web_search_tool_result",
                 "content":[{"type":"web_search_result","url":"https://rust-lang.org"}]}
            ]})
        );
        let back: Message = serde_json::from_value(v).unwrap();
        assert_eq!(back, m);
        // A provider call is not a client tool call.
        assert_eq!(m.tool_uses().count(), 0);
    }

    #[test]
    fn instance_payload_round_trips_with_kind_tag() {
        let m = Message::instance(InstancePayload::State {
            instance_id: "i1".into(),
            patch: json!({"count": 1}),
        });
        let v = serde_json::to_value(&m).unwrap();
        assert_eq!(
            v,
            json!({"role":"instance","items":{"kind":"state","instanceId":"i1","patch":{"count":1}}})
        );
        let back: Message = serde_json::from_value(v).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn role_and_items_must_agree() {
        let bad = json!({"role":"user","items":{"kind":"state","instanceId":"i","patch":{}}});
        let err = serde_json::from_value::<Message>(bad).unwrap_err();
        assert!(
            err.to_string().contains("cannot hold an instance payload"),
            "{err}"
        );
        let bad = json!({"role":"instance","items":"hello"});
        assert!(serde_json::from_value::<Message>(bad).is_err());
    }

    #[test]
    fn unknown_item_type_is_an_error() {
        let bad = json!({"role":"user","items":[{"type":"nope"}]});
        assert!(serde_json::from_value::<Message>(bad).is_err());
    }

    #[test]
    fn text_concatenates_text_items_only() {
        let m = Message::assistant_items(vec![
            Item::text("a"),
            Item::tool_use("t", "x", json!({})),
            Item::text("b"),
        ]);
        assert_eq!(m.text(), "ab");
    }

    fn image(data: &str) -> Item {
        Item::Image {
            mime_type: "image/jpeg".into(),
            data: data.into(),
            detail: None,
        }
    }

    fn ephemeral(items: Items, metadata: Option<Metadata>) -> Message {
        MessageData {
            role: Role::Ephemeral,
            items,
            metadata,
        }
        .into()
    }

    #[test]
    fn a_string_ephemeral_is_one_silent_user_message() {
        let e = ephemeral(
            Items::Text("the user looks away".into()),
            Some(Metadata {
                singleton: Some("camera".into()),
                ..Metadata::default()
            }),
        );
        let view = e.ephemeral_view();
        assert_eq!(
            serde_json::to_value(&view).unwrap(),
            json!([{"role":"user","items":"the user looks away","metadata":{"silent":true}}])
        );
    }

    #[test]
    fn each_image_is_one_camera_frame_and_other_items_are_dropped() {
        let e = ephemeral(
            Items::List(vec![image("A"), Item::text("dropped"), image("B")]),
            Some(Metadata {
                singleton: Some("camera".into()),
                singleton_frame_count: Some(3),
                ..Metadata::default()
            }),
        );
        let view = e.ephemeral_view();
        let text = "[Camera frame] This is a snapshot from the user's live camera (not an uploaded file). Frames since last turn: 3.";
        assert_eq!(
            serde_json::to_value(&view).unwrap(),
            json!([
                {"role":"user","items":[{"type":"text","text":text},{"type":"image","mimeType":"image/jpeg","data":"A"}],"metadata":{"silent":true}},
                {"role":"user","items":[{"type":"text","text":text},{"type":"image","mimeType":"image/jpeg","data":"B"}],"metadata":{"silent":true}}
            ])
        );
        // Without a frame count, a frame counts as one.
        let single = ephemeral(Items::List(vec![image("A")]), None).ephemeral_view();
        assert!(single[0].text().ends_with("Frames since last turn: 1."));
    }

    #[test]
    fn other_lists_keep_their_items_and_other_roles_pass_through() {
        let items = vec![Item::text("a"), Item::text("b")];
        let view = ephemeral(Items::List(items.clone()), None).ephemeral_view();
        assert_eq!(view.len(), 1);
        assert_eq!(view[0].role, Role::User);
        assert_eq!(view[0].item_list(), items.as_slice());
        assert!(view[0].is_silent());
        let user = Message::user("hi");
        assert_eq!(user.ephemeral_view(), vec![user.clone()]);
        assert!(user.ephemeral_parts().is_empty());
    }
}

//! Tools: the typed [`Tool`] trait authors implement, its erased form
//! [`DynTool`], the definition sent to models, and what a call produces.
//!
//! A tool has a typed input (deserialized from the model's JSON and described
//! by a JSON Schema derived with `schemars`) and a typed output. Its output can
//! be any serializable value, a [`ToolReply`] with separate texts for the user
//! and the model, a [`TerminateResponse`] that ends the run, or a
//! [`ToolOutcome::Images`]: a text and the images the model sees beside it.
//!
//! ```
//! use markov_core::async_trait;
//! use markov_core::tool::{Tool, ToolContext};
//! use schemars::JsonSchema;
//! use serde::Deserialize;
//!
//! /// Adds two integers.
//! struct Add;
//!
//! #[derive(Deserialize, JsonSchema)]
//! struct AddArgs { a: i64, b: i64 }
//!
//! #[async_trait]
//! impl Tool for Add {
//!     const NAME: &'static str = "add";
//!     type Args = AddArgs;
//!     type Output = i64;
//!     type Error = std::convert::Infallible;
//!
//!     fn description(&self) -> String { "Add two integers".into() }
//!
//!     async fn call(&self, args: AddArgs, _cx: &ToolContext<'_>) -> Result<i64, Self::Error> {
//!         Ok(args.a + args.b)
//!     }
//! }
//! ```

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::{InstanceId, ToolCallId};
use crate::message::{ImageData, Item, MAX_ARGUMENT_DEPTH, Message, nesting_exceeds};

/// A tool name that providers accept: `^[a-zA-Z0-9_-]{1,64}$`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct ToolName(Arc<str>);

/// A name that no provider would accept as a tool name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid tool name {name:?}: a tool name must match ^[a-zA-Z0-9_-]{{1,64}}$")]
pub struct InvalidToolName {
    name: String,
}

impl InvalidToolName {
    /// The rejected name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl ToolName {
    /// Checks `name` against the providers' rule.
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidToolName> {
        let name = name.into();
        let ok = (1..=64).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if ok {
            Ok(ToolName(name.into()))
        } else {
            Err(InvalidToolName { name })
        }
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for ToolName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ToolName::new(s).map_err(serde::de::Error::custom)
    }
}

impl fmt::Debug for ToolName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for ToolName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for ToolName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for ToolName {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

/// What a tool promises about running a call again: the contract a
/// resumed conversation keeps for a call that may have started but whose
/// result was never recorded (the process died between the tool's side
/// effect and the write of its result).
///
/// A tool that does not say ([`ToolDefinition::delivery`] unset) gets
/// [`Delivery::default_for`] its approval: at most once when every call
/// waits for the application's approval, at least once otherwise. A tool
/// registry's metadata may set it too, and wins over the definition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    /// The call runs again on resume, with the same
    /// [`ToolContext::idempotency_key`]: right for a tool that honours the
    /// key (an outside API that deduplicates by it) or has no side effect,
    /// such as a retrieval.
    AtLeastOnce,
    /// The call never runs twice. Its start is recorded (durably, with a
    /// store) before the tool runs; a resumed conversation that finds the
    /// start but no result answers the call with an `INTERRUPTED` error (its
    /// outcome is unknown and it was not run again) and names it to the
    /// application, so that a person can reconcile it. Right for a tool
    /// that cannot honour a key (an email, a payment without idempotency).
    /// A tool that keeps its side effects in its call's journal
    /// ([`DynTool::resumes_from_journal`], a sub-agent) is resumed from it
    /// instead, where the conversation has a journal.
    AtMostOnce,
}

impl Delivery {
    /// The contract of a tool that does not state one: [`AtMostOnce`]
    /// when every call needs the application's approval (a person decided
    /// it, and it must not happen twice), [`AtLeastOnce`] otherwise.
    ///
    /// [`AtMostOnce`]: Delivery::AtMostOnce
    /// [`AtLeastOnce`]: Delivery::AtLeastOnce
    pub fn default_for(needs_approval: bool) -> Self {
        if needs_approval {
            Delivery::AtMostOnce
        } else {
            Delivery::AtLeastOnce
        }
    }

    /// The wire name (`"at_least_once"`, `"at_most_once"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Delivery::AtLeastOnce => "at_least_once",
            Delivery::AtMostOnce => "at_most_once",
        }
    }
}

impl fmt::Display for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a model is told about a tool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDefinition {
    /// The tool's name.
    pub name: ToolName,
    /// What it does, for the model.
    pub description: String,
    /// A JSON Schema of its input object.
    pub input_schema: Value,
    /// Whether its successful output is the machine's response for the turn.
    /// Not sent to providers.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub terminal: bool,
    /// Whether every call waits for the application's approval before it
    /// runs (the machine pauses; see `markov_policy::confirm`). Not sent to
    /// providers: the model cannot tell, and cannot approve anything.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub needs_approval: bool,
    /// Whether a call interrupted before its result was recorded runs
    /// again on resume ([`Delivery`]); `None`: [`Delivery::default_for`]
    /// its approval. Not sent to providers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<Delivery>,
}

impl ToolDefinition {
    /// A non-terminal definition. The name is checked here, not at the first model call.
    pub fn new(
        name: impl Into<String>,
        description: impl Into<String>,
        input_schema: Value,
    ) -> Result<Self, InvalidToolName> {
        Ok(ToolDefinition {
            name: ToolName::new(name)?,
            description: description.into(),
            input_schema,
            terminal: false,
            needs_approval: false,
            delivery: None,
        })
    }

    /// Marks the tool terminal (builder style).
    #[must_use]
    pub fn terminal(mut self, terminal: bool) -> Self {
        self.terminal = terminal;
        self
    }

    /// Makes every call of the tool wait for the application's approval
    /// (builder style), with or without a tool registry.
    #[must_use]
    pub fn needs_approval(mut self, needs_approval: bool) -> Self {
        self.needs_approval = needs_approval;
        self
    }

    /// States the tool's [`Delivery`] contract (builder style): what a
    /// resumed conversation does with a call interrupted before its result
    /// was recorded.
    #[must_use]
    pub fn delivery(mut self, delivery: Delivery) -> Self {
        self.delivery = Some(delivery);
        self
    }

    /// The contract a call of this tool gets: the one stated, else
    /// [`Delivery::default_for`] its approval. (A registry's metadata may
    /// override both.)
    pub fn effective_delivery(&self) -> Delivery {
        self.delivery
            .unwrap_or_else(|| Delivery::default_for(self.needs_approval))
    }
}

/// A tool the provider runs itself (upstream's "provider built-in tool marker"),
/// such as Anthropic's web search or code execution server tools.
///
/// The model's calls to it come back already answered, in the same response,
/// as [`Item::ProviderToolUse`] and [`Item::ProviderToolResult`] items: the
/// loop never runs it and never writes a result for it. It is offered to the
/// model through [`ModelRequest::provider_tools`](crate::model::ModelRequest::provider_tools),
/// beside (not among) the [`ToolDefinition`]s, since it has no input schema.
///
/// Its JSON form is the vendor's tool object: `kind` as `type`, `name`, and
/// every `config` entry at the top level. `type` and `name` always come from
/// the fields; keys of that name in `config` are ignored.
///
/// ```
/// use markov_core::tool::ProviderTool;
/// use serde_json::json;
///
/// let search = ProviderTool::new("web_search_20250305", "web_search")
///     .unwrap()
///     .with("max_uses", json!(5));
/// assert_eq!(
///     search.to_json(),
///     json!({"type": "web_search_20250305", "name": "web_search", "max_uses": 5})
/// );
/// let back: ProviderTool = serde_json::from_value(search.to_json()).unwrap();
/// assert_eq!(back, search);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderTool {
    /// The name the model calls it by (Anthropic fixes it per tool type,
    /// e.g. `web_search`).
    pub name: ToolName,
    /// The vendor's tool type string, e.g. `web_search_20250305`.
    pub kind: String,
    /// Further vendor options (`max_uses`, `allowed_domains`, ...), sent as given.
    pub config: serde_json::Map<String, Value>,
}

impl ProviderTool {
    /// A provider tool of vendor type `kind`, without options. The name is
    /// checked here.
    pub fn new(kind: impl Into<String>, name: impl Into<String>) -> Result<Self, InvalidToolName> {
        Ok(ProviderTool {
            name: ToolName::new(name)?,
            kind: kind.into(),
            config: serde_json::Map::new(),
        })
    }

    /// Sets one vendor option (builder style).
    #[must_use]
    pub fn with(mut self, key: impl Into<String>, value: Value) -> Self {
        self.config.insert(key.into(), value);
        self
    }

    /// The vendor's tool object: `{"type": kind, "name": name, ...config}`.
    pub fn to_json(&self) -> Value {
        let mut object = self.config.clone();
        object.insert("type".into(), Value::String(self.kind.clone()));
        object.insert("name".into(), Value::String(self.name.to_string()));
        Value::Object(object)
    }
}

impl Serialize for ProviderTool {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

impl<'de> Deserialize<'de> for ProviderTool {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut config = serde_json::Map::<String, Value>::deserialize(d)?;
        let kind = match config.remove("type") {
            Some(Value::String(kind)) => kind,
            _ => return Err(D::Error::custom("a provider tool needs a string `type`")),
        };
        let name = match config.remove("name") {
            Some(Value::String(name)) => ToolName::new(name).map_err(D::Error::custom)?,
            _ => return Err(D::Error::custom("a provider tool needs a string `name`")),
        };
        Ok(ProviderTool { name, kind, config })
    }
}

/// A tool's request to end the current run (the `finish` tool returns one).
///
/// The loop records a tool result holding `message`, or its configured default
/// (`"Finished"`) when there is none, marks the step done and does not call the
/// model again.
// Not `Serialize`: a tool returning it means "terminate", never "send this JSON".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TerminateResponse {
    /// An optional note about the completion, for the model's record and the application.
    pub message: Option<String>,
}

impl TerminateResponse {
    /// A termination with an optional note.
    pub fn new(message: Option<String>) -> Self {
        TerminateResponse { message }
    }
}

/// What the user sees from a [`ToolReply`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum UserMessage {
    /// Text, recorded as an assistant `text` item.
    Text(String),
    /// An application message, recorded as an assistant `output` item.
    Data(Value),
}

/// A reply with separate texts for the user and for the model (upstream's `toolReply`).
// Not `Serialize`, for the same reason as `TerminateResponse`.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolReply {
    /// What the user sees, recorded as an assistant message after the tool results.
    pub user_message: UserMessage,
    /// What the model reads as the tool result.
    pub llm_message: String,
}

impl ToolReply {
    /// A reply with user-facing text and a model-facing text.
    pub fn new(user_message: impl Into<String>, llm_message: impl Into<String>) -> Self {
        ToolReply {
            user_message: UserMessage::Text(user_message.into()),
            llm_message: llm_message.into(),
        }
    }
}

/// The erased outcome of a successful tool call.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ToolOutcome {
    /// A plain value. A JSON string is the text itself; anything else is its JSON text.
    Value(Value),
    /// Separate texts for the user and the model.
    Reply(ToolReply),
    /// End the run.
    Terminate(TerminateResponse),
    /// A text and the images that go with it: the model reads the text
    /// and sees the images in the same tool result where its provider
    /// takes images there (elsewhere it reads a note with each image's
    /// type and size, never its data).
    Images {
        /// What the model reads.
        text: String,
        /// The images, in order.
        images: Vec<ImageData>,
    },
}

impl ToolOutcome {
    /// The text the model reads as the tool result. `default_terminate` fills in
    /// a [`TerminateResponse`] without a message.
    pub fn model_text(&self, default_terminate: &str) -> String {
        match self {
            ToolOutcome::Value(Value::String(s)) => s.clone(),
            ToolOutcome::Value(v) => v.to_string(),
            ToolOutcome::Reply(r) => r.llm_message.clone(),
            ToolOutcome::Images { text, .. } => text.clone(),
            ToolOutcome::Terminate(t) => t
                .message
                .clone()
                .unwrap_or_else(|| default_terminate.to_owned()),
        }
    }

    /// The images that go with the text the model reads (none but for
    /// [`ToolOutcome::Images`]).
    pub fn images(&self) -> &[ImageData] {
        match self {
            ToolOutcome::Images { images, .. } => images,
            _ => &[],
        }
    }

    /// The text a terminal tool hands the user as the machine's response: a
    /// string verbatim, a structured value as JSON, a reply's user text (or its
    /// data as JSON), a termination's note.
    pub fn response_text(&self, default_terminate: &str) -> String {
        match self {
            ToolOutcome::Reply(ToolReply {
                user_message: UserMessage::Text(s),
                ..
            }) => s.clone(),
            ToolOutcome::Reply(ToolReply {
                user_message: UserMessage::Data(v),
                ..
            }) => v.to_string(),
            other => other.model_text(default_terminate),
        }
    }
}

/// Turns a tool's typed output into a [`ToolOutcome`].
///
/// Implemented for every `Serialize` type, and for [`ToolReply`],
/// [`TerminateResponse`] and [`ToolOutcome`] themselves.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be a tool output",
    note = "a tool output must implement `serde::Serialize`, or be `ToolReply`, `TerminateResponse` or `ToolOutcome`"
)]
pub trait IntoToolOutcome {
    /// Whether an output of this type can end the run ([`TerminateResponse`]).
    const MAY_TERMINATE: bool = false;

    /// Converts the output. Fails only when serialization fails.
    fn into_outcome(self) -> Result<ToolOutcome, serde_json::Error>;
}

impl<T: Serialize> IntoToolOutcome for T {
    fn into_outcome(self) -> Result<ToolOutcome, serde_json::Error> {
        serde_json::to_value(self).map(ToolOutcome::Value)
    }
}

impl IntoToolOutcome for ToolReply {
    fn into_outcome(self) -> Result<ToolOutcome, serde_json::Error> {
        Ok(ToolOutcome::Reply(self))
    }
}

impl IntoToolOutcome for TerminateResponse {
    const MAY_TERMINATE: bool = true;

    fn into_outcome(self) -> Result<ToolOutcome, serde_json::Error> {
        Ok(ToolOutcome::Terminate(self))
    }
}

impl IntoToolOutcome for ToolOutcome {
    const MAY_TERMINATE: bool = true;

    fn into_outcome(self) -> Result<ToolOutcome, serde_json::Error> {
        Ok(self)
    }
}

/// Writes a tool makes to the state of the instance it runs for.
///
/// The runtime implements this; it merges the patch, validates the result
/// against the node's state type and refuses invalid updates.
pub trait StateAccess: Send + Sync {
    /// The state as it was when the call started (a snapshot: an update in the
    /// same call does not change it).
    fn state(&self) -> &Value;

    /// Shallow-merges `patch` into the running state after validating the result.
    fn update_state(&self, patch: Value) -> Result<(), StateUpdateError>;
}

/// A refused state update.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StateUpdateError {
    /// The merged state failed validation; the message is the validator's.
    #[error("state validation failed: {0}")]
    Invalid(String),
    /// A patch must be a JSON object.
    #[error("a state patch must be a JSON object")]
    NotAnObject,
    /// The tool belongs to an ancestor, whose state cannot be written from a tool.
    #[error("Cannot update ancestor state from tool. Ancestor state updates are not supported.")]
    Ancestor,
    /// There is no state to update (e.g. a tool run outside a machine).
    #[error("this tool call has no state to update")]
    Unavailable,
}

/// A state that cannot be written, for tools run without a machine.
#[derive(Debug, Default)]
pub struct NoState {
    empty: Value,
}

impl StateAccess for NoState {
    fn state(&self) -> &Value {
        &self.empty
    }

    fn update_state(&self, _patch: Value) -> Result<(), StateUpdateError> {
        Err(StateUpdateError::Unavailable)
    }
}

/// What a tool sees of the world during one call.
#[derive(Clone, Copy)]
pub struct ToolContext<'a> {
    call_id: &'a ToolCallId,
    instance_id: Option<&'a InstanceId>,
    root_instance_id: Option<&'a InstanceId>,
    history: &'a [Message],
    state: &'a dyn StateAccess,
    idempotency_key: Option<&'a IdempotencyKey<'a>>,
    usage: Option<&'a UsageSink>,
    hold: Option<&'a dyn Hold>,
    journal: Option<&'a (dyn Fn() -> Arc<dyn CallJournal> + Send + Sync)>,
}

/// A person's decision asked for by a running call
/// ([`ToolContext::ask_approval`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum HoldDecision {
    /// Approved: go on with these arguments (the asked ones, or as the
    /// person edited them).
    Approved(Value),
    /// Denied, with the person's message if any.
    Denied(Option<String>),
    /// The person answered in the action's place with this result.
    Answered(Value),
    /// Not decided yet: the call returns at once, the step pauses, and the
    /// call runs again (same id, same arguments) when the run is resumed,
    /// asking again.
    Waiting,
    /// Nobody can decide here (a context made by hand, a step nothing
    /// can resume, the request expired or too many wait): why.
    Unavailable(String),
}

/// The conversation's approvals as a running call sees them (see
/// [`ToolContext::ask_approval`]); the machine's tool path gives one.
pub trait Hold: Send + Sync {
    /// Asks for a person's decision on `action` with `args`, bound to the
    /// call.
    fn ask(&self, action: &str, args: &Value) -> HoldDecision;

    /// Keeps `state` with the call's waiting request, stored with the
    /// conversation; `false` when the call has none.
    fn keep(&self, state: Value) -> bool;

    /// The state the call kept with its request, if any.
    fn kept(&self) -> Option<Value>;
}

/// The durable journal of the conversation a call runs in, as that one
/// call sees it ([`ToolContext::journal`]): records it keeps under names of
/// its own, durable before [`write`](Self::write) returns, and read back
/// ([`recorded`](Self::recorded)) when the same call runs again after a
/// crash, in this process or another. A sub-agent keeps its model's
/// answers and its tools' results here, so that a crash inside it repeats
/// neither. Records live as long as the call may run again: until the step
/// that answers it is recorded.
#[async_trait]
pub trait CallJournal: Send + Sync + fmt::Debug {
    /// What earlier runs of this call recorded, `(name, record)` in the
    /// order written (a name written twice once, with its last record);
    /// empty on the call's first run.
    fn recorded(&self) -> Vec<(String, Value)>;

    /// Records `record` under `name`, replacing a record of that name,
    /// durably before it returns. An error means nothing durable holds it.
    async fn write(&self, name: &str, record: Value) -> Result<(), String>;

    /// Whether the call may go on: `Err` with the reason once the
    /// conversation's writer lost the right to write (another worker may
    /// be running this very call).
    fn check(&self) -> Result<(), String>;

    /// Keeps `step`, a step of a sub-agent run by this call (or, through
    /// `calls`, by a call nested in it, outermost first), with the trace
    /// of the caller's step in flight, where a store records it. Nothing
    /// durable is promised: a trace is for people to read.
    fn keep_step(&self, calls: &[ToolCallId], step: Value);
}

/// Usage spent inside tool calls (a sub-agent's model calls, say) that the
/// caller's step counts as its own: in its usage, its cost and its limits.
/// The machine's tool path gives each call one
/// ([`ToolContext::report_usage`]).
#[derive(Debug, Default)]
pub struct UsageSink {
    spent: std::sync::Mutex<crate::usage::Usage>,
    /// Set (under the lock) when something was added and not yet taken:
    /// a step whose calls report nothing, the most common, takes no lock.
    added: std::sync::atomic::AtomicBool,
}

impl UsageSink {
    /// Nothing spent yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `usage`.
    pub fn add(&self, usage: crate::usage::Usage) {
        let mut spent = self.spent.lock().unwrap_or_else(|p| p.into_inner());
        *spent += usage;
        self.added.store(true, std::sync::atomic::Ordering::Release);
    }

    /// What was added since the last take. An add that runs at the same
    /// time as the take is either in it or left for the next.
    pub fn take(&self) -> crate::usage::Usage {
        if !self.added.load(std::sync::atomic::Ordering::Acquire) {
            return crate::usage::Usage::default();
        }
        let mut spent = self.spent.lock().unwrap_or_else(|p| p.into_inner());
        self.added
            .store(false, std::sync::atomic::Ordering::Relaxed);
        std::mem::take(&mut *spent)
    }
}

/// A call's idempotency key, made the first time a tool asks for it (most
/// tools never do, and making it hashes).
pub struct IdempotencyKey<'a> {
    make: &'a (dyn Fn() -> String + Send + Sync),
    key: std::sync::OnceLock<String>,
}

impl<'a> IdempotencyKey<'a> {
    /// A key that `make` makes when it is first asked for.
    pub fn new(make: &'a (dyn Fn() -> String + Send + Sync)) -> Self {
        IdempotencyKey {
            make,
            key: std::sync::OnceLock::new(),
        }
    }

    /// The key.
    pub fn get(&self) -> &str {
        self.key.get_or_init(|| (self.make)())
    }
}

impl fmt::Debug for IdempotencyKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyKey")
            .field("key", &self.key.get())
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for ToolContext<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolContext")
            .field("call_id", self.call_id)
            .field("instance_id", &self.instance_id)
            .field("history_len", &self.history.len())
            .finish_non_exhaustive()
    }
}

impl<'a> ToolContext<'a> {
    /// A context for one call. `history` is borrowed, never copied.
    pub fn new(
        call_id: &'a ToolCallId,
        history: &'a [Message],
        state: &'a dyn StateAccess,
    ) -> Self {
        ToolContext {
            call_id,
            instance_id: None,
            root_instance_id: None,
            history,
            state,
            idempotency_key: None,
            usage: None,
            hold: None,
            journal: None,
        }
    }

    /// Sets where [`journal`](Self::journal) gets the call's journal: made
    /// when a tool asks for it (most never do).
    #[must_use]
    pub fn with_journal(
        mut self,
        make: &'a (dyn Fn() -> Arc<dyn CallJournal> + Send + Sync),
    ) -> Self {
        self.journal = Some(make);
        self
    }

    /// This call's part of its conversation's durable journal, when the
    /// conversation has one (a stored session): see [`CallJournal`]. Made
    /// afresh each time it is asked for (it reads what is recorded): ask
    /// once per call. `None` for a conversation kept in memory only, or a
    /// context made by hand.
    pub fn journal(&self) -> Option<Arc<dyn CallJournal>> {
        self.journal.map(|make| make())
    }

    /// Sets what [`ask_approval`](Self::ask_approval) asks.
    #[must_use]
    pub fn with_hold(mut self, hold: &'a dyn Hold) -> Self {
        self.hold = Some(hold);
        self
    }

    /// Asks the application for a person's decision on `action` with
    /// `args` while the call runs (a sub-agent's call that needs
    /// approval): the request is the caller's, listed with its other
    /// approvals. [`HoldDecision::Waiting`] means the step pauses: return
    /// at once; the call runs again when the run is resumed and gets the
    /// decision by asking the same. A tool that asks says so with
    /// [`DynTool::may_pause`].
    pub fn ask_approval(&self, action: &str, args: &Value) -> HoldDecision {
        match self.hold {
            Some(hold) => hold.ask(action, args),
            None => {
                HoldDecision::Unavailable("no approvals can be asked for in this call".to_owned())
            }
        }
    }

    /// Sets where the call's own usage goes (see
    /// [`report_usage`](Self::report_usage)).
    #[must_use]
    pub fn with_usage_sink(mut self, sink: &'a UsageSink) -> Self {
        self.usage = Some(sink);
        self
    }

    /// Keeps `state` with the request this call is waiting for
    /// ([`ask_approval`](Self::ask_approval) answered
    /// [`HoldDecision::Waiting`]), stored with the conversation, so that
    /// the call, run again on resume (in this process or another), can
    /// continue from it ([`kept_state`](Self::kept_state)). `false` when
    /// there is nothing to keep it with.
    pub fn keep_state(&self, state: Value) -> bool {
        self.hold.is_some_and(|hold| hold.keep(state))
    }

    /// The state this call kept while it waited (see
    /// [`keep_state`](Self::keep_state)).
    pub fn kept_state(&self) -> Option<Value> {
        self.hold.and_then(Hold::kept)
    }

    /// Reports usage the call spent (a sub-agent's model calls): the
    /// machine adds it to the step's usage, cost and limits. `false` when
    /// nothing counts it (a context made by hand).
    pub fn report_usage(&self, usage: crate::usage::Usage) -> bool {
        match self.usage {
            Some(sink) => {
                sink.add(usage);
                true
            }
            None => false,
        }
    }

    /// Sets the call's idempotency key (see [`ToolContext::idempotency_key`]).
    #[must_use]
    pub fn with_idempotency_key(mut self, key: &'a IdempotencyKey<'a>) -> Self {
        self.idempotency_key = Some(key);
        self
    }

    /// A key for this call that is the same on every retry and every resume
    /// of it, and different for every other call: hand it to an outside API
    /// that deduplicates requests (a payment provider's idempotency header),
    /// so that even a crash inside the tool, after its side effect and
    /// before its result was recorded, repeats nothing outside. Set by the
    /// machine's tool path; `None` for a context made by hand.
    pub fn idempotency_key(&self) -> Option<&'a str> {
        self.idempotency_key.map(IdempotencyKey::get)
    }

    /// The same context writing through `state` instead (a stage that
    /// records the updates a call makes, say).
    #[must_use]
    pub fn with_state(mut self, state: &'a dyn StateAccess) -> Self {
        self.state = state;
        self
    }

    /// The state the context reads and writes.
    pub fn state_access(&self) -> &'a dyn StateAccess {
        self.state
    }

    /// Sets the instance the call runs for and the root of its tree.
    #[must_use]
    pub fn with_instance(mut self, instance: &'a InstanceId, root: &'a InstanceId) -> Self {
        self.instance_id = Some(instance);
        self.root_instance_id = Some(root);
        self
    }

    /// The id of this call.
    pub fn call_id(&self) -> &'a ToolCallId {
        self.call_id
    }

    /// The leaf instance the call runs for (also for ancestor and charter tools).
    pub fn instance_id(&self) -> Option<&'a InstanceId> {
        self.instance_id
    }

    /// The root instance of the tree.
    pub fn root_instance_id(&self) -> Option<&'a InstanceId> {
        self.root_instance_id
    }

    /// The whole history the call can see.
    pub fn history(&self) -> &'a [Message] {
        self.history
    }

    /// The messages of the history produced by this call's instance.
    pub fn instance_messages(&self) -> impl Iterator<Item = &'a Message> + 'a {
        let id = self.instance_id;
        self.history
            .iter()
            .filter(move |m| id.is_some() && m.source_instance() == id)
    }

    /// The state snapshot as JSON.
    pub fn state_json(&self) -> &Value {
        self.state.state()
    }

    /// The state snapshot deserialized into `S`.
    pub fn state<S: DeserializeOwned>(&self) -> Result<S, serde_json::Error> {
        S::deserialize(self.state.state())
    }

    /// Shallow-merges a patch into the running state; later calls in the turn see it.
    pub fn update_state(&self, patch: impl Serialize) -> Result<(), StateUpdateError> {
        let patch =
            serde_json::to_value(patch).map_err(|e| StateUpdateError::Invalid(e.to_string()))?;
        self.state.update_state(patch)
    }
}

/// A typed tool. Implement this, with `#[async_trait]` on the `impl` as on
/// every markov trait with async methods, or let `#[tool]` write it (the
/// `macros` feature); the runtime erases it into a [`DynTool`].
///
/// A tool owns what it needs of the application (a database pool, an HTTP
/// client): they are its fields, given when the tool is made, so nothing is
/// looked up when it runs.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a markov tool",
    note = "write the tool with `#[tool]`, or implement `markov_core::tool::Tool` (with `#[async_trait]`) with `NAME`, `Args`, `Output`, `Error`, `description` and `call`"
)]
#[async_trait]
pub trait Tool: Send + Sync + 'static {
    /// The name the model calls it by; checked against `^[a-zA-Z0-9_-]{1,64}$`.
    const NAME: &'static str;
    /// Whether a successful output is the machine's response for the turn.
    const TERMINAL: bool = false;
    /// Whether every call waits for the application's approval before it
    /// runs: the machine pauses the run, and the application approves,
    /// edits, denies or answers the call (see `markov_policy::confirm`).
    const NEEDS_APPROVAL: bool = false;
    /// What a resumed conversation does with a call interrupted before its
    /// result was recorded ([`Delivery`]); `None` (the default):
    /// [`Delivery::default_for`] [`NEEDS_APPROVAL`](Self::NEEDS_APPROVAL).
    const DELIVERY: Option<Delivery> = None;
    /// The input, deserialized from the model's arguments; its schema is sent to the model.
    type Args: DeserializeOwned + JsonSchema + Send;
    /// The output: any `Serialize` value, or a [`ToolReply`] / [`TerminateResponse`].
    type Output: IntoToolOutcome + Send;
    /// The failure; the model reads `Tool execution error: <its Display>`.
    type Error: std::error::Error + Send + Sync + 'static;

    /// What the tool does, for the model.
    fn description(&self) -> String;

    /// Runs the tool.
    async fn call(
        &self,
        args: Self::Args,
        cx: &ToolContext<'_>,
    ) -> Result<Self::Output, Self::Error>;
}

/// Why an erased tool call failed. The display texts are what the model reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ToolCallError {
    /// The arguments did not fit the input type.
    #[error("Invalid tool input: {0}")]
    InvalidInput(String),
    /// The tool itself failed.
    #[error("Tool execution error: {0}")]
    Execution(String),
}

/// The object-safe form of a tool, so a node can hold tools of different types.
///
/// Implemented for every [`Tool`] by [`Erased`]; implement it directly only
/// for a tool whose schema is known at run time (an MCP server's tools).
#[async_trait]
pub trait DynTool: Send + Sync + fmt::Debug {
    /// The definition sent to models.
    fn definition(&self) -> &ToolDefinition;

    /// Whether a call may end the run (its output type can be a [`TerminateResponse`]).
    fn may_terminate(&self) -> bool {
        false
    }

    /// Whether a call may ask for a person's decision while it runs
    /// ([`ToolContext::ask_approval`]) and so pause the step: the
    /// machine then keeps the answer that made the call, to resume it.
    fn may_pause(&self) -> bool {
        false
    }

    /// Whether the tool keeps every side effect of a call in the call's
    /// journal ([`ToolContext::journal`]) and answers it from there when the
    /// call runs again, so that running a call again repeats none of them
    /// (a sub-agent does: its own ledger is in its caller's journal). An
    /// at-most-once call of such a tool that a crash interrupted is run
    /// again, resuming from its journal, instead of being answered
    /// `INTERRUPTED` — but only where the conversation has a journal (a
    /// stored session); without one it is answered `INTERRUPTED` as any.
    fn resumes_from_journal(&self) -> bool {
        false
    }

    /// Deserializes `input` and runs the tool.
    ///
    /// The arguments are borrowed: the call's copy in the history is the only
    /// one, and the tool's typed arguments are read straight from it.
    async fn call_json(
        &self,
        input: &Value,
        cx: ToolContext<'_>,
    ) -> Result<ToolOutcome, ToolCallError>;
}

/// A shared, type-erased tool.
pub type SharedTool = Arc<dyn DynTool>;

/// The schema of `T` as a JSON value, with the `$schema` and `title` keys that
/// providers do not want removed.
pub fn input_schema_for<T: JsonSchema>() -> Value {
    let schema = schemars::schema_for!(T);
    let mut value = schema.to_value();
    if let Value::Object(map) = &mut value {
        map.remove("$schema");
        map.remove("title");
    }
    value
}

/// Adapts a typed [`Tool`] into a [`DynTool`].
pub struct Erased<T: Tool> {
    tool: T,
    definition: ToolDefinition,
}

impl<T: Tool> fmt::Debug for Erased<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tool")
            .field("name", &self.definition.name)
            .field("terminal", &self.definition.terminal)
            .finish_non_exhaustive()
    }
}

impl<T: Tool> Erased<T> {
    /// Erases `tool`, checking its name now rather than at the first model call.
    pub fn new(tool: T) -> Result<Self, InvalidToolName> {
        let definition =
            ToolDefinition::new(T::NAME, tool.description(), input_schema_for::<T::Args>())?
                .terminal(T::TERMINAL)
                .needs_approval(T::NEEDS_APPROVAL);
        let definition = match T::DELIVERY {
            Some(delivery) => definition.delivery(delivery),
            None => definition,
        };
        Ok(Erased { tool, definition })
    }

    /// Erases `tool` and shares it.
    pub fn shared(tool: T) -> Result<SharedTool, InvalidToolName> {
        Ok(Arc::new(Self::new(tool)?))
    }
}

#[async_trait]
impl<T: Tool> DynTool for Erased<T> {
    fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    fn may_terminate(&self) -> bool {
        <T::Output as IntoToolOutcome>::MAY_TERMINATE
    }

    async fn call_json(
        &self,
        input: &Value,
        cx: ToolContext<'_>,
    ) -> Result<ToolOutcome, ToolCallError> {
        let args =
            T::Args::deserialize(input).map_err(|e| ToolCallError::InvalidInput(e.to_string()))?;
        let output = self
            .tool
            .call(args, &cx)
            .await
            .map_err(|e| ToolCallError::Execution(e.to_string()))?;
        output
            .into_outcome()
            .map_err(|e| ToolCallError::Execution(format!("output is not JSON: {e}")))
    }
}

/// The key under which [`parse_tool_arguments`] keeps the raw text of
/// arguments that are not JSON.
pub const MALFORMED_ARGUMENTS_KEY: &str = "__invalid_arguments";

/// The key under which [`parse_tool_arguments`] keeps the parse error of
/// arguments that are not JSON.
pub const MALFORMED_ARGUMENTS_ERROR_KEY: &str = "__error";

/// Why a tool call's arguments cannot be handed to any tool.
///
/// Checked by [`check_tool_arguments`] before a tool or any policy stage sees
/// the call, so a garbled call never runs with defaults in place of what the
/// model meant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidArguments {
    /// The arguments were not valid JSON (a stream cut short, a server's bad
    /// JSON); see [`parse_tool_arguments`].
    #[error("the arguments are not valid JSON: {error}")]
    Malformed {
        /// The text the model sent.
        raw: String,
        /// Why it did not parse.
        error: String,
    },
    /// The arguments were JSON but not an object.
    #[error("the arguments must be a JSON object, not {found}")]
    NotAnObject {
        /// The JSON type found (`"null"`, `"array"`, ...).
        found: &'static str,
    },
    /// The arguments nest objects and arrays deeper than a history can
    /// hold and read back ([`MAX_ARGUMENT_DEPTH`]).
    #[error("the arguments are nested deeper than {limit} levels")]
    TooDeep {
        /// The deepest nesting accepted.
        limit: usize,
    },
}

/// Tool arguments from the JSON text a provider sent.
///
/// Empty text is `{}` (servers send it for tools without parameters). Text
/// that is not JSON is kept, not guessed at: it becomes
/// `{"__invalid_arguments": <text>, "__error": <parse error>}`, which the
/// history can store and send back as it is, and which
/// [`check_tool_arguments`] refuses before any tool runs.
pub fn parse_tool_arguments(raw: &str) -> Value {
    if raw.trim().is_empty() {
        return Value::Object(serde_json::Map::new());
    }
    match serde_json::from_str(raw) {
        Ok(value) => value,
        Err(error) => {
            let mut map = serde_json::Map::new();
            map.insert(
                MALFORMED_ARGUMENTS_KEY.into(),
                Value::String(raw.to_owned()),
            );
            map.insert(
                MALFORMED_ARGUMENTS_ERROR_KEY.into(),
                Value::String(error.to_string()),
            );
            Value::Object(map)
        }
    }
}

/// Whether `input` can be handed to a tool: a JSON object that is not the
/// marker [`parse_tool_arguments`] leaves for malformed arguments, nested
/// at most [`MAX_ARGUMENT_DEPTH`] deep.
pub fn check_tool_arguments(input: &Value) -> Result<(), InvalidArguments> {
    let found = match input {
        Value::Object(map) => {
            return match map.get(MALFORMED_ARGUMENTS_KEY) {
                Some(raw) => Err(InvalidArguments::Malformed {
                    raw: raw.as_str().map_or_else(|| raw.to_string(), str::to_owned),
                    error: map
                        .get(MALFORMED_ARGUMENTS_ERROR_KEY)
                        .and_then(Value::as_str)
                        .unwrap_or("not JSON")
                        .to_owned(),
                }),
                None if nesting_exceeds(input, MAX_ARGUMENT_DEPTH) => {
                    Err(InvalidArguments::TooDeep {
                        limit: MAX_ARGUMENT_DEPTH,
                    })
                }
                None => Ok(()),
            };
        }
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
    };
    Err(InvalidArguments::NotAnObject { found })
}

/// What the loop records for one tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolExecutionResult {
    /// The call this answers.
    pub call_id: ToolCallId,
    /// The text the model sees.
    pub content: String,
    /// Whether the call failed.
    pub is_error: bool,
    /// Whether the call was a successful terminal tool call.
    pub is_terminal: bool,
    /// Whether the tool asked to end the run ([`TerminateResponse`]).
    pub terminate: Option<TerminateResponse>,
    /// Text for the user rather than the model: a terminal tool's response or a reply's user text.
    pub user_message: Option<UserMessage>,
    /// Images the model sees beside `content` ([`ToolOutcome::Images`]).
    pub images: Vec<ImageData>,
}

impl ToolExecutionResult {
    /// An error result the model can read.
    pub fn error(call_id: ToolCallId, content: impl Into<String>) -> Self {
        ToolExecutionResult {
            call_id,
            content: content.into(),
            is_error: true,
            is_terminal: false,
            terminate: None,
            user_message: None,
            images: Vec::new(),
        }
    }

    /// A successful result.
    pub fn success(call_id: ToolCallId, content: impl Into<String>) -> Self {
        ToolExecutionResult {
            call_id,
            content: content.into(),
            is_error: false,
            is_terminal: false,
            terminate: None,
            user_message: None,
            images: Vec::new(),
        }
    }

    /// The `tool_result` item for the history. `state_known` writes `is_error`
    /// even on success (node tools do; built-ins leave it out).
    pub fn to_item(&self, state_known: bool) -> Item {
        Item::tool_result_with_images(
            self.call_id.clone(),
            self.content.clone(),
            self.is_error_field(state_known),
            self.images.clone(),
        )
    }

    /// [`Self::to_item`], moving the content instead of copying it.
    pub fn into_item(self, state_known: bool) -> Item {
        let is_error = self.is_error_field(state_known);
        Item::tool_result_with_images(self.call_id, self.content, is_error, self.images)
    }

    fn is_error_field(&self, state_known: bool) -> Option<bool> {
        if self.is_error {
            Some(true)
        } else if state_known {
            Some(false)
        } else {
            None
        }
    }
}

/// A borrowed-or-owned description, so static tool texts cost nothing.
pub type Description = Cow<'static, str>;

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_usage_sink_gives_what_was_added_once_and_nothing_when_nothing_was() {
        let sink = UsageSink::new();
        assert_eq!(sink.take(), crate::usage::Usage::default());
        let spent = crate::usage::Usage {
            input_tokens: 3,
            output_tokens: 4,
            ..Default::default()
        };
        sink.add(spent);
        sink.add(spent);
        let taken = sink.take();
        assert_eq!((taken.input_tokens, taken.output_tokens), (6, 8));
        assert_eq!(sink.take(), crate::usage::Usage::default(), "taken once");
        sink.add(spent);
        assert_eq!(sink.take().input_tokens, 3, "added again after a take");
    }

    #[test]
    fn an_images_outcome_is_its_text_for_the_model_and_keeps_its_images() {
        let image = ImageData::new("image/jpeg", "/9j/4AAQ");
        let outcome = ToolOutcome::Images {
            text: "the photo".into(),
            images: vec![image.clone()],
        };
        assert_eq!(outcome.model_text("Finished"), "the photo");
        assert_eq!(outcome.response_text("Finished"), "the photo");
        assert_eq!(outcome.images(), std::slice::from_ref(&image));
        assert!(ToolOutcome::Value(json!("x")).images().is_empty());
    }

    #[test]
    fn arguments_parse_or_are_kept_as_malformed() {
        assert_eq!(parse_tool_arguments(""), json!({}));
        assert_eq!(parse_tool_arguments(r#"{"a":1}"#), json!({"a":1}));
        assert_eq!(check_tool_arguments(&json!({"a": 1})), Ok(()));
        let bad = parse_tool_arguments(r#"{"filter":"#);
        match check_tool_arguments(&bad) {
            Err(InvalidArguments::Malformed { raw, .. }) => assert_eq!(raw, r#"{"filter":"#),
            other => panic!("not refused as malformed: {other:?}"),
        }
        for (input, found) in [
            (json!(null), "null"),
            (json!([1]), "an array"),
            (json!("x"), "a string"),
            (json!(3), "a number"),
        ] {
            assert_eq!(
                check_tool_arguments(&input),
                Err(InvalidArguments::NotAnObject { found })
            );
        }
    }

    #[test]
    fn tool_names_follow_the_provider_rule() {
        assert!(ToolName::new("add").is_ok());
        assert!(ToolName::new("get_endpoint-docs_2").is_ok());
        assert!(ToolName::new("a".repeat(64)).is_ok());
        for bad in ["", "has space", "dot.name", "ünï", &"a".repeat(65)] {
            let err = ToolName::new(bad).unwrap_err();
            assert!(err.to_string().contains("invalid tool name"), "{err}");
        }
        assert!(serde_json::from_value::<ToolName>(json!("bad name")).is_err());
    }

    struct Add;
    #[derive(Deserialize, JsonSchema)]
    struct AddArgs {
        a: i64,
        b: i64,
    }
    #[async_trait]
    impl Tool for Add {
        const NAME: &'static str = "add";
        type Args = AddArgs;
        type Output = i64;
        type Error = std::convert::Infallible;
        fn description(&self) -> String {
            "Add".into()
        }
        async fn call(&self, args: AddArgs, _cx: &ToolContext<'_>) -> Result<i64, Self::Error> {
            Ok(args.a + args.b)
        }
    }

    struct BadName;
    #[async_trait]
    impl Tool for BadName {
        const NAME: &'static str = "bad name";
        type Args = AddArgs;
        type Output = i64;
        type Error = std::convert::Infallible;
        fn description(&self) -> String {
            String::new()
        }
        async fn call(&self, _: AddArgs, _: &ToolContext<'_>) -> Result<i64, Self::Error> {
            Ok(0)
        }
    }

    #[test]
    fn a_bad_name_is_an_error_at_definition_time() {
        assert!(Erased::new(BadName).is_err());
    }

    #[test]
    fn schema_is_derived_from_the_args_type() {
        let t = Erased::new(Add).unwrap();
        let schema = &t.definition().input_schema;
        assert_eq!(schema["type"], "object");
        assert_eq!(schema["properties"]["a"]["type"], "integer");
        assert!(schema.get("$schema").is_none());
    }

    #[tokio::test]
    async fn erased_call_validates_input() {
        let t = Erased::new(Add).unwrap();
        let id = ToolCallId::new("c1");
        let state = NoState::default();
        let cx = ToolContext::new(&id, &[], &state);
        let ok = t.call_json(&json!({"a": 2, "b": 3}), cx).await.unwrap();
        assert_eq!(ok, ToolOutcome::Value(json!(5)));
        let err = t.call_json(&json!({"a": "x"}), cx).await.unwrap_err();
        assert!(err.to_string().starts_with("Invalid tool input: "), "{err}");
    }

    #[test]
    fn string_outputs_are_not_json_quoted() {
        assert_eq!(ToolOutcome::Value(json!("hi")).model_text("F"), "hi");
        assert_eq!(
            ToolOutcome::Value(json!({"a":1})).model_text("F"),
            r#"{"a":1}"#
        );
        assert_eq!(
            ToolOutcome::Terminate(TerminateResponse::default()).model_text("Finished"),
            "Finished"
        );
        let reply = ToolOutcome::Reply(ToolReply::new("for user", "for model"));
        assert_eq!(reply.model_text("F"), "for model");
        assert_eq!(reply.response_text("F"), "for user");
    }
}

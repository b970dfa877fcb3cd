//! Commands: user-invoked operations that bypass inference.
//!
//! A command is declared on a [`Node`](crate::node::Node) or a
//! [`Pack`]. An application runs it by name against a
//! machine (`markov_executor::run_command`); it reads and writes the state of
//! its instance (or pack) through a [`CommandContext`] and returns a
//! [`CommandResult`]: a value, a resume, or a transition
//! ([`TransitionResult`]: replace, spawn, cede, suspend).
//!
//! Implement the typed [`Command`] trait (with `#[async_trait]`, like every
//! markov trait with async methods); builders erase it into a
//! [`DynCommand`]. The input is deserialized from JSON and its schema derived
//! with `schemars`, as for tools.
//!
//! ```
//! use markov_core::async_trait;
//! use markov_charter::command::{Command, CommandContext, CommandError, CommandResult};
//! use markov_charter::node::Node;
//! use schemars::JsonSchema;
//! use serde::{Deserialize, Serialize};
//! use serde_json::json;
//!
//! #[derive(Serialize, Deserialize, JsonSchema)]
//! struct Counter { count: i64 }
//!
//! #[derive(Deserialize, JsonSchema)]
//! struct By { by: i64 }
//!
//! /// Adds `by` to the counter and returns the new count.
//! struct Bump;
//!
//! #[async_trait]
//! impl Command for Bump {
//!     const NAME: &'static str = "bump";
//!     type Input = By;
//!     type Error = CommandError;
//!     fn description(&self) -> String { "Bump the counter".into() }
//!     async fn execute(&self, input: By, cx: &CommandContext<'_>) -> Result<CommandResult, CommandError> {
//!         let Counter { count } = cx.state().map_err(CommandError::failed)?;
//!         cx.update_state(json!({ "count": count + input.by }))?;
//!         Ok(CommandResult::with_payload(json!(count + input.by)))
//!     }
//! }
//!
//! let node = Node::builder("Count.").state(Counter { count: 0 }).command(Bump).build().unwrap();
//! assert_eq!(node.command("bump").unwrap().info().description, "Bump the counter");
//! ```

use std::fmt;
use std::sync::{Arc, Mutex};

use markov_core::async_trait;
use markov_core::message::{Message, Metadata, Source};
use markov_core::{InstanceId, tool::input_schema_for};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::pack::Pack;
use crate::state::{StateSchema, merge_patch};
use crate::transition::TransitionResult;

/// What a command yields (upstream's result types, discriminated by `type`).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum CommandResult {
    /// `command_result`: success with an optional payload; `messages` are
    /// enqueued after the command's state messages.
    Result {
        /// The value returned to the caller.
        payload: Option<Value>,
        /// Messages to enqueue (see [`CommandContext::user_message`] for a
        /// text attributed to the target, upstream's string form).
        messages: Vec<Message>,
    },
    /// `command_resume`: clears the target's suspension.
    Resume,
    /// A transition of the target: replace (`transition`), `spawn`, `cede`
    /// or `suspend`. Pack commands ignore it (upstream's "any other return").
    Transition(TransitionResult),
}

impl CommandResult {
    /// Success without payload or messages (also a pack command's "nothing").
    pub fn done() -> Self {
        CommandResult::Result {
            payload: None,
            messages: Vec::new(),
        }
    }

    /// Success with a payload.
    pub fn with_payload(payload: Value) -> Self {
        command_result(Some(payload), Vec::new())
    }

    /// Appends a message to enqueue (a no-op on results other than
    /// [`CommandResult::Result`]).
    #[must_use]
    pub fn message(mut self, message: Message) -> Self {
        if let CommandResult::Result { messages, .. } = &mut self {
            messages.push(message);
        }
        self
    }
}

impl From<TransitionResult> for CommandResult {
    fn from(result: TransitionResult) -> Self {
        CommandResult::Transition(result)
    }
}

/// `commandResult(payload?, messages?)`.
pub fn command_result(payload: Option<Value>, messages: Vec<Message>) -> CommandResult {
    CommandResult::Result { payload, messages }
}

/// `commandResume()`.
pub fn command_resume() -> CommandResult {
    CommandResult::Resume
}

/// Why a command failed. The display texts are upstream's failure messages
///; `run_command` reports them as values, never raises them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CommandError {
    /// The targeted instance is not in the tree.
    #[error("Instance not found: {0}")]
    InstanceNotFound(InstanceId),
    /// Neither the target's node nor its packs declare the command.
    #[error("Command not found: {0}")]
    NotFound(String),
    /// The input did not fit the command's input type.
    #[error("Invalid input: {0}")]
    InvalidInput(String),
    /// A node command's state update failed validation.
    #[error("Command state update validation failed: {0}")]
    StateUpdate(String),
    /// A pack command's state update failed validation.
    #[error("Pack state update validation failed: {0}")]
    PackStateUpdate(String),
    /// A node command on the root returned a cede.
    #[error("Cannot cede from root instance")]
    CedeFromRoot,
    /// The command failed; the message is its own.
    #[error("{0}")]
    Failed(String),
}

impl CommandError {
    /// A failure carrying `message` as it is (upstream's thrown error).
    pub fn failed(message: impl fmt::Display) -> Self {
        CommandError::Failed(message.to_string())
    }
}

/// What `getAvailableCommands` lists for one command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommandInfo {
    /// The name it is run by.
    pub name: String,
    /// What it does.
    pub description: String,
    /// The JSON Schema of its input.
    #[serde(rename = "inputSchema")]
    pub input_schema: Value,
}

/// A typed command. Implement this; node and pack builders erase it into a
/// [`DynCommand`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a markov command",
    note = "implement `markov_charter::command::Command` with `NAME`, `Input`, `Error`, `description` and `execute`"
)]
#[async_trait]
pub trait Command: Send + Sync + 'static {
    /// The name it is run by (unique among a node's or a pack's commands).
    const NAME: &'static str;
    /// The input, deserialized from the caller's JSON (`Invalid input: <msg>` otherwise).
    type Input: DeserializeOwned + JsonSchema + Send;
    /// The failure; the caller reads its display text as the error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// What the command does.
    fn description(&self) -> String;

    /// Runs the command.
    async fn execute(
        &self,
        input: Self::Input,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, Self::Error>;
}

/// The object-safe form of a command, so a node can hold commands of different types.
#[async_trait]
pub trait DynCommand: Send + Sync + fmt::Debug {
    /// Name, description and input schema.
    fn info(&self) -> &CommandInfo;

    /// The name it is run by.
    fn name(&self) -> &str {
        &self.info().name
    }

    /// Deserializes `input` and runs the command.
    async fn execute_json(
        &self,
        input: Value,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError>;
}

/// A shared, type-erased command.
pub type SharedCommand = Arc<dyn DynCommand>;

/// Adapts a typed [`Command`] into a [`DynCommand`].
pub struct ErasedCommand<C: Command> {
    command: C,
    info: CommandInfo,
}

impl<C: Command> fmt::Debug for ErasedCommand<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Command")
            .field("name", &self.info.name)
            .finish_non_exhaustive()
    }
}

impl<C: Command> ErasedCommand<C> {
    /// Erases `command`, deriving its input schema.
    pub fn new(command: C) -> Self {
        let info = CommandInfo {
            name: C::NAME.to_owned(),
            description: command.description(),
            input_schema: input_schema_for::<C::Input>(),
        };
        ErasedCommand { command, info }
    }

    /// Erases `command` and shares it.
    pub fn shared(command: C) -> SharedCommand {
        Arc::new(Self::new(command))
    }
}

#[async_trait]
impl<C: Command> DynCommand for ErasedCommand<C> {
    fn info(&self) -> &CommandInfo {
        &self.info
    }

    async fn execute_json(
        &self,
        input: Value,
        cx: &CommandContext<'_>,
    ) -> Result<CommandResult, CommandError> {
        let input: C::Input =
            serde_json::from_value(input).map_err(|e| CommandError::InvalidInput(e.to_string()))?;
        self.command
            .execute(input, cx)
            .await
            .map_err(|e| CommandError::Failed(e.to_string()))
    }
}

/// Called with each patch a node command's `update_state` accepted, at once.
pub type OnStateUpdate<'a> = &'a (dyn Fn(&Value) + Send + Sync);

enum Scope<'a> {
    Node {
        history: &'a [Message],
        on_update: Option<OnStateUpdate<'a>>,
    },
    Pack {
        name: &'a str,
    },
}

#[derive(Debug)]
struct Running {
    state: Value,
    patches: Vec<Value>,
}

/// What a command sees: a state snapshot, `update_state`, and (node commands)
/// its instance and that instance's messages.
pub struct CommandContext<'a> {
    target: &'a InstanceId,
    scope: Scope<'a>,
    snapshot: Value,
    schema: &'a dyn StateSchema,
    running: Mutex<Running>,
}

impl fmt::Debug for CommandContext<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("CommandContext");
        d.field("target", self.target);
        match &self.scope {
            Scope::Node { history, .. } => d.field("history_len", &history.len()),
            Scope::Pack { name } => d.field("pack", name),
        };
        d.field("state", &self.snapshot).finish_non_exhaustive()
    }
}

/// The state a command left behind: its running state and every accepted patch, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandUpdates {
    /// The running state after every accepted update (the snapshot when none).
    pub state: Value,
    /// The accepted patches, as given.
    pub patches: Vec<Value>,
}

impl CommandUpdates {
    /// The patches shallow-merged into one (later keys win); `None` when there were none.
    pub fn merged_patch(&self) -> Option<Value> {
        let mut acc = None;
        for p in &self.patches {
            crate::state::accumulate_patch(&mut acc, p);
        }
        acc
    }
}

impl<'a> CommandContext<'a> {
    /// The context of a node command run on instance `target`, whose node
    /// validates with `schema`. `history` is the machine's history.
    pub fn for_node(
        target: &'a InstanceId,
        state: Value,
        schema: &'a dyn StateSchema,
        history: &'a [Message],
    ) -> Self {
        Self::new(
            target,
            Scope::Node {
                history,
                on_update: None,
            },
            state,
            schema,
        )
    }

    /// The context of a command of `pack`, run for instance `target`, with the
    /// pack's current `state`.
    pub fn for_pack(pack: &'a Pack, state: Value, target: &'a InstanceId) -> Self {
        Self::new(
            target,
            Scope::Pack { name: pack.name() },
            state,
            pack.schema(),
        )
    }

    fn new(
        target: &'a InstanceId,
        scope: Scope<'a>,
        state: Value,
        schema: &'a dyn StateSchema,
    ) -> Self {
        CommandContext {
            target,
            scope,
            running: Mutex::new(Running {
                state: state.clone(),
                patches: Vec::new(),
            }),
            snapshot: state,
            schema,
        }
    }

    /// Calls `f` with each patch a node command's `update_state` accepts, as
    /// it is accepted (the executor enqueues a `state` message there).
    #[must_use]
    pub fn on_state_update(mut self, f: OnStateUpdate<'a>) -> Self {
        if let Scope::Node { on_update, .. } = &mut self.scope {
            *on_update = Some(f);
        }
        self
    }

    fn running(&self) -> std::sync::MutexGuard<'_, Running> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state as it was when the command started (updates do not change it).
    pub fn state_json(&self) -> &Value {
        &self.snapshot
    }

    /// The state snapshot deserialized into `S`.
    pub fn state<S: DeserializeOwned>(&self) -> Result<S, serde_json::Error> {
        S::deserialize(&self.snapshot)
    }

    /// The running state: the snapshot with every accepted update merged in.
    pub fn current_state(&self) -> Value {
        self.running().state.clone()
    }

    /// Shallow-merges `patch` into the running state and validates the result
    /// against the node's (or pack's) schema; the parsed value becomes the
    /// running state. A node command's accepted patch is enqueued at once as
    /// its own `state` message; a pack command's patches are merged into one
    /// `packState` message, enqueued when the command returns.
    pub fn update_state(&self, patch: impl Serialize) -> Result<(), CommandError> {
        let refused = |msg: String| match self.scope {
            Scope::Node { .. } => CommandError::StateUpdate(msg),
            Scope::Pack { .. } => CommandError::PackStateUpdate(msg),
        };
        let patch = serde_json::to_value(patch).map_err(|e| refused(e.to_string()))?;
        {
            let mut running = self.running();
            let merged = merge_patch(&running.state, &patch).map_err(|e| refused(e.to_string()))?;
            running.state = self.schema.parse(&merged).map_err(refused)?;
            running.patches.push(patch.clone());
        }
        if let Scope::Node {
            on_update: Some(f), ..
        } = &self.scope
        {
            f(&patch);
        }
        Ok(())
    }

    /// The targeted instance, for node commands (`None` for pack commands).
    pub fn instance_id(&self) -> Option<&'a InstanceId> {
        match self.scope {
            Scope::Node { .. } => Some(self.target),
            Scope::Pack { .. } => None,
        }
    }

    /// The pack, for pack commands.
    pub fn pack_name(&self) -> Option<&'a str> {
        match self.scope {
            Scope::Pack { name } => Some(name),
            Scope::Node { .. } => None,
        }
    }

    /// The messages of the history produced by the target instance (node
    /// commands; empty for pack commands).
    pub fn instance_messages(&self) -> impl Iterator<Item = &'a Message> + 'a {
        let history: &'a [Message] = match self.scope {
            Scope::Node { history, .. } => history,
            Scope::Pack { .. } => &[],
        };
        let id = self.target;
        history
            .iter()
            .filter(move |m| m.source_instance() == Some(id))
    }

    /// A user message attributed to the targeted instance (upstream's string
    /// form of `commandResult(payload, "text")`).
    pub fn user_message(&self, text: impl Into<String>) -> Message {
        Message::user(text).with_metadata(Metadata::with_source(Source {
            instance_id: Some(self.target.clone()),
            ..Source::default()
        }))
    }

    /// The running state and the accepted patches.
    pub fn into_updates(self) -> CommandUpdates {
        let running = self.running.into_inner().unwrap_or_else(|p| p.into_inner());
        CommandUpdates {
            state: running.state,
            patches: running.patches,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::TypedState;
    use serde_json::json;

    #[derive(Serialize, Deserialize, JsonSchema)]
    struct Counter {
        count: i64,
    }

    #[derive(Deserialize, JsonSchema)]
    struct Empty {}

    struct Twice;

    #[async_trait]
    impl Command for Twice {
        const NAME: &'static str = "twice";
        type Input = Empty;
        type Error = CommandError;
        fn description(&self) -> String {
            "Two updates".into()
        }
        async fn execute(
            &self,
            _: Empty,
            cx: &CommandContext<'_>,
        ) -> Result<CommandResult, CommandError> {
            cx.update_state(json!({"count": 1}))?;
            cx.update_state(json!({"count": 2}))?;
            Ok(CommandResult::with_payload(cx.state_json().clone()))
        }
    }

    #[tokio::test]
    async fn updates_validate_and_accumulate() {
        let schema = TypedState::<Counter>::new();
        let id = InstanceId::new("i1");
        let seen = Mutex::new(Vec::new());
        let record = |p: &Value| seen.lock().unwrap().push(p.clone());
        let cx = CommandContext::for_node(&id, json!({"count": 0}), &schema, &[])
            .on_state_update(&record);
        let cmd = ErasedCommand::new(Twice);
        let result = cmd.execute_json(json!({}), &cx).await.unwrap();
        // The payload is the snapshot: updates do not change it.
        assert!(
            matches!(result, CommandResult::Result { payload: Some(p), .. } if p == json!({"count": 0}))
        );
        let err = cx.update_state(json!({"count": "x"})).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("Command state update validation failed: "),
            "{err}"
        );
        let updates = cx.into_updates();
        assert_eq!(updates.state, json!({"count": 2}));
        assert_eq!(updates.merged_patch(), Some(json!({"count": 2})));
        assert_eq!(seen.into_inner().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn bad_input_is_invalid_input() {
        let schema = TypedState::<Counter>::new();
        let id = InstanceId::new("i1");
        let cx = CommandContext::for_node(&id, json!({"count": 0}), &schema, &[]);
        let err = ErasedCommand::new(Twice)
            .execute_json(json!(3), &cx)
            .await
            .unwrap_err();
        assert!(err.to_string().starts_with("Invalid input: "), "{err}");
    }
}

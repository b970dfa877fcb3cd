//! [`Node`]: a behaviour blueprint — instructions, typed state, tools, transitions.
//!
//! Nodes are built with [`NodeBuilder`], which validates and freezes: a tool
//! (or [provider built-in tool](NodeBuilder::provider_tool)) whose name
//! collides with another or with a reserved built-in name (`updateState`,
//! `transition`, `transition_*`), a duplicate transition name or an initial
//! state its schema refuses is an error at build time.
//!
//! ```
//! use markov_charter::node::Node;
//! use schemars::JsonSchema;
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize, JsonSchema)]
//! struct Counter { count: i64 }
//!
//! let node = Node::builder("Count things.")
//!     .name("counter")
//!     .state(Counter { count: 0 })
//!     .build()
//!     .unwrap();
//! assert_eq!(node.initial_state().unwrap()["count"], 0);
//! ```

use std::fmt;
use std::sync::Arc;

use markov_core::NodeId;
use markov_core::model::Thinking;
use markov_core::tool::{ProviderTool, SharedTool, Tool};
use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::command::{Command, ErasedCommand, SharedCommand};
use crate::context::ContextPolicy;
use crate::define::error::ConfigError;
use crate::define::toolset::ToolSet;
use crate::externalize::{Cleanup, ExternalContext, ExternalizeError, StateHandler};
use crate::loop_guard::LoopGuard;
use crate::pack::Pack;
use crate::state::{AnyObject, StateSchema, TypedState, json_type};
use crate::tool_choice::{OutputRestriction, ToolChoiceRule, TurnPolicy, check_thinking};
use crate::transition::Transition;

/// Whether a node receives user input or works beside the node that does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NodeKind {
    /// A normal node: at most one such leaf is active.
    #[default]
    Standard,
    /// A worker: runs in parallel with the primary leaf, has no packs, cedes when done.
    Worker,
}

/// Model settings a node overrides (node > executor defaults).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExecutorConfig {
    /// The model name.
    pub model: Option<String>,
    /// The token limit.
    pub max_tokens: Option<u32>,
    /// The temperature.
    pub temperature: Option<f32>,
}

impl ExecutorConfig {
    /// Reads upstream's `executorConfig` JSON, with its type errors.
    pub fn from_json(value: &Value) -> Result<Self, ConfigError> {
        let mut config = ExecutorConfig::default();
        if let Some(v) = value.get("model") {
            config.model = Some(
                v.as_str()
                    .ok_or_else(|| ConfigError::ExecutorConfigType {
                        key: "model",
                        expected: "a string",
                        got: json_type(v),
                    })?
                    .to_owned(),
            );
        }
        if let Some(v) = value.get("maxTokens") {
            let n = v.as_u64().ok_or_else(|| ConfigError::ExecutorConfigType {
                key: "maxTokens",
                expected: "a number",
                got: json_type(v),
            })?;
            config.max_tokens = Some(u32::try_from(n).unwrap_or(u32::MAX));
        }
        if let Some(v) = value.get("temperature") {
            let t = v.as_f64().ok_or_else(|| ConfigError::ExecutorConfigType {
                key: "temperature",
                expected: "a number",
                got: json_type(v),
            })?;
            config.temperature = Some(t as f32);
        }
        Ok(config)
    }
}

type MapTextBlock = dyn Fn(&str) -> Value + Send + Sync;

/// Structured output: the answer follows a JSON Schema and is recorded as `output` items.
#[derive(Clone)]
pub struct OutputConfig {
    schema: Value,
    map_text_block: Arc<MapTextBlock>,
}

impl fmt::Debug for OutputConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutputConfig")
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

impl OutputConfig {
    /// Output following the schema of `T`; each text block is parsed as JSON
    /// (kept as a string when it is not JSON).
    pub fn of<T: JsonSchema>() -> Self {
        Self::new(markov_core::tool::input_schema_for::<T>(), |text| {
            serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
        })
    }

    /// Output following `schema`, each text block mapped by `map_text_block`.
    pub fn new(
        schema: Value,
        map_text_block: impl Fn(&str) -> Value + Send + Sync + 'static,
    ) -> Self {
        OutputConfig {
            schema,
            map_text_block: Arc::new(map_text_block),
        }
    }

    /// The schema sent to the model.
    pub fn schema(&self) -> &Value {
        &self.schema
    }

    /// Maps one text block of the answer to an application message.
    pub fn map_text_block(&self, text: &str) -> Value {
        (self.map_text_block)(text)
    }
}

pub(crate) struct NodeInner {
    pub(crate) id: NodeId,
    pub(crate) name: Option<String>,
    pub(crate) instructions: String,
    pub(crate) schema: Arc<dyn StateSchema>,
    /// Whether the node was given a state type or schema.
    pub(crate) stateful: bool,
    pub(crate) tools: ToolSet,
    pub(crate) provider_tools: Vec<ProviderTool>,
    pub(crate) transitions: Vec<(String, Transition)>,
    pub(crate) commands: Vec<SharedCommand>,
    pub(crate) initial_state: Option<Value>,
    pub(crate) executor_config: ExecutorConfig,
    pub(crate) output: Option<OutputConfig>,
    pub(crate) packs: Vec<Pack>,
    pub(crate) kind: NodeKind,
    pub(crate) policy: TurnPolicy,
    pub(crate) loop_guard: Option<LoopGuard>,
    pub(crate) externalize: Option<StateHandler>,
    pub(crate) context_policy: Option<ContextPolicy>,
}

/// A behaviour blueprint. Cheap to clone (shared); identity is its [`NodeId`].
#[derive(Clone)]
pub struct Node(pub(crate) Arc<NodeInner>);

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.0.id)
            .field("name", &self.0.name)
            .field("kind", &self.0.kind)
            .field("tools", &self.0.tools.len())
            .field("transitions", &self.0.transitions.len())
            .field("commands", &self.0.commands.len())
            .finish_non_exhaustive()
    }
}

impl PartialEq for Node {
    fn eq(&self, other: &Self) -> bool {
        self.0.id == other.0.id
    }
}

impl Node {
    /// A builder for a node with these instructions.
    pub fn builder(instructions: impl Into<String>) -> NodeBuilder {
        NodeBuilder::new(instructions)
    }

    /// The node's identity.
    pub fn id(&self) -> &NodeId {
        &self.0.id
    }

    /// The node's name, if given.
    pub fn name(&self) -> Option<&str> {
        self.0.name.as_deref()
    }

    /// The instructions.
    pub fn instructions(&self) -> &str {
        &self.0.instructions
    }

    /// Whether the node has state of its own: a state type or schema was
    /// given. By default only such a node is offered `updateState` and
    /// shown its state in the prompt
    /// ([`PromptStyle`](crate::charter::PromptStyle)).
    pub fn has_state(&self) -> bool {
        self.0.stateful
    }

    /// The state schema.
    pub fn schema(&self) -> &dyn StateSchema {
        &*self.0.schema
    }

    /// The node's own tools.
    pub fn tools(&self) -> &ToolSet {
        &self.0.tools
    }

    /// The provider built-in tools declared on the node, in declaration
    /// order: tools the provider runs itself (see [`ProviderTool`]).
    pub fn provider_tools(&self) -> &[ProviderTool] {
        &self.0.provider_tools
    }

    /// The provider built-in tool called `name`, if the node declares one.
    pub fn provider_tool(&self, name: &str) -> Option<&ProviderTool> {
        self.0.provider_tools.iter().find(|t| t.name == *name)
    }

    /// The transitions, in declaration order.
    pub fn transitions(&self) -> &[(String, Transition)] {
        &self.0.transitions
    }

    /// The transition called `name`.
    pub fn transition(&self, name: &str) -> Option<&Transition> {
        self.0
            .transitions
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
    }

    /// The commands, in declaration order.
    pub fn commands(&self) -> &[SharedCommand] {
        &self.0.commands
    }

    /// The command called `name`.
    pub fn command(&self, name: &str) -> Option<&SharedCommand> {
        self.0.commands.iter().find(|c| c.name() == name)
    }

    /// The initial state, if any.
    pub fn initial_state(&self) -> Option<&Value> {
        self.0.initial_state.as_ref()
    }

    /// Model settings this node overrides.
    pub fn executor_config(&self) -> &ExecutorConfig {
        &self.0.executor_config
    }

    /// Structured output, if the node declares it.
    pub fn output(&self) -> Option<&OutputConfig> {
        self.0.output.as_ref()
    }

    /// Packs declared on the node.
    pub fn packs(&self) -> &[Pack] {
        &self.0.packs
    }

    /// Standard or worker.
    pub fn kind(&self) -> NodeKind {
        self.0.kind
    }

    /// Whether this is a worker node.
    pub fn is_worker(&self) -> bool {
        self.0.kind == NodeKind::Worker
    }

    /// The node's own loop guard, if it sets one (else the charter's applies).
    pub fn loop_guard(&self) -> Option<LoopGuard> {
        self.0.loop_guard
    }

    /// The node's own context policy, which overrides its agent's (see
    /// [`crate::context`]).
    pub fn context_policy(&self) -> Option<&ContextPolicy> {
        self.0.context_policy.as_ref()
    }

    /// How the loop treats this node's turns: output restriction, tool choice.
    pub fn policy(&self) -> &TurnPolicy {
        &self.0.policy
    }

    /// The externalized-state handler, if the node declares one (see
    /// [`crate::externalize`]).
    pub fn externalize_handler(&self) -> Option<&StateHandler> {
        self.0.externalize.as_ref()
    }

    /// The state schema, shared.
    pub fn shared_schema(&self) -> Arc<dyn StateSchema> {
        Arc::clone(&self.0.schema)
    }
}

/// Builds a [`Node`]; [`NodeBuilder::build`] validates everything at once.
#[derive(Debug)]
pub struct NodeBuilder {
    name: Option<String>,
    instructions: String,
    schema: Arc<dyn StateSchema>,
    stateful: bool,
    tools: Vec<SharedTool>,
    provider_tools: Vec<ProviderTool>,
    transitions: Vec<(String, Transition)>,
    commands: Vec<SharedCommand>,
    initial_state: Option<Result<Value, String>>,
    executor_config: ExecutorConfig,
    output: Option<OutputConfig>,
    packs: Vec<Pack>,
    kind: NodeKind,
    policy: TurnPolicy,
    loop_guard: Option<LoopGuard>,
    externalize: Option<StateHandler>,
    context_policy: Option<ContextPolicy>,
    errors: Vec<ConfigError>,
}

/// Names the loop reserves for its built-in tools.
pub fn is_reserved_tool_name(name: &str) -> bool {
    name == "updateState" || name == "transition" || name.starts_with("transition_")
}

impl NodeBuilder {
    fn new(instructions: impl Into<String>) -> Self {
        NodeBuilder {
            name: None,
            instructions: instructions.into(),
            schema: Arc::new(AnyObject),
            stateful: false,
            tools: Vec::new(),
            provider_tools: Vec::new(),
            transitions: Vec::new(),
            commands: Vec::new(),
            // A node without a state type keeps an empty object as state.
            initial_state: Some(Ok(Value::Object(serde_json::Map::new()))),
            executor_config: ExecutorConfig::default(),
            output: None,
            packs: Vec::new(),
            kind: NodeKind::Standard,
            policy: TurnPolicy::default(),
            loop_guard: None,
            context_policy: None,
            externalize: None,
            errors: Vec::new(),
        }
    }

    /// Names the node.
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Types the state as `S`, starting from `initial`.
    #[must_use]
    pub fn state<S>(mut self, initial: S) -> Self
    where
        S: Serialize + DeserializeOwned + JsonSchema + 'static,
    {
        self.schema = Arc::new(TypedState::<S>::new());
        self.stateful = true;
        self.initial_state = Some(serde_json::to_value(initial).map_err(|e| e.to_string()));
        self
    }

    /// Types the state as `S` without an initial state.
    #[must_use]
    pub fn state_type<S>(mut self) -> Self
    where
        S: Serialize + DeserializeOwned + JsonSchema + 'static,
    {
        self.schema = Arc::new(TypedState::<S>::new());
        self.stateful = true;
        self.initial_state = None;
        self
    }

    /// Uses a custom schema and initial state.
    #[must_use]
    pub fn schema(mut self, schema: Arc<dyn StateSchema>, initial: Option<Value>) -> Self {
        self.schema = schema;
        self.stateful = true;
        self.initial_state = initial.map(Ok);
        self
    }

    /// Adds a typed tool.
    #[must_use]
    pub fn tool<T: Tool>(mut self, tool: T) -> Self {
        match markov_core::tool::Erased::shared(tool) {
            Ok(t) => self.tools.push(t),
            Err(e) => self.errors.push(e.into()),
        }
        self
    }

    /// Adds an erased tool.
    #[must_use]
    pub fn shared_tool(mut self, tool: SharedTool) -> Self {
        self.tools.push(tool);
        self
    }

    /// Declares a provider built-in tool: a tool the provider runs
    /// itself, such as Anthropic's web search. It is offered to the model
    /// beside the node's tools; the loop never runs it and writes no result
    /// for its calls. Its name must not collide with the node's tools,
    /// another provider tool or a reserved built-in name.
    ///
    /// ```
    /// use markov_core::tool::ProviderTool;
    /// use markov_charter::node::Node;
    /// use serde_json::json;
    ///
    /// let search = ProviderTool::new("web_search_20250305", "web_search")?
    ///     .with("max_uses", json!(5));
    /// let node = Node::builder("Answer with sources.").provider_tool(search).build()?;
    /// assert_eq!(node.provider_tools()[0].kind, "web_search_20250305");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn provider_tool(mut self, tool: ProviderTool) -> Self {
        self.provider_tools.push(tool);
        self
    }

    /// Adds a transition under `name`.
    #[must_use]
    pub fn transition(mut self, name: impl Into<String>, transition: Transition) -> Self {
        self.transitions.push((name.into(), transition));
        self
    }

    /// Adds a typed command (see [`crate::command`]).
    #[must_use]
    pub fn command<C: Command>(mut self, command: C) -> Self {
        self.commands.push(ErasedCommand::shared(command));
        self
    }

    /// Adds an erased command under `key`, which must equal its name
    /// (`Node command name mismatch` otherwise).
    #[must_use]
    pub fn shared_command(mut self, key: impl Into<String>, command: SharedCommand) -> Self {
        let key = key.into();
        if key != command.name() {
            self.errors.push(ConfigError::CommandNameMismatch {
                key,
                name: command.name().to_owned(),
            });
        }
        self.commands.push(command);
        self
    }

    /// Overrides model settings for this node.
    #[must_use]
    pub fn executor_config(mut self, config: ExecutorConfig) -> Self {
        self.executor_config = config;
        self
    }

    /// Declares structured output.
    #[must_use]
    pub fn output(mut self, output: OutputConfig) -> Self {
        self.output = Some(output);
        self
    }

    /// Declares a pack (not allowed on workers).
    #[must_use]
    pub fn pack(mut self, pack: Pack) -> Self {
        self.packs.push(pack);
        self
    }

    /// Externalizes the state of this node's instances: the
    /// handler is called once per instance with its
    /// [`ExternalContext`], and from then on `state` messages for the
    /// instance reach its callbacks instead of the tree. See
    /// [`crate::externalize`].
    #[must_use]
    pub fn externalize(
        self,
        handler: impl Fn(&ExternalContext) -> Result<Option<Cleanup>, ExternalizeError>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.state_handler(StateHandler::new(handler))
    }

    /// Externalizes the state with a handler shared with other nodes.
    #[must_use]
    pub fn state_handler(mut self, handler: StateHandler) -> Self {
        self.externalize = Some(handler);
        self
    }

    /// Makes this a worker node.
    #[must_use]
    pub fn worker(mut self) -> Self {
        self.kind = NodeKind::Worker;
        self
    }

    /// How many identical tool calls this node's leaves may make per user
    /// turn, instead of the charter's
    /// ([`LoopGuard::OFF`] for no limit).
    #[must_use]
    pub fn loop_guard(mut self, guard: LoopGuard) -> Self {
        self.loop_guard = Some(guard);
        self
    }

    /// Sets how the loop treats this node's turns.
    #[must_use]
    pub fn policy(mut self, policy: TurnPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets the output restriction (see [`OutputRestriction`]).
    #[must_use]
    pub fn restriction(mut self, restriction: OutputRestriction) -> Self {
        self.policy.restriction = restriction;
        self
    }

    /// Sets the tool-choice rule (see [`ToolChoiceRule`]).
    #[must_use]
    pub fn tool_choice(mut self, policy: ToolChoiceRule) -> Self {
        self.policy.tool_choice = policy;
        self
    }

    /// Enables extended thinking for this node's calls. Checked against the
    /// tool-choice rule and temperature when the node is built.
    #[must_use]
    pub fn thinking(mut self, thinking: Thinking) -> Self {
        self.policy.thinking = Some(thinking);
        self
    }

    /// What this node's model calls are shown of a long history, instead
    /// of its agent's policy (see [`crate::context`]).
    #[must_use]
    pub fn context_policy(mut self, policy: ContextPolicy) -> Self {
        self.context_policy = Some(policy);
        self
    }

    /// Validates and freezes the node.
    pub fn build(mut self) -> Result<Node, ConfigError> {
        if let Some(e) = self.errors.drain(..).next() {
            return Err(e);
        }
        let label = self.name.clone().unwrap_or_else(|| "<unnamed>".into());
        let mut tools = ToolSet::new();
        for tool in self.tools {
            let name = tool.definition().name.as_str();
            if is_reserved_tool_name(name) {
                return Err(ConfigError::ReservedToolName {
                    node: label,
                    tool: name.to_owned(),
                });
            }
            tools.add_shared(tool)?;
        }
        for (i, tool) in self.provider_tools.iter().enumerate() {
            let name = tool.name.as_str();
            if is_reserved_tool_name(name) {
                return Err(ConfigError::ReservedToolName {
                    node: label,
                    tool: name.to_owned(),
                });
            }
            if tools.get(name).is_some()
                || self.provider_tools[..i].iter().any(|t| t.name == tool.name)
            {
                return Err(ConfigError::DuplicateTool(name.to_owned()));
            }
        }
        for (i, (name, _)) in self.transitions.iter().enumerate() {
            if self.transitions[..i].iter().any(|(n, _)| n == name) {
                return Err(ConfigError::DuplicateTransition {
                    node: label,
                    transition: name.clone(),
                });
            }
        }
        for (i, command) in self.commands.iter().enumerate() {
            if self.commands[..i]
                .iter()
                .any(|c| c.name() == command.name())
            {
                return Err(ConfigError::DuplicateCommand {
                    owner: label,
                    command: command.name().to_owned(),
                });
            }
        }
        if self.kind == NodeKind::Worker && !self.packs.is_empty() {
            return Err(ConfigError::WorkerWithPacks(label));
        }
        let initial_state =
            match self.initial_state {
                None => None,
                Some(Err(e)) => {
                    return Err(ConfigError::InvalidInitialState {
                        node: label,
                        message: e,
                    });
                }
                Some(Ok(v)) => Some(self.schema.parse(&v).map_err(|message| {
                    ConfigError::InvalidInitialState {
                        node: label.clone(),
                        message,
                    }
                })?),
            };
        let node = Node(Arc::new(NodeInner {
            id: NodeId::new(uuid::Uuid::new_v4().to_string()),
            name: self.name,
            instructions: self.instructions,
            schema: self.schema,
            stateful: self.stateful,
            tools,
            provider_tools: self.provider_tools,
            transitions: self.transitions,
            commands: self.commands,
            initial_state,
            executor_config: self.executor_config,
            output: self.output,
            packs: self.packs,
            kind: self.kind,
            policy: self.policy,
            loop_guard: self.loop_guard,
            context_policy: self.context_policy,
            externalize: self.externalize,
        }));
        validate_policy(node.policy(), &node)?;
        Ok(node)
    }
}

/// Checks a node's turn policy against the node: `Named` names one of its
/// tools, `Required` has a way out, thinking fits the tool choice.
fn validate_policy(policy: &TurnPolicy, node: &Node) -> Result<(), ConfigError> {
    let label = || node.name().unwrap_or("<unnamed>").to_owned();
    match &policy.tool_choice {
        ToolChoiceRule::Named(tool) if node.tools().get(tool.as_str()).is_none() => {
            return Err(ConfigError::UnknownNamedTool {
                node: label(),
                tool: tool.to_string(),
            });
        }
        ToolChoiceRule::Required => {
            let has_exit = !node.transitions().is_empty()
                || node
                    .tools()
                    .iter()
                    .any(|t| t.definition().terminal || t.may_terminate());
            if !has_exit {
                return Err(ConfigError::RequiredWithoutExit(label()));
            }
        }
        _ => {}
    }
    if let Some(thinking) = policy.thinking {
        check_thinking(
            thinking,
            thinking.allows(),
            &policy.tool_choice,
            node.executor_config().temperature,
        )
        .map_err(|constraint| ConfigError::ThinkingConflict {
            node: label(),
            constraint,
        })?;
    }
    Ok(())
}

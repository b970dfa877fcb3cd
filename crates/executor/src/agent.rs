//! [`Agent`]: one value that describes an agent — its nodes or
//! instructions, its tools and their policies, its model, settings and
//! limits — built once, validated, frozen and cheap to clone. Everything
//! that runs an agent takes it: a machine in memory ([`Agent::machine`]), a
//! restored snapshot ([`Agent::restore`]), a durable session
//! (`markov_store::DurableMachine::open`) and the HTTP service
//! (`markov_server::router`).

use std::sync::Arc;

use markov_charter::ConfigError;
use markov_charter::charter::{Charter, CharterBuilder};
use markov_charter::context::ContextPolicy;
use markov_charter::node::{Node, NodeBuilder, OutputConfig};
use markov_core::model::{Model, ModelSettings};
use markov_core::tool::{SharedTool, Tool};
use markov_policy::{
    Budget, EnvelopeMode, ErrorFormat, Mode, PolicyConfig, RegistryError, ToolMetadata,
    ToolRegistry, ToolRegistryBuilder,
};
use schemars::JsonSchema;
use serde_json::Value;

use crate::error::RunError;
use crate::executor::Executor;
use crate::instance::Instance;
use crate::machine::Machine;
use crate::run::RunOptions;
use crate::serialize::{DeserializeError, SerializedMachine, deserialize_machine};
use crate::standard::{StandardExecutor, Unservable};
use crate::stream::MessageStreamEvent;
use crate::usage::{Prices, UsageLimits};

/// An agent, ready to run: see [`Agent::builder`].
///
/// Cloning is cheap (one reference count); every machine made from it
/// shares its charter, model and tool registry.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

struct Inner {
    charter: Charter,
    start: Node,
    state: Value,
    executor: Arc<dyn Executor>,
    /// The standard executor the agent runs on, when it does: the server
    /// streams its model calls ([`Agent::streamed`]).
    standard: Option<StandardExecutor>,
    run: RunOptions,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.name())
            .field("start", &self.inner.start.name())
            .finish_non_exhaustive()
    }
}

/// An agent that could not be built: the option or the node or tool at
/// fault is named.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// Neither a model nor an executor was given.
    #[error("agent {agent:?} has no model: call `model` (or `executor`) on its builder")]
    NoModel {
        /// The agent.
        agent: String,
    },
    /// Neither instructions nor a node was given.
    #[error("agent {agent:?} has nothing to run: give it `instructions` or a `node`")]
    NoNode {
        /// The agent.
        agent: String,
    },
    /// `start` names no node of the agent.
    #[error("agent {agent:?} starts at node {node:?}, which it does not have")]
    UnknownStart {
        /// The agent.
        agent: String,
        /// The name given to `start`.
        node: String,
    },
    /// Two options that cannot be used together.
    #[error("agent {agent:?}: `{option}` cannot be used with `{with}`: {why}")]
    Conflict {
        /// The agent.
        agent: String,
        /// The option set second.
        option: &'static str,
        /// The option it conflicts with.
        with: &'static str,
        /// What to do instead.
        why: &'static str,
    },
    /// A node (the agent's own, made of its instructions, or one given with
    /// `node`) or the charter could not be built.
    #[error("agent {agent:?}, node {node:?}: {source}")]
    Node {
        /// The agent.
        agent: String,
        /// The node's name.
        node: String,
        /// Why.
        #[source]
        source: ConfigError,
    },
    /// The charter (nodes, packs, transitions by reference) is inconsistent.
    #[error("agent {agent:?}: {source}")]
    Charter {
        /// The agent.
        agent: String,
        /// Why.
        #[source]
        source: ConfigError,
    },
    /// A tool given with `tool_with` could not be registered.
    #[error("agent {agent:?}: {source}")]
    Tool {
        /// The agent.
        agent: String,
        /// Why (the tool is named).
        #[source]
        source: RegistryError,
    },
    /// The model cannot be offered a node's tools or output type: its
    /// provider cannot express a schema (Gemini's dialect has no maps, for
    /// one). Found when the agent is built, by
    /// [`Model::check_tools`], rather than at the node's first model call.
    #[error("agent {agent:?}, node {node:?}: the model cannot be offered {}: {source}", offered(.source))]
    Unsupported {
        /// The agent.
        agent: String,
        /// The node's name.
        node: String,
        /// What the model refuses (the tool, or the output type), and why.
        #[source]
        source: markov_core::Unsupported,
    },
    /// A node's context policy compacts with a vendor's own compaction
    /// (`Summarize::native`) that cannot serve the agent's model: the
    /// policy's model offers none (`makes` is `None`), or it makes items
    /// of a vendor the agent's model does not read
    /// ([`Model::native_summaries`]).
    #[error("agent {agent:?}, node {node:?}: {}", native_mismatch(.makes.as_deref(), .reads.as_deref()))]
    NativeCompaction {
        /// The agent.
        agent: String,
        /// The node's name.
        node: String,
        /// The vendor of the items the policy's model makes, if it makes any.
        makes: Option<String>,
        /// The vendor of the items the agent's model reads, if it reads any.
        reads: Option<String>,
    },
    /// The start state does not fit the start node.
    #[error("agent {agent:?}: {source}")]
    State {
        /// The agent.
        agent: String,
        /// Why.
        #[source]
        source: RunError,
    },
}

/// Why a native compaction cannot serve a model, as
/// [`BuildError::NativeCompaction`] says it.
fn native_mismatch(makes: Option<&str>, reads: Option<&str>) -> String {
    match (makes, reads) {
        (None, _) => "Summarize::native needs a model with a compaction of its own (OpenAI's Responses API); use Summarize::new with a summarizer model instead".to_owned(),
        (Some(makes), None) => format!("the context policy's compaction makes {makes} items, which the agent's model cannot read; use Summarize::new instead"),
        (Some(makes), Some(reads)) => format!("the context policy's compaction makes {makes} items, but the agent's model reads {reads} items only"),
    }
}

/// What a refusal is about, as [`BuildError::Unsupported`] names it.
fn offered(refused: &markov_core::Unsupported) -> String {
    match &refused.tool {
        Some(tool) => format!("tool {:?}", tool.as_str()),
        None => "its output type".to_owned(),
    }
}

impl Agent {
    /// Starts describing an agent named `name`.
    ///
    /// A one-node agent is given [`instructions`](AgentBuilder::instructions)
    /// and [`tool`](AgentBuilder::tool)s; an agent of several nodes is given
    /// [`node`](AgentBuilder::node)s. Tools given with
    /// [`tool_with`](AgentBuilder::tool_with) run under the policy pipeline
    /// (budgets, approvals, idempotency, latency) and are offered to every
    /// node.
    ///
    /// ```
    /// use markov_executor::Agent;
    /// use markov_testkit::ScriptedModel;
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let agent = Agent::builder("greeter")
    ///     .instructions("Greet the user.")
    ///     .model(ScriptedModel::builder().text("Hello!").build())
    ///     .build()
    ///     .unwrap();
    /// let mut machine = agent.machine();
    /// machine.enqueue_user("hi");
    /// let last = machine.run().await.unwrap();
    /// assert!(last.done);
    /// # });
    /// ```
    pub fn builder(name: impl Into<String>) -> AgentBuilder {
        let name = name.into();
        AgentBuilder {
            charter: Charter::builder(name.clone()),
            charter_configured: false,
            charter_given: None,
            name,
            instructions: None,
            node: None,
            nodes: Vec::new(),
            start: None,
            state: None,
            registry: None,
            registry_given: false,
            tools_with: false,
            policies: None,
            mode: None,
            model: None,
            executor: None,
            settings: None,
            context_policy: None,
            run: None,
            prices: None,
        }
    }

    /// Starts describing an agent over a charter built elsewhere (its nodes,
    /// packs, transitions and charter tools; the agent's name is the
    /// charter's), as a port of a markov-machines program has one. The
    /// first node registered is where conversations start unless
    /// [`start`](AgentBuilder::start) names another; the model, tools under
    /// policies and limits are given as for [`builder`](Self::builder).
    /// Nodes, instructions and [`charter`](AgentBuilder::charter) belong to
    /// the charter given: giving them too is a build error.
    pub fn on_charter(charter: Charter) -> AgentBuilder {
        let mut builder = Self::builder(charter.name());
        builder.charter_given = Some(charter);
        builder
    }

    /// Whether `a` and `b` are the same agent: clones of one built value,
    /// so that a machine one of them restored runs exactly as if the other
    /// had. Two agents built alike are not the same.
    pub fn ptr_eq(a: &Agent, b: &Agent) -> bool {
        Arc::ptr_eq(&a.inner, &b.inner)
    }

    /// The agent's name (its charter's).
    pub fn name(&self) -> &str {
        self.inner.charter.name()
    }

    /// The charter: every node, pack and transition by reference.
    pub fn charter(&self) -> &Charter {
        &self.inner.charter
    }

    /// The node a new conversation starts at.
    pub fn start_node(&self) -> &Node {
        &self.inner.start
    }

    /// The state a new conversation starts with.
    pub fn start_state(&self) -> &Value {
        &self.inner.state
    }

    /// What runs each step's leaves (a model call and the tools it asks
    /// for, with the standard executor).
    pub fn executor(&self) -> &Arc<dyn Executor> {
        &self.inner.executor
    }

    /// The limits of each run ([`Machine::run`]).
    pub fn run_options(&self) -> &RunOptions {
        &self.inner.run
    }

    /// A new conversation with this agent, in memory.
    pub fn machine(&self) -> Machine {
        let inner = &self.inner;
        Machine::fresh(
            inner.charter.clone(),
            Arc::clone(&inner.executor),
            Instance::new(inner.start.clone(), inner.state.clone()),
            inner.run.clone(),
        )
    }

    /// A new conversation with this agent whose instance tree is `root`
    /// instead of the start node (a tree prepared by the application: a
    /// parent with children, packs, another start state). The tree is
    /// checked as [`build`](AgentBuilder::build) checks the start: each
    /// state against its node's schema, each node against the charter.
    pub fn machine_at(&self, root: Instance) -> Result<Machine, RunError> {
        Machine::from_tree(
            self.inner.charter.clone(),
            Arc::clone(&self.inner.executor),
            root,
            self.inner.run.clone(),
        )
    }

    /// A conversation with this agent restored from its snapshot
    /// ([`serialize_machine`](crate::serialize_machine)).
    pub fn restore(&self, snapshot: SerializedMachine) -> Result<Machine, DeserializeError> {
        let mut machine = deserialize_machine(
            self.inner.charter.clone(),
            Arc::clone(&self.inner.executor),
            snapshot,
        )?;
        machine.set_run_options(self.inner.run.clone());
        Ok(machine)
    }

    /// This agent with its model calls streamed to `callback` (see
    /// [`StandardExecutor::with_streaming`]), for a service that shows
    /// answers as they are written. An agent built with its own
    /// [`executor`](AgentBuilder::executor) streams as that executor was
    /// built to: it is returned as it is, and the answer says so.
    pub fn streamed(
        &self,
        callback: impl Fn(&MessageStreamEvent) + Send + Sync + 'static,
    ) -> Result<Agent, Agent> {
        let Some(standard) = &self.inner.standard else {
            return Err(self.clone());
        };
        let standard = standard.clone().with_streaming(callback);
        Ok(Agent {
            inner: Arc::new(Inner {
                charter: self.inner.charter.clone(),
                start: self.inner.start.clone(),
                state: self.inner.state.clone(),
                executor: Arc::new(standard.clone()),
                standard: Some(standard),
                run: self.inner.run.clone(),
            }),
        })
    }
}

/// Describes an [`Agent`]; [`build`](Self::build) validates and freezes it.
pub struct AgentBuilder {
    name: String,
    charter: CharterBuilder,
    /// Whether `charter(..)` was called.
    charter_configured: bool,
    /// The charter given whole to [`Agent::on_charter`].
    charter_given: Option<Charter>,
    instructions: Option<String>,
    /// What `tool` and `output` add to the one node made of the
    /// instructions (`Some` once any of the three is given).
    node: Option<Vec<NodeOp>>,
    nodes: Vec<(String, Node)>,
    start: Option<String>,
    state: Option<Value>,
    registry: Option<ToolRegistryBuilder>,
    /// Whether `registry` came whole from [`AgentBuilder::registry`].
    registry_given: bool,
    /// Whether `tool_with` was called.
    tools_with: bool,
    policies: Option<PolicyConfig>,
    mode: Option<Mode>,
    model: Option<Arc<dyn Model>>,
    executor: Option<Arc<dyn Executor>>,
    settings: Option<ModelSettings>,
    context_policy: Option<ContextPolicy>,
    run: Option<RunOptions>,
    prices: Option<Prices>,
}

impl std::fmt::Debug for AgentBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentBuilder")
            .field("name", &self.name)
            .field("nodes", &self.nodes.len())
            .field("model", &self.model.is_some())
            .field("executor", &self.executor.is_some())
            .finish_non_exhaustive()
    }
}

/// One addition to the one-node agent's node.
type NodeOp = Box<dyn FnOnce(NodeBuilder) -> NodeBuilder + Send>;

const ONE_NODE: &str = "an agent is either one node (instructions, tool, output) or several (node): give the instructions to a node of their own";

impl AgentBuilder {
    fn one_node(&mut self) -> &mut Vec<NodeOp> {
        self.node.get_or_insert_with(Vec::new)
    }

    /// The instructions of a one-node agent.
    #[must_use]
    pub fn instructions(mut self, instructions: impl Into<String>) -> Self {
        self.instructions = Some(instructions.into());
        self.one_node();
        self
    }

    /// A tool of the agent's one node, run as the node's tools are (no
    /// policy stage; see [`tool_with`](Self::tool_with) for those).
    #[must_use]
    pub fn tool<T: Tool>(mut self, tool: T) -> Self {
        self.one_node().push(Box::new(move |node| node.tool(tool)));
        self
    }

    /// [`tool`](Self::tool) for a tool known only at run time (such as an
    /// MCP server's, `markov_mcp::McpClient::tools`).
    #[must_use]
    pub fn shared_tool(mut self, tool: SharedTool) -> Self {
        self.one_node()
            .push(Box::new(move |node| node.shared_tool(tool)));
        self
    }

    /// A tool under the policy pipeline, offered to every node: `metadata`
    /// says its category (for budgets and audit), whether it needs the
    /// application's approval, its latency budget and the modes it may run
    /// in. Its completed calls are never repeated, even across a crash.
    #[must_use]
    pub fn tool_with<T: Tool>(mut self, tool: T, metadata: ToolMetadata) -> Self {
        let registry = self
            .registry
            .take()
            .unwrap_or_else(|| ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED)));
        self.registry = Some(registry.register(tool, metadata));
        self.tools_with = true;
        self
    }

    /// [`tool_with`](Self::tool_with) for a tool known only at run time
    /// (such as an MCP server's, with `markov_mcp::McpClient::default_metadata`).
    #[must_use]
    pub fn shared_tool_with(mut self, tool: SharedTool, metadata: ToolMetadata) -> Self {
        let registry = self
            .registry
            .take()
            .unwrap_or_else(|| ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED)));
        self.registry = Some(registry.register_shared(tool, metadata));
        self.tools_with = true;
        self
    }

    /// Tools already registered with their metadata and policies (such as
    /// an MCP server's, `markov_mcp::McpClient::register`), instead of
    /// [`tool_with`](Self::tool_with) and [`policies`](Self::policies).
    #[must_use]
    pub fn registry(mut self, registry: ToolRegistryBuilder) -> Self {
        self.registry = Some(registry);
        self.registry_given = true;
        self
    }

    /// The budgets, approval lifetime, idempotency limits and result format
    /// of the tools given with [`tool_with`](Self::tool_with). By default:
    /// no budget, and results as the tools' own text (no JSON envelope).
    #[must_use]
    pub fn policies(mut self, config: PolicyConfig) -> Self {
        self.policies = Some(config);
        self
    }

    /// The mode the policy pipeline runs calls in (default
    /// [`Mode::TEXT`]).
    #[must_use]
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = Some(mode);
        self
    }

    /// The type of the one node's final answer: the model is asked for JSON
    /// of `T`'s schema, read with [`Machine::run_typed`].
    #[must_use]
    pub fn output<T: JsonSchema>(mut self) -> Self {
        let output = OutputConfig::of::<T>();
        self.one_node()
            .push(Box::new(move |node| node.output(output)));
        self
    }

    /// A node, registered as `name`. The first node is where conversations
    /// start unless [`start`](Self::start) names another.
    #[must_use]
    pub fn node(mut self, name: impl Into<String>, node: Node) -> Self {
        self.nodes.push((name.into(), node));
        self
    }

    /// Conversations start at the node registered as `name`.
    #[must_use]
    pub fn start(mut self, name: impl Into<String>) -> Self {
        self.start = Some(name.into());
        self
    }

    /// The state conversations start with (else the start node's initial
    /// state, else `{}`).
    #[must_use]
    pub fn state(mut self, state: Value) -> Self {
        self.state = Some(state);
        self
    }

    /// More of the charter: packs, charter tools, transitions by reference.
    #[must_use]
    pub fn charter(mut self, f: impl FnOnce(CharterBuilder) -> CharterBuilder) -> Self {
        self.charter = f(self.charter);
        self.charter_configured = true;
        self
    }

    /// The model the agent's steps call.
    #[must_use]
    pub fn model(self, model: impl Model + 'static) -> Self {
        self.shared_model(Arc::new(model))
    }

    /// [`model`](Self::model), shared with other agents.
    #[must_use]
    pub fn shared_model(mut self, model: Arc<dyn Model>) -> Self {
        self.model = Some(model);
        self
    }

    /// What the model is shown of a long conversation (see
    /// [`markov_charter::context`]): keep the last turns, trim old tool
    /// results, summarize older turns. A node's own policy
    /// ([`NodeBuilder::context_policy`]) overrides it. Without one, every
    /// call is sent the whole history, and a model that refuses it as too
    /// long ends the run with
    /// [`YieldReason::ContextExhausted`](crate::YieldReason::ContextExhausted).
    #[must_use]
    pub fn context_policy(mut self, policy: ContextPolicy) -> Self {
        self.context_policy = Some(policy);
        self
    }

    /// Default model settings (a node's executor config overrides them).
    #[must_use]
    pub fn settings(mut self, settings: ModelSettings) -> Self {
        self.settings = Some(settings);
        self
    }

    /// The step limit of each run (default
    /// [`DEFAULT_MAX_STEPS`](crate::DEFAULT_MAX_STEPS)).
    #[must_use]
    pub fn max_steps(mut self, max_steps: usize) -> Self {
        let run = self.run.take().unwrap_or_default();
        self.run = Some(run.max_steps(max_steps));
        self
    }

    /// Bounds on the tokens, requests and money of each run, each user
    /// turn and the session (see [`UsageLimits`]): checked before each
    /// model call, they end the run with
    /// [`YieldReason::UsageLimit`](crate::YieldReason::UsageLimit) rather
    /// than make a call that could pass one.
    ///
    /// ```
    /// use markov_executor::{Agent, Limit, UsageLimits, YieldReason};
    /// use markov_testkit::ScriptedModel;
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let limits = UsageLimits::builder().per_turn(Limit::new().requests(1)).build().unwrap();
    /// let model = ScriptedModel::builder().text("Hello.").build();
    /// let agent = Agent::builder("frugal")
    ///     .instructions("Answer.")
    ///     .model(model)
    ///     .usage_limits(limits)
    ///     .build()
    ///     .unwrap();
    /// let mut machine = agent.machine();
    /// machine.enqueue_user("hi");
    /// assert_eq!(machine.run().await.unwrap().yield_reason, YieldReason::EndTurn);
    /// assert_eq!(machine.usage().turn.requests, 1);
    /// # });
    /// ```
    #[must_use]
    pub fn usage_limits(mut self, limits: UsageLimits) -> Self {
        let run = self.run.take().unwrap_or_default();
        self.run = Some(run.usage_limits(limits));
        self
    }

    /// The prices of the model calls (default: the bundled table of
    /// [`Prices::table`]), for the cost in each step's usage and for
    /// limits on money.
    #[must_use]
    pub fn prices(mut self, prices: Prices) -> Self {
        self.prices = Some(prices);
        self
    }

    /// Every limit of each run at once.
    #[must_use]
    pub fn run_options(mut self, options: RunOptions) -> Self {
        self.run = Some(options);
        self
    }

    /// Runs the leaves with `executor` instead of the standard executor
    /// over a model. It then owns the model, its settings and the tools'
    /// policies: giving those too is a build error.
    #[must_use]
    pub fn executor(self, executor: impl Executor + 'static) -> Self {
        self.shared_executor(Arc::new(executor))
    }

    /// [`executor`](Self::executor), shared with other agents.
    #[must_use]
    pub fn shared_executor(mut self, executor: Arc<dyn Executor>) -> Self {
        self.executor = Some(executor);
        self
    }

    /// The first pair of options that cannot be used together, as
    /// (option, the one it conflicts with, what to do instead): reported by
    /// `build`, since a builder method cannot fail without breaking the chain.
    fn conflict(&self) -> Option<(&'static str, &'static str, &'static str)> {
        let custom = self.executor.is_some();
        let given = self.charter_given.is_some();
        let limited = self
            .run
            .as_ref()
            .is_some_and(|run| run.usage_limits.is_set());
        let checks: [(bool, &'static str, &'static str, &'static str); 14] = [
            (
                given && !self.nodes.is_empty(),
                "node",
                "on_charter",
                "register the node in the charter given",
            ),
            (
                given && self.node.is_some(),
                "instructions",
                "on_charter",
                "the charter given holds the nodes: give the instructions to one of them",
            ),
            (
                given && self.charter_configured,
                "charter",
                "on_charter",
                "add packs, tools and transitions to the charter given before building it",
            ),
            (
                self.registry_given && self.tools_with,
                "tool_with (or shared_tool_with)",
                "registry",
                "register the tool in the registry given",
            ),
            (
                self.registry_given && self.policies.is_some(),
                "policies",
                "registry",
                "the registry given brings its own policies",
            ),
            (
                custom && self.model.is_some(),
                "model",
                "executor",
                "an executor brings its own model",
            ),
            (
                custom && self.settings.is_some(),
                "settings",
                "executor",
                "set the settings on the executor",
            ),
            (
                custom && limited,
                "usage_limits",
                "executor",
                "the standard executor checks usage limits before each model call: give the model instead",
            ),
            (
                custom && self.prices.is_some(),
                "prices",
                "executor",
                "give the prices to the executor (StandardExecutor::with_prices)",
            ),
            (
                custom && self.context_policy.is_some(),
                "context_policy",
                "executor",
                "set the context policy on the executor (StandardExecutor::with_context_policy)",
            ),
            (
                custom && self.registry.is_some(),
                "tool_with",
                "executor",
                "give the executor the tool registry",
            ),
            (
                self.registry.is_none() && (self.policies.is_some() || self.mode.is_some()),
                "policies",
                "no tool_with",
                "policies and mode apply to tools given with tool_with",
            ),
            (
                self.node.is_some() && !self.nodes.is_empty(),
                "instructions",
                "node",
                ONE_NODE,
            ),
            (
                self.node.is_some() && self.instructions.is_none(),
                "tool",
                "no instructions",
                "a one-node agent's tools and output need its instructions",
            ),
        ];
        checks
            .into_iter()
            .find(|check| check.0)
            .map(|(_, option, with, why)| (option, with, why))
    }

    /// Validates everything and freezes the agent.
    pub fn build(self) -> Result<Agent, BuildError> {
        let agent = self.name.clone();
        if let Some((option, with, why)) = self.conflict() {
            return Err(BuildError::Conflict {
                agent,
                option,
                with,
                why,
            });
        }
        let mut nodes = match &self.charter_given {
            Some(charter) => charter
                .nodes()
                .map(|(name, node)| (name.to_owned(), node.clone()))
                .collect(),
            None => self.nodes,
        };
        if let (Some(instructions), Some(ops)) = (self.instructions, self.node) {
            let node = ops.into_iter().fold(
                Node::builder(instructions).name(agent.clone()),
                |node, op| op(node),
            );
            let node = node.build().map_err(|source| BuildError::Node {
                agent: agent.clone(),
                node: agent.clone(),
                source,
            })?;
            nodes.push((agent.clone(), node));
        }
        if nodes.is_empty() {
            return Err(BuildError::NoNode { agent });
        }
        let start_name = self.start.unwrap_or_else(|| nodes[0].0.clone());
        let start = nodes
            .iter()
            .find(|(name, _)| *name == start_name)
            .map(|(_, node)| node.clone())
            .ok_or_else(|| BuildError::UnknownStart {
                agent: agent.clone(),
                node: start_name.clone(),
            })?;
        let charter = match self.charter_given {
            Some(charter) => charter,
            None => {
                let mut charter = self.charter;
                for (name, node) in nodes {
                    charter = charter.node(name, node);
                }
                charter.build().map_err(|source| BuildError::Charter {
                    agent: agent.clone(),
                    source,
                })?
            }
        };
        let registry = match self.registry {
            Some(registry) => {
                let registry = if self.registry_given {
                    registry
                } else {
                    registry.policies(self.policies.unwrap_or_else(|| {
                        PolicyConfig::new(Budget::UNLIMITED)
                            .envelope(EnvelopeMode::Off)
                            .errors(ErrorFormat::PlainText)
                    }))
                };
                let registry = registry.lock().map_err(|source| BuildError::Tool {
                    agent: agent.clone(),
                    source,
                })?;
                Some(Arc::new(registry))
            }
            None => None,
        };
        let (executor, standard): (Arc<dyn Executor>, _) = match (self.executor, self.model) {
            (Some(executor), _) => (executor, None),
            (None, Some(model)) => {
                let mut standard = StandardExecutor::shared(model);
                if let Some(settings) = self.settings {
                    standard = standard.with_settings(settings);
                }
                if let Some(prices) = self.prices {
                    standard = standard.with_prices(prices);
                }
                if let Some(policy) = self.context_policy {
                    standard = standard.with_context_policy(policy);
                }
                if let Some(registry) = registry {
                    standard = standard.with_registry(registry, self.mode.unwrap_or(Mode::TEXT));
                }
                (Arc::new(standard.clone()), Some(standard))
            }
            (None, None) => return Err(BuildError::NoModel { agent }),
        };
        if let Some(standard) = &standard {
            standard
                .check_nodes(&charter)
                .map_err(|(node, why)| match why {
                    Unservable::Tools(source) => BuildError::Node {
                        agent: agent.clone(),
                        node,
                        source,
                    },
                    Unservable::Refused(source) => BuildError::Unsupported {
                        agent: agent.clone(),
                        node,
                        source,
                    },
                    Unservable::Native { makes, reads } => BuildError::NativeCompaction {
                        agent: agent.clone(),
                        node,
                        makes,
                        reads,
                    },
                })?;
        }
        let state = self
            .state
            .or_else(|| start.initial_state().cloned())
            .unwrap_or_else(|| Value::Object(serde_json::Map::new()));
        // The start checked as every machine's tree is (without running
        // any externalized handler): whatever would make `Agent::machine`
        // fail is found here.
        Machine::check_tree(
            &charter,
            &Arc::new(Instance::new(start.clone(), state.clone())),
        )
        .map_err(|source| BuildError::State {
            agent: agent.clone(),
            source,
        })?;
        Ok(Agent {
            inner: Arc::new(Inner {
                charter,
                start,
                state,
                executor,
                standard,
                run: self.run.unwrap_or_default(),
            }),
        })
    }
}

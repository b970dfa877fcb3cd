//! [`AgentBuilder`] and the states it moves through.
//!
//! What cannot be used together cannot be written: the builder's type
//! says what has been given, and only the options that fit are offered.
//!
//! - Its first type parameter is what runs: nothing yet ([`Empty`]), one
//!   node made of instructions ([`OneNode`]), several nodes ([`Nodes`]), or
//!   a charter built elsewhere ([`OnCharter`]). Tools and output belong to
//!   the one node; nodes and the charter's extras belong to an agent of
//!   its own nodes.
//! - Its second is how it runs: the standard executor over a model
//!   ([`OnModel`], with the model's settings, prices, context policy and
//!   tools under policies) or an executor of the application's
//!   ([`OnExecutor`], which owns all of those).
//!
//! What each combination that cannot be written became, with an example
//! that does not compile (the options a build error still names are
//! listed with [`BuildError::Conflict`]):
//!
#![doc = include_str!("unexpressible.md")]

use std::sync::Arc;

use markov_charter::charter::{Charter, CharterBuilder};
use markov_charter::context::ContextPolicy;
use markov_charter::node::{Node, NodeBuilder, OutputConfig};
use markov_core::model::{Model, ModelSettings};
use markov_core::tool::{SharedTool, Tool};
use markov_policy::{
    Budget, EnvelopeMode, ErrorFormat, Mode, PolicyConfig, ToolMetadata, ToolRegistry,
    ToolRegistryBuilder,
};
use schemars::JsonSchema;
use serde_json::Value;

use super::{Agent, BuildError};
use crate::executor::Executor;
use crate::run::RunOptions;
use crate::standard::StandardExecutor;
use markov_context::Prices;

/// Describes an [`Agent`]; [`build`](Self::build) validates and freezes it.
///
/// Start with [`Agent::builder`] (or [`Agent::on_charter`]) for an agent
/// over a model, or [`Agent::with_executor`] (or
/// [`Agent::on_charter_with_executor`]) for one on an executor of the
/// application's. `N` is what runs, `R` how (see the
/// [module](crate::agent::builder)).
#[must_use]
pub struct AgentBuilder<N, R = OnModel> {
    name: String,
    nodes: N,
    run: R,
    start: Option<String>,
    state: Option<Value>,
    limits: RunOptions,
}

macro_rules! debug_as_name {
    ($($state:ident),*) => {$(
        impl std::fmt::Debug for $state {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(stringify!($state))
            }
        }
    )*};
}

debug_as_name!(Empty, OneNode, Nodes, OnCharter, PolicyTools, OnExecutor);

impl<N, R> std::fmt::Debug for AgentBuilder<N, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentBuilder")
            .field("name", &self.name)
            .field("nodes", &std::any::type_name::<N>())
            .field("run", &std::any::type_name::<R>())
            .finish_non_exhaustive()
    }
}

/// No node yet: give [`instructions`](AgentBuilder::instructions) or
/// [`node`](AgentBuilder::node)s.
pub struct Empty {
    charter: CharterBuilder,
}

/// One node, made of the agent's instructions, with its tools and output.
pub struct OneNode {
    charter: CharterBuilder,
    instructions: String,
    ops: Vec<NodeOp>,
}

/// Nodes given one by one.
pub struct Nodes {
    charter: CharterBuilder,
    nodes: Vec<(String, Node)>,
}

/// A charter built elsewhere: its nodes, packs, transitions and tools.
pub struct OnCharter {
    charter: Charter,
}

/// The standard executor over a model, with what configures it. `P` is
/// whether tools run under the policy pipeline: [`NoPolicyTools`] until a
/// first [`tool_with`](AgentBuilder::tool_with), then [`PolicyTools`], with
/// their [`policies`](AgentBuilder::policies) and
/// [`mode`](AgentBuilder::mode).
#[derive(Default)]
pub struct OnModel<P = NoPolicyTools> {
    model: Option<Arc<dyn Model>>,
    settings: Option<ModelSettings>,
    prices: Option<Prices>,
    context_policy: Option<ContextPolicy>,
    guards: Option<markov_guard::Guards>,
    node_guards: Vec<(String, markov_guard::Guards)>,
    guard_audit: Option<Arc<dyn markov_policy::AuditSink>>,
    tools: P,
}

/// No tool under the policy pipeline (yet).
#[derive(Debug, Default)]
pub struct NoPolicyTools(());

/// Tools under the policy pipeline, with its policies and mode.
pub struct PolicyTools {
    registry: ToolRegistryBuilder,
    policies: Option<PolicyConfig>,
    mode: Option<Mode>,
}

impl<P> std::fmt::Debug for OnModel<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnModel")
    }
}

/// An executor of the application's, which owns the model, its settings
/// and the tools' policies.
pub struct OnExecutor {
    executor: Arc<dyn Executor>,
}

/// One addition to the one-node agent's node.
type NodeOp = Box<dyn FnOnce(NodeBuilder) -> NodeBuilder + Send>;

impl Agent {
    /// Starts describing an agent named `name`, run by the standard
    /// executor over a model.
    ///
    /// A one-node agent is given [`instructions`](AgentBuilder::instructions)
    /// and then its [`tool`](AgentBuilder::tool)s; an agent of several nodes
    /// is given [`node`](AgentBuilder::node)s. Tools given with
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
    pub fn builder(name: impl Into<String>) -> AgentBuilder<Empty> {
        AgentBuilder::new(name.into(), OnModel::default())
    }

    /// Starts describing an agent over a charter built elsewhere (its nodes,
    /// packs, transitions and charter tools; the agent's name is the
    /// charter's), as a port of a markov-machines program has one. The
    /// first node registered is where conversations start unless
    /// [`start`](AgentBuilder::start) names another; the model, tools under
    /// policies and limits are given as for [`builder`](Self::builder).
    pub fn on_charter(charter: Charter) -> AgentBuilder<OnCharter> {
        AgentBuilder::given(charter, OnModel::default())
    }

    /// Starts describing an agent named `name` whose leaves `executor` runs
    /// instead of the standard executor over a model: the executor owns the
    /// model, its settings, prices, context policy and the tools' policies,
    /// so the builder offers none of them.
    pub fn with_executor(
        name: impl Into<String>,
        executor: Arc<dyn Executor>,
    ) -> AgentBuilder<Empty, OnExecutor> {
        AgentBuilder::new(name.into(), OnExecutor { executor })
    }

    /// [`on_charter`](Self::on_charter) with the leaves run by `executor`,
    /// as [`with_executor`](Self::with_executor) describes.
    pub fn on_charter_with_executor(
        charter: Charter,
        executor: Arc<dyn Executor>,
    ) -> AgentBuilder<OnCharter, OnExecutor> {
        AgentBuilder::given(charter, OnExecutor { executor })
    }
}

impl<R> AgentBuilder<Empty, R> {
    fn new(name: String, run: R) -> Self {
        AgentBuilder {
            nodes: Empty {
                charter: Charter::builder(name.clone()),
            },
            name,
            run,
            start: None,
            state: None,
            limits: RunOptions::default(),
        }
    }

    /// The instructions of a one-node agent (a node named as the agent).
    pub fn instructions(self, instructions: impl Into<String>) -> AgentBuilder<OneNode, R> {
        self.with_nodes(|Empty { charter }| OneNode {
            charter,
            instructions: instructions.into(),
            ops: Vec::new(),
        })
    }

    /// A node, registered as `name`. The first node is where conversations
    /// start unless [`start`](Self::start) names another.
    pub fn node(self, name: impl Into<String>, node: Node) -> AgentBuilder<Nodes, R> {
        self.nodes(std::iter::once((name.into(), node)))
    }

    /// Nodes, each registered under its name, in order.
    pub fn nodes(self, nodes: impl IntoIterator<Item = (String, Node)>) -> AgentBuilder<Nodes, R> {
        self.with_nodes(|Empty { charter }| Nodes {
            charter,
            nodes: nodes.into_iter().collect(),
        })
    }
}

impl<R> AgentBuilder<OnCharter, R> {
    fn given(charter: Charter, run: R) -> Self {
        AgentBuilder {
            name: charter.name().to_owned(),
            nodes: OnCharter { charter },
            run,
            start: None,
            state: None,
            limits: RunOptions::default(),
        }
    }
}

impl<N, R> AgentBuilder<N, R> {
    fn with_nodes<M>(self, f: impl FnOnce(N) -> M) -> AgentBuilder<M, R> {
        AgentBuilder {
            name: self.name,
            nodes: f(self.nodes),
            run: self.run,
            start: self.start,
            state: self.state,
            limits: self.limits,
        }
    }

    /// Conversations start at the node registered as `name`.
    pub fn start(mut self, name: impl Into<String>) -> Self {
        self.start = Some(name.into());
        self
    }

    /// The state conversations start with (else the start node's initial
    /// state, else `{}`).
    pub fn state(mut self, state: Value) -> Self {
        self.state = Some(state);
        self
    }

    /// The limits of each run, all in one value (default
    /// [`RunOptions::default`]): its step limit
    /// ([`DEFAULT_MAX_STEPS`](crate::DEFAULT_MAX_STEPS) unless set) and
    /// its bounds on the tokens, requests and money of each run, user turn
    /// and session ([`UsageLimits`](markov_context::UsageLimits)), checked before
    /// each model call: they end the run with
    /// [`YieldReason::UsageLimit`](crate::YieldReason::UsageLimit) rather
    /// than make a call that could pass one. Usage limits need the
    /// standard executor, which makes the calls: an agent on an executor
    /// of its own that is given some does not build.
    ///
    /// ```
    /// use markov_context::{Limit, UsageLimits};
    /// use markov_executor::{Agent, RunOptions, YieldReason};
    /// use markov_testkit::ScriptedModel;
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let limits = UsageLimits::builder().per_turn(Limit::new().requests(1)).build().unwrap();
    /// let model = ScriptedModel::builder().text("Hello.").build();
    /// let agent = Agent::builder("frugal")
    ///     .instructions("Answer.")
    ///     .model(model)
    ///     .limits(RunOptions::default().max_steps(8).usage_limits(limits))
    ///     .build()
    ///     .unwrap();
    /// let mut machine = agent.machine();
    /// machine.enqueue_user("hi");
    /// assert_eq!(machine.run().await.unwrap().yield_reason, YieldReason::EndTurn);
    /// assert_eq!(machine.usage().turn.requests, 1);
    /// # });
    /// ```
    pub fn limits(mut self, limits: RunOptions) -> Self {
        self.limits = limits;
        self
    }
}

impl<R> AgentBuilder<OneNode, R> {
    fn push(mut self, op: NodeOp) -> Self {
        self.nodes.ops.push(op);
        self
    }

    /// A tool of the agent's one node, run as the node's tools are (no
    /// policy stage; see [`tool_with`](AgentBuilder::tool_with) for those).
    pub fn tool<T: Tool>(self, tool: T) -> Self {
        self.push(Box::new(move |node| node.tool(tool)))
    }

    /// Tools known only at run time, such as an MCP server's
    /// (`markov_mcp::McpClient::tools`), for the agent's one node as
    /// [`tool`](Self::tool) gives one.
    pub fn tools(self, tools: impl IntoIterator<Item = SharedTool>) -> Self {
        let tools: Vec<SharedTool> = tools.into_iter().collect();
        self.push(Box::new(move |node| {
            tools.into_iter().fold(node, NodeBuilder::shared_tool)
        }))
    }

    /// The type of the one node's final answer: the model is asked for JSON
    /// of `T`'s schema, read with [`Machine::run_typed`](crate::Machine::run_typed).
    pub fn output<T: JsonSchema>(self) -> Self {
        let output = OutputConfig::of::<T>();
        self.push(Box::new(move |node| node.output(output)))
    }
}

impl<R> AgentBuilder<Nodes, R> {
    /// Another node, registered as `name`.
    pub fn node(mut self, name: impl Into<String>, node: Node) -> Self {
        self.nodes.nodes.push((name.into(), node));
        self
    }
}

macro_rules! charter_setter {
    ($($state:ty),*) => {$(
        impl<R> AgentBuilder<$state, R> {
            /// More of the charter: packs, charter tools, transitions by
            /// reference.
            pub fn charter(mut self, f: impl FnOnce(CharterBuilder) -> CharterBuilder) -> Self {
                let slot = &mut self.nodes.charter;
                let charter = std::mem::replace(slot, Charter::builder(self.name.clone()));
                *slot = f(charter);
                self
            }
        }
    )*};
}

charter_setter!(Empty, OneNode, Nodes);

impl<N, P> AgentBuilder<N, OnModel<P>> {
    fn on_model(mut self, f: impl FnOnce(&mut OnModel<P>)) -> Self {
        f(&mut self.run);
        self
    }

    /// The model the agent's steps call (an `Arc<dyn Model>` shared with
    /// other agents is a model too).
    pub fn model(self, model: impl Model + 'static) -> Self {
        self.shared_model(Arc::new(model))
    }

    /// [`model`](Self::model), shared with other agents, without wrapping
    /// it again.
    pub fn shared_model(self, model: Arc<dyn Model>) -> Self {
        self.on_model(|run| run.model = Some(model))
    }

    /// Default model settings (a node's executor config overrides them).
    pub fn settings(self, settings: ModelSettings) -> Self {
        self.on_model(|run| run.settings = Some(settings))
    }

    /// The prices of the model calls (default: the bundled table of
    /// [`Prices::table`]), for the cost in each step's usage and for
    /// limits on money.
    pub fn prices(self, prices: Prices) -> Self {
        self.on_model(|run| run.prices = Some(prices))
    }

    /// What the model is shown of a long conversation (see
    /// [`markov_charter::context`]): keep the last turns, trim old tool
    /// results, summarize older turns. A node's own policy
    /// ([`NodeBuilder::context_policy`]) overrides it. Without one, every
    /// call is sent the whole history, and a model that refuses it as too
    /// long ends the run with
    /// [`YieldReason::ContextExhausted`](crate::YieldReason::ContextExhausted).
    pub fn context_policy(self, policy: ContextPolicy) -> Self {
        self.on_model(|run| run.context_policy = Some(policy))
    }

    /// Guards on what goes in and what comes out (see [`markov_guard`] and
    /// [`StandardExecutor::with_guards`]): a block ends the run with
    /// [`YieldReason::Blocked`](crate::YieldReason::Blocked), and nothing
    /// a guard blocks is streamed or run.
    pub fn guards(self, guards: markov_guard::Guards) -> Self {
        self.on_model(|run| run.guards = Some(guards))
    }

    /// Guards of the node named `node` of its own (see
    /// [`StandardExecutor::with_node_guards`]): its leaves run the agent's
    /// [`guards`](Self::guards) and then these, in each stack. A name the
    /// agent has no node of fails the build
    /// ([`BuildError::UnknownGuardedNode`]).
    pub fn node_guards(self, node: impl Into<String>, guards: markov_guard::Guards) -> Self {
        let node = node.into();
        self.on_model(|run| run.node_guards.push((node, guards)))
    }

    /// Where the guards' rewrites and blocks are audited (see
    /// [`StandardExecutor::with_guard_audit`]), with tools under the
    /// policy pipeline or without. By default, the audit sink of the
    /// agent's [`policies`](AgentBuilder::policies), if it has any.
    pub fn guard_audit(self, sink: Arc<dyn markov_policy::AuditSink>) -> Self {
        self.on_model(|run| run.guard_audit = Some(sink))
    }
}

impl<N> AgentBuilder<N, OnModel<NoPolicyTools>> {
    fn with_policy_tools(
        self,
        registry: ToolRegistryBuilder,
    ) -> AgentBuilder<N, OnModel<PolicyTools>> {
        let OnModel {
            model,
            settings,
            prices,
            context_policy,
            guards,
            node_guards,
            guard_audit,
            tools: NoPolicyTools(()),
        } = self.run;
        AgentBuilder {
            name: self.name,
            nodes: self.nodes,
            run: OnModel {
                model,
                settings,
                prices,
                context_policy,
                guards,
                node_guards,
                guard_audit,
                tools: PolicyTools {
                    registry,
                    policies: None,
                    mode: None,
                },
            },
            start: self.start,
            state: self.state,
            limits: self.limits,
        }
    }

    /// A tool under the policy pipeline, offered to every node: `metadata`
    /// says its category (for budgets and audit), whether it needs the
    /// application's approval, its latency budget and the modes it may run
    /// in. Its completed calls are never repeated, even across a crash.
    /// Its [`policies`](AgentBuilder::policies) and
    /// [`mode`](AgentBuilder::mode) can be given after it.
    pub fn tool_with<T: Tool>(
        self,
        tool: T,
        metadata: ToolMetadata,
    ) -> AgentBuilder<N, OnModel<PolicyTools>> {
        self.with_policy_tools(registry()).tool_with(tool, metadata)
    }

    /// Tools known only at run time under the policy pipeline, each with
    /// its metadata, as [`tool_with`](Self::tool_with) gives one: an MCP
    /// server's, say, with `markov_mcp::McpClient::default_metadata`.
    pub fn tools_with(
        self,
        tools: impl IntoIterator<Item = (SharedTool, ToolMetadata)>,
    ) -> AgentBuilder<N, OnModel<PolicyTools>> {
        self.with_policy_tools(registry()).tools_with(tools)
    }
}

/// The registry tools under policies are registered in.
fn registry() -> ToolRegistryBuilder {
    ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED))
}

impl<N> AgentBuilder<N, OnModel<PolicyTools>> {
    fn register(mut self, f: impl FnOnce(ToolRegistryBuilder) -> ToolRegistryBuilder) -> Self {
        let tools = &mut self.run.tools;
        tools.registry = f(std::mem::replace(&mut tools.registry, registry()));
        self
    }

    /// Another tool under the policy pipeline (see
    /// [`tool_with`](AgentBuilder::tool_with)).
    pub fn tool_with<T: Tool>(self, tool: T, metadata: ToolMetadata) -> Self {
        self.register(|registry| registry.register(tool, metadata))
    }

    /// More tools known only at run time under the policy pipeline (see
    /// [`tools_with`](AgentBuilder::tools_with)).
    pub fn tools_with(self, tools: impl IntoIterator<Item = (SharedTool, ToolMetadata)>) -> Self {
        self.register(|registry| {
            tools
                .into_iter()
                .fold(registry, |registry, (tool, metadata)| {
                    registry.register_shared(tool, metadata)
                })
        })
    }

    /// The budgets, approval lifetime, idempotency limits and result format
    /// of the tools under the policy pipeline. By default: no budget, and
    /// results as the tools' own text (no JSON envelope). (What a
    /// [`ToolRegistryBuilder`] holds is these and the tools, so an MCP
    /// server's tools under its policies are `tools_with` and `policies`.)
    pub fn policies(mut self, config: PolicyConfig) -> Self {
        self.run.tools.policies = Some(config);
        self
    }

    /// The mode the policy pipeline runs calls in (default
    /// [`Mode::TEXT`]).
    pub fn mode(mut self, mode: Mode) -> Self {
        self.run.tools.mode = Some(mode);
        self
    }
}

/// What runs, in a builder that can be built: [`OneNode`], [`Nodes`] and
/// [`OnCharter`] ([`Empty`] has nothing to run).
pub trait Runnable: sealed::Runnable {}

impl Runnable for OneNode {}
impl Runnable for Nodes {}
impl Runnable for OnCharter {}

/// How it runs: [`OnModel`] or [`OnExecutor`].
pub trait Runner: sealed::Runner {}

impl Runner for OnModel<NoPolicyTools> {}
impl Runner for OnModel<PolicyTools> {}
impl Runner for OnExecutor {}

mod sealed;

impl<N: Runnable, R: Runner> AgentBuilder<N, R> {
    /// Validates everything and freezes the agent.
    ///
    /// # Errors
    /// What only `build` can find, naming the option, node or tool at
    /// fault: see [`BuildError`].
    pub fn build(self) -> Result<Agent, BuildError> {
        let agent = self.name;
        self.run.check(&agent, &self.limits)?;
        let (charter, start) = self.nodes.charter(&agent, self.start)?;
        let (executor, standard) = self.run.executor(&agent, &charter)?;
        Agent::freeze(
            agent,
            charter,
            start,
            self.state,
            executor,
            standard,
            self.limits,
        )
    }
}

//! [`Agent`]: one value that describes an agent — its nodes or
//! instructions, its tools and their policies, its model, settings and
//! limits — built once, validated, frozen and cheap to clone. Everything
//! that runs an agent takes it: a machine in memory ([`Agent::machine`]), a
//! restored snapshot ([`Agent::restore`]), a durable session
//! (`markov_store::DurableMachine::open`) and the HTTP service
//! (`markov_server::router`). [`AgentBuilder`] describes one.

use std::sync::Arc;

use markov_charter::ConfigError;
use markov_charter::charter::Charter;
use markov_charter::node::Node;
use markov_policy::RegistryError;
use serde_json::Value;

use crate::error::RunError;
use crate::executor::Executor;
use crate::instance::Instance;
use crate::machine::Machine;
use crate::run::RunOptions;
use crate::serialize::{DeserializeError, SerializedMachine, deserialize_machine};
use crate::standard::StandardExecutor;
use crate::stream::MessageStreamEvent;

mod as_tool;
pub mod builder;

pub use as_tool::{AgentTool, SubAgentStep};
pub use builder::AgentBuilder;

/// An agent, ready to run: see [`Agent::builder`] and [`AgentBuilder`].
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
    /// An agent over a model was given none.
    #[error(
        "agent {agent:?} has no model: call `model` on its builder (or start it with `Agent::with_executor`)"
    )]
    NoModel {
        /// The agent.
        agent: String,
    },
    /// The agent has no node: its charter (given, or made of an empty
    /// list of nodes) has none.
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
    /// `node_guards` names no node of the agent.
    #[error("agent {agent:?} has guards for node {node:?}, which it does not have")]
    UnknownGuardedNode {
        /// The agent.
        agent: String,
        /// The name given to `node_guards`.
        node: String,
    },
    /// Two options that cannot be used together, where the builder's type
    /// cannot tell: usage limits (in the [`limits`](AgentBuilder::limits))
    /// on an executor of the application's, since only the standard
    /// executor checks them.
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
    /// A tool given with `tool_with` or `tools_with` could not be registered.
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
    /// [`Model::check_tools`](markov_core::Model::check_tools), rather than at the node's first model call.
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
    /// ([`Model::native_summaries`](markov_core::Model::native_summaries)).
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
    /// The agent of a charter, its start and the executor that runs it,
    /// once its start state is checked as every machine's tree is (without
    /// running any externalized handler): whatever would make
    /// [`Agent::machine`] fail is found here.
    fn freeze(
        agent: String,
        charter: Charter,
        start: Node,
        state: Option<Value>,
        executor: Arc<dyn Executor>,
        standard: Option<StandardExecutor>,
        run: RunOptions,
    ) -> Result<Agent, BuildError> {
        let state = state
            .or_else(|| start.initial_state().cloned())
            .unwrap_or_else(|| Value::Object(serde_json::Map::new()));
        Machine::check_tree(
            &charter,
            &Arc::new(Instance::new(start.clone(), state.clone())),
        )
        .map_err(|source| BuildError::State { agent, source })?;
        Ok(Agent {
            inner: Arc::new(Inner {
                charter,
                start,
                state,
                executor,
                standard,
                run,
            }),
        })
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

    /// Whether the thinking the agent's stored messages keep may be shown
    /// to the user: `false` when the agent has output guards, which check
    /// the thinking it streams but not the thinking the history keeps as
    /// the provider signed it (see the guardrails guide).
    pub fn shows_stored_thinking(&self) -> bool {
        self.inner.executor.shows_stored_thinking()
    }

    /// This agent with its model calls streamed to `callback` (see
    /// [`StandardExecutor::with_streaming`]), for a service that shows
    /// answers as they are written. An agent built with its own
    /// executor ([`Agent::with_executor`]) streams as that executor was
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

//! Transitions: the declared ways to leave a node, and what taking one yields.
//!
//! | kind | how the target is found | state |
//! |---|---|---|
//! | [`Transition::Code`] | your async function returns a [`TransitionResult`] | carried or given |
//! | [`Transition::Serial`] | a charter node by name, or an inline node | reset to `initial_state` |
//! | [`Transition::General`] | the model writes an inline node as argument `node` | reset |
//! | [`Transition::Ref`] | `"name"` → the charter's transition, `"node.t"` → that node's | as the target's |

use std::fmt;
use std::sync::Arc;

use futures::future::BoxFuture;
use serde_json::Value;

use crate::node::Node;

/// The input a code transition receives.
#[derive(Debug, Clone, PartialEq)]
pub struct TransitionInput {
    /// The node's running state, after this turn's updates.
    pub state: Value,
    /// The model's arguments, without `reason`.
    pub args: Value,
    /// Why the model took the transition.
    pub reason: String,
}

// Boxed twice on purpose: each transition is a closure of its own type
// returning a future of its own type, and a charter keeps many in one map,
// so both are erased. `Transition::code` takes any closure; only this alias
// sees the boxes (an async closure cannot be a trait object).
type CodeFn =
    dyn Fn(TransitionInput) -> BoxFuture<'static, Result<TransitionResult, String>> + Send + Sync;

/// A transition decided by code.
pub struct CodeTransition {
    description: String,
    arguments: Option<Value>,
    execute: Box<CodeFn>,
}

impl fmt::Debug for CodeTransition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CodeTransition")
            .field("description", &self.description)
            .field("arguments", &self.arguments)
            .finish_non_exhaustive()
    }
}

impl CodeTransition {
    /// The description shown to the model.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// The JSON Schema of the arguments, if the model must supply any.
    pub fn arguments(&self) -> Option<&Value> {
        self.arguments.as_ref()
    }

    /// Runs the transition.
    pub async fn execute(&self, input: TransitionInput) -> Result<TransitionResult, String> {
        (self.execute)(input).await
    }
}

/// Where a transition leads: a node registered in the charter, or a node value.
#[derive(Debug, Clone)]
pub enum NodeTarget {
    /// A charter node, by name.
    Ref(String),
    /// A node value.
    Inline(Node),
}

impl From<Node> for NodeTarget {
    fn from(node: Node) -> Self {
        NodeTarget::Inline(node)
    }
}

/// A way to leave a node. (Exhaustive: the executor matches every kind,
/// and a new one must be handled there.)
#[derive(Debug, Clone)]
pub enum Transition {
    /// Decided by code.
    Code(Arc<CodeTransition>),
    /// A fixed target; serializable.
    Serial {
        /// The description shown to the model.
        description: String,
        /// The target.
        target: NodeTarget,
        /// A JSON Schema of arguments the model must supply, if any.
        arguments: Option<Value>,
    },
    /// The model supplies the target node inline.
    General {
        /// The description shown to the model.
        description: String,
    },
    /// A charter transition (`"name"`) or another node's (`"node.transition"`).
    Ref(String),
}

impl Transition {
    /// A code transition without arguments.
    pub fn code<F, Fut>(description: impl Into<String>, execute: F) -> Self
    where
        F: Fn(TransitionInput) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<TransitionResult, String>> + Send + 'static,
    {
        Self::code_with_arguments(description, None, execute)
    }

    /// A code transition whose arguments follow `arguments` (a JSON Schema).
    pub fn code_with_arguments<F, Fut>(
        description: impl Into<String>,
        arguments: Option<Value>,
        execute: F,
    ) -> Self
    where
        F: Fn(TransitionInput) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<TransitionResult, String>> + Send + 'static,
    {
        Transition::Code(Arc::new(CodeTransition {
            description: description.into(),
            arguments,
            execute: Box::new(move |input| Box::pin(execute(input))),
        }))
    }

    /// A transition to a fixed node.
    pub fn to(description: impl Into<String>, target: impl Into<NodeTarget>) -> Self {
        Transition::Serial {
            description: description.into(),
            target: target.into(),
            arguments: None,
        }
    }

    /// A transition to a charter node, by name.
    pub fn to_ref(description: impl Into<String>, node: impl Into<String>) -> Self {
        Self::to(description, NodeTarget::Ref(node.into()))
    }

    /// A transition whose target node the model writes.
    pub fn general(description: impl Into<String>) -> Self {
        Transition::General {
            description: description.into(),
        }
    }

    /// A reference to a charter transition or another node's.
    pub fn reference(name: impl Into<String>) -> Self {
        Transition::Ref(name.into())
    }

    /// The description shown in the system prompt (`None` for refs).
    pub fn description(&self) -> Option<&str> {
        match self {
            Transition::Code(c) => Some(&c.description),
            Transition::Serial { description, .. } | Transition::General { description } => {
                Some(description)
            }
            Transition::Ref(_) => None,
        }
    }
}

/// A child to create.
#[derive(Debug, Clone)]
pub struct SpawnChild {
    /// Its node.
    pub node: NodeTarget,
    /// Its state; the node's initial state when `None`.
    pub state: Option<Value>,
}

/// What a cede hands to the parent.
#[derive(Debug, Clone, PartialEq)]
pub enum CedeContent {
    /// A text, delivered as a user message.
    Text(String),
    /// Messages, delivered as they are.
    Messages(Vec<markov_core::Message>),
}

/// What taking a transition yields. (Exhaustive, as [`Transition`] is.)
#[derive(Debug, Clone)]
pub enum TransitionResult {
    /// Replace the current node.
    To {
        /// The target.
        node: NodeTarget,
        /// The new state; the target's initial state when `None`.
        state: Option<Value>,
    },
    /// Add children below the current instance.
    Spawn(Vec<SpawnChild>),
    /// Remove the current instance, handing content to the parent.
    Cede(Option<CedeContent>),
    /// Pause the current instance until resumed.
    Suspend {
        /// The id a resume must name (a uuid when not given).
        suspend_id: String,
        /// Why.
        reason: String,
        /// Application data.
        metadata: Option<Value>,
    },
}

/// `transitionTo(node, state?)`.
pub fn transition_to(node: impl Into<NodeTarget>, state: Option<Value>) -> TransitionResult {
    TransitionResult::To {
        node: node.into(),
        state,
    }
}

/// `spawn(node, state?)` for one child.
pub fn spawn(node: impl Into<NodeTarget>, state: Option<Value>) -> TransitionResult {
    TransitionResult::Spawn(vec![SpawnChild {
        node: node.into(),
        state,
    }])
}

/// `cede(content?)`.
pub fn cede(content: Option<CedeContent>) -> TransitionResult {
    TransitionResult::Cede(content)
}

/// `suspend(reason)`, with a fresh uuid as suspend id.
pub fn suspend(reason: impl Into<String>) -> TransitionResult {
    TransitionResult::Suspend {
        suspend_id: uuid::Uuid::new_v4().to_string(),
        reason: reason.into(),
        metadata: None,
    }
}

/// A transition resolved to its effect on the instance tree.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum TransitionOutcome {
    /// Replace the leaf's node and state.
    To {
        /// The new node.
        node: Node,
        /// The new state.
        state: Value,
    },
    /// The target is the node already there: nothing changes (upstream emits nothing).
    Stay,
    /// New children of the leaf, with their states.
    Spawn(Vec<(Node, Value)>),
    /// Remove the leaf.
    Cede(Option<CedeContent>),
    /// Pause the leaf.
    Suspend {
        /// The id a resume must name.
        suspend_id: String,
        /// Why.
        reason: String,
        /// Application data.
        metadata: Option<Value>,
    },
}

/// Why a queued transition could not be taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransitionError {
    /// The node declares no such transition.
    #[error("Unknown transition: {0}")]
    Unknown(String),
    /// A general transition without its `node` argument.
    #[error("General transition requires a node argument")]
    GeneralNeedsNode,
    /// A ref or an inline node did not resolve.
    #[error(transparent)]
    Config(#[from] crate::define::error::ConfigError),
    /// Neither a state nor an initial state for the target.
    #[error("Transition returned undefined state and target node has no initialState")]
    NoState,
    /// A code transition failed.
    #[error("{0}")]
    Code(String),
}

//! Errors raised while building runtime values or running transitions.

use markov_core::tool::InvalidToolName;

/// A configuration that cannot work, reported when it is built rather than at the first call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A tool name providers would refuse.
    #[error(transparent)]
    InvalidToolName(#[from] InvalidToolName),
    /// Two tools with one name.
    #[error("duplicate tool name {0:?}")]
    DuplicateTool(String),
    /// A node tool uses a name the loop reserves for a built-in tool.
    #[error("Tool \"{tool}\" from node conflicts with existing tool from builtin:{tool}")]
    ReservedToolName {
        /// The node.
        node: String,
        /// The tool.
        tool: String,
    },
    /// Two transitions with one name on a node.
    #[error("duplicate transition {transition:?} on node {node}")]
    DuplicateTransition {
        /// The node.
        node: String,
        /// The transition.
        transition: String,
    },
    /// A worker node declares packs.
    #[error("worker node {0} cannot declare packs")]
    WorkerWithPacks(String),
    /// The initial state does not fit the state type.
    #[error("Invalid state for node \"{node}\": {message}")]
    InvalidInitialState {
        /// The node.
        node: String,
        /// The validator's message.
        message: String,
    },
    /// A charter tool's key differs from its name.
    #[error("Charter tool name mismatch: key \"{key}\" does not match tool.name \"{name}\"")]
    CharterToolNameMismatch {
        /// The key.
        key: String,
        /// The tool's name.
        name: String,
    },
    /// A transition ref names no charter transition.
    #[error("Unknown transition ref: {0}")]
    UnknownTransitionRef(String),
    /// A dotted transition ref names no charter node.
    #[error("Unknown node in transition ref: {0}")]
    UnknownNodeInTransitionRef(String),
    /// A dotted transition ref names no transition of its node.
    #[error("Unknown transition on node {node}: {transition}")]
    UnknownTransitionOnNode {
        /// The node.
        node: String,
        /// The transition.
        transition: String,
    },
    /// A node ref names no charter node.
    #[error("Unknown node ref: {0}")]
    UnknownNodeRef(String),
    /// An inline node read from JSON is malformed.
    #[error("invalid inline node: {0}")]
    InvalidSerialNode(String),
    /// A tool ref names no charter tool.
    #[error("Unknown tool ref: {0}")]
    UnknownToolRef(String),
    /// A dotted tool ref names no charter node.
    #[error("Unknown node in tool ref: {0}")]
    UnknownNodeInToolRef(String),
    /// A dotted tool ref names no tool of its node.
    #[error("Unknown tool on node {node}: {tool}")]
    UnknownToolOnNode {
        /// The node.
        node: String,
        /// The tool.
        tool: String,
    },
    /// Two charter nodes (or transitions, packs) with one name.
    #[error("duplicate charter entry {0:?}")]
    DuplicateCharterEntry(String),
    /// `executorConfig` has a value of the wrong type.
    #[error("executorConfig.{key} must be {expected}, got {got}")]
    ExecutorConfigType {
        /// The key.
        key: &'static str,
        /// What it must be.
        expected: &'static str,
        /// What it is.
        got: &'static str,
    },
    /// A `Named` tool choice names a tool the node does not have.
    #[error("node {node}: tool choice rule Named({tool}) names a tool the node does not offer")]
    UnknownNamedTool {
        /// The node.
        node: String,
        /// The tool.
        tool: String,
    },
    /// A `Required` tool choice with no way to end the turn.
    #[error(
        "node {0}: tool choice rule Required forces a tool call on every model call, so the node needs a way out: a terminal tool, a tool that ends the run (like finish) or a transition"
    )]
    RequiredWithoutExit(String),
    /// Two commands with one name on a node or a pack.
    #[error("duplicate command {command:?} on {owner}")]
    DuplicateCommand {
        /// The node or pack.
        owner: String,
        /// The command.
        command: String,
    },
    /// A node command registered under a key that differs from its name.
    #[error("Node command name mismatch: key \"{key}\" does not match command.name \"{name}\"")]
    CommandNameMismatch {
        /// The key.
        key: String,
        /// The command's name.
        name: String,
    },
    /// Thinking combined with settings the provider refuses alongside it.
    #[error("node {node}: {constraint}")]
    ThinkingConflict {
        /// The node.
        node: String,
        /// The violated constraint.
        constraint: String,
    },
}

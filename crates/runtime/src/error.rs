//! Errors raised while building runtime values.

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
}

//! Errors that end a run.

use markov_core::model::ModelError;

/// Why a run stopped without an answer. The history stays consistent either way.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// The model call of step `step` failed.
    #[error("model call failed at step {step}: {source}")]
    Model {
        /// The 1-based step.
        step: usize,
        /// The model's error.
        #[source]
        source: ModelError,
    },
    /// The run used all its steps without finishing.
    #[error("Max steps ({0}) exceeded")]
    MaxSteps(usize),
}

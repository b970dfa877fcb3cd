//! A run's options, its default step limit, and the note a cut-off answer
//! is followed by.

use markov_context::UsageLimits;
use serde::{Deserialize, Serialize};

/// The default step limit.
pub const DEFAULT_MAX_STEPS: usize = 50;

/// The text of the system message ([`Role::System`](markov_core::Role::System),
/// markov's own words, never the user's) added after a first `max_tokens`
/// step, asking for a short answer.
pub const RECOVERY_TEXT: &str = "Your response was cut off due to length limits. Please provide a brief summary of your findings and respond to the user now. Do not use any tools - just give your final answer.";

/// Options of one run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunOptions {
    /// Steps allowed before the run fails with `Max steps (<n>) exceeded`.
    pub max_steps: usize,
    /// The tool result of a `TerminateResponse` without a message.
    pub terminate_message: String,
    /// Bounds on tokens, requests and money, checked before each model
    /// call (none by default).
    #[serde(default, skip_serializing_if = "unlimited")]
    pub usage_limits: UsageLimits,
}

fn unlimited(limits: &UsageLimits) -> bool {
    !limits.is_set()
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            max_steps: DEFAULT_MAX_STEPS,
            terminate_message: "Finished".to_owned(),
            usage_limits: UsageLimits::none(),
        }
    }
}

impl RunOptions {
    /// Sets the step limit.
    #[must_use]
    pub fn max_steps(mut self, max_steps: usize) -> Self {
        self.max_steps = max_steps;
        self
    }

    /// Sets the default termination note.
    #[must_use]
    pub fn terminate_message(mut self, message: impl Into<String>) -> Self {
        self.terminate_message = message.into();
        self
    }

    /// Sets the usage limits.
    #[must_use]
    pub fn usage_limits(mut self, limits: UsageLimits) -> Self {
        self.usage_limits = limits;
        self
    }
}

//! Running one model response: its tool calls through the tool path, a
//! queued transition, and what the model is shown (system prompt, tools).
//! It reports what happened as data; the executor applies it.

pub(crate) mod enforcer;
pub mod pipeline;
pub mod prompt;
pub mod toolgen;
mod transition;

pub use transition::take_transition;

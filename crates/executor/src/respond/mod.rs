//! Running one model response: its tool calls through the tool path, a
//! queued transition, and what the model is shown (system prompt, tools).
//! It reports what happened as data; the executor applies it.

mod builtin;
mod call;
pub(crate) mod enforcer;
pub(crate) mod lookup;
pub(crate) mod pipeline;
pub(crate) mod prompt;
mod transition;

pub(crate) use transition::take_transition;

#[cfg(test)]
mod tests;

//! markov's standard loop.
//!
//! [`Agent`] calls a model, runs the tools it asks for, feeds the results back
//! and repeats until the model answers without tool calls or the step limit is
//! hit. Every tool call gets exactly one result, so the history it leaves is
//! one that providers accept for the next turn.
//!
//! ```
//! use markov_executor::Agent;
//! use markov_core::Message;
//! use markov_testkit::ScriptedModel;
//!
//! # tokio_test();
//! # fn tokio_test() {
//! # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
//! # rt.block_on(async {
//! let model = ScriptedModel::builder().text("hello").build();
//! let agent = Agent::builder(model).build();
//! let mut history = vec![Message::user("hi")];
//! let out = agent.run(&mut history).await.unwrap();
//! assert_eq!(out.response, "hello");
//! assert_eq!(history.len(), 2);
//! # });
//! # }
//! ```
#![deny(missing_docs)]

mod agent;
mod error;

pub use agent::{Agent, AgentBuilder, DEFAULT_MAX_STEPS, RunOutput};
pub use error::RunError;

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

//! Test doubles for markov: scripted and failing models, and proptest strategies.
//!
//! - [`ScriptedModel`] answers from a script, records every request, refuses
//!   answers a real provider could not give, and errors when its script runs out.
//! - [`FailingModel`] returns an error, at once or after some calls.
//! - [`ProbeModel`] answers every method of `Model` with something of its
//!   own, to check that a wrapper forwards each.
//! - [`strategies`] generates messages and tool calls for property tests.
//! - [`fixtures`] has tools for tests, written with `#[tool]`: `add`, a
//!   payment you can count, one that needs approval, one that panics, one
//!   that hangs, and [`Counted`](fixtures::Counted) for any tool.
//! - [`required_program`] finds a program a test needs (a failure under
//!   `CI=true` when it is missing).
//! - [`sse`] reads a server-sent event stream back as (event, data) pairs.
//! - `http` (with the `http` feature) is a loopback fake provider speaking
//!   the Anthropic Messages and OpenAI Chat Completions wire formats, to
//!   test real clients end to end.
//! - `engine` (with the `engine` feature) is the fixture agent and the
//!   child processes the durable engines' crash tests share.
//!
//! ```
//! use markov_testkit::ScriptedModel;
//! use serde_json::json;
//!
//! let model = ScriptedModel::builder()
//!     .tool_call("lookup", json!({"key": "k"}))
//!     .text("done")
//!     .build();
//! assert_eq!(model.calls(), 0);
//! ```
#![deny(missing_docs)]

#[cfg(feature = "engine")]
pub mod engine;
mod failing;
pub mod fixtures;
#[cfg(feature = "http")]
pub mod http;
mod probe;
mod program;
mod scripted;
pub mod sse;
pub mod strategies;

pub use failing::FailingModel;
pub use probe::ProbeModel;
pub use program::required_program;
pub use scripted::{RecordedRequest, Recording, ScriptBuilder, ScriptedModel, text_response};

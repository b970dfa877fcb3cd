//! markov's data model and traits. No I/O, no runtime: tool authors and model
//! clients depend on this crate alone.
//!
//! - [`Message`](message::Message) and [`Item`](message::Item): the conversation, in
//!   upstream markov-machines' JSON form.
//! - [`Tool`](tool::Tool): a typed tool; [`DynTool`](tool::DynTool) its erased form;
//!   [`ToolDefinition`](tool::ToolDefinition) what a model is told about it.
//! - [`Model`](model::Model): one async trait every model client implements, over a
//!   [`ModelRequest`](model::ModelRequest) that borrows the history.
//!
//! ```
//! use markov_core::message::{Item, Message};
//!
//! let m = Message::user("What is 2 + 3?");
//! let json = serde_json::to_string(&m).unwrap();
//! assert_eq!(json, r#"{"role":"user","items":[{"type":"text","text":"What is 2 + 3?"}]}"#);
//! let back: Message = serde_json::from_str(&json).unwrap();
//! assert_eq!(back, m);
//! ```
#![deny(missing_docs)]

pub mod ids;
pub mod message;
pub mod model;
pub mod tool;

pub use ids::{InstanceId, MessageId, NodeId, RunId, ToolCallId};
pub use message::{Item, Items, Message, Metadata, Role};
pub use model::{
    Model, ModelError, ModelRequest, ModelResponse, ModelSettings, StopReason, StreamEvent,
    Thinking, ToolChoice, Usage,
};
pub use tool::{
    DynTool, Erased, SharedTool, TerminateResponse, Tool, ToolContext, ToolDefinition,
    ToolExecutionResult, ToolName, ToolOutcome, ToolReply,
};

//! markov's data model and traits. No I/O, no runtime: tool authors and model
//! clients depend on this crate alone.
//!
//! - [`Message`] and [`Item`]: the conversation, in
//!   upstream markov-machines' JSON form.
//! - [`Tool`]: a typed tool; [`DynTool`] its erased form;
//!   [`ToolDefinition`] what a model is told about it.
//! - [`Model`]: one async trait every model client implements, over a
//!   [`ModelRequest`] that borrows the history.
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
    Deps, DynTool, Erased, ProviderTool, SharedTool, TerminateResponse, Tool, ToolContext,
    ToolDefinition, ToolExecutionResult, ToolName, ToolOutcome, ToolReply,
};

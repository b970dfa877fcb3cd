//! markov's tool execution layer.
//!
//! - [`ToolSet`] holds a node's tools by name and refuses duplicates.
//! - [`execute_call`] runs one tool call and always returns exactly one
//!   [`ToolExecutionResult`](markov_core::ToolExecutionResult): unknown tools,
//!   invalid arguments and tool failures become error results the model can read.
//!
//! ```
//! use markov_runtime::ToolSet;
//! let tools = ToolSet::new();
//! assert!(tools.get("missing").is_none());
//! ```
#![deny(missing_docs)]

mod error;
mod execute;
mod toolset;

pub use error::ConfigError;
pub use execute::execute_call;
pub use toolset::ToolSet;

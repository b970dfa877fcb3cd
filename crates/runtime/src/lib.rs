//! markov's runtime: the definitions a machine is made of, and the execution
//! of one leaf's tool calls.
//!
//! - [`Charter`](charter::Charter): the static registry (nodes, tools,
//!   transitions, packs, prompt builder), shared by many machines.
//! - [`Node`](node::Node): instructions, typed state, tools, transitions, turn policy.
//! - [`Transition`](transition::Transition) and [`Pack`](pack::Pack).
//! - [`externalize`]: handing a node's or pack's state to application code.
//! - [`command`]: user-invoked operations on nodes and packs that bypass inference.
//! - [`pipeline`]: runs one model response's tool calls in order and reports
//!   their results and effects as data; it never touches the instance tree.
//! - [`registry`]: a tool registry whose calls pass a policy stack (modes,
//!   budgets, confirmation, idempotency, timeouts, audit), with error envelopes.
//! - [`prompt`] and [`toolgen`]: the system prompt and the tool list a model sees.
//!
//! ```
//! use markov_runtime::{charter::Charter, node::Node};
//!
//! let node = Node::builder("Greet the user.").build().unwrap();
//! let charter = Charter::builder("greeter").node("greet", node).build().unwrap();
//! assert!(charter.node("greet").is_some());
//! ```
#![deny(missing_docs)]

pub mod charter;
pub mod command;
mod error;
mod execute;
pub mod externalize;
pub mod node;
pub mod pack;
pub mod pipeline;
pub mod policy;
pub mod prompt;
pub mod registry;
pub mod serial;
pub mod state;
pub mod toolgen;
mod toolset;
pub mod transition;

pub use error::ConfigError;
pub use execute::execute_call;
pub use toolset::ToolSet;

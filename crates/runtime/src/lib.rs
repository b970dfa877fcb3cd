//! markov's runtime: the definitions a machine is made of, their serialized
//! forms, and the running of one model response's tool calls.
//!
//! The crate is laid out by role, and each role only looks down:
//!
//! - **definitions** (`src/define/`): [`Charter`](charter::Charter), the
//!   static registry shared by many machines; [`Node`](node::Node)
//!   (instructions, typed state, tools, transitions, turn policy);
//!   [`Transition`](transition::Transition), [`Pack`](pack::Pack), typed
//!   [`command`]s, [`state`] schemas, [`externalize`]d state and the
//!   [`tool_choice`] rules. Data, and the checks that freeze it.
//! - **serialized forms** (`src/serial/`): [`serial`], nodes and packs as
//!   JSON, read back against a charter.
//! - **running one response** (`src/respond/`): [`pipeline`] runs one model
//!   response's tool calls in order through the tool path and reports their
//!   results and effects as data (it never touches the instance tree);
//!   [`respond::take_transition`] decides a queued transition; [`prompt`] and
//!   [`toolgen`] build what the model sees; [`ToolChoiceEnforcer`] applies a
//!   tool-choice policy around any model.
//!
//! The tool registry and its policy stack are the `markov-policy` crate,
//! re-exported here as [`registry`].
//!
//! ```
//! use markov_runtime::{charter::Charter, node::Node};
//!
//! let node = Node::builder("Greet the user.").build().unwrap();
//! let charter = Charter::builder("greeter").node("greet", node).build().unwrap();
//! assert!(charter.node("greet").is_some());
//! ```
#![deny(missing_docs)]

mod define;
pub mod respond;
pub mod serial;

pub use define::error::ConfigError;
pub use define::toolset::ToolSet;
pub use define::{charter, command, externalize, node, pack, state, tool_choice, transition};
pub use respond::enforcer::ToolChoiceEnforcer;
pub use respond::{pipeline, prompt, toolgen};

/// The tool registry and its policy pipeline: the `markov-policy` crate.
pub use markov_policy as registry;

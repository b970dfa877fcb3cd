//! markov's definitions: what a machine is made of, and their serialized
//! forms.
//!
//! The crate is laid out by role, and each role only looks down:
//!
//! - **definitions** (`src/define/`): [`Charter`](charter::Charter), the
//!   static registry shared by many machines; [`Node`](node::Node)
//!   (instructions, typed state, tools, transitions, turn policy, the
//!   [`loop_guard`] on identical calls);
//!   [`Transition`](transition::Transition), [`Pack`](pack::Pack), the
//!   [`context`] policy (what a model is shown of a long history), typed
//!   [`command`]s, [`state`] schemas, [`externalize`]d state and the
//!   [`tool_choice`] rules. Data, and the checks that freeze it.
//! - **serialized forms** (`src/serial/`): [`serial`], nodes and packs as
//!   JSON, read back against a charter.
//! - **offered tools** ([`toolgen`]): the tool definitions a node offers
//!   under a charter, derived from the definitions alone (the charter keeps
//!   them, since nothing they are made of ever changes).
//!
//! Running a machine — its loop, one response's tool calls, what the model
//! is shown — is `markov-executor`'s; the tool registry and its policy
//! stack are `markov-policy`'s.
//!
//! ```
//! use markov_charter::{charter::Charter, node::Node};
//!
//! let node = Node::builder("Greet the user.").build().unwrap();
//! let charter = Charter::builder("greeter").node("greet", node).build().unwrap();
//! assert!(charter.node("greet").is_some());
//! ```
#![deny(missing_docs)]

mod define;
pub mod serial;
pub mod toolgen;

pub use define::error::ConfigError;
pub use define::toolset::ToolSet;
pub use define::{
    charter, command, context, externalize, loop_guard, node, pack, state, tool_choice, transition,
};

//! The definitions a machine is made of: data, and the checks that freeze
//! it. Nothing here runs a model or a tool.

pub mod charter;
pub mod command;
pub mod context;
pub(crate) mod error;
pub mod externalize;
pub mod loop_guard;
pub mod node;
pub mod pack;
pub mod state;
pub mod tool_choice;
pub(crate) mod toolset;
pub mod transition;

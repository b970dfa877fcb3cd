//! The integration tests of this crate, one binary (so linking does not
//! dominate the test run): one module per area.

mod agent;
mod agents_as_tools;
mod approvals;
mod builtin_tools;
mod cancellation;
mod client;
mod commands;
mod common;
mod context;
mod ephemeral;
mod ergonomics;
mod exactly_once;
mod externalize;
mod finish_restriction;
mod guards;
mod handoffs;
mod loop_guard;
mod machine;
mod parallel;
mod policies;
mod properties;
mod safe_tools;
mod sans_io;
mod serialization;
mod streaming;
mod suspend_resume;
mod terminal_tools;
mod token_count;
mod tool_choice;
mod tool_choice_rules;
mod tool_search;
mod tree;
mod usage;

//! The integration tests of this crate, one binary (so linking does not
//! dominate the test run): one module per area.

mod anthropic;
mod approvals;
mod body_cache;
mod builtin_tools;
mod common;
mod conformance;
mod context;
mod ephemeral;
mod fallback;
mod gemini;
mod hardening;
mod limits;
mod machine_anthropic;
mod machine_openai;
mod native_compaction;
mod openai;
mod responses;
mod structured_output;
mod token_count;
mod tool_images;
mod tool_schemas;
mod tracing;
mod wire_snapshots;

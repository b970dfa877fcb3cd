//! markov: stateful, tool-using LLM agents in Rust.
//!
//! This crate gathers markov's crates behind one dependency and one import:
//!
//! ```
//! use markov::prelude::*;
//!
//! /// Adds two integers.
//! #[tool]
//! async fn add(a: i64, b: i64) -> i64 {
//!     a + b
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let agent = Agent::builder("calculator")
//!     .instructions("You do arithmetic with your tools.")
//!     .tool(Add)
//!     .model(
//!         ScriptedModel::builder()
//!             .tool_call("add", json!({"a": 2, "b": 3}))
//!             .text("2 + 3 = 5")
//!             .build(),
//!     )
//!     .build()?;
//! let mut machine = agent.machine();
//! machine.enqueue_user("What is 2 + 3?");
//! let last = machine.run().await?;
//! assert!(last.done);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! The crates, each usable on its own:
//!
//! - [`core`]: messages, the `Tool` and `Model` traits (what a tool author or
//!   a model client depends on);
//! - [`policy`]: the tool registry and its policy pipeline;
//! - [`charter`]: the definitions a machine is made of (charter, nodes,
//!   transitions, packs) and their serialized forms;
//! - [`context`]: context views and compaction, token counts, usage,
//!   usage limits and model prices;
//! - [`executor`]: the machine, its run loop, snapshots;
//! - [`guard`]: guardrails on input, output, tool calls and tool results,
//!   and ready-made guards;
//! - [`tools`]: the standard `respond` and `finish` tools;
//! - [`testkit`] (feature `testkit`, on by default): scripted models;
//! - `providers` (feature `providers`): Anthropic, OpenAI-compatible
//!   (Chat Completions and Responses) and Gemini clients, a fallback
//!   list, outgoing limits;
//! - `store` (feature `store`): durable sessions;
//! - `otel` (feature `otel`): the spans as OpenTelemetry spans;
//! - `mcp` (feature `mcp`): tools from Model Context Protocol servers, and
//!   markov tools served over MCP;
//! - `server` (feature `server`, with `store`): agents served over HTTP with
//!   a web page;
//! - `eval` (feature `eval`): evals — datasets of cases, evaluators over a
//!   run's steps, reports and baseline comparison.
#![deny(missing_docs)]

pub use markov_charter as charter;
pub use markov_context as context;
pub use markov_core as core;
#[cfg(feature = "eval")]
pub use markov_eval as eval;
pub use markov_executor as executor;
pub use markov_guard as guard;
pub use markov_macros::tool;
#[cfg(feature = "mcp")]
pub use markov_mcp as mcp;
#[cfg(feature = "otel")]
pub use markov_otel as otel;
pub use markov_policy as policy;
#[cfg(feature = "providers")]
pub use markov_providers as providers;
#[cfg(feature = "server")]
pub use markov_server as server;
#[cfg(feature = "store")]
pub use markov_store as store;
#[cfg(feature = "testkit")]
pub use markov_testkit as testkit;
pub use markov_tools_std as tools;

/// What an application needs to build and run an agent, in one import.
pub mod prelude {
    pub use markov_charter::charter::Charter;
    pub use markov_charter::context::{ContextPolicy, Summarize, TokenCount};
    pub use markov_charter::loop_guard::LoopGuard;
    pub use markov_charter::node::{Node, OutputConfig};
    pub use markov_charter::pack::Pack;
    pub use markov_charter::tool_choice::{OutputRestriction, ToolChoiceRule};
    pub use markov_charter::transition::Transition;
    pub use markov_context::{Limit, ModelPrice, Prices, UsageLimits};
    pub use markov_core::tool::{Delivery, TerminateResponse, Tool, ToolContext, ToolReply};
    pub use markov_core::{Message, Model, ModelRequest, ModelSettings, ToolChoice, Usd};
    pub use markov_executor::{
        Agent, AgentTool, BuildError, Handoff, HistoryFilter, Machine, MachineStep, RunError,
        RunOptions, Team, YieldReason, run_machine,
    };
    pub use markov_macros::tool;
    pub use markov_policy::{
        ApprovalFlow, Budget, Category, Decision, FoundScope, Mode, PolicyConfig, ToolMetadata,
        ToolRegistry, ToolSearch,
    };
    #[cfg(feature = "server")]
    pub use markov_server::{Server, create_api_key};
    #[cfg(feature = "store")]
    pub use markov_store::{DurableMachine, DurableTeam, SessionId, SqliteStore, WorkerId};
    #[cfg(feature = "testkit")]
    pub use markov_testkit::ScriptedModel;
    pub use serde_json::json;
    pub use std::sync::Arc;
}

/// The README's examples, compiled and run as doc tests (with every
/// feature on, as `cargo xtask test` builds the facade once).
#[cfg(all(doctest, feature = "server", feature = "providers"))]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

/// The guide's examples, one page each, compiled and run as doc tests
/// like the README's (the tidy test checks that every page with a Rust
/// example is here).
#[cfg(all(doctest, feature = "server", feature = "providers"))]
pub mod guide {
    /// `docs/guide/approvals.md`.
    #[doc = include_str!("../../../docs/guide/approvals.md")]
    pub struct Approvals;
    /// `docs/guide/guardrails.md`.
    #[doc = include_str!("../../../docs/guide/guardrails.md")]
    pub mod guardrails {}
    /// `docs/guide/context-and-cost.md`.
    #[doc = include_str!("../../../docs/guide/context-and-cost.md")]
    pub struct ContextAndCost;
    /// `docs/guide/structured-output.md`.
    #[doc = include_str!("../../../docs/guide/structured-output.md")]
    pub struct StructuredOutput;
    /// `docs/guide/serving.md` (its example needs `server` and `providers`).
    #[doc = include_str!("../../../docs/guide/serving.md")]
    pub struct Serving;
    /// `docs/guide/studio.md`.
    #[doc = include_str!("../../../docs/guide/studio.md")]
    pub struct Studio;
    /// `docs/guide/tools-and-policies.md`.
    #[doc = include_str!("../../../docs/guide/tools-and-policies.md")]
    pub struct ToolsAndPolicies;
    /// `docs/guide/many-tools-and-agents.md`.
    #[doc = include_str!("../../../docs/guide/many-tools-and-agents.md")]
    pub struct ManyToolsAndAgents;
}

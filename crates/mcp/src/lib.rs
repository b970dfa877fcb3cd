//! Model Context Protocol for markov, on the official Rust SDK (`rmcp`).
//!
//! - [`McpClient`] connects to an MCP server, over stdio (a child process
//!   it starts and stops) or Streamable HTTP (with headers and a bearer
//!   token), and offers the server's tools as markov tools.
//! - [`McpTool`] is one of those tools: a [`DynTool`](markov_core::tool::DynTool),
//!   so a node offers it and a registry runs it like any other tool, its
//!   policies included (modes, budgets, confirmations, idempotency,
//!   timeouts, audit, the loop guard).
//! - [`McpToolServer`] serves a markov [`ToolRegistry`](markov_policy::ToolRegistry),
//!   with its policies, as an MCP server over stdio or Streamable HTTP.
//!
//! ```no_run
//! use markov_mcp::{McpClient, McpServerConfig, ToolFilter};
//! use markov_policy::{Budget, PolicyConfig, ToolRegistry};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let files = McpClient::connect(
//!     McpServerConfig::stdio("npx", ["-y", "@modelcontextprotocol/server-filesystem", "."])
//!         .prefix("fs_")
//!         .filter(ToolFilter::default().deny(["write_file"])),
//! )
//! .await?;
//! let registry = files
//!     .register(ToolRegistry::builder(PolicyConfig::new(Budget::UNLIMITED)), McpClient::default_metadata)
//!     .await?
//!     .lock()?;
//! // Or, without a registry: Agent::builder(..).instructions(..).tools(files.tools().await?).
//! # let _ = registry; Ok(()) }
//! ```
//!
//! # What a stdio server sees
//!
//! A stdio server's environment is not markov's: it gets the variables of
//! [`DEFAULT_INHERITED_ENV`] (`PATH`, `HOME`, `USER`, `LOGNAME`, `SHELL`,
//! `TERM`; on Windows their equivalents), as the official SDKs pass them,
//! plus what its configuration names ([`McpServerConfig::env`], and
//! [`McpServerConfig::inherit_env`] for a variable of markov's own). An
//! API key in markov's environment never reaches a server that was not
//! given it.
//!
//! # Approvals
//!
//! [`McpClient::default_metadata`] maps a tool's annotations onto the
//! registry: a tool the server marks read-only (`readOnlyHint: true`) runs
//! without approval; any other (marked destructive, not marked read-only,
//! or without annotations) needs the application's approval before each
//! call. Per server, [`Approval::All`] or [`Approval::None`] replace the
//! hints, and [`McpServerConfig::require_approval`] and
//! [`McpServerConfig::skip_approval`] name tools either way.
//! [`McpTool::approval`] says what was decided and why;
//! [`McpTool::annotations`] keeps the server's hints.
//!
//! The hints also state what a crash may repeat (the tool definition's
//! [`Delivery`](markov_core::tool::Delivery)): a tool marked read-only or
//! idempotent runs again after a crash with the same idempotency key; one
//! marked destructive and not idempotent runs at most once (a call found
//! started on resume is answered `INTERRUPTED`, never run again); without
//! those hints the contract follows the approval.
//!
//! # What the model reads
//!
//! A tool's content blocks, as the official clients show them: text as it
//! is, an image as an image part of the tool result (a provider that takes
//! no images there, such as Chat Completions, sends a note with its type
//! and size instead), an audio clip, or an image too large
//! ([`MAX_IMAGE_BYTES`]) or of a type providers refuse, as that note;
//! never base64 data as text. Structured content is the result only when
//! the tool declares an output schema and it says what the text says. See
//! [`to_outcome`].
//!
//! # What is offered
//!
//! Every tool the filter admits, under a provider-safe name; two names
//! that clash get a stable suffix, with a warning. A tool the server runs
//! only as a task (`taskSupport: "required"`) is not offered, since this
//! client does not speak the tasks extension (seen over stdio and
//! Streamable HTTP, from the listing's raw messages).
//!
//! # Configuration file
//!
//! [`McpServerConfig::from_file`] reads the `mcpServers` JSON of Claude
//! Desktop, Cursor and VS Code (`command`, `args`, `env`, `cwd`, `url`,
//! `headers`), with markov's keys for roots, timeouts, approvals and tool
//! filters. [`McpServerConfig::parse`] reads one server from a line (a URL,
//! or a command in shell words). Roots ([`McpServerConfig::root`]) are
//! offered only when configured, as desktop clients without a workspace
//! do; the legacy HTTP+SSE transport is not supported, and an `/sse` URL
//! or `"type": "sse"` says so.
//!
//! # Sessions
//!
//! One [`McpClient`] is one MCP session. Its clones and its tools share it,
//! so handing one client's tools to many machines shares the session; for
//! a session per machine, connect a client per machine. The session ends
//! with [`McpClient::close`], or when the last clone and tool are dropped;
//! a stdio server's child process stops with it.
//!
//! # TLS
//!
//! The HTTP client uses rustls without a built-in crypto provider, and
//! rustls panics when none is installed. [`McpClient::connect`] installs
//! *ring* as the process's default provider before its first HTTP
//! connection, unless the application installed one already; an
//! application that wants another provider installs it before connecting.
//! See [`install_crypto_provider`].
//!
//! # Failures
//!
//! A tool call never panics and never hangs: a server error, `isError`, a
//! call timeout (default [`DEFAULT_CALL_TIMEOUT`]), a lost connection or a
//! dead child process is an error result the model reads, and the next
//! call reconnects (or starts the child again). Errors say what failed,
//! where and what to check, in words; a server message nested too deep to
//! read ends the connection at once with that reason, rather than leaving
//! the request to wait out its timeout.
#![deny(missing_docs)]

mod child;
mod client;
mod config;
mod content;
mod error;
mod file;
mod http;
mod server;

pub use client::{ApprovalDecision, CLOSE_TIMEOUT, McpClient, McpTool};
pub use config::{
    Approval, DEFAULT_CALL_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_INHERITED_ENV,
    DEFAULT_LIST_TIMEOUT, McpServerConfig, ToolFilter, Transport,
};
pub use content::{MAX_IMAGE_BYTES, blocks_text, to_outcome};
pub use error::McpError;
pub use server::McpToolServer;

/// rmcp, for what this crate does not wrap (its content types,
/// [`CallToolResult`](rmcp::model::CallToolResult), its transport configurations).
pub use rmcp;

/// The `_meta` key under which a call's idempotency key travels
/// ([`markov_core::tool::ToolContext::idempotency_key`]): the client sends
/// it, [`McpToolServer`] hands it to the tool.
pub const IDEMPOTENCY_META_KEY: &str = "markov/idempotencyKey";

/// Installs *ring* as the process's rustls crypto provider, unless one is
/// installed already. [`McpClient::connect`] calls it before an HTTP
/// connection; call it yourself before building any other rustls client
/// of the process if you build that one first. Returns whether this call
/// installed it.
pub fn install_crypto_provider() -> bool {
    rustls::crypto::CryptoProvider::get_default().is_none()
        && rustls::crypto::ring::default_provider()
            .install_default()
            .is_ok()
}

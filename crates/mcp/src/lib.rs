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
//! // Or, without a registry: Node::builder(..).shared_tool(tool) for each of `files.tools().await?`.
//! # let _ = registry; Ok(()) }
//! ```
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
//! call reconnects (or starts the child again).
#![deny(missing_docs)]

mod child;
mod client;
mod config;
mod content;
mod error;
mod file;
mod server;

pub use client::{ApprovalDecision, CLOSE_TIMEOUT, McpClient, McpTool};
pub use config::{
    Approval, DEFAULT_CALL_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_INHERITED_ENV,
    DEFAULT_LIST_TIMEOUT, McpServerConfig, ToolFilter, Transport,
};
pub use content::{blocks_text, to_outcome};
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

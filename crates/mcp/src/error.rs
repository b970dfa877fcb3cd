//! The crate's errors: what can go wrong talking to an MCP server, or
//! serving one.

use std::time::Duration;

/// Why an MCP operation failed.
///
/// A tool call's failure never reaches the application as this type: the
/// tool turns it into an error result the model reads (see
/// [`McpTool`](crate::McpTool)). It is returned by the calls an
/// application makes itself: connecting, listing, serving.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum McpError {
    /// The configuration cannot be used (an empty command, a bad URL or header).
    #[error("invalid MCP configuration: {0}")]
    Config(String),
    /// The child process of a stdio server could not be started.
    #[error("cannot start MCP server `{command}`: {source}")]
    Spawn {
        /// The program.
        command: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The connection or the MCP handshake failed.
    #[error("cannot connect to MCP server {server}: {detail}")]
    Connect {
        /// The server's label (its command or URL).
        server: String,
        /// What went wrong.
        detail: String,
    },
    /// An operation did not finish in time.
    #[error("MCP {operation} did not finish within {} ms", .after.as_millis())]
    Timeout {
        /// What was waited for (`connect`, `tools/list`, `tools/call`).
        operation: &'static str,
        /// The limit.
        after: Duration,
    },
    /// The connection closed (a dead child process, a dropped connection).
    /// The next operation connects again.
    #[error("the MCP connection closed: {0}")]
    Disconnected(String),
    /// The server answered with a JSON-RPC error.
    #[error("MCP server error {code}: {message}")]
    Server {
        /// The JSON-RPC error code (`-32602` for invalid parameters).
        code: i32,
        /// The server's message.
        message: String,
    },
    /// The server answered something this client does not handle (a task,
    /// a request for more input).
    #[error("unexpected MCP response: {0}")]
    Unexpected(String),
    /// Serving failed (the transport or the listener).
    #[error("MCP server failed: {0}")]
    Serve(String),
    /// The client was closed with [`McpClient::close`](crate::McpClient::close).
    #[error("the MCP client was closed")]
    Closed,
}

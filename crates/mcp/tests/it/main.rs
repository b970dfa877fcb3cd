//! Scenario tests of markov-mcp against real MCP servers the tests start
//! themselves: the crate's stdio test server as a child process, and rmcp
//! servers in-process on a loopback port.

mod common;
mod http;
mod images;
mod naming;
mod policies;
mod reference;
mod server;
mod stdio;

//! The integration tests of this crate, one binary (so linking does not
//! dominate the test run): one module per area.

mod demo;
mod eval;
mod fixtures;
mod mcp;
mod server;

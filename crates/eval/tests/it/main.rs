//! The integration tests of this crate, one binary: one module per area.

mod cli;
mod export;
mod fixtures;
mod guards;
mod guide;
mod regression;
mod state;

//! The integration tests of this crate, one binary: one module per area.

mod export;
mod fixtures;
mod guide;
mod regression;
mod state;

//! The integration tests of this crate, one binary: one module per area.

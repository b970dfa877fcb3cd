//! The facade's scenario tests: its examples driven as a user would, and
//! the examples' eval datasets, run offline.

mod evals;
#[cfg(all(feature = "server", feature = "providers"))]
mod support;

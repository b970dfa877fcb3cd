//! The facade's scenario tests: its examples driven as a user would.

#[cfg(all(feature = "server", feature = "providers"))]
mod support;

//! The integration tests of this crate, one binary (so linking does not
//! dominate the test run): one module per area.

#[cfg(feature = "sqlite")]
mod agents;
#[cfg(feature = "sqlite")]
mod approvals;
#[cfg(feature = "sqlite")]
mod cache;
#[cfg(feature = "sqlite")]
mod cancel;
mod common;
mod context;
#[cfg(feature = "sqlite")]
mod exactly_once;
#[cfg(feature = "sqlite")]
mod handoffs;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "postgres")]
mod postgres_restart;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "sqlite")]
mod steps;
#[cfg(feature = "sqlite")]
mod studio;
#[cfg(feature = "sqlite")]
mod teams;
#[cfg(feature = "sqlite")]
mod tool_search;
#[cfg(feature = "sqlite")]
mod views;

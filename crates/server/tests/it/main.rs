//! The integration tests of this crate, one binary: one module per area.

mod browser;
mod client;
mod fixtures;
mod guards;
mod http;
mod restart;
mod service;
mod studio;
mod studio_agents;
mod studio_hooks;
mod team;

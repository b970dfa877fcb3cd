//! Scenario tests against a real `restate-server` on loopback.

mod kills;
mod overhead;
mod support;

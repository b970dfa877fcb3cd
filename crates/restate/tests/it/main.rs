//! Scenario tests against a real `restate-server` on loopback.

mod cluster;
mod fixture;
mod kills;
mod overhead;
mod redeploy;
mod support;

//! Scenario tests against a real `temporal server start-dev` on loopback.

mod kills;
mod overhead;
mod redeploy;
mod support;

//! Scenario tests against a real `temporal server start-dev` on loopback.

mod continued;
mod fixture;
mod kills;
mod overhead;
mod redeploy;
mod support;

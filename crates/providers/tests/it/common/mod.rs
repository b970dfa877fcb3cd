//! Shared fixtures of the end-to-end provider tests: [`machine`] builds a
//! whole calculator machine over whichever client a test passes in. The
//! fake provider the clients talk to is `markov_testkit::http`.

#![allow(dead_code, unreachable_pub)]

pub mod machine;

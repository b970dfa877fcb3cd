//! Tests of running one response: the pipeline's handling of provider
//! built-in tools, and the system prompt byte for byte.

mod builtin_tools;
mod prompt;

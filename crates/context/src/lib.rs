//! markov's context and usage: what a model call is shown of a long
//! history, and what the calls use, may use and cost.
//!
//! - [`ContextViews`]: one view of the history per context policy, kept
//!   incrementally; compaction (a summary, a vendor's native compaction, a
//!   forced cut after a context-length refusal) and the token estimates
//!   that decide when to compact.
//! - [`call_in_view`]: a leaf's call under a context policy, the summary,
//!   compaction or count it needs first and the second call after a
//!   refusal as too long, each admitted by the usage limits; the calls
//!   themselves are the caller's ([`LeafCalls`]).
//! - [`UsageTotals`], [`UsageLimits`] and [`UsageMeter`]: what a
//!   conversation used, the bounds on it, and the check made before every
//!   model call ([`admit_call`]); [`metered`] counts what an answered call
//!   used.
//! - [`Prices`] and [`ModelPrice`]: the bundled price table and its
//!   overrides, in exact nano-dollars.
//!
//! The executor calls these; none of them calls a model (the executor
//! makes every call) or knows the instance tree.
#![deny(missing_docs)]

mod compact;
mod count;
mod usage;
mod views;

pub use compact::{Called, Leaf, LeafCalls, call_in_view};
pub use usage::{
    Limit, LimitExceeded, LimitKind, LimitScope, ModelCall, ModelPrice, NoPrice, Prices,
    UsageLimits, UsageLimitsBuilder, UsageLimitsError, UsageMeter, UsageTotals, admit_call,
    estimate_framing_tokens, estimate_input_tokens, metered, metered_usage,
};
pub use views::{ContextViews, SUMMARY_PREAMBLE, ViewShape};

//! markov's context and usage: what a model call is shown of a long
//! history, and what the calls use, may use and cost.
//!
//! - [`ContextViews`]: one view of the history per context policy, kept
//!   incrementally; compaction (a summary, a vendor's native compaction, a
//!   forced cut after a context-length refusal) and the token estimates
//!   that decide when to compact.
//! - [`ExactCounts`]: the model's own counts of a view, remembered so a
//!   view is counted again only when its estimate could cross a threshold.
//! - [`UsageTotals`], [`UsageLimits`] and [`UsageMeter`]: what a
//!   conversation used, the bounds on it, and the check made before every
//!   model call ([`admit_call`]); [`metered`] counts what an answered call
//!   used.
//! - [`Prices`] and [`ModelPrice`]: the bundled price table and its
//!   overrides, in exact nano-dollars.
//!
//! The executor calls these; none of them calls a model or knows the
//! instance tree.
#![deny(missing_docs)]

mod count;
mod usage;
mod views;

pub use count::{ExactCounts, Known, Unavailable};
pub use usage::{
    Limit, LimitExceeded, LimitKind, LimitScope, ModelCall, ModelPrice, NoPrice, Prices,
    UsageLimits, UsageLimitsBuilder, UsageLimitsError, UsageMeter, UsageTotals, admit_call,
    estimate_framing_tokens, estimate_input_tokens, metered, metered_usage,
};
pub use views::{
    ContextViews, Forced, Prepared, SUMMARY_PREAMBLE, SummaryJob, ViewRef, native_reads,
};

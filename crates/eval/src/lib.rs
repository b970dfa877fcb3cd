//! Evals for markov agents: know whether a change of instructions, tools
//! or model made the agent better or worse, from what it *did*.
//!
//! - A [`Dataset`] of [`Case`]s, written by hand in TOML (or JSONL), or
//!   exported from a stored session ([`export_session`]): the user turns,
//!   the answers a scripted model plays offline, the expectations.
//! - [`Expect`]: evaluators over the run's steps and its answer — tool
//!   trajectory (exact, in order, subset, with argument matching), the
//!   terminal tool and its output, the yield reason, the policy's
//!   refusals, budgets (steps, tokens, cost, time), the output (equals,
//!   contains, matches, a JSON Schema, the agent's output type), an LLM
//!   judge with a rubric (its usage counted apart), and evaluators of your
//!   own ([`Evaluator`], one method).
//! - [`Runner`]: every case, repeated for a pass rate, on the scripted
//!   model (offline, deterministic: CI) or a real one
//!   ([`ModelChoice::from_env`]), a bounded number at a time; a case that
//!   errors is a failure with its error; every run is stored as a session.
//! - [`Report`]: a table ([`Report::table`]), JSON, JUnit XML, and the
//!   [`Comparison`] with a baseline: regressions and improvements per
//!   case and evaluator, cost and time beside.
//! - [`cli`]: the command line (`run`, `export`) for a binary of your
//!   own over your agent; `markov-cli`'s `markov-eval` is the demo's.
//!
//! See `docs/guide/evals.md` for a worked example.
#![deny(missing_docs)]

pub mod cli;
mod dataset;
mod expect;
mod export;
mod judge;
mod report;
mod run;

pub use dataset::{Answer, Call, Case, Dataset, DatasetError};
pub use expect::{
    CaseRun, Evaluator, Expect, ExpectedCall, ToolCall, TrajectoryMode, Verdict, json_contains,
};
pub use export::{ExportError, export_dataset, export_session, export_steps};
pub use judge::{JUDGE_INSTRUCTIONS, judge, parse_verdict, transcript};
pub use report::{
    CaseDelta, CaseReport, Change, Comparison, Evaluation, Report, RunReport, Summary, xml_escape,
};
pub use run::{AgentFactory, DEFAULT_TIMEOUT, ModelChoice, Progress, RunError, Runner};

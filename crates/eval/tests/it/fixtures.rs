//! The calculator agent of the guide's worked example, and its dataset.

use std::sync::Arc;

use markov_core::model::Model;
use markov_core::tool;
use markov_eval::Dataset;
use markov_executor::{Agent, BuildError};
use markov_policy::{Category, ToolMetadata};
use schemars::JsonSchema;

/// The calculator's answer.
#[derive(Debug, JsonSchema)]
#[allow(dead_code)]
pub(crate) struct Sum {
    /// The sum.
    sum: i64,
}

/// Adds two integers.
#[tool]
async fn add(a: i64, b: i64) -> i64 {
    a + b
}

/// Reports a sum to the user: its text is the answer.
#[tool(terminal)]
async fn report_sum(a: i64, b: i64, sum: i64) -> String {
    format!("{a} + {b} = {sum}")
}

/// The calculator agent on `model`, with `instructions`.
pub(crate) fn calculator(model: Arc<dyn Model>, instructions: &str) -> Result<Agent, BuildError> {
    Agent::builder("calculator")
        .instructions(instructions)
        // Under the registry's policies: an unknown tool is refused.
        .tool_with(Add, ToolMetadata::new(Category::Other))
        .tool_with(ReportSum, ToolMetadata::new(Category::Action))
        .output::<Sum>()
        .shared_model(model)
        .build()
}

/// The calculator's instructions.
pub(crate) const INSTRUCTIONS: &str = "You do arithmetic. Always use the add tool.";

/// The dataset of the guide.
pub(crate) fn dataset() -> Dataset {
    Dataset::load(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/datasets/calculator.toml"
    ))
    .expect("the calculator dataset reads")
}

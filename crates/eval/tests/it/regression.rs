//! A broken instruction shows as a regression against the baseline.
//!
//! The model here is deterministic and reads its instructions: it uses the
//! `add` tool only when told to, and otherwise guesses (wrongly). So the
//! same dataset passes with the calculator's instructions and fails with
//! an instruction that lost the sentence about the tool.

use std::sync::Arc;

use markov_core::model::{Model, ModelError, ModelRequest, ModelResponse, StopReason};
use markov_core::{Item, Role, ToolCallId};
use markov_eval::{Comparison, Dataset, ModelChoice, Runner};

use crate::fixtures::{INSTRUCTIONS, calculator};

/// Calls `add(2, 3)` when the system prompt says to use the tool, then
/// answers with the tool's result; otherwise answers `{"sum": 6}`.
#[derive(Debug)]
struct ReadsItsInstructions;

#[markov_core::async_trait]
impl Model for ReadsItsInstructions {
    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let result = request.messages().iter().rev().find_map(|m| {
            (m.role == Role::User).then(|| {
                m.item_list().iter().find_map(|item| match item {
                    Item::ToolResult { content, .. } => Some(content.clone()),
                    _ => None,
                })
            })?
        });
        let answer = match result {
            Some(sum) => Item::text(format!("{{\"sum\": {sum}}}")),
            None if request.system().contains("Always use the add tool") => Item::tool_use(
                ToolCallId::new("call_1"),
                "add",
                serde_json::json!({"a": 2, "b": 3}),
            ),
            None => Item::text("{\"sum\": 6}"),
        };
        let stop = if matches!(answer, Item::ToolUse { .. }) {
            StopReason::ToolUse
        } else {
            StopReason::EndTurn
        };
        Ok(ModelResponse::new(vec![answer], stop))
    }
}

const DATASET: &str = r#"
name = "instructions"

[[case]]
id = "adds"
input = ["What is 2 + 3?"]

[[case.expect]]
kind = "trajectory"
calls = [{ tool = "add", args = { a = 2, b = 3 } }]

[[case.expect]]
kind = "output_contains"
value = "5"

[[case]]
id = "answers-json"
input = ["What is 2 + 3?"]

[[case.expect]]
kind = "output_type"
"#;

async fn report(instructions: &'static str) -> markov_eval::Report {
    let dataset = Dataset::from_toml(DATASET).expect("reads");
    Runner::new(move |model| calculator(model, instructions))
        .model(ModelChoice::Live {
            model: Arc::new(ReadsItsInstructions) as Arc<dyn Model>,
            label: "reads its instructions".into(),
        })
        .repeat(3)
        .run(&dataset)
        .await
        .expect("runs")
}

#[tokio::test]
async fn a_broken_instruction_is_flagged_as_a_regression_against_the_baseline() {
    let baseline = report(INSTRUCTIONS).await;
    assert_eq!(baseline.summary.pass_rate, 1.0, "{}", baseline.table());
    let broken = report("You do arithmetic.").await;
    let comparison = Comparison::new(&baseline, &broken);
    let table = comparison.table();
    assert!(comparison.has_regressions(), "{table}");
    let regressed: Vec<(String, Option<String>)> = comparison
        .regressions
        .iter()
        .map(|c| (c.case.clone(), c.evaluator.clone()))
        .collect();
    assert_eq!(
        regressed,
        [
            ("adds".to_owned(), None),
            ("adds".to_owned(), Some("trajectory_in_order".to_owned())),
            ("adds".to_owned(), Some("output_contains".to_owned())),
        ],
        "{table}"
    );
    // The case that does not depend on the sentence did not move.
    assert!(comparison.improvements.is_empty(), "{table}");
    assert!(
        table.contains("worse adds / trajectory_in_order: 100% -> 0%"),
        "{table}"
    );
    assert!(table.contains("answers-json: pass 100% -> 100%"), "{table}");
    // The same instructions compared with themselves: nothing to report.
    let again = report(INSTRUCTIONS).await;
    assert!(!Comparison::new(&baseline, &again).has_regressions());
}

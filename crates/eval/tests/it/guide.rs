//! The guide's worked example: the calculator dataset, every kind of
//! expectation, run offline with its report in all three formats.

use markov_eval::{CaseRun, Evaluator, Report, Runner, Verdict};
use serde_json::Value;

use crate::fixtures::{INSTRUCTIONS, calculator, dataset};

/// A custom evaluator: at most `config.max` tool calls.
#[derive(Debug)]
struct CallsAtMost;

#[markov_core::async_trait]
impl Evaluator for CallsAtMost {
    async fn evaluate(&self, run: &CaseRun, config: &Value) -> Verdict {
        let Some(max) = config.get("max").and_then(Value::as_u64) else {
            return Verdict::fail("config.max is not a number");
        };
        if run.calls.len() as u64 <= max {
            Verdict::pass()
        } else {
            Verdict::fail(format!("{} calls > {max}", run.calls.len()))
        }
    }
}

fn runner() -> Runner {
    Runner::new(|model| calculator(model, INSTRUCTIONS))
        .evaluator("calls_at_most", CallsAtMost)
        .concurrency(2)
}

#[tokio::test]
async fn the_calculator_dataset_passes_offline_with_every_evaluator_kind() {
    let dataset = dataset();
    let report = runner().run(&dataset).await.expect("runs");
    let table = report.table();
    assert_eq!(report.summary.runs, 3, "{table}");
    assert_eq!(report.summary.passed, 3, "{table}");
    let kinds: std::collections::BTreeSet<&str> = report
        .cases
        .iter()
        .flat_map(|c| &c.runs)
        .flat_map(|r| &r.evaluations)
        .map(|e| e.evaluator.split('#').next().unwrap_or_default())
        .collect();
    let every = [
        "budget",
        "calls_at_most",
        "judge",
        "output_contains",
        "output_equals",
        "output_matches",
        "output_schema",
        "output_type",
        "refusals",
        "terminal_tool",
        "trajectory_exact",
        "trajectory_in_order",
        "trajectory_subset",
        "yield_reason",
    ];
    assert_eq!(kinds.into_iter().collect::<Vec<_>>(), every, "{table}");
    // The judge's usage is apart from the agent's: one scripted request.
    let first = &report.cases[0].runs[0];
    assert_eq!(first.judge_usage.requests, 1);
    assert_eq!(first.usage.requests, 2);
    assert_eq!(first.steps, 2);
    // Each run names its stored session.
    assert!(
        first
            .session
            .starts_with("calculator/adds-with-the-tool/1/")
    );

    // JSON reads back; JUnit has a test case per run and no failure.
    assert_eq!(Report::from_json(&report.to_json()).expect("reads"), report);
    let junit = report.to_junit();
    assert_eq!(junit.matches("<testcase ").count(), 3, "{junit}");
    assert!(!junit.contains("<failure"), "{junit}");
    assert!(
        junit.contains("name=\"an-unknown-tool-is-refused#1\""),
        "{junit}"
    );
    assert!(table.contains("3 of 3 runs passed (100%)"), "{table}");
}

#[tokio::test]
async fn a_wrong_expectation_fails_at_its_step_and_says_why() {
    let mut dataset = dataset();
    // The first case now expects the tool to be called with other numbers.
    dataset.cases[0].expect[0] = markov_eval::Expect::Trajectory {
        mode: markov_eval::TrajectoryMode::Exact,
        calls: vec![markov_eval::ExpectedCall {
            tool: "add".into(),
            args: Some(serde_json::json!({"a": 2, "b": 4})),
        }],
    };
    let report = runner().run(&dataset).await.expect("runs");
    let run = &report.cases[0].runs[0];
    assert!(!run.passed);
    assert_eq!(run.failed_step, Some(1), "{}", report.table());
    let failed: Vec<_> = run
        .evaluations
        .iter()
        .filter(|e| !e.verdict.passed)
        .collect();
    assert_eq!(failed.len(), 1);
    assert!(
        failed[0]
            .verdict
            .detail
            .contains("expected add({\"a\":2,\"b\":4})"),
        "{}",
        failed[0].verdict.detail
    );
    let junit = report.to_junit();
    assert!(
        junit.contains("<failure type=\"trajectory_exact\""),
        "{junit}"
    );
    assert!(
        report.table().contains("trajectory_exact: call 1 is add("),
        "{}",
        report.table()
    );
}

#[tokio::test]
async fn a_case_that_errors_is_a_failed_run_with_its_error_and_the_others_still_run() {
    let mut dataset = dataset();
    // The script runs out before the turn ends; the second case has none.
    dataset.cases[0].script.pop();
    dataset.cases[1].script.clear();
    let report = runner().repeat(2).run(&dataset).await.expect("runs");
    assert_eq!(report.summary.runs, 6);
    assert_eq!(report.summary.errors, 4, "{}", report.table());
    assert_eq!(report.summary.passed, 2, "{}", report.table());
    let exhausted = report.cases[0].runs[0].error.as_deref().unwrap_or_default();
    assert!(exhausted.contains("script is exhausted"), "{exhausted}");
    let missing = report.cases[1].runs[1].error.as_deref().unwrap_or_default();
    assert!(missing.contains("has no script"), "{missing}");
    assert!(report.to_junit().contains("<error message="));
    assert_eq!(report.cases[2].pass_rate(), 1.0);
}

#[test]
fn the_guide_shows_the_dataset_ci_runs() {
    let guide = include_str!("../../../../docs/guide/evals.md");
    let dataset = include_str!("../../datasets/calculator.toml");
    let block = guide
        .split("```toml\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the guide has a TOML block");
    assert!(
        dataset.contains(block),
        "the guide's TOML block is not in datasets/calculator.toml:\n{block}"
    );
}

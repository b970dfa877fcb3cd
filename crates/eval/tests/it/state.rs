//! A case may start the conversation in a state of its own.

use markov_core::async_trait;
use markov_core::tool::{Tool, ToolContext};
use markov_eval::{Dataset, Runner};
use markov_executor::Agent;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

/// Says which unit the conversation counts in, from its state.
#[derive(Debug)]
struct Unit;

/// No arguments.
#[derive(Debug, Deserialize, JsonSchema)]
struct NoArgs {}

#[async_trait]
impl Tool for Unit {
    const NAME: &'static str = "unit";
    type Args = NoArgs;
    type Output = Value;
    type Error = std::convert::Infallible;
    fn description(&self) -> String {
        "The unit of the count.".into()
    }
    async fn call(&self, _args: NoArgs, cx: &ToolContext<'_>) -> Result<Value, Self::Error> {
        Ok(cx.state_json().get("unit").cloned().unwrap_or(Value::Null))
    }
}

const DATASET: &str = r#"
name = "state"

[[case]]
id = "default-state"
input = ["Which unit?"]
script = [{ calls = [{ tool = "unit" }] }, { text = "done" }]

[[case.expect]]
kind = "custom"
name = "unit_result"
config = "apples"

[[case]]
id = "own-state"
input = ["Which unit?"]
state = { unit = "pears" }
script = [{ calls = [{ tool = "unit" }] }, { text = "done" }]

[[case.expect]]
kind = "custom"
name = "unit_result"
config = "pears"
"#;

/// The first call's result is the configured text (as JSON).
#[derive(Debug)]
struct UnitResult;

#[async_trait]
impl markov_eval::Evaluator for UnitResult {
    async fn evaluate(&self, run: &markov_eval::CaseRun, config: &Value) -> markov_eval::Verdict {
        let got = run
            .calls
            .first()
            .and_then(|c| c.result.clone())
            .unwrap_or_default();
        if Some(got.as_str()) == config.as_str() {
            markov_eval::Verdict::pass()
        } else {
            markov_eval::Verdict::fail(format!("unit {got}, expected {config}"))
        }
    }
}

#[tokio::test]
async fn a_case_state_replaces_the_start_state_keys_it_names() {
    let dataset = Dataset::from_toml(DATASET).expect("reads");
    let report = Runner::new(|model| {
        Agent::builder("counter")
            .instructions("Count.")
            .tool(Unit)
            .state(json!({"unit": "apples", "n": 0}))
            .shared_model(model)
            .build()
    })
    .evaluator("unit_result", UnitResult)
    .run(&dataset)
    .await
    .expect("runs");
    assert_eq!(report.summary.passed, 2, "{}", report.table());
}

//! The `evals` example's dataset passes offline on the example's own agent.

#[allow(dead_code)]
#[path = "../../examples/evals.rs"]
mod example;

use markov::eval::{Dataset, Runner};

#[tokio::test]
async fn the_quickstart_dataset_passes_offline_on_the_examples_agent() {
    let dataset = Dataset::load(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/evals/quickstart.toml"
    ))
    .expect("the dataset reads");
    let report = Runner::new(example::calculator)
        .run(&dataset)
        .await
        .expect("runs");
    assert_eq!(report.summary.runs, 2, "{}", report.table());
    assert_eq!(report.summary.passed, 2, "{}", report.table());
}

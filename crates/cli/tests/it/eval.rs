//! The demo's eval dataset: it passes offline on each case's script, and
//! the `markov-eval` binary runs it against an OpenAI-compatible server
//! (a loopback fake here, llama.cpp, vLLM or Ollama for the owners) with
//! one environment variable, reporting a pass rate rather than an error.

use markov_eval::{Dataset, ModelChoice, Report, Runner};

use crate::fixtures::without_provider;

const DATASET: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/evals/demo.toml");

#[tokio::test]
async fn the_demo_dataset_passes_offline_on_the_real_demo_agent() {
    let dataset = Dataset::load(DATASET).expect("the demo dataset reads");
    let report = Runner::new(markov_cli::demo_eval_agent)
        .model(ModelChoice::Scripted)
        .run(&dataset)
        .await
        .expect("runs");
    assert_eq!(report.summary.runs, 3, "{}", report.table());
    assert_eq!(report.summary.passed, 3, "{}", report.table());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn one_variable_runs_the_demo_dataset_on_a_real_server_with_a_pass_rate() {
    use markov_testkit::http::{FakeServer, Reply, openai};
    use serde_json::json;

    // A small model that gets two cases right and one wrong (it forgets
    // the figure), one case after the other.
    let server = FakeServer::scripted(vec![
        Reply::json(
            200,
            json!({"object": "list", "data": [{"id": "local-model"}]}),
        ),
        Reply::json(
            200,
            openai::tool_call("c1", "population", &json!({"city": "Lisbon"})),
        ),
        Reply::json(
            200,
            openai::tool_call("c2", "population", &json!({"city": "Porto"})),
        ),
        Reply::json(
            200,
            openai::tool_call("c3", "add", &json!({"a": 545_923, "b": 231_962})),
        ),
        Reply::json(200, openai::text("Together they have 777,885 inhabitants.")),
        Reply::json(
            200,
            openai::tool_call("c4", "population", &json!({"city": "Porto"})),
        ),
        Reply::json(200, openai::text("Porto is a large city.")),
        Reply::json(
            200,
            openai::tool_call("c5", "population", &json!({"city": "Madrid"})),
        ),
        Reply::json(
            200,
            openai::text("I don't know how many people live in Madrid."),
        ),
    ])
    .await;
    let out = std::env::temp_dir().join(format!("markov-eval-demo-{}", std::process::id()));
    let base = format!("{}/v1", server.base_url());
    let out_arg = out.clone();
    let output = tokio::task::spawn_blocking(move || {
        let mut command = without_provider(env!("CARGO_BIN_EXE_markov-eval"));
        command
            .env("OPENAI_BASE_URL", &base)
            .args([
                "run",
                DATASET,
                "--concurrency",
                "1",
                "--min-pass-rate",
                "0.6",
                "--out",
            ])
            .arg(&out_arg)
            .output()
            .expect("markov-eval runs")
    })
    .await
    .expect("joined");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    let first = stdout.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("model: openai chat completions api ("),
        "{first}"
    );
    assert!(first.contains("local-model"), "{first}");
    let report = Report::from_json(
        &std::fs::read_to_string(out.join("report.json")).expect("report.json is written"),
    )
    .expect("reads");
    assert_eq!(report.summary.errors, 0, "{stdout}");
    assert_eq!(
        (report.summary.passed, report.summary.runs),
        (2, 3),
        "{stdout}"
    );
    let one_city = &report.cases[1].runs[0];
    assert!(!one_city.passed);
    assert_eq!(one_city.evaluations[1].evaluator, "output_matches");
    assert!(!one_city.evaluations[1].verdict.passed);
    assert!(stdout.contains("2 of 3 runs passed (67%)"), "{stdout}");
    let junit = std::fs::read_to_string(out.join("junit.xml")).expect("junit.xml is written");
    assert!(
        junit.contains("<failure type=\"output_matches\""),
        "{junit}"
    );
    assert!(out.join("sessions.db").exists());
    // Every model call named the served model, never a vendor default.
    for request in &server.requests()[1..] {
        assert_eq!(request.body["model"], "local-model");
    }
    let _ = std::fs::remove_dir_all(&out);
}

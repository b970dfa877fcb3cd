//! A client generated from the served OpenAPI document by a standard
//! generator (`openapi-python-client`), driving the whole API: the document
//! validates (`openapi-spec-validator`), every answer has the status and
//! the body the document gives, and every streamed event fits its schema
//! (see `client.py`). In CI a missing generator is a failure, never a
//! skip (`.ci/run` installs it).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use markov_executor::Agent;
use markov_policy::{Category, ToolMetadata};
use markov_testkit::ScriptedModel;
use serde_json::{Value, json};

use crate::http::{Pay, Slow, serve_agent};

/// The Python that has the generator, the validator and httpx: the one of
/// `MARKOV_OPENAPI_PYTHON` (what `.ci/run` installs), else `python3`.
fn python() -> PathBuf {
    std::env::var_os("MARKOV_OPENAPI_PYTHON").map_or_else(|| "python3".into(), PathBuf::from)
}

/// The generator's command: beside that Python (a virtual environment's
/// `bin`), else on the `PATH`.
fn generator(python: &Path) -> PathBuf {
    python
        .parent()
        .map(|bin| bin.join("openapi-python-client"))
        .filter(|path| path.is_file())
        .unwrap_or_else(|| "openapi-python-client".into())
}

fn runs(command: &mut Command) -> bool {
    command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// The tools, or `None` (outside CI) when they are missing.
fn tools() -> Option<(PathBuf, PathBuf)> {
    let python = python();
    let generator = generator(&python);
    let present = runs(Command::new(&python).args([
        "-c",
        "import openapi_spec_validator, jsonschema, httpx, attrs",
    ])) && runs(Command::new(&generator).arg("--version"));
    if present {
        return Some((python, generator));
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "openapi-python-client and openapi-spec-validator are not installed for {} \
         (MARKOV_OPENAPI_PYTHON), and CI must run the generated client's test (.ci/run installs them)",
        python.display()
    );
    eprintln!("skipped: openapi-python-client / openapi-spec-validator not installed");
    None
}

/// Runs `command` to its end, at most `limit`: its status and output.
async fn run(mut command: Command, limit: Duration) -> (bool, String) {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the command starts");
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("waits") {
            let output = child.wait_with_output().expect("its output");
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
            return (status.success(), text);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let output = child.wait_with_output().expect("its output");
            panic!(
                "{command:?} took longer than {limit:?}: {}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_generated_from_the_document_drives_the_whole_api() {
    let Some((python, generator)) = tools() else {
        return;
    };
    // Each answer takes a moment, so a turn can be cancelled while it runs.
    let model = Slow(
        ScriptedModel::builder()
            .tool_call("pay", json!({"amount": 5}))
            .text("Paid 5.")
            .text("Too late to cancel.")
            .build(),
        Duration::from_millis(800),
    );
    let pays = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let agent = Agent::builder("payments")
        .instructions("You pay bills.")
        .tool_with(
            Pay(pays.clone()),
            ToolMetadata::new(Category::Action).with_confirmation(),
        )
        .model(model)
        .build()
        .expect("the agent builds");
    let f = serve_agent(agent, pays).await;

    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "generated-client-{}-{}",
        std::process::id(),
        f.base.rsplit(':').next().unwrap_or("0")
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a directory");
    // The document as the running server serves it.
    let served = f
        .client
        .get(format!("{}/openapi.json", f.base))
        .bearer_auth(&f.key)
        .send()
        .await
        .expect("sent")
        .text()
        .await
        .expect("a body");
    let _: Value = serde_json::from_str(&served).expect("JSON");
    let document = dir.join("openapi.json");
    std::fs::write(&document, &served).expect("written");

    let mut generate = Command::new(&generator);
    generate
        .arg("generate")
        .arg("--path")
        .arg(&document)
        .args(["--meta", "none", "--output-path"])
        .arg(dir.join("markov_client"));
    let (generated, output) = run(generate, Duration::from_secs(120)).await;
    assert!(generated, "the generator failed: {output}");
    // Only the metrics (OpenMetrics text) and a session saved as an eval
    // case (a TOML file) are left to the caller to read: the generator
    // makes no type of a text format that is not JSON.
    for warning in output.lines().filter(|l| l.starts_with("WARNING")) {
        assert!(
            warning.contains("GET /metrics") || warning.contains("GET /sessions/{id}/case"),
            "the generator could not use part of the document: {warning}\n{output}"
        );
    }

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/client.py");
    let mut drive = Command::new(&python);
    drive
        .arg(script)
        .arg(&f.base)
        .arg(&f.key)
        .arg(&dir)
        .arg(&document);
    let (passed, output) = run(drive, Duration::from_secs(120)).await;
    assert!(passed && output.trim_end().ends_with("OK"), "{output}");
    let _ = std::fs::remove_dir_all(&dir);
}

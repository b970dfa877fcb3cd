//! `markov-demo`, the README's demo: an agent with two tools, `add` and
//! `population`, answers "How many people live in Lisbon and Porto
//! together?" and prints each step of the run.
//!
//! The model is chosen at start, and the first line says which:
//!
//! - `ANTHROPIC_API_KEY` or `ANTHROPIC_BASE_URL` set: the Messages API, at
//!   Anthropic or at another address (a local server such as llama.cpp's);
//! - else `OPENAI_API_KEY` or `OPENAI_BASE_URL` set: an OpenAI-compatible
//!   Chat Completions server (OpenAI, vLLM, Ollama, llama.cpp, LM Studio);
//! - else a scripted model, labelled as a rehearsal.
//!
//! A failure is printed on stderr and the process exits with status 1.
//!
//! ```text
//! cargo run -p markov-cli --bin markov-demo
//! ANTHROPIC_API_KEY=... cargo run -p markov-cli --bin markov-demo
//! ANTHROPIC_BASE_URL=http://localhost:8080 cargo run -p markov-cli --bin markov-demo
//! OPENAI_BASE_URL=http://localhost:11434/v1 cargo run -p markov-cli --bin markov-demo
//! ```

mod tools;

use std::process::ExitCode;
use std::sync::Arc;

use futures::StreamExt;
use markov_core::message::{Item, Message};
use markov_core::model::Model;
use markov_executor::{Instance, Machine, RunError, RunOptions, StandardExecutor, run_machine};
use markov_providers::{Anthropic, OpenAi};
use markov_runtime::charter::Charter;
use markov_runtime::node::Node;
use markov_testkit::ScriptedModel;
use serde_json::json;

use crate::tools::{Add, Population};

/// The question the agent answers.
const QUESTION: &str = "How many people live in Lisbon and Porto together?";

/// Why the demo stopped early.
#[derive(Debug, thiserror::Error)]
enum DemoError {
    /// A provider client could not be built from the environment.
    #[error("cannot configure the model: {0}")]
    Provider(#[from] markov_providers::ConfigError),
    /// The node or charter is invalid.
    #[error("invalid agent: {0}")]
    Agent(#[from] markov_runtime::ConfigError),
    /// The machine could not be built, or the run failed.
    #[error("the run failed: {0}")]
    Run(#[from] RunError),
}

/// Whether an environment variable is set to something other than blanks
/// (the providers treat an empty value as unset, and so does the choice).
fn is_set(var: &str) -> bool {
    std::env::var(var).is_ok_and(|value| !value.trim().is_empty())
}

/// `MARKOV_MODEL` names the model to ask for (e.g. a local server's model),
/// overriding the client's default.
fn model_override() -> Option<String> {
    std::env::var("MARKOV_MODEL")
        .ok()
        .filter(|m| !m.trim().is_empty())
}

/// The model for this run and the line that names it.
fn pick_model() -> Result<(Arc<dyn Model>, String), DemoError> {
    if is_set("ANTHROPIC_API_KEY") || is_set("ANTHROPIC_BASE_URL") {
        let model = Anthropic::from_env()?;
        let base = std::env::var("ANTHROPIC_BASE_URL")
            .ok()
            .filter(|url| !url.trim().is_empty())
            .unwrap_or_else(|| markov_providers::anthropic::DEFAULT_BASE_URL.to_owned());
        let label = format!(
            "model: anthropic messages api ({base}, {})",
            model_override().as_deref().unwrap_or(model.default_model())
        );
        return Ok((Arc::new(model), label));
    }
    if is_set("OPENAI_API_KEY") || is_set("OPENAI_BASE_URL") {
        let model = OpenAi::from_env()?;
        let base = std::env::var("OPENAI_BASE_URL")
            .ok()
            .filter(|url| !url.trim().is_empty())
            .unwrap_or_else(|| markov_providers::openai::DEFAULT_BASE_URL.to_owned());
        let label = format!(
            "model: openai-compatible ({base}, {})",
            model_override().as_deref().unwrap_or(model.default_model())
        );
        return Ok((Arc::new(model), label));
    }
    let label = "model: scripted (no ANTHROPIC_API_KEY or OPENAI_API_KEY set; \
                 this run is a rehearsal, not a real model)"
        .to_owned();
    Ok((Arc::new(scripted()), label))
}

/// What a model with the two tools would do: look both cities up, add,
/// answer.
fn scripted() -> ScriptedModel {
    ScriptedModel::builder()
        .tool_calls([
            ("population", json!({"city": "Lisbon"})),
            ("population", json!({"city": "Porto"})),
        ])
        .tool_call("add", json!({"a": 545_923, "b": 231_962}))
        .text("Lisbon and Porto have 777885 inhabitants together.")
        .build()
}

/// Prints the text, tool calls and tool results of one message.
fn print_message(message: &Message) {
    for item in message.item_list() {
        match item {
            Item::Text { text } => println!("  {:?}: {text}", message.role),
            Item::ToolUse { name, input, .. } => println!("  model calls {name}({input})"),
            Item::ToolResult {
                content, is_error, ..
            } => println!(
                "  tool {}: {content}",
                if *is_error == Some(true) {
                    "error"
                } else {
                    "result"
                }
            ),
            _ => {}
        }
    }
}

/// Builds the agent over the chosen model and runs it on [`QUESTION`].
async fn demo() -> Result<(), DemoError> {
    let (model, label) = pick_model()?;
    println!("{label}");
    let node = Node::builder("You answer questions about cities with your tools.")
        .name("cities")
        .tool(Add)
        .tool(Population)
        .build()?;
    let charter = Charter::builder("demo")
        .node("cities", node.clone())
        .build()?;
    let mut machine = Machine::new(
        charter,
        StandardExecutor::shared(model).with_settings(markov_core::model::ModelSettings {
            model: model_override(),
            ..markov_core::model::ModelSettings::default()
        }),
        Instance::new(node, json!({})),
    )?;
    machine.enqueue_user(QUESTION);
    let mut steps = std::pin::pin!(run_machine(&mut machine, RunOptions::default()));
    let mut n = 0;
    while let Some(step) = steps.next().await {
        let step = step?;
        n += 1;
        println!("step {n} ({}):", step.yield_reason.as_str());
        for message in &step.history {
            print_message(message);
        }
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match demo().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

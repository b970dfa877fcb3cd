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

use std::process::ExitCode;

use futures::StreamExt;
use markov_core::message::{Item, Message};
use markov_executor::{Instance, Machine, RunError, RunOptions, StandardExecutor, run_machine};
use markov_runtime::charter::Charter;
use markov_runtime::node::Node;
use serde_json::json;

use markov_cli::tools::{Add, Population};
use markov_cli::{INSTRUCTIONS, QUESTION, model_override, pick_model};

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
    let node = Node::builder(INSTRUCTIONS)
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

//! Runs a demo agent on Temporal: a greeter with one tool run as an
//! activity.
//!
//! ```text
//! temporal server start-dev --headless &               # frontend :7233
//! cargo run -p markov-temporal --example temporal_demo # polls task queue "markov"
//! temporal workflow signal-with-start --workflow-id alice --type MarkovSession \
//!     --task-queue markov --input '{}' --signal-name send --signal-input '"hi, I like tea"'
//! temporal workflow query --workflow-id alice --type status
//! ```
//!
//! The model is scripted, so the example needs no API key; put a provider
//! client from `markov-providers` in its place for a real one.

use markov_core::async_trait;
use markov_core::tool::{Tool, ToolContext};
use markov_executor::Agent;
use markov_temporal::{SessionClient, SessionWorker, Steps};
use markov_testkit::ScriptedModel;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

#[derive(Debug, Deserialize, JsonSchema)]
struct NoteArgs {
    /// What to remember.
    note: String,
}

/// Remembers a note (here: prints it).
struct Remember;

#[async_trait]
impl Tool for Remember {
    const NAME: &'static str = "remember";
    type Args = NoteArgs;
    type Output = String;
    type Error = std::convert::Infallible;

    fn description(&self) -> String {
        "Remember a note about the user.".into()
    }

    async fn call(&self, args: NoteArgs, _cx: &ToolContext<'_>) -> Result<String, Self::Error> {
        println!("remembered: {}", args.note);
        Ok(format!("remembered {}", args.note))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = ScriptedModel::builder()
        .tool_call("remember", json!({"note": "likes tea"}))
        .text("Hello! I will remember that you like tea.")
        .build();
    let steps = Steps::new();
    let agent = Agent::builder("greeter")
        .instructions("Greet the user and remember what they like.")
        .model(steps.model(model))
        .tools([steps.tool(Remember)?])
        .build()?;
    let address =
        std::env::var("MARKOV_TEMPORAL_ADDRESS").unwrap_or_else(|_| "http://127.0.0.1:7233".into());
    let client = SessionClient::connect(&address, "default", "markov").await?;
    println!("running MarkovSession workflows on task queue markov at {address}");
    SessionWorker::new(agent, steps).run(&client).await?;
    Ok(())
}

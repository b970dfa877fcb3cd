//! Serves a demo agent on Restate: a greeter with one journaled tool.
//!
//! ```text
//! restate-server &                                   # ingress :8080, admin :9070
//! cargo run -p markov-restate --example restate_demo # serves on :9080
//! restate deployments register http://127.0.0.1:9080
//! curl -X POST localhost:8080/MarkovSession/alice/send --json '"hi, note that I like tea"'
//! ```
//!
//! The model is scripted, so the example needs no API key; put a provider
//! client from `markov-providers` in its place for a real one.

use markov_core::async_trait;
use markov_core::tool::{Tool, ToolContext};
use markov_executor::Agent;
use markov_restate::{JournaledModel, SessionObject, journaled};
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
    let agent = Agent::builder("greeter")
        .instructions("Greet the user and remember what they like.")
        .model(JournaledModel::new(model))
        .tools([journaled(Remember)?])
        .build()?;
    let addr = std::env::var("MARKOV_RESTATE_ADDR").unwrap_or_else(|_| "127.0.0.1:9080".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!(
        "serving MarkovSession on http://{addr}; register it with restate deployments register"
    );
    SessionObject::new(agent).serve(listener).await;
    Ok(())
}

//! The demo agent both binaries run: `markov-demo` (one question, printed
//! step by step) and `markov-serve` (the agent over HTTP with a web page).
//!
//! The model is chosen from the environment, and the chosen endpoint is
//! named in one line:
//!
//! - `ANTHROPIC_API_KEY` or `ANTHROPIC_BASE_URL` set: the Messages API, at
//!   Anthropic or at another address (a local server such as llama.cpp's);
//! - else `GEMINI_API_KEY` or `GEMINI_BASE_URL` set: the Gemini API;
//! - else `OPENAI_API_KEY` or `OPENAI_BASE_URL` set: OpenAI's Responses API
//!   with `MARKOV_OPENAI_API=responses`, else an OpenAI-compatible Chat
//!   Completions server (OpenAI, vLLM, Ollama, llama.cpp, LM Studio);
//! - else a scripted model, labelled as a rehearsal.
//!
//! `MARKOV_MODEL` names the model; without it, a server other than the
//! vendor's is asked for the model it serves ([`pick_settled_model_or`]).
#![deny(missing_docs)]

mod rehearsal;
pub mod tools;

pub use rehearsal::Rehearsal;

use std::sync::Arc;

use markov_core::model::{Model, ModelSettings};
use markov_executor::{Agent, AgentBuilder};
use markov_testkit::ScriptedModel;
use serde_json::json;

/// The question `markov-demo` asks.
pub const QUESTION: &str = "How many people live in Lisbon and Porto together?";

/// The demo node's instructions.
pub const INSTRUCTIONS: &str = "You answer questions about cities with your tools.";

/// `MARKOV_MODEL` names the model to ask for (e.g. a local server's model),
/// overriding the client's default.
pub fn model_override() -> Option<String> {
    std::env::var("MARKOV_MODEL")
        .ok()
        .filter(|m| !m.trim().is_empty())
}

/// The model for this run and the line that names it.
pub fn pick_model() -> Result<(Arc<dyn Model>, String), markov_providers::ConfigError> {
    pick_model_or(Arc::new(scripted()))
}

/// [`pick_model_or`], and then, for a server other than the vendor's with
/// no `MARKOV_MODEL` set, the model the server serves
/// ([`markov_providers::EnvModel::settle_model`]): the vendor's default
/// name (`gpt-4.1`, `claude-…`) is never sent to a local server.
///
/// # Errors
/// As [`pick_model_or`], and [`markov_providers::ConfigError::ModelNotNamed`]
/// when the server does not name exactly one model.
pub async fn pick_settled_model_or(
    rehearsal: Arc<dyn Model>,
) -> Result<(Arc<dyn Model>, String), markov_providers::ConfigError> {
    match markov_providers::from_env()? {
        Some(configured) => {
            let configured = configured.settle_model().await?;
            Ok((
                configured.model(),
                format!("model: {}", configured.description()),
            ))
        }
        None => Ok((rehearsal, rehearsal_label())),
    }
}

/// The first line of a run on the scripted model.
fn rehearsal_label() -> String {
    "model: scripted (no ANTHROPIC_API_KEY, GEMINI_API_KEY or OPENAI_API_KEY set; \
     this run is a rehearsal, not a real model)"
        .to_owned()
}

/// [`pick_model`] with `rehearsal` when no provider is configured.
pub fn pick_model_or(
    rehearsal: Arc<dyn Model>,
) -> Result<(Arc<dyn Model>, String), markov_providers::ConfigError> {
    if let Some(configured) = markov_providers::from_env()? {
        // The model asked for, when `MARKOV_MODEL` overrides the client's.
        let label = match model_override() {
            Some(model) => format!("model: {} asking for {model}", configured.description()),
            None => format!("model: {}", configured.description()),
        };
        return Ok((configured.model(), label));
    }
    Ok((rehearsal, rehearsal_label()))
}

/// The demo agent on `model`, with its two tools: add more tools (an MCP
/// server's) or policies, then build it.
pub fn demo_agent(model: Arc<dyn Model>) -> AgentBuilder {
    Agent::builder("cities")
        .instructions(INSTRUCTIONS)
        .tool(tools::Add)
        .tool(tools::Population)
        .shared_model(model)
        .settings(ModelSettings {
            model: model_override(),
            ..ModelSettings::default()
        })
}

/// The demo agent as `markov-demo` runs it, on `model`: the turn's first
/// call must use a tool (the questions need them), so a server that
/// ignores the tools it is offered fails rather than making an answer up.
/// The agent the demo's eval dataset (`crates/cli/evals/demo.toml`) runs.
///
/// # Errors
/// The agent does not build.
pub fn demo_eval_agent(model: Arc<dyn Model>) -> Result<Agent, markov_executor::BuildError> {
    let model = Arc::new(markov_executor::ToolChoiceEnforcer::new(
        model,
        markov_runtime::tool_choice::ToolChoiceRule::RequiredFirst,
    ));
    demo_agent(model).build()
}

/// What a model with the two tools would do: look both cities up, add,
/// answer.
pub fn scripted() -> ScriptedModel {
    ScriptedModel::builder()
        .tool_calls([
            ("population", json!({"city": "Lisbon"})),
            ("population", json!({"city": "Porto"})),
        ])
        .tool_call("add", json!({"a": 545_923, "b": 231_962}))
        .text("Lisbon and Porto have 777885 inhabitants together.")
        .build()
}

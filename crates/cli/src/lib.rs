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

pub mod mcp;
mod rehearsal;
pub mod tools;

pub use rehearsal::Rehearsal;

use std::sync::Arc;

use markov_charter::context::{ContextPolicy, DEFAULT_SUMMARY_MAX_TOKENS, Summarize};
use markov_core::model::{Model, ModelLimits, ModelSettings};
use markov_executor::agent::builder::OneNode;
use markov_executor::{Agent, AgentBuilder};
use markov_testkit::ScriptedModel;
use serde_json::json;

/// The question `markov-demo` asks.
pub const QUESTION: &str = "How many people live in Lisbon and Porto together?";

/// The demo node's instructions.
pub const INSTRUCTIONS: &str = "You answer questions about cities with your tools.";

/// The demo agent's instructions in the demo team (`markov-serve
/// --team`), where it hands the adding to `maths`.
pub const TEAM_INSTRUCTIONS: &str = "You answer questions about cities with your tools. \
You cannot add: hand the numbers to the maths agent, naming them in the reason, and answer \
with what it hands back.";

/// The instructions of the demo team's `maths` agent.
pub const MATHS_INSTRUCTIONS: &str = "You add the numbers you are handed with your add tool, \
then hand the conversation back with the sum in the reason.";

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

/// The model a binary runs on, the line that names it, and the context
/// window the server reported for it.
#[derive(Debug, Clone)]
pub struct Chosen {
    /// The model client.
    pub model: Arc<dyn Model>,
    /// The first line the binaries print: `model: …`.
    pub label: String,
    /// The context window, in tokens, a local server said it runs the
    /// model with (llama.cpp's `GET /props`, vLLM's model list); `None`
    /// for the vendor's API, a server that does not say, and the
    /// rehearsal.
    pub served_context: Option<u32>,
    /// Whether the server's chat template handles tools, where it says
    /// (llama.cpp's `GET /props`).
    pub template_has_tools: Option<bool>,
    /// The client's default model (`None` for the rehearsal).
    pub default_model: Option<String>,
    /// The client the environment configured (`None` for the rehearsal),
    /// which also writes a request as its wire body
    /// ([`markov_providers::EnvModel::request_body`]).
    pub client: Option<markov_providers::EnvModel>,
}

/// The context window assumed of a model neither markov
/// ([`ModelLimits`]) nor its server knows: a small local server's.
pub const ASSUMED_CONTEXT_WINDOW: u32 = 4_096;

impl Chosen {
    /// The model name the calls ask for (`MARKOV_MODEL`, else the client's
    /// default, which the label names).
    fn model_name(&self) -> Option<String> {
        model_override().or_else(|| self.default_model.clone())
    }

    /// The settings of the demo agent's calls: the model asked for
    /// (`MARKOV_MODEL`), and an answer that fits the context: a quarter of
    /// the window the server reported
    /// ([`ModelLimits::max_tokens_within`]), else the model's default
    /// ([`Model::default_max_tokens`]: a known model's most up to 8 192,
    /// 2 048 for a model markov does not know).
    pub fn settings(&self) -> ModelSettings {
        let mut settings = ModelSettings {
            model: model_override(),
            ..ModelSettings::default()
        };
        settings.max_tokens = match self.served_context {
            Some(window) => ModelLimits::max_tokens_within(window, self.model_name().as_deref()),
            None => self.model.default_max_tokens(&settings),
        };
        settings
    }

    /// The context window to plan for: the server's word, else markov's
    /// table ([`ModelLimits::of`]), else [`ASSUMED_CONTEXT_WINDOW`].
    pub fn context_window(&self) -> u32 {
        self.served_context
            .or_else(|| {
                self.model_name()
                    .as_deref()
                    .and_then(ModelLimits::of)
                    .map(|limits| limits.context_window)
            })
            .unwrap_or(ASSUMED_CONTEXT_WINDOW)
    }
}

/// [`pick_model_or`], and then, for a server other than the vendor's with
/// no `MARKOV_MODEL` set, the model the server serves
/// ([`markov_providers::EnvModel::settle_model`]): the vendor's default
/// name (`gpt-4.1`, `claude-…`) is never sent to a local server. A server
/// other than the vendor's is asked for its context window and chat
/// template as well ([`markov_providers::EnvModel::served_facts`]).
///
/// # Errors
/// As [`pick_model_or`], and [`markov_providers::ConfigError::ModelNotNamed`]
/// when the server does not name exactly one model.
pub async fn pick_settled_model_or(
    rehearsal: Arc<dyn Model>,
) -> Result<Chosen, markov_providers::ConfigError> {
    match markov_providers::from_env()? {
        Some(configured) => {
            let configured = configured.settle_model().await?;
            let facts = configured.served_facts().await;
            Ok(Chosen {
                model: configured.model(),
                label: format!("model: {}", configured.description()),
                served_context: facts.context_window,
                template_has_tools: facts.template_has_tools,
                default_model: Some(configured.default_model().to_owned()),
                client: Some(configured),
            })
        }
        None => Ok(Chosen {
            model: rehearsal,
            label: rehearsal_label(),
            served_context: None,
            template_has_tools: None,
            default_model: None,
            client: None,
        }),
    }
}

/// What the served agent is shown of a long session
/// (`markov-serve --context`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContextChoice {
    /// Older turns are summarized by the agent's own model once the
    /// session passes half the context window; old tool results are
    /// trimmed to a stub.
    #[default]
    Summarize,
    /// Only the last turns are shown (no summary call); old tool results
    /// are trimmed to a stub.
    Recent,
    /// The whole history is sent: a session that outgrows the context
    /// ends each run with `context_exhausted`.
    None,
}

/// Turns the `Recent` policy keeps, the current one included.
pub const RECENT_TURNS: usize = 6;

/// The context policy of the served agent on `chosen`'s model: `None` for
/// [`ContextChoice::None`]. Either policy also compacts the view to the
/// current turn when the server refuses a request as too long, so a
/// session never dies of its own length.
pub fn context_policy(choice: ContextChoice, chosen: &Chosen) -> Option<ContextPolicy> {
    let built = match choice {
        ContextChoice::None => return None,
        ContextChoice::Recent => ContextPolicy::builder()
            .keep_last_turns(RECENT_TURNS)
            .trim_tool_results(2)
            .build(),
        ContextChoice::Summarize => {
            let window = chosen.context_window();
            let summary = ModelSettings {
                model: model_override(),
                max_tokens: (window / 4).clamp(1, DEFAULT_SUMMARY_MAX_TOKENS),
                ..ModelSettings::default()
            };
            ContextPolicy::builder()
                .trim_tool_results(2)
                .summarize(
                    Summarize::new(Arc::clone(&chosen.model), u64::from(window / 2))
                        .settings(summary),
                )
                .build()
        }
    };
    match built {
        Ok(policy) => Some(policy),
        Err(error) => {
            // The rules above are fixed and valid; say so loudly if not.
            tracing::error!(%error, "the served agent's context policy is invalid; none is set");
            None
        }
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

/// The demo agent on `chosen`'s model (`model` in its place, a wrapper of
/// it, say), with its two tools and [`Chosen::settings`]: add more tools
/// (an MCP server's) or policies, then build it.
pub fn demo_agent(chosen: &Chosen, model: Arc<dyn Model>) -> AgentBuilder<OneNode> {
    Agent::builder("cities")
        .instructions(INSTRUCTIONS)
        .tool(tools::Add)
        .tool(tools::Population)
        .shared_model(model)
        .settings(chosen.settings())
}

/// The demo agent as `markov-demo` runs it, on `model`: the turn's first
/// call must use a tool (the questions need them), so a server that
/// ignores the tools it is offered fails rather than making an answer up.
/// The agent the demo's eval dataset (`crates/cli/evals/demo.toml`) runs.
///
/// # Errors
/// The agent does not build.
pub fn demo_eval_agent(model: Arc<dyn Model>) -> Result<Agent, markov_executor::BuildError> {
    // Nothing is asked of the server here: the answer budget is the
    // client's default for its model.
    let chosen = Chosen {
        label: String::new(),
        served_context: None,
        template_has_tools: None,
        default_model: model.model_name().map(str::to_owned),
        model: Arc::clone(&model),
        client: None,
    };
    let model = Arc::new(markov_executor::ToolChoiceEnforcer::new(
        model,
        markov_charter::tool_choice::ToolChoiceRule::RequiredFirst,
    ));
    demo_agent(&chosen, model).build()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn served(context: Option<u32>) -> Chosen {
        Chosen {
            model: Arc::new(scripted()),
            label: "model: test".into(),
            served_context: context,
            template_has_tools: None,
            default_model: Some("qwen2.5-0.5b-instruct".into()),
            client: None,
        }
    }

    #[test]
    fn the_served_policy_is_sized_to_the_reported_context() {
        let chosen = served(Some(1024));
        assert_eq!(chosen.settings().max_tokens, 256);
        let policy = context_policy(ContextChoice::Summarize, &chosen).expect("a policy");
        let summarize = policy.summarize().expect("a summarizer");
        assert_eq!(summarize.threshold_tokens(), 512);
        assert_eq!(summarize.model_settings().max_tokens, 256);
        assert_eq!(policy.trim_tool_results(), Some(2));

        let recent = context_policy(ContextChoice::Recent, &chosen).expect("a policy");
        assert_eq!(recent.keep_last_turns(), Some(RECENT_TURNS));
        assert!(recent.summarize().is_none());
        assert!(context_policy(ContextChoice::None, &chosen).is_none());
    }

    #[test]
    fn an_unreported_context_falls_back_to_the_documented_defaults() {
        let chosen = served(None);
        assert_eq!(
            chosen.settings().max_tokens,
            markov_core::model::UNKNOWN_MODEL_MAX_TOKENS
        );
        assert_eq!(chosen.context_window(), ASSUMED_CONTEXT_WINDOW);
        let known = Chosen {
            default_model: Some("claude-3-5-haiku-20241022".into()),
            ..served(None)
        };
        assert_eq!(known.context_window(), 200_000);
    }
}

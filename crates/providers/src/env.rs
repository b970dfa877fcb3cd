//! [`from_env`]: the model client the environment configures.

use std::sync::Arc;

use markov_core::model::Model;

use crate::error::ConfigError;

/// A model client chosen from the environment, with the line that names
/// it.
#[derive(Clone)]
pub struct EnvModel {
    model: Arc<dyn Model>,
    description: String,
}

impl std::fmt::Debug for EnvModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvModel")
            .field("description", &self.description)
            .finish_non_exhaustive()
    }
}

impl EnvModel {
    /// The client, to give an agent (`AgentBuilder::shared_model`).
    pub fn model(&self) -> Arc<dyn Model> {
        Arc::clone(&self.model)
    }

    /// What it is and where it sends requests, e.g. `anthropic messages api
    /// (https://api.anthropic.com/v1/messages, claude-…)`: the endpoint as
    /// errors show it (a password or query, where a key may ride,
    /// redacted) and the model asked for by default.
    pub fn description(&self) -> &str {
        &self.description
    }
}

/// Whether an environment variable is set to something other than blanks
/// (the clients treat an empty value as unset, and so does the choice).
#[cfg(any(feature = "anthropic", feature = "openai"))]
fn is_set(var: &str) -> bool {
    std::env::var(var).is_ok_and(|value| !value.trim().is_empty())
}

/// The model client the environment configures, in this order:
///
/// - `ANTHROPIC_API_KEY` or `ANTHROPIC_BASE_URL` set: the Messages API, at
///   Anthropic or at another address (a local server such as llama.cpp's);
/// - else `OPENAI_API_KEY` or `OPENAI_BASE_URL` set: an OpenAI-compatible
///   Chat Completions server (OpenAI, vLLM, Ollama, llama.cpp, LM Studio).
///
/// `Ok(None)` when neither is set (an application then says so, or runs a
/// scripted model it labels as such); `Err` when one is set but the client
/// cannot be built from it (a malformed base URL, a missing key for the
/// vendor's own address).
///
/// ```no_run
/// let Some(configured) = markov_providers::from_env()? else {
///     panic!("set ANTHROPIC_API_KEY or OPENAI_API_KEY");
/// };
/// println!("model: {}", configured.description());
/// # Ok::<(), markov_providers::ConfigError>(())
/// ```
pub fn from_env() -> Result<Option<EnvModel>, ConfigError> {
    #[cfg(feature = "anthropic")]
    if is_set("ANTHROPIC_API_KEY") || is_set("ANTHROPIC_BASE_URL") {
        let model = crate::Anthropic::from_env()?;
        let description = format!(
            "anthropic messages api ({}, {})",
            model.endpoint(),
            model.default_model()
        );
        return Ok(Some(EnvModel {
            model: Arc::new(model),
            description,
        }));
    }
    #[cfg(feature = "openai")]
    if is_set("OPENAI_API_KEY") || is_set("OPENAI_BASE_URL") {
        let model = crate::OpenAi::from_env()?;
        let description = format!(
            "openai-compatible ({}, {})",
            model.endpoint(),
            model.default_model()
        );
        return Ok(Some(EnvModel {
            model: Arc::new(model),
            description,
        }));
    }
    Ok(None)
}

//! [`from_env`]: the model client the environment configures.
#![cfg_attr(
    not(any(feature = "anthropic", feature = "openai", feature = "gemini")),
    allow(unused_variables, unreachable_code, dead_code)
)]

use std::sync::Arc;

use markov_core::model::Model;

use crate::error::ConfigError;

/// The environment variable that names the model to ask for, overriding
/// the client's default (a local server's model, say).
pub const MODEL_ENV: &str = "MARKOV_MODEL";

/// The environment variable that picks OpenAI's API: `responses` for the
/// Responses API, anything else (or unset) for Chat Completions.
pub const OPENAI_API_ENV: &str = "MARKOV_OPENAI_API";

/// The client behind an [`EnvModel`], kept concrete so that it can be
/// given another default model.
#[derive(Clone)]
enum Client {
    /// No client feature is on: there is no client to hold.
    #[cfg(not(any(feature = "anthropic", feature = "openai", feature = "gemini")))]
    Never(std::convert::Infallible),
    #[cfg(feature = "anthropic")]
    Anthropic(crate::Anthropic),
    #[cfg(feature = "openai")]
    OpenAi(crate::OpenAi),
    #[cfg(feature = "responses")]
    Responses(crate::Responses),
    #[cfg(feature = "gemini")]
    Gemini(crate::Gemini),
}

/// A model client chosen from the environment, with the line that names
/// it.
#[derive(Clone)]
pub struct EnvModel {
    client: Client,
    /// Whether the model was named (`MARKOV_MODEL`), not the client's
    /// default.
    named: bool,
}

impl std::fmt::Debug for EnvModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvModel")
            .field("description", &self.description())
            .finish_non_exhaustive()
    }
}

impl EnvModel {
    /// The client, to give an agent (`AgentBuilder::shared_model`).
    pub fn model(&self) -> Arc<dyn Model> {
        match &self.client {
            #[cfg(not(any(feature = "anthropic", feature = "openai", feature = "gemini")))]
            Client::Never(never) => match *never {},
            #[cfg(feature = "anthropic")]
            Client::Anthropic(client) => Arc::new(client.clone()),
            #[cfg(feature = "openai")]
            Client::OpenAi(client) => Arc::new(client.clone()),
            #[cfg(feature = "gemini")]
            Client::Gemini(client) => Arc::new(client.clone()),
            #[cfg(feature = "responses")]
            Client::Responses(client) => Arc::new(client.clone()),
        }
    }

    /// The exact body the client sends for `request` (`stream`: asking
    /// for a streamed answer), encoded afresh: the JSON on the wire,
    /// without the headers that carry the key (see
    /// [`Client::request_body_uncached`](crate::Client::request_body_uncached)).
    ///
    /// # Errors
    /// A request this API cannot carry.
    pub fn request_body(
        &self,
        request: &markov_core::model::ModelRequest<'_>,
        stream: bool,
    ) -> Result<Vec<u8>, markov_core::model::ModelError> {
        match &self.client {
            #[cfg(not(any(feature = "anthropic", feature = "openai", feature = "gemini")))]
            Client::Never(never) => match *never {},
            #[cfg(feature = "anthropic")]
            Client::Anthropic(c) => c.request_body_uncached(request, stream),
            #[cfg(feature = "openai")]
            Client::OpenAi(c) => c.request_body_uncached(request, stream),
            #[cfg(feature = "responses")]
            Client::Responses(c) => c.request_body_uncached(request, stream),
            #[cfg(feature = "gemini")]
            Client::Gemini(c) => c.request_body_uncached(request, stream),
        }
    }

    /// What it is and where it sends requests, e.g. `anthropic messages api
    /// (https://api.anthropic.com/v1/messages, claude-…)`: the API, the
    /// endpoint as errors show it (a password or query, where a key may
    /// ride, redacted) and the model asked for by default.
    pub fn description(&self) -> String {
        let (api, endpoint, model) = self.parts();
        format!("{api} ({endpoint}, {model})")
    }

    /// The model asked for when a request names none (the client's
    /// default, or the one [`Self::settle_model`] settled on).
    pub fn default_model(&self) -> &str {
        self.parts().2
    }

    /// The API's name, its endpoint (redacted) and the default model.
    fn parts(&self) -> (&'static str, String, &str) {
        match &self.client {
            #[cfg(not(any(feature = "anthropic", feature = "openai", feature = "gemini")))]
            Client::Never(never) => match *never {},
            #[cfg(feature = "anthropic")]
            Client::Anthropic(c) => ("anthropic messages api", c.endpoint(), c.default_model()),
            #[cfg(feature = "openai")]
            Client::OpenAi(c) => (
                "openai chat completions api",
                c.endpoint(),
                c.default_model(),
            ),
            #[cfg(feature = "responses")]
            Client::Responses(c) => ("openai responses api", c.endpoint(), c.default_model()),
            #[cfg(feature = "gemini")]
            Client::Gemini(c) => ("gemini api", c.endpoint(), c.default_model()),
        }
    }

    /// Whether the client talks to the vendor's own service.
    fn is_vendor(&self) -> bool {
        match &self.client {
            #[cfg(not(any(feature = "anthropic", feature = "openai", feature = "gemini")))]
            Client::Never(never) => match *never {},
            #[cfg(feature = "anthropic")]
            Client::Anthropic(c) => c.is_vendor(),
            #[cfg(feature = "openai")]
            Client::OpenAi(c) => c.is_vendor(),
            #[cfg(feature = "responses")]
            Client::Responses(c) => c.is_vendor(),
            #[cfg(feature = "gemini")]
            Client::Gemini(c) => c.is_vendor(),
        }
    }

    /// Settles which model a server other than the vendor's is asked for
    /// when the environment names none (`MARKOV_MODEL`): the vendor's
    /// default name (`gpt-4.1`, `claude-…`) means nothing to a local
    /// server, so the server is asked for the models it serves and the
    /// only one is taken. At the vendor's address, or with a model named,
    /// nothing is asked.
    ///
    /// # Errors
    /// [`ConfigError::ModelNotNamed`] when the server lists several
    /// models (named in the error), none, or cannot be asked.
    pub async fn settle_model(self) -> Result<Self, ConfigError> {
        if self.named || self.is_vendor() {
            return Ok(self);
        }
        let (_, endpoint, _) = self.parts();
        let listed: Result<Vec<String>, markov_core::ModelError> = match &self.client {
            #[cfg(not(any(feature = "anthropic", feature = "openai", feature = "gemini")))]
            Client::Never(never) => match *never {},
            #[cfg(feature = "anthropic")]
            Client::Anthropic(c) => c.served_models().await,
            #[cfg(feature = "openai")]
            Client::OpenAi(c) => c.served_models().await,
            #[cfg(feature = "responses")]
            Client::Responses(c) => c.served_models().await,
            #[cfg(feature = "gemini")]
            Client::Gemini(c) => c.served_models().await,
        };
        let not_named = |reason: String| ConfigError::ModelNotNamed {
            endpoint: endpoint.clone(),
            var: MODEL_ENV,
            reason,
        };
        let models = listed.map_err(|error| {
            not_named(format!("asking the server for its models failed: {error}"))
        })?;
        let model = match models.as_slice() {
            [one] => one.clone(),
            [] => return Err(not_named("the server lists no model".into())),
            many => {
                return Err(not_named(format!("the server serves {}", many.join(", "))));
            }
        };
        Ok(self.with_model(model))
    }

    /// What a server other than the vendor's says of itself: the context
    /// window it runs the model with (llama.cpp's server at `GET /props`,
    /// vLLM in its model list) and whether its chat template handles tools
    /// (llama.cpp). Nothing at the vendor's address (markov knows its
    /// models, `ModelLimits`), for a server that does not say, and when
    /// asking fails or takes longer than 5 s (said in a warning): the
    /// caller then keeps its documented default.
    pub async fn served_facts(&self) -> crate::ServedFacts {
        if self.is_vendor() {
            return crate::ServedFacts::default();
        }
        let (_, endpoint, model) = self.parts();
        let asked: Result<crate::ServedFacts, markov_core::ModelError> = match &self.client {
            #[cfg(not(any(feature = "anthropic", feature = "openai", feature = "gemini")))]
            Client::Never(never) => match *never {},
            #[cfg(feature = "anthropic")]
            Client::Anthropic(c) => c.served_facts().await,
            #[cfg(feature = "openai")]
            Client::OpenAi(c) => c.served_facts().await,
            #[cfg(feature = "responses")]
            Client::Responses(c) => c.served_facts().await,
            #[cfg(feature = "gemini")]
            Client::Gemini(_) => Ok(crate::ServedFacts::default()),
        };
        match asked {
            Ok(facts) => {
                match facts.context_window {
                    Some(tokens) => {
                        tracing::info!(%endpoint, model, tokens, "the server reports its context window");
                    }
                    None => {
                        tracing::info!(%endpoint, model, "the server does not report its context window");
                    }
                }
                facts
            }
            Err(error) => {
                tracing::warn!(%endpoint, model, %error, "asking the server about itself failed");
                crate::ServedFacts::default()
            }
        }
    }

    /// The same client with `model` as its default.
    fn with_model(self, model: String) -> Self {
        let client = match self.client {
            #[cfg(not(any(feature = "anthropic", feature = "openai", feature = "gemini")))]
            Client::Never(never) => match never {},
            #[cfg(feature = "anthropic")]
            Client::Anthropic(c) => Client::Anthropic(c.with_default_model(model)),
            #[cfg(feature = "openai")]
            Client::OpenAi(c) => Client::OpenAi(c.with_default_model(model)),
            #[cfg(feature = "responses")]
            Client::Responses(c) => Client::Responses(c.with_default_model(model)),
            #[cfg(feature = "gemini")]
            Client::Gemini(c) => Client::Gemini(c.with_default_model(model)),
        };
        EnvModel {
            client,
            named: true,
        }
    }
}

/// Whether an environment variable is set to something other than blanks
/// (the clients treat an empty value as unset, and so does the choice).
#[cfg(any(feature = "anthropic", feature = "openai", feature = "gemini"))]
fn is_set(var: &str) -> bool {
    std::env::var(var).is_ok_and(|value| !value.trim().is_empty())
}

/// The model client the environment configures, in this order:
///
/// - `ANTHROPIC_API_KEY` or `ANTHROPIC_BASE_URL` set: the Messages API, at
///   Anthropic or at another address (a local server such as llama.cpp's;
///   the base URL without `/v1`);
/// - else `GEMINI_API_KEY` or `GEMINI_BASE_URL` set: the Gemini API
///   (feature `gemini`);
/// - else `OPENAI_API_KEY` or `OPENAI_BASE_URL` set: OpenAI's Responses API
///   when `MARKOV_OPENAI_API=responses` (feature `responses`), else an
///   OpenAI-compatible Chat Completions server (OpenAI, vLLM, Ollama,
///   llama.cpp, LM Studio; the base URL with `/v1`).
///
/// `MARKOV_MODEL` names the model to ask for; without it a server other
/// than the vendor's should be asked which model it serves
/// ([`EnvModel::settle_model`]). `Ok(None)` when no provider is set (an
/// application then says so, or runs a scripted model it labels as such);
/// `Err` when one is set but the client cannot be built from it (a
/// malformed base URL, named with its variable; a missing key for the
/// vendor's own address).
///
/// ```no_run
/// # async fn demo() -> Result<(), markov_providers::ConfigError> {
/// let Some(configured) = markov_providers::from_env()? else {
///     panic!("set ANTHROPIC_API_KEY, GEMINI_API_KEY or OPENAI_API_KEY");
/// };
/// let configured = configured.settle_model().await?;
/// println!("model: {}", configured.description());
/// # Ok(())
/// # }
/// ```
pub fn from_env() -> Result<Option<EnvModel>, ConfigError> {
    let named = std::env::var(MODEL_ENV)
        .ok()
        .filter(|m| !m.trim().is_empty());
    let pick = |client: Client| {
        let env = EnvModel {
            client,
            named: false,
        };
        Some(match named.clone() {
            Some(model) => env.with_model(model),
            None => env,
        })
    };
    #[cfg(feature = "anthropic")]
    if is_set("ANTHROPIC_API_KEY") || is_set("ANTHROPIC_BASE_URL") {
        return Ok(pick(Client::Anthropic(crate::Anthropic::from_env()?)));
    }
    #[cfg(feature = "gemini")]
    if is_set(crate::gemini::API_KEY_ENV) || is_set(crate::gemini::BASE_URL_ENV) {
        return Ok(pick(Client::Gemini(crate::Gemini::from_env()?)));
    }
    #[cfg(feature = "openai")]
    if is_set("OPENAI_API_KEY") || is_set("OPENAI_BASE_URL") {
        let api = std::env::var(OPENAI_API_ENV).unwrap_or_default();
        match api.trim().to_ascii_lowercase().as_str() {
            "" | "chat" | "chat_completions" | "chat-completions" => {
                return Ok(pick(Client::OpenAi(crate::OpenAi::from_env()?)));
            }
            #[cfg(feature = "responses")]
            "responses" => {
                return Ok(pick(Client::Responses(crate::Responses::from_env()?)));
            }
            _ => {
                return Err(ConfigError::InvalidEnv {
                    var: OPENAI_API_ENV,
                    value: api,
                    expected: if cfg!(feature = "responses") {
                        "`responses` or `chat`"
                    } else {
                        "`chat` (the `responses` feature of markov-providers is off)"
                    },
                });
            }
        }
    }
    let _ = &pick;
    Ok(None)
}

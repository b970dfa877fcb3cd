//! [`Agent`]: one model, one set of tools, the basic loop.

use std::sync::Arc;

use markov_core::message::Message;
use markov_core::model::{Model, ModelRequest, ModelSettings, ToolChoice, Usage};
use markov_core::tool::{NoState, SharedTool, Tool, ToolContext};
use markov_runtime::{ConfigError, ToolSet, execute_call};
use tracing::Instrument;

use crate::error::RunError;

/// The default step limit.
pub const DEFAULT_MAX_STEPS: usize = 50;

/// An agent: a model, a system prompt and tools.
#[derive(Debug, Clone)]
pub struct Agent {
    model: Arc<dyn Model>,
    system: String,
    tools: ToolSet,
    settings: ModelSettings,
    max_steps: usize,
}

/// Builds an [`Agent`]; tool names are checked as tools are added.
#[derive(Debug)]
pub struct AgentBuilder {
    agent: Agent,
}

impl AgentBuilder {
    /// Sets the system prompt.
    #[must_use]
    pub fn system(mut self, system: impl Into<String>) -> Self {
        self.agent.system = system.into();
        self
    }

    /// Adds a typed tool.
    pub fn tool<T: Tool>(mut self, tool: T) -> Result<Self, ConfigError> {
        self.agent.tools.add(tool)?;
        Ok(self)
    }

    /// Adds an erased tool.
    pub fn shared_tool(mut self, tool: SharedTool) -> Result<Self, ConfigError> {
        self.agent.tools.add_shared(tool)?;
        Ok(self)
    }

    /// Sets the model settings.
    #[must_use]
    pub fn settings(mut self, settings: ModelSettings) -> Self {
        self.agent.settings = settings;
        self
    }

    /// Sets the step limit (model calls per run).
    #[must_use]
    pub fn max_steps(mut self, max_steps: usize) -> Self {
        self.agent.max_steps = max_steps;
        self
    }

    /// The agent.
    pub fn build(self) -> Agent {
        self.agent
    }
}

/// What a finished run produced.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOutput {
    /// The final answer's text.
    pub response: String,
    /// How many model calls the run made.
    pub steps: usize,
    /// Tokens used across the run.
    pub usage: Usage,
}

impl Agent {
    /// A builder around `model`.
    pub fn builder(model: impl Model + 'static) -> AgentBuilder {
        AgentBuilder {
            agent: Agent {
                model: Arc::new(model),
                system: String::new(),
                tools: ToolSet::new(),
                settings: ModelSettings::default(),
                max_steps: DEFAULT_MAX_STEPS,
            },
        }
    }

    /// The agent's tools.
    pub fn tools(&self) -> &ToolSet {
        &self.tools
    }

    /// Runs until the model answers without tool calls, appending every
    /// message to `history` (which must already hold the user's input).
    pub async fn run(&self, history: &mut Vec<Message>) -> Result<RunOutput, RunError> {
        let span = tracing::info_span!("run", max_steps = self.max_steps, tools = self.tools.len());
        self.run_inner(history).instrument(span).await
    }

    async fn run_inner(&self, history: &mut Vec<Message>) -> Result<RunOutput, RunError> {
        let mut usage = Usage::default();
        for step in 1..=self.max_steps {
            let response = {
                let request = ModelRequest {
                    system: &self.system,
                    messages: history,
                    tools: self.tools.definitions(),
                    tool_choice: &ToolChoice::Auto,
                    settings: &self.settings,
                    output_schema: None,
                };
                let span = tracing::info_span!("model_call", step, messages = history.len());
                self.model
                    .complete(request)
                    .instrument(span)
                    .await
                    .map_err(|source| RunError::Model { step, source })?
            };
            usage += response.usage;
            let calls: Vec<_> = response
                .tool_calls()
                .map(|(id, name, input)| (id.clone(), name.to_owned(), input.clone()))
                .collect();
            let assistant = Message::assistant_items(response.content);
            if calls.is_empty() {
                let text = assistant.text();
                history.push(assistant);
                return Ok(RunOutput {
                    response: text,
                    steps: step,
                    usage,
                });
            }
            history.push(assistant);
            let mut results = Vec::with_capacity(calls.len());
            let state = NoState::default();
            for (id, name, input) in calls {
                let cx = ToolContext::new(&id, history, &state);
                let result =
                    execute_call(self.tools.get(&name), &id, &name, input, cx, "Finished").await;
                results.push(result.to_item(true));
            }
            history.push(Message::user_items(results));
        }
        Err(RunError::MaxSteps(self.max_steps))
    }
}

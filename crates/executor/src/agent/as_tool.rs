//! [`AgentTool`]: an [`Agent`] offered to another agent as a tool.
//!
//! Each call runs the agent as a sub-agent: a fresh machine of its own
//! (its own history, instructions, tools, policies and limits) is given the
//! call's input as its user message and run to the end of that turn; the
//! tool's result is the sub-agent's answer. What its model calls spend is
//! reported to the caller's step ([`ToolContext::report_usage`]), so it is
//! in the caller's usage, cost and usage limits.

use std::fmt;

use markov_core::async_trait;
use markov_core::tool::{
    DynTool, InvalidToolName, ToolCallError, ToolContext, ToolDefinition, ToolOutcome,
    input_schema_for,
};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::Agent;
use crate::step::YieldReason;

/// The argument of an agent tool without a typed input.
const REQUEST: &str = "request";

/// Checks a call's arguments against a typed input.
type Check = fn(&Value) -> Result<(), String>;

/// An [`Agent`] as a tool: made by [`Agent::as_tool`].
#[derive(Clone)]
pub struct AgentTool {
    agent: Agent,
    definition: ToolDefinition,
    /// Set for a typed input: the arguments are checked against it and
    /// the sub-agent reads their JSON.
    typed: Option<Check>,
}

impl fmt::Debug for AgentTool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentTool")
            .field("name", &self.definition.name)
            .field("typed", &self.typed.is_some())
            .finish_non_exhaustive()
    }
}

impl Agent {
    /// This agent as a tool named `name`, described by `description`, for
    /// another agent to call (register it like any erased tool:
    /// `AgentBuilder::tools`, or with metadata under the policy
    /// pipeline). Its input is `{"request": string}`, the sub-agent's user
    /// message; [`AgentTool::input`] gives it a typed one.
    ///
    /// # Errors
    /// `name` is not a valid tool name.
    pub fn as_tool(
        &self,
        name: impl Into<String>,
        description: impl Into<String>,
    ) -> Result<AgentTool, InvalidToolName> {
        let definition = ToolDefinition::new(
            name,
            description,
            json!({
                "type": "object",
                "properties": {
                    REQUEST: {
                        "type": "string",
                        "description": "What to ask of this agent, in full: it sees nothing else of the conversation."
                    }
                },
                "required": [REQUEST],
                "additionalProperties": false
            }),
        )?;
        Ok(AgentTool {
            agent: self.clone(),
            definition,
            typed: None,
        })
    }
}

impl AgentTool {
    /// A typed input: the tool's schema is `I`'s, a call's arguments must
    /// read as an `I` (else the model reads why), and the sub-agent's user
    /// message is their JSON.
    #[must_use]
    pub fn input<I: JsonSchema + DeserializeOwned>(mut self) -> Self {
        self.definition.input_schema = input_schema_for::<I>();
        self.typed = Some(|args| I::deserialize(args).map(drop).map_err(|e| e.to_string()));
        self
    }

    /// The agent it runs.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// The user message a call with `input` gives the sub-agent.
    fn message(&self, input: &Value) -> Result<String, ToolCallError> {
        match self.typed {
            Some(check) => {
                check(input).map_err(ToolCallError::InvalidInput)?;
                Ok(input.to_string())
            }
            None => match input.get(REQUEST).and_then(Value::as_str) {
                Some(text) if !text.trim().is_empty() => Ok(text.to_owned()),
                _ => Err(ToolCallError::InvalidInput(format!(
                    "missing non-empty string field `{REQUEST}`"
                ))),
            },
        }
    }
}

#[async_trait]
impl DynTool for AgentTool {
    fn definition(&self) -> &ToolDefinition {
        &self.definition
    }

    async fn call_json(
        &self,
        input: &Value,
        cx: ToolContext<'_>,
    ) -> Result<ToolOutcome, ToolCallError> {
        let message = self.message(input)?;
        let name = self.definition.name.as_str();
        let span = tracing::info_span!(
            "invoke_agent",
            otel.name = %format_args!("invoke_agent {name}"),
            gen_ai.operation.name = "invoke_agent",
            gen_ai.agent.name = name,
        );
        let mut machine = self.agent.machine();
        machine.enqueue_user(message);
        let ran = tracing::Instrument::instrument(machine.run(), span).await;
        // Spent whether the sub-agent answered or not.
        if !cx.report_usage(machine.usage().session) {
            tracing::debug!(agent = name, "a sub-agent's usage has no step to count it");
        }
        let last = ran.map_err(|e| ToolCallError::Execution(format!("{name} failed: {e}")))?;
        if last.yield_reason == YieldReason::AwaitingApproval {
            tracing::warn!(
                agent = name,
                waiting = last.approvals.len(),
                "a sub-agent's call waits for an approval it cannot get here: not run"
            );
            return Err(ToolCallError::Execution(format!(
                "{name} stopped: one of its actions needs a person's approval, which it cannot get when called as a tool"
            )));
        }
        if let Some(limit) = &last.usage_limit {
            return Err(ToolCallError::Execution(format!(
                "{name} stopped at its usage limit: {limit}"
            )));
        }
        match last.output() {
            Some(answer) => Ok(ToolOutcome::Value(Value::String(answer))),
            None => Err(ToolCallError::Execution(format!(
                "{name} ended without an answer ({:?})",
                last.yield_reason
            ))),
        }
    }
}

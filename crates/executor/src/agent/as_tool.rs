//! [`AgentTool`]: an [`Agent`] offered to another agent as a tool.
//!
//! Each call runs the agent as a sub-agent: a fresh machine of its own
//! (its own history, instructions, tools, policies and limits) is given the
//! call's input as its user message and run to the end of that turn; the
//! tool's result is the sub-agent's answer. What its model calls spend is
//! reported to the caller's step ([`ToolContext::report_usage`]), so it is
//! in the caller's usage, cost and usage limits.
//!
//! A call of the sub-agent that needs a person's approval is asked of the
//! caller's approvals ([`ToolContext::ask_approval`]): the caller's step
//! pauses with the request among its own, and the sub-agent's machine
//! waits here, by the call's idempotency key, until the caller's run is
//! resumed and the call runs again; the decision then goes to the
//! sub-agent, which resumes. The waiting machine is also kept with the
//! caller's request ([`ToolContext::keep_state`]), so a caller restored
//! from a snapshot or a store continues it.

use std::fmt;
use std::sync::{Arc, Mutex};

use markov_core::async_trait;
use markov_core::tool::{
    DynTool, HoldDecision, InvalidToolName, ToolCallError, ToolContext, ToolDefinition,
    ToolOutcome, input_schema_for,
};
use markov_policy::Decision;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::Agent;
use crate::machine::Machine;
use crate::step::{MachineStep, YieldReason};

/// The most sub-agent machines one tool keeps waiting for decisions: the
/// oldest is dropped beyond it (a log line says so).
const MAX_WAITING: usize = 256;

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
    /// The sub-agents waiting for a decision of the caller's, by the
    /// call's idempotency key, oldest first.
    waiting: Arc<Mutex<Vec<(String, Machine)>>>,
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
            waiting: Arc::default(),
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

    fn may_pause(&self) -> bool {
        true
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
        let key = cx.idempotency_key().map(str::to_owned);
        let waiting = key
            .as_deref()
            .and_then(|key| self.take_waiting(key))
            .or_else(|| self.restore_kept(&cx));
        let (mut machine, mut last) = match waiting {
            Some(machine) => (machine, None),
            None => {
                let mut machine = self.agent.machine();
                machine.enqueue_user(message);
                let ran = tracing::Instrument::instrument(machine.run(), span.clone()).await;
                // Spent whether the sub-agent answered or not.
                report(&cx, name, machine.usage().session);
                let step =
                    ran.map_err(|e| ToolCallError::Execution(format!("{name} failed: {e}")))?;
                (machine, Some(step))
            }
        };
        while machine.is_awaiting_approval() {
            for request in machine.approvals().pending() {
                let action = format!("{name}.{}", request.tool);
                let decision = match cx.ask_approval(&action, &request.args) {
                    HoldDecision::Waiting => {
                        // Kept with the caller's request too, so that a
                        // caller restored elsewhere continues from here.
                        match crate::serialize::serialize_machine(&machine)
                            .map_err(|e| e.to_string())
                            .and_then(|s| serde_json::to_value(&s).map_err(|e| e.to_string()))
                        {
                            Ok(state) => {
                                if !cx.keep_state(state) {
                                    tracing::debug!(
                                        agent = name,
                                        "nothing keeps the waiting sub-agent with the request"
                                    );
                                }
                            }
                            Err(e) => {
                                tracing::warn!(agent = name, error = %e, "the waiting sub-agent could not be serialized: kept in memory only")
                            }
                        }
                        if let Some(key) = key {
                            self.keep_waiting(key, machine);
                        }
                        return Err(ToolCallError::Execution(format!(
                            "{name} waits for a person's decision on {}",
                            request.tool
                        )));
                    }
                    HoldDecision::Approved(args) if args == request.args => Decision::Approve,
                    HoldDecision::Approved(args) => Decision::Edit { args },
                    HoldDecision::Denied(message) => Decision::Deny { message },
                    HoldDecision::Answered(result) => Decision::Respond { result },
                    HoldDecision::Unavailable(why) => {
                        tracing::warn!(agent = name, %why, "a sub-agent's call cannot get an approval: not run");
                        return Err(ToolCallError::Execution(format!(
                            "{name} stopped: {} needs a person's approval, which cannot be asked for here ({why})",
                            request.tool
                        )));
                    }
                    _ => {
                        return Err(ToolCallError::Execution(format!(
                            "{name} stopped: an unknown decision on {}",
                            request.tool
                        )));
                    }
                };
                if let Err(e) = machine.approvals().decide(&request.request_id, decision) {
                    tracing::debug!(agent = name, error = %e, "a sub-agent's request was decided already");
                }
            }
            let resumed = tracing::Instrument::instrument(machine.resume(), span.clone()).await;
            let step =
                resumed.map_err(|e| ToolCallError::Execution(format!("{name} failed: {e}")))?;
            report(&cx, name, step.run_usage);
            last = Some(step);
        }
        let Some(last) = last else {
            return Err(ToolCallError::Execution(format!(
                "{name} was waiting and ran no further"
            )));
        };
        answer(name, &last)
    }
}

impl AgentTool {
    /// The waiting sub-agent the call kept with the caller's request (a
    /// caller restored from a snapshot or a store), if any.
    fn restore_kept(&self, cx: &ToolContext<'_>) -> Option<Machine> {
        let kept = cx.kept_state()?;
        let restored = serde_json::from_value(kept)
            .map_err(|e| e.to_string())
            .and_then(|snapshot| self.agent.restore(snapshot).map_err(|e| e.to_string()));
        match restored {
            Ok(machine) => Some(machine),
            Err(e) => {
                tracing::warn!(
                    agent = self.definition.name.as_str(),
                    error = %e,
                    "the kept sub-agent does not read back: it starts again"
                );
                None
            }
        }
    }

    fn take_waiting(&self, key: &str) -> Option<Machine> {
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        let i = waiting.iter().position(|(k, _)| k == key)?;
        Some(waiting.remove(i).1)
    }

    fn keep_waiting(&self, key: String, machine: Machine) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if waiting.len() >= MAX_WAITING {
            tracing::warn!(
                agent = self.definition.name.as_str(),
                "too many sub-agents wait for decisions: the oldest is dropped"
            );
            waiting.remove(0);
        }
        waiting.push((key, machine));
    }
}

/// Reports a sub-agent's spending to the caller's step.
fn report(cx: &ToolContext<'_>, name: &str, usage: markov_core::model::Usage) {
    if !cx.report_usage(usage) {
        tracing::debug!(agent = name, "a sub-agent's usage has no step to count it");
    }
}

/// The call's result from the sub-agent's last step.
fn answer(name: &str, last: &MachineStep) -> Result<ToolOutcome, ToolCallError> {
    if let Some(limit) = &last.usage_limit {
        return Err(ToolCallError::Execution(format!(
            "{name} stopped at its usage limit: {limit}"
        )));
    }
    if last.yield_reason == YieldReason::AwaitingApproval {
        return Err(ToolCallError::Execution(format!(
            "{name} stopped: it waits for an approval"
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

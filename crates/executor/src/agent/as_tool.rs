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
//!
//! In a stored session the sub-agent keeps its answers, its ledger and,
//! once it finished, its result in the call's journal
//! ([`ToolContext::journal`]); the call run again after a crash continues
//! from them, repeating no side effect, so even an at-most-once agent tool
//! is resumed rather than answered `INTERRUPTED`
//! ([`DynTool::resumes_from_journal`]).

use std::fmt;
use std::sync::{Arc, Mutex};

use markov_core::async_trait;
use markov_core::ids::{InstanceId, ToolCallId};
use markov_core::tool::{
    CallJournal, DynTool, HoldDecision, InvalidToolName, ToolCallError, ToolContext,
    ToolDefinition, ToolOutcome, input_schema_for,
};
use markov_policy::{Decision, Journal, LedgerEntry, PolicyState, RecordedAnswer};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::Agent;
use crate::instance::Instance;
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

    /// The sub-agent's answers and its own ledger are in the call's
    /// journal: run again, it replays them and repeats no side effect, so
    /// even an at-most-once call of it resumes after a crash.
    fn resumes_from_journal(&self) -> bool {
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
        // The caller's journal, when its session is stored: the sub-agent
        // keeps its answers and answered calls there, and takes back what
        // an earlier run of this call kept (a crash inside it).
        let journal = cx.journal();
        if let Some(result) = journal.as_deref().and_then(|j| recorded_result(j, name)) {
            // An earlier run of this call finished, and the caller's ledger
            // never recorded its result (a crash in between): that result
            // is the answer, and the sub-agent does not run again.
            report(&cx, name, result.usage);
            return result.outcome.into_result();
        }
        let waiting = key
            .as_deref()
            .and_then(|key| self.take_waiting(key))
            .or_else(|| self.restore_kept(&cx));
        let resumed = waiting.is_some();
        let mut machine = match waiting {
            Some(machine) => machine,
            None => {
                let machine = self.sub_machine(key.as_deref());
                machine.enqueue_user(message);
                machine
            }
        };
        match &journal {
            Some(journal) => durable(&mut machine, journal, name),
            // A waiting sub-agent whose caller left its store since: it
            // runs in memory, as its caller does.
            None if resumed => machine.policy_state().clear_journal(),
            None => {}
        }
        let mut last = None;
        // What this run reports to the caller's step.
        let mut spent = markov_core::model::Usage::default();
        if !resumed {
            let ran = self
                .drive(&mut machine, false, journal.as_deref(), &span)
                .await;
            // Spent whether the sub-agent answered or not.
            spent += machine.usage().session;
            report(&cx, name, machine.usage().session);
            let step = ran.map_err(|e| ToolCallError::Execution(format!("{name} failed: {e}")))?;
            last = Some(step);
        }
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
            let resumed = self
                .drive(&mut machine, true, journal.as_deref(), &span)
                .await;
            let step =
                resumed.map_err(|e| ToolCallError::Execution(format!("{name} failed: {e}")))?;
            spent += step.run_usage;
            report(&cx, name, step.run_usage);
            last = Some(step);
        }
        let Some(last) = last else {
            return Err(ToolCallError::Execution(format!(
                "{name} was waiting and ran no further"
            )));
        };
        let unused = machine.policy_state().answers().unused_seeds();
        if !unused.is_empty() {
            tracing::warn!(
                agent = name,
                unused = unused.len(),
                "recorded answers of an earlier run of this sub-agent were not replayed: its run went another way, and their steps were asked of its model again"
            );
        }
        let result = answer(name, &last);
        if let Some(journal) = &journal {
            keep_result(journal.as_ref(), name, &result, spent).await;
        }
        result
    }
}

/// The name of the record that keeps a finished call's result.
const RESULT: &str = "result";

/// A finished sub-agent's result as its call's journal keeps it: the
/// outcome, and what the run that produced it reported to the caller's
/// step (reported again when the result is).
#[derive(Debug, Serialize, Deserialize)]
struct KeptResult {
    outcome: markov_core::journal::RecordedOutcome,
    usage: markov_core::model::Usage,
}

/// The result an earlier run of the call recorded, if it finished.
fn recorded_result(journal: &dyn CallJournal, name: &str) -> Option<KeptResult> {
    let (_, value) = journal
        .recorded()
        .into_iter()
        .rev()
        .find(|(record, _)| record == RESULT)?;
    match serde_json::from_value(value) {
        Ok(kept) => Some(kept),
        Err(e) => {
            tracing::warn!(agent = name, error = %e, "the recorded result of an earlier run of this sub-agent does not read back: it runs again from its records");
            None
        }
    }
}

/// Records the finished call's `result` in its journal before the caller's
/// ledger records it, so that a crash in between answers the call again
/// with it: the sub-agent's last model call is not asked again.
async fn keep_result(
    journal: &dyn CallJournal,
    name: &str,
    result: &Result<ToolOutcome, ToolCallError>,
    usage: markov_core::model::Usage,
) {
    let kept = KeptResult {
        outcome: markov_core::journal::RecordedOutcome::of(result.clone()),
        usage,
    };
    let written = match serde_json::to_value(&kept) {
        Ok(value) => journal.write(RESULT, value).await,
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = written {
        tracing::warn!(agent = name, error = %e, "the sub-agent's result could not be recorded: a crash before the caller records it asks its last model call again");
    }
}

impl AgentTool {
    /// A new machine of the sub-agent for the call whose idempotency key is
    /// `key`: its root instance and its conversation are named after the
    /// key, the same every time the call runs (so the answers and calls an
    /// earlier run recorded are its own); without a key, as any new
    /// machine.
    fn sub_machine(&self, key: Option<&str>) -> Machine {
        let Some(key) = key else {
            return self.agent.machine();
        };
        let inner = &self.agent.inner;
        let root = Instance::with_id(
            InstanceId::new(format!("sub-{}", key.get(..32).unwrap_or(key))),
            inner.start.clone(),
            inner.state.clone(),
        );
        let mut machine = Machine::fresh(
            inner.charter.clone(),
            Arc::clone(&inner.executor),
            root,
            inner.run.clone(),
        );
        machine.policy = Arc::new(PolicyState::with_conversation(key));
        machine
    }

    /// Runs the sub-agent (or resumes its step that waited for approval)
    /// to the end of its turn, handing each step to the caller's journal
    /// for the caller's step trace.
    async fn drive(
        &self,
        machine: &mut Machine,
        resume: bool,
        journal: Option<&dyn CallJournal>,
        span: &tracing::Span,
    ) -> Result<MachineStep, crate::RunError> {
        use futures::StreamExt;
        let options = machine.run_options().clone();
        let _held = resume.then(|| machine.queue().hold_back());
        let state = if resume {
            crate::RunState::resume(options)
        } else {
            crate::RunState::new(options)
        };
        let mut from = machine.history().len() as u64;
        let mut steps = std::pin::pin!(crate::run::steps(machine, state));
        let mut last = None;
        let mut started = std::time::Instant::now();
        while let Some(step) = tracing::Instrument::instrument(steps.next(), span.clone()).await {
            let step = step?;
            if let Some(journal) = journal {
                let millis = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
                let record = SubAgentStep::of(self.definition.name.as_str(), &step, from, millis);
                match serde_json::to_value(&record) {
                    Ok(value) => journal.keep_step(&[], value),
                    Err(e) => {
                        tracing::warn!(error = %e, "a sub-agent's step could not be kept for the trace");
                    }
                }
            }
            from = from.saturating_add(step.history.len() as u64);
            started = std::time::Instant::now();
            last = Some(step);
        }
        last.ok_or(crate::RunError::NoSteps)
    }

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

/// Makes the sub-agent durable in its caller's journal: what an earlier
/// run of the call recorded is seeded (its answers replayed instead of
/// asked again, its answered calls answered from its ledger), and from now
/// on its answers and answered calls are written there before they are
/// used, as a stored session's are.
fn durable(machine: &mut Machine, journal: &Arc<dyn CallJournal>, name: &str) {
    let mut entries = Vec::new();
    let mut answers = Vec::new();
    for (record, value) in journal.recorded() {
        if record == RESULT {
            continue;
        }
        let read = if record.starts_with(ANSWER) {
            serde_json::from_value::<RecordedAnswer>(value).map(|answer| answers.push(answer))
        } else {
            serde_json::from_value::<LedgerEntry>(value).map(|mut entry| {
                entry.key = record.clone();
                entries.push(entry);
            })
        };
        if let Err(e) = read {
            tracing::warn!(agent = name, record = %record, error = %e, "a record of an earlier run of this sub-agent does not read back: not used");
        }
    }
    if !answers.is_empty() || !entries.is_empty() {
        tracing::info!(
            agent = name,
            answers = answers.len(),
            calls = entries.len(),
            "the sub-agent continues an earlier run: what it recorded is replayed"
        );
    }
    let written = answers
        .iter()
        .map(|a| (answer_name(a), a.clone()))
        .collect();
    // A machine kept while it waited for a decision holds what it recorded
    // up to then: only what came after is seeded.
    let policy = machine.policy_state();
    let len = machine.history().len() as u64;
    answers.retain(|a| {
        a.history_len >= len && policy.answers().history_len_of(&a.instance) != Some(a.history_len)
    });
    if !entries.is_empty() && !policy.ledger().is_empty() {
        let kept = policy.ledger().snapshot();
        entries.retain(|e| !kept.iter().any(|k| k.key == e.key));
    }
    policy.seed(entries, answers);
    policy.set_journal(Arc::new(SubJournal {
        journal: Arc::clone(journal),
        written: Mutex::new(written),
    }));
    machine.set_record_calls(true);
    // Run again, it spawns the same instances: their records are theirs.
    machine.replayable_ids = true;
}

/// The names of a sub-agent's answers among its call's records.
const ANSWER: &str = "answer:";

/// The record name of `answer`: its instance and history length.
fn answer_name(answer: &RecordedAnswer) -> String {
    format!("{ANSWER}{}:{}", answer.instance, answer.history_len)
}

/// A sub-agent's journal: its caller's call's records.
struct SubJournal {
    journal: Arc<dyn CallJournal>,
    /// The answers written, by record name.
    written: Mutex<std::collections::HashMap<String, RecordedAnswer>>,
}

#[async_trait]
impl Journal for SubJournal {
    async fn write(&self, entry: &LedgerEntry) -> Result<(), String> {
        let value = serde_json::to_value(entry).map_err(|e| e.to_string())?;
        self.journal.write(&entry.key, value).await
    }

    fn check(&self) -> Result<(), String> {
        self.journal.check()
    }

    async fn write_answers(&self, answers: &[RecordedAnswer]) -> Result<(), String> {
        for answer in answers {
            let name = answer_name(answer);
            let known = self
                .written
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&name)
                .is_some_and(|written| written == answer);
            if known {
                continue;
            }
            let value = serde_json::to_value(answer).map_err(|e| e.to_string())?;
            self.journal.write(&name, value).await?;
            self.written
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(name, answer.clone());
        }
        Ok(())
    }

    fn keep_step(&self, calls: &[ToolCallId], step: Value) {
        self.journal.keep_step(calls, step);
    }
}

/// One step of a sub-agent, as its caller's step trace keeps it (a stored
/// session's studio shows it under the call that ran the sub-agent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SubAgentStep {
    /// The sub-agent's tool name.
    pub agent: String,
    /// Why the step ended.
    pub yield_reason: YieldReason,
    /// Whether the sub-agent's run ended with it.
    pub done: bool,
    /// The model that answered, as the answer named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// What the step's model calls used.
    pub usage: markov_core::model::Usage,
    /// Milliseconds the step took.
    pub step_ms: u64,
    /// The sub-agent's history had this many messages before the step.
    pub history_from: u64,
    /// The messages the step added to the sub-agent's history (which is
    /// kept nowhere else).
    pub messages: Vec<markov_core::Message>,
    /// Each leaf's model call (see [`MachineStep::calls`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub calls: Vec<crate::ModelCall>,
    /// The sub-agent's calls that waited for approval when the step ended.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approvals: Vec<markov_policy::ConfirmationRequest>,
}

impl SubAgentStep {
    /// The record of `step` of the sub-agent `agent`, made over a history
    /// of `history_from` messages in `step_ms` milliseconds.
    pub fn of(agent: &str, step: &MachineStep, history_from: u64, step_ms: u64) -> Self {
        SubAgentStep {
            agent: agent.to_owned(),
            yield_reason: step.yield_reason,
            done: step.done,
            model: step.model.clone(),
            usage: step.usage,
            step_ms,
            history_from,
            messages: step.history.clone(),
            calls: step.calls.clone(),
            approvals: step.approvals.clone(),
        }
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

//! Replaying a stored session against the agent as it is now, and where
//! the two runs part.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use markov_core::model::{
    Model, ModelError, ModelLayer, ModelRequest, ModelResponse, StopReason, Usage,
};
use markov_core::{Item, Message, Role};
use markov_executor::Agent;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::durable::DurableError;
use crate::{SessionId, StepTrace, Store};

/// Which answers a replay uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayMode {
    /// The recorded answer of a step whose request is unchanged; the live
    /// model from the first step whose request differs on.
    #[default]
    RecordedWhereUnchanged,
    /// The live model for every step.
    Live,
}

/// How a replay runs: which answers it uses, and whether tool calls the
/// recording does not have may run their tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ReplayOptions {
    /// Which answers the replay uses.
    pub mode: ReplayMode,
    /// Whether a call of a tool with effects the recording does not have
    /// runs (off: it gets an error result saying it was not run).
    pub run_tools_live: bool,
}

impl From<ReplayMode> for ReplayOptions {
    fn from(mode: ReplayMode) -> Self {
        ReplayOptions {
            mode,
            run_tools_live: false,
        }
    }
}

/// How a replay answered one tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallSource {
    /// The recorded result of the same call (same tool, same arguments),
    /// with the state it wrote; the tool did not run.
    Recorded,
    /// The tool ran: it has no effect the replay knows of, or the
    /// recording has no such call and the replay was asked to run tools
    /// live.
    Live,
    /// Not run: a tool with effects the recording has no such call of;
    /// the model got an error result saying so.
    Refused,
}

/// Why a replay did not simply run a tool again: the effect it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolEffect {
    /// Its registry metadata says it changes something in the world
    /// ([`Category::Action`](markov_policy::Category::Action)).
    Action,
    /// It must never run twice ([`Delivery::AtMostOnce`](markov_core::tool::Delivery::AtMostOnce),
    /// stated or the default of a tool that needs approval).
    AtMostOnce,
    /// It states it honours an idempotency key
    /// ([`Delivery::AtLeastOnce`](markov_core::tool::Delivery::AtLeastOnce)):
    /// an outside call a replay must not repeat.
    Idempotent,
    /// The recorded call wrote state: the replay writes what it wrote.
    WritesState,
}

/// One tool call a replay made, and how it was answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCallReplay {
    /// The step whose answer made the call (see [`StepDiff::index`]).
    pub step: u64,
    /// The tool called.
    pub tool: String,
    /// Its arguments.
    pub args: Value,
    /// How it was answered.
    pub answered_from: ToolCallSource,
    /// The effect that kept the tool from running again, when it has one
    /// (`None`: the tool ran again, having none the replay knows of).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<ToolEffect>,
}

/// Where a replayed step's answer came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnswerSource {
    /// The recorded answer, played back (no model call).
    Recorded,
    /// The live model.
    Live,
}

/// One side of a step of a replay's diff.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepSide {
    /// The request as the model received it (system, messages, tools,
    /// tool choice, settings, output schema).
    pub request: Value,
    /// The answer's text, if it had any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The tools the answer called, with their arguments, in order.
    pub tool_calls: Vec<(String, Value)>,
    /// What the call used.
    pub usage: Usage,
}

/// One step of a replay beside the recorded step it stands for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepDiff {
    /// The step's place, from 0 (the model calls of the replay, in order).
    pub index: u64,
    /// The recorded step, if the session had one here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded: Option<StepSide>,
    /// The replayed step, if the replay made one here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replayed: Option<StepSide>,
    /// Where the replay's answer came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answered_from: Option<AnswerSource>,
    /// Whether the two requests differ.
    pub request_changed: bool,
    /// Whether the two answers differ (text or tool calls).
    pub answer_changed: bool,
}

/// What a replay did, step by step, beside the recording.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayReport {
    /// The session replayed.
    pub session: SessionId,
    /// The mode it was replayed in.
    pub mode: ReplayMode,
    /// The first step where the two runs part (its request or its answer
    /// differs, or one run has no such step); `None` when they never do.
    pub parted_at: Option<u64>,
    /// Every step, in order.
    pub steps: Vec<StepDiff>,
    /// Every tool call the replay made, in order, with how it was
    /// answered: a recorded side effect never runs again.
    pub tool_calls: Vec<ToolCallReplay>,
    /// Why the replay stopped early, if a run failed (the steps before it
    /// are reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Replays stored session `id` against the agent `build` makes over a model
/// (the agent as it is now: changed instructions, tools or settings): the
/// session's user turns are asked again, in order, on a machine kept in
/// memory (nothing is written to the store), each model call answered as
/// `mode` says — by the recorded answer where the request is unchanged, or
/// by `live`. Returns each step beside the recorded one and where the two
/// runs part.
///
/// A call of a tool with effects ([`ToolEffect`]) never runs again: an
/// action tool (registry metadata), a tool that states its delivery
/// contract (at most once, or at least once under an idempotency key; a
/// tool that needs approval is at most once), and a tool whose recorded
/// call wrote state. When the recording has the same call (same tool, same
/// arguments, the first such recorded call not yet used) it gets the
/// recorded result, and the state patch the recorded call wrote is written
/// again; otherwise it gets an error result the model reads, unless
/// `options` ask to run tools live (a call whose only effect is the state
/// it writes runs: the replay's machine is kept in memory). Other tools
/// run again. [`ReplayReport::tool_calls`] says how each call was
/// answered, and which effect kept it from running.
///
/// # Errors
/// The session or its steps cannot be read, or the agent's machine cannot
/// be made.
pub async fn replay<S: Store + ?Sized>(
    store: &S,
    id: &SessionId,
    live: Arc<dyn Model>,
    build: impl FnOnce(Arc<dyn Model>) -> Agent,
    options: impl Into<ReplayOptions>,
) -> Result<ReplayReport, DurableError> {
    let options = options.into();
    let mode = options.mode;
    let session = store.load(id).await?;
    let steps = store.steps(id, 0, usize::MAX).await?;
    let history = &session.snapshot.history;
    let recorded: Vec<Recorded> = steps
        .iter()
        .filter_map(|step| Recorded::of(step, history))
        .collect();
    let model = Arc::new(ReplayModel {
        live,
        mode,
        recorded: recorded.clone(),
        calls: Mutex::new(Vec::new()),
        parted: Mutex::new(false),
    });
    let agent = build(model.clone());
    // The machine the session started as (its instances' ids included,
    // which tools may show the model), when the recording says.
    let mut machine = match steps.first().and_then(|s| s.tree_before.clone()) {
        Some(instance) => agent.restore(markov_executor::SerializedMachine {
            format_version: markov_executor::FORMAT_VERSION,
            instance,
            history: Vec::new(),
            policy: markov_policy::PolicySnapshot::default(),
            usage: markov_context::UsageTotals::default(),
        })?,
        None => {
            tracing::warn!(session = %id, "the tree the session started from was not recorded: the replay starts from the agent's");
            agent.machine()
        }
    };
    machine.set_record_calls(false);
    let gate = Arc::new(ReplayGate {
        recorded: Mutex::new(recorded_calls(history, &steps)),
        run_live: options.run_tools_live,
        model: model.clone(),
        calls: Mutex::new(Vec::new()),
    });
    machine.policy_state().set_call_gate(gate.clone());
    let mut error = None;
    for input in history.iter().filter(|m| is_user_input(m)) {
        machine.enqueue([input.clone()]);
        if let Err(e) = machine.run().await {
            error = Some(e.to_string());
            break;
        }
    }
    let calls = model
        .calls
        .lock()
        .map(|c| c.clone())
        .unwrap_or_else(|p| p.into_inner().clone());
    let count = recorded.len().max(calls.len());
    let mut diffs = Vec::with_capacity(count);
    let mut parted_at = None;
    for i in 0..count {
        let old = recorded.get(i).map(|r| r.side.clone());
        let new = calls.get(i).map(|c| c.side.clone());
        let (request_changed, answer_changed) = match (&old, &new) {
            (Some(a), Some(b)) => (
                a.request != b.request,
                a.text != b.text || a.tool_calls != b.tool_calls,
            ),
            _ => (true, true),
        };
        if parted_at.is_none() && (request_changed || answer_changed) {
            parted_at = Some(i as u64);
        }
        diffs.push(StepDiff {
            index: i as u64,
            recorded: old,
            replayed: new,
            answered_from: calls.get(i).map(|c| c.source),
            request_changed,
            answer_changed,
        });
    }
    Ok(ReplayReport {
        session: id.clone(),
        mode,
        parted_at,
        steps: diffs,
        tool_calls: gate
            .calls
            .lock()
            .map(|c| c.clone())
            .unwrap_or_else(|p| p.into_inner().clone()),
        error,
    })
}

/// A recorded tool call, its result and the state it wrote.
#[derive(Debug, Clone)]
struct RecordedCall {
    tool: String,
    args: Value,
    content: String,
    is_error: bool,
    state: Option<Value>,
}

/// The recorded tool calls with their results and the state patches the
/// steps' traces say they wrote, in order.
fn recorded_calls(history: &[Message], steps: &[StepTrace]) -> Vec<RecordedCall> {
    let mut wrote: std::collections::HashMap<&str, std::collections::VecDeque<&Value>> =
        std::collections::HashMap::new();
    for call in steps
        .iter()
        .flat_map(|s| &s.calls)
        .flat_map(|c| &c.tool_calls)
    {
        if let Some(state) = &call.state {
            wrote
                .entry(call.call_id.as_str())
                .or_default()
                .push_back(state);
        }
    }
    let mut results = std::collections::HashMap::new();
    for message in history {
        for item in message.item_list() {
            if let Item::ToolResult {
                tool_use_id,
                content,
                is_error,
                ..
            } = item
            {
                results.insert(tool_use_id.clone(), (content.clone(), *is_error));
            }
        }
    }
    let mut calls = Vec::new();
    for message in history.iter().filter(|m| m.role == Role::Assistant) {
        for item in message.item_list() {
            if let Item::ToolUse { id, name, input } = item {
                match results.get(id) {
                    Some((content, is_error)) => calls.push(RecordedCall {
                        tool: name.clone(),
                        args: input.clone(),
                        content: content.clone(),
                        is_error: is_error.unwrap_or(false),
                        state: wrote
                            .get_mut(id.as_str())
                            .and_then(|patches| patches.pop_front())
                            .cloned(),
                    }),
                    None => {
                        tracing::debug!(tool = %name, "a recorded call has no recorded result: a replay cannot answer it from the recording");
                    }
                }
            }
        }
    }
    calls
}

/// Answers a replay's tool calls from the recording, and refuses the
/// calls with effects the recording does not have.
#[derive(Debug)]
struct ReplayGate {
    /// The recorded calls not yet used, in order.
    recorded: Mutex<Vec<RecordedCall>>,
    run_live: bool,
    model: Arc<ReplayModel>,
    calls: Mutex<Vec<ToolCallReplay>>,
}

impl markov_policy::CallGate for ReplayGate {
    fn decide(
        &self,
        tool: &str,
        args: &Value,
        metadata: Option<&markov_policy::ToolMetadata>,
        delivery: Option<markov_core::tool::Delivery>,
    ) -> markov_policy::CallDecision {
        use markov_policy::CallDecision;
        let declared = if metadata.is_some_and(|m| m.category() == markov_policy::Category::Action)
        {
            Some(ToolEffect::Action)
        } else {
            match delivery {
                Some(markov_core::tool::Delivery::AtMostOnce) => Some(ToolEffect::AtMostOnce),
                Some(markov_core::tool::Delivery::AtLeastOnce) => Some(ToolEffect::Idempotent),
                None => None,
            }
        };
        let mut recorded = self.recorded.lock().unwrap_or_else(|p| p.into_inner());
        let found = recorded
            .iter()
            .position(|r| r.tool == tool && r.args == *args);
        let wrote_state = found.is_some_and(|i| recorded[i].state.is_some());
        let effect = declared.or(wrote_state.then_some(ToolEffect::WritesState));
        let (decision, source) = match (effect, found) {
            // No effect the replay knows of: the tool runs again (on the
            // replay's own machine, nothing stored).
            (None, _) => (CallDecision::Run, ToolCallSource::Live),
            (Some(_), Some(i)) => {
                let r = recorded.remove(i);
                (
                    CallDecision::Answer {
                        content: r.content,
                        is_error: r.is_error,
                        state_updates: r.state.into_iter().collect(),
                    },
                    ToolCallSource::Recorded,
                )
            }
            (Some(_), None) if self.run_live => (CallDecision::Run, ToolCallSource::Live),
            (Some(_), None) => {
                tracing::info!(
                    tool,
                    "a replay did not run a call the recording does not have: the tool has side effects"
                );
                (
                    CallDecision::Answer {
                        content: format!(
                            "not run during a replay: the recording has no such call and `{tool}` has side effects"
                        ),
                        is_error: true,
                        state_updates: Vec::new(),
                    },
                    ToolCallSource::Refused,
                )
            }
        };
        drop(recorded);
        self.push(tool, args, source, effect);
        decision
    }
}

impl ReplayGate {
    /// Reports a call, under the step whose answer made it.
    fn push(&self, tool: &str, args: &Value, source: ToolCallSource, effect: Option<ToolEffect>) {
        let step = self
            .model
            .calls
            .lock()
            .map_or(0, |c| c.len())
            .saturating_sub(1);
        self.calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(ToolCallReplay {
                step: step as u64,
                tool: tool.to_owned(),
                args: args.clone(),
                answered_from: source,
                effect,
            });
    }
}

/// A recorded model call: its request and its answer.
#[derive(Debug, Clone)]
struct Recorded {
    side: StepSide,
    answer: ModelResponse,
}

impl Recorded {
    fn of(step: &StepTrace, history: &[Message]) -> Option<Self> {
        let request = request_json(&step.request(history)?.as_request());
        let from = usize::try_from(step.history_from).ok()?;
        let to = usize::try_from(step.history_to).ok()?.min(history.len());
        let message = history
            .get(from..to)?
            .iter()
            .find(|m| m.role == Role::Assistant)?;
        let content = message.item_list().to_vec();
        let stop = if content.iter().any(|i| matches!(i, Item::ToolUse { .. })) {
            StopReason::ToolUse
        } else {
            StopReason::EndTurn
        };
        let mut answer = ModelResponse::new(content, stop).with_usage(step.usage);
        if let Some(model) = &step.model {
            answer = answer.with_model(model.clone());
        }
        Some(Recorded {
            side: side(request, &answer),
            answer,
        })
    }
}

/// A replayed model call.
#[derive(Debug, Clone)]
struct Call {
    side: StepSide,
    source: AnswerSource,
}

/// The live model behind a replay, answering from the recording where it
/// may.
#[derive(Debug)]
struct ReplayModel {
    live: Arc<dyn Model>,
    mode: ReplayMode,
    recorded: Vec<Recorded>,
    calls: Mutex<Vec<Call>>,
    /// Set at the first request that differs: from there on, the live
    /// model answers (the recorded answers belong to the other run).
    parted: Mutex<bool>,
}

#[async_trait]
impl ModelLayer for ReplayModel {
    type Inner = dyn Model;

    fn inner(&self) -> &Self::Inner {
        &*self.live
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let json = request_json(&request);
        let index = self.calls.lock().map_or(0, |c| c.len());
        let recorded = (self.mode == ReplayMode::RecordedWhereUnchanged)
            .then(|| self.recorded.get(index))
            .flatten()
            .filter(|r| r.side.request == json);
        let parted = {
            let mut parted = self.parted.lock().unwrap_or_else(|p| p.into_inner());
            if recorded.is_none() {
                *parted = true;
            }
            *parted
        };
        let (answer, source) = match recorded {
            Some(r) if !parted => (r.answer.clone(), AnswerSource::Recorded),
            _ => (self.live.complete(request).await?, AnswerSource::Live),
        };
        if let Ok(mut calls) = self.calls.lock() {
            calls.push(Call {
                side: side(json, &answer),
                source,
            });
        }
        Ok(answer)
    }
}

fn side(request: Value, answer: &ModelResponse) -> StepSide {
    let text: String = answer
        .content
        .iter()
        .filter_map(|i| match i {
            Item::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    StepSide {
        request,
        text: (!text.is_empty()).then_some(text),
        tool_calls: answer
            .tool_calls()
            .map(|(_, name, args)| (name.to_owned(), args.clone()))
            .collect(),
        usage: answer.usage,
    }
}

/// A request as JSON, to compare and to show: the messages without their
/// metadata (which instance wrote them, under ids each machine makes
/// anew), which no provider sends.
fn request_json(request: &ModelRequest<'_>) -> Value {
    let messages: Vec<Value> = request
        .messages()
        .iter()
        .map(|m| {
            let mut value = serde_json::to_value(m).unwrap_or(Value::Null);
            if let Some(object) = value.as_object_mut() {
                object.remove("metadata");
            }
            value
        })
        .collect();
    serde_json::json!({
        "system": request.system(),
        "messages": messages,
        "tools": request.tools(),
        "provider_tools": request.provider_tools(),
        "tool_choice": request.tool_choice(),
        "settings": request.settings(),
        "output_schema": request.output_schema(),
    })
}

/// Whether `message` is text a user typed (not an instance's hand-back).
fn is_user_input(message: &Message) -> bool {
    message.role == Role::User
        && message.source_instance().is_none()
        && !message.is_silent()
        && message
            .item_list()
            .iter()
            .any(|item| matches!(item, Item::Text { text } if !text.is_empty()))
}

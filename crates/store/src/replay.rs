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
    /// The replay's tools are the agent's own and ran: a replay plays
    /// back recorded model answers, not recorded tool results, so give
    /// the agent stand-ins for tools with effects.
    pub tools_ran: bool,
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
/// The agent's tools run (see [`ReplayReport::tools_ran`]).
///
/// # Errors
/// The session or its steps cannot be read, or the agent's machine cannot
/// be made.
pub async fn replay<S: Store + ?Sized>(
    store: &S,
    id: &SessionId,
    live: Arc<dyn Model>,
    build: impl FnOnce(Arc<dyn Model>) -> Agent,
    mode: ReplayMode,
) -> Result<ReplayReport, DurableError> {
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
        tools_ran: true,
        error,
    })
}

/// A recorded model call: its request and its answer.
#[derive(Debug, Clone)]
struct Recorded {
    side: StepSide,
    answer: ModelResponse,
}

impl Recorded {
    fn of(step: &StepTrace, history: &[Message]) -> Option<Self> {
        let request = request_json(&step.request(history)?);
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

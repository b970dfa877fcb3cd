//! The workflow that drives a session's machine, and the worker that runs
//! it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use markov_executor::serialize::SerializedMachine;
use markov_executor::{Agent, Machine, MachineStep, RunError, serialize_machine};
use markov_policy::Decision;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use temporalio_macros::{workflow, workflow_methods};
use temporalio_sdk::{
    ActivityOptions, ContinueAsNewOptions, SyncWorkflowContext, WorkflowContext,
    WorkflowContextView, WorkflowResult,
};

use crate::activities::MarkovActivities;
use crate::{StepInput, StepOptions, drive, interrupted_value};

/// What a turn answers: the last step's text, whether the machine is done,
/// and the length of the history after the turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TurnResult {
    /// The machine's response: the last step's, else the text of the last
    /// assistant message (`None` when it has none).
    pub response: Option<String>,
    /// Whether the run ended done (an answer, a terminal tool, ...).
    pub done: bool,
    /// Why the last step yielded (`YieldReason` as markov writes it).
    pub yield_reason: String,
    /// Messages in the session's history after the turn.
    pub history_len: usize,
    /// The run's error, when the turn failed (the session goes on).
    pub error: Option<String>,
}

/// A call that waits for the application's decision: answer it with
/// [`SessionClient::decide`](crate::SessionClient::decide) and this `id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PendingApproval {
    /// The id to decide it by (the model's id of the call).
    pub id: String,
    /// The tool asked for.
    pub tool: String,
    /// The arguments the model gave.
    pub args: Value,
}

/// A decision on one pending call, as the `decide` signal carries it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ApprovalDecision {
    /// The [`PendingApproval::id`] decided.
    pub id: String,
    /// The decision.
    pub decision: Decision,
}

impl ApprovalDecision {
    /// `decision` on the call `id`.
    pub fn new(id: impl Into<String>, decision: Decision) -> Self {
        ApprovalDecision {
            id: id.into(),
            decision,
        }
    }
}

/// Where a session stands, as the `status` query answers it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SessionStatus {
    /// Turns finished since the session began (across continue-as-new).
    pub turns: u64,
    /// The last finished turn's result.
    pub last: Option<TurnResult>,
    /// The calls the running turn waits for decisions on.
    pub pending: Vec<PendingApproval>,
    /// User messages received and not yet begun.
    pub queued: usize,
}

/// The workflow's input: a new session (`SessionInput::default()`, `{}` as
/// JSON), or the session carried over by continue-as-new.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct SessionInput {
    /// The machine's snapshot (`SerializedMachine` as JSON); `None` for a
    /// new session.
    pub snapshot: Option<Value>,
    /// User messages received and not yet begun.
    pub inbox: Vec<String>,
    /// Turns finished so far.
    pub turns: u64,
}

pub use session::MarkovSession;

/// The workflow itself, apart: its macros make an undocumented, un-`Debug`
/// item per handler.
#[allow(missing_docs, missing_debug_implementations)]
mod session {
    use super::*;

    /// The workflow `MarkovSession`: one per session, its workflow id the
    /// session id. Signals `send` (a user message) and `decide` (an
    /// [`ApprovalDecision`]); queries `status` ([`SessionStatus`]) and
    /// `snapshot` (the machine as markov's snapshot JSON, to import into a
    /// markov store or the studio with `Agent::restore`).
    #[workflow]
    #[derive(Default)]
    pub struct MarkovSession {
        /// `None` only in the instance the SDK makes for itself; the worker's
        /// factory always gives one.
        pub(super) agent: Option<Agent>,
        pub(super) options: Arc<StepOptions>,
        pub(super) inbox: VecDeque<String>,
        pub(super) decisions: HashMap<String, Decision>,
        pub(super) status: SessionStatus,
        pub(super) snapshot: Value,
    }

    impl std::fmt::Debug for MarkovSession {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("MarkovSession")
                .field("agent", &self.agent.as_ref().map(Agent::name))
                .field("status", &self.status)
                .finish_non_exhaustive()
        }
    }

    #[workflow_methods]
    impl MarkovSession {
        /// Runs the session's turns as user messages arrive; continues as new
        /// when the history grows.
        #[run]
        pub async fn run(
            ctx: &mut WorkflowContext<Self>,
            input: SessionInput,
        ) -> WorkflowResult<()> {
            let (agent, options) = ctx.state(|s| (s.agent.clone(), Arc::clone(&s.options)));
            let Some(agent) = agent else {
                return Err(temporalio_common::error::ApplicationFailure::non_retryable(
                    "this worker has no agent for the session",
                )
                .into());
            };
            let mut machine = match &input.snapshot {
                Some(snapshot) => restore(&agent, snapshot.clone())?,
                None => agent.machine(),
            };
            ctx.state_mut(|s| {
                // A run continued as new answers the snapshot it carries over.
                if let Some(snapshot) = input.snapshot {
                    s.snapshot = snapshot;
                }
                s.inbox.extend(input.inbox);
                s.status.turns = input.turns;
                s.status.queued = s.inbox.len();
            });
            loop {
                ctx.wait_condition(|s| !s.inbox.is_empty()).await?;
                let Some(message) = ctx.state_mut(|s| {
                    let message = s.inbox.pop_front();
                    s.status.queued = s.inbox.len();
                    message
                }) else {
                    continue;
                };
                let result = turn(ctx, &options, &mut machine, message).await?;
                let snapshot = serialize_machine(&machine)
                    .ok()
                    .and_then(|s| serde_json::to_value(s).ok());
                if snapshot.is_none() {
                    tracing::error!("the machine's snapshot could not be written after a turn");
                }
                ctx.state_mut(|s| {
                    s.status.turns += 1;
                    s.status.last = Some(result);
                    s.status.pending.clear();
                    if let Some(snapshot) = &snapshot {
                        s.snapshot = snapshot.clone();
                    }
                });
                let grown = ctx.continue_as_new_suggested()
                    || ctx.history_length() >= options.continue_after_events;
                if grown && let Some(snapshot) = snapshot {
                    let (inbox, turns) =
                        ctx.state(|s| (s.inbox.iter().cloned().collect(), s.status.turns));
                    ctx.continue_as_new(
                        SessionInput {
                            snapshot: Some(snapshot),
                            inbox,
                            turns,
                        },
                        ContinueAsNewOptions::default(),
                    )?;
                }
            }
        }

        /// A user message: the next turn's input.
        #[signal]
        pub fn send(&mut self, _ctx: &mut SyncWorkflowContext<Self>, message: String) {
            self.inbox.push_back(message);
            self.status.queued = self.inbox.len();
        }

        /// A decision on a pending call.
        #[signal]
        pub fn decide(&mut self, _ctx: &mut SyncWorkflowContext<Self>, decision: ApprovalDecision) {
            if !self.status.pending.iter().any(|p| p.id == decision.id) {
                tracing::warn!(id = %decision.id, "a decision names no pending call; it is ignored");
                return;
            }
            self.decisions.insert(decision.id, decision.decision);
        }

        /// Where the session stands.
        #[query]
        pub fn status(&self, _ctx: &WorkflowContextView) -> SessionStatus {
            self.status.clone()
        }

        /// The machine as markov's snapshot JSON after the last turn (`null`
        /// before the first).
        #[query]
        pub fn snapshot(&self, _ctx: &WorkflowContextView) -> Value {
            self.snapshot.clone()
        }
    }
}

impl MarkovSession {
    /// The instance the worker's factory makes for each workflow run.
    pub(crate) fn for_agent(agent: Agent, options: Arc<StepOptions>) -> Self {
        MarkovSession {
            agent: Some(agent),
            options,
            inbox: VecDeque::new(),
            decisions: HashMap::new(),
            status: SessionStatus::default(),
            snapshot: Value::Null,
        }
    }
}

fn restore(agent: &Agent, snapshot: Value) -> WorkflowResult<Machine> {
    let snapshot: SerializedMachine = serde_json::from_value(snapshot).map_err(|e| {
        temporalio_common::error::ApplicationFailure::non_retryable(format!(
            "the session's snapshot cannot be read: {e}"
        ))
    })?;
    agent.restore(snapshot).map_err(|e| {
        temporalio_common::error::ApplicationFailure::non_retryable(format!(
            "the session's snapshot cannot be restored: {e}"
        ))
        .into()
    })
}

/// One turn: the message, the run, the approvals it waits for.
async fn turn(
    ctx: &WorkflowContext<MarkovSession>,
    options: &StepOptions,
    machine: &mut Machine,
    message: String,
) -> WorkflowResult<TurnResult> {
    machine.enqueue_user(message);
    let mut last = drive(machine.run(), async |step| serve(ctx, options, step).await).await;
    while last.is_ok() && machine.is_awaiting_approval() {
        wait_for_decisions(ctx, machine).await?;
        last = drive(machine.resume(), async |step| {
            serve(ctx, options, step).await
        })
        .await;
    }
    Ok(turn_result(machine, last))
}

fn turn_result(machine: &Machine, last: Result<MachineStep, RunError>) -> TurnResult {
    let history_len = machine.history().len();
    match last {
        Ok(last) => TurnResult {
            response: last.response.clone().or_else(|| {
                machine
                    .history()
                    .iter()
                    .rev()
                    .find(|m| m.role == markov_core::message::Role::Assistant)
                    .map(|m| m.text())
                    .filter(|t| !t.is_empty())
            }),
            done: last.done,
            yield_reason: format!("{:?}", last.yield_reason),
            history_len,
            error: None,
        },
        Err(error) => {
            tracing::warn!(%error, "a turn failed");
            TurnResult {
                response: None,
                done: false,
                yield_reason: String::new(),
                history_len,
                error: Some(error.to_string()),
            }
        }
    }
}

/// Lists the pending calls in the workflow's state, waits for a decision
/// on each and applies them.
async fn wait_for_decisions(
    ctx: &WorkflowContext<MarkovSession>,
    machine: &mut Machine,
) -> WorkflowResult<()> {
    let mut pending = machine.approvals().pending();
    // The calls' ids come from the recorded model answer: the same on
    // every replay, unlike the requests' own ids.
    pending.sort_by(|a, b| (&a.call_id, &a.tool).cmp(&(&b.call_id, &b.tool)));
    let listed: Vec<(PendingApproval, markov_policy::ApprovalId)> = pending
        .iter()
        .enumerate()
        .map(|(i, request)| {
            let id = request
                .call_id
                .as_ref()
                .map_or_else(|| format!("{}#{i}", request.tool), ToString::to_string);
            (
                PendingApproval {
                    id,
                    tool: request.tool.clone(),
                    args: request.args.clone(),
                },
                request.request_id.clone(),
            )
        })
        .collect();
    let ids: Vec<String> = listed.iter().map(|(p, _)| p.id.clone()).collect();
    ctx.state_mut(|s| s.status.pending = listed.iter().map(|(p, _)| p.clone()).collect());
    ctx.wait_condition(|s| ids.iter().all(|id| s.decisions.contains_key(id)))
        .await?;
    for (approval, request_id) in listed {
        let Some(decision) = ctx.state_mut(|s| s.decisions.remove(&approval.id)) else {
            continue;
        };
        if let Err(error) = machine.approvals().decide(&request_id, decision) {
            // An edit whose arguments do not fit the tool, say: the call is
            // denied with the reason, so the model reads why.
            tracing::warn!(%error, "a decision was refused; the call is denied");
            let _ = machine.approvals().decide(
                &request_id,
                Decision::Deny {
                    message: Some(format!("the decision was refused: {error}")),
                },
            );
        }
    }
    ctx.state_mut(|s| s.status.pending.clear());
    Ok(())
}

/// Runs one step as an activity and answers its recorded value.
async fn serve(
    ctx: &WorkflowContext<MarkovSession>,
    options: &StepOptions,
    step: StepInput,
) -> Value {
    let retry = |attempts: u32| {
        temporalio_common::RetryPolicy::builder()
            .maximum_attempts(attempts)
            .build()
    };
    let activity_options = |attempts: u32| {
        ActivityOptions::with_start_to_close_timeout(options.call_timeout)
            .heartbeat_timeout(options.heartbeat_timeout)
            .retry_policy(retry(attempts))
            .build()
    };
    match step {
        StepInput::Model(input) => {
            let input = match serde_json::to_value(input) {
                Ok(input) => input,
                Err(e) => {
                    return serde_json::json!({ "error": format!("the model call could not be written: {e}") });
                }
            };
            ctx.execute_activity(
                MarkovActivities::model,
                input,
                activity_options(options.max_attempts.max(1)),
            )
            .await
            .unwrap_or_else(|error| {
                tracing::warn!(%error, "a model call failed for good");
                serde_json::json!({ "error": error.to_string() })
            })
        }
        StepInput::Tool(input) => {
            // An at-most-once call gets a second attempt only to learn that
            // the first one started: that attempt answers INTERRUPTED.
            let attempts = if input.at_most_once {
                2
            } else {
                options.max_attempts.max(1)
            };
            let at_most_once = input.at_most_once;
            let input = match serde_json::to_value(input) {
                Ok(input) => input,
                Err(e) => {
                    return serde_json::json!({ "error": format!("the tool call could not be written: {e}") });
                }
            };
            ctx.execute_activity(MarkovActivities::tool, input, activity_options(attempts))
                .await
                .unwrap_or_else(|error| {
                    tracing::warn!(%error, "a tool call failed for good");
                    if at_most_once {
                        interrupted_value()
                    } else {
                        serde_json::json!({ "error": error.to_string() })
                    }
                })
        }
    }
}

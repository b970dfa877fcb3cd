//! The bodies the API answers and the events it streams, as the types the
//! handlers build: the OpenAPI document describes these very types.

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

/// An error: what went wrong, in words.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ErrorBody {
    /// What went wrong.
    pub(crate) error: String,
}

/// The service is up.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Health {
    /// Always `ok`.
    pub(crate) status: String,
}

/// Who the caller is.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Me {
    /// The principal, which owns the sessions it creates.
    pub(crate) principal: String,
    /// Its roles.
    pub(crate) roles: Vec<String>,
}

/// An agent the server serves.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct AgentInfo {
    /// Its name.
    pub(crate) name: String,
    /// Whether `POST /sessions` creates its sessions.
    pub(crate) default: bool,
    /// The model it answers with, if the server names it.
    pub(crate) model: Option<String>,
    /// For a team served under this name: its agents' names.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) team: Option<Vec<String>>,
}

/// A session just created.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct NewSession {
    /// Its id.
    pub(crate) id: String,
    /// Its agent.
    pub(crate) agent: String,
}

/// A session in a list.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SessionSummary {
    /// Its id.
    pub(crate) id: String,
    /// Its agent.
    pub(crate) agent: String,
    /// How many messages its history holds.
    pub(crate) messages: u64,
    /// Whether a run of it is in progress on this server.
    pub(crate) running: bool,
    /// Whether a run is recorded in progress in the store (here, on
    /// another worker, or left by one that stopped, to be continued).
    pub(crate) interrupted: bool,
    /// When it was created, in Unix milliseconds.
    pub(crate) created_at: u64,
    /// When it last changed, in Unix milliseconds.
    pub(crate) updated_at: u64,
}

/// A call waiting for the user's decision.
#[derive(Debug, Serialize, ToSchema)]
#[allow(dead_code)]
pub(crate) struct ApprovalRequest {
    /// What `POST /sessions/{id}/approvals/{request}` decides.
    request_id: String,
    /// When it expires, in Unix milliseconds.
    expires: u64,
    /// The tool.
    tool: String,
    /// The exact arguments.
    #[schema(value_type = Object)]
    args: Value,
    /// A one-line preview of the action.
    preview: String,
    /// The paused call's id (calls paused for approval only).
    #[serde(skip_serializing_if = "Option::is_none")]
    call_id: Option<String>,
}

/// An at-most-once call that a resumed step found started and never
/// finished: answered `INTERRUPTED` and not run again, its outcome
/// unknown, for a person to reconcile.
#[derive(Debug, Serialize, ToSchema)]
#[allow(dead_code)]
pub(crate) struct InterruptedCall {
    /// The call's id in the model's answer.
    call_id: String,
    /// The tool.
    tool: String,
    /// The arguments it was called with (`null` when they were too large
    /// to keep).
    #[schema(value_type = Object)]
    args: Value,
    /// The agent instance the call ran for, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    instance: Option<String>,
    /// The call's ledger key (user turn, instance, call id).
    key: String,
    /// When the call started, in Unix milliseconds.
    started_at: u64,
}

/// Where a page that shows the history joins the run in progress.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct LiveRun {
    /// The `Last-Event-ID` to read the run's events from its start.
    pub(crate) last_event_id: String,
    /// How many messages of the history were stored before the run.
    pub(crate) history_len: usize,
    /// The user's text that started the turn, which its first step
    /// records.
    pub(crate) message: Option<String>,
}

/// A session, whole.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SessionDetail {
    /// Its id.
    pub(crate) id: String,
    /// Its agent.
    pub(crate) agent: String,
    /// Its messages (assistant text also as sanitized `html`).
    #[schema(value_type = Vec<Object>)]
    pub(crate) history: Value,
    /// The agent's state.
    #[schema(value_type = Object)]
    pub(crate) state: Value,
    /// The calls waiting for a decision.
    #[schema(value_type = Vec<ApprovalRequest>)]
    pub(crate) pending_approvals: Vec<markov_policy::ConfirmationRequest>,
    /// Whether a turn waits for decisions.
    pub(crate) awaiting_approval: bool,
    /// What the session used so far.
    #[schema(value_type = Object)]
    pub(crate) usage: Value,
    /// Whether a run of it is in progress on this server.
    pub(crate) running: bool,
    /// Whether a run is recorded in progress in the store.
    pub(crate) interrupted: bool,
    /// Where the run in progress here takes up from the history.
    pub(crate) live_run: Option<LiveRun>,
    /// For a team conversation: its agents, the one holding it, who wrote
    /// each message of `history` (which holds the conversation's texts),
    /// and the handoffs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) team: Option<TeamDetail>,
}

/// A team conversation's part of a session's detail.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct TeamDetail {
    /// The team's agents.
    pub(crate) agents: Vec<String>,
    /// The agent holding the conversation: the one the next message goes
    /// to.
    pub(crate) current_agent: String,
    /// For each message of the history, the agent that wrote it (`null`
    /// for the user's).
    pub(crate) speakers: Vec<Option<String>>,
    /// Every handoff, in order.
    pub(crate) handoffs: Vec<HandoffEvent>,
}

/// One agent handed the conversation to another.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct HandoffEvent {
    /// The agent that handed over.
    pub(crate) from: String,
    /// The agent that took over (and answers from now on).
    pub(crate) to: String,
    /// Why, as its model said.
    pub(crate) reason: String,
    /// Where it happened: how many messages of the conversation's history
    /// came before it.
    pub(crate) at: usize,
}

/// A run is stopping.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Cancelling {
    /// Always `true`.
    pub(crate) cancelling: bool,
}

/// What a command did.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct CommandResult {
    /// Whether it succeeded.
    pub(crate) success: bool,
    /// Its value.
    #[schema(value_type = Option<Object>)]
    pub(crate) value: Value,
    /// Why it failed.
    pub(crate) error: Option<String>,
}

// --- the events of a run --------------------------------------------------------

/// One step: its messages (assistant text also as sanitized HTML), why it
/// ended, the response (and its HTML), the calls waiting for approval, the
/// model that answered, what the step and the turn and session so far
/// used, and the usage limit that ended the run, if one did.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct StepEvent {
    /// Why the step ended (`end_turn`, `tool_calls`, `awaiting_approval`, ...).
    pub(crate) yield_reason: String,
    /// Whether the turn is over.
    pub(crate) done: bool,
    /// The messages the step added.
    #[schema(value_type = Vec<Object>)]
    pub(crate) messages: Value,
    /// The model's answer, if the step ended the turn with one.
    pub(crate) response: Option<String>,
    /// The answer as sanitized HTML.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) response_html: Option<String>,
    /// The calls waiting for approval.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<ApprovalRequest>)]
    pub(crate) approvals: Vec<markov_policy::ConfirmationRequest>,
    /// The model that answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) model: Option<String>,
    /// What the step used.
    #[schema(value_type = Object)]
    pub(crate) usage: markov_core::model::Usage,
    /// What the turn and the session used so far.
    #[schema(value_type = Object)]
    pub(crate) totals: markov_context::UsageTotals,
    /// The usage limit that ended the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) usage_limit: Option<String>,
    /// The at-most-once calls this step answered `INTERRUPTED` (started
    /// before a crash, never finished, not run again).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<InterruptedCall>)]
    pub(crate) interrupted: Vec<markov_policy::InterruptedCall>,
    /// In a team conversation: the agent that made the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) agent: Option<String>,
    /// In a team conversation, on the first step after a handoff: how many
    /// of the step's first messages are what the handoff gave the agent
    /// (the conversation as the team shows it, and a note of the handoff:
    /// markov's words to the agent, not the user's).
    #[serde(skip_serializing_if = "is_zero")]
    pub(crate) handoff_context: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl StepEvent {
    /// The event of `step` (outside a team conversation), its thinking
    /// shown only when `thinking` (the agent says whether it may be).
    pub(crate) fn of(step: &markov_executor::MachineStep, thinking: bool) -> Self {
        let messages = crate::markdown::shown(&step.history, thinking);
        // The answer is the last message's text, rendered just above.
        let response_html = step.response.as_deref().and_then(|text| {
            crate::markdown::rendered(&messages, text).or_else(|| crate::markdown::to_html(text))
        });
        StepEvent {
            yield_reason: step.yield_reason.as_str().to_owned(),
            done: step.done,
            messages,
            response: step.response.clone(),
            response_html,
            approvals: step.approvals.clone(),
            model: step.model.clone(),
            usage: step.usage,
            totals: step.totals,
            usage_limit: step.usage_limit.map(|limit| limit.to_string()),
            interrupted: step.interrupted.clone(),
            agent: None,
            handoff_context: 0,
        }
    }
}

/// A piece of the model's text (or of its thinking) as it arrives.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct DeltaEvent {
    /// The text.
    pub(crate) text: String,
}

/// A decision was recorded (the first event of a decision's stream).
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct DecidedEvent {
    /// The request decided.
    pub(crate) request_id: String,
    /// `approve`, `edit`, `deny` or `respond`.
    pub(crate) decision: String,
    /// The tool.
    pub(crate) tool: String,
    /// How many calls still wait: the run resumes when none does.
    pub(crate) waiting: usize,
}

/// The run ended (the last event of a run that was not interrupted).
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct DoneEvent {
    /// Whether the turn is over.
    pub(crate) done: bool,
    /// The model's answer.
    pub(crate) response: Option<String>,
    /// Why the last step ended.
    pub(crate) yield_reason: String,
    /// Whether the turn waits for decisions.
    pub(crate) awaiting_approval: bool,
    /// Why it was stopped from outside (`cancelled`, `deadline`), if it
    /// was.
    pub(crate) stopped: Option<String>,
    /// The usage limit that ended the run, if one did.
    pub(crate) usage_limit: Option<String>,
    /// What the turn and the session used.
    #[schema(value_type = Object)]
    pub(crate) usage: Value,
    /// In a team conversation: the agent that answered, which holds the
    /// conversation now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) agent: Option<String>,
}

/// The server is shutting down mid-run: the run continues when it is back.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct InterruptedEvent {
    /// Why the last step ended.
    pub(crate) yield_reason: String,
    /// Why the run stopped here.
    pub(crate) reason: String,
}

/// One server-sent event of a run, as `{"event": <name>, "data": <the
/// event's JSON>}`. On the wire each is an SSE frame: `event:` is the
/// name, `data:` the JSON text and `id:` `<run>-<seq>`, which a client
/// that lost its stream sends back as `Last-Event-ID` to
/// `GET /sessions/{id}/events` to read what followed.
#[derive(Debug, Serialize, ToSchema)]
#[serde(tag = "event", content = "data", rename_all = "snake_case")]
#[allow(dead_code)]
// A step's event is the largest (its usage and totals are kept typed, not
// as JSON trees), and boxing it would cost an allocation per step: an event
// lives only until `RunLog::record` has written it as text, and none is
// ever kept in a collection where its size would add up.
#[allow(clippy::large_enum_variant)]
pub(crate) enum RunEvent {
    /// A decision was recorded.
    Decided(DecidedEvent),
    /// A step was stored.
    Step(StepEvent),
    /// A piece of the model's text.
    Delta(DeltaEvent),
    /// A piece of the model's thinking, as the output guards let it
    /// through (checked like the text; a part a guard blocks streams no
    /// further, and the step's message then shows it as it was streamed,
    /// ending with the mark that the rest was withheld).
    Thinking(DeltaEvent),
    /// The run ended.
    Done(DoneEvent),
    /// The server stopped mid-run.
    Interrupted(InterruptedEvent),
    /// The run failed.
    Error(ErrorBody),
    /// In a team conversation: an agent handed the conversation to
    /// another (stored before it is sent), which makes the next steps.
    Handoff(HandoffEvent),
}

impl RunEvent {
    /// Its name and its data as JSON text, for the run's log.
    pub(crate) fn into_logged(self) -> (&'static str, String) {
        fn text(value: &impl Serialize) -> String {
            serde_json::to_string(value).unwrap_or_else(|_| "{}".into())
        }
        match self {
            RunEvent::Decided(e) => ("decided", text(&e)),
            RunEvent::Step(e) => ("step", text(&e)),
            RunEvent::Delta(e) => ("delta", text(&e)),
            RunEvent::Thinking(e) => ("thinking", text(&e)),
            RunEvent::Done(e) => ("done", text(&e)),
            RunEvent::Interrupted(e) => ("interrupted", text(&e)),
            RunEvent::Error(e) => ("error", text(&e)),
            RunEvent::Handoff(e) => ("handoff", text(&e)),
        }
    }
}

// --- the studio -------------------------------------------------------------------

/// What every recorded step shows, an agent's own and a sub-agent's: why
/// it ended, its model call, what it used and how long it took, the
/// messages it added, the approvals it left, its tool calls and the
/// sub-agents they ran.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct StepView {
    /// Why it ended (`end_turn`, `tool_calls`, `awaiting_approval`, ...).
    pub(crate) yield_reason: String,
    /// Whether its run (the agent's, or the sub-agent's) ended with it.
    pub(crate) done: bool,
    /// The model that answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) model: Option<String>,
    /// The node whose model call it made, if it made one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) node: Option<String>,
    /// The tool choice of its model call, if it made one.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub(crate) tool_choice: Option<Value>,
    /// How many tools its model call was offered.
    pub(crate) tools: usize,
    /// What it used (tokens, requests, cost).
    #[schema(value_type = Object)]
    pub(crate) usage: Value,
    /// Milliseconds from its start to its end.
    pub(crate) step_ms: u64,
    /// Milliseconds its model calls took.
    pub(crate) model_ms: u64,
    /// Milliseconds its tools took.
    pub(crate) tools_ms: u64,
    /// Whether its exact request can be read (`GET .../steps/{n}/request`;
    /// a sub-agent's step's at `GET .../steps/{n}/sub_agents/{at}/request`,
    /// rebuilt from the sub-agent's history recorded in this step or the
    /// few before).
    pub(crate) has_request: bool,
    /// Whether its request can also be read as the provider's wire body
    /// (`.../wire` beside `.../request`): it can be read, and the server
    /// has an encoder for the agent (or sub-agent) that made it.
    pub(crate) wire: bool,
    /// The messages it added: the answer, its tool calls, their results
    /// (assistant text also as sanitized `html`).
    #[schema(value_type = Vec<Object>)]
    pub(crate) messages: Value,
    /// The calls that waited for approval when it ended.
    #[schema(value_type = Vec<ApprovalRequest>)]
    pub(crate) approvals: Vec<markov_policy::ConfirmationRequest>,
    /// Each tool call of the step's model calls as the trace recorded it:
    /// `call_id`, `tool`, `ms` and the policy's decision (`outcome`: `ran`,
    /// `refused` with its `stage` and `envelope`, `awaiting`, `ledger`,
    /// `answered`; `approval` with its `decision` and who decided, `by`).
    /// Empty where the trace recorded none (older steps).
    #[schema(value_type = Vec<Object>)]
    pub(crate) tool_calls: Vec<Value>,
    /// The sub-agents its tool calls ran, each under the call that ran it,
    /// nested as they ran (absent when none ran).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) sub_agents: Vec<SubAgentRun>,
}

/// One recorded step, as the studio's timeline shows it.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct StepSummary {
    /// Its place in the session, from 0.
    pub(crate) index: u64,
    /// When it was recorded, in Unix milliseconds.
    pub(crate) recorded_at: u64,
    /// What it shows.
    #[serde(flatten)]
    pub(crate) step: StepView,
    /// In a team conversation's timeline: which agent made the step, in
    /// which of its sessions, and the handoff that gave it the
    /// conversation (absent in an agent's own session).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) team: Option<TeamStep>,
}

/// The steps a sub-agent ran for one tool call of a step.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SubAgentRun {
    /// The tool call that ran it.
    pub(crate) call_id: String,
    /// The sub-agent's tool name.
    pub(crate) agent: String,
    /// What its steps here used in all, nested sub-agents' included: part
    /// of the calling step's usage, which counts it.
    #[schema(value_type = Object)]
    pub(crate) usage: Value,
    /// Its steps, in the order they ran.
    pub(crate) steps: Vec<SubAgentStepSummary>,
}

/// One step of a sub-agent, as the studio shows it under the call that ran
/// the sub-agent.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SubAgentStepSummary {
    /// Its place among the calling step's sub-agent steps: what
    /// `GET .../steps/{n}/sub_agents/{at}/request` names.
    pub(crate) at: usize,
    /// The sub-agent's tool name.
    pub(crate) agent: String,
    /// What it shows.
    #[serde(flatten)]
    #[schema(no_recursion)]
    pub(crate) step: StepView,
}

/// A step of a team conversation's timeline: the agent that made it.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct TeamStep {
    /// The agent.
    pub(crate) agent: String,
    /// The agent's own session in the conversation, whose step it is
    /// (`GET /sessions/{session}/steps/{step}/request` reads its request,
    /// `.../wire` its wire body).
    pub(crate) session: String,
    /// The step's place in that session, from 0.
    pub(crate) step: u64,
    /// The handoff that gave the agent the conversation, on its first step
    /// after it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) handoff: Option<HandoffEvent>,
}

/// A team conversation's timeline: whose steps it holds, and why its
/// steps are not forked or replayed one agent at a time.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct TeamTimeline {
    /// The team's agents.
    pub(crate) agents: Vec<String>,
    /// Why a step of it is not forked, and the conversation not replayed.
    pub(crate) no_fork: String,
}

/// A page of a session's recorded steps.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct StepPage {
    /// The steps, in order.
    pub(crate) steps: Vec<StepSummary>,
    /// Where the next page starts (`from`), absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) next: Option<u64>,
    /// Whether the server replays the session (`POST /sessions/{id}/replay`).
    pub(crate) replayable: bool,
    /// Whether the server shows the steps' requests as the provider's wire
    /// body (`GET /sessions/{id}/steps/{n}/wire`); in a team conversation,
    /// whether it does for any of its agents (each step's `wire` says
    /// whether for it).
    pub(crate) wire: bool,
    /// Whether the server exports the session as an eval case
    /// (`GET /sessions/{id}/case`).
    pub(crate) exportable: bool,
    /// Set for a team conversation: the page holds every agent's steps,
    /// in the order they ran, `index` their place in that order.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) team: Option<TeamTimeline>,
}

/// A step's model request as the provider's wire body.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct StepWire {
    /// The step.
    pub(crate) step: u64,
    /// The node that called.
    pub(crate) node: String,
    /// The JSON body the provider is sent for the request (no headers),
    /// credential-like fields redacted.
    #[schema(value_type = Object)]
    pub(crate) body: Value,
}

/// A step's model request as the model received it.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct StepRequest {
    /// The step.
    pub(crate) step: u64,
    /// The node that called.
    pub(crate) node: String,
    /// System prompt, messages, tools, provider tools, tool choice,
    /// settings and output schema, credential-like fields redacted.
    #[schema(value_type = Object)]
    pub(crate) request: Value,
}

/// The stored requests still waiting for a decision, unexpired.
pub(crate) fn pending(
    approvals: &[markov_policy::ApprovalRecord],
) -> Vec<&markov_policy::ConfirmationRequest> {
    let now = crate::now_ms();
    approvals
        .iter()
        .filter(|r| r.status == markov_policy::ApprovalStatus::Pending && now < r.request.expires)
        .map(|r| &r.request)
        .collect()
}

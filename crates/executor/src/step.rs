//! What a run yields: one [`MachineStep`] per step, with its [`YieldReason`].

use std::sync::Arc;

use markov_core::tool::TerminateResponse;
use markov_core::{InstanceId, Message};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::instance::Instance;

/// The prefix of markov's note recorded in the place of what a guard
/// blocked (a user's message, an answer): a system message, never the
/// blocked words.
pub const BLOCKED_NOTE: &str = "[guard]";

/// The mark that ends a thinking part an output guard blocked partway, in
/// the copy of a streamed answer that is shown (the final message of its
/// stream): the part reads as it was streamed up to the block, then a
/// blank line and this mark. A part blocked before any of it was streamed
/// is left out of that copy. The history keeps the part as the provider
/// signed it.
pub const THINKING_WITHHELD: &str = "[guard] The rest of this thinking was withheld.";

/// Why a step ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum YieldReason {
    /// The turn is over.
    EndTurn,
    /// Tools ran; the loop continues.
    ToolUse,
    /// The token limit cut the answer.
    MaxTokens,
    /// An instance ceded to its parent.
    Cede,
    /// A command (resume) ran.
    Command,
    /// An instance suspended.
    Suspend,
    /// Nothing is active; suspended instances wait for a resume.
    AwaitingResume,
    /// An external executor handed control outside.
    External,
    /// The answer had no tool call and output is restricted: a reminder was
    /// injected and the model is called again.
    Restricted,
    /// The loop guard ended the run: a leaf kept calling one tool with the
    /// same arguments within the user turn.
    LoopDetected,
    /// Calls of the answer need the application's approval: the step ended
    /// without recording the answer, and the run waits for the decisions
    /// ([`MachineStep::approvals`] lists the calls), then for
    /// [`Machine::resume`](crate::Machine::resume).
    AwaitingApproval,
    /// The run was stopped from outside (cancelled, or past its deadline):
    /// the step in flight is recorded with a result for each of its calls
    /// (the calls that had not finished get
    /// [`CANCELLED_TOOL_CALL`](crate::CANCELLED_TOOL_CALL)), and the turn is
    /// over. See [`RunState::cancel`](crate::RunState::cancel).
    Cancelled,
    /// The next model call could have passed a usage limit
    /// ([`UsageLimits`](markov_context::UsageLimits)), so it was not made: the run
    /// ends here, everything before it recorded, and
    /// [`MachineStep::usage_limit`] says which limit. The next turn goes on
    /// unless the limit is the session's.
    UsageLimit,
    /// The model refused the conversation as too long for its context
    /// window, and nothing could be left out: no context policy is set
    /// (set one with `AgentBuilder::context_policy` or
    /// `NodeBuilder::context_policy`, see `markov_charter::context`), or
    /// the current turn alone is too long. Nothing of the step is
    /// recorded and the run is over; the session stays usable once a
    /// policy is set (or with a model of a larger context window).
    ContextExhausted,
    /// A guard blocked the user's message or the answer (see
    /// `markov_guard`): no text it blocked was delivered and no call of
    /// the blocked answer ran. The history records markov's note in the
    /// answer's place (a system message naming the guard and its reason);
    /// the turn is over and the next one goes on.
    Blocked,
}

impl YieldReason {
    /// The wire string (`"end_turn"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            YieldReason::EndTurn => "end_turn",
            YieldReason::ToolUse => "tool_use",
            YieldReason::MaxTokens => "max_tokens",
            YieldReason::Cede => "cede",
            YieldReason::Command => "command",
            YieldReason::Suspend => "suspend",
            YieldReason::AwaitingResume => "awaiting_resume",
            YieldReason::External => "external",
            YieldReason::Restricted => "restricted",
            YieldReason::LoopDetected => "loop_detected",
            YieldReason::AwaitingApproval => "awaiting_approval",
            YieldReason::Cancelled => "cancelled",
            YieldReason::UsageLimit => "usage_limit",
            YieldReason::ContextExhausted => "context_exhausted",
            YieldReason::Blocked => "blocked",
        }
    }
}

/// A suspended instance, as reported by an `awaiting_resume` step.
#[derive(Debug, Clone, PartialEq)]
pub struct SuspendedInstance {
    /// The instance.
    pub instance_id: InstanceId,
    /// Its suspend id.
    pub suspend_id: String,
    /// Why.
    pub reason: String,
    /// Application data.
    pub metadata: Option<Value>,
}

/// One step of a run.
#[derive(Debug, Clone)]
pub struct MachineStep {
    /// The tree after the step (a cheap shared snapshot).
    pub instance: Arc<Instance>,
    /// The messages this step produced, in order: the machine's history
    /// holds the same messages, shared, not copies of them.
    pub history: Vec<Message>,
    /// Why the step ended.
    pub yield_reason: YieldReason,
    /// Whether the run is over.
    pub done: bool,
    /// What a ceding instance handed back (only on a `cede` step of a single leaf).
    pub cede_content: Option<Value>,
    /// Suspended instances (on `awaiting_resume`).
    pub suspended_instances: Vec<SuspendedInstance>,
    /// The calls waiting for the application's decision (on
    /// `awaiting_approval`), oldest first: each request's id, the call's id,
    /// the tool, the arguments, a preview and the expiry. Decide them with
    /// [`Machine::approvals`](crate::Machine::approvals).
    pub approvals: Vec<markov_policy::ConfirmationRequest>,
    /// The machine's exact response, when a terminal tool produced it.
    pub response: Option<String>,
    /// Set when a tool ended the run with a `TerminateResponse`.
    pub termination: Option<TerminateResponse>,
    /// The intents the step's tools returned for the application, in leaf
    /// and call order.
    pub intents: Vec<crate::executor::Intent>,
    /// What this step's model calls used (tokens, requests, cost), summed
    /// over its leaves.
    pub usage: markov_core::model::Usage,
    /// What the run has used so far, this step included.
    pub run_usage: markov_core::model::Usage,
    /// What the user turn and the session have used so far, this step
    /// included ([`Machine::usage`](crate::Machine::usage)).
    pub totals: markov_context::UsageTotals,
    /// The limit the next model call could have passed (on a
    /// [`YieldReason::UsageLimit`] step).
    pub usage_limit: Option<markov_context::LimitExceeded>,
    /// The model that answered this step's model call, as the answer names
    /// it ([`ModelResponse::model`](markov_core::ModelResponse::model)):
    /// the primary leaf's, or a worker's on a step of workers only. With a
    /// fallback model it says which model of the list answered. `None`
    /// when the step called no model or the answer named none.
    pub model: Option<String>,
    /// At-most-once calls this step found started and never finished (the
    /// process died, or the run was dropped, while their tool ran): each
    /// was answered `INTERRUPTED` and not run again. Their outcome is
    /// unknown: show them (call id, tool, arguments) to a person, who
    /// checks whether the effect happened.
    pub interrupted: Vec<markov_policy::InterruptedCall>,
    /// What each leaf's model call was made of and how long it took, in
    /// leaf order: empty unless the machine records calls
    /// ([`Machine::set_record_calls`](crate::Machine::set_record_calls)).
    pub calls: Vec<ModelCall>,
}

impl MachineStep {
    /// What the user reads of this step: the terminal tool's
    /// [`response`](Self::response) when there is one, else the text of the
    /// step's last assistant message (`None` when the step ended without
    /// one: on tool calls, a pause for approval, a `finish` without text).
    pub fn output(&self) -> Option<String> {
        if let Some(response) = &self.response {
            return Some(response.clone());
        }
        self.history
            .iter()
            .rev()
            .find(|m| m.role == markov_core::Role::Assistant)
            .map(markov_core::Message::text)
            .filter(|text| !text.is_empty())
    }
}

/// Per-leaf bookkeeping of the current turn, for tool-choice and restriction rules.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnState {
    /// Whether a tool has run in this turn (tool choice relaxes to `Auto` after).
    pub tool_ran: bool,
    /// Restriction reminders injected since the turn began or the last tool ran.
    pub injections: u32,
    /// The next call is the recovery call after an answer cut off by the
    /// token limit: it asks for no tools, so no tool choice forces one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recovering: bool,
}

/// One leaf's model call of a step: everything its request held besides
/// the history, which it names by length (the request was sent the first
/// `history_len` messages of the machine's history), and how long the model
/// and the tools took.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCall {
    /// The leaf instance that called.
    pub instance: String,
    /// The leaf's node, by name (or id when unnamed).
    pub node: String,
    /// The system prompt sent (kept once by a store, see
    /// [`markov_core::kept`]).
    #[serde(serialize_with = "markov_core::kept::serialize_shared")]
    pub system: std::sync::Arc<str>,
    /// The tools offered (kept once by a store).
    #[serde(serialize_with = "markov_core::kept::serialize_shared")]
    pub tools: std::sync::Arc<[markov_core::tool::ToolDefinition]>,
    /// The provider built-in tools offered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub provider_tools: Vec<markov_core::tool::ProviderTool>,
    /// The tool choice.
    pub tool_choice: markov_core::model::ToolChoice,
    /// The settings.
    pub settings: markov_core::model::ModelSettings,
    /// The structured-output schema, if the node declares one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<serde_json::Value>,
    /// How many messages of the history the request was sent (the first
    /// ones, in order).
    pub history_len: u64,
    /// Whether a context policy changed what the request showed of the
    /// history (a summary, messages left out, results stubbed): then the
    /// request's messages were a view of the first `history_len` messages,
    /// not those messages as they are. `false` for a call under a policy
    /// whose view had not changed anything yet.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub context_view: bool,
    /// The shape of that view, from which its messages are rebuilt; `None`
    /// when the request was sent the history as it is, and on calls
    /// recorded before views were (whose request cannot be rebuilt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub view: Option<markov_context::ViewShape>,
    /// The leaf's turn bookkeeping when it called (what the tool choice
    /// rules saw), so that a fork continues the turn as it stood.
    #[serde(default)]
    pub turn: TurnState,
    /// Whether the answer was a recorded one replayed (no model call).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replayed: bool,
    /// Milliseconds the model call took (its retries and summaries
    /// included).
    pub model_ms: u64,
    /// Milliseconds the tools took, from the answer to the step's end.
    pub tools_ms: u64,
    /// The answer's tool calls, in order: each one's time and what the
    /// policy decided (ran, refused, waited for approval, answered from
    /// the ledger). Empty for an answer without calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<markov_policy::CallTrace>,
}

impl ModelCall {
    /// The request as it was sent, over `history` (the machine's history
    /// of which the request was sent the first
    /// [`history_len`](Self::history_len) messages, or the view
    /// [`view`](Self::view) made of them).
    ///
    /// `None` when `history` is shorter than that, or when a context
    /// policy's view was not recorded (a call recorded before views were).
    pub fn request<'a>(&'a self, history: &'a [markov_core::Message]) -> Option<SentRequest<'a>> {
        let len = usize::try_from(self.history_len).ok()?;
        let messages = history.get(..len)?;
        let messages = match (&self.view, self.context_view) {
            (Some(view), _) => std::borrow::Cow::Owned(view.messages(messages)?),
            (None, true) => return None,
            (None, false) => std::borrow::Cow::Borrowed(messages),
        };
        Some(SentRequest {
            call: self,
            messages,
        })
    }
}

/// A recorded call's request rebuilt ([`ModelCall::request`]): the call
/// and the messages it was sent.
#[derive(Debug, Clone)]
pub struct SentRequest<'a> {
    call: &'a ModelCall,
    messages: std::borrow::Cow<'a, [markov_core::Message]>,
}

impl SentRequest<'_> {
    /// The request, as the model received it (to inspect, or to encode as
    /// any provider's wire body).
    pub fn as_request(&self) -> markov_core::model::ModelRequest<'_> {
        let call = self.call;
        markov_core::model::ModelRequest::new(&call.system, &self.messages, &call.settings)
            .with_tools(&call.tools)
            .with_provider_tools(&call.provider_tools)
            .with_tool_choice(&call.tool_choice)
            .with_output_schema(call.output_schema.as_ref())
    }

    /// The messages the request was sent.
    pub fn messages(&self) -> &[markov_core::Message] {
        &self.messages
    }
}

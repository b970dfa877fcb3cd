//! The tool pipeline: one model response's tool calls, run in order, reported
//! as data.
//!
//! [`run_tool_calls`] dispatches each call: `updateState`, then the
//! transition tools, then the node's tools, ancestors' tools (nearest first),
//! charter tools and, for non-workers, the tools of the node's packs. Every
//! call gets exactly one result, except a call of a provider built-in tool
//! (declared on the node, or found on an ancestor before
//! any tool of that name), which the provider already ran: it is skipped and
//! produces no result, no reply and no intent. Nothing is applied to any instance: the
//! caller receives the accumulated state patch, pack patches, the queued
//! transition and the terminal/termination signals, and decides.
//!
//! Rules decided here:
//! - one transition per response (`Only one transition allowed per turn`); a
//!   transition name the node does not declare is an error result at once;
//! - the first terminal tool that succeeds gives the response; a later
//!   terminal call in the same response is not executed;
//! - a tool whose `update_state` was refused gets an error result (upstream
//!   ignored the failure silently).
//!
//! With a tool registry ([`LeafView::policies`]), calls of the tools it
//! registers (whether the node, an ancestor, the charter, a pack or only the
//! registry declares them) and of unknown names go through the registry's
//! policy stack (see [`markov_policy`]); the tool still runs with the same
//! [`ToolContext`], so its state updates apply as without one. A node,
//! ancestor, charter or pack tool the registry does not register (a node's
//! own `respond` or `finish`, say) takes the plain execute-only path, as
//! without a registry: it is offered, so it must be callable. Built-ins
//! (`updateState`, transitions) bypass the stack. An unknown name is then a
//! `NOT_FOUND` envelope instead of `Unknown tool: <name>`, and the intents
//! that tools returned through the stack are collected in
//! [`PipelineOutcome::intents`].

use std::collections::BTreeMap;
use std::sync::Mutex;

use markov_core::ids::{InstanceId, ToolCallId};
use markov_core::message::{Item, Message};
use markov_core::tool::{
    TerminateResponse, ToolContext, ToolExecutionResult, UserMessage, check_tool_arguments,
};
use serde_json::Value;
use tracing::Instrument;

use super::builtin::{queue_transition, update_state_builtin};
use super::call::{contain_panic, invalid_arguments, plain_session, repeated_call, run_found};
use super::lookup::{Found, ScopedState, is_provider_tool, resolve};

use markov_charter::charter::{AncestorView, Charter};
use markov_charter::loop_guard::LoopGuard;
use markov_charter::node::Node;
use markov_charter::toolgen::{TRANSITION, TRANSITION_PREFIX, UPDATE_STATE};
use markov_policy::{
    PolicyState, RegistrySession, Repeat, RepeatCounts, ToolErrorKind, ToolOrigin,
};

/// What the pipeline needs to know about the leaf it runs for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeafView<'a> {
    /// The charter.
    pub charter: &'a Charter,
    /// The leaf's node.
    pub node: &'a Node,
    /// The leaf's instance id.
    pub instance_id: &'a InstanceId,
    /// The root's instance id.
    pub root_id: &'a InstanceId,
    /// The leaf's state at the start of the step.
    pub state: &'a Value,
    /// Ancestors, root first.
    pub ancestors: &'a [AncestorView<'a>],
    /// Pack states (the root's), by pack name.
    pub pack_states: &'a BTreeMap<String, Value>,
    /// Whether the leaf is a worker.
    pub is_worker: bool,
    /// The history tools may read.
    pub history: &'a [Message],
    /// The tool result of a `TerminateResponse` without a message.
    pub terminate_message: &'a str,
    /// The tool registry, mode and turn counters regular calls go through;
    /// `None` runs tools directly.
    pub policies: Option<RegistrySession<'a>>,
    /// The conversation's identical-call counts; `None` turns the loop
    /// guard off.
    pub repeats: Option<&'a RepeatCounts>,
    /// The conversation whose ledger the plain path (no registry) keeps, so
    /// that a resumed step answers a completed call from it; `None` keeps
    /// the calls in a throwaway state of the process.
    pub conversation: Option<&'a PolicyState>,
    /// Set when nothing can replay the step's answer (it was not
    /// recorded: no journal keeps it, no call of it can pause the step, it
    /// is not a replay): the length of the history it was asked over. The
    /// plain path's calls then go straight to the tool with no ledger
    /// entry, and a tool that asks for its idempotency key gets the key a
    /// recorded answer would have given it. `None`: the plain path keeps
    /// the ledger.
    pub unrecorded: Option<u64>,
    /// The loop guard of the leaf's node (or the charter's).
    pub loop_guard: LoopGuard,
    /// Whether tool arguments and results go into the trace (opt-in: they
    /// may hold personal data).
    pub capture_content: bool,
    /// Where the calls report what they spend themselves (a sub-agent's
    /// model calls), for the step to count; `None`: nothing counts it.
    pub usage: Option<&'a markov_core::tool::UsageSink>,
    /// Where each call's trace goes (its time and what the policy decided),
    /// when the machine records its steps; `None`: nothing is timed or
    /// kept.
    pub traces: Option<&'a CallTraces>,
}

/// The traces of one response's calls, in call order, kept while the
/// calls run.
#[derive(Debug, Default)]
pub(crate) struct CallTraces(Mutex<Vec<markov_policy::CallTrace>>);

impl CallTraces {
    fn push(&self, trace: markov_policy::CallTrace) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(trace);
    }

    /// The traces kept so far (none are left).
    pub(crate) fn take(&self) -> Vec<markov_policy::CallTrace> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// How the stages answered a call, and the decision it went on with.
pub(super) type Verdict = (
    markov_policy::CallOutcome,
    Option<markov_policy::DecidedApproval>,
);

/// The verdict of a call the pipeline answered itself, refused at
/// `stage` with `error`.
fn refused(stage: &'static str, error: Option<ToolErrorKind>) -> Option<Verdict> {
    Some((
        markov_policy::CallOutcome::Refused {
            stage: stage.into(),
            error: error.map(|k| k.as_str().into()),
        },
        None,
    ))
}

/// The verdict of a built-in that ran.
fn ran(result: &ToolExecutionResult) -> Option<Verdict> {
    Some((
        markov_policy::CallOutcome::Ran {
            ok: !result.is_error,
            error: None,
        },
        None,
    ))
}

/// One requested call, borrowed from the assistant message that holds it
/// (the history's copy is the only one).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ToolCall<'a> {
    /// Its id.
    pub id: &'a ToolCallId,
    /// The tool name the model wrote.
    pub name: &'a str,
    /// The arguments.
    pub input: &'a Value,
}

impl<'a> ToolCall<'a> {
    /// The calls of `message` (its `tool_use` items), in order.
    pub(crate) fn all_in(message: &'a Message) -> impl Iterator<Item = ToolCall<'a>> {
        message
            .tool_uses()
            .map(|(id, name, input)| ToolCall { id, name, input })
    }
}

/// A transition the model asked for, to run after all calls.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct QueuedTransition {
    /// Which result reports it (to correct it if the transition fails).
    pub result_index: usize,
    /// The transition's name on the node.
    pub name: String,
    /// Why.
    pub reason: String,
    /// The arguments, without `reason`.
    pub args: Value,
}

/// The response a terminal tool produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TerminalResponse {
    /// The call.
    pub call_id: ToolCallId,
    /// The tool.
    pub tool: String,
    /// The response text, verbatim.
    pub text: String,
    /// Whether the text is already among the reply items (a `ToolReply`'s user text).
    pub in_replies: bool,
}

/// Everything one response's calls produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct PipelineOutcome {
    /// One result per call, in call order (none for provider built-in tool calls).
    pub results: Vec<ToolExecutionResult>,
    /// Whether each result's `is_error: false` is written on success (node
    /// tools) or left out (built-ins, pack tools).
    pub result_states_known: StatesKnown,
    /// Assistant items from `ToolReply` user messages, in call order.
    pub replies: Vec<Item>,
    /// The leaf's new state and the accumulated patch, if it changed.
    pub state: Option<(Value, Value)>,
    /// Accumulated patches per pack, in first-write order.
    pub pack_patches: Vec<(String, Value)>,
    /// The queued transition, if any.
    pub transition: Option<QueuedTransition>,
    /// The terminal response, if a terminal tool succeeded.
    pub terminal: Option<TerminalResponse>,
    /// A tool asked to end the run.
    pub terminate: Option<TerminateResponse>,
    /// The intents tools returned through the registry, in call order, with
    /// the call that returned each.
    pub intents: Vec<(ToolCallId, Value)>,
    /// The loop guard ended the run: the tool the leaf kept calling with the
    /// same arguments, and how many times it did in this user turn.
    pub loop_stop: Option<(String, u32)>,
    /// The calls that did not run because they wait for the application's
    /// decision, in call order: the step pauses instead of recording them.
    pub awaiting: Vec<markov_policy::ConfirmationRequest>,
}

impl PipelineOutcome {
    /// The `tool_result` items, in call order.
    #[cfg(test)]
    pub(crate) fn result_items(&self) -> Vec<Item> {
        self.results
            .iter()
            .zip(self.result_states_known.iter())
            .map(|(r, known)| r.to_item(known))
            .collect()
    }

    /// [`Self::result_items`], moving the results out (they are left
    /// empty).
    pub(crate) fn take_result_items(&mut self) -> Vec<Item> {
        std::mem::take(&mut self.results)
            .into_iter()
            .zip(self.result_states_known.iter())
            .map(|(r, known)| r.into_item(known))
            .collect()
    }
}

/// Whether each result's `is_error: false` is written on success, in
/// result order. Most results' is (a node tool's): only the others are
/// kept, by index, so a step of node tools keeps no list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct StatesKnown {
    len: usize,
    /// The indices of the results whose state is not known, ascending.
    unknown: Vec<usize>,
}

impl StatesKnown {
    /// Notes the next result's.
    pub(crate) fn push(&mut self, known: bool) {
        if !known {
            self.unknown.push(self.len);
        }
        self.len += 1;
    }

    /// How many results are noted.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Each result's, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = bool> + '_ {
        let mut unknown = self.unknown.iter().peekable();
        (0..self.len).map(move |i| {
            let is_unknown = unknown.next_if(|&&u| u == i).is_some();
            !is_unknown
        })
    }
}

/// The results of one response's calls as they complete, readable while the
/// pipeline still runs: a step that is cancelled midway (its run dropped, an
/// outer timeout) records them from here, so a call that ran is never
/// forgotten.
#[derive(Debug, Default)]
pub(crate) struct CallLog {
    results: Mutex<Vec<ToolExecutionResult>>,
}

impl CallLog {
    /// Nothing completed yet.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// The result recorded for `call`, if it completed.
    pub(crate) fn result_of(&self, call: &ToolCallId) -> Option<ToolExecutionResult> {
        self.results
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|r| r.call_id == *call)
            .cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<ToolExecutionResult>> {
        self.results.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn len(&self) -> usize {
        self.lock().len()
    }

    // The results live here while the calls run (not copied: the outcome
    // takes them at the end).
    fn push(&self, result: ToolExecutionResult) {
        self.lock().push(result);
    }

    /// Room for `n` more results (one allocation for a step's calls).
    fn reserve(&self, n: usize) {
        self.lock().reserve(n);
    }

    fn take(&self) -> Vec<ToolExecutionResult> {
        std::mem::take(&mut *self.lock())
    }
}

/// Runs `calls` in order for `leaf`. Never fails: every call gets one
/// result, except calls of provider built-in tools, which get none.
#[cfg(test)]
pub(crate) async fn run_tool_calls(leaf: &LeafView<'_>, calls: &[ToolCall<'_>]) -> PipelineOutcome {
    run_tool_calls_logged(leaf, calls, &CallLog::new()).await
}

/// [`run_tool_calls`], writing each result to `log` (empty at the start) as
/// soon as it exists; the outcome takes them from it at the end.
///
/// Before anything else, each call's arguments are checked
/// ([`check_tool_arguments`]): arguments that are not a JSON object (a
/// stream cut short, a server's bad JSON) are an invalid-input error result,
/// and neither a built-in, a policy stage nor a tool sees them. A tool that
/// panics gets an execution-failed error result; the calls after it still
/// run.
pub(crate) async fn run_tool_calls_logged(
    leaf: &LeafView<'_>,
    calls: &[ToolCall<'_>],
    log: &CallLog,
) -> PipelineOutcome {
    let mut out = PipelineOutcome::default();
    log.reserve(calls.len());
    let mut running_state = leaf.state.clone();
    let mut state_patch: Option<Value> = None;
    let mut running_packs: BTreeMap<String, Value> = BTreeMap::new();
    let mut pack_patches: Vec<(String, Value)> = Vec::new();

    for call in calls {
        let started = leaf.traces.map(|_| std::time::Instant::now());
        // How the call was answered and the state it wrote, for its trace.
        let verdict: Option<Verdict>;
        let mut wrote = None;
        // OpenTelemetry's GenAI conventions; `otel.name` is the span name an
        // OpenTelemetry exporter shows.
        let span = tracing::info_span!(
            "execute_tool",
            otel.name = %format_args!("execute_tool {}", call.name),
            gen_ai.operation.name = "execute_tool",
            gen_ai.tool.name = %call.name,
            gen_ai.tool.call.id = %call.id,
            instance_id = %leaf.instance_id,
            gen_ai.tool.call.arguments = tracing::field::Empty,
            gen_ai.tool.call.result = tracing::field::Empty,
            error.type = tracing::field::Empty,
        );
        if leaf.capture_content {
            span.record(
                "gen_ai.tool.call.arguments",
                tracing::field::display(&call.input),
            );
        }
        // Looked up once: each lookup hashes the name at every level.
        let provider = is_provider_tool(leaf, call.name);
        let garbled = if provider {
            None
        } else {
            check_tool_arguments(call.input).err()
        };
        let repeat = match (garbled.is_some(), leaf.repeats) {
            (false, Some(counts)) if out.loop_stop.is_none() && !provider => counts.check(
                leaf.loop_guard.max_repeats(),
                leaf.loop_guard.refusals_before_stop(),
                leaf.instance_id,
                call.name,
                call.input,
            ),
            _ => Repeat::Allowed,
        };
        let (result, known) = if let Some(error) = garbled {
            let result = span.in_scope(|| invalid_arguments(leaf, call, &error.to_string()));
            verdict = refused("arguments", Some(ToolErrorKind::InvalidInput));
            (result, true)
        } else if let Some((tool, _)) = &out.loop_stop {
            // The run ends with this response: the calls after the stop are
            // answered, not run.
            let text = format!(
                "Not run: the run was stopped because {tool} was called with the same arguments again and again."
            );
            verdict = refused("loop_guard", None);
            (ToolExecutionResult::error(call.id.clone(), text), true)
        } else if let Repeat::Refused { times } | Repeat::Stop { times } = repeat {
            span.in_scope(|| {
                tracing::warn!(
                    times,
                    "identical tool call refused: the model is repeating itself"
                )
            });
            if matches!(repeat, Repeat::Stop { .. }) {
                out.loop_stop = Some((call.name.to_owned(), times));
            }
            verdict = refused("loop_guard", Some(ToolErrorKind::RepeatedCall));
            (repeated_call(leaf, call, times), true)
        } else if call.name == UPDATE_STATE {
            let r = span.in_scope(|| {
                update_state_builtin(leaf, call, &mut running_state, &mut state_patch)
            });
            verdict = ran(&r);
            (r, false)
        } else if call.name == TRANSITION || call.name.starts_with(TRANSITION_PREFIX) {
            let index = log.len();
            let r = span.in_scope(|| queue_transition(leaf, call, index, &mut out));
            verdict = ran(&r);
            (r, false)
        } else if provider {
            span.in_scope(|| {
                tracing::debug!("provider built-in tool call skipped: the provider ran it")
            });
            continue;
        } else {
            match resolve(leaf, call.name) {
                None => {
                    // Boxed: a name no level declares is rare, and its path
                    // would otherwise enlarge every call's future.
                    let (result, judged) =
                        Box::pin(run_unresolved(leaf, call).instrument(span.clone())).await;
                    verdict = judged;
                    (result, true)
                }
                Some(found) => {
                    let terminal = match &found {
                        Found::Node(t, _) | Found::Pack(t, _) => t.definition().terminal,
                    };
                    if terminal && let Some(first) = &out.terminal {
                        let r = ToolExecutionResult::error(
                            call.id.clone(),
                            format!(
                                "Only one terminal tool may be called per turn: {} already produced the response, so {} was not run.",
                                first.tool, call.name
                            ),
                        );
                        verdict = refused("terminal", None);
                        (r, true)
                    } else {
                        let is_pack = matches!(found, Found::Pack(..));
                        let ran = std::pin::pin!(run_found(
                            leaf,
                            found,
                            call,
                            &mut running_state,
                            &mut state_patch,
                            &mut running_packs,
                            &mut pack_patches,
                        ));
                        let found = ran.instrument(span.clone()).await;
                        out.intents
                            .extend(found.intents.into_iter().map(|i| (call.id.clone(), i)));
                        out.awaiting.extend(found.awaiting);
                        verdict = found.verdict;
                        wrote = found.wrote;
                        (found.result, !is_pack)
                    }
                }
            }
        };
        if result.is_error {
            span.record("error.type", "tool_error");
        }
        if leaf.capture_content {
            span.record("gen_ai.tool.call.result", result.content.as_str());
        }
        span.in_scope(|| {
            tracing::debug!(
                is_error = result.is_error,
                is_terminal = result.is_terminal,
                "tool call finished"
            )
        });
        if let (Some(traces), Some(started)) = (leaf.traces, started) {
            traces.push(trace_of(call, &result, started, verdict, wrote));
        }
        log.push(record(&mut out, call, result, known));
    }
    out.results = log.take();

    if state_patch.is_some() || running_state != *leaf.state {
        let patch = state_patch.unwrap_or_else(|| running_state.clone());
        out.state = Some((running_state, patch));
    }
    out.pack_patches = pack_patches;
    out
}

/// A call of a name no level of the leaf declares, through the
/// registry's stack (whose unknown-tool stage answers it) or the plain
/// one (`Unknown tool: <name>`), with how the stages answered it when the
/// calls are traced.
async fn run_unresolved(
    leaf: &LeafView<'_>,
    call: &ToolCall<'_>,
) -> (ToolExecutionResult, Option<Verdict>) {
    // A match, not `unwrap_or_else(plain_session)`: the fn item's
    // `'static` return would pin the leaf's lifetime.
    let session = match leaf.policies {
        Some(session) => session,
        None => plain_session(leaf),
    };
    let state = ScopedState::read_only(leaf.state.clone());
    let cx = ToolContext::new(call.id, leaf.history, &state)
        .with_instance(leaf.instance_id, leaf.root_id);
    let executed = std::pin::pin!(session.run(
        ToolOrigin::Node,
        None,
        call.id,
        call.name,
        std::borrow::Cow::Borrowed(call.input),
        cx,
        leaf.terminate_message,
    ));
    let judged = Mutex::new(None);
    let result = contain_panic(leaf, call, async {
        let executed = executed.await;
        if leaf.traces.is_some() {
            *judged.lock().unwrap_or_else(|p| p.into_inner()) =
                Some((executed.outcome, executed.approval));
        }
        executed.result
    })
    .await;
    (
        result,
        judged.into_inner().unwrap_or_else(|p| p.into_inner()),
    )
}

/// The trace of `call`, answered with `result` after it started at
/// `started`: what the stages decided (a call a panic ended ran and
/// failed), and the error the model read when the call was refused.
fn trace_of(
    call: &ToolCall<'_>,
    result: &ToolExecutionResult,
    started: std::time::Instant,
    verdict: Option<Verdict>,
    state: Option<Value>,
) -> markov_policy::CallTrace {
    let (outcome, approval) = verdict.unwrap_or((
        markov_policy::CallOutcome::Ran {
            ok: !result.is_error,
            error: None,
        },
        None,
    ));
    let envelope = matches!(outcome, markov_policy::CallOutcome::Refused { .. })
        .then(|| result.content.clone());
    markov_policy::CallTrace {
        call_id: call.id.clone(),
        tool: call.name.to_owned(),
        ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        outcome,
        approval,
        envelope,
        state,
    }
}

/// Notes what `result` means for the response and returns it, as recorded.
fn record(
    out: &mut PipelineOutcome,
    call: &ToolCall<'_>,
    mut result: ToolExecutionResult,
    known: bool,
) -> ToolExecutionResult {
    if !result.is_error {
        if let Some(user) = result.user_message.take() {
            let item = match &user {
                UserMessage::Text(s) => Item::text(s.clone()),
                UserMessage::Data(v) => Item::Output { data: v.clone() },
            };
            // A terminal tool's plain output is recorded as the response below,
            // a reply's user message is recorded here (once).
            let from_reply = !result.is_terminal || result.content != user_text(&user);
            if from_reply {
                out.replies.push(item);
            }
            if result.is_terminal && out.terminal.is_none() {
                out.terminal = Some(TerminalResponse {
                    call_id: call.id.clone(),
                    tool: call.name.to_owned(),
                    text: user_text(&user),
                    in_replies: from_reply,
                });
            }
        }
        if let Some(t) = result.terminate.clone()
            && out.terminate.is_none()
        {
            out.terminate = Some(t);
        }
    } else {
        result.is_terminal = false;
        result.user_message = None;
    }
    out.result_states_known.push(known);
    result
}

fn user_text(user: &UserMessage) -> String {
    match user {
        UserMessage::Text(s) => s.clone(),
        UserMessage::Data(v) => v.to_string(),
    }
}

#[cfg(test)]
mod states_known_tests {
    use super::StatesKnown;

    #[test]
    fn each_result_reads_back_what_was_noted_in_order() {
        let noted = [true, false, false, true, true, false];
        let mut states = StatesKnown::default();
        for known in noted {
            states.push(known);
        }
        assert_eq!(states.len(), noted.len());
        assert_eq!(states.iter().collect::<Vec<_>>(), noted);
        let mut all_known = StatesKnown::default();
        all_known.push(true);
        all_known.push(true);
        assert_eq!(all_known.iter().collect::<Vec<_>>(), [true, true]);
        assert_eq!(
            all_known.unknown.capacity(),
            0,
            "no list when all are known"
        );
    }
}

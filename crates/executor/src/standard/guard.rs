//! The step with guards on ([`StandardExecutor::with_guards`]): the same
//! phases, with the input guard run concurrently with the model call when
//! asked to (by default it ran where the run drained the message, see
//! `run/input.rs`), the
//! output guard on the answer (streamed text held back until it passed),
//! the tool-call guard before the calls run and the tool-result guard
//! before the model reads their results.
//!
//! The guarantees: no tool call of an answer whose input guard has not
//! passed runs, however slow the guard; no streamed text leaves the
//! executor before the output guard passed it, so a blocked answer is
//! never partly delivered.

use std::sync::{Arc, Mutex, PoisonError};

use futures::StreamExt;
use futures::future::{Either, select};
use markov_core::MessageId;
use markov_core::ToolCallId;
use markov_core::message::{Item, Items, Message, Metadata, Role, StreamInfo, StreamState};
use markov_core::model::{ModelError, ModelRequest, ModelResponse, StopReason, StreamEvent, Usage};
use markov_core::tool::ToolExecutionResult;
use markov_guard::{Blocked, Checked, Guards};
use markov_policy::{AuditSink, GuardAction, GuardPoint, GuardRecord};
use tokio::sync::watch;

use super::StandardExecutor;
use super::call::{Answer, Reply};
use super::record::Recorded;
use super::settle::settle;
use super::tools::ToolsRan;
use crate::effect::Entry;
use crate::error::RunError;
use crate::executor::{LeafContext, LeafOutcome};
use crate::step::{BLOCKED_NOTE, THINKING_WITHHELD, YieldReason};
use crate::stream::{
    DeltaKind, MessageStreamEvent, StreamDelta, StreamFailure, StreamOptions, VesselState,
};

/// One leaf's streamed text held back until the guards passed it.
#[derive(Debug)]
pub(crate) struct HoldBack {
    guards: Arc<Guards>,
    /// The input guard's verdict, once known (`true`: passed); `None`
    /// when no input guard runs.
    input: Option<watch::Receiver<Option<bool>>>,
    state: Mutex<HoldState>,
}

#[derive(Debug, Default)]
struct HoldState {
    /// The vessel the answer streams into, once enqueued, and the last
    /// sequence number told.
    vessel: Option<(MessageId, u64)>,
    /// The stream was read through the hold-back.
    streamed: bool,
    /// The text released, as released (rewritten where a guard rewrote).
    released: String,
    /// A guard rewrote some of the text.
    rewritten: bool,
    /// The output guard blocked.
    blocked: Option<Blocked>,
    /// Each thinking part of the answer, as shown: checked by the output
    /// guards like answer text (the history keeps the thinking as the
    /// provider signed it; what is shown is this copy).
    thinking: Vec<ThinkingShown>,
}

/// One thinking part of a streamed answer, as the output guards let it be
/// shown.
#[derive(Debug)]
struct ThinkingShown {
    /// Its content index in the model's answer.
    index: usize,
    /// Received and not yet checked.
    held: String,
    /// Released, as released (rewritten where a guard rewrote).
    shown: String,
    /// A guard blocked it: nothing more of it is shown.
    withheld: bool,
}

impl HoldBack {
    fn state(&self) -> std::sync::MutexGuard<'_, HoldState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for the input guard; `false` if it blocked.
    async fn input_passed(&self) -> bool {
        let Some(input) = &self.input else {
            return true;
        };
        let mut input = input.clone();
        match input.wait_for(Option::is_some).await {
            Ok(verdict) => *verdict == Some(true),
            // The step stopped waiting: nothing is released.
            Err(_) => false,
        }
    }
}

/// The text of the user's message that starts a turn: the user messages
/// at the end of the history, tool results left out. `None` when the
/// history does not end with one (a later step of the turn).
fn turn_input(history: &[Message]) -> Option<String> {
    let mut texts: Vec<String> = history
        .iter()
        .rev()
        .take_while(|m| m.role == Role::User)
        .map(Message::text)
        .filter(|t| !t.is_empty())
        .collect();
    if texts.is_empty() {
        return None;
    }
    texts.reverse();
    Some(texts.join("\n"))
}

/// The answer's text items, joined.
fn answer_text(content: &[Item]) -> String {
    content
        .iter()
        .filter_map(|i| match i {
            Item::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("")
}

/// Replaces the answer's text by `text`: in the first text item's place,
/// the other text items removed.
fn replace_text(content: &mut Vec<Item>, text: String) {
    let mut text = Some(text);
    content.retain_mut(|item| match item {
        Item::Text { text: t } => match text.take() {
            Some(new) => {
                *t = new;
                true
            }
            None => false,
        },
        _ => true,
    });
}

impl StandardExecutor {
    /// The step with `guards` on: see the module's documentation.
    pub(super) async fn run_guarded(
        &self,
        cx: LeafContext<'_>,
        guards: &Arc<Guards>,
    ) -> Result<LeafOutcome, RunError> {
        let prepared = self.prepare(&cx)?;
        let span = self.chat_span(&cx, &prepared);
        // Guard-first (the default), the input guard decided where the
        // run drained the message: only the concurrent mode checks here.
        let input = if guards.input.is_empty() || !guards.is_input_concurrent() {
            None
        } else {
            turn_input(cx.history)
        };
        let (verdict_tx, verdict_rx) = watch::channel(None);
        // Streamed text goes through a hold-back: a copy of this executor,
        // for this leaf, whose stream reader holds text back and whose
        // callback notes the vessel.
        let hold = self.streaming.as_ref().map(|_| {
            Arc::new(HoldBack {
                guards: Arc::clone(guards),
                input: input.is_some().then(|| verdict_rx.clone()),
                state: Mutex::new(HoldState::default()),
            })
        });
        let held;
        let exec = match (&hold, &self.streaming) {
            (Some(hold), Some(options)) => {
                let noted = Arc::clone(hold);
                let inner = Arc::clone(&options.on_message_stream);
                let mut copy = self.clone();
                copy.guards = None;
                copy.node_guards = None;
                copy.hold = Some(Arc::clone(hold));
                copy.streaming = Some(StreamOptions::new(move |event| {
                    match event {
                        MessageStreamEvent::Start {
                            message_id, seq, ..
                        } => noted.state().vessel = Some((message_id.clone(), *seq)),
                        // The final message as shown: its thinking as the
                        // output guards let it through.
                        MessageStreamEvent::End {
                            message_id,
                            seq,
                            source,
                            message,
                        } if !noted.guards.output.is_empty() => {
                            let mut shown = message.clone();
                            show_thinking(&mut shown, &noted.state().thinking);
                            return inner(&MessageStreamEvent::End {
                                message_id: message_id.clone(),
                                seq: *seq,
                                source: source.clone(),
                                message: shown,
                            });
                        }
                        _ => {}
                    }
                    inner(event);
                }));
                held = copy;
                &held
            }
            _ => self,
        };
        let model_call = exec.call_or_replay(&cx, &prepared, &span);
        let reply = match input {
            None => model_call.await?,
            Some(text) => {
                let check = guards.input.check(&text);
                futures::pin_mut!(check, model_call);
                match select(check, model_call).await {
                    Either::Left((checked, model_call)) => match checked {
                        Checked::Blocked(blocked) => {
                            // The model call is dropped unfinished when the
                            // step returns: none of its text was released,
                            // none of its calls runs.
                            let _ = verdict_tx.send(Some(false));
                            return Ok(self.blocked(
                                &cx,
                                hold.as_deref(),
                                "message",
                                blocked,
                                Usage::default(),
                            ));
                        }
                        Checked::Passed(rewritten) => {
                            if rewritten.is_some() {
                                tracing::warn!(
                                    "an input guard rewrote the user's message: the message is already in the history, so the rewrite is not applied"
                                );
                            }
                            let _ = verdict_tx.send(Some(true));
                            model_call.await?
                        }
                    },
                    Either::Right((reply, check)) => {
                        let reply = reply?;
                        // The answer waits for the input guard: none of its
                        // calls runs before it passed.
                        match check.await {
                            Checked::Blocked(blocked) => {
                                let _ = verdict_tx.send(Some(false));
                                let usage = match &reply {
                                    Reply::Answer(answer) => self.used(&prepared, answer),
                                    Reply::Stopped(outcome) => outcome.usage,
                                };
                                return Ok(self.blocked(
                                    &cx,
                                    hold.as_deref(),
                                    "message",
                                    blocked,
                                    usage,
                                ));
                            }
                            Checked::Passed(_) => {
                                let _ = verdict_tx.send(Some(true));
                                reply
                            }
                        }
                    }
                }
            }
        };
        let mut answer = match reply {
            Reply::Answer(answer) => answer,
            Reply::Stopped(outcome) => return Ok(outcome),
        };
        if !guards.output.is_empty() {
            let streamed = hold.as_ref().map(|h| {
                let mut state = h.state();
                let blocked = state.blocked.take();
                let released = state.rewritten.then(|| std::mem::take(&mut state.released));
                (state.streamed, blocked, released)
            });
            match streamed {
                Some((true, Some(blocked), _)) => {
                    let usage = self.used(&prepared, &answer);
                    return Ok(self.blocked(&cx, hold.as_deref(), "answer", blocked, usage));
                }
                Some((true, None, Some(released))) => {
                    replace_text(&mut answer.response.content, released)
                }
                Some((true, None, None)) => {}
                // Not streamed (or structured output, never streamed):
                // the whole answer is checked.
                _ => {
                    let text = answer_text(&answer.response.content);
                    if !text.is_empty() {
                        match guards.output.check(&text).await {
                            Checked::Blocked(blocked) => {
                                let usage = self.used(&prepared, &answer);
                                return Ok(self.blocked(
                                    &cx,
                                    hold.as_deref(),
                                    "answer",
                                    blocked,
                                    usage,
                                ));
                            }
                            Checked::Passed(Some(rewritten)) => {
                                self.audit(GuardPoint::Output, GuardAction::Rewrite, None);
                                replace_text(&mut answer.response.content, rewritten);
                            }
                            Checked::Passed(None) => {}
                        }
                    }
                }
            }
        }
        // The tool-call guard before the answer is recorded: a rewrite is
        // what the call runs with and what the history keeps; a blocked
        // call is answered with an error, not run.
        let mut refused = Vec::new();
        if !guards.tool_calls.is_empty() {
            for item in &mut answer.response.content {
                let Item::ToolUse { id, input, .. } = item else {
                    continue;
                };
                match guards.tool_calls.check(&input.to_string()).await {
                    Checked::Passed(None) => {}
                    Checked::Passed(Some(rewritten)) => {
                        self.audit(GuardPoint::ToolCall, GuardAction::Rewrite, Some(id));
                        match serde_json::from_str(&rewritten) {
                            Ok(value) => *input = value,
                            Err(_) => refused.push(ToolExecutionResult::error(
                                id.clone(),
                                "Tool call not run: a guard rewrote its arguments into text that is not JSON.",
                            )),
                        }
                    }
                    Checked::Blocked(blocked) => {
                        self.audit(GuardPoint::ToolCall, block_of(&blocked), Some(id));
                        refused.push(ToolExecutionResult::error(
                            id.clone(),
                            format!("Tool call not run: {blocked}."),
                        ));
                    }
                }
            }
        }
        // Recorded through the hold-back's copy when streamed: the final
        // message's event shows the thinking as the guards let it through.
        let mut calls = match exec.record(&cx, &prepared, answer, &span).await? {
            Recorded::Finished(outcome) => return Ok(outcome),
            Recorded::Calls(calls) => calls,
        };
        calls.refused.extend(refused);
        let mut ran = match self.run_tools(&cx, calls, &span, None).await {
            ToolsRan::Paused(outcome) => return Ok(outcome),
            ToolsRan::Done(ran) => ran,
        };
        if !guards.tool_results.is_empty() {
            for result in &mut ran.outcome.results {
                match guards.tool_results.check(&result.content).await {
                    Checked::Passed(None) => {}
                    Checked::Passed(Some(rewritten)) => {
                        self.audit(
                            GuardPoint::ToolResult,
                            GuardAction::Rewrite,
                            Some(&result.call_id),
                        );
                        result.content = rewritten;
                    }
                    Checked::Blocked(blocked) => {
                        self.audit(
                            GuardPoint::ToolResult,
                            block_of(&blocked),
                            Some(&result.call_id),
                        );
                        result.content = format!("Tool result withheld: {blocked}.");
                        result.is_error = true;
                    }
                }
            }
        }
        Ok(settle(&cx, ran).await)
    }

    /// Where the guards' rewrites and blocks are audited: the sink given
    /// to [`StandardExecutor::with_guard_audit`], else the audit sink of
    /// the executor's registry, if it has one.
    pub(super) fn audit_sink(&self) -> Option<&Arc<dyn AuditSink>> {
        self.guard_audit.as_ref().or_else(|| {
            self.registry
                .as_ref()
                .and_then(|binding| binding.registry().audit_sink())
        })
    }

    /// Traces a guard's rewrite or block and hands it to the audit sink.
    fn audit(&self, point: GuardPoint, action: GuardAction, call_id: Option<&ToolCallId>) {
        let record = GuardRecord {
            point,
            action,
            call_id: call_id.cloned(),
        };
        record.trace();
        if let Some(sink) = self.audit_sink() {
            sink.guard(&record);
        }
    }

    /// What an answer's call used, with the summarizer's calls.
    fn used(&self, prepared: &super::prepare::Prepared, answer: &Answer) -> Usage {
        let mut usage = if answer.resumed {
            Usage::default()
        } else {
            markov_context::metered(&self.prices, &self.call(prepared), &answer.response)
        };
        usage += answer.spent;
        usage
    }

    /// The outcome of a blocked step: markov's note in its place (a system
    /// message, never the user's words), replacing the streamed vessel if
    /// one was enqueued, the stream told it failed, and the run's yield
    /// reason [`YieldReason::Blocked`].
    fn blocked(
        &self,
        cx: &LeafContext<'_>,
        hold: Option<&HoldBack>,
        what: &str,
        blocked: Blocked,
        usage: Usage,
    ) -> LeafOutcome {
        tracing::warn!(
            instance = %cx.instance().id(),
            "the {what} was blocked by a guard"
        );
        let point = if what == "answer" {
            GuardPoint::Output
        } else {
            GuardPoint::Input
        };
        self.audit(point, block_of(&blocked), None);
        let source = cx.source();
        let text = format!("{BLOCKED_NOTE} The {what} was {blocked}.");
        let mut metadata = Metadata::with_source(source.clone());
        let vessel = hold.and_then(|h| h.state().vessel.clone());
        if let Some((message_id, seq)) = &vessel {
            metadata.message_id = Some(message_id.clone());
            metadata.stream = Some(StreamInfo {
                state: StreamState::Error,
                seq: Some(seq + 1),
            });
        }
        let note = Message::system(text).with_metadata(metadata);
        if let (Some((message_id, seq)), Some(options)) = (vessel, &self.streaming) {
            (options.on_message_stream)(&MessageStreamEvent::Error {
                message_id,
                seq: seq + 1,
                source,
                error: StreamFailure {
                    message: blocked.to_string(),
                },
            });
        }
        let mut outcome =
            LeafOutcome::new(vec![Entry::message(note)], YieldReason::Blocked, cx.turn);
        outcome.usage = usage;
        outcome
    }
}

/// Reads the model's stream into `vessel` like the plain reader, but tells
/// `options` of text only once the guards passed it: nothing before the
/// input guard passed, and answer text in the pieces the output guards'
/// [`Hold`] asks for, each passed (or rewritten) by them. On a block the
/// stream is dropped (the model call stops) and nothing more is told.
pub(super) async fn read_held(
    exec: &StandardExecutor,
    request: ModelRequest<'_>,
    vessel: &mut VesselState,
    options: &StreamOptions,
    hold: &HoldBack,
) -> Result<ModelResponse, ModelError> {
    hold.state().streamed = true;
    let unit = hold.guards.output.hold();
    let checked = !hold.guards.output.is_empty();
    let mut input_passed = hold.input.is_none();
    // Text received and not yet released, its content index, and thinking
    // deltas waiting for the input guard.
    let mut held = String::new();
    let mut index = 0;
    let mut thinking: Vec<MessageStreamEvent> = Vec::new();
    let mut events = exec.model.stream(request);
    // What the model has sent so far: a stream dropped on a block has not
    // reported its usage (providers report it at the end), so what it used
    // is estimated from the request and this text, conservatively.
    let mut received = String::new();
    let stopped = |received: &str| {
        let mut cut = ModelResponse::new(Vec::new(), StopReason::EndTurn);
        cut.usage = Usage {
            input_tokens: markov_context::estimate_input_tokens(&request),
            output_tokens: markov_core::tokens::estimate_text(received),
            ..Usage::default()
        };
        Ok(cut)
    };
    while let Some(event) = events.next().await {
        let event = event?;
        match &event {
            StreamEvent::TextDelta { text, .. } => received.push_str(text),
            StreamEvent::ThinkingDelta { thinking, .. } => received.push_str(thinking),
            StreamEvent::ToolCallDelta { partial_json, .. } => received.push_str(partial_json),
            _ => {}
        }
        let done = matches!(event, StreamEvent::Done(_));
        if let Some(update) = vessel.on_event(&event) {
            match &update {
                MessageStreamEvent::Update { delta, .. } if delta.kind == DeltaKind::Text => {
                    held.push_str(&delta.delta);
                    index = delta.content_index;
                }
                // Thinking is checked as answer text is, part by part.
                MessageStreamEvent::Update { delta, .. } if checked => {
                    let mut state = hold.state();
                    let at = state
                        .thinking
                        .iter()
                        .position(|t| t.index == delta.content_index);
                    let part = match at {
                        Some(at) => &mut state.thinking[at],
                        None => {
                            state.thinking.push(ThinkingShown {
                                index: delta.content_index,
                                held: String::new(),
                                shown: String::new(),
                                withheld: false,
                            });
                            let last = state.thinking.len() - 1;
                            &mut state.thinking[last]
                        }
                    };
                    if !part.withheld {
                        part.held.push_str(&delta.delta);
                    }
                }
                _ => thinking.push(update),
            }
        }
        let thinking_ready = checked && {
            let state = hold.state();
            state
                .thinking
                .iter()
                .any(|t| !t.held.is_empty() && (done || unit.ready(&t.held).is_some()))
        };
        let ready = if done {
            Some(held.len())
        } else if checked {
            unit.ready(&held)
        } else {
            Some(held.len())
        };
        if (ready.is_some() || !thinking.is_empty() || thinking_ready) && !input_passed {
            if done || hold.input.as_ref().is_some_and(|rx| rx.borrow().is_some()) {
                input_passed = hold.input_passed().await;
                if !input_passed {
                    return stopped(&received);
                }
            } else {
                // The input guard has not decided: keep reading.
                if let StreamEvent::Done(response) = event {
                    return Ok(response);
                }
                continue;
            }
        }
        for update in thinking.drain(..) {
            options_tell(hold, options, &update);
        }
        if thinking_ready {
            release_thinking(exec, hold, vessel, options, done).await;
        }
        if let Some(upto) = ready.filter(|n| *n > 0) {
            let piece: String = held.drain(..upto).collect();
            let text = if checked {
                match hold.guards.output.check(&piece).await {
                    Checked::Passed(None) => piece,
                    Checked::Passed(Some(rewritten)) => {
                        let first = !std::mem::replace(&mut hold.state().rewritten, true);
                        if first {
                            exec.audit(GuardPoint::Output, GuardAction::Rewrite, None);
                        }
                        rewritten
                    }
                    Checked::Blocked(blocked) => {
                        hold.state().blocked = Some(blocked);
                        return stopped(&received);
                    }
                }
            } else {
                piece
            };
            hold.state().released.push_str(&text);
            let update = MessageStreamEvent::Update {
                message_id: vessel.message_id().clone(),
                seq: vessel.seq(),
                source: vessel.source().clone(),
                delta: StreamDelta {
                    kind: DeltaKind::Text,
                    content_index: index,
                    delta: text,
                },
            };
            options_tell(hold, options, &update);
        }
        if let StreamEvent::Done(response) = event {
            return Ok(response);
        }
    }
    Err(ModelError::InvalidResponse(
        "the stream ended without a final message".into(),
    ))
}

/// Releases what the output guards pass of each thinking part: the pieces
/// their [`Hold`](markov_guard::Hold) asks for (all that is held when the
/// stream is `done`), rewritten where a guard rewrote. A thinking part a
/// guard blocks is withheld from then on; the answer goes on (the history
/// keeps the thinking as the provider signed it, and the model's answer is
/// checked on its own).
async fn release_thinking(
    exec: &StandardExecutor,
    hold: &HoldBack,
    vessel: &VesselState,
    options: &StreamOptions,
    done: bool,
) {
    let unit = hold.guards.output.hold();
    let parts = hold.state().thinking.len();
    for at in 0..parts {
        let (index, piece) = {
            let mut state = hold.state();
            let part = &mut state.thinking[at];
            let upto = if done {
                Some(part.held.len())
            } else {
                unit.ready(&part.held)
            };
            match upto.filter(|n| *n > 0 && !part.withheld) {
                Some(upto) => (part.index, part.held.drain(..upto).collect::<String>()),
                None => continue,
            }
        };
        let text = match hold.guards.output.check(&piece).await {
            Checked::Passed(None) => piece,
            Checked::Passed(Some(rewritten)) => {
                exec.audit(GuardPoint::Output, GuardAction::Rewrite, None);
                rewritten
            }
            Checked::Blocked(blocked) => {
                tracing::warn!(
                    "a thinking part was blocked by a guard: it is withheld, the answer goes on"
                );
                exec.audit(GuardPoint::Output, block_of(&blocked), None);
                let mut state = hold.state();
                let part = &mut state.thinking[at];
                part.withheld = true;
                part.held.clear();
                continue;
            }
        };
        hold.state().thinking[at].shown.push_str(&text);
        let update = MessageStreamEvent::Update {
            message_id: vessel.message_id().clone(),
            seq: vessel.seq(),
            source: vessel.source().clone(),
            delta: StreamDelta {
                kind: DeltaKind::Thinking,
                content_index: index,
                delta: text,
            },
        };
        options_tell(hold, options, &update);
    }
}

/// Replaces the thinking items of `message` (a copy to show, never the
/// history's) by what `shown` says of them, in order: the text the output
/// guards released, without the provider's signature; a part a guard
/// blocked partway reads as it was released, then a blank line and
/// [`THINKING_WITHHELD`], so the final message agrees with what was
/// streamed. A part none of which was released (blocked at once, or never
/// streamed, so never seen by the guards) is left out.
fn show_thinking(message: &mut Message, shown: &[ThinkingShown]) {
    let mut parts: Vec<&ThinkingShown> = shown.iter().collect();
    parts.sort_by_key(|t| t.index);
    let mut parts = parts.into_iter();
    if let Items::List(items) = &mut message.make_mut().items {
        items.retain_mut(|item| {
            let Item::Thinking {
                thinking,
                signature,
            } = item
            else {
                return true;
            };
            match parts.next() {
                Some(part) if part.shown.is_empty() => false,
                Some(part) => {
                    *thinking = if part.withheld {
                        format!("{}\n\n{THINKING_WITHHELD}", part.shown)
                    } else {
                        part.shown.clone()
                    };
                    *signature = None;
                    true
                }
                None => false,
            }
        });
    }
}

/// A block, as audited.
fn block_of(blocked: &Blocked) -> GuardAction {
    GuardAction::Block {
        guard: blocked.guard.clone(),
        reason: blocked.reason.clone(),
    }
}

/// Tells `options` of `update` and notes its sequence number.
fn options_tell(hold: &HoldBack, options: &StreamOptions, update: &MessageStreamEvent) {
    if let Some((_, seq)) = &mut hold.state().vessel {
        *seq = update.seq();
    }
    (options.on_message_stream)(update);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_turn_input_is_the_trailing_user_text() {
        let history = [
            Message::user("old"),
            Message::assistant("answer"),
            Message::user("new one"),
        ];
        assert_eq!(turn_input(&history).as_deref(), Some("new one"));
        assert_eq!(turn_input(&history[..2]), None);
    }

    #[test]
    fn replacing_text_keeps_other_items_in_place() {
        let mut content = vec![
            Item::text("a"),
            Item::Thinking {
                thinking: "t".into(),
                signature: None,
            },
            Item::text("b"),
        ];
        replace_text(&mut content, "X".into());
        assert_eq!(
            content,
            vec![
                Item::text("X"),
                Item::Thinking {
                    thinking: "t".into(),
                    signature: None
                }
            ]
        );
    }
}

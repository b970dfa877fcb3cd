//! Settle: the pipeline's outcome recorded in the emission order, a queued
//! transition taken, and the step's yield reason decided.

use crate::respond::pipeline::PipelineOutcome;
use crate::respond::take_transition;
use markov_charter::transition::{TransitionError, TransitionOutcome};
use markov_core::message::{Item, Message};
use markov_core::tool::ToolExecutionResult;
use serde_json::Value;
use tracing::Instrument;

use super::record::Metered;
use super::tools::Ran;
use super::with_source;
use crate::effect::{Effect, Entry};
use crate::executor::{Intent, LeafContext, LeafOutcome};
use crate::instance::SuspendInfo;
use crate::step::{TurnState, YieldReason};

/// Settles the step: the pipeline's outcome recorded after the answer, a
/// queued transition taken (see [`after_tools`] and
/// [`after_transition`]), and the step's usage and model set.
pub(super) async fn settle(cx: &LeafContext<'_>, ran: Ran) -> LeafOutcome {
    match settled(cx, ran) {
        Settled::Done(outcome) => outcome,
        Settled::Transition(pending, metered) => transition(cx, pending, metered).await,
    }
}

/// What [`settled`] decided.
// Made once per leaf per step and matched at once: boxing the outcome
// would add an allocation per step.
#[allow(clippy::large_enum_variant)]
pub(super) enum Settled {
    /// The step's outcome, its usage and model set.
    Done(LeafOutcome),
    /// A transition is queued: [`transition`] takes it and completes the
    /// step.
    Transition(Box<PendingTransition>, Metered),
}

/// [`settle`] up to a queued transition, without awaiting anything: a
/// step that queued none (the most common) is settled here, and its
/// future never holds the transition's.
pub(super) fn settled(cx: &LeafContext<'_>, ran: Ran) -> Settled {
    let Ran {
        entries,
        mut outcome,
        metered,
    } = ran;
    match after_tools(cx, entries, &mut outcome) {
        AfterTools::Finish(outcome) => Settled::Done(metered.onto(outcome)),
        AfterTools::Transition(pending) => Settled::Transition(pending, metered),
    }
}

/// Takes the queued transition of `pending` and completes the step.
pub(super) async fn transition(
    cx: &LeafContext<'_>,
    pending: Box<PendingTransition>,
    metered: Metered,
) -> LeafOutcome {
    let span = tracing::info_span!("transition", name = %pending.name);
    let result = take_transition(
        cx.charter,
        cx.instance().node(),
        &pending.state,
        &pending.name,
        &pending.reason,
        &pending.args,
    )
    .instrument(span)
    .await;
    metered.onto(after_transition(cx, *pending, result))
}

/// What to do after the tools ran.
#[derive(Debug)]
// Made once per leaf per step and matched at once: boxing the outcome
// would add an allocation per step to save a few bytes of a short-lived
// value.
#[allow(clippy::large_enum_variant)]
pub(super) enum AfterTools {
    /// The leaf is done for this step.
    Finish(LeafOutcome),
    /// Take the queued transition, then call [`after_transition`].
    Transition(Box<PendingTransition>),
}

/// A step waiting for its transition.
#[derive(Debug)]
pub(super) struct PendingTransition {
    entries: Vec<Entry>,
    outcome: PipelineOutcome,
    turn: TurnState,
    /// The transition's name.
    pub name: String,
    /// Why the model took it.
    pub reason: String,
    /// Its arguments.
    pub args: Value,
    /// The running state after this turn's updates.
    pub state: Value,
}

/// Records the pipeline's outcome and decides the step's result.
pub(super) fn after_tools(
    cx: &LeafContext<'_>,
    entries: Vec<Entry>,
    outcome: &mut PipelineOutcome,
) -> AfterTools {
    // A tool ran: tool choice relaxes and restriction counters start over.
    let turn = TurnState {
        tool_ran: true,
        injections: 0,
        recovering: false,
    };
    match &outcome.transition {
        Some(queued) => AfterTools::Transition(Box::new(PendingTransition {
            name: queued.name.clone(),
            reason: queued.reason.clone(),
            args: queued.args.clone(),
            state: outcome
                .state
                .as_ref()
                .map(|(s, _)| s.clone())
                .unwrap_or_else(|| cx.instance().state().clone()),
            entries,
            outcome: std::mem::take(outcome),
            turn,
        })),
        None => AfterTools::Finish(finish(cx, entries, outcome, turn, None)),
    }
}

/// Completes a step whose transition was attempted.
pub(super) fn after_transition(
    cx: &LeafContext<'_>,
    pending: PendingTransition,
    result: Result<TransitionOutcome, TransitionError>,
) -> LeafOutcome {
    let PendingTransition {
        entries,
        mut outcome,
        turn,
        name,
        ..
    } = pending;
    match result {
        Err(error) => {
            // The transition tool already said "complete"; correct the claim.
            if let Some(queued) = &outcome.transition
                && let Some(slot) = outcome.results.get_mut(queued.result_index)
            {
                *slot = ToolExecutionResult::error(
                    slot.call_id.clone(),
                    format!("Transition to \"{name}\" failed: {error}"),
                );
            }
            outcome.transition = None;
            finish(cx, entries, &mut outcome, turn, None)
        }
        Ok(transition) => finish(cx, entries, &mut outcome, turn, Some(transition)),
    }
}

/// The step's outcome: the entries so far, then the state patches, the
/// results and the replies, taken from `outcome` (left emptied).
pub(super) fn finish(
    cx: &LeafContext<'_>,
    mut entries: Vec<Entry>,
    outcome: &mut PipelineOutcome,
    mut turn: TurnState,
    transition: Option<TransitionOutcome>,
) -> LeafOutcome {
    let source = cx.source();
    let leaf_id = cx.instance().id().clone();
    if let Some((_, patch)) = &outcome.state {
        entries.push(Entry::effect(
            cx.charter,
            Effect::State {
                instance: leaf_id.clone(),
                patch: patch.clone(),
            },
            Some(source.clone()),
        ));
    }
    for (pack, patch) in &outcome.pack_patches {
        entries.push(Entry::effect(
            cx.charter,
            Effect::PackState {
                pack: pack.clone(),
                patch: patch.clone(),
            },
            Some(source.clone()),
        ));
    }
    entries.push(Entry::message(with_source(
        Message::user_items(outcome.take_result_items()),
        &source,
    )));
    // A transition wins over a terminal response and over termination.
    let terminal = outcome.terminal.as_ref().filter(|_| transition.is_none());
    let mut replies = std::mem::take(&mut outcome.replies);
    if let Some(t) = terminal
        && !t.in_replies
    {
        replies.push(Item::text(t.text.clone()));
    }
    if !replies.is_empty() {
        entries.push(Entry::message(with_source(
            Message::assistant_items(replies),
            &source,
        )));
    }
    let loop_stop = outcome.loop_stop.take();
    let mut result = LeafOutcome::new(entries, YieldReason::ToolUse, turn);
    result.intents = std::mem::take(&mut outcome.intents)
        .into_iter()
        .map(|(call_id, value)| Intent {
            instance_id: leaf_id.clone(),
            call_id,
            value,
        })
        .collect();
    match transition {
        Some(t) => {
            let (effect, reason) = match t {
                TransitionOutcome::To { node, state } => {
                    // Entering a node starts its turn over (tool choice forces again).
                    turn = TurnState::default();
                    (
                        Some(Effect::Transition {
                            instance: leaf_id,
                            node,
                            state,
                        }),
                        YieldReason::ToolUse,
                    )
                }
                TransitionOutcome::Spawn(children) if !children.is_empty() => (
                    Some(Effect::Spawn {
                        parent: leaf_id,
                        children,
                    }),
                    YieldReason::ToolUse,
                ),
                TransitionOutcome::Cede(content) => (
                    Some(Effect::Cede {
                        instance: leaf_id,
                        content,
                    }),
                    YieldReason::Cede,
                ),
                TransitionOutcome::Suspend {
                    suspend_id,
                    reason,
                    metadata,
                } => (
                    Some(Effect::Suspend {
                        instance: leaf_id,
                        info: SuspendInfo {
                            suspend_id,
                            reason,
                            suspended_at: std::time::SystemTime::now(),
                            metadata,
                        },
                    }),
                    YieldReason::Suspend,
                ),
                _ => (None, YieldReason::ToolUse),
            };
            if let Some(effect) = effect {
                result
                    .entries
                    .push(Entry::effect(cx.charter, effect, Some(source)));
            }
            result.yield_reason = reason;
            result.turn = turn;
        }
        None => {
            if let Some(t) = terminal {
                result.yield_reason = YieldReason::EndTurn;
                result.response = Some(t.text.clone());
            }
            if let Some(t) = &outcome.terminate {
                result.yield_reason = YieldReason::EndTurn;
                result.termination = Some(t.clone());
            }
        }
    }
    if let Some((tool, times)) = loop_stop {
        tracing::warn!(tool, times, "the loop guard ends the run");
        result.yield_reason = YieldReason::LoopDetected;
    }
    result
}

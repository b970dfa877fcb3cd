//! Run the tools: the answer's calls through the tool pipeline, a pause
//! for approvals, and every call answered even when the run is cancelled
//! while they run.

use std::collections::HashSet;

use crate::respond::pipeline::{
    CallLog, CallTraces, LeafView, PipelineOutcome, ToolCall, run_tool_calls_logged,
};
use markov_core::ids::ToolCallId;
use markov_core::message::{Item, Message, Source};
use markov_core::tool::ToolExecutionResult;

use super::prepare::{ancestor_views, pack_states};
use super::record::{Metered, ToolStep};
use super::{CANCELLED_TOOL_CALL, StandardExecutor, with_source};
use crate::effect::Entry;
use crate::executor::{LeafContext, LeafOutcome};
use crate::queue::Queue;
use crate::step::YieldReason;

/// What the tools did, to settle.
pub(super) struct Ran {
    /// Entries so far (the assistant message first).
    pub(super) entries: Vec<Entry>,
    /// The pipeline's outcome, the refused calls' results after its own.
    pub(super) outcome: PipelineOutcome,
    /// What the step used.
    pub(super) metered: Metered,
}

/// What [`StandardExecutor::run_tools`] ended with.
// Made once per leaf per step and matched at once: boxing would add an
// allocation per step.
#[allow(clippy::large_enum_variant)]
pub(super) enum ToolsRan {
    /// Calls wait for the application's approval: the step pauses with
    /// nothing recorded.
    Paused(LeafOutcome),
    /// Every call has its result.
    Done(Ran),
}

impl StandardExecutor {
    /// Runs the answer's calls through the tool pipeline (the registry's
    /// policy stack, or the plain path keeping the conversation's ledger
    /// when the answer was recorded).
    /// Dropped while they run — the run cancelled — the calls are queued
    /// with the results they had ([`ToolsInFlight`]). When calls wait for
    /// approval, nothing of the step is recorded: the counters the step
    /// charged are put back, the answer waits, paused, and the outcome
    /// carries the usage the call already spent. Each call's trace goes to
    /// `traces`, when there is one.
    pub(super) async fn run_tools(
        &self,
        cx: &LeafContext<'_>,
        step: ToolStep,
        span: &tracing::Span,
        traces: Option<&CallTraces>,
    ) -> ToolsRan {
        let ToolStep {
            entries,
            refused,
            mut metered,
            vessel_id,
            resumed,
            unrecorded,
        } = step;
        // What the calls spend themselves (a sub-agent's model calls)
        // counts as the step's.
        let spent = markov_core::tool::UsageSink::new();
        let calls = Calls::of(&entries, &refused);
        let ancestors = ancestor_views(cx);
        let packs = pack_states(cx);
        // The turn's budget counters only matter to a registry's stages.
        let turn = self
            .registry
            .as_ref()
            .map(|_| cx.policy.budgets().for_leaf(cx.instance().id()));
        let view = LeafView {
            charter: cx.charter,
            node: cx.instance().node(),
            instance_id: cx.instance().id(),
            root_id: cx.root().id(),
            state: cx.instance().state(),
            ancestors: &ancestors,
            pack_states: &packs,
            is_worker: cx.is_worker(),
            history: cx.history,
            terminate_message: cx.terminate_message,
            policies: self
                .registry
                .as_deref()
                .zip(turn.as_ref())
                .map(|(binding, turn)| binding.session(turn, cx.policy)),
            // Without a registry, the plain path still keeps this
            // conversation's ledger, so a resumed step never runs a
            // completed call again (unless nothing can resume it).
            conversation: Some(cx.policy),
            repeats: Some(cx.policy.repeats()),
            unrecorded,
            loop_guard: cx
                .instance()
                .node()
                .loop_guard()
                .unwrap_or_else(|| cx.charter.loop_guard()),
            capture_content: self.capture_content,
            usage: Some(&spent),
            traces,
        };
        // Taken before any call counts: a step that pauses puts the counters
        // back, since resuming replays its calls.
        let mark = cx.policy.mark_leaf(cx.instance().id());
        let log = CallLog::new();
        let in_flight = ToolsInFlight {
            queue: cx.queue,
            calls: &calls,
            log: &log,
            recorded: Some((&entries, &refused)),
            source: cx.source(),
            resumed: resumed.then(|| (cx.policy, cx.instance().id())),
        };
        let mut outcome = run_tool_calls_logged(&view, &calls, &log).await;
        in_flight.disarm();
        metered.add(spent.take());
        drop(calls);
        if !outcome.awaiting.is_empty() {
            // Nothing of the step is recorded: the answer waits, paused,
            // with the calls that ran in the ledger, until the application
            // has decided and the step is resumed.
            tracing::info!(
                parent: span,
                waiting = outcome.awaiting.len(),
                "calls wait for the application's approval: the step pauses"
            );
            cx.policy.rewind_leaf(mark);
            cx.policy.answers().set_paused(cx.instance().id(), true);
            if let Some(id) = &vessel_id {
                cx.queue.remove_message(id);
            }
            let paused = LeafOutcome::new(Vec::new(), YieldReason::AwaitingApproval, cx.turn);
            return ToolsRan::Paused(metered.onto(paused));
        }
        cx.policy.answers().set_paused(cx.instance().id(), false);
        for _ in &refused {
            outcome.result_states_known.push(true);
        }
        outcome.results.extend(refused);
        ToolsRan::Done(Ran {
            entries,
            outcome,
            metered,
        })
    }
}

/// A response whose tools are running. Dropped armed — the run was
/// cancelled (dropped, an outer timeout) while a tool ran — it enqueues the
/// assistant message with one result per call: the result of each call that
/// completed, [`CANCELLED_TOOL_CALL`] for the others. The next run records
/// them, so a call that ran is never missing from the history.
pub(super) struct ToolsInFlight<'a> {
    queue: &'a Queue,
    calls: &'a [ToolCall<'a>],
    log: &'a CallLog,
    /// The entries so far and the refused calls' results, until disarmed.
    recorded: Option<(&'a [Entry], &'a [ToolExecutionResult])>,
    source: Source,
    /// Set when the response is a paused answer being resumed: its record
    /// goes once the cancelled step's entries are queued, since they
    /// record the answer (replaying it again would record it twice).
    resumed: Option<(&'a markov_policy::PolicyState, &'a markov_core::InstanceId)>,
}

impl ToolsInFlight<'_> {
    fn disarm(mut self) {
        self.recorded = None;
    }
}

impl Drop for ToolsInFlight<'_> {
    fn drop(&mut self) {
        let Some((entries, refused)) = self.recorded.take() else {
            return;
        };
        // Copied only here, on cancellation: the step itself never copies
        // its messages.
        let mut entries = entries.to_vec();
        let results: Vec<Item> = self
            .calls
            .iter()
            .map(|call| {
                self.log
                    .result_of(call.id)
                    .unwrap_or_else(|| {
                        ToolExecutionResult::error(call.id.clone(), CANCELLED_TOOL_CALL)
                    })
                    .to_item(true)
            })
            .chain(refused.iter().map(|r| r.to_item(true)))
            .collect();
        tracing::warn!(
            calls = self.calls.len(),
            "run cancelled while tools ran: the calls are recorded with the results they had"
        );
        entries.push(Entry::message(with_source(
            Message::user_items(results),
            &self.source,
        )));
        self.queue.enqueue_entries(entries);
        if let Some((policy, instance)) = self.resumed {
            policy.abandon_paused(instance);
        }
    }
}

/// The calls to run of a response [`interpret`] returned as
/// [`AfterModel::RunTools`]: the assistant message's `tool_use` items
/// (the first entry), but those answered without running (`refused`),
/// borrowed from the message.
pub(super) fn tool_calls<'a>(
    entries: &'a [Entry],
    refused: &[ToolExecutionResult],
) -> Vec<ToolCall<'a>> {
    calls_iter(entries, refused).collect()
}

pub(super) fn calls_iter<'a>(
    entries: &'a [Entry],
    refused: &[ToolExecutionResult],
) -> impl Iterator<Item = ToolCall<'a>> {
    // A set, not a scan per call: a response can repeat one id thousands
    // of times, and every repeat is refused.
    let refused: HashSet<ToolCallId> = refused.iter().map(|r| r.call_id.clone()).collect();
    entries
        .first()
        .into_iter()
        .flat_map(|first| ToolCall::all_in(&first.message))
        .filter(move |c| !refused.contains(c.id))
}

/// A response's calls: most responses make one, which needs no list.
pub(super) enum Calls<'a> {
    One([ToolCall<'a>; 1]),
    Many(Vec<ToolCall<'a>>),
}

impl<'a> Calls<'a> {
    fn of(entries: &'a [Entry], refused: &[ToolExecutionResult]) -> Self {
        let mut calls = calls_iter(entries, refused);
        match (calls.next(), calls.next()) {
            (Some(only), None) => Calls::One([only]),
            (first, second) => Calls::Many(first.into_iter().chain(second).chain(calls).collect()),
        }
    }
}

impl<'a> std::ops::Deref for Calls<'a> {
    type Target = [ToolCall<'a>];

    fn deref(&self) -> &Self::Target {
        match self {
            Calls::One(one) => one,
            Calls::Many(many) => many,
        }
    }
}

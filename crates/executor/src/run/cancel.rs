//! A run its caller stopped: what the step in flight left queued is
//! recorded or kept, so the turn ends valid.

use markov_core::Role;
use markov_core::message::{Item, Message};

use super::apply::announce;
use super::{RunState, make_step};
use crate::machine::Machine;
use crate::step::{MachineStep, YieldReason};

impl RunState {
    /// Ends the run because its caller stopped it (a cancel, a deadline),
    /// after dropping the step in flight: the model call it was waiting
    /// for, or the tools it was running.
    ///
    /// A step cancelled while its tools ran left its answer queued with one
    /// result per call (the result of each call that finished,
    /// [`CANCELLED_TOOL_CALL`](crate::CANCELLED_TOOL_CALL) for the others):
    /// that answer and its results are recorded here, in the history, so
    /// the turn ends valid and the next run never replays the answer (its
    /// calls are not run again). A partly streamed answer whose calls never
    /// started is dropped: nothing was done for it. Input queued meanwhile
    /// stays queued for the next run. The returned step (yield reason
    /// [`YieldReason::Cancelled`], done) holds what the run recorded since
    /// its last step.
    pub fn cancel(&mut self, machine: &mut Machine) -> MachineStep {
        // Input that was waiting for its check stays queued for the next run.
        self.requeue_pending_input(machine);
        self.input.clear();
        self.input_instructions.clear();
        let entries = machine.queue.drain_all();
        let answered: std::collections::HashSet<&markov_core::ToolCallId> = entries
            .iter()
            .filter(|e| e.message.role == Role::User)
            .flat_map(|e| e.message.item_list())
            .filter_map(|item| match item {
                Item::ToolResult { tool_use_id, .. } => Some(tool_use_id),
                _ => None,
            })
            .collect();
        let is_results = |m: &Message| {
            m.role == Role::User
                && !m.item_list().is_empty()
                && m.item_list()
                    .iter()
                    .all(|item| matches!(item, Item::ToolResult { .. }))
        };
        let mut recorded = Vec::new();
        let mut kept = Vec::new();
        for entry in &entries {
            let message = &entry.message;
            if entry.effect.is_some() {
                kept.push(entry.clone());
            } else if message.role == Role::Assistant {
                // A streamed answer cut off before its calls started has a
                // call without a result: it is dropped, as nothing ran.
                let complete = message.tool_uses().all(|(id, _, _)| answered.contains(id));
                if complete && !message.item_list().is_empty() {
                    recorded.push(message.clone());
                }
            } else if is_results(message) {
                recorded.push(message.clone());
            } else {
                kept.push(entry.clone());
            }
        }
        drop(entries);
        machine.queue.requeue_front(kept);
        machine.history.extend(recorded.iter().cloned());
        // The cancelled answer is in the history now: it is never replayed.
        machine.policy.settle_step();
        let mut history = std::mem::take(&mut self.pending);
        history.extend(recorded);
        self.finished = true;
        let mut step = make_step(machine, history, YieldReason::Cancelled, true);
        step.run_usage = self.usage;
        announce(machine, &step, self.steps);
        step
    }
}

//! A step's leaves have run: their outcomes recorded in task order, their
//! entries drained into the history, their effects applied, and the step
//! to yield built with the reason it stops for.

use markov_charter::transition::CedeContent;
use markov_core::message::{Message, Metadata, Source};
use markov_core::model::Usage;

use super::apply::{announce, apply, cedes_of, resolve_effect};
use super::{LeafTask, RECOVERY_TEXT, RunState, make_step};
use crate::effect::cede_json;
use crate::error::RunError;
use crate::executor::LeafOutcome;
use crate::machine::Machine;
use crate::step::{MachineStep, YieldReason};

impl RunState {
    /// Records the leaves' results (in task order), applies their effects and
    /// returns the step to yield.
    pub fn on_leaf_results(
        &mut self,
        machine: &mut Machine,
        tasks: &[LeafTask],
        results: Vec<Result<LeafOutcome, RunError>>,
    ) -> Result<MachineStep, RunError> {
        let mut step = self.record_step(machine, tasks, results)?;
        // The answers this step replayed or recorded are in the history now;
        // the paused ones wait for their resume.
        machine.policy.settle_step();
        self.usage += step.usage;
        machine.usage.add(step.usage);
        step.run_usage = self.usage;
        step.totals = machine.usage;
        self.finished = step.done;
        announce(machine, &step, self.steps);
        Ok(step)
    }

    fn record_step(
        &mut self,
        machine: &mut Machine,
        tasks: &[LeafTask],
        results: Vec<Result<LeafOutcome, RunError>>,
    ) -> Result<MachineStep, RunError> {
        let mut failure = None;
        // Collected in place: the results' buffer holds the outcomes.
        let outcomes: Vec<LeafOutcome> = results
            .into_iter()
            .filter_map(|r| match r {
                Ok(o) => Some(o),
                Err(e) => {
                    failure = failure.take().or(Some(e));
                    None
                }
            })
            .collect();
        if let Some(e) = failure {
            // What succeeded stays queued for the next run rather than being lost.
            for o in outcomes {
                machine.queue.enqueue_entries(o.entries);
            }
            return Err(e);
        }
        if outcomes.len() != tasks.len() {
            return Err(RunError::Executor(format!(
                "{} results for {} leaves",
                outcomes.len(),
                tasks.len()
            )));
        }

        let mut primary: Option<(YieldReason, Option<String>, Option<_>)> = None;
        let mut primary_id = None;
        // Whether the primary leaf's node declares an output type.
        let mut primary_typed = false;
        let mut paused = false;
        let mut busy_workers = Vec::new();
        let mut intents = Vec::new();
        let mut usage = Usage::default();
        // The model of the primary leaf's answer; of the first worker's
        // that names one on a step without a primary leaf.
        let mut primary_model = None;
        let mut worker_model = None;
        // The first limit a leaf's call could have passed: the run ends
        // with this step.
        let mut limited = None;
        let mut calls = Vec::new();
        for (task, mut outcome) in tasks.iter().zip(outcomes) {
            usage += outcome.usage;
            if let Some(call) = outcome.call.take() {
                calls.push(*call);
            }
            limited = limited.or(outcome.usage_limit.take());
            let leaf = &task.leaf;
            let mut turn = outcome.turn;
            turn.recovering = false;
            self.turns.insert(leaf.leaf().id().clone(), turn);
            intents.append(&mut outcome.intents);
            paused |= outcome.yield_reason == YieldReason::AwaitingApproval;
            if leaf.is_worker() {
                match outcome.yield_reason {
                    YieldReason::EndTurn => tracing::warn!(
                        instance = %leaf.leaf().id(),
                        "worker returned end_turn without ceding"
                    ),
                    YieldReason::ToolUse => busy_workers.push(leaf.leaf().id().clone()),
                    _ => {}
                }
            } else if primary.is_none() {
                primary = Some((outcome.yield_reason, outcome.response, outcome.termination));
                primary_id = Some(leaf.leaf().id().clone());
                primary_typed = leaf.leaf().node().output().is_some();
                primary_model = outcome.model.take();
            }
            if worker_model.is_none() && leaf.is_worker() {
                worker_model = outcome.model.take();
            }
            machine.queue.enqueue_entries(outcome.entries);
        }
        let model = if primary.is_some() {
            primary_model
        } else {
            worker_model
        };
        let (step_history, effects) = machine
            .queue
            .drain_messages(|e| resolve_effect(machine, e))
            .map_err(|refused| {
                let (error, entry) = *refused;
                RunError::RefusedInstanceMessage {
                    reason: error.to_string(),
                    message: Box::new(entry.message),
                }
            })?;
        machine.history.extend(step_history.iter().cloned());
        apply(machine, &effects, self.steps);
        let applied = cedes_of(&effects);
        let mut history = std::mem::take(&mut self.pending);
        if history.is_empty() {
            history = step_history;
        } else {
            history.extend(step_history);
        }

        let (reason, response, termination) = primary.unwrap_or((YieldReason::EndTurn, None, None));
        if reason == YieldReason::EndTurn {
            for id in &busy_workers {
                tracing::warn!(
                    instance = %id,
                    "worker returned tool_use but the turn ends: its work is abandoned until the next run"
                );
            }
        }
        if let Some((id, content)) = applied.cedes.first() {
            // The handed-back content is recorded in the step it happened in,
            // as well as in the machine's history (upstream shows it only in
            // the latter).
            let handed_back: Vec<Message> = match content {
                Some(CedeContent::Text(s)) => {
                    vec![
                        Message::user(s.clone()).with_metadata(Metadata::with_source(Source {
                            instance_id: Some(id.clone()),
                            ..Source::default()
                        })),
                    ]
                }
                Some(CedeContent::Messages(list)) => list.clone(),
                None => Vec::new(),
            };
            machine.history.extend(handed_back.iter().cloned());
            history.extend(handed_back);
            if tasks.len() == 1 {
                let mut step = make_step(machine, history, YieldReason::Cede, false);
                step.cede_content = cede_json(content);
                step.intents = intents;
                step.usage = usage;
                step.model = model;
                step.calls = std::mem::take(&mut calls);
                return Ok(step);
            }
        }
        if paused {
            // The run waits for the application: whatever the other leaves
            // did is recorded, the paused answers are not.
            let mut step = make_step(machine, history, YieldReason::AwaitingApproval, true);
            step.approvals = machine
                .policy
                .approvals()
                .held_pending_at(std::time::SystemTime::now());
            step.intents = intents;
            step.usage = usage;
            step.model = model;
            step.calls = std::mem::take(&mut calls);
            return Ok(step);
        }
        if let Some(limit) = limited {
            // What the other leaves did is recorded; the call that could
            // have passed the limit was never made.
            tracing::info!(%limit, "a usage limit ends the run before its next model call");
            let mut step = make_step(machine, history, YieldReason::UsageLimit, true);
            step.usage_limit = Some(limit);
            step.intents = intents;
            step.usage = usage;
            step.model = model;
            step.calls = std::mem::take(&mut calls);
            return Ok(step);
        }
        if reason == YieldReason::MaxTokens {
            // A cut typed answer gets no recovery call: asked to answer
            // now, under its output schema, the model could only shape a
            // guess like an answer. The run ends with the cut answer, and
            // a typed run says it was cut.
            if primary_typed && !self.recovered {
                tracing::info!(
                    "a typed answer was cut by the token limit: the run ends without a recovery call"
                );
                self.recovered = true;
            }
            let mut history = history;
            let recovering = !self.recovered;
            if recovering {
                self.recovered = true;
                // markov's own words, never the user's: a system message,
                // which providers send as their vendor accepts and a page
                // shows as markov's note. The step carries it, so that
                // what shows the steps shows it.
                let reminder = Message::system(RECOVERY_TEXT);
                machine.history.push(reminder.clone());
                history.push(reminder);
                if let Some(turn) = primary_id.and_then(|id| self.turns.get_mut(&id)) {
                    turn.recovering = true;
                }
            }
            let mut step = make_step(machine, history, YieldReason::MaxTokens, !recovering);
            step.intents = intents;
            step.usage = usage;
            step.model = model;
            step.calls = std::mem::take(&mut calls);
            return Ok(step);
        }
        let done = matches!(
            reason,
            YieldReason::EndTurn
                | YieldReason::External
                | YieldReason::LoopDetected
                | YieldReason::ContextExhausted
                | YieldReason::Blocked
        ) || termination.is_some();
        let mut step = make_step(machine, history, reason, done);
        step.response = response;
        step.termination = termination;
        step.intents = intents;
        step.usage = usage;
        step.model = model;
        step.calls = std::mem::take(&mut calls);
        Ok(step)
    }
}

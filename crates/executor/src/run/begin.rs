//! A step begins: the active leaves it runs, each with its turn, or the
//! step that says the run waits for a resume.

use super::{Action, LeafTask, LeafTasks, RunState, make_step};
use crate::error::RunError;
use crate::machine::Machine;
use crate::step::{SuspendedInstance, YieldReason};

impl RunState {
    /// The leaves this step runs (the paused ones alone when the run
    /// resumes), or the step that ends a run with no active leaf.
    pub(super) fn begin_step(&mut self, machine: &Machine) -> Result<Action, RunError> {
        if self.steps >= self.options.max_steps {
            return Err(RunError::MaxSteps(self.options.max_steps));
        }
        let resuming = std::mem::take(&mut self.resuming);
        let paused = if resuming {
            let paused = machine.paused_leaves();
            if paused.is_empty() {
                return Err(RunError::NotAwaitingApproval);
            }
            Some(paused)
        } else {
            None
        };
        self.steps += 1;
        let mut tasks = LeafTasks::new();
        let (turns, current_step) = (&self.turns, self.steps);
        machine.root.for_each_active_leaf(&mut |leaf| {
            if let Some(paused) = &paused
                && !paused.contains(leaf.leaf().id())
            {
                return;
            }
            // A resumed leaf has run a tool this turn: the model call after
            // it is not forced again.
            let mut turn = turns.get(leaf.leaf().id()).copied().unwrap_or_default();
            if paused.is_some() {
                turn.tool_ran = true;
            }
            tasks.push(LeafTask {
                turn,
                leaf,
                current_step,
            });
        });
        if tasks.is_empty() {
            let suspended = machine.root.suspended_instances();
            if suspended.is_empty() {
                return Err(RunError::NoActiveInstances);
            }
            let mut step = make_step(machine, Vec::new(), YieldReason::AwaitingResume, true);
            step.suspended_instances = suspended
                .iter()
                .filter_map(|i| {
                    i.suspended().map(|s| SuspendedInstance {
                        instance_id: i.id().clone(),
                        suspend_id: s.suspend_id.clone(),
                        reason: s.reason.clone(),
                        metadata: s.metadata.clone(),
                    })
                })
                .collect();
            return Ok(Action::Yield(step));
        }
        let primaries = tasks.iter().filter(|t| !t.leaf.is_worker()).count();
        if primaries > 1 {
            return Err(RunError::TooManyPrimaryLeaves(primaries));
        }
        Ok(Action::RunLeaves(tasks))
    }
}

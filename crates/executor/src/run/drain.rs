//! The run's first phase: the queue drained into the history before the
//! first step, the input guards' check it waits for, and a resume request
//! that ends the run there.

use markov_core::message::Message;
use markov_core::model::Usage;
use markov_core::{InstanceId, Role};

use super::apply::{apply, collapse_ephemerals, resolve_effects, resume_request};
use super::input::{self, InputCheck};
use super::{RunState, make_step};
use crate::effect::Entry;
use crate::error::RunError;
use crate::instance::Instance;
use crate::machine::Machine;
use crate::step::{MachineStep, YieldReason};

impl RunState {
    /// The check the drained `entries` need before they enter the history:
    /// `None` when the executor has no input guard for the primary leaf,
    /// or every user text of `entries` has its verdict.
    fn input_check(&mut self, machine: &Machine, entries: &[Entry]) -> Option<InputCheck> {
        if !entries.iter().any(|e| e.message.role == Role::User) {
            return None;
        }
        // The message goes to the primary leaf: the active instance.
        let guards = machine.executor.input_guard(machine.root.active().node())?;
        if guards.is_empty() {
            return None;
        }
        let mut texts = input::guarded_texts(entries);
        // The verdicts cover the batch's first texts, by position; new
        // input queued meanwhile comes after them.
        let covered = match self.verdicts.as_ref().map(|v| v.covers(&texts)) {
            None => 0,
            Some(Some(covered)) => covered,
            Some(None) => {
                tracing::warn!(
                    "the queued input changed while the input guards checked it: checking it all again"
                );
                self.verdicts = None;
                0
            }
        };
        let texts = texts.split_off(covered);
        (!texts.is_empty()).then(|| input::check(guards, texts))
    }

    /// Drains, records, applies. Returns a step when the run ends
    /// here, or the check the input guards must make first.
    pub(super) fn initial_drain(&mut self, machine: &mut Machine) -> Result<Drained, RunError> {
        let mut entries = machine.queue.drain_all();
        if let Some((at, id, suspend_id)) = resume_request(&entries) {
            // The resume step is not done, yet it ends the run.
            return match resume(machine, &id, &suspend_id) {
                Ok(step) => {
                    self.finished = true;
                    Ok(Drained::Step(step))
                }
                Err(e) => {
                    // The invalid resume is dropped; the rest waits, in order.
                    entries.remove(at);
                    machine.queue.requeue_front(entries);
                    Err(e)
                }
            };
        }
        let user_turn = entries
            .iter()
            .any(|e| e.message.role == Role::User && !e.message.is_silent());
        // markov's own instruction runs the model too, within the turn.
        let triggers = user_turn || entries.iter().any(Entry::is_instruction);
        if triggers && !machine.paused_leaves().is_empty() {
            // The paused step's answer comes first in the history: the
            // input waits, queued, until the step is resumed.
            machine.queue.requeue_front(entries);
            return Err(RunError::AwaitingApproval {
                pending: machine
                    .policy
                    .approvals()
                    .held_pending_at(std::time::SystemTime::now())
                    .len(),
            });
        }
        if let Some(check) = self.input_check(machine, &entries) {
            // The input guards decide before anything is drained: the
            // batch waits, in order, for their verdicts, queued and as the
            // run's pending input.
            self.input = entries.iter().map(|e| e.message.clone()).collect();
            self.input_instructions = entries
                .iter()
                .enumerate()
                .filter_map(|(at, e)| e.is_instruction().then_some(at))
                .collect();
            self.input_queued = true;
            machine.queue.requeue_front(entries);
            return Ok(Drained::Check(check));
        }
        if user_turn {
            // A user turn starts: per-turn budgets start over (and only here,
            // so transitions inside the turn never refill them), and so
            // does the turn's usage.
            machine.policy.begin_user_turn();
            machine.usage.turn = Usage::default();
        }
        // Resolved on the raw batch, so what is requeued on an error is the
        // batch as it was (ephemerals not yet collapsed).
        let effects = resolve_effects(machine, &mut entries)?;
        // Applied once the batch is sure to be drained: what an error
        // requeues is the batch as it was.
        // (Each rewrite and block was traced and audited by the check.)
        let blocked = match self.verdicts.take() {
            Some(verdicts) => !input::apply_verdicts(&mut entries, &verdicts)
                .blocked
                .is_empty(),
            None => false,
        };
        let messages: Vec<Message> = collapse_ephemerals(entries)
            .into_iter()
            .map(|e| e.message)
            .collect();
        machine.history.extend(messages.iter().cloned());
        // The pending input is in the history now, as the guards let it.
        self.input.clear();
        self.input_instructions.clear();
        apply(machine, &effects, 0);
        if blocked || !triggers {
            // A blocked message ends the run before any model call.
            self.finished = true;
            let reason = if blocked {
                YieldReason::Blocked
            } else {
                YieldReason::EndTurn
            };
            return Ok(Drained::Step(make_step(machine, messages, reason, true)));
        }
        self.pending = messages;
        Ok(Drained::Run)
    }
}

/// What the initial drain did.
// Returned once per run and matched at once.
#[allow(clippy::large_enum_variant)]
pub(super) enum Drained {
    /// The input guards must check the queued messages first.
    Check(InputCheck),
    /// The run ends with this step.
    Step(MachineStep),
    /// The run goes on with its first step.
    Run,
}

fn resume(
    machine: &mut Machine,
    id: &InstanceId,
    suspend_id: &str,
) -> Result<MachineStep, RunError> {
    let instance = machine
        .root
        .find(id)
        .ok_or_else(|| RunError::InstanceNotFound(id.clone()))?;
    let stored = instance
        .suspended()
        .ok_or_else(|| RunError::NotSuspended(id.clone()))?;
    if stored.suspend_id != suspend_id {
        return Err(RunError::SuspendIdMismatch {
            expected: stored.suspend_id.clone(),
            got: suspend_id.to_owned(),
        });
    }
    Instance::update(&mut machine.root, id, &mut |i| i.suspended = None);
    // markov's note, not the user's words: a system message.
    let notice = Message::system(format!("[Resumed instance {id}]"));
    machine.history.push(notice.clone());
    Ok(make_step(
        machine,
        vec![notice],
        YieldReason::Command,
        false,
    ))
}

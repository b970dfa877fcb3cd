//! The run loop: drain the queue, run every active leaf, apply what they
//! report, yield one [`MachineStep`] per step, until a step is done.
//!
//! ```text
//! initial drain → (leaves run concurrently → drain → apply → yield)* → done
//! ```
//!
//! Executors report messages and effects; only the apply phase, after every
//! leaf of a step has finished, changes the tree, copy-on-write.

use std::collections::HashMap;
use std::sync::Arc;

use markov_core::InstanceId;
use markov_core::message::Message;
use markov_core::model::Usage;
use serde::{Deserialize, Serialize};

mod apply;
mod begin;
mod cancel;
mod drain;
mod drive;
mod input;
mod options;
mod record;

use apply::announce;
use drain::Drained;
pub(crate) use drive::{resume_to_completion, steps};
pub use drive::{run_leaves, run_machine, run_to_completion};
pub use input::{InputCheck, InputChecked};
pub use options::{DEFAULT_MAX_STEPS, RECOVERY_TEXT, RunOptions};

use crate::effect::Entry;
use crate::error::RunError;
use crate::instance::ActiveLeaf;
use crate::machine::Machine;
use crate::step::{MachineStep, TurnState, YieldReason};

/// What the run needs done next.
#[derive(Debug)]
#[non_exhaustive]
// A step is yielded once per step and moved straight out: boxing it would
// add an allocation per step to save a few bytes of a short-lived value.
#[allow(clippy::large_enum_variant)]
pub enum Action {
    /// Check the queued user messages with the input guards before they
    /// enter the history: await [`InputCheck::run`], hand its verdicts to
    /// [`RunState::on_input_checked`], then call [`RunState::next`] again.
    /// Asked only of a machine whose executor has input guards.
    CheckInput(InputCheck),
    /// Run one inference for each of these leaves (concurrently), then hand
    /// the results, in the same order, to [`RunState::on_leaf_results`].
    RunLeaves(LeafTasks),
    /// Yield this step, then call [`RunState::next`] again: it says
    /// [`Action::Finished`] when the run is over.
    Yield(MachineStep),
    /// The run is over: its last step was done, or a resume ended it (the
    /// resume step is not done, yet the run stops there). Nothing
    /// more happens; a new run needs a new [`RunState`].
    Finished,
}

/// The leaves a step runs, in order (a slice through `Deref`). A step of a
/// one-leaf tree, the common case, needs no list.
#[derive(Debug, Clone)]
pub struct LeafTasks(Tasks);

#[derive(Debug, Clone)]
enum Tasks {
    One([LeafTask; 1]),
    Many(Vec<LeafTask>),
}

impl LeafTasks {
    fn new() -> Self {
        LeafTasks(Tasks::Many(Vec::new()))
    }

    fn push(&mut self, task: LeafTask) {
        self.0 = match std::mem::replace(&mut self.0, Tasks::Many(Vec::new())) {
            Tasks::Many(tasks) if tasks.is_empty() => Tasks::One([task]),
            Tasks::One([first]) => Tasks::Many(vec![first, task]),
            Tasks::Many(mut tasks) => {
                tasks.push(task);
                Tasks::Many(tasks)
            }
        };
    }
}

impl std::ops::Deref for LeafTasks {
    type Target = [LeafTask];

    fn deref(&self) -> &[LeafTask] {
        match &self.0 {
            Tasks::One(one) => one,
            Tasks::Many(many) => many,
        }
    }
}

/// One leaf to run in this step, with what its executor must know.
#[derive(Debug, Clone)]
pub struct LeafTask {
    /// The leaf and its path.
    pub leaf: ActiveLeaf,
    /// Its turn bookkeeping.
    pub turn: TurnState,
    /// The 1-based step number.
    pub current_step: usize,
}

/// The run loop as a plain value: it never awaits and never does I/O.
///
/// [`RunState::next`] says what must happen next; a driver performs it
/// ([`run_machine`] is that driver, a few lines long) and feeds the leaves'
/// results back through [`RunState::on_leaf_results`]. The state is
/// serializable, so a run can be paused between steps and resumed elsewhere.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    options: RunOptions,
    started: bool,
    steps: usize,
    pending: Vec<Message>,
    recovered: bool,
    /// Looked up twice a step: hashed with a fast seeded hasher.
    turns: HashMap<InstanceId, TurnState, foldhash::fast::RandomState>,
    /// Set once the run has yielded its last step.
    #[serde(default)]
    finished: bool,
    /// Tokens used by the run's model calls so far.
    #[serde(default)]
    usage: Usage,
    /// The run resumes a step that waited for approval: its first step runs
    /// the paused leaves only, replaying their answers.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    resuming: bool,
    /// The input guards' verdicts on the user texts about to be drained:
    /// only between a [`Action::CheckInput`] and the drain (never written:
    /// a run restored before its drain checks again).
    #[serde(skip)]
    verdicts: Option<InputChecked>,
    /// Pending input: the batch waiting for the input guards' verdicts —
    /// the user's messages and whatever was queued with them (a command's
    /// record, the records of queued effects, markov's instructions) —
    /// outside the history (never shown or read as history). A durable
    /// driver writes it with the run, so a worker that dies while the
    /// guards check loses nothing: a continuing worker puts the batch back
    /// in the queue, and the guards check it again. Emptied by the drain
    /// that enters it into the history, which applies its effects.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    input: Vec<Message>,
    /// The places in `input` of markov's instructions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    input_instructions: Vec<usize>,
    /// The pending input is in the machine's queue (not after the run was
    /// restored elsewhere: the first call then queues it again).
    #[serde(skip)]
    input_queued: bool,
}

fn make_step(
    machine: &Machine,
    history: Vec<Message>,
    reason: YieldReason,
    done: bool,
) -> MachineStep {
    MachineStep {
        instance: Arc::clone(&machine.root),
        history,
        yield_reason: reason,
        done,
        cede_content: None,
        suspended_instances: Vec::new(),
        approvals: Vec::new(),
        response: None,
        termination: None,
        intents: Vec::new(),
        usage: Usage::default(),
        run_usage: Usage::default(),
        totals: machine.usage,
        usage_limit: None,
        model: None,
        interrupted: machine.policy.take_interrupted(),
        calls: Vec::new(),
    }
}

impl RunState {
    /// A run that has not started.
    pub fn new(options: RunOptions) -> Self {
        RunState {
            options,
            started: false,
            steps: 0,
            pending: Vec::new(),
            recovered: false,
            turns: HashMap::default(),
            finished: false,
            usage: Usage::default(),
            resuming: false,
            verdicts: None,
            input: Vec::new(),
            input_instructions: Vec::new(),
            input_queued: false,
        }
    }

    /// A run that resumes the machine's step that waits for approval: its
    /// first step replays the paused answers (no model call) once the
    /// application has decided their calls — the approved ones run, once,
    /// the others get the denial, the application's result or an expiry —
    /// and records every call's result; the steps after it call the model
    /// as any run does. Nothing is drained first: a driver holds queued
    /// input back meanwhile ([`Machine::resume`] does), so that it starts a
    /// turn of its own after the paused one is over.
    pub fn resume(options: RunOptions) -> Self {
        RunState {
            started: true,
            resuming: true,
            ..RunState::new(options)
        }
    }

    /// A run that has begun and goes on from its leaves' turns as `turns`
    /// gives them (what each leaf's tool-choice rules have seen so far):
    /// its next step calls the model at once, draining nothing first. A
    /// fork at a step inside a run starts so.
    pub fn continuing(
        options: RunOptions,
        turns: impl IntoIterator<Item = (InstanceId, TurnState)>,
    ) -> Self {
        RunState {
            started: true,
            turns: turns.into_iter().collect(),
            ..RunState::new(options)
        }
    }

    /// The run's options.
    pub fn options(&self) -> &RunOptions {
        &self.options
    }

    /// Steps taken so far.
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// The batch waiting for the input guards' verdicts (see
    /// [`Action::CheckInput`]): the user's messages and the records of what
    /// was queued with them (commands, effects, markov's instructions);
    /// empty unless the run stopped before its drain. They are not in the
    /// history; a driver that stores the run stores them with it, and a
    /// restored run checks them again and applies the effects once, in
    /// the drain.
    pub fn pending_input(&self) -> &[Message] {
        &self.input
    }

    /// Queues the pending input of a run restored elsewhere again, at the
    /// front, once: the guards check it as if it had just arrived.
    fn requeue_pending_input(&mut self, machine: &Machine) {
        if self.input_queued || self.input.is_empty() {
            return;
        }
        tracing::info!(
            messages = self.input.len(),
            "the run stopped while the input guards checked its input: checking it again"
        );
        let entries = self.input.iter().enumerate().map(|(at, message)| {
            Entry::pending(message.clone(), self.input_instructions.contains(&at))
        });
        machine.queue.requeue_front(entries.collect());
        self.input_queued = true;
    }

    /// The tokens the run's model calls have used so far.
    pub fn usage(&self) -> Usage {
        self.usage
    }

    /// Whether the run is over: its last step has been yielded.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// What to do next: the initial drain on the first call, then one step;
    /// [`Action::Finished`] once the run is over.
    pub fn next(&mut self, machine: &mut Machine) -> Result<Action, RunError> {
        if self.finished {
            return Ok(Action::Finished);
        }
        if !self.started {
            self.requeue_pending_input(machine);
            // Marked only once the drain succeeded: after an error, the next
            // call drains again rather than stepping without the input.
            match self.initial_drain(machine)? {
                Drained::Check(check) => return Ok(Action::CheckInput(check)),
                Drained::Step(step) => {
                    self.started = true;
                    announce(machine, &step, 0);
                    return Ok(Action::Yield(step));
                }
                Drained::Run => self.started = true,
            }
        }
        let action = self.begin_step(machine)?;
        if let Action::Yield(step) = &action {
            self.finished = step.done;
            announce(machine, step, self.steps);
        }
        Ok(action)
    }

    /// The input guards' verdicts on the user messages of an
    /// [`Action::CheckInput`]: the next [`RunState::next`] drains them,
    /// rewritten or blocked as the verdicts say.
    pub fn on_input_checked(&mut self, checked: InputChecked) {
        match &mut self.verdicts {
            Some(verdicts) => verdicts.extend(checked),
            None => self.verdicts = Some(checked),
        }
    }
}

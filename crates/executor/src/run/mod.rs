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

use markov_charter::transition::CedeContent;
use markov_core::message::{Item, Message, Metadata, Source};
use markov_core::model::Usage;
use markov_core::{InstanceId, Role};
use serde::{Deserialize, Serialize};

mod apply;
mod drive;
mod input;
mod options;

use apply::{
    announce, apply, cedes_of, collapse_ephemerals, resolve_effect, resolve_effects, resume_request,
};
pub(crate) use drive::{resume_to_completion, steps};
pub use drive::{run_leaves, run_machine, run_to_completion};
pub use input::{InputCheck, InputChecked};
pub use options::{DEFAULT_MAX_STEPS, RECOVERY_TEXT, RunOptions};

use crate::effect::{Entry, cede_json};
use crate::error::RunError;
use crate::executor::LeafOutcome;
use crate::instance::{ActiveLeaf, Instance};
use crate::machine::Machine;
use crate::step::{MachineStep, SuspendedInstance, TurnState, YieldReason};

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

    /// Phase A: drain, record, apply. Returns a step when the run ends
    /// here, or the check the input guards must make first.
    fn initial_drain(&mut self, machine: &mut Machine) -> Result<Drained, RunError> {
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

    fn begin_step(&mut self, machine: &Machine) -> Result<Action, RunError> {
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

/// What the initial drain did.
// Returned once per run and matched at once.
#[allow(clippy::large_enum_variant)]
enum Drained {
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

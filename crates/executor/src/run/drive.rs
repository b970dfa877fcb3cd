//! The async driver: the leaves of a step run concurrently, their
//! outcomes handed back to [`RunState`], step after step.

use futures::stream::{self, Stream, StreamExt};
use tracing::Instrument;

use markov_context::UsageMeter;

use super::{Action, LeafTask, RunOptions, RunState};
use crate::error::RunError;
use crate::executor::{LeafContext, LeafOutcome};
use crate::machine::Machine;
use crate::step::MachineStep;

/// Performs one [`Action::RunLeaves`]: every leaf's executor, concurrently;
/// hand the results to [`RunState::on_leaf_results`]. A driver of its own
/// (one that persists each step, say) calls it between the two.
///
/// If the run is dropped before every leaf has finished, the outcomes of the
/// leaves that did finish are not lost: they go to the queue, and the next
/// run records them.
pub async fn run_leaves(
    machine: &Machine,
    state: &RunState,
    tasks: &[LeafTask],
) -> Vec<Result<LeafOutcome, RunError>> {
    fn context<'a>(
        machine: &'a Machine,
        state: &'a RunState,
        task: &'a LeafTask,
        meter: &'a UsageMeter,
    ) -> LeafContext<'a> {
        LeafContext {
            charter: &machine.charter,
            leaf: &task.leaf,
            history: &machine.history,
            history_id: machine.history_id,
            current_step: task.current_step,
            max_steps: state.options.max_steps,
            turn: task.turn,
            terminate_message: &state.options.terminate_message,
            queue: &machine.queue,
            policy: &machine.policy,
            usage: meter,
            views: &machine.views,
            record_calls: machine.record_calls,
        }
    }
    let meter = UsageMeter::new(state.options.usage_limits, state.usage, machine.usage);
    let meter = &meter;
    if let [task] = tasks {
        // One leaf: nothing else finishes while it runs, and its own
        // in-flight calls are the executor's to record if it is cancelled.
        return vec![
            machine
                .executor
                .run_leaf(context(machine, state, task, meter))
                .await,
        ];
    }
    let finished = UnrecordedOutcomes {
        queue: &machine.queue,
        slots: tasks.iter().map(|_| std::sync::Mutex::new(None)).collect(),
        armed: true,
    };
    let futures = tasks.iter().zip(&finished.slots).map(|(task, slot)| async {
        let outcome = machine
            .executor
            .run_leaf(context(machine, state, task, meter))
            .await;
        *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(outcome);
    });
    futures::future::join_all(futures).await;
    finished.disarm()
}

/// The leaves' outcomes while the others still run. Dropped armed (the run
/// was cancelled), it enqueues the entries of the finished ones, so their
/// tool calls and results reach the history with the next run.
struct UnrecordedOutcomes<'a> {
    queue: &'a crate::queue::Queue,
    slots: Vec<std::sync::Mutex<Option<Result<LeafOutcome, RunError>>>>,
    armed: bool,
}

impl UnrecordedOutcomes<'_> {
    fn disarm(mut self) -> Vec<Result<LeafOutcome, RunError>> {
        self.armed = false;
        std::mem::take(&mut self.slots)
            .into_iter()
            .map(|slot| {
                slot.into_inner()
                    .unwrap_or_else(|p| p.into_inner())
                    .unwrap_or_else(|| Err(RunError::Executor("a leaf did not finish".into())))
            })
            .collect()
    }
}

impl Drop for UnrecordedOutcomes<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        for slot in &self.slots {
            if let Some(Ok(outcome)) = slot.lock().unwrap_or_else(|p| p.into_inner()).take() {
                self.queue.enqueue_entries(outcome.entries);
            }
        }
    }
}

/// The driver: performs the state's actions until it yields a step, or
/// `None` when the run is over.
async fn drive(
    machine: &mut Machine,
    state: &mut RunState,
) -> Result<Option<MachineStep>, RunError> {
    // The action is taken apart before anything is awaited, so the
    // future does not keep a step's room (twice: the action and the `?`
    // around it) across an await.
    let tasks = loop {
        let check = match state.next(machine)? {
            Action::Yield(step) => return Ok(Some(step)),
            Action::Finished => return Ok(None),
            Action::RunLeaves(tasks) => break tasks,
            Action::CheckInput(check) => check,
        };
        let checked = check.run().await;
        state.on_input_checked(checked);
    };
    let span = tracing::info_span!("step", step = state.steps, leaves = tasks.len());
    let results = run_leaves(machine, state, &tasks).instrument(span).await;
    let step = state.on_leaf_results(machine, &tasks, results)?;
    if state.is_finished() {
        // The run's totals, once (`gen_ai.usage.*` of invoke_agent).
        let run = tracing::Span::current();
        run.record("gen_ai.usage.input_tokens", step.run_usage.input_tokens);
        run.record("gen_ai.usage.output_tokens", step.run_usage.output_tokens);
    }
    Ok(Some(step))
}

/// Runs the machine, yielding one step per model call round, until a step is
/// done or an error ends the run (the stream then yields that error last).
///
/// Input must be enqueued first ([`Machine::enqueue`]).
pub fn run_machine(
    machine: &mut Machine,
    options: RunOptions,
) -> impl Stream<Item = Result<MachineStep, RunError>> + Send + '_ {
    steps(machine, RunState::new(options))
}

/// The steps of `state`'s run, driven over `machine`.
pub(crate) fn steps(
    machine: &mut Machine,
    state: RunState,
) -> impl Stream<Item = Result<MachineStep, RunError>> + Send + '_ {
    // OpenTelemetry's GenAI conventions for an agent invocation.
    let span = tracing::info_span!(
        "invoke_agent",
        otel.name = %format_args!("invoke_agent {}", machine.charter.name()),
        gen_ai.operation.name = "invoke_agent",
        gen_ai.agent.name = machine.charter.name(),
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        max_steps = state.options.max_steps
    );
    // The state is boxed once per run: each step's future moves a pointer
    // in and out, not the state.
    stream::unfold(Some((machine, Box::new(state))), move |run| {
        let span = span.clone();
        async move {
            let (machine, mut state) = run?;
            let item = drive(machine, &mut state)
                .instrument(span)
                .await
                .transpose()?;
            // A step ends the run when it is done, or when the state says so
            // (a resume step is not done but ends the run); an error ends it too.
            let go_on = item.is_ok() && !state.is_finished();
            Some((item, go_on.then_some((machine, state))))
        }
    })
}

/// The last step of a stream of steps.
async fn last_step(
    steps: impl Stream<Item = Result<MachineStep, RunError>>,
) -> Result<MachineStep, RunError> {
    let mut steps = std::pin::pin!(steps);
    let mut last = None;
    while let Some(step) = steps.next().await {
        last = Some(step?);
    }
    last.ok_or(RunError::NoSteps)
}

/// Runs the machine to the end and returns the last step.
pub async fn run_to_completion(
    machine: &mut Machine,
    options: RunOptions,
) -> Result<MachineStep, RunError> {
    last_step(run_machine(machine, options)).await
}

/// Resumes the machine's step that waits for approval
/// ([`RunState::resume`]) and runs to the end; returns the last step. Input
/// queued meanwhile is held back during the resumed run and left queued
/// for the next one.
pub(crate) async fn resume_to_completion(
    machine: &mut Machine,
    options: RunOptions,
) -> Result<MachineStep, RunError> {
    let _held = machine.queue.hold_back();
    last_step(steps(machine, RunState::resume(options))).await
}

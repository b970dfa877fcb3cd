//! markov sessions as Temporal workflows.
//!
//! [`SessionWorker`] runs an [`Agent`](markov_executor::Agent) on a
//! Temporal task queue as the workflow `MarkovSession`, one workflow per
//! session (the workflow id is the session id). The workflow drives the
//! session's machine; the model call and each tool call are Temporal
//! activities, so that a crash or a redeploy of the worker resumes the turn
//! from the workflow's history without repeating a finished model call or a
//! tool's side effect.
//!
//! The agent's model and tools take part when they are registered with
//! [`Steps`]: [`Steps::model`] wraps the model, [`Steps::tool`] (or
//! [`Steps::shared_tool`]) each tool. Outside a workflow the wrappers call
//! straight through, so the same agent runs in memory or in `markov-store`
//! unchanged; inside one, the wrapper schedules an activity and the worker
//! runs the registered model or tool there.
//!
//! - A tool whose delivery is [`Delivery::AtMostOnce`] runs in one attempt:
//!   Temporal records an activity's start before the worker runs it, and an
//!   attempt that finds an earlier one (a worker that died mid-call, seen by
//!   its heartbeat running out) answers the call with an [`INTERRUPTED`]
//!   error instead of running it again. A tool whose delivery is
//!   [`Delivery::AtLeastOnce`] runs again in that case, with the same
//!   idempotency key.
//! - A tool that keeps its side effects in its call's journal
//!   ([`DynTool::resumes_from_journal`], an agent offered as a tool) gets a
//!   call journal in its activity, kept as the activity's heartbeat details,
//!   so a retried attempt resumes inside it, asking no recorded model answer
//!   again and running no recorded call again; it is never answered
//!   [`INTERRUPTED`].
//! - A model call that fails with a retryable error is retried by Temporal;
//!   any other failure reaches the machine as it does today.
//! - Calls that need approval pause the run as they do everywhere; the
//!   workflow lists them (the `status` query, [`SessionStatus::pending`])
//!   and waits for a `decide` signal per call ([`SessionClient::decide`]),
//!   a wait that survives restarts of the worker and of the server.
//! - User messages are signals ([`SessionClient::send`] starts the workflow
//!   if it is not running); a turn's result is read with the `status` query.
//! - After a turn, when the workflow's history has grown past
//!   [`StepOptions::continue_after_events`] (or the server suggests it), the
//!   workflow continues as new with the machine's snapshot.
//! - Tokens are not streamed: an activity answers whole, so the model is
//!   called with `complete`.
//! - A tool run as an activity sees the machine's state as it was when the
//!   call started and no history ([`ToolContext::history`] is empty); its
//!   state updates are applied by the workflow when the activity answers.
//! - A tool's `ToolMetadata::timeout` would run a clock inside the
//!   workflow, which a replay does not repeat: bound calls with
//!   [`StepOptions::call_timeout`] instead.
//!
//! ```no_run
//! use markov_executor::Agent;
//! use markov_temporal::{SessionClient, SessionWorker, Steps};
//! use markov_testkit::ScriptedModel;
//!
//! # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
//! let steps = Steps::new();
//! let agent = Agent::builder("greeter")
//!     .instructions("Greet the user.")
//!     .model(steps.model(ScriptedModel::builder().text("Hello!").build()))
//!     .build()?;
//! let client = SessionClient::connect("http://127.0.0.1:7233", "default", "markov").await?;
//! SessionWorker::new(agent, steps).run(&client).await?;
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use markov_core::async_trait;
use markov_core::journal::{RecordedAnswer, RecordedOutcome};
use markov_core::model::{
    Model, ModelError, ModelLayer, ModelRequest, ModelResponse, StreamEvent, replay_stream,
};
use markov_core::tool::{
    Delivery, DynTool, Erased, InvalidToolName, SharedTool, StateAccess, StateUpdateError, Tool,
    ToolCallError, ToolContext, ToolDefinition, ToolOutcome,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

mod activities;
mod client;
mod records;
mod worker;
mod workflow;

pub use client::{SessionClient, TemporalError};
pub use worker::SessionWorker;
pub use workflow::{
    ApprovalDecision, MarkovSession, PendingApproval, SessionInput, SessionStatus, TurnResult,
};

/// The text of the result of an at-most-once call whose activity was
/// started by an earlier attempt that did not answer: the call is not run
/// again.
pub const INTERRUPTED: &str =
    "INTERRUPTED: the call started before a crash and its outcome is unknown; it was not run again";

tokio::task_local! {
    static BRIDGE: Bridge;
}

/// The way from the wrappers, which run inside the machine, to the
/// workflow, which alone holds the Temporal context.
#[derive(Clone)]
pub(crate) struct Bridge {
    ops: mpsc::UnboundedSender<Op>,
}

/// One activity asked for by a wrapper, and where its answer goes.
pub(crate) struct Op {
    pub(crate) step: StepInput,
    pub(crate) reply: oneshot::Sender<Value>,
}

/// What an activity is given: everything the worker needs to make the
/// call again in another process.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub(crate) enum StepInput {
    /// A model call.
    Model(ModelInput),
    /// A tool call.
    Tool(ToolInput),
}

/// A model call as an activity's input.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ModelInput {
    /// The model's index in its [`Steps`].
    pub(crate) model: usize,
    pub(crate) system: String,
    pub(crate) messages: Vec<markov_core::message::Message>,
    pub(crate) tools: Vec<ToolDefinition>,
    pub(crate) provider_tools: Vec<markov_core::tool::ProviderTool>,
    pub(crate) tool_choice: markov_core::model::ToolChoice,
    pub(crate) settings: markov_core::model::ModelSettings,
    pub(crate) output_schema: Option<Value>,
}

/// A tool call as an activity's input.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ToolInput {
    pub(crate) tool: String,
    pub(crate) args: Value,
    pub(crate) call_id: String,
    pub(crate) idempotency_key: Option<String>,
    pub(crate) state: Value,
    pub(crate) at_most_once: bool,
}

/// Sends `step` to the workflow when called inside one (else runs `direct`)
/// and answers the activity's value.
async fn step_or_direct(
    step: StepInput,
    direct: BoxFuture<'_, Value>,
    interrupted: Value,
) -> Value {
    let Ok(ops) = BRIDGE.try_with(|b| b.ops.clone()) else {
        return direct.await;
    };
    drop(direct);
    let (reply, answer) = oneshot::channel();
    if ops.send(Op { step, reply }).is_err() {
        tracing::error!("the workflow stopped before a step was scheduled");
        return interrupted;
    }
    answer.await.unwrap_or_else(|_| {
        tracing::error!("the workflow ended before a step had its result");
        interrupted
    })
}

/// Runs `machine` with the wrappers' steps sent to `serve`, one at a time
/// in the order the machine asks for them, and returns the machine's
/// output.
pub(crate) async fn drive<F, S>(machine: F, mut serve: S) -> F::Output
where
    F: Future,
    S: AsyncFnMut(StepInput) -> Value,
{
    let (ops, mut rx) = mpsc::unbounded_channel::<Op>();
    let machine = BRIDGE.scope(Bridge { ops }, machine);
    tokio::pin!(machine);
    loop {
        let op = tokio::select! {
            biased;
            out = &mut machine => return out,
            op = rx.recv() => match op {
                Some(op) => op,
                None => return machine.await,
            },
        };
        let value = serve(op.step).await;
        if op.reply.send(value).is_err() {
            tracing::warn!("the machine dropped a step before its result arrived");
        }
    }
}

/// The models and tools whose calls run as activities: register each with
/// [`Steps::model`] or [`Steps::tool`] while building the agent, then hand
/// the same `Steps` to [`SessionWorker::new`], whose activities call them.
#[derive(Debug, Clone, Default)]
pub struct Steps {
    inner: Arc<Mutex<Registry>>,
}

#[derive(Debug, Default)]
struct Registry {
    models: Vec<Arc<dyn Model>>,
    tools: HashMap<String, SharedTool>,
}

impl Steps {
    /// No models, no tools.
    pub fn new() -> Self {
        Steps::default()
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers `inner` and answers the model to give the agent: its calls
    /// run as activities inside a workflow.
    pub fn model<M: Model + 'static>(&self, inner: M) -> StepModel<M> {
        let inner = Arc::new(inner);
        let mut registry = self.registry();
        let index = registry.models.len();
        registry.models.push(Arc::clone(&inner) as Arc<dyn Model>);
        StepModel { inner, index }
    }

    /// Registers `tool` and answers the tool to give the agent
    /// (`AgentBuilder::tools`, or `tools_with` under the policy pipeline).
    ///
    /// # Errors
    /// The tool's name is not a valid tool name.
    pub fn tool<T: Tool>(&self, tool: T) -> Result<SharedTool, InvalidToolName> {
        Ok(self.shared_tool(Erased::shared(tool)?))
    }

    /// [`Steps::tool`] for a tool known only at run time (such as an MCP
    /// server's). A second tool of the same name replaces the first in the
    /// worker's activities (said in a warning).
    pub fn shared_tool(&self, tool: SharedTool) -> SharedTool {
        let name = tool.definition().name.to_string();
        if self
            .registry()
            .tools
            .insert(name.clone(), Arc::clone(&tool))
            .is_some()
        {
            tracing::warn!(tool = %name, "a tool of this name was registered again; the last one runs");
        }
        Arc::new(StepTool { inner: tool })
    }

    pub(crate) fn model_at(&self, index: usize) -> Option<Arc<dyn Model>> {
        self.registry().models.get(index).cloned()
    }

    pub(crate) fn tool_named(&self, name: &str) -> Option<SharedTool> {
        self.registry().tools.get(name).cloned()
    }
}

/// A model whose calls run as activities inside a workflow (made by
/// [`Steps::model`]). A retryable failure ([`ModelError::is_retryable`]) is
/// retried by Temporal; any other failure is recorded and reaches the
/// machine as it does today.
///
/// Streaming calls are made with `complete` and replayed as events: an
/// activity answers whole.
#[derive(Debug)]
pub struct StepModel<M> {
    inner: Arc<M>,
    index: usize,
}

/// Calls `model` with the request `input` describes, as the activity does,
/// and answers the value the workflow records: `{"ok": response}`,
/// `{"err": failure}`, or `{"retry": message}` for a failure Temporal
/// should retry.
pub(crate) async fn call_model(model: &dyn Model, input: &ModelInput) -> Value {
    let request = ModelRequest::new(&input.system, &input.messages, &input.settings)
        .with_tools(&input.tools)
        .with_provider_tools(&input.provider_tools)
        .with_tool_choice(&input.tool_choice)
        .with_output_schema(input.output_schema.as_ref());
    model_value(model.complete(request).await)
}

/// A model call's result as the workflow's history keeps it (a retryable
/// failure as `{"retry": …}`, which the activity hands to Temporal to
/// retry).
fn model_value(result: Result<ModelResponse, ModelError>) -> Value {
    serde_json::to_value(RecordedAnswer::of(result)).unwrap_or_else(
        |e| serde_json::json!({ "error": format!("the answer could not be recorded: {e}") }),
    )
}

#[async_trait]
impl<M: Model> ModelLayer for StepModel<M> {
    type Inner = M;

    fn inner(&self) -> &M {
        &self.inner
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let step = StepInput::Model(ModelInput {
            model: self.index,
            system: request.system().to_owned(),
            messages: request.messages().to_vec(),
            tools: request.tools().to_vec(),
            provider_tools: request.provider_tools().to_vec(),
            tool_choice: request.tool_choice().clone(),
            settings: request.settings().clone(),
            output_schema: request.output_schema().cloned(),
        });
        let direct: BoxFuture<'_, Value> =
            Box::pin(async move { model_value(self.inner.complete(request).await) });
        let value = step_or_direct(
            step,
            direct,
            serde_json::to_value(RecordedAnswer::failed(INTERRUPTED)).unwrap_or_default(),
        )
        .await;
        RecordedAnswer::read(value)
    }

    fn stream<'a>(
        &'a self,
        request: ModelRequest<'a>,
    ) -> BoxStream<'a, Result<StreamEvent, ModelError>> {
        replay_stream(ModelLayer::complete(self, request))
    }
}

/// The state a tool sees inside an activity: the machine's state when the
/// call started; its updates are kept and applied by the workflow.
#[derive(Debug)]
pub(crate) struct RecordingState {
    state: Value,
    patches: Mutex<Vec<Value>>,
}

impl RecordingState {
    pub(crate) fn new(state: Value) -> Self {
        RecordingState {
            state,
            patches: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn into_patches(self) -> Vec<Value> {
        self.patches
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl StateAccess for RecordingState {
    fn state(&self) -> &Value {
        &self.state
    }

    fn update_state(&self, patch: Value) -> Result<(), StateUpdateError> {
        if !patch.is_object() {
            return Err(StateUpdateError::NotAnObject);
        }
        self.patches
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(patch);
        Ok(())
    }
}

/// A tool whose calls run as activities inside a workflow (made by
/// [`Steps::tool`] or [`Steps::shared_tool`]).
#[derive(Debug)]
pub struct StepTool {
    inner: SharedTool,
}

#[async_trait]
impl DynTool for StepTool {
    fn definition(&self) -> &ToolDefinition {
        self.inner.definition()
    }

    fn may_terminate(&self) -> bool {
        self.inner.may_terminate()
    }

    fn resumes_from_journal(&self) -> bool {
        self.inner.resumes_from_journal()
    }

    async fn call_json(
        &self,
        input: &Value,
        cx: ToolContext<'_>,
    ) -> Result<ToolOutcome, ToolCallError> {
        let definition = self.inner.definition();
        let delivery = definition.effective_delivery();
        let state = cx.state_access();
        let step = StepInput::Tool(ToolInput {
            tool: definition.name.to_string(),
            args: input.clone(),
            call_id: cx.call_id().to_string(),
            idempotency_key: cx.idempotency_key().map(str::to_owned),
            state: state.state().clone(),
            // A tool that resumes from its call's journal (a sub-agent)
            // is never answered INTERRUPTED: its retried activity resumes.
            at_most_once: delivery == Delivery::AtMostOnce && !self.inner.resumes_from_journal(),
        });
        let direct: BoxFuture<'_, Value> = Box::pin(async move {
            let outcome = RecordedOutcome::of(self.inner.call_json(input, cx).await);
            tool_value(outcome, Vec::new())
        });
        let mut value = step_or_direct(step, direct, interrupted_value()).await;
        if value.get("interrupted").is_some() {
            return Err(ToolCallError::Execution(INTERRUPTED.to_owned()));
        }
        if let Some(error) = value.get("error").and_then(Value::as_str) {
            return Err(ToolCallError::Execution(error.to_owned()));
        }
        let patches: Vec<Value> = value
            .get_mut("patches")
            .map(Value::take)
            .and_then(|p| serde_json::from_value(p).ok())
            .unwrap_or_default();
        let outcome = value
            .get_mut("outcome")
            .map(Value::take)
            .ok_or_else(|| ToolCallError::Execution("the activity answered no outcome".into()))?;
        let result = serde_json::from_value::<RecordedOutcome>(outcome)
            .map_err(|e| {
                ToolCallError::Execution(format!("a recorded result could not be read: {e}"))
            })?
            .into_result();
        for patch in patches {
            if let Err(error) = state.update_state(patch) {
                tracing::warn!(%error, tool = %definition.name, "a state update made in an activity was refused");
                return Err(ToolCallError::Execution(format!(
                    "the tool ran, but its state update was refused: {error}"
                )));
            }
        }
        result
    }
}

/// The value an activity answers for a tool call.
pub(crate) fn tool_value(outcome: RecordedOutcome, patches: Vec<Value>) -> Value {
    match serde_json::to_value(outcome) {
        Ok(outcome) => serde_json::json!({ "outcome": outcome, "patches": patches }),
        Err(e) => serde_json::json!({ "error": format!("the result could not be recorded: {e}") }),
    }
}

pub(crate) fn interrupted_value() -> Value {
    serde_json::json!({ "interrupted": INTERRUPTED })
}

/// How the workflow schedules its activities.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct StepOptions {
    /// The longest one model call or tool call may take (Temporal's
    /// start-to-close timeout). Default: 10 minutes.
    pub call_timeout: Duration,
    /// How long a worker that stopped heartbeating is given before its
    /// activity is taken as lost (and retried, or answered `INTERRUPTED`
    /// for an at-most-once tool). The worker heartbeats a third of this
    /// while a call runs. Default: 10 seconds.
    pub heartbeat_timeout: Duration,
    /// Attempts of a model call (or an at-least-once tool call) before the
    /// machine reads its failure. Default: 5.
    pub max_attempts: u32,
    /// Continue as new after a turn once the workflow's history has this
    /// many events. Default: 2 000.
    pub continue_after_events: u32,
    /// How long a workflow task waits for the worker that ran the session
    /// last (Temporal's sticky queue) before any worker may take it: after
    /// a worker dies, its sessions resume no sooner. Default: 10 seconds.
    pub sticky_timeout: Duration,
}

impl Default for StepOptions {
    fn default() -> Self {
        StepOptions {
            call_timeout: Duration::from_secs(600),
            heartbeat_timeout: Duration::from_secs(10),
            max_attempts: 5,
            continue_after_events: 2_000,
            sticky_timeout: Duration::from_secs(10),
        }
    }
}

impl StepOptions {
    /// Sets [`StepOptions::heartbeat_timeout`].
    #[must_use]
    pub fn with_heartbeat_timeout(mut self, timeout: Duration) -> Self {
        self.heartbeat_timeout = timeout;
        self
    }

    /// Sets [`StepOptions::call_timeout`].
    #[must_use]
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// Sets [`StepOptions::max_attempts`].
    #[must_use]
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// Sets [`StepOptions::sticky_timeout`].
    #[must_use]
    pub fn with_sticky_timeout(mut self, timeout: Duration) -> Self {
        self.sticky_timeout = timeout;
        self
    }

    /// Sets [`StepOptions::continue_after_events`].
    #[must_use]
    pub fn with_continue_after_events(mut self, events: u32) -> Self {
        self.continue_after_events = events;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use markov_testkit::ScriptedModel;

    #[tokio::test]
    async fn outside_a_workflow_the_model_is_called_straight_through() {
        let steps = Steps::new();
        let agent = markov_executor::Agent::builder("a")
            .instructions("Say hi.")
            .model(steps.model(ScriptedModel::builder().text("hi").build()))
            .build()
            .expect("agent");
        let mut machine = agent.machine();
        machine.enqueue_user("hello");
        let last = machine.run().await.expect("a run");
        assert!(last.done);
        assert_eq!(machine.history().len(), 2);
    }

    #[test]
    fn a_recorded_model_failure_keeps_its_kind() {
        let error = ModelError::ContextLength("too long".into());
        let value = model_value(Err(error.clone()));
        assert_eq!(RecordedAnswer::read(value), Err(error));
    }

    #[test]
    fn a_state_update_made_in_an_activity_is_kept_for_the_workflow() {
        let state = RecordingState::new(serde_json::json!({"n": 1}));
        assert_eq!(state.state(), &serde_json::json!({"n": 1}));
        assert_eq!(
            state.update_state(serde_json::json!(3)),
            Err(StateUpdateError::NotAnObject)
        );
        state
            .update_state(serde_json::json!({"n": 2}))
            .expect("an object patch");
        assert_eq!(state.into_patches(), vec![serde_json::json!({"n": 2})]);
    }
}

//! markov sessions as Restate virtual objects.
//!
//! [`SessionObject`] serves an [`Agent`](markov_executor::Agent) as a Restate virtual object
//! keyed by session: Restate runs one invocation at a time per key, keeps
//! the session's machine (its history, instance tree, policy state and
//! usage) in the object's K/V state, and journals every model call and
//! every tool call through `ctx.run`, so that a crash or a redeploy of the
//! service resumes the turn without repeating a finished model call or a
//! tool's side effect.
//!
//! The agent's model and tools take part in the journal when they are
//! wrapped: the model in [`JournaledModel`], each tool by [`journaled`] or
//! [`journaled_shared`]. Outside a Restate handler the wrappers call
//! straight through, so the same agent runs in memory or in
//! `markov-store` unchanged.
//!
//! - A tool whose delivery is [`Delivery::AtMostOnce`] gets a journaled
//!   start before it runs: an invocation retried after a crash between
//!   that start and the tool's recorded result answers the call with an
//!   `INTERRUPTED` error instead of running it again. A tool whose delivery
//!   is [`Delivery::AtLeastOnce`] runs again in that case, with the same
//!   idempotency key.
//! - A tool that keeps its side effects in its call's journal
//!   ([`DynTool::resumes_from_journal`], an agent offered as a tool) is not
//!   run inside one step: it runs in the handler's flow with a call journal
//!   whose records are `ctx.run` steps of the invocation, so a retried
//!   invocation resumes inside it, asking no recorded model answer again
//!   and running no recorded call again.
//! - Calls that need approval pause the run as they do everywhere; the
//!   handler then creates one Restate awakeable per pending request, lists
//!   them in the object's state (the `approvals` handler reads them) and
//!   waits for them: resolving an awakeable with a
//!   [`Decision`](markov_policy::Decision) as JSON (`{"decision":
//!   "approve"}`, `edit`, `deny`, `respond`) decides the call. The wait
//!   survives restarts of the service and of the server.
//! - Usage limits and the loop guard are the agent's, as for any machine.
//! - Tokens are not streamed: Restate answers an invocation with its whole
//!   result, so the model is called with `complete` inside `ctx.run` and
//!   the client reads the turn's answer when the invocation ends.
//!
//! ```no_run
//! use markov_executor::Agent;
//! use markov_restate::{JournaledModel, SessionObject};
//! use markov_testkit::ScriptedModel;
//!
//! # async fn serve() -> std::io::Result<()> {
//! let agent = Agent::builder("greeter")
//!     .instructions("Greet the user.")
//!     .model(JournaledModel::new(ScriptedModel::builder().text("Hello!").build()))
//!     .build()
//!     .expect("a valid agent");
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:9080").await?;
//! SessionObject::new(agent).serve(listener).await;
//! # Ok(())
//! # }
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use markov_core::async_trait;
use markov_core::journal::{RecordedAnswer, RecordedOutcome};
use markov_core::model::{
    Model, ModelError, ModelLayer, ModelRequest, ModelResponse, StreamEvent, replay_stream,
};
use markov_core::tool::{
    CallJournal, Delivery, DynTool, Erased, InvalidToolName, SharedTool, Tool, ToolCallError,
    ToolContext, ToolDefinition, ToolOutcome,
};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

mod object;
mod records;

pub use object::{PendingApproval, SessionObject, TurnResult};

/// The text of the result of an at-most-once call whose start was
/// journaled by an earlier attempt of the invocation but whose result was
/// not: the call is not run again.
pub const INTERRUPTED: &str =
    "INTERRUPTED: the call started before a crash and its outcome is unknown; it was not run again";

tokio::task_local! {
    static BRIDGE: Bridge;
}

/// The way from the wrappers, which run inside the machine, to the
/// handler, which alone holds the Restate context.
#[derive(Clone)]
pub(crate) struct Bridge {
    ops: mpsc::UnboundedSender<Op>,
}

/// One journaled step asked for by a wrapper.
pub(crate) struct Op {
    pub(crate) name: String,
    pub(crate) at_most_once: bool,
    pub(crate) events: mpsc::UnboundedSender<OpEvent>,
}

/// What the handler tells the wrapper about its step.
pub(crate) enum OpEvent {
    /// The step is not in the journal: run the work now and send its
    /// result.
    RunNow(oneshot::Sender<Value>),
    /// The step's result, journaled (now or by an earlier attempt).
    Done(Value),
}

/// Runs `work` as one journaled step named `name` when called inside a
/// session handler (else runs it directly): the journaled value when the
/// step is in the journal, the work's otherwise.
async fn journal_step(
    name: String,
    at_most_once: bool,
    work: BoxFuture<'_, Value>,
    interrupted: Value,
) -> Value {
    let Ok(ops) = BRIDGE.try_with(|b| b.ops.clone()) else {
        return work.await;
    };
    journal_through(&ops, name, at_most_once, work, interrupted).await
}

/// [`journal_step`] through the handler's `ops`.
pub(crate) async fn journal_through(
    ops: &mpsc::UnboundedSender<Op>,
    name: String,
    at_most_once: bool,
    work: BoxFuture<'_, Value>,
    interrupted: Value,
) -> Value {
    let (events, mut rx) = mpsc::unbounded_channel();
    let op = Op {
        name,
        at_most_once,
        events,
    };
    if ops.send(op).is_err() {
        return interrupted;
    }
    let mut work = Some(work);
    while let Some(event) = rx.recv().await {
        match event {
            OpEvent::RunNow(reply) => match work.take() {
                Some(work) => {
                    let _ = reply.send(work.await);
                }
                None => {
                    tracing::error!(
                        "a journaled step was asked to run twice; answered as interrupted"
                    );
                    let _ = reply.send(interrupted.clone());
                }
            },
            OpEvent::Done(value) => return value,
        }
    }
    tracing::error!("the session handler ended before a journaled step had its result");
    interrupted
}

/// Serves the wrappers' steps with `ctx.run` while `machine` runs, and
/// returns the machine's output. Steps are journaled one at a time, in the
/// order the machine asks for them.
pub(crate) async fn drive<F: Future>(
    ctx: &restate_sdk::prelude::ObjectContext<'_>,
    machine: F,
) -> F::Output {
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
        let value = {
            let step = journal_op(ctx, &op);
            tokio::pin!(step);
            // The machine does the step's work while the journal waits.
            tokio::select! {
                biased;
                value = &mut step => value,
                out = &mut machine => return out,
            }
        };
        let _ = op.events.send(OpEvent::Done(value));
    }
}

async fn journal_op(ctx: &restate_sdk::prelude::ObjectContext<'_>, op: &Op) -> Value {
    use restate_sdk::prelude::{ContextSideEffects, Json, RunFuture};
    let begun_here = Arc::new(AtomicBool::new(!op.at_most_once));
    if op.at_most_once {
        let flag = Arc::clone(&begun_here);
        let started = ctx
            .run(move || async move {
                flag.store(true, Ordering::SeqCst);
                Ok(())
            })
            .name(format!("start {}", op.name))
            .await;
        if let Err(error) = started {
            tracing::error!(%error, "the start of an at-most-once call was not journaled");
            return interrupted_value();
        }
    }
    let events = op.events.clone();
    let result = ctx
        .run(move || async move {
            if !begun_here.load(Ordering::SeqCst) {
                tracing::warn!(
                    "an at-most-once call started before a crash is answered as interrupted"
                );
                return Ok(Json(interrupted_value()));
            }
            let (reply, value) = oneshot::channel();
            events
                .send(OpEvent::RunNow(reply))
                .map_err(|_| restate_sdk::prelude::HandlerError::from("the machine stopped"))?;
            let value = value.await.map_err(|_| {
                restate_sdk::prelude::HandlerError::from("the machine dropped the step")
            })?;
            if let Some(retry) = value.get("retry").and_then(Value::as_str) {
                // A retryable failure is Restate's to retry, not the journal's.
                return Err(restate_sdk::prelude::HandlerError::from(retry.to_owned()));
            }
            Ok(Json(value))
        })
        .name(op.name.clone())
        .await;
    match result {
        Ok(Json(value)) => value,
        Err(error) => {
            tracing::error!(%error, step = %op.name, "a journaled step failed for good");
            serde_json::json!({ "error": error.to_string() })
        }
    }
}

fn interrupted_value() -> Value {
    serde_json::json!({ "interrupted": INTERRUPTED })
}

/// A model whose calls are journaled steps inside a session handler:
/// an invocation retried after a crash reads a finished call's answer
/// from the journal instead of calling the model again. A retryable
/// failure ([`ModelError::is_retryable`]) is retried by Restate; any other
/// failure is journaled and reaches the machine as it does today.
///
/// Streaming calls are made with `complete` and replayed as events:
/// Restate journals whole results, not token streams.
#[derive(Debug)]
pub struct JournaledModel<M> {
    inner: M,
}

impl<M: Model> JournaledModel<M> {
    /// Wraps `inner`.
    pub fn new(inner: M) -> Self {
        JournaledModel { inner }
    }
}

#[async_trait]
impl<M: Model> ModelLayer for JournaledModel<M> {
    type Inner = M;

    fn inner(&self) -> &M {
        &self.inner
    }

    async fn complete(&self, request: ModelRequest<'_>) -> Result<ModelResponse, ModelError> {
        let work: BoxFuture<'_, Value> = Box::pin(async move {
            answer_value(RecordedAnswer::of(self.inner.complete(request).await))
        });
        let value = journal_step(
            "model".to_owned(),
            false,
            work,
            answer_value(RecordedAnswer::failed(INTERRUPTED)),
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

/// A recorded answer as the journal's JSON (a retryable failure as
/// `{"retry": …}`, which the journal step hands to Restate to retry).
fn answer_value(answer: RecordedAnswer) -> Value {
    serde_json::to_value(answer).unwrap_or_else(
        |e| serde_json::json!({ "error": format!("the answer could not be journaled: {e}") }),
    )
}

/// A tool whose calls are journaled steps inside a session handler
/// (made by [`journaled`] or [`journaled_shared`]).
#[derive(Debug)]
pub struct JournaledTool {
    inner: SharedTool,
}

/// Wraps `tool` so that its calls are journaled steps inside a session
/// handler; register the result with `AgentBuilder::tools` (or
/// `tools_with`, for tools under the policy pipeline).
///
/// # Errors
/// The tool's name is not a valid tool name.
pub fn journaled<T: Tool>(tool: T) -> Result<SharedTool, InvalidToolName> {
    Ok(journaled_shared(Erased::shared(tool)?))
}

/// [`journaled`] for a tool known only at run time (such as an MCP
/// server's).
pub fn journaled_shared(tool: SharedTool) -> SharedTool {
    Arc::new(JournaledTool { inner: tool })
}

#[async_trait]
impl DynTool for JournaledTool {
    fn definition(&self) -> &ToolDefinition {
        self.inner.definition()
    }

    fn may_terminate(&self) -> bool {
        self.inner.may_terminate()
    }

    fn may_pause(&self) -> bool {
        self.inner.may_pause()
    }

    fn resumes_from_journal(&self) -> bool {
        self.inner.resumes_from_journal()
    }

    async fn call_json(
        &self,
        input: &Value,
        cx: ToolContext<'_>,
    ) -> Result<ToolOutcome, ToolCallError> {
        if self.inner.resumes_from_journal()
            && let Ok(ops) = BRIDGE.try_with(|b| b.ops.clone())
        {
            // A tool that keeps its side effects in its call's journal (a
            // sub-agent) runs in the handler's flow rather than inside one
            // step: its records are steps of the invocation's journal, so
            // a retried invocation resumes inside it.
            let records = records::ObjectRecords::open(ops, cx.call_id()).await;
            let make =
                move || -> Arc<dyn CallJournal> { Arc::clone(&records) as Arc<dyn CallJournal> };
            return self.inner.call_json(input, cx.with_journal(&make)).await;
        }
        let definition = self.inner.definition();
        let delivery = definition.effective_delivery();
        let name = format!("tool {} {}", definition.name, cx.call_id());
        let work: BoxFuture<'_, Value> = Box::pin(async move {
            let outcome = RecordedOutcome::of(self.inner.call_json(input, cx).await);
            serde_json::to_value(outcome).unwrap_or_else(|e| {
                serde_json::json!({ "kind": "failed", "message": format!("the result could not be journaled: {e}") })
            })
        });
        let value = journal_step(
            name,
            delivery == Delivery::AtMostOnce,
            work,
            interrupted_value(),
        )
        .await;
        if value.get("interrupted").is_some() {
            return Err(ToolCallError::Execution(INTERRUPTED.to_owned()));
        }
        if let Some(error) = value.get("error").and_then(Value::as_str) {
            return Err(ToolCallError::Execution(error.to_owned()));
        }
        serde_json::from_value::<RecordedOutcome>(value)
            .map_err(|e| {
                ToolCallError::Execution(format!("a journaled result could not be read: {e}"))
            })?
            .into_result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use markov_testkit::ScriptedModel;

    #[tokio::test]
    async fn outside_a_handler_the_model_is_called_straight_through() {
        let model = JournaledModel::new(ScriptedModel::builder().text("hi").build());
        let agent = markov_executor::Agent::builder("a")
            .instructions("Say hi.")
            .model(model)
            .build()
            .expect("agent");
        let mut machine = agent.machine();
        machine.enqueue_user("hello");
        let last = machine.run().await.expect("a run");
        assert!(last.done);
        assert_eq!(machine.history().len(), 2);
    }
}

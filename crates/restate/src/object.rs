//! The virtual object that serves an agent: one key per session.

use futures::future::BoxFuture;
use markov_executor::serialize::SerializedMachine;
use markov_executor::{Agent, Machine, MachineStep, RunError, serialize_machine};
use markov_policy::Decision;
use restate_sdk::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::drive;

/// The K/V key of the session's machine (its snapshot as JSON).
const MACHINE: &str = "machine";
/// The K/V key of the approvals the session waits for.
const APPROVALS: &str = "approvals";

/// What a turn answers: the last step's text, whether the machine is done,
/// and the length of the history after the turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TurnResult {
    /// The machine's response: the last step's, else the text of the
    /// last assistant message (`None` when it has none).
    pub response: Option<String>,
    /// Whether the run ended done (an answer, a terminal tool, ...).
    pub done: bool,
    /// Why the last step yielded (`YieldReason` as markov writes it).
    pub yield_reason: String,
    /// Messages in the session's history after the turn.
    pub history_len: usize,
}

/// A call that waits for the application's decision, and the Restate
/// awakeable that decides it: resolve it with a `Decision` as JSON through
/// the ingress (`POST /restate/awakeables/{awakeable}/resolve`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PendingApproval {
    /// The awakeable to resolve.
    pub awakeable: String,
    /// The tool asked for.
    pub tool: String,
    /// The arguments the model gave.
    pub args: Value,
    /// The model's id of the call.
    pub call_id: Option<String>,
}

/// An [`Agent`] served as the Restate virtual object `MarkovSession`,
/// keyed by session id. Its handlers:
///
/// - `send` (exclusive): takes a user message, runs the turn (waiting on
///   awakeables for the calls that need approval) and answers a
///   [`TurnResult`]. Call it through the ingress,
///   `POST /MarkovSession/{session}/send` (or `.../send/send` to start it
///   without waiting).
/// - `approvals` (shared): the [`PendingApproval`]s the session waits for.
/// - `snapshot` (shared): the session's machine as markov's snapshot JSON
///   (`SerializedMachine`), to import it into a markov store or the studio
///   (`markov_executor::Agent::restore`).
#[derive(Debug, Clone)]
pub struct SessionObject {
    agent: Agent,
}

impl SessionObject {
    /// Serves `agent`. Its model should be a [`crate::JournaledModel`] and
    /// its tools [`crate::journaled`]: what is not wrapped runs again when
    /// an invocation is retried.
    pub fn new(agent: Agent) -> Self {
        SessionObject { agent }
    }

    /// Serves the object on `listener` over HTTP/2 until the process
    /// ends; register the address with the Restate server
    /// (`restate deployments register http://host:port`, or the admin
    /// API's `POST /deployments`).
    pub async fn serve(self, listener: tokio::net::TcpListener) {
        HttpServer::new(Endpoint::builder().bind(self).build())
            .serve(listener)
            .await;
    }

    async fn load(&self, ctx: &ObjectContext<'_>) -> Result<Machine, HandlerError> {
        let stored = ctx.get::<Json<Value>>(MACHINE).await?;
        let snapshot = match stored {
            Some(Json(snapshot)) => snapshot,
            // A new machine has random ids: made once, inside the journal,
            // so that a retried invocation starts from the same one.
            None => {
                let agent = self.agent.clone();
                ctx.run(move || async move {
                    let machine = agent.machine();
                    let snapshot = serialize_machine(&machine)
                        .map_err(|e| HandlerError::from(e.to_string()))?;
                    Ok(Json(serde_json::to_value(snapshot)?))
                })
                .name("new machine")
                .await?
                .into_inner()
            }
        };
        let snapshot: SerializedMachine = serde_json::from_value(snapshot)
            .map_err(|e| TerminalError::new(format!("the stored machine cannot be read: {e}")))?;
        self.agent.restore(snapshot).map_err(|e| {
            TerminalError::new(format!("the stored machine cannot be restored: {e}")).into()
        })
    }
}

fn store(ctx: &ObjectContext<'_>, machine: &Machine) -> Result<(), HandlerError> {
    let snapshot = serialize_machine(machine).map_err(|e| HandlerError::from(e.to_string()))?;
    ctx.set(MACHINE, Json(serde_json::to_value(snapshot)?));
    Ok(())
}

fn run_error(error: RunError) -> HandlerError {
    TerminalError::new(format!("the turn failed: {error}")).into()
}

#[restate_sdk::object(name = "MarkovSession")]
impl SessionObject {
    /// Runs one user turn.
    #[handler]
    async fn send(
        &self,
        ctx: ObjectContext<'_>,
        message: String,
    ) -> Result<Json<TurnResult>, HandlerError> {
        self.turn(ctx, message).await
    }

    /// The approvals the session waits for.
    #[handler]
    async fn approvals(
        &self,
        ctx: SharedObjectContext<'_>,
    ) -> Result<Json<Vec<PendingApproval>>, HandlerError> {
        Ok(ctx
            .get::<Json<Vec<PendingApproval>>>(APPROVALS)
            .await?
            .unwrap_or_default())
    }

    /// The session's machine as markov's snapshot JSON (`null` before the
    /// first turn).
    #[handler]
    async fn snapshot(&self, ctx: SharedObjectContext<'_>) -> Result<Json<Value>, HandlerError> {
        Ok(ctx
            .get::<Json<Value>>(MACHINE)
            .await?
            .unwrap_or(Json(Value::Null)))
    }
}

impl SessionObject {
    /// The body of `send`, boxed so that its future is checked `Send` at
    /// one lifetime.
    fn turn<'a>(
        &'a self,
        ctx: ObjectContext<'a>,
        message: String,
    ) -> BoxFuture<'a, Result<Json<TurnResult>, HandlerError>> {
        Box::pin(async move {
            let mut machine = self.load(&ctx).await?;
            if machine.is_awaiting_approval() {
                return Err(TerminalError::new("the session waits for approvals").into());
            }
            machine.enqueue_user(message);
            let mut last = drive(&ctx, machine.run()).await.map_err(run_error)?;
            while machine.is_awaiting_approval() {
                last = self.decide(&ctx, &mut machine).await?;
            }
            store(&ctx, &machine)?;
            Ok(Json(TurnResult {
                response: last.response.clone().or_else(|| {
                    machine
                        .history()
                        .iter()
                        .rev()
                        .find(|m| m.role == markov_core::message::Role::Assistant)
                        .map(|m| m.text())
                        .filter(|t| !t.is_empty())
                }),
                done: last.done,
                yield_reason: format!("{:?}", last.yield_reason),
                history_len: machine.history().len(),
            }))
        })
    }

    /// Waits for the decisions on the pending calls (one awakeable each),
    /// applies them and resumes the turn.
    async fn decide(
        &self,
        ctx: &ObjectContext<'_>,
        machine: &mut Machine,
    ) -> Result<MachineStep, HandlerError> {
        let mut pending = machine.approvals().pending();
        // The order awakeables are made in must be the same on every
        // attempt: the calls' ids and tools come from the journaled answer.
        pending.sort_by(|a, b| (&a.call_id, &a.tool).cmp(&(&b.call_id, &b.tool)));
        let mut waits = Vec::with_capacity(pending.len());
        let mut listed = Vec::with_capacity(pending.len());
        for request in &pending {
            let (awakeable, decision) = ctx.awakeable::<Json<Decision>>();
            listed.push(PendingApproval {
                awakeable,
                tool: request.tool.clone(),
                args: request.args.clone(),
                call_id: request.call_id.as_ref().map(ToString::to_string),
            });
            waits.push((request.request_id.clone(), decision));
        }
        // Only what every attempt writes the same is written before the
        // wait: a retried invocation's replay checks each state write
        // against the journal, and the machine's snapshot holds the
        // requests' random ids and clock times.
        ctx.set(APPROVALS, Json(listed));
        for (id, decision) in waits {
            let Json(decision) = decision.await?;
            if let Err(error) = machine.approvals().decide(&id, decision) {
                // An edit whose arguments do not fit the tool, say: the call
                // is denied with the reason, so the model reads why.
                tracing::warn!(%error, "a decision was refused; the call is denied");
                let _ = machine.approvals().decide(
                    &id,
                    Decision::Deny {
                        message: Some(format!("the decision was refused: {error}")),
                    },
                );
            }
        }
        ctx.clear(APPROVALS);
        drive(ctx, machine.resume()).await.map_err(run_error)
    }
}

//! The centre of the onion: runs the resolved tool with `call_json`, splits
//! off its intents and writes the success envelope.

use futures::FutureExt;
use futures::future::BoxFuture;
use markov_core::tool::{ToolCallError, ToolExecutionResult, ToolOutcome};
use serde::Serialize;
use serde_json::Value;

use super::error::{Rejection, ToolErrorKind, success_envelope};
use super::service::{ToolRequest, ToolService};
use crate::execute::into_result;

/// The key under which [`WithIntents`] serializes its intents.
pub const INTENTS_KEY: &str = "markov_intents";

/// A tool output carrying intents for the application besides its data.
///
/// Serializes to `{"data": .., "markov_intents": [..]}`; the registry's
/// execute stage recognises exactly that shape, gives the model `data` (and,
/// in the envelope, the intents) and hands the intents to the caller.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WithIntents<T> {
    /// What the model reads.
    pub data: T,
    /// Application-defined intents (e.g. `{"type":"end_session"}`).
    #[serde(rename = "markov_intents")]
    pub intents: Vec<Value>,
}

impl<T> WithIntents<T> {
    /// `data` with `intents`.
    pub fn new(data: T, intents: impl IntoIterator<Item = Value>) -> Self {
        WithIntents {
            data,
            intents: intents.into_iter().collect(),
        }
    }
}

/// Whether successful results are wrapped in `{"ok":true,"data":..}`.
///
/// Errors always are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvelopeMode {
    /// `{"ok":true,"data":..,"intents":[..]?}` (the seed's choice).
    On,
    /// The tool's text as without a registry.
    Off,
}

/// Runs the request's tool.
#[derive(Debug, Clone, Copy)]
pub struct ExecuteService {
    envelope: EnvelopeMode,
}

impl ExecuteService {
    /// An executor writing results in `envelope` mode.
    pub fn new(envelope: EnvelopeMode) -> Self {
        ExecuteService { envelope }
    }
}

/// Splits a [`WithIntents`] value into its data and intents.
fn split_intents(outcome: ToolOutcome) -> (ToolOutcome, Vec<Value>) {
    match outcome {
        ToolOutcome::Value(Value::Object(mut map))
            if map.len() == 2
                && map.contains_key("data")
                && map.get(INTENTS_KEY).is_some_and(Value::is_array) =>
        {
            let intents = match map.remove(INTENTS_KEY) {
                Some(Value::Array(items)) => items,
                _ => Vec::new(),
            };
            let data = map.remove("data").unwrap_or(Value::Null);
            (ToolOutcome::Value(data), intents)
        }
        other => (other, Vec::new()),
    }
}

impl ToolService for ExecuteService {
    fn call<'a>(&'a self, req: ToolRequest<'a>) -> BoxFuture<'a, ToolExecutionResult> {
        let Some(tool) = req.tool else {
            let result = Rejection::new(ToolErrorKind::NotFound)
                .with_detail(req.name)
                .respond(&req);
            return Box::pin(std::future::ready(result));
        };
        let envelope = self.envelope;
        let ToolRequest {
            call_id,
            name,
            input,
            report,
            cx,
            terminate_message,
            ..
        } = req;
        Box::pin(async move {
            // A panic is the tool's failure, not the conversation's: it is
            // answered like any other, so audit and the ledger see it too.
            let outcome = std::panic::AssertUnwindSafe(tool.call_json(input, cx))
                .catch_unwind()
                .await
                .unwrap_or_else(|_| Err(ToolCallError::Execution("the tool panicked".to_owned())));
            match outcome {
                Ok(outcome) => {
                    let (outcome, intents) = split_intents(outcome);
                    let data = match (&outcome, envelope) {
                        (ToolOutcome::Value(v), EnvelopeMode::On) => Some(v.clone()),
                        (other, EnvelopeMode::On) => {
                            Some(Value::String(other.model_text(terminate_message)))
                        }
                        (_, EnvelopeMode::Off) => None,
                    };
                    let mut result = into_result(
                        call_id,
                        tool.definition().terminal,
                        Ok(outcome),
                        terminate_message,
                    );
                    if let Some(data) = data {
                        result.content = success_envelope(&data, &intents);
                    }
                    if !intents.is_empty() {
                        report.set_intents(intents);
                    }
                    result
                }
                Err(ToolCallError::InvalidInput(detail)) => {
                    Rejection::new(ToolErrorKind::InvalidInput)
                        .with_detail(detail)
                        .into_result(call_id, report)
                }
                Err(ToolCallError::Execution(detail)) => {
                    // The tool's Display is addressed to the model by the
                    // `Tool` contract, so it is the safe detail.
                    tracing::warn!(tool = name, error = %detail, "tool execution failed");
                    Rejection::new(ToolErrorKind::ExecutionFailed)
                        .with_detail(detail)
                        .into_result(call_id, report)
                }
                Err(other) => {
                    tracing::warn!(tool = name, error = %other, "tool execution failed");
                    Rejection::new(ToolErrorKind::ExecutionFailed).into_result(call_id, report)
                }
            }
        })
    }

    fn stages(&self, out: &mut Vec<&'static str>) {
        out.push("execute");
    }
}

//! The centre of the onion: runs the resolved tool with `call_json`, splits
//! off its intents and writes the success envelope.

use futures::FutureExt;
use markov_core::async_trait;
use markov_core::ids::ToolCallId;
use markov_core::tool::{ToolCallError, ToolExecutionResult, ToolOutcome, UserMessage};
use serde::Serialize;
use serde_json::Value;

use crate::error::{EnvelopeMode, ErrorFormat, Rejection, success_envelope};
use crate::kind::ToolErrorKind;
use crate::service::{ToolOrigin, ToolRequest, ToolService};

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

/// Runs the request's tool.
#[derive(Debug, Clone, Copy)]
pub struct ExecuteService {
    envelope: EnvelopeMode,
    errors: ErrorFormat,
    /// How long a request a running call asks for lives; `None`: a call
    /// cannot ask (nothing could resume its step).
    holds: Option<std::time::Duration>,
}

impl ExecuteService {
    /// An executor writing successes in `envelope` mode and errors as
    /// envelopes.
    pub fn new(envelope: EnvelopeMode) -> Self {
        ExecuteService {
            envelope,
            errors: ErrorFormat::Envelope,
            holds: None,
        }
    }

    /// The execute stage of a machine without a registry: plain successes,
    /// plain-text errors ([`ErrorFormat::PlainText`]).
    pub fn plain() -> Self {
        ExecuteService {
            envelope: EnvelopeMode::Off,
            errors: ErrorFormat::PlainText,
            holds: None,
        }
    }

    /// Lets a running call ask for a person's decision
    /// (`ToolContext::ask_approval`), as a request of the conversation's
    /// approvals bound to the call that lives for `ttl`: only where the
    /// step that made the call can pause and be resumed.
    #[must_use]
    pub fn holds(mut self, ttl: std::time::Duration) -> Self {
        self.holds = Some(ttl);
        self
    }

    /// Sets how errors are worded.
    #[must_use]
    pub fn errors(mut self, errors: ErrorFormat) -> Self {
        self.errors = errors;
        self
    }

    /// The plain-text error result of `error`, worded for `origin`.
    fn plain_error(
        origin: ToolOrigin,
        call_id: &ToolCallId,
        report: &crate::report::CallReport,
        kind: ToolErrorKind,
        error: ToolCallError,
    ) -> ToolExecutionResult {
        report.set_error(kind);
        let text = match (origin, error) {
            (ToolOrigin::Pack, ToolCallError::InvalidInput(m)) => {
                format!("Invalid pack tool input: {m}")
            }
            (ToolOrigin::Pack, ToolCallError::Execution(m)) => format!("Tool error: {m}"),
            (_, error) => error.to_string(),
        };
        ToolExecutionResult::error(call_id.clone(), text)
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

#[async_trait]
impl ToolService for ExecuteService {
    async fn call(&self, req: ToolRequest<'_>) -> ToolExecutionResult {
        let Some(tool) = req.tool else {
            req.report.set_stage("execute");
            let result = match self.errors {
                ErrorFormat::Envelope => Rejection::new(ToolErrorKind::NotFound)
                    .with_detail(req.name)
                    .respond(&req),
                ErrorFormat::PlainText => {
                    req.report.set_error(ToolErrorKind::NotFound);
                    ToolExecutionResult::error(
                        req.call_id.clone(),
                        format!("Unknown tool: {}", req.name),
                    )
                }
            };
            return result;
        };
        let envelope = self.envelope;
        let errors = self.errors;
        let key = self.holds.map(|_| req.ledger_key());
        let hold = match (self.holds, &key) {
            (Some(ttl), Some(key)) => Some(CallHold {
                policy: req.policy,
                report: req.report,
                key,
                instance: req.cx.instance_id(),
                call_id: req.call_id,
                ttl,
            }),
            _ => None,
        };
        let cx = match &hold {
            Some(hold) => req.cx.with_hold(hold),
            None => req.cx,
        };
        let ToolRequest {
            call_id,
            name,
            input,
            report,
            cx,
            terminate_message,
            origin,
            ..
        } = ToolRequest { cx, ..req };
        report.set_ran();
        // A panic is the tool's failure, not the conversation's: it is
        // answered like any other, so audit and the ledger see it too.
        let outcome = std::panic::AssertUnwindSafe(tool.call_json(&input, cx))
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
            Err(error) if errors == ErrorFormat::PlainText => {
                let kind = match error {
                    ToolCallError::InvalidInput(_) => ToolErrorKind::InvalidInput,
                    _ => ToolErrorKind::ExecutionFailed,
                };
                Self::plain_error(origin, call_id, report, kind, error)
            }
            Err(ToolCallError::InvalidInput(detail)) => Rejection::new(ToolErrorKind::InvalidInput)
                .with_detail(detail)
                .into_result(call_id, report),
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
    }

    fn stages(&self, out: &mut Vec<&'static str>) {
        out.push("execute");
    }
}

/// Turns a tool's outcome into its one result: a success (a terminal
/// tool's marked `is_terminal`, its response text as the user message) or
/// the error's plain text.
pub fn into_result(
    id: &ToolCallId,
    terminal: bool,
    outcome: Result<ToolOutcome, ToolCallError>,
    default_terminate_message: &str,
) -> ToolExecutionResult {
    match outcome {
        Ok(outcome) => {
            let mut result = ToolExecutionResult::success(
                id.clone(),
                outcome.model_text(default_terminate_message),
            );
            result.images = outcome.images().to_vec();
            if terminal {
                result.is_terminal = true;
                result.user_message = Some(UserMessage::Text(
                    outcome.response_text(default_terminate_message),
                ));
            } else if let ToolOutcome::Reply(reply) = &outcome {
                result.user_message = Some(reply.user_message.clone());
            }
            if let ToolOutcome::Terminate(t) = outcome {
                result.terminate = Some(t);
            }
            result
        }
        Err(e) => ToolExecutionResult::error(id.clone(), e.to_string()),
    }
}

/// What a running call asks of the conversation's approvals: a request
/// bound to the call (its ledger key), decided like any other.
struct CallHold<'a> {
    policy: &'a crate::state::PolicyState,
    report: &'a crate::report::CallReport,
    key: &'a str,
    instance: Option<&'a markov_core::ids::InstanceId>,
    call_id: &'a ToolCallId,
    ttl: std::time::Duration,
}

impl markov_core::tool::Hold for CallHold<'_> {
    fn ask(&self, action: &str, args: &Value) -> markov_core::tool::HoldDecision {
        use crate::approvals::HeldCheck;
        use markov_core::tool::HoldDecision;
        let check = self.policy.approvals().check_held(
            self.key,
            self.instance,
            self.call_id,
            action,
            args,
            || Value::Null,
            self.ttl,
            std::time::SystemTime::now(),
        );
        match check {
            HeldCheck::Run(edited) => {
                HoldDecision::Approved(edited.unwrap_or_else(|| args.clone()))
            }
            HeldCheck::Wait(request) => {
                self.report.set_awaiting(request);
                HoldDecision::Waiting
            }
            HeldCheck::Denied(message) => HoldDecision::Denied(message),
            HeldCheck::Answered(result) => HoldDecision::Answered(result),
            HeldCheck::Expired => HoldDecision::Unavailable("the request expired".to_owned()),
            HeldCheck::Full => HoldDecision::Unavailable(format!(
                "{} requests already wait for a decision",
                crate::approvals::MAX_PENDING
            )),
        }
    }

    fn keep(&self, state: Value) -> bool {
        self.policy.approvals().keep_held_state(self.key, state)
    }

    fn kept(&self) -> Option<Value> {
        self.policy.approvals().held_state(self.key)
    }
}

#[cfg(test)]
mod tests {
    use markov_core::message::{ImageData, Item};

    use super::*;

    #[test]
    fn the_images_of_an_outcome_reach_the_tool_result_item() {
        let image = ImageData::new("image/png", "aGVsbG8=");
        let outcome = ToolOutcome::Images {
            text: "a chart".into(),
            images: vec![image.clone()],
        };
        let result = into_result(&ToolCallId::from("t1"), false, Ok(outcome), "Finished");
        assert_eq!(result.content, "a chart");
        assert_eq!(
            result.into_item(true),
            Item::tool_result_with_images("t1", "a chart", Some(false), vec![image])
        );
    }
}

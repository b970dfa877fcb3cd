//! What a durable engine's journal keeps of a model call
//! ([`RecordedAnswer`]) and of a tool call ([`RecordedOutcome`]): one form
//! each, which every engine adapter (Restate's journal, Temporal's
//! workflow history) writes and reads, so the adapters cannot drift apart
//! and a journal written by one release replays under the next.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::message::ImageData;
use crate::model::{ModelError, ModelResponse};
use crate::tool::{TerminateResponse, ToolCallError, ToolOutcome, ToolReply, UserMessage};

/// A tool call's outcome — the tool's value, reply, termination or images,
/// or its failure — in a form that serializes and reads back as the same
/// outcome.
///
/// A durable engine (Restate's journal, Temporal's workflow history) keeps
/// each tool call's outcome so that a replayed handler answers the call
/// without running the tool again; every engine adapter keeps it in this
/// one form, so they cannot drift apart. Its JSON is an object tagged by
/// `kind` (`value`, `reply`, `terminate`, `images`, `invalid_input`,
/// `failed`); journals written in it stay readable.
///
/// ```
/// use markov_core::journal::RecordedOutcome;
/// use markov_core::tool::{ToolCallError, ToolOutcome};
/// use serde_json::json;
///
/// let recorded = RecordedOutcome::of(Ok(ToolOutcome::Value(json!({"a": 1}))));
/// let journal = serde_json::to_value(&recorded).unwrap();
/// assert_eq!(journal, json!({"kind": "value", "value": {"a": 1}}));
/// let read: RecordedOutcome = serde_json::from_value(journal).unwrap();
/// assert_eq!(read.into_result(), Ok(ToolOutcome::Value(json!({"a": 1}))));
///
/// let failed = RecordedOutcome::of(Err(ToolCallError::Execution("down".into())));
/// assert_eq!(failed.into_result(), Err(ToolCallError::Execution("down".into())));
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RecordedOutcome(Repr);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Repr {
    Value {
        value: Value,
    },
    Reply {
        user: UserMessage,
        llm: String,
    },
    Terminate {
        message: Option<String>,
    },
    Images {
        text: String,
        images: Vec<ImageData>,
    },
    InvalidInput {
        message: String,
    },
    Failed {
        message: String,
    },
}

impl RecordedOutcome {
    /// The record of a call's `result`.
    pub fn of(result: Result<ToolOutcome, ToolCallError>) -> Self {
        RecordedOutcome(match result {
            Ok(ToolOutcome::Value(value)) => Repr::Value { value },
            Ok(ToolOutcome::Reply(reply)) => Repr::Reply {
                user: reply.user_message,
                llm: reply.llm_message,
            },
            Ok(ToolOutcome::Terminate(t)) => Repr::Terminate { message: t.message },
            Ok(ToolOutcome::Images { text, images }) => Repr::Images { text, images },
            Err(ToolCallError::InvalidInput(message)) => Repr::InvalidInput { message },
            Err(ToolCallError::Execution(message)) => Repr::Failed { message },
        })
    }

    /// The result it records, as the call returned it.
    pub fn into_result(self) -> Result<ToolOutcome, ToolCallError> {
        match self.0 {
            Repr::Value { value } => Ok(ToolOutcome::Value(value)),
            Repr::Reply { user, llm } => Ok(ToolOutcome::Reply(ToolReply {
                user_message: user,
                llm_message: llm,
            })),
            Repr::Terminate { message } => {
                Ok(ToolOutcome::Terminate(TerminateResponse::new(message)))
            }
            Repr::Images { text, images } => Ok(ToolOutcome::Images { text, images }),
            Repr::InvalidInput { message } => Err(ToolCallError::InvalidInput(message)),
            Repr::Failed { message } => Err(ToolCallError::Execution(message)),
        }
    }
}

/// A model call's result as a journal keeps it: the answer, a failure the
/// machine is told of, or a failure the engine should retry (one
/// [`ModelError::is_retryable`] says is passing).
///
/// Its JSON is `{"ok": <answer>}`, `{"err": {"kind": …, "message": …}}` or
/// `{"retry": <why>}`. An engine's own entry for a step that produced no
/// answer, `{"error": <why>}`, reads as an invalid response with that text
/// (see [`read`](Self::read)).
///
/// ```
/// use markov_core::journal::RecordedAnswer;
/// use markov_core::model::{ModelError, ModelResponse, StopReason};
/// use markov_core::Item;
///
/// let answer = ModelResponse::new(vec![Item::text("hi")], StopReason::EndTurn);
/// let journal = serde_json::to_value(RecordedAnswer::of(Ok(answer.clone()))).unwrap();
/// assert_eq!(RecordedAnswer::read(journal), Ok(answer));
///
/// let overloaded = RecordedAnswer::of(Err(ModelError::Overloaded("busy".into())));
/// assert!(overloaded.retry().is_some(), "the engine retries it");
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RecordedAnswer(AnswerRepr);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum AnswerRepr {
    Ok(ModelResponse),
    Err(Failure),
    Retry(String),
}

/// A model failure as the journal keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Failure {
    Http { status: u16, message: String },
    InvalidResponse { message: String },
    InvalidRequest { message: String },
    ContextLength { message: String },
}

impl RecordedAnswer {
    /// The record of a model call's `result`.
    pub fn of(result: Result<ModelResponse, ModelError>) -> Self {
        RecordedAnswer(match result {
            Ok(response) => AnswerRepr::Ok(response),
            Err(error) if error.is_retryable() => AnswerRepr::Retry(error.to_string()),
            Err(ModelError::Http {
                status, message, ..
            }) => AnswerRepr::Err(Failure::Http { status, message }),
            Err(ModelError::InvalidRequest(message)) => {
                AnswerRepr::Err(Failure::InvalidRequest { message })
            }
            Err(ModelError::ContextLength(message)) => {
                AnswerRepr::Err(Failure::ContextLength { message })
            }
            Err(other) => AnswerRepr::Err(Failure::InvalidResponse {
                message: other.to_string(),
            }),
        })
    }

    /// A call that gave no answer for `message`'s reason (it was
    /// interrupted, or its answer could not be journaled): the machine
    /// reads it as an invalid response.
    pub fn failed(message: impl Into<String>) -> Self {
        RecordedAnswer(AnswerRepr::Err(Failure::InvalidResponse {
            message: message.into(),
        }))
    }

    /// Why the engine should retry the call, when the failure is passing.
    pub fn retry(&self) -> Option<&str> {
        match &self.0 {
            AnswerRepr::Retry(why) => Some(why),
            _ => None,
        }
    }

    /// The result it records, as the machine sees it (a retryable failure
    /// that was not retried reads as an invalid response with its text).
    pub fn into_result(self) -> Result<ModelResponse, ModelError> {
        match self.0 {
            AnswerRepr::Ok(response) => Ok(response),
            AnswerRepr::Retry(message) | AnswerRepr::Err(Failure::InvalidResponse { message }) => {
                Err(ModelError::InvalidResponse(message))
            }
            AnswerRepr::Err(Failure::Http { status, message }) => Err(ModelError::Http {
                status,
                message,
                retry_after: None,
            }),
            AnswerRepr::Err(Failure::InvalidRequest { message }) => {
                Err(ModelError::InvalidRequest(message))
            }
            AnswerRepr::Err(Failure::ContextLength { message }) => {
                Err(ModelError::ContextLength(message))
            }
        }
    }

    /// Reads a journal entry back as the call's result: a recorded answer,
    /// or an engine's `{"error": <why>}` for a step that produced none; any
    /// other entry is an invalid response that says it could not be read.
    pub fn read(value: Value) -> Result<ModelResponse, ModelError> {
        if let Some(why) = value.get("error").and_then(Value::as_str) {
            return Err(ModelError::InvalidResponse(why.to_owned()));
        }
        serde_json::from_value::<RecordedAnswer>(value)
            .map_err(|e| {
                ModelError::InvalidResponse(format!(
                    "a recorded model answer could not be read: {e}"
                ))
            })?
            .into_result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::ImageData;
    use serde_json::json;

    fn round_trip(
        result: Result<ToolOutcome, ToolCallError>,
    ) -> Result<ToolOutcome, ToolCallError> {
        let text = serde_json::to_string(&RecordedOutcome::of(result)).expect("serializes");
        serde_json::from_str::<RecordedOutcome>(&text)
            .expect("reads back")
            .into_result()
    }

    #[test]
    fn every_outcome_reads_back_as_itself() {
        let image = ImageData::new("image/png", "AQID");
        for result in [
            Ok(ToolOutcome::Value(json!({"a": 1}))),
            Ok(ToolOutcome::Value(json!("text"))),
            Ok(ToolOutcome::Reply(ToolReply::new(
                "for you",
                "for the model",
            ))),
            Ok(ToolOutcome::Reply(ToolReply {
                user_message: UserMessage::Data(json!({"n": 2})),
                llm_message: "data".into(),
            })),
            Ok(ToolOutcome::Terminate(TerminateResponse::new(Some(
                "bye".into(),
            )))),
            Ok(ToolOutcome::Terminate(TerminateResponse::new(None))),
            Ok(ToolOutcome::Images {
                text: "a chart".into(),
                images: vec![image],
            }),
            Err(ToolCallError::InvalidInput("missing field".into())),
            Err(ToolCallError::Execution("the service is down".into())),
        ] {
            assert_eq!(round_trip(result.clone()), result);
        }
    }

    /// The form the engines' journals were written in before this type
    /// existed (each adapter had its own copy of it): such a journal still
    /// replays.
    #[test]
    fn journals_in_the_engines_earlier_form_still_read() {
        for (journal, expected) in [
            (
                json!({"kind": "value", "value": 5}),
                Ok(ToolOutcome::Value(json!(5))),
            ),
            (
                json!({"kind": "reply", "user": "hi", "llm": "said hi"}),
                Ok(ToolOutcome::Reply(ToolReply::new("hi", "said hi"))),
            ),
            (
                json!({"kind": "terminate", "message": null}),
                Ok(ToolOutcome::Terminate(TerminateResponse::new(None))),
            ),
            (
                json!({"kind": "invalid_input", "message": "bad"}),
                Err(ToolCallError::InvalidInput("bad".into())),
            ),
            (
                json!({"kind": "failed", "message": "down"}),
                Err(ToolCallError::Execution("down".into())),
            ),
        ] {
            let read: RecordedOutcome = serde_json::from_value(journal).expect("reads");
            assert_eq!(read.into_result(), expected);
        }
    }

    #[test]
    fn every_model_result_reads_back_as_the_machine_should_see_it() {
        use crate::model::StopReason;
        let answer = ModelResponse::new(vec![crate::Item::text("hi")], StopReason::EndTurn);
        for (result, expected) in [
            (Ok(answer.clone()), Ok(answer)),
            (
                Err(ModelError::Http {
                    status: 400,
                    message: "bad".into(),
                    retry_after: None,
                }),
                Err(ModelError::Http {
                    status: 400,
                    message: "bad".into(),
                    retry_after: None,
                }),
            ),
            (
                Err(ModelError::InvalidRequest("no".into())),
                Err(ModelError::InvalidRequest("no".into())),
            ),
            (
                Err(ModelError::ContextLength("long".into())),
                Err(ModelError::ContextLength("long".into())),
            ),
        ] {
            let recorded = RecordedAnswer::of(result);
            assert_eq!(recorded.retry(), None);
            let journal = serde_json::to_value(&recorded).expect("serializes");
            assert_eq!(RecordedAnswer::read(journal), expected);
        }
    }

    #[test]
    fn a_passing_failure_is_the_engines_to_retry() {
        let recorded = RecordedAnswer::of(Err(ModelError::Http {
            status: 503,
            message: "down".into(),
            retry_after: None,
        }));
        assert!(recorded.retry().is_some_and(|why| why.contains("down")));
        assert_eq!(
            serde_json::to_value(&recorded).expect("serializes")["retry"],
            json!(recorded.retry().unwrap_or_default())
        );
    }

    /// The entries the engines wrote before this type existed still read.
    #[test]
    fn model_entries_in_the_engines_earlier_form_still_read() {
        assert_eq!(
            RecordedAnswer::read(json!({"err": {"kind": "context_length", "message": "long"}})),
            Err(ModelError::ContextLength("long".into()))
        );
        assert_eq!(
            RecordedAnswer::read(json!({"error": "the journal failed"})),
            Err(ModelError::InvalidResponse("the journal failed".into()))
        );
        assert!(matches!(
            RecordedAnswer::read(json!({"what": 1})),
            Err(ModelError::InvalidResponse(text)) if text.contains("could not be read")
        ));
    }

    #[test]
    fn an_unknown_kind_is_an_error_not_a_default() {
        assert!(serde_json::from_value::<RecordedOutcome>(json!({"kind": "teleport"})).is_err());
    }
}

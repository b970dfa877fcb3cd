//! markov's standard tools.
//!
//! - [`Respond`] (`respond`): a terminal tool whose output is the text it is
//!   given, for a model that must hand back an exact answer.
//! - [`Finish`] (`finish`): ends the run with an optional note, by returning a
//!   [`TerminateResponse`].
//! - [`registry::standard_registry`]: both as named templates (`finishTool`,
//!   `respondTool`) with display metadata.
//!
//! ```
//! use markov_core::tool::{DynTool, Erased};
//! use markov_tools_std::{Finish, Respond};
//!
//! let respond = Erased::new(Respond).unwrap();
//! assert!(respond.definition().terminal);
//! let finish = Erased::new(Finish).unwrap();
//! assert_eq!(finish.definition().name.as_str(), "finish");
//! ```
#![deny(missing_docs)]

pub mod registry;

use std::convert::Infallible;

use markov_core::async_trait;
use markov_core::tool::{TerminateResponse, Tool, ToolContext};
use schemars::JsonSchema;
use serde::Deserialize;

/// A terminal tool: its output, the given text unchanged, is the machine's response.
#[derive(Debug, Clone, Copy, Default)]
pub struct Respond;

/// The input of the respond tool.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
pub struct RespondArgs {
    /// The exact response to give the user.
    pub text: String,
}

#[async_trait]
impl Tool for Respond {
    const NAME: &'static str = "respond";
    const TERMINAL: bool = true;
    type Args = RespondArgs;
    type Output = String;
    type Error = Infallible;

    fn description(&self) -> String {
        "Give the user this exact response and end the turn.".into()
    }

    async fn call(&self, args: RespondArgs, _cx: &ToolContext<'_>) -> Result<String, Infallible> {
        Ok(args.text)
    }
}

/// Signals that the current task is complete; ends the run.
///
/// A completion tool of your own works the same way: return a
/// [`TerminateResponse`] from `call`.
///
/// ```
/// use std::convert::Infallible;
/// use markov_core::async_trait;
/// use markov_core::tool::{TerminateResponse, Tool, ToolContext};
/// use schemars::JsonSchema;
/// use serde::Deserialize;
///
/// /// Marks the current task as complete.
/// struct CompleteTask;
///
/// #[derive(Deserialize, JsonSchema)]
/// struct CompleteTaskArgs {
///     /// Summary of completed work.
///     summary: String,
/// }
///
/// #[async_trait]
/// impl Tool for CompleteTask {
///     const NAME: &'static str = "complete_task";
///     type Args = CompleteTaskArgs;
///     type Output = TerminateResponse;
///     type Error = Infallible;
///
///     fn description(&self) -> String { "Mark the current task as complete".into() }
///
///     async fn call(&self, args: CompleteTaskArgs, _cx: &ToolContext<'_>)
///         -> Result<TerminateResponse, Infallible>
///     {
///         Ok(TerminateResponse::new(Some(format!("Task completed: {}", args.summary))))
///     }
/// }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct Finish;

/// The input of the finish tool.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
pub struct FinishArgs {
    /// Note about task completion.
    #[serde(default)]
    pub note: Option<String>,
}

#[async_trait]
impl Tool for Finish {
    const NAME: &'static str = "finish";
    type Args = FinishArgs;
    type Output = TerminateResponse;
    type Error = Infallible;

    fn description(&self) -> String {
        "Signal the current task is complete. Call this before ending when output is restricted."
            .into()
    }

    async fn call(
        &self,
        args: FinishArgs,
        _cx: &ToolContext<'_>,
    ) -> Result<TerminateResponse, Infallible> {
        Ok(TerminateResponse::new(args.note))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use markov_core::ToolCallId;
    use markov_core::tool::{DynTool, Erased, NoState, ToolOutcome};
    use serde_json::json;

    #[tokio::test]
    async fn respond_returns_the_text_unchanged() {
        let t = Erased::new(Respond).unwrap();
        let id = ToolCallId::new("c");
        let state = NoState::default();
        let out = t
            .call_json(
                &json!({"text": "1. Apple\n2. Banana"}),
                ToolContext::new(&id, &[], &state),
            )
            .await
            .unwrap();
        assert_eq!(out.response_text("Finished"), "1. Apple\n2. Banana");
    }

    #[tokio::test]
    async fn finish_terminates_with_its_note() {
        let t = Erased::new(Finish).unwrap();
        let id = ToolCallId::new("c");
        let state = NoState::default();
        let cx = ToolContext::new(&id, &[], &state);
        let out = t.call_json(&json!({"note": "all done"}), cx).await.unwrap();
        assert_eq!(
            out,
            ToolOutcome::Terminate(TerminateResponse::new(Some("all done".into())))
        );
        let out = t.call_json(&json!({}), cx).await.unwrap();
        assert_eq!(out.model_text("Finished"), "Finished");
        let schema = &t.definition().input_schema;
        assert!(schema["required"].as_array().is_none_or(|r| r.is_empty()));
    }
}

//! Running one tool call into exactly one result.

use markov_core::ids::ToolCallId;
use markov_core::tool::{
    SharedTool, ToolCallError, ToolContext, ToolExecutionResult, ToolOutcome, UserMessage,
};
use serde_json::Value;
use tracing::Instrument;

/// Runs one call of `tool` (or reports `Unknown tool: <name>` when there is none).
///
/// Never fails: every outcome, including invalid arguments and tool errors, is
/// a [`ToolExecutionResult`] the model can read. A terminal tool's success is
/// marked `is_terminal`, with its response text as the user message.
pub async fn execute_call(
    tool: Option<&SharedTool>,
    id: &ToolCallId,
    name: &str,
    input: Value,
    cx: ToolContext<'_>,
    default_terminate_message: &str,
) -> ToolExecutionResult {
    let Some(tool) = tool else {
        return ToolExecutionResult::error(id.clone(), format!("Unknown tool: {name}"));
    };
    let span = tracing::info_span!("tool_call", tool = name, call_id = %id);
    let outcome = tool.call_json(input, cx).instrument(span.clone()).await;
    let result = into_result(
        id,
        tool.definition().terminal,
        outcome,
        default_terminate_message,
    );
    span.in_scope(|| tracing::debug!(is_error = result.is_error, "tool call finished"));
    result
}

/// Turns a tool's outcome into its result.
pub(crate) fn into_result(
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

//! Running one tool call into exactly one result.

use markov_core::ids::ToolCallId;
use markov_core::tool::{SharedTool, ToolContext, ToolExecutionResult, ToolOutcome};
use serde_json::Value;
use tracing::Instrument;

use crate::toolset::definition;

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
    let terminal = definition(tool.as_ref()).terminal;
    match outcome {
        Ok(outcome) => {
            let mut result = ToolExecutionResult::success(
                id.clone(),
                outcome.model_text(default_terminate_message),
            );
            if terminal {
                result.is_terminal = true;
                result.user_message = Some(markov_core::tool::UserMessage::Text(
                    outcome.response_text(default_terminate_message),
                ));
            } else if let ToolOutcome::Reply(reply) = &outcome {
                result.user_message = Some(reply.user_message.clone());
            }
            if let ToolOutcome::Terminate(t) = outcome {
                result.terminate = Some(t);
            }
            span.in_scope(|| tracing::debug!(is_error = false, "tool call finished"));
            result
        }
        Err(e) => {
            span.in_scope(|| tracing::debug!(is_error = true, error = %e, "tool call failed"));
            ToolExecutionResult::error(id.clone(), e.to_string())
        }
    }
}

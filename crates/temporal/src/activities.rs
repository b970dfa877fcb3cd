//! The activities a worker runs for its workflows: one model call, one
//! tool call.
// The activities macro needs `pub` handlers; the type is the crate's own.
#![allow(unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use markov_core::ToolCallId;
use markov_core::tool::{IdempotencyKey, ToolCallError, ToolContext};
use serde_json::Value;
use temporalio_macros::activities;
use temporalio_sdk::activities::{ActivityContext, ActivityError};

use crate::{
    ModelInput, RecordedOutcome, RecordingState, Steps, ToolInput, call_model, interrupted_value,
    tool_value,
};

/// The worker's side of the steps: it calls the models and tools
/// registered in its [`Steps`].
#[derive(Debug)]
pub struct MarkovActivities {
    pub(crate) steps: Steps,
    /// How often a running call heartbeats.
    pub(crate) heartbeat_every: Duration,
}

/// Runs `work` while heartbeating every `every`, so that Temporal learns of
/// a dead worker within the heartbeat timeout rather than the call timeout.
async fn heartbeating<F: Future<Output = Value>>(
    ctx: &ActivityContext,
    every: Duration,
    work: F,
) -> Value {
    let beat = async {
        loop {
            tokio::time::sleep(every).await;
            if let Err(error) = ctx.record_heartbeat(()).await {
                tracing::warn!(%error, "an activity heartbeat could not be recorded");
            }
        }
    };
    tokio::select! {
        value = work => value,
        never = beat => never,
    }
}

#[activities]
impl MarkovActivities {
    /// One model call: answers `{"ok": response}` or `{"err": failure}`,
    /// and fails (for Temporal to retry) on a retryable failure.
    #[activity]
    pub async fn model(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: Value,
    ) -> Result<Value, ActivityError> {
        let input: ModelInput = match serde_json::from_value(input) {
            Ok(input) => input,
            Err(e) => {
                return Ok(
                    serde_json::json!({ "error": format!("the model call could not be read: {e}") }),
                );
            }
        };
        let Some(model) = self.steps.model_at(input.model) else {
            return Ok(
                serde_json::json!({ "error": format!("this worker has no model {}", input.model) }),
            );
        };
        let value = heartbeating(&ctx, self.heartbeat_every, call_model(&*model, &input)).await;
        if let Some(retry) = value.get("retry").and_then(Value::as_str) {
            return Err(ActivityError::from(anyhow_message(retry)));
        }
        Ok(value)
    }

    /// One tool call: answers `{"outcome": .., "patches": [..]}`, or
    /// `{"interrupted": ..}` for an at-most-once call an earlier attempt
    /// started.
    #[activity]
    pub async fn tool(
        self: Arc<Self>,
        ctx: ActivityContext,
        input: Value,
    ) -> Result<Value, ActivityError> {
        let input: ToolInput = match serde_json::from_value(input) {
            Ok(input) => input,
            Err(e) => {
                return Ok(
                    serde_json::json!({ "error": format!("the tool call could not be read: {e}") }),
                );
            }
        };
        if input.at_most_once && ctx.info().attempt > 1 {
            tracing::warn!(tool = %input.tool, call = %input.call_id, "an at-most-once call started before a crash is answered as interrupted");
            return Ok(interrupted_value());
        }
        let Some(tool) = self.steps.tool_named(&input.tool) else {
            // A worker whose agent no longer has the tool: the model reads why.
            tracing::warn!(tool = %input.tool, "a recorded call names a tool this worker does not have");
            let outcome = RecordedOutcome::from_result(Err(ToolCallError::Execution(format!(
                "the tool `{}` is not available any more",
                input.tool
            ))));
            return Ok(tool_value(outcome, Vec::new()));
        };
        let call_id = ToolCallId::new(input.call_id.as_str());
        let state = RecordingState::new(input.state);
        let key_text = input.idempotency_key.clone().unwrap_or_default();
        let make = move || key_text.clone();
        let key = IdempotencyKey::new(&make);
        let mut cx = ToolContext::new(&call_id, &[], &state);
        if input.idempotency_key.is_some() {
            cx = cx.with_idempotency_key(&key);
        }
        let result = heartbeating(&ctx, self.heartbeat_every, async {
            let outcome = RecordedOutcome::from_result(tool.call_json(&input.args, cx).await);
            serde_json::to_value(outcome).unwrap_or_else(|e| {
                serde_json::json!({ "kind": "failed", "message": format!("the result could not be recorded: {e}") })
            })
        })
        .await;
        let patches = state.into_patches();
        Ok(serde_json::json!({ "outcome": result, "patches": patches }))
    }
}

/// A retryable failure as the error Temporal retries on.
fn anyhow_message(message: &str) -> std::io::Error {
    std::io::Error::other(message.to_owned())
}

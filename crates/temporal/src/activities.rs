//! The activities a worker runs for its workflows: one model call, one
//! tool call.
// The activities macro needs `pub` handlers; the type is the crate's own.
#![allow(unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use markov_core::ToolCallId;
use markov_core::journal::RecordedOutcome;
use markov_core::tool::{CallJournal, IdempotencyKey, ToolCallError, ToolContext};
use serde_json::Value;
use temporalio_macros::activities;
use temporalio_sdk::activities::{ActivityContext, ActivityError};

use crate::records::ActivityRecords;
use crate::{
    ModelInput, RecordingState, Steps, ToolInput, call_model, interrupted_value, tool_value,
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
/// With `records`, each heartbeat carries them, sent as they are (see
/// [`ActivityRecords`]).
async fn heartbeating<F: Future<Output = Value>>(
    ctx: &ActivityContext,
    every: Duration,
    records: Option<&ActivityRecords>,
    work: F,
) -> Value {
    let beat = async {
        loop {
            tokio::time::sleep(every).await;
            let beat = match records {
                Some(records) => records.beat().await,
                None => ctx.record_heartbeat(()).await.map_err(|e| e.to_string()),
            };
            if let Err(error) = beat {
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
        let value = heartbeating(
            &ctx,
            self.heartbeat_every,
            None,
            call_model(&*model, &input),
        )
        .await;
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
        let attempt = ctx.info().attempt;
        let every = self.heartbeat_every;
        Ok(run_tool(&self.steps, input, attempt, Some((&ctx, every))).await)
    }
}

/// Runs the tool call `input` describes on attempt `attempt`, heartbeating
/// through `heartbeat` (an activity's context and how often) while the
/// tool runs, and answers the value the workflow records.
async fn run_tool(
    steps: &Steps,
    input: ToolInput,
    attempt: u32,
    heartbeat: Option<(&ActivityContext, Duration)>,
) -> Value {
    let tool = steps.tool_named(&input.tool);
    // A tool that keeps its side effects in its call's journal (a
    // sub-agent) resumes from it instead, where an activity runs it.
    let resumes = heartbeat.is_some() && tool.as_ref().is_some_and(|t| t.resumes_from_journal());
    if input.at_most_once && attempt > 1 && !resumes {
        tracing::warn!(tool = %input.tool, call = %input.call_id, "an at-most-once call started before a crash is answered as interrupted");
        return interrupted_value();
    }
    let Some(tool) = tool else {
        // A worker whose agent no longer has the tool: the model reads why.
        tracing::warn!(tool = %input.tool, "a recorded call names a tool this worker does not have");
        let outcome = RecordedOutcome::of(Err(ToolCallError::Execution(format!(
            "the tool `{}` is not available any more",
            input.tool
        ))));
        return tool_value(outcome, Vec::new());
    };
    let call_id = ToolCallId::new(input.call_id.as_str());
    let state = RecordingState::new(input.state);
    let key_text = input.idempotency_key.clone().unwrap_or_default();
    let make = move || key_text.clone();
    let key = IdempotencyKey::new(&make);
    let records = match heartbeat {
        Some((ctx, _)) if resumes => Some(Arc::new(ActivityRecords::new(ctx))),
        _ => None,
    };
    let make = records.clone().map(|records| {
        move || -> Arc<dyn CallJournal> { Arc::clone(&records) as Arc<dyn CallJournal> }
    });
    let result = {
        let mut cx = ToolContext::new(&call_id, &[], &state);
        if input.idempotency_key.is_some() {
            cx = cx.with_idempotency_key(&key);
        }
        if let Some(make) = &make {
            cx = cx.with_journal(make);
        }
        let args = &input.args;
        let work = async move {
            let outcome = RecordedOutcome::of(tool.call_json(args, cx).await);
            serde_json::to_value(outcome).unwrap_or_else(|e| {
                serde_json::json!({ "kind": "failed", "message": format!("the result could not be recorded: {e}") })
            })
        };
        match heartbeat {
            Some((ctx, every)) => heartbeating(ctx, every, records.as_deref(), work).await,
            None => work.await,
        }
    };
    let patches = state.into_patches();
    serde_json::json!({ "outcome": result, "patches": patches })
}

/// A retryable failure as the error Temporal retries on.
fn anyhow_message(message: &str) -> std::io::Error {
    std::io::Error::other(message.to_owned())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use markov_core::async_trait;
    use markov_core::tool::Tool;
    use schemars::JsonSchema;
    use serde::Deserialize;
    use serde_json::json;

    use super::*;

    #[derive(Debug, Deserialize, JsonSchema)]
    struct Args {
        n: u32,
    }

    /// Counts its runs and writes `n` to the state.
    struct Count(Arc<AtomicUsize>);

    #[async_trait]
    impl Tool for Count {
        const NAME: &'static str = "count";
        type Args = Args;
        type Output = String;
        type Error = std::convert::Infallible;

        fn description(&self) -> String {
            "Count.".into()
        }

        async fn call(&self, args: Args, cx: &ToolContext<'_>) -> Result<String, Self::Error> {
            self.0.fetch_add(1, Ordering::SeqCst);
            let _ = cx.state_access().update_state(json!({ "n": args.n }));
            Ok(format!(
                "counted {} with {}",
                args.n,
                cx.idempotency_key().unwrap_or("-")
            ))
        }
    }

    fn input(tool: &str, at_most_once: bool) -> ToolInput {
        ToolInput {
            tool: tool.to_owned(),
            args: json!({"n": 3}),
            call_id: "call_1".to_owned(),
            idempotency_key: Some("key-1".to_owned()),
            state: json!({"n": 1}),
            at_most_once,
        }
    }

    fn steps() -> (Steps, Arc<AtomicUsize>) {
        let runs = Arc::new(AtomicUsize::new(0));
        let steps = Steps::new();
        steps.tool(Count(Arc::clone(&runs))).expect("a tool");
        (steps, runs)
    }

    #[tokio::test]
    async fn a_tool_call_answers_its_outcome_and_state_updates() {
        let (steps, runs) = steps();
        let value = run_tool(&steps, input("count", true), 1, None).await;
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(
            value["outcome"]["value"],
            json!("counted 3 with key-1"),
            "{value}"
        );
        assert_eq!(value["patches"], json!([{"n": 3}]));
    }

    #[tokio::test]
    async fn a_second_attempt_of_an_at_most_once_call_does_not_run_it() {
        let (steps, runs) = steps();
        let value = run_tool(&steps, input("count", true), 2, None).await;
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        assert_eq!(value, interrupted_value());
    }

    #[tokio::test]
    async fn a_second_attempt_of_an_at_least_once_call_runs_it_again() {
        let (steps, runs) = steps();
        let value = run_tool(&steps, input("count", false), 2, None).await;
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(value["outcome"]["kind"], "value", "{value}");
    }

    #[tokio::test]
    async fn a_call_to_a_tool_this_worker_lacks_answers_an_error_the_model_reads() {
        let (steps, runs) = steps();
        let value = run_tool(&steps, input("gone", false), 1, None).await;
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        assert_eq!(value["outcome"]["kind"], "failed", "{value}");
        assert!(
            value["outcome"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("`gone` is not available")),
            "{value}"
        );
    }
}

//! The built-in tools the pipeline answers itself, without the tool path:
//! `updateState` (a state patch, checked against the node's schema) and the
//! transition tools (one queued transition per response).

use markov_charter::state::{accumulate_patch, merge_patch};
use markov_charter::toolgen::{TRANSITION, TRANSITION_PREFIX};
use markov_core::tool::ToolExecutionResult;
use serde_json::{Map, Value};

use super::pipeline::{LeafView, PipelineOutcome, QueuedTransition, ToolCall};

pub(super) fn update_state_builtin(
    leaf: &LeafView<'_>,
    call: &ToolCall<'_>,
    running: &mut Value,
    acc: &mut Option<Value>,
) -> ToolExecutionResult {
    let Some(patch) = call.input.get("patch") else {
        return ToolExecutionResult::error(
            call.id.clone(),
            "State update failed: missing field `patch`",
        );
    };
    let merged = match merge_patch(running, patch) {
        Ok(m) => m,
        Err(e) => {
            return ToolExecutionResult::error(
                call.id.clone(),
                format!("State update failed: {e}"),
            );
        }
    };
    match leaf.node.schema().parse(&merged) {
        Ok(parsed) => {
            *running = parsed;
            accumulate_patch(acc, patch);
            ToolExecutionResult::success(call.id.clone(), "State updated successfully")
        }
        Err(msg) => {
            ToolExecutionResult::error(call.id.clone(), format!("State update failed: {msg}"))
        }
    }
}

pub(super) fn queue_transition(
    leaf: &LeafView<'_>,
    call: &ToolCall<'_>,
    result_index: usize,
    out: &mut PipelineOutcome,
) -> ToolExecutionResult {
    if out.transition.is_some() {
        return ToolExecutionResult::error(call.id.clone(), "Only one transition allowed per turn");
    }
    let reason = call
        .input
        .get("reason")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let (name, args) = if call.name == TRANSITION {
        match call.input.get("to").and_then(Value::as_str) {
            Some(to) => (to.to_owned(), Value::Object(Map::new())),
            None => {
                return ToolExecutionResult::error(
                    call.id.clone(),
                    "Invalid tool input: missing string field `to`",
                );
            }
        }
    } else {
        let name = call.name[TRANSITION_PREFIX.len()..].to_owned();
        let mut args = match &call.input {
            Value::Object(m) => m.clone(),
            _ => Map::new(),
        };
        args.remove("reason");
        (name, Value::Object(args))
    };
    if leaf.node.transition(&name).is_none() {
        // Upstream aborts the whole run here; the model can correct a typo.
        return ToolExecutionResult::error(call.id.clone(), format!("Unknown transition: {name}"));
    }
    out.transition = Some(QueuedTransition {
        result_index,
        name: name.clone(),
        reason,
        args,
    });
    ToolExecutionResult::success(
        call.id.clone(),
        format!(
            "Transition to \"{name}\" complete. You are now in the new context - respond to the user."
        ),
    )
}

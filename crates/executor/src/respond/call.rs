//! One resolved tool call through the tool path: the tool's scoped state
//! (its node's, an ancestor's read-only, or its pack's), the registry's
//! policy stack or the plain one, a contained panic, and the error results
//! of calls that are refused before any tool sees them.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

use futures::FutureExt;
use markov_charter::state::accumulate_patch;
use markov_core::tool::{SharedTool, ToolCallError, ToolContext, ToolExecutionResult};
use markov_policy::{
    Mode, PolicyState, RegistrySession, Rejection, ToolErrorKind, ToolOrigin, TurnBudgetState,
    plain_registry, unrecorded_registry,
};
use serde_json::Value;

use super::lookup::{Found, Scope, ScopedState, pack_state};
use super::pipeline::{LeafView, ToolCall, Verdict};

#[allow(clippy::too_many_arguments)]
pub(super) async fn run_found(
    leaf: &LeafView<'_>,
    found: Found<'_>,
    call: &ToolCall<'_>,
    running_state: &mut Value,
    state_patch: &mut Option<Value>,
    running_packs: &mut BTreeMap<String, Value>,
    pack_patches: &mut Vec<(String, Value)>,
) -> FoundRan {
    let intents;
    let awaiting;
    let verdict;
    let mut wrote = None;
    let result = match found {
        Found::Node(tool, scope) => {
            let scoped = match scope {
                Scope::Current => ScopedState::writable(running_state.clone(), leaf.node.schema()),
                Scope::Ancestor(state) => ScopedState::read_only(state.clone()),
            };
            let cx = ToolContext::new(call.id, leaf.history, &scoped)
                .with_instance(leaf.instance_id, leaf.root_id);
            let (mut result, tool_intents, waits, judged) =
                call_tool(leaf, tool, call, cx, ToolOrigin::Node).await;
            intents = tool_intents;
            awaiting = waits;
            verdict = judged;
            let (new_state, patch, refused) = scoped.take();
            if let Some(patch) = patch {
                if leaf.traces.is_some() {
                    wrote = Some(patch.clone());
                }
                // Updates made before a failure are kept, as upstream does.
                *running_state = new_state;
                accumulate_patch(state_patch, &patch);
            }
            if let Some(msg) = refused
                && !result.is_error
            {
                result = ToolExecutionResult::error(
                    call.id.clone(),
                    format!("{}\n\nError: State update failed: {msg}", result.content),
                );
            }
            result
        }
        Found::Pack(tool, pack) => {
            let current = pack_state(running_packs, leaf.pack_states, pack);
            let scoped = ScopedState::writable(current, pack.schema());
            let cx = ToolContext::new(call.id, leaf.history, &scoped)
                .with_instance(leaf.instance_id, leaf.root_id);
            let (result, tool_intents, waits, judged) =
                call_tool(leaf, tool, call, cx, ToolOrigin::Pack).await;
            intents = tool_intents;
            awaiting = waits;
            verdict = judged;
            let (new_state, patch, refused) = scoped.take();
            if let Some(patch) = patch {
                if leaf.traces.is_some() {
                    wrote = Some(patch.clone());
                }
                running_packs.insert(pack.name().to_owned(), new_state);
                match pack_patches.iter_mut().find(|(n, _)| n == pack.name()) {
                    Some((_, acc)) => {
                        let mut a = Some(std::mem::take(acc));
                        accumulate_patch(&mut a, &patch);
                        *acc = a.unwrap_or_default();
                    }
                    None => pack_patches.push((pack.name().to_owned(), patch)),
                }
            }
            match refused {
                // A failed call keeps its own error, as before.
                Some(msg) if !result.is_error => ToolExecutionResult::error(
                    call.id.clone(),
                    format!(
                        "{}\n\nError: Pack state validation failed: {msg}",
                        result.content
                    ),
                ),
                _ => result,
            }
        }
    };
    FoundRan {
        result,
        intents,
        awaiting,
        verdict,
        wrote,
    }
}

/// What [`run_found`] ran.
pub(super) struct FoundRan {
    pub(super) result: ToolExecutionResult,
    pub(super) intents: Vec<Value>,
    pub(super) awaiting: Option<markov_policy::ConfirmationRequest>,
    /// How the call was answered, when the calls are traced.
    pub(super) verdict: Option<Verdict>,
    /// The state patch the call wrote, when the calls are traced.
    pub(super) wrote: Option<Value>,
}

/// The error result of a call the loop guard refused.
pub(super) fn repeated_call(
    leaf: &LeafView<'_>,
    call: &ToolCall<'_>,
    times: u32,
) -> ToolExecutionResult {
    let detail = format!(
        "you have called {} with these same arguments {times} times in this turn. Repeating it will not change the result: use what you have, try something different, or answer the user",
        call.name
    );
    refused(
        leaf,
        call,
        ToolErrorKind::RepeatedCall,
        &detail,
        format!("Not run: {detail}."),
    )
}

/// The error result of `call`, refused for `kind` with `detail`: the
/// registry's envelope when the leaf has policies, else `plain`.
fn refused(
    leaf: &LeafView<'_>,
    call: &ToolCall<'_>,
    kind: ToolErrorKind,
    detail: &str,
    plain: String,
) -> ToolExecutionResult {
    let content = match leaf.policies {
        Some(_) => Rejection::new(kind).with_detail(detail).to_envelope(),
        None => plain,
    };
    ToolExecutionResult::error(call.id.clone(), content)
}

/// The error result of a call whose arguments no tool may see.
pub(super) fn invalid_arguments(
    leaf: &LeafView<'_>,
    call: &ToolCall<'_>,
    detail: &str,
) -> ToolExecutionResult {
    tracing::debug!(
        detail,
        "tool call refused: its arguments are not a JSON object"
    );
    refused(
        leaf,
        call,
        ToolErrorKind::InvalidInput,
        detail,
        ToolCallError::InvalidInput(detail.to_owned()).to_string(),
    )
}

/// Runs `call`'s future; a panic inside it becomes an execution-failed error
/// result, so the process, the machine and the rest of the response live on.
pub(super) async fn contain_panic(
    leaf: &LeafView<'_>,
    call: &ToolCall<'_>,
    run: impl std::future::Future<Output = ToolExecutionResult>,
) -> ToolExecutionResult {
    match std::panic::AssertUnwindSafe(run).catch_unwind().await {
        Ok(result) => result,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(tool = %call.name, panic = %what, "tool panicked");
            let detail = "the tool panicked";
            refused(
                leaf,
                call,
                ToolErrorKind::ExecutionFailed,
                detail,
                ToolCallError::Execution(detail.to_owned()).to_string(),
            )
        }
    }
}

/// Runs one resolved tool through the tool path: the registry's stack when
/// one is set and registers the tool's name, else the plain execute-only
/// stack ([`plain_session`]). Returns the result, the intents of a success,
/// and the request the call waits for when it needs the application's
/// approval.
async fn call_tool(
    leaf: &LeafView<'_>,
    tool: &SharedTool,
    call: &ToolCall<'_>,
    cx: ToolContext<'_>,
    origin: ToolOrigin,
) -> (
    ToolExecutionResult,
    Vec<Value>,
    Option<markov_policy::ConfirmationRequest>,
    Option<Verdict>,
) {
    // A tool the leaf offers but the registry does not register (a node's
    // own `respond` or `finish`, say) has no metadata for the stack's
    // stages, which would refuse every call of it as unknown: what is
    // offered must be callable, so it runs as it would without a registry.
    // A gate set on the conversation (a replay) decides first: its answer
    // stands for the tool's, which then does not run.
    if let Some(gate) = leaf.conversation.and_then(|p| p.call_gate()) {
        let metadata = leaf
            .policies
            .as_ref()
            .and_then(|s| s.registry.metadata(call.name));
        let definition = tool.definition();
        let delivery = metadata
            .and_then(markov_policy::ToolMetadata::delivery)
            .or(definition.delivery)
            .or_else(|| {
                let approval = metadata.is_some_and(|m| m.requires_confirmation())
                    || definition.needs_approval;
                approval.then_some(markov_core::tool::Delivery::AtMostOnce)
            });
        if let markov_policy::CallDecision::Answer {
            content,
            is_error,
            state_updates,
        } = gate.decide(call.name, call.input, metadata, delivery)
        {
            for patch in state_updates {
                // Refused now as then: the state is the one the recorded
                // call wrote to, and its result already says so.
                if let Err(error) = cx.state_access().update_state(patch) {
                    tracing::debug!(%error, "a played-back state patch was refused");
                }
            }
            let result = if is_error {
                ToolExecutionResult::error(call.id.clone(), content)
            } else {
                ToolExecutionResult::success(call.id.clone(), content)
            };
            let verdict = Some((markov_policy::CallOutcome::Answered, None));
            return (result, Vec::new(), None, verdict);
        }
    }
    let (session, plain) = match leaf.policies {
        Some(session) if session.registry.metadata(call.name).is_some() => (session, false),
        _ => (plain_session(leaf), true),
    };
    // Without the ledger's stage, the key a tool may ask for is made here,
    // the same as that stage makes it from the recorded answer.
    let (instance, call_id) = (leaf.instance_id, call.id);
    let make_key = match (plain, leaf.unrecorded, leaf.conversation) {
        (true, Some(answer), Some(policy)) => {
            Some(move || policy.tool_key_at(Some(instance), Some(answer), call_id))
        }
        _ => None,
    };
    let key = make_key
        .as_ref()
        .map(|make| markov_core::tool::IdempotencyKey::new(make));
    let cx = match &key {
        Some(key) => cx.with_idempotency_key(key),
        None => cx,
    };
    let cx = match leaf.usage {
        Some(sink) => cx.with_usage_sink(sink),
        None => cx,
    };
    // Pinned where it is made: the panic guard below holds a reference,
    // not a second copy of the call's future.
    let run = std::pin::pin!(session.run(
        origin,
        Some(tool),
        call.id,
        call.name,
        std::borrow::Cow::Borrowed(call.input),
        cx,
        leaf.terminate_message,
    ));
    let reported = Mutex::new((Vec::new(), None, None));
    let result = contain_panic(leaf, call, async {
        let executed = run.await;
        let verdict = leaf.traces.map(|_| (executed.outcome, executed.approval));
        *reported.lock().unwrap_or_else(|p| p.into_inner()) =
            (executed.intents, executed.awaiting, verdict);
        executed.result
    })
    .await;
    let (intents, awaiting, verdict) = reported.into_inner().unwrap_or_else(|p| p.into_inner());
    (result, intents, awaiting, verdict)
}

/// The tool path of a leaf without a registry: [`plain_registry`]'s stack
/// (the pause of a tool that needs approval, the ledger, the execution),
/// or [`unrecorded_registry`]'s (the execution alone) for an answer nothing
/// can replay; upstream's plain-text errors.
pub(super) fn plain_session<'a>(leaf: &LeafView<'a>) -> RegistrySession<'a> {
    static MODE: OnceLock<Mode> = OnceLock::new();
    static TURN: OnceLock<TurnBudgetState> = OnceLock::new();
    static STATE: OnceLock<PolicyState> = OnceLock::new();
    let registry = match leaf.unrecorded {
        Some(_) => unrecorded_registry(),
        None => plain_registry(),
    };
    registry.session_in(
        MODE.get_or_init(|| Mode::TEXT),
        TURN.get_or_init(TurnBudgetState::new),
        match leaf.conversation {
            Some(state) => state,
            None => STATE.get_or_init(PolicyState::new),
        },
    )
}

//! The studio's routes: a session's recorded steps, one step's exact
//! request, and forking a session at a step. Read by the session's owner
//! and by principals with the developer role; a fork belongs to whoever
//! forked.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Extension, Path, Query, State};
use markov_core::Message;
use markov_core::model::Usage;
use markov_executor::{ModelCall, SubAgentStep, YieldReason};
use markov_policy::ConfirmationRequest;
use markov_store::{
    CreateOptions, DurableMachine, ForkOptions, SessionId, SessionInfo, StepTrace, StoredSession,
};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::auth::{DEVELOPER, Principal};
use crate::wire::{ErrorBody, StepPage, StepRequest, StepSummary, StepView};
use crate::{ApiError, Service, markdown};

pub(crate) mod agents;

type Shared = State<Arc<Service>>;

/// The most steps one page holds.
pub(crate) const MAX_PAGE: usize = 200;

/// Session `id`, loaded, if `principal` may read its steps: its owner or a
/// developer. Anyone else is told it does not exist, as for the session
/// itself.
pub(crate) async fn readable(
    service: &Service,
    principal: &Principal,
    id: &str,
) -> Result<(SessionId, StoredSession), ApiError> {
    let (id, _) = may_read(service, principal, id).await?;
    let stored = service.store.load(&id).await?;
    Ok((id, stored))
}

/// Session `id`'s description, if `principal` may read its steps (see
/// [`readable`]), without loading its history.
pub(crate) async fn may_read(
    service: &Service,
    principal: &Principal,
    id: &str,
) -> Result<(SessionId, SessionInfo), ApiError> {
    let id = SessionId::new(id);
    let info = service.store.info(&id).await?;
    let owner = info.owner.as_ref() == Some(principal.id());
    if !owner && !principal.has_role(DEVELOPER) {
        return Err(ApiError::NotFound(format!("no session {id}")));
    }
    Ok((id, info))
}

/// A page of steps.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct Page {
    /// The first step, from 0 (default 0).
    #[serde(default)]
    from: u64,
    /// How many steps at most (default and most 200).
    limit: Option<usize>,
}

fn history_slice(history: &[Message], from: u64, to: u64) -> &[Message] {
    let from = usize::try_from(from)
        .unwrap_or(usize::MAX)
        .min(history.len());
    let to = usize::try_from(to)
        .unwrap_or(usize::MAX)
        .clamp(from, history.len());
    &history[from..to]
}

/// What every recorded step has, an agent's own (a [`StepTrace`]) and a
/// sub-agent's (a [`SubAgentStep`]), borrowed for [`step_view`].
pub(crate) struct Recorded<'a> {
    yield_reason: &'a YieldReason,
    done: bool,
    model: &'a Option<String>,
    usage: &'a Usage,
    step_ms: u64,
    calls: &'a [ModelCall],
    approvals: &'a [ConfirmationRequest],
}

impl<'a> From<&'a StepTrace> for Recorded<'a> {
    fn from(step: &'a StepTrace) -> Self {
        Recorded {
            yield_reason: &step.yield_reason,
            done: step.done,
            model: &step.model,
            usage: &step.usage,
            step_ms: step.step_ms,
            calls: &step.calls,
            approvals: &step.approvals,
        }
    }
}

impl<'a> From<&'a SubAgentStep> for Recorded<'a> {
    fn from(step: &'a SubAgentStep) -> Self {
        Recorded {
            yield_reason: &step.yield_reason,
            done: step.done,
            model: &step.model,
            usage: &step.usage,
            step_ms: step.step_ms,
            calls: &step.calls,
            approvals: &step.approvals,
        }
    }
}

/// How a step is shown: whether with its stored thinking (the agent says
/// whether it may be), and whether the server encodes its request as the
/// wire body (it has an encoder for the step's agent).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Showing {
    /// Stored thinking is shown.
    pub(crate) thinking: bool,
    /// The request is shown as the wire body too, where it can be rebuilt.
    pub(crate) wire: bool,
}

/// What `step` shows: `messages` are the ones it added, `has_request`
/// whether its request can be rebuilt; its sub-agents are added by the
/// caller.
pub(crate) fn step_view(
    step: Recorded<'_>,
    messages: &[Message],
    has_request: bool,
    showing: Showing,
) -> StepView {
    let call = step.calls.first();
    StepView {
        yield_reason: step.yield_reason.as_str().to_owned(),
        done: step.done,
        model: step.model.clone(),
        node: call.map(|c| c.node.clone()),
        tool_choice: call.map(|c| json!(c.tool_choice)),
        tools: call.map_or(0, |c| c.tools.len()),
        usage: json!(step.usage),
        step_ms: step.step_ms,
        model_ms: step.calls.iter().map(|c| c.model_ms).sum(),
        tools_ms: step.calls.iter().map(|c| c.tools_ms).sum(),
        has_request,
        wire: has_request && showing.wire,
        messages: markdown::shown(messages, showing.thinking),
        approvals: step.approvals.to_vec(),
        // Each call's tool calls with their time and the policy's decision
        // (none for a call recorded before tool calls were traced).
        tool_calls: step
            .calls
            .iter()
            .flat_map(|call| &call.tool_calls)
            .filter_map(|trace| serde_json::to_value(trace).ok())
            .collect(),
        sub_agents: Vec::new(),
    }
}

/// Step `step`'s summary, over `messages`, the history from message
/// `first` on (covering the step's own messages), of a session whose whole
/// history has `total` messages.
fn summary(
    step: &StepTrace,
    messages: &[Message],
    first: u64,
    total: u64,
    showing: Showing,
) -> StepSummary {
    // What `StepTrace::request` needs: a call that saw the history as it
    // is or recorded its view's shape, and that much history.
    let has_request = step
        .calls
        .first()
        .is_some_and(|c| (!c.context_view || c.view.is_some()) && c.history_len <= total);
    let added = history_slice(
        messages,
        step.history_from.saturating_sub(first),
        step.history_to.saturating_sub(first),
    );
    StepSummary {
        index: step.index,
        recorded_at: step.recorded_at,
        step: step_view(step.into(), added, has_request, showing),
        team: None,
    }
}

#[utoipa::path(get, path = "/sessions/{id}/steps", tag = "studio",
    params(("id" = String, Path, description = "The session"), Page),
    responses((status = 200, description = "A page of the session's recorded steps, in order: \
        per step its yield reason, model, node, tool choice, usage, latency (whole step, model, \
        tools), the messages it added (the answer, its tool calls and their results, assistant \
        text also as sanitized `html`) and the approvals it left waiting. `next` is where the \
        next page starts, absent on the last page. For the session's owner and developers.",
                  body = StepPage),
              (status = 400, description = "A bad `from` or `limit`", body = ErrorBody),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 404, description = "No such session the caller may read", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn steps(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    page: Result<Query<Page>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<StepPage>, ApiError> {
    let Query(page) = page.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    let limit = page.limit.unwrap_or(MAX_PAGE);
    if limit == 0 || limit > MAX_PAGE {
        return Err(ApiError::BadRequest(format!(
            "limit is 1 to {MAX_PAGE} (got {limit})"
        )));
    }
    let (id, info) = may_read(&service, &principal, &id).await?;
    if let Some(team) = agents::team_page(&service, &id, &info, page.from, limit).await? {
        return Ok(Json(team));
    }
    // One more than asked says whether another page follows.
    let mut traces = service.store.steps(&id, page.from, limit + 1).await?;
    let next = (traces.len() > limit).then(|| {
        traces.truncate(limit);
        traces.last().map_or(page.from, |s| s.index + 1)
    });
    // The history only when there are steps to show it for: a page that
    // polls for new steps of a long session and finds none reads no
    // message.
    // Only the messages the page's steps added are read, so a page costs
    // the same at step 10 as at step 10 000.
    let steps = if traces.is_empty() {
        Vec::new()
    } else {
        let first = traces.iter().map(|s| s.history_from).min().unwrap_or(0);
        let last = traces.iter().map(|s| s.history_to).max().unwrap_or(first);
        let count = usize::try_from(last.saturating_sub(first)).unwrap_or(usize::MAX);
        let messages = service.store.messages(&id, first, count).await?;
        let total = info.messages.max(last);
        let earlier = agents::earlier_steps(&*service.store, &id, page.from, &traces).await?;
        // Stored thinking was never checked by the output guards: the
        // studio shows it only where the chat would (its owner reads it
        // here too). An agent this server does not serve shows none.
        let showing = Showing {
            thinking: service
                .agents
                .get(&info.charter)
                .is_some_and(|agent| agent.shows_stored_thinking()),
            wire: service.hooks.wire.contains_key(&info.charter),
        };
        traces
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut shown = summary(s, &messages, first, total, showing);
                if !s.sub_agents.is_empty() {
                    shown.step.sub_agents = agents::sub_agents(
                        s,
                        &agents::before(&earlier, &traces, i),
                        &|name| service.hooks.wire.contains_key(name),
                        showing.thinking,
                    );
                }
                shown
            })
            .collect()
    };
    Ok(Json(StepPage {
        steps,
        next,
        replayable: service.replays.contains_key(&info.charter),
        wire: service.hooks.wire.contains_key(&info.charter),
        exportable: service.hooks.case_export.is_some(),
        team: None,
    }))
}

/// One recorded step, read by `principal`.
pub(crate) async fn step_of(
    service: &Service,
    principal: &Principal,
    id: &str,
    n: u64,
) -> Result<(SessionId, StoredSession, StepTrace), ApiError> {
    let (id, stored) = readable(service, principal, id).await?;
    let step = service
        .store
        .steps(&id, n, 1)
        .await?
        .into_iter()
        .find(|s| s.index == n)
        .ok_or_else(|| ApiError::NotFound(format!("session {id} recorded no step {n}")))?;
    Ok((id, stored, step))
}

/// Replaces the values of fields named as credentials are (`api_key`,
/// `authorization`, `password`, ...), at any depth, so that a key a tool
/// argument or setting carried is never shown. Names are matched whole:
/// `max_tokens` is a setting, not a token.
pub(crate) fn redact(value: &mut Value) {
    const SECRET: [&str; 11] = [
        "api_key",
        "apikey",
        "x-api-key",
        "authorization",
        "proxy-authorization",
        "password",
        "secret",
        "client_secret",
        "token",
        "access_token",
        "refresh_token",
    ];
    match value {
        Value::Object(map) => {
            for (key, field) in map.iter_mut() {
                let lower = key.to_ascii_lowercase();
                if SECRET.contains(&lower.as_str()) && !field.is_null() {
                    *field = Value::String("<redacted>".into());
                } else {
                    redact(field);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact),
        _ => {}
    }
}

#[utoipa::path(get, path = "/sessions/{id}/steps/{n}/request", tag = "studio",
    params(("id" = String, Path, description = "The session"),
           ("n" = u64, Path, description = "The step, from 0")),
    responses((status = 200, description = "The step's first model call as the model received \
        it: system prompt, messages, tools, tool choice, settings (`request`, its credential-like \
        fields redacted), and the node that called", body = StepRequest),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 404, description = "No such session the caller may read, or no such step", body = ErrorBody),
              (status = 409, description = "The step made no model call, or was recorded under a \
                  context policy before views were, so its request cannot be rebuilt", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn step_request(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path((id, n)): Path<(String, u64)>,
) -> Result<Json<StepRequest>, ApiError> {
    let (id, stored, step) = step_of(&service, &principal, &id, n).await?;
    let history = &stored.snapshot.history;
    let sent = step.request(history).ok_or_else(|| {
        ApiError::Conflict(format!(
            "step {n} of session {id} has no request to rebuild (no model call, or recorded \
             under a context policy before views were)"
        ))
    })?;
    let request = sent.as_request();
    let messages: Vec<Value> = request
        .messages()
        .iter()
        .map(|m| {
            let mut value = serde_json::to_value(m).unwrap_or(Value::Null);
            if let Some(object) = value.as_object_mut() {
                object.remove("metadata");
            }
            value
        })
        .collect();
    let mut body = json!({
        "system": request.system(),
        "messages": messages,
        "tools": request.tools(),
        "provider_tools": request.provider_tools(),
        "tool_choice": request.tool_choice(),
        "settings": request.settings(),
        "output_schema": request.output_schema(),
    });
    redact(&mut body);
    Ok(Json(StepRequest {
        step: n,
        node: step
            .calls
            .first()
            .map(|c| c.node.clone())
            .unwrap_or_default(),
        request: body,
    }))
}

/// How to replay.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub(crate) struct Replay {
    /// `recorded_where_unchanged` (the default: the recorded answer while
    /// the request is unchanged, the live model from where it differs) or
    /// `live` (the live model throughout).
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    mode: Option<markov_store::ReplayMode>,
}

#[utoipa::path(post, path = "/sessions/{id}/replay", tag = "studio",
    params(("id" = String, Path, description = "The session")),
    request_body = Replay,
    responses((status = 200, description = "The session's user turns asked again of the agent as \
        the server runs it now, in memory (nothing is stored): each step beside the recorded one \
        (`steps`: requests, answer text, tool calls, usage, where the answer came from, whether \
        request and answer changed), `parted_at` the first step where the runs part, \
        `tool_calls` each tool call and how it was answered: `recorded` (the recorded result, \
        the tool did not run), `live` (it ran) or `refused` (an action tool the recording \
        lacks, not run)",
                  body = Object),
              (status = 400, description = "Not a replay body", body = ErrorBody),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 403, description = "A signed-in browser's request without its Origin", body = ErrorBody),
              (status = 404, description = "No such session the caller may read", body = ErrorBody),
              (status = 409, description = "The server replays no session of this agent", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn replay(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Result<Json<Replay>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(Replay { mode }) = body?;
    let (id, stored) = readable(&service, &principal, &id).await?;
    let replayer = service.replays.get(&stored.info.charter).ok_or_else(|| {
        ApiError::Conflict(format!(
            "this server replays no session of agent {:?}",
            stored.info.charter
        ))
    })?;
    let build = Arc::clone(&replayer.build);
    let report = markov_store::replay(
        &*service.store,
        &id,
        Arc::clone(&replayer.live),
        move |model| build(model),
        mode.unwrap_or_default(),
    )
    .await?;
    tracing::info!(session = %id, by = %principal.id().as_str(), parted_at = ?report.parted_at, "replayed a session");
    let mut report = serde_json::to_value(&report)
        .map_err(|e| ApiError::Internal(format!("the replay's report: {e}")))?;
    redact(&mut report);
    Ok(Json(report))
}

/// How to fork.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct Fork {
    /// Replaces the text of the user message the step answered.
    #[serde(default)]
    pub(crate) edit_user: Option<String>,
}

/// Forks session `id` at step `n` for `principal`, who may read its steps:
/// the new session's id and its machine, leased to this worker, its run
/// still to start.
pub(crate) async fn fork(
    service: &Service,
    principal: &Principal,
    id: &str,
    n: u64,
    edit_user: Option<String>,
) -> Result<(SessionId, String, DurableMachine<dyn markov_store::Store>), ApiError> {
    let (source, stored) = readable(service, principal, id).await?;
    let agent = service.agents.get(&stored.info.charter).ok_or_else(|| {
        ApiError::NotFound(format!(
            "session {source} runs agent {:?}, which this server does not serve",
            stored.info.charter
        ))
    })?;
    let new = SessionId::random();
    let forked = DurableMachine::fork(
        Arc::clone(&service.store),
        &source,
        n,
        new.clone(),
        service.worker.clone(),
        agent,
        ForkOptions {
            create: CreateOptions::default()
                .owner(principal.id().clone())
                .lease(service.lease),
            edit_user,
        },
    )
    .await
    .map_err(|e| match e {
        markov_store::DurableError::Store(markov_store::StoreError::Corrupt { detail, .. }) => {
            ApiError::Conflict(detail)
        }
        markov_store::DurableError::Store(markov_store::StoreError::NotFound(_)) => {
            ApiError::NotFound(format!("session {source} recorded no step {n}"))
        }
        other => ApiError::from(other),
    })?;
    tracing::info!(source = %source, step = n, fork = %new, by = %principal.id().as_str(), "forked a session");
    Ok((new, agent.name().to_owned(), forked))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_redacted_at_any_depth_and_settings_are_not() {
        let mut body = json!({
            "settings": {"max_tokens": 100, "temperature": null},
            "messages": [{"items": [{"input": {"Api_Key": "sk-1", "amount": 4,
                "nested": {"password": "hunter2", "token": null}}}]}],
            "Authorization": "Bearer x",
        });
        redact(&mut body);
        assert_eq!(
            body,
            json!({
                "settings": {"max_tokens": 100, "temperature": null},
                "messages": [{"items": [{"input": {"Api_Key": "<redacted>", "amount": 4,
                    "nested": {"password": "<redacted>", "token": null}}}]}],
                "Authorization": "<redacted>",
            })
        );
    }
}

//! The studio's view of several agents: the steps a sub-agent ran, under
//! the tool call that ran it (nested as the sub-agents were), with the
//! request of each rebuilt from the sub-agent's recorded history; and a
//! team conversation's steps, every agent's, in one timeline in the order
//! they ran, each labelled with its agent and the handoffs marked.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Extension, Path, State};
use markov_core::Message;
use markov_core::ids::ToolCallId;
use markov_core::model::{ModelRequest, Usage};
use markov_executor::team::{HAND_BACK, TRANSFER_PREFIX};
use markov_executor::{Agent, HandoffRecord, ModelCall, SentRequest};
use markov_store::{SessionId, SessionInfo, StepTrace, StoreError, SubAgentTrace, agent_session};
use serde_json::{Value, json};

use super::{Showing, may_read, redact, step_view, summary};
use crate::auth::Principal;
use crate::wire::{
    ErrorBody, HandoffEvent, StepPage, StepRequest, SubAgentRun, SubAgentStepSummary, TeamStep,
    TeamTimeline,
};
use crate::{ApiError, Service};

/// How many of the caller's steps before a step the sub-agents' history is
/// looked for in: a sub-agent that waited for an approval goes on in the
/// caller's next step, so its history is split between the two.
pub(super) const SUB_AGENT_LOOKBACK: u64 = 8;

/// Why a team conversation's steps are neither forked nor replayed.
const TEAM_NO_FORK: &str = "Forking and replaying are not offered in a team conversation: each \
    agent's session holds only its own part, and a fork or replay of one would leave out the \
    team's state (who holds the conversation, the handoffs) and the other agents' parts.";

/// The sub-agents `step`'s tool calls ran, each under its call, nested as
/// they ran; `earlier` holds the caller's steps before `step`, oldest
/// first (where a sub-agent's history before this step is looked for),
/// and `wired` says whether the server has an encoder for a sub-agent.
pub(super) fn sub_agents(
    step: &StepTrace,
    earlier: &[&StepTrace],
    wired: &dyn Fn(&str) -> bool,
    thinking: bool,
) -> Vec<SubAgentRun> {
    if step.sub_agents.is_empty() {
        return Vec::new();
    }
    let under = Under {
        step,
        earlier,
        wired,
        thinking,
    };
    let mut runs = runs_under(&under, &[]);
    // A step of a sub-agent always has a call above it; one whose call is
    // nowhere in the steps above (a trace cut short) is shown at the top
    // rather than dropped.
    let shown = count_steps(&runs);
    if shown < step.sub_agents.len() {
        tracing::debug!(
            step = step.index,
            missing = step.sub_agents.len() - shown,
            "sub-agent steps whose calling step is not recorded: shown under the step"
        );
        for (at, entry) in step.sub_agents.iter().enumerate() {
            if !contains(&runs, at) {
                runs.push(SubAgentRun {
                    call_id: entry
                        .calls
                        .last()
                        .map(ToString::to_string)
                        .unwrap_or_default(),
                    agent: entry.step.agent.clone(),
                    usage: json!(entry.step.usage),
                    steps: vec![sub_step(&under, at, Vec::new())],
                });
            }
        }
    }
    runs
}

fn count_steps(runs: &[SubAgentRun]) -> usize {
    runs.iter()
        .flat_map(|r| &r.steps)
        .map(|s| 1 + count_steps(&s.step.sub_agents))
        .sum()
}

fn contains(runs: &[SubAgentRun], at: usize) -> bool {
    runs.iter()
        .flat_map(|r| &r.steps)
        .any(|s| s.at == at || contains(&s.step.sub_agents, at))
}

/// A caller's step whose sub-agents are shown: the caller's steps before
/// it (oldest first), whether the server has an encoder for a sub-agent
/// (by its tool name), and whether stored thinking is shown.
struct Under<'a> {
    step: &'a StepTrace,
    earlier: &'a [&'a StepTrace],
    wired: &'a dyn Fn(&str) -> bool,
    thinking: bool,
}

/// The runs of the sub-agents called at depth `path.len()` under the calls
/// `path` (the step's own calls for an empty path), in the order their
/// first step ended.
fn runs_under(under: &Under<'_>, path: &[ToolCallId]) -> Vec<SubAgentRun> {
    let step = under.step;
    let mut runs: Vec<(ToolCallId, Vec<usize>)> = Vec::new();
    for (at, entry) in step.sub_agents.iter().enumerate() {
        let Some((call, above)) = entry.calls.split_last() else {
            continue;
        };
        if above != path {
            continue;
        }
        match runs.iter_mut().find(|(c, _)| c == call) {
            Some((_, ats)) => ats.push(at),
            None => runs.push((call.clone(), vec![at])),
        }
    }
    runs.into_iter()
        .map(|(call, ats)| {
            let mut nested = {
                let mut deeper = path.to_vec();
                deeper.push(call.clone());
                runs_under(under, &deeper)
            };
            let mut steps: Vec<SubAgentStepSummary> = Vec::with_capacity(ats.len());
            let mut usage = Usage::default();
            for &at in &ats {
                let entry = &step.sub_agents[at].step;
                usage += entry.usage;
                // The nested runs this step called (or answered, for a
                // call it resumed).
                let (mine, rest): (Vec<_>, Vec<_>) = nested
                    .into_iter()
                    .partition(|run| mentions(&entry.messages, &run.call_id));
                nested = rest;
                steps.push(sub_step(under, at, mine));
            }
            // Runs under a call none of these steps shows (its answer was
            // in the caller's earlier step) go under the last step.
            if let Some(last) = steps.last_mut() {
                last.step.sub_agents.extend(nested);
            }
            SubAgentRun {
                call_id: call.to_string(),
                agent: ats
                    .first()
                    .map(|&at| step.sub_agents[at].step.agent.clone())
                    .unwrap_or_default(),
                usage: json!(usage),
                steps,
            }
        })
        .collect()
}

/// Whether `messages` call or answer the tool call `id`.
fn mentions(messages: &[Message], id: &str) -> bool {
    messages
        .iter()
        .flat_map(Message::item_list)
        .any(|item| match item {
            markov_core::Item::ToolUse { id: used, .. } => used.as_str() == id,
            markov_core::Item::ToolResult { tool_use_id, .. } => tool_use_id.as_str() == id,
            _ => false,
        })
}

/// The summary of `step`'s sub-agent step `at`, with the runs it called.
fn sub_step(under: &Under<'_>, at: usize, sub_agents: Vec<SubAgentRun>) -> SubAgentStepSummary {
    let entry = &under.step.sub_agents[at].step;
    let has_request = sub_history(under.step, under.earlier, at).is_some();
    let showing = Showing {
        thinking: under.thinking,
        wire: (under.wired)(&entry.agent),
    };
    let mut step = step_view(entry.into(), &entry.messages, has_request, showing);
    step.sub_agents = sub_agents;
    SubAgentStepSummary {
        at,
        agent: entry.agent.clone(),
        step,
    }
}

/// The sub-agent's history as its step `at` of `step` called the model
/// with it (at least the part that call was sent), put together from the
/// sub-agent's steps recorded up to it, in `earlier` (the caller's steps
/// before `step`, oldest first) and in `step`: `None` when that step made
/// no model call, when a context policy chose what the call was shown, or
/// when part of that history is not among them.
pub(super) fn sub_history<'a>(
    step: &'a StepTrace,
    earlier: &[&'a StepTrace],
    at: usize,
) -> Option<Vec<&'a Message>> {
    let target: &SubAgentTrace = step.sub_agents.get(at)?;
    let call = target.step.calls.first().filter(|c| !c.context_view)?;
    let need = usize::try_from(call.history_len).ok()?;
    let before = earlier
        .iter()
        .flat_map(|s| s.sub_agents.iter())
        // Its own step too: the input its run was given comes first in it.
        .chain(step.sub_agents.get(..=at).unwrap_or_default())
        .filter(|e| e.calls == target.calls);
    let mut history: Vec<&Message> = Vec::new();
    // Whether `history` holds the sub-agent's history from its start.
    let mut whole = true;
    for entry in before {
        let from = usize::try_from(entry.step.history_from).ok()?;
        if from == 0 {
            history.clear();
            whole = true;
        } else if from > history.len() {
            // A step of the sub-agent is missing (kept elsewhere, or cut
            // by retention).
            whole = false;
            continue;
        } else {
            history.truncate(from);
        }
        history.extend(entry.step.messages.iter());
    }
    (whole && history.len() >= need).then(|| {
        history.truncate(need);
        history
    })
}

/// The caller's steps just before a page of steps that starts at `from`
/// (`page`), read when a step near the page's start ran a sub-agent, whose
/// history may have begun before the page.
pub(super) async fn earlier_steps(
    store: &dyn markov_store::Store,
    id: &SessionId,
    from: u64,
    page: &[StepTrace],
) -> Result<Vec<StepTrace>, ApiError> {
    let near = page
        .iter()
        .take(usize::try_from(SUB_AGENT_LOOKBACK).unwrap_or(usize::MAX))
        .any(|s| !s.sub_agents.is_empty());
    if from == 0 || !near {
        return Ok(Vec::new());
    }
    let first = from.saturating_sub(SUB_AGENT_LOOKBACK);
    let count = usize::try_from(from - first).unwrap_or(usize::MAX);
    Ok(store.steps(id, first, count).await?)
}

/// The caller's steps before step `i` of `page`, at most
/// [`SUB_AGENT_LOOKBACK`] of them, oldest first: from `earlier` (the steps
/// just before the page) and the page itself.
pub(super) fn before<'a>(
    earlier: &'a [StepTrace],
    page: &'a [StepTrace],
    i: usize,
) -> Vec<&'a StepTrace> {
    let lookback = usize::try_from(SUB_AGENT_LOOKBACK).unwrap_or(usize::MAX);
    let mut steps: Vec<&StepTrace> = earlier
        .iter()
        .chain(page.get(..i).unwrap_or_default())
        .collect();
    let cut = steps.len().saturating_sub(lookback);
    steps.drain(..cut);
    steps
}

/// A request as the studio shows it: system prompt, messages (without
/// their metadata), tools, tool choice, settings, credential-like fields
/// redacted.
fn request_body(request: &ModelRequest<'_>) -> Value {
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
    body
}

#[utoipa::path(get, path = "/sessions/{id}/steps/{n}/sub_agents/{at}/request", tag = "studio",
    params(("id" = String, Path, description = "The session"),
           ("n" = u64, Path, description = "The step, from 0"),
           ("at" = usize, Path, description = "The sub-agent step: its `at` in the step's `sub_agents`")),
    responses((status = 200, description = "A sub-agent's step's model call as the sub-agent's \
        model received it (`request`: system prompt, messages, tools, tool choice, settings, \
        credential-like fields redacted), rebuilt from the sub-agent's history recorded with \
        its caller's steps, and the node that called", body = StepRequest),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 404, description = "No such session the caller may read, step, or sub-agent step", body = ErrorBody),
              (status = 409, description = "The sub-agent's step made no model call, a context \
                  policy chose what it showed the model, or the sub-agent's history before it \
                  is not recorded in the caller's steps read", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn sub_agent_request(
    State(service): State<Arc<Service>>,
    Extension(principal): Extension<Principal>,
    Path((id, n, at)): Path<(String, u64, usize)>,
) -> Result<Json<StepRequest>, ApiError> {
    let sub = sub_agent_call(&service, &principal, &id, n, at).await?;
    let sent = sub.request()?;
    Ok(Json(StepRequest {
        step: n,
        node: sub.call.node.clone(),
        request: request_body(&sent.as_request()),
    }))
}

/// A sub-agent's step's model call, with the sub-agent's history it was
/// sent (rebuilt from the caller's recorded steps).
pub(crate) struct SubAgentCall {
    /// The sub-agent's tool name.
    pub(crate) agent: String,
    /// Its first model call.
    pub(crate) call: ModelCall,
    /// The sub-agent's history as the call saw it.
    history: Vec<Message>,
    /// Which step it is, in words, for an error.
    what: String,
}

impl SubAgentCall {
    /// The request as the sub-agent's model received it.
    pub(crate) fn request(&self) -> Result<SentRequest<'_>, ApiError> {
        self.call.request(&self.history).ok_or_else(|| {
            ApiError::Conflict(format!(
                "{} has no request to rebuild (a context policy chose what the model was \
                 shown)",
                self.what
            ))
        })
    }
}

/// Sub-agent step `at` of step `n` of session `id`, read by `principal`:
/// `404` when there is no such step the caller may read, `409` when it
/// made no model call or the sub-agent's history before it is not in the
/// caller's steps read.
pub(crate) async fn sub_agent_call(
    service: &Service,
    principal: &Principal,
    id: &str,
    n: u64,
    at: usize,
) -> Result<SubAgentCall, ApiError> {
    let (id, _) = may_read(service, principal, id).await?;
    let first = n.saturating_sub(SUB_AGENT_LOOKBACK);
    let window = usize::try_from(n - first + 1).unwrap_or(usize::MAX);
    let mut traces = service.store.steps(&id, first, window).await?;
    let position = traces
        .iter()
        .position(|s| s.index == n)
        .ok_or_else(|| ApiError::NotFound(format!("session {id} recorded no step {n}")))?;
    traces.truncate(position + 1);
    let (step, earlier) = traces
        .split_last()
        .ok_or_else(|| ApiError::NotFound(format!("session {id} recorded no step {n}")))?;
    let earlier: Vec<&StepTrace> = earlier.iter().collect();
    let entry = step.sub_agents.get(at).ok_or_else(|| {
        ApiError::NotFound(format!(
            "step {n} of session {id} ran no sub-agent step {at}"
        ))
    })?;
    let what = format!("sub-agent step {at} of step {n} of session {id}");
    let conflict = || {
        ApiError::Conflict(format!(
            "{what} has no request to rebuild (no model call, a context policy chose what the \
             model was shown, or the sub-agent's history before it is not recorded here)"
        ))
    };
    let history: Vec<Message> = sub_history(step, &earlier, at)
        .ok_or_else(conflict)?
        .into_iter()
        .cloned()
        .collect();
    let call = entry.step.calls.first().ok_or_else(conflict)?.clone();
    Ok(SubAgentCall {
        agent: entry.step.agent.clone(),
        call,
        history,
        what,
    })
}

/// A page of a team conversation's timeline: `None` when session `id`
/// (described by `info`) is not a team conversation this server serves.
///
/// Positions in the timeline are found by merging the agents' steps from
/// the first, so a page reads up to `from + limit + 1` steps of each agent
/// (the messages only of the steps it shows).
pub(super) async fn team_page(
    service: &Service,
    id: &SessionId,
    info: &SessionInfo,
    from: u64,
    limit: usize,
) -> Result<Option<StepPage>, ApiError> {
    if service.teams.is_empty() {
        return Ok(None);
    }
    let Some(record) = service.store.team_state(id).await? else {
        return Ok(None);
    };
    let Some((_, team)) = crate::team::served_team(service, id, &info.charter, &record) else {
        return Ok(None);
    };
    let state = record.state();
    let handoffs: Vec<(usize, &HandoffRecord)> = state.handoffs_at().collect();
    let from_at = usize::try_from(from).unwrap_or(usize::MAX);
    let want = from_at.saturating_add(limit).saturating_add(1);
    let mut agents: Vec<(String, SessionId, Vec<StepTrace>)> = Vec::new();
    for name in team.names() {
        let session = if name == team.entry() {
            id.clone()
        } else {
            agent_session(id, name)
        };
        let steps = match service.store.steps(&session, 0, want).await {
            Ok(steps) => steps,
            // An agent that never had the conversation has no session.
            Err(StoreError::NotFound(_)) => Vec::new(),
            Err(e) => return Err(e.into()),
        };
        agents.push((name.to_owned(), session, steps));
    }
    let lists: Vec<(&str, &[StepTrace])> = agents
        .iter()
        .map(|(name, _, steps)| (name.as_str(), steps.as_slice()))
        .collect();
    let records: Vec<&HandoffRecord> = handoffs.iter().map(|(_, r)| *r).collect();
    let order = merge(team.entry(), &lists, &records);
    let mut shown: Vec<&Placed> = order.iter().skip(from_at).take(limit + 1).collect();
    let next = (shown.len() > limit).then(|| {
        shown.truncate(limit);
        from + limit as u64
    });
    // Each agent's messages for the steps shown, read once per agent.
    let mut messages: Vec<Option<(u64, Vec<Message>, u64)>> = vec![None; agents.len()];
    for (a, (_, session, steps)) in agents.iter().enumerate() {
        let mine: Vec<&StepTrace> = shown
            .iter()
            .filter(|p| p.agent == a)
            .map(|p| &steps[p.step])
            .collect();
        if mine.is_empty() {
            continue;
        }
        let first = mine.iter().map(|s| s.history_from).min().unwrap_or(0);
        let last = mine.iter().map(|s| s.history_to).max().unwrap_or(first);
        let count = usize::try_from(last.saturating_sub(first)).unwrap_or(usize::MAX);
        let read = service.store.messages(session, first, count).await?;
        let total = service.store.info(session).await?.messages.max(last);
        messages[a] = Some((first, read, total));
    }
    let steps = shown
        .iter()
        .enumerate()
        .map(|(i, placed)| {
            let (name, session, traces) = &agents[placed.agent];
            let trace = &traces[placed.step];
            let (first, read, total) = messages[placed.agent]
                .as_ref()
                .map_or((0, &[][..], 0), |(f, m, t)| (*f, m.as_slice(), *t));
            // Each agent's stored thinking shows only where that agent
            // allows it (its output guards never saw it).
            // Its wire body is its agent's session's: encoded as that
            // agent's requests are.
            let showing = Showing {
                thinking: team.agent(name).is_some_and(Agent::shows_stored_thinking),
                wire: service.hooks.wire.contains_key(name),
            };
            let mut shown = summary(trace, read, first, total, showing);
            let earlier = placed.step.saturating_sub(SUB_AGENT_LOOKBACK as usize);
            let before: Vec<&StepTrace> = traces[earlier..placed.step].iter().collect();
            shown.step.sub_agents = sub_agents(
                trace,
                &before,
                &|name| service.hooks.wire.contains_key(name),
                showing.thinking,
            );
            shown.index = from + i as u64;
            shown.team = Some(TeamStep {
                agent: name.clone(),
                session: session.to_string(),
                step: trace.index,
                handoff: placed
                    .handoff
                    .and_then(|h| handoffs.get(h))
                    .map(|(at, record)| HandoffEvent {
                        from: record.from.clone(),
                        to: record.to.clone(),
                        reason: record.reason.clone(),
                        at: *at,
                    }),
            });
            shown
        })
        .collect();
    Ok(Some(StepPage {
        steps,
        next,
        replayable: false,
        wire: team
            .names()
            .any(|name| service.hooks.wire.contains_key(name)),
        exportable: false,
        team: Some(TeamTimeline {
            agents: team.names().map(str::to_owned).collect(),
            no_fork: TEAM_NO_FORK.to_owned(),
        }),
    }))
}

/// A step's place in a team's timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Placed {
    /// The agent, by its place in the lists merged.
    agent: usize,
    /// The step, by its place in the agent's list.
    step: usize,
    /// The handoff (by its place among the conversation's) that gave the
    /// agent the conversation before this step.
    handoff: Option<usize>,
}

/// Whether `step` ended its agent's run with a handoff: a run that ended
/// with a handoff tool called (or, for a step whose tool calls were not
/// traced, any run that ended).
fn hands_over(step: &StepTrace) -> bool {
    if !step.done {
        return false;
    }
    let mut traced = step.calls.iter().flat_map(|c| &c.tool_calls).peekable();
    if traced.peek().is_none() {
        return true;
    }
    traced.any(|t| t.tool == HAND_BACK || t.tool.starts_with(TRANSFER_PREFIX))
}

/// The agents' steps (`agents`: each agent's name and its steps in order)
/// in the order they ran: the agent holding the conversation goes on
/// until a step of another was recorded earlier, and a step that handed
/// over (the next of `handoffs`, in order, from its agent) passes the
/// conversation to the agent it names, whose next step is marked with
/// the handoff. Steps recorded in the same millisecond so keep the order
/// the handoffs say.
fn merge(entry: &str, agents: &[(&str, &[StepTrace])], handoffs: &[&HandoffRecord]) -> Vec<Placed> {
    let total = agents.iter().map(|(_, steps)| steps.len()).sum();
    let mut order = Vec::with_capacity(total);
    let mut next = vec![0usize; agents.len()];
    let find = |name: &str| agents.iter().position(|(n, _)| *n == name);
    let mut holder = find(entry).unwrap_or(0);
    let mut h = 0;
    // The handoff to mark on its agent's next step.
    let mut marked: Option<(usize, usize)> = None;
    while order.len() < total {
        let head = |a: usize| agents[a].1.get(next[a]);
        let Some((earliest, first)) = (0..agents.len())
            .filter_map(|a| head(a).map(|s| (s.recorded_at, a)))
            .min()
        else {
            break;
        };
        let a = match head(holder) {
            Some(step) if step.recorded_at <= earliest => holder,
            _ => first,
        };
        holder = a;
        let step = &agents[a].1[next[a]];
        let handoff = match marked {
            Some((handoff, to)) if to == a => {
                marked = None;
                Some(handoff)
            }
            _ => None,
        };
        order.push(Placed {
            agent: a,
            step: next[a],
            handoff,
        });
        next[a] += 1;
        if hands_over(step)
            && let Some(record) = handoffs.get(h)
            && record.from == agents[a].0
        {
            if let Some(to) = find(&record.to) {
                marked = Some((h, to));
                holder = to;
            }
            h += 1;
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(index: u64, at: u64, done: bool) -> StepTrace {
        let mut trace: StepTrace = serde_json::from_value(json!({
            "index": index, "recorded_at": at, "yield_reason": "end_turn", "done": done,
            "usage": {}, "step_ms": 0, "history_from": 0, "history_to": 0, "calls": [],
        }))
        .expect("a trace");
        trace.done = done;
        trace
    }

    fn handoff(from: &str, to: &str) -> HandoffRecord {
        HandoffRecord {
            from: from.into(),
            to: to.into(),
            reason: String::new(),
        }
    }

    #[test]
    fn steps_of_the_same_millisecond_follow_the_handoffs_and_later_ones_the_clock() {
        // Triage hands to billing, billing answers and hands back, triage
        // answers; all in one millisecond but the last turn.
        let triage = [step(0, 5, true), step(1, 5, true), step(2, 9, true)];
        let billing = [step(0, 5, false), step(1, 5, true)];
        let there = handoff("triage", "billing");
        let back = handoff("billing", "triage");
        let order = merge(
            "triage",
            &[("billing", &billing), ("triage", &triage)],
            &[&there, &back],
        );
        let seen: Vec<(usize, usize, Option<usize>)> =
            order.iter().map(|p| (p.agent, p.step, p.handoff)).collect();
        assert_eq!(
            seen,
            [
                (1, 0, None),
                (0, 0, Some(0)),
                (0, 1, None),
                (1, 1, Some(1)),
                (1, 2, None)
            ]
        );
    }

    #[test]
    fn a_sub_agents_history_is_put_together_across_the_callers_steps() {
        let call = ToolCallId::new("call-1");
        let sub = |from: u64, texts: &[&str], history_len: Option<u64>| -> SubAgentTrace {
            let calls = match history_len {
                Some(len) => json!([{
                    "instance": "root", "node": "n", "system": "s", "tools": [],
                    "tool_choice": markov_core::model::ToolChoice::Auto,
                    "settings": markov_core::model::ModelSettings::default(),
                    "history_len": len,
                    "model_ms": 0, "tools_ms": 0
                }]),
                None => json!([]),
            };
            serde_json::from_value(json!({
                "calls": [call.to_string()],
                "step": {
                    "agent": "clerk", "yield_reason": "end_turn", "done": false,
                    "usage": {}, "step_ms": 0, "history_from": from,
                    "messages": texts.iter().map(|t| Message::user(*t)).collect::<Vec<_>>(),
                    "calls": calls,
                }
            }))
            .expect("a sub-agent trace")
        };
        let mut paused = step(0, 1, true);
        paused.sub_agents = vec![sub(0, &["ask", "answer"], Some(1))];
        let mut resumed = step(1, 2, true);
        resumed.sub_agents = vec![sub(2, &["result"], None), sub(3, &["done"], Some(3))];
        let history = sub_history(&resumed, &[&paused], 1).expect("whole");
        let texts: Vec<String> = history.iter().map(|m| m.text()).collect();
        assert_eq!(texts, ["ask", "answer", "result"]);
        // Without the caller's earlier step, its start is missing.
        assert!(sub_history(&resumed, &[], 1).is_none());
        // A step without a model call has no request.
        assert!(sub_history(&resumed, &[&paused], 0).is_none());
    }
}

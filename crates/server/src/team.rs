//! Team conversations served: a session of a team the server serves
//! (`ServerBuilder::team`) is a [`DurableTeam`]. Its turns run like an
//! agent's (one at a time, in a task of their own, streamed, cancellable,
//! bounded by the run deadline, interrupted by a shutdown and continued
//! after it), with `step` and `done` events naming the agent and a
//! `handoff` event for each handoff. A tool call that needs approval
//! pauses the turn with the agent that made it: the session shows the
//! calls waiting, the conversation's decision route decides them, and the
//! last decision resumes the turn with that agent. Commands are refused:
//! a command changes one agent's machine outside any turn, which the
//! conversation's record of who holds it would not follow.

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use markov_executor::{Agent, Team};
use markov_policy::{ApprovalId, ConfirmationRequest, Decision};
use markov_store::{
    CreateOptions, DurableTeam, SessionId, SessionInfo, Store, TeamEvent, TeamRecord, TeamReply,
    member_session,
};
use serde_json::json;

use crate::auth::Principal;
use crate::runs::{RunGuard, RunLog, StopCause};
use crate::wire::{
    DecidedEvent, DoneEvent, ErrorBody, HandoffEvent, InterruptedEvent, LiveRun, NewSession,
    RunEvent, SessionDetail, StepEvent, TeamDetail,
};
use crate::{ApiError, Service, markdown};

/// The separator of an agent's own session in a team conversation
/// (`markov_store::agent_session`).
const AGENT_SESSION: char = '~';

/// The first team served whose entry agent is named `charter`, with the
/// name it is served as.
fn team_of_charter<'a>(service: &'a Service, charter: &str) -> Option<(&'a str, &'a Team)> {
    service.teams.iter().find_map(|(name, team)| {
        team.agent(team.entry())
            .filter(|agent| agent.name() == charter)
            .map(|_| (name.as_str(), team))
    })
}

/// The team served that conversation `id`, whose entry agent is
/// `charter`, is with: the one named in its `record` (a team served under
/// another name, or whose entry agent is not `charter`, is none, with a
/// log line). A conversation stored before teams were named is matched by
/// its entry agent's name, with a log line saying so.
pub(crate) fn served_team<'a>(
    service: &'a Service,
    id: &SessionId,
    charter: &str,
    record: &TeamRecord,
) -> Option<(&'a str, &'a Team)> {
    match record.team() {
        Some(stored) => {
            let found = service
                .teams
                .get_key_value(stored)
                .filter(|(_, team)| {
                    team.agent(team.entry())
                        .is_some_and(|agent| agent.name() == charter)
                })
                .map(|(name, team)| (name.as_str(), team));
            if found.is_none() {
                tracing::warn!(session = %id, team = stored, charter, "a conversation with a team this server does not serve (or whose entry agent is another)");
            }
            found
        }
        None => {
            let found = team_of_charter(service, charter);
            if let Some((name, _)) = found {
                tracing::info!(session = %id, team = name, charter, "a team conversation stored without its team's name is matched by its entry agent's name");
            }
            found
        }
    }
}

/// The entry agent named `charter` of one of the teams served: a team
/// conversation's session runs on it. (The other agents' own sessions are
/// the team's business: not served one by one.)
pub(crate) fn agent_named<'a>(service: &'a Service, charter: &str) -> Option<&'a Agent> {
    team_of_charter(service, charter).and_then(|(_, team)| team.agent(team.entry()))
}

/// Creates a conversation with `team` (served as `name`), the caller's.
pub(crate) async fn create(
    service: &Service,
    principal: &Principal,
    name: &str,
    team: &Team,
) -> Result<Response, ApiError> {
    let id = SessionId::random();
    let session = DurableTeam::create_with(
        Arc::clone(&service.store),
        id.clone(),
        service.worker.clone(),
        team.clone(),
        CreateOptions::default()
            .owner(principal.id().clone())
            .lease(service.lease),
    )
    .await?;
    session.release().await?;
    Ok((
        StatusCode::CREATED,
        Json(NewSession {
            id: id.to_string(),
            agent: name.to_owned(),
        }),
    )
        .into_response())
}

/// A list of sessions as a user sees it: a team conversation is one
/// session, of the team (its agents' own sessions are left out).
pub(crate) async fn list(
    service: &Service,
    sessions: &mut Vec<SessionInfo>,
) -> Result<(), ApiError> {
    if service.teams.is_empty() {
        return Ok(());
    }
    let ids: std::collections::HashSet<String> =
        sessions.iter().map(|s| s.id.to_string()).collect();
    sessions.retain(|s| {
        !s.id
            .as_str()
            .rsplit_once(AGENT_SESSION)
            .is_some_and(|(conversation, _)| ids.contains(conversation))
    });
    for session in sessions.iter_mut() {
        if service.agents.contains_key(&session.charter) {
            continue;
        }
        let entries = service
            .teams
            .values()
            .filter(|team| {
                team.agent(team.entry())
                    .is_some_and(|agent| agent.name() == session.charter)
            })
            .count();
        // Teams sharing an entry agent are told apart by the name stored
        // with each conversation; a lone one needs no read.
        let name = match entries {
            0 => None,
            1 => team_of_charter(service, &session.charter).map(|(name, _)| name),
            _ => match service.store.team_state(&session.id).await? {
                Some(record) => served_team(service, &session.id, &session.charter, &record)
                    .map(|(name, _)| name),
                None => None,
            },
        };
        if let Some(name) = name {
            session.charter = name.to_owned();
        }
    }
    Ok(())
}

/// Session `id` as a team conversation of the caller's: `None` when it is
/// not one (or the server serves no team); "not found" when it is
/// another principal's.
async fn conversation<'a>(
    service: &'a Service,
    principal: &Principal,
    id: &str,
) -> Result<Option<(SessionId, &'a str, &'a Team)>, ApiError> {
    if service.teams.is_empty() {
        return Ok(None);
    }
    let id = SessionId::new(id);
    let info = service.store.info(&id).await?;
    if info.owner.as_ref() != Some(principal.id()) {
        return Err(ApiError::NotFound(format!("no session {id}")));
    }
    let Some(record) = service.store.team_state(&id).await? else {
        return Ok(None);
    };
    Ok(served_team(service, &id, &info.charter, &record).map(|(name, team)| (id, name, team)))
}

/// Refuses (`409`) a command on a team conversation: a command changes
/// one agent's machine outside any turn, and the conversation's record of
/// which agent holds it and what each has seen would not follow.
pub(crate) async fn refuse_command(
    service: &Service,
    principal: &Principal,
    id: &str,
) -> Result<(), ApiError> {
    match conversation(service, principal, id).await? {
        Some((id, name, _)) => Err(ApiError::Conflict(format!(
            "session {id} is a conversation with team {name:?}: it takes messages and \
             decisions on tool calls, no commands (a command would change one agent's \
             machine outside the team's turn)"
        ))),
        None => Ok(()),
    }
}

/// The stored calls of a team conversation's paused turn still waiting
/// for a decision, unexpired (the agent holding it made them), and
/// whether the turn is paused. `None` when `id` is not a team
/// conversation.
async fn waiting(
    service: &Service,
    id: &SessionId,
    team: &Team,
    record: &markov_store::TeamRecord,
) -> Result<(Vec<ConfirmationRequest>, bool), ApiError> {
    if !record.is_turn_pending() {
        return Ok((Vec::new(), false));
    }
    let current = record.state().current();
    let stored = service
        .store
        .load(&member_session(id, team, current))
        .await?;
    let paused = stored.snapshot.policy.answers.iter().any(|a| a.paused);
    let pending = crate::wire::pending(&stored.snapshot.policy.approvals)
        .into_iter()
        .cloned()
        .collect();
    Ok((pending, paused))
}

/// `GET /sessions/{id}/approvals` of a team conversation: the calls
/// waiting for a decision. `None` when `id` is not one.
pub(crate) async fn approvals(
    service: &Service,
    principal: &Principal,
    id: &str,
) -> Result<Option<Vec<ConfirmationRequest>>, ApiError> {
    let Some((id, _, team)) = conversation(service, principal, id).await? else {
        return Ok(None);
    };
    let record = service
        .store
        .team_state(&id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no session {id}")))?;
    Ok(Some(waiting(service, &id, team, &record).await?.0))
}

/// The agent other than `current` whose stored machine has request `id`
/// (a call of a turn that went on after its decision), if one has.
async fn decided_before(
    service: &Service,
    conversation: &SessionId,
    team: &Team,
    current: &str,
    id: &ApprovalId,
) -> Option<String> {
    for agent in team.names().filter(|name| *name != current) {
        // An agent that never held the conversation has no session: none.
        let Ok(stored) = service
            .store
            .load(&member_session(conversation, team, agent))
            .await
        else {
            continue;
        };
        if stored
            .snapshot
            .policy
            .approvals
            .iter()
            .any(|r| r.request.request_id == *id)
        {
            return Some(agent.to_owned());
        }
    }
    None
}

/// `POST /sessions/{id}/approvals/{request}` on a team conversation: the
/// decision of `principal` on a call of the agent holding it, written;
/// then, once no call waits, the paused turn resumed with that agent (and
/// any handoff after it). Returns the log to stream (`decided` first).
/// `None` when `id` is not a team conversation.
pub(crate) async fn decide(
    service: &Arc<Service>,
    principal: &Principal,
    id: &str,
    request: &str,
    decision: Decision,
) -> Result<Option<Arc<RunLog>>, ApiError> {
    let Some((id, _, team)) = conversation(service, principal, id).await? else {
        return Ok(None);
    };
    // One decision at a time: of two racing, the second is a 409 here, or
    // refused as already decided below.
    let guard = claim(service, &id)?;
    let mut session = open(service, &id, team).await?;
    let request_id = ApprovalId::from(request);
    let tool = session.approval_tool(&request_id);
    if tool.is_none()
        && let Some(agent) =
            decided_before(service, &id, team, session.current(), &request_id).await
    {
        let current = session.current().to_owned();
        session.release().await?;
        return Err(ApiError::Conflict(format!(
            "request {request} is agent {agent:?}'s, already decided: the conversation is \
             held by {current:?} now"
        )));
    }
    if let Some(role) = tool.as_ref().and_then(|t| service.approval_roles.get(t))
        && !principal.has_role(role)
    {
        session.release().await?;
        return Err(ApiError::Forbidden(format!(
            "deciding on calls of `{}` needs the `{role}` role",
            tool.unwrap_or_default()
        )));
    }
    let name = decision.as_str();
    let decided = match session
        .decide_by(&request_id, decision, principal.id().as_str())
        .await
    {
        Ok(request) => request,
        Err(error) => {
            session.release().await?;
            return Err(error.into());
        }
    };
    let waiting = session.pending().len();
    let event = RunEvent::Decided(DecidedEvent {
        request_id: decided.request_id.to_string(),
        decision: name.to_owned(),
        tool: decided.tool,
        waiting,
    });
    let work = if waiting == 0 && session.is_awaiting_approval() {
        Work::Resume
    } else {
        Work::Nothing
    };
    Ok(Some(spawn(service, guard, session, Some(event), work)))
}

/// `GET /sessions/{id}` of a team conversation: its texts, who wrote
/// each, the handoffs, the agent holding it. `None` when `id` is not one.
pub(crate) async fn show(
    service: &Service,
    principal: &Principal,
    id: &str,
) -> Result<Option<SessionDetail>, ApiError> {
    let Some((id, name, team)) = conversation(service, principal, id).await? else {
        return Ok(None);
    };
    let record = service
        .store
        .team_state(&id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no session {id}")))?;
    let state = record.state();
    let (pending_approvals, awaiting_approval) = waiting(service, &id, team, &record).await?;
    let live = service.runs.get(&id).filter(|log| !log.is_finished());
    let live_run = live.as_ref().map(|log| {
        let (last_event_id, history_len, message) = log.join();
        LiveRun {
            last_event_id,
            history_len,
            message,
        }
    });
    // The history is looked up after the run: a turn that ends in between
    // shows its answer in the history and no run to follow.
    let stored = service.store.info(&id).await?;
    Ok(Some(SessionDetail {
        id: id.to_string(),
        agent: name.to_owned(),
        history: markdown::shown(state.transcript(), shows_stored_thinking(team)),
        state: json!({}),
        pending_approvals,
        awaiting_approval,
        usage: json!({}),
        running: live.is_some(),
        // A turn paused for approval is in progress, not interrupted.
        interrupted: (record.is_turn_pending() && !awaiting_approval) || stored.running,
        live_run,
        team: Some(TeamDetail {
            agents: team.names().map(str::to_owned).collect(),
            current_agent: state.current().to_owned(),
            speakers: state
                .speakers()
                .into_iter()
                .map(|s| s.map(str::to_owned))
                .collect(),
            handoffs: state
                .handoffs_at()
                .map(|(at, record)| HandoffEvent {
                    from: record.from.clone(),
                    to: record.to.clone(),
                    reason: record.reason.clone(),
                    at,
                })
                .collect(),
        }),
    }))
}

/// `POST /sessions/{id}/messages` to a team conversation: runs the turn
/// and returns its log to stream. `None` when `id` is not one.
pub(crate) async fn message(
    service: &Arc<Service>,
    principal: &Principal,
    id: &str,
    text: String,
) -> Result<Option<Arc<RunLog>>, ApiError> {
    let Some((id, _, team)) = conversation(service, principal, id).await? else {
        return Ok(None);
    };
    let guard = claim(service, &id)?;
    let session = open(service, &id, team).await?;
    let waiting = session.pending().len();
    if waiting > 0 {
        let agent = session.current().to_owned();
        session.release().await?;
        return Err(ApiError::Conflict(format!(
            "session {id} waits for the decision on {waiting} tool call(s) of agent {agent:?}: \
             decide them first"
        )));
    }
    Ok(Some(spawn(
        service,
        guard,
        session,
        None,
        Work::Message(text),
    )))
}

/// Continues the team turn session `id` (claimed as a session whose run
/// was in progress) takes part in, if it is a team conversation or one of
/// its agents' sessions: `false` if it is neither.
pub(crate) async fn continue_interrupted(
    service: &Arc<Service>,
    id: &SessionId,
) -> Result<bool, ApiError> {
    if service.teams.is_empty() {
        return Ok(false);
    }
    let conversation = match id.as_str().rsplit_once(AGENT_SESSION) {
        Some((conversation, _)) => SessionId::new(conversation),
        None => id.clone(),
    };
    let Some(record) = service.store.team_state(&conversation).await? else {
        return Ok(false);
    };
    let info = service.store.info(&conversation).await?;
    let Some((_, team)) = served_team(service, &conversation, &info.charter, &record) else {
        return Err(ApiError::NotFound(format!(
            "session {conversation} is a conversation of a team this server does not serve"
        )));
    };
    let guard = claim(service, &conversation)?;
    let session = open(service, &conversation, team).await?;
    spawn(service, guard, session, None, Work::Resume);
    service.metrics.runs_continued.inc();
    Ok(true)
}

/// The run of conversation `id`, claimed: a conversation runs one turn at
/// a time.
fn claim(service: &Service, id: &SessionId) -> Result<RunGuard, ApiError> {
    service.runs.claim(id).ok_or_else(|| {
        ApiError::Conflict(format!(
            "session {id} is running; wait for its run to end, or cancel it"
        ))
    })
}

async fn open(
    service: &Service,
    id: &SessionId,
    team: &Team,
) -> Result<DurableTeam<dyn Store>, ApiError> {
    Ok(DurableTeam::open_with(
        Arc::clone(&service.store),
        id.clone(),
        service.worker.clone(),
        team.clone(),
        service.lease,
    )
    .await?)
}

/// What a team conversation's run does.
enum Work {
    /// Nothing more (a decision that leaves calls waiting): the session
    /// is released.
    Nothing,
    /// Finish the turn in progress: one a restart interrupted, or one
    /// paused for approval whose calls are all decided.
    Resume,
    /// Run the turn of this message (finishing the one before first).
    Message(String),
}

/// Performs `work` in a task of its own, logging `first`, then the turn's
/// events; returns the log.
fn spawn(
    service: &Arc<Service>,
    guard: RunGuard,
    mut session: DurableTeam<dyn Store>,
    first: Option<RunEvent>,
    work: Work,
) -> Arc<RunLog> {
    let log = Arc::clone(guard.log());
    if let Some(event) = first {
        log.record(event);
    }
    let text = match &work {
        Work::Message(text) => Some(text.clone()),
        _ => None,
    };
    log.start(
        session.cancel_token(),
        session.state().transcript().len(),
        text.clone(),
    );
    session.interrupt_when(service.shutdown.child_token());
    // A turn's handoffs come after its user message, before its answer.
    let at = session.state().transcript().len() + usize::from(text.is_some());
    let thinking = shows_stored_thinking(session.team());
    let service = Arc::clone(service);
    let task_log = Arc::clone(&log);
    let id = session.id().clone();
    tokio::spawn(crate::runs::RUN_LOG.scope(Arc::clone(&log), async move {
        let log = task_log;
        let started = Instant::now();
        service.metrics.running.inc();
        let deadline = {
            let (log, limit, id) = (Arc::clone(&log), service.limits.run_deadline, id.clone());
            tokio::spawn(async move {
                tokio::time::sleep(limit).await;
                if log.stop(StopCause::Deadline) {
                    tracing::warn!(session = %id, ?limit, "a team turn passed its deadline: it is cancelled");
                }
            })
        };
        // How many first messages of the next step a handoff gave.
        let mut given = 0;
        let on_event = |event: TeamEvent<'_>| match event {
            TeamEvent::Step { agent, step } => {
                service.metrics.steps.inc();
                let mut event = StepEvent::of(step, thinking);
                // The thinking as it was streamed, checked, unless the stored one is shown.
                log.show_thinking(&mut event.messages, !thinking);
                event.agent = Some(agent.to_owned());
                event.handoff_context = std::mem::take(&mut given);
                log.record(RunEvent::Step(event));
            }
            TeamEvent::Handoff { handoff, context } => {
                given = context.len();
                log.record(RunEvent::Handoff(HandoffEvent {
                    from: handoff.from.clone(),
                    to: handoff.to.clone(),
                    reason: handoff.reason.clone(),
                    at,
                }));
            }
            _ => {}
        };
        let result = match work {
            Work::Message(text) => session.send_each(text, on_event).await.map(Some),
            Work::Resume => session.resume_each(on_event).await,
            Work::Nothing => Ok(None),
        };
        let released = session.release().await;
        let result: Result<Option<TeamReply>, ApiError> = match (result, released) {
            (Err(error), _) | (Ok(_), Err(error)) => Err(error.into()),
            (Ok(reply), Ok(())) => Ok(reply),
        };
        deadline.abort();
        let outcome = match result {
            Ok(Some(reply)) if reply.interrupted => {
                log.record(RunEvent::Interrupted(InterruptedEvent {
                    yield_reason: reply
                        .step
                        .as_ref()
                        .map_or("interrupted", |s| s.yield_reason.as_str())
                        .to_owned(),
                    reason: "the server is shutting down: the turn continues when it is back"
                        .into(),
                }));
                "interrupted"
            }
            Ok(Some(reply)) => {
                let step = reply.step.as_ref();
                let cancelled =
                    step.is_some_and(|s| s.yield_reason == markov_executor::YieldReason::Cancelled);
                let stopped = cancelled.then(|| log.cause().map_or("cancelled", StopCause::as_str));
                let unstepped = if reply.awaiting_approval {
                    "awaiting_approval"
                } else {
                    "end_turn"
                };
                log.record(RunEvent::Done(DoneEvent {
                    done: !reply.awaiting_approval && step.is_none_or(|s| s.done),
                    response: reply.answer.clone(),
                    yield_reason: step
                        .map_or(unstepped, |s| s.yield_reason.as_str())
                        .to_owned(),
                    awaiting_approval: reply.awaiting_approval,
                    stopped: stopped.map(str::to_owned),
                    usage_limit: step.and_then(|s| s.usage_limit.map(|l| l.to_string())),
                    usage: step.map_or(json!({}), |s| json!(s.totals)),
                    agent: Some(reply.agent.clone()),
                }));
                stopped.unwrap_or("done")
            }
            Ok(None) => "nothing",
            Err(error) => {
                tracing::warn!(session = %id, %error, "a team turn failed");
                log.record(RunEvent::Error(ErrorBody {
                    error: error.to_string(),
                }));
                "error"
            }
        };
        service.metrics.run_ended(outcome, started.elapsed());
        service.metrics.running.dec();
        drop(guard);
    }));
    log
}

/// Whether a team conversation may show the thinking its history keeps:
/// only when every agent of the team may (the transcript mixes them).
fn shows_stored_thinking(team: &Team) -> bool {
    team.names()
        .filter_map(|name| team.agent(name))
        .all(Agent::shows_stored_thinking)
}

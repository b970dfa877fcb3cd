//! Team conversations served: a session of a team the server serves
//! (`ServerBuilder::team`) is a [`DurableTeam`]. Its turns run like an
//! agent's (one at a time, in a task of their own, streamed, cancellable,
//! bounded by the run deadline, interrupted by a shutdown and continued
//! after it), with `step` and `done` events naming the agent and a
//! `handoff` event for each handoff.

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use markov_executor::{Agent, Team};
use markov_store::{
    CreateOptions, DurableTeam, SessionId, SessionInfo, Store, TeamEvent, TeamReply,
};
use serde_json::json;

use crate::auth::Principal;
use crate::runs::{RunGuard, RunLog, StopCause};
use crate::wire::{
    DoneEvent, ErrorBody, HandoffEvent, InterruptedEvent, LiveRun, NewSession, RunEvent,
    SessionDetail, StepEvent, TeamDetail,
};
use crate::{ApiError, Service, markdown};

/// The separator of an agent's own session in a team conversation
/// (`markov_store::agent_session`).
const AGENT_SESSION: char = '~';

/// The team whose entry agent is named `charter`, with the name it is
/// served as.
fn team_of_charter<'a>(service: &'a Service, charter: &str) -> Option<(&'a str, &'a Team)> {
    service.teams.iter().find_map(|(name, team)| {
        team.agent(team.entry())
            .filter(|agent| agent.name() == charter)
            .map(|_| (name.as_str(), team))
    })
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
pub(crate) fn list(service: &Service, sessions: &mut Vec<SessionInfo>) {
    if service.teams.is_empty() {
        return;
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
        if !service.agents.contains_key(&session.charter)
            && let Some((name, _)) = team_of_charter(service, &session.charter)
        {
            session.charter = name.to_owned();
        }
    }
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
    let Some((name, team)) = team_of_charter(service, &info.charter) else {
        return Ok(None);
    };
    if service.store.team_state(&id).await?.is_none() {
        return Ok(None);
    }
    Ok(Some((id, name, team)))
}

/// Refuses (`409`) `what` on a team conversation, which runs one agent's
/// machine after another: a decision or a command goes to one machine,
/// which the team's turn would not follow.
pub(crate) async fn refuse(
    service: &Service,
    principal: &Principal,
    id: &str,
    what: &str,
) -> Result<(), ApiError> {
    match conversation(service, principal, id).await? {
        Some((id, name, _)) => Err(ApiError::Conflict(format!(
            "session {id} is a conversation with team {name:?}, which takes messages only: no {what}"
        ))),
        None => Ok(()),
    }
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
        pending_approvals: Vec::new(),
        awaiting_approval: false,
        usage: json!({}),
        running: live.is_some(),
        interrupted: record.is_turn_pending() || stored.running,
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
    Ok(Some(spawn(service, guard, session, Some(text))))
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
    if service.store.team_state(&conversation).await?.is_none() {
        return Ok(false);
    }
    let info = service.store.info(&conversation).await?;
    let Some((_, team)) = team_of_charter(service, &info.charter) else {
        return Err(ApiError::NotFound(format!(
            "session {conversation} is a conversation of a team this server does not serve"
        )));
    };
    let guard = claim(service, &conversation)?;
    let session = open(service, &conversation, team).await?;
    spawn(service, guard, session, None);
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

/// Runs the turn of `text` (or, without one, finishes the turn a restart
/// interrupted) in a task of its own, logging its events; returns the log.
fn spawn(
    service: &Arc<Service>,
    guard: RunGuard,
    mut session: DurableTeam<dyn Store>,
    text: Option<String>,
) -> Arc<RunLog> {
    let log = Arc::clone(guard.log());
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
        let result = match text {
            Some(text) => session.send_each(text, on_event).await.map(Some),
            None => session.resume_each(on_event).await,
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
                log.record(RunEvent::Done(DoneEvent {
                    done: step.is_none_or(|s| s.done),
                    response: reply.answer.clone(),
                    yield_reason: step
                        .map_or("end_turn", |s| s.yield_reason.as_str())
                        .to_owned(),
                    awaiting_approval: step.is_some_and(|s| {
                        s.yield_reason == markov_executor::YieldReason::AwaitingApproval
                    }),
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

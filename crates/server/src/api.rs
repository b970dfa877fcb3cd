//! The routes and what they do.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::extract::rejection::JsonRejection;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Extension, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::from_fn_with_state;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use axum_extra::extract::CookieJar;
use axum_extra::extract::cookie::{Cookie, SameSite};
use futures::Stream;
use markov_core::Item;
use markov_executor::{Agent, MachineStep, YieldReason};
use markov_policy::{ApprovalId, Decision};
use markov_store::{
    CreateOptions, DurableMachine, Lease, OpenOptions, SessionId, SessionInfo, Store,
};
use serde::Deserialize;
use serde_json::{Value, json};
use tower_http::timeout::RequestBodyTimeoutLayer;

use crate::auth::{Principal, verify_api_key_with_id};
use crate::guard::{self, COOKIE};
use crate::runs::{RUN_LOG, RunGuard, RunLog, StopCause};
use crate::wire::{
    AgentInfo, ApprovalRequest, Cancelling, CommandResult, DecidedEvent, DoneEvent, ErrorBody,
    Health, InterruptedEvent, LiveRun, Me, NewSession, RunEvent, SessionDetail, SessionSummary,
    StepEvent,
};
use crate::{ApiError, Service, markdown};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

type Shared = State<Arc<Service>>;

/// The routes, with their checks.
pub(crate) fn router(service: Arc<Service>) -> Router {
    let limits = service.limits.clone();
    let (public, _) = public_routes().split_for_parts();
    let (protected, _) = protected_routes().split_for_parts();
    let protected = protected.route_layer(from_fn_with_state(
        Arc::clone(&service),
        guard::authenticate,
    ));
    let mut app = Router::new()
        .route("/", get(page))
        .route("/assets/app.js", get(script))
        .route("/assets/app.css", get(style))
        .merge(public)
        .merge(protected)
        .fallback(no_route)
        .layer(DefaultBodyLimit::max(limits.max_body_bytes))
        .layer(RequestBodyTimeoutLayer::new(limits.body_timeout));
    if !service.cors.is_empty() {
        let origins: Vec<HeaderValue> = service
            .cors
            .iter()
            .filter_map(|o| HeaderValue::from_str(o).ok())
            .collect();
        app = app.layer(
            tower_http::cors::CorsLayer::new()
                .allow_origin(origins)
                .allow_methods([
                    axum::http::Method::GET,
                    axum::http::Method::POST,
                    axum::http::Method::DELETE,
                ])
                .allow_headers([
                    header::AUTHORIZATION,
                    header::CONTENT_TYPE,
                    axum::http::HeaderName::from_static("last-event-id"),
                ])
                .max_age(Duration::from_secs(600)),
        );
    }
    app.layer(from_fn_with_state(
        Arc::clone(&service),
        guard::hosts_and_headers,
    ))
    .layer(from_fn_with_state(Arc::clone(&service), guard::access_log))
    .with_state(service)
}

/// The documented routes that need no credential: each route and its
/// entry in the document come from one declaration, so they cannot drift.
pub(crate) fn public_routes() -> OpenApiRouter<Arc<Service>> {
    OpenApiRouter::new()
        .routes(routes!(health))
        .routes(routes!(sign_in, sign_out))
}

/// The documented routes that need a credential.
pub(crate) fn protected_routes() -> OpenApiRouter<Arc<Service>> {
    OpenApiRouter::new()
        .routes(routes!(me))
        .routes(routes!(agents))
        .routes(routes!(create_default, list_all))
        .routes(routes!(create_for, list_for))
        .routes(routes!(show))
        .routes(routes!(message))
        .routes(routes!(events))
        .routes(routes!(cancel))
        .routes(routes!(approvals))
        .routes(routes!(decide))
        .routes(routes!(command))
        .routes(routes!(crate::studio::steps))
        .routes(routes!(crate::studio::step_request))
        .routes(routes!(crate::studio::agents::sub_agent_request))
        .routes(routes!(fork))
        .routes(routes!(crate::studio::replay))
        .routes(routes!(crate::hooks::step_wire))
        .routes(routes!(crate::hooks::sub_agent_wire))
        .routes(routes!(crate::hooks::case))
        .routes(routes!(openapi))
        .routes(routes!(metrics))
}

async fn no_route() -> ApiError {
    ApiError::NotFound("no route for this path".into())
}

// --- the page ---------------------------------------------------------------

const PAGE: &str = include_str!("../assets/index.html");
const SCRIPT: &str = include_str!("../assets/app.js");
const STYLE: &str = include_str!("../assets/app.css");

/// The page's policy: its own script and style only, requests to this
/// service only, never framed.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, PAGE_POLICY),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn page() -> Response {
    asset("text/html; charset=utf-8", PAGE)
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

#[utoipa::path(get, path = "/healthz", tag = "service", security(),
    responses((status = 200, description = "The service is up", body = Health)))]
pub(crate) async fn health() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
    })
}

// --- identity -----------------------------------------------------------------

/// A browser's sign-in.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct SignIn {
    /// An API key.
    key: String,
}

#[utoipa::path(post, path = "/auth/session", tag = "identity", request_body = SignIn, security(),
    responses((status = 204, description = "Signed in: the session cookie (`markov_session`, \
        HTTP-only, SameSite=Strict) is set; it lasts until it expires, the key is revoked or \
        the browser signs out"),
              (status = 400, description = "Not a sign-in body", body = ErrorBody),
              (status = 401, description = "Not a valid key", body = ErrorBody),
              (status = 413, description = "The body is too large", body = ErrorBody),
              (status = 429, description = "Too many attempts from this address: \
                  `Retry-After` says when to try again", body = ErrorBody)))]
pub(crate) async fn sign_in(
    State(service): Shared,
    peer: Option<Extension<ConnectInfo<std::net::SocketAddr>>>,
    jar: CookieJar,
    body: Result<Json<SignIn>, JsonRejection>,
) -> Result<(CookieJar, StatusCode), ApiError> {
    // Keys cannot be guessed, but each attempt costs a lookup: attempts are
    // limited per address like a principal's requests.
    let address = peer.map_or_else(|| "unknown".to_owned(), |p| p.0.0.ip().to_string());
    if service
        .limiter
        .check_key(&format!("sign-in {address}"))
        .is_err()
    {
        return Err(ApiError::TooManyRequests(60));
    }
    let Json(SignIn { key }) = body?;
    let Some((principal, key_id)) = verify_api_key_with_id(&*service.keys, key.trim()).await?
    else {
        return Err(ApiError::Unauthorized("not a valid API key".into()));
    };
    let token = service
        .verifiers
        .cookie
        .sign(&principal, &key_id)
        .ok_or_else(|| ApiError::Internal("cannot sign the session cookie".into()))?;
    let cookie = Cookie::build((COOKIE, token))
        .path("/")
        .http_only(true)
        .same_site(SameSite::Strict)
        .secure(service.secure_cookies)
        .build();
    Ok((jar.add(cookie), StatusCode::NO_CONTENT))
}

#[utoipa::path(delete, path = "/auth/session", tag = "identity", security(),
    responses((status = 204, description = "Signed out: the cookie is cleared, and its value \
        signs nobody in any more")))]
pub(crate) async fn sign_out(
    State(service): Shared,
    jar: CookieJar,
) -> Result<(CookieJar, StatusCode), ApiError> {
    // The cookie's value stays refused, not only cleared from this
    // browser: a copy of it signs nobody in any more, on any worker. If
    // the store cannot record that, the browser is told and keeps its
    // cookie to sign out again.
    if let Some(signed) = jar
        .get(COOKIE)
        .and_then(|cookie| service.verifiers.cookie.verify(cookie.value()))
    {
        signed.end(&*service.keys).await?;
    }
    Ok((
        jar.remove(Cookie::build(COOKIE).path("/")),
        StatusCode::NO_CONTENT,
    ))
}

#[utoipa::path(get, path = "/me", tag = "identity",
    responses((status = 200, description = "The caller's principal and roles", body = Me),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn me(Extension(principal): Extension<Principal>) -> Json<Me> {
    Json(Me {
        principal: principal.id().as_str().to_owned(),
        roles: principal.roles().map(str::to_owned).collect(),
    })
}

// --- agents and sessions ------------------------------------------------------

#[utoipa::path(get, path = "/agents", tag = "sessions",
    responses((status = 200, description = "The agents served", body = Vec<AgentInfo>),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn agents(State(service): Shared) -> Json<Vec<AgentInfo>> {
    Json(
        service
            .agents
            .keys()
            .map(|name| AgentInfo {
                name: name.clone(),
                default: *name == service.default_agent,
                model: service.models.get(name).cloned(),
                team: None,
            })
            .chain(service.teams.iter().map(|(name, team)| AgentInfo {
                name: name.clone(),
                default: *name == service.default_agent,
                model: None,
                team: Some(team.names().map(str::to_owned).collect()),
            }))
            .collect(),
    )
}

#[utoipa::path(post, path = "/sessions", tag = "sessions",
    responses((status = 201, description = "A session of the default agent", body = NewSession),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 403, description = "A signed-in browser's request without its Origin", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn create_default(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
) -> Result<Response, ApiError> {
    let agent = service.default_agent.clone();
    create(&service, &principal, &agent).await
}

#[utoipa::path(post, path = "/agents/{agent}/sessions", tag = "sessions",
    params(("agent" = String, Path, description = "The agent's name")),
    responses((status = 201, description = "A session of the agent", body = NewSession),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 403, description = "A signed-in browser's request without its Origin", body = ErrorBody),
              (status = 404, description = "No such agent", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn create_for(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path(agent): Path<String>,
) -> Result<Response, ApiError> {
    create(&service, &principal, &agent).await
}

fn agent_named<'a>(service: &'a Service, name: &str) -> Result<&'a Agent, ApiError> {
    service
        .agents
        .get(name)
        .ok_or_else(|| ApiError::NotFound(format!("no agent {name:?}")))
}

/// The agent or team served as `name`: `Ok` if there is one.
fn served(service: &Service, name: &str) -> Result<(), ApiError> {
    if service.teams.contains_key(name) {
        return Ok(());
    }
    agent_named(service, name).map(|_| ())
}

async fn create(
    service: &Service,
    principal: &Principal,
    agent: &str,
) -> Result<Response, ApiError> {
    if let Some(team) = service.teams.get(agent) {
        return crate::team::create(service, principal, agent, team).await;
    }
    let agent = agent_named(service, agent)?;
    let id = SessionId::random();
    let options = CreateOptions::default()
        .owner(principal.id().clone())
        .lease(service.lease);
    // Kept in memory from its creation: a session's first message does
    // not read back what was just stored.
    let options = match &service.sessions {
        Some(cache) => options.cache(cache.clone(), agent),
        None => options,
    };
    let session = DurableMachine::create_with(
        Arc::clone(&service.store),
        id.clone(),
        service.worker.clone(),
        agent.machine(),
        options,
    )
    .await?;
    session.release().await?;
    Ok((
        StatusCode::CREATED,
        Json(NewSession {
            id: id.to_string(),
            agent: agent.name().to_owned(),
        }),
    )
        .into_response())
}

async fn listed(
    service: &Service,
    mut sessions: Vec<SessionInfo>,
) -> Result<Json<Vec<SessionSummary>>, ApiError> {
    crate::team::list(service, &mut sessions).await?;
    Ok(Json(
        sessions
            .into_iter()
            .map(|s| {
                let running = service
                    .runs
                    .get(&s.id)
                    .is_some_and(|log| !log.is_finished());
                SessionSummary {
                    id: s.id.to_string(),
                    agent: s.charter,
                    messages: s.messages,
                    running,
                    interrupted: s.running,
                    created_at: s.created_at,
                    updated_at: s.updated_at,
                }
            })
            .collect(),
    ))
}

#[utoipa::path(get, path = "/sessions", tag = "sessions",
    responses((status = 200, description = "The caller's sessions, most recent first",
                  body = Vec<SessionSummary>),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn list_all(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
) -> Result<Json<Vec<SessionSummary>>, ApiError> {
    let sessions = service.store.list(Some(principal.id())).await?;
    listed(&service, sessions).await
}

#[utoipa::path(get, path = "/agents/{agent}/sessions", tag = "sessions",
    params(("agent" = String, Path, description = "The agent's name")),
    responses((status = 200, description = "The caller's sessions of the agent",
                  body = Vec<SessionSummary>),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 404, description = "No such agent", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn list_for(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path(agent): Path<String>,
) -> Result<Json<Vec<SessionSummary>>, ApiError> {
    served(&service, &agent)?;
    let sessions = service.store.list(Some(principal.id())).await?;
    let mut listed = listed(&service, sessions).await?;
    listed.0.retain(|s| s.agent == agent);
    Ok(listed)
}

/// Session `id` and its agent, if it is `principal`'s: another
/// principal's session is "not found", as if it did not exist.
async fn owned<'a>(
    service: &'a Service,
    principal: &Principal,
    id: &str,
) -> Result<(SessionId, &'a Agent), ApiError> {
    let id = SessionId::new(id);
    let info = service.store.info(&id).await?;
    if info.owner.as_ref() != Some(principal.id()) {
        return Err(ApiError::NotFound(format!("no session {id}")));
    }
    let agent = agent_of(service, &id, &info.charter)?;
    Ok((id, agent))
}

/// The agent (or a team's entry agent) this server serves as `charter`,
/// which session `id` runs.
fn agent_of<'a>(
    service: &'a Service,
    id: &SessionId,
    charter: &str,
) -> Result<&'a Agent, ApiError> {
    let agent = service
        .agents
        .get(charter)
        .or_else(|| crate::team::agent_named(service, charter));
    agent.ok_or_else(|| {
        ApiError::NotFound(format!(
            "session {id} runs agent {charter:?}, which this server does not serve"
        ))
    })
}

/// Session `id`, if it is `principal`'s, leased to this worker and claimed
/// for a run here, and opened: what a request that changes a session
/// starts with. Another principal's session is "not found", as if it did
/// not exist, even while it runs; a session that runs, here or on another
/// worker, is a conflict.
///
/// Whose the session is, is checked in the same store call that leases it
/// (one round trip to the store, not two); the run here is claimed after,
/// so a session this worker runs is looked at first, without leasing it.
async fn opened(
    service: &Arc<Service>,
    principal: &Principal,
    id: &str,
) -> Result<(RunGuard, DurableMachine<dyn Store>), ApiError> {
    let id = SessionId::new(id);
    if service.runs.is_running(&id) {
        owned(service, principal, id.as_str()).await?;
        return Err(running(&id));
    }
    let lease = service
        .store
        .acquire_owned(&id, principal.id(), &service.worker, service.lease)
        .await?;
    let agent = match agent_of(service, &id, &lease.charter) {
        Ok(agent) => agent,
        Err(error) => {
            // No run of an agent this server does not serve goes on here:
            // the lease just taken is nobody else's.
            service.store.release(&id, &service.worker).await?;
            return Err(error);
        }
    };
    // A request for the same session that got here first claims it, and
    // its run keeps the lease (this worker's: ours only renewed it). Were
    // that run to end before this claim, the lease would be left to
    // expire: other workers wait for it at most its length, this one not
    // at all.
    let guard = claim(service, &id)?;
    let session = open_leased(service, lease, agent).await?;
    Ok((guard, session))
}

#[utoipa::path(get, path = "/sessions/{id}", tag = "sessions",
    params(("id" = String, Path, description = "The session")),
    responses((status = 200, description = "History (assistant text also as sanitized `html`), state, \
        pending approvals, whether a run is recorded in progress in the store (`interrupted`: running \
        on this or another worker, or left by one that stopped or died, to be continued), whether it runs \
        here and, if it does, where its events take up from the history \
        (`live_run`: the first `history_len` messages, then the events after `last_event_id`; \
        `message` is the user's text that started the turn, which its first step records)",
                  body = SessionDetail),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 404, description = "No such session of the caller's", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn show(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<SessionDetail>, ApiError> {
    if let Some(detail) = crate::team::show(&service, &principal, &id).await? {
        return Ok(Json(detail));
    }
    let (id, agent) = owned(&service, &principal, &id).await?;
    let stored = service.store.load(&id).await?;
    let pending = crate::wire::pending(&stored.snapshot.policy.approvals);
    // The run is looked up after the history is loaded: whatever it has
    // stored by now, the page shows the history it started from and then
    // every event of the run, so it shows each message once.
    let live = service.runs.get(&id).filter(|log| !log.is_finished());
    let live_run = live.as_ref().map(|log| {
        let (last_event_id, history_len, message) = log.join();
        LiveRun {
            last_event_id,
            history_len,
            message,
        }
    });
    Ok(Json(SessionDetail {
        id: stored.info.id.to_string(),
        agent: agent.name().to_owned(),
        history: markdown::shown(&stored.snapshot.history, agent.shows_stored_thinking()),
        state: json!(stored.snapshot.instance.state),
        pending_approvals: pending.into_iter().cloned().collect(),
        awaiting_approval: stored.snapshot.policy.answers.iter().any(|a| a.paused),
        usage: json!(stored.snapshot.usage),
        running: live.is_some(),
        interrupted: stored.info.running,
        live_run,
        team: None,
    }))
}

#[utoipa::path(get, path = "/sessions/{id}/approvals", tag = "approvals",
    params(("id" = String, Path, description = "The session")),
    responses((status = 200, description = "The calls waiting for a decision",
                  body = Vec<ApprovalRequest>),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 404, description = "No such session of the caller's", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn approvals(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<Vec<markov_policy::ConfirmationRequest>>, ApiError> {
    if let Some(waiting) = crate::team::approvals(&service, &principal, &id).await? {
        return Ok(Json(waiting));
    }
    let (id, _) = owned(&service, &principal, &id).await?;
    let stored = service.store.load(&id).await?;
    Ok(Json(
        crate::wire::pending(&stored.snapshot.policy.approvals)
            .into_iter()
            .cloned()
            .collect(),
    ))
}

// --- the studio ----------------------------------------------------------------

#[utoipa::path(post, path = "/sessions/{id}/steps/{n}/fork", tag = "studio",
    params(("id" = String, Path, description = "The session"),
           ("n" = u64, Path, description = "The step, from 0")),
    request_body = crate::studio::Fork,
    responses((status = 201, description = "A new session, the caller's, as the source was before \
        the step (history, state, turn and budget counters), and its run started at once: its first \
        request is the step's request again (with the user's message edited, if asked). Follow \
        it as any session (`GET /sessions/{id}`, its events)", body = NewSession),
              (status = 400, description = "Not a fork body", body = ErrorBody),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 403, description = "A signed-in browser's request without its Origin", body = ErrorBody),
              (status = 404, description = "No such session the caller may read, or no such step", body = ErrorBody),
              (status = 409, description = "The step cannot be forked at (no model call, or what it \
                  started from was not recorded)", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn fork(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path((id, n)): Path<(String, u64)>,
    body: Result<Json<crate::studio::Fork>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(crate::studio::Fork { edit_user }) = body?;
    let (new, agent, forked) = crate::studio::fork(&service, &principal, &id, n, edit_user).await?;
    let guard = claim(&service, &new)?;
    spawn_run(&service, guard, forked, None, Work::Continue);
    Ok((
        StatusCode::CREATED,
        Json(NewSession {
            id: new.to_string(),
            agent,
        }),
    )
        .into_response())
}

// --- runs -----------------------------------------------------------------------

fn claim(service: &Arc<Service>, id: &SessionId) -> Result<RunGuard, ApiError> {
    service.runs.claim(id).ok_or_else(|| running(id))
}

/// The answer to a request for a session that runs here.
fn running(id: &SessionId) -> ApiError {
    ApiError::Conflict(format!(
        "session {id} is running; wait for its run to end, or cancel it"
    ))
}

/// Opens the session `lease` is of, over `agent`.
async fn open_leased(
    service: &Service,
    lease: Lease,
    agent: &Agent,
) -> Result<DurableMachine<dyn Store>, ApiError> {
    let options = OpenOptions::default().lease(service.lease);
    let options = match &service.sessions {
        Some(cache) => options.cache(cache.clone()),
        None => options,
    };
    let session =
        DurableMachine::open_leased(Arc::clone(&service.store), lease, agent, options).await?;
    let source = if session.was_kept() {
        "memory"
    } else {
        "store"
    };
    service
        .metrics
        .sessions_opened
        .get_or_create(&crate::metrics::SourceLabel { source })
        .inc();
    Ok(session)
}

/// What a run does with its session.
enum Work {
    /// Nothing more: the session is released.
    Nothing,
    /// Resume the turn that waits for approval.
    Resume,
    /// Run a turn for this message, resuming first a turn whose approvals
    /// are all decided or expired.
    Message(String),
    /// Continue a run a stopped server left in progress.
    Continue,
}

/// Performs `work` on `session` in a task of its own (a client that leaves
/// does not stop it), logging `first`, then the run's events; returns the
/// log.
fn spawn_run(
    service: &Arc<Service>,
    guard: RunGuard,
    mut session: DurableMachine<dyn Store>,
    first: Option<RunEvent>,
    work: Work,
) -> Arc<RunLog> {
    let log = Arc::clone(guard.log());
    if let Some(event) = first {
        log.record(event);
    }
    let message = match &work {
        Work::Message(text) => Some(text.clone()),
        _ => None,
    };
    log.start(
        session.cancel_token(),
        session.machine().history().len(),
        message,
    );
    session.interrupt_when(service.shutdown.child_token());
    let thinking = session.machine().shows_stored_thinking();
    let service = Arc::clone(service);
    let task_log = Arc::clone(&log);
    let id = session.id().clone();
    // Boxed: the run's future holds the machine's whole step inline, many
    // kilobytes that the runtime would otherwise copy on each move into
    // its task and again when the task ends; boxed, it is copied once.
    tokio::spawn(Box::pin(RUN_LOG.scope(Arc::clone(&log), async move {
        let log = task_log;
        let started = Instant::now();
        service.metrics.running.inc();
        let deadline = {
            let (log, limit, id) = (Arc::clone(&log), service.limits.run_deadline, id.clone());
            tokio::spawn(async move {
                tokio::time::sleep(limit).await;
                if log.stop(StopCause::Deadline) {
                    tracing::warn!(session = %id, ?limit, "a run passed its deadline: it is cancelled");
                }
            })
        };
        let on_step = |step: &MachineStep| {
            service.metrics.steps.inc();
            let results = step
                .history
                .iter()
                .flat_map(|m| m.item_list())
                .filter(|i| matches!(i, Item::ToolResult { .. }))
                .count();
            service.metrics.tool_calls.inc_by(results as u64);
            let mut event = StepEvent::of(step, thinking);
            // The thinking as it was streamed, checked, unless the stored one is shown.
            log.show_thinking(&mut event.messages, !thinking);
            log.record(RunEvent::Step(event));
        };
        let result = async {
            // The session is released as soon as the run returns: the run's
            // last write gives up the lease with it, in one store write.
            let last = match work {
                Work::Nothing => None,
                Work::Resume => {
                    session.release_with_run();
                    Some(session.resume_each_step(on_step).await)
                }
                Work::Continue => {
                    session.release_with_run();
                    Some(session.run_each_step(on_step).await)
                }
                Work::Message(text) => Some(
                    async {
                        let mut on_step = on_step;
                        if session.machine().is_awaiting_approval() {
                            session.resume_each_step(&mut on_step).await?;
                        }
                        session.machine().enqueue_user(text);
                        session.release_with_run();
                        session.run_each_step(&mut on_step).await
                    }
                    .await,
                ),
            };
            let interrupted = session.is_interrupted();
            let released = session.release().await;
            let last = last.transpose()?;
            released?;
            Ok::<_, ApiError>(last.map(|last| (last, interrupted)))
        }
        .await;
        deadline.abort();
        let outcome = match result {
            Ok(Some((last, true))) => {
                log.record(RunEvent::Interrupted(InterruptedEvent {
                    yield_reason: last.yield_reason.as_str().to_owned(),
                    reason: "the server is shutting down: the run continues when it is back"
                        .into(),
                }));
                "interrupted"
            }
            Ok(Some((last, false))) => {
                let stopped = (last.yield_reason == YieldReason::Cancelled)
                    .then(|| log.cause().map_or("cancelled", StopCause::as_str));
                log.record(RunEvent::Done(DoneEvent {
                    done: last.done,
                    response: last.output(),
                    yield_reason: last.yield_reason.as_str().to_owned(),
                    awaiting_approval: last.yield_reason == YieldReason::AwaitingApproval,
                    stopped: stopped.map(str::to_owned),
                    usage_limit: last.usage_limit.map(|limit| limit.to_string()),
                    usage: json!(last.totals),
                    agent: None,
                }));
                stopped.unwrap_or("done")
            }
            Ok(None) => "nothing",
            Err(error) => {
                // On the console of whoever runs the server: the page shows
                // the user the same message.
                tracing::warn!(session = %id, %error, "a run failed");
                log.record(RunEvent::Error(ErrorBody {
                    error: error.to_string(),
                }));
                "error"
            }
        };
        service.metrics.run_ended(outcome, started.elapsed());
        service.metrics.running.dec();
        drop(guard);
    })));
    log
}

fn streamed(log: &Arc<RunLog>) -> Sse<impl Stream<Item = Result<Event, Infallible>> + use<>> {
    Sse::new(log.events(None)).keep_alive(KeepAlive::default())
}

/// A user message.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct UserText {
    /// What the user says.
    text: String,
}

#[utoipa::path(post, path = "/sessions/{id}/messages", tag = "runs",
    params(("id" = String, Path, description = "The session")), request_body = UserText,
    responses((status = 200, content_type = "text/event-stream", body = RunEvent,
                  description = "The turn's events, as server-sent events (see `RunEvent`), \
                  until the run ends with `done`, `interrupted` or `error`"),
              (status = 400, description = "Not a message, or an empty one", body = ErrorBody),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 403, description = "A signed-in browser's request without its Origin", body = ErrorBody),
              (status = 404, description = "No such session of the caller's", body = ErrorBody),
              (status = 409, description = "The session runs, or waits for decisions", body = ErrorBody),
              (status = 413, description = "The body is too large", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn message(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Result<Json<UserText>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(UserText { text }) = body?;
    if text.trim().is_empty() {
        return Err(ApiError::BadRequest("the message is empty".into()));
    }
    if let Some(log) = crate::team::message(&service, &principal, &id, text.clone()).await? {
        return Ok(streamed(&log).into_response());
    }
    // Claimed before the stream starts, so a busy session is a plain 409,
    // and held by the run until it ends.
    let (guard, session) = opened(&service, &principal, &id).await?;
    let id = session.id().clone();
    if session.machine().is_awaiting_approval() {
        let waiting = session
            .machine()
            .approvals()
            .held_pending_at(SystemTime::now())
            .len();
        if waiting > 0 {
            session.release().await?;
            return Err(ApiError::Conflict(format!(
                "session {id} waits for the decision on {waiting} tool call(s): decide them first"
            )));
        }
    }
    let log = spawn_run(&service, guard, session, None, Work::Message(text));
    Ok(streamed(&log).into_response())
}

#[utoipa::path(get, path = "/sessions/{id}/events", tag = "runs",
    params(("id" = String, Path, description = "The session"),
           ("Last-Event-ID" = Option<String>, Header, description = "The last event received")),
    responses((status = 200, content_type = "text/event-stream", body = RunEvent,
                  description = "The run's events after `Last-Event-ID` (from its start if the \
                  id is of another run), then live until the run ends; a finished run is \
                  replayed only when `Last-Event-ID` is sent, for a short while after its end"),
              (status = 204, description = "No run in progress, and no `Last-Event-ID` asks \
                  for what a finished one sent"),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 404, description = "No such session of the caller's", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn events(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let (id, _) = owned(&service, &principal, &id).await?;
    let after = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    // A finished run is replayed only to a client that read part of it
    // (or of an earlier run) and says so: a client that merely looks for
    // a run to follow learns there is none.
    let Some(log) = service
        .runs
        .get(&id)
        .filter(|log| after.is_some() || !log.is_finished())
    else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    Ok(Sse::new(log.events(after.as_deref()))
        .keep_alive(KeepAlive::default())
        .into_response())
}

#[utoipa::path(post, path = "/sessions/{id}/cancel", tag = "runs",
    params(("id" = String, Path, description = "The session")),
    responses((status = 202, description = "The run is stopping; its stream ends with `done`, \
                  stopped: cancelled", body = Cancelling),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 403, description = "A signed-in browser's request without its Origin", body = ErrorBody),
              (status = 404, description = "No such session of the caller's", body = ErrorBody),
              (status = 409, description = "No run in progress", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn cancel(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let (id, _) = owned(&service, &principal, &id).await?;
    match service.runs.get(&id) {
        Some(log) if log.stop(StopCause::Cancelled) => {
            Ok((StatusCode::ACCEPTED, Json(Cancelling { cancelling: true })).into_response())
        }
        _ => Err(ApiError::Conflict(format!(
            "session {id} has no run in progress"
        ))),
    }
}

/// A decision, as the API documents it.
#[derive(Debug, utoipa::ToSchema)]
#[allow(dead_code)]
pub(crate) struct DecisionBody {
    /// `approve`, `edit`, `deny` or `respond`.
    decision: String,
    /// The edited arguments (`edit`).
    #[schema(value_type = Option<Object>)]
    args: Option<Value>,
    /// Why (`deny`).
    message: Option<String>,
    /// The call's result, given by the application (`respond`).
    #[schema(value_type = Option<Object>)]
    result: Option<Value>,
}

#[utoipa::path(post, path = "/sessions/{id}/approvals/{request}", tag = "approvals",
    params(("id" = String, Path, description = "The session"),
           ("request" = String, Path, description = "The confirmation request")),
    request_body = DecisionBody,
    responses((status = 200, content_type = "text/event-stream", body = RunEvent,
                  description = "`decided`, then, once no call waits, the resumed run's events, \
                  as server-sent events (see `RunEvent`)"),
              (status = 400, description = "Not a decision, or one the request cannot take", body = ErrorBody),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 403, description = "The tool's calls need a role the caller lacks, or a \
                  signed-in browser's request without its Origin", body = ErrorBody),
              (status = 404, description = "No such session of the caller's, or no such request in it", body = ErrorBody),
              (status = 409, description = "Already decided, or the session runs", body = ErrorBody),
              (status = 410, description = "Expired", body = ErrorBody),
              (status = 413, description = "The body is too large", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn decide(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path((id, request)): Path<(String, String)>,
    body: Result<Json<Decision>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(decision) = body?;
    if let Some(log) =
        crate::team::decide(&service, &principal, &id, &request, decision.clone()).await?
    {
        return Ok(streamed(&log).into_response());
    }
    // One decision at a time per session: of two racing, the second is a
    // 409 here, or refused as already decided below.
    let (guard, mut session) = opened(&service, &principal, &id).await?;
    let request_id = ApprovalId::from(request.as_str());
    let tool = session
        .machine()
        .approvals()
        .get(&request_id)
        .map(|record| record.request.tool);
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
    let machine = session.machine();
    let waiting = machine.approvals().held_pending_at(SystemTime::now()).len();
    let event = RunEvent::Decided(DecidedEvent {
        request_id: decided.request_id.to_string(),
        decision: name.to_owned(),
        tool: decided.tool,
        waiting,
    });
    let work = if waiting == 0 && machine.is_awaiting_approval() {
        Work::Resume
    } else {
        Work::Nothing
    };
    let log = spawn_run(&service, guard, session, Some(event), work);
    Ok(streamed(&log).into_response())
}

/// A command to run.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct CommandRequest {
    /// The command's name.
    name: String,
    /// Its input.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    input: Option<Value>,
}

#[utoipa::path(post, path = "/sessions/{id}/commands", tag = "sessions",
    params(("id" = String, Path, description = "The session")), request_body = CommandRequest,
    responses((status = 200, description = "The command's result", body = CommandResult),
              (status = 400, description = "Not a command request", body = ErrorBody),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 403, description = "A signed-in browser's request without its Origin", body = ErrorBody),
              (status = 404, description = "No such session of the caller's", body = ErrorBody),
              (status = 409, description = "The session runs, or it is a team conversation \
                  (which takes messages and decisions, no commands)", body = ErrorBody),
              (status = 413, description = "The body is too large", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn command(
    State(service): Shared,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: Result<Json<CommandRequest>, JsonRejection>,
) -> Result<Json<CommandResult>, ApiError> {
    let Json(request) = body?;
    crate::team::refuse_command(&service, &principal, &id).await?;
    let (_guard, mut session) = opened(&service, &principal, &id).await?;
    let outcome = session
        .command(
            &request.name,
            request.input.unwrap_or_else(|| json!({})),
            Default::default(),
        )
        .await;
    let released = session.release().await;
    let outcome = outcome?;
    released?;
    Ok(Json(CommandResult {
        success: outcome.result.success,
        value: json!(outcome.result.value),
        error: outcome.result.error,
    }))
}

// --- the service itself -----------------------------------------------------------

#[utoipa::path(get, path = "/openapi.json", tag = "service",
    responses((status = 200, description = "This document", content_type = "application/json",
                  body = Object),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        crate::openapi::document(),
    )
        .into_response()
}

#[utoipa::path(get, path = "/metrics", tag = "service",
    responses((status = 200, description = "The metrics, in the OpenMetrics text format",
                  content_type = "application/openmetrics-text", body = String),
              (status = 401, description = "No live credential", body = ErrorBody),
              (status = 429, description = "Too many requests", body = ErrorBody)))]
pub(crate) async fn metrics(State(service): Shared) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        service.metrics.encode(),
    )
        .into_response()
}

/// Continues the runs left in progress on the store — by this server
/// before a restart, or by a worker that died — now and every half lease,
/// until the server stops.
pub(crate) async fn continue_interrupted_forever(service: Arc<Service>) {
    loop {
        while let Some(id) = continue_one(&service).await {
            tracing::info!(session = %id, "continuing a run left in progress");
        }
        // The rate limiter's state of principals (and sign-in addresses)
        // not seen for a while goes, so it does not grow without bound.
        service.limiter.retain_recent();
        // And the logs of runs that ended a while ago, on an idle server.
        service.runs.sweep();
        tokio::select! {
            () = tokio::time::sleep(service.lease / 2) => {}
            () = service.shutdown.cancelled() => return,
        }
    }
}

/// Claims one interrupted run and continues it in the background.
async fn continue_one(service: &Arc<Service>) -> Option<SessionId> {
    if service.shutdown.is_cancelled() {
        return None;
    }
    let lease = match service
        .store
        .claim_interrupted(&service.worker, service.lease)
        .await
    {
        Ok(lease) => lease?,
        Err(error) => {
            tracing::warn!(%error, "cannot look for runs to continue");
            return None;
        }
    };
    let id = lease.session.clone();
    let started = async {
        if crate::team::continue_interrupted(service, &id).await? {
            return Ok(());
        }
        let agent = agent_named(service, &lease.charter)?;
        let guard = claim(service, &id)?;
        let session = open_leased(service, lease, agent).await?;
        spawn_run(service, guard, session, None, Work::Continue);
        service.metrics.runs_continued.inc();
        Ok::<_, ApiError>(())
    }
    .await;
    if let Err(error) = started {
        // Left leased: another worker may take it once the lease expires.
        tracing::warn!(session = %id, %error, "cannot continue a run left in progress");
    }
    Some(id)
}

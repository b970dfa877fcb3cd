//! markov's agents as an HTTP service.
//!
//! [`router`] serves one [`Agent`] over sessions kept in a [`Store`]:
//!
//! | method and path | what it does |
//! | --- | --- |
//! | `GET /` | a web page: chat, the streamed steps, the calls waiting for approval with approve / edit / deny buttons |
//! | `POST /sessions` | creates a session: `201 {"id": ...}` |
//! | `GET /sessions` | lists the sessions |
//! | `GET /sessions/{id}` | a session's history, pending approvals and whether it waits for them |
//! | `POST /sessions/{id}/messages` `{"text": ...}` | runs a turn, streamed as server-sent events |
//! | `GET /sessions/{id}/approvals` | the calls waiting for a decision (request id, call id, tool, arguments, preview, expiry) |
//! | `POST /sessions/{id}/approvals/{request}` | decides one, streamed as server-sent events: `{"decision": "approve"}`, `{"decision": "edit", "args": {...}}`, `{"decision": "deny", "message": "..."}` or `{"decision": "respond", "result": ...}` |
//! | `POST /sessions/{id}/commands` `{"name": ..., "input": {...}}` | runs a command (no model call) |
//!
//! A run is streamed as `delta` events (text as the model writes it, for
//! an agent on the standard executor), `step` events (each step's messages: text, tool
//! calls, tool results; its yield reason; the response when a terminal tool
//! gave one; the calls waiting for approval), then `done` (the last step's
//! response, whether the turn is over, whether it waits for approvals) or
//! `error`. Every step is in the store before it is sent. A client that
//! goes away does not stop the run: it goes on and is stored, and
//! `GET /sessions/{id}` shows it.
//!
//! A turn whose calls need approval ends waiting for them (a `step` with
//! yield reason `awaiting_approval`). A decision is answered by a
//! `decided` event; deciding the last waiting call resumes the run — the
//! approved calls run, no model call first — and streams it like a
//! message's. A message to a session that waits for decisions is a `409`;
//! once nothing is left to decide (the requests expired), a message first
//! resumes the waiting turn (expired calls are answered as expired), then
//! runs.
//!
//! Bad input gets a JSON error, never a panic: malformed JSON `400`, an
//! unknown session `404`, a body over the limit `413`, a second message
//! while the session runs `409` (the first run is not disturbed). A
//! decision on an unknown request (or another session's) is a `404`, on a
//! request already decided a `409`, on an expired one a `410`, with edited
//! arguments that do not fit the tool a `400`; none changes anything.
#![deny(missing_docs)]

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::Stream;
use markov_executor::stream::DeltaKind;
use markov_executor::{Agent, MachineStep, MessageStreamEvent, YieldReason};
use markov_policy::{ApprovalError, ApprovalId, ApprovalStatus, Decision};
use markov_store::{DurableError, DurableMachine, SessionId, Store, StoreError, WorkerId};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Serves `app` on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, app: Router) -> std::io::Result<()> {
    axum::serve(listener, app).await
}

tokio::task_local! {
    /// The event stream of the run the current task performs.
    static RUN_EVENTS: tokio::sync::mpsc::UnboundedSender<Event>;
}

/// Sends a model call's text delta to the event stream of the run that
/// asked, as a `delta` event (`{"text": ...}`) before that step's `step`
/// event. One agent serves every session: the deltas find their run
/// through the task that performs it.
fn send_delta(event: &MessageStreamEvent) {
    if let MessageStreamEvent::Update { delta, .. } = event
        && delta.kind == DeltaKind::Text
    {
        let _ = RUN_EVENTS.try_with(|events| {
            let event = Event::default()
                .event("delta")
                .json_data(json!({"text": delta.delta}))
                .unwrap_or_else(|_| Event::default().event("delta"));
            let _ = events.send(event);
        });
    }
}

/// The largest request body accepted.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// The service's shared state.
struct Service {
    agent: Agent,
    store: Arc<dyn Store>,
    worker: WorkerId,
    /// Sessions with a run in progress in this process.
    running: Mutex<HashSet<SessionId>>,
}

/// The router serving `agent` over the sessions in `store`, writing as
/// `worker`. An agent on the standard executor has its answers streamed
/// as they are written (`delta` events); one with an executor of its own
/// streams as that executor does.
pub fn router(agent: Agent, store: Arc<dyn Store>, worker: WorkerId) -> Router {
    let agent = agent.streamed(send_delta).unwrap_or_else(|agent| agent);
    let service = Arc::new(Service {
        agent,
        store,
        worker,
        running: Mutex::new(HashSet::new()),
    });
    Router::new()
        .route("/", get(page))
        .route("/sessions", post(create).get(list))
        .route("/sessions/{id}", get(show))
        .route("/sessions/{id}/messages", post(message))
        .route("/sessions/{id}/approvals", get(approvals))
        .route("/sessions/{id}/approvals/{request}", post(decide))
        .route("/sessions/{id}/commands", post(command))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(service)
}

/// An error answered as `{"error": "..."}` with its status.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// The request is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// No such session or request.
    #[error("{0}")]
    NotFound(String),
    /// The session is busy, or the request already decided.
    #[error("{0}")]
    Conflict(String),
    /// The request expired.
    #[error("{0}")]
    Gone(String),
    /// The body is too large.
    #[error("the request body is larger than {MAX_BODY_BYTES} bytes")]
    TooLarge,
    /// Something failed on our side.
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::Gone(_) => StatusCode::GONE,
            ApiError::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if matches!(self, ApiError::Internal(_)) {
            tracing::error!(error = %self, "request failed");
        }
        (self.status(), Json(json!({"error": self.to_string()}))).into_response()
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::NotFound(id) => ApiError::NotFound(format!("no session {id}")),
            StoreError::Leased { .. } | StoreError::LeaseLost { .. } => {
                ApiError::Conflict(error.to_string())
            }
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl From<DurableError> for ApiError {
    fn from(error: DurableError) -> Self {
        match error {
            DurableError::Store(e) => e.into(),
            DurableError::Approval(e) => e.into(),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl From<ApprovalError> for ApiError {
    fn from(error: ApprovalError) -> Self {
        let text = error.to_string();
        match error {
            ApprovalError::NotFound(_) => ApiError::NotFound(text),
            ApprovalError::AlreadyDecided { .. } => ApiError::Conflict(text),
            ApprovalError::Expired(_) => ApiError::Gone(text),
            _ => ApiError::BadRequest(text),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::TooLarge
        } else {
            ApiError::BadRequest(rejection.body_text())
        }
    }
}

type Shared = State<Arc<Service>>;

/// The web page: a chat with the streamed steps and approve / deny buttons
/// (plain HTML and JavaScript, no build step).
const PAGE: &str = include_str!("../assets/index.html");

async fn page() -> axum::response::Html<&'static str> {
    axum::response::Html(PAGE)
}

async fn create(State(service): Shared) -> Result<Response, ApiError> {
    let machine = service.agent.machine();
    let id = SessionId::random();
    let session = DurableMachine::create(
        Arc::clone(&service.store),
        id.clone(),
        service.worker.clone(),
        machine,
    )
    .await?;
    session.release().await?;
    Ok((StatusCode::CREATED, Json(json!({"id": id}))).into_response())
}

async fn list(State(service): Shared) -> Result<Json<Value>, ApiError> {
    let sessions = service.store.list(None).await?;
    Ok(Json(Value::Array(
        sessions
            .into_iter()
            .map(|s| {
                json!({
                    "id": s.id, "charter": s.charter, "messages": s.messages,
                    "running": s.running, "updated_at": s.updated_at,
                })
            })
            .collect(),
    )))
}

async fn show(State(service): Shared, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let stored = service.store.load(&SessionId::new(id)).await?;
    let now = now_ms();
    let pending: Vec<_> = stored
        .snapshot
        .policy
        .approvals
        .iter()
        .filter(|r| r.status == ApprovalStatus::Pending && now < r.request.expires)
        .map(|r| &r.request)
        .collect();
    Ok(Json(json!({
        "id": stored.info.id,
        "history": stored.snapshot.history,
        "state": stored.snapshot.instance.state,
        "pending_approvals": pending,
        "awaiting_approval": stored.snapshot.policy.answers.iter().any(|a| a.paused),
    })))
}

async fn approvals(
    State(service): Shared,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let stored = service.store.load(&SessionId::new(id)).await?;
    let now = now_ms();
    let pending: Vec<_> = stored
        .snapshot
        .policy
        .approvals
        .into_iter()
        .filter(|r| r.status == ApprovalStatus::Pending && now < r.request.expires)
        .map(|r| r.request)
        .collect();
    Ok(Json(json!(pending)))
}

/// Now, in Unix milliseconds.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Marks a session as running in this process until dropped.
struct Busy {
    service: Arc<Service>,
    id: SessionId,
}

impl Busy {
    fn claim(service: &Arc<Service>, id: &SessionId) -> Result<Self, ApiError> {
        let mut running = service.running.lock().unwrap_or_else(|p| p.into_inner());
        if !running.insert(id.clone()) {
            return Err(ApiError::Conflict(format!(
                "session {id} is running; wait for its run to end"
            )));
        }
        Ok(Busy {
            service: Arc::clone(service),
            id: id.clone(),
        })
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.service
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

async fn open(service: &Service, id: &SessionId) -> Result<DurableMachine<dyn Store>, ApiError> {
    Ok(DurableMachine::open(
        Arc::clone(&service.store),
        id.clone(),
        service.worker.clone(),
        &service.agent,
    )
    .await?)
}

async fn decide(
    State(service): Shared,
    Path((id, request)): Path<(String, String)>,
    body: Result<Json<Decision>, JsonRejection>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let Json(decision) = body?;
    let id = SessionId::new(id);
    // One decision at a time per session: of two racing, the second is a
    // 409 here, or refused as already decided below.
    let busy = Busy::claim(&service, &id)?;
    let mut session = open(&service, &id).await?;
    let request_id = ApprovalId::from(request.as_str());
    let name = decision.as_str();
    let decided = match session.decide(&request_id, decision).await {
        Ok(request) => request,
        Err(error) => {
            session.release().await?;
            return Err(error.into());
        }
    };
    let machine = session.machine();
    let waiting = machine
        .approvals()
        .held_pending_at(std::time::SystemTime::now())
        .len();
    let event = Event::default()
        .event("decided")
        .json_data(json!({
            "request_id": decided.request_id,
            "decision": name,
            "tool": decided.tool,
            "waiting": waiting,
        }))
        .unwrap_or_else(|_| Event::default().event("decided"));
    let work = if waiting == 0 && machine.is_awaiting_approval() {
        Work::Resume
    } else {
        Work::Nothing
    };
    Ok(stream_run(busy, session, Some(event), work))
}

/// What a streamed request does with its session.
enum Work {
    /// Nothing more: the session is released.
    Nothing,
    /// Resume the turn that waits for approval.
    Resume,
    /// Run a turn for this message, resuming first a turn whose approvals
    /// are all decided or expired.
    Message(String),
}

/// Performs `work` on `session` in a task of its own (a client that leaves
/// does not stop it), streaming `first`, then the run's events.
fn stream_run(
    busy: Busy,
    mut session: DurableMachine<dyn Store>,
    first: Option<Event>,
    work: Work,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let (events, receiver) = tokio::sync::mpsc::unbounded_channel::<Event>();
    if let Some(event) = first {
        let _ = events.send(event);
    }
    let deltas = events.clone();
    tokio::spawn(RUN_EVENTS.scope(deltas, async move {
        // The run goes on when the client leaves: sends then fail, quietly.
        let send = |event: Event| {
            let _ = events.send(event);
        };
        let result = async {
            let last = match work {
                Work::Nothing => None,
                Work::Resume => Some(
                    session
                        .resume_each_step(|step| send(step_event(step)))
                        .await,
                ),
                Work::Message(text) => Some(
                    async {
                        if session.machine().is_awaiting_approval() {
                            session
                                .resume_each_step(|step| send(step_event(step)))
                                .await?;
                        }
                        session.machine().enqueue_user(text);
                        session.run_each_step(|step| send(step_event(step))).await
                    }
                    .await,
                ),
            };
            let released = session.release().await;
            let last = last.transpose()?;
            released?;
            Ok::<_, ApiError>(last)
        }
        .await;
        match result {
            Ok(Some(last)) => send(
                Event::default()
                    .event("done")
                    .json_data(json!({
                        "done": last.done,
                        "response": last.response,
                        "yield_reason": last.yield_reason.as_str(),
                        "awaiting_approval": last.yield_reason == YieldReason::AwaitingApproval,
                    }))
                    .unwrap_or_else(|_| Event::default().event("done")),
            ),
            Ok(None) => {}
            Err(error) => send(Event::default().event("error").data(error.to_string())),
        }
        drop(busy);
    }));
    let stream = futures::stream::unfold(receiver, |mut receiver| async move {
        let event = receiver.recv().await?;
        Some((Ok(event), receiver))
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// A command to run.
#[derive(Debug, Deserialize)]
struct CommandRequest {
    name: String,
    #[serde(default)]
    input: Option<Value>,
}

async fn command(
    State(service): Shared,
    Path(id): Path<String>,
    body: Result<Json<CommandRequest>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(request) = body?;
    let id = SessionId::new(id);
    let _busy = Busy::claim(&service, &id)?;
    let mut session = open(&service, &id).await?;
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
    Ok(Json(json!({
        "success": outcome.result.success,
        "value": outcome.result.value,
        "error": outcome.result.error,
    })))
}

/// A user message.
#[derive(Debug, Deserialize)]
struct UserText {
    text: String,
}

/// One step as a client sees it.
#[derive(Debug, Serialize)]
struct StepEvent<'a> {
    yield_reason: &'static str,
    done: bool,
    messages: &'a [markov_core::Message],
    response: Option<&'a str>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    approvals: &'a [markov_policy::ConfirmationRequest],
}

fn step_event(step: &MachineStep) -> Event {
    let body = StepEvent {
        yield_reason: step.yield_reason.as_str(),
        done: step.done,
        messages: &step.history,
        response: step.response.as_deref(),
        approvals: &step.approvals,
    };
    Event::default()
        .event("step")
        .json_data(&body)
        .unwrap_or_else(|_| Event::default().event("step").data("{}"))
}

async fn message(
    State(service): Shared,
    Path(id): Path<String>,
    body: Result<Json<UserText>, JsonRejection>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let Json(UserText { text }) = body?;
    if text.trim().is_empty() {
        return Err(ApiError::BadRequest("the message is empty".into()));
    }
    let id = SessionId::new(id);
    // Claimed before the stream starts, so a busy session is a plain 409,
    // and held by the run until it ends.
    let busy = Busy::claim(&service, &id)?;
    // Opened here, so an unknown or leased session is a plain 404 / 409.
    let session = open(&service, &id).await?;
    if session.machine().is_awaiting_approval() {
        let waiting = session
            .machine()
            .approvals()
            .held_pending_at(std::time::SystemTime::now())
            .len();
        if waiting > 0 {
            session.release().await?;
            return Err(ApiError::Conflict(format!(
                "session {id} waits for the decision on {waiting} tool call(s): decide them first"
            )));
        }
    }
    Ok(stream_run(busy, session, None, Work::Message(text)))
}

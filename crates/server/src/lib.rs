//! markov's agents as an HTTP service you can put in front of users.
//!
//! A [`Server`] serves one or more [`Agent`]s over sessions kept in a
//! store (SQLite or Postgres), each session owned by the principal that
//! created it:
//!
//! ```no_run
//! # async fn demo(agent: markov_executor::Agent) -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use markov_server::Server;
//! use markov_store::SqliteStore;
//!
//! let store = Arc::new(SqliteStore::open("sessions.db")?);
//! let key = markov_server::create_api_key(&*store, "alice", &[]).await?;
//! println!("alice's key: {}", key.key);
//! let server = Server::builder().agent(agent).store(store).build()?;
//! let listener = markov_server::bind("127.0.0.1:8080").await?;
//! server.serve(listener).await?; // until SIGTERM or Ctrl-C
//! # Ok(()) }
//! ```
//!
//! | method and path | what it does |
//! | --- | --- |
//! | `GET /` | the web page (public, as are its `/assets/…`) |
//! | `GET /healthz` | `{"status": "ok"}` (public) |
//! | `POST /auth/session` `{"key": ...}` | a browser signs in with an API key: a session cookie |
//! | `DELETE /auth/session` | signs out |
//! | `GET /me` | the caller: principal and roles |
//! | `GET /agents` | the agents served, with the model each answers with if named ([`ServerBuilder::model_description`]) |
//! | `POST /sessions`, `POST /agents/{agent}/sessions` | creates a session (of the first agent, or of `agent`): `201 {"id": ...}` |
//! | `GET /sessions`, `GET /agents/{agent}/sessions` | the caller's sessions |
//! | `GET /sessions/{id}` | a session's history, pending approvals, whether it waits for them, whether a run is in progress on any worker (`interrupted`) or runs here, and where a running turn's events take up from the history |
//! | `POST /sessions/{id}/messages` `{"text": ...}` | runs a turn, streamed as server-sent events |
//! | `GET /sessions/{id}/events` | the running turn's events again (after `Last-Event-ID`), then live |
//! | `POST /sessions/{id}/cancel` | stops the running turn |
//! | `GET /sessions/{id}/approvals` | the calls waiting for a decision |
//! | `POST /sessions/{id}/approvals/{request}` | decides one (`approve`, `edit`, `deny`, `respond`), streamed |
//! | `POST /sessions/{id}/commands` `{"name": ..., "input": {...}}` | runs a command (no model call) |
//! | `GET /sessions/{id}/steps`, `…/steps/{n}/request`, `…/steps/{n}/wire`, `…/steps/{n}/sub_agents/{at}/request`, `…/sub_agents/{at}/wire`, `…/case`, `POST …/steps/{n}/fork`, `POST …/replay` | the studio: recorded steps (a sub-agent's under its call, a team's agents' in one timeline), a step's request (also as the wire body; a sub-agent step's too), the session as an eval case, forks and replays (for the owner and developers) |
//! | `GET /openapi.json` | this API as an OpenAPI document |
//! | `GET /metrics` | counters and latency histograms for Prometheus |
//!
//! **Identity.** Every route but the page, its assets, the health check
//! and sign-in needs a credential: `Authorization: Bearer <key>` with an
//! API key ([`create_api_key`]; only its hash is stored, compared in
//! constant time), a bearer token from an external issuer
//! ([`JwtConfig`]), or the cookie a browser gets by signing in with a key
//! (`HttpOnly`, `SameSite=Strict`, `Secure` when the public URL is
//! `https`). A session belongs to its creator: another principal's
//! session is a `404`, as if it did not exist. Deciding on calls of some
//! tools can need a role ([`ServerBuilder::approval_role`]).
//!
//! **Hosts.** A request whose `Host` is not one of the allowed names (by
//! default only loopback: `localhost`, `127.0.0.1`, `[::1]`), or whose
//! `Origin` is not one of theirs or a configured CORS origin, is a `403`:
//! a page on another site cannot reach the service through DNS
//! rebinding. A browser's unsafe request (a `POST`, a `DELETE`) signed in
//! by cookie must carry an allowed `Origin`. No CORS unless configured.
//!
//! **Limits.** Request heads must arrive within a timeout, bodies within
//! another; connections are capped; a body over the limit is a `413`
//! before it is read; each principal has a request rate, past which it
//! gets `429` with `Retry-After`. Each run has a deadline: past it, the
//! run is cancelled like `POST /sessions/{id}/cancel` does — the step in
//! flight ends with a result for each of its calls, the turn ends with
//! yield reason `cancelled`, and the session takes the next message.
//!
//! **Runs.** A run is streamed as `delta` events (text as the model writes
//! it, for an agent on the standard executor), `step` events (each step's
//! messages: text, tool calls, tool results; its yield reason; the
//! response; the calls waiting for approval; the `model` that answered,
//! when the provider named it), then `done` (the last
//! step's response, whether the turn is over, whether it waits for
//! approvals, what stopped it), `interrupted` (the server shut down after
//! a stored step; the run continues when it restarts) or `error`. Every
//! event has an id: a client that lost its stream asks
//! `GET /sessions/{id}/events` with `Last-Event-ID` and gets what it
//! missed, then the rest live (a finished run's events stay for a minute
//! or until the session's next run). Every step is in the store before it
//! is sent, and a client that leaves does not stop the run.
//!
//! **Assistant text as HTML.** Wherever messages are sent (`step`
//! events, `GET /sessions/{id}`), an assistant's text item also carries
//! `html`: its markdown rendered (pulldown-cmark) and sanitized (ammonia)
//! for a page to insert as it is — formatting tags only, links only to
//! `http`, `https` and `mailto` targets, any HTML the model wrote shown as
//! text, characters that reorder or hide text written as marked code
//! points. A text over 256 KiB has none.
//!
//! **Teams.** A team served with [`ServerBuilder::team`] is listed by
//! `GET /agents` with its agents (`team`), and each of its sessions is a
//! conversation with the team (`markov_store::DurableTeam`): the agent
//! holding it answers or hands it over. Its `step` and `done` events name
//! the `agent`, a `handoff` event (`from`, `to`, `reason`) tells each
//! handoff once it is stored, and `GET /sessions/{id}` gives the
//! conversation's texts as `history`, with `team`: the agents, the
//! `current_agent` the next message goes to, who wrote each message and
//! where each handoff was. A call that needs approval pauses the team's
//! turn with the agent that made it: the session lists it, the
//! conversation's decision route decides it, and the last decision
//! resumes the turn with that agent (and its handoffs). Commands, which
//! would change one agent's machine outside any turn, are a `409`.
//!
//! A turn whose calls need approval ends waiting for them; deciding the
//! last one resumes the run and streams it. A message to a session that
//! waits for decisions is a `409`.
//!
//! **Shutdown.** [`Server::serve`] stops on SIGTERM or Ctrl-C: it stops
//! accepting, lets each running turn finish the step it is in and store
//! it, and returns; the turns stay recorded as in progress, and a server
//! started on the same store continues them (on Postgres, any worker's,
//! once their lease has expired). A worker that dies mid-turn leaves its
//! runs the same way: another worker continues them once their leases
//! expire ([`ServerBuilder::lease`]), and a client polls
//! `GET /sessions/{id}` there until `interrupted` is false.
//!
//! Bad input gets a JSON error, never a panic: malformed JSON `400`, no
//! credential `401`, a foreign host or a missing role `403`, an unknown or
//! foreign session `404`, a body over the limit `413`, too many requests
//! `429`, a second message while the session runs `409`.
#![deny(missing_docs)]

mod api;
mod auth;
mod guard;
mod hooks;
mod markdown;
mod metrics;
mod openapi;
mod runs;
mod studio;
mod team;
mod wire;

use std::collections::{BTreeMap, HashMap};
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use markov_executor::{Agent, Team};
use markov_policy::ApprovalError;
use markov_store::{DurableError, KeyStore, SessionCache, Store, StoreError, WorkerId};
use serde_json::json;
use tokio_util::sync::CancellationToken;

pub use auth::{
    APPROVER, DEVELOPER, JwtConfig, JwtConfigError, KeyError, NewApiKey, Principal, create_api_key,
};
pub use serve::{LISTEN_BACKLOG, bind};

use crate::auth::{CookieSigner, KeyCache, Verifiers};
use crate::metrics::Metrics;
use crate::runs::Runs;

/// The limits a server keeps. Every wait has a bound.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Limits {
    /// A request's head must arrive within this (slow clients are closed).
    pub header_timeout: Duration,
    /// A request's body must arrive within this.
    pub body_timeout: Duration,
    /// Connections served at once; more wait to be accepted.
    pub max_connections: usize,
    /// The largest request body accepted.
    pub max_body_bytes: usize,
    /// Requests per minute per principal (bursts of as many).
    pub requests_per_minute: NonZeroU32,
    /// How long a run may take before it is cancelled.
    pub run_deadline: Duration,
    /// How long a shutdown waits for running steps to be stored.
    pub shutdown_grace: Duration,
    /// How long a browser's sign-in lasts.
    pub sign_in: Duration,
    /// How many idle sessions' machines the server keeps in memory between
    /// messages (the least recently used make room; `0` keeps none). A
    /// message to a session kept here skips reading its history back,
    /// unless another worker wrote the session since (see
    /// `markov_store::SessionCache`). Memory grows with the histories
    /// kept, up to [`open_session_bytes`](Self::open_session_bytes).
    pub open_sessions: usize,
    /// How many bytes of history (written as JSON, as the store holds it;
    /// the machines in memory take about as much again) the sessions kept
    /// in memory may take together: the least recently used make room, and
    /// a session whose history alone is larger is not kept.
    pub open_session_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_body_bytes: 64 * 1024,
            requests_per_minute: NonZeroU32::new(600).unwrap_or(NonZeroU32::MIN),
            run_deadline: Duration::from_secs(600),
            shutdown_grace: Duration::from_secs(30),
            sign_in: Duration::from_secs(12 * 3600),
            open_sessions: 1000,
            open_session_bytes: 256 * 1024 * 1024,
        }
    }
}

/// Why a server cannot be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// No agent to serve.
    #[error(
        "a server needs at least one agent (ServerBuilder::agent) or team (ServerBuilder::team)"
    )]
    NoAgent,
    /// No store.
    #[error("a server needs a store (ServerBuilder::store)")]
    NoStore,
    /// Two agents (or teams) have one name.
    #[error("two agents are named {0:?}: each needs its own name")]
    DuplicateAgent(String),
    /// An allowed host, an origin or the public URL cannot be used.
    #[error("{0}")]
    Address(String),
    /// The cookie key is too short.
    #[error("the cookie key has at least 32 bytes")]
    CookieKey,
    /// The operating system's random source failed (making the cookie key).
    #[error("the operating system's random source failed: {0}")]
    Random(String),
    /// A model is named for an agent the server does not serve.
    #[error("a model is named for agent {0:?}, which is not served (ServerBuilder::agent)")]
    UnknownAgent(String),
    /// The lease is shorter than [`ServerBuilder::MIN_LEASE`] or longer
    /// than [`ServerBuilder::MAX_LEASE`].
    #[error(
        "a lease of {0:?} is outside {min:?}..={max:?} (ServerBuilder::lease)",
        min = ServerBuilder::MIN_LEASE,
        max = ServerBuilder::MAX_LEASE
    )]
    Lease(Duration),
}

/// Builds a [`Server`]: the agents, the store, who may call, the limits.
#[derive(Debug, Default)]
#[must_use]
pub struct ServerBuilder {
    agents: Vec<Agent>,
    teams: Vec<(String, Team)>,
    store: Option<(Arc<dyn Store>, Arc<dyn KeyStore>)>,
    worker: Option<WorkerId>,
    jwt: Option<JwtConfig>,
    hosts: Vec<String>,
    cors: Vec<String>,
    public_url: Option<String>,
    approval_roles: HashMap<String, String>,
    cookie_key: Option<Vec<u8>>,
    limits: Limits,
    models: HashMap<String, String>,
    lease: Option<Duration>,
    replays: HashMap<String, Replayer>,
    /// Whether a team was added before any agent (`POST /sessions` then
    /// creates its sessions).
    first_is_team: bool,
    hooks: hooks::StudioHooks,
}

/// How the studio replays an agent's sessions: the live model, and the
/// agent as it is now over a given model.
#[derive(Clone)]
pub(crate) struct Replayer {
    pub(crate) live: Arc<dyn markov_core::model::Model>,
    pub(crate) build: Arc<dyn Fn(Arc<dyn markov_core::model::Model>) -> Agent + Send + Sync>,
}

impl std::fmt::Debug for Replayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replayer").finish_non_exhaustive()
    }
}

impl ServerBuilder {
    /// The shortest lease [`lease`](Self::lease) accepts: a lease is
    /// renewed every third of its length while a step runs, and each
    /// renewal is a store round trip that must fit in it.
    pub const MIN_LEASE: Duration = Duration::from_secs(1);

    /// The longest lease [`lease`](Self::lease) accepts: a worker that dies
    /// holds its sessions this long.
    pub const MAX_LEASE: Duration = Duration::from_secs(24 * 3600);

    /// Serves `agent`, at `/agents/{its name}/sessions`; the first agent is
    /// also the one `POST /sessions` creates sessions of.
    pub fn agent(mut self, agent: Agent) -> Self {
        self.agents.push(agent);
        self
    }

    /// Serves `team` as `name`, at `/agents/{name}/sessions` like an agent
    /// (the first agent or team added is the one `POST /sessions` creates
    /// sessions of): each of its sessions is a team conversation
    /// (`markov_store::DurableTeam`), held by one of the team's agents at a
    /// time. Its runs' `step` and `done` events name the agent that made
    /// them, a `handoff` event tells each handoff, and
    /// `GET /sessions/{id}` gives the conversation with the agent that
    /// wrote each answer, the handoffs and the agent that holds it now.
    pub fn team(mut self, name: impl Into<String>, team: Team) -> Self {
        let name = name.into();
        if self.agents.is_empty() && self.teams.is_empty() {
            self.first_is_team = true;
        }
        self.teams.push((name, team));
        self
    }

    /// Names the model `agent` answers with — its API, endpoint and model,
    /// as `markov_providers::EnvModel::description` writes them — for the
    /// people who talk to it: `GET /agents` gives it as the agent's
    /// `model`, and the page shows it. An agent without one is shown
    /// without a model (the server cannot ask a model what it is).
    pub fn model_description(
        mut self,
        agent: impl Into<String>,
        description: impl Into<String>,
    ) -> Self {
        self.models.insert(agent.into(), description.into());
        self
    }

    /// Keeps sessions and API keys in `store`.
    pub fn store<S: Store + KeyStore + 'static>(mut self, store: Arc<S>) -> Self {
        self.store = Some((store.clone(), store));
        self
    }

    /// Writes sessions as `worker` (a random id unless set).
    pub fn worker(mut self, worker: WorkerId) -> Self {
        self.worker = Some(worker);
        self
    }

    /// Also accepts bearer tokens from an external issuer.
    pub fn jwt(mut self, jwt: JwtConfig) -> Self {
        self.jwt = Some(jwt);
        self
    }

    /// Also answers requests for `host` (a name, without scheme or port).
    pub fn allowed_host(mut self, host: impl Into<String>) -> Self {
        self.hosts.push(host.into());
        self
    }

    /// Lets pages of `origin` (`https://app.example.com`) call the API with
    /// bearer credentials (CORS). None unless configured.
    pub fn cors_origin(mut self, origin: impl Into<String>) -> Self {
        self.cors.push(origin.into());
        self
    }

    /// The URL users reach the service at (`https://agents.example.com`):
    /// its host is allowed, and an `https` URL makes the sign-in cookie
    /// `Secure`.
    pub fn public_url(mut self, url: impl Into<String>) -> Self {
        self.public_url = Some(url.into());
        self
    }

    /// Lets the studio replay sessions of agent `agent` (`POST
    /// /sessions/{id}/replay`) against the agent `build` makes over a model
    /// — the agent as it is now — with `live` answering wherever the
    /// recording does not (see `markov_store::replay`). A replay runs the
    /// agent's own tools: give `build`'s agent stand-ins for tools with
    /// effects. An agent without one is not replayed.
    pub fn replay_agent(
        mut self,
        agent: impl Into<String>,
        live: Arc<dyn markov_core::model::Model>,
        build: impl Fn(Arc<dyn markov_core::model::Model>) -> Agent + Send + Sync + 'static,
    ) -> Self {
        self.replays.insert(
            agent.into(),
            Replayer {
                live,
                build: Arc::new(build),
            },
        );
        self
    }

    /// Lets the studio show the requests of agent `agent`'s steps as the
    /// provider's wire body (`GET /sessions/{id}/steps/{n}/wire`): `encode`
    /// writes a request as the JSON the provider the agent runs on is sent,
    /// without headers (a client's `request_body`, say). Fields named as
    /// credentials are redacted all the same. An agent without one answers
    /// `409` there, and the page offers no wire body. `agent` may also name
    /// a team's agent (whose steps in the team's timeline then show it) or
    /// a sub-agent by its tool name
    /// (`GET /sessions/{id}/steps/{n}/sub_agents/{at}/wire`).
    pub fn wire_body(
        mut self,
        agent: impl Into<String>,
        encode: impl Fn(
            &markov_core::model::ModelRequest<'_>,
        ) -> Result<Vec<u8>, markov_core::model::ModelError>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.hooks.wire.insert(agent.into(), Arc::new(encode));
        self
    }

    /// Lets the studio save a session, or a range of its steps, as an eval
    /// case (`GET /sessions/{id}/case?from=&to=`): `export` is given the
    /// store, the session and the steps (`None` for the whole session) and
    /// writes the case file, e.g. with `markov_eval::export_dataset` (the
    /// server knows no eval format; `markov-serve` plugs that one in). Its
    /// error is answered as it is: `ApiError::NotFound` for steps not
    /// recorded, `ApiError::Conflict` for steps without a user turn.
    /// Without one, that route answers `409` and the page offers no export.
    pub fn case_export<F>(mut self, export: F) -> Self
    where
        F: Fn(
                Arc<dyn Store>,
                markov_store::SessionId,
                Option<std::ops::Range<u64>>,
            ) -> futures::future::BoxFuture<'static, Result<String, ApiError>>
            + Send
            + Sync
            + 'static,
    {
        self.hooks.case_export = Some(Arc::new(export));
        self
    }

    /// Only principals with `role` may decide on calls of `tool`.
    pub fn approval_role(mut self, tool: impl Into<String>, role: impl Into<String>) -> Self {
        self.approval_roles.insert(tool.into(), role.into());
        self
    }

    /// Signs browsers' sign-in cookies with `key` (at least 32 bytes), so
    /// that every worker accepts them and they survive a restart; a random
    /// key per process unless set.
    pub fn cookie_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.cookie_key = Some(key.into());
        self
    }

    /// How long this server's lease on a session lasts unless renewed
    /// (`markov_store::DEFAULT_LEASE`, 60 s, unless set; between
    /// [`MIN_LEASE`](Self::MIN_LEASE) and [`MAX_LEASE`](Self::MAX_LEASE),
    /// or [`build`](Self::build) refuses it). A run renews its lease while
    /// it works; a worker that dies mid-turn holds its sessions until their
    /// leases expire, and then another worker on the same store continues
    /// their runs. Servers look for such runs every half lease, so a
    /// shorter lease resumes a dead worker's sessions sooner, at the price
    /// of a renewal every third of it while a step runs. Every worker on a
    /// store should use the same lease.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Sets the limits.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Checks the configuration and builds the server.
    pub fn build(self) -> Result<Server, BuildError> {
        let default_agent = match (self.first_is_team, self.agents.first(), self.teams.first()) {
            (true, _, Some((name, _))) | (false, None, Some((name, _))) => name.clone(),
            (_, Some(agent), _) => agent.name().to_owned(),
            _ => return Err(BuildError::NoAgent),
        };
        let (store, keys) = self.store.ok_or(BuildError::NoStore)?;
        let mut agents = BTreeMap::new();
        for agent in self.agents {
            let name = agent.name().to_owned();
            let agent = agent
                .streamed(runs::send_delta)
                .unwrap_or_else(|agent| agent);
            if agents.insert(name.clone(), agent).is_some() {
                return Err(BuildError::DuplicateAgent(name));
            }
        }
        let mut teams: BTreeMap<String, Team> = BTreeMap::new();
        for (name, team) in self.teams {
            if agents.contains_key(&name) || teams.contains_key(&name) {
                return Err(BuildError::DuplicateAgent(name));
            }
            // The text of each agent's answers arrives as it is written;
            // each conversation is stored with the name the team is served
            // as, which tells it its team.
            let team = team
                .map_agents(|agent| {
                    agent
                        .streamed(runs::send_delta)
                        .unwrap_or_else(|agent| agent)
                })
                .named(name.clone());
            teams.insert(name, team);
        }
        if let Some(unknown) = self.models.keys().find(|name| !agents.contains_key(*name)) {
            return Err(BuildError::UnknownAgent(unknown.clone()));
        }
        let mut hosts: Vec<String> = ["localhost", "127.0.0.1", "[::1]"]
            .into_iter()
            .map(str::to_owned)
            .collect();
        for host in self.hosts {
            hosts.push(guard::host_name(&host).ok_or_else(|| {
                BuildError::Address(format!(
                    "allowed host {host:?} is not a host name (no scheme, path or port)"
                ))
            })?);
        }
        let mut secure_cookies = false;
        if let Some(url) = &self.public_url {
            let (scheme, host) = guard::split_origin(url).ok_or_else(|| {
                BuildError::Address(format!("public URL {url:?} is not `http(s)://host[:port]`"))
            })?;
            secure_cookies = scheme == "https";
            hosts.push(host);
        }
        for origin in &self.cors {
            if guard::split_origin(origin).is_none() {
                return Err(BuildError::Address(format!(
                    "CORS origin {origin:?} is not `http(s)://host[:port]`"
                )));
            }
        }
        let cookie_key = match self.cookie_key {
            Some(key) if key.len() < 32 => return Err(BuildError::CookieKey),
            Some(key) => key,
            // A secret: from the operating system's random source.
            None => auth::os_random_hex::<32>()
                .map_err(|e| BuildError::Random(e.to_string()))?
                .into_bytes(),
        };
        let lease = self.lease.unwrap_or(markov_store::DEFAULT_LEASE);
        if !(Self::MIN_LEASE..=Self::MAX_LEASE).contains(&lease) {
            return Err(BuildError::Lease(lease));
        }
        let limits = self.limits;
        let limiter = RateLimiter::keyed(Quota::per_minute(limits.requests_per_minute));
        Ok(Server {
            service: Arc::new(Service {
                agents,
                teams,
                default_agent,
                store,
                keys,
                worker: self.worker.unwrap_or_else(WorkerId::random),
                lease,
                verifiers: Verifiers {
                    jwt: self.jwt,
                    cookie: CookieSigner::new(&cookie_key, limits.sign_in),
                    keys: KeyCache::default(),
                },
                approval_roles: self.approval_roles,
                sessions: NonZeroUsize::new(limits.open_sessions)
                    .map(|sessions| SessionCache::new(sessions, limits.open_session_bytes)),
                models: self.models,
                replays: self.replays,
                hooks: self.hooks,
                hosts,
                cors: self.cors,
                secure_cookies,
                limiter,
                limits,
                runs: Arc::default(),
                metrics: Metrics::new(),
                shutdown: CancellationToken::new(),
            }),
        })
    }
}

/// What every request handler shares.
struct Service {
    agents: BTreeMap<String, Agent>,
    /// The teams served, by the name they are served as.
    teams: BTreeMap<String, Team>,
    default_agent: String,
    store: Arc<dyn Store>,
    keys: Arc<dyn KeyStore>,
    worker: WorkerId,
    /// The length of this server's leases on sessions.
    lease: Duration,
    verifiers: Verifiers,
    approval_roles: HashMap<String, String>,
    /// The machines of idle sessions, kept between messages.
    sessions: Option<SessionCache>,
    /// The models the agents answer with, as the application named them.
    models: HashMap<String, String>,
    /// The agents the studio replays, and how.
    replays: HashMap<String, Replayer>,
    /// How the studio shows wire bodies and writes eval cases, if it does.
    hooks: hooks::StudioHooks,
    /// Allowed host names, lowercase, without port.
    hosts: Vec<String>,
    /// Allowed CORS origins.
    cors: Vec<String>,
    secure_cookies: bool,
    limiter: DefaultKeyedRateLimiter<String>,
    limits: Limits,
    runs: Arc<Runs>,
    metrics: Metrics,
    /// Cancelled when the server shuts down: runs stop after their step.
    shutdown: CancellationToken,
}

/// markov's agents served over HTTP (see the crate's documentation).
#[derive(Clone)]
pub struct Server {
    service: Arc<Service>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("agents", &self.service.agents.keys().collect::<Vec<_>>())
            .field("worker", &self.service.worker)
            .field("hosts", &self.service.hosts)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// A builder.
    pub fn builder() -> ServerBuilder {
        ServerBuilder::default()
    }

    /// The routes with their checks (identity, hosts, limits), to serve
    /// with [`Server::serve`] — which adds the connection limits and the
    /// graceful shutdown — or to nest in an application of one's own.
    pub fn router(&self) -> Router {
        api::router(Arc::clone(&self.service))
    }

    /// The OpenAPI document of the routes.
    pub fn openapi_json(&self) -> String {
        openapi::document()
    }

    /// Serves on `listener` until SIGTERM or Ctrl-C, then shuts down
    /// gracefully (see the crate's documentation). Runs left in progress
    /// on the store by an earlier server are continued first.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        self.serve_until(listener, shutdown_signal()).await
    }

    /// [`serve`](Self::serve) until `shutdown` completes.
    pub async fn serve_until(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> std::io::Result<()> {
        let service = Arc::clone(&self.service);
        let resumer = tokio::spawn(api::continue_interrupted_forever(Arc::clone(&service)));
        let connections = serve::accept(listener, self.router(), &service.limits, shutdown).await;
        resumer.abort();
        tracing::info!(
            running = service.runs.running(),
            "shutting down: running turns stop after the step they are in"
        );
        service.shutdown.cancel();
        let grace = service.limits.shutdown_grace;
        if !service.runs.drained(grace).await {
            tracing::warn!(
                running = service.runs.running(),
                "shutdown grace over: runs still in progress are continued by the next server"
            );
        }
        serve::close(connections, grace).await;
        Ok(())
    }
}

mod serve;

/// Completes on SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// Now, in Unix milliseconds.
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// An error answered as `{"error": "..."}` with its status.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// The request is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// No credential, or not a valid one.
    #[error("{0}")]
    Unauthorized(String),
    /// The caller may not do this (a foreign host, a missing role).
    #[error("{0}")]
    Forbidden(String),
    /// No such session, agent or request (or not the caller's).
    #[error("{0}")]
    NotFound(String),
    /// The session is busy, or the request already decided.
    #[error("{0}")]
    Conflict(String),
    /// The request expired.
    #[error("{0}")]
    Gone(String),
    /// The body is too large.
    #[error("{0}")]
    TooLarge(String),
    /// Too many requests: try again after this many seconds.
    #[error("too many requests: try again in {0} s")]
    TooManyRequests(u64),
    /// Something failed on our side.
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::Gone(_) => StatusCode::GONE,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::TooManyRequests(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if matches!(self, ApiError::Internal(_)) {
            tracing::error!(error = %self, "request failed");
        }
        let mut response = (
            self.status(),
            axum::Json(json!({"error": self.to_string()})),
        )
            .into_response();
        let headers = response.headers_mut();
        match &self {
            ApiError::TooManyRequests(seconds) => {
                headers.insert(axum::http::header::RETRY_AFTER, (*seconds).into());
            }
            ApiError::Unauthorized(_) => {
                headers.insert(
                    axum::http::header::WWW_AUTHENTICATE,
                    axum::http::HeaderValue::from_static("Bearer"),
                );
            }
            _ => {}
        }
        response
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

impl From<axum::extract::rejection::JsonRejection> for ApiError {
    fn from(rejection: axum::extract::rejection::JsonRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::TooLarge("the request body is larger than this server accepts".into())
        } else {
            ApiError::BadRequest(rejection.body_text())
        }
    }
}

//! `markov-serve`: the demo agent as an HTTP service with a web page, its
//! sessions and API keys in a SQLite file (or PostgreSQL with
//! `--database-url`).
//!
//! ```text
//! cargo run -p markov-cli --bin markov-serve                  # http://127.0.0.1:8080
//! cargo run -p markov-cli --bin markov-serve -- keys create alice --role approver
//! cargo run -p markov-cli --bin markov-serve -- keys list
//! cargo run -p markov-cli --bin markov-serve -- keys revoke <id>
//! cargo run -p markov-cli --bin markov-serve -- --help
//! ```
//!
//! A session never dies of its own length: the agent has a context policy
//! (`--context`, summaries by default) sized to the context window the
//! server reports, and its answers fit that window as `markov-demo`'s do.
//! `--require-approval <tool>` makes a tool's calls wait for a person.
//!
//! `--team <name>` serves a team under that name instead: `cities` (the
//! entry agent, with `population`) hands the adding to `maths` (with `add`),
//! which hands the conversation back once it has the sum;
//! `--handoff-history` says what `maths` is shown of the conversation when
//! it is first handed it.
//!
//! The model is chosen as for `markov-demo` (see the library); without a
//! key it is the scripted [`Rehearsal`], and the first line says so. When
//! the store holds no API key yet, one is created for the principal
//! `admin` (an approver and a developer) and printed once, to sign in with.
//!
//! The studio needs no other service: a session's steps replay against the
//! agent served, a step's request shows as the configured client's wire
//! body, and a session, or a range of its steps, downloads as a case
//! `markov-eval` runs offline.

// A server's work is many small allocations that live for one request or
// one step; jemalloc takes about a fifth off its CPU per step against the
// system's allocator (docs/PERFORMANCE.md). A program that serves markov
// from its own binary chooses its own allocator (the serving guide).
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use markov_cli::tools::{Add, Population};
use markov_cli::{
    ContextChoice, INSTRUCTIONS, MATHS_INSTRUCTIONS, Rehearsal, TEAM_INSTRUCTIONS, context_policy,
    pick_settled_model_or,
};
use markov_core::model::Model;
use markov_core::tool::Tool;
use markov_executor::{Agent, Handoff, HistoryFilter, Team};
use markov_policy::{Category, ToolMetadata};
use markov_server::{ApiError, DEVELOPER, JwtConfig, Limits, Server, create_api_key};
use markov_store::{KeyStore, PostgresStore, SqliteStore, WorkerId};

/// markov's demo agent as an HTTP service: a chat page, sessions that
/// survive restarts, API keys.
#[derive(Debug, Parser)]
#[command(name = "markov-serve", version)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    database: Database,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Creates, lists and revokes API keys (kept hashed in the database).
    #[command(subcommand)]
    Keys(Keys),
}

#[derive(Debug, Subcommand)]
enum Keys {
    /// Creates a key for a principal and prints it (the only time it is shown).
    Create {
        /// Who the key signs in as: the owner of the sessions it creates.
        principal: String,
        /// A role the principal has with this key (repeat for more), e.g.
        /// `approver`.
        #[arg(long = "role")]
        roles: Vec<String>,
    },
    /// Lists the keys: id, principal, roles, created, revoked.
    List,
    /// Revokes a key by its id: it signs nobody in from now on.
    Revoke {
        /// The key's id (the part after `mk_`, before the next `_`).
        id: String,
    },
}

/// Where sessions and keys are kept.
#[derive(Debug, Args)]
struct Database {
    /// The SQLite file (default: `$XDG_DATA_HOME/markov/sessions.db`, or
    /// `~/.local/share/markov/sessions.db`).
    #[arg(long, global = true, conflicts_with = "database_url")]
    database: Option<PathBuf>,
    /// A PostgreSQL connection string instead of SQLite (several servers
    /// can share it). Also `MARKOV_DATABASE_URL`.
    #[arg(
        long,
        global = true,
        env = "MARKOV_DATABASE_URL",
        hide_env_values = true
    )]
    database_url: Option<String>,
}

/// How the service is served.
#[derive(Debug, Args)]
struct ServeArgs {
    /// MCP servers whose tools the agent gets (see `markov_cli::mcp`).
    #[command(flatten)]
    mcp: markov_cli::mcp::McpArgs,
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    bind: std::net::IpAddr,
    /// The port to listen on.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Also answer requests for this host name (repeat for more); loopback
    /// names are always allowed.
    #[arg(long = "allowed-host")]
    allowed_hosts: Vec<String>,
    /// The URL users reach the service at, e.g. `https://agents.example.com`
    /// (its host is allowed; https makes the sign-in cookie Secure).
    #[arg(long)]
    public_url: Option<String>,
    /// Let pages of this origin call the API with bearer credentials
    /// (CORS; repeat for more). None by default.
    #[arg(long = "cors-origin")]
    cors_origins: Vec<String>,
    /// Only principals with ROLE may decide on calls of TOOL (`TOOL=ROLE`;
    /// repeat for more), e.g. `add=approver`.
    #[arg(long = "approval-role", value_parser = tool_role)]
    approval_roles: Vec<(String, String)>,
    /// Calls of TOOL wait for a person's approval on the page (or
    /// `POST /sessions/{id}/approvals/{request}`) before they run (repeat
    /// for more): `add` or `population`.
    #[arg(long = "require-approval", value_name = "TOOL")]
    require_approval: Vec<String>,
    /// What the model is shown of a long session: `summarize` (older turns
    /// summarized by the model once a session passes half the context
    /// window), `recent` (the last turns only) or `none` (everything: a
    /// session that outgrows the context fails each message). With either
    /// policy a request the server refuses as too long is sent again with
    /// the current turn alone.
    #[arg(long, value_enum, default_value = "summarize")]
    context: ContextArg,
    /// Accept bearer tokens from this issuer (with --jwt-audience and a key).
    #[arg(long, requires = "jwt_audience")]
    jwt_issuer: Option<String>,
    /// The audience the tokens must name.
    #[arg(long, requires = "jwt_issuer")]
    jwt_audience: Option<String>,
    /// The issuer's public key (PEM): RS256, or ES256 with --jwt-algorithm
    /// es256. For HS256 the shared secret is read from MARKOV_JWT_SECRET.
    #[arg(long)]
    jwt_public_key: Option<PathBuf>,
    /// The tokens' algorithm.
    #[arg(long, value_enum, default_value = "rs256")]
    jwt_algorithm: JwtAlgorithm,
    /// Requests per minute per principal (429 past it).
    #[arg(long, default_value_t = NonZeroU32::new(600).unwrap_or(NonZeroU32::MIN))]
    rate_limit: NonZeroU32,
    /// Seconds a run may take before it is cancelled.
    #[arg(long, default_value_t = 600)]
    run_deadline: u64,
    /// Connections served at once.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Seconds a client has to send a request's head.
    #[arg(long, default_value_t = 10)]
    header_timeout: u64,
    /// The largest request body, in bytes.
    #[arg(long, default_value_t = 64 * 1024)]
    max_body: usize,
    /// Idle sessions kept in memory between messages (0: none).
    #[arg(long, default_value_t = 1000)]
    open_sessions: usize,
    /// Bytes of history the idle sessions kept in memory may take
    /// together (their size as JSON; the least recently used make room).
    #[arg(long, default_value_t = 256 * 1024 * 1024)]
    open_session_bytes: u64,
    /// Serve a team under this name instead of the lone agent: `cities`
    /// (the entry agent, which looks populations up) hands the adding to
    /// `maths` (which adds with `add`, then hands the conversation back).
    /// Its sessions are team conversations: their events and the session
    /// name the agent that answered and each handoff.
    #[arg(long, value_name = "NAME")]
    team: Option<String>,
    /// With --team: what `maths` is shown of the conversation when `cities`
    /// first hands it over: `everything` (every user and agent text),
    /// `last-turns=N` (the texts of the last N user turns) or `summary` (a
    /// summary the model writes). Handed it again, it is shown what came
    /// after its part.
    #[arg(long, value_name = "FILTER", value_parser = handoff_history, default_value = "everything")]
    handoff_history: HistoryArg,
    /// This server's name in the store's leases (default:
    /// `markov-serve@HOSTNAME`): a server restarted with the same name
    /// takes its sessions back at once.
    #[arg(long)]
    worker: Option<String>,
}

/// `--context`, as [`ContextChoice`].
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum ContextArg {
    Summarize,
    Recent,
    None,
}

impl From<ContextArg> for ContextChoice {
    fn from(arg: ContextArg) -> Self {
        match arg {
            ContextArg::Summarize => ContextChoice::Summarize,
            ContextArg::Recent => ContextChoice::Recent,
            ContextArg::None => ContextChoice::None,
        }
    }
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum JwtAlgorithm {
    Rs256,
    Es256,
    Hs256,
}

/// An export's failure as the studio answers it.
fn export_error(error: markov_eval::ExportError) -> ApiError {
    use markov_eval::ExportError;
    use markov_store::StoreError;
    match error {
        ExportError::Store(StoreError::NotFound(id)) => {
            ApiError::NotFound(format!("no session {id}"))
        }
        error @ ExportError::NoSteps { .. } => ApiError::NotFound(error.to_string()),
        error @ ExportError::NoInput(_) => ApiError::Conflict(error.to_string()),
        error => ApiError::Internal(error.to_string()),
    }
}

/// `--handoff-history`, read: a filter's name, before the model it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HistoryArg {
    Everything,
    LastTurns(usize),
    Summary,
}

impl HistoryArg {
    /// The filter, a summary written by `model`.
    fn filter(self, model: &Arc<dyn Model>) -> HistoryFilter {
        match self {
            HistoryArg::Everything => HistoryFilter::Everything,
            HistoryArg::LastTurns(n) => HistoryFilter::LastTurns(n),
            HistoryArg::Summary => HistoryFilter::Summary(Arc::clone(model)),
        }
    }
}

fn handoff_history(value: &str) -> Result<HistoryArg, String> {
    match value {
        "everything" => Ok(HistoryArg::Everything),
        "summary" => Ok(HistoryArg::Summary),
        _ => value
            .strip_prefix("last-turns=")
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|n| *n > 0)
            .map(HistoryArg::LastTurns)
            .ok_or_else(|| {
                format!(
                    "expected `everything`, `last-turns=N` (N at least 1) or `summary`, got {value:?}"
                )
            }),
    }
}

fn tool_role(value: &str) -> Result<(String, String), String> {
    value
        .split_once('=')
        .filter(|(tool, role)| !tool.is_empty() && !role.is_empty())
        .map(|(tool, role)| (tool.to_owned(), role.to_owned()))
        .ok_or_else(|| format!("expected TOOL=ROLE, got {value:?}"))
}

/// Sessions and keys in one store.
enum Backend {
    Sqlite(Arc<SqliteStore>, PathBuf),
    Postgres(Arc<PostgresStore>),
}

impl Backend {
    async fn open(database: &Database) -> Result<Self, String> {
        if let Some(url) = &database.database_url {
            let store = PostgresStore::connect(url)
                .await
                .map_err(|e| format!("cannot connect to PostgreSQL: {e}"))?;
            return Ok(Backend::Postgres(Arc::new(store)));
        }
        let path = match &database.database {
            Some(path) => path.clone(),
            None => default_database()?,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        let store =
            SqliteStore::open(&path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        Ok(Backend::Sqlite(Arc::new(store), path))
    }

    fn keys(&self) -> &dyn KeyStore {
        match self {
            Backend::Sqlite(store, _) => &**store,
            Backend::Postgres(store) => &**store,
        }
    }

    fn describe(&self) -> String {
        match self {
            Backend::Sqlite(_, path) => format!("SQLite file {}", path.display()),
            Backend::Postgres(_) => "PostgreSQL".into(),
        }
    }
}

/// Where a user expects an application's data: the XDG data directory.
fn default_database() -> Result<PathBuf, String> {
    let base = std::env::var_os("XDG_DATA_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .map(|home| PathBuf::from(home).join(".local/share"))
        })
        .ok_or("neither XDG_DATA_HOME nor HOME is set: give --database <file>")?;
    Ok(base.join("markov").join("sessions.db"))
}

fn host_name() -> String {
    std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

async fn keys(backend: &Backend, command: Keys) -> Result<(), String> {
    let keys = backend.keys();
    match command {
        Keys::Create { principal, roles } => {
            let key = create_api_key(keys, &principal, &roles)
                .await
                .map_err(|e| e.to_string())?;
            println!("{}", key.key);
            eprintln!(
                "created key {} for {principal} (roles: {}); it is shown only this once",
                key.id,
                if roles.is_empty() {
                    "none".into()
                } else {
                    roles.join(", ")
                }
            );
        }
        Keys::List => {
            let all = keys.keys().await.map_err(|e| e.to_string())?;
            if all.is_empty() {
                println!("no keys");
            }
            for key in all {
                println!(
                    "{}  {}  roles: {}  created: {}{}",
                    key.id,
                    key.principal,
                    if key.roles.is_empty() {
                        "none".into()
                    } else {
                        key.roles.join(",")
                    },
                    key.created_at,
                    key.revoked_at
                        .map(|at| format!("  revoked: {at}"))
                        .unwrap_or_default()
                );
            }
        }
        Keys::Revoke { id } => {
            let id = id.trim_start_matches("mk_").split('_').next().unwrap_or("");
            if keys.revoke_key(id).await.map_err(|e| e.to_string())? {
                println!("revoked {id}");
            } else {
                return Err(format!("no live key {id:?}"));
            }
        }
    }
    Ok(())
}

fn jwt(args: &ServeArgs) -> Result<Option<JwtConfig>, String> {
    let (Some(issuer), Some(audience)) = (&args.jwt_issuer, &args.jwt_audience) else {
        return Ok(None);
    };
    let config = match args.jwt_algorithm {
        JwtAlgorithm::Hs256 => {
            let secret = std::env::var("MARKOV_JWT_SECRET")
                .map_err(|_| "HS256 tokens need MARKOV_JWT_SECRET".to_owned())?;
            JwtConfig::hs256(secret.as_bytes(), issuer, audience)
        }
        algorithm => {
            let path = args
                .jwt_public_key
                .as_ref()
                .ok_or("--jwt-issuer needs --jwt-public-key (or --jwt-algorithm hs256)")?;
            let pem =
                std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            match algorithm {
                JwtAlgorithm::Es256 => JwtConfig::es256_pem(&pem, issuer, audience),
                _ => JwtConfig::rs256_pem(&pem, issuer, audience),
            }
        }
    };
    config.map(Some).map_err(|e| e.to_string())
}

async fn serve(backend: Backend, args: ServeArgs) -> Result<(), String> {
    let chosen = pick_settled_model_or(Arc::new(Rehearsal))
        .await
        .map_err(|e| e.to_string())?;
    let label = chosen.label.clone();
    for tool in &args.require_approval {
        if ![Add::NAME, Population::NAME].contains(&tool.as_str()) {
            return Err(format!(
                "--require-approval {tool}: the agent has no such tool (it has {} and {})",
                Add::NAME,
                Population::NAME
            ));
        }
    }
    let mcp = markov_cli::mcp::McpServers::connect(args.mcp.configs().map_err(|e| e.to_string())?)
        .await
        .map_err(|e| format!("cannot use the MCP server: {e}"))?;
    for line in mcp.summary() {
        tracing::info!("{line}");
    }
    let tools: Vec<_> = mcp.under_policies().collect();
    let policy = context_policy(args.context.into(), &chosen);
    let settings = chosen.settings();
    let require_approval = args.require_approval.clone();
    let in_team = args.team.is_some();
    let metadata = move |tool: &str, category| {
        let metadata = ToolMetadata::new(category);
        if require_approval.iter().any(|t| t == tool) {
            metadata.with_confirmation()
        } else {
            metadata
        }
    };
    // The agent over a model: the one served over the chosen model, and
    // the same agent over the model a replay gives it. In the team,
    // `cities` hands the adding to `maths` rather than adding itself.
    let handoff = match in_team {
        true => Some(Handoff::tool("maths", "To add numbers.").map_err(|e| e.to_string())?),
        false => None,
    };
    let build = {
        let (metadata, settings, policy) = (metadata.clone(), settings.clone(), policy.clone());
        move |model: Arc<dyn Model>| {
            let mut agent = Agent::builder("cities")
                .instructions(if in_team {
                    TEAM_INSTRUCTIONS
                } else {
                    INSTRUCTIONS
                })
                .tool_with(Population, metadata(Population::NAME, Category::Retrieval))
                .tools_with(tools.iter().cloned())
                .shared_model(model)
                .settings(settings.clone());
            agent = match &handoff {
                Some(handoff) => agent.tools([Arc::clone(handoff)]),
                None => agent.tool_with(Add, metadata(Add::NAME, Category::Other)),
            };
            if let Some(policy) = &policy {
                agent = agent.context_policy(policy.clone());
            }
            agent.build()
        }
    };
    let agent = build(Arc::clone(&chosen.model)).map_err(|e| e.to_string())?;
    let team = match &args.team {
        None => None,
        Some(name) => {
            let back = Handoff::back().map_err(|e| e.to_string())?;
            let mut maths = Agent::builder("maths")
                .instructions(MATHS_INSTRUCTIONS)
                .tool_with(Add, metadata(Add::NAME, Category::Other))
                .tools([back])
                .shared_model(Arc::clone(&chosen.model))
                .settings(settings.clone());
            if let Some(policy) = &policy {
                maths = maths.context_policy(policy.clone());
            }
            let maths = maths.build().map_err(|e| e.to_string())?;
            let team = Team::builder()
                .agent("cities", agent.clone())
                .agent("maths", maths)
                .history("maths", args.handoff_history.filter(&chosen.model))
                .build()
                .map_err(|e| e.to_string())?;
            Some((name.clone(), team))
        }
    };
    let first_key = if backend
        .keys()
        .keys()
        .await
        .map_err(|e| e.to_string())?
        .is_empty()
    {
        let key = create_api_key(
            backend.keys(),
            "admin",
            &["approver".to_owned(), DEVELOPER.to_owned()],
        )
        .await
        .map_err(|e| e.to_string())?;
        Some(key.key)
    } else {
        None
    };
    let mut limits = Limits::default();
    limits.requests_per_minute = args.rate_limit;
    limits.run_deadline = Duration::from_secs(args.run_deadline);
    limits.max_connections = args.max_connections;
    limits.header_timeout = Duration::from_secs(args.header_timeout);
    limits.max_body_bytes = args.max_body;
    limits.open_sessions = args.open_sessions;
    limits.open_session_bytes = args.open_session_bytes;
    let worker = args
        .worker
        .clone()
        .unwrap_or_else(|| format!("markov-serve@{}", host_name()));
    // The page names the model for the people who talk to it, as the first
    // line names it here.
    let description = label.strip_prefix("model: ").unwrap_or(&label).to_owned();
    // The studio with no extra service: replays against the agent as it is
    // served, each request's wire body from the configured client, and a
    // session saved as a case `markov-eval` runs.
    let served = agent.clone();
    let mut builder = match team {
        // A team's agents answer with the chosen model too: the first line
        // names it (the page names no model for a team).
        Some((name, team)) => {
            tracing::info!(team = %name, filter = ?args.handoff_history, "serving the team cities and maths");
            Server::builder().team(name, team)
        }
        None => Server::builder()
            .agent(agent)
            .model_description("cities", description),
    };
    builder = builder
        .replay_agent("cities", Arc::clone(&chosen.model), move |model| {
            build(model).unwrap_or_else(|e| {
                // The served agent built with the same options, so this
                // does not happen; were it to, the replay runs the served
                // agent (the live model throughout) and says why.
                tracing::error!(error = %e, "the replayed agent does not build: replaying the served one");
                served.clone()
            })
        })
        .case_export(|store, id, steps| {
            Box::pin(async move {
                let dataset = markov_eval::export_dataset(&*store, &id, steps)
                    .await
                    .map_err(export_error)?;
                dataset
                    .to_toml()
                    .map_err(|e| ApiError::Conflict(e.to_string()))
            })
        })
        .worker(WorkerId::new(worker))
        .limits(limits);
    if let Some(client) = chosen.client.clone() {
        // Runs are streamed, so the body sent asked for a streamed answer.
        if in_team {
            let client = client.clone();
            builder = builder.wire_body("maths", move |request| client.request_body(request, true));
        }
        builder = builder.wire_body("cities", move |request| client.request_body(request, true));
    }
    builder = match &backend {
        Backend::Sqlite(store, _) => builder.store(Arc::clone(store)),
        Backend::Postgres(store) => builder.store(Arc::clone(store)),
    };
    for host in &args.allowed_hosts {
        builder = builder.allowed_host(host);
    }
    for origin in &args.cors_origins {
        builder = builder.cors_origin(origin);
    }
    for (tool, role) in &args.approval_roles {
        builder = builder.approval_role(tool, role);
    }
    if let Some(url) = &args.public_url {
        builder = builder.public_url(url);
    }
    if let Some(jwt) = jwt(&args)? {
        builder = builder.jwt(jwt);
    }
    if let Ok(key) = std::env::var("MARKOV_COOKIE_KEY") {
        builder = builder.cookie_key(key.into_bytes());
    }
    let server = builder.build().map_err(|e| e.to_string())?;
    let address = SocketAddr::new(args.bind, args.port);
    let listener = markov_server::bind(address)
        .await
        .map_err(|e| format!("cannot listen on {address}: {e}"))?;
    let address = listener.local_addr().map_err(|e| e.to_string())?;
    println!("{label}");
    println!(
        "serving on http://{address} (sessions in {})",
        backend.describe()
    );
    if let Some(key) = first_key {
        println!(
            "no API key existed: created one for `admin` (approver, developer), shown only now:"
        );
        println!("  {key}");
        println!(
            "sign in on the page with it, or: curl -H 'Authorization: Bearer {key}' http://{address}/sessions"
        );
    }
    let served = server.serve(listener).await.map_err(|e| e.to_string());
    mcp.close().await;
    served?;
    println!("stopped");
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // The console log: each request, each failed turn, start and stop.
    // Colours only on a terminal: a log file or a journal gets plain text.
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let result = async {
        let backend = Backend::open(&cli.database).await?;
        match cli.command {
            Some(Command::Keys(command)) => keys(&backend, command).await,
            None => serve(backend, cli.serve).await,
        }
    }
    .await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

//! The client: one connection (one MCP session) to one server, its tool
//! list, and the tools it offers as markov tools.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as SyncMutex};
use std::time::Duration;

use markov_core::async_trait;
use markov_core::tool::{
    Delivery, DynTool, SharedTool, ToolCallError, ToolContext, ToolDefinition, ToolOutcome,
};
use markov_policy::{Category, ToolMetadata, ToolRegistryBuilder};
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientCapabilities, ClientConfig, Implementation,
    JsonObject, RequestMetaObject, ToolAnnotations,
};
// Roots are deprecated by a protocol revision to come, but the servers of
// today (the reference filesystem server) ask for them.
#[allow(deprecated)]
use rmcp::model::{ListRootsResult, Root};
use rmcp::service::{ClientInitializeError, NotificationContext, RequestContext, RunningService};
use rmcp::{ClientHandler, ErrorData, Peer, RoleClient, ServiceError, ServiceExt};
use serde_json::Value;
use tokio::sync::{Mutex, watch};

use crate::child::{ChildTransport, Seen};
use crate::config::{Approval, DEFAULT_INHERITED_ENV, McpServerConfig, Transport};
use crate::http::WatchedClient;
use crate::{IDEMPOTENCY_META_KEY, McpError};

/// How long [`McpClient::close`] waits for the server to stop before it is
/// killed (a child process) or dropped (a connection).
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A client of one MCP server: one connection, one MCP session.
///
/// Cheap to clone; clones share the connection. The tools it hands out
/// ([`tools`](Self::tools)) share it too, so one client serves any number
/// of nodes and machines. For a session per machine, connect one client
/// per machine.
///
/// The connection is made by [`connect`](Self::connect) and made again,
/// lazily, by the first call after it was lost: a stdio server whose child
/// process died is started again, an HTTP server is reconnected. The call
/// that saw the loss fails with an error result the model reads. Every
/// wait is bounded: connecting, listing and each call by the
/// configuration's timeouts.
///
/// The child process of a stdio server stops when the client is closed
/// ([`close`](Self::close)) or when the last clone and the last of its
/// tools are dropped (it is killed then, and on the owning process's exit
/// its stdin closes, which ends a well-behaved server).
#[derive(Clone)]
pub struct McpClient {
    inner: Arc<Inner>,
}

impl fmt::Debug for McpClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpClient")
            .field("server", &self.inner.label)
            .finish_non_exhaustive()
    }
}

#[allow(deprecated)]
struct Inner {
    config: McpServerConfig,
    label: String,
    connection: Mutex<Connection>,
    /// The offered tools, as last listed; `None` before the first listing.
    listed: SyncMutex<Option<Arc<[Arc<ToolInfo>]>>>,
    changes: Arc<Changes>,
    /// What the stdio transport's watch learned (see the `child` module).
    seen: Arc<SyncMutex<Seen>>,
    /// The configured roots, as `file://` URIs.
    roots: Arc<[Root]>,
}

enum Connection {
    Idle,
    Open(RunningService<RoleClient, Handler>),
    Closed,
}

/// What the client learns from the server's notifications.
#[derive(Debug)]
struct Changes {
    /// The tool list changed since it was last listed.
    stale: AtomicBool,
    /// Counts `tools/list_changed` notifications.
    count: watch::Sender<u64>,
}

impl Changes {
    fn mark(&self) {
        self.stale.store(true, Ordering::SeqCst);
        self.count.send_modify(|n| *n += 1);
    }
}

/// The client side of the MCP session: answers the server's notifications
/// and its `roots/list`.
#[allow(deprecated)]
struct Handler {
    changes: Arc<Changes>,
    roots: Arc<[Root]>,
}

#[allow(deprecated)]
impl ClientHandler for Handler {
    fn on_tool_list_changed(
        &self,
        _context: NotificationContext<RoleClient>,
    ) -> impl Future<Output = ()> + Send + '_ {
        tracing::debug!("MCP tool list changed");
        self.changes.mark();
        std::future::ready(())
    }

    fn list_roots(
        &self,
        _context: RequestContext<RoleClient>,
    ) -> impl Future<Output = Result<ListRootsResult, ErrorData>> + Send + '_ {
        std::future::ready(Ok(ListRootsResult::new(self.roots.to_vec())))
    }

    fn get_info(&self) -> ClientConfig {
        // Roots are announced only when some are configured: a server then
        // asks for them instead of falling back to its own defaults.
        let capabilities = if self.roots.is_empty() {
            ClientCapabilities::default()
        } else {
            ClientCapabilities::builder().enable_roots().build()
        };
        ClientConfig::new(
            capabilities,
            Implementation::new("markov-mcp", env!("CARGO_PKG_VERSION")),
        )
    }
}

/// The configured roots as `file://` URIs, each named by its last component.
#[allow(deprecated)]
fn roots(config: &McpServerConfig) -> Result<Vec<Root>, McpError> {
    config
        .roots
        .iter()
        .map(|dir| {
            let absolute = std::path::absolute(dir)
                .map_err(|e| McpError::Config(format!("root {}: {e}", dir.display())))?;
            let uri = reqwest::Url::from_file_path(&absolute).map_err(|()| {
                McpError::Config(format!("root {} is not a usable path", dir.display()))
            })?;
            let mut root = Root::new(uri.to_string());
            root.name = absolute
                .file_name()
                .map(|n| n.to_string_lossy().into_owned());
            Ok(root)
        })
        .collect()
}

/// One tool of the server, as offered.
#[derive(Debug)]
struct ToolInfo {
    definition: ToolDefinition,
    remote: String,
    annotations: Option<ToolAnnotations>,
    /// Whether the tool declares an output schema.
    output_schema: bool,
    approval: ApprovalDecision,
}

/// Whether one tool needs the application's approval before each call,
/// and why: the outcome of the server's [`Approval`] mode, its lists of
/// names, and the tool's annotations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApprovalDecision {
    /// Approval is needed.
    pub required: bool,
    /// Why, in words (e.g. "the server marks it destructive").
    pub reason: &'static str,
}

impl ApprovalDecision {
    fn decide(config: &McpServerConfig, name: &str, hints: Option<&ToolAnnotations>) -> Self {
        let decision = |required, reason| ApprovalDecision { required, reason };
        if config.require_approval.iter().any(|n| n == name) {
            return decision(true, "the configuration requires approval for it");
        }
        if config.skip_approval.iter().any(|n| n == name) {
            return decision(false, "the configuration exempts it from approval");
        }
        match config.approval {
            Approval::All => decision(true, "the configuration requires approval for all tools"),
            Approval::None => decision(false, "the configuration trusts all tools of the server"),
            Approval::Hints => {
                let read_only = hints.and_then(|h| h.read_only_hint) == Some(true);
                let destructive = hints.and_then(|h| h.destructive_hint);
                if read_only {
                    decision(false, "the server marks it read-only")
                } else if destructive == Some(true) {
                    decision(true, "the server marks it destructive")
                } else if hints.is_none() {
                    decision(
                        true,
                        "the server gives no annotations (a tool may change things unless marked read-only)",
                    )
                } else {
                    decision(true, "the server does not mark it read-only")
                }
            }
        }
    }
}

impl McpClient {
    /// Connects to the server and lists its tools, within the
    /// configuration's connect and list timeouts.
    pub async fn connect(config: McpServerConfig) -> Result<Self, McpError> {
        let (count, _) = watch::channel(0);
        let roots = roots(&config)?.into();
        let client = McpClient {
            inner: Arc::new(Inner {
                label: config.label(),
                config,
                connection: Mutex::new(Connection::Idle),
                listed: SyncMutex::new(None),
                changes: Arc::new(Changes {
                    stale: AtomicBool::new(true),
                    count,
                }),
                seen: Arc::default(),
                roots,
            }),
        };
        client.refresh().await?;
        Ok(client)
    }

    /// The server's label: its command or URL.
    pub fn label(&self) -> &str {
        &self.inner.label
    }

    /// The server's tools that the filter admits, as markov tools, named
    /// with the prefix. The list is cached; it is listed again here after
    /// the server said it changed (`notifications/tools/list_changed`) or
    /// after a reconnection.
    ///
    /// A name that providers would refuse (longer than 64 characters, or
    /// with characters outside `a-zA-Z0-9_-`) is offered with each such
    /// character replaced by `_` and cut at 64; the server is called by
    /// its own name. When two of the server's names give the same offered
    /// name (`files.read` and `files_read`), the one sorted later gets a
    /// suffix made from its own name (`files_read_1a2b3c`), the same on
    /// every listing, with a warning in the log.
    ///
    /// A tool the server marks task-only (`execution.taskSupport:
    /// "required"`, callable only through the tasks extension, which this
    /// client does not speak) is not offered, with a warning, over stdio
    /// and Streamable HTTP alike.
    pub async fn tools(&self) -> Result<Vec<SharedTool>, McpError> {
        if self.inner.changes.stale.load(Ordering::SeqCst) || self.cached().is_none() {
            self.refresh().await?;
        }
        Ok(self
            .cached()
            .iter()
            .flat_map(|list| list.iter())
            .map(|info| self.tool(info))
            .collect())
    }

    /// [`tools`](Self::tools) as [`McpTool`]s, for an application that
    /// reads their annotations or approval decision (e.g. to register each
    /// with [`default_metadata`](Self::default_metadata) in an agent).
    pub async fn mcp_tools(&self) -> Result<Vec<Arc<McpTool>>, McpError> {
        Ok(self
            .cached_or_list()
            .await?
            .into_iter()
            .map(|info| {
                Arc::new(McpTool {
                    client: Arc::clone(&self.inner),
                    info,
                })
            })
            .collect())
    }

    /// Lists the server's tools again, whatever the cache holds.
    pub async fn refresh(&self) -> Result<Vec<SharedTool>, McpError> {
        // Cleared before the listing, so that a notification during it
        // marks the new list stale again.
        self.inner.changes.stale.store(false, Ordering::SeqCst);
        let result = self.inner.list().await;
        let list = match result {
            Ok(list) => list,
            Err(err) => {
                self.inner.changes.stale.store(true, Ordering::SeqCst);
                return Err(err);
            }
        };
        let infos: Arc<[Arc<ToolInfo>]> = self.inner.offered(list).into();
        *lock(&self.inner.listed) = Some(Arc::clone(&infos));
        Ok(infos.iter().map(|info| self.tool(info)).collect())
    }

    /// A receiver that changes on each `notifications/tools/list_changed`
    /// of the server: an application that rebuilds its registry or nodes
    /// on a new tool list waits on it, then calls [`tools`](Self::tools).
    pub fn list_changed(&self) -> watch::Receiver<u64> {
        self.inner.changes.count.subscribe()
    }

    /// Registers every offered tool in `builder`, each with the metadata
    /// `metadata` gives it (see [`default_metadata`](Self::default_metadata)),
    /// so the registry's policies apply to MCP calls as to any other.
    pub async fn register(
        &self,
        mut builder: ToolRegistryBuilder,
        metadata: impl Fn(&McpTool) -> ToolMetadata,
    ) -> Result<ToolRegistryBuilder, McpError> {
        for info in self.cached_or_list().await? {
            let tool = McpTool {
                client: Arc::clone(&self.inner),
                info,
            };
            let meta = metadata(&tool);
            builder = builder.register_shared(Arc::new(tool), meta);
        }
        Ok(builder)
    }

    /// Metadata from the server's hints and the configuration's approval
    /// rules: a tool marked read-only is a [`Category::Retrieval`], any
    /// other an [`Category::Action`]; the tool needs confirmation when
    /// [`McpTool::approval`] says so (by default: unless the server marks
    /// it read-only, see [`Approval`]); the timeout is the client's call
    /// timeout.
    pub fn default_metadata(tool: &McpTool) -> ToolMetadata {
        let category = if tool.read_only() == Some(true) {
            Category::Retrieval
        } else {
            Category::Action
        };
        let metadata = ToolMetadata::new(category).with_timeout(tool.client.config.call_timeout);
        if tool.approval().required {
            metadata.with_confirmation()
        } else {
            metadata
        }
    }

    /// Calls the server's tool `name` (its own name, not the offered one)
    /// and returns its answer as it came. A tool's failure (`isError`) is
    /// an `Ok` here.
    pub async fn call_raw(
        &self,
        name: &str,
        arguments: JsonObject,
        idempotency_key: Option<&str>,
    ) -> Result<CallToolResult, McpError> {
        self.inner.call(name, arguments, idempotency_key).await
    }

    /// Closes the session: a stdio server's stdin is closed and the child
    /// waited for, then terminated, then killed ([`CLOSE_TIMEOUT`] at
    /// most); an HTTP session is ended. Later calls fail with
    /// [`McpError::Closed`].
    pub async fn close(&self) {
        let previous = {
            let mut connection = self.inner.connection.lock().await;
            std::mem::replace(&mut *connection, Connection::Closed)
        };
        if let Connection::Open(mut service) = previous {
            // The service's own close bounds each stage of the child's
            // shutdown; this bounds the whole.
            if tokio::time::timeout(CLOSE_TIMEOUT * 3, service.close_with_timeout(CLOSE_TIMEOUT))
                .await
                .is_err()
            {
                tracing::warn!(server = %self.inner.label, "MCP server did not close in time");
            }
        }
    }

    fn cached(&self) -> Option<Arc<[Arc<ToolInfo>]>> {
        lock(&self.inner.listed).clone()
    }

    async fn cached_or_list(&self) -> Result<Vec<Arc<ToolInfo>>, McpError> {
        if self.inner.changes.stale.load(Ordering::SeqCst) || self.cached().is_none() {
            self.refresh().await?;
        }
        Ok(self
            .cached()
            .map(|list| list.iter().cloned().collect())
            .unwrap_or_default())
    }

    fn tool(&self, info: &Arc<ToolInfo>) -> SharedTool {
        Arc::new(McpTool {
            client: Arc::clone(&self.inner),
            info: Arc::clone(info),
        })
    }
}

impl Inner {
    /// The connection's peer, connecting first if there is none or it closed.
    async fn peer(&self) -> Result<Peer<RoleClient>, McpError> {
        let limit = self.config.connect_timeout;
        let timeout = || McpError::Timeout {
            operation: "connect",
            after: limit,
        };
        // Waiting for the lock counts against the connect timeout: another
        // caller may be connecting.
        let mut connection = tokio::time::timeout(limit, self.connection.lock())
            .await
            .map_err(|_| timeout())?;
        match &*connection {
            Connection::Open(service) if !service.is_closed() => {
                return Ok(service.peer().clone());
            }
            Connection::Closed => return Err(McpError::Closed),
            Connection::Open(_) => {
                tracing::info!(server = %self.label, "MCP connection lost; connecting again");
            }
            Connection::Idle => {}
        }
        *connection = Connection::Idle;
        let service = tokio::time::timeout(limit, self.open())
            .await
            .map_err(|_| timeout())??;
        let peer = service.peer().clone();
        *connection = Connection::Open(service);
        // A new session may offer other tools.
        self.changes.stale.store(true, Ordering::SeqCst);
        Ok(peer)
    }

    /// Opens a new connection and runs the MCP handshake.
    async fn open(&self) -> Result<RunningService<RoleClient, Handler>, McpError> {
        let handler = Handler {
            changes: Arc::clone(&self.changes),
            roots: Arc::clone(&self.roots),
        };
        let failed = |detail: String| McpError::Connect {
            server: self.label.clone(),
            detail,
        };
        match &self.config.transport {
            Transport::Stdio {
                command,
                args,
                env,
                inherit,
                cwd,
            } => {
                let mut cmd = tokio::process::Command::new(command);
                cmd.args(args).env_clear();
                for name in DEFAULT_INHERITED_ENV
                    .iter()
                    .map(std::ffi::OsStr::new)
                    .chain(inherit.iter().map(|n| n.as_os_str()))
                {
                    // A shell function exported into the environment is no
                    // variable a server needs.
                    if let Some(value) =
                        std::env::var_os(name).filter(|v| !v.to_string_lossy().starts_with("()"))
                    {
                        cmd.env(name, value);
                    }
                }
                cmd.envs(env.iter().map(|(k, v)| (k, v)));
                if let Some(dir) = cwd {
                    cmd.current_dir(dir);
                }
                cmd.stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::inherit())
                    .kill_on_drop(true);
                let child = cmd.spawn().map_err(|source| McpError::Spawn {
                    command: self.label.clone(),
                    source,
                })?;
                *lock(&self.seen) = Seen::default();
                let transport = ChildTransport::new(child, Arc::clone(&self.seen), CLOSE_TIMEOUT)
                    .map_err(|source| McpError::Spawn {
                    command: self.label.clone(),
                    source,
                })?;
                handler
                    .serve(transport)
                    .await
                    .map_err(|e| failed(self.init_failure(&e)))
            }
            Transport::Http {
                url,
                headers,
                bearer,
            } => {
                crate::install_crypto_provider();
                let refused = Arc::new(SyncMutex::new(None));
                *lock(&self.seen) = Seen::default();
                let transport = http_transport(
                    url,
                    headers,
                    bearer.as_deref(),
                    &self.config,
                    Arc::clone(&refused),
                    Arc::clone(&self.seen),
                )?;
                // rmcp's message ends at "error following redirect": the
                // reason, if a redirect was refused, is said instead.
                handler.serve(transport).await.map_err(|e| {
                    failed(
                        lock(&refused)
                            .take()
                            .unwrap_or_else(|| http_init_failure(url, &e)),
                    )
                })
            }
        }
    }

    /// Forgets the connection after it failed; the next call connects again.
    async fn reset(&self) {
        let mut connection = self.connection.lock().await;
        if matches!(*connection, Connection::Open(_)) {
            *connection = Connection::Idle;
        }
    }

    /// Every page of `tools/list`, within the list timeout.
    async fn list(&self) -> Result<Vec<rmcp::model::Tool>, McpError> {
        let limit = self.config.list_timeout;
        let peer = self.peer().await?;
        match tokio::time::timeout(limit, peer.list_all_tools()).await {
            Err(_) => Err(McpError::Timeout {
                operation: "tools/list",
                after: limit,
            }),
            Ok(Ok(tools)) => Ok(tools),
            Ok(Err(err)) => Err(self.failed(err).await),
        }
    }

    /// One `tools/call`, within the call timeout.
    async fn call(
        &self,
        name: &str,
        arguments: JsonObject,
        idempotency_key: Option<&str>,
    ) -> Result<CallToolResult, McpError> {
        let limit = self.config.call_timeout;
        let peer = self.peer().await?;
        let mut params = CallToolRequestParams::new(name.to_owned()).with_arguments(arguments);
        if let Some(key) = idempotency_key {
            let mut meta = RequestMetaObject::new();
            meta.0.0.insert(
                IDEMPOTENCY_META_KEY.to_owned(),
                Value::String(key.to_owned()),
            );
            params.meta = Some(meta);
        }
        // Dropping the request at the deadline sends the server a
        // cancellation; the connection stays.
        match tokio::time::timeout(limit, peer.call_tool(params)).await {
            Err(_) => Err(McpError::Timeout {
                operation: "tools/call",
                after: limit,
            }),
            Ok(Ok(result)) => Ok(result),
            Ok(Err(err)) => Err(self.failed(err).await),
        }
    }

    /// The error for a failed request; a lost connection is forgotten.
    async fn failed(&self, err: ServiceError) -> McpError {
        match err {
            ServiceError::McpError(data) => McpError::Server {
                code: data.code.0,
                message: data.message.into_owned(),
            },
            ServiceError::Timeout { timeout } => McpError::Timeout {
                operation: "request",
                after: timeout,
            },
            ServiceError::TransportClosed => {
                self.reset().await;
                McpError::Disconnected(self.lost_because(
                    "the server closed the connection (a stdio server's process may have exited: see its messages on stderr)",
                ))
            }
            ServiceError::TransportSend(send) => {
                self.reset().await;
                let cause = error_chain(&*send.error);
                // Over HTTP the answer is parsed with the request: a too
                // deep one fails it at once, with the parser's words.
                if cause.contains("recursion limit exceeded") {
                    return McpError::Disconnected(crate::child::too_deep());
                }
                McpError::Disconnected(self.lost_because(&format!(
                    "a request to the server failed ({cause}); the next call connects again"
                )))
            }
            ServiceError::UnexpectedResponse => McpError::Unexpected(
                "the server answered with a result of another kind than asked for".into(),
            ),
            other => McpError::Unexpected(other.to_string()),
        }
    }

    /// Why the connection was lost: the watch's reason when it ended it,
    /// else `otherwise`.
    fn lost_because(&self, otherwise: &str) -> String {
        lock(&self.seen)
            .refused
            .clone()
            .unwrap_or_else(|| otherwise.to_owned())
    }

    /// A stdio server's failed handshake, in words.
    fn init_failure(&self, err: &ClientInitializeError) -> String {
        if let Some(reason) = lock(&self.seen).refused.clone() {
            return reason;
        }
        match err {
            ClientInitializeError::ConnectionClosed(_) => STOPPED_EARLY.to_owned(),
            // The process may exit while the handshake is written to it.
            ClientInitializeError::TransportError { error, .. } => {
                format!("{STOPPED_EARLY} ({})", error.error)
            }
            other => handshake_failure(other),
        }
    }

    /// The listed tools the filter admits, with their offered names.
    fn offered(&self, mut list: Vec<rmcp::model::Tool>) -> Vec<Arc<ToolInfo>> {
        let prefix = self.config.prefix.as_deref().unwrap_or("");
        let task_only = lock(&self.seen).task_only.clone();
        list.retain(|tool| self.config.filter.admits(&tool.name));
        // Of the tools that share a plain offered name, the one whose own
        // name sorts first keeps it, whatever the server's order.
        let mut owners: std::collections::HashMap<String, &str> = std::collections::HashMap::new();
        for tool in &list {
            let owner = owners
                .entry(offered_name(prefix, &tool.name))
                .or_insert(&tool.name);
            if *tool.name < **owner {
                *owner = &tool.name;
            }
        }
        let owners: std::collections::HashMap<String, String> = owners
            .into_iter()
            .map(|(offered, owner)| (offered, owner.to_owned()))
            .collect();
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for tool in list {
            if !self.config.filter.admits(&tool.name) {
                continue;
            }
            if task_only.contains(&*tool.name) {
                tracing::warn!(
                    server = %self.label,
                    tool = %tool.name,
                    "MCP tool not offered: the server runs it only as a task, which this client does not support"
                );
                continue;
            }
            let mut offered = offered_name(prefix, &tool.name);
            if owners
                .get(&offered)
                .is_some_and(|owner| *owner != *tool.name)
            {
                let suffixed = suffixed_name(&offered, &tool.name);
                tracing::warn!(
                    server = %self.label,
                    tool = %tool.name,
                    taken = %offered,
                    offered = %suffixed,
                    "MCP tool offered under a suffixed name: its plain offered name is another tool's"
                );
                offered = suffixed;
            }
            if !seen.insert(offered.clone()) {
                tracing::warn!(
                    server = %self.label,
                    tool = %tool.name,
                    offered,
                    "MCP tool left out: even its suffixed name is taken"
                );
                continue;
            }
            let schema = Value::Object((*tool.input_schema).clone());
            let description = tool
                .description
                .as_deref()
                .or(tool.title.as_deref())
                .unwrap_or("")
                .to_owned();
            let definition = ToolDefinition::new(offered, description, schema).map(|definition| {
                match delivery_from_hints(tool.annotations.as_ref()) {
                    Some(delivery) => definition.delivery(delivery),
                    None => definition,
                }
            });
            match definition {
                Ok(definition) => out.push(Arc::new(ToolInfo {
                    approval: ApprovalDecision::decide(
                        &self.config,
                        &tool.name,
                        tool.annotations.as_ref(),
                    ),
                    definition,
                    remote: tool.name.into_owned(),
                    annotations: tool.annotations,
                    output_schema: tool.output_schema.is_some(),
                })),
                Err(err) => tracing::warn!(server = %self.label, %err, "MCP tool left out"),
            }
        }
        out
    }
}

/// `prefix` + `name`, with what providers refuse replaced by `_`, cut at 64.
fn offered_name(prefix: &str, name: &str) -> String {
    let mut out: String = prefix
        .chars()
        .chain(name.chars())
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    if out.is_empty() {
        out.push('_');
    }
    out
}

/// Why a stdio server's handshake failed when its process went away.
const STOPPED_EARLY: &str = "the server's process stopped before answering the MCP handshake: \
     check that the command starts an MCP server speaking on stdio (its messages are on stderr)";

/// `offered` with a suffix made from the server's own `name` (a hash, so
/// the same name always gets the same suffix), still at most 64
/// characters.
fn suffixed_name(offered: &str, name: &str) -> String {
    // FNV-1a: stable across runs and platforms, unlike the std hasher.
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let suffix = format!("_{:06x}", hash & 0xff_ffff);
    let keep = 64 - suffix.len();
    let mut out: String = offered.chars().take(keep).collect();
    out.push_str(&suffix);
    out
}

/// A failed handshake rmcp describes with its own types, in words.
fn handshake_failure(err: &ClientInitializeError) -> String {
    match err {
        ClientInitializeError::JsonRpcError(data) => format!(
            "the server refused the MCP handshake: {} (error {})",
            data.message, data.code.0
        ),
        ClientInitializeError::NoCompatibleProtocolVersion {
            server_supported, ..
        } => format!(
            "the server speaks no MCP protocol version this client does ({} offered)",
            server_supported
                .iter()
                .map(|v| v.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        ClientInitializeError::ConnectionClosed(_) => {
            "the server closed the connection during the MCP handshake".to_owned()
        }
        ClientInitializeError::ExpectedInitResponse(_)
        | ClientInitializeError::ExpectedInitResult(_)
        | ClientInitializeError::ConflictInitResponseId(..)
        | ClientInitializeError::UncorrelatedErrorResponse { .. } => {
            "the server did not answer the MCP handshake as the protocol says".to_owned()
        }
        other => other.to_string(),
    }
}

/// An error and its sources, one after the other (reqwest's top error
/// says "error sending request", its source why).
fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    // rmcp's HTTP error names its cause in its text but not as a source.
    use rmcp::transport::streamable_http_client::StreamableHttpError;
    if let Some(StreamableHttpError::Client(cause)) =
        err.downcast_ref::<StreamableHttpError<reqwest::Error>>()
    {
        return error_chain(cause);
    }
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(next) = source {
        let text = next.to_string();
        if !out.contains(&text) {
            out = format!("{out}: {text}");
        }
        source = next.source();
    }
    out
}

/// An HTTP server's failed handshake, in words: where, and what to check.
fn http_init_failure(url: &str, err: &ClientInitializeError) -> String {
    let ClientInitializeError::TransportError { error, .. } = err else {
        return handshake_failure(err);
    };
    // The underlying error's own text (an HTTP status, a refused
    // connection), without rmcp's wrapper that names its types.
    let cause = error_chain(&*error.error);
    let legacy = reqwest::Url::parse(url)
        .ok()
        .is_some_and(|u| u.path().trim_end_matches('/').ends_with("/sse"));
    if legacy {
        return format!(
            "{url} looks like the endpoint of the legacy HTTP+SSE transport, which this \
             client does not support: give the server's Streamable HTTP endpoint (often \
             `/mcp`), or start the server in that mode ({cause})"
        );
    }
    format!(
        "no MCP handshake with {url} ({cause}): check the URL (a Streamable HTTP endpoint, \
         often ending in `/mcp`), that the server is running, and its headers or token"
    )
}

/// The Streamable HTTP transport with the configuration's headers, its
/// answers watched for task-only tools (noted in `seen`).
fn http_transport(
    url: &str,
    headers: &std::collections::BTreeMap<String, String>,
    bearer: Option<&str>,
    config: &McpServerConfig,
    refused: Arc<SyncMutex<Option<String>>>,
    seen: Arc<SyncMutex<Seen>>,
) -> Result<rmcp::transport::StreamableHttpClientTransport<WatchedClient>, McpError> {
    use axum::http::{HeaderName, HeaderValue};
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;

    let mut custom = std::collections::HashMap::new();
    for (name, value) in headers {
        let name = HeaderName::try_from(name.as_str())
            .map_err(|e| McpError::Config(format!("header name `{name}`: {e}")))?;
        let value = HeaderValue::try_from(value.as_str())
            .map_err(|e| McpError::Config(format!("header `{name}`: {e}")))?;
        custom.insert(name, value);
    }
    let mut transport = StreamableHttpClientTransportConfig::with_uri(url.to_owned())
        .custom_headers(custom)
        .reinit_on_expired_session(true);
    if let Some(token) = bearer {
        transport = transport.auth_header(token.to_owned());
    }
    let client = reqwest::Client::builder()
        .connect_timeout(config.connect_timeout)
        .redirect(reqwest::redirect::Policy::custom(move |attempt| {
            same_origin_redirects(attempt, &refused)
        }))
        .build()
        .map_err(|e| McpError::Config(format!("HTTP client: {e}")))?;
    Ok(rmcp::transport::StreamableHttpClientTransport::with_client(
        WatchedClient::new(client, seen, config.list_timeout),
        transport,
    ))
}

/// How many redirects one request follows.
const MAX_REDIRECTS: usize = 5;

/// Follows a redirect only within the server's own origin (a server mounted
/// at `/mcp` that answers from `/mcp/`, say). reqwest strips
/// `Authorization` from a request redirected to another host, but not the
/// configuration's other headers, which often carry keys: such a redirect
/// is an error naming both origins (never their paths or queries, which
/// may hold secrets too), also left in `refused` for the connection's
/// error to say.
fn same_origin_redirects(
    attempt: reqwest::redirect::Attempt<'_>,
    refused: &SyncMutex<Option<String>>,
) -> reqwest::redirect::Action {
    let Some(first) = attempt.previous().first() else {
        return attempt.stop();
    };
    let origin = |url: &reqwest::Url| {
        format!(
            "{}://{}:{}",
            url.scheme(),
            url.host_str().unwrap_or_default(),
            url.port_or_known_default().unwrap_or_default()
        )
    };
    let (from, to) = (origin(first), origin(attempt.url()));
    let reason = if attempt.previous().len() > MAX_REDIRECTS {
        format!("more than {MAX_REDIRECTS} redirects from {from}")
    } else if from == to {
        return attempt.follow();
    } else {
        format!(
            "refused a redirect from {from} to another origin, {to}: the configured headers would reach it (give the server's own URL)"
        )
    };
    *lock(refused) = Some(reason.clone());
    attempt.error(reason)
}

// A panic elsewhere cannot leave the cached list half-written: it is
// replaced whole.
use crate::child::lock;

/// One tool of an MCP server, as a markov tool ([`DynTool`]).
///
/// Register it in a registry (or let [`McpClient::register`] do it) and
/// the registry's policies apply to its calls: modes, budgets,
/// confirmations, idempotency, timeouts, audit, the loop guard. Give it to
/// a node (`Node::builder(..).shared_tool(..)`) and it is offered and
/// called like any other tool.
///
/// A call sends the call's [`ToolContext::idempotency_key`] to the server
/// in the request's `_meta`, under [`IDEMPOTENCY_META_KEY`], so a server
/// that deduplicates can recognise a call repeated after a crash. Every
/// failure is an error result the model reads: the server's error, a
/// timeout, a lost connection or a dead child process, `isError`.
pub struct McpTool {
    client: Arc<Inner>,
    info: Arc<ToolInfo>,
}

impl fmt::Debug for McpTool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpTool")
            .field("name", &self.info.definition.name)
            .field("remote", &self.info.remote)
            .field("server", &self.client.label)
            .finish()
    }
}

impl McpTool {
    /// The name the server knows the tool by.
    pub fn remote_name(&self) -> &str {
        &self.info.remote
    }

    /// The offered definition (prefixed name, description, schema as given).
    pub fn definition(&self) -> &ToolDefinition {
        &self.info.definition
    }

    /// The server's `readOnlyHint`, if it gave one.
    pub fn read_only(&self) -> Option<bool> {
        self.info.annotations.as_ref()?.read_only_hint
    }

    /// The server's `destructiveHint`, if it gave one.
    pub fn destructive(&self) -> Option<bool> {
        self.info.annotations.as_ref()?.destructive_hint
    }

    /// The server's `idempotentHint`, if it gave one.
    pub fn idempotent(&self) -> Option<bool> {
        self.info.annotations.as_ref()?.idempotent_hint
    }

    /// All the server's annotations of the tool, as it gave them.
    pub fn annotations(&self) -> Option<&ToolAnnotations> {
        self.info.annotations.as_ref()
    }

    /// Whether the tool needs approval before each call, and why (see
    /// [`Approval`]); [`McpClient::default_metadata`] follows it.
    pub fn approval(&self) -> ApprovalDecision {
        self.info.approval
    }

    /// The label of the tool's server (its command or URL).
    pub fn server(&self) -> &str {
        &self.client.label
    }
}

#[async_trait]
impl DynTool for McpTool {
    fn definition(&self) -> &ToolDefinition {
        &self.info.definition
    }

    async fn call_json(
        &self,
        input: &Value,
        cx: ToolContext<'_>,
    ) -> Result<ToolOutcome, ToolCallError> {
        let Value::Object(arguments) = input else {
            return Err(ToolCallError::InvalidInput(
                "the arguments are not a JSON object".into(),
            ));
        };
        match self
            .client
            .call(&self.info.remote, arguments.clone(), cx.idempotency_key())
            .await
        {
            Ok(result) => crate::content::to_outcome(result, self.info.output_schema),
            // The server refused the arguments (JSON-RPC invalid params).
            Err(McpError::Server {
                code: -32602,
                message,
            }) => Err(ToolCallError::InvalidInput(message)),
            Err(err) => Err(ToolCallError::Execution(err.to_string())),
        }
    }
}

/// The side-effect contract the server's hints state: a read-only or
/// idempotent tool may run again after a crash (with the same idempotency
/// key, which markov passes in the call's `_meta`); a destructive one that
/// is not idempotent runs at most once. Without such hints the contract
/// follows the approval ([`Delivery::default_for`]): a tool that needs
/// approval runs at most once.
fn delivery_from_hints(hints: Option<&ToolAnnotations>) -> Option<Delivery> {
    let hints = hints?;
    if hints.read_only_hint == Some(true) || hints.idempotent_hint == Some(true) {
        Some(Delivery::AtLeastOnce)
    } else if hints.destructive_hint == Some(true) {
        Some(Delivery::AtMostOnce)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offered_names_are_provider_safe() {
        assert_eq!(offered_name("gh_", "search.issues"), "gh_search_issues");
        assert_eq!(offered_name("", "a/b c"), "a_b_c");
        assert_eq!(offered_name("", "").len(), 1);
        assert_eq!(offered_name("p_", &"x".repeat(100)).len(), 64);
    }

    #[test]
    fn suffixes_are_stable_and_fit() {
        let a = suffixed_name("files_read", "files_read");
        assert_eq!(a, suffixed_name("files_read", "files_read"));
        assert_ne!(a, suffixed_name("files_read", "files.read"));
        assert!(a.starts_with("files_read_"));
        assert_eq!(suffixed_name(&"x".repeat(64), "y").len(), 64);
    }

    #[test]
    fn delivery_follows_the_hints_and_otherwise_the_approval() {
        let mut idempotent = annotated(Some(false), Some(true));
        idempotent.idempotent_hint = Some(true);
        assert_eq!(
            delivery_from_hints(Some(&annotated(Some(true), None))),
            Some(Delivery::AtLeastOnce)
        );
        assert_eq!(
            delivery_from_hints(Some(&idempotent)),
            Some(Delivery::AtLeastOnce)
        );
        assert_eq!(
            delivery_from_hints(Some(&annotated(Some(false), Some(true)))),
            Some(Delivery::AtMostOnce)
        );
        assert_eq!(
            delivery_from_hints(Some(&annotated(Some(false), Some(false)))),
            None
        );
        assert_eq!(delivery_from_hints(None), None);
    }

    fn annotated(read_only: Option<bool>, destructive: Option<bool>) -> ToolAnnotations {
        let mut a = ToolAnnotations::default();
        a.read_only_hint = read_only;
        a.destructive_hint = destructive;
        a
    }

    #[test]
    fn approval_follows_hints_then_the_configuration() {
        let config = McpServerConfig::stdio("s", Vec::<String>::new());
        let decide = |c: &McpServerConfig, name, hints: Option<ToolAnnotations>| {
            ApprovalDecision::decide(c, name, hints.as_ref()).required
        };
        assert!(!decide(&config, "read", Some(annotated(Some(true), None))));
        assert!(decide(
            &config,
            "write",
            Some(annotated(Some(false), Some(true)))
        ));
        assert!(decide(
            &config,
            "mkdir",
            Some(annotated(Some(false), Some(false)))
        ));
        assert!(decide(&config, "bare", None));
        let config = config
            .clone()
            .require_approval(["read"])
            .skip_approval(["write"]);
        assert!(decide(&config, "read", Some(annotated(Some(true), None))));
        assert!(!decide(
            &config,
            "write",
            Some(annotated(Some(false), Some(true)))
        ));
        let all = McpServerConfig::stdio("s", Vec::<String>::new()).approval(Approval::All);
        assert!(decide(&all, "read", Some(annotated(Some(true), None))));
        let none = McpServerConfig::stdio("s", Vec::<String>::new()).approval(Approval::None);
        assert!(!decide(
            &none,
            "write",
            Some(annotated(Some(false), Some(true)))
        ));
    }
}

//! [`ToolRegistry`]: registered tools with their metadata, frozen by
//! [`ToolRegistryBuilder::lock`], with the standard stack built once.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use markov_core::ids::ToolCallId;
use markov_core::tool::{
    Erased, SharedTool, Tool, ToolContext, ToolDefinition, ToolExecutionResult,
};
use serde_json::{Value, json};

use crate::approvals::{ApprovalFlow, CONFIRMATION_TOKEN, ConfirmationRequest};
use crate::config::PolicyConfig;
use crate::confirm::ConfirmLayer;
use crate::error::{EnvelopeMode, ErrorFormat, Rejection};
use crate::execute::ExecuteService;
use crate::idempotency::IdempotencyLayer;
use crate::kind::ToolErrorKind;
use crate::metadata::{Mode, ToolMetadata};
use crate::report::CallReport;
use crate::search::{FoundTool, SEARCH_TOOLS, SearchIndex, SearchTool};
use crate::service::{ToolOrigin, ToolRequest, ToolService};
use crate::stack::PolicyStack;
use crate::state::PolicyState;
use crate::turn::{Budget, TurnBudgetState};

/// The result text of a `TerminateResponse` without a message, for
/// [`ToolRegistry::execute`].
const TERMINATE_MESSAGE: &str = "Finished";

/// A registry that could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// Two tools share a name.
    #[error("tool {0:?} is registered twice")]
    Duplicate(String),
    /// A tool's name is not a valid tool name.
    #[error("{0}")]
    InvalidName(#[from] markov_core::tool::InvalidToolName),
}

#[derive(Debug, Clone)]
struct Entry {
    tool: SharedTool,
    metadata: ToolMetadata,
}

/// Collects tools and their metadata; [`lock`](Self::lock) freezes them.
#[derive(Debug)]
pub struct ToolRegistryBuilder {
    entries: Vec<Entry>,
    errors: Vec<RegistryError>,
    config: PolicyConfig,
}

impl ToolRegistryBuilder {
    /// Registers a typed tool.
    #[must_use]
    pub fn register<T: Tool>(mut self, tool: T, metadata: ToolMetadata) -> Self {
        match Erased::shared(tool) {
            Ok(tool) => self.entries.push(Entry { tool, metadata }),
            Err(e) => self.errors.push(e.into()),
        }
        self
    }

    /// Registers an erased tool (e.g. one a node also holds).
    #[must_use]
    pub fn register_shared(mut self, tool: SharedTool, metadata: ToolMetadata) -> Self {
        self.entries.push(Entry { tool, metadata });
        self
    }

    /// Sets the stack's settings.
    #[must_use]
    pub fn policies(mut self, config: PolicyConfig) -> Self {
        self.config = config;
        self
    }

    /// Freezes the registry: checks the names, computes the version and
    /// builds the standard stack.
    ///
    /// When a tool is deferred ([`ToolMetadata::deferred`]), the built-in
    /// `search_tools` tool is registered last, over an index of the
    /// deferred tools.
    pub fn lock(mut self) -> Result<ToolRegistry, RegistryError> {
        if let Some(e) = self.errors.into_iter().next() {
            return Err(e);
        }
        let search = if self.entries.iter().any(|e| e.metadata.is_deferred()) {
            let index = SearchIndex::new(
                self.entries
                    .iter()
                    .filter(|e| e.metadata.is_deferred())
                    .map(|e| (e.tool.definition(), e.metadata.allowed_modes())),
            );
            let tool = SearchTool::new(Arc::new(index), self.config.tool_search.max_results)?;
            self.entries.push(Entry {
                tool: Arc::new(tool.clone()),
                metadata: ToolMetadata::new(crate::metadata::Category::Retrieval),
            });
            Some(tool)
        } else {
            None
        };
        let mut index = HashMap::with_capacity(self.entries.len());
        for (i, e) in self.entries.iter().enumerate() {
            let name = e.tool.definition().name.as_str().to_owned();
            if index.insert(name.clone(), i).is_some() {
                return Err(RegistryError::Duplicate(name));
            }
        }
        let mut keys: Vec<(&str, &str)> = self
            .entries
            .iter()
            .map(|e| (e.tool.definition().name.as_str(), e.metadata.version()))
            .collect();
        keys.sort_unstable();
        let mut h = DefaultHasher::new();
        keys.hash(&mut h);
        let version: Arc<str> = Arc::from(format!("{}.{:016x}", keys.len(), h.finish()));
        let mut config = self.config;
        config.registry_version = Arc::clone(&version);
        let service: Arc<dyn ToolService> = Arc::new(
            PolicyStack::standard(&config).service(
                ExecuteService::new(config.envelope)
                    .errors(config.errors)
                    .holds(config.confirmation_ttl),
            ),
        );
        Ok(ToolRegistry {
            entries: self.entries,
            index,
            version,
            config,
            service,
            own_state: Arc::new(PolicyState::new()),
            search,
        })
    }
}

/// A call that went through the stack.
#[derive(Debug, Clone, PartialEq)]
pub struct Executed {
    /// The result (an envelope on failure).
    pub result: ToolExecutionResult,
    /// Why it failed.
    pub error: Option<ToolErrorKind>,
    /// The intents of a success.
    pub intents: Vec<Value>,
    /// Set when the call did not run and waits for the application's
    /// decision on this request ([`ApprovalFlow::Pause`]): once decided, the
    /// same call (same id, same arguments) gets the decision's outcome.
    pub awaiting: Option<ConfirmationRequest>,
    /// How the stages answered it (for a step's trace).
    pub outcome: crate::report::CallOutcome,
    /// The application's decision it went on with, if it needed one.
    pub approval: Option<crate::approvals::DecidedApproval>,
}

/// The registry of a machine that has none: no tools, no policies but the
/// pause of a tool whose definition needs approval and the ledger, and the
/// execute stage, in [`ErrorFormat::PlainText`]. Every
/// tool call takes the same path through a [`ToolService`]; this is that
/// path's plainest form.
pub fn plain_registry() -> &'static ToolRegistry {
    static PLAIN: std::sync::OnceLock<ToolRegistry> = std::sync::OnceLock::new();
    PLAIN.get_or_init(|| {
        let config = PolicyConfig::new(Budget::UNLIMITED).envelope(EnvelopeMode::Off);
        ToolRegistry {
            entries: Vec::new(),
            index: HashMap::new(),
            version: Arc::from("0.plain"),
            // The ledger even here: a resumed step answers a completed call
            // from it instead of running the tool again.
            service: Arc::new(
                PolicyStack::new()
                    .layer(
                        ConfirmLayer::new(config.confirmation_ttl)
                            .format(EnvelopeMode::Off, ErrorFormat::PlainText),
                    )
                    .layer(IdempotencyLayer::new(config.idempotency))
                    .service(ExecuteService::plain().holds(config.confirmation_ttl)),
            ),
            config,
            own_state: Arc::new(PolicyState::new()),
            search: None,
        }
    })
}

/// The registry of a machine that has none, for the calls of an answer
/// nothing can replay (no journal keeps it, no call of it can pause the
/// step, it is not itself a replay): only the execute stage, in
/// [`ErrorFormat::PlainText`](crate::ErrorFormat). A ledger entry is kept
/// so that a replayed answer does not run a completed call again; an
/// answer that is never replayed needs none, and its calls cost no more
/// than the tool.
pub fn unrecorded_registry() -> &'static ToolRegistry {
    static UNRECORDED: std::sync::OnceLock<ToolRegistry> = std::sync::OnceLock::new();
    UNRECORDED.get_or_init(|| {
        let config = PolicyConfig::new(Budget::UNLIMITED).envelope(EnvelopeMode::Off);
        ToolRegistry {
            entries: Vec::new(),
            index: HashMap::new(),
            version: Arc::from("0.unrecorded"),
            service: Arc::new(ExecuteService::plain()),
            config,
            own_state: Arc::new(PolicyState::new()),
            search: None,
        }
    })
}

/// The frozen registry: tools, metadata, version and the standard stack.
#[derive(Debug, Clone)]
pub struct ToolRegistry {
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
    version: Arc<str>,
    config: PolicyConfig,
    service: Arc<dyn ToolService>,
    /// The conversation state of calls made through [`ToolRegistry::execute`]
    /// (a machine brings its own).
    own_state: Arc<PolicyState>,
    /// `search_tools`, when a tool is deferred.
    search: Option<SearchTool>,
}

impl ToolRegistry {
    /// A builder with `config`.
    pub fn builder(config: PolicyConfig) -> ToolRegistryBuilder {
        ToolRegistryBuilder {
            entries: Vec::new(),
            errors: Vec::new(),
            config,
        }
    }

    /// `<tool count>.<hash of the sorted names and versions>`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The metadata of `name`.
    pub fn metadata(&self, name: &str) -> Option<&ToolMetadata> {
        self.index.get(name).map(|&i| &self.entries[i].metadata)
    }

    /// The tool `name`.
    pub fn tool(&self, name: &str) -> Option<&SharedTool> {
        self.index.get(name).map(|&i| &self.entries[i].tool)
    }

    /// The names, in registration order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries
            .iter()
            .map(|e| e.tool.definition().name.as_str())
    }

    /// The stack's settings.
    pub fn config(&self) -> &PolicyConfig {
        &self.config
    }

    /// The audit sink of the stack's settings
    /// ([`PolicyConfig::audit_sink`]), if one is set: where the executor
    /// also sends its guards' records ([`GuardRecord`](crate::GuardRecord)).
    pub fn audit_sink(&self) -> Option<&Arc<dyn crate::AuditSink>> {
        self.config.audit_sink.as_ref()
    }

    /// Whether this registry wraps successful results in the envelope.
    pub fn envelope(&self) -> EnvelopeMode {
        self.config.envelope
    }

    /// The standard stack over the execution.
    pub fn service(&self) -> &dyn ToolService {
        &*self.service
    }

    /// Whether a tool is deferred (and `search_tools` registered).
    pub fn has_deferred(&self) -> bool {
        self.search.is_some()
    }

    /// Whether `name` is registered and deferred.
    pub fn is_deferred(&self, name: &str) -> bool {
        self.metadata(name).is_some_and(ToolMetadata::is_deferred)
    }

    /// Whether `name` is registered.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// The state of the conversation that [`execute`](Self::execute) runs
    /// calls in: its approvals ([`PolicyState::approvals`]) and ledger. A
    /// machine has its own (`Machine::policy_state`).
    pub fn policy_state(&self) -> &PolicyState {
        &self.own_state
    }

    /// The definition to offer a model for `name`, as [`definitions`](Self::definitions) writes it.
    pub fn definition(&self, name: &str) -> Option<ToolDefinition> {
        self.index
            .get(name)
            .map(|&i| offered(&self.entries[i], self.config.approval_flow))
    }

    /// The definitions to offer a model, in registration order: exactly the
    /// schemas the stack enforces. In the token flow
    /// ([`ApprovalFlow::Token`]) a tool that needs confirmation gets an
    /// optional `confirmationToken` string argument; a paused call needs
    /// none, so the model is offered nothing to approve with.
    /// A provider crate renders them in its vendor's format (e.g.
    /// `markov_providers::openai::tool_schemas`).
    pub fn definitions(&self) -> Vec<ToolDefinition> {
        let flow = self.config.approval_flow;
        self.entries.iter().map(|e| offered(e, flow)).collect()
    }

    /// A session of this registry in `mode`, charging `turn`, in the
    /// registry's own conversation state.
    pub fn session<'a>(&'a self, mode: &'a Mode, turn: &'a TurnBudgetState) -> RegistrySession<'a> {
        self.session_in(mode, turn, &self.own_state)
    }

    /// A session of this registry in `mode`, charging `turn`, in the
    /// conversation `policy`.
    pub fn session_in<'a>(
        &'a self,
        mode: &'a Mode,
        turn: &'a TurnBudgetState,
        policy: &'a PolicyState,
    ) -> RegistrySession<'a> {
        RegistrySession {
            registry: self,
            mode,
            turn,
            policy,
        }
    }

    /// Runs one call of a registered tool through the stack.
    pub async fn execute(
        &self,
        session: (&Mode, &TurnBudgetState),
        call_id: &ToolCallId,
        name: &str,
        input: Value,
        cx: ToolContext<'_>,
    ) -> Executed {
        let (mode, turn) = session;
        self.session(mode, turn)
            .run(
                ToolOrigin::Node,
                self.tool(name),
                call_id,
                name,
                std::borrow::Cow::Owned(input),
                cx,
                TERMINATE_MESSAGE,
            )
            .await
    }
}

/// A registry, the session's mode and the turn's counters: what a caller
/// needs to send calls through the stack.
#[derive(Debug, Clone, Copy)]
pub struct RegistrySession<'a> {
    /// The registry.
    pub registry: &'a ToolRegistry,
    /// The mode.
    pub mode: &'a Mode,
    /// The turn's counters.
    pub turn: &'a TurnBudgetState,
    /// The conversation's approvals and ledger.
    pub policy: &'a PolicyState,
}

impl<'a> RegistrySession<'a> {
    /// Runs `tool` (as the caller resolved it, found at `origin`) for
    /// `name` through the stack.
    #[allow(clippy::too_many_arguments)]
    pub async fn run(
        &self,
        origin: ToolOrigin,
        tool: Option<&'a SharedTool>,
        call_id: &'a ToolCallId,
        name: &'a str,
        input: std::borrow::Cow<'a, Value>,
        cx: ToolContext<'a>,
        terminate_message: &'a str,
    ) -> Executed {
        let report = CallReport::new();
        if let Err(error) = markov_core::tool::check_tool_arguments(&input) {
            report.set_stage("arguments");
            // No stage and no tool sees arguments that are not an object.
            let result = Rejection::new(ToolErrorKind::InvalidInput)
                .with_detail(error.to_string())
                .into_result(call_id, &report);
            return Executed {
                error: report.error_kind(),
                intents: Vec::new(),
                outcome: report.outcome(result.is_error),
                result,
                awaiting: None,
                approval: None,
            };
        }
        // `search_tools` sees only the tools the session's mode allows.
        let search = self
            .registry
            .search
            .as_ref()
            .filter(|_| name == SEARCH_TOOLS)
            .map(|s| Arc::new(s.in_mode(self.mode)) as SharedTool);
        let tool = match &search {
            Some(s) => Some(s),
            None => tool,
        };
        let found_input = search.is_some().then(|| input.clone().into_owned());
        let req = ToolRequest {
            call_id,
            name,
            input,
            tool,
            metadata: self.registry.metadata(name),
            mode: self.mode,
            turn: self.turn,
            policy: self.policy,
            report: &report,
            cx,
            terminate_message,
            origin,
        };
        // Through the trait object itself: `Arc<dyn ToolService>`'s own
        // impl would box a second future around the first.
        let result = (*self.registry.service).call(req).await;
        if let (Some(input), Some(search)) = (found_input, &self.registry.search)
            && !result.is_error
            && report.awaiting().is_none()
        {
            // The search is a pure function of the frozen registry: a
            // replayed call (answered from the ledger) finds the same.
            self.policy.note_found(
                search.in_mode(self.mode).found(&input),
                self.registry.config.tool_search.scope,
            );
        }
        let parts = report.into_parts(result.is_error);
        Executed {
            error: parts.error,
            intents: parts.intents,
            awaiting: parts.awaiting,
            outcome: parts.outcome,
            approval: parts.approval,
            result,
        }
    }
}

/// A registry bound to a mode: what an executor holds. The conversation
/// state (approvals, ledger, budget counters) is the machine's.
#[derive(Debug)]
pub struct RegistryBinding {
    registry: Arc<ToolRegistry>,
    mode: Mode,
    /// Offered tool lists by the address of the list they extend (which is
    /// kept alive here, so the address is not reused).
    offered: std::sync::Mutex<Vec<OfferedList>>,
    /// The deferred tools the mode allows, made on first use.
    deferred: std::sync::OnceLock<Arc<[markov_core::tool::ToolName]>>,
}

/// One offered list, by what it was made from.
#[derive(Debug)]
struct OfferedList {
    base: Arc<[ToolDefinition]>,
    found: Arc<[FoundTool]>,
    all: bool,
    merged: Arc<[ToolDefinition]>,
}

/// Tool lists remembered at most by [`RegistryBinding::offered_tools`].
const MAX_OFFERED_LISTS: usize = 256;

impl RegistryBinding {
    /// `registry` in `mode`.
    pub fn new(registry: Arc<ToolRegistry>, mode: Mode) -> Self {
        RegistryBinding {
            registry,
            mode,
            offered: std::sync::Mutex::new(Vec::new()),
            deferred: std::sync::OnceLock::new(),
        }
    }

    /// The names of the deferred tools the mode allows, in registration
    /// order: what a provider's own tool search is sent as deferred (with
    /// [`all_tools`](Self::all_tools)).
    pub fn deferred_names(&self) -> Arc<[markov_core::tool::ToolName]> {
        Arc::clone(self.deferred.get_or_init(|| {
            self.registry
                .entries
                .iter()
                .filter(|e| e.metadata.is_deferred() && e.metadata.allows(&self.mode))
                .map(|e| e.tool.definition().name.clone())
                .collect()
        }))
    }

    /// Whether calls offered through this binding use a provider's own
    /// tool search when `model_searches` (the model's
    /// `native_tool_search`): some tool is deferred and the registry's
    /// [`ToolSearch`](crate::ToolSearch) allows it.
    pub fn uses_native_search(&self, model_searches: bool) -> bool {
        model_searches && self.registry.has_deferred() && self.registry.config.tool_search.native
    }

    /// The tools to offer a leaf whose own tool list is `base`, with the
    /// deferred tools in `found` (in that order): a tool of `base` that is
    /// registered is offered with the registry's definition (the schema the
    /// stack enforces, with `confirmationToken` where needed), then the
    /// registered tools the mode allows that `base` lacks and that are not
    /// deferred (`search_tools` last of them), then the found ones — at the
    /// end, so that a list grows only by its tail and a provider's prompt
    /// cache stays warm. Computed once per `base` list and found list.
    pub fn offered_tools(
        &self,
        base: &Arc<[ToolDefinition]>,
        found: &Arc<[FoundTool]>,
    ) -> Arc<[ToolDefinition]> {
        self.offered_list(base, found, false)
    }

    /// Every tool that may be offered to a leaf whose own tool list is
    /// `base` (the deferred ones included, `search_tools` left out), for a
    /// provider's own tool search (the deferred tools are sent marked for
    /// loading on demand) and for a model's check of what it can be
    /// offered.
    pub fn all_tools(&self, base: &Arc<[ToolDefinition]>) -> Arc<[ToolDefinition]> {
        self.offered_list(base, &Arc::from([]), true)
    }

    fn offered_list(
        &self,
        base: &Arc<[ToolDefinition]>,
        found: &Arc<[FoundTool]>,
        all: bool,
    ) -> Arc<[ToolDefinition]> {
        let mut lists = self.offered.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(list) = lists
            .iter()
            .find(|l| Arc::ptr_eq(&l.base, base) && l.all == all && l.found[..] == found[..])
        {
            return Arc::clone(&list.merged);
        }
        let mut merged: Vec<ToolDefinition> = base
            .iter()
            .map(|d| {
                self.registry
                    .definition(d.name.as_str())
                    .unwrap_or_else(|| d.clone())
            })
            .collect();
        let in_base = |name: &str| base.iter().any(|d| d.name.as_str() == name);
        for entry in &self.registry.entries {
            let name = entry.tool.definition().name.as_str();
            let wanted = if all {
                name != SEARCH_TOOLS
            } else {
                !entry.metadata.is_deferred()
            };
            if wanted && entry.metadata.allows(&self.mode) && !in_base(name) {
                merged.push(offered(entry, self.registry.config.approval_flow));
            }
        }
        if !all {
            for f in found.iter() {
                let Some(&i) = self.registry.index.get(&f.name) else {
                    tracing::debug!(tool = %f.name, "a found tool is no longer registered: not offered");
                    continue;
                };
                let entry = &self.registry.entries[i];
                let name = f.name.as_str();
                if entry.metadata.is_deferred()
                    && entry.metadata.allows(&self.mode)
                    && !in_base(name)
                    && !merged.iter().any(|d| d.name.as_str() == name)
                {
                    merged.push(offered(entry, self.registry.config.approval_flow));
                }
            }
        }
        let merged: Arc<[ToolDefinition]> = merged.into();
        if lists.len() >= MAX_OFFERED_LISTS {
            lists.clear();
        }
        lists.push(OfferedList {
            base: Arc::clone(base),
            found: Arc::clone(found),
            all,
            merged: Arc::clone(&merged),
        });
        merged
    }

    /// The registry.
    pub fn registry(&self) -> &ToolRegistry {
        &self.registry
    }

    /// The mode.
    pub fn mode(&self) -> &Mode {
        &self.mode
    }

    /// A session charging `turn`, in the conversation `policy`.
    pub fn session<'a>(
        &'a self,
        turn: &'a TurnBudgetState,
        policy: &'a PolicyState,
    ) -> RegistrySession<'a> {
        self.registry.session_in(&self.mode, turn, policy)
    }
}

/// A registered tool's definition as offered: with the `confirmationToken`
/// argument when the tool needs confirmation in the token flow.
fn offered(e: &Entry, flow: ApprovalFlow) -> ToolDefinition {
    let mut def = e.tool.definition().clone();
    let needs = e.metadata.requires_confirmation() || def.needs_approval;
    if needs
        && flow == ApprovalFlow::Token
        && let Some(obj) = def.input_schema.as_object_mut()
    {
        let props = obj
            .entry("properties")
            .or_insert_with(|| Value::Object(serde_json::Map::new()));
        if let Some(props) = props.as_object_mut() {
            props.insert(
                CONFIRMATION_TOKEN.to_owned(),
                json!({
                    "type": "string",
                    "description": "The request_id of a confirmation request the user has approved. Leave it out until then."
                }),
            );
        }
    }
    def
}
